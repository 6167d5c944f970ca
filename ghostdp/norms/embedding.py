"""torch.nn.Embedding: rows indexed by the input ids get the output grads."""
from __future__ import annotations

import torch

from .factors import EmbeddingGather
from .registry import register_norm_rule


@register_norm_rule(torch.nn.Embedding)
def embedding_rule(module, inputs, output_grad, trainable):
    if "weight" not in trainable:
        return {}
    ids = inputs[0]
    return {"weight": EmbeddingGather(ids, output_grad, module.num_embeddings, module.padding_idx)}
