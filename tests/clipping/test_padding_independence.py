"""A forward whose outputs depend on how far the batch is padded is refused once the batches' lengths differ
(clipping/padding.py, run by the forward check of clipping/independence.py).

With dynamic padding an added long example pads every other example further; a model that reads positions its
attention mask excludes (a mean over all positions) then moves the others' clipped gradients: no gradient and no
replaced example shows it.
"""
import types

import pytest
import torch
from torch import nn

import ghostdp
from conftest import CLIPPING_MODES, without_forward_checks
from ghostdp.clipping.padding import EXTRA, padded_arguments

REFUSED = "the model's outputs depend on how far the batch is padded"
V, D, B = 20, 4, 4


class Pooled(nn.Module):
    """Token embeddings, a Linear per position, then a mean over the positions: over all of them (``masked`` False,
    the padding included) or over those the attention mask keeps."""

    def __init__(self, masked: bool, dropout: float = 0.0):
        super().__init__()
        self.masked = masked
        self.embed, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, 2)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids, attention_mask):
        h = self.drop(torch.tanh(self.mix(self.embed(input_ids))))
        if not self.masked:
            return self.head(h.mean(1))
        m = attention_mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def padded_batch(lengths, T, generator):
    """Examples of the given lengths, padded with id 0 (mask 0) to T positions."""
    ids = torch.randint(1, V, (len(lengths), T), generator=generator)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, n:] = 0
    return ids, mask


def clipped_sum(model, ids, mask, C):
    """The per-example definition: each example's gradient alone (its padding as the batch gives it), clipped."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in range(ids.shape[0]):
        loss = model(ids[i:i + 1], mask[i:i + 1]).pow(2).sum()
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += min(1.0, C / float(norm)) * g
    return torch.cat([t.flatten() for t in total])


class PooledFromItsBatch(Pooled):
    """Pooled, its forward given the batch in one argument: a dict, or a SimpleNamespace (the mask found inside it by
    its name: unchecked for padding before 2026-12-03); or the two tensors, as Pooled's (the per-example loop)."""

    def forward(self, batch, attention_mask=None):
        if attention_mask is not None:
            return super().forward(batch, attention_mask)
        batch = batch if isinstance(batch, dict) else vars(batch)
        return super().forward(batch["input_ids"], batch["attention_mask"])


CALLS = {
    "by keyword": lambda model, ids, mask: model(input_ids=ids, attention_mask=mask),
    "positionally": lambda model, ids, mask: model(ids, mask),  # the mask found by its name in the signature
    "in a batch dict": lambda model, ids, mask: model({"input_ids": ids, "attention_mask": mask}),
    "in a namespace": lambda model, ids, mask: model(types.SimpleNamespace(input_ids=ids, attention_mask=mask)),
}


def train_steps(model, batches, clipping="ghost", called="by keyword"):
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        for ids, mask in batches:
            out = CALLS[called](model, ids, mask)
            controller.loss(out.pow(2).sum(1)).backward()
            model.zero_grad()
    finally:
        controller.detach()
    return controller


@pytest.mark.parametrize("called", sorted(CALLS))
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_mean_over_padded_positions_is_refused_once_the_lengths_differ(clipping, called):
    torch.manual_seed(0)
    model = (PooledFromItsBatch if called.startswith("in a") else Pooled)(masked=False).double()
    g = torch.Generator().manual_seed(1)
    # The hole, on the per-example definition: one added example of length 16 pads the 4 others from 6 to 16
    # positions, and moves their clipped sum by more than C (besides its own C).
    ids, mask = padded_batch([6, 4, 5, 6], 6, g)
    longer = (torch.cat([ids, torch.zeros(B, 10, dtype=torch.long)], 1),
              torch.cat([mask, torch.zeros(B, 10, dtype=torch.long)], 1))
    C = 0.01
    assert float((clipped_sum(model, *longer, C) - clipped_sum(model, ids, mask, C)).norm()) > 1.5 * C
    g = torch.Generator().manual_seed(2)
    same_length = [padded_batch([6, 3, 5, 6], 6, g), padded_batch([2, 6, 6, 4], 6, g)]
    train_steps(model, same_length, clipping, called)  # one length so far: not refused
    with pytest.raises(RuntimeError, match=REFUSED + r".*length \d+\) by 8 more positions.*lengths differ \(6, 9\)"
                                           r".*check_padding = False"):
        train_steps(model, same_length + [padded_batch([9, 3, 5, 9], 9, g)], clipping, called)


