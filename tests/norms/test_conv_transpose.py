"""The transposed convolutions' rule (norms/conv_transpose.py): the factor it returns, the adjoint convolution's,
equals the per-example autograd gradients in float64 on every norm path (unfolded patches, Gram, materialised),
with stride, padding, dilation, groups, output_padding beyond the stride and a forward's output_size, in 1, 2
and 3 dims; its clipped sum and token mass too; models on each path are exact against the per-example loop in
both modes, and none of their transposed convolutions is left to the fallback."""
import pytest
import torch
from torch import nn

from ghostdp.norms.conv import ConvWeight, unfold_patches
from ghostdp.norms.conv_transpose import conv_transpose_rule
from ghostdp.norms.factors import OuterProduct, PerExampleGrad
from ghostdp.norms.registry import find_norm_rule
from ghostdp.validate import fallback_modules
from conftest import assert_exact

B = 3
CASES = [  # (layer, the input's spatial shape, the forward's keyword arguments)
    (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), (7,), {}),
    (lambda: nn.ConvTranspose1d(6, 8, 3, stride=2, padding=1, output_padding=1), (5,), {}),
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, padding=1, output_padding=1), (5, 5), {}),
    # output_padding past the stride (allowed below the dilation): conv(G, W) has more positions than x
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=(1, 2), dilation=3, padding=(2, 1), output_padding=(2, 1)),
     (5, 4), {}),
    (lambda: nn.ConvTranspose2d(8, 8, 3, padding=1, groups=8), (4, 4), {}),  # depthwise
    (lambda: nn.ConvTranspose3d(2, 4, (2, 3, 2), stride=2, padding=(0, 1, 1)), (3, 4, 3), {}),
    (lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1), (5, 5), {"output_size": (11, 11)}),
]
IDS = [f"{len(spatial)}d-{k}" for k, (_, spatial, _) in enumerate(CASES)]


def factor_and_reference(layer, spatial, kwargs):
    x = torch.randn(B, layer.in_channels, *spatial)
    out = layer(x, **kwargs)
    grad = torch.randn_like(out)
    factors = conv_transpose_rule(layer, (x,), grad, {"weight", "bias"})
    reference = {name: [] for name in factors}  # autograd, one example at a time
    for i in range(B):
        for name, g in zip(factors, torch.autograd.grad(layer(x[i:i + 1], **kwargs),
                                                        [getattr(layer, n) for n in factors], grad[i:i + 1])):
            reference[name].append(g)
    return factors, {name: torch.stack(gs) for name, gs in reference.items()}, x, grad


