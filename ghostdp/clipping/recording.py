"""The forward side of the controller: every call of a hooked module in a training forward.

Each call of a module with trainable parameters becomes a ``ModuleCall`` (records.py): its inputs, the
gradient edges of its outputs, its shapes. Pass 1 then needs each call's output grads G: a probe on each
output (probe.py) hands them over as autograd passes, unless the call is captured (capture.py): book-keeping's
calls whose G it keeps whole, and with two passes every ruled call above the lowest ones. The recorder
also counts each parameter's recorded uses that pass 1 has not reached yet (a parameter with one use is
reduced to its norm as soon as its G arrives), knows the batch size from the model's first tensor
argument, and whether the forward ran a trained layer under an activation checkpoint (which decides the
step's mode: modes.mode_of_step).

What a call records depends on when it runs (``_call_kind``): an ordinary forward records it; a reentrant
checkpoint's recomputation records it for pass 1 or for the layout proof (reentrant.py); any other
recomputation records nothing (its probes are inert).
"""
from __future__ import annotations

import functools
import operator
import sys
import warnings
from collections import defaultdict

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .. import collector
from ..norms.fallback import attached_rule, hooked_modules, output_batch_dims, owned_parameters
from ..norms.registry import ROWS, replaced_method
from ..norms.relative_bias import POSITION_BIAS_ARGUMENT, looks_up_per_example, per_example_position_bias
from ..norms.window_bias import adds_window_bias
from ..sharding import is_sharded, sharded_units
from ..norms.parameter_uses import ENTRIES as USE_ENTRIES, find_uses, use_of
from .capture import capturable_now, capture, capture_use, saved_tensor_hooks as _saved_tensor_hooks
from .leaves import flatten, unflatten
from .probe import InputSink, add_probe
from .records import ModuleCall
from .repeated import capture_at_repeats, repeated_by_caller
from .reentrant import NON_REENTRANT_FIX, USE_NON_REENTRANT
from .saved_bytes import storage_keys

# torch's global forward hooks (register_module_forward_hook): they run before every module's own forward hooks.
_GLOBAL_FORWARD_HOOKS = torch.nn.modules.module._global_forward_hooks

_ADDS_NOTES = sys.version_info >= (3, 11)  # BaseException.add_note
_EXPANDED, _NOT_EXPANDED = (True,), (False,)  # a ruled call's one output, broadcast to the batch or not
# What a forward hook records (ForwardRecorder._call_kind): a call of the forward; a call of a reentrant
# checkpoint's region, recomputed by pass 1 or by the layout proof; nothing (an inert probe).
_RECORDED, _IN_REGION, _IN_PROOF, _INERT = "recorded", "in region", "in proof", "inert"


COMPILED_FORWARD = (
    "the model's forward runs under torch.compile. ghostdp's hooks on every trained layer break the compiled graph "
    "into many small pieces, each with its own guards: on the CPU stand-in (BERT L=12, H=64, python -m "
    "profiling.compiled, 2026-11-26) a compiled book-keeping step took 57.5 ms against 23.1 ms uncompiled (ghost 63.3 "
    "against 25.9; plain steps 6.7 against 10.6), so compiling slows private training down. The results are exact "
    "either way. Fix: train the model uncompiled (a compiled copy for evaluation is fine).")


def zero_size_leaf(leaves: dict, device) -> torch.Tensor:
    """The leaf of ``leaves`` for this device, made on first use: an empty tensor that requires grad."""
    if device not in leaves:
        leaves[device] = torch.zeros(0, device=device, requires_grad=True)
    return leaves[device]


def _checkpointing_flag_holders(module) -> list:
    """The submodules whose ``gradient_checkpointing`` attribute transformers' ``is_activation_checkpointing``
    reads (through peft's wrapper too), found once: that property walks every module at each read, and
    ``gradient_checkpointing_enable`` sets the attribute only on modules that already have it."""
    model = module  # the property's newer name, then its older one (transformers < 5)
    while not any(hasattr(type(model), name) for name in ("is_activation_checkpointing", "is_gradient_checkpointing")):
        base = getattr(model, "base_model", None)  # peft's PeftModel forwards to the model it wraps
        if base is None or base is model:
            return []
        model = base
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def _edge(t: torch.Tensor) -> GradientEdge:
    """t's gradient edge. For the output of a C++ op this is (grad_fn, output_nr); get_gradient_edge
    would also make an ownership token (an extra view op) for a Python Function's output, and find
    the accumulator of a leaf."""
    node = t.grad_fn
    if node is None or isinstance(node, torch._C._FunctionBase):
        return get_gradient_edge(t)
    return GradientEdge(node, t.output_nr)


def _all_tensors(args) -> bool:
    for a in args:
        if not isinstance(a, torch.Tensor):
            return False
    return True


