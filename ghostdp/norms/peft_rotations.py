"""peft's orthogonal adapters: OFT's rotation of a layer's input, HRA's Householder reflections and BOFT's butterfly
rotation of a Linear. Registered by qualified name, so ``import ghostdp`` imports no peft module; a call the rules do
not know takes the exact fallback.

Each rotation Q is formed from the adapter's parameters alone (a Cayley transform, a product of reflections), so the
rules form each example's gradient of Q as a Linear's factors give it, and pull it back to the parameters through Q's
own small graph, recomputed from them: OFT's by one backward over B copies of its rows, HRA's in closed form, BOFT's
by batched VJPs (batched_vjp.grads_through), as for a weight-normalised weight (parametrized.py). That materialises
each example's gradient of Q (as many elements as Q has), where the exact fallback ran a batched VJP of the whole
layer per chunk of examples (tiny BERT, L=2, H=64, B=16, T=32, one CPU thread, book-keeping, adapters on query and
value: OFT 3.10x plain, HRA 3.28x, BOFT 4.51x; by these rules 1.70x, 1.77x, 2.13x). With x_t the input and G_t the
output grad at position t:

**OFT** (``peft.tuners.oft.layer.OFTRotationModule``, which peft's OFT layers call on their input). It rotates each
block of k features of x (..., n k) by an orthogonal R_j (k, k), the Cayley transform (exact, or its Neumann series) of
a skew-symmetric matrix whose upper triangle is row j of its ``weight``, every block by the same R where
``block_share``: y[..., j, c] = sum_k x[..., j, k] R_j[k, c], so g_i(R_j) = sum_t x_t[j]^T G_t[j], (B, n, k, k). Row j
of ``weight`` forms R_j alone, so the B examples' pullbacks are one backward of the module's own transform over B copies
of the rows (``_pulled_to_weight``; by batched VJPs, 1.86x plain). Up to peft 0.21, on a convolution's 4-D input the
module rotated x's unfolded patches and folded them back (peft's own fold, linear but not laid out as the unfold's
adjoint): x is the patches and G the fold's VJP of the output grad. From peft 0.22 a 4-D input is rotated along its last
dim, as any other, and OFT's Conv2d rotates its base's weight instead (below). Declined (``_rotates_its_input``): other
arguments, inputs of more than 4 dims, and COFT (``coft``: the forward projects ``weight`` in place before using it).

**OFT on a convolution, peft 0.22** (``peft.tuners.oft.layer.Conv2d``, whose rotation modules have ``rotate``). y is the
frozen base's convolution of x by W_R, the base's weight (out, in k k) rotated by each active adapter's block-diagonal
R (``OFTRotationModule.rotate``, from the right of W viewed (out, in k k)), so g_i(W_R) is the convolution rule's factor
(conv.py), pulled back to each adapter's ``weight`` by batched VJPs of W_R as the layer forms it
(batched_vjp.grads_through). The layer owns its rotation modules' parameters (fallback.ABSORBED_CHILDREN: they are
not called). Declined: adapters disabled or merged, other arguments, a base that is not a frozen nn.Conv2d with zeros
padding, and COFT (its rotation projects ``weight`` in place).

**HRA** (``peft.tuners.hra.layer.HRALinear``). y = x (W H)^T + b with W, b the frozen base's and H (in, in) the product
of each active adapter's reflections (``get_delta_weight``), so g_i(H) = W^T g_i(W H) = sum_t (G_t W)^T x_t: an
OuterProduct of G W and x, pulled back through the reflections in closed form (``_reflections_pullback``; with the
Gram-Schmidt form, ``apply_GS``, by the VJP: 3.28x -> 2.38x plain by the VJP alone, 1.72x in closed form).

**BOFT** (``peft.tuners.boft.layer.Linear``). y = (base(x R) - b) * S + b with R (in, in) the product of each active
adapter's butterfly rotation and S (out,) the product of their scales s (``get_delta_weight``). With z = x R W^T (the
base's output less its bias):
- g_i(S) = sum_t G_t * z_t, and each adapter's s gets it times the other adapters' scales;
- g_i(R) = sum_t x_t^T ((G_t * S) W): an OuterProduct of x and (G * S) W.
Declined in training where an adapter has a dropout (``boft_dropout``: a random block of one random example's
rotation replaced by the identity).

HRA and BOFT are declined (``_adapts_a_frozen_linear``) where adapters are disabled or merged, with other arguments,
or where the base is not an nn.Linear with frozen parameters (their forwards read its weight and bias directly).
"""
from __future__ import annotations

