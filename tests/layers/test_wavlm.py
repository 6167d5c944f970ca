"""ghostdp.layers.wavlm.WavLMAttention: transformers' WavLM attention with its projections called as Linear layers.
It gives transformers' outputs (float64, masks, dropout draws), ``validate.fix`` swaps it in keeping every parameter
object and state_dict key, a fixed WavLM is exact against the per-example loop in both modes with nothing on the
fallback, and an unfixed one is warned of at attaching and refused at the step, both naming the fix."""
import pytest
import torch
import transformers
from transformers.models.wavlm import modeling_wavlm

import ghostdp
from ghostdp.layers import wavlm
from ghostdp.layers.twins import twin_of
from ghostdp.norms import parameter_uses
from conftest import assert_exact, assert_twin_keeps_other_code

B = 3
SAMPLES = 400  # 39 frames after the tiny feature encoder


def _attention(dropout=0.0):
    torch.manual_seed(0)
    attention = modeling_wavlm.WavLMAttention(16, 4, dropout=dropout, num_buckets=32, max_distance=100).double()
    with torch.no_grad():  # (ones at initialisation)
        attention.gru_rel_pos_const.uniform_(0.5, 1.5)
    return attention


def _wavlm(stable_layer_norm=False):
    """WavLM for CTC with its first attention's bias table and every gate constant spread, the feature encoder and
    the weight-normalised positional convolution frozen (the latter takes the fallback: not what is tested here)."""
    torch.manual_seed(0)
    model = transformers.WavLMForCTC(transformers.WavLMConfig(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        final_dropout=0.0, mask_time_prob=0.0, vocab_size=5, num_buckets=16, max_bucket_distance=40,
        do_stable_layer_norm=stable_layer_norm)).double()
    model.freeze_feature_encoder()
    model.wavlm.encoder.pos_conv_embed.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gru_rel_pos_const", "rel_attn_embed.weight")):
                p.uniform_(-1, 1)
    return model


def test_transformers_wavlm_attention_has_the_code_the_twin_computes():
    assert wavlm.has_known_code(_attention())
    assert twin_of(_attention()) is wavlm


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padded keys"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_twin_gives_transformers_outputs_attention_weights_and_position_bias(padded, dropout):
    """In train mode: with dropout the twin draws the same masks from the same generator state."""
    attention = _attention(dropout).train()
    twin = wavlm.from_transformers(attention)
    x = torch.randn(B, 20, 16, dtype=torch.float64)
    mask = None
    if padded:
        mask = torch.ones(B, 20, dtype=torch.bool)
        mask[1, 13:] = False
    torch.manual_seed(1)
    expected = attention(x, attention_mask=mask)
    torch.manual_seed(1)
    got = twin(x, attention_mask=mask)
    for e, g in zip(expected, got):
        assert e.shape == g.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    torch.manual_seed(1)  # a later layer: given the first one's bias
    expected = attention(x, attention_mask=mask, position_bias=expected[2])
    torch.manual_seed(1)
    torch.testing.assert_close(twin(x, attention_mask=mask, position_bias=expected[2])[0], expected[0],
                               rtol=1e-12, atol=1e-14)


def test_the_buckets_are_transformers_buckets():
    attention = _attention()
    relative = torch.arange(-300, 300)[None, :]
    assert torch.equal(wavlm.from_transformers(attention).relative_positions_bucket(relative),
                       attention._relative_positions_bucket(relative))


def test_fix_swaps_every_wavlm_attention_keeping_its_parameters_state_dict_and_outputs():
    model = _wavlm().eval()
    model.wavlm.encoder.layers[1].attention.q_proj.requires_grad_(False)
    names = ["wavlm.encoder.layers.0.attention", "wavlm.encoder.layers.1.attention"]
    assert ghostdp.validate.swappable_modules(model) == names
    audio = torch.randn(B, SAMPLES, dtype=torch.float64)
    before, params, keys = model(audio).logits, dict(model.named_parameters()), list(model.state_dict())
    ghostdp.validate.fix(model)
    assert all(type(model.get_submodule(n)) is wavlm.WavLMAttention for n in names)
    assert dict(model.named_parameters()) == params  # the same objects, frozen flags and all
    assert not model.wavlm.encoder.layers[1].attention.q_proj.weight.requires_grad
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(audio).logits, before, rtol=1e-12, atol=1e-14)
    assert ghostdp.validate.swappable_modules(model) == []


@pytest.mark.parametrize("stable_layer_norm", [False, True], ids=["post-norm", "stable layer norm"])
def test_a_fixed_wavlm_is_exact_with_nothing_on_the_fallback(stable_layer_norm, no_fallback, monkeypatch):
    """Examples of three lengths (the attention mask pads the shorter ones' keys); the first attention's bias table
    gets each example's gradient over both layers' use of it, the gate constants as elementwise uses."""
    uses = []
    scaled = parameter_uses.ENTRIES[parameter_uses.SCALED]
    monkeypatch.setitem(parameter_uses.ENTRIES, parameter_uses.SCALED, type(scaled)(**{
        **scaled.__dict__, "rule": lambda *a: uses.append(1) or scaled.rule(*a)}))
    model = ghostdp.validate.fix(_wavlm(stable_layer_norm))
    torch.manual_seed(2)
    audio = torch.randn(B, SAMPLES, dtype=torch.float64)
    mask = torch.ones(B, SAMPLES, dtype=torch.long)
    mask[1, 300:], mask[2, 200:] = 0, 0
    audio = audio * mask

    def losses(sl):
        return model(audio[sl], attention_mask=mask[sl]).logits.pow(2).mean((1, 2))

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)
    assert uses  # gru_rel_pos_const: a use, not the fallback


def test_an_unfixed_wavlm_is_warned_of_at_attaching_and_refused_at_the_step_both_naming_the_fix():
    model = _wavlm().train()
    with pytest.warns(UserWarning, match=r"'wavlm.encoder.layers.0.attention'.*WavLMAttention hands.*validate\.fix"):
        controller = ghostdp.GhostClipping(model, 1.0)
    try:
        logits = model(torch.randn(B, SAMPLES, dtype=torch.float64)).logits
        with pytest.raises(RuntimeError, match=r"outside the forward.*ghostdp\.validate\.fix\(model\)"):
            controller.loss(logits.pow(2).mean((1, 2))).backward()
    finally:
        controller.detach()


def test_a_wavlm_attention_with_code_of_its_own_is_left_with_a_warning():
    class OwnForward(modeling_wavlm.WavLMAttention):
        def forward(self, hidden_states, attention_mask=None, position_bias=None, index=0, **kwargs):
            return super().forward(hidden_states, attention_mask, position_bias, index, **kwargs)

    model = _wavlm()
    assert_twin_keeps_other_code(model, model.wavlm.encoder.layers[0], "attention", OwnForward, wavlm,
                                 "wavlm.encoder.layers.0.attention")
    assert type(model.wavlm.encoder.layers[1].attention) is wavlm.WavLMAttention  # the other layer's was swapped
