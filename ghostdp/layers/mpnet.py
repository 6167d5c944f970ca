"""MPNet's encoder with its relative attention bias looked up for each example.

transformers' MPNetEncoder looks its relative attention bias up once for the batch, ``relative_attention_bias`` (an
nn.Embedding) of the (q, k) buckets, and expands the (1, heads, q, k) bias to every example itself: no call of the
table holds an example's gradient, so ghostdp refused it, naming the freeze (its bias is the whole encoder's, which
no fallback could own cheaply).

``MPNetEncoder`` here runs transformers' own ``forward`` on the same children (its function, called on this module)
and computes the bias as ``compute_position_bias`` does, but looks the buckets up as a batch of one, (1, q, k), whose
output ghostdp's recorder broadcasts to the batch (as for T5's bias: norms/relative_bias.py): the table's call then
has an output grad per example, over every layer's use of the bias, and the Embedding rule forms each example's
gradient. The values are compute_position_bias's; tests/layers/test_mpnet.py checks the outputs against
transformers' in float64. ``validate.fix`` swaps every MPNetEncoder whose code is the one written here for this
module (layers/twins.py); state_dict keys are unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from ..norms.registry import has_bodies
from .taken_over import TakenOver, twin

TRANSFORMERS_CLASS = "transformers.models.mpnet.modeling_mpnet.MPNetEncoder"
WHY = ("looks its relative attention bias up once for the batch and expands it to every example itself, so no call "
       "of the table holds an example's gradient")

# The bodies (registry.forward_body) of transformers' MPNetEncoder methods: forward runs as it is,
# compute_position_bias is computed again (a lookup of a batch of one).
FORWARD_BODY = (
    'position_bias = self.compute_position_bias(hidden_states) ; all_hidden_states = () if output_hidden_'
    'states else None ; all_attentions = () if output_attentions else None ; for i, layer_module in enume'
    'rate(self.layer):\n    if output_hidden_states:\n        all_hidden_states = all_hidden_states + (hidd'
    'en_states,)\n    layer_outputs = layer_module(hidden_states, attention_mask, position_bias, output_at'
    'tentions=output_attentions, **kwargs)\n    hidden_states = layer_outputs[0]\n    if output_attentions:'
    '\n        all_attentions = all_attentions + (layer_outputs[1],) ; if output_hidden_states:\n    all_hi'
    'dden_states = all_hidden_states + (hidden_states,) ; if not return_dict:\n    return tuple((v for v i'
    'n [hidden_states, all_hidden_states, all_attentions] if v is not None)) ; return BaseModelOutput(las'
    't_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=all_attentions)')

POSITION_BIAS_BODY = (
    'bsz, qlen, klen = (x.size(0), x.size(1), x.size(1)) ; if position_ids is not None:\n    context_posit'
    'ion = position_ids[:, :, None]\n    memory_position = position_ids[:, None, :]\nelse:\n    context_posi'
    'tion = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]\n    memory_position = torch.ar'
    'ange(klen, dtype=torch.long, device=x.device)[None, :] ; relative_position = memory_position - conte'
    'xt_position ; rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets) '
    '; values = self.relative_attention_bias(rp_bucket) ; values = values.permute([2, 0, 1]).unsqueeze(0)'
    ' ; values = values.expand((bsz, -1, qlen, klen)).contiguous() ; return values')
_KNOWN_BODIES = {"forward": FORWARD_BODY, "compute_position_bias": POSITION_BIAS_BODY}


def has_known_code(module: nn.Module) -> bool:
    """Whether the methods of ``module``'s class that MPNetEncoder runs or computes again have the code written here."""
    return has_bodies(type(module), _KNOWN_BODIES.items())


class MPNetEncoder(TakenOver):
    """transformers' MPNetEncoder (same outputs and state_dict keys) whose relative attention bias is looked up as a
    batch of one (module doc). Build it with ``from_transformers``."""

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        """(B, heads, q, k): compute_position_bias's values, from one lookup of a batch of one (or of each example's
        positions, where ``position_ids`` are given)."""
        bsz, qlen, klen = x.size(0), x.size(1), x.size(1)
        if position_ids is not None:
            context_position = position_ids[:, :, None]
            memory_position = position_ids[:, None, :]
        else:
            context_position = torch.arange(qlen, dtype=torch.long, device=x.device)[:, None]
            memory_position = torch.arange(klen, dtype=torch.long, device=x.device)[None, :]
        buckets = self._code.relative_position_bucket(memory_position - context_position, num_buckets=num_buckets)
        if buckets.dim() == 2:
            buckets = buckets.unsqueeze(0)  # (1, q, k): broadcast to the batch by ghostdp where it records
        values = self.relative_attention_bias(buckets).permute([0, 3, 1, 2])  # (1 or B, heads, q, k)
        return values.expand((bsz, -1, qlen, klen)).contiguous()


def from_transformers(module: nn.Module) -> MPNetEncoder:
    """The ghostdp module for a transformers MPNetEncoder with the code written here."""
    return twin(MPNetEncoder, module, TRANSFORMERS_CLASS, has_known_code, "MPNetEncoder")
