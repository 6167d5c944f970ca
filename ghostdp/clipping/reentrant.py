"""Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``).

A reentrant checkpoint runs its region's forward without a graph; its backward node recomputes the
region and runs a backward of its own on it (``torch.autograd.backward``). So the region's graph
exists only inside that node's backward, and only a backward without ``inputs`` may enter it: the
norm pass then cannot be ``autograd.grad`` towards the probes. With such regions in the step:

- pass 1 is ``torch.autograd.backward`` of the per-example losses. It also accumulates every
  parameter's unclipped gradient, so the gradients of the model's trainable parameters and of the
  graph's other leaves are set aside before it and put back after it, and each parameter's is
  dropped as soon as it is accumulated (``stashed_grads``);
- the module calls of a region are recorded when pass 1's recomputation makes them: the forward
  hooks see ``RegionWatch.depth > 0``. Recomputations in the layout proof record calls that only
  project their output grads; those in pass 2 record nothing (inert probes);
- the audit of a region's graph runs when the region's backward is done, before any norm is used:
  while a region is recomputed in pass 1, ``RegionTracer`` (a TorchFunctionMode entered by the
  checkpoint node's pre-hook, left by its post-hook) keeps the autograd node of every tensor the
  recomputation makes or reads, the region's outputs included, so the walk from those nodes
  reaches every edge of the region. It also refuses, before the region's backward adds to its
  ``.grad``, a tensor that requires grad and is not a model parameter (or a tensor the
  recomputation made, like the checkpoint's detached inputs).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .audit import accumulate_grad_type

USE_NON_REENTRANT = (
    "use non-reentrant checkpointing: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False}), TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs="
    "{'use_reentrant': False}), or torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
NON_REENTRANT_FIX = "Fix: " + USE_NON_REENTRANT


class ForeignLeafError(NotImplementedError):
    """A reentrant checkpoint's region reads a tensor that requires grad but is not a model parameter."""

    def __init__(self, leaf, fix):
        super().__init__(
            f"a tensor of shape {tuple(leaf.shape)} that requires grad but is not a trainable parameter of the model "
            "is read inside a reentrant activation checkpoint: ghostdp's norm pass through such a checkpoint is a "
            "backward() that would add its unclipped gradient to the tensor's .grad. Fix: make it a parameter of "
            "the model (its gradient is then clipped), detach it or requires_grad_(False), or " + fix)


class OutsideTensorError(NotImplementedError):
    """A reentrant checkpoint's region reads a tensor of the graph outside it without taking it as an input."""

    def __init__(self, tensor, fix):
        super().__init__(
            f"a tensor of shape {tuple(tensor.shape)} computed outside a reentrant activation checkpoint is read "
            "inside it without being one of its inputs: the checkpoint's own backward would then run the graph "
            "outside it, and ghostdp's probes there a second time. Fix: pass the tensor to checkpoint(...) as an "
            "input, or " + fix)


class RegionTracer(TorchFunctionMode):
    """Keeps the autograd node of every tensor argument and result of the torch calls it sees. Refuses, as
    inputs of a call that records graph nodes, a leaf that requires grad, was not made here (the
    checkpoint's detached inputs are) and is not in ``allowed`` (ids of the model's trainable parameters
    and of the probe leaves), and a tensor whose node is in ``outside`` (the graph outside the regions)."""

    def __init__(self, allowed, outside, fix):
        super().__init__()
        self.nodes = {}  # the nodes, in the order made (a dict: the region's graph signature is the same each step)
        self.function_edges = {}  # Python Function's node -> its next_functions (audit.released_edges)
        self._made = {}  # id -> weak reference, of every tensor a traced call returned
        self._allowed, self._outside, self._fix = allowed, outside, fix

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        recorded = self._keep(outputs)  # whether the call made graph nodes: then its leaf inputs are in the graph
        self._keep(args, recorded)
        if kwargs:
            self._keep(kwargs.values(), recorded)
        self._made.update((id(t), weakref.ref(t)) for t in outputs if isinstance(t, torch.Tensor))
        return out

    def _keep(self, values, check=False) -> bool:
        """Keeps the nodes of the tensors among ``values``; whether there was one. ``check``: refuse the
        tensors described above."""
        found = False
        for t in values:
            if isinstance(t, torch.Tensor):
                node = t.grad_fn
                if node is not None:
                    if check and node in self._outside:
                        raise OutsideTensorError(t, self._fix)
                    if node not in self.nodes:
                        self.nodes[node] = None
                        if isinstance(node, BackwardCFunction):  # read while alive: torch <= 2.11 frees them
                            self.function_edges[node] = node.next_functions
                    found = True
                elif check and t.requires_grad and id(t) not in self._allowed:
                    made = self._made.get(id(t))
                    if made is None or made() is not t:
                        raise ForeignLeafError(t, self._fix)
            elif isinstance(t, (tuple, list)):
                found = self._keep(t, check) or found
        return found


