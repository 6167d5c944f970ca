"""A forward that mixes examples where no gradient flows is refused (clipping/independence.py).

A statistic of the batch computed without gradient (a detached mean, one under torch.no_grad(), a running
statistic used in train() mode) makes each example's gradient depend on the other examples' data: no gradient
shows it, so the layout proof passed it, and one added example moved the others' clipped sum by 4.5 C. The
check reruns the forward on checked steps on the first or the last example copied to every row of the batch, the
random generators and buffers as the forward had them, and refuses a move of that example's output.
"""
import dataclasses
import random
import types
import warnings

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from conftest import CLIPPING_MODES, Gain, assert_exact, clipped_sum_through_the_batch
from ghostdp.clipping.independence import RERUN_FAILED

REFUSED = "the model's forward mixes examples where no gradient flows"
B, D = 8, 2


class DetachedCentring(nn.Module):
    """x minus the batch's mean of x, detached, before a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.lin(x - x.detach().mean(0, keepdim=True))


class NoGradStandardise(nn.Module):
    """No norm rule (the fallback): a gain after subtracting the batch mean computed under no_grad."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x):
        with torch.no_grad():
            mean = x.mean(0, keepdim=True)
        return (x - mean) * self.gain


class RunningCentring(nn.Module):
    """A Linear after subtracting a running mean that a train() forward updates from the batch first."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)
        self.register_buffer("running_mean", torch.zeros(D))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.5).add_(0.5 * x.mean(0))
        return self.lin(x - self.running_mean)


class CentresTheSecondOfAPair(nn.Module):
    """No norm rule: takes a tuple, whose second tensor (no grad) it centres on the batch's mean. The proof of a
    module's inputs (pass_one._prove_fallback_inputs) reads tensor arguments, not tensors inside containers."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, pair):
        a, b = pair
        return (a + b - b.mean(0, keepdim=True)) * self.gain


class PairedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = CentresTheSecondOfAPair()

    def forward(self, x):
        return self.pair((x, 2 * x))


class DroppedThenCentred(nn.Module):
    """Dropout, then a detached centring: the reruns must draw the forward's own masks, or the masks' differences
    would hide the mixing (the reruns start from the generators' states of the forward)."""

    def __init__(self):
        super().__init__()
        self.drop, self.centre = nn.Dropout(0.5), DetachedCentring()

    def forward(self, x):
        return self.centre(self.drop(x))


class ScaledByTheBatchSize(nn.Module):
    """A Linear on sin(B² x): the batch's size alone moves each example (replacing an example keeps it; removing
    one, in eval() mode, does not)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)
        self.drop = nn.Dropout(0.3)  # the removal runs in eval() mode: a smaller batch would draw other masks

    def forward(self, x):
        return self.drop(self.lin(torch.sin(x * x.shape[0] ** 2)))


class CentredThenRows(nn.Module):
    """A detached centring, then a Linear on each feature as a row of its own, (B * D, 1), as a mixture of experts'
    router runs on its flattened tokens: the layout proof finds that call's examples in blocks of rows on dim 0
    (layout.ROWS_LAYOUT), where the check perturbed them. Until 2026-12-02 any call with that layout switched the
    refusal off, and this trained with its clipped sum 0.2-0.5 off."""

    def __init__(self):
        super().__init__()
        self.centre, self.rows = DetachedCentring(), nn.Linear(1, 1)

    def forward(self, x):
        return self.rows(self.centre(x).reshape(-1, 1)).reshape(x.shape)


class CentredThenRawWeightOnRows(nn.Module):
    """The same with a raw weight's product, F.linear of (B, D, 1): an mm on (B * D, 1) rows, where the weight's use
    is captured (norms/parameter_uses.py), with the same layout."""

    def __init__(self):
        super().__init__()
        self.centre, self.weight = DetachedCentring(), nn.Parameter(torch.tensor([[1.5]]))

    def forward(self, x):
        return nn.functional.linear(self.centre(x).unsqueeze(-1), self.weight).squeeze(-1)


class CentredThenGRU(nn.Module):
    """A detached centring, then torch's GRU (on the fallback), whose h_n holds the examples on dim 1, (layers, B,
    H): until 2026-12-02 a call laid out off dim 0 switched the refusal off, though no argument of the forward has
    another dim of the batch's size (where the examples could lie instead)."""

    def __init__(self):
        super().__init__()
        self.centre, self.gru = DetachedCentring(), nn.GRU(D, D, batch_first=True)

    def forward(self, x):
        return self.gru(self.centre(x).unsqueeze(1).expand(-1, 3, -1))[0][:, -1]  # three steps: the fallback


MIXING = {"detached mean": DetachedCentring, "no_grad mean, no rule": NoGradStandardise,
          "running mean": RunningCentring, "mean of a tuple's input, no rule": PairedInputs,
          "detached mean after dropout": DroppedThenCentred, "the batch's size": ScaledByTheBatchSize,
          "detached mean, then a Linear on flattened rows": CentredThenRows,
          "detached mean, then a raw weight's product on flattened rows": CentredThenRawWeightOnRows,
          "detached mean, then a GRU": CentredThenGRU}


class Scored(nn.Module):
    """Per-example loss <body(x)_i, v_i>."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, v):
        return (self.body(x) * v).sum(1)


def _assert_step_refused(model, x, v, clipping: str, match: str):
    """A step of Scored ``model`` on (``x``, ``v``) is refused (``match``) without writing gradients."""
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=match):
            controller.loss(model(x, v), reduction="sum").backward()
        assert all(p.grad is None for p in model.parameters()), "a refused step wrote gradients"
    finally:
        controller.detach()


def _neighbouring_batches():
    """D: 8 examples with large loss weights (each clipped); D + j: an example with a zero loss weight (its own
    gradient is 0) and a far-off x, which moves the batch's statistic."""
    x, v = torch.randn(B, D), 100 * torch.randn(B, D)
    return (x, v), (torch.cat([x, 1e3 * torch.ones(1, D)]), torch.cat([v, torch.zeros(1, D)]))


