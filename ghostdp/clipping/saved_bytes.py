"""The bytes a step's autograd graph holds in the tensors its nodes saved, read without unpacking any.

Two passes keep the whole graph through pass 1 (pass 2 frees it as it goes); book-keeping's one backward frees it
as it goes and keeps its factors instead (modes.py weighs the two). Over the nodes the step's audit visited, this
counts every tensor a node saved for its backward, each storage once, leaving out those alive anyway (the model's
parameters and buffers) and anything saved under saved-tensor hooks: a checkpoint's or an offload's packed form
is theirs, and unpacking it here would run their hooks (a non-reentrant checkpoint's recomputes its region).
"""
from __future__ import annotations

import torch

_SAVED_TENSOR = getattr(torch._C._autograd, "SavedTensor", None)
# torch's raw saved tensors tell whether hooks packed them (unpack_hook) and give the tensor without unpacking
# it (data); without both, nothing is counted (modes.py then keeps its fixed limit).
READABLE = _SAVED_TENSOR is not None and all(hasattr(_SAVED_TENSOR, a) for a in ("data", "unpack_hook"))
_RAW_NAMES = {}  # node type -> the names of its raw saved attributes


def saved_bytes(nodes, alive_anyway: set) -> int | None:
    """Bytes of the storages that ``nodes`` saved without hooks, each once, those keyed in ``alive_anyway``
    ((device, address), as storage_of gives) left out; None where this torch cannot tell (READABLE)."""
    if not READABLE:
        return None
    storages = {}
    for node in nodes:
        kind = type(node)
        names = _RAW_NAMES.get(kind)
        if names is None:
            names = _RAW_NAMES[kind] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        for name in names:
            try:
                saved = getattr(node, name)
            except RuntimeError:  # a node whose graph was freed (a reentrant region's, already run)
                continue
            for item in saved if isinstance(saved, (tuple, list)) else (saved,):
                if type(item) is not _SAVED_TENSOR or item.unpack_hook is not None:
                    continue
                tensor = item.data
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    key, nbytes = storage_of(tensor)
                    if key is not None and key not in alive_anyway:
                        storages[key] = nbytes
    return sum(storages.values())


def storage_of(tensor: torch.Tensor) -> tuple:
    """(key, bytes) of the tensor's storage; (None, 0) for one without a readable storage (a DTensor, a parameter
    whose FSDP2 shard was freed after its forward)."""
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None, 0


def storage_keys(tensors) -> set:
    """The storage keys of ``tensors`` (a model's parameters and buffers, a forward's arguments: alive anyway)."""
    return {storage_of(t)[0] for t in tensors}
