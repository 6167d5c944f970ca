"""LayerNorm, GroupNorm, RMSNorm: per-example gradients are (B, d), so instantiate them.

For y = w * xhat + b:  dL/dw_i = sum over positions of G * xhat,  dL/db_i = sum of G.
xhat is recomputed from the saved input in float32 or better.
"""
from __future__ import annotations

import torch

from .factors import Instantiated, acc_dtype
from .registry import register_norm_rule


def _affine_grads(xhat, G, trainable, reduce_dims, names=("weight", "bias")):
    out = {}
    if names[0] in trainable:
        out[names[0]] = Instantiated((G * xhat).sum(reduce_dims) if reduce_dims else G * xhat)
    if names[1] in trainable:
        out[names[1]] = Instantiated(G.sum(reduce_dims) if reduce_dims else G)
    return out


def _leading_dims(x, n_normalized):
    """Dims between the batch dim and the normalised trailing dims."""
    return tuple(range(1, x.dim() - n_normalized))


@register_norm_rule(torch.nn.LayerNorm)
def layer_norm_rule(module, inputs, output_grad, trainable):
    dt = acc_dtype(inputs[0], output_grad)
    x, G = inputs[0].to(dt), output_grad.to(dt)
    dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, keepdim=True, unbiased=False)
    xhat = (x - mean) * torch.rsqrt(var + module.eps)
    return _affine_grads(xhat, G, trainable, _leading_dims(x, len(dims)))


@register_norm_rule(torch.nn.RMSNorm)
def rms_norm_rule(module, inputs, output_grad, trainable):
    dt = acc_dtype(inputs[0], output_grad)
    x, G = inputs[0].to(dt), output_grad.to(dt)
    dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
    eps = module.eps if module.eps is not None else torch.finfo(inputs[0].dtype).eps
    xhat = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return _affine_grads(xhat, G, trainable, _leading_dims(x, len(dims)))


@register_norm_rule(torch.nn.GroupNorm)
def group_norm_rule(module, inputs, output_grad, trainable):
    dt = acc_dtype(inputs[0], output_grad)
    x, G = inputs[0].to(dt), output_grad.to(dt)
    B, C = x.shape[:2]
    grouped = x.reshape(B, module.num_groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    var = grouped.var(-1, keepdim=True, unbiased=False)
    xhat = ((grouped - mean) * torch.rsqrt(var + module.eps)).reshape(x.shape)
    spatial = tuple(range(2, x.dim()))
    return _affine_grads(xhat, G, trainable, spatial)
