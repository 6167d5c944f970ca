"""Linear layers on degenerate inputs."""
import torch
from torch import nn

import ghostdp


def test_a_zero_length_sequence_has_norm_zero_in_both_modes():
    for clipping in ("ghost", "bookkeeping"):
        lin = nn.Linear(3, 2)
        controller = ghostdp.GhostClipping(lin, 1.0, clipping=clipping)
        controller.loss(lin(torch.randn(4, 0, 3)).sum((1, 2)), reduction="sum").backward()
        assert torch.equal(controller.last_norms, torch.zeros(4, dtype=torch.float64))
        assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
        controller.detach()


def test_a_zero_length_sequence_next_to_ordinary_tokens_adds_nothing():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1e6)
    x = torch.randn(4, 5, 3)
    controller.loss(lin(x).sum((1, 2)) + lin(x[:, :0]).sum((1, 2)), reduction="sum").backward()
    with_empty = controller.last_norms.clone()
    lin.zero_grad()
    controller.loss(lin(x).sum((1, 2)), reduction="sum").backward()
    torch.testing.assert_close(with_empty, controller.last_norms)


def test_a_16_bit_output_grad_with_a_float32_input_is_multiplied_as_autocast_did():
    # Under autocast a Linear casts its float32 input to bf16 for the matmul, so its output grad G is
    # bf16 and autograd's weight gradient is G^T bf16(A). The factor casts A as well: its Gram, its
    # per-example gradient and its clipped sum are those of bf16(A), in one dtype (tensor cores on a GPU).
    from ghostdp.norms.factors import InputGrams, OuterProduct
    B, T, d, p = 3, 5, 7, 4
    A = torch.randn(B, T, d, dtype=torch.float32) * (1 + 1e-3 * torch.randn(B, T, d, dtype=torch.float32))
    G = torch.randn(B, T, p, dtype=torch.bfloat16)
    factor = OuterProduct(G, A, (p, d), input_side="right")
    assert factor.operand_dtype == torch.bfloat16
    exact = torch.einsum("btp,btd->bpd", G.double(), A.bfloat16().double())  # autograd's, in float64
    assert not torch.allclose(exact, torch.einsum("btp,btd->bpd", G.double(), A.double()), rtol=1e-4)
    for grams in (None, InputGrams()):
        torch.testing.assert_close(factor.sq_norm(grams).double(), exact.pow(2).sum((1, 2)), rtol=1e-5, atol=0)
    torch.testing.assert_close(factor.materialize(0, B).double(), exact, rtol=1e-5, atol=1e-6)
    c = torch.tensor([0.5, 1.0, 0.25], dtype=torch.float64)
    torch.testing.assert_close(factor.weighted_sum(c).double(), torch.einsum("b,bpd->pd", c, exact),
                               rtol=1e-2, atol=1e-2)  # c_i L_i rounded to bf16, as pass 2 rounds c_i G_i


def test_gram_tiles_split_long_sequences_on_cpu_only_and_every_device_stays_within_the_budget():
    from ghostdp.norms.factors import ELEMENT_BUDGET, gram_tile
    assert gram_tile(32, 512, "cuda") == 512           # one whole Gram: launch-bound, not FLOP-bound there
    assert gram_tile(32, 512, "cpu") == 256            # CPU: the tiles on and above the diagonal, 3/4 of it
    assert gram_tile(32, 100, "cpu") == 100
    for device in ("cpu", "cuda"):
        tile = gram_tile(4096, 4096, device)
        assert tile < 4096 and 2 * 4096 * tile * tile <= ELEMENT_BUDGET


def test_scaling_a_16_bit_factor_rounds_once_without_a_wide_copy():
    from ghostdp.norms.factors import _scaled
    x = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    w = torch.rand(4, 1, 1, dtype=torch.float32)
    got = _scaled(x, w, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (x.float() * w).bfloat16())
    assert torch.equal(_scaled(x, w, torch.float32), x.float() * w)


def test_the_gram_tile_cache_does_not_keep_its_tensor_alive():
    # It did: a layer's (B, T, 4H) input then stayed alive through the backward of the layers below,
    # 8 MB of a 52 MB checkpointed step (profiling.bench --cpu-memory tensors).
    import weakref
    from ghostdp.norms.factors import InputGrams
    grams = InputGrams()
    x = torch.randn(2, 6, 4)
    grams.tiles(x, torch.float32, 3).get(0, 0, x[:, :3], x[:, :3])
    alive = weakref.ref(x)
    del x
    assert alive() is None


def test_a_new_tensor_at_a_dead_tensors_address_does_not_find_its_gram_tiles():
    # Two tensors over one numpy buffer share address, shape, strides and version: only the dead
    # owner tells them apart, as for an address the allocator hands out again.
    import numpy as np
    from ghostdp.norms.factors import InputGrams
    buffer = np.random.default_rng(0).standard_normal((2, 6, 4)).astype(np.float32)
    grams = InputGrams()
    first = torch.from_numpy(buffer)
    grams.tiles(first, torch.float32, 3).get(0, 0, first[:, :3], first[:, :3])
    del first
    buffer *= 2.0  # new values, same address
    second = torch.from_numpy(buffer)
    tile = grams.tiles(second, torch.float32, 3).get(0, 0, second[:, :3], second[:, :3])
    torch.testing.assert_close(tile, second[:, :3] @ second[:, :3].transpose(1, 2))


class LowRank(nn.Module):
    """An adapter's shape: a rank-2 down and up projection of 16 features (at 12 tokens below)."""

    def __init__(self, bias=True):
        super().__init__()
        self.down, self.up = nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=bias)

    def forward(self, x):
        return self.up(self.down(x))


def test_book_keeping_keeps_the_explicit_gradients_of_a_low_rank_layer_and_stays_exact():
    from conftest import assert_exact_model
    from ghostdp.norms.factors import Instantiated, OuterProduct, SummedTokens
    torch.manual_seed(0)
    model, x = LowRank().double(), torch.randn(6, 12, 16, dtype=torch.float64)
    # Each weight's per-example gradient (2 x 16 = 32 values) holds less than its input and output grad
    # (12 tokens x 18 values); the bias's sums over tokens (16) less than its tokens (12 x 16).
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    controller.per_example_norms(model(x).pow(2).sum((1, 2)))  # pass 1 alone: what it keeps for the sums
    kept = {name: type(controller._kept[p][0]) for name, p in model.named_parameters()}
    controller.detach()
    assert kept == {"down.weight": Instantiated, "up.weight": Instantiated, "up.bias": SummedTokens}
    wide = OuterProduct(torch.randn(6, 4, 16), torch.randn(6, 4, 16), (16, 16))
    assert wide.kept() is wide  # 256 values per example against 4 tokens x 32: the factors stay
    assert_exact_model(model, x, lambda out, sl: out.pow(2).sum((1, 2)), 6)
