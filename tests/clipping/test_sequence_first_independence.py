"""The forward check on a sequence-first batch (clipping/independence.py: examples_dim_and_batch, learn_from).

A model fed (T, B, ...) tensors (torch's Transformer and recurrent layers with their default batch_first=False) holds
its examples on dim 1. Until 2026-12-03 the check replaced rows of dim 0, positions, took the batch to be T, and at the
norm pass, whose losses number B, dropped what it found: such a forward that mixed its examples without gradient
trained without a word. The check now takes dim 1 where the model has sequence-first layers (put right by the calls
those layers receive), or where an earlier norm pass found the examples there, and compares each output on the dim
that holds them ((T, B, ...) or pooled (B, ...)).
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import ghostdp
from conftest import (CLIPPING_MODES, assert_exact, clipped_sum, clipped_sum_through_the_batch,
                      reference_per_example_grads)

REFUSED = "the model's forward mixes examples where no gradient flows"
UNSURE = ("could not check", "cannot tell whether")
T, B, D = 5, 4, 6  # no two alike: a tensor with another dim of the batch's size is inconclusive


def centred_on_the_batch(h):
    """h (T, B, d) minus its detached mean over the batch (dim 1): every example moved by the others' data."""
    return h - h.detach().mean(1, keepdim=True)


class SequenceFirstEncoder(nn.Module):
    """A Linear, optionally the batch's detached mean taken off, a sequence-first encoder (attention or LSTM), a head
    on every position (T, B, 2) or on the last one (B, 2)."""

    def __init__(self, layer="attention", mix=False, pooled=False, classes=2):
        super().__init__()
        self.read = nn.Linear(D, D)
        self.layer = (nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0) if layer == "attention"
                      else nn.LSTM(D, D))
        self.head = nn.Linear(D, classes)
        self.mix, self.pooled = mix, pooled

    def forward(self, x, padding_mask=None):  # x (T, B, D); padding_mask (B, T), True at padding
        h = self.read(x)
        if self.mix:
            h = centred_on_the_batch(h)
        if isinstance(self.layer, nn.LSTM):
            h = self.layer(h)[0]
        else:
            h = self.layer(h, src_key_padding_mask=padding_mask)
        return self.head(h[0] if self.pooled else h)


def losses_of(out, pooled):
    return out.pow(2).sum(1) if pooled else out.pow(2).sum((0, 2))


def step(controller, model, x, pooled, **kwargs):
    controller.loss(losses_of(model(x, **kwargs), pooled), reduction="sum").backward()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("layer", ["attention", "lstm"])
@pytest.mark.parametrize("pooled", [False, True])
def test_a_sequence_first_forward_that_mixes_without_gradient_is_refused_at_its_first_step(clipping, layer, pooled):
    model = SequenceFirstEncoder(layer, mix=True, pooled=pooled).train()
    x = torch.randn(T, B, D)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exact per-example fallback")  # torch's attention
            with pytest.raises(RuntimeError, match=REFUSED + r".*\(on dim 1 of its tensors: a sequence-first batch\)"):
                step(controller, model, x, pooled)
        assert all(p.grad is None for p in model.parameters()), "a refused step wrote gradients"
    finally:
        controller.detach()


def test_the_mixing_refused_moves_the_others_clipped_sum_by_more_than_c():
    """Not a degenerate model: one example changed moves the clipped sum of the other three by more than C = 1."""
    model = SequenceFirstEncoder("lstm", mix=True).train()
    params = [p for p in model.parameters()]
    x = 3 * torch.randn(T, B, D)
    changed = x.clone()
    changed[:, -1] = 3 * torch.randn(T, D) + 5
    kept = slice(0, B - 1)
    first, second = (clipped_sum_through_the_batch(losses_of(model(batch), False)[kept], params)
                     for batch in (x, changed))
    assert float((first - second).norm()) > 1.0


