"""LayerNorm, GroupNorm, InstanceNorm, RMSNorm: per-example gradients are (B, d), so instantiate them.

For y = w * xhat + b:  dL/dw_i = sum over positions of G * xhat,  dL/db_i = sum of G.
xhat is recomputed from the saved input. float32 and float64 inputs are used as they are;
16-bit inputs are read in their own dtype (no float32 copies of x, G, xhat and G * xhat, each as
large as the layer's activations): xhat and G * xhat are formed in 16 bits, and the sums over
positions and the norms accumulate in float32 inside the reductions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .factors import ELEMENT_BUDGET, Instantiated, acc_dtype, summed_positions_mass
from .registry import entry_by_code, register_forward_rule, register_norm_rule

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _working(x, G):
    """x and G as the rule reads them: as they are where either is 16-bit (the reductions accumulate in
    float32), else both in the accumulation dtype."""
    if x.dtype in SIXTEEN_BIT or G.dtype in SIXTEEN_BIT:
        return x, G
    dt = acc_dtype(x, G)
    # Tensor.to is a dispatched op even where the dtype matches (some microseconds a call on the host).
    return x if x.dtype == dt else x.to(dt), G if G.dtype == dt else G.to(dt)


def _affine_grads(xhat, G, trainable, reduce_dims, names=("weight", "bias"), example_dims=1, scale_masses=True,
                  massless=frozenset()):
    """Per-example sums over the positions ``reduce_dims`` of G * xhat (weight) and G (bias), each with the
    token mass of that sum (precision.py); sums and masses accumulate in float32 or better. The first
    ``example_dims`` dims index the examples (2: several layers' calls stacked). ``scale_masses`` False: the
    masses lack their factor sqrt(positions) (summed_positions_mass). ``massless``: the names whose mass nobody
    reads (LayerNormCall.drop_mass): None."""
    positions = math.prod(G.shape[d] for d in reduce_dims)
    dt = acc_dtype(xhat, G)
    out = {}
    if names[0] in trainable:
        terms = G * xhat
        out[names[0]] = Instantiated(terms.sum(reduce_dims, dtype=dt) if reduce_dims else terms.to(dt),
                                     mass=None if names[0] in massless else
                                     summed_positions_mass(terms, positions, dt, example_dims, scale_masses))
    if names[1] in trainable:
        out[names[1]] = Instantiated(G.sum(reduce_dims, dtype=dt) if reduce_dims else G.to(dt),
                                     mass=None if names[1] in massless else
                                     summed_positions_mass(G, positions, dt, example_dims, scale_masses))
    return out


def _leading_dims(x, n_normalized):
    """Dims between the batch dim and the normalised trailing dims."""
    return tuple(range(1, x.dim() - n_normalized))


class LayerNormCall:
    """x and G of one LayerNorm call; the per-example gradients of its weight and bias (``AffineGrad``)
    are formed on first use, alone or, through ``form_layer_norms``, for many calls in one stacked
    expression (norms/batched.py)."""

    def __init__(self, x, G, normalized_shape, eps, trainable):
        self.x, self.G = _working(x, G)
        self.device = x.device
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        self.param_shape = torch.Size(self.normalized_shape)  # its weight's and bias's
        self.trainable = frozenset([n for n in ("weight", "bias") if n in trainable])
        self.massless = frozenset()  # the names whose token mass nobody reads (drop_mass)
        self.stacked = None  # once formed: ({name: (grads, masses) of the calls formed together}, this call's row)
        self.mass_scale = 1.0  # what those masses are still to be multiplied by (form_layer_norms' scale_masses)
        self._formed = None  # name -> Instantiated, this call's row of those, picked on first use
        # Calls with equal keys are formed together.
        self.batch_key = (self.x.shape, self.x.dtype, self.G.dtype, self.device, self.normalized_shape, eps,
                          self.trainable, self.massless)

    def drop_mass(self, name: str) -> None:
        """``name``'s gradients are formed without their token mass (AffineGrad.kept), where not formed yet."""
        if self.stacked is None and name not in self.massless:
            self.massless = self.massless | {name}
            self.batch_key = self.batch_key[:-1] + (self.massless,)

    def form(self):
        if self._formed is None:
            if self.stacked is None:
                form_layer_norms([self])
            (stacked, k), scale = self.stacked, self.mass_scale
            self._formed = {n: Instantiated(grads[k], None if mass is None else mass[k] if scale == 1.0 else
                                            mass[k] * scale) for n, (grads, mass) in stacked.items()}
        return self._formed


def form_layer_norms(calls, scale_masses=True):
    """Forms the gradients of LayerNorm calls of one ``batch_key``, stacked: {name: ((k, B, *shape) grads,
    (k, B) masses)}. xhat = (x - mean) / sqrt(var + eps) over the normalised dims is one fused op for all;
    where xhat and G * xhat would exceed ELEMENT_BUDGET, over runs of positions (_token_runs).
    ``scale_masses`` False: the masses lack their factor sqrt(positions), left in each call's ``mass_scale``
    (applied where a call's row is read alone): a call formed alone hands its masses to DeferredGrams, which
    multiplies the masses of all the layers it holds at once instead of two ops per call."""
    first = calls[0]
    x = first.x.unsqueeze(0) if len(calls) == 1 else torch.stack([c.x for c in calls])
    G = first.G.unsqueeze(0) if len(calls) == 1 else torch.stack([c.G for c in calls])
    reduce_dims = tuple(d + 1 for d in _leading_dims(first.x, len(first.normalized_shape)))
    runs = _token_runs(x, reduce_dims)
    if runs is None:
        xhat = F.layer_norm(x, first.normalized_shape, eps=first.eps)
        affine = _affine_grads(xhat, G, first.trainable, reduce_dims, example_dims=2, scale_masses=scale_masses,
                               massless=first.massless)
        stacked = {n: (f.grads, f.mass) for n, f in affine.items()}
    else:
        stacked = _affine_grads_by_runs(x, G, first, reduce_dims, runs, scale_masses)
    scale = 1.0 if scale_masses else math.sqrt(math.prod(x.shape[d] for d in reduce_dims))
    for k, call in enumerate(calls):  # a call's own row is picked only if it is read alone (LayerNormCall.form)
        call.stacked, call.mass_scale = (stacked, k), scale
        call.x = call.G = None  # only the (B, d) gradients are kept (book-keeping holds them to the end)
    return stacked


def _token_runs(x, reduce_dims):
    """Slices of the first position dim (``reduce_dims[0]``) whose xhat stays within ELEMENT_BUDGET elements, or
    None where all of x does (or it has no position dim): a LayerNorm of a large batch would otherwise hold two
    float32 temporaries as large as its input (xhat and G * xhat: at the Fast Gradient Clipping post's set-up,
    BERT-base fp32 at B=2048, 1.6 GB)."""
    if not reduce_dims or x.numel() <= ELEMENT_BUDGET:
        return None
    dim = reduce_dims[0]
    length = x.shape[dim]
    step = max(1, length * ELEMENT_BUDGET // x.numel())
    return [slice(lo, min(lo + step, length)) for lo in range(0, length, step)] if step < length else None


def _affine_grads_by_runs(x, G, call, reduce_dims, runs, scale_masses=True):
    """What ``_affine_grads`` gives for the weight and bias of stacked LayerNorm calls, with xhat and G * xhat
    formed over ``runs`` of the first position dim: the sums over positions add up run by run, and the weight's
    token mass sqrt(positions) |G * xhat|_F from the runs' squared norms (without sqrt(positions) where not
    ``scale_masses``). The bias reads G in place. No mass for the names in ``call.massless``."""
    dim, dt = reduce_dims[0], acc_dtype(x, G)
    positions = math.prod(G.shape[d] for d in reduce_dims)
    weight_mass = positions > 1 and "weight" not in call.massless
    out = {}
    if "weight" in call.trainable:
        total = squares = None
        for run in runs:
            index = (slice(None),) * dim + (run,)
            terms = G[index] * F.layer_norm(x[index], call.normalized_shape, eps=call.eps)
            part = terms.sum(reduce_dims, dtype=dt)
            total = part if total is None else total + part
            if weight_mass:
                square = torch.linalg.vector_norm(terms, dim=tuple(range(2, terms.dim())), dtype=dt).square()
                squares = square if squares is None else squares + square
        out["weight"] = (total, None if not weight_mass else
                         squares.sqrt() * math.sqrt(positions) if scale_masses else squares.sqrt())
    if "bias" in call.trainable:
        out["bias"] = (G.sum(reduce_dims, dtype=dt), None if "bias" in call.massless else
                       summed_positions_mass(G, positions, dt, 2, scale_masses))
    return out


def stacked_grads(factors):
    """The (k, B, *shape) per-example gradients of k AffineGrads of one name as ``form_layer_norms`` stacked
    them, where the factors are the rows of whole stacks in order, stack after stack: those stacks, concatenated
    if several (layers formed one at a time: one op, no row picked and stacked again); else None."""
    name, parts, k = factors[0].name, [], 0
    while k < len(factors):
        first = factors[k].call.stacked if type(factors[k]) is AffineGrad else None
        if first is None or name not in first[0]:
            return None
        stacked = first[0]  # the run below checks that factors[k] is its row 0
        grads = stacked[name][0]
        run = factors[k:k + grads.shape[0]]
        if len(run) != grads.shape[0] or any(type(f) is not AffineGrad or f.name != name or f.call.stacked is None
                                             or f.call.stacked[0] is not stacked or f.call.stacked[1] != j
                                             for j, f in enumerate(run)):
            return None
        parts.append(grads)
        k += len(run)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class AffineGrad(Instantiated):
    """The per-example gradient of a LayerNorm's weight or bias (``name``), formed by its call on first use."""

    def __init__(self, call: LayerNormCall, name: str):
        self.call, self.name = call, name
        self.batch_size = call.x.shape[0]
        self.param_shape = call.param_shape

    @property
    def grads(self):
        return self.call.form()[self.name].grads

    @property
    def mass(self):
        return self.call.form()[self.name].mass

    def kept(self, with_mass: bool = True):
        """Book-keeping keeps this factor. Without ``with_mass`` (the parameter's only use this step) its gradients
        are formed without their token mass, as OuterProduct.kept's explicit ones: its norm is the dot product of
        the finished g_i and its clipped sum adds the same g_i (normalization.stacked_grads), so nothing of its
        tokens enters a sum over the whole batch's terms (two vector norms a call fewer)."""
        if not with_mass:
            self.call.drop_mass(self.name)
        return self


@register_norm_rule(torch.nn.LayerNorm, tokenwise=True)
def layer_norm_rule(module, inputs, output_grad, trainable):
    call = LayerNormCall(inputs[0], output_grad, module.normalized_shape, module.eps, trainable)
    return {n: AffineGrad(call, n) for n in call.trainable}


@register_norm_rule(torch.nn.RMSNorm, tokenwise=True)
def rms_norm_rule(module, inputs, output_grad, trainable):
    x, G = _working(inputs[0], output_grad)
    dims = tuple(range(x.dim() - len(module.normalized_shape), x.dim()))
    eps = module.eps if module.eps is not None else torch.finfo(inputs[0].dtype).eps
    mean_square = torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=acc_dtype(x)).square() / math.prod(
        x.shape[d] for d in dims)
    xhat = x * torch.rsqrt(mean_square + eps).to(x.dtype)
    return _affine_grads(xhat, G, trainable, _leading_dims(x, len(dims)))


@register_norm_rule(torch.nn.GroupNorm)
def group_norm_rule(module, inputs, output_grad, trainable):
    x, G = _working(inputs[0], output_grad)
    xhat = F.group_norm(x, module.num_groups, eps=module.eps)
    spatial = tuple(range(2, x.dim()))
    return _affine_grads(xhat, G, trainable, spatial)


def instance_norm_rule(module, inputs, output_grad, trainable):
    """InstanceNorm1d/2d/3d with affine=True: GroupNorm with a group per channel. xhat from the input's own
    statistics (training, or track_running_stats=False) or from the running ones (eval with tracked statistics),
    as the module's forward takes them; F.instance_norm updates no running statistic without the input's."""
    x, G = _working(inputs[0], output_grad)
    use_input_stats = module.training or not module.track_running_stats
    running = (None, None) if use_input_stats else (module.running_mean, module.running_var)
    xhat = F.instance_norm(x, *running, use_input_stats=use_input_stats, eps=module.eps)
    return _affine_grads(xhat, G, trainable, tuple(range(2, x.dim())))


for _cls in (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d):
    register_norm_rule(_cls, instance_norm_rule)


def _hf_style(module) -> str:
    """The cast style of the module's forward: the body its rule was registered for, as the registry matched it
    (once per class)."""
    return _BODY_STYLES[entry_by_code(type(module)).owner]


def _hf_xhat(module, x, style):
    """xhat exactly as the class computes it: statistics in float32, cast where the class casts."""
    x32 = x.to(torch.float32)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    mean_square = x32.pow(2).mean(-1, keepdim=True) + eps
    inv_rms = torch.pow(mean_square, -0.5) if style == "gemma4" else torch.rsqrt(mean_square)
    if style in ("gemma", "gemma4"):  # (x.float() normalised) * (1 + w) (Gemma 4: * w), cast at the end
        return x32 * inv_rms
    if style == "t5":  # x (own dtype) * float32 statistic, cast to a half-precision weight's dtype
        xhat = x * inv_rms
        return xhat.to(module.weight.dtype) if module.weight.dtype in (torch.float16, torch.bfloat16) else xhat
    return (x32 * inv_rms).to(x.dtype)  # llama style: normalise in float32, cast back, then scale


def _float32_product_grads(xhat32, inputs, output_grad, trainable) -> dict:
    """The affine gradients of a norm whose forward multiplies its float32 xhat by its weight in float32 and casts at
    the end: the model forms the weight gradient in float32, so the rule does too, then casts to the accumulation
    dtype."""
    grads = _affine_grads(xhat32, output_grad.to(torch.float32), trainable, _leading_dims(xhat32, 1))
    dt = acc_dtype(inputs[0], output_grad)
    return {n: Instantiated(f.grads.to(dt), f.mass) for n, f in grads.items()}


def transformers_rms_norm_rule(module, inputs, output_grad, trainable):
    """transformers' RMSNorm classes: y = w * xhat (Gemma: (1 + w) * xhat), xhat over the last dim.

    Either way dL/dw_i = sum over positions of G * xhat.
    """
    style = _hf_style(module)
    xhat = _hf_xhat(module, inputs[0], style)
    if style in ("gemma", "gemma4"):  # the model itself forms this weight gradient in float32
        return _float32_product_grads(xhat, inputs, output_grad, trainable)
    dt = acc_dtype(inputs[0], output_grad)
    return _affine_grads(xhat.to(dt), output_grad.to(dt), trainable, _leading_dims(xhat, 1))


# ConvNext's LayerNorm, copied into ConvNextV2, SAM 1-3, RF-DETR, LW-DETR, DeepSeek-VL's hybrid, ...: nn.LayerNorm's
# forward over the last dim of (B, H, W, C) features, or over the channels of (B, C, H, W) ones permuted to
# channels last and back. Registered by its code with nn.LayerNorm as what ``super().forward`` must call.
CHANNELS_FIRST_LAYER_NORM_BODY = (
    "if self.data_format == 'channels_first':\n    features = features.permute(0, 2, 3, 1)\n    features = "
    "super().forward(features)\n    features = features.permute(0, 3, 1, 2)\nelse:\n    features = "
    "super().forward(features) ; return features")


def channels_first_layer_norm_rule(module, inputs, output_grad, trainable):
    """The LayerNorm rule on the LayerNorm's own input and output grad: channels last, as the forward permutes."""
    x, G = inputs[0], output_grad
    if module.data_format == "channels_first":
        x, G = x.permute(0, 2, 3, 1), G.permute(0, 2, 3, 1)
    return layer_norm_rule(module, [x], G, trainable)


register_forward_rule(CHANNELS_FIRST_LAYER_NORM_BODY, channels_first_layer_norm_rule, base=torch.nn.LayerNorm)


# LayerNorms written out in float32 (transformers' DeBERTa's and Cohere's, and their copies): xhat formed as each
# forms it, mean and variance over the last dim.
DEBERTA_LAYER_NORM_BODY = (
    "input_type = hidden_states.dtype ; hidden_states = hidden_states.float() ; mean = hidden_states.mean(-1, "
    "keepdim=True) ; variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True) ; hidden_states = "
    "(hidden_states - mean) / torch.sqrt(variance + self.variance_epsilon) ; hidden_states = "
    "hidden_states.to(input_type) ; y = self.weight * hidden_states + self.bias ; return y")
COHERE_LAYER_NORM_BODY = (
    "input_dtype = hidden_states.dtype ; hidden_states = hidden_states.to(torch.float32) ; mean = "
    "hidden_states.mean(-1, keepdim=True) ; variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True) ; "
    "hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon) ; hidden_states = "
    "self.weight.to(torch.float32) * hidden_states ; return hidden_states.to(input_dtype)")


def deberta_layer_norm_rule(module, inputs, output_grad, trainable):
    """y = w * xhat + b, xhat = (x - mean) / sqrt(var + eps) in float32, cast back to x's dtype before the affine."""
    x = inputs[0]
    x32 = x.float()
    centred = x32 - x32.mean(-1, keepdim=True)
    xhat = (centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)
    dt = acc_dtype(x, output_grad)
    return _affine_grads(xhat.to(dt), output_grad.to(dt), trainable, _leading_dims(x, 1))


def cohere_layer_norm_rule(module, inputs, output_grad, trainable):
    """y = w * xhat (no bias), xhat = (x - mean) * rsqrt(var + eps), product in float32 and cast at the end: the model
    forms this weight gradient in float32, as Gemma's (transformers_rms_norm_rule)."""
    x32 = inputs[0].to(torch.float32)
    centred = x32 - x32.mean(-1, keepdim=True)
    xhat = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return _float32_product_grads(xhat, inputs, output_grad, trainable)


register_forward_rule(DEBERTA_LAYER_NORM_BODY, deberta_layer_norm_rule, tokenwise=True)
register_forward_rule(COHERE_LAYER_NORM_BODY, cohere_layer_norm_rule, params=("weight",), tokenwise=True)


# Each of these computes xhat = x * rsqrt(mean(x^2, -1) + eps) and scales it by its weight; the style says where it
# casts. transformers copies these forwards into many model families (LlamaRMSNorm's into some 140 of them:
# Mistral, Mixtral, Qwen2/3 and their MoE, Granite, OLMo 2, DeepSeek, ...), so they are registered by their code
# (registry.register_forward_rule), which is read from the class's source when a module is first looked up:
# importing ghostdp imports no modeling file, and a class whose forward changed is not taken for the old one.
LLAMA_RMS_NORM_BODY = (
    "input_dtype = hidden_states.dtype ; hidden_states = hidden_states.to(torch.float32) ; variance = "
    "hidden_states.pow(2).mean(-1, keepdim=True) ; hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon) ; return self.weight * hidden_states.to(input_dtype)")
# The weight times the float32 xhat, cast at the end (OLMo's hybrid and FlexOlmo, AFMoE, ...): Gemma's casts.
FLOAT32_PRODUCT_RMS_NORM_BODY = (
    "input_dtype = hidden_states.dtype ; hidden_states = hidden_states.to(torch.float32) ; variance = "
    "hidden_states.pow(2).mean(-1, keepdim=True) ; hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon) ; return (self.weight * hidden_states).to(input_dtype)")
T5_LAYER_NORM_BODY = (
    "variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True) ; hidden_states = hidden_states * "
    "torch.rsqrt(variance + self.variance_epsilon) ; if self.weight.dtype in [torch.float16, torch.bfloat16]:\n"
    "    hidden_states = hidden_states.to(self.weight.dtype) ; return self.weight * hidden_states")
# Gemma's (1, 2, 3, VaultGemma, T5Gemma, Qwen3-Next, ...): the float32 xhat times (1 + weight), cast at the end; its
# forward calls self._norm, whose body must be this one too (another with this forward normalises in groups).
GEMMA_RMS_NORM_BODY = ("output = self._norm(x.float()) ; output = output * (1.0 + self.weight.float()) ; "
                       "return output.type_as(x)")
GEMMA_NORM_METHOD_BODY = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"
# Gemma 4's: the float32 xhat (a power -0.5, not rsqrt) times the weight itself, where it has one (with_scale).
GEMMA4_RMS_NORM_BODY = (
    "normed_output = self._norm(hidden_states.float()) ; if self.with_scale:\n    normed_output = normed_output * "
    "self.weight.float() ; return normed_output.type_as(hidden_states)")
# Its _norm reads self.eps up to transformers 5.24 and self.variance_epsilon from 5.25 (_hf_xhat reads either).
GEMMA4_NORM_METHOD_BODY = tuple(
    f"mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.{eps} ; return "
    "hidden_states * torch.pow(mean_squared, -0.5)" for eps in ("eps", "variance_epsilon"))
_BODY_STYLES = {LLAMA_RMS_NORM_BODY: "llama", FLOAT32_PRODUCT_RMS_NORM_BODY: "gemma", T5_LAYER_NORM_BODY: "t5",
                GEMMA_RMS_NORM_BODY: "gemma", GEMMA4_RMS_NORM_BODY: "gemma4"}
_NORM_METHODS = {GEMMA_RMS_NORM_BODY: GEMMA_NORM_METHOD_BODY, GEMMA4_RMS_NORM_BODY: GEMMA4_NORM_METHOD_BODY}
for _body in _BODY_STYLES:
    register_forward_rule(_body, transformers_rms_norm_rule, params=("weight",), tokenwise=True,
                          methods={"_norm": _NORM_METHODS[_body]} if _body in _NORM_METHODS else None)
