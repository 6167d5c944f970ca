"""peft's LoHa and LoKr on a Linear or a convolution: adapters that form a weight from their parameters. Registered by
qualified name, so ``import ghostdp`` imports no peft module; a call the rule does not know takes the exact fallback.

For each active adapter the forward adds x dW^T (a convolution: the base's convolution of x by dW) to the frozen
base's output, where dW is formed from the adapter's own parameters alone (``get_delta_weight``): LoHa's
s (W1a W1b) * (W2a W2b), LoKr's s kron(W1, W2), each factor either a matrix or a product of two (on a convolution
LoKr's W2 may carry the kernel's dims), reshaped to the base's weight. With G_t the output grad at position t:
- g_i(dW) = sum_t G_t x_t^T, a Linear's weight gradient (an OuterProduct of G and x), or the convolution rule's
  factor of the base's convolution (conv.py);
- each parameter's g_i is J^T g_i(dW), J the Jacobian of dW in that parameter, in closed form (``_loha_pullback``,
  ``_lokr_pullback``) on each example's materialised g_i(dW), in chunks of ELEMENT_BUDGET elements
  (batched_vjp.pulled_back).
The exact fallback ran a batched VJP of the whole layer per chunk of examples (tiny BERT, L=2, H=64, B=16, T=32, one
CPU thread, book-keeping, r=8 on query and value: LoHa 3.19x plain, LoKr 3.40x; by the rule 1.81x and 1.71x; a 3-layer
32-channel convolution net on 16x16 images, B=32, r=4 on two layers: LoHa 8.62x -> 1.63x, LoKr 9.17x -> 1.44x). G and x
are taken in dW's dtype, as the adapter's F.linear (or convolution) reads them.

Declined, so that such a call takes the fallback (``_computes_the_adapters``, ``_adapters_applied``): adapters
disabled or merged, other arguments, a base that is not the layer's own class (nn.Linear, nn.Conv2d, nn.Conv1d), a
convolution with a padding mode other than zeros (dW's convolution pads with zeros) or in a CP form
(use_effective_conv2d's core tensors; LoKr's 3-D W2 on a Conv1d, which torch.kron aligns from the left), and in
training an adapter with a rank dropout (a random mask of dW's rows) or a module dropout (the adapter skipped at
random); and any call where the output's graph does not hold one sum per active adapter: peft draws
``torch.rand(1) > module_dropout`` even for a module dropout of 0, which skips the adapter when the draw is exactly 0
(once in 2^24 calls), and the rule must not then give it the gradient of a call that did not use it.
"""
from __future__ import annotations

import functools

import torch

from .batched_vjp import pulled_back
from .conv import conv_rule
from .factors import OuterProduct
from .peft_layers import adapter_parameters, plain_adapted_call
from .registry import qualified_name, register_norm_rule

LOHA_LINEAR = "peft.tuners.loha.layer.Linear"
LOKR_LINEAR = "peft.tuners.lokr.layer.Linear"
# The convolutions, with the base class each must wrap: dW is then a convolution's weight (out, in / groups, *k)
CONVOLUTIONS = {f"peft.tuners.{tuner}.layer.{name}": base for tuner in ("loha", "lokr")
                for name, base in (("Conv2d", torch.nn.Conv2d), ("Conv1d", torch.nn.Conv1d))}


def _active(module) -> list:
    return [a for a in module.active_adapters if a in module._available_adapters]


def _computes_the_adapters(module, args, kwargs) -> bool:
    """Whether this call adds each active adapter's x dW^T (or its convolution by dW) to the base's output with no
    random draw in dW, as the rule assumes."""
    if not plain_adapted_call(module, args, kwargs):
        return False
    base = module.get_base_layer()
    if type(base) is not CONVOLUTIONS.get(qualified_name(type(module)), torch.nn.Linear):
        return False
    if isinstance(base, torch.nn.modules.conv._ConvNd) and (
            base.padding_mode != "zeros"  # dW's convolution pads with zeros whatever the base's padding mode
            or any(_unknown_form(module, a) for a in _active(module))):
        return False
    return not module.training or all(not module.rank_dropout[a] and not module.module_dropout[a]
                                      for a in _active(module))


def _unknown_form(module, adapter) -> bool:
    """Whether a convolution's adapter forms dW otherwise than the rule's pullbacks assume: in its CP form
    (use_effective_conv2d: a core tensor), or, on a Conv1d, from a 3-D Kronecker factor, which torch.kron aligns
    with the 2-D one from the left ((1, a, b) against (c, d, k)) before peft reshapes the product."""
    lokr_w2 = getattr(module, "lokr_w2", {})
    return (adapter in getattr(module, "hada_t1", {}) or adapter in getattr(module, "lokr_t2", {})
            or (adapter in lokr_w2 and lokr_w2[adapter].dim() == 3))


def _adapters_applied(module, args, kwargs, output):
    """(x,) where the output's graph holds a sum per active adapter (result + x dW^T, then a cast), else None: an
    adapter skipped by peft's module-dropout draw (the module doc). A sum whose second term is a leaf or has no
    graph is the base's own (F.linear adds its bias so to a non-contiguous input's product), not an adapter's."""
    node = output.grad_fn
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        node = node.next_functions[0][0]
    sums = 0
    while node is not None and type(node).__name__ == "AddBackward0":
        term = node.next_functions[1][0]
        sums += term is not None and type(term).__name__ != "AccumulateGrad"
        node = node.next_functions[0][0]
    return tuple(args) if sums == len(_active(module)) else None


