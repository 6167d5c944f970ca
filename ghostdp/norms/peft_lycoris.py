"""peft's LoHa and LoKr on a Linear: adapters that form a weight from their parameters. Registered by qualified name,
so ``import ghostdp`` imports no peft module; a call the rule does not know takes the exact fallback.

For each active adapter the forward adds x dW^T to the frozen base's output, where dW (out, in) is formed from the
adapter's own parameters alone (``get_delta_weight``): LoHa's s (W1a W1b) * (W2a W2b), LoKr's s kron(W1, W2), each
factor either a matrix or a product of two. With G_t the output grad at position t:
- g_i(dW) = sum_t G_t x_t^T, a Linear's weight gradient (an OuterProduct of G and x);
- each parameter's g_i is J^T g_i(dW), J the Jacobian of dW in that parameter: dW is recomputed from the parameters
  (peft's own ``get_delta_weight``, without its rank dropout) and each example's g_i(dW) is pulled back through it
  by batched VJPs (batched_vjp.grads_through), as for a weight-normalised weight (parametrized.py).
That materialises each example's (out, in) gradient of dW, in chunks of ELEMENT_BUDGET elements, where the exact
fallback runs a batched VJP of the whole layer per chunk of examples (tiny BERT, L=2, H=64, B=16, T=32, one CPU
thread, book-keeping: 3.4x plain with LoHa on query and value, 3.3x with LoKr). G and x are taken in dW's dtype,
as the adapter's F.linear reads them.

Declined, so that such a call takes the fallback (``_computes_the_adapters``, ``_adapters_applied``): adapters
disabled or merged, other arguments, a base layer that is not an nn.Linear, and in training an adapter with a rank
dropout (a random mask of dW's rows) or a module dropout (the adapter skipped at random); and any call where the
output's graph does not hold one sum per active adapter: peft draws ``torch.rand(1) > module_dropout`` even for a
module dropout of 0, which skips the adapter when the draw is exactly 0 (once in 2^24 calls), and the rule must not
then give it the gradient of a call that did not use it.
"""
from __future__ import annotations

import functools

import torch

from .batched_vjp import pulled_back
from .factors import OuterProduct
from .registry import register_norm_rule

LOHA_LINEAR = "peft.tuners.loha.layer.Linear"
LOKR_LINEAR = "peft.tuners.lokr.layer.Linear"


def _adapter_parameters(module) -> frozenset:
    """The names of every adapter's parameters, as the module owns them (its ParameterDicts by adapter)."""
    return frozenset(f"{kind}.{adapter}" for kind in module.adapter_layer_names for adapter in getattr(module, kind))


def _active(module) -> list:
    return [a for a in module.active_adapters if a in module._available_adapters]


def _computes_the_adapters(module, args, kwargs) -> bool:
    """Whether this call adds x dW^T of each active adapter to the base's output with no random draw in dW."""
    if len(args) != 1 or kwargs or module.disable_adapters or module.merged:
        return False
    if type(module.get_base_layer()) is not torch.nn.Linear:  # a convolution, its CP forms of dW
        return False
    return not module.training or all(not module.rank_dropout[a] and not module.module_dropout[a]
                                      for a in _active(module))


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
        grads = grads.to(other["1"].dtype)
        p = {side: grads * other[side] for side in {side for side, _ in parts}}
        return [p[side] @ factor[f"w{side}_b"].t() if part == "a" else factor[f"w{side}_a"].t() @ p[side]
                for side, part in parts]
    return pullback


def _lokr_pullback(module, adapter, names):
    """(grads of dW, (k, out, in)) -> each of ``names``' grads, for dW = s kron(W1, W2), W1 (a, b), W2 (c, d), each a
    matrix or a product of two: dW[i c + k, j d + l] = s W1[i, j] W2[k, l], so g(W1)[i, j] = s sum_kl g[i c + k,
    j d + l] W2[k, l] and g(W2) alike; a product's factors as in a Linear (g(Wa) = g(W) Wb^T, g(Wb) = Wa^T g(W))."""
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

    def pullback(grads):
        grads = grads.to(w1.dtype).reshape(-1, w1.shape[0], w2.shape[0], w1.shape[1], w2.shape[1])  # (k, a, c, b, d)
        whole = {"1": torch.einsum("nikjl,kl->nij", grads, w2) * s, "2": torch.einsum("nikjl,ij->nkl", grads, w1) * s}
        out = []
        for name in names:
            kind = name.split(".")[0][len("lokr_w"):]  # "1", "1_a", "1_b", ...
            g, (_, a, b) = whole[kind[0]], sides[kind[0]]
            out.append(g if len(kind) == 1 else g @ b.t() if kind[-1] == "a" else a.t() @ g)
        return out
    return pullback


_PULLBACKS = {LOHA_LINEAR: _loha_pullback, LOKR_LINEAR: _lokr_pullback}


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
            # dW's dtype, in which F.linear reads x and from which G reaches it
            dtype = functools.reduce(torch.promote_types, [module.get_parameter(n).dtype for n in held])
            shape = module.get_base_layer().weight.shape  # dW's: (out, in)
            rows = x.to(dtype).reshape(batch, -1, shape[1])
            grads = output_grad.to(dtype).reshape(batch, -1, shape[0])
            delta = OuterProduct(grads, rows, shape)
            factors.update(zip(names, pulled_back(delta, shape.numel(), pullback_of(module, adapter, names))))
        return factors
    return rule


for _kind in (LOHA_LINEAR, LOKR_LINEAR):
    register_norm_rule(_kind, _formed_weight_rule(_kind), params=_adapter_parameters, tokenwise=True,
                       accepts=_computes_the_adapters, rule_inputs=_adapters_applied)
