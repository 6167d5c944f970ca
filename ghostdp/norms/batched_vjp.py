"""Vector-Jacobian products for a batch of cotangents at once (the exact fallback, a parametrization's chain)."""
from __future__ import annotations

import warnings

import torch


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
