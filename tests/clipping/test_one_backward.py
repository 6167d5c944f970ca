"""Two passes take book-keeping's one backward on a step where the last norm pass found that book-keeping would keep
little (modes.ONE_BACKWARD_WHERE_KEEPING_LITTLE): adapters, whose explicit per-example gradients (rank r << T tokens)
are small beside their layers' inputs and output grads; a causal LM fine-tuned whole, whose graph saves far more
than book-keeping keeps (modes.KEPT_OF_SAVED). The switched steps against the float64 per-example loop
(plain, under non-reentrant and reentrant checkpointing, peft's LoRA on BERT), and the set-ups that keep two passes:
a model whose kept factors are not small, several processes, sharded parameters, the switch turned off. A BERT
classifier switches where it keeps about what its graph saved and keeps two passes where it keeps more."""
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from ghostdp.clipping import controller as controller_module
from ghostdp.clipping import modes
from ghostdp import model_tree
from conftest import clipped_sum, reference_per_example_grads, trainable, without_scheduled_proofs
from test_models import B, classification_loss, padded_text, tiny_bert

T, D, R = 16, 8, 1  # a rank-1 adapter on 16 tokens: it keeps about R / T of what its layers hold


class Adapted(nn.Module):
    """A frozen Linear with a trainable low-rank adapter beside it: x W^T + (x A^T) B^T."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.down = nn.Linear(D, R, bias=False)
        self.up = nn.Linear(R, D, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class AdaptedNet(nn.Module):
    """Two adapted blocks, optionally checkpointed, and a trainable head on the mean token."""

    def __init__(self, checkpointing=None, frozen_base=True):
        super().__init__()
        self.blocks = nn.ModuleList([Adapted(), Adapted()])
        self.head = nn.Linear(D, 3)
        self.checkpointing = checkpointing
        if not frozen_base:
            for block in self.blocks:
                block.base.requires_grad_(True)

    def forward(self, x):
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x.mean(1))


def dp_step(controller, model, losses) -> bool:
    """One backward of the DP loss of ``losses()`` (per example) into fresh p.grad: whether book-keeping's one
    backward wrote the clipped sums."""
    controller.ledger.open()
    model.zero_grad(set_to_none=True)
    controller.loss(losses(), reduction="sum").backward()
    return controller.ledger.records[-1].one_backward


def step(controller, model, x, C):
    """dp_step on AdaptedNet's losses with C: (the clipped sums, whether book-keeping's one backward wrote them)."""
    controller.max_grad_norm = C
    wrote = dp_step(controller, model, lambda: model(x).pow(2).sum(1))
    return {n: p.grad.clone() for n, p in trainable(model)}, wrote


def exact_steps(model, losses, n, make_controller=None, rtol=1e-10):
    """Three DP steps of ``losses(sl)`` (the per-example losses of the examples at slice sl, n in all) with C below
    every example's norm, above all of them and below again: their clipped sums equal the float64 per-example
    loop's at every step. Whether each took book-keeping's one backward (the first takes two passes and measures
    what book-keeping would keep), and the controller (detached). ``make_controller(model)``: the controller."""
    per_example = reference_per_example_grads(model, lambda i: losses(slice(i, i + 1)).sum(), n)
    _, norms = clipped_sum(per_example, 1.0)
    controller = (make_controller or (lambda m: ghostdp.GhostClipping(m, 1.0)))(model)
    wrote = []
    for C in (0.5 * float(norms.min()), 2.0 * float(norms.max()), 0.5 * float(norms.min())):
        ref, _ = clipped_sum(per_example, C)
        controller.max_grad_norm = C
        wrote.append(dp_step(controller, model, lambda: losses(slice(None))))
        for name, p in trainable(model):
            torch.testing.assert_close(p.grad, ref[name], rtol=rtol, atol=1e-12)
    controller.detach()
    return wrote, controller


def assert_switched_steps_exact(model, x):
    """exact_steps on AdaptedNet's losses: whether each step took one backward."""
    return exact_steps(model, lambda sl: model(x[sl]).pow(2).sum(1), len(x))[0]


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_two_passes_take_one_backward_once_the_adapters_are_found_to_keep_little(checkpointing):
    torch.manual_seed(0)
    model = AdaptedNet(checkpointing)
    # A reentrant checkpoint gives its region's parameters gradient only through an input that requires grad.
    x = torch.randn(4, T, D).requires_grad_(checkpointing == "reentrant")
    assert assert_switched_steps_exact(model, x) == [False, True, True]


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_between_an_eighth_and_a_half_kept_one_backward_only_without_checkpointing(checkpointing):
    """On 4 tokens the rank-1 adapters keep about a quarter of what their layers hold: one backward where two passes
    would hold the whole graph anyway, two passes under checkpointing (modes.KEPT_FRACTION_WITHOUT_CHECKPOINTING)."""
    torch.manual_seed(0)
    model = AdaptedNet(checkpointing)
    x = torch.randn(4, 4, D)
    wrote = assert_switched_steps_exact(model, x)
    controller = ghostdp.GhostClipping(model, 1.0)
    step(controller, model, x, 1.0)
    fraction = controller.step_modes.kept_fraction
    controller.detach()
    assert modes.KEPT_FRACTION_UNDER_CHECKPOINTING < fraction < modes.KEPT_FRACTION_WITHOUT_CHECKPOINTING
    assert wrote == ([False, True, True] if checkpointing is None else [False, False, False])


