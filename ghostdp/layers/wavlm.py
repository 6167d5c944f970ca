"""WavLM's attention with its projections called as Linear layers, so that the Linear norm rule covers them.

transformers' WavLMAttention applies ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` by handing their weights to
``F.multi_head_attention_forward``: no call of those Linear children is ever made, so gradient reaches their
parameters outside their modules' forwards and ghostdp refuses the step (it cannot bound what it never sees). The
first layer's attention also looks its relative position bias up once for the whole batch, ``rel_attn_embed`` of
the (T, T) buckets, and repeats it over the examples itself, so no call of that table has an example's gradient.

``WavLMAttention`` here computes what transformers' does (same outputs, attention weights and position bias;
tests/layers/test_wavlm.py checks them against transformers' in float64) from the same child modules and parameter
objects, taken over as they are (frozen flags, device, dtype and any optimizer's references stay):
- each projection is a call of its Linear child on the (B, T, E) states; the scores are formed as
  multi_head_attention_forward forms them (q scaled by sqrt(1 / head_dim), the gated bias added, padded keys at
  -inf, softmax, dropout of the weights), and the output projection is a call of ``out_proj``;
- the bias table is looked up as a batch of one, (1, T, T) buckets, whose output ghostdp's recorder broadcasts to
  the batch (as for T5's bias: norms/relative_bias.py), so the Embedding rule forms each example's gradient of it
  over every layer's use (the later layers take the first one's position bias, as in transformers);
- ``gru_rel_pos_const`` scales the gate elementwise, a use of the module's own parameter (norms/parameter_uses.py),
  and ``gru_rel_pos_linear`` stays a Linear call.
``validate.fix`` swaps every WavLMAttention whose code is the one written here (``has_known_code``) for this module
(layers/twins.py); state_dict keys are unchanged, so checkpoints load either way.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..norms.registry import has_bodies
from .taken_over import TakenOver, twin

TRANSFORMERS_CLASS = "transformers.models.wavlm.modeling_wavlm.WavLMAttention"
WHY = ("hands the weights of its q_proj, k_proj, v_proj and out_proj to F.multi_head_attention_forward, so gradient "
       "reaches them outside their Linear modules, which ghostdp refuses (it cannot bound what it never sees)")

# The bodies (registry.forward_body) of transformers' WavLMAttention methods that this module computes again.
FORWARD_BODY = (
    "bsz, tgt_len, _ = hidden_states.size() ; if position_bias is None:\n    position_bias = self.compute_bias("
    "tgt_len, tgt_len)\n    position_bias = position_bias.unsqueeze(0).repeat(bsz, 1, 1, 1).view(bsz * "
    "self.num_heads, tgt_len, tgt_len) ; gated_hidden_states = hidden_states.view(hidden_states.shape[:-1] + "
    "(self.num_heads, -1)) ; gated_hidden_states = gated_hidden_states.permute(0, 2, 1, 3) ; relative_position_proj "
    "= self.gru_rel_pos_linear(gated_hidden_states) ; relative_position_proj = relative_position_proj.view("
    "gated_hidden_states.shape[:-1] + (2, 4)).sum(-1) ; gate_a, gate_b = torch.sigmoid(relative_position_proj)."
    "chunk(2, dim=-1) ; gate_output = gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0 ; gated_position_bias "
    "= gate_output.view(bsz * self.num_heads, -1, 1) * position_bias ; gated_position_bias = gated_position_bias."
    "view((-1, tgt_len, tgt_len)) ; attn_output, attn_weights = self.torch_multi_head_self_attention(hidden_states, "
    "attention_mask, gated_position_bias) ; return (attn_output, attn_weights, position_bias)")
ATTENTION_BODY = (
    "query = key = value = hidden_states.transpose(0, 1) ; key_padding_mask = attention_mask.ne(1) if "
    "attention_mask is not None else None ; bias_k = bias_v = None ; add_zero_attn = False ; attn_output, "
    "attn_weights = F.multi_head_attention_forward(query, key, value, self.embed_dim, self.num_heads, "
    "torch.empty([0]), torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), bias_k, bias_v, "
    "add_zero_attn, self.dropout, self.out_proj.weight, self.out_proj.bias, self.training, key_padding_mask, "
    "need_weights=True, attn_mask=gated_position_bias, use_separate_proj_weight=True, q_proj_weight="
    "self.q_proj.weight, k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight) ; attn_output = "
    "attn_output.transpose(0, 1) ; if attn_weights is not None:\n    attn_weights = attn_weights[:, None]."
    "broadcast_to(attn_weights.shape[:1] + (self.num_heads,) + attn_weights.shape[1:]) ; return (attn_output, "
    "attn_weights)")
COMPUTE_BIAS_BODY = (
    "device = self.rel_attn_embed.weight.device ; context_position = torch.arange(query_length, dtype=torch.long, "
    "device=device)[:, None] ; memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :] "
    "; relative_position = memory_position - context_position ; relative_position_bucket = "
    "self._relative_positions_bucket(relative_position) ; values = self.rel_attn_embed(relative_position_bucket) ; "
    "values = values.permute([2, 0, 1]) ; return values")
BUCKET_BODY = (
    "num_buckets = self.num_buckets // 2 ; relative_buckets = (relative_positions > 0).to(torch.long) * num_buckets "
    "; relative_positions = torch.abs(relative_positions) ; max_exact = num_buckets // 2 ; is_small = "
    "relative_positions < max_exact ; relative_positions_if_large = torch.log(relative_positions.float() / "
    "max_exact) ; relative_positions_if_large = relative_positions_if_large / math.log(self.max_distance / "
    "max_exact) ; relative_positions_if_large = relative_positions_if_large * (num_buckets - max_exact) ; "
    "relative_position_if_large = (max_exact + relative_positions_if_large).to(torch.long) ; "
    "relative_position_if_large = torch.min(relative_position_if_large, torch.full_like(relative_position_if_large, "
    "num_buckets - 1)) ; relative_buckets += torch.where(is_small, relative_positions, relative_position_if_large) ; "
    "return relative_buckets")
_KNOWN_BODIES = {"forward": FORWARD_BODY, "torch_multi_head_self_attention": ATTENTION_BODY,
                 "compute_bias": COMPUTE_BIAS_BODY, "_relative_positions_bucket": BUCKET_BODY}


def has_known_code(module: nn.Module) -> bool:
    """Whether the methods of ``module``'s class that WavLMAttention computes again have the code written here."""
    return has_bodies(type(module), _KNOWN_BODIES.items())


