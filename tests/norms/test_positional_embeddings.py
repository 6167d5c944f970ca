"""transformers' learned positional embeddings (BART's arange of positions, OPT's cumulative sum of the attention mask)
and scaled word embeddings by their code: the rule reads the ids the forward looks up, formed as the forward forms
them (RuleEntry.rule_inputs). Each exact against the per-example loop in both modes, with the rule's calls counted."""
import ast
import importlib
import pathlib

import pytest
import torch
import transformers
from torch import nn

import ghostdp
from ghostdp.norms import registry
from ghostdp.norms.embedding import (ARANGE_POSITIONS_BODY, CAST_SCALED_EMBEDDING_BODY,
                                     GIVEN_OR_UNBATCHED_POSITIONS_BODY, MASK_POSITIONS_BODY, SCALED_EMBEDDING_BODY,
                                     UNBATCHED_POSITIONS_BODY, arange_positions, cast_scaled_embedding_rule,
                                     embedding_rule, mask_positions, scaled_embedding_rule, shape_positions)
from ghostdp.norms.normalization import GEMMA4_RMS_NORM_BODY, transformers_rms_norm_rule
from ghostdp.validate import fallback_modules
from conftest import assert_exact, count_forward_rule_calls

B, T, V = 3, 6, 40
BODIES = {"arange": ARANGE_POSITIONS_BODY, "mask": MASK_POSITIONS_BODY}
_BART = transformers.models.bart.modeling_bart.BartLearnedPositionalEmbedding
_OPT = transformers.models.opt.modeling_opt.OPTLearnedPositionalEmbedding


@pytest.fixture
def rule_calls(monkeypatch):
    """{"arange" / "mask": the number of calls the positions' rule has formed since a controller attached}."""
    return count_forward_rule_calls(monkeypatch, BODIES)


def _lm_losses(model, ids, mask=None):
    ce = nn.CrossEntropyLoss()

    def losses(sl):
        extra = {} if mask is None else {"attention_mask": mask[sl]}
        if model.config.is_encoder_decoder:
            extra["decoder_input_ids"] = ids[sl].flip(1)
        out = model(input_ids=ids[sl], **extra)
        return ghostdp.per_example_loss(ce, out.logits[:, :-1], ids[sl][:, 1:])
    return losses


def _assert_lm_exact(model, ids, mask=None, rtol=1e-9):
    losses = _lm_losses(model, ids, mask)
    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), B, rtol)


def test_bart_positions_take_their_rule_and_are_exact(rule_calls):
    cfg = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                  decoder_ffn_dim=24, max_position_embeddings=16, scale_embedding=True, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0)
    model = transformers.BartForConditionalGeneration(cfg)
    for embed in (model.model.encoder.embed_positions, model.model.decoder.embed_positions):
        assert registry.lookup_rule(embed) is registry._FORWARD_RULES[ARANGE_POSITIONS_BODY]
    _assert_lm_exact(model, torch.randint(3, V, (B, T)))
    assert rule_calls.get("arange")  # the encoder's and the decoder's, every step
    assert not rule_calls.get("mask")


def test_opt_positions_follow_each_examples_padding_by_their_rule_and_are_exact(rule_calls):
    """Left padding: each example's positions start where its tokens do (a cumulative sum of its mask), so a
    rule that read one arange for the batch would be wrong for the padded examples."""
    cfg = transformers.OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, ffn_dim=24, num_attention_heads=2,
                                 max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0,
                                 attention_dropout=0.0)
    model = transformers.OPTForCausalLM(cfg)
    assert registry.lookup_rule(model.model.decoder.embed_positions) is registry._FORWARD_RULES[MASK_POSITIONS_BODY]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, :1] = 0
    _assert_lm_exact(model, torch.randint(3, V, (B, T)), mask)
    assert rule_calls.get("mask") and not rule_calls.get("arange")


def _seq2seq(name, **config):
    torch.manual_seed(0)
    cfg = getattr(transformers, name + "Config")(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, dropout=0.0, attention_dropout=0.0,
        pad_token_id=1, **config)
    return getattr(transformers, name + "ForConditionalGeneration")(cfg)


