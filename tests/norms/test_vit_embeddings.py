"""ViT's, DeiT's, DINOv2's and DINOv2 with registers' embeddings (leading tokens, position embeddings) by their rule, and the calls it
declines by the fallback: each exact against the per-example loop in both modes, with the path each took counted."""

import pytest
import torch
import transformers

from ghostdp.norms import registry
from ghostdp.norms.vit_embeddings import (CLIP_VISION_EMBEDDINGS_BODY, DEIT_EMBEDDINGS_BODY, DINOV2_EMBEDDINGS_BODY,
                                          DINOV2_REGISTERS_EMBEDDINGS_BODY, OWLVIT_VISION_EMBEDDINGS_BODY,
                                          VIT_EMBEDDINGS_BODY, plain_call, stored_positions_call)
from ghostdp.validate import fallback_modules
from conftest import assert_exact, count_forward_rule_calls

B = 3
# family: (config, model, the body its embeddings' forward has, what the model takes beside the config)
FAMILIES = {"vit": (transformers.ViTConfig, transformers.ViTModel, VIT_EMBEDDINGS_BODY,
                    {"add_pooling_layer": False, "use_mask_token": True}),
            "deit": (transformers.DeiTConfig, transformers.DeiTModel, DEIT_EMBEDDINGS_BODY,
                     {"add_pooling_layer": False, "use_mask_token": True}),
            "dinov2": (transformers.Dinov2Config, transformers.Dinov2Model, DINOV2_EMBEDDINGS_BODY, {}),
            "dinov2-registers": (transformers.Dinov2WithRegistersConfig, transformers.Dinov2WithRegistersModel,
                                 DINOV2_REGISTERS_EMBEDDINGS_BODY, {})}


def _model(family, hidden_dropout_prob=0.0):
    config, model_class, _, extra = FAMILIES[family]
    cfg = config(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=20, mlp_ratio=1, hidden_dropout_prob=hidden_dropout_prob,
                 attention_probs_dropout_prob=0.0, num_register_tokens=2)
    model = model_class(cfg, **extra)
    with torch.no_grad():  # zeros at init in DINOv2's
        for name, p in model.embeddings.named_parameters(recurse=False):
            p.normal_()
    return model


@pytest.fixture
def rule_calls(monkeypatch):
    """{family: the number of calls its embeddings rule has formed since a controller attached}."""
    return count_forward_rule_calls(monkeypatch, {family: body for family, (_, _, body, _) in FAMILIES.items()})


def _assert_exact(model, x, **kwargs):
    with torch.no_grad():
        w = torch.randn(model(x[:1], **{k: v[:1] if isinstance(v, torch.Tensor) else v
                                        for k, v in kwargs.items()}).last_hidden_state.shape[1:])

    def losses(sl):
        extra = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return (model(x[sl], **extra).last_hidden_state * w).flatten(1).sum(1).pow(2)

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_leading_tokens_and_position_embeddings_take_their_rule_and_are_exact(rule_calls, family):
    model = _model(family)
    assert registry.find_norm_rule(model.embeddings) is not None
    _assert_exact(model, torch.randn(B, 3, 8, 8))
    assert rule_calls.get(family)  # every step's embeddings call (the mask token's gradient: zeros, it is unused)


def test_vit_msn_has_vits_embeddings():
    embeddings = transformers.ViTMSNModel(transformers.ViTMSNConfig()).embeddings
    assert registry.lookup_rule(embeddings) is registry._FORWARD_RULES[VIT_EMBEDDINGS_BODY]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("branch", ["mask tokens", "interpolated positions", "non-square"])
def test_a_call_the_rule_does_not_know_takes_the_fallback_and_is_exact(rule_calls, family, branch):
    model = _model(family)
    interpolate = {} if family.startswith("dinov2") else {"interpolate_pos_encoding": True}  # DINOv2: when needed
    if branch == "mask tokens":
        mask = torch.tensor([[True, False, False, True], [False, False, True, False], [True, True, False, False]])
        _assert_exact(model, torch.randn(B, 3, 8, 8), bool_masked_pos=mask)
    elif branch == "interpolated positions":
        _assert_exact(model, torch.randn(B, 3, 12, 12), **interpolate)
    else:  # as many patches (4) as positions, not square: DINOv2 interpolates all the same
        _assert_exact(model, torch.randn(B, 3, 4, 16), **interpolate)
    assert not rule_calls


def test_an_active_dropout_is_declined():
    model = _model("vit", hidden_dropout_prob=0.1).train()
    x = torch.randn(B, 3, 8, 8)
    assert not plain_call(model.embeddings, (x,), {"bool_masked_pos": None, "interpolate_pos_encoding": None})
    model.eval()
    assert plain_call(model.embeddings, (x,), {"bool_masked_pos": None, "interpolate_pos_encoding": None})
    model.embeddings.dropout.p = 0.0
    model.train()
    assert plain_call(model.embeddings, (x, None, False), {})
    assert not plain_call(model.embeddings, (x, None, True), {})


def test_dinov2_takes_the_stored_positions_only_where_its_interpolation_returns_them():
    embeddings = _model("dinov2").embeddings
    assert stored_positions_call(embeddings, (torch.randn(B, 3, 8, 8),), {"bool_masked_pos": None})
    assert stored_positions_call(embeddings, (), {"pixel_values": torch.randn(B, 3, 9, 9)})  # 2 x 2 patches still
    for shape in ((B, 3, 12, 12), (B, 3, 4, 16), (B, 3, 16, 4)):
        assert not stored_positions_call(embeddings, (torch.randn(shape),), {})
    assert not stored_positions_call(embeddings, (torch.randn(B, 3, 8, 8), torch.zeros(B, 4, dtype=torch.bool)), {})


@pytest.mark.parametrize("family", ["clip", "owlvit"])
def test_clips_class_embedding_takes_its_rule_and_is_exact(monkeypatch, family):
    """CLIP's vision embeddings own only the class embedding, row 0 of their output; the positions are a child
    Embedding's. Nothing of the tower is left to the fallback."""
    config, model_class, body = {
        "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel, CLIP_VISION_EMBEDDINGS_BODY),
        "owlvit": (transformers.OwlViTVisionConfig, transformers.OwlViTVisionModel, OWLVIT_VISION_EMBEDDINGS_BODY),
    }[family]
    calls = count_forward_rule_calls(monkeypatch, {family: body})
    model = model_class(config(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                               image_size=8, patch_size=4))
    embeddings = next(m for m in model.modules() if type(m).__name__.endswith("VisionEmbeddings"))
    assert registry.lookup_rule(embeddings) is registry._FORWARD_RULES[body]
    assert not fallback_modules(model)
    _assert_exact(model, torch.randn(B, 3, 8, 8))
    assert calls.get(family)
