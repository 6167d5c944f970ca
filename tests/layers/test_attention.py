"""ghostdp.layers.MultiheadAttention: outputs, attention weights and gradients equal torch.nn's over its settings and
masks, and ghostdp's clipped sums through it equal a per-example loop, in float64, in both clipping modes."""
import itertools
import warnings

import pytest
import torch
from torch import nn

import ghostdp
from ghostdp import layers
from conftest import assert_exact_model

E, HEADS, B, L, S, KV = 8, 2, 3, 4, 5, 6

SETTINGS = [dict(batch_first=bf, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero, kdim=kdim, vdim=kdim)
            for bf, bias, bias_kv, zero, kdim in itertools.product((False, True), (True, False), (False, True),
                                                                   (False, True), (None, KV))]


def masks():
    """The masks torch.nn.MultiheadAttention takes: bool and float, padding and attention, 2-D and 3-D, together."""
    padding = torch.rand(B, S) < 0.3
    padding[:, 0] = False  # (an example with every key masked has no attention: NaN in both)
    per_head = torch.rand(B * HEADS, L, S) < 0.2
    per_head[..., 0] = False
    return [{}, {"key_padding_mask": padding}, {"attn_mask": torch.randn(L, S)},
            {"attn_mask": per_head, "key_padding_mask": padding},
            {"attn_mask": torch.randn(L, S), "key_padding_mask": -3.0 * padding.double()}]


def inputs(module, requires_grad=False):
    kdim = module.kdim
    q, k, v = torch.randn(B, L, E), torch.randn(B, S, kdim), torch.randn(B, S, kdim)
    if not module.batch_first:
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_outputs_weights_and_gradients_equal_torch(settings):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, HEADS, **settings)
    ours = layers.from_torch(reference)
    x = inputs(reference, requires_grad=True)
    for mask, (need_weights, average) in itertools.product(masks(), ((True, True), (True, False), (False, True))):
        got = ours(*x, need_weights=need_weights, average_attn_weights=average, **mask)
        expected = reference(*x, need_weights=need_weights, average_attn_weights=average, **mask)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
        if need_weights:
            torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)
        else:
            assert got[1] is None and expected[1] is None
        loss_got, loss_expected = got[0].sin().sum(), expected[0].sin().sum()
        assert torch.autograd.grad(loss_got, x, retain_graph=True)[0].allclose(
            torch.autograd.grad(loss_expected, x, retain_graph=True)[0], rtol=1e-12, atol=1e-12)
        # our projections' gradients, concatenated as torch packs its parameters, equal torch's
        names = [n for n, _ in ours.named_parameters()]
        grad_of = dict(zip(names, torch.autograd.grad(loss_got, list(ours.parameters()), retain_graph=True)))
        for torch_name, our_keys in ours._torch_names():
            expected_grad = torch.autograd.grad(loss_expected, reference.get_parameter(torch_name),
                                                retain_graph=True)[0]
            torch.testing.assert_close(torch.cat([grad_of[k] for k in our_keys]), expected_grad, rtol=1e-12,
                                       atol=1e-12)


def test_causal_hint_and_unbatched_input_equal_torch():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, HEADS, batch_first=True)
    ours = layers.from_torch(reference)
    x = torch.randn(B, L, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    for need_weights in (True, False):
        torch.testing.assert_close(ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)[0],
                                   reference(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)[0])
    padding = torch.tensor([False, False, True, False])
    got, expected = ours(x[0], x[0], x[0], key_padding_mask=padding), reference(x[0], x[0], x[0],
                                                                                 key_padding_mask=padding)
    assert got[0].shape == (L, E) and got[1].shape == (L, L)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kdim", [None, KV])