@pytest.mark.parametrize("name,body", [("Blenderbot", GIVEN_OR_UNBATCHED_POSITIONS_BODY),
                                       ("BlenderbotSmall", GIVEN_OR_UNBATCHED_POSITIONS_BODY),
                                       ("BigBirdPegasus", GIVEN_OR_UNBATCHED_POSITIONS_BODY),
                                       ("LED", UNBATCHED_POSITIONS_BODY)])
@pytest.mark.parametrize("length", [T, B], ids=["T=6", "T=B"])
def test_positions_looked_up_without_a_batch_dim_are_exact(name, body, length):
    """LED's, Blenderbot's and BigBird-Pegasus' learned positions: (T, d) with no batch dim, added by the encoder and
    the decoder to the (B, T, d) embeddings (RuleEntry.unbatched_output). Before 2026-11-28 the layout proof refused
    them trained (no dim of their output held the examples; with T == B, one that mixed them); BigBird-Pegasus' until
    2026-12-08 (a scratch sweep of transformers' sequence classifiers found it refused)."""
    config = {"attention_window": 4, "max_encoder_position_embeddings": 16, "max_decoder_position_embeddings": 16} \
        if name == "LED" else {"max_position_embeddings": 16}
    if name == "BigBirdPegasus":  # full attention: the block-sparse one needs sequences of many blocks
        config["attention_type"] = "original_full"
    model = _seq2seq(name, **config)
    stacks = model.led if name == "LED" else model.model
    for embed in (stacks.encoder.embed_positions, stacks.decoder.embed_positions):
        assert registry.lookup_rule(embed) is registry._FORWARD_RULES[body]
    assert not fallback_modules(model)
    _assert_lm_exact(model, torch.randint(3, V, (B, length)))


@pytest.mark.parametrize("arguments", [((torch.Size([3, 5]),), {}), ((torch.Size([3, 5]), 2), {}),
                                       ((torch.Size([1, 3]),), {"position_ids": torch.tensor([[2, 0, 1]])})])
def test_shape_positions_are_the_ids_blenderbots_forward_looks_up(arguments):
    embed = transformers.models.blenderbot.modeling_blenderbot.BlenderbotLearnedPositionalEmbedding(16, 4)
    args, kwargs = arguments
    ids, = shape_positions(embed, args, kwargs)
    assert ids.dim() == 2 and ids.shape[0] == 1
    torch.testing.assert_close(embed(*args, **kwargs), nn.functional.embedding(ids, embed.weight).reshape(
        embed(*args, **kwargs).shape), rtol=0, atol=0)


def test_a_sinusoidal_table_with_blenderbots_forward_keeps_the_fallback():
    """Pegasus' sinusoidal positions have Blenderbot's forward but are not among the classes whose callers add the
    output to the embeddings (RoFormer's, of the same body, reads it as 2-D): declined, the exact fallback."""
    embed = transformers.models.pegasus.modeling_pegasus.PegasusSinusoidalPositionalEmbedding(16, 4)
    entry = registry.lookup_rule(embed)
    assert entry is registry._FORWARD_RULES[GIVEN_OR_UNBATCHED_POSITIONS_BODY]
    assert not entry.accepts(embed, (torch.Size([2, 3]),), {})


class PositionsAndHead(nn.Module):
    """A learned positional embedding called as ``call`` says, added to the features, then a Linear."""

    def __init__(self, positions, call):
        super().__init__()
        self.positions, self.call, self.head = positions, call, nn.Linear(8, 2)

    def forward(self, ids, x):
        return self.head(torch.tanh(x + self.call(self.positions, ids)))


@pytest.mark.parametrize("call", ["cache_length", "position_ids", "keyword"])
def test_bart_positions_by_each_branch_of_the_forward_are_exact(rule_calls, call):
    """From a cache length (arange from 2), from position ids (one row for the batch: shared by it, broadcast), and
    with every argument a keyword."""
    positions = {"cache_length": lambda m, ids: m(ids, 2),
                 "position_ids": lambda m, ids: m(ids, position_ids=torch.tensor([4, 1, 0, 3, 2, 5])),
                 "keyword": lambda m, ids: m(input_ids=ids, cache_length=1, position_ids=None)}[call]
    model = PositionsAndHead(_BART(12, 8), positions)
    ids, x = torch.randint(0, V, (B, T)), torch.randn(B, T, 8)
    assert_exact(model, lambda: model(ids, x).pow(2).sum((1, 2)),
                 lambda i: model(ids[i:i + 1], x[i:i + 1]).pow(2).sum(), B)
    assert rule_calls.get("arange")