def test_peft_lora_on_bert_takes_one_backward_and_stays_exact():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(tiny_bert(), LoraConfig(r=1, lora_alpha=2, target_modules=["query", "value"],
                                                   modules_to_save=["classifier"]))
    for n, p in model.named_parameters():  # LoRA B starts at zero; make the test non-degenerate
        if "lora_B" in n:
            nn.init.normal_(p, std=0.5)
    model.train()
    ids, mask = padded_text(30, T=16)
    loss_of = classification_loss(torch.randint(0, 3, (B,)))

    def losses(sl):
        return loss_of(model(input_ids=ids[sl], attention_mask=mask[sl]), sl)

    per_example = reference_per_example_grads(model, lambda i: losses(slice(i, i + 1)).sum(), B)
    ref, _ = clipped_sum(per_example, 0.1)
    controller = ghostdp.GhostClipping(model, 0.1)
    wrote = []
    for _ in range(2):
        wrote.append(dp_step(controller, model, lambda: losses(slice(None))))
        for n, p in trainable(model):
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-9, atol=1e-12)
    controller.detach()
    assert wrote == [False, True]


def test_a_model_whose_factors_are_not_small_keeps_two_passes():
    torch.manual_seed(0)
    model = AdaptedNet(frozen_base=False)  # on 4 tokens book-keeping keeps the base weights' inputs and output grads
    assert assert_switched_steps_exact(model, torch.randn(4, 4, D)) == [False, False, False]


def test_two_passes_measure_again_where_the_trained_calls_change():
    """A model found to keep much is weighed again as soon as its trained calls change (the step's footprint, the
    elements of their outputs, moves: modes.StepModes.counts_saved): frozen after pass 4, its base stops counting at
    pass 5's measure, and pass 6 takes one backward; unfrozen, pass 7 (one backward, its calls changed) measures and
    pass 8 goes back."""
    torch.manual_seed(0)
    model, x = AdaptedNet(frozen_base=False), torch.randn(4, 4, D)  # 4 tokens: the base keeps about 2/3
    controller = ghostdp.GhostClipping(model, 1.0)
    assert [step(controller, model, x, 1.0)[1] for _ in range(5)] == [False] * 5  # passes 0-4
    for block in model.blocks:
        block.base.requires_grad_(False)
    assert [step(controller, model, x, 1.0)[1] for _ in range(2)] == [False, True]  # 5-6
    for block in model.blocks:
        block.base.requires_grad_(True)
    assert [step(controller, model, x, 1.0)[1] for _ in range(2)] == [True, False]  # 7 measures, 8 goes back
    controller.detach()


