"""ViT's embeddings: y = cat(class token, patch embeddings) + position embeddings, then dropout (DeiT's: the class
and distillation tokens, then the patches; DINOv2's: the positions through interpolate_pos_encoding, which returns
them as they are for square images with as many patches as positions; DINOv2 with registers': register tokens put
after the class token once the positions are added).

The leading tokens (1, 1, d) and the position embeddings (1, k + N, d) broadcast over the batch, each position once,
so example i's gradients are its output grad itself: G_i (k + N, d) for the positions, its row j for the j-th
leading token (formed per example, nothing summed: no token mass). The patch embeddings are a child (a Conv2d, with
its own rule). The forward's other branches are declined (``plain_call``, DINOv2's ``stored_positions_call``) and
take the exact fallback: mask tokens (the position embeddings then meet a mix of patch and mask), interpolated
positions (bicubic, from the table), and an active dropout (its mask, which the output grad has not passed
through, scales the gradient).

Before 2026-11-27 every call took the fallback, whose batched VJP from masked output grads costs O(B^2) elements:
on a 6-layer d=192 ViT at B=64 (CPU, two threads, interleaved against that day's start) book-keeping went from
1.56x to 1.40x plain and ghost from 1.61x to 1.33x.

CLIP's vision embeddings (and their copies: AltCLIP, Chinese-CLIP, MetaCLIP 2, X-CLIP, GIT, CLIPSeg, BridgeTower,
Kosmos-2; OwlViT's and OWLv2's, without the cast) own only the class embedding, a (d,) vector put before the patches;
the positions are a child Embedding's (its own rule) or interpolated from its table, added to every row. So the class
embedding's per-example gradient is row 0 of G, whichever branch the call took (``class_embedding_rule``).
"""
from __future__ import annotations

import torch

from .factors import Instantiated
from .registry import call_arguments, register_forward_rule


def plain_call(module, args, kwargs) -> bool:
    """Whether the call adds the class token and the stored position embeddings, with no mask tokens and no
    active dropout (the branches ``vit_embeddings_rule`` knows)."""
    arguments = call_arguments(module, args, kwargs)
    return (arguments["bool_masked_pos"] is None and not arguments["interpolate_pos_encoding"]
            and _inactive(module.dropout))  # as the forward reads them