class RegionWatch:
    """Whether a reentrant checkpoint's backward (its recomputation and its own backward) is running;
    in pass 1, each region's recomputation is traced and handed to ``audit(tracer, token)`` as soon as
    the region's backward is done (holding its graph longer would hold its inputs' gradients too).
    ``token()`` is called when a traced region starts; its value comes back with the tracer."""

    def __init__(self, token, audit, fix):
        self.depth = 0
        self._tracing = None  # while pass 1 runs: RegionTracer's (allowed, outside)
        self._auditing = True  # the traced regions are audited (pass 1), or only traced (the proof before it)
        self._token, self._audit, self._fix = token, audit, fix
        self._entered = []    # per running region: (its tracer, its token), or None when not traced

    def watch(self, nodes) -> None:
        """Hook the checkpoint nodes of this step's graph (they live as long as the graph)."""
        for node in nodes:
            node.register_prehook(self._enter)
            node.register_hook(self._leave)

    def _enter(self, grad_outputs):
        self.depth += 1
        entry = None
        if self._tracing is not None:
            entry = (RegionTracer(*self._tracing, self._fix), self._token())
            entry[0].__enter__()
        self._entered.append(entry)

    def _leave(self, grad_inputs, grad_outputs):
        self.depth -= 1
        entry = self._entered.pop() if self._entered else None
        if entry is not None:
            entry[0].__exit__(None, None, None)
            if self._auditing:
                self._audit(*entry)

    @contextlib.contextmanager
    def traced(self, allowed, outside, audit: bool = True):
        """Pass 1: trace the regions it recomputes (RegionTracer's ``allowed`` and ``outside``), each audited when
        its backward is done; afterwards nothing runs and nothing is traced. ``audit`` False (the layout proof
        before pass 1): traced for the refusals only."""
        self._tracing, self._auditing = (allowed, outside), audit
        try:
            yield
        finally:
            while self._entered:  # a region's backward raised: its post-hook never ran
                entry = self._entered.pop()
                if entry is not None and entry[0] in _get_current_function_mode_stack():
                    entry[0].__exit__(None, None, None)
            self._tracing, self.depth = None, 0


def leaves_below(roots, stop=frozenset()) -> list:
    """The tensors whose gradient accumulators the graph below ``roots`` reaches, not entering ``stop``."""
    accumulator = accumulate_grad_type()
    leaves, seen, stack = [], set(stop), list(roots)
    while stack:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        if type(current) is accumulator:
            leaves.append(current.variable)
        else:
            stack.extend(nxt for nxt, _ in current.next_functions)
    return leaves


def _drop_grad(tensor: torch.Tensor) -> None:
    tensor.grad = None


@contextlib.contextmanager
def stashed_grads(tensors, dropped=()):
    """``.grad`` of each tensor set aside (None) inside the block and put back after it. The gradients
    that the block accumulates into ``dropped`` (parameters: a whole model's worth) are freed as soon
    as they are accumulated, one at a time, instead of all living to the end of the block."""
    unique = list({id(t): t for t in list(tensors) + list(dropped)}.values())
    saved = [t.grad for t in unique]
    for t in unique:
        t.grad = None
    hooks = [t.register_post_accumulate_grad_hook(_drop_grad) for t in dropped]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for t, grad in zip(unique, saved):
            t.grad = grad