def test_a_step_of_one_backward_is_measured_again_only_where_its_calls_changed(monkeypatch):
    """Measuring what book-keeping keeps costs ~1.5 us a factor (~1 ms a step on the BERT stand-in), and the same calls
    (modules, output shapes, trained parameters) keep the same bytes: steps of one backward between the layout
    proofs' (passes 1, 2, 4, 8) measure only where their calls differ from the last measured step's (here: fewer
    tokens), and take their mode from it."""
    from ghostdp.clipping.modes import StepModes
    torch.manual_seed(0)
    model = AdaptedNet()
    controller = ghostdp.GhostClipping(model, 1.0)
    measured = []
    original = StepModes.measured

    def watch(self, passed, *args, **kwargs):
        measured.append(bool(passed.held_bytes))
        return original(self, passed, *args, **kwargs)

    monkeypatch.setattr(StepModes, "measured", watch)
    long, short = torch.randn(4, 16, D), torch.randn(4, 12, D)
    wrote = [step(controller, model, x, 1.0)[1] for x in [long] * 6 + [short, short, long]]  # passes 0-8
    controller.detach()
    assert wrote == [False] + [True] * 8  # one backward from pass 1 on
    assert measured == [True, True, True, False, True, False, True, False, True]  # 0-2, 4 (proofs), 6 and 8 (calls)


def test_the_graph_is_counted_on_the_proofs_schedule_while_its_footprint_holds(monkeypatch):
    """Counting the graph's saved bytes costs about a microsecond a saved tensor: the first pass, the layout proofs'
    (1, 2, 4, 8, ...) and a pass whose footprint moved by more than 10% count, the others estimate."""
    torch.manual_seed(0)
    model = AdaptedNet(frozen_base=False)
    counted = []
    real = controller_module.saved_bytes
    monkeypatch.setattr(controller_module, "saved_bytes", lambda *a: counted.append(True) or real(*a))
    controller = ghostdp.GhostClipping(model, 1.0)
    passes = []
    for k in range(10):
        before = len(counted)
        step(controller, model, torch.randn(4, 4, D), 1.0)
        passes += [k] * (len(counted) - before)
    assert passes == [0, 1, 2, 4, 8]
    step(controller, model, torch.randn(4, 5, D), 1.0)  # longer examples: 25% more elements, estimated
    assert len(counted) == 5
    step(controller, model, torch.randn(4, 8, D), 1.0)  # twice as many: counted
    step(controller, model, torch.randn(4, 8, D), 1.0)
    assert len(counted) == 6
    controller.detach()


def tiny_causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=96, n_embd=8, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double().train()


def test_a_causal_lm_fine_tuned_whole_takes_one_backward_and_stays_exact():
    """Fine-tuning a causal LM whole: its graph saves the LM head's logits and their log-softmax, far more than
    book-keeping keeps (modes.KEPT_OF_SAVED), so two passes take book-keeping's one backward from the second step,
    with the clipped sums of the per-example loop at every step."""
    torch.manual_seed(0)
    model, ids = tiny_causal_lm(), torch.randint(0, 96, (4, 12))

    def losses(sl):
        logits = model(input_ids=ids[sl]).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 96), ids[sl, 1:].reshape(-1),
                                                 reduction="none").view(logits.shape[0], -1).mean(1)

    wrote, controller = exact_steps(model, losses, len(ids), rtol=1e-9)
    assert wrote == [False, True, True]
    # The fixed limit alone would have kept two passes:
    assert controller.step_modes.kept_of_saved < modes.KEPT_OF_SAVED
    assert controller.step_modes.kept_fraction > modes.KEPT_FRACTION_WITHOUT_CHECKPOINTING