def _clipped_sum_from_the_batch_forward(model, x, v):
    """The clipped sum through the batch's forward (conftest.clipped_sum_through_the_batch) of every trainable
    parameter."""
    torch.manual_seed(5)  # dropout: the first examples' masks are the same in both batches
    return clipped_sum_through_the_batch(model(x, v), [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("body", list(MIXING))
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_batch_statistic_without_gradient_is_refused(body, clipping):
    (x, v), (xj, vj) = _neighbouring_batches()
    model = Scored(MIXING[body]()).train()
    state = {k: t.clone() for k, t in model.state_dict().items()}
    moved = _clipped_sum_from_the_batch_forward(model, x, v) - _clipped_sum_from_the_batch_forward(model, xj, vj)
    assert float(moved.norm()) > 2.0, "degenerate test: the added example does not move the others' clipped sum"
    model.load_state_dict(state)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the running mean is a changed buffer (buffers.py)
            with pytest.raises(RuntimeError, match=REFUSED):
                controller.loss(model(x, v), reduction="sum").backward()
        assert all(p.grad is None for p in model.parameters()), "a refused step wrote gradients"
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_forward_that_reads_the_batch_size_is_refused_in_a_batch_of_two(clipping):
    """Copying either example keeps the batch's size; until 2026-12-07 only batches of three or more ran without an
    example, and this trained with each example's clipped gradient moved by the other's presence."""
    torch.manual_seed(0)
    model = Scored(ScaledByTheBatchSize()).train()
    x, v = torch.randn(2, D), 100 * torch.randn(2, D)
    params = list(model.parameters())
    model.eval()  # without dropout: the first example alone against beside the second
    moved = clipped_sum_through_the_batch(model(x, v)[:1], params) - clipped_sum_through_the_batch(model(x[:1], v[:1]),
                                                                                                  params)
    model.train()
    assert float(moved.norm()) > 0.5, "degenerate test: the second example does not move the first's clipped sum"
    _assert_step_refused(model, x, v, clipping, REFUSED + ": removing the (first|last) of the 2 examples")


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, v):
        return (self.drop(self.lin(x)) * v).sum(1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_dropout_is_not_mixing_and_the_random_stream_is_put_back(clipping):
    """The reruns draw dropout's masks from the forward's own generator state (they would differ otherwise and
    read as mixing), and training's stream goes on after them as if they had not run."""
    x, v = torch.randn(B, D), torch.randn(B, D)
    model = Dropped().train()
    torch.manual_seed(1)
    plain_losses = model(x, v)
    plain_next = torch.rand(4)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        torch.manual_seed(1)
        losses = model(x, v)
        assert controller.independence.forwards == 1 and controller.independence.finding is None
        controller.loss(losses, reduction="sum").backward()
        assert torch.equal(torch.rand(4), plain_next)
        assert torch.equal(losses, plain_losses)
    finally:
        controller.detach()


class NoiseOfItsOwn(nn.Module):
    """Adds noise in training, drawn from generators it holds itself, in a dict (as peft's PVeRA with a generator_seed
    does), and centres on the batch's detached mean or not."""

    def __init__(self, mix):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.generators = {"default": torch.Generator().manual_seed(7)}
        self.mix = mix

    def forward(self, x):
        h = self.lin(x)
        if self.training:  # as dropout does
            h = h + torch.randn(h.shape, generator=self.generators["default"])
        return (h - h.detach().mean(0) if self.mix else h).pow(2).sum(1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_generator_the_model_holds_is_put_back_after_the_reruns(clipping):
    """The reruns draw from the module's own generator as the forward does, and put it back: the forward draws what
    it would without ghostdp, and the check compares like with like (until 2026-12-07 each rerun drew other noise
    from it, the training forward others again)."""
    x = torch.randn(B, D)
    model = NoiseOfItsOwn(mix=False).train()
    plain_losses = model(x)
    plain_next = torch.rand(4, generator=model.generators["default"])
    model.generators["default"].manual_seed(7)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        losses = model(x)
        assert controller.independence.forwards == 1 and controller.independence.finding is None
        assert controller.independence.last_moves
        assert max(move.relative for move in controller.independence.last_moves) < 1e-6
        controller.loss(losses, reduction="sum").backward()
        assert torch.equal(losses, plain_losses)
        assert torch.equal(torch.rand(4, generator=model.generators["default"]), plain_next)
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_mixing_forward_that_draws_from_a_generator_of_its_own_is_refused(clipping):
    model = NoiseOfItsOwn(mix=True).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss(model(torch.randn(B, D)), reduction="sum").backward()
    finally:
        controller.detach()


class LayerDrop(nn.Module):
    """Skips its second layer in training on a draw from NumPy's or Python's global generator (transformers' wav2vec2
    family draws its LayerDrop and SpecAugment masks from NumPy's)."""

    def __init__(self, source):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.draw = np.random.random if source == "numpy" else random.random

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) if self.training and self.draw() < 0.5 else h).pow(2).sum(1)


@pytest.mark.parametrize("source", ["numpy", "python"])
def test_numpys_and_pythons_generators_are_put_back_after_the_reruns(source):
    """Until 2026-12-07 the reruns drew from them without putting them back: each rerun dropped other layers, so the
    NumPy model that keeps its examples apart was refused as mixing at its third step, and the Python one trained with
    the check allowing the reruns' spread (moves of 0.13 of its outputs); and training drew other numbers than it
    would without ghostdp."""
    x = torch.randn(B, D)
    model = LayerDrop(source).train()
    np.random.seed(0)
    random.seed(0)
    plain = [model(x) for _ in range(6)]
    after = (np.random.random(), random.random())
    np.random.seed(0)
    random.seed(0)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        for step in range(6):
            losses = model(x)
            moves = controller.independence.last_moves
            assert not moves or max(m.relative for m in moves) == 0
            assert torch.equal(losses, plain[step])
            controller.loss(losses, reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        assert (np.random.random(), random.random()) == after
    finally:
        controller.detach()


SPEECH_FAMILIES = {  # transformers' speech encoders that draw LayerDrop and SpecAugment's masks from NumPy's generator
    "wav2vec2": (transformers.Wav2Vec2Model, transformers.Wav2Vec2Config, {}),
    "sew": (transformers.SEWModel, transformers.SEWConfig, {"squeeze_factor": 1}),
    "unispeech": (transformers.UniSpeechModel, transformers.UniSpeechConfig, {}),
}


class SpeechLosses(nn.Module):
    """A 2-layer speech encoder drawing LayerDrop (0.5) and SpecAugment's time masks (0.3) itself in training, its
    feature encoder and positional convolution frozen (fine-tuning recipes freeze the former), under a head:
    per-example losses."""

    def __init__(self, family):
        super().__init__()
        model, config, extra = SPEECH_FAMILIES[family]
        self.encoder = model(config(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.5,
            mask_time_prob=0.3, mask_time_length=2, **extra))
        self.encoder.feature_extractor._freeze_parameters()
        self.encoder.encoder.pos_conv_embed.requires_grad_(False)  # weight norm: not what is tested here
        self.head = nn.Linear(8, 2)

    def forward(self, audio):
        return self.head(self.encoder(audio).last_hidden_state).pow(2).mean((1, 2))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("family", sorted(SPEECH_FAMILIES))
def test_a_speech_encoder_drawing_layerdrop_and_specaugment_from_numpy_trains_checked(family, clipping):
    """The check's reruns draw what the forward draws (no move), and the model is not refused (until 2026-12-07 it
    could be, as the NumPy LayerDrop above was, or was checked against the spread of other draws: moves of up to 0.14
    (wav2vec2, with 1.10 of its outputs' size allowed), 0.09 (SEW) and 0.05 (UniSpeech) between draws alone)."""
    torch.manual_seed(0)
    np.random.seed(0)
    model = SpeechLosses(family).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        compared = 0
        for _ in range(5):
            losses = model(torch.randn(4, 200))
            moves = controller.independence.last_moves
            compared += bool(moves)
            assert not moves or max(m.relative for m in moves) == 0
            controller.loss(losses, reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        assert compared >= 3  # forwards 0, 1, 2 and 4 are checked
    finally:
        controller.detach()


class CountsForwards(nn.Module):
    """A buffer that each train() forward increments (harmless: no data in it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.lin(x).squeeze(1)


def test_buffers_are_put_back_after_the_reruns():
    model = CountsForwards().train()
    buffer = model.calls
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a changed buffer (buffers.py)
            losses = model(torch.randn(B, D))
        assert controller.independence.forwards == 1
        # The forward's own tensor (its version as the forward left it), not a rerun's copy, and one increment.
        assert model.calls is buffer and buffer._version == 1 and float(buffer) == 1.0
        controller.loss(losses, reduction="sum").backward()
    finally:
        controller.detach()


def test_a_checked_forward_leaves_the_step_exact():
    """The check leaves the step as it was: each controller checks its first forward, and the clipped sum is the
    per-example loop's."""
    model = Scored(nn.Sequential(nn.Linear(D, 3), nn.Tanh(), nn.Linear(3, D)))
    x, v = torch.randn(B, D), torch.randn(B, D)
    assert_exact(model, lambda: model(x, v), lambda i: model(x[i:i + 1], v[i:i + 1]).sum(), B)


class SequenceFirst(nn.Module):
    """A sequence-first attention layer run on T == B positions: the check's replacement lands on a position, which
    the attention mixes into the others as it should; the layout proof shows the examples on dim 1."""

    def __init__(self):
        super().__init__()
        self.attention = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0)

    def forward(self, x):  # (T, B, d) -> (T, B, d)
        return self.attention(x)


class ReadSequenceFirst(SequenceFirst):
    """The sequence-first attention model with a trained Linear reading its (T, B, d) input first: that Linear's
    proof puts the input's examples on dim 1 (SequenceFirst's, the fallback's proof of its inputs)."""

    def __init__(self):
        super().__init__()
        self.read = nn.Linear(4, 4)

    def forward(self, x):
        return super().forward(self.read(x))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("make", [SequenceFirst, ReadSequenceFirst])
def test_a_sequence_first_model_whose_length_is_the_batch_size_is_checked_on_dim_1_once_the_proof_says_so(clipping,
                                                                                                        make):
    """At T = B the first forward is checked on dim 0, its positions, which attention mixes as it should; the norm
    pass's proof reads the examples on dim 1, where the check runs again, finds nothing and is kept for the next
    forwards (until 2026-12-07 the move on dim 0 was warned of as inconclusive, and every step with T = B went
    unconcluded, mixing or not)."""
    model = make().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        for step in range(2):  # the first and the second forward are checked
            out = model(torch.randn(B, B, 4))
            assert controller.independence._checked.dim == (0 if step == 0 else 1)
            assert (controller.independence.finding is not None) == (step == 0)  # the positions moved each other
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                controller.loss(out.pow(2).mean((0, 2)), reduction="sum").backward()
            assert not [w for w in caught if "could not check" in str(w.message) or "cannot tell" in str(w.message)]
            assert controller.independence.examples_dim == 1
            assert all(p.grad is not None for p in model.parameters())
            model.zero_grad(set_to_none=True)
    finally:
        controller.detach()


class CentredBeforeASequenceFirstLayer(nn.Module):
    """A batch-first model (B, T, d) with T == B: a detached batch mean, then a GRU built with batch_first=False but
    fed (B, T, d), as a model that transposes for it might. The check finds the mean's move and cannot conclude."""

    def __init__(self):
        super().__init__()
        self.centre, self.gru = DetachedCentring(), nn.GRU(D, D)

    def forward(self, x):  # (B, T, D) with T == B
        return self.gru(self.centre(x).transpose(0, 1))[0].transpose(0, 1)


def test_a_move_the_check_cannot_conclude_on_is_warned_of_with_what_it_found():
    model = CentredBeforeASequenceFirstLayer().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.warns(UserWarning, match=r"copying the (first|last) of the 8 examples .* moved the (first|last) "
                                             r"one's output by .* cannot tell whether that is mixing.*"
                                             r"batch_first=False \(gru\)"):
            controller.loss(model(100 * torch.randn(B, B, D)).pow(2).sum((1, 2)), reduction="sum").backward()
    finally:
        controller.detach()


class ReadBeforeCentring(CentredBeforeASequenceFirstLayer):
    """The same, with a trained layer reading the input first: a Linear, whose layout proof puts the examples of
    the input's dim 0 on dim 0, or a module without a rule, whose proof of its inputs does; so the check's
    replacement there replaced examples."""

    def __init__(self, reader):
        super().__init__()
        self.read = nn.Linear(D, D) if reader == "linear" else Gain(D)

    def forward(self, x):  # (B, T, D) with T == B
        return super().forward(self.read(x))


def _assert_square_step_refused(model, x, clipping: str):
    """A step on ``x``, a batch of B examples of B positions (a DP loss of each example's sum of squares), is refused
    as mixing found by a copy of the first or the last example."""
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=r"the model's forward mixes examples where no gradient flows: copying "
                                               r"the (first|last) of the 8 examples"):
            controller.loss(model(x).pow(2).sum((1, 2)), reduction="sum").backward()
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("reader", ["linear", "without a rule"])
def test_a_move_in_a_model_whose_input_a_trained_layer_reads_batch_first_is_refused_also_where_it_is_square(
        clipping, reader):
    """Warned of only (trained, one example moving the others) until late 2026-12-02."""
    model = ReadBeforeCentring(reader).train()
    _assert_square_step_refused(model, 100 * torch.randn(B, B, D), clipping)


class CentredTwoViews(nn.Module):
    """A batch-first model at T == B: the batch and a second view of it in one Linear (2B rows, example e at rows e and
    e + B: layout.TILED_LAYOUT), a detached batch mean taken off the views' sum."""

    def __init__(self):
        super().__init__()
        self.views, self.centre = nn.Linear(D, D), DetachedCentring()

    def forward(self, x):  # (B, T, D) with T == B
        h = self.views(torch.cat([x, x.flip(1)]))
        return self.centre(h[:len(x)] + h[len(x):])


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_move_in_a_model_of_two_views_of_its_batch_is_refused_also_where_it_is_square(clipping):
    """Two views stacked on dim 0 keep the examples on dim 0; only as many views as examples (a sequence-first batch of
    length B flattened) leave the check inconclusive (independence._laid_out_off_dim_0)."""
    model = CentredTwoViews().train()
    _assert_square_step_refused(model, 100 * torch.randn(B, B, D), clipping)


class LookedUpBeforeCentring(CentredBeforeASequenceFirstLayer):
    """The same on token ids (B, T) with T == B, looked up by an Embedding that peft's LoRA adapts (the base frozen,
    as peft leaves it): the adapter's rule (norms/peft_lora.py), tokenwise, proves the ids' examples on dim 0."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, D)

    def forward(self, ids):  # (B, T) with T == B
        return super().forward(self.embed(ids))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_move_in_a_model_whose_ids_an_adapted_embedding_reads_is_refused_also_where_they_are_square(clipping):
    """Warned of only (trained) until 2026-12-03: the adapted Embedding took the fallback, whose input proof cannot
    run on integer ids (the LoRA fuzzer at B = T: seed 335 of 300-699)."""
    import peft
    model = peft.get_peft_model(LookedUpBeforeCentring(), peft.LoraConfig(
        r=2, target_modules=["embed"], init_lora_weights=False)).double().train()
    _assert_square_step_refused(model, torch.randint(0, 11, (B, B)), clipping)


class MixesFromTheThirdForward(DetachedCentring):
    """Keeps the examples apart on its first three forwards, then centres on the batch's detached mean."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, x):
        self.forwards += torch.is_grad_enabled()
        return self.lin(x - x.detach().mean(0, keepdim=True) if self.forwards > 3 else x)


def test_a_forward_that_starts_mixing_later_is_refused_at_the_next_checked_forward():
    """Checked forwards are the layout proof's schedule (0, 1, 2, 4, 8, ...): forward 3 mixes unchecked (see the
    module doc of independence.py), forward 4 is refused."""
    x, v = _neighbouring_batches()[0]
    model = Scored(MixesFromTheThirdForward()).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        for _ in range(4):
            controller.loss(model(x, v), reduction="sum").backward()
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss(model(x, v), reduction="sum").backward()
    finally:
        controller.detach()


class Labelled(nn.Module):
    """An output dict, as transformers' ModelOutput flattens: the refusal names the output that moved."""

    def __init__(self):
        super().__init__()
        self.body = DetachedCentring()

    def forward(self, x):
        return {"logits": self.body(x), "shared": torch.ones(3)}


def test_the_refusal_names_the_output_that_moved():
    x, v = _neighbouring_batches()[0]
    model = Labelled().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=r"output\['logits'\]"):
            controller.loss((model(x)["logits"] * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


@dataclasses.dataclass
class Logits:
    logits: torch.Tensor


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor


class LogitsOfOnesOwn:  # a class with attributes, neither a dataclass nor a namespace
    def __init__(self, logits):
        self.logits = logits


class SlottedLogits:
    __slots__ = ("logits",)

    def __init__(self, logits):
        self.logits = logits


class Returns(nn.Module):
    """DetachedCentring's output returned in ``returns``, which pytree keeps whole (outputs.output_leaves)."""

    def __init__(self, returns):
        super().__init__()
        self.body, self.returns = DetachedCentring(), returns

    def forward(self, x):
        return self.returns(logits=self.body(x))


@pytest.mark.parametrize("returns", [types.SimpleNamespace, Logits, LogitsOfOnesOwn])
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_forward_whose_output_pytree_keeps_whole_is_checked(returns, clipping):
    """Its tensors are found among its attributes: the refusal names the one that moved (trained without a word
    before 2026-12-03, the check comparing nothing)."""
    x, v = _neighbouring_batches()[0]
    model = Returns(returns).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=REFUSED + r".*output\.logits"):
            controller.loss((model(x).logits * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


class ReadsItsBatch(nn.Module):
    """DetachedCentring on the batch it is given in a SimpleNamespace or a dataclass (``batch.x``)."""

    def __init__(self):
        super().__init__()
        self.body = DetachedCentring()

    def forward(self, batch):
        return self.body(batch.x)


@pytest.mark.parametrize("make_batch", [lambda x: types.SimpleNamespace(x=x), Inputs], ids=["namespace", "dataclass"])
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_forward_whose_batch_comes_in_an_object_pytree_keeps_whole_is_checked(make_batch, clipping):
    """The reruns replace the examples inside copies of that object (leaves.flatten and unflatten): trained without
    a word before 2026-12-03, the check finding no tensor to replace."""
    x, v = _neighbouring_batches()[0]
    model = ReadsItsBatch().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss((model(make_batch(x)) * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


def test_a_forward_whose_output_holds_no_tensor_with_the_batch_on_dim_0_is_warned_of_once():
    model = Returns(SlottedLogits).train()
    x, v = _neighbouring_batches()[0]
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.warns(UserWarning, match=r"could not check that the model's forward keeps the examples apart "
                          r"where no gradient flows: no tensor of its output has 8 rows on dim 0.*"
                          r"output: not a tensor\).*Fix: keep the examples on dim 0"):
            controller.loss((model(x).logits * v).sum(1), reduction="sum").backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            controller.loss((model(x).logits * v).sum(1), reduction="sum").backward()  # checked again: not warned
    finally:
        controller.detach()


class PooledSequenceFirst(nn.Module):
    """A sequence-first encoder layer on (T, B, d), its last position's output, (B, 2): dim 0 of the input is T."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.layer(x)[-1])


def test_a_sequence_first_model_whose_output_is_batch_first_is_checked_on_dim_1():
    """Its batch_first=False layer and the (T, B, d) call it gets put the examples on dim 1 of the input and dim 0 of
    the (B, 2) output, where the check compares them (unchecked and warned of before 2026-12-03, when it replaced rows
    of dim 0, the positions; tests/clipping/test_sequence_first_independence.py has the refusals)."""
    model = PooledSequenceFirst().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(torch.randn(3, 5, 4))
            assert [move.output for move in controller.independence.last_moves] == [0, 0]  # both replacements
            assert controller.independence.finding is None
            controller.loss(out.pow(2).sum(1), reduction="sum").backward()
        assert not [w for w in caught if "could not check" in str(w.message)]
        assert controller.independence.examples_dim == 1
    finally:
        controller.detach()


class FromLists(nn.Module):
    """A forward that takes its batch as Python lists (or a tensor) and makes the tensor itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, rows):
        return self.lin(torch.as_tensor(rows, dtype=self.lin.weight.dtype)).squeeze(1)


def test_a_forward_whose_arguments_hold_no_tensor_is_warned_of_once_and_an_empty_batch_is_not():
    model = FromLists().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.warns(UserWarning, match=r"could not check.*its arguments hold no tensor with a dim \(float\), "
                          r"so the check cannot replace the batch's examples.*Fix: pass the batch as tensors"):
            controller.loss(model(torch.randn(B, D).tolist()), reduction="sum").backward()
    finally:
        controller.detach()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            controller.loss(model(torch.empty(0, D)), reduction="sum").backward()  # Poisson sampling drew none
        assert not [w for w in caught if "could not check" in str(w.message)], [str(w.message) for w in caught]
    finally:
        controller.detach()


class WithAnEncodeMethod(nn.Module):
    """DetachedCentring and a head, also reached through a method of the model's own (``encode``)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = DetachedCentring(), nn.Linear(D, D)

    def forward(self, x):
        return self.encode(x)

    def encode(self, x):
        return self.head(self.body(x))


class Encoder(nn.Module):
    """The fix the warning names: a module whose forward is the method called, the model its submodule."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.encode(x)


OUTSIDE = {"a method": lambda model, x: model.encode(x), "its parts": lambda model, x: model.head(model.body(x))}


@pytest.mark.parametrize("called", sorted(OUTSIDE))
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_forward_outside_the_model_s_own_is_warned_of_once_and_the_fix_is_checked(called, clipping):
    """The check reruns the model's forward: layers called through a method or one by one went unseen, and a forward
    that mixed examples without gradient trained without a word before 2026-12-03."""
    x, v = _neighbouring_batches()[0]
    model = WithAnEncodeMethod().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.warns(UserWarning, match=r"could not check.*module 'body.lin' trained in a forward that ran "
                          r"outside the forward of the model ghostdp was given \(WithAnEncodeMethod\).*Fix: call the "
                          r"model itself.*or give ghostdp a module whose forward is what you call"):
            controller.loss((OUTSIDE[called](model, x) * v).sum(1), reduction="sum").backward()
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            controller.loss((OUTSIDE[called](model, x) * v).sum(1), reduction="sum").backward()  # once
    finally:
        controller.detach()
    wrapped = Encoder(model)
    controller = ghostdp.GhostClipping(wrapped, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss((wrapped(x) * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


def test_a_forward_outside_the_model_s_own_is_not_warned_of_with_the_check_switched_off():
    x, v = _neighbouring_batches()[0]
    model = WithAnEncodeMethod().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.independence.every = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            controller.loss((model.encode(x) * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


class RefusesToRunWithoutGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        if not torch.is_grad_enabled():
            raise RuntimeError("this model runs only with gradient")
        return self.lin(x).squeeze(1)


def test_a_forward_that_cannot_run_again_is_warned_of_once_and_trains():
    model = RefusesToRunWithoutGradient().train()
    x = torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        message = RERUN_FAILED.split("{")[0]
        with pytest.warns(UserWarning, match=message):
            controller.loss(model(x), reduction="sum").backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            controller.loss(model(x), reduction="sum").backward()  # forward 1 is checked too: no second warning
        assert model.lin.weight.grad is not None
    finally:
        controller.detach()


class GivesEveryExampleOneOfThem(nn.Module):
    """Every example plus a Linear of one example's input (``which``: the first or the last): a prefix or an anchor
    taken from the batch. The inputs carry no gradient, so no layout proof sees it; until 2026-12-02 the check
    replaced only the last example, and the first one's trained with its clipped sum 0.5 of its size off."""

    def __init__(self, which: int):
        super().__init__()
        self.lin, self.which = nn.Linear(D, D), which

    def forward(self, x):
        return x + self.lin(x[self.which].unsqueeze(0))


@pytest.mark.parametrize("batch", [2, B])
@pytest.mark.parametrize("which", [0, -1])
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_one_examples_input_given_to_every_example_is_refused(batch, which, clipping):
    """The first example copied to every row moves the first one's output where the last is given to all, and the last
    copied moves the last one's where the first is (module doc)."""
    given = 0 if which == 0 else batch - 1  # the example the others get: a far-off one moves all their gradients
    _assert_refused_where_one_example_moves_the_others(lambda: GivesEveryExampleOneOfThem(which), batch, given, 0.5,
                                                       clipping, REFUSED)


def _assert_refused_where_one_example_moves_the_others(make_body, batch: int, mover: int, least: float,
                                                      clipping: str, match: str):
    """Scored(make_body()), built after seeding, on ``batch`` examples: example ``mover`` moved far off moves the
    others' clipped sum by more than ``least`` (the test is not degenerate), and the step is refused (``match``)
    without writing gradients."""
    torch.manual_seed(0)
    model = Scored(make_body()).train()
    x, v = torch.randn(batch, D), 100 * torch.randn(batch, D)
    far = x.clone()
    far[mover] = 1e3
    kept = [i for i in range(batch) if i != mover]
    moved = (clipped_sum_through_the_batch(model(x, v)[kept], list(model.parameters()))
             - clipped_sum_through_the_batch(model(far, v)[kept], list(model.parameters())))
    assert float(moved.norm()) > least, f"degenerate test: example {mover} does not move the others' clipped sum"
    _assert_step_refused(model, x, v, clipping, match)


class TheSecondGetsTheThirds(nn.Module):
    """The second example gets something of the third's input (which carries no gradient): neither the first example's
    output nor the last's depends on another example, and with four or more, no example depends on the last one. Before
    late 2026-12-02 it trained (the check compared the first example, the last, and the others without the last in
    their rows); the removal's rerun now also reverses the others' order."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return torch.tanh(torch.cat([y[:1], y[1:2] + torch.sin(3 * x[2:3]), y[2:]]))


@pytest.mark.parametrize("batch", [4, B])
@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_middle_example_given_something_of_another_is_refused(batch, clipping):
    _assert_refused_where_one_example_moves_the_others(TheSecondGetsTheThirds, batch, 2, 0.2, clipping,
                                                       REFUSED + ".*reversing the others' order")


class MaskedByTheFirst(nn.Module):
    """Every example's output masked where the first example's input is not positive, without gradient. Where the
    others share the first's signs but the second, copying the first or the last to every row, and removing the last,
    leave the mask as it is; removing the first moves it. Trained before 2026-12-07 (the fuzzer's third generation of
    blocks, at B = T: a mask from the first example's data)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x) * (x.detach()[:1] > 0)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_statistic_that_only_removing_the_first_example_moves_is_refused(clipping):
    torch.manual_seed(0)
    model = Scored(MaskedByTheFirst()).train()
    x, v = torch.rand(5, D) + 0.1, 100 * torch.randn(5, D)
    x[1] = -x[1]  # the second example's signs differ from the first's: the others' share them
    params = list(model.parameters())
    moved = (clipped_sum_through_the_batch(model(x, v)[2:], params)
             - clipped_sum_through_the_batch(model(x[1:], v[1:])[1:], params))
    assert float(moved.norm()) > 0.5, "degenerate test: removing the first example does not move the others' sum"
    _assert_step_refused(model, x, v, clipping, REFUSED + ": removing the first of the 5 examples")


class CapacityOfTheBatch(nn.Module):
    """Expert-choice routing's capacity: of all the batch's (B, 2) tokens, the B with the highest score (feature 0)
    pass through a Linear and the others are zeroed; the choice carries no gradient, and which tokens are kept depends
    on every example's scores."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):  # (B, 2, D)
        flat = self.lin(x).reshape(-1, D)
        kept = x.detach().reshape(-1, D)[:, 0].topk(len(x)).indices
        return torch.zeros_like(flat).index_copy(0, kept, flat[kept]).reshape(x.shape).sum(1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_capacity_that_only_removing_the_middle_example_moves_is_refused(clipping):
    """Five examples of two tokens, the capacity five: the first, the second and the last hold one kept token each,
    the middle one two, the fourth none. Copying the first or the last to every row keeps each copy one token; removing
    the first, the last or (reversed) any of them frees a slot its own token held; removing the middle one frees two,
    and the last example's second token is kept: only that removal moves another example."""
    torch.manual_seed(0)
    model = Scored(CapacityOfTheBatch()).train()
    x, v = torch.randn(5, 2, D), 100 * torch.randn(5, D)
    scores = [(9, 1), (8, 2), (7, 6), (0.5, 0.4), (5, 3)]  # kept: 9, 8, 7, 6, 5
    x[..., 0] = torch.tensor(scores, dtype=x.dtype)
    x[4, 1, 1:] = 100 * x[4, 1, 1:].sign()  # the last example's second token, kept without the middle example
    params = list(model.parameters())
    others = without = [0, 1, 3, 4]  # (the batch without the middle example: its rows are the others')
    moved = (clipped_sum_through_the_batch(model(x, v)[others], params)
             - clipped_sum_through_the_batch(model(x[without], v[without]), params))
    assert float(moved.norm()) > 0.5, "degenerate test: removing the middle example does not move the others' sum"
    _assert_step_refused(model, x, v, clipping, REFUSED + r": removing example 2 \(from 0\) of the 5 examples")


class OffsetByRow(nn.Module):
    """A Linear plus a fixed offset for each row the example lies in: no example reads another's data, but removing
    one from a batch moves the examples after it to other rows, and so their gradients."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("offsets", torch.randn(B, D))

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.offsets[:len(x)])


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_forward_that_treats_an_example_by_its_row_is_refused(clipping):
    model = Scored(OffsetByRow()).train()
    x, v = torch.randn(B, D), 100 * torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match=REFUSED + ".*reversing the others' order"):
            controller.loss(model(x, v), reduction="sum").backward()
    finally:
        controller.detach()


def test_a_batch_of_one_is_not_rerun():
    model = CountsForwards().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calls = []
            model.register_forward_hook(lambda *_: calls.append(1))
            controller.loss(model(torch.randn(1, D)), reduction="sum").backward()
        assert calls == [1]
    finally:
        controller.detach()


class OffsetPerRow(nn.Module):
    """A Linear plus a fixed offset for each row of a batch of 8: runs on 8 examples only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("offsets", torch.randn(B, D))

    def forward(self, x):
        return self.lin(x) + self.offsets


def test_a_forward_that_takes_only_its_batch_size_is_checked_without_the_removal():
    """The removal's rerun fails (a buffer of the batch's size); the replacement is still checked, silently."""
    model = OffsetPerRow().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller.loss(model(torch.randn(B, D)).pow(2).sum(1)).backward()
    assert controller.independence.last_moves and controller.independence.last_removal_moves == []
    controller.detach()


class QueueOfFeatures(nn.Module):
    """As MoCo: each example's features against a queue of earlier batches' features, kept as a plain attribute
    and updated by every training forward (``how``: replaced, or written in place), or set once, from the first
    training batch, and kept (a bank of the first examples' features; no attribute before)."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.how = nn.Linear(D, D), how
        if how != "set once":
            self.queue = torch.zeros(2 * B, D)

    def forward(self, x):
        h = self.lin(x)
        if "queue" not in self.__dict__:
            if self.training:
                self.queue = torch.cat([h.detach(), h.detach()])
            return torch.cat([h, torch.zeros(len(x), 2 * B)], 1)
        scores = h @ self.queue.clone().T  # a copy, as MoCo takes: the queue changes before the backward
        if self.training and self.how == "in place":
            with torch.no_grad():
                self.queue.copy_(torch.cat([self.queue[B:], h.detach()]))
        elif self.training and self.how == "replaced":
            self.queue = torch.cat([self.queue[B:], h.detach()])
        return torch.cat([h, scores], 1)


@pytest.mark.parametrize("how", ["replaced", "in place", "set once"])
def test_a_queue_of_features_kept_as_an_attribute_is_warned_of_and_the_reruns_leave_it(how):
    """Later steps' gradients read earlier examples (the queue): warned of by name, on the checked forwards; the
    reruns, which run before the forward, update the queue too (or set it), and what training keeps is what it
    would keep without them: an attribute a rerun set is removed again, so that the forward sets it and is
    warned of."""
    def train(checks: bool):
        torch.manual_seed(0)
        model = QueueOfFeatures(how).train()
        controller = ghostdp.GhostClipping(model, 1.0)
        if not checks:
            controller.independence.every = 0
        g = torch.Generator().manual_seed(9)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                optimizer.zero_grad()
                controller.loss(model(torch.randn(B, D, generator=g)).pow(2).sum(1)).backward()
                optimizer.step()
        controller.detach()
        warned = [str(w.message) for w in caught if "module attribute 'queue'" in str(w.message)]
        return model.queue.clone(), model.lin.weight.detach().clone(), warned

    with_checks, without = train(True), train(False)
    assert len(with_checks[2]) == 1 and "MoCo" in with_checks[2][0] and without[2] == []
    assert torch.equal(with_checks[0], without[0]) and torch.equal(with_checks[1], without[1])


class ChoosesAKernelForTheBatch(nn.Module):
    """Rounds its output to float32 where no example is masked (as transformers drops an attention mask that is
    all ones, and another kernel rounds otherwise): the batch decides how, not what, each example computes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, mask):
        y = self.lin(x)
        return y.float().double() if bool(mask.all()) else y


def test_a_kernel_chosen_for_the_whole_batch_is_not_mixing(monkeypatch):
    """The replaced last example (masked) makes the mask all ones: the others' outputs move by float32's rounding,
    under the relative floor. Without the floor the same move is refused, so the test sees a real move."""
    from ghostdp.clipping import independence
    model = ChoosesAKernelForTheBatch().train()
    x, v, mask = torch.randn(B, D), torch.randn(B, D), torch.ones(B, dtype=torch.bool)
    mask[-1] = False
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss((model(x, mask) * v).sum(1), reduction="sum").backward()
        monkeypatch.setattr(independence, "relative_floor", lambda dtype: 0.0)
        controller.independence.forwards = 0  # the next forward is checked
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss((model(x, mask) * v).sum(1), reduction="sum").backward()
    finally:
        controller.detach()


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x):  # the checkpoint's input is an activation: it requires grad in training only
        return self.c(checkpoint(self.b, self.a(x), use_reentrant=True)).squeeze(1)


def test_the_reruns_of_a_reentrant_checkpoint_do_not_warn_of_inputs_without_grad():
    """torch's reentrant checkpoint warns where none of its inputs requires grad, as in every rerun without
    gradient: the training forward, whose checkpoint's input does, warns of nothing, and neither do its reruns."""
    model = ReentrantCheckpoint().train()
    x = torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            losses = model(x)
        assert controller.independence.forwards == 1 and controller.independence.finding is None
        controller.loss(losses, reduction="sum").backward()
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_training_with_the_checks_is_bitwise_training_without_them(clipping):
    """A BERT with dropout and padding, five steps of DP-SGD from one seed: the checked forwards (0, 1, 2, 4)
    leave the generators, the buffers and so every parameter exactly as training without the checks would."""
    from transformers import BertConfig, BertForSequenceClassification
    from conftest import without_forward_checks

    def train(checks: bool):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=16, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2,
            num_labels=3)).train()
        controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
        if not checks:
            without_forward_checks(controller)
        reruns = []
        model.register_forward_pre_hook(lambda *_: None if torch.is_grad_enabled() else reruns.append(1))
        g = torch.Generator().manual_seed(1)
        ids, mask = torch.randint(1, 30, (B, 8), generator=g), torch.ones(B, 8, dtype=torch.long)
        mask[-1, 5:] = 0
        labels = torch.randint(0, 3, (B,), generator=g)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(5):
            optimizer.zero_grad()
            logits = model(input_ids=ids, attention_mask=mask).logits
            controller.loss(torch.nn.functional.cross_entropy(logits, labels, reduction="none")).backward()
            optimizer.step()
        controller.detach()
        return model.state_dict(), len(reruns), torch.rand(3)

    with_checks, without = train(True), train(False)
    # forwards 0, 1, 2 and 4 checked: three reruns each (the batch, and the first or the last example copied to
    # every row), and five in eval() mode (the batch, the batch without its last example, without its first, without
    # its middle one, the batch padded further: clipping/padding.py)
    assert with_checks[1] == 32 and without[1] == 0
    assert all(torch.equal(with_checks[0][k], without[0][k]) for k in without[0])
    assert torch.equal(with_checks[2], without[2])  # the global generator's stream too


class DrawsOnlyWithGradient(nn.Module):
    """Draws random numbers in a training forward only: its reruns leave the generator elsewhere than the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        if torch.is_grad_enabled():
            x = x + 0.0 * torch.rand(x.shape)
        return self.lin(x).squeeze(1)


def test_the_generators_are_left_where_the_forward_left_them():
    model = DrawsOnlyWithGradient().train()
    x = torch.randn(B, D)
    torch.manual_seed(3)
    model(x)
    after_forward = torch.rand(4)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        torch.manual_seed(3)
        model(x)  # checked, its reruns draw nothing
        assert torch.equal(torch.rand(4), after_forward)
    finally:
        controller.detach()


def test_book_keeping_keeps_its_one_backward_on_a_checked_forward():
    """A trained layer run without gradient in train() mode reads as a checkpoint's forward to book-keeping
    (recording.py), which then takes two passes: the reruns' own such calls leave that flag as it was."""
    model = Scored(nn.Sequential(nn.Linear(D, 3), nn.Tanh(), nn.Linear(3, D))).train()
    x, v = torch.randn(B, D), torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    try:
        controller.ledger.open()
        losses = model(x, v)
        assert controller.independence.forwards == 1  # checked
        controller.loss(losses, reduction="sum").backward()
        assert controller.ledger.records[-1].one_backward  # one backward: book-keeping wrote the clipped sums itself
    finally:
        controller.detach()


def test_a_finding_waits_for_the_norm_pass_through_another_forward():
    """Two forwards per step (two views of each example, as contrastive training takes): the first is checked and
    mixes, the second is not checked; their DP loss is refused."""
    x, v = _neighbouring_batches()[0]
    model = Scored(DetachedCentring()).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.independence.forwards = 4  # forward 4 is checked, forward 5 is not
        first, second = model(x, v), model(x + 0.1, v)
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.loss(first + second, reduction="sum").backward()
    finally:
        controller.detach()


def test_the_switch_the_refusal_names_turns_the_check_off():
    """The refusal tells a user whose model keeps its examples apart but moves by more than rounding allows (a GPU's
    16-bit kernels chosen by the batch's content) to set controller.independence.every = 0: that switch works."""
    x, v = _neighbouring_batches()[0]
    model = Scored(DetachedCentring()).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=r"controller\.independence\.every = 0"):
            controller.loss(model(x, v), reduction="sum").backward()
        controller.independence.every = 0
        model.zero_grad(set_to_none=True)
        controller.loss(model(x, v), reduction="sum").backward()
        assert model.body.lin.weight.grad is not None
    finally:
        controller.detach()



class FrozenWideThenTrained(nn.Module):
    """A frozen wide MLP (its intermediate only transient: no gradient flows there), then trained layers that save
    their inputs (what a step keeps through its backward)."""

    def __init__(self, d_in=8, d=64, wide=1024, layers=4):
        super().__init__()
        self.up, self.down = nn.Linear(d_in, wide).requires_grad_(False), nn.Linear(wide, d).requires_grad_(False)
        self.trained = nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x):
        return self.trained(self.down(torch.relu(self.up(x)))).sum(1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_checked_forward_peaks_no_higher_than_an_unchecked_one(clipping):
    """Exact tensor bytes: the reruns run before the training forward, so their largest temporaries never lie
    beside the activations it saves. Run after the forward (before 2026-11-26), a checked step peaked at 1.13x an
    unchecked one here, and a Llama-shaped LoRA model's proof steps at 1.17x plain against 1.06x between them
    (profiling.bench --model llama-lora --layers 2 --hidden 256 --seq 256 --batches 8)."""
    from profiling.bench import tensor_peak_mb
    torch.manual_seed(0)
    model = FrozenWideThenTrained().float()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    x = torch.randn(8, 64, 8, dtype=torch.float32)

    def step():
        model.zero_grad(set_to_none=True)
        controller.loss(model(x).sum(1)).backward()

    for _ in range(5):  # norm passes 0-4: the scheduled proofs and checks (0, 1, 2, 4) are behind
        step()
    tensor_peak_mb(step)  # pass 5, profiled so that the next reads are right (bench.steady_and_proof_peaks)
    unchecked = tensor_peak_mb(step)  # pass 6
    with controller.independence.checking_every_forward():
        checked = tensor_peak_mb(step)  # pass 7: checked, no layout proof
    assert controller.independence.last_moves, "the forward was not checked"
    assert checked <= 1.05 * unchecked, (checked, unchecked)


class ScalesItsInputInPlace(nn.Module):
    """Scales its input in place (as a forward that normalises pixel values in the batch tensor itself), and keeps
    what each training forward received."""

    def __init__(self):
        super().__init__()
        self.lin, self.received = nn.Linear(D, D), []

    def forward(self, x):
        if torch.is_grad_enabled():
            self.received.append(x.clone())
        with torch.no_grad():
            x.mul_(0.5)
        return self.lin(x)


def test_the_reruns_leave_the_batch_as_the_forward_receives_it():
    """The reruns run before the forward (since 2026-11-26) on copies of its arguments: a forward that changes
    its input in place would otherwise train on a batch the reruns had already changed."""
    model = ScalesItsInputInPlace()
    controller = ghostdp.GhostClipping(model, 1.0)
    x = torch.randn(B, D)
    given = x.clone()
    controller.loss(model(x).pow(2).sum(1)).backward()
    assert controller.independence.last_moves, "the forward was not checked"
    assert len(model.received) == 1 and torch.equal(model.received[0], given)
    assert torch.equal(x, given * 0.5)  # the forward's own change, once


class ScalesByTheNextOfAnIterator(nn.Module):
    """Takes an iterator beside its batch and consumes one item of it per call."""

    def __init__(self):
        super().__init__()
        self.lin, self.used = nn.Linear(D, D), []

    def forward(self, x, scales):
        scale = next(scales)
        if torch.is_grad_enabled():
            self.used.append(scale)
        return self.lin(x) * scale


def test_a_forward_that_takes_an_iterator_is_warned_of_and_not_rerun():
    """A rerun, which runs before the forward since 2026-11-26, would consume the iterator's items that the
    forward is given: it is not rerun (warned of once, RERUN_FAILED), and the forward takes the first item."""
    model = ScalesByTheNextOfAnIterator()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.warns(UserWarning, match=r"could not check.*an argument of the model's forward is an iterator"):
        controller.loss(model(torch.randn(B, D), iter([2.0, 3.0, 5.0, 7.0, 11.0])).pow(2).sum(1)).backward()
    assert model.used == [2.0]


class MovesItsWeightInEval(nn.Module):
    """A forward that, in eval() mode only, moves its weight by its batch's mean (a step no clipping bounds)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        if not self.training:
            with torch.no_grad():
                self.lin.weight.add_(x.mean())
        return self.lin(x)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_weight_the_reruns_move_and_leave_moved_is_refused(clipping):
    """The check's reruns in eval() mode ran such a forward, and the training forward then read the weight they had
    moved by their batches (examples removed): trained before 2026-12-08, a model moved outside DP."""
    torch.manual_seed(0)
    model = MovesItsWeightInEval()
    weight = model.lin.weight.detach().clone()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        x = torch.randn(4, D)
        with pytest.raises(RuntimeError, match=r"changed parameter\(s\) 'lin.weight' in place \(or replaced them\) "
                                               r"while ghostdp's forward check reran its forward.*did not put them back"):
            controller.loss(model(x).pow(2).sum(1), reduction="sum").backward()
        assert model.lin.weight.grad is None
        assert not torch.equal(model.lin.weight, weight)  # moved, as the message says: build the model again
    finally:
        controller.detach()


def _rwkv(rescale_every):
    torch.manual_seed(0)
    return transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=3, attention_hidden_size=16, intermediate_size=24,
        context_length=16, rescale_every=rescale_every))


def _rwkv_losses(model, ids):
    def losses(sl):
        logits = model(input_ids=ids[sl]).logits
        return ghostdp.per_example_loss(nn.CrossEntropyLoss(), logits[:, :-1], ids[sl][:, 1:])
    return losses


def test_rwkv_rescaling_its_weights_for_inference_trains_exactly():
    """RWKV with rescale_every = 1 divides block k's output weights by 2^k in eval() mode and multiplies them back
    in train() mode: the check's eval() reruns move them, its train() reruns put them back, and the step is
    exact (a weight changed by the reruns is compared by its norms, not its version)."""
    model, ids = _rwkv(1), torch.randint(0, 30, (3, 5))
    losses = _rwkv_losses(model, ids)
    weights = [p.detach().clone() for p in model.parameters()]
    assert_exact(model, lambda: losses(slice(None)), lambda i: losses(slice(i, i + 1)).sum(), 3, rtol=1e-6)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("checked", [True, False], ids=["checked step", "unchecked step"])
def test_rwkv_after_an_evaluation_is_refused_naming_rescale_every(checked):
    """An evaluation between steps leaves RWKV's weights rescaled. On a checked step the check's train() rerun
    rescales them back in place, on another the training forward does: refused either way (a parameter moved by the
    reruns, or inside a training forward), the message naming the fix."""
    model, ids = _rwkv(1), torch.randint(0, 30, (3, 5))
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.independence.every = 1 if checked else 0
    try:
        with torch.no_grad():
            model.eval()(input_ids=ids)
        model.train()
        changed = "reran its forward" if checked else "changed in place during a training forward"
        with pytest.raises(RuntimeError, match=changed + r".*RWKV.*config.rescale_every = 0"):
            controller.loss(_rwkv_losses(model, ids)(slice(None))).backward()
    finally:
        controller.detach()
