"""Swin's relative position bias, with each example's gradient.

Swin's attention runs on the windows of every example at once, (B * windows, N, d) rows, and adds to every row's
scores one bias per head, (1, heads, N, N), that its input-less child ``relative_position_bias`` reads from a table by
a fixed index (SwinRelativePositionBias). No call of that child holds an example's gradient as the model computes
it, so until 2026-11-28 ghostdp broadcast its output to (B, heads, N, N), the attention's shapes no longer matched,
and the error asked to freeze the tables.

Where the attention has Swin's code (WINDOW_ATTENTION_BODY), its forward pre-hook (clipping/recording.py) notes its
rows, and the child's output is broadcast to (B, windows, heads, N, N) instead, then reshaped to those rows: the rows
of one example lie together, as Swin's window partition lays them out (example-major; the layout proof, which checks
that output's batch dim on its schedule, would find them mixed otherwise). The child's rule then reads each
example's output grad G_i (windows, heads, N, N) and forms g_i[r, h] = sum over the windows w and positions (p, q)
with index[p, q] = r of G_i[w, h, p, q]: an EmbeddingGather of the index repeated for each window, whose small table
keeps its explicit (B, rows, heads) gradients (EmbeddingGather._keeps_explicit).
"""
from __future__ import annotations

import functools

import torch

from .factors import EmbeddingGather
from .registry import forward_body, register_forward_rule

# SwinRelativePositionBias.forward's body (registry.forward_body; tests/norms/test_window_bias.py checks that
# transformers' Swin has both).
WINDOW_BIAS_BODY = (
    "relative_position_bias = self.relative_position_bias_table[self.relative_position_index] ; "
    "relative_position_bias = relative_position_bias.view(self.window_area, self.window_area, -1) ; "
    "return relative_position_bias.permute(2, 0, 1).contiguous().unsqueeze(0)")
# SwinAttention.forward's: the bias added to every row's scores, directly or with the shifted windows' mask.
WINDOW_ATTENTION_BODY = (
    "input_shape = hidden_states.shape[:-1] ; hidden_shape = (*input_shape, -1, self.head_dim) ; query_states = "
    "self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2) ; key_states = self.k_proj(hidden_states).view("
    "hidden_shape).transpose(1, 2) ; value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2) ; "
    "relative_position_bias = self.relative_position_bias() ; if attention_mask is not None:\n    num_windows = "
    "attention_mask.shape[0]\n    batch_size = input_shape[0] // num_windows\n    seq_len = input_shape[1]\n    "
    "attention_mask = attention_mask.unsqueeze(1).unsqueeze(0).expand(batch_size, -1, -1, -1, -1).reshape(-1, 1, "
    "seq_len, seq_len)\n    combined_mask = relative_position_bias + attention_mask\nelse:\n    combined_mask = "
    "relative_position_bias ; attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface("
    "self.config._attn_implementation, eager_attention_forward) ; attn_output, attn_weights = attention_interface("
    "self, query_states, key_states, value_states, combined_mask, dropout=0.0 if not self.training else "
    "self.attention_dropout, scaling=self.scaling, **kwargs) ; attn_output = attn_output.reshape(*input_shape, "
    "-1).contiguous() ; attn_output = self.o_proj(attn_output) ; return (attn_output, attn_weights)")


@functools.cache
def adds_window_bias(cls: type) -> bool:
    """Whether ``cls``'s forward is Swin's attention's (WINDOW_ATTENTION_BODY): its rows are (B * windows, N, d)
    and the output of its ``relative_position_bias`` child is added to each row's scores."""
    return forward_body(cls.forward) == WINDOW_ATTENTION_BODY


def window_bias_rule(module: torch.nn.Module, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """g_i[r, h] = sum of G_i[w, h, p, q] over the windows w and positions with index[p, q] = r (module doc).
    ``output_grad``: (B, windows, heads, N, N), or (1, heads, N, N) where the batch is one example (not broadcast)."""
    if "relative_position_bias_table" not in trainable:
        return {}
    G = output_grad if output_grad.dim() == 5 else output_grad.unsqueeze(1)  # (B, windows, heads, N, N)
    return {"relative_position_bias_table": gathered_by_index(G, module.relative_position_index,
                                                              module.relative_position_bias_table.shape[0])}


def gathered_by_index(G: torch.Tensor, index: torch.Tensor, rows: int) -> EmbeddingGather:
    """The factor of a (rows, heads) table read at ``index`` (N x N of its rows) into a bias (heads, N, N) that every
    window of an example adds: ``G`` (B, windows, heads, N, N), each example's output grads, so g_i[r, h] = the sum of
    G_i[w, h, p, q] over its windows w and the positions (p, q) of index r (Swin's, and BEiT's with one window)."""
    B, windows, heads, N, _ = G.shape
    grads = G.permute(0, 1, 3, 4, 2).reshape(B, windows * N * N, heads)  # each (window, p, q) a row of the table
    ids = index.reshape(1, 1, N * N).expand(B, windows, N * N).reshape(B, windows * N * N)
    return EmbeddingGather(ids, grads, rows)


register_forward_rule(WINDOW_BIAS_BODY, window_bias_rule, params=("relative_position_bias_table",))
