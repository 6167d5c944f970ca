"""Linear layers: torch.nn.Linear and transformers' Conv1D (GPT-2)."""
from __future__ import annotations

import torch

from .factors import Instantiated, OuterProduct
from .registry import register_norm_rule


def _flatten_tokens(inputs: torch.Tensor, output_grad: torch.Tensor):
    """(B, ..., d) -> (B, T, d); a 2-D input becomes T = 1."""
    B = output_grad.shape[0]
    return inputs.reshape(B, -1, inputs.shape[-1]), output_grad.reshape(B, -1, output_grad.shape[-1])


@register_norm_rule(torch.nn.Linear)
def linear_rule(module, inputs, output_grad, trainable):
    A, G = _flatten_tokens(inputs[0], output_grad)
    out = {}
    if "weight" in trainable:
        out["weight"] = OuterProduct(G, A, module.weight.shape, input_side="right")  # g_i = G_i^T A_i
    if "bias" in trainable:
        out["bias"] = Instantiated(G.sum(1))
    return out


def conv1d_transformers_rule(module, inputs, output_grad, trainable):
    """transformers' Conv1D computes x @ W + b with W of shape (in, out): g_i = A_i^T G_i."""
    A, G = _flatten_tokens(inputs[0], output_grad)
    out = {}
    if "weight" in trainable:
        out["weight"] = OuterProduct(A, G, module.weight.shape, input_side="left")
    if "bias" in trainable:
        out["bias"] = Instantiated(G.sum(1))
    return out


try:  # transformers is a dependency, but keep the core importable without it.
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover
    _HFConv1D = None
if _HFConv1D is not None:
    register_norm_rule(_HFConv1D, conv1d_transformers_rule)
