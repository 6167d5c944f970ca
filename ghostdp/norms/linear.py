"""Linear layers: torch.nn.Linear and transformers' Conv1D (GPT-2).

For y = x W^T + b (Linear) or y = x W + b (Conv1D) on (B, T, d) inputs, example i's gradients are
g_W = G_i^T A_i (Conv1D: A_i^T G_i) and g_b = sum_t G_it; the weight's is kept as an OuterProduct.
"""
from __future__ import annotations

import math

import torch


from .factors import Instantiated, OuterProduct, acc_dtype
from .registry import register_norm_rule


def _flatten_tokens(inputs: torch.Tensor, output_grad: torch.Tensor):
    """(B, ..., d) -> (B, T, d); a 2-D input becomes T = 1."""
    B = output_grad.shape[0]
    return inputs.reshape(B, -1, inputs.shape[-1]), output_grad.reshape(B, -1, output_grad.shape[-1])


def _linear_factors(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                    trainable: set[str], weight_is_out_by_in: bool) -> dict:
    A, G = _flatten_tokens(inputs[0], output_grad)  # (B, T, d), (B, T, p)
    T = G.shape[1]
    # |G_i|_F, shared by both token masses (the weight's and the bias's): see precision.py.
    g_norm = torch.linalg.vector_norm(G, dim=(1, 2), dtype=acc_dtype(G)) if T > 1 else None
    out = {}
    if "weight" in trainable:
        if weight_is_out_by_in:  # g_i = G_i^T A_i
            out["weight"] = OuterProduct(G, A, module.weight.shape, input_side="right", known_norms={"left": g_norm})
        else:                    # g_i = A_i^T G_i
            out["weight"] = OuterProduct(A, G, module.weight.shape, input_side="left", known_norms={"right": g_norm})
    if "bias" in trainable:
        out["bias"] = Instantiated(G.sum(1), mass=None if g_norm is None else g_norm * math.sqrt(T))
    return out


@register_norm_rule(torch.nn.Linear, tokenwise=True)
def linear_rule(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                trainable: set[str]) -> dict:
    return _linear_factors(module, inputs, output_grad, trainable, weight_is_out_by_in=True)


@register_norm_rule("transformers.pytorch_utils.Conv1D", tokenwise=True)
def conv1d_transformers_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                             trainable: set[str]) -> dict:
    """transformers' Conv1D computes x @ W + b with W of shape (in, out)."""
    return _linear_factors(module, inputs, output_grad, trainable, weight_is_out_by_in=False)
