"""ghostdp.layers.mpnet.MPNetEncoder: MPNet's encoder with its relative attention bias looked up for each example.
It gives transformers' outputs (float64, padded texts, dropout draws), ``validate.fix`` swaps it in keeping every
parameter and state_dict key, a fixed MPNet with its bias table trained is exact against the per-example loop in
both modes with nothing on the fallback, and an unfixed one is warned of at attaching and refused, naming the fix."""
import pytest
import torch
import transformers
from transformers.models.mpnet import modeling_mpnet

import ghostdp
from ghostdp.layers import mpnet
from ghostdp.layers.twins import twin_of
from conftest import assert_exact_model, assert_twin_keeps_other_code, assert_warned_and_refused, classified_as

B = 3


def _mpnet(dropout=0.0):
    """MPNet's 32 buckets of relative positions (compute_position_bias's default), the table drawn away from its
    initial values so that every example's gradient of it differs."""
    torch.manual_seed(0)
    model = transformers.MPNetForSequenceClassification(transformers.MPNetConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=40, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        num_labels=3)).double()
    with torch.no_grad():
        model.mpnet.encoder.relative_attention_bias.weight.normal_(0.0, 0.5)
    return model


def _text():
    torch.manual_seed(1)
    ids, mask = torch.randint(3, 30, (B, 7)), torch.ones(B, 7, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0
    return ids, mask


def test_transformers_mpnet_encoder_has_the_code_the_twin_runs():
    encoder = _mpnet().mpnet.encoder
    assert mpnet.has_known_code(encoder) and twin_of(encoder) is mpnet


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fix_keeps_the_models_parameters_state_dict_and_outputs(dropout):
    """In train mode: with dropout the swapped model draws the same masks from the same generator state."""
    model = _mpnet(dropout).train()
    ids, mask = _text()
    assert ghostdp.validate.swappable_modules(model) == ["mpnet.encoder"]
    torch.manual_seed(2)
    before, params, keys = model(input_ids=ids, attention_mask=mask).logits, dict(model.named_parameters()), list(
        model.state_dict())
    ghostdp.validate.fix(model)
    assert type(model.mpnet.encoder) is mpnet.MPNetEncoder
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    torch.manual_seed(2)
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, before, rtol=1e-12, atol=1e-14)


def test_a_fixed_mpnet_with_its_bias_table_trained_is_exact_with_nothing_on_the_fallback(no_fallback):
    model = ghostdp.validate.fix(_mpnet())
    assert model.mpnet.encoder.relative_attention_bias.weight.requires_grad
    ids, mask = _text()
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classified_as(torch.tensor([0, 2, 1])), B)


def test_an_unfixed_mpnet_is_warned_of_at_attaching_and_refused_naming_the_fix():
    ids, mask = _text()
    assert_warned_and_refused(
        _mpnet().train(), lambda model: model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1),
        r"'mpnet.encoder' \(MPNetEncoder looks its relative attention bias up once.*validate\.fix",
        r"relative_attention_bias.*ghostdp\.validate\.fix\(model\) looks up")


def test_an_encoder_with_code_of_its_own_is_left_with_a_warning():
    class OwnBias(modeling_mpnet.MPNetEncoder):
        def compute_position_bias(self, x, position_ids=None, num_buckets=32):
            return super().compute_position_bias(x, position_ids, num_buckets)

    model = _mpnet()
    assert_twin_keeps_other_code(model, model.mpnet, "encoder", OwnBias, mpnet, "mpnet.encoder")
