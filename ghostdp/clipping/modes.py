"""How the clipped sum reaches p.grad once pass 1 has given the clip coefficients c_i.

- ``TwoPass`` ("ghost", the default): the DP loss's backward returns c_i for loss i and autograd
  continues (pass 2), so the ordinary backward forms sum_i c_i g_i. Memory: that of training.
- ``BookKeeping`` ("bookkeeping"): pass 1 keeps each layer's factors (activations A and output
  grads G) and the loss's backward writes sum_i c_i g_i = (c ⊙ G)^T A per layer into p.grad;
  autograd stops there (no second backward). Faster, but A and G of every layer stay alive
  until the coefficients are known.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ..norms.factors import EmbeddingGather, PerExampleGrad


class TwoPass:
    name = "ghost"
    keeps_factors = False
    continues_backward = True  # autograd's continuation from the losses is pass 2

    def grad_of_losses(self, kept, coefficients, grad_output, losses, group_of=None):
        return (coefficients * grad_output).to(losses.dtype)


class BookKeeping:
    name = "bookkeeping"
    keeps_factors = True
    continues_backward = False

    @torch.no_grad()
    def grad_of_losses(self, kept, coefficients, grad_output, losses, group_of=None):
        """``coefficients``: (B,), or (groups, B) with ``group_of`` mapping id(parameter) to its row."""
        all_weights = coefficients * grad_output.to(coefficients.dtype)
        in_dtype = {}  # the weights in each factor's accumulation dtype, converted once for all factors

        def weighted_sum(factor, group, **options):
            weights = all_weights if group is None else all_weights[group]
            if type(factor).sum_dtype is PerExampleGrad.sum_dtype:  # a factor that does not say: as given
                return factor.weighted_sum(weights, **options)
            dt = factor.sum_dtype()
            if (dt, group) not in in_dtype:
                in_dtype[(dt, group)] = weights.to(dt)
            return factor.weighted_sum(in_dtype[(dt, group)], **options)

        for param, factors in kept.items():
            group = None if group_of is None else group_of[id(param)]
            if len(factors) == 1 and isinstance(factors[0], EmbeddingGather):
                clipped = weighted_sum(factors[0], group, out_dtype=param.dtype)  # no wide copy of a 16-bit table
            else:
                clipped = weighted_sum(factors[0], group)
                for factor in factors[1:]:  # further uses of the same parameter (tied weights)
                    clipped = clipped + weighted_sum(factor, group)
            clipped = clipped.to(param.dtype)
            if param.grad is None:
                param.grad = clipped
            else:
                param.grad.add_(clipped)
        return None  # nothing flows further back: p.grad already holds the clipped sum


CLIPPING_MODES = {mode.name: mode for mode in (TwoPass(), BookKeeping())}


def clipping_mode(name: str):
    if name not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {tuple(CLIPPING_MODES)}, got {name!r}")
    return CLIPPING_MODES[name]


def new_factor_store():
    return defaultdict(list)  # parameter -> the factors of its uses in this pass
