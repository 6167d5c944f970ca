"""peft's LoRA: its adapter on an embedding, DoRA's magnitude on a Linear, and AdaLoRA's SVD adapter on a Linear. Each
registered by qualified name, so ``import ghostdp`` imports no peft module; a call the rules do not know takes the
exact fallback (``accepts``).

**The adapter on an embedding** (``peft.tuners.lora.layer.Embedding``). For each active adapter, with A (r, V) and
B (d, r) its factors, s its scaling (times the base layer's ``embed_scale`` where it has one: Gemma's scaled
embeddings), the forward adds s (A^T[x_t]) B^T to the frozen lookup W[x_t]. With G_t the output grad at position t,
u_t = s A^T[x_t] (r,) and k_t = s B^T G_t (r,):
- g_i(B) = sum_t G_t u_t^T: an OuterProduct of G and u, as a Linear's weight whose input rows are u;
- g_i(A) = (sum_t e_{x_t} k_t^T)^T: the transpose (TransposedGrad) of an EmbeddingGather of the ids and k, the
  positions at the base layer's padding_idx dropped, as F.embedding's backward drops them.
G is taken in the adapter's dtype, as the adapter's backward receives it (peft adds its output to the base's
lookup and casts the sum to the base's dtype). Until 2026-12-03 such a module took the fallback, a batched VJP of
its whole forward (tiny BERT, L=2, H=64, B=16, T=32, one CPU thread: book-keeping 1.76x plain with LoRA on the
word embeddings besides query and value, 1.27x without them). Declined (``_computes_the_adapters``): adapters
disabled or merged, a variant (DoRA), a mixed batch of adapters (``adapter_names``), tensor-parallel input or
output functions, or a base layer with max_norm, scale_grad_by_freq or sparse gradients.

**DoRA's magnitude on a Linear** (``peft.tuners.lora.dora.DoraLinearLayer``, the module holding the magnitude m
(out,) that peft's DoRA Linear calls with its x, A, B, scaling s, base layer and base output). Its output is
(m / n - 1) (x W^T) + (m / n) s (x A^T B^T), n = ||W + s B A|| by rows, detached as the DoRA paper prescribes (peft
does so), so g_i(m) = sum_t G_t * z_t with z = (x W^T + s x A^T B^T) / n: an elementwise scale's gradient
(elementwise.scale_grads). z is formed from the call's arguments when its forward has run, as the forward forms it
(``RuleEntry.rule_inputs``, without gradient); x W^T is the base output the call was given, less its bias. Until
2026-12-03 the module took the fallback through the adapter's whole forward (the same tiny BERT with DoRA on query
and value: book-keeping 2.56x plain, against 1.25x for LoRA). Declined (``_known_dora_call``): A or B not plain
biasless Linears, a base weight that is quantized, parametrized (a parametrization computes it again, spectral
norm moving its vectors) or not 2-D, or other arguments.

**AdaLoRA's adapter on a Linear** (``peft.tuners.adalora.layer.SVDLinear``). For each active adapter, with A (r, in),
the singular values E (r, 1), B (out, r) and c = scaling / (ranknum + 1e-5), the forward adds c x (A * E)^T B^T to the
frozen base's output. With u_t = c (A * E) x_t, k_t = c B^T G_t and v_t = A x_t (each (r,)):
- g_i(B) = sum_t G_t u_t^T (an OuterProduct, as a Linear's weight on the rows u);
- g_i(A) = sum_t (E * k_t) x_t^T (an OuterProduct: the gradient of A * E, times E by rows);
- g_i(E) = sum_t k_t * v_t, of E's shape (an elementwise scale's gradient, elementwise.scale_grads).
G is taken in the adapter's dtype. Until 2026-12-03 the layer took the fallback (the tiny BERT with AdaLoRA r=8 on
query and value: book-keeping 4.52x plain). Declined (``_computes_the_svd_adapters``): adapters disabled or merged,
an active dropout, or other arguments.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from .elementwise import scale_grads
from .factors import EmbeddingGather, OuterProduct, TransposedGrad
from .peft_layers import plain_adapted_call
from .registry import register_norm_rule

LORA_EMBEDDING = "peft.tuners.lora.layer.Embedding"
DORA_LINEAR = "peft.tuners.lora.dora.DoraLinearLayer"
ADALORA_LINEAR = "peft.tuners.adalora.layer.SVDLinear"
_DORA_ARGUMENTS = frozenset({"lora_A", "lora_B", "scaling", "base_layer", "base_result", "adapter_name"})


def _adapter_parameters(module) -> frozenset:
    """The names of every adapter's two factors, as the module owns them (norms/fallback.owned_parameters)."""
    return frozenset(f"lora_embedding_{side}.{adapter}" for adapter in module.lora_embedding_A for side in "AB")