def stored_positions_call(module, args, kwargs) -> bool:
    """DINOv2's: no mask tokens, no active dropout, and the stored position embeddings added as they are:
    interpolate_pos_encoding's early return (not tracing, a square image, as many patches as positions), with the
    patches counted from the patch embeddings' Conv2d."""
    conv = getattr(module.patch_embeddings, "projection", None)
    arguments = call_arguments(module, args, kwargs)
    if arguments["bool_masked_pos"] is not None or not _inactive(module.dropout) or torch.jit.is_tracing():
        return False
    if module.position_embeddings is None:
        return True
    if type(conv) is not torch.nn.Conv2d or isinstance(conv.padding, str):
        return False
    height, width = arguments["pixel_values"].shape[-2:]
    patches = 1
    for size, k, stride, pad, dilation in zip((height, width), conv.kernel_size, conv.stride, conv.padding,
                                              conv.dilation):
        patches *= (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    return height == width and patches == module.position_embeddings.shape[1] - 1


def _inactive(dropout) -> bool:
    return type(dropout) is torch.nn.Identity or (
        type(dropout) is torch.nn.Dropout and (dropout.p == 0 or not dropout.training))


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
# DINOv2's (BEiT's has this forward too, with another interpolate_pos_encoding: the methods check leaves it out).
DINOV2_EMBEDDINGS_BODY = (
    "_, _, height, width = pixel_values.shape ; embeddings = self.patch_embeddings(pixel_values) ; batch_size, "
    "seq_len, _ = embeddings.size() ; if bool_masked_pos is not None:\n    mask_tokens = self.mask_token.expand("
    "batch_size, seq_len, -1)\n    mask = bool_masked_pos.unsqueeze(-1).type_as(mask_tokens)\n    embeddings = "
    "embeddings * (1 - mask) + mask_tokens * mask ; cls_tokens = self.cls_token.expand(batch_size, -1, -1) ; "
    "embeddings = torch.cat((cls_tokens, embeddings), dim=1) ; if self.position_embeddings is not None:\n    "
    "embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width) ; embeddings = "
    "self.dropout(embeddings) ; return embeddings")
DINOV2_INTERPOLATE_BODY = (
    "num_patches = embeddings.shape[1] - 1 ; num_positions = self.position_embeddings.shape[1] - 1 ; if not "
    "torch.jit.is_tracing() and num_patches == num_positions and (height == width):\n    return "
    "self.position_embeddings ; class_pos_embed = self.position_embeddings[:, :1] ; patch_pos_embed = "
    "self.position_embeddings[:, 1:] ; dim = embeddings.shape[-1] ; patch_height, patch_width = "
    "self.patch_embeddings.patch_size ; new_height = height // patch_height ; new_width = width // patch_width ; "
    "sqrt_num_positions = torch_int(num_positions ** 0.5) ; patch_pos_embed = patch_pos_embed.reshape(1, "
    "sqrt_num_positions, sqrt_num_positions, dim) ; patch_pos_embed = patch_pos_embed.permute(0, 3, 1, 2) ; "
    "target_dtype = patch_pos_embed.dtype ; patch_pos_embed = nn.functional.interpolate(patch_pos_embed.to("
    "torch.float32), size=(new_height, new_width), mode='bicubic', align_corners=False).to(dtype=target_dtype) ; "
    "patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim) ; return torch.cat((class_pos_embed, "
    "patch_pos_embed), dim=1)")
register_forward_rule(DINOV2_EMBEDDINGS_BODY, vit_embeddings_rule,
                      params=("cls_token", "position_embeddings", "mask_token"), accepts=stored_positions_call,
                      methods={"interpolate_pos_encoding": DINOV2_INTERPOLATE_BODY})


def registers_rule(module, inputs, output_grad, trainable):
    """DINOv2 with registers: y = cat(e[:, :1], registers, e[:, 1:]) with e = cat(class token, patches) + positions,
    so the positions' gradient is G without the register rows, the registers' is those rows."""
    B, R = output_grad.shape[0], module.register_tokens.shape[1]
    out = {}
    if "position_embeddings" in trainable:
        out["position_embeddings"] = Instantiated(
            torch.cat((output_grad[:, :1], output_grad[:, 1 + R:]), dim=1).unsqueeze(1))
    if "cls_token" in trainable:
        out["cls_token"] = Instantiated(output_grad[:, :1].unsqueeze(1))
    if "register_tokens" in trainable:
        out["register_tokens"] = Instantiated(output_grad[:, 1:1 + R].unsqueeze(1))
    if "mask_token" in trainable:  # unused by a call without bool_masked_pos
        out["mask_token"] = Instantiated(output_grad.new_zeros((B, *module.mask_token.shape)))
    return out


DINOV2_REGISTERS_EMBEDDINGS_BODY = (
    'batch_size, _, height, width = pixel_values.shape ; embeddings = self.patch_embeddings(pixel_values) ; if '
    'bool_masked_pos is not None:\n    embeddings = torch.where(bool_masked_pos.unsqueeze(-1), '
    'self.mask_token.to(embeddings.dtype).unsqueeze(0), embeddings) ; cls_tokens = '
    'self.cls_token.expand(batch_size, -1, -1) ; embeddings = torch.cat((cls_tokens, embeddings), dim=1) ; '
    'embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width) ; embeddings = '
    'torch.cat((embeddings[:, :1], self.register_tokens.expand(embeddings.shape[0], -1, -1), embeddings[:, 1:]), '
    'dim=1) ; embeddings = self.dropout(embeddings) ; return embeddings')
DINOV2_REGISTERS_INTERPOLATE_BODY = (
    'num_patches = embeddings.shape[1] - 1 ; num_positions = self.position_embeddings.shape[1] - 1 ; if not '
    'torch.jit.is_tracing() and num_patches == num_positions and (height == width):\n    return '
    'self.position_embeddings ; class_pos_embed = self.position_embeddings[:, 0] ; patch_pos_embed = '
    'self.position_embeddings[:, 1:] ; dim = embeddings.shape[-1] ; patch_height, patch_width = '
    'self.patch_embeddings.patch_size ; height = height // patch_height ; width = width // patch_width ; '
    'sqrt_num_positions = torch_int(num_positions ** 0.5) ; patch_pos_embed = patch_pos_embed.reshape(1, '
    'sqrt_num_positions, sqrt_num_positions, dim) ; patch_pos_embed = patch_pos_embed.permute(0, 3, 1, 2) ; '
    'target_dtype = patch_pos_embed.dtype ; patch_pos_embed = '
    'nn.functional.interpolate(patch_pos_embed.to(dtype=torch.float32), size=(torch_int(height), '
    "torch_int(width)), mode='bicubic', align_corners=False, antialias=True).to(dtype=target_dtype) ; "
    'patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim) ; return '
    'torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1)')
register_forward_rule(DINOV2_REGISTERS_EMBEDDINGS_BODY, registers_rule,
                      params=("cls_token", "register_tokens", "position_embeddings", "mask_token"),
                      accepts=stored_positions_call,
                      methods={"interpolate_pos_encoding": DINOV2_REGISTERS_INTERPOLATE_BODY})


def class_embedding_rule(module, inputs, output_grad, trainable):
    """CLIP's vision embeddings: y = cat(class embedding, patches) + positions, nothing after; the class embedding's
    gradient is G's row 0 (see the module doc)."""
    if "class_embedding" not in trainable:
        return {}
    return {"class_embedding": Instantiated(output_grad[:, 0])}


# CLIP's (9 classes) and OwlViT's (2), registered by their code; the child modules (the patch Conv2d, the positions'
# Embedding) take their own rules.
CLIP_VISION_EMBEDDINGS_BODY = (
    'batch_size, _, height, width = pixel_values.shape ; if not interpolate_pos_encoding and (height != '
    'self.image_size or width != self.image_size):\n    raise ValueError(f"Input image size ({height}*{width}) '
    'doesn\'t match model ({self.image_size}*{self.image_size}).") ; target_dtype = self.patch_embedding.weight.dtype '
    '; patch_embeds = self.patch_embedding(pixel_values.to(dtype=target_dtype)) ; patch_embeds = '
    'patch_embeds.flatten(2).transpose(1, 2) ; class_embeds = self.class_embedding.expand(batch_size, 1, -1) ; '
    'embeddings = torch.cat([class_embeds, patch_embeds], dim=1) ; if interpolate_pos_encoding:\n    embeddings = '
    'embeddings + self.interpolate_pos_encoding(embeddings, height, width)\nelse:\n    embeddings = embeddings + '
    'self.position_embedding(self.position_ids) ; return embeddings')
OWLVIT_VISION_EMBEDDINGS_BODY = (
    'batch_size, _, height, width = pixel_values.shape ; patch_embeds = self.patch_embedding(pixel_values) ; '
    'patch_embeds = patch_embeds.flatten(2).transpose(1, 2) ; class_embeds = self.class_embedding.expand(batch_size, '
    '1, -1) ; embeddings = torch.cat([class_embeds, patch_embeds], dim=1) ; if interpolate_pos_encoding:\n    '
    'embeddings = embeddings + self.interpolate_pos_encoding(embeddings, height, width)\nelse:\n    embeddings = '
    'embeddings + self.position_embedding(self.position_ids) ; return embeddings')
for _body in (CLIP_VISION_EMBEDDINGS_BODY, OWLVIT_VISION_EMBEDDINGS_BODY):
    register_forward_rule(_body, class_embedding_rule, params=("class_embedding",))
