"""The one registry of norm rules, keyed by module class and found through the MRO.

A rule is a function ``rule(module, inputs, output_grad, trainable) -> {name: PerExampleGrad}``:
``inputs`` are the positional tensors the module was called with (batch first),
``output_grad`` the (B, ...) gradient of the loss w.r.t. the module's output,
``trainable`` the names of the module's own parameters that require grad now (a set-like view: ``in``,
``-``, ``&``).
Modules whose class has no rule and that own trainable parameters are handled
by the fallback (``ghostdp.norms.fallback``).

A rule is trusted for a subclass only while the subclass computes what the rule
assumes: a subclass that overrides ``forward`` (transformers' scaled embeddings) or owns other
parameters has no rule until one is registered for it or for its forward's code, and goes to the
exact fallback.

Third-party classes are registered by their qualified name ("package.module.Class"),
so that ``import ghostdp`` imports none of their modules. A rule may also be registered for a forward's
code (``register_forward_rule``): every class whose ``forward`` has exactly that body, read from its source
when a module of it is first looked up (transformers copies one RMSNorm forward into some 140 model
families, under as many names, and a name list goes stale with each release; the source is what runs).

>>> @register_norm_rule(MyScaledLinear, params=("weight",))        # doctest: +SKIP
... def my_rule(module, inputs, output_grad, trainable):
...     return {"weight": OuterProduct(output_grad * module.scale, inputs[0], module.weight.shape)}
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Callable, Dict

import torch

Rule = Callable[..., Dict[str, "PerExampleGrad"]]


# A value of RuleEntry.tokenwise between False (the examples on the declared batch dim) and True (on any leading dim,
# or flattened into dim 0): on dim 0, whole or flattened into it (rows), where the layer does not act alike on every
# leading position but does along dim 0 (an elementwise use of a parameter that differs per head: parameter_uses.py).
ROWS = "rows"


@dataclass(frozen=True)
class RuleEntry:
    rule: Rule
    # The parameters the rule covers: names, or (module) -> names where they depend on the module (peft's adapters,
    # named by adapter: peft_lora.py)
    params: frozenset | Callable[[torch.nn.Module], frozenset]
    # The module maps each position of (..., features) alone: any leading dim may be the batch. A callable: whether
    # this module does, read at each call (an elementwise scale does only where it is the same at every position).
    tokenwise: bool | str | Callable[[torch.nn.Module], bool | str]  # True, False or ROWS
    owner: type | str   # the registered class (or its qualified name) whose forward the rule knows
    # (module, inputs, output, trainable) -> whether book-keeping keeps this call's output grad whole until
    # the clipped sums: pass 1 may then capture it without a probe (clipping/capture.py). None: never.
    holds_output_grad: Callable[..., bool] | None = None
    methods: tuple = ()  # registered by code: (name, body) of each method the forward calls (register_forward_rule)
    base: type | None = None  # registered by code: the class whose forward ``super().forward`` must call
    # (module, args, kwargs) -> whether this call computes what the rule knows; a declined call takes the fallback.
    # None: every call.
    accepts: Callable[..., bool] | None = None
    # (module, args, kwargs, output) -> the tensors the rule reads as its inputs, where they are not the call's
    # positional tensors (a learned positional embedding's position ids, formed from its arguments as its forward
    # forms them; the tensor a ConvNext block's layer scale multiplied, read from the output's graph), or None where
    # this call computed something the rule does not know (it takes the exact fallback). None: the call's tensors.
    rule_inputs: Callable[..., tuple] | None = None
    # The module's output, (positions, features), has no batch dim and is shared by the batch (a learned positional
    # embedding that the model adds to the (B, positions, features) embeddings): the recorder gives it one, broadcast
    # to the batch as any output of batch size 1, so that its output grad is per example.
    unbatched_output: bool = False

    def covers(self, module: torch.nn.Module) -> frozenset:
        """The names of the parameters of ``module`` that the rule covers."""
        return self.params(module) if callable(self.params) else self.params


_RULES: dict[type | str, RuleEntry] = {}
_FORWARD_RULES: dict[str, RuleEntry] = {}  # a forward's body (forward_body) -> its rule
_BY_CLASS: dict = {}  # a class -> the entry its code matched, or None (read once per class)
_SIGNATURES: dict = {}  # a class -> its forward's signature (call_arguments)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_instance_of(module, name: str) -> bool:
    """Whether ``module``'s class, or a class it derives from, has the qualified name ``name`` (a class of a package
    ghostdp does not import, transformers')."""
    return any(qualified_name(cls) == name for cls in type(module).__mro__)


