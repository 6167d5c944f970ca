"""ConvTranspose1d / ConvTranspose2d / ConvTranspose3d.

A transposed convolution y = conv_transpose(x, W) is the adjoint in its input of the convolution with the same
weight, stride, padding, dilation and groups: <conv_transpose(x, W), G> = <x, conv(G, W)> for every W. So its
per-example weight gradient d<y_i, G_i>/dW is that convolution's weight gradient with G_i as its input and x_i as
its output grad, and the weight layouts agree: conv maps G's C_out channels to x's C_in with a weight
(C_in, C_out/groups, *k), the transposed convolution's own. The rule hands those roles to the convolution's factors
(conv.py: the unfolded patches of G where they are short, else ConvWeight: Gram or grouped weight-gradient
convolution for the norms, one weight gradient for the clipped sum), so every norm path, token mass and clipped
sum of a convolution serves the transposed one.

output_padding (or a forward's output_size) adds positions at the end of y that no x position reaches through
all of W; conv(G, W) then has up to output_padding // stride more positions per dim than x, whose output grads
are zero (``_adjoint_output_grad`` pads x with them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .conv import SHORT_PATCH, ConvWeight, bias_factor, unfolded_factor
from .registry import register_norm_rule


def _adjoint_output_grad(module, x: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """x (B, C_in, *L_in) zero-padded at the end of each spatial dim to the size of conv(G, W) over the output grad
    G (B, C_out, *L_out): floor((L_out + 2 p - d (k - 1) - 1) / s) + 1, which is L_in + output_padding // s."""
    extra = []
    for i in range(x.dim() - 2):
        k, s, p, d = module.kernel_size[i], module.stride[i], module.padding[i], module.dilation[i]
        extra.append((output_grad.shape[2 + i] + 2 * p - d * (k - 1) - 1) // s + 1 - x.shape[2 + i])
    flat_pad = [amount for e in reversed(extra) for amount in (0, e)]  # F.pad wants the last dim first
    return F.pad(x, flat_pad) if any(flat_pad) else x


def conv_transpose_rule(module: torch.nn.modules.conv._ConvTransposeNd, inputs: tuple[torch.Tensor, ...],
                        output_grad: torch.Tensor, trainable) -> dict:
    """weight: the adjoint convolution's factor, G_i as its input and x_i as its output grad (see the module doc);
    bias: sum over the output's positions of G_i, as a convolution's."""
    out = {}
    if "weight" in trainable:
        x = _adjoint_output_grad(module, inputs[0], output_grad)
        # The adjoint's patches are G's: C_out/groups * prod(k) long, the weight's trailing dims.
        short = module.groups == 1 and math.prod(module.weight.shape[1:]) <= SHORT_PATCH
        out["weight"] = (unfolded_factor if short else ConvWeight)(module, output_grad, x)
    if "bias" in trainable:
        out["bias"] = bias_factor(output_grad)
    return out


for _cls in (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d):
    register_norm_rule(_cls, conv_transpose_rule)
