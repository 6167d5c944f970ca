"""Elementwise scales and shifts: y = x * s (+ b), s and b parameters that broadcast over the batch (a LayerScale:
s of shape (d,); ConvNextV2's GRN: s and b of shape (1, 1, 1, C) on a scaled input; torch.nn.PReLU: s of shape (C,)
on min(0, x) along the channel dim 1).

Example i's gradient is g_i = sum over the broadcast positions of G_i * x_i (the shape of s), and of G_i for b,
formed as the LayerNorm's weight and bias are (normalization._affine_grads, with x for xhat): (B, *s.shape)
instantiated, the sums and masses accumulated in float32 or better, 16-bit inputs read in their own dtype.
"""
from __future__ import annotations

from functools import partial

import torch

from .factors import Instantiated
from .normalization import _affine_grads, _working
from .registry import register_forward_rule, register_norm_rule


def _broadcast_dims(x: torch.Tensor, param: torch.Tensor) -> tuple:
    """The dims of x (B, ...) over which ``param`` broadcasts, where its gradient is summed. A parameter with a size
    other than 1 at x's batch dim, or with dims before it, is refused with the fix."""
    lead = param.dim() - (x.dim() - 1)  # the parameter's dims at x's batch dim or before it
    if lead > 1 or (lead == 1 and param.shape[0] != 1):
        raise ValueError(
            f"an elementwise parameter of shape {tuple(param.shape)} on an input of shape {tuple(x.shape)} spans "
            "the batch dim: its gradient cannot be split by example. Fix: freeze it (requires_grad_(False)).")
    trailing = tuple(param.shape[max(0, lead):])
    aligned = (1,) * (x.dim() - 1 - len(trailing)) + trailing  # the parameter's shape beside x's dims 1...
    return tuple(d + 1 for d, size in enumerate(aligned) if size == 1 and x.shape[d + 1] != 1)


def scale_grads(x: torch.Tensor, G: torch.Tensor, scale: torch.Tensor) -> Instantiated:
    """g_i = sum_to_size(G_i * x_i, scale.shape) for x and G of shape (B, ...), with its token mass."""
    return _summed_to(scale, x, G, ("param", None))


def shift_grads(G: torch.Tensor, shift: torch.Tensor) -> Instantiated:
    """g_i = sum_to_size(G_i, shift.shape) for G of shape (B, ...), with its token mass."""
    return _summed_to(shift, G, G, (None, "param"))


def _summed_to(param, x, G, names) -> Instantiated:
    """_affine_grads' weight (G * x) or bias (G) gradient, as ``names`` picks, summed over the dims ``param``
    broadcasts over, shaped (B, *param.shape)."""
    reduce_dims = _broadcast_dims(G, param)
    x, G = _working(x, G)
    g = _affine_grads(x, G, ("param",), reduce_dims, names=names)["param"]
    return Instantiated(g.grads.reshape(G.shape[0], *param.shape), g.mass)


def scale_is_tokenwise(scale: torch.Tensor) -> bool:
    """Whether x * scale scales every leading position of x alike (scale's dims before its last are all 1), so
    that any leading dim of x may hold the examples. A scale that differs by position, (T, d), meets a
    sequence-first (T, B, d) input's batch dim: there each example has its own row of it, which the rule, reading
    the input made batch-first, would not know (the clipped sum was not the gradient before 2026-11-27)."""
    return scale.numel() == (scale.shape[-1] if scale.dim() else 1)


@register_norm_rule(torch.nn.PReLU, params=("weight",))
def prelu_rule(module: torch.nn.PReLU, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
               trainable) -> dict:
    """y = max(0, x) + a * min(0, x), a of shape (C,) along x's channel dim 1 (or (1,): one for every channel), so
    g_i = sum over the positions a broadcasts over of G_i * min(0, x_i): the scale of min(0, x) (torch's backward
    takes x where x <= 0, and 0 elsewhere)."""
    if "weight" not in trainable:
        return {}
    x, a = inputs[0], module.weight
    aligned = a.view(a.shape[0], *[1] * (x.dim() - 2)) if x.dim() > 1 else a  # (C, 1, ...): beside x's dims 1...
    g = scale_grads(x.clamp(max=0), output_grad, aligned)
    return {"weight": Instantiated(g.grads.reshape(x.shape[0], *a.shape), g.mass)}