def register_norm_rule(module_class: type | str, rule: Rule | None = None, params=("weight", "bias"),
                       tokenwise: bool | Callable[[torch.nn.Module], bool] = False,
                       holds_output_grad: Callable[..., bool] | None = None,
                       accepts: Callable[..., bool] | None = None, rule_inputs: Callable[..., tuple] | None = None):
    """Register ``rule`` for ``module_class`` and its subclasses that keep its ``forward``; usable as a decorator.

    ``module_class`` is a ``torch.nn.Module`` subclass or the qualified name of one ("pkg.module.Class").
    ``params`` names the parameters the rule covers, or is a function of the module that names them: a module
    owning any other parameter goes to the fallback. ``tokenwise``: the module acts on each leading position alone (Linear, Embedding,
    LayerNorm), so its batch may be a later leading dim (sequence-first) or flattened into rows; a callable
    ``tokenwise(module)`` says so per module, read at each call.
    ``holds_output_grad(module, inputs, output, trainable)``: whether the factors the rule returns for
    this call keep its output grad whole in book-keeping (``PerExampleGrad.kept``), told from the
    forward's tensors; book-keeping then captures that grad in pass 1 without a per-call probe. A wrong
    True costs memory (the grad is held to the end of pass 1), never exactness.
    ``accepts`` and ``rule_inputs``: as for ``register_forward_rule`` (nn.EmbeddingBag: mode "max" declined, the
    bags' members read from the call's arguments by name).
    """
    if isinstance(module_class, str):
        if "." not in module_class:
            raise ValueError(f"register_norm_rule needs a qualified class name such as "
                             f"'package.module.Class', got {module_class!r}")
    elif not (isinstance(module_class, type) and issubclass(module_class, torch.nn.Module)):
        raise TypeError(f"register_norm_rule needs a torch.nn.Module subclass, got {module_class!r}")

    def add(fn):
        _RULES[module_class] = RuleEntry(fn, params if callable(params) else frozenset(params), tokenwise, module_class,
                                         holds_output_grad,
                                         accepts=accepts, rule_inputs=rule_inputs)
        return fn

    return add(rule) if rule is not None else add


def register_forward_rule(body: str, rule: Rule, params=("weight", "bias"),
                          tokenwise: bool | Callable[[torch.nn.Module], bool] = False,
                          holds_output_grad: Callable[..., bool] | None = None, methods: dict | None = None,
                          base: type | None = None, accepts: Callable[..., bool] | None = None,
                          rule_inputs: Callable[..., tuple] | None = None, unbatched_output: bool = False) -> None:
    """Register ``rule`` for every module class whose ``forward`` has the body ``body``: its statements as
    ``forward_body`` gives them (the docstring left out, formatting and comments normalised by ``ast``). The
    names in the body (the argument's, the attributes') are part of it. ``methods``: {name: body, or a tuple of the
    bodies accepted} of the methods of the module that the forward calls, which must have those bodies too (Gemma's
    forward calls self._norm, whose body differs between classes with that forward). ``base``: for a body that calls
    ``super().forward``, the class whose forward that must be (``super_forward``; ConvNext's LayerNorm: nn.LayerNorm's).
    ``accepts(module, args, kwargs)``: for a forward with branches the rule does not know (ViT's embeddings: mask
    tokens, interpolated positions, dropout), whether this call took the known ones; a call it declines takes
    the exact fallback. ``rule_inputs(module, args, kwargs, output)``: the tensors the rule reads as its ``inputs``,
    where the forward computes them from its arguments (OPT's positions: a cumulative sum of the attention mask),
    formed as the body forms them, or finds them in the output's graph (ConvNext's scaled features); None where
    the call computed something else (it takes the exact fallback); by default the call's positional tensors. A
    class registered by itself, or one derived from a registered class whose forward it keeps, takes that
    registration instead. ``params``, ``tokenwise`` and ``holds_output_grad`` as for ``register_norm_rule``.
    ``unbatched_output``: see RuleEntry (LED's and Blenderbot's learned positions)."""
    _FORWARD_RULES[body] = RuleEntry(rule, frozenset(params), tokenwise, body, holds_output_grad,
                                     tuple(sorted((methods or {}).items())), base, accepts, rule_inputs,
                                     unbatched_output)
    _BY_CLASS.clear()


def forward_body(fn) -> str | None:
    """The statements of a function's body, each as ``ast.unparse`` writes it, joined by " ; ", without a leading
    docstring; None where its source cannot be read (a builtin, a class made at run time, a REPL) or where the
    function is decorated (a wrapper's source is the function it wraps: the body would not be what runs)."""
    if hasattr(fn, "__wrapped__"):
        return None
    function = parsed_function(fn)
    if function is None or function.decorator_list:
        return None
    return body_text(function)


