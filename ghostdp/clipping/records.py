"""What the controller records per step: one ModuleCall per hooked forward, one NormPass per backward,
and one BackwardRecord per backward of a DP loss for the DP optimizer's checks."""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch

from ..norms.batched import NormQueue, concatenated, mass_roots, reduce_factors, reduced_mass
from ..norms.deferred import DeferredGrams
from ..norms.factors import InputGrams, SqrtProduct
from .capture import on_output_grads
from .modes import new_factor_store
from .saved_bytes import storage_of


_NO_NODES = frozenset()


class BackwardRecord(NamedTuple):
    """One backward of a DP loss, as the DP optimizer reads it at the step (``StepLedger.take``, ledger.py)."""
    examples: int                      # examples clipped (0 for a padding chunk)
    loss_scale: torch.Tensor           # the gradient that flowed into the loss: 1 for a plain backward()
    unclipped: torch.Tensor | None     # adaptive clipping: examples whose norm was <= C
    wrote_sums: bool                   # ghostdp wrote the clipped sums itself, not autograd (no DDP reducer)
    max_grad_norm: float               # the clipping norm C its coefficients used (the noise is scaled to it)
    one_backward: bool                 # it took book-keeping's one backward (else two passes)


class ModuleCall:
    """One call of one hooked module in a forward pass, alive as long as its graph.

    ``inputs`` and ``grads`` (the output grads G, one per tensor output) feed the norm rule;
    ``edges`` (the outputs' gradient edges) and ``input_nodes`` bound the call's region of the
    graph (the audit, the fallback); ``shapes`` and ``layouts`` say where its examples are
    (layout.py); ``fired`` is set when pass 1 reaches it, ``done`` when its norms are formed.
    ``captured``: None for a probed call; for a captured one (capture.py) the output number of its
    edge, ``named`` whether pass 1 names that edge (book-keeping keeps its G whole, or G is small), ``by_hook``
    whether the node's pre-hook hands G over when the node runs in pass 1 (else a named call's G comes from
    the backward's result; ``hooked_grad``: the G its node ran with, capture.hooked_output_grad; ``sink_unknown``:
    captured as two passes capture, without looking for a sink below, so that its node may not run), and
    ``input_versions`` those of its inputs at the forward. ``in_region``: made by pass 1's recomputation of a
    reentrant checkpoint's region (reentrant.py). ``proven_in``: the layout.GraphLayouts its layouts come from or
    go to (its graph form's, or its region form's). ``recorder``: the ForwardRecorder
    (recording.py) that counts its uses; its ``pass_one`` receives the call's output grads.
    ``input_edges``: a module without a rule, its float inputs' gradient edges (recording.InputSink), whose
    gradients the layout proof checks too (PassOne._prove_fallback_inputs); ``fallback_stops``: from the step's
    audit to the end of pass 1, the nodes where its fallback's VJP stops (fallback_paths.py).
    """

    __slots__ = ("recorder", "name", "module", "rule", "tokenwise", "params", "inputs", "input_nodes", "edges",
                 "batch_dims", "expanded", "shapes", "layouts", "projections", "grads", "fired", "eager", "done",
                 "captured", "named", "by_hook", "hooked_grad", "input_versions", "in_region", "proven_in",
                 "input_edges", "fallback_stops", "sink_unknown", "reads_argument", "argument_layout")

    def __init__(self, recorder, name, module, entry, params, batch_dims=(0,)):
        # Per-output fields start as empty tuples: the forward hook sets them (a list where it appends).
        self.recorder, self.name, self.module, self.params = recorder, name, module, params
        self.rule = entry.rule if entry is not None else None
        tokenwise = entry is not None and entry.tokenwise
        self.tokenwise = tokenwise(module) if callable(tokenwise) else tokenwise
        self.batch_dims = batch_dims
        self.inputs = self.edges = self.expanded = self.grads = self.shapes = ()
        self.layouts = self.projections = self.eager = self.captured = self.input_versions = self.proven_in = None
        self.input_edges = ()
        self.fallback_stops = self.hooked_grad = None
        # The checked forward's square argument it reads (independence.py): its id (a ruled call), or (its id, the
        # index of that input's edge) for a call without a rule, whose input proof then sets argument_layout
        self.reads_argument = self.argument_layout = None
        self.input_nodes = _NO_NODES
        self.fired = self.done = self.named = self.by_hook = self.in_region = self.sink_unknown = False

    def on_output_grads(self, grad_outputs):
        """The pre-hook of a captured call's node (capture.py)."""
        return on_output_grads(self, grad_outputs)

    def __del__(self):
        # getattr: a copy made without __init__ (torch.compile's tracing) has no state to release.
        if not getattr(self, "fired", True):
            self.recorder.forget(self)


def _device(groups):
    return next(p for parts in groups for p in parts).device


