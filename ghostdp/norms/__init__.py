"""Per-layer norm rules: one file per layer family, one registry."""
from . import (beit_bias, conv, conv_transpose, elementwise, embedding, experts,  # noqa: F401  (registers rules)
               linear, normalization, peft_deltas, peft_lora, peft_lycoris, peft_prompt, peft_rotations,
               peft_tokens, vit_embeddings, window_bias)
from .factors import (PerExampleGrad, Instantiated, OuterProduct, EmbeddingGather, RaggedEmbeddingGather,
                      combined_sq_norm)
from .registry import find_norm_rule, register_norm_rule

__all__ = ["register_norm_rule", "find_norm_rule", "PerExampleGrad", "Instantiated", "OuterProduct",
           "EmbeddingGather", "RaggedEmbeddingGather", "combined_sq_norm"]