@pytest.mark.parametrize("bias_kv", [False, True])
def test_same_seed_same_weights_and_state_dict_keys_as_torch(kdim, bias_kv):
    torch.manual_seed(3)
    reference = nn.MultiheadAttention(E, HEADS, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv)
    next_after_torch = torch.rand(1)
    torch.manual_seed(3)
    ours = layers.MultiheadAttention(E, HEADS, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv)
    assert torch.equal(torch.rand(1), next_after_torch), "the two draw a different number of random values"
    expected, got = reference.state_dict(), ours.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # and back: torch.nn's module loads ours, ours loads a changed torch.nn state
    nn.MultiheadAttention(E, HEADS, kdim=kdim, vdim=kdim, add_bias_kv=bias_kv).load_state_dict(got)
    changed = {k: v + 1 for k, v in expected.items()}
    ours.load_state_dict(changed)
    assert all(torch.equal(ours.state_dict()[k], changed[k]) for k in changed)
    if kdim is None:
        assert torch.equal(ours.in_proj_weight, changed["in_proj_weight"]) and ours.q_proj_weight is None
    else:
        assert ours.in_proj_weight is None and torch.equal(ours.k_proj_weight, changed["k_proj_weight"])
    assert torch.equal(ours.in_proj_bias, changed["in_proj_bias"])
    if kdim is None:  # a copy: writing into it, or differentiating through it, raises instead of doing nothing
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            nn.init.xavier_uniform_(ours.in_proj_weight)
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            (torch.randn(2, E, requires_grad=True) @ ours.in_proj_weight.T).sum().backward()
    else:  # the projection's own weight: a write reaches it
        nn.init.zeros_(ours.k_proj_weight)
        assert not ours.k_proj.weight.any()
    assert ours.k_proj.weight.shape == (E, kdim or E)
    assert layers.MultiheadAttention(E, HEADS, bias=False).in_proj_bias is None


def test_every_projection_has_a_norm_rule_where_torch_has_none():
    reference = nn.MultiheadAttention(E, HEADS)
    assert ghostdp.validate.fallback_modules(nn.Sequential(reference)) == {
        "0": ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]}, "torch.nn's own module: the fallback (the reason for ours)"
    ours = nn.Sequential(layers.from_torch(reference))
    assert ghostdp.validate.fallback_modules(ours) == {}
    with_bias_kv = nn.Sequential(layers.MultiheadAttention(E, HEADS, add_bias_kv=True))
    assert ghostdp.validate.fallback_modules(with_bias_kv) == {"0": ["bias_k", "bias_v"]}


class Encoder(nn.Module):
    """A torch.nn.TransformerEncoder (made private through validate.fix) and a head: per-example losses."""

    def __init__(self, batch_first, norm_first=False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)
        self.batch_first = batch_first

    def forward(self, x, padding=None, causal=False):
        if not self.batch_first:
            x = x.transpose(0, 1)
        tokens = x.shape[1 if self.batch_first else 0]
        mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1) if causal else None  # bool, as the padding
        out = self.encoder(x, mask=mask, src_key_padding_mask=padding, is_causal=causal)
        return self.head(out.mean(1 if self.batch_first else 0))


@pytest.mark.parametrize("batch_first,norm_first,causal", [(True, False, False), (False, True, True),
                                                           (False, False, False)])
def test_transformer_encoder_clipped_sums_match_a_per_example_loop(batch_first, norm_first, causal):
    model = ghostdp.validate.fix(Encoder(batch_first, norm_first))
    assert all(isinstance(layer.self_attn, layers.MultiheadAttention) for layer in model.encoder.layers)
    assert ghostdp.validate.fallback_modules(model) == {}
    x = torch.randn(B, L, E)
    padding = torch.tensor([[False] * L, [False, False, True, True], [False, True, False, True]])
    labels = torch.tensor([0, 2, 1])

    def loss(out, sl):
        return nn.functional.cross_entropy(out, labels[sl], reduction="none")

    class Call(nn.Module):  # model(inputs[sl]) with the padding of the same examples
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, both):
            return self.model(both[..., :E], both[..., E] > 0, causal)

    both = torch.cat([x, padding.unsqueeze(-1).double()], dim=-1)
    assert_exact_model(Call(), both, loss, B)


