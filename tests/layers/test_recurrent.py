"""ghostdp.layers' LSTM, GRU and RNN: outputs and gradients equal torch.nn's, and ghostdp's clipped sums equal a
per-example loop over the torch.nn module, in float64, in both clipping modes."""
import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import ghostdp
from ghostdp import layers
from conftest import CLIPPING_MODES, clipped_sum, ghost_clipped_sum, relative_error, RTOL

B, T, VOCAB, E, H = 4, 5, 11, 3, 4
VARIANTS = [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {}), (nn.RNN, {"nonlinearity": "relu"})]
VARIANT_IDS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


class Tagger(nn.Module):
    """Embedding -> recurrent layers -> a head on every output step and on the last hidden state."""

    def __init__(self, rnn, packed):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, E)
        self.rnn = rnn
        directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(directions * H, 2)
        self.packed = packed

    def forward(self, ids, lengths):
        x = self.emb(ids)
        batch_first = self.rnn.batch_first
        if not batch_first:
            x = x.transpose(0, 1)
        if self.packed:
            x = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, state = self.rnn(x)
        h_n = state[0] if isinstance(state, tuple) else state
        if self.packed:
            out = nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first, total_length=ids.shape[1])[0]
        if not batch_first:
            out = out.transpose(0, 1)
        return self.head(out).sum(1).pow(2).sum(1) + h_n.sin().sum((0, 2))   # (B,) per-example losses


def torch_names(model):
    """{id(parameter): torch.nn-style name}: ghostdp.layers modules save under torch.nn's keys."""
    return {id(p): name for name, p in model.state_dict(keep_vars=True).items() if isinstance(p, nn.Parameter)}


def pair(cls, kwargs, packed, **settings):
    torch.manual_seed(0)
    reference = Tagger(cls(E, H, **settings, **kwargs), packed)
    ours = Tagger(layers.from_torch(reference.rnn), packed)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def per_example_grads(model, ids, lengths):
    params = [(n, p) for n, p in model.state_dict(keep_vars=True).items() if isinstance(p, nn.Parameter)]
    out = []
    for i in range(ids.shape[0]):
        grads = torch.autograd.grad(model(ids[i:i + 1], lengths[i:i + 1]).sum(), [p for _, p in params])
        out.append({n: g for (n, _), g in zip(params, grads)})
    return out


def assert_clipped_sums_match_torch(reference, ours, ids, lengths):
    per_example = per_example_grads(reference, ids, lengths)
    names = torch_names(ours)
    _, norms = clipped_sum(per_example, 1.0)
    for C in (0.5 * float(norms.min()), 2.0 * float(norms.max())):
        expected, expected_norms = clipped_sum(per_example, C)
        for clipping in CLIPPING_MODES:
            got, got_norms = ghost_clipped_sum(ours, lambda: ours(ids, lengths), C, clipping)
            by_torch_name = {names[id(p)]: got[n] for n, p in ours.named_parameters()}
            assert float(((got_norms - expected_norms).abs() / expected_norms).max()) < RTOL
            assert relative_error(by_torch_name, expected) < RTOL, clipping