class WavLMAttention(TakenOver):
    """transformers' WavLMAttention (same outputs, state_dict keys and attention weights) whose projections are Linear
    calls and whose relative position bias is looked up as a batch of one (module doc). Build it with
    ``from_transformers``."""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, index=0, **kwargs):
        bsz, tgt_len, _ = hidden_states.size()
        heads = self.num_heads
        if position_bias is None:
            position_bias = self.batch_position_bias(bsz, tgt_len)
        gated = hidden_states.view(bsz, tgt_len, heads, -1).permute(0, 2, 1, 3)
        relative_position_proj = self.gru_rel_pos_linear(gated).view(bsz, heads, tgt_len, 2, 4).sum(-1)
        gate_a, gate_b = torch.sigmoid(relative_position_proj).chunk(2, dim=-1)
        gate_output = gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0
        scores_bias = (gate_output.view(bsz * heads, -1, 1) * position_bias).view(-1, tgt_len, tgt_len)
        if attention_mask is not None:  # multi_head_attention_forward's key padding mask: -inf at padded keys
            padded = attention_mask.ne(1).view(bsz, 1, 1, tgt_len)
            scores_bias = scores_bias.view(bsz, heads, tgt_len, tgt_len).masked_fill(padded, float("-inf"))
            scores_bias = scores_bias.view(bsz * heads, tgt_len, tgt_len)

        def by_head(x):  # (B, T, E) -> (B * heads, T, head_dim), multi_head_attention_forward's order
            return x.view(bsz, tgt_len, heads, self.head_dim).transpose(1, 2).reshape(bsz * heads, tgt_len, -1)

        q = by_head(self.q_proj(hidden_states)) * math.sqrt(1.0 / self.head_dim)
        k, v = by_head(self.k_proj(hidden_states)), by_head(self.v_proj(hidden_states))
        weights = torch.softmax(torch.baddbmm(scores_bias, q, k.transpose(-2, -1)), dim=-1)
        if self.training and self.dropout > 0.0:
            weights = F.dropout(weights, p=self.dropout)
        context = torch.bmm(weights, v).view(bsz, heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = self.out_proj(context.reshape(bsz, tgt_len, self.embed_dim))
        mean_weights = weights.view(bsz, heads, tgt_len, tgt_len).mean(dim=1)
        attn_weights = mean_weights[:, None].broadcast_to((bsz, heads, tgt_len, tgt_len))
        return attn_output, attn_weights, position_bias

    def batch_position_bias(self, bsz: int, length: int) -> torch.Tensor:
        """(bsz * heads, T, T): compute_bias's values for every example, from one lookup of a batch of one."""
        device = self.rel_attn_embed.weight.device
        positions = torch.arange(length, dtype=torch.long, device=device)
        buckets = self.relative_positions_bucket(positions[None, :] - positions[:, None])
        values = self.rel_attn_embed(buckets.unsqueeze(0)).permute(0, 3, 1, 2)  # (1 or B, heads, T, T)
        return values.expand(bsz, -1, -1, -1).reshape(bsz * self.num_heads, length, length)

    def relative_positions_bucket(self, relative_positions: torch.Tensor) -> torch.Tensor:
        """WavLM's bucket of each relative position: exact below a quarter of the buckets, then logarithmic up to
        ``max_distance``; positive offsets in the upper half."""
        half = self.num_buckets // 2
        buckets = (relative_positions > 0).to(torch.long) * half
        distance = torch.abs(relative_positions)
        max_exact = half // 2
        large = torch.log(distance.float() / max_exact) / math.log(self.max_distance / max_exact)
        large = (max_exact + large * (half - max_exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, half - 1))
        return buckets + torch.where(distance < max_exact, distance, large)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


def from_transformers(module: nn.Module) -> WavLMAttention:
    """The ghostdp module for a transformers WavLMAttention with the code written here."""
    return twin(WavLMAttention, module, TRANSFORMERS_CLASS, has_known_code, "WavLMAttention")
