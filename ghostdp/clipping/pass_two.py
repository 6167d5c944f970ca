"""Pass 2 of two passes: pass 1's backward again, each ruled call writing its clipped sums (c ⊙ G)^T A from the
output grads G that pass 1 formed its norm from.

A backward of sum_i c_i L_i instead (the algorithm as first written, and ghostdp until 2026-11-27) forms c_i g_i
from a G of its own that equals c_i times pass 1's only up to rounding (c_i is not a power of two); where an
example's G at a layer is mostly rounding (catastrophic cancellation, e.g. a saturated softmax in an attention on
raw inputs of 1e4) the two differ by as much as G itself, and one example moved a float32 clipped sum by up to
4.5 C (tests/privacy/test_pass_two.py, the sensitivity audit's linear-attention-encoder). Pass 2 runs pass 1's
backward with the same cotangent towards the same probes and edges (the same second backward where pass 1 needed
one), so each call receives pass 1's G bit for bit (the same ops on the same values in the same order), and writes
its sums with the rule's factors (modes.ClippedSums, as book-keeping writes its own from kept factors). Autograd
forms no weight gradient in either pass.

- Reentrant checkpoints (reentrant.py): pass 1 was a backward without inputs, and so is pass 2; it recomputes each
  region, whose calls are recorded again and take the layouts of pass 1's region calls in order
  (``take_twin_layouts``); what autograd accumulates into the parameters is dropped, and the sums are written
  once that backward is done.
- FSDP2: FSDP reduce-scatters each unit's gradients in its post-backward hook, during pass 2's backward, so each
  call's sums are written as its G arrives (``synchronous``); a step in which some call's G comes only from the
  backward's result keeps a backward of sum_i c_i L_i (``keep_for_fsdp``, GhostClipping.write_clipped_sums).
- Bit for bit holds where the backward's kernels are deterministic; where they are not (a GPU's atomics in an
  attention backward or a scatter), pass 2's G differs from pass 1's by their rounding, or by as much as G itself
  where G is mostly rounding. So on the layout proof's steps, and on every step once such a difference has been
  seen, each parameter's clipped sum is scaled so that no example can exceed C whatever G pass 2 received: pass 1
  keeps each parameter's per-example squared norm n1_p (formed layer by layer), pass 2 forms it again from its own
  factors (n2_p), and writes sum_i c_i s_pi g2_pi with s_pi = min(1, n1_pi / n2_pi). Each example's contribution
  then has squared norm sum_p c_i^2 s_pi^2 n2_pi^2 <= c_i^2 sum_p n1_pi^2 <= C^2; where the passes agree, s is 1 up
  to the rounding of two ways of forming one norm. On those steps each ruled call's G is also compared between the
  passes (CHECK_PASS_TWO), and a difference turns the scaling on for every later step (warned once,
  StepModes.pass_two_rescaled). Not refused, and not dropped: whether the passes differ depends on the batch, and a
  batch dropped for one example's sake would take every other example's gradient with it (an update that moves by up
  to B C). FSDP2's sums, which FSDP reduce-scatters as they are written, are not scaled: a difference there is
  refused (PASS_TWO_DIFFERS).
"""
from __future__ import annotations

import warnings

import torch

from ..callers import caller_stacklevel
from ..norms import batched
from ..norms.factors import combined_sq_norm
from .modes import new_factor_store
from .records import NormPass

# On the layout proof's steps (layout.py: the first, then norm passes 2, 4, ..., REPROOF_EVERY and every
# REPROOF_EVERY-th; a new graph) every ruled call's output grads are compared between the two passes (each
# example's sum of squares in float64, one reduction per call and pass), and their clipped sums are scaled (see
# the module doc); a difference scales every later step's sums too (PASS_TWO_RESCALED). False: neither.
CHECK_PASS_TWO = True

PASS_TWO_RESCALED = (
    "clipping='ghost': pass 2 repeats pass 1's backward so that each layer's clipped sum reads the output grads its "
    "norm was formed from, but on this step module '{name}' received different ones in the two passes (an example's "
    "squared norm there differs by {relative:.3g} of itself): a kernel of this backward is not deterministic (on a "
    "GPU: atomics in an attention backward or a scatter). From now on pass 2 forms each parameter's per-example "
    "norms again and scales its clipped sums so that no example's clipped gradient exceeds the clipping norm (this "
    "step's were scaled so already): the same memory, more time per step. clipping='bookkeeping' (one backward, "
    "more memory) or torch.use_deterministic_algorithms(True) (on CUDA with CUBLAS_WORKSPACE_CONFIG=:4096:8) avoid "
    "that cost.")

