"""Embeddings: rows indexed by the input ids get the output grads.

torch.nn.Embedding: y_t = E[x_t], so g_i = sum_t e_{x_t} G_t^T (an EmbeddingGather).
transformers' scaled word embeddings (Gemma, BART, M2M100, ...): y_t = E[x_t] * s with s =
``embed_scale`` (Gemma's casts it to the weight's dtype first), so g_i = sum_t e_{x_t} (s G_t)^T.
transformers' learned positional embeddings (BART, mBART, PLBart, MVP, TrOCR; OPT, BioGPT): nn.Embedding's
lookup of position ids that the forward forms from its arguments (an arange, or the attention mask's cumulative
sum) plus an offset; the rule reads those ids, formed as the forward forms them (``RuleEntry.rule_inputs``).
Before 2026-11-27 they took the exact fallback, whose batched VJP instantiates every example's gradient of the
whole table (B x 1026 x d for BART, B x 2050 x d for OPT) from masked output grads of B^2 T d elements. LED's and
Blenderbot's look an arange up with no batch dim, (T, d), added to the (B, T, d) embeddings: the recorder gives that
output a batch dim (RuleEntry.unbatched_output), and the same rule reads it (since 2026-11-28; refused before).
torch.nn.EmbeddingBag in modes "sum" and "mean": each output row (a bag) is a weighted sum of rows, so an
EmbeddingGather of the bag's ids with the bag's output grad scaled per member (since 2026-11-27; the fallback's
before); a 1-D input's positions, each with its bag, in a RaggedEmbeddingGather. Mode "max" (since 2026-11-28;
the fallback's before): feature d of bag b is row m_bd's, the one torch's forward picked (its max_indices, which
its backward reads), so g_b = sum_d e_{m_bd} (G_bd e_d)^T: the same factors, each member's output grad masked to
the features its row won (at the member that first holds that row, so that a row repeated in a bag counts once).
"""
from __future__ import annotations

import torch

from .factors import EmbeddingGather, RaggedEmbeddingGather
from .registry import call_arguments, qualified_name, register_forward_rule, register_norm_rule


def _holds_output_grad(module, inputs, output, trainable) -> bool:
    """Book-keeping keeps G itself in the EmbeddingGather (the scaled rules below keep s G, a copy: not these)."""
    return "weight" in trainable


@register_norm_rule(torch.nn.Embedding, params=("weight",), tokenwise=True, holds_output_grad=_holds_output_grad)
def embedding_rule(module: torch.nn.Embedding, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                   trainable: set[str]) -> dict:
    if "weight" not in trainable:
        return {}
    return {"weight": EmbeddingGather(inputs[0], output_grad, module.num_embeddings, module.padding_idx)}


def scaled_embedding_rule(module: torch.nn.Embedding, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                          trainable: set[str]) -> dict:
    return embedding_rule(module, inputs, output_grad * module.embed_scale, trainable)


def cast_scaled_embedding_rule(module: torch.nn.Embedding, inputs: tuple[torch.Tensor, ...],
                               output_grad: torch.Tensor, trainable: set[str]) -> dict:
    return embedding_rule(module, inputs, output_grad * module.embed_scale.to(module.weight.dtype), trainable)


# Registered by their code (registry.register_forward_rule): a name list went stale with each release (Gemma 4's and
# 6 other classes with one of these two forwards took the fallback, a per-example VJP over the whole vocabulary's
# table).
SCALED_EMBEDDING_BODY = "return super().forward(input_ids) * self.embed_scale"
CAST_SCALED_EMBEDDING_BODY = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"
register_forward_rule(SCALED_EMBEDDING_BODY, scaled_embedding_rule, params=("weight",), tokenwise=True,
                      base=torch.nn.Embedding)
register_forward_rule(CAST_SCALED_EMBEDDING_BODY, cast_scaled_embedding_rule, params=("weight",), tokenwise=True,
                      base=torch.nn.Embedding)


