"""How the clipped sum reaches p.grad once pass 1 has given the clip coefficients c_i.

- ``TwoPass`` ("ghost", the default): the DP loss's backward gives c_i for loss i and runs pass 2, a
  backward of sum_i c_i L_i of its own (GhostClipping.write_clipped_sums), so the ordinary backward forms
  sum_i c_i g_i. Memory: that of training.
- ``BookKeeping`` ("bookkeeping"): pass 1 keeps each layer's factors (activations A and output
  grads G) and the loss's backward writes sum_i c_i g_i = (c ⊙ G)^T A per layer into p.grad;
  autograd stops there (no second backward). Faster, but A and G of every layer stay alive
  until the coefficients are known.

A book-keeping step whose forward ran under activation checkpointing (or any saved-tensor hooks, e.g.
offloading) takes two passes instead (``mode_of_step``): its kept A and G would be every layer's
activations, the very memory checkpointing frees (BERT L=4, B=16, CPU: 3.4x the plain checkpointed
peak, as much as book-keeping without checkpointing, and slower). Unless what it keeps is small: where
the explicit per-example gradients are smaller than A and G (adapters: LoRA's rank r << T tokens) it
keeps those (``PerExampleGrad.kept``), and when the last norm pass found that everything kept would be
at most KEPT_FRACTION_UNDER_CHECKPOINTING of the bytes the layers' A and G hold, it stays one backward.
Per-group clipping has no two-pass form, so it keeps book-keeping there (and warns when it keeps much).

The other way round, a two-pass step takes book-keeping's one backward where the last norm pass found that it
would keep that little (ONE_BACKWARD_WHERE_KEEPING_LITTLE): with adapters, pass 2 repeats the backward through
the whole frozen base for gradients that book-keeping writes from small kept factors. Or, without a checkpoint,
where what it keeps is no more than about the tensors the graph saved, which two passes hold through pass 1 and
book-keeping frees as its backward goes (saved_bytes.py, KEPT_OF_SAVED): a causal LM's graph saves its head's
float32 logits and log-softmax, so its full fine-tuning keeps less; a BERT classifier's keeps about as much where
its Linear layers keep their inputs and output grads, more where they keep explicit per-example gradients (long
sequences), and a stack of Linear layers more.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import defaultdict

import torch

from ..norms.batched_sums import weighted_sums
from ..norms.factors import EmbeddingGather, PerExampleGrad
from .layout import REPROOF_EVERY, proof_scheduled

log = logging.getLogger("ghostdp")


class TwoPass:
    name = "ghost"
    keeps_factors = False
    continues_backward = True  # pass 2 is a backward of the losses (GhostClipping.write_clipped_sums)

    def grad_of_losses(self, kept, coefficients, grad_output, losses, group_of=None):
        """The weights of the losses in pass 2's backward where it is not pass 1's again (see
        GhostClipping.write_clipped_sums): c_i times the loss's incoming gradient."""
        return (coefficients * grad_output).to(losses.dtype)


class BookKeeping:
    name = "bookkeeping"
    keeps_factors = True
    continues_backward = False

    @torch.no_grad()
    def grad_of_losses(self, kept, coefficients, grad_output, losses, group_of=None):
        """``coefficients``: (B,), or (groups, B) with ``group_of`` mapping id(parameter) to its row."""
        ClippedSums(coefficients, grad_output, group_of).write(kept)
        return None  # nothing flows further back: p.grad already holds the clipped sum


