"""A rule applies to a subclass only while the subclass keeps the ruled class's forward."""
import ast
import importlib
import pathlib

import pytest
import torch
import transformers
from torch import nn

import ghostdp
from ghostdp.norms.embedding import cast_scaled_embedding_rule, embedding_rule, scaled_embedding_rule
from ghostdp.norms.linear import MATMUL_LINEARS, linear_rule
from ghostdp.norms.normalization import channels_first_layer_norm_rule
from ghostdp.norms.registry import _FORWARD_RULES, _RULES, find_norm_rule, forward_body, lookup_rule
from conftest import assert_exact

B = 3


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_subclass_overriding_forward_goes_to_the_fallback_and_is_exact():
    model = nn.Sequential(DoubledLinear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert find_norm_rule(model[0]) is None and find_norm_rule(model[2]) is not None
    x = torch.randn(B, 3)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), B)


def test_a_forward_replaced_on_the_instance_goes_to_the_fallback_and_is_exact():
    """A Linear whose forward was replaced on the instance (here: it squares its input) is not the Linear
    the rule knows. Before, its rule read the call's input as A: the norms were off (ghost clipped the true
    gradient with the wrong coefficients, book-keeping wrote the wrong gradient, each silently)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].forward = lambda h: nn.functional.linear(h * h, model[2].weight, model[2].bias)
    assert find_norm_rule(model[2]) is None and find_norm_rule(model[0]) is not None
    x = torch.randn(B, 3)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), B)


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_forward_replaced_on_the_instance_after_attaching_goes_to_the_fallback(clipping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(B, 3, dtype=torch.float64)
    controller = ghostdp.GhostClipping(model, 1e9, clipping=clipping)  # nothing clipped: p.grad = sum of g_i
    model[2].forward = lambda h: nn.functional.linear(h * h, model[2].weight, model[2].bias)
    controller.loss(model(x).pow(2).sum(1), "sum").backward()
    got = [p.grad.clone() for p in model.parameters()]
    norms = controller.last_norms
    controller.detach()
    expected_norms = []
    for i in range(B):
        grads = torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), list(model.parameters()))
        expected_norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    torch.testing.assert_close(norms, torch.stack(expected_norms), rtol=1e-10, atol=0)
    model.zero_grad()
    model(x).pow(2).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)


def _tiny_text_inputs(vocab, T=6):
    ids = torch.randint(3, vocab, (B, T))
    return ids


def _lm_exact(model, ids, rtol=1e-9):
    model.train()
    ce = nn.CrossEntropyLoss()

    def losses(sl):
        out = model(input_ids=ids[sl], decoder_input_ids=ids[sl]) if model.config.is_encoder_decoder \
            else model(input_ids=ids[sl])
        return ghostdp.per_example_loss(ce, out.logits[:, :-1], ids[sl][:, 1:])

    return assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B, rtol)


def _grouped_norm(self, x):  # normalises groups of 3 features: not the _norm Gemma's rule was matched with
    x = x.reshape(*x.shape[:-1], -1, 3)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_method_the_forward_calls_replaced_on_the_instance_after_attaching_goes_to_the_fallback(clipping):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    torch.manual_seed(0)
    gemma = GemmaRMSNorm(6)
    with torch.no_grad():
        gemma.weight.uniform_(-1, 1)
    x, w = torch.randn(4, 3, 6), torch.randn(3, 6)
    controller = ghostdp.GhostClipping(gemma, 1e9, clipping=clipping)
    gemma._norm = _grouped_norm.__get__(gemma)  # after attaching: the rule was chosen for the class's _norm
    controller.loss((gemma(x) * w).sum((1, 2)).pow(2), "sum").backward()
    norms = controller.last_norms
    controller.detach()
    expected = [torch.autograd.grad((gemma(x[i:i + 1]) * w).sum().pow(2), gemma.weight)[0].norm() for i in range(4)]
    # Gemma computes in float32 inside a float64 model (test_models' Llama note); the rule read 0.89-1.24x.
    torch.testing.assert_close(norms, torch.stack(expected), rtol=1e-6, atol=0)


def test_gemma_scaled_embedding_has_its_own_exact_rule():
    cfg = transformers.GemmaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=16)
    model = transformers.GemmaForCausalLM(cfg)
    assert lookup_rule(model.model.embed_tokens).rule is cast_scaled_embedding_rule
    # Gemma's RMSNorm computes in float32 inside a float64 model (see test_models' Llama note).
    _lm_exact(model, _tiny_text_inputs(40), rtol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_falcons_matmul_linear_takes_the_linear_rule_and_is_exact(bias):
    """FalconLinear computes input @ W^T (+ b) instead of F.linear: the same function, checked from its source above;
    without the rule every Falcon projection took the fallback."""
    cfg = transformers.FalconConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    hidden_dropout=0.0, attention_dropout=0.0, bias=bias)
    model = transformers.FalconForCausalLM(cfg)
    linears = [m for m in model.modules() if type(m).__name__ == "FalconLinear"]
    assert len(linears) == 4 and all(find_norm_rule(m) is linear_rule for m in linears)
    assert all((m.bias is not None) == bias for m in linears)
    _lm_exact(model, _tiny_text_inputs(40))


def test_bart_with_scaled_and_trainable_learned_position_embeddings_is_exact():
    cfg = transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                  decoder_ffn_dim=24, max_position_embeddings=16, scale_embedding=True,
                                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = transformers.BartForConditionalGeneration(cfg)
    # Both by their code (tests/norms/test_positional_embeddings.py): the fallback's before 2026-11-27.
    assert find_norm_rule(model.model.encoder.embed_positions) is embedding_rule
    assert find_norm_rule(model.model.encoder.embed_tokens) is scaled_embedding_rule
    _lm_exact(model, _tiny_text_inputs(40))


@pytest.mark.parametrize("v2", [False, True], ids=["convnext", "convnext-v2"])
def test_convnext_layer_norms_take_the_layer_norm_rule_by_their_code_and_are_exact(v2):
    config, model_class = ((transformers.ConvNextV2Config, transformers.ConvNextV2ForImageClassification) if v2 else
                           (transformers.ConvNextConfig, transformers.ConvNextForImageClassification))
    cfg = config(num_channels=3, hidden_sizes=[8, 8], depths=[1, 1], num_stages=2, patch_size=2, image_size=8,
                 num_labels=3)
    model = model_class(cfg)
    norms = [m for m in model.modules() if type(m).__name__ in ("ConvNextLayerNorm", "ConvNextV2LayerNorm")]
    assert {m.data_format for m in norms} == {"channels_first", "channels_last"}
    assert all(find_norm_rule(m) is channels_first_layer_norm_rule for m in norms)
    # Feature-map width 8 == channel count 8: a LayerNorm rule over the wrong dim would fit every shape (it was
    # silently wrong once, before the fallback took these).
    x = torch.randn(B, 3, 16, 16)
    labels = torch.tensor([0, 1, 2])
    ce = nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: ce(model(x).logits, labels),
                 lambda i: ce(model(x[i:i + 1]).logits, labels[i:i + 1]).sum(), B)


class DoubledLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return 2 * super().forward(x)


def _with_convnext_norm_body(base):
    """A class over ``base`` with ConvNext's LayerNorm forward, copied (as transformers copies it into other
    families); its super() reaches ``base``."""

    class Copied(base):
        def __init__(self, d, data_format):
            super().__init__(d)
            self.data_format = data_format

        def forward(self, features):
            if self.data_format == "channels_first":
                features = features.permute(0, 2, 3, 1)
                features = super().forward(features)
                features = features.permute(0, 3, 1, 2)
            else:
                features = super().forward(features)
            return features
    return Copied


ConvNextNormBody = _with_convnext_norm_body(nn.LayerNorm)
# The same body over a LayerNorm that doubles its output: super().forward is not nn.LayerNorm's.
ConvNextBodyOverDoubled = _with_convnext_norm_body(DoubledLayerNorm)


class DoubledBetween(ConvNextNormBody, DoubledLayerNorm):
    """The copied class itself, with the doubling LayerNorm after it in the MRO: its super() now reaches that."""


class KeepsTheCopiedForward(ConvNextNormBody):
    pass


@pytest.mark.parametrize("data_format", ["channels_first", "channels_last"])
def test_a_forward_matched_by_its_body_calls_super_of_the_registered_base_or_has_no_rule(data_format):
    from ghostdp.norms.registry import super_forward
    x = torch.randn(B, 6, 4, 5) if data_format == "channels_first" else torch.randn(B, 4, 5, 6)
    w = torch.randn(*x.shape[1:])
    for cls, ruled in ((ConvNextNormBody, True), (KeepsTheCopiedForward, True), (ConvNextBodyOverDoubled, False),
                       (DoubledBetween, False)):
        norm = cls(6, data_format)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-1, 1)
        assert (super_forward(cls) is nn.LayerNorm.forward) == ruled, cls
        assert (find_norm_rule(norm) is channels_first_layer_norm_rule) == ruled, cls
        assert_exact(norm, lambda: (norm(x) * w).flatten(1).sum(1).pow(2),
                     lambda i: (norm(x[i:i + 1]) * w).sum().pow(2), B)
    assert super_forward(nn.Linear) is None  # no super() in its forward


RULED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.Conv1d, nn.Conv2d, nn.Conv3d,
         nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
RULED_NAMES = {f"nn.{c.__name__}" for c in RULED}
# The forwards that compute what nn.Linear's does (linear.MATMUL_LINEARS).
MATMUL_BODIES = {"hidden_states = input @ self.weight.T ; if self.bias is None:\n    return hidden_states ; "
                 "return hidden_states + self.bias"}


def _overriding_subclasses():
    """(qualified name, forward source) of every transformers model class deriving from a ruled torch
    class and defining forward, read from the source (importing them all would take minutes)."""
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = {}
    for path in root.glob("*/modeling_*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) in RULED_NAMES for b in node.bases):
                forward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"),
                               None)
                if forward is not None:
                    body = [s for s in forward.body
                            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                    name = f"transformers.models.{path.parent.name}.{path.stem}.{node.name}"
                    found[name] = " ; ".join(ast.unparse(s) for s in body)
    return found


def test_every_transformers_subclass_that_overrides_forward_is_ruled_only_if_its_forward_was_checked():
    found = _overriding_subclasses()
    assert len(found) > 50  # the scan sees transformers' model classes
    registered = {k for k in _RULES if isinstance(k, str) and k.startswith("transformers.models.")}
    for name in registered & set(found):
        assert name.split(".", 2)[2] in MATMUL_LINEARS, name
        assert found[name] in MATMUL_BODIES, (name, found[name])
    for name in set(MATMUL_LINEARS):
        assert f"transformers.models.{name}" in found, f"{name} is registered but not in this transformers"
    # Everything else that overrides forward finds no rule, or the rule registered for its forward's code (ConvNext's
    # LayerNorm and its copies): check a sample by importing it.
    unregistered = sorted(set(found) - registered)
    for name in unregistered[:: max(1, len(unregistered) // 12)]:
        module_name, cls_name = name.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), cls_name)
        entry = lookup_rule(cls.__new__(cls))
        assert entry is None or entry is _FORWARD_RULES[forward_body(cls.forward)], name
