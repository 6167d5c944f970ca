"""An example whose huge gradient terms cancel cannot round away the other examples' gradients."""
import pytest
import torch
from torch import nn

import ghostdp


class MeanPooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 4) -> (B,): a linear score, so every example's output grad is non-zero
        return (self.lin(x).mean(1) * torch.tensor([1.0, -2.0, 0.5], dtype=x.dtype)).sum(1)


def _batch(dtype, M):
    torch.manual_seed(1)
    x = torch.randn(16, 2, 4, dtype=dtype)
    v = torch.randn(4, dtype=dtype)
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
    x = torch.randn(32, 64, 4, dtype=torch.float32) * 100
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
