"""T5's relative attention bias looked up per example (norms/relative_bias.py): which classes take it, its values
against compute_bias's, and the clipped sums against the per-example loop through the paths a training step takes."""
import pytest
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

import ghostdp
from conftest import assert_exact
from ghostdp.norms.registry import forward_body
from ghostdp.norms.relative_bias import T5_COMPUTE_BIAS_BODY, looks_up_per_example, per_example_position_bias


def _t5(attention="sdpa", layers=2):
    config = transformers.T5Config(vocab_size=30, d_model=16, d_kv=8, d_ff=24, num_layers=layers, num_heads=2,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, classifier_dropout=0.0, num_labels=3, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.T5ForSequenceClassification(config).train()


def test_the_classes_with_t5s_code_look_their_bias_up_per_example_and_no_other():
    assert forward_body(T5Attention.compute_bias) == T5_COMPUTE_BIAS_BODY
    assert looks_up_per_example(T5Attention)
    assert looks_up_per_example(transformers.models.mt5.modeling_mt5.MT5Attention)
    assert not looks_up_per_example(transformers.models.umt5.modeling_umt5.UMT5Attention)  # its own compute_bias

    class Scaled(T5Attention):  # a forward of its own: its use of a given bias is not known
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states * 2, **kwargs)

    assert not looks_up_per_example(Scaled)


@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("past", [0, 3])
def test_each_examples_bias_is_what_compute_bias_gives(decoder, past):
    attention = _t5().transformer.encoder.block[0].layer[0].SelfAttention
    attention.is_decoder = decoder  # one-way buckets

    class Cache:
        def get_seq_length(self, layer):
            return past

    hidden = torch.randn(3, 5, 16)
    # (Outside a recorded forward the table's hook does not broadcast its batch of one: test_a_frozen_table_... .)
    bias = per_example_position_bias(attention, (hidden,), {"cache": Cache() if past else None})
    expected = attention.compute_bias(5, past + 5, past_seen_tokens=past)  # (1, heads, q, k)
    assert bias.shape == (1, 2, 5, past + 5) and torch.equal(bias, expected)
    assert per_example_position_bias(attention, (hidden,), {"position_bias": expected}) is None  # given: as it is


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_clipped_sums_equal_the_per_example_loop_with_padding(attention):
    """Two layers a stack, so the second adds the first one's bias; eager attention adds it to the scores, SDPA folds
    it into its mask; the second example is padded."""
    model = _t5(attention).double()
    ids = torch.randint(3, 30, (4, 6))
    ids[:, -1] = 1
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, :2] = 0
    labels = torch.tensor([0, 1, 2, 1])
    head = torch.nn.CrossEntropyLoss()

    def losses(rows):
        return ghostdp.per_example_loss(head, model(input_ids=ids[rows], attention_mask=mask[rows]).logits,
                                        labels[rows])

    assert ghostdp.validate.fallback_modules(model) == {}
    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), 4)


def test_under_non_reentrant_checkpointing_the_recomputation_looks_it_up_as_the_forward_did():
    model = _t5().double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(3, 30, (3, 5))
    ids[:, -1] = 1
    labels = torch.tensor([2, 0, 1])
    head = torch.nn.CrossEntropyLoss()

    def losses(rows):
        return ghostdp.per_example_loss(head, model(input_ids=ids[rows]).logits, labels[rows])

    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), 3)


def test_a_frozen_table_and_a_forward_without_gradient_keep_the_shared_lookup():
    model = _t5()
    attention = model.transformer.encoder.block[0].layer[0].SelfAttention
    shapes = []
    attention.register_forward_hook(lambda module, args, output: shapes.append(tuple(output[1].shape)))
    ids = torch.randint(3, 30, (3, 5))
    ids[:, -1] = 1
    controller = ghostdp.GhostClipping(model, 1.0)
    last = []  # the training forward's (the forward check's reruns, without gradient, run before it)
    try:
        model(input_ids=ids)  # a recorded forward, the table trained: one lookup per example
        last.append(shapes[-1])
        with torch.no_grad():
            model(input_ids=ids)
        last.append(shapes[-1])
        attention.relative_attention_bias.weight.requires_grad_(False)
        model(input_ids=ids)
        last.append(shapes[-1])
    finally:
        controller.detach()
    assert last == [(3, 2, 5, 5), (1, 2, 5, 5), (1, 2, 5, 5)]
