"""A PackedSequence argument unpacked for the forward check, and packed again for each rerun (independence.py).

A PackedSequence (torch.nn.utils.rnn.pack_padded_sequence, the habit of Opacus' DPLSTM users) holds the batch's
tokens in one (tokens, ...) tensor, time step by time step: no dim of it is the batch's. The check replaces and
removes examples on dim 0 of the batch's tensors, so it takes such an argument as the padded (B, T, ...) batch and its
(B,) lengths (PaddedSequences, a dataclass: leaves.flatten looks into it), and each rerun gets them packed again
(unsorted, as replaced or reordered examples are). Before 2026-12-03 the check took the tokens for the examples, and
its finding went unused (the losses number B): a forward on packed sequences that mixed its examples without gradient
trained, warned of as unchecked.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten, tree_map_only


@dataclasses.dataclass
class PaddedSequences:
    """A PackedSequence as the check replaces its examples: each example's steps padded to (B, T, ...), and its
    lengths (B,)."""
    padded: torch.Tensor
    lengths: torch.Tensor


def _is_packed(x) -> bool:
    return isinstance(x, PackedSequence)


def unpacked(arguments):
    """``arguments`` with each PackedSequence replaced by its PaddedSequences (in the batch's own order)."""
    return tree_map_only(PackedSequence, lambda p: PaddedSequences(*pad_packed_sequence(p, batch_first=True)),
                         arguments, is_leaf=_is_packed)


def repacked(arguments):
    """``arguments`` with each PaddedSequences packed again (unsorted); the same object where there is none."""
    if not any(isinstance(leaf, PaddedSequences) for leaf in tree_flatten(arguments)[0]):
        return arguments
    return tree_map_only(PaddedSequences, lambda s: pack_padded_sequence(s.padded, s.lengths, batch_first=True,
                                                                         enforce_sorted=False), arguments)