@pytest.mark.parametrize("build,spatial,kwargs", CASES, ids=IDS)
def test_factors_equal_per_example_autograd(build, spatial, kwargs):
    layer = build()
    factors, reference, _, _ = factor_and_reference(layer, spatial, kwargs)
    weights = torch.randn(B)
    for name, factor in factors.items():
        want = reference[name]
        torch.testing.assert_close(factor.materialize(0, B), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(factor.materialize(1, 3), want[1:3], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(factor.sq_norm(), want.flatten(1).pow(2).sum(1), rtol=1e-10, atol=0)
        torch.testing.assert_close(factor.weighted_sum(weights), torch.tensordot(weights, want, dims=1),
                                   rtol=1e-10, atol=1e-12)


LONG_PATCHES = [  # G's patches longer than conv.SHORT_PATCH: ConvWeight
    (lambda: nn.ConvTranspose1d(6, 32, 3, stride=2, padding=1, output_padding=1), (5,)),
    (lambda: nn.ConvTranspose2d(4, 8, 3, stride=(1, 2), dilation=3, padding=(2, 1), output_padding=(2, 1)), (5, 4)),
    (lambda: nn.ConvTranspose3d(2, 8, (2, 3, 2), stride=2, padding=(0, 1, 1)), (3, 4, 3)),
    (lambda: nn.ConvTranspose2d(4, 4, 3, padding=1, groups=2), (4, 4)),
]


@pytest.mark.parametrize("build,spatial", LONG_PATCHES, ids=["1d", "2d-dilated", "3d", "2d-grouped"])
def test_both_norm_paths_of_a_long_patch_and_its_token_mass(build, spatial):
    """ConvWeight's Gram of G's unfolded patches and its materialised gradients give the same norms; its token mass
    is |x_i|_F |U_i|_F over G's patches U_i at the adjoint convolution's positions (Cauchy-Schwarz bound of
    sum_l |x_il| |U_il|; x_i is zero at the positions the adjoint adds for output_padding past the stride)."""
    layer = build()
    factors, reference, x, grad = factor_and_reference(layer, spatial, {})
    factor = factors["weight"]
    assert isinstance(factor, ConvWeight)
    want = reference["weight"].flatten(1).pow(2).sum(1)
    torch.testing.assert_close(PerExampleGrad.sq_norm(factor), want, rtol=1e-10, atol=0)
    if layer.groups == 1:
        torch.testing.assert_close(factor._unfolded().sq_norm(), want, rtol=1e-10, atol=0)
    U = unfold_patches(layer, grad)
    torch.testing.assert_close(factor.token_mass(), x.flatten(1).norm(dim=1) * U.flatten(1).norm(dim=1),
                               rtol=1e-10, atol=0)


def test_the_factor_follows_the_patch_length_and_groups():
    """G's patches are C_out/groups * prod(k) long: short and ungrouped ones are unfolded (OuterProduct), others
    take ConvWeight (a grouped one would be one unfolded factor per group)."""
    x = torch.randn(2, 4, 5, 5)
    short = nn.ConvTranspose2d(4, 3, 2, stride=2)  # 3 * 2 * 2 = 12
    assert isinstance(conv_transpose_rule(short, (x,), short(x), {"weight"})["weight"], OuterProduct)
    long = nn.ConvTranspose2d(4, 32, 3)  # 32 * 9
    assert isinstance(conv_transpose_rule(long, (x,), long(x), {"weight"})["weight"], ConvWeight)
    grouped = nn.ConvTranspose2d(4, 4, 2, groups=2)
    assert isinstance(conv_transpose_rule(grouped, (x,), grouped(x), {"weight"})["weight"], ConvWeight)


class Decoder(nn.Module):
    """A generator's upsampling path from a 2x2 latent: a long patch over few positions (ConvWeight's Gram), a short
    patch (unfolded), a grouped one with output_padding and a frozen bias (ConvWeight, materialised), one given
    output_size and no bias, and a 1-D one."""

    def __init__(self):
        super().__init__()
        self.up0 = nn.ConvTranspose2d(16, 32, 4)
        self.up1 = nn.ConvTranspose2d(32, 8, 2, stride=2)
        self.up2 = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.up3 = nn.ConvTranspose2d(8, 4, 3, padding=1, bias=False)
        self.up4 = nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1)
        self.up2.bias.requires_grad_(False)

    def forward(self, z):
        h = torch.tanh(self.up0(z))
        h = torch.tanh(self.up1(h))
        h = torch.tanh(self.up2(h))
        h = torch.tanh(self.up3(h, output_size=h.shape[2:]))
        return self.up4(h.flatten(2))


def test_a_decoder_is_exact_with_no_transposed_convolution_on_the_fallback():
    torch.manual_seed(0)
    model = Decoder()
    z = torch.randn(4, 16, 2, 2)
    assert not fallback_modules(model)
    assert find_norm_rule(model.up4) is conv_transpose_rule
    paths = {name: conv_transpose_rule(layer, (x,), layer(x), {"weight"})["weight"]
             for name, layer, x in [("up0", model.up0, z), ("up2", model.up2, torch.randn(4, 8, 10, 10))]}
    assert paths["up0"]._prefers_gram() and not paths["up2"]._prefers_gram()
    with torch.no_grad():
        w = torch.randn_like(model(z[:1])[0])

    def losses(inp):
        return (model(inp) * w).flatten(1).sum(1).pow(2)

    assert_exact(model, lambda: losses(z), lambda i: losses(z[i:i + 1]).sum(), 4)