def layer_scale_rule(module, inputs, output_grad, trainable):
    return {"lambda1": scale_grads(inputs[0], output_grad, module.lambda1)} if "lambda1" in trainable else {}


# transformers' LayerScale (DINOv2, DINOv3, SAM 3, EoMT, ...): the forward, registered by its code (registry.py).
LAYER_SCALE_BODY = "return hidden_state * self.lambda1"
register_forward_rule(LAYER_SCALE_BODY, layer_scale_rule, params=("lambda1",),
                      tokenwise=lambda module: scale_is_tokenwise(module.lambda1))


def global_response_norm_rule(module, inputs, output_grad, trainable):
    """ConvNextV2's GRN: y = w * (x * N(x)) + b + x, N(x) = |x|_(H,W) / (mean_C |x|_(H,W) + 1e-6) of each example
    alone (x: (B, H, W, C)); w scales x * N(x), formed here as the forward forms it, and b shifts."""
    x, out = inputs[0], {}
    if "weight" in trainable:
        global_features = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        norm_features = global_features / (global_features.mean(dim=-1, keepdim=True) + 1e-6)
        out["weight"] = scale_grads(x * norm_features, output_grad, module.weight)
    if "bias" in trainable:
        out["bias"] = shift_grads(output_grad, module.bias)
    return out


GLOBAL_RESPONSE_NORM_BODY = (
    "global_features = torch.linalg.vector_norm(hidden_states, ord=2, dim=(1, 2), keepdim=True) ; norm_features = "
    "global_features / (global_features.mean(dim=-1, keepdim=True) + 1e-06) ; hidden_states = self.weight * "
    "(hidden_states * norm_features) + self.bias + hidden_states ; return hidden_states")
register_forward_rule(GLOBAL_RESPONSE_NORM_BODY, global_response_norm_rule)


def separable_conv_rule(module, inputs, output_grad, trainable):
    """ConvBERT's SeparableConv1D: a depthwise and a pointwise Conv1d (children, with their own rule), then
    x += bias, a (C, 1) shift of the (B, C, T) output."""
    return {"bias": shift_grads(output_grad, module.bias)} if "bias" in trainable else {}


SEPARABLE_CONV_BODY = "x = self.depthwise(hidden_states) ; x = self.pointwise(x) ; x += self.bias ; return x"
register_forward_rule(SEPARABLE_CONV_BODY, separable_conv_rule, params=("bias",))


# Nodes a drop path (or any product with a constant) leaves between a block's residual add and its scaled branch:
# the branch's G is the output grad times (or over) the constant, elementwise, so no example's G reaches another's.
_CONSTANT_SCALINGS = {"MulBackward0": "mul", "DivBackward0": "div"}