def test_one_fixed_length_and_a_mask_that_pools_are_not_refused():
    """Padded to one length (padding='max_length'), T is no property of the batch; pooled with the mask, the
    outputs do not move (dropout on: the padding reruns run in eval() mode)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    fixed = [padded_batch([6, 3, 5, 2], 8, g) for _ in range(4)]
    controller = train_steps(Pooled(masked=False), fixed)
    assert controller.independence.padding_finding is not None  # found, and not refused: one length
    lengths = [padded_batch([6, 3, 5, 6], 6, g), padded_batch([9, 3, 5, 9], 9, g), padded_batch([4, 3, 2, 4], 4, g)]
    controller = train_steps(Pooled(masked=True, dropout=0.3), lengths)
    assert controller.independence.padding_finding is None
    assert controller.independence.last_padding_moves and not any(m.exceeds for m in
                                                                  controller.independence.last_padding_moves)


def test_the_switch_the_refusal_names_turns_the_padding_check_off():
    torch.manual_seed(0)
    model = Pooled(masked=False)
    g = torch.Generator().manual_seed(4)
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.independence.check_padding = False
    for ids, mask in [padded_batch([6, 3, 5, 6], 6, g), padded_batch([9, 3, 5, 9], 9, g)]:
        controller.loss(model(input_ids=ids, attention_mask=mask).pow(2).sum(1)).backward()
    assert controller.independence.padding_finding is None
    controller.detach()


class TorchEncoderPooled(nn.Module):
    """torch's own encoder, batch-first, given its key padding mask (True at padding) as nn.TransformerEncoder takes
    it; a mean over all positions (``masked`` False) or over the real ones."""

    def __init__(self, masked: bool, batch_first: bool = True):
        super().__init__()
        self.masked, self.batch_first = masked, batch_first
        self.embed, self.head = nn.Embedding(V, D), nn.Linear(D, 2)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0, batch_first=batch_first), 1,
            enable_nested_tensor=False)

    def forward(self, input_ids, src_key_padding_mask):  # ids (B, T), or (T, B) sequence-first; the mask (B, T)
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=src_key_padding_mask)
        if not self.batch_first:
            h = h.transpose(0, 1)
        if not self.masked:
            return self.head(h.mean(1))
        kept = (~src_key_padding_mask)[..., None].to(h.dtype)
        return self.head((h * kept).sum(1) / kept.sum(1))


class FedTransposed(nn.Module):
    """A sequence-first model called with (B, T) ids, for clipped_sum's examples (rows of dim 0)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, mask):
        return self.model(input_ids.t(), mask)


def key_padded_batch(lengths, T, generator, batch_first=True):
    ids, mask = padded_batch(lengths, T, generator)
    return ids if batch_first else ids.t(), mask == 0  # True at padding


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_a_torch_encoder_given_a_key_padding_mask_is_checked_for_padding(clipping, batch_first):
    """The mask found by torch's name (src_key_padding_mask, True at padding): before 2026-12-03 only attention_mask
    was looked for, and this encoder's mean over padded positions trained without a word. Sequence-first, the ids
    (T, B) are padded on dim 0 beside the (B, T) mask."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    model = ghostdp.validate.fix(TorchEncoderPooled(masked=False, batch_first=batch_first)).double()
    ids, mask = key_padded_batch([6, 4, 5, 6], 6, g, batch_first)
    longer = (torch.cat([ids, torch.zeros(*ids.shape[:-1], 10, dtype=torch.long)], -1) if batch_first else
              torch.cat([ids, torch.zeros(10, B, dtype=torch.long)], 0),
              torch.cat([mask, torch.ones(B, 10, dtype=torch.bool)], 1))

    def clipped_sum_of(ids, mask):  # the per-example definition, each example alone, given (B, T) ids
        return clipped_sum(model if batch_first else FedTransposed(model), ids if batch_first else ids.t(), mask, C)

    C = 0.01
    assert float((clipped_sum_of(*longer) - clipped_sum_of(ids, mask)).norm()) > 1.5 * C
    batches = [key_padded_batch([6, 3, 5, 6], 6, g, batch_first), key_padded_batch([9, 3, 5, 9], 9, g, batch_first)]
    with pytest.raises(RuntimeError, match=REFUSED + r".*by 8 more positions, masked out.*lengths differ \(6, 9\)"):
        train_steps(model, batches, clipping, called="positionally")
    masked = ghostdp.validate.fix(TorchEncoderPooled(masked=True, batch_first=batch_first)).double()
    controller = train_steps(masked, batches + [key_padded_batch([2, 5, 3, 1], 5, g, batch_first)], clipping,
                             "positionally")
    assert controller.independence.last_padding_moves and not any(
        m.exceeds for m in controller.independence.last_padding_moves)


class EncoderDecoder(nn.Module):
    """torch's nn.Transformer, sequence-first, given the source's and the target's key padding masks."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(D, 2, 1, 1, 8, dropout=0.0)
        self.head = nn.Linear(D, 2)

    def forward(self, src, tgt, src_key_padding_mask, tgt_key_padding_mask):
        return self.head(self.transformer(src, tgt, src_key_padding_mask=src_key_padding_mask,
                                          tgt_key_padding_mask=tgt_key_padding_mask,
                                          memory_key_padding_mask=src_key_padding_mask))


