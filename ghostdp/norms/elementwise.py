"""Elementwise scales: y = x * s, s a parameter that broadcasts over the batch (a LayerScale: s of shape (d,)).

Example i's gradient is g_i = sum over the broadcast positions of G_i * x_i (the shape of s), formed as the
LayerNorm's weight is (normalization._affine_grads, with x for xhat): (B, *s.shape) instantiated, the sums and
masses accumulated in float32 or better, 16-bit inputs read in their own dtype.
"""
from __future__ import annotations

import torch

from .factors import Instantiated
from .normalization import _affine_grads, _working
from .registry import register_forward_rule


def scale_grads(x: torch.Tensor, G: torch.Tensor, scale: torch.Tensor) -> Instantiated:
    """g_i = sum_to_size(G_i * x_i, scale.shape) for x and G of shape (B, ...), with its token mass."""
    if scale.dim() >= x.dim():
        raise ValueError(
            f"an elementwise scale of shape {tuple(scale.shape)} on an input of shape {tuple(x.shape)} spans the "
            "batch dim: its gradient cannot be split by example. Fix: freeze it (requires_grad_(False)).")
    aligned = (1,) * (x.dim() - 1 - scale.dim()) + tuple(scale.shape)  # scale's shape beside x's dims 1...
    reduce_dims = tuple(d + 1 for d, size in enumerate(aligned) if size == 1 and x.shape[d + 1] != 1)
    x, G = _working(x, G)
    g = _affine_grads(x, G, ("scale",), reduce_dims, names=("scale", None))["scale"]
    return Instantiated(g.grads.reshape(x.shape[0], *scale.shape), g.mass)


def layer_scale_rule(module, inputs, output_grad, trainable):
    return {"lambda1": scale_grads(inputs[0], output_grad, module.lambda1)} if "lambda1" in trainable else {}


# transformers' LayerScale (DINOv2, DINOv3, SAM 3, EoMT, ...): the forward, registered by its code (registry.py).
LAYER_SCALE_BODY = "return hidden_state * self.lambda1"
register_forward_rule(LAYER_SCALE_BODY, layer_scale_rule, params=("lambda1",), tokenwise=True)
