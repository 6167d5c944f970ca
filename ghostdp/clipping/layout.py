"""Which dimension of a layer's output holds the examples: proven from gradients, never guessed from sizes.

A norm rule needs example i's rows of a layer's output grad G. Sizes alone cannot say where they
are: a sequence-first (T, B, d) output with T == B looks batch-first, and a (B*T, d) output (OPT's
decoder flattens its tokens) has no dim of size B at all. So the layout is proven.

Proof. Backpropagate the per-example losses once with cotangent v (a random (B,) vector) instead
of ones. Backward is linear in its cotangent, so G_v = sum_j v_j G^(j), where G^(j) is loss j's
output grad. If a candidate layout is right, each row r holds one example e(r)'s gradient only, so
G_v[r] = v_e(r) G_1[r]. If a row also holds another example's gradient, the two sides differ for
almost every v: the difference sum_{j != e(r)} (v_j - v_e(r)) G^(j)[r] is a non-zero linear function
of v. Both sides are compared after projecting the feature dim onto a random vector w (a (…,)
tensor per output instead of G). The proof runs when a layer's shape signature (which dims equal
B) is new, and its result is kept for that signature.
"""
from __future__ import annotations

import torch

# |G_v - v ⊙ G_1| <= tolerance * scale: the two backward passes round differently.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # float64 models may compute parts in float32 (Llama RMSNorm)
TOLERANCE_16_BIT = 5e-2

BATCH_FIRST = ("dim", 0)


def signature(shapes, batch_size: int) -> tuple:
    """Which dims of each output equal the batch size, and whether the first is a multiple of it."""
    return tuple((tuple(n == batch_size for n in s), len(s) > 0 and s[0] > batch_size and s[0] % batch_size == 0)
                 for s in shapes)


def candidates(shape, batch_size: int, tokenwise: bool, declared_dim: int):
    """Layouts to try, most usual first. ``tokenwise`` layers (Linear, Embedding, LayerNorm) act on each
    leading position alone, so any leading dim or a flattened batch may hold the examples; other layers
    only their declared batch dim."""
    if not tokenwise:
        return [("dim", declared_dim)] if len(shape) > declared_dim and shape[declared_dim] == batch_size else []
    out = [("dim", d) for d in range(len(shape) - 1) if shape[d] == batch_size]
    if len(shape) > 1 and shape[0] > batch_size and shape[0] % batch_size == 0:
        out.insert(1 if out[:1] == [BATCH_FIRST] else 0, ("rows",))
    return out


def projection_vector(n: int, dtype, device, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def project(grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """G's feature dim (the last) projected onto w, in w's dtype: a tensor of shape G.shape[:-1]."""
    if grad.dim() == 0:
        return grad.reshape(1).to(w.dtype) * w[:1]
    return torch.matmul(grad.to(w.dtype), w)


def per_row(v: torch.Tensor, layout, shape) -> torch.Tensor:
    """v laid out as the examples are in a tensor of ``shape`` (a projected output), for broadcasting."""
    if layout[0] == "rows":
        return v.repeat_interleave(shape[0] // v.shape[0]).reshape((shape[0],) + (1,) * (len(shape) - 1))
    d = layout[1]
    return v.reshape((1,) * d + (v.shape[0],) + (1,) * (len(shape) - d - 1))


def holds(layout, projected_v: torch.Tensor, projected_1: torch.Tensor, v: torch.Tensor, dtype) -> bool:
    expected = per_row(v, layout, projected_1.shape) * projected_1
    finite = torch.isfinite(expected) & torch.isfinite(projected_v)  # NaN/inf examples are refused later
    expected, projected_v = expected[finite], projected_v[finite]
    scale = float(torch.maximum(expected.abs().max(), projected_v.abs().max())) if expected.numel() else 0.0
    if scale == 0.0:
        return True
    tolerance = TOLERANCE.get(dtype, TOLERANCE_16_BIT)
    return float((projected_v - expected).abs().max()) <= tolerance * scale


def to_batch_first(layout, tensor: torch.Tensor, output_shape, batch_size: int) -> torch.Tensor:
    """A tensor laid out like the output (an input of a tokenwise layer, or its output grad), made (B, ...)."""
    if layout == BATCH_FIRST:
        return tensor
    if layout[0] == "rows":
        if tensor.dim() == 0 or tensor.shape[0] != output_shape[0]:
            return tensor
        return tensor.reshape(batch_size, tensor.shape[0] // batch_size, *tensor.shape[1:])
    d = layout[1]
    if tensor.dim() <= d or tuple(tensor.shape[:d + 1]) != tuple(output_shape[:d + 1]):
        return tensor
    return tensor.movedim(d, 0)
