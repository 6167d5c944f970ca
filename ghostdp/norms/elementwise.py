"""Elementwise scales: y = x * s, s a parameter that broadcasts over the batch (a LayerScale: s of shape (d,)).

Example i's gradient is g_i = sum over the broadcast positions of G_i * x_i (the shape of s), formed as the
LayerNorm's weight is: (B, *s.shape) instantiated, the sums and masses accumulated in float32 or better.
"""
from __future__ import annotations

import torch

from .factors import Instantiated, acc_dtype, summed_positions_mass
from .normalization import SIXTEEN_BIT
from .registry import register_forward_rule


def scale_grads(x: torch.Tensor, G: torch.Tensor, scale: torch.Tensor) -> Instantiated:
    """g_i = sum_to_size(G_i * x_i, scale.shape) for x and G of shape (B, ...), with its token mass."""
    if scale.dim() >= x.dim():
        raise ValueError(
            f"an elementwise scale of shape {tuple(scale.shape)} on an input of shape {tuple(x.shape)} spans the "
            "batch dim: its gradient cannot be split by example. Fix: freeze it (requires_grad_(False)).")
    aligned = (1,) * (x.dim() - 1 - scale.dim()) + tuple(scale.shape)  # scale's shape beside x's dims 1...
    reduce_dims = tuple(d + 1 for d, size in enumerate(aligned) if size == 1 and x.shape[d + 1] != 1)
    positions = 1
    for d in reduce_dims:
        positions *= x.shape[d]
    dt = acc_dtype(x, G)
    if not (x.dtype in SIXTEEN_BIT or G.dtype in SIXTEEN_BIT):  # 16-bit: the product in 16 bits, sums in float32
        x, G = x.to(dt), G.to(dt)
    terms = G * x
    grads = terms.sum(reduce_dims, dtype=dt) if reduce_dims else terms.to(dt)
    return Instantiated(grads.reshape(x.shape[0], *scale.shape),
                        summed_positions_mass(terms, positions, dt) if reduce_dims else None)


def layer_scale_rule(module, inputs, output_grad, trainable):
    return {"lambda1": scale_grads(inputs[0], output_grad, module.lambda1)} if "lambda1" in trainable else {}


# transformers' LayerScale (DINOv2, DINOv3, SAM 3, EoMT, ...): the forward, registered by its code (registry.py).
LAYER_SCALE_BODY = "return hidden_state * self.lambda1"
register_forward_rule(LAYER_SCALE_BODY, layer_scale_rule, params=("lambda1",), tokenwise=True)
