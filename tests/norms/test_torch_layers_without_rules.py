"""torch.nn layers that have no norm rule of their own go through the fallback (norms/fallback.py): exact against
the float64 per-example loop in both modes, every example clipped and none. Those that mix examples are refused
elsewhere (BatchNorm by the model check); InstanceNorm normalises each example alone."""
import pytest
import torch
from torch import nn

from conftest import assert_exact

B = 5

CASES = {
    "Bilinear": (lambda: nn.Bilinear(4, 3, 2), lambda: (torch.randn(B, 4), torch.randn(B, 3))),
    "InstanceNorm1d, affine": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True)),
                               lambda: (torch.randn(B, 2, 9),)),
    "InstanceNorm2d, affine, running stats": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
        lambda: (torch.randn(B, 2, 6, 6),)),
    "LocalResponseNorm after a conv": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.LocalResponseNorm(2)),
                                       lambda: (torch.randn(B, 2, 6, 6),)),
}


def _loss(out):
    flat = out.reshape(out.shape[0], -1)
    return flat.pow(2).sum(1) + flat.sum(1)  # not even in the output: a gradient that no sign symmetry cancels


@pytest.mark.parametrize("name", list(CASES))
def test_a_torch_layer_without_a_rule_is_exact(name):
    build, data = CASES[name]
    torch.manual_seed(0)
    model, inputs = build(), data()
    assert_exact(model, lambda: _loss(model(*inputs)),
                 lambda i: _loss(model(*[x[i:i + 1] for x in inputs])).sum(), B)