def parsed_function(fn) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The parsed definition of a function, decorators included, from its source; None where that cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    return function if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def body_text(function: ast.FunctionDef) -> str:
    """A parsed function's statements, each as ``ast.unparse`` writes it, joined by " ; ", without a leading
    docstring: the body ``register_forward_rule`` compares (forward_body; a scan of source files, in the tests)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return " ; ".join(ast.unparse(statement) for statement in body)


def super_forward(cls):
    """The function ``super().forward`` calls in ``cls.forward``: the forward of the first class that defines one
    after the class the forward was written in (its ``__class__`` cell, which ``super()`` reads) in cls's MRO;
    None where the forward has no such cell (it does not call ``super()``) or nothing after defines a forward."""
    fn = cls.forward
    code = getattr(fn, "__code__", None)
    if code is None or "__class__" not in code.co_freevars:
        return None
    written_in = fn.__closure__[code.co_freevars.index("__class__")].cell_contents
    mro = cls.__mro__
    if written_in not in mro:
        return None
    return next((c.__dict__["forward"] for c in mro[mro.index(written_in) + 1:] if "forward" in c.__dict__), None)


def has_bodies(cls: type, bodies) -> bool:
    """Whether each method of ``cls`` named in ``bodies`` ((name, body) pairs) has that body (forward_body)."""
    return all(body_matches(forward_body(getattr(cls, name, None)), body) for name, body in bodies)


def body_matches(found: str | None, expected) -> bool:
    """Whether a method's body ``found`` is ``expected``: one body, or a tuple of the bodies accepted (transformers
    renamed an attribute a method reads between releases: Gemma 4's ``_norm``, self.eps in 5.24, self.variance_epsilon
    in 5.25)."""
    return found in expected if isinstance(expected, tuple) else found == expected


# Wrappers that run the function they wrap or another implementation of the same products, chosen by a setting: a
# forward wrapped by one has the wrapped function's body (dispatched_body), and a rule registered for that body reads
# the setting in its ``accepts`` (transformers' experts implementations: "eager" runs the wrapped forward, "grouped_mm"
# and "batched_mm" the same products batched; experts.py).
DISPATCHING_WRAPPERS = (
    ("transformers/integrations/moe.py", "use_experts_implementation.<locals>.wrapper.<locals>.forward"),)


def dispatched_body(fn) -> str | None:
    """The body of the function that ``fn`` wraps, where ``fn`` is one of the DISPATCHING_WRAPPERS; else None."""
    code, wrapped = getattr(fn, "__code__", None), getattr(fn, "__wrapped__", None)
    if code is None or wrapped is None:
        return None
    filename = code.co_filename.replace("\\", "/")
    if not any(filename.endswith(f) and getattr(code, "co_qualname", None) == q for f, q in DISPATCHING_WRAPPERS):
        return None
    return forward_body(wrapped)


def entry_by_code(cls) -> RuleEntry | None:
    """The entry registered for ``cls``'s forward's body (register_forward_rule; a dispatching wrapper's: the wrapped
    function's), read once per class, or None."""
    if cls not in _BY_CLASS:
        body = (forward_body(cls.forward) or dispatched_body(cls.forward)) if _FORWARD_RULES else None
        entry = _FORWARD_RULES.get(body) if body is not None else None
        if entry is not None and not has_bodies(cls, entry.methods):
            entry = None
        if entry is not None and entry.base is not None and super_forward(cls) is not entry.base.__dict__["forward"]:
            entry = None  # its super().forward is another class's: the body alone does not say what runs
        _BY_CLASS[cls] = entry
    return _BY_CLASS[cls]


def replaced_method(module: torch.nn.Module, entry: RuleEntry) -> bool:
    """Whether a method that the entry's forward calls (RuleEntry.methods) was set on the module instance: its body
    is then not the one the registry checked."""
    return any(name in module.__dict__ for name, _ in entry.methods)


def call_arguments(module: torch.nn.Module, args, kwargs) -> dict:
    """The module's forward's arguments by name, as a call passed them, defaults filled in: what a rule registered by
    code reads of a call (RuleEntry.accepts, RuleEntry.rule_inputs)."""
    signature = _SIGNATURES.get(type(module))
    if signature is None:
        signature = _SIGNATURES[type(module)] = inspect.signature(type(module).forward)
    bound = signature.bind(module, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def lookup_rule(module: torch.nn.Module) -> RuleEntry | None:
    """The entry of the most specific registered class in the module's MRO, if the module's class
    still runs that class's forward and the module has no forward of its own (one set on the
    instance: ``module.forward = ...``, which the rule cannot know); else (no class of its MRO is registered, or
    its class overrides that class's forward) the entry registered for its forward's body
    (register_forward_rule), unless the instance has a method of its own that the forward calls; None
    otherwise."""
    if "forward" in module.__dict__:
        return None
    for cls in type(module).__mro__:
        entry = _RULES.get(cls) or _RULES.get(qualified_name(cls))
        if entry is not None:
            if type(module).forward is cls.forward:
                return entry
            break
    if type(module).forward is torch.nn.Module.forward:
        return None
    entry = entry_by_code(type(module))
    if entry is not None and replaced_method(module, entry):
        return None  # a method the forward calls was replaced on the instance: its body is not the one checked
    return entry


def find_norm_rule(module: torch.nn.Module) -> Rule | None:
    """The rule that applies to ``module`` (see ``lookup_rule``), or None."""
    entry = lookup_rule(module)
    return entry.rule if entry is not None else None
