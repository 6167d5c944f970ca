"""ghostdp.layers.deberta.DisentangledSelfAttention: DeBERTa-v2's and v3's attention whose relative position
projections keep ghostdp's per-example views. It gives transformers' outputs (float64, padded keys, dropout draws),
``validate.fix`` swaps it in keeping every parameter and state_dict key, a fixed DeBERTa (v3's shared keys and v2's
position projections) with only its relative embeddings and their LayerNorm frozen is exact against the per-example
loop in both modes with nothing on the fallback, and the embeddings left trainable are warned of at attaching and
refused at the step, both naming the freeze."""
import pytest
import torch
import transformers
from transformers.models.deberta_v2 import modeling_deberta_v2

import ghostdp
from ghostdp.layers import deberta
from ghostdp.layers.twins import twin_of
from conftest import assert_exact_model, assert_twin_keeps_other_code, assert_warned_and_refused, classified_as

B = 3
SHARED = ("deberta.encoder.rel_embeddings.", "deberta.encoder.LayerNorm.")


def _deberta(share_att_key=True, dropout=0.0, frozen=True):
    """Relative attention over 4 position buckets (8 relative embeddings), both c2p and p2c, the embeddings layer
    normalised; ``frozen``: the relative embeddings and their LayerNorm (shared by the batch) frozen."""
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"],
        share_att_key=share_att_key, norm_rel_ebd="layer_norm", hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, pooler_dropout=0.0, num_labels=3, pad_token_id=0)).double()
    if frozen:
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(SHARED))
    return model


def _text():
    torch.manual_seed(1)
    ids, mask = torch.randint(1, 30, (B, 7)), torch.ones(B, 7, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0
    return ids * mask, mask


def test_transformers_deberta_v2_attention_has_the_code_the_twin_runs():
    attention = _deberta().deberta.encoder.layer[0].attention.self
    assert deberta.has_known_code(attention) and twin_of(attention) is deberta


@pytest.mark.parametrize("share_att_key", [True, False], ids=["deberta-v3", "deberta-v2"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fix_keeps_the_models_parameters_state_dict_and_outputs(share_att_key, dropout):
    """In train mode: with dropout the swapped model draws the same masks from the same generator state."""
    model = _deberta(share_att_key, dropout).train()
    ids, mask = _text()
    torch.manual_seed(2)
    before, params, keys = model(input_ids=ids, attention_mask=mask).logits, dict(model.named_parameters()), list(
        model.state_dict())
    names = [f"deberta.encoder.layer.{k}.attention.self" for k in range(2)]
    assert ghostdp.validate.swappable_modules(model) == names
    ghostdp.validate.fix(model)
    assert all(type(model.get_submodule(n)) is deberta.DisentangledSelfAttention for n in names)
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    torch.manual_seed(2)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("share_att_key", [True, False], ids=["deberta-v3", "deberta-v2"])
def test_a_fixed_deberta_with_its_relative_embeddings_frozen_is_exact_with_nothing_on_the_fallback(
        share_att_key, no_fallback):
    """Every attention's query and key projections train (v3: they also project the relative embeddings; v2: its
    position projections train too), each example's text padded to its own length."""
    model = ghostdp.validate.fix(_deberta(share_att_key))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "deberta.encoder.layer.0.attention.self.query_proj.weight" in trained
    assert share_att_key or "deberta.encoder.layer.0.attention.self.pos_key_proj.weight" in trained
    ids, mask = _text()
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classified_as(torch.tensor([0, 2, 1])), B)


def test_relative_embeddings_left_trainable_are_warned_of_and_refused_naming_the_freeze():
    ids, mask = _text()
    assert_warned_and_refused(
        ghostdp.validate.fix(_deberta(frozen=False)).train(),
        lambda model: model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1),
        r"'deberta.encoder.rel_embeddings.weight', 'deberta.encoder.LayerNorm.weight'.*is the batch's sum.*Fix: freeze",
        r"outside the forward.*DeBERTa-v2's encoder.*Fix: freeze them")


def test_an_attention_with_code_of_its_own_is_left_with_a_warning():
    class OwnBias(modeling_deberta_v2.DisentangledSelfAttention):
        def disentangled_attention_bias(self, *args):
            return super().disentangled_attention_bias(*args)

    model = _deberta()
    assert_twin_keeps_other_code(model, model.deberta.encoder.layer[0].attention, "self", OwnBias, deberta,
                                 "deberta.encoder.layer.0.attention.self")
