"""A module's own parameter used by one elementwise op (or as a matrix product's weight) inside its forward: the op's
output grad gives its per-example gradient, so the module needs no fallback.

Some modules own a parameter beside their children and apply it in their forward by one elementwise op, then go on
to compute much more: BEiT's, Data2Vec-vision's and DiT's layers scale the attention's and the MLP's outputs
(``self.lambda_1 * attention_output``) before their residuals, and their embeddings broadcast a class token to the
batch; wav2vec2's model (and HuBERT's, Data2Vec-audio's, UniSpeech's, SEW's copies) writes ``masked_spec_embed``
into the time steps that SpecAugment masks. Such a module has no rule, and the exact fallback took one batched VJP
of its whole forward per chunk of examples: on one CPU thread at B=8 a 4-layer BEiT's book-keeping step took 3.9x
plain (2.0x with its parameters as uses), a 4-layer wav2vec2 for CTC's 6.3x (1.7x).

Where every trainable parameter of the module's own reaches its outputs through exactly one edge of its forward's
graph, from a node ``op`` of one of these kinds (the parameter itself, or cast to another dtype, as that node's
operand), each is a use (``ElementwiseUse``) that the recorder captures like a ruled call (capture.py): its G is the
gradient of the op's output, taken at the op's node, and
- ``scaled``: ``op = p * x`` (or ``x * p``), p of x's trailing shape: g_i = sum of G_i * x_i over the positions p
  broadcasts over (elementwise.scale_grads), x as the op saved it;
- ``written``: ``h[mask] = p``, mask boolean over h's leading dims and p the value written at each masked position:
  g_i = sum of G_i over example i's written positions (elementwise.shift_grads of G times the mask or the count of
  writes). Into a tensor that is not a view, the op's node is an index_put's, which keeps the mask; into a view
  (wav2vec2's feature projection's output, a view of the Linear's matmul) it is autograd's CopySlices, which hides
  both the op and its mask: the node is called once on a probe of distinct values, and the gradient it gives p must
  be whole rows of the probe, each exactly, which names the rows written (``_written_rows``; one host read a step);
- ``expanded``: ``op = p.expand(B, ...)``, p of size 1 (or absent) on dim 0, broadcast to the batch (a class token
  or a mask token, ``self.cls_token.expand(batch_size, -1, -1)``): g_i = sum of G_i over the dims p broadcasts over;
- ``added``: ``op = x + p``, p broadcast over the batch (DeBERTa's ``q_bias``, added to the queries per head):
  g_i = sum of G_i over the dims p broadcasts over;
- ``linear`` and ``matmul``: ``op = x @ p.t()`` (``F.linear(x, p)``: a mixture of experts' router, transformers'
  ``*TopKRouter``) or ``x @ p``, an mm's or addmm's node on the rows x (N, d) of a 2-D input or of a (B, T, d) one
  viewed so: g_i = G_i^T x_i (or x_i^T G_i) over example i's rows, a Linear's factors (OuterProduct), x as the node
  saved it; with its bias b trained beside it in one addmm (``F.linear(x, p, b)``), one use of both, as a Linear's
  (g_i(b) = sum of G_i over example i's rows). Since 2026-12-02 (the exact fallback's before).
p is the op's operand itself, or seen through a chain of casts and views that keep its elements in their order
(``gamma.unsqueeze(-1).unsqueeze(-1) * x``, PoolFormer's layer scales; DeBERTa's bias viewed per head and permuted):
its gradient is then the operand's, reshaped (``ElementwiseUse.shape``: p's shape as the op reads it). The chain may
also hold elementwise functions of one argument (_FUNCTIONS: a gate's ``tanh()`` in gated cross-attention, Mllama's
``1 - gate.tanh()``, Swin v2's ``clamp(logit_scale, max=...).exp()``, a sigmoid, a power): the operand is then
f(p), whose Jacobian is diagonal, so g_i(p) = f'(p) * g_i(f(p)), f'(p) formed when the forward has run by the
chain's own nodes applied to ones (``ElementwiseUse.derivative``; autograd's formulas, clamp's mask at its bounds
included). Since 2026-12-02; such a module took the exact fallback before.
The layout proof checks each use's G as it checks a call's output grad (where its examples lie), and the step's audit
attributes the parameter's edge to the use's region (the op down to its other operand), so a parameter used in any
other way is still refused or takes the fallback (``find_uses`` returns None).
"""
from __future__ import annotations