def scaled_before_the_residual(output: torch.Tensor, scale: torch.Tensor):
    """(x, factor) for a block that ends ``residual + c * (scale * x).permute(0, 3, 1, 2)`` (x * scale alike; c:
    products with and quotients by tensors without gradient, a drop path's mask over its keep rate, that keep the
    output's shape), read from the autograd graph of the block's ``output``: x as the multiply saved it, and the
    factor (a tensor, or 1) by which the output grad becomes the branch's. None where the graph holds anything else
    between them (a hook that changed an output, FSDP's gathered parameters, a broadcast that changed a shape) or
    where reading it would recompute a checkpointed region (saved-tensor hooks: a non-reentrant checkpoint's unpack
    runs the region's forward again)."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return None
    add = output.grad_fn
    if type(add).__name__ != "AddBackward0" or add._saved_alpha != 1:
        return None
    node, factor = add.next_functions[1][0], 1
    while type(node).__name__ in _CONSTANT_SCALINGS:
        op = _CONSTANT_SCALINGS[type(node).__name__]
        (first, _), (second, _) = node.next_functions
        if first is not None and second is None:  # branch * c, branch / c
            branch, constant = first, node._saved_other
        elif op == "mul" and first is None and second is not None:  # c * branch
            branch, constant = second, node._saved_self
        else:  # both with gradient, or c / branch
            return None
        factor = factor * constant if op == "mul" else factor / constant
        node = branch
    if type(node).__name__ != "PermuteBackward0" or tuple(node._saved_dims) != (0, 3, 1, 2):
        return None
    multiply = node.next_functions[0][0]
    if type(multiply).__name__ != "MulBackward0":
        return None
    operands = [getattr(edge, "variable", None) for edge, _ in multiply.next_functions]
    x = multiply._saved_other if operands[0] is scale else multiply._saved_self if operands[1] is scale else None
    if x is None or tuple(x.shape) != (output.shape[0], *output.shape[2:], output.shape[1]):
        return None
    if torch.is_tensor(factor) and torch.broadcast_shapes(factor.shape, output.shape) != output.shape:
        return None
    return x, factor


def residual_scale_rule(module, inputs, output_grad, trainable):
    """A ConvNext block's layer scale (scaled_before_the_residual; its only parameter of its own): inputs are the
    scaled (B, H, W, C) tensor and, after a drop path, the factor c; the branch's G is c times the block's output
    grad (the residual adds the branch unchanged), permuted back."""
    x, G = inputs[0], output_grad if len(inputs) == 1 else output_grad * inputs[1]
    return {name: scale_grads(x, G.permute(0, 2, 3, 1), getattr(module, name)) for name in trainable}


def _scaled_input(module, args, kwargs, output, name):
    """What the layer scale ``name``'s rule reads of this call (x, and the factor c where there is one), or None (the
    call takes the exact fallback)."""
    read = scaled_before_the_residual(output, getattr(module, name))
    if read is None:
        return None
    x, factor = read
    return (x,) if not torch.is_tensor(factor) else (x, factor)


# ConvNext's block (transformers' ConvNextLayer) and DINOv3's ConvNext block: the block owns its layer scale, so
# it took the exact fallback before 2026-11-27 (a batched VJP per chunk of examples; book-keeping 3.39x plain against
# 2.18x by this rule, B=32, 64x64 images). The scaled tensor is the output of the block's last Linear.
CONVNEXT_LAYER_BODY = (
    "residual = features ; features = self.dwconv(features) ; features = features.permute(0, 2, 3, 1) ; features = "
    "self.layernorm(features) ; features = self.pwconv1(features) ; features = self.act(features) ; features = "
    "self.pwconv2(features) ; if self.layer_scale_parameter is not None:\n    features = self.layer_scale_parameter * "
    "features ; features = features.permute(0, 3, 1, 2) ; features = residual + self.drop_path(features) ; return "
    "features")
DINOV3_CONVNEXT_LAYER_BODY = (
    "residual = features ; features = self.depthwise_conv(features) ; features = features.permute(0, 2, 3, 1) ; "
    "features = self.layer_norm(features) ; features = self.pointwise_conv1(features) ; features = "
    "self.activation_fn(features) ; features = self.pointwise_conv2(features) ; features = features * self.gamma ; "
    "features = features.permute(0, 3, 1, 2) ; features = residual + self.drop_path(features) ; return features")
for _body, _name in ((CONVNEXT_LAYER_BODY, "layer_scale_parameter"), (DINOV3_CONVNEXT_LAYER_BODY, "gamma")):
    register_forward_rule(_body, residual_scale_rule, params=(_name,), rule_inputs=partial(_scaled_input, name=_name))
