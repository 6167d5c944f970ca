"""Graph audit: every gradient path into a trainable leaf must belong to a hooked module call.

A parameter read outside its module's forward (``self.emb.weight`` used directly
by a parent, a stray ``nn.Parameter`` in the loss) gets gradient that no norm
rule saw, so its clipping would be silently wrong. The audit walks the autograd
graph of the per-example losses once, collects every edge into an
AccumulateGrad node of a leaf that requires grad, and checks that each lies in
the region of some recorded module call (from that call's outputs down to its
inputs). It runs on the first step and again whenever the pattern of uses changes.
"""
from __future__ import annotations

from .probe import ProbeIdentity


def _walk(roots, stop=frozenset()):
    """Yield (node, input_index, next_node) for every edge below roots, not entering `stop` nodes."""
    seen = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for idx, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            yield node, idx, nxt
            if nxt not in stop and nxt not in seen:
                stack.append(nxt)


def _leaf(node):
    return getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None


def unattributed_leaves(loss_node, ignore=()):
    """Trainable leaves (other than `ignore`) with gradient edges outside every recorded module call."""
    ignore = {id(t) for t in ignore}
    all_edges = {}
    uses = []
    for node, idx, nxt in _walk([loss_node]):
        leaf = _leaf(nxt)
        if leaf is not None and id(leaf) not in ignore:
            all_edges[(node, idx)] = leaf
        if isinstance(nxt, ProbeIdentity._backward_cls) and getattr(nxt, "use", None) is not None:
            uses.append(nxt.use)
    attributed = set()
    for use in {id(u): u for u in uses}.values():
        own = {id(p) for p in use.params.values()}
        roots = [e.node for e in use.edges]
        for node, idx, nxt in _walk(roots, stop=use.input_nodes):
            leaf = _leaf(nxt)
            if leaf is not None and id(leaf) in own:
                attributed.add((node, idx))
    missing = {id(leaf): leaf for key, leaf in all_edges.items() if key not in attributed}
    return list(missing.values())
