"""GhostClipping: the one controller of the two-pass backward.

Attach it to a model (hooks in place, no wrapper), build the loss with
``controller.loss(per_example_losses)`` or ``controller.criterion(torch_loss)``,
and call ``backward()`` as usual:

- pass 1 (inside the loss's backward): ``autograd.grad`` towards the probe gives
  every hooked layer its output grad G; its norm rule turns (inputs, G) into
  per-example squared norms, which are summed over layers;
- clip coefficients c_i = min(1, C / (n_i + 1e-6));
- pass 2: autograd continues with grad c_i for loss i, leaving sum_i c_i g_i in p.grad.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.autograd.graph import get_gradient_edge
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..norms.factors import InputGrams, combined_sq_norm
from ..norms.fallback import OPAQUE_MODULES, fallback_grads, hooked_modules, output_batch_dims, owned_parameters
from ..norms.registry import find_norm_rule, rule_parameters
from .. import validate
from .audit import unattributed_leaves
from .modes import clipping_mode, new_factor_store
from .probe import add_probe

CLIP_EPS = 1e-6


class NonFiniteLossError(FloatingPointError):
    """Some examples have a NaN or infinite loss or gradient norm."""

    def __init__(self, indices, what):
        self.indices = indices
        super().__init__(
            f"examples {indices} of this batch have a non-finite {what}; their clipped gradient would be "
            "NaN. Fix the data or the model (e.g. a log of 0, an overflow in float16), or pass "
            "nonfinite='skip' to drop such examples from the step.")


class Use:
    """One call of one hooked module in a forward pass, alive as long as its graph."""

    __slots__ = ("controller", "name", "module", "rule", "params", "inputs", "input_nodes", "edges",
                 "batch_dims", "expanded", "grads", "fired", "eager", "done")

    def __init__(self, controller, name, module, rule, params):
        self.controller, self.name, self.module, self.rule, self.params = controller, name, module, rule, params
        self.inputs, self.edges, self.batch_dims, self.expanded, self.grads = (), [], [], [], []
        self.input_nodes = frozenset()
        self.fired = self.done = False
        self.eager = {}

    def __del__(self):
        if not self.fired:
            self.controller._forget(self)


class _Pass:
    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.sq = None
        self.pending = defaultdict(list)  # parameter -> factors of its several uses
        self.kept = new_factor_store()    # book-keeping: every factor, for the clipped sum
        self.uses = []
        self.grams = InputGrams()         # the last input's Gram, shared by layers reading it (Q, K, V)

    def add(self, sq):
        sq = sq.double()
        self.sq = sq if self.sq is None else self.sq + sq


def check_max_grad_norm(value):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value != value \
            or value == float("inf"):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {value!r}")


def _zero_size_leaf(leaves: dict, device) -> torch.Tensor:
    """The leaf of ``leaves`` for this device, made on first use: an empty tensor that requires grad."""
    if device not in leaves:
        leaves[device] = torch.zeros(0, device=device, requires_grad=True)
    return leaves[device]


def _leading_dim(args, kwargs):
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    return None


class GhostClipping:
    """Per-example gradient clipping by ghost norms on ``module``, hooks attached in place.

    Args:
        module: the model; it is not wrapped and keeps its type, attributes and state_dict keys.
        max_grad_norm: the clipping norm C > 0.
        nonfinite: "error" (default) raises on a NaN/inf per-example loss or norm;
            "skip" gives such examples a clip coefficient of 0 (see ``clip_coefficients``).
        check_model: run ``ghostdp.validate.check`` on the model first.
        clipping: "ghost" (two passes, default) or "bookkeeping" (one backward; see ``modes``).
    """

    def __init__(self, module: torch.nn.Module, max_grad_norm: float, *, nonfinite: str = "error",
                 check_model: bool = True, clipping: str = "ghost"):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"GhostClipping needs a torch.nn.Module, got {type(module).__name__}")
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}")
        if check_model:
            validate.check(module)
        self.mode = clipping_mode(clipping)
        if self.mode.keeps_factors and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            raise NotImplementedError(
                "clipping='bookkeeping' writes the clipped sum into p.grad without a second backward, so DDP's "
                "gradient all-reduce never runs; with several processes use clipping='ghost'.")
        self.module = module
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self._probes = {}
        self._anchors = {}
        self._graph_needed_after_pass1 = False
        self._live = defaultdict(int)  # parameter -> recorded, not yet consumed uses
        self._pass = None
        self._in_fallback = False
        self._batch_hint = None
        self._kept = new_factor_store()
        self._audited_pattern = None
        self.last_norms = None
        self.last_coefficients = None
        # Gradient that flowed into the last DP loss (1 for a plain backward()): p.grad holds this
        # times the clipped sum, so a scaled loss shows here for the optimizer to check.
        self.last_loss_scale = None
        # One (number of examples, incoming gradient) per DP-loss backward since the DP optimizer
        # last took them (None: nobody listens); and callables run before each norm pass.
        self.passes: list[tuple[int, float]] | None = None
        self.pass_observers: list = []
        # Set for a padding chunk (multi-process training): the next DP loss weighs 0 and counts no examples.
        self.next_loss_is_padding = False
        self._handles = [module.register_forward_pre_hook(self._on_root_forward, with_kwargs=True)]
        for name, m in hooked_modules(module):
            rule = None if isinstance(m, OPAQUE_MODULES) else find_norm_rule(m)
            if rule is not None and not set(owned_parameters(m)) <= rule_parameters(rule):
                rule = None  # a subclass with parameters of its own: its forward differs, use the fallback
            self._handles.append(m.register_forward_hook(functools.partial(self._on_forward, name, rule),
                                                         with_kwargs=True))

    # ----------------------------------------------------------------- settings
    @property
    def max_grad_norm(self) -> float:
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value):
        check_max_grad_norm(value)
        self._max_grad_norm = float(value)

    def detach(self) -> None:
        """Remove every hook; the model is as before attaching."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ----------------------------------------------------------------- forward
    def _recording(self, module) -> bool:
        return module.training and torch.is_grad_enabled() and not self._in_fallback

    def _on_root_forward(self, module, args, kwargs):
        if self._recording(module):
            self._batch_hint = _leading_dim(args, kwargs)

    def anchor(self, device):
        """A zero-size leaf for a DP loss whose backward must not continue into the model (book-keeping)."""
        return _zero_size_leaf(self._anchors, device)

    def _probe(self, device):
        return _zero_size_leaf(self._probes, device)

    def _on_forward(self, name, rule, module, args, kwargs, output):
        if not self._recording(module):
            return None
        params = {n: p for n, p in owned_parameters(module).items() if p.requires_grad}
        if not params:
            return None
        if self._pass is not None:
            raise NotImplementedError(
                f"module '{name}' ran a forward during ghostdp's norm pass, as activation (gradient) "
                "checkpointing does; ghostdp does not support checkpointing yet. Fix: turn it off "
                "(e.g. model.gradient_checkpointing_disable()).")
        flat, spec = tree_flatten(output)
        slots = [i for i, t in enumerate(flat)
                 if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if not slots:
            return None
        if rule is not None and not (isinstance(output, torch.Tensor) and slots == [0]):
            rule = None
        use = Use(self, name, module, rule, params)
        if rule is None and len(slots) > 1:
            # Its fallback runs after pass 1 has gone below it, through the module's own graph.
            self._graph_needed_after_pass1 = True
        use.batch_dims = [0] if rule is not None else output_batch_dims(module, len(slots))
        B = self._batch_hint
        new_flat = list(flat)
        for slot, (i, dim) in enumerate(zip(slots, use.batch_dims)):
            t = flat[i]
            use.edges.append(get_gradient_edge(t))
            # Output shared by the whole batch (BERT's position embeddings): broadcast it to the
            # batch here so that its output grad stays per example.
            expanded = B is not None and B > 1 and t.dim() > dim and t.shape[dim] == 1
            if expanded:
                t = t.expand(*t.shape[:dim], B, *t.shape[dim + 1:])
            use.expanded.append(expanded)
            new_flat[i] = add_probe(t, self._probe(t.device), use, slot, known_forward=rule is not None)
        use.grads = [None] * len(slots)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        use.input_nodes = frozenset(get_gradient_edge(a).node for a in inputs if a.requires_grad)
        if rule is not None:
            if use.expanded[0]:
                inputs = [a.expand(B, *a.shape[1:]) if a.dim() > 0 and a.shape[0] == 1 else a for a in inputs]
            use.inputs = tuple(inputs)
        for p in params.values():
            self._live[p] += 1
        return tree_unflatten(new_flat, spec)

    def _forget(self, use):
        for p in use.params.values():
            self._live[p] -= 1
            if self._live[p] <= 0:
                del self._live[p]

    # ----------------------------------------------------------------- pass 1
    def _receives_output_grads(self) -> bool:
        return self._pass is not None and not self._in_fallback

    def _receive(self, use, slot, grad):
        use.grads[slot] = grad
        if not use.fired:
            use.fired = True
            self._pass.uses.append(use)
            # A parameter with a single live use can be reduced to its norm now and its G freed;
            # one with several uses waits for all of them (cross terms).
            use.eager = {n: self._live[p] == 1 and p not in self._pass.pending for n, p in use.params.items()}
            self._forget(use)
        if len(use.grads) == 1:
            self._compute(use)

    def _check_pass_two(self, use):
        if self._in_fallback or use.fired:
            return
        raise RuntimeError(
            f"a gradient reached module '{use.name}' through a backward that did not start from a ghostdp "
            "loss, so it would not be clipped. Fix: build every loss you backpropagate through this model "
            "with GhostClipping.loss / the DP criterion, or call detach() on the controller first.")

    def _compute(self, use):
        B = self._pass.batch_size
        for g, d in zip(use.grads, use.batch_dims):
            if g is not None and (g.dim() <= d or g.shape[d] != B):
                raise RuntimeError(
                    f"module '{use.name}' ({type(use.module).__name__}) produced an output of shape "
                    f"{tuple(g.shape)} whose batch dimension {d} does not match the {B} per-example losses. "
                    "ghostdp needs every trainable layer's output to be batch-first (one row per example). "
                    "Fix: call the model itself (not a submodule) so ghostdp sees the batch size, or "
                    "register a norm rule for this module.")
        with record_function(f"ghostdp.norms.{type(use.module).__name__}"):  # profiling/layers.py reads these
            factors = {}
            if use.rule is not None:
                factors = use.rule(use.module, use.inputs, use.grads[0], set(use.params))
            missing = {n: p for n, p in use.params.items() if n not in factors}
            if missing:
                self._in_fallback = True
                try:
                    factors.update(fallback_grads(missing, use.edges, use.grads, use.batch_dims, use.expanded, B))
                finally:
                    self._in_fallback = False
            for n, f in factors.items():
                if self.mode.keeps_factors:
                    self._pass.kept[use.params[n]].append(f)
                if use.eager[n]:
                    self._pass.add(f.sq_norm(self._pass.grams))
                else:
                    self._pass.pending[use.params[n]].append(f)
        use.inputs, use.edges, use.grads, use.done = (), [], [], True

    def _finish(self):
        for use in self._pass.uses:
            if not use.done:
                self._compute(use)
        for factors in self._pass.pending.values():
            self._pass.add(combined_sq_norm(factors))

    def _audit(self, per_example_losses):
        pattern = frozenset((id(p), n) for p, n in self._live.items())
        if pattern == self._audited_pattern:
            return
        stray = unattributed_leaves(per_example_losses.grad_fn, ignore=self._probes.values())
        if stray and not self._live:
            raise RuntimeError(
                "no call of a trainable layer was recorded for this loss: the forward ran with the model in "
                "eval() mode (ghostdp records only in train mode) or before the controller was attached. "
                "Fix: call model.train() before the forward of a training step.")
        if stray:
            names = {id(p): n for n, p in self.module.named_parameters()}
            described = ", ".join(
                f"'{names[id(leaf)]}'" if id(leaf) in names else f"a tensor of shape {tuple(leaf.shape)} "
                "that is not a parameter of the model" for leaf in stray)
            raise RuntimeError(
                f"gradient reaches {described} outside the forward of the module that owns it (e.g. a "
                "parent reads child.weight directly, or a trainable tensor enters the loss), so ghostdp "
                "cannot bound its per-example norm. Fix: call the owning module instead of reading its "
                "parameter, freeze the tensor, or register a norm rule for the parent module.")
        self._audited_pattern = pattern

    def per_example_norms(self, per_example_losses: torch.Tensor) -> torch.Tensor:
        """Pass 1 only: the (B,) per-example gradient norms of all trainable parameters, float64."""
        if per_example_losses.dim() != 1:
            raise ValueError(f"per-example losses must have shape (batch,), got {tuple(per_example_losses.shape)}")
        if not per_example_losses.requires_grad:
            raise ValueError("the per-example losses do not require grad: no trainable parameter was used "
                             "(is the forward under torch.no_grad(), or is every parameter frozen?)")
        if self._pass is not None:
            raise RuntimeError("a ghostdp norm pass is already running (nested backward of a DP loss)")
        B = per_example_losses.shape[0]
        if B == 0:  # an empty Poisson batch: nothing to clip, the step adds noise only
            return torch.zeros(0, dtype=torch.float64, device=per_example_losses.device)
        self._audit(per_example_losses)
        self._pass = _Pass(B)
        try:
            probes = list(self._probes.values())
            with record_function("ghostdp.pass1"):
                if probes:
                    # Pass 2 needs the graph again; book-keeping has none, so pass 1 frees it as it goes.
                    retain = self.mode.continues_backward or self._graph_needed_after_pass1
                    torch.autograd.grad(per_example_losses, probes, torch.ones_like(per_example_losses),
                                        retain_graph=retain, allow_unused=True)
                with record_function("ghostdp.norms.shared_parameters"):
                    self._finish()
            sq, self._kept = self._pass.sq, self._pass.kept
        finally:
            self._pass = None
        if sq is None:
            sq = torch.zeros(B, dtype=torch.float64, device=per_example_losses.device)
        return sq.clamp(min=0).sqrt()

    def clip_coefficients(self, per_example_losses: torch.Tensor) -> torch.Tensor:
        """Pass 1 and c_i = min(1, C / (n_i + 1e-6)); non-finite examples raise or get c_i = 0."""
        for observe in self.pass_observers:
            observe(per_example_losses)
        norms = self.per_example_norms(per_example_losses)
        bad = ~torch.isfinite(norms) | ~torch.isfinite(per_example_losses.detach()).to(norms.device)
        coeffs = (self.max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)
        if bad.any():
            indices = bad.nonzero().flatten().tolist()
            if self.nonfinite == "error":
                self._kept = new_factor_store()
                raise NonFiniteLossError(indices, "loss or gradient norm")
            coeffs = torch.where(bad, torch.zeros_like(coeffs), coeffs)
        self.last_norms, self.last_coefficients = norms, coeffs
        return coeffs

    def grad_of_losses(self, coefficients, grad_output, losses):
        """After pass 1: the gradient for the losses (pass 2 follows), or None once the clipping mode
        has written the clipped sum into p.grad itself."""
        kept, self._kept = self._kept, new_factor_store()
        with record_function("ghostdp.clipped_sum"):
            return self.mode.grad_of_losses(kept, coefficients, grad_output, losses)

    # ----------------------------------------------------------------- losses
    def loss(self, per_example_losses: torch.Tensor, reduction: str = "mean", expected_batch_size=None):
        """The training loss for per-example losses (B,): an ordinary tensor whose backward runs both passes.

        Its value is sum_i L_i / expected_batch_size ("mean"; default divisor: B) or sum_i L_i ("sum").
        Whatever the reduction, backward() leaves the clipped SUM sum_i c_i g_i in p.grad
        (times the gradient flowing into this loss, 1 for a plain backward()); the DP optimizer
        adds the noise and divides by the expected batch size.
        """
        from .loss import clipped_loss
        return clipped_loss(self, per_example_losses, reduction, expected_batch_size)

    def criterion(self, criterion: torch.nn.Module, expected_batch_size=None):
        """Wrap a torch loss (it must support reduction="none") into a DP criterion."""
        from .loss import DPCriterion
        return DPCriterion(criterion, self, expected_batch_size)
