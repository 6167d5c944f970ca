"""Linear layers: torch.nn.Linear, its transformers subclasses that compute the same function (Falcon's), and
transformers' Conv1D (GPT-2).

For y = x W^T + b (Linear) or y = x W + b (Conv1D) on (B, T, d) inputs, example i's gradients are
g_W = G_i^T A_i (Conv1D: A_i^T G_i) and g_b = sum_t G_it; the weight's is kept as an OuterProduct.
"""
from __future__ import annotations

import torch

from .factors import OuterProduct, SummedTokens, explicit_is_smaller
from .registry import register_norm_rule


def _flatten_tokens(inputs: torch.Tensor, output_grad: torch.Tensor):
    """(B, ..., d) -> (B, T, d); a 2-D input becomes T = 1."""
    if inputs.dim() == 3 and output_grad.dim() == 3:  # already (B, T, d): no reshape to dispatch
        return inputs, output_grad
    B = output_grad.shape[0]
    return inputs.reshape(B, -1, inputs.shape[-1]), output_grad.reshape(B, -1, output_grad.shape[-1])


def _linear_factors(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                    trainable: set[str], weight_is_out_by_in: bool) -> dict:
    A, G = _flatten_tokens(inputs[0], output_grad)  # (B, T, d), (B, T, p)
    out = {}
    if "weight" in trainable:
        if weight_is_out_by_in:  # g_i = G_i^T A_i
            out["weight"] = OuterProduct(G, A, module.weight.shape, input_side="right")
        else:                    # g_i = A_i^T G_i
            out["weight"] = OuterProduct(A, G, module.weight.shape, input_side="left")
    if "bias" in trainable:  # after the weight: its norm and mass reuse the Gram of G the weight forms
        out["bias"] = SummedTokens(G)
    return out


def _holds_output_grad(module, inputs, output, trainable, weight_is_out_by_in: bool) -> bool:
    """Book-keeping keeps G whole: in the bias's summed tokens, or in the weight's factors where its explicit
    gradients would not be smaller (OuterProduct.kept), as the forward's shapes tell it (batch first)."""
    if "bias" in trainable:
        return True
    if "weight" not in trainable or output.dim() == 0:
        return False
    x = inputs[0]
    B, p, d = output.shape[0], output.shape[-1], x.shape[-1]
    T = output.numel() // max(1, B * p)
    if weight_is_out_by_in:  # left = G (B, T, p), right = A (B, T, d)
        return not explicit_is_smaller(B, T, p, d, output.dtype, x.dtype)
    return not explicit_is_smaller(B, T, d, p, x.dtype, output.dtype)


def _linear_holds_output_grad(module, inputs, output, trainable):
    return _holds_output_grad(module, inputs, output, trainable, weight_is_out_by_in=True)


def _conv1d_holds_output_grad(module, inputs, output, trainable):
    return _holds_output_grad(module, inputs, output, trainable, weight_is_out_by_in=False)


@register_norm_rule(torch.nn.Linear, tokenwise=True, holds_output_grad=_linear_holds_output_grad)
def linear_rule(module: torch.nn.Linear, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                trainable: set[str]) -> dict:
    return _linear_factors(module, inputs, output_grad, trainable, weight_is_out_by_in=True)


@register_norm_rule("transformers.pytorch_utils.Conv1D", tokenwise=True, holds_output_grad=_conv1d_holds_output_grad)
def conv1d_transformers_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                             trainable: set[str]) -> dict:
    """transformers' Conv1D computes x @ W + b with W of shape (in, out)."""
    return _linear_factors(module, inputs, output_grad, trainable, weight_is_out_by_in=False)


# transformers' nn.Linear subclasses whose forward is ``input @ self.weight.T``, plus ``self.bias`` where there is one:
# the Linear's function, so the Linear's rule (tests/norms/test_subclass_rules.py checks each forward in the installed
# transformers; without a rule each took the exact but slower fallback). Registered by name: importing ghostdp
# imports no modeling file.
MATMUL_LINEARS = ["falcon.modeling_falcon.FalconLinear"]
for _name in MATMUL_LINEARS:
    register_norm_rule(f"transformers.models.{_name}", linear_rule, tokenwise=True,
                       holds_output_grad=_linear_holds_output_grad)
