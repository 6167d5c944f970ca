"""The fallback on a flattened batch: a module without a rule called on the tokens of every example, (B * T, d).

Mixture-of-experts layers route the flattened tokens (transformers' Mixtral and Qwen2-MoE: a router and experts
stored as 3-D parameters, both run on (B * T, d)). Their outputs have no dim of size B, and the step was refused
("no dimension of size B") before 2026-12-02; since the same day their experts have a rule (norms/experts.py) and
their routers' weights are products' uses (norms/parameter_uses.py), so the fallback serves other such modules.
A call without a rule whose batch dim is 0 now also tries the layout
("rows",): the layout proof checks that each example's rows lie together on dim 0, its inputs of those rows are
checked for mixing as a batch-first input is, and the fallback masks its VJP's cotangent per example's rows.
"""
import pytest
import torch
import transformers
from torch import nn

import ghostdp
from conftest import CLIPPING_MODES, assert_exact, assert_exact_model
from test_models import B, classification_loss, padded_text


class Router(nn.Module):
    """A raw parameter (no rule) applied to flattened tokens: softmax gates, (N, experts), scaled by the weight's norm
    (a parameter read twice is no product's use: parameter_uses.py; a router reading it once is)."""

    def __init__(self, d, experts=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d))

    def forward(self, tokens):
        return torch.softmax(tokens @ self.weight.t() * self.weight.norm(), dim=-1)


class MixingRouter(Router):
    """The same on tokens centred by the mean over every row: each output row reads every example's tokens."""

    def forward(self, tokens):
        return super().forward(tokens - tokens.mean(0, keepdim=True))


class Gated(nn.Module):
    """(B, T, d) -> the router on the flattened tokens; ``sequence_first``: flattened from (T, B, d), so that each
    block of T rows holds several examples' tokens."""

    def __init__(self, router=Router, d=4, sequence_first=False):
        super().__init__()
        self.proj = nn.Linear(3, d)
        self.router = router(d)
        self.head = nn.Linear(d, 2)
        self.sequence_first = sequence_first

    def forward(self, x):
        h = self.proj(x)
        if self.sequence_first:
            h = h.transpose(0, 1)
        gates = self.router(h.reshape(-1, h.shape[-1]))
        mixed = (h.reshape(-1, h.shape[-1]) * gates[:, :1]).reshape(h.shape)
        if self.sequence_first:
            mixed = mixed.transpose(0, 1)
        return self.head(mixed.mean(1))


def _batch(n=B, T=5):
    torch.manual_seed(0)
    return torch.randn(n, T, 3, dtype=torch.float64)


def _loss(model, x):
    return model(x).pow(2).sum(1)


def test_a_module_without_a_rule_on_flattened_tokens_is_exact_in_both_modes():
    torch.manual_seed(1)
    model = Gated().double()
    x = _batch()
    assert_exact(model, lambda: _loss(model, x), lambda i: _loss(model, x[i:i + 1]).sum(), B)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_its_calls_are_proven_on_the_rows_layout(clipping):
    """The call took the fallback on ("rows",), not on a batch dim (a test that cannot pass by another path)."""
    model = Gated().double()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    proven = []
    original = controller.pass_one.layouts.resolve

    def resolve(call, batch_size):
        original(call, batch_size)
        proven.append((call.name, call.layouts))

    controller.pass_one.layouts.resolve = resolve
    try:
        controller.loss(_loss(model, _batch()), reduction="sum").backward()
    finally:
        controller.detach()
    assert ("router", (("rows",),)) in proven
    assert "router" in controller.pass_one.took_fallback


def test_a_module_on_flattened_tokens_that_mixes_examples_is_refused():
    """Its output rows keep the examples apart (each example's loss reaches only its own rows), its input's do not:
    the input proof refuses it, as it refuses a batch mean on a batch-first input."""
    model = Gated(MixingRouter).double()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=r"module 'router' \(MixingRouter\) has no norm rule and mixes examples"):
            controller.loss(_loss(model, _batch()), reduction="sum").backward()
    finally:
        controller.detach()


def test_tokens_flattened_sequence_first_are_refused():
    """Rows flattened from (T, B, d): each block of T rows holds tokens of several examples, which the proof finds."""
    model = Gated(sequence_first=True).double()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=r"module 'router' \(Router\) produced an output of shape \(20, 3\) "
                                               r"whose gradient mixes several examples"):
            controller.loss(_loss(model, _batch()), reduction="sum").backward()
    finally:
        controller.detach()


def _small(**extra):
    return dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=30,
                max_position_embeddings=32, num_key_value_heads=1, pad_token_id=0, num_labels=3, **extra)


def _eager(config):
    config._experts_implementation = "eager"  # transformers' grouped_mm has no float64 kernel on CPU
    return config


MIXTURES = {
    "mixtral": lambda: transformers.MixtralForSequenceClassification(_eager(transformers.MixtralConfig(
        **_small(num_local_experts=4, num_experts_per_tok=2)))),
    # a shared expert beside the routed ones, with a sigmoid gate (an nn.Linear on the flattened tokens)
    "qwen2-moe": lambda: transformers.Qwen2MoeForSequenceClassification(_eager(transformers.Qwen2MoeConfig(
        **_small(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                 shared_expert_intermediate_size=12)))),
}


@pytest.mark.parametrize("name", list(MIXTURES))
def test_mixture_of_experts_trained_whole_is_exact(name):
    model = MIXTURES[name]().double()
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classification_loss(labels), B)


def test_mixture_of_experts_by_grouped_matmuls_is_exact_in_float32():
    """transformers' default experts implementation on CPU (torch._grouped_mm, float32 and 16-bit only): the
    fallback's batched VJP runs through it."""
    torch.manual_seed(0)
    model = transformers.MixtralForSequenceClassification(transformers.MixtralConfig(
        **_small(num_local_experts=4, num_experts_per_tok=2))).float()  # (the tests' default dtype is float64)
    assert model.config._experts_implementation == "grouped_mm"
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classification_loss(labels), B, rtol=1e-4)
