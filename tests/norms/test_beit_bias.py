"""BEiT's relative position bias trained with each example's gradient (norms/beit_bias.py): transformers' BEiT has the
code the rule was written for; the rule's factor equals each example's autograd gradient of the table; BEiT with a
bias per layer and Data2Vec-vision with one shared by the encoder are exact against the per-example loop in both
modes with nothing on the fallback; a call that interpolates keeps the fallback, exact; under checkpointing, BEiT is
exact non-reentrant and refused reentrant, naming the fix."""
import pytest
import torch
import transformers
from transformers.models.beit import modeling_beit

import ghostdp
from ghostdp.norms import registry
from ghostdp.norms.beit_bias import BEIT_BIAS_BODY, beit_bias_rule
from conftest import assert_exact, assert_exact_model, classified_as

B = 3


def _model(family="beit", shared=False, image_size=8):
    """Two layers, 2 x 2 patches and the class token (N = 5); the tables and the layer scales drawn away from their
    initial values."""
    torch.manual_seed(0)
    config = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
                  image_size=image_size, patch_size=4, num_labels=3, layer_scale_init_value=0.1,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                  use_relative_position_bias=not shared, use_shared_relative_position_bias=shared)
    if family == "beit":
        model = transformers.BeitForImageClassification(transformers.BeitConfig(**config))
    else:
        model = transformers.Data2VecVisionForImageClassification(transformers.Data2VecVisionConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("relative_position_bias_table", "lambda_1", "lambda_2")):
                p.normal_(0.0, 0.5)
    return model


def _images(size=8):
    torch.manual_seed(1)
    return torch.randn(B, 3, size, size)


LABELS = torch.tensor([0, 2, 1])


def test_transformers_beit_has_the_code_the_rule_knows():
    assert registry.forward_body(modeling_beit.BeitRelativePositionBias.forward) == BEIT_BIAS_BODY
    bias = _model().beit.layers[0].relative_position_bias
    assert registry.find_norm_rule(bias) is beit_bias_rule


def test_the_factor_is_each_examples_gradient_of_the_table():
    bias = _model().beit.layers[0].relative_position_bias
    table = bias.relative_position_bias_table
    out = bias(bias.window_size, False, dim_size=5)  # (1, heads, N, N)
    G = torch.randn(B, *out.shape[1:])
    factor = beit_bias_rule(bias, (), G, {"relative_position_bias_table"})["relative_position_bias_table"]
    reference = torch.stack([torch.autograd.grad(bias(bias.window_size, False, dim_size=5), table, G[i:i + 1])[0]
                             for i in range(B)])
    torch.testing.assert_close(factor.materialize(0, B), reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(factor.sq_norm(), reference.flatten(1).pow(2).sum(1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("family, shared", [("beit", False), ("data2vec-vision", True)],
                         ids=["beit, a bias per layer", "data2vec-vision, one shared"])
def test_a_model_with_its_relative_position_bias_trained_is_exact_with_nothing_on_the_fallback(
        family, shared, no_fallback):
    model = _model(family, shared)
    assert_exact_model(model, dict(pixel_values=_images()), classified_as(LABELS), B)


def test_a_call_that_interpolates_the_bias_keeps_the_exact_fallback(monkeypatch):
    """16 x 16 images into a model made for 8 x 8, with interpolate_pos_encoding: the table is resampled to the
    larger window, which the rule declines."""
    from ghostdp.clipping import pass_one
    fallback, calls = pass_one.fallback_grads, []
    monkeypatch.setattr(pass_one, "fallback_grads", lambda *a, **k: calls.append(1) or fallback(*a, **k))
    model = _model()
    images = _images(16)
    ce = torch.nn.CrossEntropyLoss(reduction="none")

    def losses(sl):
        return ce(model(pixel_values=images[sl], interpolate_pos_encoding=True).logits, LABELS[sl])

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)
    assert calls


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_under_checkpointing_beit_is_exact_non_reentrant_and_refused_reentrant_naming_the_fix(reentrant):
    """Reentrant: the layer scales, elementwise uses, are captured only in an ordinary forward (refused with a
    generic stray message before 2026-12-02; the bias itself was refused there as a module without a rule)."""
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if not reentrant:
        assert_exact_model(model, dict(pixel_values=_images()), classified_as(LABELS), B)
        return
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="inside a reentrant activation checkpoint.*use_reentrant': False"):
            loss = torch.nn.functional.cross_entropy(model(pixel_values=_images()).logits, LABELS, reduction="none")
            controller.loss(loss).backward()
    finally:
        controller.detach()
