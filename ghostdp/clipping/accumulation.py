"""Gradient that reaches p.grad outside ghostdp's passes is refused.

ghostdp writes the clipped sum into p.grad itself: pass 2 is a backward of its own inside the DP loss's
backward (controller.write_clipped_sums), and book-keeping assigns its sums. The DP loss's backward never
continues into the model in the caller's backward (loss.py), so nothing legitimate accumulates into a
parameter there. A term added to the DP loss that reads a parameter outside the module calls ghostdp records
does: ``(dp_loss + 1e-3 * (x @ model.fc.weight.T).sum()).backward()`` put that term's gradient, which depends
on the data and no clipping bounds, into p.grad, and neither the probes and captured calls (it reaches no
recorded call) nor the step's graph audit (it walks the DP loss's graph) saw it; the DP optimizer's sum bound
only sees a term large enough to take the clipped sum past (examples x C) (before 2026-11-26, both modes took
the step).

``AccumulationWatch`` puts a post-accumulate-grad hook on every trainable parameter of the model (at attaching,
and at each step's audit for a parameter unfrozen since), which refuses an accumulation outside pass 2, outside
pass 1's backwards (reentrant checkpoints, whose accumulations pass 1 drops as they come: reentrant.stashed_grads)
and outside a fallback's own backward. The refusal is raised in the backward and kept for the DP optimizer, which
refuses to step until zero_grad() has cleared p.grad.
"""
from __future__ import annotations

UNCLIPPED_ACCUMULATION = (
    "a gradient reached the parameter '{name}' through a backward that did not come from ghostdp's passes: "
    "autograd accumulated it into p.grad unclipped, so one example could move the update by more than the "
    "clipping norm. It comes from a term that reads the parameter outside the model's recorded layer calls (a "
    "loss added to the DP loss that uses model.<layer>.weight directly, e.g. tied weights applied by hand), or "
    "from a backward of another loss while the model is private. Fix: compute every term that depends on the "
    "data from the model's outputs and fold it into the per-example losses (GhostClipping.loss / the DP "
    "criterion); a term that depends on the parameters alone (weight decay) belongs in the optimizer; use "
    "torch.autograd.grad for gradients that must not reach p.grad, or detach() the controller for non-private "
    "training. Clear p.grad (optimizer.zero_grad()) before the next step.")


class AccumulationWatch:
    """The post-accumulate-grad hooks of one controller's pass 1 (``pass_one``) on ``params``."""

    def __init__(self, pass_one, names: dict):
        self.pass_one = pass_one
        self.names = names   # id(parameter) -> its name in the model, for the error
        self.hook_ids = {}   # id(parameter) -> the id of this watch's hook on it
        self._refusal = None
        self.refusal_listener = None  # the DP optimizer's (the last one built), called when a refusal is first recorded

    @property
    def refusal(self) -> str | None:
        """The message of the last refusal, until ``clear`` (the DP optimizer's zero_grad, which drops p.grad)."""
        return self._refusal

    def clear(self) -> None:
        self._refusal = None

    def watch(self, params) -> list:
        """Hooks each of ``params`` that requires grad and is not hooked yet (a parameter unfrozen or swapped in
        after attaching is hooked at the next step's audit); the new handles."""
        handles = []
        for p in params:
            if p.requires_grad and id(p) not in self.hook_ids and p.is_leaf:
                handle = p.register_post_accumulate_grad_hook(self._accumulated)
                self.hook_ids[id(p)] = handle.id
                handles.append(handle)
        return handles

    def others_hooks(self, param) -> bool:
        """Whether ``param`` has post-accumulate-grad hooks besides this watch's (the user's own)."""
        hooks = param._post_accumulate_grad_hooks  # None, or handle id -> hook; read every step for every parameter
        return bool(hooks) and (len(hooks) > 1 or self.hook_ids.get(id(param)) not in hooks)

    def _accumulated(self, param) -> None:
        passes = self.pass_one
        if passes.in_pass_two or passes.current is not None or passes.in_fallback:
            return
        if self._refusal is None and self.refusal_listener is not None:
            self.refusal_listener()
        self._refusal = UNCLIPPED_ACCUMULATION.format(name=self.names.get(id(param), tuple(param.shape)))
        raise RuntimeError(self._refusal)