def test_a_bert_keeping_about_what_its_graph_saves_takes_one_backward_and_stays_exact():
    """A BERT classifier whose Linear layers keep their inputs and output grads keeps about the bytes its graph saved
    (1.00 here; 1.01-1.03 measured, book-keeping's peak at or below two passes' every time): two passes take
    book-keeping's one backward from the second step, with the per-example loop's clipped sums at every step."""
    torch.manual_seed(0)
    ids, mask = padded_text(30, T=8)
    model = tiny_bert()
    loss_of = classification_loss(torch.randint(0, 3, (B,)))

    def losses(sl):
        return loss_of(model(input_ids=ids[sl], attention_mask=mask[sl]), sl)

    wrote, controller = exact_steps(model, losses, B, rtol=1e-9)
    assert wrote == [False, True, True]
    assert 0.9 < controller.step_modes.kept_of_saved <= modes.KEPT_OF_SAVED  # (0.9: the limit before 2026-11-27)


def test_a_model_keeping_more_than_its_graph_saves_keeps_two_passes():
    """A stack of Linear layers whose explicit per-example gradients, which no saved tensor shares, are what
    book-keeping keeps (1.78 the bytes its graph saved) keeps two passes. (The tiny BERT classifier at T=16 that
    stood for BERT at T=160-512 here, 1.28-1.32 measured there, fell to 1.099 on 2026-11-28, when its token-type and
    position tables started to keep their explicit gradients, smaller than their ids and G: it takes one backward
    now.)"""
    torch.manual_seed(0)
    width = 32  # on 4 tokens its inputs and output grads are smaller than its explicit gradients: kept whole
    stack = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 3)).double()
    x = torch.randn(8, 4, width)
    controller = ghostdp.GhostClipping(stack, 1.0)
    assert not any(dp_step(controller, stack, lambda: stack(x).pow(2).sum((1, 2))) for _ in range(3))
    assert controller.step_modes.kept_of_saved > modes.KEPT_OF_SAVED
    controller.detach()


class Embedded(nn.Module):
    """A module without a norm rule (its own position vector: the fallback, whose input goes through a sink for the
    layout proof) around a ruled Linear that reads that input, as a ViT's embeddings around its patch projection,
    then a trainable head."""

    def __init__(self):
        super().__init__()
        self.projection = nn.Linear(D, D)
        self.position = nn.Parameter(torch.randn(T, D))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.projection(x) + self.position).mean(1))


def assert_embedded_steps_exact(monkeypatch, expects_one_backward):
    torch.manual_seed(0)
    model, x = Embedded().double(), torch.randn(4, T, D)
    monkeypatch.setattr(modes, "KEPT_OF_SAVED", 10.0)  # what it keeps against its graph: one backward from step 2

    def make_controller(m):
        controller = ghostdp.GhostClipping(m, 1.0)
        if not expects_one_backward:
            monkeypatch.setattr(controller.recorder, "expects_one_backward", lambda checkpointing: False)
        return controller

    wrote, controller = exact_steps(model, lambda sl: model(x[sl]).pow(2).sum(1), len(x), make_controller)
    assert wrote == [False, True, True] and controller.recorder.two_passes is not expects_one_backward


def test_a_forward_expected_to_take_one_backward_is_recorded_as_book_keeping_records_it(monkeypatch):
    """Where a two-pass controller expects the DP loss to take book-keeping's one backward, the forward captures its
    calls as book-keeping does: the projection, whose input passes the sink of the module around it, keeps its
    probe (two passes capture it, and pass 1 names it in a second backward, through the graph that the one
    backward frees: a ViT failed there before 2026-11-27)."""
    assert_embedded_steps_exact(monkeypatch, expects_one_backward=True)


