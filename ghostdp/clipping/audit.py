"""Graph audit, every step: every gradient path into a trainable parameter must belong to a recorded call.

A parameter read outside its module's forward (``self.emb.weight`` used directly by a parent, on
every step or only for some inputs) gets gradient that no norm rule saw, so its clipping would be
silently wrong. Each step, one walk of the loss's autograd graph collects every edge into the
gradient accumulator of a trainable model parameter and the recorded module calls (the probe
nodes); each edge must lie in the region of a call of the module owning that parameter (from the
call's outputs down to its inputs; a captured call (capture.py) is found in the metadata of its node,
among the nodes of the types its controller captured). Tensors that require grad but are not model parameters (an
input made to require grad by ``enable_input_require_grads``) are never stepped, so they are no
concern. The walk visits each node once: about 0.2 ms for a 12-layer BERT's ~950 nodes on a CPU.

The same walk gives the graph's signature: the type of each node in the order the walk meets it (a
depth-first walk: the same order for the same graph; under a TorchDispatchMode autograd records some ops
with other node types, so such a step's graph is new). The layout proof (layout.py), that no example's
gradient mixes with another's, covers the graph it ran on; a graph with another signature and the same
shapes (a batch mean or a mixup that a model applies on some steps only, a contrastive term added to the
losses) is proven again (pass_one.PassOne.run; inside a reentrant region, PassOne.region_audited).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.utils.checkpoint import CheckpointFunction

from .capture import found_call
from .fallback_paths import stops, uncounted_parameters
from .probe import ProbeIdentity
from .repeated import repeated_by_its_caller

_PROBE_NODE = ProbeIdentity._backward_cls
# node type -> whether the walk lists its nodes: a probe's, a reentrant checkpoint's (torch's or a subclass), an
# embedding lookup's (frequency_scaled)
_MARKED = {}


def _marked(kind: type) -> bool:
    known = _MARKED.get(kind)
    if known is None:
        forward = getattr(kind, "_forward_cls", None)  # a Python Function's backward node type names its Function
        known = _MARKED[kind] = ((isinstance(forward, type) and issubclass(forward, (ProbeIdentity, CheckpointFunction)))
                                 or kind in embedding_lookup_types())
    return known


@functools.cache
def embedding_lookup_types() -> frozenset:
    """The node types of F.embedding's and F.embedding_bag's backward (nn.Embedding, nn.EmbeddingBag)."""
    with torch.enable_grad():
        table, ids = torch.zeros(2, 1, requires_grad=True), torch.zeros(1, 1, dtype=torch.long)
        return frozenset({type(torch.nn.functional.embedding(ids, table).grad_fn),
                          type(torch.nn.functional.embedding_bag(ids, table).grad_fn)})


def frequency_scaled(node) -> bool:
    """Whether an embedding lookup's backward divides each row's gradient by the count of its index over the
    whole batch (scale_grad_by_freq=True): an example's gradient then depends on the other examples' indices."""
    return bool(getattr(node, "_saved_scale_grad_by_freq", False))


@functools.cache
def accumulate_grad_type() -> type:
    with torch.enable_grad():  # first called inside a backward, where grad mode is off
        leaf = torch.zeros(1, requires_grad=True)
        return type(leaf.view(1).grad_fn.next_functions[0][0])


def _edges_into_parameters(roots, parameters: dict, stop=frozenset(), marked=False, seen=None,
                           captured_types=frozenset(), recorded=None, kinds=None, foreign=None):
    """({(node, input index): parameter}, [probe and checkpoint nodes]) for every edge below ``roots``
    into the gradient accumulator of one of ``parameters`` (id -> parameter), not entering ``stop``
    nodes; with ``marked``, the probe and reentrant checkpoint nodes reached are listed, and the nodes
    of ``captured_types``. ``seen``: a set that receives the nodes visited. ``recorded``: node -> its
    next_functions, read while it was alive (released_edges). ``kinds``: a list that receives the type of
    each node as the walk meets it (the graph's signature: the module doc). ``foreign``: a dict that receives the
    nn.Parameters requiring grad whose accumulators the walk meets and that are not among ``parameters``, by id.
    One visit per node, no generator and few calls per node: this runs every step."""
    edges = {}
    found = []
    seen = set() if seen is None else seen
    kinds = [] if kinds is None else kinds
    foreign = {} if foreign is None else foreign
    accumulator = accumulate_grad_type()
    marked_types = _MARKED
    stack = [r for r in roots if r is not None]
    if marked:
        found.extend(r for r in stack if _marked(type(r)))
    kinds.extend(type(r) for r in stack)
    push, pop, visit, note = stack.append, stack.pop, seen.add, kinds.append
    while stack:
        node = pop()
        if node in seen:
            continue
        visit(node)
        idx = -1
        try:
            below = node.next_functions
        except RuntimeError:
            below = released_edges(node, recorded)
        for nxt, _ in below:
            idx += 1
            if nxt is None or nxt in seen:
                continue
            kind = type(nxt)
            note(kind)
            if kind is accumulator:  # a leaf's gradient accumulator: nothing below it
                leaf = nxt.variable
                param = parameters.get(id(leaf))
                if param is not None:
                    edges[(node, idx)] = param
                elif isinstance(leaf, torch.nn.Parameter):  # not a probe's, a sink's or an input's leaf
                    foreign[id(leaf)] = leaf
                continue
            if marked:
                is_marked = marked_types.get(kind)
                if is_marked or (is_marked is None and _marked(kind)) or kind in captured_types:
                    found.append(nxt)
            if nxt not in stop:
                push(nxt)
    # A node met from two parents before the walk visits it is listed twice: a reentrant checkpoint's twice made
    # two watches of its region, and the second audit of it, after the first had released its calls' edges,
    # refused the region's parameters as stray (a residual x + f(x) after the checkpoint).
    return edges, list(dict.fromkeys(found))


def released_edges(node, recorded):
    """The next_functions of a Python Function's node that its graph no longer holds: up to torch 2.11, such a
    node's Python object outlives its C++ node (a reentrant checkpoint's recomputed graph, freed by its own
    backward), and reading its edges raises. ``recorded`` holds the edges read while it was alive."""
    if recorded is not None and node in recorded:
        return recorded[node]
    raise RuntimeError(
        f"ghostdp's graph audit cannot read the edges of the autograd node {type(node).__name__}: its graph was "
        f"freed before the audit reached it (torch {torch.__version__} keeps no edges for a released node of a "
        "Python autograd.Function), so it cannot check that no gradient reaches a parameter outside its "
        "layer. Fix: " + RELEASED_NODE_FIX)


RELEASED_NODE_FIX = ("use non-reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=False), "
                     "or gradient_checkpointing_kwargs={'use_reentrant': False} in transformers), or upgrade torch.")


class GraphAudit(NamedTuple):
    """What audit_graph found (see there)."""
    stray: list
    calls: list
    reentrant: list
    uncounted: list
    frequency_scaled: list
    foreign: list


def audit_graph(roots, parameters: dict, stop=frozenset(), seen=None, captured_types=frozenset(), recorded=None,
                kinds=None) -> GraphAudit:
    """The stray parameters, recorded calls, reentrant checkpoint nodes, uncounted (parameter, call) pairs,
    frequency-scaled embedding lookups and foreign parameters of the graph below ``roots``.

    ``parameters``: id -> trainable parameter of the model. A stray parameter has a gradient edge
    outside every recorded call of its module. A reentrant checkpoint (torch.utils.checkpoint with
    use_reentrant=True) hides its region's graph until its own backward recomputes it (reentrant.py). A call
    without a rule gets the nodes where its fallback's VJP stops (``fallback_stops``), and a parameter of one
    that a path from the roots reaches past every VJP is uncounted (fallback_paths.py). An embedding lookup with
    scale_grad_by_freq couples the examples' gradients in its backward, where the layout proof (a property of
    the graph's data flow) does not look: any such node is listed (``frequency_scaled``), in any module. A
    foreign parameter is an nn.Parameter that gets gradient but is not one of ``parameters`` (a module added to
    the model after attaching, a parameter held outside the model): no norm counts it.
    ``stop``: nodes not entered (audited before); ``seen`` receives the nodes visited;
    ``captured_types``: the node types of the controller's captured calls (their edges are set here);
    ``recorded``: the edges of Python Functions' nodes, read while they were alive (released_edges);
    ``kinds`` receives the node types in the order the walk meets them: the graph's signature (below).
    """
    foreign = {}
    edges, found = _edges_into_parameters(roots, parameters, stop, True, seen, captured_types, recorded, kinds,
                                          foreign)
    calls = {}
    points = {}  # node -> the call whose output grads are taken there (a probe's, a captured call's)
    reentrant, scaled = [], []
    lookups = embedding_lookup_types()
    for node in found:
        kind = type(node)
        if kind in lookups:
            if frequency_scaled(node):
                scaled.append(node)
            if kind not in captured_types:
                continue
        if kind is _PROBE_NODE:
            call = getattr(node, "call", None)
        elif kind in captured_types:
            call = found_call(node)
        else:
            reentrant.append(node)
            continue
        if call is not None:
            calls[id(call)] = points[node] = call
    attributed = _edges_in_regions(calls.values(), points)
    stray = {id(p): p for key, p in edges.items() if key not in attributed}
    # Calls without a rule, and those captured at the model's repeat of their shared output (repeated.py: a path
    # to the table past that repeat, the prompt read again after the forward, escapes its norm too)
    fallback = [call for call in calls.values() if call.rule is None or repeated_by_its_caller(call)]
    uncounted = uncounted_parameters(roots, points, fallback, accumulate_grad_type()) if fallback else []
    return GraphAudit(list(stray.values()), list(calls.values()), reentrant, uncounted, scaled,
                      list(foreign.values()))


def _edges_in_regions(calls, points: dict) -> set:
    """The edges (node, input index) into each call's own parameters that lie in its region: from its
    outputs' nodes down to, not into, its input nodes. One small walk per call, so written without
    _edges_into_parameters' general set-up. A call without a rule gets its ``fallback_stops``: its input nodes
    and the output-grad points (``points``: node -> call) of other calls of its parameters that its walk meets
    (fallback_paths.py)."""
    accumulator = accumulate_grad_type()
    attributed = set()
    for call in calls:
        own = {id(p) for p in call.params.values()}
        stop = call.input_nodes
        stack = [e.node for e in call.edges]
        seen = set()
        met = [] if call.rule is None else None
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            idx = -1
            for nxt, _ in node.next_functions:
                idx += 1
                if nxt is None or nxt in seen:
                    continue
                if type(nxt) is accumulator:
                    if id(nxt.variable) in own:
                        attributed.add((node, idx))
                elif nxt not in stop:
                    stack.append(nxt)
                    if met is not None and nxt in points:
                        met.append(nxt)
        if met is not None:
            call.fallback_stops = stops(call, {node: points[node] for node in met})
    return attributed