def test_cross_attention_with_key_value_biases_matches_a_per_example_loop():
    """kdim/vdim differ from embed_dim; bias_k and bias_v take the exact fallback, the projections their rule."""
    attention = layers.MultiheadAttention(E, HEADS, kdim=KV, vdim=KV, add_bias_kv=True, add_zero_attn=True,
                                          batch_first=True)
    head = nn.Linear(E, 1)
    model = nn.ModuleDict({"attention": attention, "head": head})
    query, memory = torch.randn(B, L, E), torch.randn(B, S, KV)

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, both):
            out, _ = self.model["attention"](both[:, :L, :E], both[:, L:, :KV], both[:, L:, :KV], need_weights=False)
            return self.model["head"](out).squeeze(-1).pow(2).sum(1)

    both = torch.zeros(B, L + S, max(E, KV))
    both[:, :L, :E], both[:, L:, :KV] = query, memory
    assert_exact_model(Call(), both, lambda out, sl: out, B)


def test_fix_keeps_a_transformers_outputs_in_training_and_on_torchs_inference_fast_path():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)
    reference = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    ours = ghostdp.validate.fix(nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)))[0]
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(B, L, E)
    padding = torch.tensor([[False] * L, [False, False, True, True], [False, True, False, True]])
    torch.testing.assert_close(ours(x, src_key_padding_mask=padding), reference(x, src_key_padding_mask=padding))
    with torch.no_grad():  # eval without grad: torch's fused layer reads in_proj_weight / in_proj_bias
        ours.eval(), reference.eval()
        torch.testing.assert_close(ours(x), reference(x))


def test_fix_leaves_a_subclass_that_overrides_forward_with_a_warning():
    class Custom(nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = nn.Sequential(Custom(E, HEADS))
    with pytest.warns(UserWarning, match="'0' \\(Custom\\).*overrides forward"):
        ghostdp.validate.fix(model)
    assert type(model[0]) is Custom
    with pytest.raises(ghostdp.validate.ModelNotPrivatizable, match="from_torch"):
        ghostdp.validate.fix(nn.MultiheadAttention(E, HEADS))


def test_from_torch_keeps_frozen_parameters_mode_and_dtype():
    reference = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float32).eval()
    reference.in_proj_weight.requires_grad_(False)
    ours = layers.from_torch(reference)
    assert ours.batch_first and not ours.training and ours.out_proj.weight.dtype == torch.float32
    assert not any(getattr(ours, p).weight.requires_grad for p in ("q_proj", "k_proj", "v_proj"))
    assert ours.q_proj.bias.requires_grad and ours.out_proj.weight.requires_grad