def test_a_forward_recorded_for_two_passes_whose_loss_takes_one_backward_keeps_the_graph(monkeypatch):
    """A forward recorded for two passes (the controller expected two passes as it started) whose loss takes one
    backward all the same keeps its graph through pass 1, as two passes do, for the calls pass 1 may not reach."""
    assert_embedded_steps_exact(monkeypatch, expects_one_backward=False)


def test_the_switched_forward_is_a_graph_form_proven_once(monkeypatch):
    """Recorded as book-keeping records it, the switched steps' graph may be another form (one Linear: two passes
    probe it, book-keeping names its edge): the layout proof runs for it once, not on every step (the scheduled
    proofs switched off)."""
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2).double(), torch.randn(4, 5, 3)
    monkeypatch.setattr(modes, "KEPT_OF_SAVED", 10.0)
    controller = ghostdp.GhostClipping(model, 1.0)
    without_scheduled_proofs(controller)
    proofs = []
    original = controller.pass_one._prove_layouts
    monkeypatch.setattr(controller.pass_one, "_prove_layouts", lambda *a: (proofs.append(1), original(*a)))
    wrote = [dp_step(controller, model, lambda: model(x).pow(2).sum((1, 2))) for _ in range(5)]
    assert wrote == [False, True, True, True, True] and len(proofs) == 2
    controller.detach()


def test_the_measure_leaves_out_the_forwards_arguments_and_counts_the_copy_book_keeping_makes():
    """A batch sliced from a tensor of the whole dataset is a view of all of it: its storage was counted whole among
    the saved bytes (and in the kept ones), which pulled the measure toward 1 (a wide Linear model read 1.03 sliced
    and 1.056 fresh, then 0.62 in its one-backward steps). The forward's arguments are the caller's, held whichever
    way the step runs: left out on both sides. Book-keeping copies such a view for the call that reads it
    (recording._compact_views): counted as that copy's bytes, in both modes alike."""
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3)).double()
    dataset = torch.randn(64, 4, D)
    fresh, sliced = dataset[:8].clone(), dataset[:8]
    measured = {}
    for name, x in (("fresh", fresh), ("sliced", sliced)):
        for clipping_steps in (1, 2):  # two passes (the first step), then book-keeping's one backward
            controller = ghostdp.GhostClipping(stack, 1.0)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(modes, "KEPT_OF_SAVED", 10.0)
                for _ in range(clipping_steps):
                    dp_step(controller, stack, lambda: stack(x).pow(2).sum((1, 2)))
            sm = controller.step_modes
            measured[name, clipping_steps] = (sm.saved_per_element, sm.kept_of_saved * sm.saved_per_element)
            controller.detach()
    footprint = 8 * 4 * (D + 3)  # the trained calls' output elements
    copy = fresh.numel() * fresh.element_size() / footprint  # per element: book-keeping's copy of the sliced view
    for steps in (1, 2):
        (saved_fresh, kept_fresh), (saved_sliced, kept_sliced) = measured["fresh", steps], measured["sliced", steps]
        assert saved_sliced == pytest.approx(saved_fresh, rel=1e-12)
        assert kept_sliced == pytest.approx(kept_fresh + copy, rel=1e-12)
    assert measured["fresh", 1] == pytest.approx(measured["fresh", 2], rel=1e-12)
    assert measured["sliced", 1] == pytest.approx(measured["sliced", 2], rel=1e-12)


def test_the_switch_is_said_once_and_can_be_turned_off(monkeypatch, caplog):
    torch.manual_seed(0)
    model, x = AdaptedNet(), torch.randn(4, T, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        assert [step(controller, model, x, 1.0)[1] for _ in range(3)] == [False, True, True]
    told = [r for r in caplog.records if "take book-keeping's one backward" in r.getMessage()]
    assert len(told) == 1
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)
    assert [step(controller, model, x, 1.0)[1] for _ in range(2)] == [False, False]
    controller.detach()


