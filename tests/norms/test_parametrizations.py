"""Parametrized weights (torch.nn.utils.parametrize): weight_norm, spectral_norm, orthogonal, one's own.

The parametrized module computes its weight from the parametrization's parameters inside its forward, so
its call's graph holds their whole gradient: the module owns them. A weight_norm under a layer whose rule covers the
weight takes that rule, its per-example weight gradients chained to g and v (norms/parametrized.py, since
2026-12-02); any other parametrization takes the exact fallback (norms/fallback.py). Before, the parametrization's
ParametrizationList was hooked as a module of its own, whose output (the weight) has no batch dim, and every such
model was refused (wav2vec2 and HuBERT, whose positional convolution is weight-normalised, among them).
"""
import warnings

import pytest
import torch
import transformers
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import ghostdp
from conftest import assert_exact, assert_exact_model, reference_per_example_grads, trainable

B = 4


class Tripled(nn.Module):
    def forward(self, weight):
        return 3.0 * weight


class LearnedScale(nn.Module):
    """A parametrization with a trainable parameter of its own."""

    def __init__(self, rows):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, rows).unsqueeze(1))

    def forward(self, weight):
        return self.scale * torch.tanh(weight)


def _mlp(first):
    return nn.Sequential(first, nn.Tanh(), nn.Linear(first.out_features, 2))


def _cross_entropy(labels):
    return lambda out, sl: nn.functional.cross_entropy(out, labels[sl], reduction="none")


@pytest.mark.parametrize("parametrized", ["weight_norm", "weight_norm_dim_none", "orthogonal", "own", "own_learned"])
def test_a_parametrized_linear_is_exact(parametrized):
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    if parametrized == "weight_norm":
        parametrizations.weight_norm(lin)
    elif parametrized == "weight_norm_dim_none":
        parametrizations.weight_norm(lin, dim=None)
    elif parametrized == "orthogonal":
        parametrizations.orthogonal(lin)
    elif parametrized == "own":
        parametrize.register_parametrization(lin, "weight", Tripled())
    else:
        parametrize.register_parametrization(lin, "weight", LearnedScale(6))
    model = _mlp(lin).double()
    names = {n for n, _ in trainable(model)}
    assert "0.parametrizations.weight.original" in names or "0.parametrizations.weight.original0" in names
    x, y = 3 * torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 2, (B,))
    assert_exact_model(model, x, _cross_entropy(y), B)


def test_a_weight_normalised_conv_and_a_parametrized_embedding_are_exact():
    torch.manual_seed(0)
    conv = parametrizations.weight_norm(nn.Conv1d(3, 4, 3, padding=1))
    emb = nn.Embedding(7, 3)
    parametrize.register_parametrization(emb, "weight", Tripled())

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.conv, self.head = emb, conv, nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(torch.tanh(self.conv(self.emb(ids).transpose(1, 2))).mean(2))

    model = Model().double()
    ids, y = torch.randint(0, 7, (B, 5)), torch.randint(0, 2, (B,))
    assert_exact_model(model, ids, _cross_entropy(y), B)


def test_spectral_norm_is_exact_and_its_power_iteration_buffers_are_not_warned_of():
    """spectral_norm updates its vectors u, v in every training forward; they follow the weight, not the data
    (a parametrization's forward sees only the parameters), so the buffer watch leaves them alone. The
    per-example loop runs one more power iteration per forward: the vectors are converged first."""
    torch.manual_seed(0)
    model = _mlp(parametrizations.spectral_norm(nn.Linear(6, 4))).double().train()
    x, y = 3 * torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 2, (B,))
    with torch.no_grad():
        for _ in range(500):
            model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a buffer warning would fail the test
        assert_exact_model(model, x, _cross_entropy(y), B)


def test_a_parametrized_module_called_twice_under_the_cache_is_exact():
    """parametrize.cached(): the weight is computed in the first call and reused by the second; the cross
    terms of the two calls go through the same parametrization."""
    torch.manual_seed(0)
    lin = parametrizations.weight_norm(nn.Linear(5, 5))
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 2, (B,))

    def losses(sl):
        with parametrize.cached():
            return _cross_entropy(y)(model(x[sl]), sl)

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B)


