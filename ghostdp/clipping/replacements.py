"""Where the forward check (independence.py) replaces, removes and compares a batch's examples.

The check copies the first example, and the last, to every other place of the batch, and removes the last, and
compares each output's examples. Which dim holds them:

A sequence-first batch ((T, B, ...), torch's Transformer and recurrent layers by default) holds its examples on dim 1
(examples_dim_and_batch). The check takes dim 1 where the model has batch_first=False modules and the first tensor of
two or more dims is not square in them, unless the first rerun finds those modules called with the batch on dim 0 (a
batch-first model that transposes for them); from the first norm pass on, it takes the dim where the losses' count
lies (independence.ForwardIndependence.learn_from). There it replaces and removes the examples on dim 1 of the tensors
of two or more dims with the batch there, on dim 0 of the others (a (B, T) padding mask, lengths), and compares each
output on the dim that holds them ((T, B, ...) or pooled (B, ...)); padding.py pads it on dim 0. Until 2026-12-03 it
replaced rows of dim 0, the positions, took T for the batch, and the norm pass, whose losses number B, dropped its
finding: a sequence-first forward that mixed its examples without gradient trained without a word (T != B; the refusal
now says "on dim 1"). A model with no batch_first=False module fed (T, B, ...) is checked on dim 1 from its first
forward where a DP loader (or DPTrainer) handed the batch out and said how many examples it holds
(examples_of_the_loaders_batch; since 2026-12-07); without one (GhostClipping in a loop of one's own) on dim 0 at its
first forward, then again on dim 1 when the DP loss is given the losses' count, before its backward
(independence.ForwardIndependence.recheck_where_guessed; until later on 2026-12-07 that first step went unchecked), and
on dim 1 from the second forward (also scheduled). Where no argument has a
dim 0 or 1 of the losses' count (a batch flattened to (B * T, d)), the check is warned of once as unchecked
(independence.NO_DIM_OF_THE_LOSSES).

At T = B every tensor of such a batch is square in its first two dims, and the first forward is checked on dim 0;
where the norm pass's proof reads the examples on dim 1, the check runs again there and goes by dim 1 from then on
(independence.ForwardIndependence.recheck_where_square). On dim 1 a square tensor other than the one whose dim was
found is left as it is (argument_dims), and an output square in the batch's size is compared on both dims
(OutputViews).

A PackedSequence is taken as its padded batch (packed.py). A forward whose first tensor argument is not the batch's
is checked where the loader's count of examples lies in its rows, from its first forward, else on the first
forward's guess, again where the losses' count lies once the DP loss has it, and from the second forward where the
norm pass found which argument holds the examples (``learned``); a (1, ...) first argument
(``model(condition, x)``) is passed over from the first: before 2026-12-03 such a forward went unchecked on every step,
without a word.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .leaves import flatten

# How a Mixing was found (independence.MIXING_OUTSIDE_GRADIENTS: "{how} moved ... output by"): the reruns of the
# replaced batches (replaced_batches), and the removal in eval() mode.
REPLACED_BY_FIRST = ("copying the first of the {batch} examples to every other row of the batch{where} moved the first "
                     "one's")
REPLACED_BY_LAST = ("copying the last of the {batch} examples to every other row of the batch{where} moved the last "
                    "one's")
REMOVED = ("removing the last of the {batch} examples{where} and reversing the others' order (the forward run again in "
           "eval() mode) moved the other examples'")
REMOVED_FIRST = ("removing the first of the {batch} examples{where} (the forward run again in eval() mode) moved the "
                 "other examples'")
REMOVED_MIDDLE = ("removing example {middle} (from 0) of the {batch} examples{where} (the forward run again in eval() "
                  "mode) moved the other examples'")
# {where} of those: the examples' dim, said where it is not dim 0 (a sequence-first batch)
ON_DIM = {0: "", 1: " (on dim 1 of its tensors: a sequence-first batch)"}


def examples_dim_and_batch(flat, learned: tuple | None, sequence_first: bool):
    """(the dim that a checked forward's examples lie on in its tensor arguments of two or more dims, their count):
    where an earlier norm pass found them (``learned``: (index in ``flat`` of the tensor, dim),
    ForwardIndependence.learn_from), there; before any, dim 1 of the first such tensor where the model has
    sequence-first modules and that tensor is not square in its first two dims; otherwise dim 0 of the first tensor of
    dim > 0 (the recorder's batch hint), or of the first one with more than one row where that one has one (a
    condition shared by the batch, passed before it). A guess wrong for the first checked forward (a batch-first model with a
    sequence-first layer inside, one whose first argument is not its batch's) is put right at its norm pass, for the
    next: checked forwards 0 and 1 are both scheduled."""
    if learned is not None:
        index, dim = learned
        if index < len(flat) and isinstance(flat[index], torch.Tensor) and flat[index].dim() > dim:
            return dim, flat[index].shape[dim]
    tensors = [(k, t) for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.dim() > 0]
    first_matrix = next(((k, t) for k, t in tensors if t.dim() > 1), None)
    if learned is None and sequence_first and first_matrix is not None and \
            first_matrix[1].shape[0] != first_matrix[1].shape[1]:
        return 1, first_matrix[1].shape[1]
    if tensors and tensors[0][1].shape[0] == 1:  # a (1, ...) condition shared by the batch before it: model(c, x)
        return 0, next((t.shape[0] for _, t in tensors if t.shape[0] > 1), 1)
    return 0, tensors[0][1].shape[0] if tensors else None


def examples_of_the_loaders_batch(flat, examples: int | None):
    """(dim, ``examples``) where the batch the DP loader (or the Trainer) handed out, of ``examples`` examples, lies in
    the forward's tensor arguments (StepLedger.examples_of_next_batch), or None (no count given, fewer than 2, or no
    tensor with that size on dim 0 or 1): dim 0 where any tensor has that many rows (the first one alone, not square in
    its first two dims); else dim 1 of the first tensor of two or more dims with that size there, not on dim 0 (a
    sequence-first (T, B, ...) batch). Rows first: a tensor the model takes before its batch ((k, d) with d = B)
    is not taken for a sequence-first batch. Used where examples_dim_and_batch's guess does not have the
    loader's count, for the first checked forward, before any norm pass has said where the examples lie."""
    if examples is None or examples < 2:
        return None
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0]
    rows = next((t for t in tensors if t.shape[0] == examples), None)
    if rows is not None:
        return None if rows.dim() > 1 and rows.shape[1] == examples else (0, examples)
    return next(((1, examples) for t in tensors if t.dim() > 1 and t.shape[1] == examples), None)


