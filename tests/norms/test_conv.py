"""The convolution factor (ConvWeight): its per-example gradients (grouped by example), both norm paths
(Gram of the unfolded patches, and materialised gradients), its clipped sum and its token mass equal the
unfolded-patch reference in float64, for every padding mode, stride, dilation and group count; a model
on each norm path is exact against the per-example loop."""
import pytest
import torch
from torch import nn

from ghostdp.norms.conv import ConvWeight, conv_rule, unfold_patches
from ghostdp.norms.factors import OuterProduct, PerExampleGrad
from conftest import assert_exact

B = 3
CASES = [
    (lambda: nn.Conv2d(4, 6, 3), (7, 6)),
    (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1), (7, 6)),
    (lambda: nn.Conv2d(4, 6, 3, dilation=2, padding="same"), (7, 6)),
    (lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1, padding_mode="reflect"), (7, 6)),
    (lambda: nn.Conv2d(4, 6, 2, padding="same", padding_mode="circular"), (5, 6)),  # asymmetric 'same'
    (lambda: nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=1), (11,)),
    (lambda: nn.Conv1d(4, 4, 3, groups=4), (9,)),
    (lambda: nn.Conv3d(2, 3, (2, 3, 2), padding=(1, 0, 1), stride=(1, 2, 1)), (4, 5, 3)),
]


def factor_and_reference(conv, spatial):
    x = torch.randn(B, conv.in_channels, *spatial)
    out = conv(x)
    grad = torch.randn_like(out)
    factor = ConvWeight(conv, x, grad)
    reference = []  # autograd, one example at a time
    for i in range(B):
        (g,) = torch.autograd.grad(conv(x[i:i + 1]), conv.weight, grad[i:i + 1])
        reference.append(g)
    return factor, torch.stack(reference), x, grad


@pytest.mark.parametrize("build,spatial", CASES, ids=[f"{len(s)}d-{i}" for i, (_, s) in enumerate(CASES)])
def test_factor_equals_per_example_autograd(build, spatial):
    conv = build()
    factor, reference, x, grad = factor_and_reference(conv, spatial)
    torch.testing.assert_close(factor.materialize(0, B), reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(factor.materialize(1, 3), reference[1:3], rtol=1e-10, atol=1e-12)
    want = reference.flatten(1).pow(2).sum(1)
    torch.testing.assert_close(PerExampleGrad.sq_norm(factor), want, rtol=1e-10, atol=0)
    torch.testing.assert_close(factor._unfolded().sq_norm(), want, rtol=1e-10, atol=0)
    torch.testing.assert_close(factor.sq_norm(), want, rtol=1e-10, atol=0)
    weights = torch.randn(B)
    torch.testing.assert_close(factor.weighted_sum(weights), torch.tensordot(weights, reference, dims=1),
                               rtol=1e-10, atol=1e-12)
    U = unfold_patches(conv, x)
    mass = grad.flatten(1).norm(dim=1) * U.flatten(1).norm(dim=1)
    torch.testing.assert_close(factor.token_mass(), mass, rtol=1e-10, atol=0)


def test_the_factor_and_norm_path_follow_the_cost_model():
    wide_and_small = ConvWeight(nn.Conv2d(32, 32, 3, padding=1), torch.randn(2, 32, 3, 3), torch.randn(2, 32, 3, 3))
    narrow_and_large = ConvWeight(nn.Conv2d(8, 8, 3, padding=1), torch.randn(2, 8, 16, 16), torch.randn(2, 8, 16, 16))
    assert wide_and_small._prefers_gram() and not narrow_and_large._prefers_gram()
    short_patch = nn.Conv2d(3, 8, 3)
    x = torch.randn(2, 3, 6, 6)
    assert isinstance(conv_rule(short_patch, [x], torch.randn(2, 8, 4, 4), {"weight"})["weight"], OuterProduct)
    long_patch = nn.Conv2d(8, 8, 3)
    x = torch.randn(2, 8, 6, 6)
    assert isinstance(conv_rule(long_patch, [x], torch.randn(2, 8, 4, 4), {"weight"})["weight"], ConvWeight)
    # A grouped convolution takes ConvWeight's one grouped convolution whatever its patch: unfolded, it would be
    # one factor per group (a depthwise 7x7 convolution's 49-long patch is short).
    depthwise = nn.Conv2d(8, 8, 7, padding=3, groups=8)
    assert isinstance(conv_rule(depthwise, [x], torch.randn(2, 8, 6, 6), {"weight"})["weight"], ConvWeight)


@pytest.mark.parametrize("spatial", [(3, 3), (12, 12)], ids=["gram", "materialised"])
def test_model_on_each_norm_path_is_exact(spatial):
    # A short patch (unfolded factor), then long ones (ConvWeight: Gram at 3x3, materialised at 12x12), then a
    # depthwise convolution (a short patch, grouped: ConvWeight, materialised).
    model = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.Tanh(), nn.Conv2d(24, 24, 3, padding=1, groups=2),
                          nn.Tanh(), nn.Conv2d(24, 24, 5, padding=2, groups=24), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(4, 3, *spatial)
    model(x)
    w = torch.randn(2)

    def losses(inp):
        return (model(inp) * w).sum(1).pow(2)

    assert_exact(model, lambda: losses(x), lambda i: losses(x[i:i + 1]).sum(), 4)
