"""Book-keeping's clipped sums sum_i c_i g_i of many layers in a few ops (see batched.py for the norms).

Factors of one kind, shape and weights are summed together: the weights (OuterProduct) of one shape
by one batched matmul (c ⊙ L)^T R, explicit per-example gradients (Instantiated, SummedTokens,
LayerNorm's AffineGrad) of one shape by one matmul, in stacks of at most batched.STACK_ELEMENTS.
"""
from __future__ import annotations

import torch

from .batched import device_of, stack_budget, within_budget
from .factors import Instantiated, OuterProduct, SummedTokens, acc_dtype, weighted_outer_sum
from .normalization import AffineGrad, stacked_grads


def weighted_sums(uses, weights_of, alone, written_in=None):
    """(position, sum_i w_i g_i) for every entry of ``uses``, a list of (factor, key of its weights), one
    batch at a time, so that the caller can write each sum and drop it before the next is formed (formed all
    at once, a BERT-base's float32 sums took 1.3x a bf16 model's gradients on top of the kept factors).
    ``weights_of(key, dtype)`` gives the (B,) weights w in a dtype. Weights (OuterProduct) of one shape are
    summed by one batched matmul, explicit per-example gradients (Instantiated, SummedTokens) of one shape
    by one; ``alone(factor, key)`` sums any other factor. ``written_in``: for each position, the dtype its
    sum is written in as it is (a parameter's only use), or None; a batch whose sums all go to one narrower
    dtype is rounded to it in one op (each element as a per-parameter conversion would round it), instead
    of one op per parameter (on a GPU in bf16: some 120 kernels a BERT-base step)."""
    batches = {}
    for position in range(len(uses)):  # no name here keeps a factor alive while the sums are written
        batch = _batch_of(*uses[position])
        if batch is None:
            yield position, alone(*uses[position])
        else:
            batches.setdefault(batch, []).append(position)
    for (kind, key, *_), same in batches.items():
        budget = stack_budget(device_of(uses[same[0]][0]))
        for positions in within_budget(same, [_stacked_elements(uses[i][0]) for i in same], budget):
            out_dtype = _common_dtype(written_in, positions)
            yield from _summed_batch(kind, key, [uses[i][0] for i in positions], positions, weights_of, out_dtype)


def _common_dtype(written_in, positions):
    """The dtype all ``positions`` are written in, or None (none given, or not all the same)."""
    if written_in is None:
        return None
    first = written_in[positions[0]]
    return first if all(written_in[i] == first for i in positions) else None


def _batch_of(factor, key):
    """What factors must share to be summed in one batch; None for a factor summed alone."""
    kind = type(factor)
    if kind is OuterProduct:
        return (kind, key, factor.left.shape, factor.right.shape, factor.left.dtype, factor.right.dtype,
                factor.left.device)
    if kind is AffineGrad:  # its call's batch key sets its gradients' shape and dtype: nothing is formed here
        return (kind, key, factor.name, factor.call.batch_key)
    if kind is Instantiated or kind is SummedTokens:
        tensor = factor.tokens if kind is SummedTokens else factor.grads
        return (kind, key, tensor.shape, tensor.dtype, tensor.device)
    return None


def _stacked_elements(factor) -> int:
    if type(factor) is OuterProduct:
        return factor.left.numel() + factor.right.numel()
    if type(factor) is SummedTokens:  # at most its (B, n) sum over tokens is stacked (_instantiated_sums)
        return factor.tokens.shape[0] * factor.tokens.shape[-1]
    return factor.batch_size * factor.param_shape.numel()


def _summed_batch(kind, key, factors, positions, weights_of, out_dtype=None):
    if kind is OuterProduct:
        sums = _outer_product_sums(factors, weights_of(key, factors[0].sum_dtype()), out_dtype)
    else:
        sums = _instantiated_sums(factors, kind is SummedTokens, lambda dt: weights_of(key, dt), out_dtype)
    return zip(positions, sums)


def _outer_product_sums(factors, w, out_dtype=None):
    """sum_i w_i L_i^T R_i of k weights of one shape: one (k, m, n) batched matmul (factors.weighted_outer_sum)."""
    if len(factors) == 1:
        return [factors[0].weighted_sum(w)]  # its writer rounds it as it would this one's rows
    pairs = [f.operands() for f in factors]
    left = torch.stack([p[0] for p in pairs])    # (k, B, T, m)
    right = torch.stack([p[1] for p in pairs])   # (k, B, T, n)
    return _shaped(weighted_outer_sum(left, right, w, w.dtype), factors, out_dtype)


def _shaped(total, factors, out_dtype=None):
    """The k rows of a (k, ...) result, each viewed as its factor's parameter (no view where it already is),
    rounded to ``out_dtype`` where given, all rows in one op."""
    if out_dtype is not None and total.dtype != out_dtype:
        total = total.to(out_dtype)
    return [t if t.shape == f.param_shape else t.view(f.param_shape) for t, f in zip(total.unbind(0), factors)]


def _instantiated_sums(factors, summed_tokens: bool, weights_in, out_dtype=None):
    """sum_i w_i g_i of k explicit gradients of one shape, (k, B, n) stacked: one matmul. For SummedTokens
    each example's gradient is first summed over its tokens."""
    if summed_tokens:
        tokens = [f.tokens for f in factors]
        dt = acc_dtype(tokens[0])
        if sum(t.numel() for t in tokens) <= stack_budget(tokens[0].device):  # small: one stack, one sum
            rows = torch.stack(tokens).sum(2, dtype=dt)
        else:  # each output grad summed over its tokens where it lies, no stacked copy of the G
            rows = [t.sum(1, dtype=dt) for t in tokens]
            rows = rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)
    else:
        rows = stacked_grads(factors) if type(factors[0]) is AffineGrad else None
        if rows is None:
            rows = torch.stack([f.grads for f in factors])
        dt = acc_dtype(rows)
        rows = rows.to(dt)
    total = torch.matmul(weights_in(dt), rows.reshape(len(factors), rows.shape[1], -1))  # (k, n)
    return _shaped(total, factors, out_dtype)
