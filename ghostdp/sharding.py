"""FSDP2 (``torch.distributed.fsdp.fully_shard``): which parameters are sharded, and their local shards.

A sharded parameter is a DTensor; FSDP2 gathers it for each forward and backward and reduce-scatters its
gradient, the average over the ranks, into the DTensor gradient whose local part this rank owns alone.
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def _dtensor_class():
    import torch.distributed.tensor as distributed_tensor  # imported on first use, not with ghostdp
    return distributed_tensor.DTensor


def is_sharded(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t).__name__ == "DTensor" and isinstance(t, _dtensor_class())


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of a sharded tensor this rank holds (a view: in-place changes reach the DTensor); t itself
    for an ordinary tensor."""
    return t.to_local() if is_sharded(t) else t


def local_parts(tensors) -> tuple[list, list | None]:
    """The local part of each tensor, and which of them are sharded: a list of bools, or None where none is
    (the common case, told by one type check a tensor instead of is_sharded's)."""
    if all(type(t) is torch.Tensor for t in tensors):
        return list(tensors), None
    sharded = [is_sharded(t) for t in tensors]
    return [t.to_local() if s else t for t, s in zip(tensors, sharded)], sharded


def has_sharded_parameters(module: torch.nn.Module) -> bool:
    return any(is_sharded(p) for p in module.parameters())


def fsdp1_wrapped(module: torch.nn.Module) -> list[str]:
    """Names of the modules FSDP1 (``FullyShardedDataParallel``) wraps: its flat parameter shards are plain
    tensors, not DTensors, so nothing here would know a gradient element is one rank's alone."""
    if not any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        return []  # no import of torch.distributed.fsdp for an ordinary model
    from torch.distributed.fsdp import FullyShardedDataParallel
    return [name or "(the model)" for name, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]


def sharded_units(module: torch.nn.Module) -> list:
    """The modules fully_shard was applied to (each gathers its parameters around its forward)."""
    if not has_sharded_parameters(module):
        return []
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]