import functools

import torch

from .batched_vjp import grads_through, pulled_back
from .conv import conv_rule
from .elementwise import scale_grads
from .factors import Instantiated, OuterProduct
from .fallback import ABSORBED_CHILDREN, ABSORBED_WHEN
from .peft_layers import adapter_parameters, plain_adapted_call
from .registry import register_norm_rule

OFT_ROTATION = "peft.tuners.oft.layer.OFTRotationModule"
HRA_LINEAR = "peft.tuners.hra.layer.HRALinear"
BOFT_LINEAR = "peft.tuners.boft.layer.Linear"


def _rotates_its_input(module, args, kwargs) -> bool:
    """Whether this call rotates the blocks of a (..., features) input as the OFT rule assumes."""
    return (len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and 1 < args[0].dim() < 5
            and not module.coft)


def _blocks(module) -> int:
    return module.in_features // module.block_size if module.block_share else module.r


def _pulled_to_weight(module, per_block: torch.Tensor) -> Instantiated:
    """Each example's gradient of ``weight`` from its gradient of the blocks' R, (B, blocks, k, k): row j of
    ``weight`` forms R_j alone, so the B examples' VJPs are one backward of the module's own Cayley transform over B
    copies of ``weight``'s rows, each copy given one example's gradient (no vmap: B times the blocks in one call)."""
    batch = per_block.shape[0]
    if module.block_share:  # one R for every block: its gradient is the blocks' sum
        per_block = per_block.sum(1, keepdim=True)
    copies = module.weight.detach().repeat(batch, 1).requires_grad_()  # (B n', k (k - 1) / 2)
    with torch.enable_grad():
        rotations = module._cayley_batch(copies, module.block_size, module.use_cayley_neumann,
                                         module.num_cayley_neumann_terms)
        (grads,) = torch.autograd.grad(rotations, copies, per_block.reshape(rotations.shape).to(rotations.dtype))
    return Instantiated(grads.reshape(batch, *module.weight.shape))


@register_norm_rule(OFT_ROTATION, params=("weight",), tokenwise=True, accepts=_rotates_its_input)
def oft_rotation_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                      trainable: set[str]) -> dict:
    if "weight" not in trainable:
        return {}
    x, dtype = inputs[0], module.weight.dtype
    batch, blocks, k = x.shape[0], _blocks(module), module.block_size
    if x.dim() == 4 and hasattr(module, "_unfold"):  # up to peft 0.21, a convolution's input: its patches are
        # rotated, then folded back by peft's fold (linear); from 0.22 rotated along its last dim, as any other
        patches = module._unfold(x.to(dtype))
        with torch.enable_grad():  # G at the rotated patches: the fold's VJP (exact, however the fold lays them out)
            rotated = torch.zeros_like(patches, requires_grad=True)
            (output_grad,) = torch.autograd.grad(module._fold(rotated, x.shape), rotated, output_grad.to(dtype))
        x = patches
    rows = x.to(dtype).reshape(batch, -1, blocks, k)
    grads = output_grad.to(dtype).reshape(batch, -1, blocks, k)
    per_block = torch.einsum("btjk,btjc->bjkc", rows, grads)  # each example's g(R): (B, blocks, k, k)
    return {"weight": _pulled_to_weight(module, per_block)}


def _active(module, held: str) -> list:
    return [a for a in module.active_adapters if a in getattr(module, held)]


OFT_CONV2D = "peft.tuners.oft.layer.Conv2d"


def _rotates_its_weight(module) -> bool:
    """Whether this OFT Conv2d rotates its base's weight (peft 0.22 on: its rotation modules have ``rotate``), not its
    input's patches through them (up to 0.21: the rotation modules' own calls, by the OFT rule)."""
    return all(hasattr(rotation, "rotate") for rotation in module.oft_R.values())