def arange_positions(module, args, kwargs, output=None) -> tuple:
    """The ids BART's positional embedding looks up, formed as its forward (ARANGE_POSITIONS_BODY) forms them."""
    arguments = call_arguments(module, args, kwargs)
    position_ids = arguments["position_ids"]
    if position_ids is None:
        bsz, seq_len = arguments["input_ids"].shape[:2]
        start = arguments["cache_length"]
        position_ids = torch.arange(start, start + seq_len, dtype=torch.long, device=module.weight.device)
        position_ids = position_ids.expand(bsz, -1)
    else:
        position_ids = position_ids.unsqueeze(0)
    return (position_ids + module.offset,)


def mask_positions(module, args, kwargs, output=None) -> tuple:
    """The ids OPT's positional embedding looks up, formed as its forward (MASK_POSITIONS_BODY) forms them."""
    arguments = call_arguments(module, args, kwargs)
    position_ids = arguments["position_ids"]
    if position_ids is None:
        attention_mask = arguments["attention_mask"]
        position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
        position_ids = position_ids[:, arguments["cache_length"]:]
    return (position_ids + module.offset,)


# BART's, mBART's, PLBart's, MVP's, TrOCR's and PP-FormulaNet's (tests/norms/test_positional_embeddings.py lists them
# from transformers' source).
ARANGE_POSITIONS_BODY = (
    "if position_ids is None:\n    bsz, seq_len = input_ids.shape[:2]\n    position_ids = torch.arange(cache_length, "
    "cache_length + seq_len, dtype=torch.long, device=self.weight.device).expand(bsz, -1)\nelse:\n    position_ids = "
    "position_ids.unsqueeze(0) ; return super().forward(position_ids + self.offset)")
# OPT's and BioGPT's.
MASK_POSITIONS_BODY = (
    "if position_ids is None:\n    position_ids = torch.cumsum(attention_mask, dim=1)\n    position_ids = "
    "(position_ids * attention_mask - 1).long()\n    position_ids = position_ids[:, cache_length:] ; return "
    "super().forward(position_ids + self.offset)")
for _body, _positions in ((ARANGE_POSITIONS_BODY, arange_positions), (MASK_POSITIONS_BODY, mask_positions)):
    register_forward_rule(_body, embedding_rule, params=("weight",), tokenwise=True, base=torch.nn.Embedding,
                          rule_inputs=_positions)


def shape_positions(module, args, kwargs, output=None) -> tuple:
    """The ids LED's and Blenderbot's positional embeddings look up, formed as their forwards (UNBATCHED_POSITIONS_BODY,
    GIVEN_OR_UNBATCHED_POSITIONS_BODY) form them: an arange over the input's shape, (1, positions) here, where
    their output (positions, d) has no batch dim (the recorder gives it one: RuleEntry.unbatched_output); the ids
    given, where a caller passes them."""
    arguments = call_arguments(module, args, kwargs)
    position_ids = arguments.get("position_ids")
    if position_ids is None:
        seq_len, start = arguments["input_ids_shape"][1], arguments["cache_length"]
        position_ids = torch.arange(start, start + seq_len, dtype=torch.long, device=module.weight.device)
    return (position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids,)


# LED's learned positions, and Blenderbot's, BlenderbotSmall's and BigBird-Pegasus' (which take ids too: the
# decoder's arange): an arange over the input's shape, looked up with no batch dim, an output (positions, d) that
# their encoders and decoders add to the (B, positions, d) embeddings. Until 2026-11-28 the layout proof refused a
# trained table (no dim of the output holds the examples); BigBird-Pegasus' until 2026-12-08 (not in the list).
# Pegasus', Marian's, RoFormer's and the time-series models' sinusoidal tables have the second body too, but
# RoFormer reads its output as 2-D: only the classes whose callers add it to the embeddings take the rule
# (``adds_positions_to_embeddings``); the others keep the fallback (their tables are frozen by default).
UNBATCHED_POSITIONS_BODY = (
    "bsz, seq_len = input_ids_shape[:2] ; positions = torch.arange(cache_length, cache_length + seq_len, "
    "dtype=torch.long, device=self.weight.device) ; return super().forward(positions)")
