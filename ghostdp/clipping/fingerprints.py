"""Per-example fingerprints of a forward's outputs, and how far they moved between two runs (independence.py).

Each output with the batch on dim 0 is projected, example by example, on a random +-1 vector and summed in
float64 (the products are exact in any dtype): a (batch,) fingerprint. A move between two runs counts where it
exceeds what rounding allows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# A move of the other examples' fingerprints counts when it exceeds NOISE_MARGIN times what the forward and
# its first rerun differ by, plus a floor relative to the fingerprints' size (relative_floor): the batch may
# decide a kernel for all examples (transformers drops an attention mask that is all ones, and a replaced
# example may make it so), and another kernel rounds differently, by some units in the last place, which
# grow through the layers. The floor costs sensitivity: a batch mean moves the others by about 1/B of the
# examples' difference. Measured (x - x.detach().mean(0) before a Linear, d = 64, Gaussian examples): seen
# in float32 up to B = 4096 (not 16384), in bfloat16 up to B = 8 (not 16; with 4 ulp: 32, not 64). Not measured
# on a GPU: a refusal names the move and the threshold, and how to switch the check off.
NOISE_MARGIN = 4.0


def relative_floor(dtype) -> float:
    """2^-14, or 8 units in the last place of a lower precision (float16, bfloat16: rounding differences grow
    through many layers, and a false refusal stops training)."""
    return max(2.0 ** -14, 8 * torch.finfo(dtype).eps)


def per_example_output(t, batch: int) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 and t.shape[0] == batch


def fingerprints_of(leaves, signs, batch: int) -> list:
    """Per output tensor with the batch on dim 0: each example's values projected on the +-1 ``signs``,
    summed in float64 (the products are exact in any dtype), (batch,); None for the others."""
    out = []
    for (_, t), s in zip(leaves, signs):
        if s is None or not per_example_output(t, batch) or t.shape[1:] != s.shape or t.dtype != s.dtype:
            out.append(None)
            continue
        # In eighths of the batch: the products' copy stays small beside a language model's logits.
        rows = t.detach().split(max(1, batch // 8))
        out.append(torch.cat([(part * s).reshape(len(part), -1).sum(1, dtype=torch.float64) for part in rows]))
    return out


class Move(NamedTuple):
    """One output's comparison: how far the examples compared moved and what was allowed, both relative to its
    largest fingerprint, and whether the move exceeds the allowance."""
    output: int          # the index of the output tensor (pytree leaf)
    relative: float
    threshold: float
    exceeds: bool


def moves_between(forward, same, moved, compared: slice, floors, again=None) -> list:
    """A Move per output with fingerprints: the move of the examples ``compared`` against NOISE_MARGIN times the
    reruns' own spread (the forward's, and ``again``'s where given) plus its ``floors`` (relative)."""
    out = []
    for k, (f, s, m, floor) in enumerate(zip(forward, same, moved, floors)):
        if f is None or s is None or m is None:
            continue
        noise = float((f - s).abs().max())
        if again is not None and again[k] is not None:
            noise = max(noise, float((again[k] - s).abs().max()))
        scale = float(s.abs().max())
        move = float((m[compared] - s[compared]).abs().max())
        threshold = NOISE_MARGIN * noise + floor * scale
        out.append(Move(k, move / scale if scale > 0 else float("inf") if move > 0 else 0.0,
                        threshold / scale if scale > 0 else float("inf"), move > threshold))
    return out


def largest_exceeding(moves):
    """The Move that exceeds its allowance by the largest relative move, or None."""
    return max((m for m in moves if m.exceeds), key=lambda m: m.relative, default=None)
