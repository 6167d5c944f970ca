"""The tensors of a model's forward, its arguments' and its output's, where pytree does not see them all.

``torch.utils._pytree`` flattens tensors, tuples, lists, dicts and transformers' ModelOutput, and keeps anything else
as one leaf. The recorder reads a hooked module's output through it (its output grads are taken at its tensors) and
the batch size from the root forward's arguments (recording.py); the forward check reruns the root forward on
batches with examples replaced and compares its output's tensors with the batch on dim 0 (independence.py); and
peft's prompt is captured at its repeat, found in the graph below the output's tensors (repeated.py). Until 2026-12-03 a model of one's own returning
``types.SimpleNamespace(logits=...)`` or a dataclass showed the forward check no tensor: it compared nothing, and a
forward that mixed its examples without gradient trained without a word; a prompt under such a model was refused as
reaching the output by no path; a batch passed in such an object left the batch size unknown, so BERT's position
embeddings (shared by the batch) were refused; and a module without a rule returning one was refused, its parameter's
gradient reaching it outside every recorded call.

Here a SimpleNamespace or a dataclass instance among the leaves is looked into, ATTRIBUTE_DEPTH levels deep:
``flatten`` and ``unflatten`` for the arguments and a module's output (rebuilt into copies of those objects: the
forward check's batches with rows replaced, a module's output with probes), ``output_leaves`` for the root's output (where that finds no tensor, any object's attributes are looked into
too: a class of one's own; not where the output holds tensors besides, as a language model's logits beside its
DynamicCache, whose key and value tensors no check reads).
"""
from __future__ import annotations

import copy
import dataclasses
import types

import torch
from torch.utils._pytree import GetAttrKey, tree_flatten, tree_flatten_with_path, tree_unflatten

ATTRIBUTE_DEPTH = 3  # levels of attributes of the objects pytree keeps whole that are looked into
_NOT_A_CONTAINER = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module)


def is_container(leaf) -> bool:
    """A SimpleNamespace, or an instance of a dataclass with a __dict__ (its attributes can be read and set)."""
    return isinstance(leaf, types.SimpleNamespace) or (
        dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and hasattr(leaf, "__dict__"))


def flatten(tree, depth: int = ATTRIBUTE_DEPTH) -> tuple[list, tuple]:
    """(leaves, spec) as ``tree_flatten`` gives them, a container among those (is_container) replaced by its
    attributes' leaves, ``depth`` levels deep; ``unflatten(leaves, spec)`` rebuilds ``tree``."""
    flat, spec = tree_flatten(tree)  # without key paths where there is no container: it runs at every root forward
    if not any(is_container(leaf) for leaf in flat):
        return flat, (spec, None)
    _, leaves, spec = flatten_with_paths(tree, depth)
    return leaves, spec


def flatten_with_paths(tree, depth: int = ATTRIBUTE_DEPTH, looked_into=is_container, path: tuple = ()) -> tuple:
    """(key paths, leaves, spec): ``flatten``'s, with each leaf's pytree key path (a container's attribute keyed
    GetAttrKey(name)); ``looked_into``: which leaves that pytree keeps whole are replaced by their attributes'."""
    flat, spec = tree_flatten_with_path(tree)
    paths, leaves, parts = [], [], []
    for key, leaf in flat:
        if not (depth and not isinstance(leaf, torch.Tensor) and looked_into(leaf)):
            parts.append(None)
            paths.append(path + key)
            leaves.append(leaf)
            continue
        attributes = []  # (name, its spec, its number of leaves)
        for name, value in vars(leaf).items():
            inner_paths, inner, inner_spec = flatten_with_paths(value, depth - 1, looked_into,
                                                                path + key + (GetAttrKey(name),))
            attributes.append((name, inner_spec, len(inner)))
            paths += inner_paths
            leaves += inner
        parts.append((leaf, attributes))
    return paths, leaves, (spec, parts)


def unflatten(leaves, spec):
    """The tree ``flatten`` gave ``spec`` for, with ``leaves``: each container a shallow copy of the original with
    its attributes set to theirs (a frozen dataclass's too)."""
    tree_spec, parts = spec
    if parts is None:  # no container
        return tree_unflatten(leaves, tree_spec)
    flat, k = [], 0
    for part in parts:
        if part is None:
            flat.append(leaves[k])
            k += 1
            continue
        original, attributes = part
        rebuilt = copy.copy(original)
        for name, inner_spec, n in attributes:
            object.__setattr__(rebuilt, name, unflatten(leaves[k:k + n], inner_spec))
            k += n
        flat.append(rebuilt)
    return tree_unflatten(flat, tree_spec)


def output_leaves(output) -> list:
    """(key path, leaf) of each of ``output``'s leaves, as ``tree_flatten_with_path`` gives them, a container's
    replaced by its attributes' leaves (keyed ``.name``), ATTRIBUTE_DEPTH levels deep; where that finds no tensor, so
    is any other object's with attributes (the module doc)."""
    for looked_into in (is_container, _has_attributes):
        paths, leaves, _ = flatten_with_paths(output, looked_into=looked_into)
        if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            break
    return list(zip(paths, leaves))


def output_tensors(output) -> list:
    """The tensors with a graph among ``output``'s leaves (output_leaves)."""
    return [t for _, t in output_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]


def _has_attributes(leaf) -> bool:
    return hasattr(leaf, "__dict__") and not isinstance(leaf, _NOT_A_CONTAINER)
