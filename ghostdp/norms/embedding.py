"""Embeddings: rows indexed by the input ids get the output grads.

torch.nn.Embedding: y_t = E[x_t], so g_i = sum_t e_{x_t} G_t^T (an EmbeddingGather).
transformers' scaled word embeddings (Gemma, BART, M2M100, ...): y_t = E[x_t] * s with s =
``embed_scale`` (Gemma's casts it to the weight's dtype first), so g_i = sum_t e_{x_t} (s G_t)^T.
"""
from __future__ import annotations

import torch

from .factors import EmbeddingGather
from .registry import register_norm_rule


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


# Each forward is `return super().forward(input_ids) * self.embed_scale` (cast: `.to(self.weight.dtype)`);
# tests/norms/test_embedding.py checks that against transformers' source.
SCALED_EMBEDDINGS_CASTING = [
    "gemma.modeling_gemma.GemmaTextScaledWordEmbedding", "gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding",
    "gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding", "gemma3n.modeling_gemma3n.Gemma3nTextScaledWordEmbedding",
    "vaultgemma.modeling_vaultgemma.VaultGemmaTextScaledWordEmbedding",
    "minicpm3.modeling_minicpm3.MiniCPM3ScaledWordEmbedding",
]
SCALED_EMBEDDINGS = [
    "bart.modeling_bart.BartScaledWordEmbedding", "mbart.modeling_mbart.MBartScaledWordEmbedding",
    "m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding", "plbart.modeling_plbart.PLBartScaledWordEmbedding",
    "nllb_moe.modeling_nllb_moe.NllbMoeScaledWordEmbedding", "biogpt.modeling_biogpt.BioGptScaledWordEmbedding",
    "blenderbot.modeling_blenderbot.BlenderbotScaledWordEmbedding", "xglm.modeling_xglm.XGLMScaledWordEmbedding",
    "bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusScaledWordEmbedding",
    "pegasus_x.modeling_pegasus_x.PegasusXScaledWordEmbedding", "trocr.modeling_trocr.TrOCRScaledWordEmbedding",
]
for _names, _rule in ((SCALED_EMBEDDINGS_CASTING, cast_scaled_embedding_rule), (SCALED_EMBEDDINGS, scaled_embedding_rule)):
    for _name in _names:
        register_norm_rule(f"transformers.models.{_name}", _rule, params=("weight",), tokenwise=True)
