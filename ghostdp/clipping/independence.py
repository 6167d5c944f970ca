"""Whether the model's forward keeps the examples apart where no gradient shows it.

The layout proof (layout.py) and the proof of a fallback's inputs (pass_one.py) read gradients, so they see
a forward that mixes examples on a path autograd differentiates. A statistic of the batch computed without
gradient mixes them where no gradient flows: a mean under torch.no_grad() or of detached tensors, a running
statistic used in train() mode, tokens routed under a capacity that the batch shares. Each example's gradient
then depends on the other examples' data, and an added example moves all of their clipped gradients:
``x - x.detach().mean(0)`` before a Linear moved the clipped sum of 8 examples by 4.5 C, both modes
(before 2026-11-26).

So on the training forwards that the layout proof's schedule names (the first; then 1, 2, 4, ..., REPROOF_EVERY and
every REPROOF_EVERY-th), the model runs three more times without gradient just before the forward itself (from its
start, in the model's first forward pre-hook: the reruns' largest temporaries never lie beside the activations the
forward saves), from the random generators' (torch's, NumPy's and Python's global ones and those its modules hold:
generators.py) and buffers' states it starts with: on the same batch, and on two batches
of one example each, the first or the last example copied to every row (dim 0 of every tensor argument of the batch's
size). That example's output must not move: no other example's data reaches it. Until 2026-12-02 the check replaced the
last example by a copy of the first and compared the others: a forward that gives every example something of the
first one (``x + lin(x[:1])``) trained, one example moving every other's clipped gradient, and a batch mean moved the
others by only 1/B of the examples' difference (seen in bfloat16 up to B = 8); a batch of copies moves it by all of
it. Outputs are compared through float64 fingerprints, one random +-1 projection per
example of each output with the batch on dim 0, at the forward's end, against what the first rerun differs from the
forward itself (a kernel chosen differently without gradient, or a nondeterministic one; where they differ, a third
rerun measures the reruns' own spread). Replacing keeps the batch's size, which a forward may read alone (``x /
x.shape[0]`` let an added example move the others' clipped sum by 0.8 C besides its own C): with two or more
examples (three before 2026-12-07: a count over a batch of two, the same in both copies, trained), the forward also
runs in eval() mode on the batch and without its last example, the others in reverse order
(eval(): a smaller batch would draw other dropout masks, on a GPU for every example), and the others' outputs must not
move there either. The reversal puts every example in another row: a forward that gives a middle example something of
another reaches neither the first one's output nor the last's, and trained until late 2026-12-02; one that treats an
example by its row (an offset per row) is refused too, since removing an example moves those after it to other rows.
It also runs without its first example, and with three or more without the middle one (batch // 2), the others in
their order (since 2026-12-07): a statistic of the batch that removing the last example leaves as it was and removing
another moves (a mask thresholded from the first example's data or from the batch's mean, a capacity of the batch's
tokens, which the fuzzer's third generation of blocks trained with). A discrete statistic of the batch that none of
these removals moves, and no copy either, still trains on such a step where removing another example would move it
(a capacity of the batch's tokens where each example removed held exactly its share of it: with many tokens rare, and
a later checked step refuses it). A forward with an attention mask
runs once more, padded further (padding.py). A move is refused at the norm pass that
follows, for the batch of its per-example losses, unless the examples might not lie on the dim the check replaced
them on: a replaced argument has another dim of the batch's size ((T, B, ...) at T = B), no trained tokenwise layer
reading it (an Embedding of the ids, a first Linear; a fallback through the proof of its inputs) has its proven
examples on that dim, and, on dim 0, a module has batch_first=False or the layout proof placed a call's examples on
another dim (a batch flattened into dim 0, each example's rows together, keeps them on dim 0: _refusable); such a
move is warned of once (INCONCLUSIVE; until late 2026-12-02 it went unsaid). Where those readers' proof places the
examples on the other dim (a sequence-first model at T = B, checked along its positions at its first forward), the
check runs again there at that norm pass, before any gradient is written, and from then on
(recheck_where_square; until 2026-12-07 every step with T = B of such a model was warned of as inconclusive, mixing
or not). Still warned, not refused: a batch-first model that mixes, with T = B and a GRU built sequence-first, where
no trained layer reads its input; the check concludes on steps whose batch size differs.

A sequence-first batch ((T, B, ...)), a PackedSequence, and a batch that is not the forward's first argument: where
the check replaces examples and compares outputs, replacements.py says.

With several processes
every process reruns the same forwards (a forward may gather parameters, FSDP2, or broadcast buffers, DDP): a rerun
that one process needs (its batch can be padded, or has two or more examples) runs everywhere, on the batch itself
where a process has nothing to check there; and every process refuses where any one found a move (it would otherwise
wait for the refusing one in the next collective), the padding check once the lengths differ on any process or
between processes (each pads its own batch). There a finding is decided at the norm pass after a checked forward
(one all-reduce; a refusal between those would stop one process alone).

The reruns take copies of the batch's tensors (a forward that scales its input in place would otherwise give the
training forward a batch the reruns had changed). The generators and buffers are put back after the reruns (a
rerun's in-place updates of a buffer go to a copy), and so are the tensors the modules keep as plain attributes
(replaced, changed in place, or set where there was none; a checked forward that changes one is warned of:
buffers.CHANGED_ATTRIBUTE), so training draws and stores what it would have without them; the model's other forward
hooks (the user's) do run again. A forward that cannot run again (or takes an iterator, which a rerun would consume
first) is warned of once and trains unchecked; so does one whose arguments hold no tensor with a dim, or whose output
has no tensor with the batch on the dim it compares (UNCHECKED, said at the norm pass, where the losses confirm
the batch: an EmbeddingBag given offsets; unsaid before 2026-12-03), and a model whose trained layers ran outside its own forward (a method
such as encode, its submodules called one by one, a LightningModule's self.net(x)), which the check does not rerun:
such a forward mixing its examples without gradient trained without a word before 2026-12-03. The tensors of a batch passed, or an output returned, in a SimpleNamespace
or a dataclass are found and replaced there (leaves.py). Not covered: mixing after the model's forward (between its output and
the DP loss), data that mixes only on steps off the schedule, and the discrete statistic above. Cost: seven forwards
without gradient on those steps (eight with an attention mask; five and six before 2026-12-07, four and five before
2026-12-02, when the CPU stand-in with B = 4 and a mask,
book-keeping, took 49.9 ms a checked step against 21.3 ms unchecked, 43.9 ms without the padding rerun), so 10 of the
first 300 steps add ~3% over them, and one step in 256 ~0.6% after.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.nn.utils import parametrize
from torch.utils._pytree import keystr

from .. import collector
from ..data import distributed_rank_and_size, maxima_across_ranks
from ..sharding import is_sharded
from .buffers import CHANGED_ATTRIBUTE, CHANGED_BY_A_RERUN, changed_attributes, tensor_attributes
from .fingerprints import fingerprints_of, largest_exceeding, moves_between, per_example_output, relative_floor
from .generators import own_generators, random_states, restore_random_states
from .layout import BATCH_FIRST, REPROOF_EVERY, ROWS_LAYOUT, TILED_LAYOUT, proof_scheduled
from .leaves import flatten, output_leaves, unflatten
from .packed import repacked, unpacked
from .padding import (COUNTS_PADDING, DEPENDS_ON_PADDING, EXTRA, at_real_positions, attention_mask, counted_padding,
                      in_eval_mode, padded_arguments)
from .recording import leading_dim
from .replacements import (ON_DIM, REMOVED, REMOVED_FIRST, REMOVED_MIDDLE, REPLACED_BY_FIRST, OutputViews,
                           argument_dims, batches_of_calls, examples_dim_and_batch, examples_of_the_loaders_batch,
                           replaced_batches, without_example, without_last_reversed)

MIXING_OUTSIDE_GRADIENTS = (
    "the model's forward mixes examples where no gradient flows: {how} {output} by "
    "{moved:.3g} of its size (beyond {threshold:.3g}, what rounding and the reruns' own spread allow), with the "
    "random generators and buffers as the forward had them. Something mixes the examples where no trained "
    "layer's gradient shows it: a mean or variance under torch.no_grad() or of detached tensors, a "
    "running statistic used in train() mode, a routing capacity shared by the batch, a scale by the batch's "
    "size (x / x.shape[0]), or one example's data given to the others (x + f(x[:1]) on the inputs: a prefix or "
    "an anchor taken from the batch). Each example's clipped gradient then depends on "
    "the others' data, and one example can move the update by more than the clipping norm (measured: 4.5 C). "
    "Fix: compute such statistics per example (normalise over each example's own features, as LayerNorm and "
    "GroupNorm do), from data outside the private batch, or keep them fixed during training. If you are sure that "
    "the examples stay apart and the move is rounding (16-bit weights, kernels that the batch's content chooses), "
    "switch the check off with controller.independence.every = 0 (engine.controller after make_private, "
    "trainer.controller in DPTrainer).")

FOUND_ON_ANOTHER_PROCESS = (
    "another process found that {what} (its error says where, by how much, and the fix). "
    "Every process stops here, so that none waits for the others in a collective.")


class ParameterChangedByARerun(RuntimeError):
    """A rerun of the forward check changed a parameter in place (CHANGED_BY_A_RERUN): refused, never warned of and
    trained unchecked as another failing rerun is (the weights may have moved)."""


FORWARD_MIXES = "the model's forward mixes examples where no gradient flows"
FORWARD_DEPENDS_ON_PADDING = "the model's forward depends on how far the batch is padded"
LOSS_COUNTS_PADDING = "the loss counts positions the attention mask excludes"

AN_ITERATOR_ARGUMENT = (
    "an argument of the model's forward is an iterator ({kind}), which a rerun of the forward would consume before "
    "the forward itself")

INCONCLUSIVE = (
    "the forward check found that {how} {output} by {moved:.3g} of its size (beyond {threshold:.3g}), but cannot "
    "tell whether that is mixing: a tensor of the batch has another dim of the batch's size ({batch}), and {why}, so "
    "the examples may lie on that dim and the check may have moved positions, not examples. The step trains. If the "
    "model keeps its examples on dim 0, this is mixing (the check would have refused it: " + FORWARD_MIXES + "); the "
    "check concludes on checked steps whose batch size differs from the other dims (Poisson sampling, another "
    "sequence length). Warned once.")

RERUN_FAILED = (
    "ghostdp could not check that the model's forward keeps the examples apart: running it again without "
    "gradient raised {error!r}. A forward that mixes examples without gradient (a batch statistic under "
    "torch.no_grad()) would go unnoticed. Fix: let the model's forward run twice per step (no state kept "
    "between calls outside its buffers).")


UNCHECKED = (
    "ghostdp could not check that the model's forward keeps the examples apart where no gradient flows: {why}. A "
    "forward that mixes examples without gradient (a batch statistic under torch.no_grad()) would go unnoticed; the "
    "layout proof still checks what the gradients show. Fix: {fix}. Warned once.")
OUTSIDE_THE_FORWARD = ("module '{name}' trained in a forward that ran outside the forward of the model ghostdp was given "
                       "({root}): a method of the model (encode, get_text_features) or its submodules called one by "
                       "one, and the check reruns only the model's own forward (nor did the watch of the buffers a training forward changes "
                       "see it)")
CALL_THE_MODEL = ("call the model itself (in a LightningModule's training_step, self(x) with a forward that runs the network, "
                  "not self.net(x)), or give ghostdp a module whose forward is what you call (class Encoder(nn.Module) "
                  "with forward(self, x): return model.encode(x), the model its submodule)")
NO_TENSOR_ARGUMENT = ("its arguments hold no tensor with a dim ({found}), so the check cannot replace the batch's "
                      "examples")
PASS_TENSORS = ("pass the batch as tensors with the examples on dim 0, or in a tuple, list, dict, dataclass or "
                "SimpleNamespace of them (a model that tokenizes its text itself: tokenize before the forward)")
NO_BATCH_FIRST_OUTPUT = ("no tensor of its output has {batch} rows on {dims}, the size of dim {dim} of the forward's first "
                         "tensor argument, where the check takes the examples to lie ({found})")
NO_DIM_OF_THE_LOSSES = ("the per-example losses number {losses}, but the check took the {batch} rows of dim {dim} of the "
                        "forward's first tensor argument for the examples (the tensor arguments' shapes: {shapes}), and "
                        "no tensor argument has the losses' size on dim 0 (nor the first of two or more dims on dim 1), "
                        "so it could not replace the batch's examples")
EXAMPLES_ON_DIM_0_OR_1 = ("pass the batch as tensors with the examples on dim 0 (or on dim 1 of every tensor of two or "
                          "more dims, for a sequence-first model), the data first, not flattened")
RETURN_BATCH_FIRST = ("keep the examples on dim 0 of the forward's tensor arguments and of its outputs (batch_first=True "
                      "for recurrent and attention layers; a 2-D input for an EmbeddingBag, not offsets), the outputs "
                      "returned as tensors or in a tuple, list, dict, dataclass, SimpleNamespace or transformers "
                      "ModelOutput")

_MISSING = object()
_EXAMPLES_ON_DIM_0 = (BATCH_FIRST, ROWS_LAYOUT)  # the layouts under which the check perturbed examples (_refusable)
_DIM_OF_LAYOUT = {**dict.fromkeys(_EXAMPLES_ON_DIM_0, 0), ("dim", 1): 1}  # an argument's examples' dim (_dims_read)
_NO_GRAD_INPUTS = "None of the inputs have requires_grad=True"  # torch.utils.checkpoint's warning


class PaddingDependence(NamedTuple):
    """A forward whose outputs at the original positions moved when the batch was padded further (padding.py)."""
    batch: int
    length: int     # T of the forward's attention_mask
    extra: int      # the positions added
    output: str
    moved: float
    threshold: float


REPLACEMENT_RERUNS = 2  # one per replaced batch: every process runs as many (a forward may gather or broadcast)


class Mixing(NamedTuple):
    """A forward in which an example's output moved when others were replaced by copies of it (or the other examples'
    outputs moved when the last was removed and their order reversed)."""
    batch: int
    output: str     # where in the model's output: 'output', "output['logits']", ...
    moved: float    # the largest move of a fingerprint, relative to the largest fingerprint
    threshold: float  # the move allowed there, relative likewise
    square: frozenset  # (id, dim replaced on) of the replaced arguments with another dim of the batch's size
    how: str = REPLACED_BY_FIRST
    dim: int = 0       # the dim of the batch's tensors of two or more dims that the check replaced examples on

    def said(self) -> str:
        """How it was found, for a message."""
        return self.how.format(batch=self.batch, where=ON_DIM[self.dim], middle=self.batch // 2)


class Checked(NamedTuple):
    """What the norm pass after a checked forward reads of it (ForwardIndependence.learn_from): (index among the
    flattened arguments, shape) of the forward's tensor arguments, the dim and size of the batch the check took, and,
    where it found no output to compare, what it found instead (a message of the unchecked warning, given where its
    batch was the losses')."""
    shapes: list
    dim: int
    batch: int | None
    unchecked: str | None = None
    square: frozenset = frozenset()  # replaced_batches': where set, the proof of the calls says which dim holds them
    leaf: int | None = None          # the index among the flattened arguments of the tensor the examples' dim goes
    leaf_id: int | None = None       # by (argument_dims), and its id (its readers' proof: _dim_read)


_GUESSED_FORWARD = "ghostdp_guessed_forward"  # the key of a _GuessedForward in its outputs' nodes' metadata


class _GuessedForward:
    """A checked forward whose examples the check guessed (ForwardIndependence.recheck_where_guessed): its module,
    arguments and Checked, held by its outputs' autograd nodes."""
    __slots__ = ("module", "args", "kwargs", "checked", "__weakref__")

    def __init__(self, module, args, kwargs, checked):
        self.module, self.args, self.kwargs, self.checked = module, args, kwargs, checked


class _Pending(NamedTuple):
    """The reruns of a checked forward, run before it (ForwardIndependence._rerun_before), for the comparison at its
    end."""
    batch: int
    devices: list
    start: tuple        # (random states, buffers with copies of their values) at the forward's start
    signs: list         # per output leaf: the fingerprints' +-1 signs, or None
    floors: list
    outputs: list       # per output leaf: (key path, shape or None)
    same: list          # fingerprints of the batch
    moved: list         # per replacement (replaced_batches): (its fingerprints, the examples compared, how)
    again: list | None  # ... of the batch once more (several processes), else None
    square: frozenset   # replaced_batches'
    arguments: tuple    # (flat, spec) of the forward's arguments
    views: OutputViews  # where each output's examples lie (fingerprinted there)
    dim: int            # the dim of the arguments' examples (examples_dim_and_batch)


def _accelerators(module, args, kwargs) -> list:
    """The devices other than the CPU that the batch and the model's parameters lie on: a forward draws from
    their generators besides the CPU's (a model split over several GPUs draws its dropout on each)."""
    tensors = [t for t in flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return list({t.device: None for t in tensors + list(module.parameters()) if t.device.type != "cpu"})


def _kinds(flat) -> str:
    """What the forward's arguments hold, for a message: their leaves' types, the first few."""
    kinds = list(dict.fromkeys(type(x).__name__ for x in flat))
    return ", ".join(kinds[:4]) + (", ..." if len(kinds) > 4 else "") if kinds else "no argument"


class ForwardIndependence:
    """The check of the module doc, for one attached model. ``finding``: the Mixing of a checked forward, until
    the norm pass that follows reads it (``refuse_mixing``)."""

    def __init__(self, module, recorder, ledger=None):
        self.recorder = recorder
        self.ledger = ledger  # the controller's StepLedger: the examples of the batch the DP loader handed out
        # Modules that may take their examples on another dim than 0 (batch_first=False: torch's recurrent and
        # attention layers, ghostdp.layers): where the batch's tensors are square, dim 0 may be their sequence.
        self.sequence_first = [name for name, m in module.named_modules() if getattr(m, "batch_first", True) is False]
        self._sequence_first_modules = [module.get_submodule(name) for name in self.sequence_first]
        self.examples_dim = None  # the dim of the arguments' examples that a norm pass found (learn_from), or None
        self.examples_leaf = None  # ... and the index, among the flattened arguments, of the tensor it found them in
        self._checked = None      # the Checked of the last checked forward, until its norm pass reads it
        # Weak references to the _GuessedForward of checked forwards whose examples were guessed with no count to go
        # by (no dim learned, no DP loader's count), until the losses give theirs (recheck_where_guessed); each lives
        # as long as its forward's graph.
        self._guessed = []
        self._guessed_now = None  # (module, args, kwargs) of the forward running where it guessed, for its end
        self.every = REPROOF_EVERY            # 0: no forward is checked (tests of what a step does without it)
        self.forwards = 0                     # training forwards begun
        self.finding = None
        self.last_moves = []                  # the Moves of the last checked forward (profiling.forward_check)
        # padding.py: the lengths (attention_mask's T) of the training forwards, two at most (whether they differ),
        # and the PaddingDependence found on a checked forward (kept: refused once the lengths differ).
        self.lengths = set()
        self.padding_finding = None
        self.check_padding = True             # False: no padding reruns (the refusal names this switch)
        self.last_padding_moves = []
        self.last_removal_moves = []          # the Moves of the last checked forward without its last example
        self.last_first_removal_moves = []    # ... without its first
        self.last_middle_removal_moves = []   # ... and without its middle one (batch // 2)
        self._pending = None                  # the reruns of a checked forward, for the comparison at its end
        self._attributes = None               # tensor_attributes as a checked forward found them at its start
        self._running = False                 # the reruns are running: the hooks stay out
        self._generator = torch.Generator().manual_seed(0x1d3)  # the fingerprints' signs: never the global RNG
        self._warned = False
        self._warned_unchecked = set()  # the causes of forwards left unchecked, warned of (_warn_unchecked)
        self._warned_inconclusive = False  # a move found where the examples may lie off dim 0 (_warn_inconclusive)
        self._changed_attributes = set()   # tensor attributes a checked forward changed (warned of once each)
        self._verdict_due = False          # several processes: a forward was checked since the last norm pass
        self.checked_mask = None           # (its attention mask or None,) of the last forward, where it was checked

    @contextlib.contextmanager
    def checking_every_forward(self):
        """Inside, every training forward is checked: the physical batch search's probes measure the memory of a
        step with a check, which the schedule runs during training too. The count of forwards is kept as it was,
        so that every process checks the same forwards of training afterwards (their searches may differ)."""
        every, forwards = self.every, self.forwards
        self.every = 1 if every else 0
        try:
            yield
        finally:
            self.every, self.forwards = every, forwards

    def attach(self, module) -> list:
        """The hooks on the model: the start's before any other (the reruns run before the forward begins for every
        other hook: FSDP2's gathers its parameters for the forward, and a rerun inside would put them back), the
        end's after BufferWatch's (which compares the forward's own changes first)."""
        return [module.register_forward_pre_hook(self._on_forward_start, with_kwargs=True, prepend=True),
                module.register_forward_hook(self._on_forward_end, with_kwargs=True)]

    def _on_forward_start(self, module, args, kwargs):
        if self._running or not self.recorder._recording(module) or torch._C._current_graph_task_id() != -1:
            return  # not a training forward, or a checkpoint's recomputation
        self.recorder.watched_arguments = {}  # set again below where this forward is checked
        self._guessed_now = None
        n, self.forwards = self.forwards, self.forwards + 1
        scheduled = self.every and (n == 0 or proof_scheduled(n, self.every))
        mask = attention_mask(module, args, kwargs) if scheduled or len(self.lengths) < 2 else None
        if mask is not None and len(self.lengths) < 2:
            self.lengths.add(mask.shape[1])
        self.checked_mask = (mask,) if scheduled else None
        self._pending = self._attributes = None
        if not scheduled:
            return
        with self._unchecked_where_a_rerun_fails():
            self._pending = self._rerun_before(module, args, kwargs)
        self._attributes = tensor_attributes(module)  # as the forward finds them, after the reruns put them back

    def _on_forward_end(self, module, args, kwargs, output):
        if self._running:
            return  # a rerun's
        self.recorder.watched_arguments = {}
        guessed, self._guessed_now = self._guessed_now, None
        if guessed is not None and self._checked is not None:  # with the Checked its _rerun_before left
            self._keep_with_the_graph(_GuessedForward(*guessed, self._checked), output)
        pending, self._pending = self._pending, None
        attributes, self._attributes = self._attributes, None
        if attributes is None:
            return
        self._warn_of_attributes(changed_attributes(attributes, tensor_attributes(module)))
        if pending is None:
            return
        # Kept until a norm pass reads it: a step of several forwards (a contrastive pair of views) may check one of
        # them and backpropagate after the next.
        with self._unchecked_where_a_rerun_fails():
            self.finding = self._compare(module, pending, output_leaves(output)) or self.finding

    @contextlib.contextmanager
    def _unchecked_where_a_rerun_fails(self):
        """Around the reruns (before the forward) and the comparison (at its end): Python's collector paused, as in
        ghostdp's other parts of a step (collector.py: the reruns' objects die by reference count); an error other
        than running out of memory warned of once (RERUN_FAILED), and the forward trains unchecked. Out of memory,
        the step does not fit with its check (the physical batch search counts it so)."""
        try:
            with collector.paused():
                yield
        except (torch.OutOfMemoryError, ParameterChangedByARerun):
            raise
        except Exception as error:  # noqa: BLE001 - the training forward can run, or ran: warn, do not break it
            if not self._warned:
                self._warned = True
                warnings.warn(RERUN_FAILED.format(error=error))

    def warn_of_calls_outside(self, name: str, root: str) -> None:
        """Once, where the check is on: a trained module ran in a training forward outside the root's forward, which
        the check reruns; nothing checked that forward."""
        if self.every:
            self._warn_unchecked(OUTSIDE_THE_FORWARD.format(name=name, root=root), CALL_THE_MODEL)

    def _warn_unchecked(self, why: str, fix: str) -> None:
        """Once for each cause: a checked forward whose examples the check cannot replace (no tensor argument), or whose
        output it cannot compare (no tensor with the batch on dim 0), or a forward it did not see (outside the
        root's: warn_of_calls_outside)."""
        if fix not in self._warned_unchecked:  # once for each cause (its fix)
            self._warned_unchecked.add(fix)
            warnings.warn(UNCHECKED.format(why=why, fix=fix))

    def _warn_of_attributes(self, names) -> None:
        """Once per name: a tensor attribute that the checked forward replaced or changed (buffers.py)."""
        for name in names:
            if name not in self._changed_attributes:
                self._changed_attributes.add(name)
                warnings.warn(CHANGED_ATTRIBUTE.format(name=name))

    @contextlib.contextmanager
    def _rerunning(self, module, devices, generators=None):
        """Inside, the reruns run; after, the random generators, the buffers, the tensor attributes, the recorder's
        checkpoint flag and parametrize.cached()'s cache are as they were before (a rerun's in-place updates of a
        buffer went to a copy; an attribute a rerun replaced, changed in place or added is put back or removed; a
        parametrized weight a rerun computed without gradient under parametrize.cached() is dropped from the
        cache, where the forward would have taken it and sent no gradient to the parametrization: its clipped
        gradients were wrong by 14%, tests/norms/test_parametrizations.py). ``generators``: the model's own
        (own_generators), where the caller has found them. A parameter that the reruns changed in place and did not
        put back is refused (CHANGED_BY_A_RERUN: nothing put it back before 2026-12-08); one a later rerun put back
        (RWKV rescales its output weights in eval() mode and back in train() mode, by powers of two) trains. Sharded
        parameters are not compared (FSDP2 gathers and frees them in place)."""
        parameters = _ParametersAsFound(module)
        states = random_states(*devices, generators=own_generators(module) if generators is None else generators)
        buffers = _buffers(module, values=False)
        checkpointed = self.recorder.forward_checkpointed
        cached = dict(parametrize._cache)  # torch's module-level cache, replaced by a new dict as cached() ends
        with torch.no_grad():
            attributes = ([(m.__dict__, dict(m.__dict__)) for m in module.modules()],
                          [(d, key, t, t._version, t.clone()) for _, d, key, t, _ in tensor_attributes(module)])
        self._running = True
        try:
            yield
        finally:
            self._running = False
            restore_random_states(states)
            _put_back(buffers)
            self.recorder.forward_checkpointed = checkpointed
            _put_back_attributes(attributes)
            parametrize._cache.clear()
            parametrize._cache.update(cached)
        moved = parameters.moved(module)
        if moved:
            more = f" and {len(moved) - 4} more" if len(moved) > 4 else ""
            raise ParameterChangedByARerun(CHANGED_BY_A_RERUN.format(
                names=", ".join(f"'{name}'" for name in moved[:4]) + more))

    def _rerun_before(self, module, args, kwargs):
        """The reruns of the module doc, before the training forward (so that their largest temporaries do not
        add to the activations it saves): a _Pending of their fingerprints for _compare at its end, or None where
        there is nothing to compare."""
        flat, spec = flatten(unpacked((args, kwargs)))  # a PackedSequence as its padded batch (packed.py)
        learned = None if self.examples_dim is None else (self.examples_leaf, self.examples_dim)
        shapes = [(k, tuple(t.shape)) for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.dim() > 0]
        # The tensor whose examples' dim the check goes by: the one a norm pass found, else the first of two or more
        # dims (examples_dim_and_batch's)
        leaf = learned[0] if learned is not None and learned[0] < len(flat) else next(
            (k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.dim() > 1), None)

        def examples_on(dim, first_dim):
            """(batch, the arguments' dims, the replaced batches, square) with the examples on ``dim``."""
            batch = first_dim or 0
            arguments_dims = argument_dims(flat, batch, dim, leaf)
            replaced, square = replaced_batches(flat, arguments_dims, batch)
            self._checked = Checked(shapes, dim, first_dim, square=square,
                                    leaf=leaf, leaf_id=None if leaf is None else id(flat[leaf]))
            return batch, arguments_dims, replaced, square

        dim, first_dim = examples_dim_and_batch(flat, learned, bool(self.sequence_first))
        guessed = dim == 1 and learned is None  # put right by the first rerun's sequence-first calls
        handed_out = self.ledger.examples_of_next_batch if self.ledger is not None else None
        if learned is None and first_dim != handed_out:  # the guess has not the loader's count of examples
            found = examples_of_the_loaders_batch(flat, handed_out)
            if found is not None:
                (dim, first_dim), guessed = found, False
        batch, arguments_dims, replacements, square = examples_on(dim, first_dim)
        # With several processes every rank reruns on the same forwards, whatever its own batch holds: a forward
        # may gather (FSDP2) or broadcast (DDP's buffers) across them.
        several = distributed_rank_and_size()[1] > 1
        # Kept for a recheck on the dim the losses' count (no count to go by) or the norm pass's proof (a square
        # batch, (T, B, ...) at T = B) places the examples on: recheck_where_guessed, recheck_where_square.
        if (learned is None and handed_out is None or square) and not several:
            self._guessed_now = (module, args, kwargs)
        self._verdict_due = self._verdict_due or several
        self.last_moves = []
        if first_dim is None:  # not an empty batch (Poisson sampling may draw one)
            self._warn_unchecked(NO_TENSOR_ARGUMENT.format(found=_kinds(flat)), PASS_TENSORS)
        if not replacements and not several:
            return None
        consumed = next((x for x in flat if isinstance(x, Iterator) and not isinstance(x, torch.Tensor)), None)
        if consumed is not None:  # the forward would get what the reruns left of it
            raise TypeError(AN_ITERATOR_ARGUMENT.format(kind=type(consumed).__name__))
        devices = _accelerators(module, args, kwargs)
        generators = own_generators(module)
        start = (random_states(*devices, generators=generators), _buffers(module))
        with self._rerunning(module, devices, generators):
            with batches_of_calls(self._sequence_first_modules if guessed else []) as batches:
                leaves = self._rerun(module, (args, kwargs), *start)
            if guessed and batches and batches[0] != batch:  # a batch-first model that transposes for such a layer
                dim, first_dim = 0, leading_dim(flat)
                batch, arguments_dims, replacements, square = examples_on(dim, first_dim)
            outputs = [(path, t.shape if isinstance(t, torch.Tensor) else None) for path, t in leaves]
            views = OutputViews.of_outputs(leaves, batch, dim)
            leaves = views.examples_first(leaves)
            signs = [self._signs(t) if per_example_output(t, batch) else None for _, t in leaves]
            with torch.no_grad():
                same = fingerprints_of(leaves, signs, batch)
            del leaves  # a language model's logits
            checkable = batch > 1 and any(f is not None for f in same)
            if not checkable and batch > 1:  # warned of at the norm pass, where the losses say whether it was the batch
                found = ", ".join(f"output{keystr(path)}: " + ("not a tensor" if shape is None else
                                                                f"a tensor of shape {tuple(shape)}")
                                  for path, shape in outputs[:4])
                self._checked = self._checked._replace(unchecked=NO_BATCH_FIRST_OUTPUT.format(
                    batch=batch, dims="dim 0 or 1" if dim else "dim 0", dim=dim, found=found or "none"))
            if not checkable and not several:
                return None  # no output with the batch on its dim: nothing to compare

            def rerun(arguments):
                return self._fingerprints_of_rerun(module, unflatten(arguments, spec), start, signs, views, batch)

            floors = [None if s is None else relative_floor(s.dtype) for s in signs]
            self._check_in_eval_mode(module, flat, spec, arguments_dims, outputs, start, signs, views, floors, batch,
                                     checkable, devices)
            # Where this process's batch cannot be checked, another's may: it reruns with them (``several``).
            moved = [(rerun(replaced), compared, how) for replaced, compared, how in replacements]
            for _ in range(REPLACEMENT_RERUNS - len(replacements) if several else 0):
                rerun(flat)  # in step with the processes that replace
            # With several processes, the rerun that measures the reruns' own spread runs on every process (the
            # forward itself is compared at its end: where it alone differs, _compare reruns once more).
            again = rerun(flat) if several else None
        if not checkable:
            return None
        square_ids = {key for key, _ in square}  # the forward's calls note which they read
        self.recorder.watched_arguments = {id(t): (id(t), t) for t in flat if id(t) in square_ids}
        return _Pending(batch, devices, start, signs, floors, outputs, same, moved, again, square, (flat, spec), views,
                        dim)

    def _compare(self, module, pending, leaves):
        """At the checked forward's end: the fingerprints of its output ``leaves`` against the reruns' (``pending``,
        _rerun_before); a Mixing, or None. A nondeterministic kernel may differ between the forward and its reruns
        only: where a move exceeds its allowance, the batch runs once more and the reruns' spread is measured too."""
        p = pending
        first = p.views.examples_first(leaves)
        forward = [None] * len(p.signs) if first is None else fingerprints_of(first, p.signs, p.batch)

        def moves_of(again):
            """Every replacement's Moves, each with how it replaced."""
            return [(move, how) for moved, compared, how in p.moved
                    for move in p.views.per_output(moves_between(forward, p.same, moved, compared, p.floors, again))]

        moves = moves_of(p.again)
        if p.again is None and any(move.exceeds for move, _ in moves):
            flat, spec = p.arguments
            with self._rerunning(module, p.devices):
                again = self._fingerprints_of_rerun(module, unflatten(flat, spec), p.start, p.signs, p.views, p.batch)
            moves = moves_of(again)
        self.last_moves = [move for move, _ in moves]
        found, how = max(((move, how) for move, how in moves if move.exceeds), key=lambda pair: pair[0].relative,
                         default=(None, None))  # largest_exceeding, keeping the replacement's how
        removals = ((self.last_removal_moves, REMOVED), (self.last_first_removal_moves, REMOVED_FIRST),
                    (self.last_middle_removal_moves, REMOVED_MIDDLE))
        for removal, removed_how in removals:
            if found is None:
                found, how = largest_exceeding(removal), removed_how
        if found is None:
            return None
        return Mixing(p.batch, "output" + keystr(p.outputs[found.output][0]), found.relative, found.threshold,
                      p.square, how, p.dim)

    @staticmethod
    def _rerun(module, arguments, states, buffers) -> list:
        """The output leaves of one forward without gradient on copies of ``arguments`` (args, kwargs; a forward
        that changes its input in place would otherwise change the batch the training forward receives), from the
        generators' ``states`` and copies of the ``buffers``' values at the forward's start."""
        _with_copies(buffers)
        restore_random_states(states)
        with torch.no_grad(), warnings.catch_warnings():
            flat, spec = flatten(arguments)
            args, kwargs = repacked(unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in flat], spec))
            # A reentrant checkpoint warns of inputs without grad, which a rerun's all are.
            warnings.filterwarnings("ignore", message=_NO_GRAD_INPUTS)
            return output_leaves(module(*args, **kwargs))

    def _fingerprints_of_rerun(self, module, arguments, start, signs, views, batch: int, positions=None) -> list:
        """The fingerprints of one rerun (_rerun, from ``start``: the generators' states and the buffers) of
        ``batch`` examples, each output's on the dims of its ``views`` (OutputViews). ``positions``: (the forward's
        outputs, T, attention mask) of a padding check (padding.py; examples on dim 0): the outputs are read at the
        real positions."""
        leaves = views.examples_first(self._rerun(module, arguments, *start))
        if leaves is None:  # an output of another structure: nothing to compare
            return [None] * len(signs)
        if positions is not None:  # (the outputs' shapes with their examples first too)
            leaves = [(None, t) for t in at_real_positions(leaves, *positions)]
        with torch.no_grad():
            return fingerprints_of(leaves, signs, batch)

    def _check_in_eval_mode(self, module, flat, spec, arguments_dims, outputs, start, signs, views, floors, batch: int,
                            checkable: bool, devices):
        """The reruns in eval() mode, where no dropout draws (a batch of another shape would draw other masks): on
        the batch; without its last example and the others reversed, and without its first, where there are two or
        more, and without its middle one where there are three or more (a forward that depends on the batch's size
        alone, or on another example than the first and the last: replacing them does not show it); and, for a
        forward with an attention mask, on the batch padded further (padding.py: a move of its real positions is kept
        as ``padding_finding``). The Moves of examples 0..batch-2, each read back from its reversed row, go to
        ``last_removal_moves``, those of the others without the first and without the middle one to
        ``last_first_removal_moves`` and ``last_middle_removal_moves``. With several processes each rerun runs on every
        process where any needs it (module doc); one that has nothing to check there runs its batch again.
        ``outputs``: (key path, shape) of the forward's output leaves; ``devices``: the accelerators of the forward (a
        collective's tensor goes to the first); ``arguments_dims`` and ``views``: where the arguments' and the
        outputs' examples lie (example_dims, OutputViews; a batch with its examples on dim 1 is padded on dim 0 of its
        (T, B, ...) tensors: padding.py)."""
        self.last_padding_moves, self.last_removal_moves = [], []
        self.last_first_removal_moves, self.last_middle_removal_moves = [], []
        arguments = unflatten(flat, spec)
        sequence_first = 1 in arguments_dims
        padded = (padded_arguments(module, *arguments, batch, sequence_first=sequence_first)
                  if checkable and self.check_padding else None)
        removing = checkable and batch > 1
        removing_middle = removing and batch > 2  # a middle example other than the first and the last
        device = devices[0] if devices else torch.device("cpu")
        removing_anywhere, middle_anywhere, padding_anywhere = map(bool, maxima_across_ranks(
            [removing, removing_middle, padded is not None], device))
        if not (removing_anywhere or padding_anywhere):
            return
        # The outputs' shapes with their examples first (dims), as the reruns' outputs are compared (at_real_positions)
        first = views.shapes_first(outputs)
        positions = None if padded is None else (first, padded[1], attention_mask(module, *arguments))

        def rerun(arguments, examples=batch, positions=positions):
            """The fingerprints of a rerun on ``arguments``; with padding checked, read at the real positions
            (``positions``: the batch's, or the rerun's own where it holds other rows)."""
            return self._fingerprints_of_rerun(module, arguments, start, signs, views, examples, positions)

        def removed(rows):
            """The fingerprints of a rerun on the batch without one example (``rows``: its flattened tensors), or None
            where this process removes none (``rows`` None: it reruns its batch, in step with the processes that do)
            or the forward fails on fewer examples."""
            try:
                if rows is None:
                    rerun(arguments)
                    return None
                fewer = unflatten(rows, spec)
                return rerun(fewer, batch - 1, None if padded is None else (first, padded[1],
                                                                            attention_mask(module, *fewer)))
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001 - a forward that keeps state of the batch's size: unchecked here
                return None

        with in_eval_mode(module):
            plain = rerun(arguments)
            if removing_anywhere:
                fewer = removed(without_last_reversed(flat, arguments_dims, batch) if removing else None)
                if fewer is not None:  # each example's fingerprint back in its row (every row has the same signs)
                    fewer = [None if f is None else f.flip(0) for f in fewer]
                    self.last_removal_moves = views.per_output(moves_between(plain, plain, fewer, slice(0, batch - 1),
                                                                             floors))
                # Without the first, and without a middle one: a statistic of the batch that the last's removal leaves
                # as it was and another's moves (a mask thresholded from the first example's data or from the batch's
                # mean, a capacity of the batch's tokens: the fuzzer, 2026-12-07)
                rest = removed(without_example(flat, arguments_dims, 0) if removing else None)
                self.last_first_removal_moves = self._moves_without(0, rest, plain, floors, views, batch)
            if middle_anywhere:
                middle = batch // 2
                rest = removed(without_example(flat, arguments_dims, middle) if removing_middle else None)
                self.last_middle_removal_moves = self._moves_without(middle, rest, plain, floors, views, batch)
            pending = padded is not None  # this process's batch is still to be padded
            for extra in (EXTRA, 1) if padding_anywhere else ():
                if extra != EXTRA and not maxima_across_ranks([pending], device)[0]:
                    break  # no process has a batch still to pad
                if not pending:
                    rerun(arguments)  # in step with the processes that pad
                    continue
                longer_batch = padded[0] if extra == EXTRA else padded_arguments(
                    module, *arguments, batch, extra, sequence_first)[0]
                try:  # more positions than the model has: one more, then unchecked for padding here
                    longer = rerun(longer_batch)
                except (IndexError, RuntimeError, ValueError):
                    continue
                pending = False
                self.last_padding_moves = views.per_output(moves_between(plain, plain, longer, slice(0, batch),
                                                                         floors))  # no draws
                found = largest_exceeding(self.last_padding_moves)
                if found is not None:
                    self.padding_finding = PaddingDependence(
                        batch, padded[1], extra, "output" + keystr(outputs[found.output][0]), found.relative,
                        found.threshold)

    @staticmethod
    def _moves_without(k: int, rest, plain, floors, views, batch: int) -> list:
        """The Moves of the examples other than ``k`` between the batch's eval() rerun (``plain``) and the rerun
        without example ``k`` (``rest``: its fingerprints, row j holding example j + (j >= k); None: none ran)."""
        if rest is None:
            return []
        others = torch.tensor([j for j in range(batch) if j != k])
        rest = [None if f is None else torch.cat([f[:k], f[:1], f[k:]]) for f in rest]  # (row k is not compared)
        return views.per_output(moves_between(plain, plain, rest, others, floors))

    def refuse_counted_padding(self, criterion, target) -> None:
        """A DP criterion called without a mask, after a checked forward: refuse targets that count positions the
        forward's attention mask excludes (padding.counted_padding), on every process where any found them."""
        checked, self.checked_mask = self.checked_mask, None
        if checked is None:
            return
        mask = checked[0]
        counted = mask is not None and counted_padding(criterion, target, mask)
        _refuse_found(COUNTS_PADDING.format(ignore=getattr(criterion, "ignore_index", None)) if counted else None,
                      bool(maxima_across_ranks([counted], target.device)[0]), LOSS_COUNTS_PADDING, ValueError)

    def _signs(self, t: torch.Tensor) -> torch.Tensor:
        signs = torch.randint(0, 2, t.shape[1:], generator=self._generator, dtype=torch.int8) * 2 - 1
        return signs.to(device=t.device, dtype=t.dtype)

    def refuse_mixing(self, batch_size: int, calls, device) -> None:
        """At the norm pass after a checked forward: refuse a Mixing where the per-example losses are the
        batch the forward was perturbed in and every call's proven layout has the examples on dim 0; refuse a
        PaddingDependence once the lengths differ. With several processes, only at the pass after a checked
        forward, and on every process where any refuses (module doc; ``device``: the losses')."""
        self.recheck_where_guessed(batch_size)
        self.recheck_where_square(batch_size, calls)
        padding = self.padding_finding
        finding, self.finding = self.finding, None
        self.learn_from(batch_size, calls)
        mixing = finding if self._refusable(finding, batch_size, calls) else None
        if mixing is None and finding is not None and finding.batch == batch_size:
            self._warn_inconclusive(finding, calls)
        lengths = sorted(self.lengths)
        if distributed_rank_and_size()[1] > 1:
            if not self._verdict_due:
                return
            self._verdict_due = False
            padded_somewhere, mixing_somewhere, longest, negated_shortest = maxima_across_ranks(
                [padding is not None, mixing is not None, max(lengths, default=0), -min(lengths, default=float("inf"))],
                device)
            if padded_somewhere and (len(lengths) > 1 or longest > -negated_shortest):
                on_all = (f"{', '.join(map(str, lengths))} on this process, "
                          f"{-negated_shortest:.0f} to {longest:.0f} on all")
                _refuse_found(None if padding is None else _padding_refusal(padding, on_all), True,
                              FORWARD_DEPENDS_ON_PADDING)
            _refuse_found(None if mixing is None else _mixing_refusal(mixing), bool(mixing_somewhere), FORWARD_MIXES)
            return
        if padding is not None and len(lengths) > 1:
            raise RuntimeError(_padding_refusal(padding, ", ".join(map(str, lengths))))
        if mixing is not None:
            raise RuntimeError(_mixing_refusal(mixing))

    def learn_from(self, batch_size: int, calls=()) -> None:
        """At the norm pass after a checked forward: where its tensor arguments hold the examples (the dim of the
        losses' count in the first of two or more dims, where both are the dim the proof of this pass's ``calls``
        reads its examples on (_dim_read; else dim 0); else dim 0 of any), kept as ``examples_dim`` and
        ``examples_leaf`` (which tensor) for the next checked forward (examples_dim_and_batch: a forward whose first
        tensor argument is no batch, ``model(condition, x)``, is checked from its second). Where the check took another
        batch
        than the losses' (a sequence-first model without a batch_first=False module, perturbed along its positions:
        until 2026-12-03 it trained without a word, mixing or not) the next checked forward takes the dim found;
        where none would put it right (no dim of the first tensor argument has the losses' size: a batch flattened
        to (B * T, d), the tokens of a PackedSequence before packed.py), or the check found no output to compare on
        the right one, warned of once (UNCHECKED)."""
        checked, self._checked = self._checked, None
        self._guessed = []
        if checked is None:
            return
        found = _where_the_losses_count_lies(checked, batch_size)
        proven = _dim_read(checked, batch_size, calls)
        if found is not None:
            self.examples_leaf, self.examples_dim = found if proven is None else (checked.leaf, proven)
        if checked.batch is None or batch_size < 2 or not self.every:
            return
        if checked.batch == batch_size:
            if checked.unchecked is not None and found is not None and found[1] == checked.dim:
                self._warn_unchecked(checked.unchecked, RETURN_BATCH_FIRST)
        elif found is None:  # no tensor argument the next checked forward could take the examples from
            shapes = ", ".join(str(shape) for _, shape in checked.shapes[:4])
            self._warn_unchecked(NO_DIM_OF_THE_LOSSES.format(losses=batch_size, batch=checked.batch, dim=checked.dim,
                                                             shapes=shapes), EXAMPLES_ON_DIM_0_OR_1)

    def _keep_with_the_graph(self, guessed, output) -> None:
        """``guessed`` kept by the autograd nodes of the forward's outputs (so as long as a loss can be built on
        them, and no longer: a forward without backward frees its batch with its graph), a weak reference here."""
        nodes = [t.grad_fn for _, t in output_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        for node in nodes:
            node.metadata[_GUESSED_FORWARD] = guessed
        if nodes:
            self._guessed.append(weakref.ref(guessed))

    def recheck_where_guessed(self, batch_size: int) -> None:
        """Where a checked forward of this step took its examples from a guess (before any norm pass, with no DP
        loader's count: ``GhostClipping`` in a loop of one's own) and the per-example losses number another
        ``batch_size``, its check runs again, before the norm pass that follows, on the tensor and dim that hold the
        losses' count (learn_from's choice): a sequence-first model without a batch_first=False module was checked
        along its positions, whose finding the norm pass drops, so that its first step trained, mixing or not (a
        detached batch mean before Linears on (T, B, D) moved the other examples' clipped sum by up to 2.17 C), until
        2026-12-07. Called by the DP loss as it is built (controller.loss, DPCriterion), outside any backward, and at
        the norm pass (per_example_norms alone). The forward itself has run: its reruns start from the generators and
        buffers as they are now, and the batch itself, rerun once more, stands for the forward's output. One process
        only (several would have to agree on which forwards to rerun)."""
        guessed, self._guessed = self._guessed, []
        if not self.every or batch_size < 2:
            return
        for forward in filter(None, (ref() for ref in guessed)):  # those whose graph lives
            checked = forward.checked
            found = None if checked.batch in (None, batch_size) else _where_the_losses_count_lies(checked, batch_size)
            if found is None:
                if checked.square:  # for the norm pass's proof (recheck_where_square)
                    self._guessed.append(weakref.ref(forward))
                continue
            self.examples_leaf, self.examples_dim = found
            self.finding = self._recheck(forward) or self.finding

    def recheck_where_square(self, batch_size: int, calls) -> None:
        """At the norm pass, before any gradient is written: where a checked forward of this step replaced examples
        of tensors with another dim of the batch's size (``square``: (T, B, ...) at T = B) and the proof of this
        pass's ``calls`` reads the examples of its leaf (Checked.leaf_id) on the other dim (_dim_read), its
        check runs again on that dim, and what it found on the first replaces what the first found. A sequence-first
        model at T = B is checked along its positions at its first forward (examples_dim_and_batch guesses dim 0
        there), and where the losses' count lies on both dims, learn_from took dim 0 from then on: until 2026-12-07
        such a model was only warned of (INCONCLUSIVE), mixing or not, on every step with T = B (a detached batch
        mean before its first Linear trained). One process only (as recheck_where_guessed)."""
        kept, self._guessed = self._guessed, []
        if not self.every or batch_size < 2:
            return
        for forward in filter(None, (ref() for ref in kept)):
            checked = forward.checked
            proven = _dim_read(checked, batch_size, calls)
            if proven is None or proven == checked.dim:
                continue
            wrong = self.finding is not None and self.finding.square == checked.square  # this forward's
            self.examples_leaf, self.examples_dim = checked.leaf, proven
            self.finding = self._recheck(forward) or (None if wrong else self.finding)

    def _recheck(self, forward):
        """The check of a ``forward`` that has run (a _GuessedForward) on the examples dim and tensor set now
        (examples_dim, examples_leaf): its reruns start from the generators and buffers as they are now, and the
        batch itself, rerun once more, stands for the forward's output. A Mixing, or None."""
        module, args, kwargs = forward.module, forward.args, forward.kwargs
        try:
            with self._unchecked_where_a_rerun_fails():
                pending = self._rerun_before(module, args, kwargs)
                if pending is not None:
                    with self._rerunning(module, pending.devices):
                        leaves = self._rerun(module, (args, kwargs), *pending.start)
                    return self._compare(module, pending, leaves)
        finally:  # the forward's calls have run: nothing reads the arguments now, nothing keeps them
            self.recorder.watched_arguments = {}
            self._guessed_now = None
        return None

    def _refusable(self, finding, batch_size: int, calls) -> bool:
        """Whether a Mixing is refused at this norm pass: its batch is the losses', and the examples lay on the dim
        of the arguments the check replaced them on. They did where no such argument has another dim of the batch's
        size (``square``); where one has, if a trained tokenwise layer reads each such argument and its proof put the
        examples on that dim (_proven: dim 0, or dim 1 of a sequence-first batch), and otherwise, on dim 0, unless a
        module is sequence-first or a call's proven layout has its examples off dim 0 (a sequence-first model of
        length B, perturbed along its positions). A batch flattened into dim 0 (ROWS_LAYOUT: each example's rows
        together, as a router's or an expert's tokens, a raw weight's product on (B * T, d) rows, Swin's windows)
        keeps them on dim 0: its proof fails on a sequence-first flattening, whose rows interleave the examples.
        Until 2026-12-02 any call laid out off dim 0 or in rows switched the refusal off, square or not (an RNN's
        h_n, (layers, B, H), or a router's rows), and a detached batch mean before one trained with its clipped sum
        0.1-1.1 of its size off."""
        if finding is None or finding.batch != batch_size:
            return False
        if not finding.square or _proven(finding.square, calls):
            return True
        return finding.dim == 0 and not self.sequence_first and not _laid_out_off_dim_0(calls, batch_size)

    def _warn_inconclusive(self, finding, calls) -> None:
        """Once per controller: a move the check found but does not refuse (``_refusable``: square arguments)."""
        if self._warned_inconclusive:
            return
        self._warned_inconclusive = True
        if finding.dim != 0:
            why = "the check took them on dim 1 (a sequence-first batch), and dim 0 has the same size"
        elif self.sequence_first:
            named = [name or "<root>" for name in self.sequence_first[:3]]
            why = f"the model has modules with batch_first=False ({', '.join(named)})"
        else:
            named = _laid_out_off_dim_0(calls, finding.batch)[:3]
            why = f"the layout proof placed the examples of {', '.join(named)} off dim 0"
        warnings.warn(INCONCLUSIVE.format(how=finding.said(), output=finding.output,
                                          moved=finding.moved, threshold=finding.threshold, batch=finding.batch,
                                          why=why))


def _where_the_losses_count_lies(checked, batch_size: int):
    """(index among the flattened arguments, dim) of the checked forward's tensor argument holding the losses'
    count: the dim of that size in the first of two or more dims, dim 0 where both are; else dim 0 of any; or None."""
    first = next(((k, shape) for k, shape in checked.shapes if len(shape) > 1), None)  # examples_dim_and_batch's
    if first is not None and batch_size in first[1][:2]:
        return first[0], first[1].index(batch_size)
    return next(((k, 0) for k, shape in checked.shapes if shape[0] == batch_size), None)


def _dims_read(calls) -> dict:
    """Per square argument of the checked forward (its id: replaced_batches) that a trained tokenwise layer with a
    rule reads (an Embedding of the token ids, a first Linear), or a module without a rule whose inputs' proof ran on
    it: the dims its readers' proven layouts (for the module without a rule: that input's) put the examples on, 0
    (_EXAMPLES_ON_DIM_0), 1 (("dim", 1): a sequence-first batch), or None (another layout, or none proven)."""
    read = {}
    for call in calls:
        if call.reads_argument is None:
            continue
        if call.rule is None:  # (its id, its input's edge): placed where the proof of its inputs ran on it
            if call.argument_layout is None:
                continue
            key, layouts = call.reads_argument[0], (call.argument_layout,)
        elif call.tokenwise is True:
            key, layouts = call.reads_argument, call.layouts
        else:
            continue
        read.setdefault(key, set()).update(_DIM_OF_LAYOUT.get(layout) for layout in layouts or (None,))
    return read


def _proven(square, calls) -> bool:
    """Whether every ``square`` argument ((id, dim replaced on) pairs) is read (_dims_read) with its examples on the
    dim the check replaced: it then perturbed examples there (until late 2026-12-02 a batch-first model with a
    sequence-first GRU inside, at T = B, was only warned of; until 2026-12-07 every sequence-first one was)."""
    read = _dims_read(calls)
    return all(read.get(key) == {dim} for key, dim in square)


def _dim_read(checked, batch_size: int, calls):
    """The dim on which the readers of a square checked forward's leaf (the tensor its examples' dim goes by: Checked)
    put its examples (_dims_read: one dim, 0 or 1), where its batch is the losses'; else None."""
    if not checked.square or checked.batch != batch_size:
        return None
    dims = _dims_read(calls).get(checked.leaf_id)
    return next(iter(dims)) if dims in ({0}, {1}) else None


def _laid_out_off_dim_0(calls, batch_size: int) -> list:
    """The names of the calls whose proven layouts have the examples off dim 0 (_EXAMPLES_ON_DIM_0), sorted. Views of
    the batch stacked on dim 0 (TILED_LAYOUT) count as off dim 0 where there are as many views as examples: a
    sequence-first batch of length B flattened, (B * B, d); two views of a batch-first one (a model's torch.cat([x, x])
    for R-Drop) keep them on dim 0."""
    return sorted({call.name for call in calls if call.layouts is not None
                   and any(layout not in _EXAMPLES_ON_DIM_0
                           and not (layout == TILED_LAYOUT and shape[0] != batch_size * batch_size)
                           for layout, shape in zip(call.layouts, call.shapes))})


def _refuse_found(here: str | None, somewhere: bool, what: str, error=RuntimeError) -> None:
    """Raise this process's refusal ``here``; where only another process found ``what`` (``somewhere``), the error
    that says so (every process stops: module doc); nothing where none found it."""
    if here is not None:
        raise error(here)
    if somewhere:
        raise error(FOUND_ON_ANOTHER_PROCESS.format(what=what))


def _padding_refusal(padding: PaddingDependence, lengths: str) -> str:
    return DEPENDS_ON_PADDING.format(batch=padding.batch, length=padding.length, extra=padding.extra,
                                     output=padding.output, moved=padding.moved, threshold=padding.threshold,
                                     lengths=lengths)


def _mixing_refusal(mixing: Mixing) -> str:
    return MIXING_OUTSIDE_GRADIENTS.format(how=mixing.said(), output=mixing.output,
                                           moved=mixing.moved, threshold=mixing.threshold)

def _buffers(module, values: bool = True) -> list:
    """(dict, key, tensor, a copy of its values or None) of every buffer of ``module``."""
    with torch.no_grad():
        return [(owner._buffers, key, t, t.clone() if values else None) for owner in module.modules()
                for key, t in owner._buffers.items() if t is not None]


def _with_copies(buffers) -> None:
    """Each buffer's dict holds a new copy of the values saved: a rerun's in-place updates go there, and the
    tensors the forward left (which its graph may have saved, at their versions) stay untouched."""
    with torch.no_grad():
        for held, key, _, values in buffers:
            held[key] = values.clone()


def _put_back(buffers) -> None:
    for held, key, tensor, _ in buffers:
        held[key] = tensor


class _ParametersAsFound:
    """The module's floating-point parameters, trained or frozen (a frozen weight a rerun moves is released with the
    model), as the reruns found them: each one's version, 2-norm and 1-norm. None where any is sharded (FSDP2 writes
    its gathered parameters in place)."""

    def __init__(self, module):
        named = [(name, p) for name, p in module.named_parameters() if p.is_floating_point()]
        self.named = [] if any(is_sharded(p) for _, p in named) else named
        self.versions = [p._version for _, p in self.named]
        self.norms = _norms([p for _, p in self.named])

    def moved(self, module) -> list[str]:
        """The names of those that are not as found: replaced by another Parameter, or changed in place with other
        norms (a change in place put back, by RWKV's train() rerun, leaves both norms; a change that keeps both
        exactly is not one a forward makes)."""
        changed = [k for k, ((_, p), version) in enumerate(zip(self.named, self.versions)) if p._version != version]
        now = _norms([self.named[k][1] for k in changed])
        moved = [self.named[k][0] for n, k in enumerate(changed)
                 if not all(bool(now[j][n] == self.norms[j][k]) for j in range(2))]
        registered = dict(module.named_parameters()) if self.named else {}
        return moved + [name for name, p in self.named if registered.get(name) is not p and name not in moved]


def _norms(parameters: list) -> tuple:
    """Each parameter's 2-norm and 1-norm, in two foreach reductions."""
    if not parameters:
        return [], []
    with torch.no_grad():
        tensors = [p.detach() for p in parameters]
        return torch._foreach_norm(tensors, 2), torch._foreach_norm(tensors, 1)


def _put_back_attributes(attributes) -> None:
    """The modules' plain attributes as they were: ``attributes`` (each module's __dict__, a shallow copy of it, and
    (dict, key, tensor, version, copy of its values) of each tensor attribute, taken before). A tensor attribute
    that a rerun replaced or added is put back or removed; one changed in place gets its values back."""
    dicts, tensors = attributes
    for d, before in dicts:
        for key, value in list(d.items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and before.get(key, _MISSING) is not value:
                if key in before:
                    d[key] = before[key]
                else:
                    del d[key]
    with torch.no_grad():
        for _, _, tensor, version, values in tensors:
            if tensor._version != version:
                tensor.copy_(values)
