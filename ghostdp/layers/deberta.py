"""DeBERTa-v2's and v3's disentangled self-attention with its relative position projections per example.

transformers' DisentangledSelfAttention projects the relative position embeddings (``rel_embeddings``, (2k, d),
shared by the batch) once, with the attention's own ``query_proj`` and ``key_proj`` (``share_att_key``: DeBERTa-v3)
or ``pos_query_proj`` and ``pos_key_proj``, and repeats each projection for every example itself
(``.repeat(B, 1, 1)``). ghostdp broadcasts those calls' outputs of batch size 1 to the batch (as a position
embedding's), and the repeat then made B^2 copies: the model's forward failed, and the fix was to freeze every
layer's query and key projections (with share_att_key) or position projections.

``DisentangledSelfAttention`` here runs transformers' own ``forward`` and ``transpose_for_scores`` on the same
children (their functions, called on this module) and forms the relative position bias as transformers'
``disentangled_attention_bias`` does, but repeats a projection only where it has one row for the batch: where
ghostdp broadcast it, it already has a row per example, so each projection's call on the relative embeddings has an
output grad per example and the Linear rule forms its per-example gradient (beside the same projection's call on
the tokens: a parameter called twice, cross terms included). The projections are computed once for the batch as
before; only the views differ. The relative embeddings themselves and the encoder's LayerNorm over them stay shared
by the batch (their gradient is the batch's sum): freeze ``encoder.rel_embeddings`` and ``encoder.LayerNorm``, as
the refusal says. tests/layers/test_deberta.py checks the outputs against transformers' in float64.
``validate.fix`` swaps every DisentangledSelfAttention whose code is the one written here for this module
(layers/twins.py); state_dict keys are unchanged.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..norms.registry import has_bodies, is_instance_of
from .taken_over import TakenOver, twin

TRANSFORMERS_CLASS = "transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention"
WHY = ("projects the relative position embeddings once for the batch and repeats the projections for every example "
       "itself, which makes B^2 copies of ghostdp's per-example views")

# The bodies (registry.forward_body) of transformers' methods: forward and transpose_for_scores run as they are,
# disentangled_attention_bias is computed again (its repeats made conditional).
FORWARD_BODY = (
    'if query_states is None:\n    query_states = hidden_states ; query_layer = self.transpose_for_scores('
    'self.query_proj(query_states), self.num_attention_heads) ; key_layer = self.transpose_for_scores(sel'
    'f.key_proj(hidden_states), self.num_attention_heads) ; value_layer = self.transpose_for_scores(self.'
    "value_proj(hidden_states), self.num_attention_heads) ; rel_att = None ; scale_factor = 1 ; if 'c2p' "
    "in self.pos_att_type:\n    scale_factor += 1 ; if 'p2c' in self.pos_att_type:\n    scale_factor += 1 ;"
    ' scale = scaled_size_sqrt(query_layer, scale_factor) ; attention_scores = torch.bmm(query_layer, key'
    '_layer.transpose(-1, -2) / scale.to(dtype=query_layer.dtype)) ; if self.relative_attention:\n    rel_'
    'embeddings = self.pos_dropout(rel_embeddings)\n    rel_att = self.disentangled_attention_bias(query_l'
    'ayer, key_layer, relative_pos, rel_embeddings, scale_factor) ; if rel_att is not None:\n    attention'
    '_scores = attention_scores + rel_att ; attention_scores = attention_scores.view(-1, self.num_attenti'
    'on_heads, attention_scores.size(-2), attention_scores.size(-1)) ; attention_mask = attention_mask.bo'
    'ol() ; attention_scores = attention_scores.masked_fill(~attention_mask, torch.finfo(query_layer.dtyp'
    'e).min) ; attention_probs = nn.functional.softmax(attention_scores, dim=-1) ; attention_probs = self'
    '.dropout(attention_probs) ; context_layer = torch.bmm(attention_probs.view(-1, attention_probs.size('
    '-2), attention_probs.size(-1)), value_layer) ; context_layer = context_layer.view(-1, self.num_atten'
    'tion_heads, context_layer.size(-2), context_layer.size(-1)).permute(0, 2, 1, 3).contiguous() ; new_c'
    'ontext_layer_shape = context_layer.size()[:-2] + (-1,) ; context_layer = context_layer.view(new_cont'
    'ext_layer_shape) ; if not output_attentions:\n    return (context_layer, None) ; return (context_laye'
    'r, attention_probs)')

TRANSPOSE_BODY = (
    'new_x_shape = x.size()[:-1] + (attention_heads, -1) ; x = x.view(new_x_shape) ; return x.permute(0, '
    '2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))')

BIAS_BODY = (
    'if relative_pos is None:\n    relative_pos = build_relative_position(query_layer, key_layer, bucket_s'
    'ize=self.position_buckets, max_position=self.max_relative_positions) ; if relative_pos.dim() == 2:\n '
    '   relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)\nelif relative_pos.dim() == 3:\n    relative_'
    "pos = relative_pos.unsqueeze(1)\nelif relative_pos.dim() != 4:\n    raise ValueError(f'Relative positi"
    "on ids must be of dim 2 or 3 or 4. {relative_pos.dim()}') ; att_span = self.pos_ebd_size ; relative_"
    'pos = relative_pos.to(device=query_layer.device, dtype=torch.long) ; rel_embeddings = rel_embeddings'
    '[0:att_span * 2, :].unsqueeze(0) ; if self.share_att_key:\n    pos_query_layer = self.transpose_for_s'
    'cores(self.query_proj(rel_embeddings), self.num_attention_heads).repeat(query_layer.size(0) // self.'
    'num_attention_heads, 1, 1)\n    pos_key_layer = self.transpose_for_scores(self.key_proj(rel_embedding'
    's), self.num_attention_heads).repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)\nelse:\n  '
    "  if 'c2p' in self.pos_att_type:\n        pos_key_layer = self.transpose_for_scores(self.pos_key_proj"
    '(rel_embeddings), self.num_attention_heads).repeat(query_layer.size(0) // self.num_attention_heads, '
    "1, 1)\n    if 'p2c' in self.pos_att_type:\n        pos_query_layer = self.transpose_for_scores(self.po"
    's_query_proj(rel_embeddings), self.num_attention_heads).repeat(query_layer.size(0) // self.num_atten'
    "tion_heads, 1, 1) ; score = 0 ; if 'c2p' in self.pos_att_type:\n    scale = scaled_size_sqrt(pos_key_"
    'layer, scale_factor)\n    c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))\n    c2p_p'
    'os = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)\n    c2p_att = torch.gather(c2p_att, d'
    'im=-1, index=c2p_pos.squeeze(0).expand([query_layer.size(0), query_layer.size(1), relative_pos.size('
    "-1)]))\n    score += c2p_att / scale.to(dtype=c2p_att.dtype) ; if 'p2c' in self.pos_att_type:\n    sca"
    'le = scaled_size_sqrt(pos_query_layer, scale_factor)\n    r_pos = build_rpos(query_layer, key_layer, '
    'relative_pos, self.max_relative_positions, self.position_buckets)\n    p2c_pos = torch.clamp(-r_pos +'
    ' att_span, 0, att_span * 2 - 1)\n    p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2)'
    ')\n    p2c_att = torch.gather(p2c_att, dim=-1, index=p2c_pos.squeeze(0).expand([query_layer.size(0), '
    'key_layer.size(-2), key_layer.size(-2)])).transpose(-1, -2)\n    score += p2c_att / scale.to(dtype=p2'
    'c_att.dtype) ; return score')
ENCODER_CLASS = "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder"
SHARED = (
    "ghostdp: DeBERTa-v2's encoder reads its relative position embeddings' table directly and normalises it once for "
    "the whole batch, so the gradient of {names} is the batch's sum, and a step is refused. Fix: freeze them "
    "(requires_grad_(False)); ghostdp.validate.fix(model) lets every attention's query and key (or position) "
    "projections train (ghostdp.layers.deberta).")


def shared_by_the_batch(model: nn.Module) -> list:
    """The names of the trainable parameters of transformers' DeBERTa-v2 encoders' relative position embeddings and
    of the LayerNorm over them: shared by the batch (module doc)."""
    found = []
    for name, module in model.named_modules():
        if is_instance_of(module, ENCODER_CLASS) and getattr(module, "relative_attention", False):
            for child in ("rel_embeddings", "LayerNorm"):
                if child in module._modules:
                    prefix = f"{name}.{child}" if name else child
                    found += [f"{prefix}.{n}" for n, p in module._modules[child].named_parameters() if p.requires_grad]
    return found


_KNOWN_BODIES = {"forward": FORWARD_BODY, "transpose_for_scores": TRANSPOSE_BODY,
                 "disentangled_attention_bias": BIAS_BODY}


def has_known_code(module: nn.Module) -> bool:
    """Whether the methods of ``module``'s class that DisentangledSelfAttention runs or computes again have the code
    written here."""
    return has_bodies(type(module), _KNOWN_BODIES.items())


class DisentangledSelfAttention(TakenOver):
    """transformers' DeBERTa-v2 DisentangledSelfAttention (same outputs and state_dict keys) whose relative position
    projections keep ghostdp's per-example views (module doc). Build it with ``from_transformers``."""

    def transpose_for_scores(self, x, attention_heads) -> torch.Tensor:
        return self._code.transpose_for_scores(self, x, attention_heads)

    def _positions(self, projection, rel_embeddings, query_layer) -> torch.Tensor:
        """A projection of the relative embeddings by head, (B * heads, 2 span, head size): repeated for each example
        where it has one row for the batch, as transformers repeats it; as it is where ghostdp broadcast it."""
        layer = self.transpose_for_scores(projection(rel_embeddings), self.num_attention_heads)
        if layer.size(0) != query_layer.size(0):
            layer = layer.repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)
        return layer

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        """transformers' disentangled_attention_bias (BIAS_BODY), its projections by ``_positions``."""
        functions = sys.modules[self._code.__module__]  # transformers' build_relative_position, build_rpos, ...
        if relative_pos is None:
            relative_pos = functions.build_relative_position(
                query_layer, key_layer, bucket_size=self.position_buckets, max_position=self.max_relative_positions)
        if relative_pos.dim() == 2:
            relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
        elif relative_pos.dim() == 3:
            relative_pos = relative_pos.unsqueeze(1)
        elif relative_pos.dim() != 4:
            raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
        att_span = self.pos_ebd_size
        relative_pos = relative_pos.to(device=query_layer.device, dtype=torch.long)
        rel_embeddings = rel_embeddings[0:att_span * 2, :].unsqueeze(0)
        if self.share_att_key:
            pos_query_layer = self._positions(self.query_proj, rel_embeddings, query_layer)
            pos_key_layer = self._positions(self.key_proj, rel_embeddings, query_layer)
        else:
            if "c2p" in self.pos_att_type:
                pos_key_layer = self._positions(self.pos_key_proj, rel_embeddings, query_layer)
            if "p2c" in self.pos_att_type:
                pos_query_layer = self._positions(self.pos_query_proj, rel_embeddings, query_layer)
        score = 0
        if "c2p" in self.pos_att_type:
            scale = functions.scaled_size_sqrt(pos_key_layer, scale_factor)
            c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
            c2p_att = torch.gather(c2p_att, dim=-1, index=c2p_pos.squeeze(0).expand(
                [query_layer.size(0), query_layer.size(1), relative_pos.size(-1)]))
            score += c2p_att / scale.to(dtype=c2p_att.dtype)
        if "p2c" in self.pos_att_type:
            scale = functions.scaled_size_sqrt(pos_query_layer, scale_factor)
            # (transformers passes max_relative_positions and position_buckets in this order: kept, for its outputs)
            r_pos = functions.build_rpos(query_layer, key_layer, relative_pos, self.max_relative_positions,
                                         self.position_buckets)
            p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
            p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
            p2c_att = torch.gather(p2c_att, dim=-1, index=p2c_pos.squeeze(0).expand(
                [query_layer.size(0), key_layer.size(-2), key_layer.size(-2)])).transpose(-1, -2)
            score += p2c_att / scale.to(dtype=p2c_att.dtype)
        return score

    def extra_repr(self) -> str:
        return f"heads={self.num_attention_heads}, share_att_key={self.share_att_key}"


def from_transformers(module: nn.Module) -> DisentangledSelfAttention:
    """The ghostdp module for a transformers DeBERTa-v2 DisentangledSelfAttention with the code written here."""
    return twin(DisentangledSelfAttention, module, TRANSFORMERS_CLASS, has_known_code,
                "DeBERTa-v2 DisentangledSelfAttention")
