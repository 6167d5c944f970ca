"""GhostClipping: the one controller of the two-pass backward.

Attach it to a model (hooks in place, no wrapper), build the loss with
``controller.loss(per_example_losses)`` or ``controller.criterion(torch_loss)``,
and call ``backward()`` as usual:

- pass 1 (inside the loss's backward): ``autograd.grad`` towards the probe gives
  every hooked layer its output grad G; its norm rule turns (inputs, G) into
  per-example squared norms, which are summed over layers;
- clip coefficients c_i = min(1, C / (n_i + 1e-6));
- pass 2: autograd continues with grad c_i for loss i, leaving sum_i c_i g_i in p.grad.

The forward hooks that record each layer call are the ``ForwardRecorder``'s (recording.py).
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
import weakref

import torch
from torch.autograd.profiler import record_function

from ..accounting.base import check_positive
from ..data import distributed_rank_and_size
from ..model_tree import current_tree
from ..sharding import fsdp1_wrapped, has_sharded_parameters
from .. import validate
from ..layers import deberta
from ..layers import twins
from .accumulation import AccumulationWatch
from .audit import audit_graph
from .buffers import BufferWatch
from .independence import ForwardIndependence
from .ledger import StepLedger
from .loss import DPCriterion, clipped_loss
from .modes import ClippedSums, StepModes, clipping_mode, new_factor_store
from .precision import ImpreciseExampleError, exact_sums, imprecise_examples
from .pass_one import PassOne
from .recording import ForwardRecorder, zero_size_leaf
from .refusals import AuditRefusals, listed as _listed
from .reentrant import NON_REENTRANT_FIX, USE_NON_REENTRANT, RegionWatch
from .samples import SampleRequest
from .saved_bytes import saved_bytes, storage_keys

CLIP_EPS = 1e-6

_profiler_enabled = torch._C._autograd._profiler_enabled
log = logging.getLogger("ghostdp")

REENTRANT_DISTRIBUTED = (
    "Reentrant activation checkpointing (use_reentrant=True) with several processes or FSDP is not supported: "
    "its norm pass is a backward without inputs, which would fire DDP's and FSDP's gradient hooks and "
    "collectives before the clipped gradients exist. " + NON_REENTRANT_FIX)

FALLBACK_MODULES = (
    "ghostdp: {count} module(s) have trainable parameters that no norm rule covers and take the exact fallback, one "
    "batched backward of the module per chunk of examples (O(B^2) elements a step; several times a ruled layer's "
    "cost at large batches): {names}. ghostdp.validate.fallback_modules(model) lists them with their parameters; "
    "where speed matters, freeze them (requires_grad_(False)) or register a norm rule. A module whose forward "
    "applies each of its own parameters by one elementwise op (a layer scale, a class token) is captured at those "
    "ops instead, which only its first call shows: the first norm pass logs which modules took the fallback.")
FALLBACK_TAKEN = (
    "ghostdp: in the first norm pass, {count} module(s) took the exact fallback: {names}{uses}.")

SWAPPABLE_MODULES = (
    "ghostdp: these torch.nn modules take the exact per-example fallback, O(batch) in time and memory (a 4-layer "
    "nn.TransformerEncoder: 7x a plain step and 30x its memory on a CPU), because torch.nn applies their weights "
    "inside one functional call that no norm rule sees: {names} ({kinds}). Fix: ghostdp.validate.fix(model) "
    "before making it private swaps them for their ghostdp.layers twins (same weights, state_dict keys and "
    "outputs), whose projections the Linear rule covers.")

# model -> its controller, while attached: a second attachment would clip and hook everything twice.
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, GhostClipping]" = weakref.WeakKeyDictionary()


class NonFiniteLossError(FloatingPointError):
    """Some examples have a NaN or infinite loss or gradient norm."""

    def __init__(self, indices, what):
        self.indices = indices
        super().__init__(
            f"examples {indices} of this batch have a non-finite {what}; their clipped gradient would be "
            "NaN. Fix the data or the model (e.g. a log of 0, an overflow in float16), or pass "
            "nonfinite='skip' to drop such examples from the step.")


def check_max_grad_norm(value):
    check_positive(value, "max_grad_norm")


def _clipping_groups(max_grad_norm, parameter_groups, mode):
    """(C_k per group, {id(parameter): k}) for per-group clipping, or (None, None) for one norm."""
    if not isinstance(max_grad_norm, (list, tuple)):
        if parameter_groups is not None:
            raise ValueError("parameter_groups are for per-group clipping: give max_grad_norm as a list, one "
                             "norm per group")
        return None, None
    if parameter_groups is None or len(parameter_groups) != len(max_grad_norm):
        count = None if parameter_groups is None else len(parameter_groups)
        raise ValueError(f"max_grad_norm lists {len(max_grad_norm)} clipping norms but there are {count} "
                         "parameter groups (the optimizer's param_groups): give one norm per group")
    if not max_grad_norm:
        raise ValueError("max_grad_norm is an empty list; give one clipping norm per parameter group")
    for value in max_grad_norm:
        check_max_grad_norm(value)
    if mode.continues_backward:
        raise NotImplementedError(
            "per-group clipping (a list of max_grad_norm) needs clipping='bookkeeping': the two-pass backward "
            "gives each example one coefficient for every layer, not one per group.")
    group_of = {}
    for k, params in enumerate(parameter_groups):
        for p in params:
            if group_of.setdefault(id(p), k) != k:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in parameter groups {group_of[id(p)]} "
                                 f"and {k}; each parameter must be clipped in one group")
    return tuple(float(c) for c in max_grad_norm), group_of


def _forget_captured_edges(calls) -> None:
    """Drops the edges the audit gave captured calls, and the fallback's stops: a call lives in its node's
    metadata (or its probe's), and its edge to that node (or to another call's probe) would keep both alive past
    the graph (a cycle through C++ that no collector sees)."""
    for call in calls:
        if call.captured is not None:
            call.edges = ()
        call.fallback_stops = None


def _attached_controller(module):
    for m in module.modules():
        controller = _ATTACHED.get(m)
        if controller is not None and controller._handles:
            return m, controller
    return None, None


class GhostClipping:
    """Per-example gradient clipping by ghost norms on ``module``, hooks attached in place.

    Args:
        module: the model; it is not wrapped and keeps its type, attributes and state_dict keys.
        max_grad_norm: the clipping norm C > 0; or a list [C_1, ..., C_K], one per group of
            ``parameter_groups`` (per-group clipping: example i's gradient of group k is clipped to
            C_k, so the whole clipped gradient has norm <= sqrt(sum_k C_k^2), ``max_grad_norm``'s value).
        nonfinite: "error" (default) raises on a NaN/inf per-example loss or norm;
            "skip" gives such examples a clip coefficient of 0 (see ``clip_coefficients``).
        check_model: run ``ghostdp.validate.check`` on the model first.
        clipping: "ghost" (two passes, default) or "bookkeeping" (one backward; see ``modes``).
    """

    def __init__(self, module: torch.nn.Module, max_grad_norm: float, *, nonfinite: str = "error",
                 check_model: bool = True, clipping: str = "ghost", parameter_groups=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"GhostClipping needs a torch.nn.Module, got {type(module).__name__}")
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}")
        wrapped = fsdp1_wrapped(module)
        if wrapped:
            raise NotImplementedError(
                f"FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, wrapping {wrapped[:3]}) is not supported: "
                "its flat parameter shards are not DTensors, so each rank's noise could not be drawn for the "
                "elements it owns alone. accelerate's FullyShardedDataParallelPlugin uses FSDP1 by default. Fix: "
                "FSDP2, with torch.distributed.fsdp.fully_shard or FullyShardedDataParallelPlugin(fsdp_version=2).")
        attached, _ = _attached_controller(module)
        if attached is not None:
            where = "this model" if attached is module else f"its submodule {type(attached).__name__}"
            raise RuntimeError(
                f"{where} already has ghostdp hooks from an earlier make_private / GhostClipping (e.g. a "
                "notebook cell run twice); a second set would record and clip every layer twice. Fix: call "
                "detach() on the earlier controller (engine.controller.detach()) first, or build a fresh model.")
        if check_model:
            validate.check(module)
        self.mode = clipping_mode(clipping)
        if self.mode.keeps_factors and has_sharded_parameters(module):
            raise NotImplementedError(
                "clipping='bookkeeping' with FSDP2 (fully_shard) is not supported: book-keeping writes the clipped "
                "sums itself, past FSDP's reduce-scatter of the gradients. Fix: clipping='ghost' (supported with "
                "FSDP2), or book-keeping with DistributedDataParallel.")
        self.module = module
        self._model_tree = None  # the model's tree as last read (_has_sharded_parameters)
        self.group_norms, self._group_of = _clipping_groups(max_grad_norm, parameter_groups, self.mode)
        # The mode each DP loss's backward runs in, from what the norm passes measure (modes.StepModes).
        self.step_modes = StepModes(self.mode, per_group=self.group_norms is not None)
        self.max_grad_norm = max_grad_norm if self.group_norms is None else sum(c * c for c in self.group_norms) ** 0.5
        self.nonfinite = nonfinite
        self._anchors = {}
        self._kept = new_factor_store()
        self._mass = None
        # Reentrant activation checkpoints (reentrant.py): a region's calls start at this index of the pass's.
        self._regions = RegionWatch(lambda: len(self.pass_one.current.region_calls), self._audit_region,
                                    USE_NON_REENTRANT)
        self._parameters = {id(p): p for p in module.parameters()}
        self.last_norms = None
        self.last_coefficients = None   # (B,); per-group clipping: (groups, B)
        self.last_group_norms = None    # per-group clipping: (groups, B) norms of each group's gradient
        self._sample_request = None     # inside grad_samples(): a samples.SampleRequest
        # What the DP loss, the loader and the DP optimizer tell each other in a step (ledger.py).
        self.ledger = StepLedger()
        # name -> context manager entered around each marked region (pass 1, each norm rule, the
        # clipped sums); None: a torch.profiler range while a profiler runs, else nothing.
        # profiling/layers.py sets one that records CUDA events, to time the regions on the device.
        self.region_timer = None
        # The forward hooks (recording.py); book-keeping also watches for checkpointed layers.
        self.recorder = ForwardRecorder(self._regions, keeps_factors=self.mode.keeps_factors)
        self.pass_one = self.recorder.pass_one = PassOne(self, self.recorder)  # pass 1 (pass_one.py)
        self.recorder.expects_one_backward = self._expects_one_backward
        # Gradient accumulated into a parameter outside ghostdp's passes is refused (accumulation.py).
        self.accumulation = AccumulationWatch(self.pass_one, {id(p): n for n, p in module.named_parameters()})
        # Buffers that a training forward changes are released without noise: warned of (buffers.py).
        self._handles = self.recorder.attach(module) + BufferWatch(module).attach(module)
        self._handles += self.accumulation.watch(self._parameters.values())
        # A forward that mixes examples where no gradient flows (a batch statistic under no_grad): independence.py.
        self.independence = ForwardIndependence(module, self.recorder, self.ledger)
        self._handles += self.independence.attach(module)
        _ATTACHED[module] = self
        slow = validate.fallback_modules(module)
        swappable = validate.swappable_modules(module)
        refusals = self.refusals = AuditRefusals(
            module, [n for n in swappable if twins.twin_of(module.get_submodule(n)) is not None],
            deberta.shared_by_the_batch(module))
        if refusals.refused_twins:  # a step would be refused: the one-line fix, said where the user sees it
            warnings.warn(refusals.twins_fix(refusals.refused_twins), stacklevel=3)
        if refusals.shared_by_the_batch:
            warnings.warn(deberta.SHARED.format(names=_listed(refusals.shared_by_the_batch)), stacklevel=3)
        for dropped in validate.dropped_losses(module):  # a term of peft's loss that the per-example losses leave out
            warnings.warn(dropped, stacklevel=3)
        swappable = [n for n in swappable if n not in refusals.refused_twins] if slow else []
        if swappable:  # a one-line fix for an O(B) cost: said where the user sees it
            kinds = sorted({type(module.get_submodule(n)).__name__ for n in swappable})
            warnings.warn(SWAPPABLE_MODULES.format(names=_listed(swappable), kinds=", ".join(kinds)), stacklevel=3)
        self._fallback_listed = list(slow)  # logged again after the first norm pass, as it went (_log_fallback)
        if slow:  # logged, not warned: the fallback is exact, only slower (T5's relative bias, raw parameters)
            log.info(FALLBACK_MODULES.format(count=len(slow), names=_listed(list(slow), quoted=False)))

    # ----------------------------------------------------------------- settings
    @property
    def max_grad_norm(self) -> float:
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value):
        check_max_grad_norm(value)
        if self.group_norms is not None and hasattr(self, "_max_grad_norm"):
            raise AttributeError("with per-group clipping the clipping norm is sqrt(sum_k C_k^2) of the group "
                                 "norms, fixed when attaching; build a new controller to change them")
        self._max_grad_norm = float(value)

    @property
    def last_loss_scale(self):
        """The gradient that flowed into the last DP loss (1 for a plain backward()): p.grad holds this times the
        clipped sum, so a scaled loss shows here (the DP optimizer refuses one)."""
        return self.ledger.loss_scale

    @property
    def attached(self) -> bool:
        """Whether the controller's hooks are on the model (until detach())."""
        return bool(self._handles)

    def detach(self) -> None:
        """Remove every hook; the model is as before attaching."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if _ATTACHED.get(self.module) is self:
            del _ATTACHED[self.module]

    def reset_step_state(self, step_modes: dict | None = None) -> None:
        """Forget a backward that will not be stepped (the automatic physical batch search's probes). ``step_modes``:
        the state of ``self.step_modes`` to go back to (StepModes.state_dict): a probe's measure of what book-keeping
        keeps would otherwise choose the mode of the first training step, which a run without the search takes in
        the configured mode (each probe then also measures the mode the first training step takes)."""
        self.ledger.forget_step()
        self._kept = new_factor_store()
        self.pass_one.current = None
        if step_modes is not None:
            self.step_modes.load_state_dict(step_modes)

    def _region(self, name: str):
        if self.region_timer is not None:
            return self.region_timer(name)
        return record_function(name) if _profiler_enabled() else contextlib.nullcontext()

    # ----------------------------------------------------------------- forward
    def anchor(self, device):
        """A zero-size leaf, the only graph input of a DP loss: its backward never continues into the model
        in the caller's backward (loss.py)."""
        return zero_size_leaf(self._anchors, device)

    def _group(self, param) -> int:
        if self._group_of is None:
            return 0
        group = self._group_of.get(id(param))
        if group is None:
            names = {id(p): n for n, p in self.module.named_parameters()}
            raise ValueError(f"parameter '{names.get(id(param), tuple(param.shape))}' is trained but in no "
                             "clipping group (the optimizer's param_groups): add it to a group or freeze it")
        return group

    def _trainable(self) -> dict:
        trainable = {k: p for k, p in self._parameters.items() if p.requires_grad}
        trainable.update((id(p), p) for p in self.recorder.gathered.values())
        return trainable

    def _audit(self, per_example_losses, mode):
        """This step's graph: refuse a stray parameter; return the recorded calls, the reentrant
        checkpoints' nodes, the nodes visited and the graph's signature (audit.py)."""
        trainable = self._trainable()
        self._handles += self.accumulation.watch(self._parameters.values())
        self.refusals.refuse_gradient_hooks(trainable, self.accumulation.others_hooks)
        seen, kinds = set(), []
        types = self.recorder.captured_types
        found = audit_graph([per_example_losses.grad_fn], trainable, seen=seen, captured_types=types, kinds=kinds)
        calls = found.calls
        try:
            replaced = {id(p): p for c in calls for p in c.params.values() if id(p) not in trainable}
            if replaced:  # parameters swapped in after attaching: audit them too, from now on
                self._parameters.update(replaced)
                seen, kinds = set(), []
                found = audit_graph([per_example_losses.grad_fn], {**trainable, **replaced}, seen=seen,
                                    captured_types=types, kinds=kinds)
                calls = found.calls
            regions = found.reentrant
            reached = next((c for c in calls if c.fired), None)
            if reached is not None:
                raise RuntimeError(
                    f"module '{reached.name}' ({type(reached.module).__name__}) of this forward was already reached "
                    "by the backward of another ghostdp loss: two DP losses of one forward (added together, or "
                    "backpropagated one after the other) would each clip an example's gradient to C, so together it "
                    "could move the update by more than C. Fix: one DP loss per forward, built from the sum of the "
                    "per-example terms (controller.loss(losses_a + losses_b)), or run the forward again for the "
                    "second loss.")
            if regions:
                if self._has_sharded_parameters() or distributed_rank_and_size()[1] > 1:
                    raise NotImplementedError(REENTRANT_DISTRIBUTED)
                self._regions.watch(regions)
            self.refusals.refuse(found, calls, nothing_live=not self.recorder.live)
        except BaseException:
            _forget_captured_edges(calls)
            raise
        return calls, regions, seen, tuple(kinds)

    def _audit_region(self, tracer, first_call):
        """In pass 1, once a reentrant checkpoint's backward is done: the graph its recomputation made
        (``tracer.nodes``), below the nodes the step's audit visited; its calls (from ``first_call`` in the
        pass's list) then get their layouts (PassOne.region_audited) and drop their nodes, which would hold
        the region's graph and inputs' gradients."""
        passed = self.pass_one.current
        audited = passed.audited
        kinds = []
        found = audit_graph([n for n in tracer.nodes if n not in audited], passed.trainable, stop=audited,
                            recorded=tracer.function_edges, kinds=kinds)
        tracer.nodes.clear()
        tracer.function_edges.clear()
        calls = passed.region_calls[first_call:]
        try:
            if found.reentrant:
                raise NotImplementedError(
                    "a reentrant activation checkpoint inside another one is not supported: ghostdp cannot see the "
                    "inner region's graph. " + NON_REENTRANT_FIX)
            self.refusals.refuse(found, calls=True)
            self.pass_one.region_audited(calls, ("region",) + tuple(kinds))
        finally:
            for call in calls:
                call.edges, call.input_nodes = (), frozenset()

    @torch.no_grad()  # called by a user outside a backward too: no graph from the activations to the norms
    def per_example_norms(self, per_example_losses: torch.Tensor, mode=None, pass_two: bool = False) -> torch.Tensor:
        """Pass 1 only: the (B,) per-example gradient norms of all trainable parameters, float64.
        ``mode``: the clipping mode of this backward (``mode_for_loss``; default: the controller's).
        ``pass_two``: ``write_clipped_sums`` follows (the DP loss's backward): two passes keep what pass 2 repeats."""
        mode = self.mode if mode is None else mode
        if per_example_losses.dim() != 1:
            raise ValueError(f"per-example losses must have shape (batch,), got {tuple(per_example_losses.shape)}")
        if not per_example_losses.requires_grad:
            raise ValueError("the per-example losses do not require grad: no trainable parameter was used "
                             "(is the forward under torch.no_grad(), or is every parameter frozen?)")
        if self.pass_one.current is not None:
            raise RuntimeError("a ghostdp norm pass is already running (nested backward of a DP loss)")
        self.pass_one.pass_two.forget()  # a pass 1 whose pass 2 never came (a refusal between them): not this step's
        B = per_example_losses.shape[0]
        self._mass = None
        if B == 0:  # an empty Poisson batch: nothing to clip, the step adds noise only
            return torch.zeros(0, dtype=torch.float64, device=per_example_losses.device)
        calls, regions, audited, graph = self._audit(per_example_losses, mode)
        self.recorder.warn_if_compiled()

        def checkpointed():  # this step ran a trained layer under a checkpoint (the modes' measure depends on it)
            return bool(regions) or self.recorder.forward_was_checkpointed()

        try:
            passes, saved, footprint = self.pass_one.layouts.passes, None, None
            if self.step_modes.weighs_saved() and not checkpointed():
                # The bytes the graph saved, which two passes hold through pass 1, read before pass 1 frees any
                # (modes.StepModes: what book-keeping would keep, against those; FSDP2's freed shards cannot be).
                footprint = sum([math.prod(shape) for call in calls for shape in call.shapes])
                if self.step_modes.counts_saved(footprint, passes) and not self._has_sharded_parameters():
                    # The parameters as the tree just read them (no second walk), the buffers, and the forward's
                    # arguments (the caller's: a slice of a tensor of the whole dataset was counted as all of it).
                    alive = storage_keys(self._model_tree.parameters + list(self.module.buffers()))
                    alive |= self.recorder.input_storages
                    saved = saved_bytes(audited, alive)
            measures_kept = saved is not None or self.step_modes.measures(mode, checkpointed, passes, calls)
            groups = 1 if self.group_norms is None else len(self.group_norms)
            passed = self.pass_one.run(per_example_losses, mode, calls, regions, audited, groups, measures_kept, graph,
                                       pass_two)
        finally:
            _forget_captured_edges(calls)
        self.independence.refuse_mixing(B, passed.calls, per_example_losses.device)
        if self.recorder.outside_forward is not None:
            self.independence.warn_of_calls_outside(self.recorder.outside_forward, type(self.module).__name__)
            self.recorder.outside_forward = None
        if self._fallback_listed:
            self._log_fallback()
        self.step_modes.measured(passed, mode, checkpointed, saved, footprint, calls)
        self._kept = passed.kept if mode.keeps_factors else passed.exact
        self._mass = (passed.total_mass(), passed.mass_dtype)
        sq = passed.total_sq()
        if sq is None:
            sq = torch.zeros(groups, B, dtype=torch.float64, device=per_example_losses.device)
        group_norms = sq.clamp(min=0).sqrt()
        if self.group_norms is None:
            return group_norms[0]
        self.last_group_norms = group_norms
        return sq.sum(0).clamp(min=0).sqrt()

    def _log_fallback(self) -> None:
        """Once, after the first norm pass: which of the modules listed when attaching took the fallback in it; the
        others were captured at their parameters' elementwise uses (or were not called)."""
        listed, self._fallback_listed = self._fallback_listed, []
        taken = sorted({n or "<root>" for n in self.pass_one.took_fallback})
        others = [n for n in listed if n not in taken]
        uses = (f"; the other {len(others)} listed when attaching ({_listed(others, 3)}) were captured at their "
                "parameters' elementwise uses or not called" if others else "")
        log.info(FALLBACK_TAKEN.format(count=len(taken), names=_listed(taken) if taken else "none", uses=uses))

    def clip_coefficients(self, per_example_losses: torch.Tensor, mode=None, pass_two: bool = False) -> torch.Tensor:
        """Pass 1 and c_i = min(1, C / (n_i + 1e-6)) (per-group clipping: c_ki = min(1, C_k / (n_ki + 1e-6)),
        shape (groups, B)). Examples with a non-finite loss or norm, or whose gradient terms could round
        the others away (precision.py), raise or get c_i = 0."""
        if self.ledger.norm_pass_check is not None:
            self.ledger.norm_pass_check(per_example_losses)
        norms = self.per_example_norms(per_example_losses, mode, pass_two)
        bad = ~torch.isfinite(norms) | ~torch.isfinite(per_example_losses.detach()).to(norms.device)
        if self.group_norms is None:
            coeffs = (self.max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)
            largest, smallest_norm = coeffs, self.max_grad_norm
        else:
            bounds = torch.tensor(self.group_norms, dtype=norms.dtype, device=norms.device)[:, None]
            coeffs = (bounds / (self.last_group_norms + CLIP_EPS)).clamp(max=1.0)
            largest, smallest_norm = coeffs.max(0).values, min(self.group_norms)
        imprecise = imprecise_examples(largest, *(self._mass or (None, None)), smallest_norm)
        if imprecise is not None:
            bad = bad | imprecise
        if bad.any():
            indices = bad.nonzero().flatten().tolist()
            if self.nonfinite == "error":
                self._kept = new_factor_store()
                self.pass_one.pass_two.forget()
                if imprecise is not None and imprecise.any():
                    raise ImpreciseExampleError(imprecise.nonzero().flatten().tolist())
                raise NonFiniteLossError(indices, "loss or gradient norm")
            coeffs = torch.where(bad, torch.zeros_like(coeffs), coeffs)
        self.last_norms, self.last_coefficients = norms, coeffs
        return coeffs

    def writes_sums_itself(self, mode=None) -> bool:
        """Whether this DP loss's clipped sums go into p.grad past autograd's accumulation and DDP's reducer, for the
        DP optimizer to sum over the ranks: book-keeping's, and two passes' that repeat pass 1 (after
        ``clip_coefficients``), except with FSDP2, which reduce-scatters them."""
        mode = self.mode if mode is None else mode
        pass_two = self.pass_one.pass_two
        return mode.keeps_factors or (pass_two.pending() and not pass_two.summed_by_fsdp())

    def write_clipped_sums(self, coefficients, grad_output, losses, mode=None):
        """After pass 1: sum_i c_i g_i into p.grad. Book-keeping writes it from its kept factors; two passes
        run pass 2, pass 1's backward again, here, as a backward of its own, which writes each layer's sum as its
        output grads arrive (pass_two.py): nothing of the DP loss's gradient flows into the model in the
        caller's backward, so a gradient that reaches a recorded call there came from something else and is
        refused (PassOne.refuse_if_not_from_dp_loss). The fallback's parameters take their sums from pass 1's
        per-example gradients (precision.py).

        With FSDP2-sharded parameters each call's sums go into the unsharded parameters' .grad as its G arrives,
        for FSDP's reduce-scatter (PassTwo.keep_for_fsdp); where a call's G would come only from the backward's
        result, after FSDP has reduced, pass 2 is still a backward of sum_i c_i L_i, whose G is c_i times pass 1's
        only up to rounding, which an example whose G is mostly rounding can turn into a contribution above C
        (pass_two.py; the README's known gaps)."""
        mode = self.mode if mode is None else mode
        kept, self._kept = self._kept, new_factor_store()
        if self.pass_one.pass_two.pending():
            with self.pass_one.running_pass_two():
                self.pass_one.pass_two.run(losses, ClippedSums(coefficients, grad_output), kept)
            return
        with self._region("ghostdp.clipped_sum"):
            weights = mode.grad_of_losses(kept, coefficients, grad_output, losses, self._group_of)
        if weights is None:
            return
        exact = exact_sums(kept, coefficients * grad_output.to(coefficients.dtype)) if kept else contextlib.nullcontext()
        with self.pass_one.running_pass_two(), exact:
            torch.autograd.backward(losses, weights)

    def mode_for_loss(self):
        """The clipping mode of the DP loss being built from this forward (modes.StepModes.for_loss)."""
        several = distributed_rank_and_size()[1] > 1
        return self.step_modes.for_loss(self.recorder.forward_was_checkpointed, several,
                                        self._has_sharded_parameters)

    def _expects_one_backward(self, checkpointing: bool) -> bool:
        """Whether the DP loss of the forward that starts now would take book-keeping's one backward (two passes
        configured: modes.StepModes.expects_one_backward)."""
        several = distributed_rank_and_size()[1] > 1
        return self.step_modes.expects_one_backward(checkpointing, several, self._has_sharded_parameters)

    def _has_sharded_parameters(self) -> bool:
        """Whether the model has FSDP2-sharded parameters, walked again only where its tree changed (model_tree.py)."""
        self._model_tree = current_tree(self._model_tree, self.module)
        return self._model_tree.sharded()

    # ----------------------------------------------------------------- per-example gradients on demand
    @contextlib.contextmanager
    def grad_samples(self, params=None, max_bytes: int = 2 ** 31):
        """Within this block, each backward of a DP loss also sets ``p.grad_sample`` (B, *p.shape): every
        example's own gradient dL_i/dp, unclipped, materialised from the factors the norm rules built
        (no second implementation per layer), in example chunks, straight into its place.

        ``params``: the parameters wanted (default: every trainable one). A parameter the step did not
        use gets ``grad_sample = None``. ``max_bytes`` bounds B * sum(p.numel()) * itemsize; a larger
        request is refused before the backward computes anything. Each backward replaces the previous
        samples (one physical batch's examples).
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        wanted = None
        if params is not None:
            params = list(params)
            foreign = [tuple(p.shape) for p in params if id(p) not in self._parameters]
            if foreign:
                raise ValueError(f"grad_samples: {len(foreign)} of the parameters (shapes {foreign[:3]}) are not "
                                 "parameters of the private model")
            wanted = {id(p) for p in params}
        previous, self._sample_request = self._sample_request, SampleRequest(wanted, max_bytes)
        try:
            yield self
        finally:
            self._sample_request = previous

    # ----------------------------------------------------------------- losses
    def loss(self, per_example_losses: torch.Tensor, reduction: str = "mean", expected_batch_size=None):
        """The training loss for per-example losses (B,): an ordinary tensor whose backward runs both passes.

        Its value is the mean of the B losses ("mean") or their sum ("sum"): what ``loss.item()`` should
        show. Whatever the reduction, backward() leaves the clipped SUM sum_i c_i g_i in p.grad
        (times the gradient flowing into this loss, 1 for a plain backward()); the DP optimizer
        adds the noise and divides by the expected batch size.
        """
        return clipped_loss(self, per_example_losses, reduction, expected_batch_size)

    def criterion(self, criterion: torch.nn.Module, expected_batch_size=None):
        """Wrap a torch loss (it must support reduction="none") into a DP criterion."""
        return DPCriterion(criterion, self, expected_batch_size)
