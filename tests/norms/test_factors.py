"""Factors against their materialised per-example gradients (norms/factors.py): TransposedGrad, the transpose of a
factor of matrix gradients (peft's LoRA embedding's A, read as A^T: norms/peft_lora.py)."""
import pytest
import torch

from ghostdp.norms.factors import EmbeddingGather, Instantiated, OuterProduct, TransposedGrad

B, T, V, H = 4, 6, 9, 3


def _gather(small_table=False):
    ids = torch.randint(0, 2 if small_table else V, (B, T), dtype=torch.long)
    ids[0, :2] = ids[0, 2]  # a repeat within an example
    return EmbeddingGather(ids, torch.randn(B, T, H, dtype=torch.float64), 2 if small_table else V, padding_idx=1)


@pytest.mark.parametrize("inner", ["gather", "outer"])
def test_the_transpose_has_its_factors_norm_mass_and_transposed_sums(inner):
    torch.manual_seed(0)
    h = _gather() if inner == "gather" else OuterProduct(torch.randn(B, T, 5, dtype=torch.float64),
                                                         torch.randn(B, T, 7, dtype=torch.float64), (5, 7))
    g = TransposedGrad(h)
    dense = h.materialize(0, B)  # (B, m, n)
    assert g.param_shape == torch.Size((dense.shape[2], dense.shape[1]))
    assert torch.equal(g.materialize(1, 3), dense[1:3].transpose(1, 2))
    assert torch.allclose(g.sq_norm(), dense.pow(2).sum((1, 2)), rtol=1e-12)
    mass = g.token_mass()
    assert mass is not None and torch.equal(torch.as_tensor(mass), torch.as_tensor(h.token_mass()))
    weights = torch.rand(B, dtype=torch.float64)
    summed = g.weighted_sum(weights)
    assert summed.is_contiguous() and summed.shape == g.param_shape
    assert torch.allclose(summed, torch.einsum("i,imn->nm", weights, dense), rtol=1e-12)
    assert g.sum_dtype() == h.sum_dtype() and g.held_bytes() == h.held_bytes() and g.kept_bytes() == h.kept_bytes()


def test_what_book_keeping_keeps_of_a_transpose_is_the_transpose_of_what_it_keeps_of_the_factor():
    torch.manual_seed(1)
    large, small = TransposedGrad(_gather()), TransposedGrad(_gather(small_table=True))
    assert large.kept() is large  # ids and G hold less than (B, V, H)
    kept = small.kept()  # a table of 2 rows: its explicit gradients hold less
    assert isinstance(kept, TransposedGrad) and isinstance(kept.inner, Instantiated)
    assert torch.allclose(kept.materialize(0, B), small.materialize(0, B), rtol=1e-12)


def test_two_transposes_merge_and_multiply_as_their_factors():
    torch.manual_seed(2)
    a, b = TransposedGrad(_gather()), TransposedGrad(_gather())
    dense_a, dense_b = a.materialize(0, B), b.materialize(0, B)
    merged = a.merge(b)
    assert isinstance(merged, TransposedGrad)
    assert torch.allclose(merged.materialize(0, B), dense_a + dense_b, rtol=1e-12)
    assert torch.allclose(a.dot(b), (dense_a * dense_b).sum((1, 2)), rtol=1e-12)
    other = Instantiated(torch.randn(B, H, V, dtype=torch.float64))  # not a transpose: no merge, the dense product
    assert a.merge(other) is None
    assert torch.allclose(a.dot(other), (dense_a * other.materialize(0, B)).sum((1, 2)), rtol=1e-12)


def test_only_a_factor_of_matrix_gradients_has_a_transpose():
    with pytest.raises(ValueError, match=r"transposes matrix gradients; this factor's are \(3,\)"):
        TransposedGrad(Instantiated(torch.randn(B, 3, dtype=torch.float64)))