class ClippedSums:
    """Writes sum_i w_i g_i of factors into p.grad, w_i = c_i times the loss's incoming gradient: book-keeping's
    sums from its kept factors, and two passes' from the factors pass 2 forms again (pass_two.py).
    ``coefficients``: (B,), or (groups, B) with ``group_of`` mapping id(parameter) to its row."""

    def __init__(self, coefficients, grad_output, group_of=None):
        self.all_weights = coefficients * grad_output.to(coefficients.dtype)
        self.group_of = group_of
        self._in_dtype = {}  # the weights in each factor's accumulation dtype, converted once for all factors
        self._collected = None  # parameter -> its sum so far, inside ``collected``

    @contextlib.contextmanager
    def collected(self):
        """Inside, the sums are collected instead of written; on leaving, written into p.grad (a backward that drops
        what autograd accumulates into the parameters runs inside: pass_two.py, reentrant checkpoints)."""
        self._collected = {}
        try:
            yield
            collected = self._collected
            self._collected = None
            while collected:
                self._write(*collected.popitem())
        finally:
            self._collected = None

    def scaled(self, scales: dict) -> "ClippedSums":
        """These sums (two passes': no clipping groups) with each parameter's weights w_i multiplied by its own (B,)
        scale (``scales``: parameter -> scale; pass_two.py), collected where these are."""
        sums = ClippedSums.__new__(ClippedSums)
        rows = torch.stack([s.to(self.all_weights.dtype) for s in scales.values()])
        sums.all_weights = rows * self.all_weights
        sums.group_of = {id(p): k for k, p in enumerate(scales)}
        sums._in_dtype, sums._collected = {}, self._collected
        return sums

    def _put(self, param, clipped):
        if self._collected is None:
            self._write(param, clipped)
        elif param in self._collected:
            self._collected[param] = self._collected[param] + clipped
        else:
            self._collected[param] = clipped

    def _weights_of(self, group, dt):
        if (dt, group) not in self._in_dtype:
            self._in_dtype[(dt, group)] = (self.all_weights if group is None else self.all_weights[group]).to(dt)
        return self._in_dtype[(dt, group)]

    def _weighted_sum(self, factor, group, **options):
        if type(factor).sum_dtype is PerExampleGrad.sum_dtype:  # a factor that does not say: as given
            return factor.weighted_sum(self.all_weights if group is None else self.all_weights[group], **options)
        return factor.weighted_sum(self._weights_of(group, factor.sum_dtype()), **options)

    @torch.no_grad()
    def write(self, kept) -> None:
        """Each parameter's sum over its factors in ``kept`` (parameter -> factors; emptied) added to its p.grad."""
        group_of = self.group_of
        uses, owner = [], []  # (factor, group) per use; the index in ``params`` of the parameter it belongs to
        params, left = [], []  # the parameters summed in batches; how many of their uses are still to come
        written_in = []  # per use: the parameter's dtype where that use's sum is its whole clipped sum, else None
        tables = []  # (parameter, its one lookup's factor, group): written last (below)
        for param, factors in kept.items():
            group = None if group_of is None else group_of[id(param)]
            if len(factors) == 1 and isinstance(factors[0], EmbeddingGather):
                tables.append((param, factors[0], group))
                continue
            owner.extend([len(params)] * len(factors))
            uses.extend((f, group) for f in factors)
            written_in.extend([param.dtype if len(factors) == 1 else None] * len(factors))
            params.append(param)
            left.append(len(factors))
        kept.clear()  # the factors live on in ``uses`` only, each until its sum is formed
        factors = None  # (the loop's name would hold the last parameter's factors to the end)
        partial = {}  # parameter index -> the sum of its uses so far (tied weights)
        # Each sum is written as its batch is formed (equal shapes in batches, norms/batched_sums.py), and its
        # factors dropped: the gradients written replace the activations and output grads that were kept.
        for position, part in weighted_sums(uses, self._weights_of, self._weighted_sum, written_in):
            uses[position] = None
            k = owner[position]
            clipped = part if k not in partial else partial.pop(k) + part
            left[k] -= 1
            if left[k]:
                partial[k] = clipped
            else:
                self._put(params[k], clipped)
        # An embedding table's clipped sum is as large as the table, and its factor (ids and G) small: written after
        # every other sum has freed its factors, not beside them (BERT L=4, H=256, B=8, the word embeddings' 30 MB
        # beside 37 MB of kept factors: 1.95x plain's peak before 2026-11-26).
        while tables:
            param, factor, group = tables.pop()
            # (in the parameter's dtype: no wide copy of a 16-bit table)
            self._put(param, self._weighted_sum(factor, group, out_dtype=param.dtype))

    @staticmethod
    def _write(param, clipped):
        if clipped.dtype != param.dtype:
            clipped = clipped.to(param.dtype)
        if param.grad is None:
            param.grad = clipped
        else:
            param.grad.add_(clipped)