class Attending(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(E, HEADS, batch_first=True), nn.Linear(E, 2)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_fix_after_peft_carries_lora_on_out_proj_over_and_its_adapter_trains_exactly():
    """peft's LoRA on out_proj never runs in torch's attention (it reads out_proj.weight). fix after get_peft_model
    crashed (a state_dict of the wrapper's keys) before late 2026-12-02; now the wrapper is carried over and called:
    with the adapter off the outputs are torch's, the state_dict keys are the same, and the adapter's clipped sums
    are the per-example loop's."""
    import peft
    torch.manual_seed(0)
    model = peft.get_peft_model(Attending(), peft.LoraConfig(r=2, target_modules=["out_proj"],
                                                             init_lora_weights=False, modules_to_save=["head"]))
    model = model.double()
    x = torch.randn(B, L, E, dtype=torch.float64)
    with model.disable_adapter():
        reference = model(x)
    keys = sorted(model.state_dict())
    ghostdp.validate.fix(model)
    attention = model.base_model.model.attn
    assert type(attention) is layers.MultiheadAttention and type(attention.out_proj).__module__.startswith("peft")
    assert sorted(model.state_dict()) == keys
    with model.disable_adapter():
        torch.testing.assert_close(model(x), reference)
    assert_exact_model(model, x, lambda out, sl: out.pow(2).sum(1), B)
    assert attention.out_proj.lora_A["default"].weight.grad is None  # assert_exact leaves no gradient; the step:
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.loss(model(x).pow(2).sum(1)).backward()
    assert float(attention.out_proj.lora_A["default"].weight.grad.abs().sum()) > 0
    controller.detach()


def test_dropout_acts_in_training_only():
    ours = layers.MultiheadAttention(E, HEADS, dropout=0.5, batch_first=True)
    x = torch.randn(B, L, E)
    for need_weights in (True, False):
        ours.eval()
        torch.testing.assert_close(ours(x, x, x, need_weights=need_weights)[0],
                                   ours(x, x, x, need_weights=need_weights)[0])
        ours.train()
        assert not torch.allclose(ours(x, x, x, need_weights=need_weights)[0],
                                  ours(x, x, x, need_weights=need_weights)[0])


@pytest.mark.parametrize("build,error,message", [
    (lambda: layers.MultiheadAttention(E, 3), ValueError, "divisible by num_heads"),
    (lambda: layers.MultiheadAttention(0, 1), ValueError, "embed_dim must be a positive integer"),
    (lambda: layers.MultiheadAttention(E, HEADS, dropout=2), ValueError, "dropout"),
    (lambda: layers.from_torch(nn.Linear(2, 2)), TypeError, "LSTM, GRU, RNN or MultiheadAttention"),
])
def test_bad_settings_are_refused_with_the_reason(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_bad_inputs_are_refused_with_the_reason():
    attention = layers.MultiheadAttention(E, HEADS, batch_first=True)
    x = torch.randn(B, L, E)
    with pytest.raises(ValueError, match=r"attn_mask must be .*\(4, 4\).*got \(4, 3\)"):
        attention(x, x, x, attn_mask=torch.zeros(L, L - 1))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, source tokens\) = \(3, 4\)"):
        attention(x, x, x, key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool or float tensor"):
        attention(x, x, x, key_padding_mask=torch.zeros(B, L, dtype=torch.long))
    with pytest.raises(RuntimeError, match="is_causal .* needs attn_mask"):
        attention(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="all be batched"):
        attention(x, x[0], x[0])
    with pytest.raises(ValueError, match="the query's batch size"):
        attention(x, x[:2], x[:2])


def test_attaching_to_torchs_attention_warns_with_the_fix_and_not_after_it():
    model = nn.Sequential(nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True), nn.Linear(E, 1))
    with pytest.warns(UserWarning, match=r"torch\.nn modules take the exact per-example fallback.*: '0\.self_attn' "
                                         r"\(MultiheadAttention\)\. Fix: ghostdp\.validate\.fix\(model\)"):
        ghostdp.GhostClipping(model, 1.0).detach()
    ghostdp.validate.fix(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ghostdp.GhostClipping(model, 1.0).detach()
    frozen = nn.Sequential(nn.MultiheadAttention(E, HEADS).requires_grad_(False), nn.Linear(E, 1))
    assert ghostdp.validate.swappable_modules(frozen) == []  # nothing to clip there: no warning
    assert ghostdp.validate.swappable_modules(nn.MultiheadAttention(E, HEADS)) == []  # fix swaps children only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ghostdp.GhostClipping(frozen, 1.0).detach()


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's, for sequence-first
def test_a_whole_transformer_with_cross_attention_matches_a_per_example_loop():
    """nn.Transformer after validate.fix: encoder self-attention, decoder self- and cross-attention (sequence-first)."""
    transformer = nn.Transformer(E, HEADS, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=12,
                                 dropout=0.0)
    ghostdp.validate.fix(transformer)
    assert ghostdp.validate.fallback_modules(transformer) == {}
    assert isinstance(transformer.decoder.layers[0].multihead_attn, layers.MultiheadAttention)
    model = nn.ModuleDict({"transformer": transformer, "head": nn.Linear(E, 1)})
    causal = nn.Transformer.generate_square_subsequent_mask(L)

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, both):  # (B, S + L, E): source then target, batch-first here
            source, target = both[:, :S].transpose(0, 1), both[:, S:].transpose(0, 1)
            out = self.model["transformer"](source, target, tgt_mask=causal, tgt_is_causal=True)
            return self.model["head"](out).squeeze(-1).pow(2).sum(0)

    assert_exact_model(Call(), torch.randn(B, S + L, E), lambda out, sl: out, B)
