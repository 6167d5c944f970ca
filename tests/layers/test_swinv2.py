"""ghostdp.layers.swinv2.Swinv2SelfAttention: Swin v2's self-attention with its continuous position bias formed for
each example. It gives transformers' outputs (float64, shifted windows' mask, attention probabilities, dropout draws),
``validate.fix`` swaps it in keeping every parameter, buffer and state_dict key, a fixed Swin v2 is exact against the
per-example loop in both modes with nothing on the fallback (its logit scales elementwise uses through clamp and
exp, one head above the clamp), and an unfixed one is warned of at attaching, naming the fix."""
import pytest
import torch
import transformers
from transformers.models.swinv2 import modeling_swinv2

import ghostdp
from ghostdp.layers import swinv2
from ghostdp.layers.twins import twin_of
from ghostdp.norms import parameter_uses
from conftest import assert_exact, assert_twin_keeps_other_code

B = 3


def _swinv2(depths=(2, 1), dropout=0.0):
    """16 x 16 images, patches of 2, windows of 4: 4 windows an example in the first stage (its second block on
    shifted windows, with the mask), one in the second. Every logit scale spread, one head of the first attention
    above the clamp at log 100 (its f' is 0)."""
    torch.manual_seed(0)
    model = transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=16, patch_size=2, embed_dim=8, depths=list(depths), num_heads=[2, 2][:len(depths)], window_size=4,
        num_labels=3, drop_path_rate=0.0, attention_probs_dropout_prob=dropout)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.uniform_(1.0, 4.0)
        model.swinv2.encoder.layers[0].blocks[0].attention.self.logit_scale[1] = 5.0
    return model


def _attentions(model):
    return [block.attention.self for layer in model.swinv2.encoder.layers for block in layer.blocks]


def test_transformers_swinv2_self_attention_has_the_code_the_twin_computes():
    attention = _attentions(_swinv2())[0]
    assert swinv2.has_known_code(attention) and twin_of(attention) is swinv2


@pytest.mark.parametrize("masked", [False, True], ids=["windows", "shifted windows"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_twin_gives_transformers_outputs_and_attention_probabilities(masked, dropout):
    """The shifted windows' mask is added twice, as transformers' code adds it; dropout draws the same masks."""
    attention = _attentions(_swinv2(dropout=dropout))[1 if masked else 0].train()
    twin = swinv2.from_transformers(attention)
    x = torch.randn(B * 4, 16, 8)
    mask = torch.randn(4, 16, 16) if masked else None
    torch.manual_seed(1)
    expected = attention(x, mask, output_attentions=True)
    torch.manual_seed(1)
    got = twin(x, mask, output_attentions=True)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


def test_fix_swaps_every_self_attention_keeping_parameters_buffers_state_dict_and_outputs():
    model = _swinv2().eval()
    names = ["swinv2.encoder.layers.0.blocks.0.attention.self", "swinv2.encoder.layers.0.blocks.1.attention.self",
             "swinv2.encoder.layers.1.blocks.0.attention.self"]
    assert ghostdp.validate.swappable_modules(model) == names
    x = torch.randn(B, 3, 16, 16)
    before, params, keys = model(pixel_values=x).logits, dict(model.named_parameters()), list(model.state_dict())
    buffers = dict(model.named_buffers())
    ghostdp.validate.fix(model)
    assert all(type(model.get_submodule(n)) is swinv2.Swinv2SelfAttention for n in names)
    assert dict(model.named_parameters()) == params and dict(model.named_buffers()) == buffers
    assert list(model.state_dict()) == keys  # the coordinate table and index stay out of it, as in transformers'
    torch.testing.assert_close(model(pixel_values=x).logits, before, rtol=1e-12, atol=1e-14)
    assert ghostdp.validate.swappable_modules(model) == []


def test_a_fixed_swinv2_is_exact_with_nothing_on_the_fallback(no_fallback, monkeypatch):
    uses = []
    scaled = parameter_uses.ENTRIES[parameter_uses.SCALED]
    monkeypatch.setitem(parameter_uses.ENTRIES, parameter_uses.SCALED, type(scaled)(**{
        **scaled.__dict__, "rule": lambda *a: uses.append(1) or scaled.rule(*a)}))
    model = ghostdp.validate.fix(_swinv2())
    x, labels = torch.randn(B, 3, 16, 16), torch.tensor([0, 2, 1])
    ce = torch.nn.CrossEntropyLoss(reduction="none")

    def losses(part):
        return ce(model(pixel_values=x[part]).logits, labels[part])

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)
    assert uses  # the logit scales: uses through clamp and exp, on each example's windows (layout ("rows",))


def test_an_unfixed_swinv2_is_warned_of_at_attaching_naming_the_fix():
    model = _swinv2(depths=(1,)).train()
    with pytest.warns(UserWarning, match=r"'swinv2.encoder.layers.0.blocks.0.attention.self'.*Swinv2SelfAttention "
                                         r"runs its position-bias MLP once.*validate\.fix"):
        controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="continuous_position_bias_mlp"):
            logits = model(pixel_values=torch.randn(B, 3, 16, 16)).logits
            controller.loss(logits.pow(2).sum(1)).backward()
    finally:
        controller.detach()


def test_a_self_attention_with_code_of_its_own_is_left_with_a_warning():
    class OwnForward(modeling_swinv2.Swinv2SelfAttention):
        def forward(self, hidden_states, attention_mask=None, output_attentions=False):
            return super().forward(hidden_states, attention_mask, output_attentions)

    model = _swinv2(depths=(1,))
    assert_twin_keeps_other_code(model, model.swinv2.encoder.layers[0].blocks[0].attention, "self", OwnForward,
                                 swinv2, "swinv2.encoder.layers.0.blocks.0.attention.self")