PASS_TWO_DIFFERS = (
    "pass 2 of clipping='ghost' repeats pass 1's backward so that each layer's clipped sum reads the output grads "
    "its norm was formed from, but on this step module '{name}' received different ones in the two passes (an "
    "example's squared norm there differs by {relative:.3g} of itself): a kernel of this backward is not "
    "deterministic (on a GPU: atomics in an attention backward or a scatter). An example's clipped gradient could "
    "then exceed the clipping norm, by as much as its output grads differ; with FSDP2-sharded parameters, whose "
    "sums FSDP reduce-scatters as pass 2 writes them, ghostdp cannot scale them to prevent that. Fix: "
    "torch.use_deterministic_algorithms(True) (on CUDA with CUBLAS_WORKSPACE_CONFIG=:4096:8). "
    "ghostdp.clipping.pass_two.CHECK_PASS_TWO = False accepts the difference.")


def squares(grad) -> torch.Tensor:
    """(B,) each example's sum of squares of a batch-first output grad, in float64 (PASS_TWO_DIFFERS)."""
    return grad.reshape(grad.shape[0], -1).double().pow(2).sum(1)


class SumsPass:
    """What pass 2 carries while it runs (NormPass.sums_pass): the sums it writes, and what it compares and scales."""

    def __init__(self, sums, skipped, twins, expected, first_sq):
        self.sums = sums            # the modes.ClippedSums it writes
        self.skipped = skipped      # the parameters whose clipped sums are written already (the fallback's)
        self.twins = twins          # through reentrant checkpoints: pass 1's region calls, in order
        self.expected = expected    # a checked step: key -> (B,) squares of pass 1's G (CHECK_PASS_TWO)
        self.pairs = []             # (name, pass 1's squares, pass 2's) of the calls compared
        self.first_sq = first_sq    # a scaled pass: pass 1's parameter -> (B,) squared norms (the module doc)
        self.scales = {}            # a scaled pass: parameter -> (B,) s_p, until its sum is written
        self.calls = {}             # id -> call reached, in order
        self.factors = new_factor_store()  # parameter -> factors waiting for their clipped sums
        self.elements = 0           # what those factors hold (PassTwo.write)