CLIPPING_MODES = {mode.name: mode for mode in (TwoPass(), BookKeeping())}


def clipping_mode(name: str):
    if name not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {tuple(CLIPPING_MODES)}, got {name!r}")
    return CLIPPING_MODES[name]


# What a step keeps is "little" when it is at most this part of the bytes its layers' inputs and output grads
# hold (a LoRA model at T=512: about 1/16 in bf16). Book-keeping then stays one backward under checkpointing,
# and two passes take book-keeping's one backward (below).
KEPT_FRACTION_UNDER_CHECKPOINTING = 1 / 8

# Two passes take book-keeping's one backward on a step where the last norm pass found that book-keeping would keep
# little (adapters: LoRA's explicit per-example gradients, rank r << T tokens): the same clipped sums, without a
# second backward through the frozen base (which made two passes 1.3-1.45x book-keeping's step on GPT-2 and Llama
# with LoRA on a GPU), and with less memory than two passes hold (their pass 1 keeps the graph for pass 2; one
# backward frees it as it goes, and keeps little). Only where book-keeping runs: no FSDP2-sharded parameter
# (mode_of_step's ``may_keep``); several processes decide together (StepModes.agree). False: two passes always take
# two passes.
ONE_BACKWARD_WHERE_KEEPING_LITTLE = True

# "Little" for that, where the forward ran no checkpoint: up to this part. Two passes then hold the whole graph,
# every trained layer's input included, through pass 2, and one backward frees it as it goes; kept in float32, an
# adapter's explicit gradients take twice their elements' bytes beside 16-bit inputs (r=16 at T=128 in bf16: about
# 1/4). Measured (CPU tensor bytes, Llama-shaped LoRA r=16, L=2, H=256, bf16, B=8, `python -m profiling.bench
# --model llama-lora --cpu-memory tensors`): book-keeping's peak below two passes' at kept fractions 0.22, 0.44 and
# 0.87 (T=128, 64, 32; at T=32 5.23 against 5.52 MB). Full fine-tuning keeps everything (a fraction of 1) and stays
# two passes. Under checkpointing the limit is KEPT_FRACTION_UNDER_CHECKPOINTING: what is kept then competes with
# the little that checkpointing leaves.
KEPT_FRACTION_WITHOUT_CHECKPOINTING = 1 / 2
# Without a checkpoint, also where book-keeping keeps at most this part of the bytes the graph saved (each storage
# once, parameters left out: saved_bytes.py), as estimated for its pass: its backward frees the graph's saved
# tensors as it keeps its factors, layer by layer, where two passes hold them all through pass 1 (and form output
# grads and Grams beside them). Measured (`python -m profiling.one_backward`, CPU tensor bytes: kept / saved, then
# two passes' peak against book-keeping's, MB; 2026-11-27), the measures fall in two clusters:
# - at most 1.03 wherever book-keeping keeps the Linear layers' inputs and output grads (the inputs are tensors the
#   graph saved anyway), and book-keeping's peak was at or below two passes' every time: GPT-2 with its tied LM head
#   (V=8192, L=4, H=256, B=8) at T=256 0.77 (479.8 against 479.5), at T=64 0.65 (104.6 against 104.5), in bf16
#   with V=2048 0.54 (181.7 against 179.1); BERT (L=4, H=256, V=1000) at T=128, B=16 1.02 (137.6 against 136.8),
#   in bf16 at T=256, B=8 1.01 (74.2 against 72.6) and at T=32 1.03 (15.3 against 13.9). The CPU stand-in of
#   profiling.overhead reads 1.02, a BERT-base in bf16 at T=128 1.01; on an H200 book-keeping's working set was at
#   or below ghost's on every BERT-base row (profiling.suite, 2026-11-26);
# - 1.28 and above where it keeps explicit per-example gradients instead (layers whose T (d + p) exceeds d p),
#   which no saved tensor shares, and its peak was 14-23% above two passes': BERT at T=160, fp32 1.28 (81.0
#   against 92.3), at T=256 1.32 (138.3 against 164.4), in bf16 at T=320 1.28 (48.1 against 59.1), T=512 1.32
#   (78.6 against 89.2); a stack of Linear layers and ReLUs 1.78 (5.2 against 8.0). (Before the forward's
#   arguments were left out, also T=192 fp32 1.23, 100.0 against 107.0, and T=384 bf16 1.23, 58.3 against 67.4.)
# The limit lies between the clusters (0.9 until 2026-11-27 kept BERT classifiers at two passes: 1.15x their
# book-keeping step on the CPU stand-in, 2026-11-27, and 1.22x on the H200's B=256 frozen row, 2026-11-26).
KEPT_OF_SAVED = 1.1