def text_batch():
    lengths = torch.tensor([T, 2, 4, 1])
    ids = torch.randint(1, VOCAB, (B, T))
    ids[torch.arange(T)[None] >= lengths[:, None]] = 0
    return ids, lengths


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("batch_first", [True, False])
def test_two_layer_bidirectional_matches_a_per_example_loop(cls, kwargs, batch_first):
    reference, ours = pair(cls, kwargs, packed=False, num_layers=2, bidirectional=True, batch_first=batch_first)
    assert_clipped_sums_match_torch(reference, ours, *text_batch())


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_sequences_match_a_per_example_loop(cls, kwargs, bidirectional):
    reference, ours = pair(cls, kwargs, packed=True, num_layers=2, bidirectional=bidirectional, batch_first=True)
    assert_clipped_sums_match_torch(reference, ours, *text_batch())


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=VARIANT_IDS)
def test_every_weight_has_a_norm_rule(cls, kwargs):
    _, ours = pair(cls, kwargs, packed=False, num_layers=2, bidirectional=True)
    hooked = dict(ghostdp.norms.fallback.hooked_modules(ours.rnn))
    assert hooked and all(ghostdp.norms.find_norm_rule(m) is not None for m in hooked.values()), hooked


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=VARIANT_IDS)
def test_same_seed_same_weights_and_state_dict_keys_as_torch(cls, kwargs):
    ours_cls = getattr(layers, cls.__name__)
    torch.manual_seed(3)
    reference = cls(E, H, num_layers=2, bidirectional=True, bias=True, **kwargs)
    torch.manual_seed(3)
    ours = ours_cls(E, H, num_layers=2, bidirectional=True, **kwargs)
    expected, got = reference.state_dict(), ours.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert ours.weight_hh_l1_reverse is ours.l1_reverse.hh.weight
    assert [len(w) for w in ours.all_weights] == [4] * 4
    no_bias = ours_cls(E, H, bias=False, **kwargs)
    assert list(no_bias.state_dict()) == list(cls(E, H, bias=False, **kwargs).state_dict())
    with pytest.raises(AttributeError):
        no_bias.bias_ih_l0


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=VARIANT_IDS)
def test_outputs_and_gradients_equal_torch_with_initial_states_and_unbatched_input(cls, kwargs):
    reference = cls(E, H, num_layers=2, bidirectional=True, **kwargs)
    ours = layers.from_torch(reference)
    x = torch.randn(T, B, E, requires_grad=True)
    h0 = torch.randn(4, B, H, requires_grad=True)
    c0 = torch.randn(4, B, H, requires_grad=True)
    state = (h0, c0) if cls is nn.LSTM else h0
    inputs = [x, h0, c0] if cls is nn.LSTM else [x, h0]

    def loss_and_grads(model, x, state):
        out, final = model(x, state)
        finals = final if isinstance(final, tuple) else (final,)
        loss = out.pow(2).sum() + sum(f.sin().sum() for f in finals)
        return [out, *finals], torch.autograd.grad(loss, inputs + list(model.state_dict(keep_vars=True).values()))

    expected_out, expected_grads = loss_and_grads(reference, x, state)
    got_out, got_grads = loss_and_grads(ours, x, state)
    for got, expected in zip(got_out + list(got_grads), expected_out + list(expected_grads)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    unbatched = (h0[:, 0], c0[:, 0]) if cls is nn.LSTM else h0[:, 0]
    torch.testing.assert_close(ours(x[:, 0], unbatched)[0], reference(x[:, 0], unbatched)[0])


def test_dropout_between_layers_acts_in_training_only():
    reference = nn.LSTM(E, H, num_layers=2, dropout=0.5)
    ours = layers.from_torch(reference)
    x = torch.randn(T, B, E)
    torch.testing.assert_close(ours.eval()(x)[0], reference.eval()(x)[0])
    ours.train()
    torch.manual_seed(1)
    first = ours(x)[0]
    assert not torch.allclose(first, ours(x)[0]), "dropout made no difference between two training calls"


def test_from_torch_keeps_frozen_weights_mode_and_dtype():
    reference = nn.GRU(E, H, batch_first=True, dtype=torch.float32).eval()
    reference.weight_ih_l0.requires_grad_(False)
    ours = layers.from_torch(reference)
    assert ours.batch_first and not ours.training and ours.weight_hh_l0.dtype == torch.float32
    assert not ours.weight_ih_l0.requires_grad and ours.weight_hh_l0.requires_grad


@pytest.mark.parametrize("build,message", [
    (lambda: layers.LSTM(E, H, proj_size=2), "proj_size"),
    (lambda: layers.RNN(E, H, nonlinearity="gelu"), "nonlinearity"),
    (lambda: layers.GRU(E, 0), "hidden_size"),
    (lambda: layers.GRU(E, H, dropout=1.5), "dropout"),
])
def test_bad_settings_are_refused_with_the_reason(build, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        build()


def test_bad_inputs_are_refused_with_the_reason():
    lstm, gru = layers.LSTM(E, H), layers.GRU(E, H)
    x = torch.randn(T, B, E)
    with pytest.raises(ValueError, match="input_size=3"):
        lstm(torch.randn(T, B, E + 1))
    with pytest.raises(ValueError, match=r"h_0 has shape \(1, 3, 4\), expected \(1, 4, 4\)"):
        gru(x, torch.zeros(1, 3, H))
    with pytest.raises(ValueError, match="tuple"):
        lstm(x, torch.zeros(1, B, H))
    with pytest.raises(ValueError, match="not a tuple"):
        gru(x, (torch.zeros(1, B, H), torch.zeros(1, B, H)))
    with pytest.raises(ValueError, match="4-D"):
        gru(torch.randn(2, T, B, E))
    with pytest.raises(TypeError, match="LSTM, GRU, RNN or MultiheadAttention"):
        layers.from_torch(nn.Linear(2, 2))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_grad_samples_equal_torch_per_example_gradients(clipping):
    reference, ours = pair(nn.LSTM, {}, packed=True, num_layers=2, bidirectional=True, batch_first=True)
    ids, lengths = text_batch()
    per_example = per_example_grads(reference, ids, lengths)
    names = torch_names(ours)
    controller = ghostdp.GhostClipping(ours, 1e6, clipping=clipping)
    try:
        with controller.grad_samples():
            controller.loss(ours(ids, lengths), reduction="sum").backward()
        for p in ours.parameters():
            want = torch.stack([g[names[id(p)]] for g in per_example])
            torch.testing.assert_close(p.grad_sample, want, rtol=1e-10, atol=1e-14, msg=names[id(p)])
    finally:
        controller.detach()
