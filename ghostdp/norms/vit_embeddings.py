"""ViT's embeddings: y = cat(class token, patch embeddings) + position embeddings, then dropout (DeiT's: the class
and distillation tokens, then the patches).

The leading tokens (1, 1, d) and the position embeddings (1, k + N, d) broadcast over the batch, each position once,
so example i's gradients are its output grad itself: G_i (k + N, d) for the positions, its row j for the j-th
leading token (formed per example, nothing summed: no token mass). The patch embeddings are a child (a Conv2d, with its own
rule). The forward's other branches are declined (``plain_call``) and take the exact fallback: mask tokens (the
position embeddings then meet a mix of patch and mask), interpolated positions (bicubic, from the table), and an
active dropout (its mask, which the output grad has not passed through, scales the gradient).

Before 2026-11-27 every call took the fallback, whose batched VJP from masked output grads costs O(B^2) elements:
on a 6-layer d=192 ViT at B=64 (CPU) book-keeping took 1.40x plain with the two trainable, 1.27x with them frozen.
"""
from __future__ import annotations

import torch

from .factors import Instantiated
from .registry import register_forward_rule


def plain_call(module, args, kwargs) -> bool:
    """Whether the call adds the class token and the stored position embeddings, with no mask tokens and no
    active dropout (the branches ``vit_embeddings_rule`` knows)."""
    bool_masked_pos = kwargs["bool_masked_pos"] if "bool_masked_pos" in kwargs else (
        args[1] if len(args) > 1 else None)
    interpolate = kwargs["interpolate_pos_encoding"] if "interpolate_pos_encoding" in kwargs else (
        args[2] if len(args) > 2 else False)
    dropout = module.dropout
    inactive = type(dropout) is torch.nn.Identity or (
        type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training))
    return bool_masked_pos is None and not interpolate and inactive  # as the forward reads them


def leading_tokens_rule(leading: tuple):
    """The rule for embeddings that put the tokens named ``leading`` before the patches, in that order."""

    def rule(module, inputs, output_grad, trainable):
        B = output_grad.shape[0]
        out = {}
        if "position_embeddings" in trainable:
            out["position_embeddings"] = Instantiated(output_grad.unsqueeze(1))
        for row, name in enumerate(leading):
            if name in trainable:
                out[name] = Instantiated(output_grad[:, row:row + 1].unsqueeze(1))
        if "mask_token" in trainable:  # unused by a call without bool_masked_pos
            out["mask_token"] = Instantiated(output_grad.new_zeros((B, *module.mask_token.shape)))
        return out
    return rule


vit_embeddings_rule = leading_tokens_rule(("cls_token",))
deit_embeddings_rule = leading_tokens_rule(("cls_token", "distillation_token"))


# ViT's and ViT-MSN's: registered by its code (registry.register_forward_rule).
VIT_EMBEDDINGS_BODY = (
    "batch_size, num_channels, height, width = pixel_values.shape ; embeddings = self.patch_embeddings(pixel_values) "
    "; if bool_masked_pos is not None:\n    seq_length = embeddings.shape[1]\n    mask_tokens = self.mask_token.expand("
    "batch_size, seq_length, -1)\n    mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)\n    embeddings = "
    "embeddings * (1.0 - mask) + mask_tokens * mask ; cls_tokens = self.cls_token.expand(batch_size, -1, -1) ; "
    "embeddings = torch.cat((cls_tokens, embeddings), dim=1) ; if interpolate_pos_encoding:\n    embeddings = "
    "embeddings + self.interpolate_pos_encoding(embeddings, height, width)\nelse:\n    if height != "
    "self.image_size[0] or width != self.image_size[1]:\n        raise ValueError(f\"Input image size ({height}*"
    "{width}) doesn't match model ({self.image_size[0]}*{self.image_size[1]}).\")\n    embeddings = embeddings + "
    "self.position_embeddings ; embeddings = self.dropout(embeddings) ; return embeddings")
register_forward_rule(VIT_EMBEDDINGS_BODY, vit_embeddings_rule, params=("cls_token", "position_embeddings",
                                                                        "mask_token"), accepts=plain_call)
# DeiT's: the class and distillation tokens before the patches.
DEIT_EMBEDDINGS_BODY = (
    "_, _, height, width = pixel_values.shape ; embeddings = self.patch_embeddings(pixel_values) ; batch_size, "
    "seq_length, _ = embeddings.size() ; if bool_masked_pos is not None:\n    mask_tokens = self.mask_token.expand("
    "batch_size, seq_length, -1)\n    mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)\n    embeddings = "
    "embeddings * (1.0 - mask) + mask_tokens * mask ; cls_tokens = self.cls_token.expand(batch_size, -1, -1) ; "
    "distillation_tokens = self.distillation_token.expand(batch_size, -1, -1) ; embeddings = torch.cat((cls_tokens, "
    "distillation_tokens, embeddings), dim=1) ; if interpolate_pos_encoding:\n    embeddings = embeddings + "
    "self.interpolate_pos_encoding(embeddings, height, width)\nelse:\n    if height != self.image_size[0] or width "
    "!= self.image_size[1]:\n        raise ValueError(f\"Input image size ({height}*{width}) doesn't match model "
    "({self.image_size[0]}*{self.image_size[1]}).\")\n    embeddings = embeddings + self.position_embeddings ; "
    "embeddings = self.dropout(embeddings) ; return embeddings")
register_forward_rule(DEIT_EMBEDDINGS_BODY, deit_embeddings_rule,
                      params=("cls_token", "distillation_token", "position_embeddings", "mask_token"),
                      accepts=plain_call)