def mode_of_step(configured, checkpointed: bool, per_group: bool, kept_fraction: float | None = None,
                 may_keep: bool = False, kept_of_saved: float | None = None):
    """The mode a DP loss's backward runs in: ``configured``, or two passes for a checkpointed book-keeping step,
    or book-keeping for a two-pass step that keeps little (see above). ``kept_fraction``: kept bytes / held bytes
    of the last norm pass, None before the first; ``kept_of_saved``: kept bytes / the graph's saved bytes (see
    KEPT_OF_SAVED), None where not measured. ``may_keep``: book-keeping can run this step (no FSDP2-sharded
    parameter; several processes decide by measures they agreed on: StepModes)."""
    limit = KEPT_FRACTION_UNDER_CHECKPOINTING if checkpointed else KEPT_FRACTION_WITHOUT_CHECKPOINTING
    keeps_little = ((kept_fraction is not None and kept_fraction <= limit)
                    or (not checkpointed and kept_of_saved is not None and kept_of_saved <= KEPT_OF_SAVED))
    if configured.keeps_factors:
        if checkpointed and not per_group and not keeps_little:
            return CLIPPING_MODES[TwoPass.name]
        return configured
    if keeps_little and may_keep and ONE_BACKWARD_WHERE_KEEPING_LITTLE:
        return CLIPPING_MODES[BookKeeping.name]
    return configured


BOOKKEEPING_WITH_CHECKPOINTING = (
    "per-group clipping with activation checkpointing: per-group clipping needs book-keeping, which keeps every "
    "layer's inputs and output grads until the clipping coefficients are known; that undoes what checkpointing "
    "saves (2.5-3.4x the plain checkpointed step's peak, BERT on CPU). One max_grad_norm (clipping='ghost', or "
    "'bookkeeping', which takes ghost's two passes under checkpointing) stays at the plain checkpointed peak "
    "(1.00-1.05x).")
TWO_PASSES_UNDER_CHECKPOINTING = (
    "clipping='bookkeeping' under activation checkpointing (or saved-tensor offloading): these steps take ghost's "
    "two passes, because keeping the layers' inputs and output grads would undo the memory checkpointing saves "
    "(book-keeping keeps one backward there only when it can keep small explicit per-example gradients instead, "
    "as for LoRA adapters). The clipped sums are the same; the time and memory are clipping='ghost''s.")
ONE_BACKWARD_KEEPING_LITTLE = (
    "clipping='ghost': what book-keeping would keep for this model is small (adapters such as LoRA: small per-example "
    "gradients beside the layers' inputs and output grads), or about what its graph saves at most (tensors two "
    "passes hold through their first pass), so its steps take book-keeping's one backward instead of a second "
    "backward: the same clipped sums, faster, and about the memory of two passes or less (modes.py; "
    "ghostdp.clipping.modes.ONE_BACKWARD_WHERE_KEEPING_LITTLE = False keeps two passes).")


