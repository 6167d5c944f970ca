"""ViT's and DeiT's embeddings (leading tokens, position embeddings) by their rule, and the calls it declines by the
fallback: each exact against the per-example loop in both modes, with the path each took counted."""
import dataclasses

import pytest
import torch
import transformers

from ghostdp.norms import registry
from ghostdp.norms.vit_embeddings import DEIT_EMBEDDINGS_BODY, VIT_EMBEDDINGS_BODY, plain_call
from conftest import assert_exact

B = 3
# family: (config, model, the body its embeddings' forward has, its tokens before the patches)
FAMILIES = {"vit": (transformers.ViTConfig, transformers.ViTModel, VIT_EMBEDDINGS_BODY, 1),
            "deit": (transformers.DeiTConfig, transformers.DeiTModel, DEIT_EMBEDDINGS_BODY, 2)}


def _model(family, hidden_dropout_prob=0.0):
    config, model_class, _, _ = FAMILIES[family]
    cfg = config(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, intermediate_size=20, hidden_dropout_prob=hidden_dropout_prob,
                 attention_probs_dropout_prob=0.0)
    model = model_class(cfg, add_pooling_layer=False, use_mask_token=True)
    with torch.no_grad():
        model.embeddings.mask_token.normal_()
    return model


@pytest.fixture
def rule_calls(monkeypatch):
    """{family: the number of calls its embeddings rule has formed since a controller attached}."""
    calls = {}
    for family, (_, _, body, _) in FAMILIES.items():
        entry = registry._FORWARD_RULES[body]

        def counted(*args, family=family, rule=entry.rule):
            calls[family] = calls.get(family, 0) + 1
            return rule(*args)

        monkeypatch.setitem(registry._FORWARD_RULES, body, dataclasses.replace(entry, rule=counted))
    monkeypatch.setattr(registry, "_BY_CLASS", {})
    return calls


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
@pytest.mark.parametrize("branch", ["mask tokens", "interpolated positions"])
def test_a_call_the_rule_does_not_know_takes_the_fallback_and_is_exact(rule_calls, family, branch):
    model = _model(family)
    if branch == "mask tokens":
        mask = torch.tensor([[True, False, False, True], [False, False, True, False], [True, True, False, False]])
        _assert_exact(model, torch.randn(B, 3, 8, 8), bool_masked_pos=mask)
    else:
        _assert_exact(model, torch.randn(B, 3, 12, 12), interpolate_pos_encoding=True)
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