def _active(module) -> list:
    return [a for a in module.active_adapters if a in module.lora_embedding_A]


def _computes_the_adapters(module, args, kwargs) -> bool:
    """Whether this call adds each active adapter's s (A^T[x]) B^T to the base's lookup, as the rule assumes."""
    base = module.get_base_layer()
    if (not plain_adapted_call(module, args, kwargs)
            or getattr(base, "max_norm", None) is not None or getattr(base, "scale_grad_by_freq", False)
            or getattr(base, "sparse", False)):
        return False
    transforms = (getattr(module, "lora_variant", {}), getattr(module, "input_fns", {}),
                  getattr(module, "output_fns", {}))
    return all(t.get(a) is None for a in _active(module) for t in transforms)


def _holds_output_grad(module, inputs, output, trainable) -> bool:
    """Book-keeping keeps G itself in B's OuterProduct where G is in the adapter's dtype already."""
    return all(module.lora_embedding_A[a].dtype == output.dtype for a in _active(module)) and any(
        f"lora_embedding_B.{a}" in trainable for a in _active(module))


def _embed_scale(module):
    scale = getattr(module, "_get_embed_scale", None)
    return scale() if scale is not None else None


@register_norm_rule(LORA_EMBEDDING, params=_adapter_parameters, tokenwise=True, holds_output_grad=_holds_output_grad,
                    accepts=_computes_the_adapters)
def lora_embedding_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                        trainable: set[str]) -> dict:
    ids = inputs[0]
    batch = ids.shape[0]
    padding_idx = module.get_base_layer().padding_idx
    embed_scale = _embed_scale(module)
    factors = {}
    for adapter in _active(module):
        name_a, name_b = f"lora_embedding_A.{adapter}", f"lora_embedding_B.{adapter}"
        a, b = module.lora_embedding_A[adapter], module.lora_embedding_B[adapter]  # (r, V), (d, r)
        if name_a not in trainable and name_b not in trainable:
            continue
        scale = module.scaling[adapter]
        if embed_scale is not None:
            scale = scale * embed_scale.to(a.dtype)
        grads = output_grad.to(a.dtype).reshape(batch, -1, b.shape[0])  # (B, T, d)
        if name_b in trainable:
            rows = F.embedding(ids, a.t()).reshape(batch, -1, a.shape[0]) * scale  # (B, T, r): u_t
            factors[name_b] = OuterProduct(grads, rows, b.shape)
        if name_a in trainable:
            rows_grads = (grads @ b) * scale  # (B, T, r): k_t
            factors[name_a] = TransposedGrad(EmbeddingGather(ids, rows_grads, a.shape[1], padding_idx))
    return factors


def _known_dora_call(module, args, kwargs) -> bool:
    """Whether this call computes the output the DoRA rule knows (the module doc)."""
    lora_a, lora_b, base = kwargs.get("lora_A"), kwargs.get("lora_B"), kwargs.get("base_layer")
    weight = getattr(base, "weight", None) if isinstance(base, torch.nn.Module) else None
    return (len(args) == 1 and set(kwargs) <= _DORA_ARGUMENTS and "scaling" in kwargs
            and type(lora_a) is torch.nn.Linear and type(lora_b) is torch.nn.Linear
            and lora_a.bias is None and lora_b.bias is None
            and type(weight) is torch.nn.Parameter and weight.dim() == 2 and not parametrize.is_parametrized(base))


