"""BEiT's relative position bias, with each example's gradient.

BEiT's and Data2Vec-vision's self-attention add to every example's scores one bias per head, (1, heads, N, N), that
an input-less child (``BeitRelativePositionBias``, one per layer or one shared by the encoder) reads from its table
``relative_position_bias_table`` by a fixed index of the token pairs (N = the patches and the class token), after
resampling the table's patch part to the window asked for. ghostdp broadcasts that output of batch size 1 to the
batch, so its output grad G has a row per example, and until 2026-12-02 the child took the exact fallback: one
batched VJP per chunk of examples, and a refusal under reentrant checkpointing (a module without a rule inside the
region).

Where the call asks for the table's own window, square (so the bilinear resampling to the same size is the
identity: torch copies), without interpolation (``accepts``), the rule forms g_i[r, h] = the sum of G_i[h, p, q]
over the pairs (p, q) whose index is r: an EmbeddingGather of the index, whose small table keeps its explicit
(B, rows, heads) gradients (EmbeddingGather._keeps_explicit): Swin's factor with one window (window_bias.py). Any
other call keeps the fallback.
"""
from __future__ import annotations

import functools

import torch

from .registry import register_forward_rule
from .window_bias import gathered_by_index

# BeitRelativePositionBias.forward's body (registry.forward_body; Data2VecVisionRelativePositionBias has the same;
# tests/norms/test_beit_bias.py checks that transformers' BEiT has it).
BEIT_BIAS_BODY = (
    'old_height = 2 * self.window_size[0] - 1 ; old_width = 2 * self.window_size[1] - 1 ; new_height = 2 '
    '* window_size[0] - 1 ; new_width = 2 * window_size[1] - 1 ; old_relative_position_bias_table = self.'
    'relative_position_bias_table ; old_num_relative_distance = self.num_relative_distance ; new_num_rela'
    'tive_distance = new_height * new_width + 3 ; old_sub_table = old_relative_position_bias_table[:old_n'
    'um_relative_distance - 3] ; old_sub_table = old_sub_table.reshape(1, old_width, old_height, -1).perm'
    'ute(0, 3, 1, 2) ; new_sub_table = nn.functional.interpolate(old_sub_table, size=(torch_int(new_heigh'
    "t), torch_int(new_width)), mode='bilinear') ; new_sub_table = new_sub_table.permute(0, 2, 3, 1).resh"
    'ape(new_num_relative_distance - 3, -1) ; new_relative_position_bias_table = torch.cat([new_sub_table'
    ', old_relative_position_bias_table[old_num_relative_distance - 3:]]) ; relative_position_index = sel'
    'f.generate_relative_position_index(window_size) ; relative_position_bias = new_relative_position_bia'
    's_table[relative_position_index.view(-1)] ; relative_position_bias = relative_position_bias.view(win'
    'dow_size[0] * window_size[1] + 1, window_size[0] * window_size[1] + 1, -1) ; relative_position_bias '
    '= relative_position_bias.permute(2, 0, 1).contiguous() ; if interpolate_pos_encoding:\n    relative_p'
    'osition_bias = nn.functional.interpolate(relative_position_bias.unsqueeze(1), size=(dim_size, dim_si'
    "ze), mode='bilinear', align_corners=False).squeeze(1) ; return relative_position_bias.unsqueeze(0)")


def _window(args, kwargs):
    """The call's window size and whether it interpolates (the forward's arguments, by position or keyword)."""
    window = args[0] if args else kwargs.get("window_size")
    interpolates = args[1] if len(args) > 1 else kwargs.get("interpolate_pos_encoding", False)
    return window, interpolates


def accepts(module, args, kwargs) -> bool:
    """The table's own square window, without interpolation: the forward reads the table by its index alone."""
    window, interpolates = _window(args, kwargs)
    own = tuple(module.window_size)
    return window is not None and tuple(window) == own and own[0] == own[1] and not interpolates


@functools.lru_cache(maxsize=64)
def _index(owner: type, window: tuple, device: torch.device) -> torch.Tensor:
    """The (N * N,) index of the table's row for each token pair, on ``device`` (transformers makes it on the CPU)."""
    return owner.generate_relative_position_index(window).reshape(-1).to(device)


def beit_bias_rule(module, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """g_i[r, h] = sum of G_i[h, p, q] over the token pairs (p, q) of index r (module doc). ``output_grad``:
    (B, heads, N, N), or (1, heads, N, N) where the batch is one example (not broadcast)."""
    if "relative_position_bias_table" not in trainable:
        return {}
    index = _index(type(module), tuple(module.window_size), output_grad.device)
    return {"relative_position_bias_table": gathered_by_index(output_grad.unsqueeze(1), index,
                                                              module.relative_position_bias_table.shape[0])}


register_forward_rule(BEIT_BIAS_BODY, beit_bias_rule, params=("relative_position_bias_table",), accepts=accepts)