def test_an_encoder_decoder_s_target_key_padding_mask_is_padded_with_true_too():
    """Source and target of one length: the target (T, B, d) is padded beside the source, and its key padding mask
    with True (padding), as the source's; with False the decoder attended the added positions, and this exact model
    was refused as depending on the padding."""
    torch.manual_seed(0)
    model = ghostdp.validate.fix(EncoderDecoder())
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        for T in (6, 7, 5):
            src, tgt = torch.randn(T, B, D), torch.randn(T, B, D)
            src_padding, tgt_padding = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
            src_padding[1, -2:] = tgt_padding[2, -1] = True
            out = model(src, tgt, src_padding, tgt_padding)
            assert controller.independence.last_padding_moves, "the padding check did not run"
            controller.loss(out.pow(2).sum((0, 2)), reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        assert controller.independence.padding_finding is None
    finally:
        controller.detach()


def test_a_key_padding_mask_is_padded_with_true_and_read_as_its_negation():
    model = TorchEncoderPooled(masked=True)
    ids, mask = key_padded_batch([3, 2], 3, torch.Generator().manual_seed(6))
    (args, _), length = padded_arguments(model, (ids, mask), {}, 2, extra=2)
    assert length == 3 and args[1].dtype == torch.bool
    assert torch.equal(args[1], torch.cat([mask, torch.ones(2, 2, dtype=torch.bool)], 1))
    assert torch.equal(args[0][:, 3:], torch.zeros(2, 2, dtype=torch.long))  # the batch's own pad id
    float_mask = torch.zeros(2, 3)  # an additive float mask is no key padding mask: not padded
    assert padded_arguments(model, (ids, float_mask), {}, 2) is None
    # sequence-first: the (T, B) ids padded on dim 0 with the pad id read at a padded position; not where T == B
    ids[1, 2] = 7  # example 1's padding, as the batch gives it
    (args, _), length = padded_arguments(model, (ids.t(), mask), {}, 2, extra=2, sequence_first=True)
    assert length == 3 and torch.equal(args[0], torch.cat([ids.t(), torch.full((2, 2), 7)], 0))
    assert torch.equal(args[1], torch.cat([mask, torch.ones(2, 2, dtype=torch.bool)], 1))
    square = key_padded_batch([2, 1], 2, torch.Generator().manual_seed(7), batch_first=False)
    assert padded_arguments(model, square, {}, 2, sequence_first=True) is None


@pytest.mark.parametrize("name", ["bert", "gpt2-classifier", "llama-left-padded"])
def test_transformers_models_with_dynamic_padding_train(name):
    """A sequence classifier that finds each example's last token by the pad id (GPT-2) is padded with the batch's
    own pad id; a causal model padded on the left computes its fully masked rows over all positions, which no
    loss that ignores padding reads (compared at the real positions only)."""
    import transformers as tf
    torch.manual_seed(0)
    small = dict(vocab_size=V, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    if name == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(hidden_size=8, max_position_embeddings=32, **small))
    elif name == "gpt2-classifier":
        model = tf.GPT2ForSequenceClassification(tf.GPT2Config(vocab_size=V, n_embd=8, n_layer=1, n_head=2,
                                                                pad_token_id=3))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=8, num_key_value_heads=1, attn_implementation="eager",
                                                   **small)).float()  # in float64 its padded rows are NaN
    g = torch.Generator().manual_seed(5)
    controller = ghostdp.GhostClipping(model, 1.0)
    for T in (7, 5, 9):
        ids, mask = padded_batch([T, T - 2, 3, T], T, g)
        if name == "gpt2-classifier":
            ids[mask == 0] = 3
        if name == "llama-left-padded":
            ids, mask = ids.flip(1), mask.flip(1)
        logits = model(input_ids=ids, attention_mask=mask).logits
        if logits.dim() == 3:  # the real positions
            logits = torch.where(mask[..., None].bool(), logits, 0)
        controller.loss(logits.pow(2).flatten(1).sum(1)).backward()
        model.zero_grad()
        assert controller.independence.last_padding_moves
    assert controller.independence.padding_finding is None
    controller.detach()


