"""Non-reentrant activation checkpointing: the norm pass unpacks the rules' inputs from the probes'
saved tensors, which recomputes them inside a checkpoint; exact against the per-example loop in float64
for a user's own checkpointed module, BERT, GPT-2 (tied) and Llama, in both clipping modes."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from ghostdp import per_example_loss
from conftest import assert_exact_model
from test_models import B, classification_loss, padded_text

CE = nn.CrossEntropyLoss()


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class CheckpointedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h.mean(1))


def test_a_users_checkpointed_blocks_are_exact():
    torch.manual_seed(0)
    model = CheckpointedNet().double()
    assert_exact_model(model, torch.randint(0, 20, (B, 6)), classification_loss(torch.randint(0, 3, (B,))), B)


def test_the_norm_pass_recomputes_the_checkpointed_region():
    torch.manual_seed(0)
    model = CheckpointedNet().double()
    forwards = []
    model.blocks[0].up.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    ids = torch.randint(0, 20, (B, 6))
    controller.loss(model(ids).pow(2).sum(1)).backward()  # the first step also proves the batch layout
    forwards.clear()
    controller.loss(model(ids).pow(2).sum(1)).backward()
    assert len(forwards) == 2  # the forward, then the recomputation in the norm pass (no second pass)


def checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def test_bert_with_checkpointing():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = checkpointing(BertForSequenceClassification(BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=3)).double())
    ids, mask = padded_text(30)
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classification_loss(torch.randint(0, 3, (B,))), B)


def test_gpt2_tied_with_checkpointing():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = checkpointing(GPT2LMHeadModel(GPT2Config(vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double())
    ids, mask = padded_text(25)
    labels = ids.masked_fill(mask == 0, -100)

    def loss(out, sl):
        return per_example_loss(CE, out.logits[:, :-1], labels[sl][:, 1:])

    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), loss, B)


def test_llama_with_checkpointing():
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(0)
    model = checkpointing(LlamaForSequenceClassification(LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, num_labels=3, pad_token_id=0)).double())
    ids, mask = padded_text(30)
    # LlamaRMSNorm computes in float32 even in a float64 model (as in test_models.py).
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classification_loss(torch.randint(0, 3, (B,))),
                       B, rtol=1e-6)


def test_book_keeping_with_checkpointing_warns_once_that_ghost_keeps_its_memory_saving():
    import warnings
    from transformers import BertConfig, BertForSequenceClassification
    model = checkpointing(BertForSequenceClassification(BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=3)).double())
    ids, mask = padded_text(30)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    with pytest.warns(UserWarning, match="clipping='ghost' stays at the plain checkpointed peak"):
        controller.loss(model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.loss(model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1)).backward()  # once
        controller.detach()
        ghost = ghostdp.GhostClipping(model, 1.0)  # ghost: no warning
        ghost.loss(model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1)).backward()