class KeptStorages:
    """What book-keeping would keep, as norm pass's factors note it (PerExampleGrad.note_kept): the tensors it would
    keep, each storage once (an input shared by query, key and value; an output grad shared by a weight and its
    bias), and the bytes of the explicit gradients it would form. A call's inputs are alive through the whole pass
    (the graph or the call holds them) and are keyed by their storage alone, except a view of a storage over twice
    its size, which book-keeping copies (recording._compact_views): its own bytes; any other tensor also by its call's
    place in the pass (``of_call``, as each call's factors are noted): two passes free an output grad once its norm
    is formed, and a later one may reuse its memory. Storages in ``alive_anyway`` (the forward's arguments, which
    the caller holds) are left out, as saved_bytes leaves them out."""

    def __init__(self):
        self.alive_anyway = set()  # keys of storages held whichever way the step runs (the forward's arguments)
        self._bytes = {}  # key -> bytes of a storage
        self._formed = 0
        self._call = 0
        self._inputs = set()

    def of_call(self, call) -> "KeptStorages":
        self._call += 1
        self._inputs = {key for key, _ in map(storage_of, call.inputs)}
        return self

    def note(self, *tensors) -> None:
        for tensor in tensors:
            key, nbytes = storage_of(tensor)
            if key is None or (key in self._inputs and _compacted(tensor, nbytes)):  # its own bytes
                self._formed += tensor.numel() * tensor.element_size()
            elif key not in self.alive_anyway:
                self._bytes[key if key in self._inputs else (self._call, *key)] = nbytes

    def formed(self, nbytes: int) -> None:
        self._formed += nbytes

    def total(self) -> int:
        return sum(self._bytes.values()) + self._formed


def _compacted(tensor, storage_bytes: int) -> bool:
    """Whether book-keeping keeps a copy of this input of a call, not its storage (recording._compact_views)."""
    return tensor._is_view() and storage_bytes > 2 * tensor.numel() * tensor.element_size()