GIVEN_OR_UNBATCHED_POSITIONS_BODY = (
    "if position_ids is None:\n    bsz, seq_len = input_ids_shape[:2]\n    position_ids = torch.arange(cache_length, "
    "cache_length + seq_len, dtype=torch.long, device=self.weight.device) ; return super().forward(position_ids)")
POSITIONS_ADDED_TO_EMBEDDINGS = frozenset(f"transformers.models.{name}" for name in (
    "led.modeling_led.LEDLearnedPositionalEmbedding",
    "blenderbot.modeling_blenderbot.BlenderbotLearnedPositionalEmbedding",
    "blenderbot_small.modeling_blenderbot_small.BlenderbotSmallLearnedPositionalEmbedding",
    "bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusLearnedPositionalEmbedding"))


def adds_positions_to_embeddings(module, args, kwargs) -> bool:
    """Whether the module is one of the classes whose callers add its output to the (B, positions, d) embeddings."""
    return qualified_name(type(module)) in POSITIONS_ADDED_TO_EMBEDDINGS


for _body in (UNBATCHED_POSITIONS_BODY, GIVEN_OR_UNBATCHED_POSITIONS_BODY):
    register_forward_rule(_body, embedding_rule, params=("weight",), tokenwise=True, base=torch.nn.Embedding,
                          accepts=adds_positions_to_embeddings, rule_inputs=shape_positions, unbatched_output=True)


def bag_members(module, args, kwargs, output=None) -> tuple:
    """The rows an nn.EmbeddingBag call reduces into each output row (a bag) and the factor each row enters with (its
    per_sample_weight in mode "sum", 1 / the bag's size in "mean"; 0 where the row is the padding_idx, which torch
    leaves out of the reduction and its count; in mode "max", per feature: ``max_winners``). A 2-D input, one bag per
    row: (ids, scales), each (bags, length), scales (bags, length, features) in mode "max".
    A 1-D input cut into bags at ``offsets``: (ids, scales, bag), each (n,), ``bag`` each position's bag, found by a
    search of the offsets (the number of bags, scale 0, for a position at or after offsets[-1] with
    include_last_offset, which torch requires to be the input's length; its float32 kernels leave such positions
    out, its float64 ones add them to the last bag): no shape depends on the bags' sizes, so nothing waits for the
    device (until 2026-11-28 the bags were padded to the longest, which was read back: a host sync in each forward
    on a GPU)."""
    arguments = call_arguments(module, args, kwargs)
    ids, offsets, weights = arguments["input"], arguments["offsets"], arguments["per_sample_weights"]
    bag = None
    if ids.dim() == 2:
        scales = torch.ones(ids.shape, device=ids.device) if weights is None else weights
    else:
        bags = offsets.shape[0] - 1 if module.include_last_offset else offsets.shape[0]
        position = torch.arange(ids.shape[0], device=ids.device)
        bag = torch.searchsorted(offsets[:bags], position, right=True) - 1  # the last bag starting at or before it
        inside = bag >= 0
        if module.include_last_offset:
            inside = inside & (position < offsets[-1])
        bag = torch.where(inside, bag, bags)
        scales = torch.ones(ids.shape, device=ids.device) if weights is None else weights
        scales = torch.where(inside, scales, 0)
    if module.padding_idx is not None:
        scales = scales * (ids != module.padding_idx)
    if module.mode == "mean":  # (no per_sample_weights in "mean")
        if bag is None:
            scales = scales / (scales != 0).sum(1, keepdim=True).clamp(min=1)
        else:
            counts = torch.zeros(bags + 1, dtype=scales.dtype, device=ids.device).index_add_(
                0, bag, (scales != 0).to(scales.dtype))
            scales = scales / counts.clamp(min=1)[bag]
    if module.mode == "max":
        scales = max_winners(module, ids, offsets, bag, scales != 0)
    scales = scales.to(module.weight.dtype)
    return (ids, scales) if bag is None else (ids, scales, bag)


