"""An example whose huge gradient terms cancel cannot round away the other examples' gradients."""
import pytest
import torch
from torch import nn

import ghostdp


class MeanPooled(nn.Module):
    """16 features in and out: at T = 2 book-keeping keeps the weight's input and output grad (not its explicit
    per-example gradients, which hold more), and sums it over every token of the batch, as two passes do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):  # (B, T, 16) -> (B,): a linear score, so every example's output grad is non-zero
        return (self.lin(x).mean(1) * torch.linspace(-2.0, 1.0, 16, dtype=x.dtype)).sum(1)


def _batch(dtype, M):
    torch.manual_seed(1)
    x = torch.randn(16, 2, 16, dtype=dtype)
    v = torch.randn(16, dtype=dtype)
    x[5] = torch.stack([M * v, -M * v])  # tokens that cancel: its true gradient is 0
    return x


@pytest.mark.parametrize("dtype,M", [(torch.float32, 1e12), (torch.float64, 1e24)])
@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_cancelling_huge_tokens_are_refused_or_skipped(dtype, M, clipping):
    model = MeanPooled().to(dtype)
    x = _batch(dtype, M)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        controller.loss(model(x), reduction="sum").backward()
    controller.detach()
    model.zero_grad()

    skipping = ghostdp.GhostClipping(model, 1.0, clipping=clipping, nonfinite="skip")
    skipping.loss(model(x), reduction="sum").backward()
    with_outlier = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    skipping.detach()
    model.zero_grad()
    keep = [i for i in range(16) if i != 5]
    reference = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    reference.loss(model(x[keep]), reduction="sum").backward()
    without = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert float((with_outlier - without).norm()) <= 1.0 * (1 + 1e-6) + 1e-5 * float(without.norm())


def test_ordinary_examples_are_not_flagged():
    model = MeanPooled().float()
    controller = ghostdp.GhostClipping(model, 1e-3)  # every example clipped hard
    x = torch.randn(32, 64, 16, dtype=torch.float32) * 100
    controller.loss(model(x)).backward()
    assert bool((controller.last_coefficients > 0).all())


class WeightedTokens(nn.Module):
    """loss_i = sum_t s_it <lin(x_it), w>: token weights s reach the output grads G, not the inputs A."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x, s):
        return (s[..., None] * self.norm(self.lin(x)) * torch.tensor([1.0, -2.0, 0.5], dtype=x.dtype)).sum((1, 2))


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_cancelling_huge_output_grads_on_zero_inputs_are_refused(clipping):
    # A = 0 and G_t = (M, -M) * w: the weight's terms vanish, the bias's and LayerNorm's cancel.
    torch.manual_seed(2)
    model = WeightedTokens().float()
    x, s = torch.randn(16, 2, 4), torch.ones(16, 2)
    x[5], s[5] = 0.0, torch.tensor([1e9, -1e9])
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        controller.loss(model(x.float(), s.float()), reduction="sum").backward()


class LowRank(nn.Module):
    """A rank-2 layer on 64 features (a LoRA factor): at T = 2 its explicit per-example gradients (2 x 64) hold
    less than its input and output grad, so book-keeping keeps them (factors.OuterProduct.kept)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 2, bias=False)

    def forward(self, x):
        return (self.lin(x).mean(1) * torch.tensor([1.0, -2.0])).sum(1)


def test_book_keeping_needs_no_mass_where_it_keeps_a_single_use_layers_finished_gradients():
    """An example whose huge tokens cancel, in a layer whose finished per-example gradients book-keeping keeps
    (a LoRA factor): its norm and its clipped sum both read the same g_i, so it cannot round the other examples
    away, and book-keeping takes the step; the clipped sum moves by at most C against the batch without it.
    Two passes form that layer's clipped sum over every token of the batch in one accumulation: refused there."""
    torch.manual_seed(3)
    x = torch.randn(16, 2, 64)
    v = torch.randn(64)
    x[5] = torch.stack([1e12 * v, -1e12 * v])

    def clipped_sum(model, batch):
        controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
        try:
            controller.loss(model(batch), reduction="sum").backward()  # taken, not refused
            return model.lin.weight.grad.detach().clone().double()
        finally:
            controller.detach()
            model.zero_grad()

    model = LowRank()
    with_outlier = clipped_sum(model, x)
    without = clipped_sum(model, x[[i for i in range(16) if i != 5]])
    assert float((with_outlier - without).norm()) <= 1.0 * (1 + 1e-6) + 1e-5 * float(without.norm())
    ghost = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        ghost.loss(model(x), reduction="sum").backward()
    ghost.detach()
    # The same layer called twice: its two uses' sums are formed apart and added, so the mass stays.
    twice = LowRank()
    twice.forward = lambda batch: LowRank.forward(twice, batch) + LowRank.forward(twice, batch.flip(1))
    controller = ghostdp.GhostClipping(twice, 1.0, clipping="bookkeeping")
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        controller.loss(twice(x), reduction="sum").backward()
    controller.detach()


class WeightedNorm(nn.Module):
    """loss_i = sum_t s_it <LayerNorm(x_it), w>: book-keeping forms a LayerNorm's per-example gradients (B, d) and
    keeps them, as the LoRA factor above."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, s):
        return (s[..., None] * self.norm(x) * torch.linspace(-2.0, 1.0, 16, dtype=x.dtype)).sum((1, 2))


def test_book_keeping_needs_no_mass_for_a_single_use_layer_norm():
    """Huge cancelling output grads in a LayerNorm called once: book-keeping's norm and clipped sum both read its
    finished (B, d) gradients, so it takes the step and moves the sum by at most C; two passes sum G * xhat over
    every token of the batch and refuse; the same LayerNorm called twice is refused in book-keeping too."""
    torch.manual_seed(4)
    x, s = torch.randn(16, 2, 16, dtype=torch.float32), torch.ones(16, 2, dtype=torch.float32)
    x[5, 1], s[5] = x[5, 0], torch.tensor([1e9, -1e9])
    keep = [i for i in range(16) if i != 5]

    def clipped_sum(model, *batch):
        controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
        try:
            controller.loss(model(*batch), reduction="sum").backward()  # taken, not refused
            return torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        finally:
            controller.detach()
            model.zero_grad()

    model = WeightedNorm().float()
    with_outlier, without = clipped_sum(model, x, s), clipped_sum(model, x[keep], s[keep])
    assert float(without.norm()) > 1.0  # the other examples' sum is not itself negligible
    assert float((with_outlier - without).norm()) <= 1.0 * (1 + 1e-6) + 1e-5 * float(without.norm())
    ghost = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        ghost.loss(model(x, s), reduction="sum").backward()
    ghost.detach()
    twice = WeightedNorm().float()
    twice.forward = lambda x, s: WeightedNorm.forward(twice, x, s) + WeightedNorm.forward(twice, x.flip(1), s)
    controller = ghostdp.GhostClipping(twice, 1.0, clipping="bookkeeping")
    with pytest.raises(ghostdp.ImpreciseExampleError, match=r"examples \[5\]"):
        controller.loss(twice(x, s), reduction="sum").backward()
    controller.detach()