def example_dims(flat, batch: int, dim: int) -> list:
    """Per leaf of the arguments: the dim its examples lie on, or None (not a tensor of the batch). On dim 1 (a
    sequence-first batch), a tensor of two or more dims with the batch's size there; else one with it on dim 0 (a
    padding mask (B, T) or lengths (B,) beside sequence-first data, as torch's Transformer takes them)."""
    out = []
    for t in flat:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            out.append(None)
        elif dim == 1 and t.dim() > 1 and t.shape[1] == batch:
            out.append(1)
        else:
            out.append(0 if t.shape[0] == batch else None)
    return out


def argument_dims(flat, batch: int, dim: int, leaf: int | None) -> list:
    """example_dims of the forward's arguments, the check's replacements' (replaced_batches): on dim 1, a tensor
    other than the ``leaf`` (an index in ``flat``: the tensor the examples' dim was found in, examples_leaf, else the
    first of two or more dims) with the batch's size on both dim 0 and dim 1 is left as it is (None): at T = B
    a (B, T) padding mask beside (T, B, d) data, as torch's sequence-first attention takes it, or more (T, B, ...)
    data, which the leaf's examples do not place. Replacing the examples of some of the tensors alone still leaves
    the kept example's whole input as it was, and another's data changed. Until 2026-12-07 such a mask was replaced
    along its positions, which moved every example's output."""
    dims = example_dims(flat, batch, dim)
    if dim != 1:
        return dims
    return [None if k != leaf and d is not None and t.dim() > 1 and t.shape[0] == t.shape[1] == batch else d
            for k, (t, d) in enumerate(zip(flat, dims))]


