"""peft's prompt tuning and p-tuning: the prompt, looked up (and encoded) once and repeated to the batch by peft
itself, captured at that repeat (clipping/repeated.py; p-tuning's encoder by its rule, norms/peft_prompt.py). Exact
against the per-example loop in both modes; any other use of the shared prompt is refused."""
import dataclasses
import types

import peft
import pytest
import torch
import transformers
from peft.tuners.prompt_tuning.model import PromptEmbedding
from torch import nn

import ghostdp
from conftest import CLIPPING_MODES, assert_exact, assert_exact_model

B, V, D, N = 5, 30, 16, 4


PROMPTS = {
    "prompt tuning": lambda: peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=N),
    "p-tuning, MLP": lambda: peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=N, encoder_hidden_size=8),
    "p-tuning, LSTM": lambda: peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=N, encoder_hidden_size=8,
                                                       encoder_reparameterization_type="LSTM"),
}


def _bert(checkpointing=None, prompt="prompt tuning"):
    config = transformers.BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), PROMPTS[prompt]()).double()
    if checkpointing is not None:
        model.base_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    return model


def _classification(labels):
    criterion = nn.CrossEntropyLoss(reduction="none")
    return lambda out, sl: criterion(out.logits, labels[sl])


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_prompt_tuning_on_bert_is_exact_in_both_modes(checkpointing):
    """The virtual tokens' table trains with the classifier peft saves; padding in the batch."""
    torch.manual_seed(0)
    model = _bert(checkpointing)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "prompt_encoder.default.embedding.weight" in trained
    ids, mask = torch.randint(1, V, (B, 7)), torch.ones(B, 7, dtype=torch.long)
    mask[0, 4:], mask[2, 5:] = 0, 0
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), _classification(torch.randint(0, 3, (B,))), B)


@pytest.mark.parametrize("prompt", ["p-tuning, MLP", "p-tuning, LSTM"])
def test_p_tuning_on_bert_is_exact_in_both_modes(prompt):
    """The encoder's embedding, LSTM and MLP all train, each example's gradient a VJP of the shared prompt."""
    torch.manual_seed(5)
    model = _bert(prompt=prompt)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and n.startswith("prompt_encoder.")}
    assert len(trained) >= 7, trained
    ids = torch.randint(1, V, (B, 6))
    assert_exact_model(model, dict(input_ids=ids), _classification(torch.randint(0, 3, (B,))), B)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_the_prompt_is_captured_at_peft_s_repeat_by_its_rule(clipping, prompt):
    """Neither broadcast by ghostdp (peft would repeat it B times over) nor taken by the fallback."""
    torch.manual_seed(1)
    model = _bert(prompt=prompt)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        out = model(input_ids=torch.randint(1, V, (B, 6)))
        assert controller.recorder.broadcast_in_forward == []
        controller.loss(out.logits.pow(2).sum(1), reduction="sum").backward()
        assert controller.pass_one.took_fallback == set()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        controller.detach()


def test_p_tuning_with_an_lstm_dropout_in_training_is_refused_with_the_fix():
    """Its encoder draws at random: the rule, which runs it again, declines, and the broadcast output fails in
    peft's concatenation with a note that names the fix."""
    config = peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=N, encoder_hidden_size=8,
                                      encoder_reparameterization_type="LSTM", encoder_dropout=0.1)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=3)), config)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="Sizes of tensors must match") as caught:
            model(input_ids=torch.randint(1, V, (B, 6)))
        assert "p-tuning with an LSTM dropout in training" in "".join(caught.value.__notes__)
    finally:
        controller.detach()


def test_prompt_tuning_on_gpt2_with_a_causal_lm_loss_is_exact():
    torch.manual_seed(2)
    config = transformers.GPT2Config(vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).double()
    ids = torch.randint(1, 25, (B, 6))
    labels = ids.clone()
    labels[0, :2] = -100

    def loss(out, sl):  # each example's next-token loss on its own tokens (the virtual tokens' logits dropped)
        logits, targets = out.logits[:, 3:-1], labels[sl][:, 1:]
        return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)

    assert_exact_model(model, dict(input_ids=ids), loss, B)


@dataclasses.dataclass
class LastLogits:  # a dataclass of one's own, which pytree does not flatten
    logits: torch.Tensor


class SlottedLogits:  # an object whose attributes are slots, not a __dict__
    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits


class LastPosition(nn.Module):
    """A model of one's own around a peft causal LM: its last position's first logits, returned in ``returns``."""

    def __init__(self, peft_model, returns):
        super().__init__()
        self.lm, self.returns = peft_model, returns

    def forward(self, input_ids):
        return self.returns(logits=self.lm(input_ids=input_ids).logits[:, -1, :3])


def _gpt2_with(prompt):
    config = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config_of = {"prompt tuning": peft.PromptTuningConfig, "p-tuning, MLP": peft.PromptEncoderConfig}[prompt]
    extra = {"encoder_hidden_size": 8} if prompt != "prompt tuning" else {}
    return peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                               config_of(task_type="CAUSAL_LM", num_virtual_tokens=N, **extra))


@pytest.mark.parametrize("returns", [types.SimpleNamespace, LastLogits])
@pytest.mark.parametrize("prompt", ["prompt tuning", "p-tuning, MLP"])
def test_a_prompt_under_a_model_whose_output_pytree_does_not_flatten_is_exact(prompt, returns):
    """The repeat is found below the tensors among the root output's attributes (repeated.output_tensors); refused
    before 2026-12-03 as reaching the output by no path, and the loss read only the last position's logits."""
    torch.manual_seed(6)
    model = LastPosition(_gpt2_with(prompt), returns).double()
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=torch.randint(1, V, (B, 5))), _classification(labels), B)