class StepModes:
    """The mode each DP loss's backward runs in (``mode_of_step``), from what the norm passes measured of what
    book-keeping keeps (``kept_fraction``), and what that choice tells the user, once each."""

    def __init__(self, configured, per_group: bool):
        self.configured = configured  # the controller's mode
        self.per_group = per_group
        self.kept_fraction = None  # of the last norm pass that measured: kept bytes / bytes its factors held
        # Of the last norm pass that counted the bytes its graph saved: those per element of the trained calls'
        # outputs (the step's footprint), and that footprint. A footprint half as large again or two thirds of it is
        # counted again (layers frozen or unfrozen, a batch of much other lengths); in between the graph's bytes are
        # estimated from it.
        self.saved_per_element = None
        self.counted_footprint = None
        # Of the last norm pass that measured: kept bytes, each tensor once / the graph's saved bytes so estimated.
        self.kept_of_saved = None
        # Several processes: (kept_fraction, kept_of_saved), each the largest of the ranks', agreed at the last
        # optimizer step (``agree``).
        self.agreed = None
        self.measured_calls = None  # calls_signature of the step last measured (not saved: it names modules by id)
        # Pass 2 of two passes received other output grads than pass 1 on a checked step: each later pass 2 scales
        # its clipped sums (pass_two.py).
        self.pass_two_rescaled = False
        self._told = set()

    def for_loss(self, checkpointed, several: bool, sharded):
        """The mode of the DP loss being built. ``checkpointed()``: its forward ran a trained layer under a
        checkpoint; ``several``: several processes (every rank must take the same mode, and each measures its own
        batches: they decide by the fraction agreed at the last optimizer step, the same on every rank, so the mode
        changes between logical batches only); ``sharded()``: the model has FSDP2-sharded parameters (book-keeping
        cannot run). Called only where they matter."""
        mode = self._decide(checkpointed, several, sharded)
        if mode is not self.configured:
            if not self.configured.keeps_factors:
                self._tell_once(ONE_BACKWARD_KEEPING_LITTLE)
            elif several or self.kept_fraction is not None:  # the first such step measures
                self._tell_once(TWO_PASSES_UNDER_CHECKPOINTING)
        return mode

    def expects_one_backward(self, checkpointing: bool, several: bool, sharded) -> bool:
        """Whether a two-pass controller's next DP loss would take book-keeping's one backward, asked as its forward
        starts (``checkpointing``: the model's transformers flag says it checkpoints): the forward then records its
        calls as book-keeping does (recording.py), for the one backward that frees the graph as it goes. A forward
        that then runs a trained layer under a checkpoint takes two passes all the same, as book-keeping's does."""
        return not self.configured.keeps_factors and self._decide(lambda: checkpointing, several, sharded).keeps_factors

    def _decide(self, checkpointed, several: bool, sharded):
        configured = self.configured
        kept_fraction, kept_of_saved = (self.agreed or (None, None)) if several else (self.kept_fraction,
                                                                                     self.kept_of_saved)
        if not configured.keeps_factors:
            mode = mode_of_step(configured, checkpointed(), False, kept_fraction, may_keep=True,
                                kept_of_saved=kept_of_saved)
            if mode is configured or sharded():  # (the walk over the parameters only where it decides)
                return configured
            return mode
        return mode_of_step(configured, checkpointed(), self.per_group, kept_fraction)

    def measures(self, mode, checkpointed, passes: int, calls=()) -> bool:
        """Whether the norm pass of a step in ``mode`` measures what book-keeping keeps (~1.5 us a factor, ~1 ms a
        step on the CPU stand-in). Book-keeping: where ``checkpointed()`` (its first such step takes two passes).
        Two passes: the first, then on the layout proofs' schedule (norm pass ``passes``), and a step that took one
        backward whose recorded ``calls`` differ from the last measured step's (``calls_signature``: to go back as
        soon as it keeps much; the same calls keep the same bytes): not every step."""
        if self.configured.keeps_factors:
            return checkpointed()
        if not ONE_BACKWARD_WHERE_KEEPING_LITTLE:
            return False
        if self.kept_fraction is None or proof_scheduled(passes, REPROOF_EVERY):
            return True
        return mode.keeps_factors and calls_signature(calls) != self.measured_calls

    def weighs_saved(self) -> bool:
        """Whether this controller weighs what book-keeping keeps against the bytes the graph saved: two passes
        configured (a step without a checkpoint then needs its footprint: ``counts_saved``)."""
        return ONE_BACKWARD_WHERE_KEEPING_LITTLE and not self.configured.keeps_factors

    def counts_saved(self, footprint: int, passes: int) -> bool:
        """Whether the step about to run norm pass ``passes``, without a checkpoint (its saved tensors would be the
        checkpoint's to hold), counts the bytes its graph saved (saved_bytes.py, ~1 us a saved tensor, 1-2 ms a
        BERT step): the first, then on the layout proofs' schedule, and where its footprint (elements of the trained
        calls' outputs) is outside 2/3 to 3/2 of the last count's. A pass that counts also measures what
        book-keeping would keep."""
        counted = self.counted_footprint
        return (counted is None or proof_scheduled(passes, REPROOF_EVERY)
                or not 2 * counted <= 3 * footprint <= 9 * counted / 2)

    def measured(self, passed, mode, checkpointed, saved: int | None = None, footprint: int | None = None,
                 calls=()) -> None:
        """Takes the measure of norm pass ``passed`` (records.NormPass), if it made one, with the bytes ``saved``
        that its graph saved where they were counted, and its ``footprint`` (``counts_saved``). Per-group clipping
        under checkpointing (``checkpointed()``), which keeps book-keeping, is warned of once where it keeps much."""
        if not passed.held_bytes:
            return
        self.kept_fraction = passed.kept_bytes / passed.held_bytes
        self.measured_calls = calls_signature(calls)
        if saved is not None and footprint:
            self.saved_per_element, self.counted_footprint = saved / footprint, footprint
        estimate = self.saved_per_element * footprint if self.saved_per_element and footprint else None
        self.kept_of_saved = passed.kept_storages.total() / estimate if estimate else None
        keeps_much = self.kept_fraction > KEPT_FRACTION_UNDER_CHECKPOINTING
        if (self.configured.keeps_factors and mode.keeps_factors and keeps_much
                and BOOKKEEPING_WITH_CHECKPOINTING not in self._told and checkpointed()):
            self._told.add(BOOKKEEPING_WITH_CHECKPOINTING)
            warnings.warn(BOOKKEEPING_WITH_CHECKPOINTING, stacklevel=3)

    def local_measure(self) -> tuple[float, float]:
        """This process's (kept_fraction, kept_of_saved) for the ranks' agreement (inf where not measured)."""
        return tuple(math.inf if m is None else m for m in (self.kept_fraction, self.kept_of_saved))

    def agree(self, largest) -> None:
        """Each measure's largest ``local_measure`` over the ranks, from the DP optimizer's all-reduce at each step."""
        self.agreed = tuple(None if math.isinf(m) else m for m in largest)

    _STATE = ("kept_fraction", "saved_per_element", "counted_footprint", "kept_of_saved", "agreed", "pass_two_rescaled")

    def state_dict(self) -> dict:
        """The measures the next steps' modes follow: a resumed run takes the modes the saved one would have taken
        (their clipped sums are equal, their rounding is not)."""
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self._STATE:
            setattr(self, name, state.get(name))
        self.pass_two_rescaled = bool(self.pass_two_rescaled)  # (a state saved before it was kept)

    def _tell_once(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            log.info(message)


def calls_signature(calls) -> tuple:
    """What sets the bytes book-keeping keeps for a step's recorded calls: each call's module, output shapes and
    number of trained parameters (StepModes.measures)."""
    return tuple([(id(call.module), call.shapes, len(call.params)) for call in calls])


def new_factor_store():
    return defaultdict(list)  # parameter -> the factors of its uses in this pass
