"""Swin's relative position bias trained with each example's gradient (norms/window_bias.py): transformers' Swin has
the code the rule and the recorder's broadcast were written for; the rule's factor equals each example's autograd
gradient of the table; a Swin with shifted windows and two stages is exact against the per-example loop in both
modes, eager and SDPA attention, nothing on the fallback; a frozen table, or a batch of one, leaves the bias as the
model forms it; an attention whose forward is not Swin's keeps ghostdp's plain broadcast (and its error)."""
import pytest
import torch
import transformers
from transformers.models.swin import modeling_swin

from ghostdp.norms import registry
from ghostdp.norms.window_bias import WINDOW_ATTENTION_BODY, WINDOW_BIAS_BODY, adds_window_bias, window_bias_rule
from ghostdp.validate import fallback_modules
import ghostdp
from conftest import assert_exact

B = 4


def _swin(attention="eager", depths=(2, 1)):
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=16, patch_size=2, embed_dim=8, depths=list(depths), num_heads=[2, 2][:len(depths)], window_size=4,
        num_labels=3, drop_path_rate=0.0, attn_implementation=attention)).double()
    with torch.no_grad():  # (zeros at initialisation: every example's gradient of them would be alike)
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                p.normal_(0.0, 0.5)
    return model


def test_transformers_swin_has_the_code_the_rule_knows():
    assert registry.forward_body(modeling_swin.SwinRelativePositionBias.forward) == WINDOW_BIAS_BODY
    assert registry.forward_body(modeling_swin.SwinAttention.forward) == WINDOW_ATTENTION_BODY
    assert adds_window_bias(modeling_swin.SwinAttention)
    bias = _swin().swin.encoder.layers[0].blocks[0].attention.relative_position_bias
    assert registry.find_norm_rule(bias) is window_bias_rule


def test_the_factor_is_each_examples_gradient_of_the_table():
    """G (B, windows, heads, N, N) as the recorder broadcasts the bias to each example's windows."""
    bias = _swin().swin.encoder.layers[0].blocks[0].attention.relative_position_bias
    table = bias.relative_position_bias_table
    out = bias()  # (1, heads, N, N)
    G = torch.randn(B, 3, *out.shape[1:])  # three windows an example
    factor = window_bias_rule(bias, (), G, {"relative_position_bias_table"})["relative_position_bias_table"]
    reference = torch.stack([torch.autograd.grad(bias(), table, G[i].sum(0, keepdim=True))[0] for i in range(B)])
    torch.testing.assert_close(factor.materialize(0, B), reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factor.sq_norm(), reference.flatten(1).pow(2).sum(1), rtol=1e-12, atol=0)
    weights = torch.randn(B)
    torch.testing.assert_close(factor.weighted_sum(weights), torch.tensordot(weights, reference, dims=1),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_swin_with_its_relative_position_bias_trained_is_exact(attention):
    """Stage 1: 4 windows an example, its second block on shifted windows (the bias added to the shift's mask);
    stage 2: one window."""
    model = _swin(attention)
    assert not fallback_modules(model)
    x, labels = torch.randn(B, 3, 16, 16), torch.randint(0, 3, (B,))
    ce = torch.nn.CrossEntropyLoss(reduction="none")

    def losses(part):
        return ce(model(pixel_values=x[part]).logits, labels[part])

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)


@pytest.mark.parametrize("frozen", [True, False], ids=["table frozen", "batch of one"])
def test_the_bias_is_the_models_own_where_ghostdp_need_not_split_it(frozen):
    """A frozen table is not hooked into; a batch of one is not broadcast: the attention adds (1, heads, N, N)."""
    model = _swin(depths=(1,))
    attention = model.swin.encoder.layers[0].blocks[0].attention
    seen = []
    attention.relative_position_bias.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    if frozen:
        attention.relative_position_bias.requires_grad_(False)
    n = B if frozen else 1
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss(model(pixel_values=torch.randn(n, 3, 16, 16)).logits.pow(2).sum(1)).backward()
    finally:
        controller.detach()
    assert seen and all(shape[0] == 1 for shape in seen), seen


def test_an_attention_with_other_code_keeps_the_plain_broadcast_and_its_error(monkeypatch):
    """A subclass of Swin's attention with a forward of its own: ghostdp does not know how it uses the bias, so the
    bias is broadcast to the batch as any output of batch size 1, and the model's failure carries ghostdp's note."""

    class OtherAttention(modeling_swin.SwinAttention):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            return super().forward(hidden_states, attention_mask, **kwargs)

    assert not adds_window_bias(OtherAttention)
    model = _swin(depths=(1,))
    block = model.swin.encoder.layers[0].blocks[0]
    other = OtherAttention.__new__(OtherAttention)
    other.__dict__.update(block.attention.__dict__)
    block.attention = other
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError) as caught:
            model(pixel_values=torch.randn(B, 3, 16, 16))
    finally:
        controller.detach()
    assert "relative_position_bias'" in "".join(getattr(caught.value, "__notes__", []))