class PassTwo:
    """Pass 2 of a controller's two passes, over its PassOne (``passes``: the running pass, the layouts, the
    backward towards the probes). ``replay`` is what pass 1 kept for it, or None."""

    def __init__(self, passes):
        self.passes = passes
        # (probes, [(captured call, its edges)], second backward, region calls, pass 1's squares, pass 1's
        # per-parameter squared norms where pass 2 scales its sums)
        self.replay = None
        self.by_fsdp = False   # FSDP2 reduce-scatters the sums (keep_for_fsdp)

    # ----------------------------------------------------------------- what pass 1 keeps
    def keep(self, probes, edges, second_backward, region_calls, squares_of_pass_one, param_sq=None) -> None:
        """Pass 1 is done: what pass 2 repeats (see the class doc)."""
        self.replay = (probes, edges, second_backward, region_calls, squares_of_pass_one, param_sq)

    def scales(self, checked: bool) -> bool:
        """Whether the pass 2 of a pass 1 starting now scales its clipped sums (the module doc): a ``checked`` step, or
        any once the passes have differed (PassOne.run leaves out FSDP2-sharded parameters: FSDP reduce-scatters
        each sum as it is written)."""
        return CHECK_PASS_TWO and (checked or self.passes.controller.step_modes.pass_two_rescaled)

    def keep_for_fsdp(self, probes, captured, second_backward) -> None:
        """With FSDP2-sharded parameters: each call's sums are written as its G arrives. A call whose G comes from the
        backward's result (named: a call recorded so, or every captured call where no probe lies below them,
        PassOne._backward_to_outputs; or named in a second backward) would come after FSDP has reduce-scattered:
        such a step keeps pass 2 as a backward of sum_i c_i L_i (the step's sums were lost before 2026-11-27's
        test of an input that requires grad)."""
        if second_backward or (captured and not probes) or any(c.named for c in captured):
            self.forget()
        else:
            self.by_fsdp = True

    def forget(self) -> None:
        """Drops what pass 2 would have repeated (a step stopped between the passes: refused examples)."""
        if self.replay is not None:
            for call, _ in self.replay[1]:
                call.inputs = ()
        self.replay, self.by_fsdp = None, False

    def pending(self) -> bool:
        """Whether the last pass 1 is to be repeated by pass 2."""
        return self.replay is not None

    def summed_by_fsdp(self) -> bool:
        """Whether pass 2's clipped sums go into FSDP2's unsharded parameters, which FSDP reduce-scatters over the
        ranks (else the DP optimizer sums the ranks' itself)."""
        return self.by_fsdp  # (set only with a replay: keep_for_fsdp follows keep; forget and run clear both)

    # ----------------------------------------------------------------- the pass
    def run(self, losses, sums, kept) -> None:
        """Pass 2: ``sums`` (modes.ClippedSums) receives each ruled call's factors, and first ``kept``'s (parameter ->
        the fallback's factors, from pass 1's per-example gradients, which need no scaling; emptied). Where a backward
        that sets p.grad aside runs (reentrant regions), the sums are held and written once the pass is done."""
        passes = self.passes
        probes, captured_edges, second_backward, region_calls, expected, param_sq = self.replay
        passed = NormPass(losses.shape[0], reentrant=region_calls is not None)
        passed.sums_pass = state = SumsPass(sums, set(kept), region_calls, expected, param_sq)
        passed.synchronous = self.by_fsdp
        self.replay, self.by_fsdp = None, False
        captured = []
        for call, edges in captured_edges:
            call.edges = edges
            captured.append(call)
        passes.current = passed
        try:
            with passes.controller._region("ghostdp.clipped_sum"):
                sums.write(kept)
            with passes.controller._region("ghostdp.pass2"):
                if region_calls is not None:
                    with sums.collected(), passes._grads_set_aside(losses):
                        torch.autograd.backward(losses, torch.ones_like(losses))
                        self._finish()
                else:
                    if probes or captured:
                        passes._backward_to_outputs(losses, probes, captured, torch.ones_like(losses),
                                                    second_backward)
                    self._finish()
            if state.pairs:
                self._compare(state.pairs, scaled=param_sq is not None)
        finally:
            passes.current = None
            for call in captured:  # (controller._forget_captured_edges)
                call.edges, call.inputs = (), ()

    def receive(self, call, slot, grad) -> None:
        """An output grad of a recorded call in pass 2; a call without a rule has its sums already."""
        if call.in_region and not call.fired:  # recorded by pass 2's recomputation: its uses are consumed
            call.fired = True
            self.passes.recorder.forget(call)
        if call.rule is None:
            call.inputs = ()  # (a probe hands them over)
            return
        state = self.passes.current.sums_pass
        if id(call) not in state.calls:
            state.calls[id(call)] = call
            call.grads, call.done = [None] * len(call.shapes), False
        call.grads[slot] = grad
        if len(call.grads) == 1:
            self.write(call)

    def write(self, call) -> None:
        """The factors of one call, waiting with others for their clipped sums (_flush)."""
        passes = self.passes
        passed = passes.current
        state = passed.sums_pass
        if call.in_region:  # a factor waiting for its sum would hold the region's graph (_fire_in_reentrant_step)
            call.inputs = tuple(x.detach() for x in call.inputs)
        passes.layouts.batch_first(call, passed.batch_size)
        if state.expected is not None and call.grads[0] is not None:
            first = state.expected.pop(self.key(call), None)
            if first is not None:
                state.pairs.append((call.name, first, squares(call.grads[0])))
        factors = call.rule(call.module, call.inputs, call.grads[0], call.params.keys())
        for n, f in factors.items():
            param = call.params[n]
            if param in state.skipped:
                continue
            if state.first_sq is not None and call.eager is not None and call.eager.get(n):  # its only use
                state.scales[param] = _scale(state.first_sq, param, f.sq_norm())
            state.factors[param].append(f)
        state.elements += sum([g.numel() for g in call.grads if g is not None])
        state.elements += sum([x.numel() for x in call.inputs])
        call.grads, call.inputs, call.done = (), (), True
        if passed.synchronous or state.elements >= batched.waiting_elements():  # then summed in batches
            self._flush()

    def _finish(self) -> None:
        """The calls that wait for output grads that never came (several outputs), and the last sums."""
        for call in self.passes.current.sums_pass.calls.values():
            if not call.done:
                self.write(call)
        self._flush(final=True)

    def _flush(self, final: bool = False) -> None:
        """The clipped sums of the factors waiting, written in batches of equal shapes (modes.ClippedSums). Where
        the sums are scaled, a parameter with several uses waits for all of them (``final``: the pass is done), its
        norm being that of their sum (cross terms), and each parameter's weights are scaled by its own s_p."""
        state = self.passes.current.sums_pass
        if state.first_sq is not None:
            self._flush_scaled(state, final)
        elif state.factors:
            with self.passes.controller._region("ghostdp.clipped_sum"):
                state.sums.write(state.factors)
        state.elements = 0

    def _flush_scaled(self, state, final: bool) -> None:
        if final:
            for param, factors in state.factors.items():
                if param not in state.scales:
                    state.scales[param] = _scale(state.first_sq, param, combined_sq_norm(factors))
        ready = {p: factors for p, factors in state.factors.items() if p in state.scales}
        if not ready:
            return
        for param in ready:
            del state.factors[param]
        with self.passes.controller._region("ghostdp.clipped_sum"):
            state.sums.scaled({p: state.scales.pop(p) for p in ready}).write(ready)

    def _compare(self, pairs, scaled: bool) -> None:
        """The calls' output grads in the two passes (CHECK_PASS_TWO): where they differ, every later step's sums are
        scaled (warned once), or, where this step's could not be (FSDP2), the step is refused."""
        differs = _first_difference(pairs)
        if differs is None:
            return
        name, relative = differs
        if not scaled:
            raise RuntimeError(PASS_TWO_DIFFERS.format(name=name, relative=relative))
        modes = self.passes.controller.step_modes
        if not modes.pass_two_rescaled:
            modes.pass_two_rescaled = True
            warnings.warn(PASS_TWO_RESCALED.format(name=name, relative=relative), stacklevel=caller_stacklevel())

    def key(self, call):
        """What names a call in both passes: itself, or a reentrant region's call by its place in the order."""
        return ("region", self.passes.current.region_calls.index(call)) if call.in_region else id(call)

    def take_twin_layouts(self, call) -> None:
        """A region call that pass 2's recomputation of a reentrant checkpoint recorded (recording.py) takes the
        layouts of pass 1's call at its place in the order; refused where the two recomputations differ."""
        from .pass_one import DIFFERENT_REGION_CALLS
        passed = self.passes.current
        k = len(passed.region_calls) - 1
        twins = passed.sums_pass.twins
        if k >= len(twins) or twins[k].module is not call.module or list(twins[k].shapes) != list(call.shapes):
            raise RuntimeError(DIFFERENT_REGION_CALLS)
        call.layouts, call.eager = twins[k].layouts, twins[k].eager  # (eager: a scaled pass 2's single uses)


