"""Buffers and parameters that a training forward changes: statistics of the data released without noise.

DP-SGD bounds and noises what the gradients carry. A buffer that the forward updates from the batch (a
running mean, as BatchNorm keeps, or any module of one's own that does the same) is saved and released
with the model, but no clipping bounds an example's part in it and no noise covers it. BatchNorm is refused
by the model check (validate.py); any other buffer changed in place or replaced during a training forward
draws one warning, naming it (a step counter or a cache of positions is harmless, and says so itself).
Buffers of a parametrization (torch.nn.utils.parametrize: spectral_norm's power-iteration vectors) are not
watched: its forward receives only the parameters, so what it stores follows them, not the batch.

A parameter changed in place during a training forward is refused: the forward moved the model by a step
that no clipping bounds (``nn.Embedding(max_norm=...)`` renormalises the rows the batch looks up: one example
moved the table by 7.4 with C = 1e-3, before any optimizer step; the model check refuses that one by name).
FSDP2's sharded parameters, which its forward gathers and puts back, are not watched.
About 40 us a forward for BERT's 200 tensors: the versions are read before and after each training forward.

Tensors that a module keeps as plain attributes (``self.queue = torch.cat([self.queue, keys])``) are compared
on the forward check's schedule only (independence.py; a walk of every module's attributes), and warned of the
same way: a memory bank of earlier examples' features makes later steps' gradients depend on examples not
sampled for them.
"""
from __future__ import annotations

import operator
import warnings

import torch
from torch.nn.utils.parametrize import ParametrizationList

from ..callers import caller_stacklevel
from ..sharding import is_sharded

CHANGED_BUFFER = (
    "buffer '{name}' changed during a training forward. If its values come from the data (a running "
    "statistic such as a mean or a variance), the model releases them without clipping or noise, and the "
    "privacy guarantee does not cover them. Fix: compute it outside training, freeze it (do not update it in "
    "train() mode), or replace the layer by one without batch statistics (LayerNorm, GroupNorm); if it does "
    "not depend on the data (a step counter, a cache of positions), ignore this warning.")

CHANGED_PARAMETER = (
    "parameter '{name}' was changed in place during a training forward: the forward itself moved the model, "
    "by a step that depends on the batch and that no clipping bounds and no noise covers (e.g. "
    "F.embedding(..., max_norm=...) renormalising the rows the batch looks up). Fix: change parameters only "
    "outside the forward, as a function of the parameters alone (e.g. renormalise the whole table after each "
    "optimizer step), or freeze the parameter and compute the changed values out of place. A model that changes "
    "its own weights when it switches between eval() and train() (RWKV with config.rescale_every > 0 rescales its "
    "output weights for inference, and back in the first training forward after an evaluation) is refused here "
    "too: set config.rescale_every = 0 to train it.")

CHANGED_BY_A_RERUN = (
    "the model changed parameter(s) {names} in place (or replaced them) while ghostdp's forward check reran its "
    "forward without gradient (in eval() mode, where dropout draws nothing, and in train() mode), and did not put "
    "them back: the weights the training forward now reads were moved by the reruns, a step that no clipping bounds "
    "and no noise covers where it depends on their batches. A model that changes its own weights in its forward does"
    " this: on every forward (F.embedding(..., max_norm=...) renormalising the rows a batch looks up, a clamp), in "
    "eval() mode only, or depending on its mode, as RWKV with config.rescale_every > 0 after an evaluation (it "
    "rescales its output weights for inference, and back in its next train() forward). Fix: change parameters only "
    "outside the forward (RWKV: set config.rescale_every = 0 to train it); then build the model again, as its "
    "weights moved. (A change that a later rerun puts back trains: RWKV's rescaling on a step with no evaluation "
    "before it.)")


REMOVED_PARAMETER = (
    "parameter '{name}' is no longer a parameter of its module: it was removed or moved after the model was made "
    "private (a parametrization registered afterwards, such as weight_norm, spectral_norm or "
    "torch.nn.utils.parametrize.register_parametrization, moves the weight into a new submodule), and ghostdp "
    "hooked and audits the model as it was then. Fix: change the model before make_private / GhostClipping, or "
    "make it private again (a new engine and optimizer, or controller.detach() and a new GhostClipping).")


CHANGED_ATTRIBUTE = (
    "module attribute '{name}', a tensor outside the module's parameters and buffers, changed during a training "
    "forward. If it keeps data of the batch that a later forward reads (a queue or memory bank of features, as "
    "MoCo keeps), one example's data reaches the gradients of steps it was not sampled for, where no clipping "
    "bounds it and the accounting does not count it: the privacy guarantee does not hold. Fix: keep no state of "
    "the data between forwards (take negatives from the batch itself); if it does not depend on the data (a "
    "cache of positions), ignore this warning.")


