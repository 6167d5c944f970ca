"""peft's trainable tokens (norms/peft_tokens.py): exact against the per-example loop by their rule, not the fallback;
the declined calls."""
import peft
import pytest
import torch
import transformers
from torch import nn

import ghostdp
from conftest import assert_exact_model, took_fallback
from ghostdp.norms.fallback import attached_rule
from ghostdp.norms.peft_tokens import _looks_up_tokens

B, V = 5, 30


def _bert(tokens, padding=0):
    config = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=padding)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.TrainableTokensConfig(
        target_modules=["word_embeddings"], token_indices=tokens))
    for p in model.parameters():  # the new rows start as the table's: move them
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    return model.double().train()


def _loss(labels):
    criterion = nn.CrossEntropyLoss(reduction="none")
    return lambda out, sl: criterion(out.logits, labels[sl])


@pytest.mark.parametrize("tokens", [[3, 7, 11], [0, 5]])  # token 0 is the padding index: no gradient there
def test_trainable_tokens_are_exact_in_both_modes_by_their_rule(tokens):
    torch.manual_seed(0)
    model = _bert(tokens)
    ids = torch.randint(1, V, (B, 8))
    ids[:, 0], ids[1, 3], ids[2, -2:] = tokens[-1], tokens[-1], 0  # a token twice in an example, padding
    ids[3, 2] = tokens[0]
    assert_exact_model(model, dict(input_ids=ids), _loss(torch.randint(0, 3, (B,))), B)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    try:
        controller.loss(model(input_ids=ids).logits.pow(2).sum(1), reduction="sum").backward()
        assert controller.pass_one.took_fallback == set()
    finally:
        controller.detach()


def test_a_scaled_table_scales_the_tokens_gradient_too():
    """Gemma's scaled word embeddings: peft multiplies the lookup by the base's embed_scale."""
    torch.manual_seed(1)

    class Scaled(nn.Embedding):
        def __init__(self):
            super().__init__(V, 4)
            self.register_buffer("embed_scale", torch.tensor(1.7))

        def forward(self, ids):
            return super().forward(ids) * self.embed_scale

    class Looked(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = Scaled(), nn.Linear(4, 3)

        def forward(self, ids):
            return self.head(self.embed(ids).mean(1))

    model = peft.get_peft_model(Looked(), peft.TrainableTokensConfig(target_modules=["embed"], token_indices=[2, 9]))
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    model.double()
    ids = torch.randint(0, V, (B, 6))
    ids[:, 0] = 9
    ids[0, 1] = 2
    assert_exact_model(model, ids, lambda out, sl: out.pow(2).sum(1), B)
    assert took_fallback(model, ids) == set()


def test_declined_calls():
    model = _bert([3, 7])
    module = model.base_model.model.bert.embeddings.word_embeddings
    ids = torch.randint(1, V, (B, 8))
    assert attached_rule(module) is not None
    assert _looks_up_tokens(module, (ids,), {})
    assert not _looks_up_tokens(module, (ids, ids), {})
    assert not _looks_up_tokens(module, (ids,), {"scale": 2})
    with model.disable_adapter():
        assert not _looks_up_tokens(module, (ids,), {})
    module.get_base_layer().max_norm = 1.0
    assert not _looks_up_tokens(module, (ids,), {})


def test_tokens_tied_to_gpt2s_output_layer_are_exact():
    """peft ties the LM head's adapter to the embedding's rows: the embedding's call by the rule, the head's (a
    Linear base, declined) by the fallback, one parameter's gradient from both."""
    torch.manual_seed(2)
    config = transformers.GPT2Config(vocab_size=25, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.TrainableTokensConfig(target_modules=["wte"], token_indices=[3, 5])).double()
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    ids = torch.randint(0, 25, (4, 6))
    ids[:, 0] = 3
    assert_exact_model(model, dict(input_ids=ids), lambda out, sl: out.logits.pow(2).mean((1, 2)), 4)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    try:
        controller.loss(model(input_ids=ids).logits.pow(2).mean((1, 2))).backward()
        assert controller.pass_one.took_fallback == {"base_model.model.lm_head"}
    finally:
        controller.detach()