def max_winners(module, ids, offsets, bag, counted) -> torch.Tensor:
    """(*ids.shape, features) bool: whether feature d of a member's bag is the member's row's, the row that torch's
    forward picked (the max_indices of torch.embedding_bag, run again without gradient: the rows its backward adds
    G to; empty bags add nothing), at the first member of the bag holding that row (a repeated row counts once).
    ``counted``: the members in the reduction (not the padding_idx, inside a bag); ``bag``: a 1-D input's bag of
    each position (bag_members), None for a 2-D input's rows."""
    flat = ids.reshape(-1)
    if bag is None:  # 2-D: one bag per row, starting every `length` positions
        bags, length = ids.shape
        member_of = torch.arange(bags, device=ids.device).unsqueeze(1).expand(bags, length).reshape(-1)
        starts, last = torch.arange(0, bags * length, max(length, 1), device=ids.device), False
    else:
        member_of, starts, last = bag, offsets, module.include_last_offset
    with torch.no_grad():
        picked = torch.embedding_bag(module.weight, flat, starts, False, 2, False, None, last, module.padding_idx)[3]
    if picked.shape[0] == 0:
        return torch.zeros(*ids.shape, module.embedding_dim, dtype=torch.bool, device=ids.device)
    # First member of each (bag, row): sorted stably by that key, a member is first where its key differs from the
    # one before it (no op whose size depends on the values).
    key = member_of * module.num_embeddings + flat
    sorted_key, order = torch.sort(key, stable=True)
    first_sorted = torch.ones_like(sorted_key, dtype=torch.bool)
    first_sorted[1:] = sorted_key[1:] != sorted_key[:-1]
    first = torch.empty_like(first_sorted).scatter_(0, order, first_sorted)
    won = flat.unsqueeze(-1) == picked[member_of.clamp(max=picked.shape[0] - 1)]  # (positions, features)
    return (won & (first & counted.reshape(-1)).unsqueeze(-1)).reshape(*ids.shape, -1)


def embedding_bag_rule(module: torch.nn.EmbeddingBag, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                       trainable: set[str]) -> dict:
    """Output row b = sum_t s_bt E[x_bt] (bag_members), so g_b = sum_t e_{x_bt} (s_bt G_b)^T: an EmbeddingGather of
    the bag's rows, each with its scaled output grad (a 1-D input's: a RaggedEmbeddingGather of its positions). In
    mode "max" s_bt is per feature (max_winners): g_b = sum_t e_{x_bt} (s_bt ⊙ G_b)^T."""
    if "weight" not in trainable:
        return {}
    if len(inputs) == 2:
        ids, scales = inputs
        scales = scales if scales.dim() > ids.dim() else scales.unsqueeze(-1)  # (bags, length, 1 or features)
        grads = output_grad.unsqueeze(1) * scales.to(output_grad.dtype)
        return {"weight": EmbeddingGather(ids, grads, module.num_embeddings)}
    ids, scales, bag = inputs
    scales = scales if scales.dim() > ids.dim() else scales.unsqueeze(-1)
    bags = output_grad.shape[0]
    inside = (bag < bags).unsqueeze(-1)
    rows = output_grad[bag.clamp(max=bags - 1)] if bags else output_grad.new_zeros(ids.shape[0], output_grad.shape[-1])
    # where, not a product: a position of no bag reads another bag's row, which may hold inf
    grads = torch.where(inside, rows * scales.to(output_grad.dtype), 0)
    return {"weight": RaggedEmbeddingGather(ids, grads, bag, bags, module.num_embeddings)}


# Its arguments read by name (offsets and per_sample_weights may come by keyword).
register_norm_rule(torch.nn.EmbeddingBag, embedding_bag_rule, params=("weight",), rule_inputs=bag_members)