def tensor_attributes(module: torch.nn.Module) -> list:
    """(name, owner's __dict__, key, tensor, version) of every tensor that a module of ``module`` holds as a plain
    attribute (not a parameter or buffer: those live in their own dicts)."""
    return [(f"{prefix}.{key}" if prefix else key, owner.__dict__, key, value, value._version)
            for prefix, owner in module.named_modules() for key, value in owner.__dict__.items()
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)]


def changed_attributes(before: list, now: list) -> list:
    """The names among the tensor attributes ``now`` that are new, replaced or changed in place since ``before``
    (both tensor_attributes of one module)."""
    seen = {(id(d), key): (t, version) for _, d, key, t, version in before}
    changed = []
    for name, d, key, t, version in now:
        old = seen.get((id(d), key))
        if old is None or old[0] is not t or old[1] != version:
            changed.append(name)
    return changed


class BufferWatch:
    """Warns once per buffer, and refuses a parameter, that a training forward of the attached model changes
    (see the module doc)."""

    def __init__(self, module: torch.nn.Module):
        # (name, dict, key): read through the owner's dict at each forward, so a tensor replaced by a new one is
        # seen; the buffers first, then the parameters. A buffer registered as None is watched for a tensor.
        parametrizing = {id(m) for p in module.modules() if isinstance(p, ParametrizationList) for m in p.modules()}
        owners = [(prefix, owner) for prefix, owner in module.named_modules() if id(owner) not in parametrizing]
        buffers = [(f"{prefix}.{key}" if prefix else key, owner._buffers, key)
                   for prefix, owner in owners for key in owner._buffers]
        self._unset = [(name, d, key) for name, d, key in buffers if d[key] is None]
        self._watched = [(name, d, key) for name, d, key in buffers if d[key] is not None]
        self._buffers = len(self._watched)
        self._watched += [(f"{prefix}.{key}" if prefix else key, owner._parameters, key)
                          for prefix, owner in module.named_modules() for key, p in owner._parameters.items()
                          if p is not None and not is_sharded(p)]
        self._dicts = [d for _, d, _ in self._watched]
        self._keys = [key for _, _, key in self._watched]
        self._before = None
        self._warned = set()

    def attach(self, module) -> list:
        if not self._watched and not self._unset:
            return []
        return [module.register_forward_pre_hook(self._note), module.register_forward_hook(self._compare)]

    def _note(self, module, args):
        if module.training and torch.is_grad_enabled():
            tensors = list(map(_GET, self._dicts, self._keys))
            try:
                versions = list(map(_VERSION, tensors))
            except AttributeError:  # a watched tensor is gone from its module since attaching
                versions = self._versions_without_removed(tensors)
            self._before = (tensors, versions)

    def _versions_without_removed(self, tensors) -> list:
        """The versions, None for a buffer set to None; a parameter gone from its module since attaching is
        refused: ghostdp hooked and audits the model as it was (a parametrization registered afterwards moves the
        weight into a module no rule or call knows, and crashed here with an AttributeError before)."""
        for n, t in enumerate(tensors):
            if t is None and n >= self._buffers:
                raise RuntimeError(REMOVED_PARAMETER.format(name=self._watched[n][0]))
        return [None if t is None else t._version for t in tensors]

    def _compare(self, module, args, output):
        if self._before is None or not torch.is_grad_enabled():
            return  # not a training forward (the forward check's reruns run inside one: independence.py)
        tensors, versions = self._before
        self._before = None
        now = list(map(_GET, self._dicts, self._keys))
        # The common case in a few C loops: the same tensors with the same versions.
        try:
            same = all(map(operator.is_, now, tensors)) and list(map(_VERSION, now)) == versions
        except AttributeError:  # a buffer set to None
            same = False
        if not same:
            for n, (old, version, new) in enumerate(zip(tensors, versions, now)):
                if new is old and (new is None or new._version == version):
                    continue
                if n >= self._buffers:
                    raise RuntimeError(CHANGED_PARAMETER.format(name=self._watched[n][0]))
                self._warn(self._watched[n][0])
        for name, d, key in self._unset:
            if d.get(key) is not None:
                self._warn(name)

    def _warn(self, name):
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(CHANGED_BUFFER.format(name=name), stacklevel=caller_stacklevel())


_GET = dict.get
_VERSION = operator.attrgetter("_version")
