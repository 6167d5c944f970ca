"""Swin v2's self-attention with its continuous position bias formed for each example.

transformers' Swinv2SelfAttention runs its position-bias MLP (``continuous_position_bias_mlp``: Linear, ReLU, Linear)
once for the whole batch, on a constant table of relative coordinates, and adds the bias it gathers from the MLP's
output to every window of every example. No call of the MLP's Linear layers holds an example's gradient then: ghostdp
broadcasts the first Linear's output of batch size 1 to the batch (as for a position embedding), and the attention's
own ``.view(-1, heads)`` then merges the copies, which ghostdp refuses (the broadcast changed what the model computes).

``Swinv2SelfAttention`` here computes what transformers' does (same outputs and attention probabilities; the mask
added twice where there is one, as transformers' code adds it; tests/layers/test_swinv2.py checks them in float64)
from the same child modules, parameters and buffers, taken over as they are:
- the MLP's layers are called one by one (the ReLU out of place: the broadcast output is a view of one row), so the
  bias has a row per example where ghostdp broadcast the first layer's output, and one row for the batch elsewhere;
  each example's bias is added to its own windows (the rows of the window batch are example-major, as Swin's window
  partition makes them), so the Linear rule forms each example's gradient of the MLP;
- ``logit_scale`` scales the cosine scores through ``clamp(..., max=log 100).exp()``, an elementwise use of the
  module's own parameter through functions (norms/parameter_uses.py).
``validate.fix`` swaps every Swinv2SelfAttention whose code is the one written here (``has_known_code``) for this
module (layers/twins.py); state_dict keys are unchanged.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..norms.registry import forward_body
from .taken_over import TakenOver, twin

TRANSFORMERS_CLASS = "transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention"
WHY = ("runs its position-bias MLP once for the batch and merges ghostdp's per-example copies of its output, which "
       "ghostdp refuses")

# The body (registry.forward_body) of transformers' Swinv2SelfAttention.forward, which this module computes again.
FORWARD_BODY = (
    "batch_size, dim, num_channels = hidden_states.shape ; query_layer = self.query(hidden_states).view(batch_size, "
    "-1, self.num_attention_heads, self.attention_head_size).transpose(1, 2) ; key_layer = self.key(hidden_states)."
    "view(batch_size, -1, self.num_attention_heads, self.attention_head_size).transpose(1, 2) ; value_layer = "
    "self.value(hidden_states).view(batch_size, -1, self.num_attention_heads, self.attention_head_size).transpose(1, "
    "2) ; attention_scores = nn.functional.normalize(query_layer, dim=-1) @ nn.functional.normalize(key_layer, "
    "dim=-1).transpose(-2, -1) ; logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp() ; "
    "attention_scores = attention_scores * logit_scale ; relative_position_bias_table = "
    "self.continuous_position_bias_mlp(self.relative_coords_table).view(-1, self.num_attention_heads) ; "
    "relative_position_bias = relative_position_bias_table[self.relative_position_index.view(-1)].view("
    "self.window_size[0] * self.window_size[1], self.window_size[0] * self.window_size[1], -1) ; "
    "relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous() ; relative_position_bias = 16 * "
    "torch.sigmoid(relative_position_bias) ; attention_scores = attention_scores + relative_position_bias.unsqueeze("
    "0) ; if attention_mask is not None:\n    mask_shape = attention_mask.shape[0]\n    attention_scores = "
    "attention_scores.view(batch_size // mask_shape, mask_shape, self.num_attention_heads, dim, dim) + "
    "attention_mask.unsqueeze(1).unsqueeze(0)\n    attention_scores = attention_scores + attention_mask.unsqueeze(1)."
    "unsqueeze(0)\n    attention_scores = attention_scores.view(-1, self.num_attention_heads, dim, dim) ; "
    "attention_probs = nn.functional.softmax(attention_scores, dim=-1) ; attention_probs = self.dropout("
    "attention_probs) ; context_layer = torch.matmul(attention_probs, value_layer) ; context_layer = "
    "context_layer.permute(0, 2, 1, 3).contiguous() ; new_context_layer_shape = context_layer.size()[:-2] + "
    "(self.all_head_size,) ; context_layer = context_layer.view(new_context_layer_shape) ; outputs = (context_layer, "
    "attention_probs) if output_attentions else (context_layer,) ; return outputs")


def has_known_code(module: nn.Module) -> bool:
    """Whether ``module``'s forward has the code written here, and its position-bias MLP is Linear, ReLU, Linear."""
    mlp = getattr(module, "continuous_position_bias_mlp", None)
    return (forward_body(type(module).forward) == FORWARD_BODY and isinstance(mlp, nn.Sequential) and len(mlp) == 3
            and isinstance(mlp[0], nn.Linear) and isinstance(mlp[1], nn.ReLU) and isinstance(mlp[2], nn.Linear))


class Swinv2SelfAttention(TakenOver):
    """transformers' Swinv2SelfAttention (same outputs and state_dict keys) whose continuous position bias has a row per
    example where ghostdp broadcasts its MLP's first output (module doc). Build it with ``from_transformers``."""

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        rows, tokens, _ = hidden_states.shape  # rows: the windows of every example, example by example
        heads = self.num_attention_heads

        def by_head(x):
            return x.view(rows, -1, heads, self.attention_head_size).transpose(1, 2)

        query, key, value = (by_head(self.query(hidden_states)), by_head(self.key(hidden_states)),
                             by_head(self.value(hidden_states)))
        scores = F.normalize(query, dim=-1) @ F.normalize(key, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        bias = self.position_bias()  # (1 or B, heads, N, N)
        examples = bias.shape[0]
        scores = (scores.view(examples, rows // examples, heads, tokens, tokens) + bias.unsqueeze(1)).view(
            rows, heads, tokens, tokens)
        if attention_mask is not None:  # added twice, as transformers' code adds it
            windows = attention_mask.shape[0]
            mask = attention_mask.unsqueeze(1).unsqueeze(0)
            scores = scores.view(rows // windows, windows, heads, tokens, tokens) + mask
            scores = (scores + mask).view(-1, heads, tokens, tokens)
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous()
        context = context.view(context.size()[:-2] + (self.all_head_size,))
        return (context, probs) if output_attentions else (context,)

    def position_bias(self) -> torch.Tensor:
        """16 sigmoid(MLP(relative coordinates)) gathered at each token pair's relative position: (1, heads, N, N),
        or (B, heads, N, N) where ghostdp broadcast the MLP's first output to the batch's B examples."""
        first, _, second = self.continuous_position_bias_mlp
        table = second(F.relu(first(self.relative_coords_table)))  # (1 or B, 2 Wh - 1, 2 Ww - 1, heads)
        examples, area = table.shape[0], self.window_size[0] * self.window_size[1]
        bias = table.reshape(examples, -1, self.num_attention_heads)[:, self.relative_position_index.view(-1)]
        return 16 * torch.sigmoid(bias.view(examples, area, area, -1).permute(0, 3, 1, 2))

    def extra_repr(self) -> str:
        return f"heads={self.num_attention_heads}, window_size={tuple(self.window_size)}"


def from_transformers(module: nn.Module) -> Swinv2SelfAttention:
    """The ghostdp module for a transformers Swinv2SelfAttention with the code written here."""
    return twin(Swinv2SelfAttention, module, TRANSFORMERS_CLASS, has_known_code, "Swinv2SelfAttention")