def _scale(first_sq: dict, param, sq) -> torch.Tensor:
    """s_p = min(1, n1_p / n2_p) per example (the module doc), float64: 1 where pass 2's norm is 0, 0 where either is
    not finite (such an example's c_i is 0 already)."""
    if param not in first_sq:
        raise RuntimeError("ghostdp internal error: pass 2 scales the clipped sum of a parameter whose norm pass 1 did "
                           "not keep; please report this with the model")
    first, second = first_sq[param].double(), sq.double()
    ratio = torch.where(second > 0, first / second, torch.ones_like(second)).clamp(max=1.0).sqrt()
    return torch.where(ratio.isfinite(), ratio, torch.zeros_like(ratio))


def _first_difference(pairs):
    """(name, relative difference) of the call whose output grads differed most between pass 1 and pass 2
    (CHECK_PASS_TWO), or None: ``pairs`` of (its name, pass 1's squares, pass 2's). One host sync, on checked steps
    only."""
    first = torch.stack([a.to(pairs[0][1].device) for _, a, _ in pairs])
    second = torch.stack([b.to(pairs[0][1].device) for _, _, b in pairs])
    # An example whose squares are not finite in pass 1 has a non-finite norm: refused or given c_i = 0 already.
    differs = (first != second) & first.isfinite()
    if not bool(differs.any()):
        return None
    tiny = torch.finfo(torch.float64).tiny
    relative = torch.where(differs, (second - first).abs() / first.abs().clamp(min=tiny), 0.0).amax(1)
    k = int(relative.argmax())
    return pairs[k][0], float(relative[k])