@pytest.mark.parametrize("arguments", [
    ((torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]),), {}),
    ((torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]), 3), {}),
    ((torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]),), {"position_ids": torch.tensor([3, 0, 1, 2])}),
    ((), {"input_ids": torch.tensor([[5, 6, 7]]), "cache_length": 1}),
])
def test_arange_positions_are_the_ids_barts_forward_looks_up(arguments):
    embed = _BART(16, 4)
    args, kwargs = arguments
    ids, = arange_positions(embed, args, kwargs)
    torch.testing.assert_close(embed(*args, **kwargs), nn.functional.embedding(ids, embed.weight), rtol=0, atol=0)


@pytest.mark.parametrize("arguments", [
    ((torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),), {}),
    ((torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), 2), {}),
    ((torch.tensor([[1, 1, 1]]),), {"position_ids": torch.tensor([[2, 0, 1]])}),
])
def test_mask_positions_are_the_ids_opts_forward_looks_up(arguments):
    embed = _OPT(16, 4)
    args, kwargs = arguments
    ids, = mask_positions(embed, args, kwargs)
    torch.testing.assert_close(embed(*args, **kwargs), nn.functional.embedding(ids, embed.weight), rtol=0, atol=0)


def test_every_transformers_class_with_these_forwards_takes_their_rule():
    """Imported and looked up: the positional embeddings of the two bodies, and a sample of the scaled ones."""
    bodies = {ARANGE_POSITIONS_BODY: embedding_rule, MASK_POSITIONS_BODY: embedding_rule,
              SCALED_EMBEDDING_BODY: scaled_embedding_rule, CAST_SCALED_EMBEDDING_BODY: cast_scaled_embedding_rule}
    root = pathlib.Path(transformers.__file__).parent / "models"
    found = {body: [] for body in bodies}
    for path in root.glob("*/modeling_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "nn.Embedding" for b in node.bases):
                forward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
                if forward is not None and registry.body_text(forward) in found:
                    found[registry.body_text(forward)].append((f"transformers.models.{path.parent.name}.{path.stem}",
                                                              node.name))
    assert len(found[ARANGE_POSITIONS_BODY]) >= 5 and len(found[MASK_POSITIONS_BODY]) >= 2
    assert len(found[SCALED_EMBEDDING_BODY]) >= 8 and len(found[CAST_SCALED_EMBEDDING_BODY]) >= 6
    for body, classes in found.items():
        sample = classes if body in (ARANGE_POSITIONS_BODY, MASK_POSITIONS_BODY) else classes[::3]
        for module_name, name in sample:
            cls = getattr(importlib.import_module(module_name), name)
            assert registry.find_norm_rule(cls.__new__(cls)) is bodies[body], name


def test_gemma4_embeddings_and_rms_norms_take_their_rules_and_are_exact():
    cfg = transformers.Gemma4TextConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        max_position_embeddings=16)
    model = transformers.Gemma4ForCausalLM(cfg)
    assert registry.find_norm_rule(model.model.embed_tokens) is cast_scaled_embedding_rule
    norms = [m for m in model.modules() if type(m).__name__ == "Gemma4RMSNorm" and m.with_scale]
    assert len(norms) >= 5
    assert all(registry.lookup_rule(m) is registry._FORWARD_RULES[GEMMA4_RMS_NORM_BODY] for m in norms)
    assert all(registry.find_norm_rule(m) is transformers_rms_norm_rule for m in norms)
    assert not fallback_modules(model)
    # Gemma computes in float32 inside a float64 model: ghost's clipped sum (pass 2, the model's own backward) is
    # exact to float32 rounding only (test_subclass_rules' Gemma note).
    _assert_lm_exact(model, torch.randint(3, V, (B, T)), rtol=1e-6)
