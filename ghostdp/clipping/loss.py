"""The DP loss: per-example losses in, an ordinary scalar tensor out, both passes in its backward."""
from __future__ import annotations

import copy

import torch

from .. import collector
from .records import BackwardRecord


class ClippedLoss(torch.autograd.Function):
    """value = sum_i L_i / divisor (the mean or the sum of this chunk's losses, what a user reads from
    ``loss.item()``); backward ignores the value: it runs pass 1, then writes the clipped sums
    (GhostClipping.write_clipped_sums: pass 2 as a backward of its own, or book-keeping's sums). p.grad
    receives the clipped SUM either way; the DP optimizer divides by the expected batch size.

    ``graph_input`` is a zero-size anchor leaf, the only input the caller's backward sees: it never
    continues into the model's graph from here, so that anything that reaches the model in that backward
    (another loss added to this one) is refused where it meets a recorded call. ``mode``: this backward's
    clipping mode, chosen when the loss is built (``GhostClipping.mode_for_loss``).
    """

    @staticmethod
    def forward(ctx, graph_input, held_losses, controller, divisor, examples, mode):
        ctx.losses = held_losses[0]  # kept with its graph: pass 1 differentiates it again
        ctx.controller = controller
        ctx.examples = examples
        ctx.mode = mode
        ctx.consumed = False
        return ctx.losses.sum() / divisor

    @staticmethod
    @collector.paused()  # the pass's objects die by reference count as it ends (collector.py)
    def backward(ctx, grad_output):
        if ctx.consumed:
            raise RuntimeError(
                "this ghostdp loss was already backpropagated once; a second backward would add every "
                "example's clipped gradient twice and double its privacy cost. Compute a new loss instead.")
        ctx.consumed = True
        coeffs = ctx.controller.clip_coefficients(ctx.losses, ctx.mode, pass_two=True)
        ledger = ctx.controller.ledger
        ledger.loss_scale = grad_output.detach()
        if ledger.records is not None:  # tensors: no host sync mid-backward
            unclipped = None
            if ledger.count_unclipped:  # adaptive clipping: examples whose norm is <= C
                norms = ctx.controller.last_norms
                unclipped = (norms <= ctx.controller.max_grad_norm).sum() if ctx.examples else norms.new_zeros(())
            ledger.record(BackwardRecord(ctx.examples, grad_output.detach(), unclipped,
                                         ctx.controller.writes_sums_itself(ctx.mode),
                                         ctx.controller.max_grad_norm, ctx.mode.keeps_factors))
        ctx.controller.write_clipped_sums(coeffs, grad_output, ctx.losses, ctx.mode)
        return None, None, None, None, None, None


