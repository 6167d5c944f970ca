"""Every gradient path into a parameter of a module without a rule is counted by exactly one of its calls.

The exact fallback (norms/fallback.py) forms a call's per-example gradients by a VJP from the call's outputs,
with that call's output grads G (taken at its probes, probe.py). Autograd sums over the paths from the loss
to a parameter; the fallback's sum is right only if each such path is counted by one call's VJP, once:

- **counted twice**: a path that passes call k's outputs and then another call j's outputs of the same
  parameter is in G_j already (G_j sums everything above j), so k's VJP must stop at j's output-grad
  points (its probe nodes, or a captured call's node). Before 2026-11-25 only k's inputs stopped it, and a
  state that the parent hands the module back as an attribute (``m.state = m(x)``; the next call adds it)
  was counted twice: one example's norm came out 23 times too small, so it moved the update by 23 C
  (``stops``);
- **counted by none**: a path from the loss into a call's interior that passes no output-grad point of a call
  of that parameter, or leaves the last one it passed through that call's inputs (where its VJP stops). A
  tensor the forward kept on the module (``self.last = x * self.g``) and its parent read after the forward
  is such a path: its gradient reached p.grad in pass 2 and no norm saw it (one example moved the update
  by 9.9 C). ``uncounted_parameters`` finds such paths in the step's graph, and the controller refuses them.

Modules with a rule run the forward their rule knows (registry.lookup_rule), which keeps nothing: their
interiors are reached only through their outputs, and the check covers the fallback's parameters only (a
step without a module without a rule costs nothing). It walks the graph once more, one visit per node and
set of still uncounted parameters: about the audit's own cost, on steps with such a module.
"""
from __future__ import annotations

import functools
import operator


def stops(call, points: dict) -> frozenset:
    """The nodes where ``call``'s fallback VJP stops: its inputs' nodes, and the output-grad points of the other
    calls that share one of its parameters (see the module doc), among ``points`` (node -> call): those that the
    walk of the call's region met (audit._edges_in_regions; in most models none, and nothing is added)."""
    own = {id(p) for p in call.params.values()}
    shared = [node for node, other in points.items()
              if other is not call and any(id(p) in own for p in other.params.values())]
    return call.input_nodes.union(shared) if shared else call.input_nodes


def uncounted_parameters(roots, points: dict, fallback_calls, accumulator: type) -> list:
    """(parameter, call) for each parameter of ``fallback_calls`` reached from ``roots`` along a path that no call's
    VJP counts (module doc): the walk carries, per node, the bit set of the parameters with such a path to it
    (a node is visited again when its set grows). An output-grad point of a call clears its parameters' bits; an
    input node of a fallback call sets them again (its VJP stops there)."""
    bit_of, owner = {}, {}
    for call in fallback_calls:
        for p in call.params.values():
            if id(p) not in bit_of:
                bit_of[id(p)], owner[id(p)] = 1 << len(bit_of), (p, call)

    def bits(call):
        return functools.reduce(operator.or_, (bit_of.get(id(p), 0) for p in call.params.values()), 0)

    counted_below = {node: b for node, b in ((n, bits(c)) for n, c in points.items()) if b}
    uncounted_below = {}
    for call in fallback_calls:
        b = bits(call)
        for node in call.input_nodes:
            uncounted_below[node] = uncounted_below.get(node, 0) | b
    everything = (1 << len(bit_of)) - 1
    reaching = {}
    stack = []
    for root in roots:
        if root is not None:
            reaching[root] = everything
            stack.append(root)
    found = 0
    while stack:
        node = stack.pop()
        open_bits = (reaching[node] | uncounted_below.get(node, 0)) & ~counted_below.get(node, 0)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt) is accumulator:
                found |= open_bits & bit_of.get(id(nxt.variable), 0)
                continue
            # Every node is visited, with no bits too: a fallback call's input node below sets its bits again.
            before = reaching.get(nxt)
            if before is None or before | open_bits != before:
                reaching[nxt] = open_bits if before is None else before | open_bits
                stack.append(nxt)
    return [owner[key] for key, b in bit_of.items() if found & b]
