"""Per-example gradients in factored form.

A norm rule never returns a per-example gradient tensor if it can avoid it. It
returns a *factor*: an object that knows the per-example gradient of one use of
one parameter implicitly, and can give

- ``sq_norm(grams=None)``: the (B,) squared Frobenius norms, accumulated in float32
  or better; ``grams``, an ``InputGrams`` of the norm pass, lets layers that read one
  input tensor share its Gram;
- ``materialize(lo, hi)``: the explicit gradients of examples lo..hi-1, shaped
  (hi - lo, *param.shape), as a last resort for cross terms;
- ``merge`` / ``dot``: the pieces needed when one parameter is used several
  times in a step (tied weights, a module called twice);
- ``kept()``: what book-keeping keeps until the clipped sum: the factor itself, or the explicit
  per-example gradients where they hold less (an adapter's low-rank Linear at T tokens);
- ``weighted_sum(c)``: sum_i c_i g_i, the clipped sum of book-keeping mode,
  formed without per-example gradients where the factor allows (an embedding's also takes
  ``out_dtype``, the parameter's, to skip a wide copy of a 16-bit table);
- ``token_mass(grams=None)``: (B,) an upper bound of the sum over an example's terms (tokens) of
  |term|, which bounds what the example adds to the batch's float accumulations (their rounding),
  or None where nothing in the example can cancel (one term, or a finished per-example gradient);
  a ``SqrtProduct`` where it is sqrt(a b) of per-example Gram traces, which the norm pass forms
  for all layers at once.

Memory is bounded by ``ELEMENT_BUDGET``: no temporary built here holds more
than that many elements (beyond one example's worth when a single example is
larger than the budget).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import torch

# Largest temporary (in elements) that a norm computation may allocate.
ELEMENT_BUDGET = 1 << 25


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: norms never accumulate in 16 bits."""
    for t in tensors:  # a loop, not acc_dtype_of over a generator: some 400 calls a step
        if t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def acc_dtype_of(*dtypes: torch.dtype) -> torch.dtype:
    """acc_dtype for tensors of these dtypes."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


@functools.cache
def _matmuls_take_out_dtype() -> bool:
    """Whether this torch's mm/bmm take out_dtype (torch >= 2.8; checked on meta tensors, no device needed)."""
    half = torch.empty(1, 1, 1, device="meta", dtype=torch.bfloat16)
    try:
        return torch.bmm(half, half, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def wide_matmul(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """a @ b (2-D, or batched 3-D) with a result in dt, the accumulation dtype.

    On CUDA, 16-bit inputs stay 16-bit: cuBLAS multiplies them on tensor cores, and with out_dtype
    float32 it accumulates and returns float32. The products of 16-bit numbers are exact in float32,
    so this equals upcasting first, at 16-bit speed and without float32 copies of the inputs.
    Elsewhere the inputs are converted to dt.
    """
    if _tensor_core_path(a, b, dt):
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=dt)
    # Tensor.to is a dispatched op even where the dtype matches; bmm and mm skip matmul's shape handling.
    a, b = (a if a.dtype == dt else a.to(dt)), (b if b.dtype == dt else b.to(dt))
    if a.dim() == b.dim() == 3:
        return torch.bmm(a, b)
    return torch.mm(a, b) if a.dim() == b.dim() == 2 else torch.matmul(a, b)


def gram(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """(..., T, T) Grams X X^T of (..., T, m) x in dt (wide_matmul). Where x is converted to dt (off the
    tensor-core path: a 16-bit x on a CPU), it is converted once for both sides, not once per side."""
    if x.dtype != dt and not _tensor_core_path(x, x, dt):
        x = x.to(dt)
    return wide_matmul(x, x.transpose(-1, -2), dt)


def _tensor_core_path(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> bool:
    return (a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16) and dt == torch.float32
            and a.device.type == "cuda" and _matmuls_take_out_dtype())


# Fewest rows of a Gram tile worth splitting T into (below, one tile): small matrix products lose
# more speed than the skipped lower tiles save. Measured on CPU (profiling/layers.py). Elsewhere T is
# never split for speed, only to stay within ELEMENT_BUDGET: on an H100 the Gram of a BERT layer is
# launch- and memory-bound, not FLOP-bound (B=32, T=512, 768x768 in bf16: one whole Gram 0.11 ms,
# while two tiles of 256 rows took the rule to 0.48 ms).
MIN_SPLIT_TILE = {"cpu": 64}


def gram_tile(B: int, T: int, device_type: str) -> int:
    """Rows per tile of the Gram computation: within ELEMENT_BUDGET, and on CPU about T/2 once T allows
    tiles of MIN_SPLIT_TILE rows or more, since only the tiles on or above the diagonal are formed."""
    budget = max(1, int(math.sqrt(ELEMENT_BUDGET / (2 * B))))
    smallest = MIN_SPLIT_TILE.get(device_type)
    split = T if smallest is None or T < 2 * smallest else max(smallest, -(-T // 2))
    return max(1, min(budget, split))


def gram_fraction(T: int, tile: int) -> float:
    """The part of the full Gram T^2 that the tiles on or above the diagonal cover: (k + 1) / (2k)."""
    k = -(-T // tile)
    return (k + 1) / (2 * k)


def prefers_gram(T: int, m: int, n: int, tile: int | None = None) -> bool:
    """Gram <L L^T, R R^T> costs T^2 (m + n) per example, times gram_fraction for its tiles;
    instantiation ||L^T R||^2 costs T m n (DESIGN.md, norm rules). profiling/layers.py checks
    this choice against measured times."""
    return gram_fraction(T, tile or T) * T * (m + n) <= m * n


def whole_gram_by_shape(B: int, T: int, m: int, n: int, device_type: str) -> bool:
    """Whether a (B, T, m) x (B, T, n) OuterProduct's norm takes one-tile Grams; decided once per shape
    (and per value of the tiling settings)."""
    return _whole_gram(B, T, m, n, device_type, ELEMENT_BUDGET, MIN_SPLIT_TILE.get(device_type))


@functools.lru_cache(maxsize=1024)
def _whole_gram(B, T, m, n, device_type, element_budget, smallest_tile) -> bool:
    return T > 1 and gram_tile(B, T, device_type) >= T and prefers_gram(T, m, n, T)


def summed_positions_mass(terms: torch.Tensor, positions: int, dtype, example_dims: int = 1,
                          scaled: bool = True) -> torch.Tensor | None:
    """A token mass for a per-example gradient summed over ``positions`` terms (B, positions, ...):
    sum_t |term_t| <= sqrt(positions) |terms|_F. None for one position (nothing to cancel). The first
    ``example_dims`` dims index the examples. ``scaled`` False: |terms|_F alone, which the caller multiplies
    by sqrt(positions) (deferred.DeferredGrams, for many layers in one op)."""
    if positions <= 1:
        return None
    norm = torch.linalg.vector_norm(terms, dim=tuple(range(example_dims, terms.dim())), dtype=dtype)
    return norm * math.sqrt(positions) if scaled else norm


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SqrtProduct(NamedTuple):
    """A token mass sqrt(a * b), a a (B,) tensor and b a (B,) tensor or a number: the norm pass stacks every
    layer's a and b and forms the products and roots in a few ops for all layers (records.NormPass.total_mass)
    instead of two or three small ops per layer."""
    a: torch.Tensor
    b: "torch.Tensor | float"


def gram_trace(gram: torch.Tensor) -> torch.Tensor:
    """(..., B) traces of (..., B, T, T) Grams: sum_t |X_t|^2 = |X_i|_F^2."""
    return torch.diagonal(gram, 0, -2, -1).sum(-1)


def example_chunks(batch: int, per_example: int):
    """[lo, hi) ranges of examples whose materialised gradients stay within ELEMENT_BUDGET elements."""
    step = max(1, ELEMENT_BUDGET // max(1, per_example))
    for lo in range(0, batch, step):
        yield lo, min(batch, lo + step)


class PerExampleGrad:
    """Base class; see the module docstring."""

    batch_size: int
    param_shape: torch.Size

    def sq_norm(self, grams=None) -> torch.Tensor:
        total = None
        for lo, hi in example_chunks(self.batch_size, math.prod(self.param_shape)):
            part = self.materialize(lo, hi).reshape(hi - lo, -1).pow(2).sum(1)
            total = part if total is None else torch.cat([total, part])
        return total

    def materialize(self, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError

    def token_mass(self, grams=None) -> torch.Tensor | SqrtProduct | None:
        return None

    def cached_norms(self, grams) -> tuple[torch.Tensor, SqrtProduct] | None:
        """((B,) squared norm, token mass) from Grams in the pass's cache (``grams``), for a factor whose norm
        and mass are read from them; None for the others (sq_norm and token_mass)."""
        return None

    def gram_reads(self, grams) -> tuple | None:
        """The (tensor, accumulation dtype, operand dtype) arguments of ``grams.whole`` whose Grams give
        ``cached_norms``, or None for a factor off that path."""
        return None

    def sum_dtype(self) -> torch.dtype:
        """The dtype in which the batch's clipped sum of this gradient accumulates."""
        return torch.float32

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """sum_i weights_i g_i, of param_shape; by default through materialised chunks."""
        total = None
        for lo, hi in example_chunks(self.batch_size, math.prod(self.param_shape)):
            g = self.materialize(lo, hi)
            part = torch.tensordot(weights[lo:hi].to(g.dtype), g, dims=1)
            total = part if total is None else total + part
        return total

    def merge(self, other: "PerExampleGrad") -> "PerExampleGrad | None":
        """A single factor for the sum of both gradients, when exact and cheap; else None."""
        return None

    def kept(self, with_mass: bool = True) -> "PerExampleGrad":
        """The form book-keeping keeps until the clipped sum: this factor, or an equal one holding less.
        ``with_mass`` False: a parameter's only use this step, whose norm and clipped sum both read what is kept
        (see OuterProduct.kept)."""
        return self

    def held_bytes(self) -> int:
        """Bytes of the tensors this factor holds (by default: as many as its explicit float32 gradients)."""
        return self.batch_size * math.prod(self.param_shape) * 4

    def kept_bytes(self) -> int:
        """Bytes of what ``kept`` would hold, from shapes alone (nothing is formed)."""
        return self.held_bytes()

    def note_kept(self, kept) -> None:
        """Adds what ``kept`` would hold to ``kept`` (records.KeptStorages: the tensors it would keep, each storage
        once, or the bytes of what it would form). By default explicit gradients of its own (nothing is formed)."""
        kept.formed(self.kept_bytes())

    def dot(self, other: "PerExampleGrad") -> torch.Tensor:
        """Per-example inner products <g_i, h_i>; by default through materialised chunks."""
        parts = []
        for lo, hi in example_chunks(self.batch_size, math.prod(self.param_shape)):
            a = self.materialize(lo, hi).reshape(hi - lo, -1)
            b = other.materialize(lo, hi).reshape(hi - lo, -1).to(a.dtype)
            parts.append((a * b).sum(1))
        return torch.cat(parts)


class Instantiated(PerExampleGrad):
    """Explicit per-example gradients (B, *param_shape): small parameters (biases, norms).

    ``mass``: the token mass of the sum over positions the rule formed them by (see ``token_mass``),
    None for a single position or a gradient formed per example.
    """

    def __init__(self, grads: torch.Tensor, mass: torch.Tensor | None = None):
        self.grads = grads
        self.batch_size = grads.shape[0]
        self.param_shape = grads.shape[1:]
        self.mass = mass

    def token_mass(self, grams=None):
        return self.mass

    def sum_dtype(self):
        return acc_dtype(self.grads)

    def sq_norm(self, grams=None) -> torch.Tensor:
        g = self.grads.reshape(self.batch_size, -1)
        g = g.to(acc_dtype(g))
        return torch.linalg.vecdot(g, g)

    def materialize(self, lo, hi):
        return self.grads[lo:hi].to(acc_dtype(self.grads))

    def weighted_sum(self, weights):
        g = self.grads.to(acc_dtype(self.grads))
        return torch.matmul(weights.to(g.dtype), g.reshape(self.batch_size, -1)).reshape(self.param_shape)

    def merge(self, other):
        if isinstance(other, Instantiated):
            return Instantiated(self.grads.to(acc_dtype(self.grads)) + other.grads.to(acc_dtype(other.grads)))
        return None


class SummedTokens(Instantiated):
    """g_i = sum_t G_it (a Linear's bias), formed on first use. Its squared norm |sum_t G_t|^2 is the
    sum of the Gram G_i G_i^T and its token mass sqrt(T) |G_i|_F a root of that Gram's trace, where the
    weight's norm has just formed that Gram (the pass's cache); otherwise from the sum itself."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens  # (B, T, p)
        self.batch_size = tokens.shape[0]
        self.param_shape = tokens.shape[2:]
        self._grads = None

    @property
    def grads(self):
        if self._grads is None:
            self._grads = self.tokens.sum(1, dtype=acc_dtype(self.tokens))
        return self._grads

    def sum_dtype(self):
        # Instantiated's reads self.grads, which would sum the tokens (an op, and a (B, p) tensor held with
        # the factor) only to learn a dtype: a bias reduced alone asked it for every layer (72 ops a step on the
        # BERT stand-in with every Gram too large to defer, as at BERT-base B=256 on a GPU).
        return acc_dtype(self.tokens)

    def held_bytes(self):
        return _nbytes(self.tokens)

    def note_kept(self, kept) -> None:
        kept.note(self.tokens)

    @property
    def mass(self):
        T = self.tokens.shape[1]
        return summed_positions_mass(self.tokens, T, acc_dtype(self.tokens))

    def _cached(self, grams):
        """(dt, operand dtype) under which the weight's norm kept the tokens' Gram, or None."""
        if grams is None or self.tokens.shape[1] <= 1:
            return None
        dt = acc_dtype(self.tokens)
        for operand_dtype in (None, self.tokens.dtype):  # cast to their own dtype (autocast) or not
            if grams.cached_key(self.tokens, dt, operand_dtype) is not None:
                return dt, operand_dtype
        return None

    def token_mass(self, grams=None):
        T = self.tokens.shape[1]
        if T <= 1:
            return None
        cached = self._cached(grams)
        return SqrtProduct(grams.whole_trace(self.tokens, *cached), float(T)) if cached else self.mass

    def sq_norm(self, grams=None):
        cached = self._cached(grams)
        return grams.whole(self.tokens, *cached).sum((1, 2)) if cached else super().sq_norm()

    def gram_reads(self, grams):
        """Its tokens' Gram, as its weight left it in the pass's cache, or None where there is none."""
        cached = self._cached(grams)
        return None if cached is None else ((self.tokens, *cached),)

    def cached_norms(self, grams):
        """((B,) squared norm, token mass sqrt(T tr(G G^T)) as a SqrtProduct) from the Gram its weight left in
        the pass's cache (one lookup for both), or None where there is none."""
        reads = self.gram_reads(grams)
        if reads is None:
            return None
        gram, trace = grams.whole_and_trace(*reads[0])
        return gram.sum((1, 2)), SqrtProduct(trace, float(self.tokens.shape[1]))


def _scaled(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * w in dtype. The product is formed in the wider of x's and w's dtypes and rounded once on
    store, so a 16-bit result needs no float32 temporary as large as x (at BERT-base, B=32: 50 MB for
    an FFN layer's output grad)."""
    if dtype == _promoted(x.dtype, w.dtype):
        return x * w
    return torch.mul(x, w, out=torch.empty(x.shape, dtype=dtype, device=x.device))


@functools.cache
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types, without a dispatched op per call."""
    return torch.promote_types(a, b)


def weighted_outer_sum(left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor, dt) -> torch.Tensor:
    """sum_i w_i L_i^T R_i in dt, for left (..., B, T, m) and right (..., B, T, n) with the examples on dim -3
    (a leading dim stacks several layers of one shape: (k, m, n) out).

    (w ⊙ L)^T R = L^T (w ⊙ R) over all (example, token) rows: one matmul, as a weight gradient, with the
    weights applied to the narrower side. On the 16-bit tensor-core path w_i L_i is rounded to 16 bits, as
    pass 2 of the two-pass mode rounds c_i G_i; elsewhere it stays in dt.
    """
    w = weights.to(dt).view(-1, 1, 1)
    scaled_dtype = left.dtype if _tensor_core_path(left, right, dt) else dt
    if left.shape[-1] <= right.shape[-1]:
        left = _scaled(left, w, scaled_dtype)
    else:
        right = _scaled(right, w, scaled_dtype)
    return wide_matmul(left.flatten(-3, -2).transpose(-1, -2), right.flatten(-3, -2), dt)


def explicit_is_smaller(B: int, T: int, m: int, n: int, left_dtype: torch.dtype, right_dtype: torch.dtype) -> bool:
    """Whether the explicit (B, m, n) gradients of an outer-product factor with sides L (B, T, m) and
    R (B, T, n) of these dtypes take fewer bytes than the sides (OuterProduct.kept; one token: never)."""
    if T <= 1:
        return False
    explicit = B * m * n * acc_dtype_of(left_dtype, right_dtype).itemsize
    return explicit < B * T * (m * left_dtype.itemsize + n * right_dtype.itemsize)


class OuterProduct(PerExampleGrad):
    """g_i = left_i^T right_i with left (B, T, m) and right (B, T, n), reshaped to param_shape.

    Linear: left = output grads G, right = inputs A. transformers Conv1D: the
    reverse. Conv: left = G, right = unfolded input. ``input_side`` ("left" or
    "right") names the side that is the layer's input as the model passed it, whose
    Gram other layers reading the same tensor can share (query, key and value).
    """

    def __init__(self, left: torch.Tensor, right: torch.Tensor, param_shape, input_side=None):
        assert left.shape[:2] == right.shape[:2], (left.shape, right.shape)
        assert input_side in (None, "left", "right"), input_side
        self.left, self.right = left, right
        self.batch_size = left.shape[0]
        self.param_shape = param_shape if type(param_shape) is torch.Size else torch.Size(param_shape)
        self.input_side = input_side

    @property
    def operand_dtype(self):
        """The 16-bit dtype of one side where the other is wider, else None. A 16-bit output grad
        next to a float32 input means the layer multiplied in 16 bits (autocast casts its input), so
        the wider side is cast to it: Grams and clipped sums then run on tensor cores as the layer's
        own matmul did, and equal what autograd forms from the cast input."""
        a, b = self.left.dtype, self.right.dtype
        if a == b:
            return None
        return a if a in (torch.float16, torch.bfloat16) else b if b in (torch.float16, torch.bfloat16) else None

    def operands(self, lo=0, hi=None):
        cast = self.operand_dtype
        whole = lo == 0 and (hi is None or hi >= self.batch_size)  # no slicing ops for the whole batch
        left, right = (self.left, self.right) if whole else (self.left[lo:hi], self.right[lo:hi])
        return (left, right) if cast is None else (left.to(cast), right.to(cast))

    def takes_whole_gram(self) -> bool:
        """Whether the norm is <L L^T, R R^T> of whole (one-tile) Grams (see sq_norm)."""
        B, T, m = self.left.shape
        return whole_gram_by_shape(B, T, m, self.right.shape[-1], self.left.device.type)

    def _whole_grams(self, grams) -> bool:
        """Whether the norm takes the one-tile Gram path with the pass's Gram cache."""
        return grams is not None and self.takes_whole_gram()

    def _gram(self, grams, x):
        return grams.whole(x, acc_dtype(self.left, self.right), self.operand_dtype)

    def cached_norms(self, grams):
        """((B,) squared norm, token mass sqrt(tr(L L^T) tr(R R^T)) as a SqrtProduct) on the one-tile Gram path
        with the pass's Gram cache (one lookup per side for both; what sq_norm and token_mass give), or None off
        that path."""
        reads = self.gram_reads(grams)
        if reads is None:
            return None
        left, left_trace = grams.whole_and_trace(*reads[0])
        right, right_trace = grams.whole_and_trace(*reads[1])
        return torch.linalg.vecdot(left.flatten(1), right.flatten(1)), SqrtProduct(left_trace, right_trace)

    def gram_reads(self, grams):
        """Both sides' whole Grams (one tile) through the pass's cache, or None off that path."""
        if grams is None or self.left.shape[1] <= 1 or not self.takes_whole_gram():
            return None
        dt, cast = acc_dtype(self.left, self.right), self.operand_dtype
        return (self.left, dt, cast), (self.right, dt, cast)

    def token_mass(self, grams=None):
        # sum_t |L_t| |R_t| <= |L|_F |R|_F (Cauchy-Schwarz), which bounds the entrywise sum of the terms
        # |L_t R_t^T| over tokens. One token (T = 1): the gradient is the term, nothing can cancel.
        if self.left.shape[1] <= 1:
            return None
        if self._whole_grams(grams):  # |X|_F^2 is the trace of the Gram that sq_norm uses anyway
            dt, cast = acc_dtype(self.left, self.right), self.operand_dtype
            return SqrtProduct(grams.whole_trace(self.left, dt, cast), grams.whole_trace(self.right, dt, cast))
        dt = acc_dtype(self.left, self.right)
        return (torch.linalg.vector_norm(self.left, dim=(1, 2), dtype=dt)
                * torch.linalg.vector_norm(self.right, dim=(1, 2), dtype=dt))

    def sum_dtype(self):
        return acc_dtype(self.left, self.right)

    def sq_norm(self, grams=None) -> torch.Tensor:
        B, T, m = self.left.shape
        n = self.right.shape[-1]
        dt = acc_dtype(self.left, self.right)
        if T == 0:  # no tokens: a zero gradient
            return torch.zeros(B, dtype=dt, device=self.left.device)
        if T == 1:  # ||g_i||^2 = ||l_i||^2 ||r_i||^2 for a rank-one gradient
            return self.left.to(dt).pow(2).sum((1, 2)) * self.right.to(dt).pow(2).sum((1, 2))
        if self._whole_grams(grams):  # one tile: the two Grams (cached) and one batched dot product
            return torch.linalg.vecdot(self._gram(grams, self.left).flatten(1),
                                       self._gram(grams, self.right).flatten(1))
        tile = gram_tile(B, T, self.left.device.type)
        if prefers_gram(T, m, n, tile):
            shared = grams if self.input_side is not None else None
            return gram_sq_norm(*self.operands(), dt, tile, shared, self.input_side)
        return super().sq_norm()

    def materialize(self, lo, hi):
        dt = acc_dtype(self.left, self.right)
        left, right = self.operands(lo, hi)
        g = wide_matmul(left.transpose(1, 2), right, dt)
        return g.reshape(hi - lo, *self.param_shape)

    def held_bytes(self):
        return _nbytes(self.left) + _nbytes(self.right)

    def _explicit_bytes(self):
        return self.batch_size * math.prod(self.param_shape) * acc_dtype(self.left, self.right).itemsize

    def _keeps_explicit(self) -> bool:
        """Whether the explicit (B, m, n) gradients take fewer bytes than L (B, T, m) and R (B, T, n):
        m n < T (m + n) at equal widths, e.g. a LoRA factor of rank r << T (one token: the factors stay)."""
        B, T, m = self.left.shape
        return explicit_is_smaller(B, T, m, self.right.shape[-1], self.left.dtype, self.right.dtype)

    def kept_bytes(self):
        return self._explicit_bytes() if self._keeps_explicit() else self.held_bytes()

    def note_kept(self, kept) -> None:
        if self._keeps_explicit():
            kept.formed(self._explicit_bytes())
        else:
            kept.note(self.left, self.right)

    def kept(self, with_mass: bool = True):
        """The explicit gradients where they hold less (``_keeps_explicit``). Book-keeping then keeps them
        instead of the layer's input and output grad, and its clipped sum is one (B) x (B, m n) product.

        Their token mass bounds what an example's cancelling tokens could put into a sum over the whole batch's
        terms (precision.py). Where the parameter has no other use this step (``with_mass`` False), nothing of
        this factor is summed so: its norm is the dot product of the finished g_i and its clipped sum adds the
        same g_i, each c_i g_i of norm at most C, so the mass (two norms and a product: three kernels per factor,
        176 factors a step on a 22-layer model with LoRA on q, k, v and o) is left out. A parameter with several
        uses keeps it: its uses' sums are formed apart and added, and g_i of two uses may cancel."""
        if not self._keeps_explicit():
            return self
        return Instantiated(self.materialize(0, self.batch_size), self.token_mass() if with_mass else None)

    def weighted_sum(self, weights):
        total = weighted_outer_sum(*self.operands(), weights, acc_dtype(self.left, self.right))
        return total if total.shape == self.param_shape else total.reshape(self.param_shape)  # a view is an op

    def merge(self, other):
        # sum_u L_u^T R_u == [L_1; L_2]^T [R_1; R_2]: concatenate along T.
        if (isinstance(other, OuterProduct) and other.left.shape[-1] == self.left.shape[-1]
                and other.right.shape[-1] == self.right.shape[-1]):
            dt = torch.promote_types(self.left.dtype, other.left.dtype)
            return OuterProduct(torch.cat([self.left.to(dt), other.left.to(dt)], 1),
                                torch.cat([self.right.to(dt), other.right.to(dt)], 1), self.param_shape)
        return None

    def dot(self, other):
        if isinstance(other, EmbeddingGather):
            return other.dot(self)
        return super().dot(other)


def _groups_of(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, key) for (n,) integer keys: each position's group of equal keys, numbered 0, 1, ... in key order,
    and each group's key (n of them: slots past the last group keep key 0 and gather nothing). What
    torch.unique(return_inverse=True) gives, padded to n groups: no op's output size depends on the values (a
    host sync on a GPU)."""
    n = keys.shape[0]
    sorted_keys, order = keys.sort()
    starts = torch.ones(n, dtype=torch.bool, device=keys.device)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    group_of_sorted = starts.cumsum(0) - 1
    # index_add_, not scatter_: one add per position (order is a permutation; a group's key comes from its first
    # position, the others add 0), so both are exact, and torch has a deterministic form of it on a GPU.
    slot = torch.zeros_like(group_of_sorted).index_add_(0, order, group_of_sorted)
    return slot, torch.zeros_like(keys).index_add_(0, group_of_sorted, sorted_keys * starts)


class EmbeddingGather(PerExampleGrad):
    """g_i = sum_t e_{x_t} G_t^T for an embedding: rows x_t of the weight get G_t.

    ||g_i||^2 = sum_{t,s} [x_t = x_s] <G_t, G_s>, computed by summing the rows of
    G that share an (example, index) key, so the cost is O(T H) per example.
    Positions whose index is ``padding_idx`` get no gradient and are dropped.
    A table of fewer rows than an example has positions (T5's 32 relative-position buckets looked up at q x k
    positions, a token-type table) has explicit gradients smaller than its ids and G: they are formed instead
    (``_keeps_explicit``), for the norm and for what book-keeping keeps.
    """

    def __init__(self, ids: torch.Tensor, grads: torch.Tensor, num_embeddings: int, padding_idx=None):
        B = ids.shape[0]
        self.ids = ids.reshape(B, -1)
        self.grads = grads.reshape(B, self.ids.shape[1], -1)
        self.num_embeddings = num_embeddings
        self.padding_idx = padding_idx
        self.batch_size = B
        self.param_shape = torch.Size((num_embeddings, self.grads.shape[-1]))

    def _held(self) -> tuple:
        return self.ids, self.grads

    def held_bytes(self):
        return sum(_nbytes(t) for t in self._held())

    def _explicit_bytes(self):
        return self.batch_size * math.prod(self.param_shape) * acc_dtype(self.grads).itemsize

    def _keeps_explicit(self) -> bool:
        """Whether the explicit (B, V, H) gradients take fewer bytes than the ids and rows of G (the class doc; an
        empty batch has none)."""
        return 0 < self._explicit_bytes() < self.held_bytes()

    def kept_bytes(self):
        return self._explicit_bytes() if self._keeps_explicit() else self.held_bytes()

    def note_kept(self, kept) -> None:
        if self._keeps_explicit():
            kept.formed(self._explicit_bytes())
        else:
            kept.note(*self._held())

    def kept(self, with_mass: bool = True):
        """The explicit gradients where they hold less (``_keeps_explicit``; see OuterProduct.kept for ``with_mass``)."""
        if not self._keeps_explicit():
            return self
        return Instantiated(self.materialize(0, self.batch_size), self.token_mass() if with_mass else None)

    def _valid(self):
        if self.padding_idx is None:
            return torch.ones_like(self.ids, dtype=torch.bool)
        return self.ids != self.padding_idx

    def _grads(self, lo=0, hi=None, weights=None):
        """Output grads of examples lo..hi-1, (b, T, H), in the accumulation dtype, times weights_i of
        their example if given, and 0 at padding positions (where, not a product: those may hold inf)."""
        dt = acc_dtype(self.grads)
        grads = self.grads[lo:hi].to(dt)
        if weights is not None:
            grads = grads * weights.to(dt)[:, None, None]
        if self.padding_idx is not None:
            grads = torch.where(self._valid()[lo:hi].unsqueeze(-1), grads, 0)
        return grads

    def token_mass(self, grams=None):
        # sum_t |G_t| <= sqrt(T) |G|_F over the example's non-padding positions: |G|_F read from G in its own
        # dtype (per position where padding is dropped), without a copy of G.
        dt, T = acc_dtype(self.grads), self.grads.shape[1]
        if self.padding_idx is None:
            return torch.linalg.vector_norm(self.grads, dim=(1, 2), dtype=dt) * math.sqrt(T)
        per_position = torch.linalg.vector_norm(self.grads, dim=2, dtype=dt)  # (B, T)
        per_position = torch.where(self._valid(), per_position, 0)  # where, not a product: padding may hold inf
        return torch.linalg.vector_norm(per_position, dim=1) * math.sqrt(T)

    def sum_dtype(self):
        return acc_dtype(self.grads)

    def _keys(self) -> torch.Tensor:
        """(n,) each position's key example * V + id; a padding position's is past every example's (B V)."""
        B, V = self.batch_size, self.num_embeddings
        keys = torch.arange(B, device=self.ids.device).unsqueeze(1) * V + self.ids  # (B, T)
        if self.padding_idx is not None:
            keys = torch.where(self._valid(), keys, B * V)
        return keys.reshape(-1)

    def sq_norm(self, grams=None):
        if self._keeps_explicit():  # a small table: its explicit gradients, in chunks (no sort of every key)
            return super().sq_norm()
        # |g_i|^2 = sum over the (example, id) groups of |sum of their rows of G|^2, the groups of the keys
        # example * V + id (_groups_of: no host sync). A position of no example (padding) has a key past every
        # example's and lands in row B of the result, dropped.
        B, V, H = self.batch_size, self.num_embeddings, self.grads.shape[-1]
        slot, group_key = _groups_of(self._keys())
        dt = acc_dtype(self.grads)
        rows = self.grads.reshape(-1, H)
        summed = torch.zeros(rows.shape, dtype=dt, device=rows.device).index_add_(0, slot, rows.to(dt))
        out = torch.zeros(B + 1, dtype=dt, device=rows.device)
        return out.index_add_(0, group_key // V, summed.pow(2).sum(1))[:B]

    def materialize(self, lo, hi):
        ids, grads = self.ids[lo:hi], self._grads(lo, hi)
        out = torch.zeros(hi - lo, *self.param_shape, dtype=grads.dtype, device=grads.device)
        return out.scatter_add_(1, ids.unsqueeze(-1).expand_as(grads), grads)

    def weighted_sum(self, weights, out_dtype=None):
        rows = self._grads(weights=weights).reshape(-1, self.grads.shape[-1])
        ids = self.ids.reshape(-1)
        if out_dtype is None or torch.finfo(out_dtype).bits >= torch.finfo(rows.dtype).bits:
            out = torch.zeros(self.param_shape, dtype=rows.dtype, device=rows.device)
            return out.index_add_(0, ids, rows)
        # A 16-bit table: sum the rows of each id in the accumulation dtype, then write them rounded
        # once, without an accumulation-dtype copy of the whole table (94 MB for BERT's words in float32).
        # Grouped by sorting (no host sync): an unused slot sums nothing and adds an exact 0 to row 0.
        slot, group_id = _groups_of(ids)
        summed = torch.zeros(rows.shape, dtype=rows.dtype, device=rows.device).index_add_(0, slot, rows)
        out = torch.zeros(self.param_shape, dtype=out_dtype, device=rows.device)
        return out.index_add_(0, group_id, summed.to(out_dtype))

    def merge(self, other):
        if isinstance(other, RaggedEmbeddingGather):
            return other.merge(self)
        if (isinstance(other, EmbeddingGather) and other.num_embeddings == self.num_embeddings
                and other.padding_idx == self.padding_idx):
            dt = torch.promote_types(self.grads.dtype, other.grads.dtype)
            return EmbeddingGather(torch.cat([self.ids, other.ids], 1),
                                   torch.cat([self.grads.to(dt), other.grads.to(dt)], 1),
                                   self.num_embeddings, self.padding_idx)
        return None

    def dot(self, other):
        # Tied embedding / output layer: <sum_t e_{x_t} E_t^T, L^T R> = sum_{t,s} L[s, x_t] <E_t, R_s>,
        # when the output layer's rows index the vocabulary (left has width V).
        if isinstance(other, OuterProduct) and other.left.shape[-1] == self.num_embeddings \
                and other.param_shape == self.param_shape:
            dt = acc_dtype(self.grads, other.left, other.right)
            parts = []
            per_example = self.ids.shape[1] * other.left.shape[1]
            for lo, hi in example_chunks(self.batch_size, per_example):
                ids = self.ids[lo:hi]
                left = other.left[lo:hi]
                picked = torch.gather(left, 2, ids.unsqueeze(1).expand(-1, left.shape[1], -1)).to(dt)  # (b, S, T)
                inner = wide_matmul(other.right[lo:hi], self._grads(lo, hi).transpose(1, 2), dt)  # (b, S, T)
                parts.append((picked * inner).sum((1, 2)))
            return torch.cat(parts)
        return super().dot(other)


class RaggedEmbeddingGather(EmbeddingGather):
    """g_i = sum_{t: e_t = i} e_{x_t} G_t^T over positions t whose number differs between examples: ``ids`` (n,),
    ``grads`` (n, H) and ``examples`` (n,), each position's example (``batch_size`` for a position of none, whose
    row of G must be 0). An nn.EmbeddingBag's 1-D input cut into bags at offsets: no shape depends on the bags'
    sizes, where padding every bag to the longest (EmbeddingGather's (B, T) layout) read the longest back, a host
    sync in each forward on a GPU, and held B x longest rows of G however short the other bags were."""

    def __init__(self, ids: torch.Tensor, grads: torch.Tensor, examples: torch.Tensor, batch_size: int,
                 num_embeddings: int):
        self.ids, self.grads, self.examples = ids, grads, examples
        self.num_embeddings, self.padding_idx = num_embeddings, None
        self.batch_size = batch_size
        self.param_shape = torch.Size((num_embeddings, grads.shape[-1]))

    @staticmethod
    def of(factor: EmbeddingGather) -> "RaggedEmbeddingGather":
        """An EmbeddingGather in this form: its positions flattened, each with its example; padding positions of
        none, their G rows 0 (where, not a product: they may hold inf)."""
        if isinstance(factor, RaggedEmbeddingGather):
            return factor
        B, T, H = factor.grads.shape
        examples = torch.arange(B, device=factor.ids.device).unsqueeze(1).expand(B, T)
        grads = factor.grads
        if factor.padding_idx is not None:
            valid = factor._valid()
            examples, grads = torch.where(valid, examples, B), torch.where(valid.unsqueeze(-1), grads, 0)
        return RaggedEmbeddingGather(factor.ids.reshape(-1), grads.reshape(-1, H), examples.reshape(-1), B,
                                     factor.num_embeddings)

    def _held(self):
        return self.ids, self.grads, self.examples

    def _keys(self):
        return self.examples * self.num_embeddings + self.ids

    def _per_example(self, values: torch.Tensor) -> torch.Tensor:
        """(B,) the sums of (n,) ``values`` over each example's positions."""
        out = torch.zeros(self.batch_size + 1, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.examples, values)[:self.batch_size]

    def token_mass(self, grams=None):
        # sum_t |G_t| <= sqrt(n_i) |G_i|_F over the n_i positions of example i.
        dt = acc_dtype(self.grads)
        squares = self._per_example(torch.linalg.vector_norm(self.grads, dim=-1, dtype=dt).pow(2))
        counts = self._per_example(torch.ones(self.examples.shape, dtype=dt, device=self.examples.device))
        return (squares * counts).sqrt()

    def _grads(self, lo=0, hi=None, weights=None):
        """Every position's row of G in the accumulation dtype, times weights_i of its example if given (the
        whole batch only: materialize and dot do not read this)."""
        dt = acc_dtype(self.grads)
        grads = self.grads.to(dt)
        if weights is not None:
            per_position = torch.cat([weights.to(dt), weights.new_zeros(1, dtype=dt)])[self.examples]
            grads = grads * per_position.unsqueeze(-1)
        return grads

    def materialize(self, lo, hi):
        dt = acc_dtype(self.grads)
        local = self.examples - lo
        local = torch.where((local >= 0) & (local < hi - lo), local, hi - lo)  # others: a row dropped below
        out = torch.zeros(hi - lo + 1, *self.param_shape, dtype=dt, device=self.grads.device)
        return out.index_put_((local, self.ids), self.grads.to(dt), accumulate=True)[:hi - lo]

    def merge(self, other):
        if (isinstance(other, EmbeddingGather) and other.num_embeddings == self.num_embeddings
                and other.batch_size == self.batch_size):
            other = RaggedEmbeddingGather.of(other)
            dt = torch.promote_types(self.grads.dtype, other.grads.dtype)
            return RaggedEmbeddingGather(torch.cat([self.ids, other.ids]),
                                         torch.cat([self.grads.to(dt), other.grads.to(dt)]),
                                         torch.cat([self.examples, other.examples]), self.batch_size,
                                         self.num_embeddings)
        return None

    def dot(self, other):
        return PerExampleGrad.dot(self, other)  # EmbeddingGather's reads a (B, T) layout


class Blocks(PerExampleGrad):
    """A gradient made of disjoint blocks (grouped convolution): norms add up."""

    def __init__(self, blocks, param_shape, dim=1):
        self.blocks = list(blocks)
        self.batch_size = self.blocks[0].batch_size
        self.param_shape = torch.Size(param_shape)
        self.dim = dim

    def sq_norm(self, grams=None):
        return sum(b.sq_norm() for b in self.blocks)

    def token_mass(self, grams=None):
        masses = [b.token_mass() for b in self.blocks]
        return None if any(m is None for m in masses) else sum(masses)

    def sum_dtype(self):
        return self.blocks[0].sum_dtype()

    def materialize(self, lo, hi):
        return torch.cat([b.materialize(lo, hi) for b in self.blocks], self.dim).reshape(hi - lo, *self.param_shape)

    def weighted_sum(self, weights):
        return torch.cat([b.weighted_sum(weights) for b in self.blocks], self.dim - 1).reshape(self.param_shape)

    def merge(self, other):
        if isinstance(other, Blocks) and len(other.blocks) == len(self.blocks):
            merged = [a.merge(b) for a, b in zip(self.blocks, other.blocks)]
            if all(m is not None for m in merged):
                return Blocks(merged, self.param_shape, self.dim)
        return None


class TransposedGrad(PerExampleGrad):
    """g_i = h_i^T for a factor h of matrix gradients, (m, n) -> (n, m): a parameter that its layer reads transposed
    (peft's LoRA embedding looks its ids up in A^T: peft_lora.py). Its norm and token mass are h's."""

    def __init__(self, inner: PerExampleGrad):
        if len(inner.param_shape) != 2:
            raise ValueError(f"TransposedGrad transposes matrix gradients; this factor's are {tuple(inner.param_shape)}")
        self.inner = inner
        self.batch_size = inner.batch_size
        self.param_shape = torch.Size((inner.param_shape[1], inner.param_shape[0]))

    def sq_norm(self, grams=None):
        return self.inner.sq_norm(grams)

    def token_mass(self, grams=None):
        return self.inner.token_mass(grams)

    def sum_dtype(self):
        return self.inner.sum_dtype()

    def materialize(self, lo, hi):
        return self.inner.materialize(lo, hi).transpose(1, 2)

    def weighted_sum(self, weights):
        return self.inner.weighted_sum(weights).t().contiguous()  # p.grad: contiguous, as autograd writes it

    def held_bytes(self):
        return self.inner.held_bytes()

    def kept_bytes(self):
        return self.inner.kept_bytes()

    def note_kept(self, kept) -> None:
        self.inner.note_kept(kept)

    def kept(self, with_mass: bool = True):
        inner = self.inner.kept(with_mass)
        return self if inner is self.inner else TransposedGrad(inner)

    def merge(self, other):
        merged = self.inner.merge(other.inner) if isinstance(other, TransposedGrad) else None
        return None if merged is None else TransposedGrad(merged)

    def dot(self, other):
        if isinstance(other, TransposedGrad):  # <h^T, k^T> = <h, k>
            return self.inner.dot(other.inner)
        return super().dot(other)


def gram_sq_norm(left, right, dt, tile, grams=None, input_side=None):
    """||L_i^T R_i||^2 = sum_{t,s} (L_i L_i^T)_{ts} (R_i R_i^T)_{ts} per example, over (t, s) tiles with
    s >= t: both Grams are symmetric, so a tile off the diagonal counts twice. With ``grams``, the
    tiles of the ``input_side`` Gram come from (and go to) that cache."""
    B, T, _ = left.shape
    shared = grams.tiles(left if input_side == "left" else right, dt, tile) if grams is not None else None

    def tile_gram(side, x, a, b):
        if shared is not None and side == input_side:
            return shared.get(a, b, x[:, a:a + tile], x[:, b:b + tile])
        return wide_matmul(x[:, a:a + tile], x[:, b:b + tile].transpose(1, 2), dt)

    total = torch.zeros(B, dtype=dt, device=left.device)
    for a in range(0, T, tile):
        for b in range(a, T, tile):
            block = (tile_gram("left", left, a, b) * tile_gram("right", right, a, b)).sum((1, 2))
            total += block if a == b else 2 * block
    return total


def _owner(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None else x._base


class InputGrams:
    """The Grams X_i X_i^T a norm pass formed last, for the next factor that reads the same tensor:
    a transformer's query, key and value projections share one input, whose Gram is then formed
    once instead of three times, and a Linear's weight and bias share its output grad's Gram (the
    bias norm |sum_t G_t|^2 is that Gram's sum, the token masses are traces). Whole Grams (one tile)
    are kept for the last three tensors used, tiles for the last tensor: the layers run back to back
    in the backward, so the memory is about three Grams; tensors are held weakly (a strong hold kept
    the last layer input alive, e.g. a BERT layer's (B, T, 4H) activation, through the backward of the
    layers below it)."""

    WHOLE = 3  # a shared input, and the output grads of the layer before and of this one

    def __init__(self):
        self._key = None
        self._key_owner = None  # weak reference to the key tensor's owner: a dead tensor's address may be reused
        self._dtype = None
        self._tiles = {}
        self._whole = {}     # key -> [weak reference to x's owner, Gram, trace or None], the newest last

    def tiles(self, x: torch.Tensor, dt, tile) -> "InputGrams":
        key = (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x._version, dt, tile)
        if x.numel() == 0 or key != self._key or self._key_owner() is not _owner(x):
            self._key, self._key_owner, self._dtype, self._tiles = key, weakref.ref(_owner(x)), dt, {}
        return self

    @staticmethod
    def _whole_key(x, dt, operand_dtype):
        return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x._version, dt, operand_dtype)

    def whole(self, x: torch.Tensor, dt, operand_dtype=None) -> torch.Tensor:
        """The whole Gram X_i X_i^T (one tile) in dt, formed once per tensor (from x cast to
        ``operand_dtype`` where given; the cache is keyed by x itself)."""
        return self._entry(x, dt, operand_dtype)[1]

    def whole_trace(self, x: torch.Tensor, dt, operand_dtype=None) -> torch.Tensor:
        """(B,) traces of ``whole(x, ...)``: |X_i|_F^2, formed once with the Gram."""
        return self.whole_and_trace(x, dt, operand_dtype)[1]

    def whole_and_trace(self, x: torch.Tensor, dt, operand_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``whole`` and ``whole_trace`` of x with one cache lookup."""
        entry = self._entry(x, dt, operand_dtype)
        if entry[2] is None:
            entry[2] = gram_trace(entry[1])
        return entry[1], entry[2]

    def _entry(self, x, dt, operand_dtype):
        key = self._whole_key(x, dt, operand_dtype)
        entry = self._whole.pop(key, None) if x.numel() else None
        if entry is None or entry[0]() is not _owner(x):
            operand = x if operand_dtype is None else x.to(operand_dtype)
            # A weak reference to the tensor that owns x's memory (views of one input share its Gram):
            # the Gram must not keep an output grad alive, and a dead tensor's address may be reused by
            # a new one with equal shape and version, which must not find this Gram.
            entry = [weakref.ref(_owner(x)), gram(operand, dt), None]
        self._whole[key] = entry
        while len(self._whole) > self.WHOLE:
            self._whole.pop(next(iter(self._whole)))
        return entry

    def cached_key(self, x: torch.Tensor, dt, operand_dtype=None):
        """The cache key under which x's whole Gram is kept, or None (nothing is formed)."""
        key = self._whole_key(x, dt, operand_dtype)
        entry = self._whole.get(key) if x.numel() else None
        return key if entry is not None and entry[0]() is _owner(x) else None

    def get(self, a, b, xa, xb):
        if (a, b) not in self._tiles:
            self._tiles[(a, b)] = wide_matmul(xa, xb.transpose(1, 2), self._dtype)
        return self._tiles[(a, b)]


def combined_sq_norm(factors) -> torch.Tensor:
    """||sum_u g_u||^2 per example for several uses of one parameter, cross terms included."""
    groups = []
    for f in factors:
        for i, g in enumerate(groups):
            merged = g.merge(f)
            if merged is not None:
                groups[i] = merged
                break
        else:
            groups.append(f)
    total = sum(g.sq_norm().double() for g in groups)
    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            total = total + 2 * groups[i].dot(groups[j]).double()
    return total
