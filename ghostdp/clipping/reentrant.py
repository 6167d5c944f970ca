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
  reaches every edge of the region.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .audit import accumulate_grad_type


class RegionTracer(TorchFunctionMode):
    """Keeps the autograd node of every tensor argument and result of the torch calls it sees."""

    def __init__(self):
        super().__init__()
        self.nodes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._keep(args)
        if kwargs:
            self._keep(kwargs.values())
        self._keep(out if isinstance(out, (tuple, list)) else (out,))
        return out

    def _keep(self, values):
        for t in values:
            if isinstance(t, torch.Tensor):
                node = t.grad_fn
                if node is not None:
                    self.nodes.add(node)
            elif isinstance(t, (tuple, list)):
                self._keep(t)


class RegionWatch:
    """Whether a reentrant checkpoint's backward (its recomputation and its own backward) is running;
    in pass 1, each region's recomputation is traced and handed to ``audit(tracer, token)`` as soon as
    the region's backward is done (holding its graph longer would hold its inputs' gradients too).
    ``token()`` is called when a traced region starts; its value comes back with the tracer."""

    def __init__(self, token, audit):
        self.depth = 0
        self.tracing = False  # pass 1 runs
        self._token, self._audit = token, audit
        self._entered = []    # per running region: (its tracer, its token), or None when not traced

    def watch(self, nodes) -> None:
        """Hook the checkpoint nodes of this step's graph (they live as long as the graph)."""
        for node in nodes:
            node.register_prehook(self._enter)
            node.register_hook(self._leave)

    def _enter(self, grad_outputs):
        self.depth += 1
        entry = None
        if self.tracing:
            entry = (RegionTracer(), self._token())
            entry[0].__enter__()
        self._entered.append(entry)

    def _leave(self, grad_inputs, grad_outputs):
        self.depth -= 1
        entry = self._entered.pop() if self._entered else None
        if entry is not None:
            entry[0].__exit__(None, None, None)
            self._audit(*entry)

    @contextlib.contextmanager
    def traced(self):
        """Pass 1: trace the regions it recomputes; afterwards nothing runs and nothing is traced."""
        self.tracing = True
        try:
            yield
        finally:
            while self._entered:  # a region's backward raised: its post-hook never ran
                entry = self._entered.pop()
                if entry is not None and entry[0] in _get_current_function_mode_stack():
                    entry[0].__exit__(None, None, None)
            self.tracing, self.depth = False, 0


def leaves_below(node) -> list:
    """The tensors whose gradient accumulators the graph below ``node`` reaches."""
    accumulator = accumulate_grad_type()
    leaves, seen, stack = [], set(), [node]
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
