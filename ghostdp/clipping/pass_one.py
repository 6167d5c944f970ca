"""Pass 1 of a controller: every recorded call's output grads G, its norm rule, the per-example norms.

``run`` starts a ``NormPass`` (records.py) after the step's audit: the layout proof first where a call's
shapes are new (layout.py), then one backward of the per-example losses towards the probes (probe.py) and
the captured calls' edges (capture.py). Each call's G arrives through ``receive``; its rule turns (inputs,
G) into factors (norms/factors.py), which are queued and reduced to squared norms in batches of layers
(norms/batched.py), or, for a parameter that several calls share, kept until all of its calls are in
(cross terms). Book-keeping also keeps every factor for its clipped sums. With reentrant checkpoints the
pass is a backward without inputs that recomputes each region (reentrant.py). Two passes' pass 2 runs this
pass's backward again through the same receiving path, forming clipped sums where this pass forms norms
(pass_two.py).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from ..data import any_rank
from ..norms import batched
from ..norms.factors import combined_sq_norm
from ..norms.fallback import fallback_grads, output_batch_dims
from ..norms.registry import ROWS
from .capture import check_inputs_unchanged, hooked_output_grad, sink_below
from .generators import own_generators, random_states, same_random_states
from . import pass_two as pass_two_module
from .layout import ROWS_LAYOUT, LayoutProver, flattened_batch
from .records import NormPass
from .reentrant import NON_REENTRANT_FIX, USE_NON_REENTRANT, leaves_below, stashed_grads
from .samples import write_samples

_profiler_enabled = torch._C._autograd._profiler_enabled

CHECKPOINTING_UNSUPPORTED = (
    "A reentrant activation checkpoint was not recognised (another library's, not torch.utils.checkpoint's): "
    "it refuses ghostdp's norm pass (an autograd.grad call). torch's reentrant checkpoints are supported. "
    + NON_REENTRANT_FIX)


RANDOM_DRAWS_IN_PASS_ONE = (
    "random numbers were drawn during the norm pass's backward: an activation checkpoint recomputed random "
    "ops (dropout) without restoring the forward's random state (torch.utils.checkpoint(..., "
    "preserve_rng_state=False); a checkpointed module drawing from a torch.Generator of its own, as peft's PVeRA "
    "with a generator_seed does, which no checkpoint restores), or a backward draws random numbers. A second "
    "backward (the layout proof; pass 2 with clipping='ghost', or book-keeping under checkpointing) would draw "
    "others: the norms that set each example's clip coefficient would belong to one gradient and the clipped sum "
    "to another, which can exceed the clipping norm (measured: 1.14 C). Fix: keep preserve_rng_state=True "
    "(torch's default) and draw from the global generator inside checkpoints (PVeRA: generator_seed=None), or "
    "make the backward deterministic.")


DIFFERENT_REGION_CALLS = (
    "a reentrant activation checkpoint recomputed different module calls in two backward passes of one step (a "
    "forward that depends on state other than its inputs and the random generators?), so ghostdp cannot prove "
    "where each example's gradient is. " + NON_REENTRANT_FIX)


def _take_projections(calls, twins) -> None:
    """Each of a reentrant step's region ``calls`` takes the projections of its twin in a proof's recomputation of
    the regions, in order (where it has a layout left to prove); refused where the two made different calls."""
    if len(calls) != len(twins) or any(a.module is not b.module or list(a.shapes) != list(b.shapes)
                                       for a, b in zip(calls, twins)):
        raise RuntimeError(DIFFERENT_REGION_CALLS)
    for call, twin in zip(calls, twins):
        if call.projections is not None:
            call.projections = twin.projections


def _projected(call) -> bool:
    """Whether a call with no proven layout has the layout proof's projections of all its output grads (a
    reentrant step proven before pass 1), so that its norm can be formed as its G arrives."""
    return call.projections is not None and all(p is not None for p in call.projections)


def _missed_calls_possible(captured) -> bool:
    """Whether a captured call was captured as two passes capture (capture.py), with no sink looked for below it:
    pass 1 may then not run its node and name it in a second backward, which needs the graph. A two-pass controller
    records a forward as book-keeping does where it expects the DP loss to take book-keeping's one backward
    (modes.StepModes.expects_one_backward); where the loss takes it all the same (its measure changed after the
    forward: another forward's loss ran in between), the graph is kept, as two passes keep it (before 2026-11-27 a
    ViT's patch projection, whose input passes the embeddings' sink, was not reached, and the step failed)."""
    for call in captured:
        if call.sink_unknown:
            return True
    return False


def _backward_to_probes(losses, inputs, cotangent, retain):
    """Pass 1's backward: towards the probes and the captured calls' edges (capture.py); their grads."""
    try:
        return torch.autograd.grad(losses, inputs, cotangent, retain_graph=retain, allow_unused=True)
    except RuntimeError as error:
        if "checkpoint" in str(error).lower() and ".grad()" in str(error):  # reentrant checkpointing
            raise NotImplementedError(CHECKPOINTING_UNSUPPORTED) from error
        raise


class PassOne:
    """The norm pass of one controller (``controller``: its recorder, clipping groups, sample request,
    timed regions and reentrant regions). ``current`` is the running NormPass, or None."""

    def __init__(self, controller, recorder):
        self.controller = controller
        self.recorder = recorder
        self.current = None
        self.in_fallback = False         # a fallback's own backward is running (its probes stay quiet)
        self.took_fallback = set()       # the names of the modules whose calls took the exact fallback, ever
        self.in_pass_two = 0             # pass 2 of a DP loss is running (running_pass_two), nested that deep
        self._reprove = False            # this pass proves every call's layout again (run)
        self._random_before = None       # the generators' states at the start of the pass (run)
        self._own_generators = None      # the torch.Generators the model's modules hold (found at the first pass)
        self.layouts = LayoutProver()
        self._shared_in_regions = set()  # ids of parameters seen with several calls in a reentrant step
        self._proof_region_calls = None  # a reentrant step proven before pass 1: the proof's region calls, in order
        self._region_uses_known = False  # a reentrant step has counted every parameter's calls
        self.pass_two = pass_two_module.PassTwo(self)  # two passes' pass 2: this pass's backward again

    def run(self, per_example_losses, mode, calls, regions, audited, groups: int, measures_kept: bool,
            graph: tuple, pass_two: bool = False) -> NormPass:
        """The layout proof if needed, then pass 1, over the audited ``calls``: the finished NormPass.
        ``graph``: the signature of the step's graph (audit.py); on a graph not proven before, every call's
        layout is proven again. ``pass_two``: two passes' pass 2 follows (pass_two.py)."""
        B = per_example_losses.shape[0]
        due = self.layouts.proof_due()  # a proof covers the values it ran on too (layout.REPROOF_EVERY)
        layouts = self.layouts.select(graph)
        reprove = due or not layouts.complete
        probes = list(self.recorder.probes.values())
        captured = [c for c in calls if c.captured is not None]
        unproven = self.layouts.assign(calls, B, everything=reprove) if probes or captured else []
        # Every process takes the same decision: a proof's backward runs FSDP2's parameter gathers, and a proof
        # on one rank alone, whose loss head differed (an empty batch's padding row is multiplied by 0), left
        # the others waiting in them (the FSDP2 test hung).
        self._reprove = any_rank(bool(unproven) or reprove, per_example_losses.device)
        if self._reprove and (probes or captured) and not unproven:
            unproven = self.layouts.assign(calls, B, everything=True)
        # The proof compares two backward passes, and two passes write the clipped sums with a second one: each
        # must see the same backward, which a random draw in one would not repeat in the other. (A book-keeping
        # step without a proof has one backward: nothing to compare.)
        second_backward = bool(unproven) or bool(regions) or mode.continues_backward
        if second_backward and self._own_generators is None:  # a module's own (PVeRA's) draws in a recomputation too
            self._own_generators = own_generators(self.controller.module)
        self._random_before = (random_states(per_example_losses.device, generators=self._own_generators)
                               if second_backward else None)
        if unproven and not regions:
            self._prove_layouts(per_example_losses, probes, captured)
            self._prove_fallback_inputs(per_example_losses, unproven)
            self._refuse_random_draws(per_example_losses.device)
        # With reentrant checkpoints a proof that is due (or needed by calls outside the regions: then _reprove is
        # set too) runs before pass 1 as well (_prove_reentrant_layouts); a region whose graph takes a new form on
        # a step without one is proven after pass 1 (_prove_deferred_layouts).
        self._proof_region_calls = None
        if regions and self._reprove:
            self._prove_reentrant_layouts(per_example_losses, audited, calls)
        passed = NormPass(B, groups=groups, reentrant=bool(regions), keeps_factors=mode.keeps_factors,
                          measures_kept=measures_kept)
        # Two passes write their clipped sums by pass 1's backward again (pass_two.py).
        self.pass_two.forget()
        passed.replayed = pass_two and mode.continues_backward
        if passed.replayed and pass_two_module.CHECK_PASS_TWO and self._reprove:
            passed.pass_two_check = {}
        if (passed.replayed and self.pass_two.scales(checked=self._reprove)
                and not self.controller._has_sharded_parameters()):
            passed.param_sq = {}  # each parameter's norms, which pass 2 scales its sums by (pass_two.py)
        passed.kept_storages.alive_anyway = self.recorder.input_storages
        request = self.controller._sample_request
        if request is not None:
            passed.samples = request.start(self.controller._parameters.values(), B)
        self.current = passed
        try:
            with self.controller._region("ghostdp.pass1"):
                if regions:  # the captured calls' grads come through their nodes' pre-hooks (capture.py)
                    self._reentrant_pass_one(per_example_losses, audited)
                    if passed.replayed:  # pass 2's recomputed region calls take the layouts of these, in order
                        # (no FSDP here: the step's audit refuses reentrant regions with it, REENTRANT_DISTRIBUTED)
                        self.pass_two.keep(probes, [(c, ()) for c in captured], False, passed.region_calls,
                                           passed.pass_two_check, passed.param_sq)
                else:
                    # The edges the step's audit gave the captured calls (pass 1 drops each once it is received),
                    # which pass 2 names again.
                    edges = [(c, c.edges) for c in captured] if passed.replayed else ()
                    if probes or captured:
                        # Pass 2 needs the graph again; book-keeping has none, so pass 1 frees it as it goes, unless
                        # its forward was recorded for two passes (_missed_calls_possible).
                        retain = (mode.continues_backward or self.recorder.graph_needed_after_pass1
                                  or _missed_calls_possible(captured))
                        self._backward_to_outputs(per_example_losses, probes, captured,
                                                  torch.ones_like(per_example_losses), retain)
                    self._finish()
                    if passed.replayed:
                        self.pass_two.keep(probes, edges, passed.second_backward, None, passed.pass_two_check,
                                           passed.param_sq)
                        if self.controller._has_sharded_parameters():
                            self.pass_two.keep_for_fsdp(probes, captured, passed.second_backward)
            if mode.continues_backward:
                self._refuse_random_draws(per_example_losses.device)
            if passed.samples is not None:
                write_samples(passed.samples, B)
        finally:
            self.current, self._proof_region_calls = None, None
        for proven in [layouts] + passed.region_forms:
            proven.complete = True
        return passed

    def _refuse_random_draws(self, device):
        """Refuse a backward of this pass that drew random numbers (RANDOM_DRAWS_IN_PASS_ONE)."""
        if not same_random_states(self._random_before, random_states(device, generators=self._own_generators)):
            raise RuntimeError(RANDOM_DRAWS_IN_PASS_ONE)

    def receives_output_grads(self) -> bool:
        return self.current is not None and not self.in_fallback

    def needs_inputs(self) -> bool:
        """Whether a ruled call's saved inputs must be unpacked now (the layout proof reads only G)."""
        return not self.current.proving

    def arrive(self, call, grad):
        """A captured call's output grad from its node's pre-hook during a backward of pass 1 (capture.py): it
        waits, with the others that arrive, until the backward is done or the waiting calls hold a fraction
        of batched.QUEUE_ELEMENTS (counted as the queue counts a factor), and is then received. The
        same Python work runs about a quarter slower per call between the engine's nodes than in one run
        after them (the stand-in's book-keeping step: 48.9 against 38.5 us a call)."""
        passed = self.current
        passed.captured_received.add(id(call))
        passed.arrived.append((call, grad))
        # Counted as the queue counts a factor (batched._held_elements): its inputs and G.
        passed.arrived_elements += grad.numel() + sum([x.numel() for x in call.inputs])
        if passed.synchronous or passed.arrived_elements >= batched.waiting_elements():
            self._receive_arrived()

    def _receive_arrived(self):
        passed = self.current
        arrived, passed.arrived, passed.arrived_elements = passed.arrived, [], 0
        arrived.reverse()
        while arrived:  # popped in order of arrival, so that no G outlives its reduction here
            self.receive_captured(*arrived.pop())

    def receive_captured(self, call, grad):
        """A captured call's output grad (capture.py), shaped as its output."""
        self.current.captured_received.add(id(call))
        if not self.current.proving:
            check_inputs_unchanged(call)
        shape = call.shapes[0]
        self.receive(call, 0, grad if grad.shape == shape else grad.view(shape))

    def _backward_to_outputs(self, losses, probes, captured, cotangent, retain):
        """Pass 1's (or the layout proof's) backward towards the probes and the captured calls' edges (capture.py).

        A captured call whose G book-keeping keeps whole (or a small one: capture.narrow_output) is ``named``:
        its edge is an input of this backward, which returns its G at the end. Any other captured call's G (and
        a small named one's, where its node runs) is handed over by its node's pre-hook as autograd runs the
        node (``arrive``), and freed once its norm is formed, as a probe's is. Autograd runs a node only if a
        named input lies below it. Book-keeping captures an unnamed call only when a probe or named call lies
        below it (capture.sink_below); two passes capture every call above the lowest ones, and name a call
        whose node this backward did not run in a second one. With nothing named below any of them (no
        probe, no named call), the first backward names them all."""
        passed = self.current
        if passed.proving:
            named, hooked = self._proof_sinks(captured)
        else:
            named = [c for c in captured if c.named]
            hooked = [c for c in captured if not c.named]
        if hooked and not (probes or named):
            named, hooked = captured, []
        self._receive_named(losses, probes, named, cotangent, retain)
        missed = [c for c in hooked if id(c) not in passed.captured_received]
        if missed:
            if not retain:
                raise RuntimeError(
                    f"internal error: pass 1 did not reach the captured layer '{missed[0].name}' although a probe "
                    "or a named layer lies below it; please report this with the model")
            passed.captured_only = True  # the second backward runs probed nodes again: they stay quiet
            passed.second_backward = True  # (pass 2 repeats it: pass_two.py)
            self._receive_named(losses, [], missed, cotangent, retain and passed.sums_pass is None)

    def _proof_sinks(self, captured):
        """The layout proof's split of the captured calls: (named, delivered by their nodes' pre-hooks). The proof
        reads only a projection of each G, so a G that the backward would return (a named edge) is held to its end
        for nothing: book-keeping names most calls in pass 1, where their factors hold G anyway, and its proof held
        every G at once next to the whole retained graph (BERT L=4, H=256, B=16: 165.8 MB on a proof step against
        120.6 MB on the others, plain 96.9 MB). So the proof names only the calls with no probe or captured call
        within capture.SINK_SEARCH_NODES below their inputs (the lowest ones), and takes every other G as its node
        runs, projects it and drops it (PassOne.arrive); a call whose node did not run all the same is named in a
        second backward (_backward_to_outputs)."""
        types = self.recorder.captured_types
        named, hooked = [], []
        for call in captured:
            (hooked if call.input_nodes and sink_below(call.input_nodes, types) else named).append(call)
        return named, hooked

    def _receive_named(self, losses, probes, named, cotangent, retain):
        """One backward towards the probes and the named calls' edges, during which the captured calls' pre-hooks
        hand their G over as their nodes run (``arrive``); then each named call not received so is received
        from the backward's result (and that G dropped once received).

        The backward returns every named G at once, so reducing the norm queue after each layer too large to
        stack would free nothing that was not alive at their start: those layers wait for the others
        (``NormPass.queue_held``, batched.NormQueue.full) and the queue is reduced after them, instead of some 70
        reductions of one layer each, each with its own Python (book-keeping on a GPU at BERT-base sizes). What
        they form stays bounded: each is reduced alone, DeferredGrams takes their Grams' products whenever it
        fills its budget, and stackable factors still fill the queue's bound as before."""
        passed = self.current
        passed.delivers_by_hooks = True
        try:
            grads = list(_backward_to_probes(losses, probes + [c.edges[0] for c in named], cotangent, retain))
        finally:
            passed.delivers_by_hooks = False
        self._receive_arrived()
        passed.queue_held = True
        try:
            for k, call in enumerate(named, start=len(probes)):
                grad, grads[k] = hooked_output_grad(call, grads[k]), None
                if grad is not None and id(call) not in passed.captured_received:
                    self.receive_captured(call, grad)
        finally:
            passed.queue_held = False
        if passed.queue.full():
            self._reduce_queue()

    def receive(self, call, slot, grad):
        """One output grad of a recorded call: from its probe (probe.py); captured (capture.py), from pass 1's
        result or its node's pre-hook."""
        passed = self.current
        if passed.captured_only and call.captured is None:
            return
        if passed.proving:
            if call.projections is not None:
                call.projections[slot] = self.layouts.project(grad)
            return
        if passed.sums_pass is not None:
            self.pass_two.receive(call, slot, grad)
            return
        call.grads[slot] = grad
        if not call.fired:
            call.fired = True
            passed.calls.append(call)
            if passed.reentrant:
                self._fire_in_reentrant_step(call)
                self.recorder.forget(call)
            else:
                self._mark_eager(call)
        if len(call.grads) == 1 and not (passed.reentrant and call.layouts is None and not _projected(call)):
            self._compute(call)

    def _mark_eager(self, call):
        """A call's first output grad outside reentrant regions: a parameter with a single live use (this one),
        and no call of it reached before in this pass, can be reduced to its norm now and its G freed
        (``call.eager``); one with several uses waits for all of them (cross terms). "Reached before", not
        "pending": a call reached earlier may form its factors only later (several outputs: at the end of the
        pass), and the last call of an unrolled nn.LSTMCell was reduced alone so, its cross terms with the other
        steps lost (examples measured up to 1.38 C). The call's uses are consumed in the same loop (what
        recorder.forget does for a call reached in a reentrant step or freed unreached)."""
        live, uses = self.recorder.live, self.current.uses
        eager = {}
        for n, p in call.params.items():
            key = id(p)
            uses[key] += 1
            left = live.get(key, 0)  # the recorded uses not yet consumed, this one included
            eager[n] = left == 1 and uses[key] == 1
            if left > 1:
                live[key] = left - 1
            else:
                live.pop(key, None)
        call.eager = eager

    def _fire_in_reentrant_step(self, call):
        """A call's first output grad in a step with reentrant checkpoints (reentrant.py): its inputs are
        detached (see below); a region's call gets its layout once the region's graph is audited
        (``region_audited``), another call's, if not yet proven, waits for the proof after pass 1; its
        parameters are reduced on arrival only once a step has counted their calls (a region recomputed
        later may use them again)."""
        passed = self.current
        # Detached: a factor kept to the clipped sums (book-keeping) would otherwise hold the region's graph,
        # down to the checkpoint's detached input and the gradient its backward left there.
        call.inputs = tuple(x.detach() for x in call.inputs)
        if (call.layouts is None and not call.in_region and not _projected(call)
                and self.layouts.assign([call], passed.batch_size, everything=self._reprove)):
            passed.deferred.append(call)
        call.eager = {}
        for n, p in call.params.items():
            key = id(p)
            if key in passed.eager_ids:  # reduced alone on an earlier call: the cross terms are lost
                self._shared_in_regions.add(key)
                raise RuntimeError(
                    f"parameter '{n}' of module '{call.name}' is used again in this step, after its norm was "
                    "formed for a single use: with reentrant activation checkpointing ghostdp learns which "
                    "parameters several calls share from the step before, and this step's calls differ. The next "
                    "step will form its norm over all of its calls; to avoid this, " + USE_NON_REENTRANT)
            passed.uses[key] += 1
            eager = (self._region_uses_known and self.recorder.live[key] == 1 and passed.uses[key] == 1
                     and key not in self._shared_in_regions)  # uses: see _mark_eager
            if eager:
                passed.eager_ids.add(key)
            call.eager[n] = eager

    def region_audited(self, calls, graph: tuple):
        """A reentrant region's backward is done and its graph audited: its ``calls`` get their proven layouts
        and their norms, or, where the region's graph (signature ``graph``, audit.py) or a call's shapes are new,
        wait for the proof after pass 1 (a region that mixes examples only on some steps is refused so)."""
        passed = self.current
        region = self.layouts.current.region(graph)
        new = self._reprove or not region.complete
        if new:
            passed.region_forms.append(region)
        unproven = self.layouts.assign(calls, passed.batch_size, everything=new, within=region)
        if unproven and self._proof_region_calls is not None:  # proven before pass 1: the same calls, in order
            first = len(passed.region_calls) - len(calls)  # calls: the pass's region calls from the region's first
            _take_projections(calls, self._proof_region_calls[first:first + len(calls)])
        else:
            passed.deferred.extend(unproven)
        for call in calls:
            if (call.fired and not call.done and (call.layouts is not None or _projected(call))
                    and len(call.grads) == 1):
                self._compute(call)

    def refuse_if_not_from_dp_loss(self, call):
        """A gradient reached a recorded call outside pass 1. It may only in a fallback's own backward, or
        in pass 2 of the DP loss whose pass 1 reached the call: anything else (a loss that is not a DP
        loss, another loss added to the DP loss, a second backward through the graph the DP loss's
        backward retained) would put gradient into p.grad that no norm bounded."""
        if self.in_fallback or (self.in_pass_two and call.fired):
            return
        raise RuntimeError(
            f"a gradient reached module '{call.name}' through a backward that did not come from a ghostdp "
            "loss alone, so it would not be clipped: a loss that is not a DP loss, another loss added to the "
            "DP loss (an auxiliary or regularising term computed from the model's outputs), or a second "
            "backward through the same forward. Fix: backpropagate the DP loss by itself, built with "
            "GhostClipping.loss / the DP criterion from every term that depends on the data (fold an "
            "auxiliary loss into the per-example losses), or call detach() on the controller first.")

    @contextlib.contextmanager
    def running_pass_two(self):
        """Pass 2 of a DP loss runs inside (the backward of its losses weighted by c_i, loss.py)."""
        self.in_pass_two += 1
        try:
            yield
        finally:
            self.in_pass_two -= 1

    # ----------------------------------------------------------------- norms
    def _compute(self, call):
        B = self.current.batch_size
        if self.current.sums_pass is not None:
            self.pass_two.write(call)
            return
        # A captured call keeps its inputs as they came (not batch-first) where pass 2 forms its clipped sums from
        # them again (pass_two.py): autograd holds them for the layer's backward until pass 2 reaches it anyway.
        # Otherwise they go: the call would hold them as long as its graph (capture.py).
        kept_inputs = call.inputs if self.current.replayed and call.captured is not None else ()
        if call.projections is not None:
            self.layouts.resolve(call, B)
        self.layouts.batch_first(call, B)
        if self.current.pass_two_check is not None and call.rule is not None and call.grads[0] is not None:
            self.current.pass_two_check[self.pass_two.key(call)] = pass_two_module.squares(call.grads[0])
        if self.controller.region_timer is None and not _profiler_enabled():
            self._factors(call, B)
        else:
            with self.controller._region(f"ghostdp.norms.{type(call.module).__name__}"):
                self._factors(call, B)
        call.grads, call.inputs, call.done = (), kept_inputs, True
        if not self.current.reentrant:  # the audit of a reentrant region reads them when its backward is done
            call.edges = ()
        if self.current.queue.full(held=self.current.queue_held):
            self._reduce_queue()

    def _factors(self, call, B):
        """The call's factors, kept, queued or pending as the mode and the parameter's uses need."""
        factors = {}
        if call.rule is not None:
            # The names as a set-like view of the call's parameters (no copy per call).
            factors = call.rule(call.module, call.inputs, call.grads[0], call.params.keys())
        missing = None  # the parameters the rule has no factor for (most calls: none, and no dict built)
        if len(factors) < len(call.params):
            missing = {n: p for n, p in call.params.items() if n not in factors}
            self.took_fallback.add(call.name)
            self.in_fallback = True
            try:
                rows, dims = None, call.batch_dims
                if call.rule is None:  # split by example as its proof found them (layout.candidates)
                    rows = [layout == ROWS_LAYOUT for layout in call.layouts]
                    dims = [layout[1] if layout[0] == "dim" else d for layout, d in zip(call.layouts, dims)]
                factors.update(fallback_grads(missing, call.edges, call.grads, dims, call.expanded, B,
                                             call.fallback_stops or call.input_nodes, rows))
            finally:
                self.in_fallback = False
        passed = self.current
        kept = passed.kept_storages.of_call(call) if passed.measures_kept and factors else None
        for n, f in factors.items():
            param = call.params[n]
            if kept is not None:  # what book-keeping would keep, against what the layers hold
                passed.held_bytes += f.held_bytes()
                passed.kept_bytes += f.kept_bytes()
                f.note_kept(kept)
            if passed.keeps_factors:
                f = f.kept(with_mass=not call.eager[n])  # explicit gradients where they hold less
            if passed.samples is not None and self.controller._sample_request.wants(param):
                passed.samples[param].append(f)
            if passed.keeps_factors:
                passed.kept[param].append(f)
            elif missing is not None and n in missing:  # two passes: see precision.exact_sums
                passed.exact[param].append(f)
            if call.eager[n] and passed.param_sq is not None:  # its own norm, kept for pass 2 (pass_two.py)
                passed.param_sq[param] = passed.reduce_alone(f, self.controller._group(param))
            elif call.eager[n]:  # its norm and mass, reduced with other layers' (norms/batched.py)
                passed.queue.push(f, self.controller._group(param))
            else:
                passed.add_mass(f)
                passed.pending[param].append(f)

    def _reduce_queue(self, final: bool = False):
        with self.controller._region("ghostdp.norms.batched"):
            self.current.reduce_queue(final)

    def _finish(self):
        """The norms of calls whose output grads came in pieces, of the queue, and of shared parameters."""
        if self._proof_region_calls is not None and len(self._proof_region_calls) != len(self.current.region_calls):
            raise RuntimeError(DIFFERENT_REGION_CALLS)
        if self.current.deferred:
            self._prove_deferred_layouts()
        for call in self.current.calls:
            if not call.done:
                self._compute(call)
        self._reduce_queue(final=True)
        with self.controller._region("ghostdp.norms.shared_parameters"):
            self._finish_shared()

    def _finish_shared(self):
        for param, factors in self.current.pending.items():
            sq = combined_sq_norm(factors)
            self.current.add(sq, self.controller._group(param))
            if self.current.param_sq is not None:
                self.current.param_sq[param] = sq
        for param in self.current.exact:
            if param in self.current.pending:  # also used by a ruled module: every call's factor
                self.current.exact[param] = list(self.current.pending[param])

    @contextlib.contextmanager
    def _grads_set_aside(self, losses):
        """Inside, a backward without inputs of ``losses`` (reentrant regions) may run: the gradients of the graph's
        leaves are set aside and put back after, and those it accumulates into the trainable parameters dropped as
        they come (reentrant.stashed_grads). Yields (the trainable parameters by id, the ids of the leaves a region
        may read with requires_grad: those parameters and the probes)."""
        trainable = self.controller._trainable()
        allowed = set(trainable) | {id(p) for p in self.recorder.probes.values()}
        with stashed_grads(leaves_below([losses.grad_fn]), dropped=list(trainable.values())):
            yield trainable, allowed

    def _reentrant_pass_one(self, losses, audited):
        """Pass 1 through reentrant checkpoints (reentrant.py): a backward without inputs, so the regions
        recompute; the gradients it accumulates are set aside and dropped."""
        with self._grads_set_aside(losses) as (trainable, allowed):
            self.current.losses, self.current.audited, self.current.trainable = losses, audited, trainable
            with self.controller._regions.traced(allowed, audited):  # each region is audited when its backward is done
                torch.autograd.backward(losses, torch.ones_like(losses), retain_graph=True)
            self._finish()  # after a proof of new layouts, a backward as well
        self._shared_in_regions.update(key for key, n in self.current.uses.items() if n > 1)
        self._region_uses_known = True

    def _prove_reentrant_layouts(self, losses, audited, calls):
        """The layout proof before pass 1 of a reentrant step: a backward without inputs with the proof's cotangent,
        which recomputes the regions (their calls project their output grads: recording._note_region_call). Pass 1
        then forms each call's norm as its G arrives (its region's calls matched to the proof's in order:
        region_audited) instead of holding every unproven call's G and inputs to a proof after it, which peaked
        at 6-12x plain's checkpointed peak (BERT L=4, H=256, B=8-32, before 2026-11-26). The gradients it
        accumulates are dropped, and the regions are traced as in pass 1, so that a tensor pass 1 would refuse
        gets no gradient from the proof (RegionWatch.traced, without the audit). Its recomputation makes the calls
        pass 1's will make (checked as they arrive), so it also counts every parameter's calls (``calls``: those
        outside the regions): pass 1 reduces a parameter with one call as it arrives on the first step too, where
        it held every layer's factors to its end (BERT L=4, H=256, B=16: 165.0 MB against plain's 56.4 MB)."""
        with self._grads_set_aside(losses) as (_, allowed):
            proof = self._reentrant_proof(losses, None, self.controller._regions.traced(allowed, audited, audit=False))
        self._proof_region_calls = proof.region_calls
        uses = Counter(id(p) for call in list(calls) + proof.region_calls for p in call.params.values())
        self._shared_in_regions.update(key for key, n in uses.items() if n > 1)
        self._region_uses_known = True

    def _reentrant_proof(self, losses, after, tracing=contextlib.nullcontext()):
        """The layout proof's backward in a reentrant step: without inputs, with the proof's cotangent, so the
        regions recompute and their calls project their output grads; its NormPass. ``after``: the pass current
        once it is done; ``tracing``: a context the backward runs in (RegionWatch.traced)."""
        proof = NormPass(losses.shape[0], proving=True, reentrant=True)
        self.current = proof
        try:
            with self.controller._region("ghostdp.layout_proof"), tracing:
                torch.autograd.backward(losses, self.layouts.cotangent(losses), retain_graph=True)
            self._refuse_random_draws(losses.device)
        finally:
            self.current = after
        return proof

    def _prove_deferred_layouts(self):
        """The layout proof after pass 1 of a reentrant step without a proof before it, for the calls whose
        layouts are new (a region whose graph took a new form). Its backward recomputes the regions again: their
        calls are matched to pass 1's in order."""
        passed = self.current
        proof = self._reentrant_proof(passed.losses, passed)  # inside pass 1's stashed_grads
        _take_projections(passed.region_calls, proof.region_calls)
        passed.deferred = []

    def _prove_fallback_inputs(self, per_example_losses, unproven):
        """The proof for the float inputs of each unproven call without a rule (recording.on_fallback_forward): each
        input's gradient, with the proof's cotangent v and with ones, must keep the examples apart on the module's
        batch dim, as an output's must (layout.holds). A module that mixes examples inside its own forward (a
        batch mean) passes the output proof, since its output grads are per example; its input grads are not.
        Two more backwards, on proof steps only, where such calls are."""
        inputs = [(c, k, edge) for c in unproven for k, edge in enumerate(c.input_edges)]
        if not inputs:
            return
        B = per_example_losses.shape[0]
        self.current, self.in_fallback = NormPass(B, proving=True), True  # probes and recomputations stay quiet
        try:
            with self.controller._region("ghostdp.layout_proof"):
                edges = [edge for _, _, edge in inputs]
                scaled = torch.autograd.grad(per_example_losses, edges, self.layouts.v.to(per_example_losses),
                                             retain_graph=True, allow_unused=True)
                plain = torch.autograd.grad(per_example_losses, edges, torch.ones_like(per_example_losses),
                                            retain_graph=True, allow_unused=True)
        finally:
            self.current, self.in_fallback = None, False
            for call in unproven:
                call.input_edges = ()
        for (call, k, _), g_v, g_1 in zip(inputs, scaled, plain):
            d = output_batch_dims(call.module, 1)[0]
            if g_v is None or g_1 is None:
                continue  # no gradient
            # An input of the rows of a flattened batch, (B * T, ...), as its outputs may be (a module on the tokens
            # of every example: recording.on_forward gives its call the ROWS layouts).
            rows = (call.tokenwise == ROWS and flattened_batch(g_1.shape, B)
                    and g_1.shape[0] in {s[0] for s in call.shapes})
            # The dims a layout can name once layout.project takes the last (features) away: a (B, T) padding mask
            # that torch's sequence-first attention takes beside (T, B, d) has its batch dim 1 projected away (at
            # T = B until 2026-12-07 its proof raised IndexError).
            if not rows and (d >= max(g_1.dim() - 1, 1) or g_1.shape[d] != B):
                continue  # no batch dim to check: a tensor shared by the batch
            if rows:  # each example's rows together; a sequence-first flattening, (T * B, ...), is not a mixing one
                kept_apart = (self._holds([ROWS_LAYOUT], g_v, g_1)
                              or self._holds([("dim", 1)], *(t.reshape(-1, B, *t.shape[1:]) for t in (g_v, g_1))))
            else:  # its batch dim first; a layout the output proof will refuse (sequence-first) is not a mixing one
                layout = self._holding([("dim", j) for j in [d] + [
                    j for j in range(g_1.dim() - 1) if j != d and g_1.shape[j] == B]], g_v, g_1)
                kept_apart = layout is not None
                if call.reads_argument is not None and call.reads_argument[1] == k:  # a square argument of the
                    call.argument_layout = layout  # forward check's: where its examples lie (independence.py)
            if not kept_apart:
                raise RuntimeError(
                    f"module '{call.name}' ({type(call.module).__name__}) has no norm rule and mixes examples "
                    f"inside its forward: the gradient of its input of shape {tuple(g_1.shape)} takes example j's "
                    "loss into example i's rows (e.g. a mean or a statistic over the batch), so one example "
                    "would move every other example's clipped gradient. Fix: compute per example (normalise "
                    "over each example's own features, as LayerNorm and GroupNorm do), or register a norm rule "
                    "for a module that keeps the examples apart.")

    def _holding(self, options, g_v, g_1):
        """The first of the layouts ``options`` that keeps the examples apart in a gradient taken with the proof's
        cotangent, ``g_v``, and with ones, ``g_1`` (layout.holds), or None."""
        return self.layouts.first_holding(options, self.layouts.project(g_v), g_1)

    def _holds(self, options, g_v, g_1) -> bool:
        return self._holding(options, g_v, g_1) is not None

    def _prove_layouts(self, per_example_losses, probes, captured):
        """The layout proof's backward with a random cotangent (layout.py); pass 1 then compares."""
        self.current = NormPass(per_example_losses.shape[0], proving=True)
        try:
            with self.controller._region("ghostdp.layout_proof"):
                self._backward_to_outputs(per_example_losses, probes, captured,
                                          self.layouts.cotangent(per_example_losses), True)
        finally:
            self.current = None
