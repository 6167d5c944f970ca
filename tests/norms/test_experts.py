"""A mixture of experts' experts trained with each example's gradient (norms/experts.py): transformers' Mixtral has the
eager code the rule was written for, behind its experts dispatcher; the rule's factors equal each example's autograd
gradients; Mixtral, Qwen2-MoE and Qwen3-MoE trained whole are exact against the per-example loop in both modes with
nothing on the fallback (the routers' weights are products' uses: parameter_uses.py), in float64 through the eager
forward and in float32 through transformers' grouped matmuls; a row routed to no expert adds nothing; a call the rule
does not know keeps the fallback, exact."""
import types

import pytest
import torch
import transformers
from transformers.models.mixtral import modeling_mixtral

import ghostdp
from ghostdp.norms import registry
from ghostdp.norms.experts import APPLY_GATE_BODY, EAGER_BODY, experts_rule
from conftest import assert_exact, assert_exact_model, classified_as
from test_models import B, padded_text

SMALL = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=30,
             max_position_embeddings=32, num_key_value_heads=1, pad_token_id=0, num_labels=3)


def _mixture(name, implementation="eager"):
    """A two-layer mixture of experts (4 experts, 2 a token); ``implementation``: transformers' experts
    implementation (grouped_mm has no float64 kernel on CPU)."""
    torch.manual_seed(0)
    config = {
        "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SMALL),
        "qwen2-moe": lambda: transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                                         shared_expert_intermediate_size=12, **SMALL),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                                         head_dim=8, **SMALL),
    }[name]()
    config._experts_implementation = implementation
    model = {"mixtral": transformers.MixtralForSequenceClassification,
             "qwen2-moe": transformers.Qwen2MoeForSequenceClassification,
             "qwen3-moe": transformers.Qwen3MoeForSequenceClassification}[name](config)
    return model


def test_transformers_mixtral_experts_have_the_code_the_rule_was_written_for():
    forward = modeling_mixtral.MixtralExperts.forward
    assert registry.forward_body(forward) is None  # transformers' dispatcher wraps it
    assert registry.dispatched_body(forward) == EAGER_BODY
    assert registry.forward_body(modeling_mixtral.MixtralExperts._apply_gate) == APPLY_GATE_BODY
    assert registry.entry_by_code(modeling_mixtral.MixtralExperts).rule is experts_rule
    assert registry.dispatched_body(transformers.MixtralForCausalLM.forward) is None  # another wrapper


def test_the_rules_factors_are_each_examples_gradients():
    """experts_rule's factors, materialised, against autograd's gradient of each example's rows of the output."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SMALL)
    config._experts_implementation = "eager"
    experts = modeling_mixtral.MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    T, k = 5, 2
    x = torch.randn(B * T, 16)
    index = torch.stack([torch.randperm(4)[:k] for _ in range(B * T)])
    weights = torch.rand(B * T, k)
    G = torch.randn(B * T, 16)
    factors = experts_rule(experts, (x.view(B, T, 16), index.view(B, T, k), weights.view(B, T, k)), G.view(B, T, 16),
                           {"gate_up_proj", "down_proj"})
    for i in range(B):
        rows = slice(i * T, (i + 1) * T)
        grads = torch.autograd.grad(experts(x, index, weights)[rows], (experts.gate_up_proj, experts.down_proj),
                                    G[rows])
        for name, grad in zip(("gate_up_proj", "down_proj"), grads):
            assert torch.allclose(factors[name].materialize(i, i + 1)[0], grad, rtol=1e-10, atol=1e-12), name
    sq = sum(f.sq_norm() for f in factors.values())
    explicit = sum(f.materialize(0, B).flatten(1).pow(2).sum(1) for f in factors.values())
    assert torch.allclose(sq, explicit, rtol=1e-10)


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_mixtures_trained_whole_are_exact_with_no_fallback(name, no_fallback):
    model = _mixture(name)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classified_as(labels), B)


def test_grouped_matmul_experts_are_exact_in_float32_with_no_fallback(no_fallback):
    model = _mixture("mixtral", "grouped_mm").float()  # (the tests' default dtype is float64)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classified_as(labels), B, rtol=1e-4)


class RoutedByHand(torch.nn.Module):
    """Tokens routed by a fixed table in which some slots name no expert (index E, as expert parallelism marks tokens
    of another rank's experts): the eager forward skips them, and so does the rule."""

    def __init__(self):
        super().__init__()
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SMALL)
        config._experts_implementation = "eager"
        self.proj = torch.nn.Linear(3, 16)
        self.weights = torch.nn.Linear(16, 2)
        self.experts = modeling_mixtral.MixtralExperts(config)  # (its parameters made by torch.empty)
        with torch.no_grad():
            self.experts.gate_up_proj.normal_(0.0, 0.3)
            self.experts.down_proj.normal_(0.0, 0.3)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.proj(x).reshape(b * t, 16)
        index = torch.tensor([[0, 1], [2, 4], [4, 4], [3, 0], [1, 2]])[:t].repeat(b, 1)  # by position
        out = self.experts(h, index, torch.sigmoid(self.weights(h)))
        return self.head(out.reshape(b, t, 16).mean(1))


def test_rows_routed_to_no_expert_add_nothing(no_fallback):
    torch.manual_seed(2)
    model = RoutedByHand()
    x = torch.randn(B, 5, 3)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), B)


def test_a_call_the_rule_does_not_know_keeps_the_fallback_and_is_exact():
    """Another gate set on the instance (its _apply_gate replaced): the exact fallback on the rows."""
    model = _mixture("mixtral")
    experts = model.model.layers[0].mlp.experts

    def gelu_gate(self, gate_up_out):
        gate, up = gate_up_out.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up

    experts._apply_gate = types.MethodType(gelu_gate, experts)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss(classified_as(labels)(model(input_ids=ids, attention_mask=mask), slice(None))).backward()
        assert controller.pass_one.took_fallback == {"model.layers.0.mlp.experts"}
    finally:
        controller.detach()
    model.zero_grad(set_to_none=True)
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classified_as(labels), B)


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_mixture_whose_forward_centres_on_the_batchs_detached_mean_is_refused(clipping):
    """The forward check (clipping/independence.py) on a mixture of experts, whose router and experts run on the
    flattened tokens (their layouts: blocks of rows, layout.ROWS_LAYOUT): a user's pre-hook that centres the first
    layer's hidden states on the batch's detached mean is refused. Until 2026-12-02 those layouts switched the refusal
    off, and the step trained."""
    model = _mixture("mixtral")

    def centred(module, args, kwargs):
        if args:
            return (args[0] - args[0].detach().mean(0, keepdim=True),) + args[1:], kwargs
        states = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": states - states.detach().mean(0, keepdim=True)}

    model.model.layers[0].register_forward_pre_hook(centred, with_kwargs=True)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match="the model's forward mixes examples where no gradient flows"):
            controller.loss(classified_as(labels)(model(input_ids=ids, attention_mask=mask), slice(None))).backward()
        assert all(p.grad is None for p in model.parameters()), "a refused step wrote gradients"
    finally:
        controller.detach()