@pytest.mark.parametrize("layer", ["attention", "lstm"])
@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("length", [T, B])
def test_a_sequence_first_forward_that_keeps_its_examples_apart_is_checked_and_exact(layer, pooled, length):
    """Checked on dim 1 without a warning (pooled to (B, 2) it went unchecked before, warned of), and exact against
    the per-example loop; the attention's (B, T) padding mask is replaced on its dim 0, or, at T = B, left as it is
    (replacements.argument_dims). At T = B the first forward is checked along its positions, which the model mixes
    as it should, and again on dim 1 once the norm pass's proof has placed the examples there (before 2026-12-07
    warned of as inconclusive on every step)."""
    model = SequenceFirstEncoder(layer, pooled=pooled).train()
    x = torch.randn(length, B, D)
    kwargs = {}
    if layer == "attention":
        padding_mask = torch.zeros(B, length, dtype=torch.bool)
        padding_mask[1, -2:] = padding_mask[3, -1] = True
        kwargs = {"padding_mask": padding_mask}
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # forwards 0 and 1 are both checked
                step(controller, model, x, pooled, **kwargs)
                moves = controller.independence.last_moves  # the check's on dim 1, the forward's own or again
                assert moves, "the check compared nothing"
                assert not any(move.exceeds for move in moves), moves
                model.zero_grad(set_to_none=True)
        unsure = [str(w.message) for w in caught if any(u in str(w.message) for u in UNSURE)]
        assert not unsure, unsure
        assert controller.independence.examples_dim == 1
    finally:
        controller.detach()

    def example(i):
        return {k: v[i:i + 1] for k, v in kwargs.items()}

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*exact per-example fallback")
        assert_exact(model, lambda: losses_of(model(x, **kwargs), pooled),
                     lambda i: losses_of(model(x[:, i:i + 1], **example(i)), pooled).sum(), B)


@pytest.mark.parametrize("mix", [False, True])
def test_a_pooled_output_with_as_many_classes_as_examples_is_compared_on_both_dims(mix):
    """(B, C) at C = B: dim 0 or dim 1 of the output may hold the examples, and the other compares classes, which
    move with any example. Compared on both, a move counts where both moved (replacements.OutputViews): an exact
    LSTM classifier trains checked, one that mixes is refused (until 2026-12-07 such an output was left out, warned
    of as unchecked, after comparing the classes alone had refused an exact one in the sensitivity audit)."""
    model = SequenceFirstEncoder("lstm", mix=mix, pooled=True, classes=B).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mix:
                with pytest.raises(RuntimeError, match=REFUSED):
                    step(controller, model, torch.randn(T, B, D), pooled=True)
            else:
                step(controller, model, torch.randn(T, B, D), pooled=True)
                assert controller.independence.last_moves
                assert all(p.grad is not None for p in model.parameters())
        unsure = [str(w.message) for w in caught if any(u in str(w.message) for u in UNSURE)]
        assert not unsure, unsure
    finally:
        controller.detach()


