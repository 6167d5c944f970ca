"""ConvNext's blocks own their layer scale, which multiplies the block's last Linear output before the residual: the
rule reads that tensor from the output's graph (norms/elementwise.py, scaled_before_the_residual) and takes the
block's output grad permuted back as its G. Each exact against the per-example loop in both modes, with the rule's
calls counted, also after a drop path that drew its mask; a block whose graph cannot be read (a checkpoint) takes the
exact fallback."""
import pytest
import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from ghostdp.norms.elementwise import CONVNEXT_LAYER_BODY, DINOV3_CONVNEXT_LAYER_BODY
from ghostdp.validate import fallback_modules
from conftest import CLIPPING_MODES, assert_exact, clipped_sum_through_the_batch, count_forward_rule_calls

B = 3


@pytest.fixture
def rule_calls(monkeypatch):
    """{"convnext" / "dinov3": the calls the layer scale's rule has formed since the test began}."""
    bodies = {"convnext": CONVNEXT_LAYER_BODY, "dinov3": DINOV3_CONVNEXT_LAYER_BODY}
    return count_forward_rule_calls(monkeypatch, bodies)


def _spread_scales(model):
    """Layer scales start at 1e-6 (ConvNext) or a constant (DINOv3): spread them over [-1, 1], so that a wrong
    channel or a wrong example in the rule shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layer_scale_parameter", "gamma")):
                p.uniform_(-1, 1)
    return model


def _convnext(drop_path_rate=0.0):
    return _spread_scales(transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[4, 8], depths=[1, 2], num_stages=2, patch_size=2, image_size=8, num_labels=3,
        drop_path_rate=drop_path_rate)))


def _dinov3_convnext():
    return _spread_scales(transformers.DINOv3ConvNextModel(transformers.DINOv3ConvNextConfig(
        num_channels=3, hidden_sizes=[4, 8], depths=[1, 2], drop_path_rate=0.0)))


def _losses(model, pixels, labels):
    output = model(pixel_values=pixels)
    if hasattr(output, "logits"):
        return nn.functional.cross_entropy(output.logits, labels, reduction="none")
    return output.last_hidden_state.pow(2).flatten(1).sum(1)


@pytest.mark.parametrize("family", ["convnext", "dinov3"])
def test_a_convnext_block_with_its_layer_scale_trained_is_exact_by_its_rule(family, rule_calls):
    model = _convnext() if family == "convnext" else _dinov3_convnext()
    layers = [m for m in model.modules() if type(m).__name__ in ("ConvNextLayer", "DINOv3ConvNextLayer")]
    assert len(layers) == 3 and fallback_modules(model) == {}
    pixels, labels = torch.randn(B, 3, 8, 8), torch.tensor([0, 2, 1])
    # The first stage's feature map is 4x4 with 4 channels: a G permuted the wrong way would fit every shape there.
    assert_exact(model, lambda: _losses(model, pixels, labels),
                 lambda i: _losses(model, pixels[i:i + 1], labels[i:i + 1]).sum(), B)
    assert rule_calls[family] == 2 * 3 * 3  # two values of C, three blocks, pass 1 of both modes and ghost's pass 2


def test_a_block_whose_drop_path_drew_its_mask_is_exact_by_its_rule(rule_calls):
    """With stochastic depth each block but the first (drop rate 0) multiplies its branch by the example's mask over
    the keep rate between the layer scale and the residual: the rule reads that factor from the graph too. Exact
    against each example's gradient through the batch's own graph (the same masks; a per-example loop would draw
    others), with a mask that drops one example's branch and keeps the others'."""
    model = _convnext(drop_path_rate=0.9).train()
    pixels, labels = torch.randn(B, 3, 8, 8), torch.tensor([0, 2, 1])
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(4)
    masks = []
    for block in model.convnext.encoder.stages[1].layers:
        block.drop_path.register_forward_hook(lambda module, args, out: masks.append((out != 0).flatten(1).any(1)))
    losses = _losses(model, pixels, labels)
    assert any(not m.all() and m.any() for m in masks), masks  # the seed drops some examples' branches, not all
    for clipping in CLIPPING_MODES:
        reference = clipped_sum_through_the_batch(losses, params, C=0.1)
        controller = ghostdp.GhostClipping(model, 0.1, clipping=clipping)
        try:
            torch.manual_seed(4)
            controller.loss(_losses(model, pixels, labels), reduction="sum").backward()
            got = torch.cat([p.grad.flatten() for p in params])
        finally:
            controller.detach()
            model.zero_grad(set_to_none=True)
        assert torch.allclose(got, reference, rtol=1e-9, atol=1e-12), clipping
    assert rule_calls["convnext"] == 3 * 3  # three blocks, pass 1 of both modes and ghost's pass 2


class _Checkpointed(nn.Module):
    """A ConvNext block run under a non-reentrant activation checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def test_a_block_under_a_checkpoint_takes_the_exact_fallback(rule_calls):
    """Reading the scaled tensor from a checkpointed graph would run the region's forward again inside the forward
    (the checkpoint's unpack hook): the reader declines there, and the block takes the fallback."""
    block = _spread_scales(transformers.models.convnext.modeling_convnext.ConvNextLayer(
        transformers.ConvNextConfig(), dim=4))
    model = _Checkpointed(block)
    x = torch.randn(B, 4, 4, 4)
    w = torch.randn(B, 4, 4, 4)
    assert_exact(model, lambda: (model(x) * w).flatten(1).sum(1).pow(2),
                 lambda i: (model(x[i:i + 1]) * w[i:i + 1]).sum().pow(2), B)
    assert rule_calls.get("convnext", 0) == 0


class _BatchCentring(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_block_that_mixes_examples_where_its_rule_declines_is_refused(clipping):
    """A drop path that is a batch mean: the graph reader declines (a node it does not know), and the layer scale is
    then an elementwise use (norms/parameter_uses.py), whose output grad mixes the examples: refused by the layout
    proof. With only the layer scale trained and an input without gradient, nothing below shows it, and the forward
    check is off here; before the uses the block took the fallback, and before its input had a sink (one is set
    before the forward, where the rule cannot yet know it will decline) the step went through."""
    block = _spread_scales(transformers.models.convnext.modeling_convnext.ConvNextLayer(
        transformers.ConvNextConfig(), dim=4))
    block.drop_path = _BatchCentring()
    for name, p in block.named_parameters():
        p.requires_grad_(name == "layer_scale_parameter")
    controller = ghostdp.GhostClipping(block, 1e-3, clipping=clipping)
    controller.independence.every = 0
    try:
        with pytest.raises(RuntimeError, match=r"\(ConvNextLayer\) produced an output .* mixes several examples"):
            controller.loss(block(torch.randn(5, 4, 3, 3)).flatten(1).sum(1), reduction="sum").backward()
    finally:
        controller.detach()