def _loha_pullback(module, adapter, names):
    """(grads of dW, (k, out, in)) -> each of ``names``' grads, for dW = s (W1a W1b) * (W2a W2b):
    g(W1a) = P1 W1b^T and g(W1b) = W1a^T P1 with P1 = s g(dW) * (W2a W2b); alike for W2a, W2b with P2 = s g(dW) * W1."""
    s = module.scaling[adapter]
    factor = {k: getattr(module, f"hada_{k}")[adapter] for k in ("w1_a", "w1_b", "w2_a", "w2_b")}
    # the other side's product, times s, by which each side's P multiplies g(dW)
    other = {"1": (factor["w2_a"] @ factor["w2_b"]) * s, "2": (factor["w1_a"] @ factor["w1_b"]) * s}
    parts = [name[len("hada_w"):].split(".")[0].split("_") for name in names]  # "hada_w1_a.default" -> "1", "a"

    def pullback(grads):
        grads = grads.to(other["1"].dtype).reshape(grads.shape[0], *other["1"].shape)  # a convolution's: flattened
        p = {side: grads * other[side] for side in {side for side, _ in parts}}
        return [p[side] @ factor[f"w{side}_b"].t() if part == "a" else factor[f"w{side}_a"].t() @ p[side]
                for side, part in parts]
    return pullback


def _lokr_pullback(module, adapter, names):
    """(grads of dW, (k, out, in, *kernel)) -> each of ``names``' grads, for dW = s kron(W1, W2), W1 (a, b), W2 (c, d)
    or, on a convolution, (c, d, *kernel), each a matrix or a product of two: dW[i c + k, j d + l, p] = s W1[i, j]
    W2[k, l, p], so g(W1)[i, j] = s sum_klp g[i c + k, j d + l, p] W2[k, l, p] and g(W2) alike; a product's factors
    as in a Linear (g(Wa) = g(W) Wb^T, g(Wb) = Wa^T g(W))."""
    sides = {}
    for side in "12":
        whole = getattr(module, f"lokr_w{side}")
        if adapter in whole:
            sides[side] = (whole[adapter], None, None)
        else:
            a, b = getattr(module, f"lokr_w{side}_a")[adapter], getattr(module, f"lokr_w{side}_b")[adapter]
            sides[side] = (a @ b, a, b)
    w1, w2 = sides["1"][0], sides["2"][0]
    s = module.scaling[adapter]
    kernel = w2.reshape(w2.shape[0], w2.shape[1], -1)  # (c, d, p): p = 1 unless W2 has a convolution's kernel

    def pullback(grads):
        # (k, a, c, b, d, p): out = i c + k, in (with the kernel) = (j d + l) p
        grads = grads.to(w1.dtype).reshape(-1, w1.shape[0], w2.shape[0], w1.shape[1], *kernel.shape[1:])
        whole = {"1": torch.einsum("nikjlp,klp->nij", grads, kernel) * s,
                 "2": (torch.einsum("nikjlp,ij->nklp", grads, w1) * s).reshape(-1, *w2.shape)}
        out = []
        for name in names:
            kind = name.split(".")[0][len("lokr_w"):]  # "1", "1_a", "1_b", ...
            g, (_, a, b) = whole[kind[0]], sides[kind[0]]
            out.append(g if len(kind) == 1 else g @ b.t() if kind[-1] == "a" else a.t() @ g)
        return out
    return pullback


_PULLBACKS = {kind: _loha_pullback if kind.startswith("peft.tuners.loha.") else _lokr_pullback
              for kind in (LOHA_LINEAR, LOKR_LINEAR, *CONVOLUTIONS)}


def _formed_weight_rule(kind):
    pullback_of = _PULLBACKS[kind]

    def rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
             trainable: set[str]) -> dict:
        x = inputs[0]
        batch = x.shape[0]
        factors = {}
        for adapter in _active(module):
            held = [f"{dict_name}.{adapter}" for dict_name in module.adapter_layer_names
                    if adapter in getattr(module, dict_name)]
            names = [n for n in held if n in trainable]
            if not names:
                continue
            # dW's dtype, in which F.linear (or the convolution) reads x and from which G reaches it
            dtype = functools.reduce(torch.promote_types, [module.get_parameter(n).dtype for n in held])
            base = module.get_base_layer()
            shape = base.weight.shape  # dW's: (out, in) or a convolution's (out, in / groups, *kernel)
            if isinstance(base, torch.nn.Linear):
                rows = x.to(dtype).reshape(batch, -1, shape[1])
                delta = OuterProduct(output_grad.to(dtype).reshape(batch, -1, shape[0]), rows, shape)
            else:  # the base's convolution with dW: its weight's factor (conv.py)
                delta = conv_rule(base, (x.to(dtype),), output_grad.to(dtype), {"weight"})["weight"]
            factors.update(zip(names, pulled_back(delta, shape.numel(), pullback_of(module, adapter, names))))
        return factors
    return rule


for _kind in (LOHA_LINEAR, LOKR_LINEAR, *CONVOLUTIONS):
    register_norm_rule(_kind, _formed_weight_rule(_kind), params=adapter_parameters,
                       tokenwise=_kind not in CONVOLUTIONS, accepts=_computes_the_adapters,
                       rule_inputs=_adapters_applied)