class CentresThenTransposesForAGRU(nn.Module):
    """A batch-first model (B, T, d), T != B: a detached batch mean, then a GRU built sequence-first that it
    transposes for. The sequence-first layer suggests dim 1; the GRU's own calls show the batch on dim 0."""

    def __init__(self):
        super().__init__()
        self.read, self.gru = nn.Linear(D, D), nn.GRU(D, D)

    def forward(self, x):  # (B, T, D)
        h = self.read(x)
        return self.gru((h - h.detach().mean(0, keepdim=True)).transpose(0, 1))[0].transpose(0, 1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_batch_first_model_that_transposes_for_a_sequence_first_layer_is_checked_on_dim_0(clipping):
    model = CentresThenTransposesForAGRU().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exact per-example fallback")
            with pytest.raises(RuntimeError, match=r"copying the (first|last) of the 4 examples to every other row of "
                                                   r"the batch moved"):
                controller.loss(model(torch.randn(B, T, D)).pow(2).sum((1, 2)), reduction="sum").backward()
    finally:
        controller.detach()


class SequenceFirstLinears(nn.Module):
    """Sequence-first (T, B, d) with no batch_first=False layer to say so: Linears, the batch's detached mean."""

    def __init__(self, mix=True):
        super().__init__()
        self.read, self.head = nn.Linear(D, D), nn.Linear(D, 1)
        self.mix = mix

    def forward(self, x):
        h = self.read(x)
        return self.head(centred_on_the_batch(h) if self.mix else h)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_in_a_loop_of_ones_own_a_sequence_first_model_is_refused_at_its_first_step(clipping):
    """Nothing before the losses says where the examples lie: the first forward is checked on dim 0 (its positions);
    the DP loss, given B losses, finds B on dim 1 and checks the forward again there, before its backward, which
    refuses it before any update (until 2026-12-07 the first step trained and the second was refused)."""
    torch.manual_seed(0)
    model = SequenceFirstLinears().train()
    before = [p.detach().clone() for p in model.parameters()]
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        out = model(torch.randn(T, B, D))
        assert controller.independence._checked.dim == 0  # the guess: the positions
        with pytest.raises(RuntimeError, match=REFUSED + r".*on dim 1 of its tensors"):
            controller.loss(out.pow(2).sum((0, 2)), reduction="sum").backward()
        assert controller.independence.examples_dim == 1
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    finally:
        controller.detach()


def test_the_norm_pass_alone_rechecks_a_guessed_forward():
    """per_example_norms without the DP loss: the recheck runs at the norm pass."""
    torch.manual_seed(0)
    model = SequenceFirstLinears().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=REFUSED):
            controller.per_example_norms(model(torch.randn(T, B, D)).pow(2).sum((0, 2)))
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_in_a_loop_of_ones_own_a_sequence_first_model_that_keeps_its_examples_apart_trains_checked(clipping):
    """The recheck on dim 1 compares (its moves are kept) and finds nothing; the step trains exactly (the gradients
    equal each example's own, clipped, as without the recheck: it put the generators and buffers back)."""
    torch.manual_seed(0)
    model = SequenceFirstLinears(mix=False).double().train()
    reference = copy.deepcopy(model)
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    x = torch.randn(T, B, D, dtype=torch.float64)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            controller.loss(model(x).pow(2).sum((0, 2)), reduction="sum").backward()
        assert not [w for w in caught if any(u in str(w.message) for u in UNSURE)]
        assert controller.independence.last_moves and controller.independence.examples_dim == 1
        per_example = reference_per_example_grads(reference, lambda i: reference(x[:, i:i + 1]).pow(2).sum(), B)
        clipped, _ = clipped_sum(per_example, 1.0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, clipped[n], rtol=1e-10, atol=1e-12)
    finally:
        controller.detach()


def sequence_first_batches(rows):
    """A collate_fn stacking the examples on dim 1: x (T, B, D), y (B,)."""
    return torch.stack([x for x, _ in rows], 1), torch.stack([y for _, y in rows])


def private_through_the_loader(model, batch_size=B, poisson=False, collate_fn=sequence_first_batches,
                               examples=3 * B, length=T):
    """model made private with a DP loader over ``examples`` random (length, D) sequences, batched by
    ``collate_fn``."""
    data = torch.utils.data.TensorDataset(torch.randn(examples, length, D), torch.randn(examples))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=collate_fn)
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson)
    return engine, optimizer, loader


