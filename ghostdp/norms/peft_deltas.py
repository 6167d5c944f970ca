"""peft's adapters that add x dW^T to a frozen Linear's output, dW formed from the adapter's own parameters alone:
FourierFT and WaveFT (a spectrum's inverse transform), RandLoRA (scaled random bases), DeLoRA (normalised low-rank
factors), GraLoRA (a grid of low-rank blocks), C3A (a block-circulant kernel), HiRA (W * (B A), the base's weight
times a low-rank product), SHiRA (a sparse dW: its values at fixed positions), VB-LoRA (low-rank factors mixed from a
vector bank by each layer's top-k logits), UniLoRA (low-rank factors read from one shared vector at fixed indices) and
TinyLoRA (B R A, R = sum_k v_k P_k of a small vector v that layers share by groups, frozen SVD factors A and B).
VB-LoRA's bank, UniLoRA's vector and TinyLoRA's vectors are parameters of several adapted layers: each layer's call is
one of their uses, whose per-example gradients are summed over the step's calls before the norm (as a tied weight's).
Registered by qualified name, so ``import ghostdp`` imports no peft module; a call the rule does not know takes the
exact fallback.

With G_t the output grad at position t, each example's gradient of dW is g_i(dW) = sum_t G_t x_t^T (an OuterProduct of G
and x, a Linear's weight gradient), and each parameter's is J^T g_i(dW), J the Jacobian of dW in it: one batched VJP of
dW's graph, as the layer forms dW (``get_delta_weight``; HiRA's from its forward's own formula, which its
``get_delta_weight`` does not follow; SHiRA's as the dense tensor its sparse one adds to the base's weight, whose VJP
gathers each example's gradient at the adapter's positions), per chunk of examples (batched_vjp.grads_through). The
forward adds each adapter's x dW^T to the base's output (FourierFT, WaveFT, HiRA, C3A through F.linear with dW or an FFT
of the kernel; RandLoRA, DeLoRA and GraLoRA through their factors, whose product dW is): ``_DELTAS`` checks each in
float64 against the per-example loop (tests/norms/test_peft_deltas.py). The exact fallback ran a batched VJP of the
whole layer per chunk of examples (a tiny BERT, L=2, H=64, B=16, T=32, one CPU thread, book-keeping, on query and value:
FourierFT 2.77x plain, WaveFT 2.61x, RandLoRA 5.21x, DeLoRA 2.62x, GraLoRA 4.11x, C3A 7.92x, HiRA 3.16x, SHiRA 4.7x,
VB-LoRA 4.9-5.3x; by this rule: the module's ``profiling.peft_methods`` rows).

Declined, so that such a call takes the fallback (``_adds_its_deltas``): adapters disabled or merged, other arguments, a
base that is not an nn.Linear or that trains, fan_in_fan_out (a transposed base weight), in training an active
adapter's dropout other than an identity (a random mask of x), and C3A with more than one active adapter (its forward
applies the second to the first one's output, not to x).
"""
from __future__ import annotations

import functools

import torch

from .batched_vjp import grads_through
from .factors import OuterProduct
from .peft_layers import adapter_names, adapter_parameters, plain_adapted_call
from .registry import qualified_name, register_norm_rule

C3A_LINEAR = "peft.tuners.c3a.layer.C3ALinear"
HIRA_LINEAR = "peft.tuners.hira.layer.Linear"
SHIRA_LINEAR = "peft.tuners.shira.layer.Linear"
# The layer classes, each with the ParameterDict whose keys are its adapters and its dropouts' ModuleDict (or None)
_DELTAS = {
    "peft.tuners.fourierft.layer.FourierFTLinear": ("fourierft_spectrum", None),
    "peft.tuners.waveft.layer.WaveFTLinear": ("waveft_spectrum", None),
    "peft.tuners.randlora.layer.Linear": ("randlora_lambda", "randlora_dropout"),
    "peft.tuners.delora.layer.DeloraLinear": ("delora_A", "delora_dropout"),
    "peft.tuners.gralora.layer.Linear": ("gralora_A", "gralora_dropout"),
    C3A_LINEAR: ("c3a_kernel", None),
    HIRA_LINEAR: ("hira_A", "hira_dropout"),
    SHIRA_LINEAR: ("shira_weight", None),
    "peft.tuners.vblora.layer.Linear": ("vblora_logits_A", "vblora_dropout"),
    "peft.tuners.unilora.layer.Linear": ("unilora_theta_d", "unilora_dropout"),
    "peft.tuners.tinylora.layer.Linear": ("tinylora_A", "tinylora_dropout"),
}


def _active(module) -> list:
    held = getattr(module, _DELTAS[qualified_name(type(module))][0])
    return [a for a in module.active_adapters if a in held]


def _adds_its_deltas(module, args, kwargs) -> bool:
    """Whether this call adds each active adapter's x dW^T to a frozen nn.Linear's output, x as it came, as the rule
    assumes."""
    if not plain_adapted_call(module, args, kwargs):
        return False
    base = module.get_base_layer()
    if (type(base) is not torch.nn.Linear or any(p.requires_grad for p in base.parameters())
            or getattr(module, "fan_in_fan_out", False)):
        return False
    kind = qualified_name(type(module))
    active = _active(module)
    if kind == C3A_LINEAR and len(active) > 1:
        return False
    dropouts = _DELTAS[kind][1]
    return dropouts is None or not module.training or all(
        type(getattr(module, dropouts)[a]) is torch.nn.Identity for a in active if a in getattr(module, dropouts))


def _delta_weight(module, adapter) -> torch.Tensor:
    """dW of one adapter, as the forward applies it (with grad: the rule's VJP runs through it)."""
    kind = qualified_name(type(module))
    if kind == HIRA_LINEAR:  # the forward's W * (B A)
        return module.get_base_layer().weight * (module.hira_B[adapter] @ module.hira_A[adapter])
    if kind == SHIRA_LINEAR:  # the dense tensor that get_delta_weight's sparse one adds to the base's weight
        weight = module.get_base_layer().weight
        rows, cols = module.shira_indices[adapter].to(weight.device).long()
        values = module.shira_weight[adapter] * module.scaling[adapter]
        return weight.new_zeros(weight.shape, dtype=values.dtype).index_put((rows, cols), values, accumulate=True)
    return module.get_delta_weight(adapter)


def delta_weight_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                      trainable: set[str]) -> dict:
    active = _active(module)
    names = [name for a in active for name in adapter_names(module, a, trainable)]
    if not names:
        return {}
    with torch.enable_grad():
        deltas = [_delta_weight(module, a) for a in active]
    dtype = functools.reduce(torch.promote_types, [d.dtype for d in deltas])
    delta = functools.reduce(torch.add, [d.to(dtype) for d in deltas])  # (out, in)
    x = inputs[0]
    batch = x.shape[0]
    rows = x.to(dtype).reshape(batch, -1, delta.shape[1])
    factor = OuterProduct(output_grad.to(dtype).reshape(batch, -1, delta.shape[0]), rows, delta.shape)
    return dict(zip(names, grads_through(delta, [module.get_parameter(n) for n in names], factor)))


for _kind in _DELTAS:
    register_norm_rule(_kind, delta_weight_rule, params=adapter_parameters, tokenwise=True, accepts=_adds_its_deltas)
