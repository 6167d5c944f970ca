"""Float precision of the clipped sum: examples that could round the others away, and exact sums.

The clipped sum adds all examples' terms (a Linear layer's G_t A_t^T over every token of the
batch) in one float accumulation, whose rounding error grows with the terms' magnitude, not with
their sum. An example whose terms are huge but cancel (tokens x and -x scaled by 1e12: gradient
0, so not clipped) can round the other examples' gradients away. Its mass m_i, a bound of the sum
over layers and tokens of |G_t| |A_t| (``PerExampleGrad.token_mass``), bounds what it puts into
those sums: an example with u * c_i * m_i > ROUNDING_TOLERANCE * C (u: unit round-off of the
accumulation's dtype) is refused, or skipped with nonfinite="skip".

Where the fallback instantiated per-example gradients g_i in pass 1, the two-pass mode does not
let pass 2 form their clipped sum in one accumulation over all examples' terms: ``exact_sums``
replaces pass 2's gradient of those parameters by sum_i c_i g_i of the finished g_i.
"""
from __future__ import annotations

import contextlib
import functools

import torch

ROUNDING_TOLERANCE = 1e-4


class ImpreciseExampleError(FloatingPointError):
    """Some examples' gradients cannot be summed with the others within float precision."""

    def __init__(self, indices):
        self.indices = indices
        super().__init__(
            f"examples {indices} of this batch have gradient terms so large (e.g. token contributions "
            "that cancel, such as x and -x scaled by 1e12) that float rounding in the batch's sums could "
            "erase other examples' gradients and move the update by more than the clipping norm allows. "
            "Fix the data (normalise or bound the inputs), or pass nonfinite='skip' to drop such "
            "examples from the step.")


def imprecise_examples(coefficients: torch.Tensor, mass, mass_dtype, max_grad_norm: float):
    """(B,) bool: u * c_i * m_i > ROUNDING_TOLERANCE * C; None where no layer gave a mass."""
    if mass is None:
        return None
    unit_roundoff = torch.finfo(mass_dtype).eps / 2
    return unit_roundoff * coefficients * mass.to(coefficients.device) > ROUNDING_TOLERANCE * max_grad_norm


@contextlib.contextmanager
def exact_sums(kept: dict, weights: torch.Tensor):
    """Two-pass mode, around pass 2: the gradient pass 2 forms for each parameter of ``kept`` (parameter ->
    its factors this step) replaced by sum_i w_i g_i of those factors (``weights``: c_i times the loss's
    incoming gradient), through gradient hooks that live only inside the block (a gradient hook of a
    parameter outside it is refused: GhostClipping._refuse_gradient_hooks)."""
    replacements = {p: sum(f.weighted_sum(weights) for f in factors) for p, factors in kept.items()}
    hooks = [p.register_hook(functools.partial(_replace, replacements, p)) for p in kept]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _replace(replacements, param, grad):
    replacement = replacements.pop(param, None)
    return grad if replacement is None else replacement.to(grad.dtype).reshape(grad.shape)