def test_a_prompt_under_a_model_whose_output_holds_no_tensor_found_is_refused_with_the_fix():
    model = LastPosition(_gpt2_with("prompt tuning"), SlottedLogits).double()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="returned 'SlottedLogits', in which ghostdp found no tensor that "
                           "requires grad.*Fix: return the outputs as tensors"):
            model(torch.randint(1, V, (B, 5)))
    finally:
        controller.detach()


def test_prompt_tuning_on_t5_with_prompts_for_encoder_and_decoder_is_exact():
    """Two transformer submodules: one table of 2 n virtual tokens, repeated once, sliced for each stack."""
    torch.manual_seed(6)
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, dropout_rate=0.0, decoder_start_token_id=0)
    model = peft.get_peft_model(transformers.T5ForConditionalGeneration(config),
                                peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=3)).double()
    assert model.get_parameter("prompt_encoder.default.embedding.weight").shape == (6, 16)
    ids, labels = torch.randint(1, 40, (4, 6)), torch.randint(1, 40, (4, 5))

    def loss(out, sl):
        return nn.functional.cross_entropy(out.logits.transpose(1, 2), labels[sl], reduction="none").sum(1)

    assert_exact_model(model, dict(input_ids=ids, labels=labels), loss, 4)


def test_multitask_prompt_tuning_which_looks_its_prompt_up_per_example_is_exact():
    """Its prompt tokens are expanded to the batch before the lookup and scaled per task: no shared output."""
    torch.manual_seed(7)
    config = transformers.BertConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.MultitaskPromptTuningConfig(
        task_type="SEQ_CLS", num_virtual_tokens=3, num_tasks=2)).double()
    ids, tasks = torch.randint(1, V, (4, 6)), torch.tensor([0, 1, 1, 0])
    assert_exact_model(model, dict(input_ids=ids, task_ids=tasks), _classification(torch.randint(0, 3, (4,))), 4)


class Prompted(nn.Module):
    """peft's prompt encoder used by a model of one's own: ``use`` says how its shared prompt reaches the output."""

    def __init__(self, use):
        super().__init__()
        config = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=N, token_dim=3,
                                         num_transformer_submodules=1)
        self.prompt = PromptEmbedding(config, nn.Embedding(V, 3))
        self.head = nn.Linear(3, 2)
        self.use = use

    def forward(self, x):
        prompt = self.prompt(torch.arange(N)[None])  # (1, N, 3)
        if self.use == "expanded":
            shared = prompt.expand(x.shape[0], -1, -1)
        elif self.use == "repeated on dim 1":
            shared = prompt.repeat(1, x.shape[0], 1).reshape(x.shape[0], N, 3)
        else:
            shared = prompt.repeat(x.shape[0], 1, 1)
        self.kept = prompt  # for a loss of one's own that reads it after the forward
        h = torch.cat([shared, x], 1)
        if self.use == "mixed":  # each example's features moved by the batch's mean: a mix through the gradient
            h = h + h.mean(0, keepdim=True)
        out = self.head(h).sum(1)
        return out + prompt.sum() if self.use == "repeated and summed" else out


def test_a_model_of_ones_own_that_repeats_peft_s_prompt_is_exact():
    torch.manual_seed(3)
    model = Prompted("repeated").double()
    x = torch.randn(B, 2, 3, dtype=torch.float64)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), B)


@pytest.mark.parametrize("use, refusal", [
    ("repeated and summed", "through RepeatBackward0, SumBackward0 \\(2 uses\\)"),
    ("expanded", "through ExpandBackward0 \\(1 use\\)"),
    ("repeated on dim 1", "through RepeatBackward0 \\(1 use\\)")])
def test_any_other_use_of_the_shared_prompt_is_refused(use, refusal):
    """A second use would bring gradient that no example's norm counts (the prompt's sum added to every output);
    an expand or a repeat on another dim is not the repeat whose rows are the examples."""
    model = Prompted(use).double()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=f"prompt of peft's prompt tuning or p-tuning.*{refusal}, not through"):
            model(torch.randn(B, 2, 3, dtype=torch.float64))
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_mix_of_the_examples_after_the_repeat_is_refused(clipping):
    model = Prompted("mixed").double()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match="rows of that repeat do not each hold one example's gradient"):
            controller.loss(model(torch.randn(B, 2, 3, dtype=torch.float64)).pow(2).sum(1)).backward()
    finally:
        controller.detach()


def test_a_batch_of_one_takes_the_probe_as_before():
    """B = 1: peft's repeat is of one row, the output is that example's, and nothing waits for the repeat."""
    torch.manual_seed(4)
    model = Prompted("repeated").double()
    x = torch.randn(1, 2, 3, dtype=torch.float64)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss(model(x).pow(2).sum(1)).backward()
        assert controller.recorder._awaiting_repeat == []
        assert model.prompt.embedding.weight.grad is not None
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_the_shared_prompt_read_again_after_the_forward_is_refused(clipping):
    """A term of each example's loss that reads the prompt kept from the forward reaches the table past the repeat,
    where its per-example gradients are taken: that part of the gradient would escape clipping (two passes) or be
    lost (book-keeping)."""
    model = Prompted("repeated").double()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        out = model(torch.randn(B, 2, 3, dtype=torch.float64))
        losses = out.pow(2).sum(1) + model.kept.sum()
        with pytest.raises(RuntimeError, match="along a path that does not go through the model's repeat"):
            controller.loss(losses).backward()
    finally:
        controller.detach()