ABSORBED_CHILDREN[OFT_CONV2D] = ("oft_R",)
ABSORBED_WHEN[OFT_CONV2D] = _rotates_its_weight


def _rotates_a_frozen_conv(module, args, kwargs) -> bool:
    """Whether this call convolves x by its frozen base's weight rotated by the active adapters, as the rule assumes."""
    if not (_rotates_its_weight(module) and plain_adapted_call(module, args, kwargs)):
        return False
    base = module.get_base_layer()
    return (type(base) is torch.nn.Conv2d and base.padding_mode == "zeros"
            and not any(p.requires_grad for p in base.parameters())
            and not any(module.oft_R[a].coft for a in _active(module, "oft_R")))


def _rotated_weight(module) -> torch.Tensor:
    """W_R as the layer's forward forms it, with grad (the rule's VJP runs through it)."""
    weight = module.get_base_weight()
    rotated = weight.view(weight.shape[0], -1).t()
    for adapter in reversed(module.active_adapters):
        if adapter in module.oft_R:
            rotation = module.oft_R[adapter]
            rotated = rotation.rotate(rotated.to(rotation.weight.dtype))
    return rotated.t().reshape(weight.shape)


def _oft_conv_parameters(module) -> frozenset:
    return frozenset(f"oft_R.{a}.weight" for a in module.oft_R)


@register_norm_rule(OFT_CONV2D, params=_oft_conv_parameters, accepts=_rotates_a_frozen_conv)
def oft_conv_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
                  trainable: set[str]) -> dict:
    names = [f"oft_R.{a}.weight" for a in _active(module, "oft_R") if f"oft_R.{a}.weight" in trainable]
    if not names:
        return {}
    with torch.enable_grad():
        rotated = _rotated_weight(module)
    base, dtype = module.get_base_layer(), rotated.dtype
    factor = conv_rule(base, (inputs[0].to(dtype),), output_grad.to(dtype), {"weight"})["weight"]
    return dict(zip(names, grads_through(rotated, [module.get_parameter(n) for n in names], factor)))


def _adapts_a_frozen_linear(module, args, kwargs) -> bool:
    """Whether this call rotates a frozen nn.Linear by its active adapters, as the HRA and BOFT rules assume."""
    if not plain_adapted_call(module, args, kwargs):
        return False
    base = module.get_base_layer()
    return type(base) is torch.nn.Linear and not any(p.requires_grad for p in base.parameters())


def _trained(module, held, trainable) -> list:
    return [f"{held}.{a}" for a in _active(module, held) if f"{held}.{a}" in trainable]


def _dtype(module, held) -> torch.dtype:
    return functools.reduce(torch.promote_types, [getattr(module, held)[a].dtype for a in _active(module, held)])


@register_norm_rule(HRA_LINEAR, params=adapter_parameters, tokenwise=True, accepts=_adapts_a_frozen_linear)
def hra_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
             trainable: set[str]) -> dict:
    names = _trained(module, "hra_u", trainable)
    if not names:
        return {}
    dtype = _dtype(module, "hra_u")  # H's, in which the forward reads x and W
    weight = module.get_base_layer().weight.to(dtype)  # (out, in)
    x = inputs[0]
    batch = x.shape[0]
    rows = x.to(dtype).reshape(batch, -1, weight.shape[1])
    pulled = output_grad.to(dtype).reshape(batch, -1, weight.shape[0]) @ weight  # G W: (B, T, in)
    adapters = _active(module, "hra_u")
    factor = OuterProduct(pulled, rows, (weight.shape[1], weight.shape[1]))
    if not any(module.hra_apply_GS[a] for a in adapters):
        pullback = _reflections_pullback([module.hra_u[a].to(dtype) for a in adapters],
                                         [adapters.index(n.split(".", 1)[1]) for n in names])
        return dict(zip(names, pulled_back(factor, weight.shape[1] ** 2, pullback)))
    with torch.enable_grad():  # H as the forward forms it, from the adapters' vectors (Gram-Schmidt's: by the VJP)
        reflections = torch.eye(weight.shape[1], dtype=dtype, device=weight.device)
        for adapter in adapters:
            reflections = reflections @ module.get_delta_weight(adapter).to(dtype)
    return dict(zip(names, grads_through(reflections, [module.get_parameter(n) for n in names], factor)))