def _broadcast_to(args, batch_size) -> tuple:
    """A shared call's inputs as its rule reads them for the batch: each of batch size 1 expanded to ``batch_size``
    (the ids of a position embedding, of peft's prompt)."""
    return tuple(a.expand(batch_size, *a.shape[1:]) if a.dim() > 0 and a.shape[0] == 1 else a for a in args)


def _compact_views(args) -> tuple:
    """The inputs that a book-keeping call holds until its clipped sums: a view of a storage over twice its
    size is copied (a pooler's first token would otherwise keep the (B, T, d) hidden states alive)."""
    for a in args:
        if a._is_view():
            return tuple([_compact(a) for a in args])
    return args


def _compact(t: torch.Tensor) -> torch.Tensor:
    if t._is_view() and t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size():
        with torch.no_grad():
            return t.clone(memory_format=torch.contiguous_format)
    return t


def _batch_on_dim_one(args, B) -> bool:
    """An input of shape (1, B, ...) that carries gradient: a sequence-first layer's input of sequence length 1
    (Longformer's global attention), whose output of size 1 on dim 0 is not shared by the batch."""
    for a in args:
        if (isinstance(a, torch.Tensor) and a.requires_grad and a.dim() > 1 and a.shape[0] == 1
                and a.shape[1] == B):
            return True
    return False


def _grad_fns(tensors) -> frozenset:
    """The autograd nodes that made ``tensors`` (none for a leaf or a tensor without grad)."""
    return frozenset([node for node in map(_GRAD_FN, tensors) if node is not None])


_GRAD_FN = operator.attrgetter("grad_fn")


def _own_or_in_a_container(module, name: str) -> bool:
    """Whether the parameter ``name`` of ``module`` (norms.fallback.owned_parameters) is its own, or in a
    ParameterDict or ParameterList child of its own (peft's IA3 vectors, ``ia3_l.default``)."""
    head, _, rest = name.partition(".")
    if not rest:
        return name in module._parameters
    return isinstance(module._modules.get(head), (torch.nn.ParameterDict, torch.nn.ParameterList)) and "." not in rest


def leading_dim(flat):
    """Dim 0 of the first tensor of dim > 0 among a forward's flattened arguments (leaves.flatten), or None."""
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return None


# torch's message where a forward sets requires_grad on a non-leaf (an InputSink's output, a view of it)
LEAF_FLAGS_ERROR = "you can only change requires_grad flags of leaf variables"
# What to freeze where a model broadcasts a computation shared by the batch itself, checked on each (the rest of the
# model then trains exactly: tests/test_models.py). A module that also runs on the batch's own inputs (DeBERTa-v3's
# query and key projections) is frozen for those too: ghostdp cannot yet split such a gradient by example.
SHARED_BY_THE_BATCH = (
    "Known cases: DeBERTa-v2/v3 with relative attention: ghostdp.validate.fix(model) swaps its attentions for "
    "ghostdp.layers.deberta's, whose query and key (or position) projections then train; freeze "
    "encoder.rel_embeddings and encoder.LayerNorm, shared by the batch (before 2026-12-02 every layer's projections "
    "had to be frozen too).")