def _dora_scaled_input(module, args, kwargs, output) -> tuple:
    """(z,), z = (x W^T + s x A^T B^T) / n as the forward forms its terms (the module doc), without gradient."""
    x = args[0]
    lora_a, lora_b, base, s = kwargs["lora_A"], kwargs["lora_B"], kwargs["base_layer"], kwargs["scaling"]
    with torch.no_grad():
        weight = base.weight.to(x.dtype)
        if module.fan_in_fan_out:  # transformers' Conv1D keeps W as (in, out)
            weight = weight.t()
        lora_weight = (lora_b.weight @ lora_a.weight).to(x.dtype)  # peft's lora_B(lora_A(I)).T: (out, in)
        norm = torch.linalg.norm(weight + s * lora_weight, dim=1).to(weight.dtype)  # (out,)
        base_result = kwargs.get("base_result")
        if base_result is None:  # the adapter's dropout is active: the forward multiplies the dropped x again
            base_result = F.linear(x, weight)
        elif base.bias is not None:
            base_result = base_result - base.bias
        adapted = F.linear(F.linear(x, lora_a.weight), lora_b.weight)  # (..., out): lora_B(lora_A(x))
        return ((base_result + s * adapted) / norm,)


@register_norm_rule(DORA_LINEAR, params=("weight",), tokenwise=True, accepts=_known_dora_call,
                    rule_inputs=_dora_scaled_input)
def dora_magnitude_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                        trainable: set[str]) -> dict:
    if "weight" not in trainable:
        return {}
    return {"weight": scale_grads(inputs[0], output_grad, module.weight)}


def _svd_adapter_parameters(module) -> frozenset:
    """Each adapter's A, E and B, and its rank (a frozen Parameter: a trained one would take the fallback)."""
    return frozenset(f"{name}.{adapter}" for adapter in module.lora_A
                     for name in ("lora_A", "lora_B", "lora_E", "ranknum"))


def _active_svd(module) -> list:
    return [a for a in module.active_adapters if a in module.lora_A]


def _computes_the_svd_adapters(module, args, kwargs) -> bool:
    """Whether this call adds each active adapter's c x (A * E)^T B^T to the base's output, as the rule assumes."""
    if not plain_adapted_call(module, args, kwargs):
        return False
    return all(type(module.lora_dropout[a]) is torch.nn.Identity or not module.training for a in _active_svd(module))


def _holds_svd_output_grad(module, inputs, output, trainable) -> bool:
    """Book-keeping keeps G itself in B's OuterProduct where G is in the adapter's dtype already."""
    return all(module.lora_A[a].dtype == output.dtype for a in _active_svd(module)) and any(
        f"lora_B.{a}" in trainable for a in _active_svd(module))


@register_norm_rule(ADALORA_LINEAR, params=_svd_adapter_parameters, tokenwise=True,
                    holds_output_grad=_holds_svd_output_grad, accepts=_computes_the_svd_adapters)
def adalora_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                 trainable: set[str]) -> dict:
    x = inputs[0]
    batch = x.shape[0]
    factors = {}
    for adapter in _active_svd(module):
        a, e, b = module.lora_A[adapter], module.lora_E[adapter], module.lora_B[adapter]  # (r, in), (r, 1), (out, r)
        names = {side: f"lora_{side}.{adapter}" for side in "ABE"}
        if not any(n in trainable for n in names.values()):
            continue
        c = module.scaling[adapter] / (module.ranknum[adapter] + 1e-5)  # (1,)
        rows = x.to(a.dtype).reshape(batch, -1, a.shape[1])  # (B, T, in)
        grads = output_grad.to(a.dtype).reshape(batch, -1, b.shape[0])  # (B, T, out)
        if names["B"] in trainable:
            factors[names["B"]] = OuterProduct(grads, (rows @ (a * e).t()) * c, b.shape)  # u: (B, T, r)
        if names["A"] in trainable or names["E"] in trainable:
            k = (grads @ b) * c  # (B, T, r)
            if names["A"] in trainable:
                factors[names["A"]] = OuterProduct(k * e.t(), rows, a.shape)
            if names["E"] in trainable:
                summed = scale_grads(rows @ a.t(), k, e.view(-1))  # sum_t k_t * v_t: (B, r)
                factors[names["E"]] = type(summed)(summed.grads.reshape(batch, *e.shape), summed.mass)
    return factors