def test_the_pad_id_is_the_batchs_else_the_models_and_unknown_skips_the_check():
    g = torch.Generator().manual_seed(6)
    ids, mask = padded_batch([5, 3, 5, 5], 5, g)
    ids[mask == 0] = 7
    model = Pooled(masked=True)
    (args, kwargs), length = padded_arguments(model, (), dict(input_ids=ids, attention_mask=mask), B)
    assert length == 5 and kwargs["input_ids"].shape == (B, 5 + EXTRA)
    assert bool((kwargs["input_ids"][:, 5:] == 7).all()) and not kwargs["attention_mask"][:, 5:].any()
    full = torch.ones(B, 5, dtype=torch.long)
    assert padded_arguments(model, (ids,), dict(attention_mask=full), B) is None  # no padding seen, no config
    model.config = type("Config", (), {"pad_token_id": 2})()
    (args, kwargs), _ = padded_arguments(model, (ids,), dict(attention_mask=full, labels=ids), B)
    assert bool((args[0][:, 5:] == 2).all()) and bool((kwargs["labels"][:, 5:] == -100).all())


def test_a_model_without_room_for_8_more_positions_is_padded_by_one_and_without_room_left_unchecked():
    import transformers as tf
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(tf.BertConfig(vocab_size=V, hidden_size=8, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=8,
                                                           max_position_embeddings=6))
    g = torch.Generator().manual_seed(7)
    controller = ghostdp.GhostClipping(model, 1.0)
    check = controller.independence
    for T, checked in ((6, False), (5, True), (4, True)):  # room for 0, 1 and 2 more positions: padded by one
        ids, mask = padded_batch([T, 3, T, 2], T, g)
        controller.loss(model(input_ids=ids, attention_mask=mask).logits.pow(2).sum(1)).backward()
        assert bool(check.last_padding_moves) == checked and check.padding_finding is None
        assert check.last_moves  # the other check ran
    controller.detach()


def test_the_padding_reruns_leave_the_training_flags_and_training_unchanged():
    """A submodule kept in eval() mode stays so; five steps with dropout from one seed are bitwise those without
    the checks."""
    def train(checks: bool):
        torch.manual_seed(0)
        model = Pooled(masked=True, dropout=0.3)
        model.mix.eval()
        controller = ghostdp.GhostClipping(model, 1.0)
        if not checks:
            without_forward_checks(controller)
        g = torch.Generator().manual_seed(8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for T in (6, 8, 5, 7, 6):
            ids, mask = padded_batch([T, 3, T, 2], T, g)
            optimizer.zero_grad()
            controller.loss(model(input_ids=ids, attention_mask=mask).pow(2).sum(1)).backward()
            optimizer.step()
        controller.detach()
        flags = [m.training for m in model.modules()]
        return model.state_dict(), flags, torch.rand(3)

    with_checks, without = train(True), train(False)
    assert with_checks[1] == without[1] == [True, True, False, True, True]
    assert all(torch.equal(with_checks[0][k], without[0][k]) for k in without[0])
    assert torch.equal(with_checks[2], without[2])
