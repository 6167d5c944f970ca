"""EmbeddingGather (norms/factors.py), the factor of the embedding rule: its squared norm and token mass against
the materialised per-example gradients, in float64 and from 16-bit output grads, with repeats, padding that holds
inf, and ids at the table's ends; and no op whose output size depends on the values (a host sync on a GPU).
RaggedEmbeddingGather (a 1-D nn.EmbeddingBag's positions, each with its bag) likewise, and its merges and products
with the other factors."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ghostdp.norms.factors import EmbeddingGather, OuterProduct, RaggedEmbeddingGather, combined_sq_norm

VALUE_SIZED = ("_unique", "_unique2", "unique_consecutive", "unique_dim", "nonzero", "masked_select",
               "_local_scalar_dense", "repeat_interleave")


def _ids_with_repeats_and_padding(B, T, V, pad):
    ids = torch.randint(0, V, (B, T))
    ids[0, :3] = V - 1          # a repeat within an example, at the table's last row
    ids[1, 0] = V - 1           # and across examples
    ids[2, -2:] = 0             # the table's first row (the padding row where pad)
    if pad:
        ids[3] = 0              # an example all padding
    return ids


def _reference(ids, grads, V, pad):
    """Per-example gradients, materialised in float64, and sum_t |G_t| over real positions."""
    B, T, H = grads.shape
    valid = torch.ones_like(ids, dtype=torch.bool) if pad is None else ids != pad
    G = torch.where(valid.unsqueeze(-1), grads.double(), 0)
    dense = torch.zeros(B, V, H, dtype=torch.float64).scatter_add_(1, ids.unsqueeze(-1).expand(B, T, H), G)
    return dense.pow(2).sum((1, 2)), G.norm(dim=(1, 2)) * math.sqrt(T)


@pytest.mark.parametrize("V", [64, 11])
@pytest.mark.parametrize("pad", [None, 0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_embedding_factors_norm_and_mass_equal_the_materialised_gradients(pad, dtype, V):
    """A table of 64 rows by the gather (a sort of the keys); of 11 rows in float64 by its explicit gradients, which
    then take fewer bytes than the ids and G (EmbeddingGather._keeps_explicit)."""
    torch.manual_seed(0)
    B, T, H = 5, 9, 4
    ids = _ids_with_repeats_and_padding(B, T, V, pad is not None)
    grads = torch.randn(B, T, H, dtype=torch.float64).to(dtype)
    if pad is not None:
        grads[ids == pad] = float("inf")  # a padding position's G is never read
    factor = EmbeddingGather(ids, grads, V, padding_idx=pad)
    assert factor._keeps_explicit() == (V == 11 and dtype == torch.float64)
    ref_sq, ref_mass = _reference(ids, grads, V, pad)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5  # float32 sums of bf16 values
    torch.testing.assert_close(factor.sq_norm().double(), ref_sq, rtol=rtol, atol=0)
    torch.testing.assert_close(factor.token_mass().double(), ref_mass, rtol=rtol, atol=0)
    if pad is not None:
        assert float(factor.sq_norm()[3]) == 0.0 and float(factor.token_mass()[3]) == 0.0
    assert factor.sq_norm().dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def dispatched_ops(fn) -> list:
    """The names of the ATen ops that ``fn()`` dispatches, in order (their overloads left off)."""
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Ops():
        fn()
    return seen


@pytest.mark.parametrize("form", ["gather", "explicit", "ragged"])
def test_the_embedding_factors_norm_mass_and_sums_dispatch_no_op_sized_by_the_values(form):
    if form == "ragged":
        factor = _ragged(V=40, dtype=torch.float32)
    else:
        V = 64 if form == "gather" else 3
        factor = EmbeddingGather(_ids_with_repeats_and_padding(4, 6, V, True), torch.randn(4, 6, 3), V, padding_idx=0)
    assert factor._keeps_explicit() == (form == "explicit")

    def norms_and_sums():
        factor.sq_norm()
        factor.token_mass()
        factor.weighted_sum(torch.rand(4))
        factor.weighted_sum(torch.rand(4), out_dtype=torch.bfloat16)  # a 16-bit table's rows summed first

    seen = dispatched_ops(norms_and_sums)
    assert seen and not [op for op in seen if op in VALUE_SIZED], seen


def test_a_16_bit_tables_clipped_sum_rounds_each_rows_float32_sum_once_with_repeats_and_padding():
    torch.manual_seed(1)
    ids = _ids_with_repeats_and_padding(5, 9, 11, True)
    factor = EmbeddingGather(ids, torch.randn(5, 9, 4, dtype=torch.bfloat16), 11, padding_idx=0)
    weights = torch.rand(5)
    dense = factor.weighted_sum(weights)  # float32, every row summed in place
    compact = factor.weighted_sum(weights, out_dtype=torch.bfloat16)
    assert dense.dtype == torch.float32 and compact.dtype == torch.bfloat16
    assert torch.equal(compact, dense.to(torch.bfloat16)) and not compact[0].any()  # the padding row gets 0


def _ragged(B=4, n=13, H=3, V=7, dtype=torch.float64):
    """Positions of B examples in runs of different lengths (example 2 has none), a repeated id within and across
    examples, and two positions of no example (index B) whose rows of G are 0."""
    torch.manual_seed(2)
    examples = torch.tensor([0, 0, 0, 0, 1, 3, 3, 3, 3, 3, 3, 4, 4])
    ids = torch.randint(0, V, (n,))
    ids[1], ids[3], ids[5] = V - 1, V - 1, V - 1
    grads = torch.randn(n, H, dtype=torch.float64)
    grads[examples == B] = 0
    return RaggedEmbeddingGather(ids, grads.to(dtype), examples, B, V)


def _dense(factor):
    """(B, V, H) float64 per-example gradients and sum_t |G_t| bounds (sqrt(n_i) |G_i|_F), by a loop."""
    B, (V, H) = factor.batch_size, factor.param_shape
    dense = torch.zeros(B, V, H, dtype=torch.float64)
    bounds = []
    for i in range(B):
        rows = factor.grads[factor.examples == i].double()
        dense[i].index_add_(0, factor.ids[factor.examples == i], rows)
        bounds.append(rows.norm() * math.sqrt(rows.shape[0]))
    return dense, torch.stack(bounds)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_ragged_factors_norm_mass_sums_and_gradients_equal_a_loop_over_examples(dtype):
    factor = _ragged(dtype=dtype)
    dense, bounds = _dense(factor)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(factor.sq_norm().double(), dense.pow(2).sum((1, 2)), rtol=rtol, atol=0)
    torch.testing.assert_close(factor.token_mass().double(), bounds, rtol=rtol, atol=0)
    assert float(factor.sq_norm()[2]) == 0.0 and float(factor.token_mass()[2]) == 0.0  # an example of no position
    weights = torch.rand(4, dtype=torch.float64)
    torch.testing.assert_close(factor.weighted_sum(weights).double(), torch.einsum("b,bvh->vh", weights, dense),
                               rtol=rtol, atol=1e-12)
    torch.testing.assert_close(factor.materialize(1, 4).double(), dense[1:4], rtol=rtol, atol=0)
    compact = factor.weighted_sum(weights, out_dtype=torch.bfloat16)
    assert compact.dtype == torch.bfloat16 and torch.equal(compact, factor.weighted_sum(weights).to(torch.bfloat16))


def test_the_ragged_factor_merges_with_a_padded_one_and_forms_cross_terms_with_a_weight():
    """A table used by a 1-D nn.EmbeddingBag and an nn.Embedding (with padding that holds inf) in one step: the merged
    factor's norm is that of the summed gradients, from either side; with a tied output layer's OuterProduct the
    cross terms come from materialised gradients."""
    ragged = _ragged()
    ids = torch.tensor([[1, 0, 6], [6, 6, 2], [0, 0, 0], [3, 5, 0]])
    grads = torch.randn(4, 3, 3, dtype=torch.float64)
    grads[ids == 0] = float("inf")
    padded = EmbeddingGather(ids, grads, 7, padding_idx=0)
    G = torch.where((ids != 0).unsqueeze(-1), grads, 0)
    dense = _dense(ragged)[0] + torch.zeros(4, 7, 3, dtype=torch.float64).scatter_add_(
        1, ids.unsqueeze(-1).expand(4, 3, 3), G)
    for merged in (ragged.merge(padded), padded.merge(ragged)):
        assert isinstance(merged, RaggedEmbeddingGather)
        torch.testing.assert_close(merged.sq_norm(), dense.pow(2).sum((1, 2)), rtol=1e-12, atol=0)
    head = OuterProduct(torch.randn(4, 5, 7, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64),
                        (7, 3), input_side="right")
    total = dense + head.materialize(0, 4)
    torch.testing.assert_close(combined_sq_norm([ragged, padded, head]), total.pow(2).sum((1, 2)), rtol=1e-12,
                               atol=0)


@pytest.mark.parametrize("V", [3, 64])
def test_book_keeping_keeps_a_small_tables_explicit_gradients_and_a_large_ones_gather(V):
    """What book-keeping keeps (kept) and what it says it keeps (kept_bytes) for a table of 3 rows, smaller explicit,
    and of 64 rows: the same clipped sums and norms either way."""
    torch.manual_seed(3)
    ids = _ids_with_repeats_and_padding(4, 6, V, True)
    factor = EmbeddingGather(ids, torch.randn(4, 6, 5, dtype=torch.float64), V, padding_idx=0)
    kept = factor.kept()
    assert isinstance(kept, EmbeddingGather) == (V == 64)
    assert factor.kept_bytes() == (4 * V * 5 * 8 if V == 3 else factor.held_bytes())
    weights = torch.rand(4, dtype=torch.float64)
    torch.testing.assert_close(kept.weighted_sum(weights), factor.weighted_sum(weights), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kept.sq_norm(), _reference(ids, factor.grads, V, 0)[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(kept.token_mass(), factor.token_mass(), rtol=1e-12, atol=0)
    assert factor.kept(with_mass=False).token_mass() is None or V == 64
