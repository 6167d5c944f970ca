"""torch.nn.PReLU by its rule (norms/elementwise.py: the scale of min(0, x) along the channel dim 1), the exact
fallback's before 2026-11-28: its factor against each example's autograd gradient in float64 for a shared and a
per-channel slope on 1-D, 2-D, 3-D and 4-D inputs, with its token mass; a CNN with PReLUs exact against the
per-example loop in both modes, nothing on the fallback."""
import pytest
import torch
from torch import nn

from ghostdp.norms.elementwise import prelu_rule
from ghostdp.norms.registry import find_norm_rule
from ghostdp.validate import fallback_modules
from conftest import assert_exact

B = 4
CASES = [(1, (B,)), (1, (B, 5)), (5, (B, 5)), (3, (B, 3, 7)), (3, (B, 3, 4, 5)), (1, (B, 3, 4, 5))]


@pytest.mark.parametrize("channels,shape", CASES, ids=[f"{c}-{len(s)}d" for c, s in CASES])
def test_the_factor_is_each_examples_gradient(channels, shape):
    torch.manual_seed(0)
    layer = nn.PReLU(channels, init=0.3)
    with torch.no_grad():
        layer.weight.uniform_(0.1, 0.5)
    x = torch.randn(*shape)
    x.view(-1)[::7] = 0.0  # torch's backward takes 0 at x = 0
    G = torch.randn(*shape)
    factor = prelu_rule(layer, (x,), G, {"weight"})["weight"]
    reference = torch.stack([torch.autograd.grad(layer(x[i:i + 1]), layer.weight, G[i:i + 1])[0] for i in range(B)])
    assert factor.param_shape == layer.weight.shape
    torch.testing.assert_close(factor.materialize(0, B), reference, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(factor.sq_norm(), reference.pow(2).sum(1), rtol=1e-12, atol=0)
    # token mass: sqrt(positions) |G_i * min(0, x_i)|_F over the positions each slope is summed over
    terms = (G * x.clamp(max=0)).reshape(B, *([channels] if channels > 1 else []), -1)
    positions = terms.shape[-1] if channels > 1 or x.dim() > 1 else 1
    if positions > 1:
        want = terms.flatten(1).norm(dim=1) * positions ** 0.5
        torch.testing.assert_close(factor.token_mass(), want, rtol=1e-12, atol=0)


def test_a_frozen_slope_has_no_factor():
    layer = nn.PReLU(3).requires_grad_(False)
    assert prelu_rule(layer, (torch.randn(2, 3),), torch.randn(2, 3), set()) == {}


def test_a_cnn_with_prelus_is_exact_with_nothing_on_the_fallback():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.PReLU(6), nn.Conv2d(6, 6, 3), nn.PReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3), nn.PReLU(3))
    assert find_norm_rule(model[1]) is prelu_rule and not fallback_modules(model)
    x = torch.randn(B, 3, 6, 6)
    w = torch.randn(3)

    def losses(inp):
        out = model(inp)
        return (out * w).sum(1).pow(2) + out.sum(1)

    assert_exact(model, lambda: losses(x), lambda i: losses(x[i:i + 1]).sum(), B)
