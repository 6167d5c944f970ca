"""Conv1d / Conv2d / Conv3d: unfold the input into patches, then the Linear rule per group.

The output at location l is W_g @ patch_l (per group g), so the per-example weight
gradient of group g is G_g^T U_g with G_g (L, C_out/g) and U_g (L, C_in/g * prod(k)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .factors import Blocks, Instantiated, OuterProduct, acc_dtype, summed_positions_mass
from .registry import register_norm_rule


def _padding_amounts(module, nd):
    """Per spatial dim (left, right) zero/other padding, including padding='same'."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return [(0, 0)] * nd
        amounts = []
        for k, d in zip(module.kernel_size, module.dilation):
            total = d * (k - 1)
            amounts.append((total // 2, total - total // 2))
        return amounts
    return [(p, p) for p in module.padding]


def unfold_patches(module, x):
    """(B, C, *S) -> (B, L, C * prod(kernel)) patches, channel-major like the weight layout."""
    nd = x.dim() - 2
    pads = _padding_amounts(module, nd)
    flat_pad = [a for pair in reversed(pads) for a in pair]  # F.pad wants the last dim first
    if any(flat_pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, flat_pad, mode=mode)
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]  # windows appended as a last dim
    B, C = x.shape[:2]
    L_shape = x.shape[2:2 + nd]
    # x: (B, C, L1..Lnd, k1..knd) -> (B, L, C, k1..knd)
    perm = [0] + list(range(2, 2 + nd)) + [1] + list(range(2 + nd, 2 + 2 * nd))
    x = x.permute(perm)
    L = 1
    for n in L_shape:
        L *= n
    return x.reshape(B, L, -1)


def conv_rule(module, inputs, output_grad, trainable):
    out = {}
    B, C_out = output_grad.shape[:2]
    G = output_grad.reshape(B, C_out, -1)  # (B, C_out, L)
    if "weight" in trainable:
        U = unfold_patches(module, inputs[0])  # (B, L, C_in * k)
        Gt = G.transpose(1, 2)  # (B, L, C_out)
        g = module.groups
        if g == 1:
            out["weight"] = OuterProduct(Gt, U, module.weight.shape)
        else:
            co, ci = C_out // g, U.shape[-1] // g
            blocks = [OuterProduct(Gt[..., j * co:(j + 1) * co], U[..., j * ci:(j + 1) * ci],
                                   (co, ci)) for j in range(g)]
            out["weight"] = Blocks(blocks, module.weight.shape, dim=1)
    if "bias" in trainable:
        out["bias"] = Instantiated(G.sum(2), mass=summed_positions_mass(G.transpose(1, 2), G.shape[2], acc_dtype(G)))
    return out


for _cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
    register_norm_rule(_cls, conv_rule)