def _reflections_pullback(vectors: list, asked: list):
    """(each example's gradient of H, (k, n, n)) -> the gradients of the adapters ``asked`` (indices into
    ``vectors``, each adapter's (n, r) u), for H = prod_j (I - 2 v_j v_j^T) over every adapter's columns in order,
    v = u / ||u||. With W_j the product before factor j and g_j the gradient of W_{j+1}, backwards from g = g(H):
    g(v_j) = -2 (W_j^T g_j v_j + g_j^T W_j v_j), g_{j-1} = g_j - 2 (g_j v_j) v_j^T, and g(u) = (g(v) - v (v . g(v)))
    / ||u|| (the normalisation's Jacobian). peft forms H in the same order (HRA's forward, Gram-Schmidt aside)."""
    units = [(k, i, u[:, i] / u[:, i].norm(), u[:, i].norm()) for k, u in enumerate(vectors) for i in range(u.shape[1])]
    prefixes = [torch.eye(vectors[0].shape[0], dtype=vectors[0].dtype, device=vectors[0].device)]
    for _, _, v, _ in units:
        prefixes.append(prefixes[-1] - 2 * torch.outer(prefixes[-1] @ v, v))

    def pullback(grads):
        g = grads.to(vectors[0].dtype)
        out = {k: torch.empty(g.shape[0], *vectors[k].shape, dtype=g.dtype, device=g.device) for k in asked}
        for j in reversed(range(len(units))):
            k, i, v, norm = units[j]
            w, gv = prefixes[j], g @ v  # W_j, g_j v_j: (k, n)
            if k in out:
                g_v = -2 * (gv @ w + (w @ v) @ g)
                out[k][:, :, i] = (g_v - torch.outer(g_v @ v, v)) / norm
            g = g - 2 * gv.unsqueeze(-1) * v
        return [out[k] for k in asked]
    return pullback


def _boft_without_dropout(module, args, kwargs) -> bool:
    return _adapts_a_frozen_linear(module, args, kwargs) and (not module.training or all(
        type(module.boft_dropout[a]) is torch.nn.Identity for a in _active(module, "boft_R")))


@register_norm_rule(BOFT_LINEAR, params=adapter_parameters, tokenwise=True, accepts=_boft_without_dropout)
def boft_rule(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output_grad: torch.Tensor,
              trainable: set[str]) -> dict:
    rotations, scales = _trained(module, "boft_R", trainable), _trained(module, "boft_s", trainable)
    if not rotations and not scales:
        return {}
    x = inputs[0]
    dtype, batch = x.dtype, x.shape[0]  # the forward casts the rotation and scale to x's dtype
    weight = module.get_base_layer().weight.to(dtype)  # (out, in)
    with torch.enable_grad():  # R and S as the forward forms them
        rotation = torch.eye(weight.shape[1], dtype=dtype, device=weight.device)
        scale, each_scale = torch.ones(weight.shape[0], 1, dtype=dtype, device=weight.device), {}
        for adapter in _active(module, "boft_R"):
            butterfly, each_scale[adapter] = module.get_delta_weight(adapter)
            rotation, scale = butterfly.to(dtype) @ rotation, each_scale[adapter].to(dtype) * scale
    rows = x.reshape(batch, -1, weight.shape[1])
    grads = output_grad.to(dtype).reshape(batch, -1, weight.shape[0])
    factors = {}
    if scales:
        with torch.no_grad():
            of_scale = scale_grads((rows @ rotation) @ weight.t(), grads, scale.view(-1))  # g(S): (B, out)
        for name in scales:
            adapter = name.split(".", 1)[1]
            others = functools.reduce(torch.mul, [s.detach().to(dtype) for a, s in each_scale.items() if a != adapter],
                                      torch.ones_like(scale.detach()))  # the other adapters' scales: (out, 1)
            factors[name] = Instantiated(of_scale.grads.reshape(batch, -1, 1) * others, of_scale.mass)
    if rotations:
        factor = OuterProduct(rows, (grads * scale.detach().view(-1)) @ weight, rotation.shape)
        factors.update(zip(rotations, grads_through(rotation, [module.get_parameter(n) for n in rotations], factor)))
    return factors