import math

import torch

from .elementwise import scale_grads, scale_is_tokenwise, shift_grads
from .factors import Instantiated, OuterProduct, SummedTokens
from .registry import ROWS, RuleEntry

SCALED, WRITTEN, EXPANDED, ADDED = "scaled", "written", "expanded", "added"
# A weight of a matrix product on the rows of its input x (N, d): ``x @ p.t()`` (F.linear's, p (m, d)) and ``x @ p``
# (p (d, m)), by an mm's or addmm's node (F.linear on 2-D x, and on (B, T, d) x viewed as 2-D).
LINEAR, MATMUL = "linear", "matmul"
_PRODUCTS = {"MmBackward0": 1, "AddmmBackward0": 2}  # the node kinds and the input index of their right operand
# The nodes that may lie between p and its op: a cast, and views that keep p's elements in their order (a permute or
# a transpose only where it moves dims of size 1: _keeps_order), so that p's gradient is the operand's, reshaped.
_VIEWS = frozenset({"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                    "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
                    "SqueezeBackward2", "PermuteBackward0", "TransposeBackward0"})
# Elementwise functions of one tensor (a diagonal Jacobian), which may lie between p and its op too, with the
# constants their nodes save that f' depends on (clamp's bounds, a power's exponent, 1 - p's alpha, softplus's).
_FUNCTIONS = {"TanhBackward0": (), "SigmoidBackward0": (), "ExpBackward0": (), "NegBackward0": (),
              "ClampBackward1": ("_saved_min", "_saved_max"), "ClampMinBackward0": ("_saved_min",),
              "ClampMaxBackward0": ("_saved_max",), "SoftplusBackward0": ("_saved_beta", "_saved_threshold"),
              "RsubBackward1": ("_saved_alpha",), "PowBackward0": ("_saved_exponent",)}
_CHAIN = _VIEWS | frozenset(_FUNCTIONS)


class ElementwiseUse:
    """Parameter ``name`` of module ``owner`` as the operand of one elementwise op (``kind``: SCALED, WRITTEN,
    EXPANDED or ADDED), read by the op in ``shape``; the "module" of its captured call (records.ModuleCall), one per
    (owner, name, kind, shape), kept across steps so that its proven layouts are its own. Made by ``use_of``, of a
    subclass named as the owner's class: errors name a call's module by its class."""

    __slots__ = ("owner", "name", "kind", "shape", "derivative", "bias", "__weakref__")

    def __init__(self, owner: torch.nn.Module, name: str, kind: str, shape: tuple, bias: str | None = None):
        self.owner, self.name, self.kind, self.shape = owner, name, kind, shape
        self.derivative = None  # f'(p) where the op reads f(p) (module doc), of p's shape: set at each forward
        self.bias = bias  # a product's use: the parameter its addmm adds to every row, trained with it, or None

    @property
    def param(self) -> torch.nn.Parameter:
        return self.owner.get_parameter(self.name)  # its own, or in a ParameterDict of its own ("ia3_l.default")

    def operand(self) -> torch.Tensor:
        """The parameter as its op reads it: of ``shape``, its elements in their order."""
        return self.param.view(self.shape)

    def as_param(self, grads: Instantiated) -> Instantiated:
        """Per-example gradients of the operand, (B, *shape), as the parameter's, (B, *param.shape): times f'(p)
        where the operand is f(p), its token mass bounded by max |f'(p)| times the operand's."""
        g = grads.grads.reshape(grads.grads.shape[0], *self.param.shape)
        if self.derivative is None:
            return Instantiated(g, grads.mass)
        mass = None if grads.mass is None else grads.mass * self.derivative.abs().amax().to(grads.mass.dtype)
        return Instantiated(g * self.derivative.to(g.dtype), mass)


_USE_TYPES = {}  # the owner's class -> the ElementwiseUse subclass of its name


