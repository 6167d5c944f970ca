"""Vector-Jacobian products for a batch of cotangents at once (the exact fallback, a parametrization's chain)."""
from __future__ import annotations

import warnings

import torch

from .factors import ELEMENT_BUDGET, Instantiated


def batched_vjp(outputs, inputs, cotangents) -> list:
    """(k, *input.shape) for each of ``inputs``: the VJPs of ``outputs`` with the k cotangents each of ``cotangents``
    holds on its dim 0, through one batched backward (``is_grads_batched``, torch.func's vmap over the backward), the
    graph kept; one backward per cotangent where a backward formula has no batching rule; zeros for an input that
    ``outputs`` do not reach."""
    k = cotangents[0].shape[0]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            grads = torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
    except RuntimeError:  # some backward formulas have no batching rule
        rows = [torch.autograd.grad(outputs, inputs, [c[j] for c in cotangents], retain_graph=True, allow_unused=True)
                for j in range(k)]
        grads = [None if row[0] is None else torch.stack(list(row)) for row in zip(*rows)]
    return [g if g is not None else p.new_zeros((k,) + p.shape) for g, p in zip(grads, inputs)]


def grads_through(weight: torch.Tensor, params: list, factor) -> list:
    """Instantiated (B, *param.shape) for each of ``params``: each example's gradient of each parameter from the
    factor of a tensor ``weight`` computed from them alone (no data: a parametrization, an adapter's weight), as J^T
    of that example's gradient of ``weight``, by batched VJPs of ``weight``'s graph (``pulled_back``)."""
    return pulled_back(factor, weight.numel(),
                       lambda grads: batched_vjp([weight], params, [grads.to(weight.dtype)]))


def pulled_back(factor, numel: int, pullback) -> list:
    """Instantiated (B, ...) for each tensor that ``pullback`` forms from a chunk of examples' gradients of a tensor of
    ``numel`` elements (``factor`` materialised, (k, ...)), over chunks that materialise at most ELEMENT_BUDGET
    elements each."""
    B = factor.batch_size
    step = max(1, ELEMENT_BUDGET // max(1, numel))
    chunks = [pullback(factor.materialize(lo, min(B, lo + step))) for lo in range(0, B, step)]
    return [Instantiated(torch.cat([chunk[k] for chunk in chunks])) for k in range(len(chunks[0]))]