def test_a_parametrized_weight_read_outside_its_module_is_refused():
    """The weight computed by a parent's own read of ``lin.weight`` carries gradient into the parametrization's
    parameters that no call of ``lin`` recorded: the audit refuses it, naming the parameter."""

    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = parametrizations.weight_norm(nn.Linear(4, 4))

        def forward(self, x):
            return self.lin(x) + x @ self.lin.weight.T

    model = ReadsWeight()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match=r"'lin\.parametrizations\.weight\.original\d' outside the forward"):
        controller.loss(model(torch.randn(B, 4)).pow(2).sum(1)).backward()


def test_per_example_gradients_of_a_parametrization():
    torch.manual_seed(0)
    model = _mlp(parametrizations.weight_norm(nn.Linear(6, 4))).double()
    x = torch.randn(B, 6, dtype=torch.float64)
    reference = reference_per_example_grads(model, lambda i: model(x[i:i + 1]).pow(2).sum(), B)
    controller = ghostdp.GhostClipping(model, 1e6)
    with controller.grad_samples():
        controller.loss(model(x).pow(2).sum(1), reduction="sum").backward()
    for name, p in trainable(model):
        expected = torch.stack([grads[name] for grads in reference])
        torch.testing.assert_close(p.grad_sample, expected, rtol=1e-10, atol=1e-12)


def test_wav2vec2_with_its_weight_normalised_positional_convolution_is_exact():
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, final_dropout=0.0, num_labels=2, classifier_proj_size=8)
    model = transformers.Wav2Vec2ForSequenceClassification(config).double()
    assert any("pos_conv_embed.conv.parametrizations.weight.original0" in n for n, _ in trainable(model))
    audio, y = torch.randn(B, 200, dtype=torch.float64), torch.randint(0, 2, (B,))
    assert_exact_model(model, audio, lambda out, sl: nn.functional.cross_entropy(out.logits, y[sl], reduction="none"),
                       B)


@pytest.fixture
def fallback_calls(monkeypatch):
    """The number of calls that took the exact fallback since the test began (a one-element list)."""
    from ghostdp.clipping import pass_one
    fallback, count = pass_one.fallback_grads, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return fallback(*args, **kwargs)
    monkeypatch.setattr(pass_one, "fallback_grads", counted)
    return count


class GroupedPositions(nn.Module):
    """wav2vec2's positional convolution in small: grouped, weight-normalised over its kernel dim (dim=2)."""

    def __init__(self, dim=2):
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(8, 8, 5, padding=2, groups=2), name="weight", dim=dim)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 8)
        return self.head(nn.functional.gelu(self.conv(x.transpose(1, 2)).transpose(1, 2)) + x).mean(1)


@pytest.mark.parametrize("layer", ["linear dim 0", "linear dim None", "grouped conv dim 2", "grouped conv dim 0"])
def test_a_weight_norm_takes_its_layers_rule_and_is_exact(layer, fallback_calls):
    torch.manual_seed(0)
    if layer.startswith("linear"):
        lin = parametrizations.weight_norm(nn.Linear(6, 6), dim=0 if layer.endswith("0") else None)
        model, x = _mlp(lin).double(), 3 * torch.randn(B, 6, dtype=torch.float64)
        assert ghostdp.validate.fallback_modules(model) == {}
        assert_exact_model(model, x, _cross_entropy(torch.randint(0, 2, (B,))), B)
    else:
        model = GroupedPositions(dim=int(layer[-1])).double()
        assert ghostdp.validate.fallback_modules(model) == {}
        assert_exact_model(model, torch.randn(B, 11, 8, dtype=torch.float64), lambda out, sl: out.pow(2).sum(1), B)
    assert fallback_calls[0] == 0


@pytest.mark.parametrize("parametrized", ["spectral_norm", "orthogonal", "weight_norm twice"])
def test_other_parametrizations_keep_the_exact_fallback(parametrized, fallback_calls):
    """spectral_norm's power iteration moves its vectors at every forward: recomputing it would move them again."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    if parametrized == "spectral_norm":
        parametrizations.spectral_norm(lin)
    elif parametrized == "orthogonal":
        parametrizations.orthogonal(lin)
    else:
        parametrizations.weight_norm(lin)
        parametrize.register_parametrization(lin, "weight", Tripled())
    model = _mlp(lin).double()
    assert list(ghostdp.validate.fallback_modules(model)) == ["0"]
    if parametrized == "spectral_norm":
        return  # exact on the fallback: test_spectral_norm_is_exact_and_its_power_iteration_buffers_are_not_warned_of
    x = 3 * torch.randn(B, 6, dtype=torch.float64)
    assert_exact_model(model, x, _cross_entropy(torch.randint(0, 2, (B,))), B)
    assert fallback_calls[0] > 0
