"""Conv1d / Conv2d / Conv3d (and, through their adjoint, the transposed ones: conv_transpose.py).

The output at location l is W_g @ patch_l (per group g), so the per-example weight gradient of group g
is G_g^T U_g with G_g (L, C_out/g) and U_g (L, C_in/g * prod(k)) the unfolded input patches: the Linear
rule over locations. Where a patch is short (C_in/groups * prod(k) <= SHORT_PATCH: the first layers of
image nets) the unfolded patches are small and that is what the factor holds (``unfolded_factor``).
Elsewhere ``ConvWeight`` keeps the input and the output grad as they are and forms
- the norms by the Gram of the patches when that is cheaper (few locations, wide layers: prefers_gram),
  else by the per-example gradients themselves, made by one grouped weight-gradient convolution with
  the examples as groups (no unfolded copy of the input, which is prod(k) times its size);
- the clipped sum sum_i c_i g_i as one ordinary weight gradient of the weighted output grads.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .factors import (Blocks, Instantiated, OuterProduct, PerExampleGrad, acc_dtype, gram_tile, prefers_gram,
                      summed_positions_mass)
from .registry import register_norm_rule

# Patch length up to which unfolding is cheap and matmuls on the patches beat the convolution kernels:
# measured on CPU (torch 2.13) on the first layers of benchmarks.opacus_paper's MNIST and CIFAR-10 networks
# (1 and 3 input channels), where the weight-gradient convolution took 1.4-3x the patch matmul. Ungrouped
# convolutions only: unfolded, a grouped one is one factor per group (Blocks), with Python and ops per group
# at every step (a depthwise 7x7 convolution's 49-long patches made ConvNext's steps 6x plain on the CPU
# stand-in, against 3.5x with ConvWeight's one grouped convolution).
SHORT_PATCH = 64


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


def padded_input(module, x):
    """x with the module's padding applied (its mode, and padding='same' however uneven)."""
    pads = _padding_amounts(module, x.dim() - 2)
    flat_pad = [a for pair in reversed(pads) for a in pair]  # F.pad wants the last dim first
    if not any(flat_pad):
        return x
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, flat_pad, mode=mode)


def unfold_patches(module, x):
    """(B, C, *S) -> (B, L, C * prod(kernel)) patches, channel-major like the weight layout."""
    nd = x.dim() - 2
    x = padded_input(module, x)
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


class ConvWeight(PerExampleGrad):
    """g_i = dL_i/dW of a convolution: the weight gradient of example i's input x_i and output grad G_i."""

    def __init__(self, module, x: torch.Tensor, output_grad: torch.Tensor):
        self.module, self.x, self.grad = module, x, output_grad
        self.batch_size = x.shape[0]
        self.param_shape = module.weight.shape
        nd = x.dim() - 2
        pads = _padding_amounts(module, nd)
        self._symmetric_zero_padding = module.padding_mode == "zeros" and all(a == b for a, b in pads)
        self._padding = [a for a, _ in pads] if self._symmetric_zero_padding else [0] * nd
        self.locations = math.prod(output_grad.shape[2:])

    def _input(self, lo=0, hi=None):
        """The input of examples lo..hi, padded here unless the convolution can pad it (symmetric zeros)."""
        x = self.x[lo:hi]
        return x if self._symmetric_zero_padding else padded_input(self.module, x)

    def _weight_grad(self, x, grad, groups):
        dt = self.sum_dtype()
        weight = torch.empty((grad.shape[1], x.shape[1] // groups, *self.param_shape[2:]), dtype=dt, device=x.device)
        m = self.module
        return torch.ops.aten.convolution_backward(
            grad.to(dt), x.to(dt), weight, None, list(m.stride), self._padding, list(m.dilation), False,
            [0] * (x.dim() - 2), groups, [False, True, False])[1]

    def _unfolded(self):
        return unfolded_factor(self.module, self.x, self.grad)

    def _prefers_gram(self) -> bool:
        co = self.param_shape[0] // self.module.groups
        ci = math.prod(self.param_shape[1:])
        L = self.locations
        return L > 1 and prefers_gram(L, co, ci, gram_tile(self.batch_size, L, self.x.device.type))

    def sum_dtype(self):
        return acc_dtype(self.x, self.grad)

    def token_mass(self, grams=None):
        # sum_l |G_l| |U_l| <= |G|_F |U|_F (Cauchy-Schwarz), as OuterProduct; |U|_F^2 counts each input
        # value once per patch that holds it: the channel-summed x^2 convolved with a kernel of ones.
        if self.locations <= 1:
            return None
        dt = self.sum_dtype()
        x = self._input()
        nd = x.dim() - 2
        squares = x.to(dt).pow(2).sum(1, keepdim=True)
        ones = torch.ones((1, 1, *self.param_shape[2:]), dtype=dt, device=x.device)
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        m = self.module
        patch_sq = conv(squares, ones, None, m.stride, self._padding, m.dilation).flatten(1).sum(1)
        return torch.linalg.vector_norm(self.grad, dim=tuple(range(1, self.grad.dim())), dtype=dt) * patch_sq.sqrt()

    def sq_norm(self, grams=None) -> torch.Tensor:
        if self._prefers_gram():
            return self._unfolded().sq_norm()
        return super().sq_norm()  # materialised in example chunks

    def materialize(self, lo, hi):
        n, g = hi - lo, self.module.groups
        x = self._input(lo, hi)
        grad = self.grad[lo:hi]
        # The examples as groups: example e's channels meet only its own output grads.
        per_example = self._weight_grad(x.reshape(1, -1, *x.shape[2:]), grad.reshape(1, -1, *grad.shape[2:]), n * g)
        return per_example.reshape(n, *self.param_shape)

    def weighted_sum(self, weights):
        dt = self.sum_dtype()
        scaled = self.grad.to(dt) * weights.to(dt).reshape(-1, *[1] * (self.grad.dim() - 1))
        return self._weight_grad(self._input(), scaled, self.module.groups)


def unfolded_factor(module, x, output_grad) -> PerExampleGrad:
    """The weight gradient as an OuterProduct of the output grads and the unfolded patches, per group."""
    U = unfold_patches(module, x)
    Gt = output_grad.reshape(*output_grad.shape[:2], -1).transpose(1, 2)
    g = module.groups
    if g == 1:
        return OuterProduct(Gt, U, module.weight.shape)
    co, ci = Gt.shape[-1] // g, U.shape[-1] // g
    return Blocks([OuterProduct(Gt[..., j * co:(j + 1) * co], U[..., j * ci:(j + 1) * ci], (co, ci))
                   for j in range(g)], module.weight.shape, dim=1)


def conv_rule(module, inputs, output_grad, trainable):
    out = {}
    if "weight" in trainable:
        short = module.groups == 1 and math.prod(module.weight.shape[1:]) <= SHORT_PATCH
        out["weight"] = (unfolded_factor if short else ConvWeight)(module, inputs[0], output_grad)
    if "bias" in trainable:
        out["bias"] = bias_factor(output_grad)
    return out


def bias_factor(output_grad: torch.Tensor) -> Instantiated:
    """A convolution's bias gradient: G_i summed over the output's positions, with its token mass."""
    G = output_grad.reshape(*output_grad.shape[:2], -1)  # (B, C_out, L)
    return Instantiated(G.sum(2), mass=summed_positions_mass(G.transpose(1, 2), G.shape[2], acc_dtype(G)))


for _cls in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
    register_norm_rule(_cls, conv_rule)
