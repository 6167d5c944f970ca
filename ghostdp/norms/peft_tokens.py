"""peft's trainable tokens (``peft.tuners.trainable_tokens.layer.TrainableTokensLayer`` on an embedding): new rows for
some tokens of a frozen table, often the special tokens of a chat template. Registered by qualified name, so
``import ghostdp`` imports no peft module; a call the rule does not know takes the exact fallback.

The forward looks the ids up in the base table with each active adapter's rows ``trainable_tokens_delta`` (n, d)
written over the rows ``token_indices`` (F.embedding, times the base's ``embed_scale`` where it has one), so
example i's gradient of an adapter's rows is an EmbeddingGather of its positions that hold one of those tokens:
row j gets sum_t [x_t = index_j] G_t, the positions at the base's padding_idx dropped, as F.embedding's backward drops
them. The other positions are given row 0 and a zero G (their rows carry no gradient). Until 2026-12-03 the layer
took the fallback, a batched VJP of its whole lookup (tiny BERT, L=2, H=64, B=16, T=32, 30 trainable tokens, one CPU
thread: book-keeping 2.04x plain). A subclass of nn.Embedding is fine: peft looks its weight up itself, not through
its forward. Declined (``_looks_up_tokens``): adapters disabled or merged, other arguments, a base that is not an
nn.Embedding (a tied LM head's Linear) or one with max_norm, scale_grad_by_freq or sparse gradients.
"""
from __future__ import annotations

import torch

from .factors import EmbeddingGather
from .peft_layers import plain_adapted_call
from .registry import register_norm_rule

TRAINABLE_TOKENS = "peft.tuners.trainable_tokens.layer.TrainableTokensLayer"


def _token_parameters(module) -> frozenset:
    return frozenset(f"trainable_tokens_delta.{adapter}" for adapter in module.trainable_tokens_delta)


def _looks_up_tokens(module, args, kwargs) -> bool:
    """Whether this call looks ids up in the table with the adapters' rows written in, as the rule assumes."""
    base = module.get_base_layer()
    return (plain_adapted_call(module, args, kwargs) and isinstance(base, torch.nn.Embedding)
            and base.max_norm is None and not base.scale_grad_by_freq and not base.sparse)


@register_norm_rule(TRAINABLE_TOKENS, params=_token_parameters, tokenwise=True, accepts=_looks_up_tokens)
def trainable_tokens_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                          trainable: set[str]) -> dict:
    ids = inputs[0]
    base = module.get_base_layer()
    scale = module._get_embed_scale()
    grads = output_grad if scale is None else output_grad * scale.to(output_grad.dtype)
    factors = {}
    for adapter in module.active_adapters:
        name = f"trainable_tokens_delta.{adapter}"
        if adapter not in module.trainable_tokens_delta or name not in trainable:
            continue
        rows = module.trainable_tokens_delta[adapter]  # (n, d)
        index = torch.as_tensor(module.token_indices[adapter], device=ids.device)
        row_of = torch.full((base.num_embeddings,), -1, dtype=torch.long, device=ids.device)
        row_of[index] = torch.arange(len(index), device=ids.device)
        looked_up = row_of[ids]  # each position's row of the adapter, or -1
        kept = looked_up >= 0
        if base.padding_idx is not None:
            kept &= ids != base.padding_idx
        kept_grads = torch.where(kept.unsqueeze(-1), grads.to(rows.dtype), 0)
        factors[name] = EmbeddingGather(looked_up.clamp(min=0), kept_grads, rows.shape[0])
    return factors