class OutputViews(NamedTuple):
    """Where the check compares each output's examples: ``of``, per view, (the index of its output leaf, the dim
    its examples lie on), a view per floating output with the batch on that dim (example_dims' rule); two, dim 0
    and dim 1, for one with the batch's size on both ((T, B, ...) at T = B, or pooled (B, C) at C = B): one of the
    two compares positions or classes, which move with any example, so an output moved only where both views moved
    (per_output). Until 2026-12-07 such an output was compared on dim 0 only where the batch lay on dim 0 (a batch-first
    model returning (T, B, ...) at T = B was refused for its positions) and not at all on dim 1. ``count``: the
    number of output leaves (a rerun's output of another structure is not compared)."""
    count: int
    of: tuple

    @classmethod
    def of_outputs(cls, leaves, batch: int, dim: int) -> OutputViews:
        views = []
        for k, ((_, t), d) in enumerate(zip(leaves, example_dims([t for _, t in leaves], batch, dim))):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or d is None:
                continue
            views += [(k, 0), (k, 1)] if t.dim() > 1 and t.shape[0] == t.shape[1] == batch else [(k, d)]
        return cls(len(leaves), tuple(views))

    def examples_first(self, leaves):
        """Per view, (key path, its output with the examples moved to dim 0: a view), or None where ``leaves`` are
        not ``count`` outputs."""
        if len(leaves) != self.count:
            return None
        return [(leaves[k][0], leaves[k][1].movedim(d, 0) if d else leaves[k][1]) for k, d in self.of]

    def shapes_first(self, outputs) -> list:
        """Per view, (key path, shape or None) of ``outputs`` (per leaf) with the view's examples first."""
        return [(outputs[k][0], outputs[k][1] if d != 1 else (outputs[k][1][1], outputs[k][1][0], *outputs[k][1][2:]))
                for k, d in self.of]

    def per_output(self, moves) -> list:
        """The Moves of the views (fingerprints.moves_between, ``output``: a view's index) as a Move per output leaf:
        a leaf's one view's, or, of two, the smaller move, exceeding where both exceed (a view without fingerprints,
        of a shape another rerun does not keep, leaves the other's)."""
        by_leaf = {}
        for move in moves:
            by_leaf.setdefault(self.of[move.output][0], []).append(move)
        return [min(found, key=lambda m: (m.exceeds, m.relative))._replace(output=leaf)
                for leaf, found in by_leaf.items()]


@contextlib.contextmanager
def batches_of_calls(modules):
    """Inside, the sequence-first ``modules``' calls note their batch, dim 1 of their first tensor argument of two or
    more dims, in the list yielded (a rerun's: where the batch's tensors are (T, B, ...) for such a layer, or (B, T,
    ...) that the model transposes for it, examples_dim_and_batch's guess of dim 1 is put right)."""
    found = []

    def note(module, args, kwargs):
        first = next((t for t in flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 1), None)
        if first is not None:
            found.append(first.shape[1])

    handles = [m.register_forward_pre_hook(note, with_kwargs=True) for m in modules]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def without_last_reversed(flat, dims, batch: int) -> list:
    """The batch's tensors without example ``batch - 1`` on their examples' dim (``dims``: example_dims; those
    replaced_batches replaces examples of), the others in reverse order: place k holds example batch - 2 - k."""
    return [t if d is None else t.narrow(d, 0, batch - 1).flip(d) for t, d in zip(flat, dims)]


def without_example(flat, dims, k: int) -> list:
    """The batch's tensors without example ``k`` on their examples' dim (``dims``: example_dims), the others in
    order: place j holds example j + (j >= k)."""
    return [t if d is None else torch.cat([t.narrow(d, 0, k), t.narrow(d, k + 1, t.shape[d] - k - 1)], d)
            for t, d in zip(flat, dims)]


def replaced_batches(flat, dims, batch: int):
    """The check's replaced batches (module doc): [(the batch's tensors with every example on its dim (``dims``:
    example_dims) a copy of one example's, that example (a slice), how)] for the first example and the last, or none
    (fewer than two examples, or no tensor of the batch); and the ids of the replaced tensors with another dim of size
    ``batch`` (``square``: their examples may lie there), as (id, the dim replaced on) pairs."""
    if batch < 2 or all(d is None for d in dims):
        return [], frozenset()
    square = frozenset((id(t), d) for t, d in zip(flat, dims)
                       if d is not None and batch in t.shape[:d] + t.shape[d + 1:])
    return [([t if d is None else t.narrow(d, kept, 1).expand_as(t).contiguous() for t, d in zip(flat, dims)],
             slice(kept, kept + 1), how)
            for kept, how in ((0, REPLACED_BY_FIRST), (batch - 1, REPLACED_BY_LAST))], square