def use_of(owner: torch.nn.Module, name: str, kind: str, shape: tuple, bias: str | None = None) -> ElementwiseUse:
    """An ElementwiseUse of ``owner``'s parameter ``name`` (and of a product's ``bias``), of the subclass named as
    ``owner``'s class."""
    owner_type = type(owner)
    use_type = _USE_TYPES.get(owner_type)
    if use_type is None:
        use_type = _USE_TYPES[owner_type] = type(owner_type.__name__, (ElementwiseUse,), {"__slots__": ()})
    return use_type(owner, name, kind, shape, bias)


def scaled_rule(use: ElementwiseUse, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """op = p * x: g_i = sum over the positions p broadcasts over of G_i * x_i (inputs: (x,), batch first)."""
    return {use.name: use.as_param(scale_grads(inputs[0], output_grad, use.operand()))}


def broadcast_rule(use: ElementwiseUse, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """op = p.expand(B, ...) or x + p: g_i = sum of G_i over the dims p broadcasts over (no inputs)."""
    return {use.name: use.as_param(shift_grads(output_grad, use.operand()))}


def written_rule(use: ElementwiseUse, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """h[mask] = p: g_i = sum of G_i over example i's written positions (inputs: (the mask, or the count of writes at
    each position,), batch first, of G's leading shape)."""
    mask = inputs[0]
    masked = output_grad * mask.reshape(*mask.shape, *[1] * (output_grad.dim() - mask.dim())).to(output_grad.dtype)
    return {use.name: use.as_param(shift_grads(masked, use.operand()))}


def product_rule(use: ElementwiseUse, inputs: tuple, output_grad: torch.Tensor, trainable) -> dict:
    """op = x @ p.t() (LINEAR: g_i = G_i^T x_i) or x @ p (MATMUL: g_i = x_i^T G_i), over each example's rows (inputs:
    (x,), batch first): a Linear's factors (factors.OuterProduct)."""
    x, G = inputs[0], output_grad
    if x.dim() == 2:  # one row per example
        x, G = x.unsqueeze(1), G.unsqueeze(1)
    left, right = (G, x) if use.kind == LINEAR else (x, G)
    out = {use.name: OuterProduct(left, right, use.param.shape, input_side="right" if use.kind == LINEAR else "left")}
    if use.bias is not None:  # added to every row: g_i = sum of G_i over example i's rows (after the weight: its
        out[use.bias] = SummedTokens(G)  # norm and mass reuse the Gram of G the weight forms, as a Linear's bias)
    return out


def _tokenwise(use: ElementwiseUse) -> bool | str:
    return True if scale_is_tokenwise(use.operand()) else ROWS


# Tokenwise as the layout proof reads it (any leading dim may hold the examples): a parameter that is the same at every
# leading position (elementwise.scale_is_tokenwise); a value written at each masked position, whose mask the layout
# makes batch first with G. Any other parameter of a use broadcasts over the op's dim 0 (_broadcasts_over_batch), so
# the examples may lie on dim 0 or be flattened into it (layout.ROWS: Swin v2's logit scale per head, applied to a
# batch of windows, each example's windows in a row).
ENTRIES = {SCALED: RuleEntry(rule=scaled_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=_tokenwise),
           WRITTEN: RuleEntry(rule=written_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=True),
           EXPANDED: RuleEntry(rule=broadcast_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=_tokenwise),
           ADDED: RuleEntry(rule=broadcast_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=_tokenwise),
           LINEAR: RuleEntry(rule=product_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=True),
           MATMUL: RuleEntry(rule=product_rule, params=frozenset(), owner=ElementwiseUse, tokenwise=True)}


class Found:
    """A use found in the graph: ``node``, the op's autograd node (its output grad is the use's G, at output 0);
    ``operand``, what the rule reads (x, the mask or the counts, or None); ``below``, the op's other input nodes (its
    region's bound); ``shape``, the op's output shape; ``param_shape``, p's as the op reads it."""

    __slots__ = ("name", "kind", "node", "operand", "below", "shape", "param_shape", "functions", "derivative", "bias")

    def __init__(self, name, kind, node, operand, below, shape, param_shape):
        self.name, self.kind, self.node, self.operand, self.below = name, kind, node, operand, below
        self.shape, self.param_shape = shape, param_shape
        self.functions, self.derivative = (), None  # the chain's functions (their kinds and bounds) and f'(p)
        self.bias = None  # a product's use: its addmm's bias parameter, trained with it (find_uses)


def find_uses(params: dict, outputs, input_nodes, batch_size: int | None) -> list[Found] | None:
    """The uses of ``params`` (name -> trainable parameter owned by the module) in the graph from the module's
    ``outputs`` down to (not into) ``input_nodes``, one per parameter, or None where any parameter has another
    number of edges there, is reached other than as an op's operand of a kind above (directly, or through a chain
    of _CHAIN nodes each with one consumer), or the op's output has not the batch on dim 0 (see the module doc). One
    walk of the module's graph."""
    if batch_size is None or not params:
        return None
    by_id = {id(p): name for name, p in params.items()}
    edges = {name: [] for name in params}  # name -> [(node, input index)] into its accumulator
    parents = {}  # a node of _CHAIN -> [(node, input index)] reaching it
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen or node in input_nodes:
            continue
        seen.add(node)
        for index, (below, _) in enumerate(node.next_functions):
            if below is None:
                continue
            variable = getattr(below, "variable", None)
            if variable is not None:  # a leaf's accumulator
                name = by_id.get(id(variable))
                if name is not None:
                    edges[name].append((node, index))
                continue
            if type(below).__name__ in _CHAIN or type(below).__name__ == "TBackward0" or _constant_multiple(below):
                parents.setdefault(below, []).append((node, index))
            stack.append(below)
    found, biases = [], {}  # biases: an addmm's node -> the name of the parameter it adds as its bias
    for name, into in edges.items():
        if len(into) != 1:
            return None
        node, index = into[0]
        param_shape = tuple(params[name].shape)
        if (type(node).__name__ == "AddmmBackward0" and index == 0 and len(param_shape) == 1
                and node._saved_beta == 1):  # F.linear's bias, added to every row: its weight's use takes it
            biases[node] = name
            continue
        chain = []  # from p up to the op
        while type(node).__name__ in _CHAIN or _constant_multiple(node):  # up the chain from p to its op
            one_input = len(node.next_functions) == 1 or _constant_multiple(node)
            if not one_input or len(parents.get(node, ())) != 1 or not _keeps_order(node):
                return None
            if _is_function(node) and tuple(node._input_metadata[0].shape) != param_shape:
                return None  # an elementwise function of p must keep its shape (no broadcast inside the chain)
            param_shape = tuple(node._input_metadata[0].shape)
            chain.append(node)
            node, index = parents[node][0]
        if math.prod(param_shape) != params[name].numel():
            return None
        functions = any(_is_function(n) for n in chain)  # f(p), not p (a product takes p itself)
        if type(node).__name__ == "TBackward0":  # x @ p.t(): p's transpose, the right operand of a product
            if len(parents.get(node, ())) != 1 or len(param_shape) != 2 or functions:
                return None
            node, index = parents[node][0]
            use = _product_at(name, param_shape, node, index, batch_size, LINEAR)
        elif len(param_shape) == 2 and not functions and _PRODUCTS.get(type(node).__name__) == index:  # x @ p
            use = _product_at(name, param_shape, node, index, batch_size, MATMUL)
        else:
            use = _use_at(name, param_shape, node, index, batch_size)
        if use is None:
            return None
        if functions:
            use.functions = tuple([_function_key(n) for n in chain if _is_function(n)])
            use.derivative = _derivative(chain, params[name], param_shape)
        found.append(use)
    for node, name in biases.items():
        product = next((f for f in found if f.node is node and f.kind in (LINEAR, MATMUL)), None)
        if product is None or tuple(params[name].shape) != product.shape[1:]:
            return None  # an addmm whose weight is not a product's use of this module
        product.bias = name
        product.below = frozenset(n for n in product.below if getattr(n, "variable", None) is not params[name])
    return found


def _function_key(node) -> tuple:
    """A function of the chain by its kind and its constants (_FUNCTIONS), so that two uses of one parameter through
    other functions are told apart."""
    kind = type(node).__name__
    if kind not in _FUNCTIONS:  # a multiple: by its constant
        return (kind, float(_multiplier(node)))
    return (kind,) + tuple(getattr(node, a) for a in _FUNCTIONS[kind])


def _constant_multiple(node) -> bool:
    """Whether the node is a multiply of one tensor by a constant number, which autograd wraps as a 0-dim tensor of
    no edge (IA3's ``ia3_scaling = 1; ia3_scaling *= l.flatten()``): an elementwise function, f(p) = c p."""
    if type(node).__name__ != "MulBackward0":
        return False
    (left, _), (right, _) = node.next_functions
    if (left is None) == (right is None):
        return False
    constant = _multiplier(node)
    return isinstance(constant, torch.Tensor) and constant.dim() == 0


def _multiplier(node):
    """A constant multiple's constant: the operand without an edge, which the multiply saved for the other's grad."""
    try:
        return node._saved_other if node.next_functions[1][0] is None else node._saved_self
    except RuntimeError:  # not saved (neither operand needed it)
        return None


def _is_function(node) -> bool:
    return type(node).__name__ in _FUNCTIONS or _constant_multiple(node)


def _derivative(chain, param, shape) -> torch.Tensor:
    """f'(p), of p's shape, for the chain from p (``chain[0]``) up to the op, which reads it in ``shape``: the
    chain's nodes applied to ones from the op down, each an elementwise function or a view (a diagonal Jacobian)."""
    with torch.no_grad():
        grad = torch.ones(shape, dtype=chain[-1]._input_metadata[0].dtype, device=param.device)
        for node in reversed(chain):
            grad = node(grad)
            if isinstance(grad, tuple):  # a constant multiple's: None for the constant
                grad = next(g for g in grad if g is not None)
        return grad.reshape(param.shape)


def _keeps_order(node) -> bool:
    """Whether a node of _CHAIN keeps its input's elements in their order: all but a permute or a transpose do, and
    those where only dims of size 1 move past the others (a bias viewed per head: (1, 1, H, d) -> (1, H, 1, d))."""
    kind = type(node).__name__
    if kind not in ("PermuteBackward0", "TransposeBackward0"):
        return True
    out = tuple(node._input_metadata[0].shape)
    if kind == "PermuteBackward0":
        order = [d % len(out) for d in node._saved_dims]
    else:
        order = list(range(len(out)))
        a, b = node._saved_dim0 % len(out), node._saved_dim1 % len(out)
        order[a], order[b] = order[b], order[a]
    moved = [order[k] for k in range(len(out)) if out[k] != 1]  # the input dim that each output dim above 1 reads
    return moved == sorted(moved)


def _broadcasts_over_batch(param_shape: tuple, shape: tuple) -> bool:
    """Whether p (of ``param_shape``) broadcasts to ``shape`` with dim 0, the batch's, of size 1 (or absent)."""
    aligned = (1,) * (len(shape) - len(param_shape)) + param_shape
    return len(aligned) == len(shape) and aligned[0] == 1 and all(a in (1, n) for a, n in zip(aligned, shape))


def _product_at(name, param_shape, node, index, batch_size, kind) -> Found | None:
    """The use of a 2-D parameter as the right operand of the product ``node`` (an mm's or addmm's: _PRODUCTS) of
    rows (N, d) whose N holds the batch's examples, or None."""
    if _PRODUCTS.get(type(node).__name__) != index or batch_size <= 1:
        return None
    shape = tuple(node._input_metadata[0].shape)
    if len(shape) != 2 or shape[0] % batch_size:
        return None
    if type(node).__name__ == "AddmmBackward0" and (node._saved_alpha != 1 or node._saved_beta != 1):
        return None  # alpha * x @ w + beta * bias: not a Linear's product
    rows = node._saved_mat1 if type(node).__name__ == "AddmmBackward0" else node._saved_self
    below = frozenset([n for k, (n, _) in enumerate(node.next_functions) if k != index and n is not None])
    return Found(name, kind, node, rows, below, shape, param_shape)


def _use_at(name, param_shape, node, index, batch_size) -> Found | None:
    """The use of a parameter, read in ``param_shape``, as input ``index`` of ``node``, where the node is an op of a
    kind above, else None."""
    kind = type(node).__name__
    shape = tuple(node._input_metadata[0].shape)
    if batch_size <= 1 or not shape:
        return None  # a batch of one: dim 0 could hold anything of size 1 (the fallback's masked VJP is exact there)
    below = frozenset([n for k, (n, _) in enumerate(node.next_functions) if k != index and n is not None])
    if kind == "CopySlices" and index == 1 and len(node.next_functions) == 2 and shape[0] % batch_size == 0:
        counts = _written_rows(node, param_shape, shape)  # (a view's base: the layout proof finds its examples' rows)
        return None if counts is None else Found(name, WRITTEN, node, counts, below, shape, param_shape)
    if shape[0] % batch_size:
        return None  # dim 0 holds the examples, or rows of them (a window batch), which the layout proof checks
    if kind == "MulBackward0" and len(node.next_functions) == 2:
        x = node._saved_other if index == 0 else node._saved_self
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or not _broadcasts_over_batch(param_shape, shape):
            return None  # x broadcast, or p spanning the batch dim (a per-example scale)
        return Found(name, SCALED, node, x, below, shape, param_shape)
    if kind == "ExpandBackward0" and len(node.next_functions) == 1 and _broadcasts_over_batch(param_shape, shape):
        return Found(name, EXPANDED, node, None, below, shape, param_shape)
    if (kind == "AddBackward0" and len(node.next_functions) == 2 and node._saved_alpha == 1
            and _broadcasts_over_batch(param_shape, shape)):
        return Found(name, ADDED, node, None, below, shape, param_shape)
    if kind == "IndexPutBackward0" and index == 1 and not node._saved_accumulate:
        indices = node._saved_indices
        if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.bool:
            return None
        mask = indices[0]
        k = mask.dim()
        if tuple(mask.shape) != shape[:k] or param_shape != shape[k:]:
            return None  # one value of p at every masked position, written whole
        return Found(name, WRITTEN, node, mask, below, shape, param_shape)
    return None


# Elements up to which a probe's codes 1, 2, ... are exact in each dtype (16-bit dtypes: too few).
_EXACT_CODES = {torch.float32: 1 << 24, torch.float64: 1 << 53}


def _written_rows(node, param_shape, shape):
    """For a CopySlices node (an in-place op on a view; its output is the view's base, ``shape`` (N, d)) whose second
    input is a parameter p read as (d,): how often each of the N rows was written with p ((N,), the base's dtype),
    where the op's gradient for p gathers whole rows of G (``h[mask] = p``, ``h[rows] = p``, ``h.copy_(p)`` into a
    view: g = the sum of G over the rows written); None for any other op (``h.mul_(p)``, ``h.add_(p)`` on a 3-D view,
    a per-element mask, ...). The node hides its op and the op's indices, so it is called once on a probe whose
    elements are 1, 2, ..., N * d: the gradient it gives p must be whole rows of the probe, each row exactly. One host
    read."""
    metadata = node._input_metadata[0]
    if len(shape) != 2 or param_shape != shape[1:] or metadata.dtype not in _EXACT_CODES:
        return None
    rows_total, width = shape
    if rows_total * width >= _EXACT_CODES[metadata.dtype]:
        return None
    with torch.no_grad():
        probe = torch.arange(1, rows_total * width + 1, dtype=metadata.dtype, device=metadata.device)
        probe = probe.view(rows_total, width)
        try:
            got = node(probe)[1]  # p's gradient as the op forms it, before autograd sums it to p's shape: (written, d)
        except RuntimeError:  # an op whose backward cannot run on the probe (another dtype it expects, ...)
            return None
        if got is None or got.dim() != 2 or got.shape[1] != width:
            return None
        rows = torch.div(got[:, 0] - 1, width, rounding_mode="floor").long()
        inside = (rows >= 0) & (rows < rows_total)
        rows = rows.clamp(0, rows_total - 1)
        if got.shape[0] and not bool((inside.all() & (got == probe[rows]).all())):  # the host read
            return None
        return torch.zeros(rows_total, dtype=metadata.dtype, device=metadata.device).index_add_(
            0, rows, torch.ones(rows.shape[0], dtype=metadata.dtype, device=metadata.device))