@pytest.mark.parametrize("poisson", [False, True])
def test_through_the_dp_loader_a_sequence_first_model_is_refused_at_its_first_step(poisson):
    """The DP loader says how many examples the batch it hands out holds (StepLedger.examples_of_next_batch): the
    first forward, whose (T, B, D) batch has that count on dim 1 only, is checked there, and its mixing is refused at
    its own norm pass, before any update (until 2026-12-07 the first step trained, checked along its positions)."""
    torch.manual_seed(0)
    model = SequenceFirstLinears().train()
    before = [p.detach().clone() for p in model.parameters()]
    engine, optimizer, loader = private_through_the_loader(model, poisson=poisson, examples=64 if poisson else 3 * B)
    x, _ = next(b for b in loader if b[0].shape[1] > 1 and b[0].shape[1] not in (T, D))
    with pytest.raises(RuntimeError, match=REFUSED + r".*on dim 1 of its tensors"):
        engine.controller.loss(model(x).pow(2).sum((0, 2)), reduction="sum").backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_through_the_dp_loader_a_sequence_first_model_that_keeps_its_examples_apart_is_checked_from_its_first_step():
    torch.manual_seed(0)
    model = SequenceFirstLinears(mix=False).train()
    engine, optimizer, loader = private_through_the_loader(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, _ in loader:
            optimizer.zero_grad()
            out = model(x)
            if engine.controller.independence.forwards == 1:
                assert engine.controller.independence.last_moves  # the first forward compared, on dim 1
                assert engine.controller.independence._checked.dim == 1
            engine.controller.loss(out.pow(2).sum((0, 2)), reduction="sum").backward()
            optimizer.step()
    assert not [w for w in caught if any(u in str(w.message) for u in UNSURE)]
    assert engine.controller.independence.examples_dim == 1


# As many positions as examples (T = B): dim 0 and dim 1 of every tensor of the batch have the batch's size, and
# nothing before the norm pass says which holds the examples. The first forward is checked along dim 0 (for a
# sequence-first batch, its positions); the norm pass's proof reads the examples of the batch where its first trained
# layer reads them, and where that is dim 1 the check runs again there, before any gradient is written
# (independence.ForwardIndependence.recheck_where_square), and from then on. Until 2026-12-07 every step with T = B
# was warned of as inconclusive, mixing or not.


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("layer", ["attention", "lstm"])
@pytest.mark.parametrize("pooled", [False, True])
def test_with_as_many_positions_as_examples_a_sequence_first_forward_that_mixes_is_refused_at_its_first_step(
        clipping, layer, pooled):
    torch.manual_seed(0)
    model = SequenceFirstEncoder(layer, mix=True, pooled=pooled).train()
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = {}
    if layer == "attention":  # (B, T) beside (T, B, D), square too: left as it is (replacements.argument_dims)
        kwargs = {"padding_mask": torch.zeros(B, B, dtype=torch.bool)}
        kwargs["padding_mask"][1, -2:] = True
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exact per-example fallback")
            for k in range(3):  # refused on each step, from the second checked on dim 1 from its start
                with pytest.raises(RuntimeError, match=REFUSED + r".*\(on dim 1 of its tensors: a sequence-first"):
                    step(controller, model, torch.randn(B, B, D), pooled, **kwargs)
                assert controller.independence.forwards == k + 1
        assert all(p.grad is None for p in model.parameters()), "a refused step wrote gradients"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    finally:
        controller.detach()


@pytest.mark.parametrize("through", ["own loop", "dp loader"])
def test_with_as_many_positions_as_examples_a_sequence_first_model_without_a_sequence_first_module_is_refused(
        through):
    """Linears on (T, B, d) at T = B: no batch_first=False module says so, and the loader's count lies on both dims."""
    torch.manual_seed(0)
    model = SequenceFirstLinears().train()
    if through == "own loop":
        controller, x = ghostdp.GhostClipping(model, 1.0), torch.randn(B, B, D)
    else:
        engine, _, loader = private_through_the_loader(model, batch_size=T, length=T)
        controller, (x, _) = engine.controller, next(iter(loader))
        assert x.shape[:2] == (T, T)
    try:
        with pytest.raises(RuntimeError, match=REFUSED + r".*on dim 1 of its tensors"):
            controller.loss(model(x).pow(2).sum((0, 2)), reduction="sum").backward()
        assert controller.independence.examples_dim == 1
        assert all(p.grad is None for p in model.parameters())
    finally:
        if through == "own loop":
            controller.detach()


class TransposedOutput(nn.Module):
    """A batch-first model (B, T, d) that returns its outputs sequence-first, (T, B, 2), optionally with the batch's
    detached mean taken off."""

    def __init__(self, mix):
        super().__init__()
        self.read, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.mix = mix

    def forward(self, x):
        h = self.read(x)
        return self.head(h - h.detach().mean(0, keepdim=True) if self.mix else h).transpose(0, 1)


@pytest.mark.parametrize("mix", [False, True])
def test_a_batch_first_model_returning_its_output_sequence_first_at_as_many_positions_as_examples(mix):
    """Its (T, B, 2) output at T = B is compared on both dims (replacements.OutputViews): until 2026-12-07 it was
    compared on dim 0 alone, its positions, and the model that keeps its examples apart was refused."""
    torch.manual_seed(0)
    model = TransposedOutput(mix).train()
    x = torch.randn(B, B, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        if mix:
            with pytest.raises(RuntimeError, match=REFUSED):
                controller.loss(model(x).pow(2).sum((0, 2)), reduction="sum").backward()
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            controller.loss(model(x).pow(2).sum((0, 2)), reduction="sum").backward()
        assert controller.independence.last_moves
        assert not [w for w in caught if any(u in str(w.message) for u in UNSURE)]
    finally:
        controller.detach()
    assert_exact(model, lambda: model(x).pow(2).sum((0, 2)), lambda i: model(x[i:i + 1]).pow(2).sum(), B)


def rows_after_a_table(rows):
    """A collate_fn giving (table, x): a (3, B) table shared by the batch (as many columns as examples), then x (B, T,
    D) batch-first."""
    return torch.randn(3, len(rows)), torch.stack([x for x, _ in rows])


class TableThenBatch(nn.Module):
    """forward(table, x): a table of 3 rows and B columns before the batch, which is centred on its detached mean or
    not. Its B columns are not a sequence-first batch: the loader's count is found in x's rows first."""

    def __init__(self, mix):
        super().__init__()
        self.lin = nn.Linear(D, 1)
        self.mix = mix

    def forward(self, table, x):
        h = x.mean(1) + table.sum()
        return self.lin(h - h.detach().mean(0, keepdim=True) if self.mix else h)


@pytest.mark.parametrize("mix", [True, False])
def test_through_the_dp_loader_a_table_before_the_batch_is_passed_over_at_the_first_step(mix):
    """The first tensor argument is no batch, and its dim 1 has the loader's count: the check takes x's rows, where
    the loader's count lies on dim 0 (not the table's columns, which would move every output: a false refusal), and
    refuses the mixing forward, or trains the one that keeps its examples apart, at the first step."""
    torch.manual_seed(0)
    model = TableThenBatch(mix).train()
    engine, optimizer, loader = private_through_the_loader(model, collate_fn=rows_after_a_table)
    table, x = next(iter(loader))
    losses = lambda: model(table, x).pow(2).sum(1)  # noqa: E731
    if mix:
        with pytest.raises(RuntimeError, match=REFUSED):
            engine.controller.loss(losses(), reduction="sum").backward()
    else:
        engine.controller.loss(losses(), reduction="sum").backward()
        assert engine.controller.independence.last_moves
        optimizer.step()


@pytest.mark.parametrize("shapes, examples, expected", [
    ([(T, B, D)], B, (1, B)),            # sequence-first
    ([(B, T, D)], B, (0, B)),            # batch-first
    ([(T, B, D), (B, T)], B, (0, B)),    # a (B, T) padding mask beside it: rows first, as example_dims reads them
    ([(3, B), (B, T)], B, (0, B)),       # a table of B columns before the batch: its rows first
    ([(B, B, D)], B, None),              # square: which dim, the count does not say
    ([(T * B, D)], B, None),             # flattened: no dim of that size
    ([(T, B, D)], 1, None),              # one example: nothing to check
    ([(T, B, D)], None, None),           # no loader's count
])
def test_the_loaders_count_of_examples_places_the_batch(shapes, examples, expected):
    from ghostdp.clipping.replacements import examples_of_the_loaders_batch
    assert examples_of_the_loaders_batch([torch.zeros(s) for s in shapes], examples) == expected


class ConditionFirst(nn.Module):
    """forward(condition, x): a (1, d) condition shared by the batch, then the (B, d) batch, centred on its detached
    mean. The first tensor argument's dim 0 is 1: the first forward's check has no batch to replace."""

    def __init__(self, mix=True):
        super().__init__()
        self.lin = nn.Linear(D, 1)
        self.mix = mix

    def forward(self, condition, x):
        h = x + condition
        return self.lin(h - h.detach().mean(0, keepdim=True) if self.mix else h)


@pytest.mark.parametrize("mix", [True, False])
def test_a_condition_passed_before_the_batch_is_passed_over(mix):
    """The (1, d) condition before the (B, d) batch: the check takes x's B from the first forward (before 2026-12-03
    its batch of 1 had nothing to replace, on every step, without a word), and the norm pass learns x's place."""
    model = ConditionFirst(mix).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    condition = torch.randn(1, D)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mix:
                with pytest.raises(RuntimeError, match=REFUSED + rf": copying the (first|last) of the {B} examples"):
                    controller.loss(model(condition, torch.randn(B, D)).pow(2).sum(1), reduction="sum").backward()
            else:
                for _ in range(2):
                    out = model(condition, torch.randn(B, D))
                    assert controller.independence.last_moves
                    controller.loss(out.pow(2).sum(1), reduction="sum").backward()
                    model.zero_grad(set_to_none=True)
                assert (controller.independence.examples_leaf, controller.independence.examples_dim) == (1, 0)
        assert not [w for w in caught if "could not check" in str(w.message)]
    finally:
        controller.detach()


class TokensAfterAWindow(nn.Module):
    """forward(window, ids): a (W, d) table of W != B rows before the (B, T) ids: the first forward's check takes W
    rows for the examples; the DP loss finds the losses' B in the ids and checks the forward again there."""

    def __init__(self, mix=True):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, D), nn.Linear(D, 1)
        self.mix = mix

    def forward(self, window, ids):
        h = self.embed(ids).mean(1) + window.mean(0)
        return self.head(h - h.detach().mean(0, keepdim=True) if self.mix else h)


@pytest.mark.parametrize("mix", [True, False])
def test_a_batch_that_is_not_the_first_argument_is_checked_at_the_first_step(mix):
    """Refused before the first update where it mixes (until 2026-12-07: from the second forward); trained where it
    does not, the recheck's comparisons made on the ids' rows and the examples learned there."""
    model = TokensAfterAWindow(mix).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    window = torch.randn(3, D)
    try:
        out = model(window, torch.randint(0, 10, (B, T)))
        assert controller.independence._checked.batch == 3  # the guess: the window's rows
        if mix:
            with pytest.raises(RuntimeError, match=REFUSED):
                controller.loss(out.pow(2).sum(1), reduction="sum").backward()
            assert all(p.grad is None for p in model.parameters())
        else:
            controller.loss(out.pow(2).sum(1), reduction="sum").backward()
            assert controller.independence.last_moves
        assert (controller.independence.examples_leaf, controller.independence.examples_dim) == (1, 0)
    finally:
        controller.detach()


class ReadsItsBatchSize(SequenceFirstEncoder):
    """Sequence-first, divides by the batch's size (x.shape[1]): replacing examples keeps it, removing one shows it."""

    def forward(self, x, padding_mask=None):
        return super().forward(x / x.shape[1])


def test_a_sequence_first_forward_that_reads_its_batch_size_is_refused_by_the_removal():
    model = ReadsItsBatchSize("lstm").train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exact per-example fallback")
            with pytest.raises(RuntimeError, match=REFUSED + r": removing the last of the 4 examples \(on dim 1"):
                step(controller, model, torch.randn(T, B, D), pooled=False)
    finally:
        controller.detach()


class Flattened(nn.Module):
    """Takes its batch flattened to (B * T, d) rows and returns (B, T): no argument has a dim of B."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, rows):
        return self.lin(rows).view(B, T)


def test_a_batch_with_no_dim_of_the_losses_size_is_warned_of_once():
    model = Flattened().train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                controller.loss(model(torch.randn(B * T, D)).pow(2).sum(1), reduction="sum").backward()
        said = [str(w.message) for w in caught if "could not check" in str(w.message)]
        assert len(said) == 1, said
        assert f"the per-example losses number {B}, but the check took the {B * T} rows of dim 0" in said[0]
        assert f"({B * T}, {D})" in said[0] and "not flattened" in said[0]
    finally:
        controller.detach()


class PackedLSTM(nn.Module):
    """An LSTM on a PackedSequence (Opacus' DPLSTM habit): its data (tokens, d) and, unsorted, its index vectors (B,);
    optionally the batch's detached mean taken off the last hidden state."""

    def __init__(self, cell=ghostdp.layers.LSTM, mix=False):
        super().__init__()
        self.rnn, self.head = cell(D, D, batch_first=True), nn.Linear(D, 2)
        self.mix = mix

    def forward(self, packed):
        h = self.rnn(packed)[1]
        h = (h[0] if isinstance(h, tuple) else h)[-1]
        return self.head(centred_on_the_batch(h.unsqueeze(0))[0] if self.mix else h)


def packed_batch(lengths):
    from torch.nn.utils.rnn import pack_padded_sequence
    x = torch.randn(len(lengths), max(lengths), D)
    return x, torch.tensor(lengths), pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                                          enforce_sorted=False)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("cell", [ghostdp.layers.LSTM, nn.GRU], ids=["ghostdp-lstm", "torch-gru"])
def test_a_forward_on_packed_sequences_is_checked(clipping, cell):
    """Unpacked to (B, T, d) and lengths for the check, packed again for each rerun (packed.py): a mean over the batch
    refused, both modes (before 2026-12-03 the check took the 14 packed tokens for the examples and its finding went
    unused); without it, no warning."""
    lengths = [3, 5, 2, 4]
    controller = ghostdp.GhostClipping(PackedLSTM(cell, mix=True).train(), 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*exact per-example fallback")
            with pytest.raises(RuntimeError, match=REFUSED + r": copying the (first|last) of the 4 examples"):
                controller.loss(controller.module(packed_batch(lengths)[2]).pow(2).sum(1), reduction="sum").backward()
    finally:
        controller.detach()
    model = PackedLSTM(cell).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = model(packed_batch(lengths)[2])
                assert controller.independence.last_moves and controller.independence.finding is None
                controller.loss(out.pow(2).sum(1), reduction="sum").backward()
                model.zero_grad(set_to_none=True)
        unsure = [str(w.message) for w in caught if any(u in str(w.message) for u in UNSURE)]
        assert not unsure, unsure
    finally:
        controller.detach()


def test_a_packed_lstm_checked_stays_exact():
    from torch.nn.utils.rnn import pack_padded_sequence
    model = PackedLSTM().train()
    x, lengths, packed = packed_batch([3, 5, 2, 4])
    assert_exact(model, lambda: model(packed).pow(2).sum(1),
                 lambda i: model(pack_padded_sequence(x[i:i + 1, :lengths[i]], lengths[i:i + 1],
                                                      batch_first=True)).pow(2).sum(), B)