class NormPass:
    """One backward of the DP loss towards the probes: the norm pass, or the layout proof before it.

    Squared norms and token masses are kept as (k, B) blocks, k layers each (a batched reduction of
    the queue gives k rows at once), and summed over layers once, at the end.
    """

    def __init__(self, batch_size, proving=False, groups=1, reentrant=False, keeps_factors=False,
                 measures_kept=False):
        self.batch_size = batch_size
        self.keeps_factors = keeps_factors  # book-keeping: every factor is kept for the clipped sums
        self.measures_kept = measures_kept  # book-keeping configured, forward checkpointed: sum up
        self.held_bytes = 0                 # the bytes the factors hold, and would keep
        self.kept_bytes = 0                 # (PerExampleGrad.kept), for modes.mode_of_step
        self.kept_storages = KeptStorages()  # the same, each tensor shared by factors once (note_kept)
        self.proving = proving            # collect projections of G for the layout proof, compute nothing
        self.reentrant = reentrant        # the graph has reentrant checkpoints (clipping/reentrant.py):
        self.region_calls = []            # the calls their recomputations made, in order
        self.region_forms = []            # the layout.GraphLayouts of the regions' forms proven in this pass
        self.deferred = []                # calls whose layouts the proof after pass 1 settles
        self.eager_ids = set()            # ids of parameters reduced on arrival
        self.uses = defaultdict(int)      # id(parameter) -> calls of it this pass
        self.losses = None                # the per-example losses, for that proof
        self.audited = None               # the nodes the step's audit visited
        self.trainable = None             # id -> trainable parameter, as that audit read them
        self.sq_parts = [[] for _ in range(groups)]  # per clipping group: (k, B) squared norms of k layers
        self.masses = []                  # (k, B) bounds of sum_t |G_t| |A_t| of k layers (precision.py)
        self.squared_masses = []          # (k, B) squares of such bounds, or a SqrtProduct of one layer's (B,)
        #                                   factors of them: multiplied and rooted together (batched.Reduced)
        self.mass_dtype = None
        self.pending = defaultdict(list)  # parameter -> factors of its several calls
        self.kept = new_factor_store()    # book-keeping: every factor, for the clipped sum
        self.exact = new_factor_store()   # two passes: the fallback's factors (precision.exact_sums)
        self.samples = None               # inside grad_samples(): parameter -> factors to materialise
        self.calls = []
        self.delivers_by_hooks = False    # a backward of pass 1 runs: captured calls' nodes' pre-hooks deliver G
        self.captured_received = set()    # ids of the captured calls received (or arrived)
        self.arrived = []                 # (call, G) from pre-hooks, to receive once the backward is done
        self.arrived_elements = 0         # (PassOne.arrive)
        self.captured_only = False        # a second backward for captured calls only (PassOne._backward_to_outputs)
        self.queue_held = False           # calls received without reducing the queue (PassOne._receive_named)
        self.replayed = False             # pass 2 repeats this pass's backward (pass_two.py)
        self.second_backward = False      # a second backward named calls the first missed (_backward_to_outputs)
        self.sums_pass = None             # pass 2 of two passes: what it writes, compares, scales (pass_two.py)
        self.synchronous = False          # each captured call received as it arrives (pass 2 with FSDP2)
        self.pass_two_check = None        # a checked step: key -> (B,) squares of a call's G (pass_two.CHECK_PASS_TWO)
        self.param_sq = None              # pass 1 whose pass 2 scales its sums: parameter -> (B,) squared norms
        self.grams = InputGrams()         # the last input's Gram, shared by layers reading it (Q, K, V)
        # Factors of single-use parameters, reduced in batches; what layers reduced alone leave, reduced together.
        self.queue = NormQueue(self.grams, DeferredGrams())

    def add(self, sq, group=0):
        """(B,) squared norms of one layer, or (k, B) of k layers, for clipping group ``group``."""
        self.sq_parts[group].append(sq if sq.dim() == 2 else sq.unsqueeze(0))

    def reduce_alone(self, factor, group=0) -> torch.Tensor:
        """One factor's (B,) squared norms, added with its token mass as the queue's reductions add them, and
        returned (a pass whose norms are kept parameter by parameter: pass_two.py)."""
        (done,) = reduce_factors([factor], self.grams)
        self._add_reduced(done, [group])
        return done.sq[0]

    def reduce_queue(self, final: bool = False):
        """Reduce the queued factors into norms and masses (``final``: all of them, the pass is done)."""
        if not self.queue.pending():
            return
        reductions, groups = self.queue.reduce(final)
        for done in reductions:
            self._add_reduced(done, groups)

    def _add_reduced(self, done, groups):
        """A batched.Reduced's squared norms and token masses; ``groups``: the clipping group of each queue row."""
        row_groups = {groups[r] for r in done.rows}
        if len(row_groups) == 1:
            self.add(done.sq, row_groups.pop())
        else:  # per-group clipping with the rows of several groups
            for k, r in enumerate(done.rows):
                self.add(done.sq[k], groups[r])
        if done.mass is not None:
            self._add_mass_rows(done.mass, done.mass_dtype, done.rooted)

    def add_mass(self, factor):
        """The token mass of one factor that is not queued (a parameter with several uses)."""
        mass, rooted = reduced_mass(factor.token_mass(self.grams))
        if mass is not None:
            self._add_mass_rows(mass, factor.sum_dtype(), rooted)

    def _add_mass_rows(self, mass, dtype, rooted=True):
        (self.masses if rooted else self.squared_masses).append(mass)
        if self.mass_dtype is None or torch.finfo(dtype).eps > torch.finfo(self.mass_dtype).eps:
            self.mass_dtype = dtype

    def total_sq(self):
        """(groups, B) float64 sums of the squared norms of each clipping group's layers, or None."""
        if self.queue.pending():  # a layer left out of the norms would be clipped too little
            raise RuntimeError("ghostdp internal error: per-example norms were read while the norm queue still "
                               "held layers; please report this")
        if not any(self.sq_parts):
            return None
        totals = []
        for parts in self.sq_parts:
            if not parts:
                totals.append(torch.zeros(self.batch_size, dtype=torch.float64, device=_device(self.sq_parts)))
                continue
            totals.append(_sum_rows(parts).double())
        return torch.stack(totals)

    def total_mass(self):
        """(B,) sum over layers of the examples' token masses, or None if no layer has one."""
        blocks = list(self.masses)
        by_dtype = {}  # dtype -> (k, B) squares (key None), and one-row SqrtProducts by their second factor's kind
        for squares in self.squared_masses:
            if isinstance(squares, SqrtProduct):
                second = "rows" if isinstance(squares.b, torch.Tensor) else squares.b  # a (B,) tensor, or a number
                by_dtype.setdefault(squares.a.dtype, {}).setdefault(second, []).append(squares)
            else:
                by_dtype.setdefault(squares.dtype, {}).setdefault(None, []).append(squares)
        for kinds in by_dtype.values():
            squares = []
            for second, parts in kinds.items():
                if second is None:
                    squares += parts
                    continue
                a = torch.stack([p.a for p in parts])
                squares.append(a * (torch.stack([p.b for p in parts]) if second == "rows" else second))
            blocks.append(mass_roots(concatenated(squares)))
        return _sum_rows(blocks) if blocks else None


def _sum_rows(blocks):
    """The sum over all rows of (k, B) blocks, in the widest of their dtypes."""
    if len({b.dtype for b in blocks}) > 1:
        blocks = [b.double() for b in blocks]
    return concatenated(blocks).sum(0)