@pytest.mark.parametrize("why", ["several processes", "sharded parameters"])
def test_no_switch_where_book_keeping_cannot_run(monkeypatch, why):
    torch.manual_seed(0)
    model, x = AdaptedNet(), torch.randn(4, T, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    step(controller, model, x, 1.0)
    assert controller.mode_for_loss().name == "bookkeeping"
    if why == "several processes":  # every rank must take the same mode: nothing agreed across the ranks yet
        monkeypatch.setattr(controller_module, "distributed_rank_and_size", lambda: (0, 2))
    else:  # FSDP2 (fully_shard puts DTensors in place of the parameters): book-keeping would write its sums past
        # FSDP's reduce-scatter. The frozen base weight stands for such a DTensor.
        frozen = model.blocks[0].base
        frozen.weight = nn.Parameter(frozen.weight.detach().clone(), requires_grad=False)
        monkeypatch.setattr(model_tree, "is_sharded", lambda t: t is frozen.weight)
    assert controller.mode_for_loss().name == "ghost"
    controller.detach()


def test_the_sharding_check_walks_the_model_again_only_where_its_tree_changed(monkeypatch):
    """A walk of the parameters recursed through every module at each step (0.35-0.7 ms on the LoRA stand-ins): the
    check reads the model's tree as last walked while every module still holds the same parameters and submodules."""
    torch.manual_seed(0)
    model, x = AdaptedNet(), torch.randn(4, T, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    read = []
    monkeypatch.setattr(model_tree, "is_sharded", lambda t: read.append(t) or False)
    assert [step(controller, model, x, 1.0)[1] for _ in range(3)] == [False, True, True]
    walked = len(read)
    assert walked == len(list(model.parameters()))  # once, on the first step that could switch
    model.blocks[1].up.weight = nn.Parameter(torch.randn(D, R))  # a parameter replaced: all are read again
    assert controller.mode_for_loss().name == "bookkeeping" and len(read) == 2 * walked
    model.blocks[0].base = nn.Linear(D, D).requires_grad_(False)  # a submodule replaced
    assert controller.mode_for_loss().name == "bookkeeping" and len(read) == 3 * walked
    assert controller.mode_for_loss().name == "bookkeeping" and len(read) == 3 * walked
    controller.detach()


def test_several_processes_decide_by_the_fraction_the_ranks_agreed_on(monkeypatch):
    """The DP optimizer's all-reduce gives every rank the largest of their measures (StepModes.agree; a real two-rank
    run is in tests/test_distributed.py): the mode follows it, not this rank's own."""
    torch.manual_seed(0)
    model, x = AdaptedNet(), torch.randn(4, T, D)
    controller = ghostdp.GhostClipping(model, 1.0)
    step(controller, model, x, 1.0)  # this rank keeps little
    monkeypatch.setattr(controller_module, "distributed_rank_and_size", lambda: (0, 2))
    controller.step_modes.agree(controller.step_modes.local_measure())
    assert controller.mode_for_loss().name == "bookkeeping"
    controller.step_modes.agree((0.75, 1.5))  # another rank keeps much
    assert controller.mode_for_loss().name == "ghost"
    controller.step_modes.agree((0.75, 0.9))  # ... but less than its graph saved
    assert controller.mode_for_loss().name == "bookkeeping"
    inf = float("inf")
    controller.step_modes.agree((inf, inf))  # another rank has measured nothing yet
    assert controller.mode_for_loss().name == "ghost" and controller.step_modes.agreed == (None, None)
    controller.detach()


def test_mode_of_step():
    ghost, bookkeeping = modes.CLIPPING_MODES["ghost"], modes.CLIPPING_MODES["bookkeeping"]
    much, below, above = 0.9, 0.99 * modes.KEPT_OF_SAVED, 1.01 * modes.KEPT_OF_SAVED  # kept fraction, kept / saved
    assert modes.mode_of_step(ghost, False, False, much, may_keep=True, kept_of_saved=below) is bookkeeping
    assert modes.mode_of_step(ghost, False, False, much, may_keep=True, kept_of_saved=above) is ghost
    assert modes.mode_of_step(ghost, True, False, much, may_keep=True, kept_of_saved=below) is ghost  # checkpointed
    assert modes.mode_of_step(ghost, False, False, much, may_keep=False, kept_of_saved=below) is ghost
    little, much = modes.KEPT_FRACTION_UNDER_CHECKPOINTING, 2 * modes.KEPT_FRACTION_UNDER_CHECKPOINTING
    assert modes.mode_of_step(ghost, False, False, little, may_keep=True) is bookkeeping
    assert modes.mode_of_step(ghost, True, False, little, may_keep=True) is bookkeeping  # checkpointed: keeps little
    assert modes.mode_of_step(ghost, True, False, much, may_keep=True) is ghost
    assert modes.mode_of_step(ghost, False, False, much, may_keep=True) is bookkeeping  # no checkpoint: up to a half
    half = modes.KEPT_FRACTION_WITHOUT_CHECKPOINTING
    assert modes.mode_of_step(ghost, False, False, half, may_keep=True) is bookkeeping
    assert modes.mode_of_step(ghost, False, False, 1.01 * half, may_keep=True) is ghost
    assert modes.mode_of_step(ghost, False, False, 1.0, may_keep=True) is ghost  # full fine-tuning at BERT-base
    assert modes.mode_of_step(ghost, False, False, None, may_keep=True) is ghost  # nothing measured yet
    assert modes.mode_of_step(ghost, False, False, little, may_keep=False) is ghost
    assert modes.mode_of_step(bookkeeping, True, False, much) is ghost
    assert modes.mode_of_step(bookkeeping, True, False, little) is bookkeeping
    assert modes.mode_of_step(bookkeeping, True, True, much) is bookkeeping  # per-group: no two-pass form


def private_run(one_backward: bool, monkeypatch):
    """Five Poisson steps of peft's LoRA on GPT-2 through the engine, in physical batches of 3; the weights after."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2ForSequenceClassification
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", one_backward)
    torch.manual_seed(0)
    model = get_peft_model(GPT2ForSequenceClassification(GPT2Config(
        vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, num_labels=3, pad_token_id=0)), LoraConfig(r=1, target_modules=["c_attn"],
                                                                  fan_in_fan_out=True, modules_to_save=["score"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.5)
    data = torch.utils.data.TensorDataset(torch.randint(1, 25, (40, T)), torch.randint(0, 3, (40,)))
    params = [p for p in model.parameters() if p.requires_grad]
    engine = ghostdp.PrivacyEngine(seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(params, lr=0.5), data_loader=torch.utils.data.DataLoader(
            data, batch_size=8), criterion=nn.CrossEntropyLoss(), noise_multiplier=0.5, max_grad_norm=0.1,
        max_physical_batch_size=3)
    wrote, steps = [], 0
    while steps < 5:
        for ids, labels in loader:
            if len(ids) == 0:  # an empty Poisson batch: noise only
                optimizer.step()
            else:
                criterion(model(input_ids=ids).logits, labels).backward()
                wrote.append(engine.controller.ledger.records[-1].one_backward)
                optimizer.step()
            if optimizer.last_step_taken:
                optimizer.zero_grad()
                steps += 1
    return [p.detach().clone() for p in params], wrote


def test_a_private_run_with_adapters_ends_where_two_passes_end(monkeypatch):
    """Poisson batches in physical chunks, the noise and the accountant: the same weights after five steps (float64,
    one noise stream), with most backward calls taking one backward."""
    ours, wrote = private_run(True, monkeypatch)
    theirs, wrote_by_two_passes = private_run(False, monkeypatch)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not any(wrote_by_two_passes) and wrote[0] is False and sum(wrote) >= len(wrote) - 1