class ForwardRecorder:
    """The forward hooks of one controller. What a call records depends on its pass 1 (``pass_one``,
    pass_one.py, set by the controller: the running pass, a fallback's backward) and on ``regions``
    (reentrant.RegionWatch: a reentrant checkpoint's backward is running)."""

    def __init__(self, regions, keeps_factors: bool):
        self.regions = regions
        self.pass_one = None
        self.root = None              # the module attached (attach)
        self.live = defaultdict(int)  # id(parameter) -> recorded, not yet consumed uses
        self.probes = {}              # device -> the probe leaf of the calls' probes
        self.sinks = {}               # device -> the leaf of the InputSinks (probe.py) of modules without a rule
        self._batch_hint = None
        self.broadcast_in_forward = []  # (name, shape) of the outputs of batch size 1 broadcast in this forward
        # ids of the modules whose output of batch size 1 the model repeats to the batch itself (repeated.py), and
        # this forward's calls of them awaiting their repeat: (call, output, the inputs its rule reads)
        self.repeated_by_caller = frozenset()
        self._awaiting_repeat = []
        self.sunk_in_forward = []  # the names of the modules whose inputs went through an InputSink in this forward
        # A call without a rule and with several outputs: its fallback runs after pass 1 has gone below it.
        self.graph_needed_after_pass1 = False
        # The forward ran a trained layer under a checkpoint (saved-tensor hooks, or with grad off in training: a
        # reentrant region): book-keeping's loss then takes two passes, and two passes' takes one backward only
        # where it keeps very little (modes.mode_of_step).
        self.forward_checkpointed = False
        self._checkpointing_flags = []
        # The calls of this forward are captured as two passes need them (capture.py), else as book-keeping's: the
        # configured mode, or book-keeping's where a two-pass controller expects its next DP loss to take one
        # backward (``expects_one_backward(checkpointing)``, set by the controller: modes.StepModes).
        self.keeps_factors = keeps_factors
        self.two_passes = not keeps_factors
        self.expects_one_backward = lambda checkpointing: False
        # Two passes configured: the storages of the last training forward's arguments, which modes.StepModes' measure
        # leaves out on both sides (saved_bytes.py, records.KeptStorages).
        self.input_storages = set()
        # Calls captured instead of probed (capture.capture says which): this forward may capture (book-keeping:
        # unless checkpointed), and the autograd node types of the calls captured so far (the audit looks
        # for them).
        self._capturing = self.two_passes
        self.captured_types = set()
        self._plain_owners = set()  # ids of the modules whose owned parameters are their _parameters
        # id(module) -> (the id of its on_forward hook, which must run before any other forward hook; its class's
        # forward, which its rule was chosen for)
        self._attached = {}
        self._warned_changed = set()  # ids of ruled modules warned of a change (_changed_since_attaching)
        # FSDP2 gathers each unit's parameters into other tensors for its forward: those are what autograd
        # reaches, so the audit must know them too (a direct read of one would otherwise go unseen).
        self.gathered = {}  # (id(unit), name) -> the gathered parameter of this step
        self.compiled_forward = False  # a forward ran under torch.compile (set while dynamo traces the root hook)
        self._collector_pauses = []  # per root forward running: whether on_root_forward paused the collector
        # The first trained module recorded in a training forward while no forward of the root ran (a method of the model
        # such as encode, or its submodules called one by one), since the last norm pass: the forward check, which
        # reruns the root's forward, did not see it (independence.ForwardIndependence.warn_of_calls_outside)
        self.outside_forward = None
        self._warned_of_compiling = False
        # id(Swin's relative position bias module) -> the rows (B * windows) of the attention about to call it
        # (on_window_attention_forward; norms/window_bias.py)
        self.window_rows = {}
        # The checked forward's arguments that are square in the batch size (independence.py), id -> (that id, the
        # tensor) (and an input sink's id -> (its argument's, the sink)): a ruled call reading one notes which, so that
        # its proven layout says where that argument's examples lie; a call without a rule notes (which, the input's
        # place among its input_edges), which the proof of its inputs places (PassOne._prove_fallback_inputs). The
        # tensors are held so that no other takes their ids while watched: a sink freed after its module's call gave
        # its id to a transposed activation, whose Linear then placed the batch's examples on dim 1 (the fuzzer at
        # B = T, seed 493, found it on 2026-12-07)
        self.watched_arguments = {}
        # (id(module), parameter name, kind, its shape at the op, the functions of it the op reads) -> its
        # norms.parameter_uses.ElementwiseUse, the "module" of the calls that capture it: one object across steps, so
        # that the layouts proven for it stay its own
        self._uses = {}

    def attach(self, module) -> list:
        """Hooks ``module`` and its hooked submodules; the handles."""
        self.root = module
        self._checkpointing_flags = _checkpointing_flag_holders(module)
        self.repeated_by_caller = repeated_by_caller(module)
        handles = [module.register_forward_pre_hook(self.on_root_forward, with_kwargs=True),
                   module.register_forward_hook(self.on_root_forward_end, always_call=True)]
        for name, m in hooked_modules(module):
            entry = attached_rule(m)
            # First among the forward hooks: FSDP2's own puts the sharded parameters back after the forward,
            # and the call must record the gathered ones that the forward used (and autograd will reach).
            handle = m.register_forward_hook(functools.partial(self.on_forward, name, entry), with_kwargs=True,
                                             prepend=True)
            handles.append(handle)
            self._attached[id(m)] = (handle.id, type(m).forward)
            if entry is None or entry.accepts is not None or entry.rule_inputs is not None:  # its inputs'
                # gradients are proven too, where it takes the fallback (PassOne._prove_fallback_inputs)
                handles.append(m.register_forward_pre_hook(functools.partial(self.on_fallback_forward, name, entry),
                                                           with_kwargs=True))
            if set(owned_parameters(m)) == {n for n, p in m._parameters.items() if p is not None}:
                self._plain_owners.add(id(m))
        for m in module.modules():
            if getattr(m, "has_relative_attention_bias", False) and looks_up_per_example(type(m)):
                handles.append(m.register_forward_pre_hook(self.on_relative_bias_forward, with_kwargs=True))
            if adds_window_bias(type(m)) and isinstance(getattr(m, "relative_position_bias", None), torch.nn.Module):
                handles.append(m.register_forward_pre_hook(self.on_window_attention_forward, with_kwargs=True))
        for unit in sharded_units(module):
            handles.append(unit.register_forward_pre_hook(self.on_unit_forward))
        return handles

    def on_relative_bias_forward(self, module, args, kwargs):
        """A recorded forward of an attention with T5's code: its position bias is passed in, looked up per example
        (norms/relative_bias.py), where its table trains."""
        if not self._recording(module) or not module.relative_attention_bias.weight.requires_grad:
            return None
        if self.regions.depth:  # recomputed by pass 1: its forward ran without gradient, so with the shared lookup
            raise NotImplementedError(
                f"the relative attention bias of {type(module).__name__} is trained inside a reentrant activation "
                "checkpoint: ghostdp looks it up per example as the forward runs, and a reentrant checkpoint's "
                "forward runs without gradient, so its recomputation would not match it. " + NON_REENTRANT_FIX)
        bias = per_example_position_bias(module, args, kwargs)
        if bias is None:
            return None
        if len(args) > POSITION_BIAS_ARGUMENT:  # passed by position (as None)
            return args[:POSITION_BIAS_ARGUMENT] + (bias,) + args[POSITION_BIAS_ARGUMENT + 1:], kwargs
        return args, {**kwargs, "position_bias": bias}

    def on_window_attention_forward(self, module, args, kwargs):
        """A forward of Swin's attention (norms/window_bias.py): the rows it runs on, B * windows, which the output of
        its relative position bias, called next, is broadcast to (_record_ruled), where its table trains (a frozen
        one's call is not recorded, and would leave the count behind)."""
        if self._recording(module) and module.relative_position_bias.relative_position_bias_table.requires_grad:
            hidden_states = args[0] if args else kwargs["hidden_states"]
            self.window_rows[id(module.relative_position_bias)] = hidden_states.shape[0]

    def forward_was_checkpointed(self) -> bool:
        """The last forward ran a trained layer under a checkpoint (see on_forward), or the
        model's transformers flag says it checkpoints."""
        return self.forward_checkpointed or self._checkpointing_flag_set()

    def _checkpointing_flag_set(self) -> bool:
        """The model's transformers flag says it checkpoints."""
        return any(m.gradient_checkpointing for m in self._checkpointing_flags)

    def _training(self, module) -> bool:
        """Whether a forward of ``module`` is a training one: the module is in train() mode, or the model it was
        attached with is (a submodule put in eval() mode, to switch off its dropout, still trains its parameters)."""
        return module.training or (self.root is not None and self.root.training)

    def _recording(self, module) -> bool:
        """Whether the hooks act on a forward of ``module``. A non-reentrant checkpoint's recomputation inside a
        fallback's own backward is acted on too, as an inert one (_call_kind: probes, nothing recorded): it must
        save the tensors the original forward saved (torch compares their count), and before 2026-11-25 it got no
        probes there, so a module without a rule called twice inside such a checkpoint raised CheckpointError."""
        return self._training(module) and torch.is_grad_enabled()

    def on_root_forward(self, module, args, kwargs):
        compiling = torch.compiler.is_compiling()
        if compiling:
            self.compiled_forward = True
        recording = self._recording(module)
        # Python's collector is paused through a training forward, as through the rest of ghostdp's step (the
        # module calls and hooks it allocates die by reference count in the DP loss's backward: collector.py);
        # every root forward pushes, its end hook (always called) pops.
        self._collector_pauses.append(recording and not compiling and collector.pause())
        if recording:
            flat = flatten((args, kwargs))[0]  # a batch in a SimpleNamespace or dataclass too (leaves.py)
            self._batch_hint = leading_dim(flat)
            self.broadcast_in_forward.clear()
            self.sunk_in_forward.clear()
            self._awaiting_repeat.clear()
            if torch._C._current_graph_task_id() == -1:  # not a recomputation: no checkpoint backward runs
                self.regions.depth = 0
                self.forward_checkpointed = _saved_tensor_hooks(False) is not None
                checkpointing = self._checkpointing_flag_set()
                # The caller holds them whichever way the step runs (a batch sliced from a tensor of the whole
                # dataset is a view of all of it).
                if not self.keeps_factors:
                    self.input_storages = storage_keys([t for t in flat if isinstance(t, torch.Tensor)])
                self.two_passes = not (self.keeps_factors or self.expects_one_backward(checkpointing))
                # Book-keeping's captured calls hold G to the end of pass 1 (capture.py).
                self._capturing = self.two_passes or not checkpointing

    def on_root_forward_end(self, module, args, output):
        """Runs also when the model's forward raised (always_call): where it set requires_grad on a tensor that is
        not a leaf after a module's inputs went through an InputSink, the sink made that input a non-leaf; else, if
        a module's output of batch size 1 was broadcast to the batch before, the error most likely comes from that
        (the model broadcasts it itself, or its dim 0 was not a batch dim). The model's own message cannot say
        either."""
        if self._collector_pauses:  # empty only where a hook before on_root_forward raised
            collector.resume(self._collector_pauses.pop())
        error = sys.exc_info()[1]  # output is None: the forward raised (not a forward inside an except block)
        if self._awaiting_repeat and output is not None:
            awaiting, self._awaiting_repeat = self._awaiting_repeat, []
            capture_at_repeats(awaiting, output, self._batch_hint, self.captured_types)
        if output is not None or error is None:
            return
        if self.sunk_in_forward and isinstance(error, RuntimeError) and LEAF_FLAGS_ERROR in str(error):
            self._add_note(error, self._sunk_input_explanation(self.sunk_in_forward[-1]))
        elif self.broadcast_in_forward:
            self._add_note(error, self._broadcast_explanation(*self.broadcast_in_forward[-1]))

    def _sunk_input_explanation(self, name) -> str:
        module = self.root.get_submodule(name)
        params = ", ".join(f"'{n}'" for n, p in owned_parameters(module).items() if p.requires_grad)
        return (
            f"ghostdp: module '{name or '<root>'}' ({type(module).__name__}) has trainable parameters of its own that "
            f"no norm rule covers ({params}), so ghostdp passed its float inputs through an input sink, a tensor that "
            "requires grad, to prove from their gradients that the module keeps the examples apart. The model's "
            "forward then set requires_grad on such an input, which only a leaf allows (transformers' wav2vec2, "
            "HuBERT, Data2Vec-audio, UniSpeech and SEW feature encoders do when they train, for gradient "
            "checkpointing). Fix: freeze those parameters (requires_grad_(False); for the wav2vec2 family, "
            "masked_spec_embed, which SpecAugment writes into the masked steps), or freeze the feature encoder "
            "(model.freeze_feature_encoder(), as fine-tuning recipes do).")

    def _broadcast_explanation(self, name, shape) -> str:
        return (
            f"ghostdp: this forward broadcast the output of module '{name}', of shape {tuple(shape)}, to the batch "
            f"of {self._batch_hint} examples (an output of batch size 1 is taken as shared by the batch, like "
            "BERT's position embeddings, so that its gradient stays per example), and the model's forward then "
            "failed. If the model broadcasts that output itself (DeBERTa's relative embeddings, a windowed "
            "attention's relative position bias other than Swin's own, peft's p-tuning with an LSTM dropout in "
            "training) or its dim 0 is not a batch dim (a sequence-first layer on a "
            "sequence of length 1: Longformer's global attention), ghostdp cannot split its gradient by example. Fix: "
            "freeze that module's parameters (requires_grad_(False)) before making the model private (a prompt "
            "trains nothing else: use peft's prompt tuning or p-tuning without that dropout, whose prompt ghostdp "
            "captures at peft's own repeat, or another adapter, e.g. LoRA). "
            + SHARED_BY_THE_BATCH)

    @staticmethod
    def _add_note(error, explanation) -> None:
        if _ADDS_NOTES:
            error.add_note(explanation)
        else:  # Python 3.10: shown before the model's error
            warnings.warn(explanation)

    def warn_if_compiled(self) -> None:
        """Once: the model's forward runs under torch.compile, which ghostdp's hooks make slower than eager."""
        if self.compiled_forward and not self._warned_of_compiling:
            self._warned_of_compiling = True
            warnings.warn(COMPILED_FORWARD)

    def on_unit_forward(self, unit, args):
        if self._recording(unit):
            for name, p in unit.named_parameters():
                if p.requires_grad and not is_sharded(p):
                    self.gathered[(id(unit), name)] = p

    def _probe(self, device):
        return zero_size_leaf(self.probes, device)

    def on_fallback_forward(self, name, entry, module, args, kwargs):
        """A module without a rule (``entry`` None), a call its rule declines (RuleEntry.accepts), or one whose rule
        may decline it once its forward has run (RuleEntry.rule_inputs: ConvNext's block, whose graph the rule reads):
        each of its float tensor arguments without grad (positional or keyword) through an InputSink, so that the
        layout proof can read that input's gradient. A module that mixes examples in its own forward (a batch mean)
        shows that only in its inputs' gradients, where no recorded call below may look (one example moved the
        update by 7 C before 2026-11-25, and by 11.7 C through a second input before 2026-11-26; a ConvNext block
        whose drop path was a batch mean, with only its layer scale trained, went through while its rule was new on
        2026-11-27)."""
        if not (args or kwargs) or not self._recording(module) or not self._trainable_owned(module):
            return None
        if entry is not None and entry.rule_inputs is None and entry.accepts(module, args, kwargs):
            return None
        sunk = {}  # id(tensor) -> its sink: a tensor passed twice is copied once

        def through_sink(x):
            if not isinstance(x, torch.Tensor) or x.requires_grad or not x.is_floating_point():
                return x
            if id(x) not in sunk:
                sunk[id(x)] = InputSink.apply(x, zero_size_leaf(self.sinks, x.device))
                if id(x) in self.watched_arguments:  # the call's proof of this input places the argument's examples
                    self.watched_arguments[id(sunk[id(x)])] = (self.watched_arguments[id(x)][0], sunk[id(x)])
            return sunk[id(x)]

        new_args = tuple([through_sink(a) for a in args])
        new_kwargs = {k: through_sink(v) for k, v in kwargs.items()}
        if not sunk:
            return None
        self.sunk_in_forward.append(name)
        return new_args, new_kwargs

    def on_forward(self, name, entry, module, args, kwargs, output):
        if entry is not None and ("forward" in module.__dict__ or (entry.methods and replaced_method(module, entry))):
            entry = None  # replaced on the instance after attaching: its forward, or a method the forward calls
            # (Gemma's _norm: norms 0.89-1.24x the true ones before 2026-11-27), is not the one the rule knows: the
            # exact fallback (registry.lookup_rule)
        if entry is not None and entry.accepts is not None and not entry.accepts(module, args, kwargs):
            entry = None  # a branch of the forward the rule does not know: the exact fallback
        if not self._recording(module):
            if self._training(module) and not self.pass_one.in_fallback:  # grad off
                self.forward_checkpointed = self.forward_checkpointed or bool(self._trainable_owned(module))
            return None
        params = self._trainable_owned(module)
        if not params:
            return None
        if not self._collector_pauses and self.outside_forward is None and torch._C._current_graph_task_id() == -1:
            self.outside_forward = name  # no root forward runs (a method of the model, a submodule called alone)
        if entry is not None:
            change = self._changed_since_attaching(module)
            if change is not None:
                entry = self._to_fallback(name, module, change)
        if not self.forward_checkpointed and _saved_tensor_hooks(False) is not None:
            self.forward_checkpointed = torch._C._current_graph_task_id() == -1  # not a recomputation
        if (entry is not None and not kwargs and isinstance(output, torch.Tensor) and output.requires_grad
                and output.is_floating_point() and _all_tensors(args) and entry.rule_inputs is None):
            return self._record_ruled(name, entry, module, args, output, params)
        if isinstance(output, torch.Tensor):  # the common case, without pytree's per-call work
            flat, spec = [output], None
        else:
            flat, spec = flatten(output)  # in a SimpleNamespace or a dataclass too (leaves.py)
        slots = [i for i, t in enumerate(flat)
                 if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if not slots:
            return None
        if entry is not None and not (isinstance(output, torch.Tensor) and slots == [0]):
            entry = None
        rule = entry.rule if entry is not None else None
        if not kwargs and _all_tensors(args):
            inputs = list(args)
        else:
            inputs = [a for a in flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        # What the rule reads: the call's tensors, or those its forward forms from them (RuleEntry.rule_inputs).
        read = inputs if rule is None or entry.rule_inputs is None else entry.rule_inputs(module, args, kwargs, output)
        if read is None:  # the call computed something the rule does not know (RuleEntry.rule_inputs)
            entry, rule, read = None, None, inputs
        kind = self._call_kind()
        may_capture = self._capturing and (self.two_passes or not self.forward_checkpointed)  # as _record_ruled's
        if (rule is None and kind is _RECORDED and may_capture
                and self._record_uses(name, module, params, [flat[i] for i in slots], inputs)):
            return None  # every trained parameter of its own is an elementwise use, captured (norms/parameter_uses.py)
        call = ModuleCall(self, name, module, entry, params,
                          (0,) if rule is not None else tuple(output_batch_dims(module, len(slots))))
        if rule is None and not any(call.batch_dims):
            call.tokenwise = ROWS  # its outputs may hold a flattened batch, (B * T, ...), which the proof checks
        call.edges, call.expanded, call.shapes = [], [], []
        recording = kind is _RECORDED or kind is _IN_REGION
        if (kind is _IN_REGION or kind is _IN_PROOF) and rule is None:  # the proof's recomputation comes first
            raise NotImplementedError(
                f"module '{name}' ({type(module).__name__}) has trainable parameters but no norm rule, inside a "
                "reentrant activation checkpoint: its fallback needs the region's graph after the checkpoint's own "
                "backward has freed it. Register a norm rule for it, or " + USE_NON_REENTRANT)
        if not recording:
            call.fired = True  # nothing to count or refuse; the proof's calls only project their output grads
        elif rule is None and len(slots) > 1:
            # Its fallback runs after pass 1 has gone below it, through the module's own graph.
            self.graph_needed_after_pass1 = True
        B = self._batch_hint
        new_flat = list(flat)
        for slot, (i, dim) in enumerate(zip(slots, call.batch_dims)):
            t = flat[i]
            if rule is not None and entry.unbatched_output and t.dim() == 2:  # (positions, d), shared by the batch:
                t = t.unsqueeze(0)  # given a batch dim of 1 (RuleEntry.unbatched_output: LED's learned positions)
            # Output shared by the whole batch (BERT's position embeddings): broadcast it to the
            # batch here so that its output grad stays per example.
            expanded = (B is not None and B > 1 and t.dim() > dim and t.shape[dim] == 1
                        and not (dim == 0 and _batch_on_dim_one(inputs, B)))
            if expanded:
                self.broadcast_in_forward.append((name, t.shape))
                t = t.expand(*t.shape[:dim], B, *t.shape[dim + 1:])
            if recording or kind is _IN_PROOF:
                call.edges.append(_edge(flat[i]))
                call.expanded.append(expanded)
                call.shapes.append(tuple(t.shape))
            saved = ()
            if rule is not None:  # one output; the rule's activations, saved on the probe's node (probe.py)
                saved = _broadcast_to(read, B) if expanded else tuple(read)
            new_flat[i] = add_probe(t, self._probe(t.device), call, slot, known_forward=rule is not None,
                                    inputs=saved)
        if recording:
            call.grads = [None] * len(slots)
            if rule is None:  # every float input's gradient edge, for the proof (PassOne._prove_fallback_inputs)
                graded = {id(t): t for t in inputs
                          if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()}
                call.input_edges = tuple([_edge(t) for t in graded.values()])
                if self.watched_arguments:  # the watched argument its sink passed on, and that input's edge
                    watched = self.watched_arguments
                    call.reads_argument = next(((watched[key][0], k) for k, key in enumerate(graded)
                                                if key in watched), None)
            # The nodes that bound the call's region below (the audit stops there); a leaf input has
            # only its gradient accumulator below, where the audit stops anyway.
            call.input_nodes = _grad_fns(inputs)
            for p in params.values():
                self.live[id(p)] += 1
        if kind is _IN_REGION or kind is _IN_PROOF:
            self._note_region_call(call, kind)
        return new_flat[0] if spec is None else unflatten(new_flat, spec)

    def _record_uses(self, name, module, params, outputs, inputs) -> bool:
        """A call of a module without a rule whose own trained parameters are each the operand of one elementwise op
        of its forward (norms/parameter_uses.py): each such use recorded and captured at its op as a ruled call, and
        True; False (nothing recorded) where any of them is not, and the call takes the exact fallback."""
        if not all(_own_or_in_a_container(module, n) for n in params):  # a parametrization's, an absorbed child's
            return False
        found = find_uses(params, outputs, _grad_fns(inputs), self._batch_hint)
        if found is None or not capturable_now():
            return False
        for f in found:
            key = (id(module), f.name, f.kind, f.param_shape, f.functions, f.bias)
            use = self._uses.get(key)
            if use is None or use.owner is not module:
                use = self._uses[key] = use_of(module, f.name, f.kind, f.param_shape, f.bias)
            use.derivative = f.derivative  # f'(p) of this forward's p (the same for every call of this key)
            used = {n: params[n] for n in (f.name, f.bias) if n is not None}  # a product's bias with its weight
            call = ModuleCall(self, f"{name}.{f.name}" if name else f.name, use, USE_ENTRIES[f.kind], used)
            call.shapes, call.grads, call.expanded = (torch.Size(f.shape),), [None], _NOT_EXPANDED
            call.input_nodes = f.below
            for param in used.values():
                self.live[id(param)] += 1
            capture_use(call, f.node, (f.operand,) if f.operand is not None else (), self.two_passes,
                        self.captured_types)
        return True

    def _changed_since_attaching(self, module) -> tuple[str, str] | None:
        """What keeps a ruled module's rule from reading its call: a forward hook that runs before on_forward (a
        global module hook, or one registered with prepend=True after attaching), whose output may not be the
        layer's own (a hook that tripled a Linear's output made its norm 3 times too small, and two passes moved
        the update by 3 C); or its class's forward replaced after attaching (the rule knows the one it was chosen
        for: a forward that tripled the input took the norm 2-3 times too small). (what changed, the fix), or None."""
        attached = self._attached.get(id(module))
        if attached is None:  # a copy of an attached module (an EMA model's deepcopy carries the hooks)
            return None
        hook, forward = attached
        if type(module).forward is not forward:
            return (f"the forward of class {type(module).__name__} was replaced after the model was made private",
                    "replace it before make_private / GhostClipping")
        if _GLOBAL_FORWARD_HOOKS or next(iter(module._forward_hooks)) != hook:
            return ("a forward hook runs before ghostdp's: a global module hook "
                    "(torch.nn.modules.module.register_module_forward_hook) or one registered with prepend=True "
                    "after the model was made private",
                    "register the hook on the module before make_private / GhostClipping, or without prepend=True "
                    "(a global hook always runs first: register it on the modules that need it instead)")
        return None

    def _to_fallback(self, name, module, change: tuple[str, str]):
        """The call takes the exact fallback, which differentiates the output it is given (warned once per
        module); None, the fallback's entry."""
        if id(module) not in self._warned_changed:
            self._warned_changed.add(id(module))
            what, fix = change
            warnings.warn(
                f"on module '{name}' ({type(module).__name__}), {what}, so its output may not be what its norm rule "
                "assumes: ghostdp forms its per-example norms with the exact but slower fallback. To keep the "
                f"rule, {fix}.")
        return None

    def _call_kind(self):
        """What a forward records now: an ordinary call; a call of a reentrant checkpoint's region recomputed
        by pass 1 (reentrant.py); one recomputed by the layout proof; or nothing (any other recomputation)."""
        if self.regions.depth:
            if self.pass_one.current is None:
                return _INERT  # a region recomputed outside ghostdp's passes (their backwards record)
            return _IN_PROOF if self.pass_one.current.proving else _IN_REGION
        return _RECORDED if self.pass_one.current is None else _INERT

    def _note_region_call(self, call, kind):
        passed = self.pass_one.current
        passed.region_calls.append(call)
        if kind is _IN_PROOF:
            call.projections = [None] * len(call.shapes)
        else:
            call.in_region = True
            if passed.sums_pass is not None:  # pass 2 of two passes (pass_two.py)
                self.pass_one.pass_two.take_twin_layouts(call)

    def _record_ruled(self, name, entry, module, args, output, params):
        """on_forward's common case, in fewer steps: a module with a norm rule, tensor arguments and one
        tensor output (Linear, LayerNorm, Embedding, ...)."""
        call = ModuleCall(self, name, module, entry, params)
        if self.watched_arguments:
            watched = self.watched_arguments
            call.reads_argument = next((watched[id(a)][0] for a in args if id(a) in watched), None)
        B = self._batch_hint
        t, saved = output, args
        if (self.repeated_by_caller and id(module) in self.repeated_by_caller and B is not None and B > 1
                and t.dim() > 0 and t.shape[0] == 1 and capturable_now()
                and self.pass_one.current is None and not self.regions.depth):
            return self._await_repeat(call, args, output, params, B)
        # Swin's bias, shared by the rows (B * windows) of the attention calling it (norms/window_bias.py)
        rows = self.window_rows.pop(id(module), None) if self.window_rows else None
        if (B is not None and B > 1 and t.dim() > 0 and t.shape[0] == 1  # shared by the batch: see on_forward
                and not _batch_on_dim_one(args, B)):
            self.broadcast_in_forward.append((name, t.shape))
            if rows is not None and rows % B == 0:  # each example's windows together: (B, windows, ...)
                t = t.unsqueeze(1).expand(B, rows // B, *t.shape[1:])
            else:
                t, rows = t.expand(B, *t.shape[1:]), None
            saved = _broadcast_to(args, B)
            call.expanded = _EXPANDED
        else:
            call.expanded = _NOT_EXPANDED
            if not self.two_passes:
                saved = _compact_views(args)
        kind = _RECORDED if self.pass_one.current is None and not self.regions.depth else self._call_kind()
        if kind is _RECORDED or kind is _IN_REGION:
            call.shapes = (t.shape,)  # a torch.Size: a tuple
            call.grads = [None]
            call.input_nodes = _grad_fns(args)
            live = self.live  # the call's parameters have one more recorded use that pass 1 has not reached
            for p in params.values():
                live[id(p)] += 1
            if (kind is _RECORDED and self._capturing and call.expanded is _NOT_EXPANDED
                    and (self.two_passes or not self.forward_checkpointed)):
                node_type = capture(call, entry, module, saved, output, self.two_passes, self.captured_types)
                if node_type is not None:  # pass 1 takes its output grad from autograd.grad: no probe
                    self.captured_types.add(node_type)
                    return None
            call.edges = (_edge(output),)
            if kind is _IN_REGION:
                self._note_region_call(call, kind)
        elif kind is _IN_PROOF:
            call.shapes, call.fired = (tuple(t.shape),), True
            self._note_region_call(call, kind)
        else:  # a non-reentrant checkpoint's recomputation, or pass 2's of a reentrant one (see on_forward)
            call.fired = True
        probed = add_probe(t, self._probe(t.device), call, 0, known_forward=True, inputs=saved)
        return probed if rows is None or call.expanded is _NOT_EXPANDED else probed.reshape(rows, *t.shape[2:])

    def _await_repeat(self, call, args, output, params, B):
        """_record_ruled for a call whose output of batch size 1 the model repeats to the batch itself (peft's
        prompt): recorded as broadcast, neither broadcast nor probed; captured at its repeat once the root's forward
        has run (repeated.py)."""
        call.expanded = _EXPANDED
        call.shapes = (torch.Size((B, *output.shape[1:])),)
        call.grads = [None]
        call.input_nodes = _grad_fns(args)
        for p in params.values():
            self.live[id(p)] += 1
        self._awaiting_repeat.append((call, output, _broadcast_to(args, B)))
        return None

    def _trainable_owned(self, module) -> dict:
        """The module's own parameters that require grad now (read at every forward: freezing after
        attaching works), from its parameter dict directly where it owns no parameter containers."""
        if id(module) in self._plain_owners:
            return {n: p for n, p in module._parameters.items() if p is not None and p.requires_grad}
        return {n: p for n, p in owned_parameters(module).items() if p.requires_grad}

    def forget(self, call):
        """The call's uses are consumed: pass 1 reached it, or it was freed unreached (records.ModuleCall)."""
        for p in call.params.values():
            key = id(p)
            self.live[key] -= 1
            if self.live[key] <= 0:
                del self.live[key]
