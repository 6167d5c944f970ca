"""The probe: an identity on each hooked layer's output that hands its output grad to the controller.

Pass 1 differentiates the loss towards one zero-size leaf (the probe) that enters
every hooked output through ``ProbeIdentity``. Autograd therefore computes
exactly the activation gradients on the way to those outputs, and no weight
gradient (no weight is an input of that ``autograd.grad`` call).

The identity marks its input dirty instead of returning a view or a copy, so a
later in-place op (``ReLU(inplace=True)``) stays legal and memory is unchanged.
Where the output was saved by its own producer (tanh, sigmoid) or is a view or
a leaf, bumping its version would break the backward, so a copy is returned.
"""
from __future__ import annotations

import torch


def can_mark_dirty(t: torch.Tensor) -> bool:
    return (t.grad_fn is not None and not t._is_view()
            and not hasattr(t.grad_fn, "_saved_result"))


class ProbeIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, probe, use, slot, in_place):
        ctx.use, ctx.slot = use, slot
        ctx.probe_meta = (probe.device, probe.dtype)
        # No zeros for a missing gradient: after book-keeping's pass 1 nothing flows further back,
        # and zeros would run a whole useless backward.
        ctx.set_materialize_grads(False)
        if in_place:
            ctx.mark_dirty(out)
            return out
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        use = ctx.use
        if use.controller._receives_output_grads():
            use.controller._receive(use, ctx.slot, grad)
            device, dtype = ctx.probe_meta
            return grad, torch.zeros(0, device=device, dtype=dtype), None, None, None
        if grad.numel():  # a gradient with no rows (an empty batch) carries no example
            use.controller._check_pass_two(use)
        return grad, None, None, None, None


def add_probe(out: torch.Tensor, probe: torch.Tensor, use, slot: int) -> torch.Tensor:
    return ProbeIdentity.apply(out, probe, use, slot, can_mark_dirty(out))