def clipped_loss(controller, per_example_losses, reduction="mean", expected_batch_size=None):
    if not isinstance(per_example_losses, torch.Tensor) or per_example_losses.dim() != 1:
        shape = tuple(per_example_losses.shape) if isinstance(per_example_losses, torch.Tensor) else None
        raise ValueError(
            f"ghostdp needs one loss per example, shape (batch,), got {shape}. A scalar means the loss was "
            "already reduced over the batch: use reduction='none'.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if expected_batch_size is not None and not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
    examples = per_example_losses.shape[0]
    controller.independence.recheck_where_guessed(examples)  # before the backward: it may rerun the forward
    if controller.ledger.take_padding():
        # A stand-in row that keeps DDP's collectives in step on a rank with fewer examples: its loss
        # times 0 has gradient exactly 0 and norm 0, so it adds nothing to the clipped sum.
        per_example_losses, examples = per_example_losses * 0.0, 0
    divisor = float(max(1, per_example_losses.shape[0])) if reduction == "mean" else 1.0
    mode = controller.mode_for_loss()
    return ClippedLoss.apply(controller.anchor(per_example_losses.device), (per_example_losses,), controller,
                             divisor, examples, mode)


def _token_weights(criterion, target):
    """Per-element weights of an index-target loss: 0 where ignore_index, class weight elsewhere."""
    valid = torch.ones_like(target, dtype=torch.bool)
    ignore = getattr(criterion, "ignore_index", None)
    if ignore is not None:
        valid = target != ignore
    weight = getattr(criterion, "weight", None)
    if weight is None:
        return valid.to(torch.get_default_dtype())
    return weight[target.clamp(0, weight.shape[0] - 1)] * valid


def per_example_loss(criterion: torch.nn.Module, output: torch.Tensor, target: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) losses: each example's loss is the mean over its own elements/tokens.

    For class-index losses (CrossEntropy, NLL) with several tokens per example, the
    mean runs over the example's tokens whose label is not ``ignore_index``
    (weighted by class weights as torch's "mean" does); an example with no such
    token has loss 0. With one label per example the loss is torch's own
    (class weight included). Outputs of shape
    (B, T, V) with labels (B, T) (Hugging Face's layout) and torch's (B, C, d1, ...)
    layout are both accepted.

    ``mask`` (the batch's attention mask, (B, T), or any 0/1 tensor matching the leading dims of the
    elementwise losses): only its nonzero positions count, in the mean too. Without it an elementwise
    loss (MSE on (B, T, d)) means over every position, the padding included: with batches padded to
    their longest example each example's loss then depends on the others' lengths.
    """
    if not hasattr(criterion, "reduction"):
        raise TypeError(
            f"criterion {type(criterion).__name__} has no 'reduction' attribute; ghostdp needs a torch loss "
            "that supports reduction='none', or compute per-example losses yourself and pass them to "
            "GhostClipping.loss().")
    if output.shape[0] != target.shape[0]:
        raise ValueError(f"the labels have batch size {target.shape[0]} but the model output has "
                         f"{output.shape[0]}; they must match (one label row per example).")
    B = output.shape[0]
    index_target = not target.is_floating_point() and isinstance(
        criterion, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))
    if target.is_floating_point() and output.dim() != target.dim():
        # Broadcasting aligns trailing dims: (B, 1) against (B,) gives (B, B), every example's loss
        # then averaging over all the others' labels, and one example moves every loss.
        raise ValueError(
            f"criterion {type(criterion).__name__} got an output of shape {tuple(output.shape)} and a target "
            f"of shape {tuple(target.shape)}; broadcasting them would mix examples (each per-example loss "
            "would read other examples' targets). Fix: give both the same shape, e.g. "
            "target.view_as(output) or output.squeeze(-1).")
    elementwise = copy.copy(criterion)
    elementwise.reduction = "none"
    if index_target and output.dim() >= 3 and output.shape[:-1] == target.shape:
        raw = elementwise(output.reshape(-1, output.shape[-1]), target.reshape(-1)).reshape(target.shape)
    else:
        raw = elementwise(output, target)
    if raw.dim() == 1 and raw.shape[0] == B:  # one element per example: its loss as torch computes it
        return raw
    if raw.dim() == 0 or raw.shape[0] != B:
        raise ValueError(f"criterion {type(criterion).__name__} with reduction='none' returned shape "
                         f"{tuple(raw.shape)}, which has no batch dimension of size {B}")
    kept = None if mask is None else _mask_of_elements(mask, raw).reshape(B, -1).to(raw.dtype)
    raw = raw.reshape(B, -1)
    if kept is not None:
        raw = raw * kept
    if criterion.reduction == "batchmean":  # KLDivLoss: the batch mean of per-example sums
        return raw.sum(1)
    if index_target or kept is not None:
        # torch's elementwise index losses carry the class weight already (and 0 at ignore_index): divide by the
        # weights of the counted tokens, as its "mean" does.
        w = _token_weights(criterion, target).reshape(B, -1).to(raw.dtype) if index_target else 1.0
        total = (w * kept if kept is not None else w).sum(1)
        return raw.sum(1) / total.clamp(min=torch.finfo(raw.dtype).tiny) * (total > 0)
    return raw.mean(1)


def _mask_of_elements(mask: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """``mask`` broadcast over the trailing dims of the elementwise losses ``raw`` (its leading dims must match)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() > raw.dim() or mask.shape != raw.shape[:mask.dim()]:
        raise ValueError(
            f"mask of shape {tuple(getattr(mask, 'shape', ()))} does not match the leading dims of the elementwise "
            f"losses, {tuple(raw.shape)}: give the batch's attention mask, (B, T), for outputs (B, T, ...), or a "
            "tensor of the losses' leading shape.")
    return (mask != 0).reshape(*mask.shape, *[1] * (raw.dim() - mask.dim())).expand_as(raw)


class DPCriterion(torch.nn.Module):
    """``criterion(output, target)`` -> the DP loss of ``GhostClipping.loss``.

    The wrapped criterion's reduction decides the value: "mean" (or "batchmean") is the mean of
    the per-example losses of the batch it is called on, "sum" their sum. Either way backward()
    leaves the clipped sum in p.grad. ``expected_batch_size`` is accepted for compatibility and
    changes nothing: the DP optimizer divides by the expected batch size.
    """

    def __init__(self, criterion: torch.nn.Module, controller, expected_batch_size=None):
        super().__init__()
        if not hasattr(criterion, "reduction"):
            per_example_loss(criterion, torch.zeros(1), torch.zeros(1))  # raises the explanatory TypeError
        if criterion.reduction not in ("mean", "sum", "batchmean"):
            raise ValueError(f"the criterion's reduction must be 'mean' or 'sum', got {criterion.reduction!r}")
        self.criterion = criterion
        self.controller = controller
        self.expected_batch_size = expected_batch_size

    def forward(self, output: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: the positions that count (per_example_loss), e.g. the batch's attention mask. Without one, a
        target laid out as the model's attention mask that counts padded positions is refused after the forwards
        that the forward check runs on (independence.py)."""
        if mask is None:
            self.controller.independence.refuse_counted_padding(self.criterion, target)
        losses = per_example_loss(self.criterion, output, target, mask)
        reduction = "sum" if self.criterion.reduction == "sum" else "mean"
        return self.controller.loss(losses, reduction, self.expected_batch_size)
