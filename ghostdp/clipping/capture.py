"""Captured calls: a layer's output grads G taken from its autograd node instead of a probe.

A probe (probe.py) is an ``autograd.Function`` on each hooked output: Python work at every call in the
forward and again in every backward, the host cost that bounds a GPU step at small batch. A captured call
has none; pass 1 gets its G from its output's gradient edge, one of two ways:

- **Book-keeping** keeps most Linear layers' G whole until the clipped sums anyway (in their factors; the
  rule's ``holds_output_grad`` says which calls). Pass 1 names those edges among the ``inputs`` of its
  ``autograd.grad``, which holds all those G to its end, no longer than book-keeping holds them anyway.
  It names a call's edge too where its G is small beside its input (``narrow_output``: an adapter's
  lora_A), rather than keep a probe as the sink below the layer above; where such a call's node runs
  (something named lies below it), its pre-hook hands G over then, so that its explicit gradients are
  formed during the pass and its input dropped there (``ModuleCall.by_hook``).
- **Two passes** free each G once its norm is formed, so pass 1 names only the probes, and a pre-hook on
  each captured call's node hands G over as autograd reaches the node. Autograd runs a node only if a
  named input lies below it, so the lowest ruled calls (no input with a graph: the first layers, or the
  first trained ones) keep their probes, the sinks below the others; a captured call whose node was not
  run all the same is named in a second backward (pass_one.py). Any ruled call may be captured so.

The call lives as long as its graph: it is stored in the metadata of the edge's autograd node, and the
step's audit, which walks the loss's graph anyway, finds it there (the call itself holds no node, so no
reference cycle through C++ outlives the graph). What the probe does besides, a captured call does so:
- a backward that did not start from a DP loss: the pre-hook refuses it, as the probe does (the node
  runs in any such backward);
- the rule's inputs: the call holds them from the forward until its norm is formed (autograd saved them
  for the layer's own backward anyway) with their version counters; pass 1 refuses an input modified in
  place since;
- a backward without inputs (pass 1 through reentrant checkpoints, reentrant.py): the pre-hook hands
  the grad over as the node runs.

A call is captured only where nothing else needs the probe: no saved-tensor hooks (a checkpoint or an
offload would drop the inputs that the call would hold), not in a recomputation or a reentrant region,
an output not broadcast to the batch, and an output that is the layer's result or a reshape of it
(F.linear's view of its (B*T, p) matmul: the edge is then the matmul's, which an in-place op on the
view does not bypass). In book-keeping, once a forward has run a trained layer under a checkpoint (or
the model's transformers flag says it checkpoints), its later calls are probed: such a step takes ghost's
two passes unless book-keeping keeps little there (modes.mode_of_step), and two passes free each G once
its norm is formed, so only the calls before the first checkpointed layer hold theirs to the end of
pass 1.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge

from .probe import ProbeIdentity, reshaped_base, tracing_or_transforming

CAPTURED_CALL = "ghostdp.captured_call"  # the key of the call in its node's metadata
SINK_SEARCH_NODES = 8  # nodes sink_below visits at most (it stops at the first recorded call's node)
NARROW_OUTPUT = 8  # book-keeping names the edge of a call whose output is this many times smaller than its input
_PROBE_NODE = ProbeIdentity._backward_cls
# The innermost saved-tensor hooks (pack, unpack), or None: a non-reentrant checkpoint's or an offload's.
saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def captured_edge(output: torch.Tensor):
    """(node, output_nr) whose grad is ``output``'s gradient (a reshaping view: its base's), or None."""
    t = reshaped_base(output) if output._is_view() else output
    if t is None:
        return None
    node = t.grad_fn
    if node is None or isinstance(node, torch._C._FunctionBase):  # a Python Function's output: probe it
        return None
    return node, t.output_nr


def capture(call, entry, module, args, output, two_passes: bool, captured_types):
    """Makes a recorded ruled call a captured one where it may be (see the module doc; the recorder has checked
    the step's conditions and recorded the call): the type of its node, or None (it needs a probe).
    ``two_passes``: the controller's mode is two passes (else book-keeping).
    ``captured_types``: the node types of the calls captured so far."""
    if not capturable_now():
        return None
    if two_passes:
        if not call.input_nodes:  # a lowest call: its probe is a sink of pass 1 (see the module doc)
            return None
        call.named, call.by_hook, call.sink_unknown = False, True, True
    elif entry.holds_output_grad is not None and entry.holds_output_grad(module, args, output, call.params):
        call.named, call.by_hook = True, False  # its factors hold G and its inputs to the clipped sums anyway
    elif narrow_output(args, output):  # its G held to the end of pass 1 costs little (an adapter's lora_A)
        call.named, call.by_hook = True, True  # its inputs are dropped once its explicit gradients are formed
    elif call.input_nodes and sink_below(call.input_nodes, captured_types):
        call.named, call.by_hook = False, True
    else:
        return None
    edge = captured_edge(output)
    if edge is None:
        return None
    node, output_nr = edge
    hold_at(call, node, output_nr, args)
    return type(node)


def capture_use(call, node, inputs, two_passes: bool, captured_types) -> None:
    """Captures a parameter's elementwise use (norms/parameter_uses.py) at its op's ``node``, holding what its rule
    reads, ``inputs``, as ``capture`` captures a ruled call whose factors do not hold G (the recorder has recorded it
    and checked ``capturable_now``): its op's pre-hook hands G over as the node runs, where two passes capture so (a
    node below it), or book-keeping finds a probe or captured call below; else pass 1 names its edge, as for a lowest
    call, which two passes give a probe and an op inside a forward cannot have (a class token's expand: G is small)."""
    if two_passes and call.input_nodes:
        call.named, call.by_hook, call.sink_unknown = False, True, True
    elif not two_passes and call.input_nodes and sink_below(call.input_nodes, captured_types):
        call.named, call.by_hook = False, True
    else:
        call.named, call.by_hook = True, False
    hold_at(call, node, 0, inputs)  # the op's one output
    captured_types.add(type(node))


def capturable_now() -> bool:
    """Whether a call may be captured now (see the module doc): no saved-tensor hooks, no recomputation (a backward
    running), no functorch transform or torch.compile tracing."""
    return (saved_tensor_hooks(False) is None and torch._C._current_graph_task_id() == -1
            and not tracing_or_transforming())


def hold_at(call, node, output_nr, inputs) -> None:
    """The call captured at output ``output_nr`` of ``node``, holding ``inputs`` (and their versions) to its norm."""
    call.inputs = inputs
    call.input_versions = tuple([a._version for a in inputs])
    call.captured = output_nr
    node.metadata[CAPTURED_CALL] = call  # the call lives as long as the node; the audit finds it there
    node.register_prehook(call.on_output_grads)  # a bound method: fewer objects per call than a partial


def narrow_output(args, output) -> bool:
    """Whether the output (so its grad G) has at most 1/NARROW_OUTPUT of the elements of the call's largest
    input: book-keeping may then hold G to the end of pass 1 (name its edge), as it holds far more for the
    layer anyway (an adapter's lora_A: G is (B, T, r) beside its (B, T, d) input and (B, r, d) kept gradients)."""
    return output.numel() * NARROW_OUTPUT <= max((a.numel() for a in args), default=0)


def sink_below(nodes, captured_types, limit=SINK_SEARCH_NODES) -> bool:
    """Whether a probed or captured call's node lies below ``nodes`` within ``limit`` nodes of the graph: then
    book-keeping's pass 1 runs a node above them (a probe, or an edge it names, lies below that call's)."""
    stack, seen = list(nodes), set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node)
        if kind is _PROBE_NODE or (kind in captured_types and CAPTURED_CALL in node.metadata):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def found_call(node):
    """The captured call on an autograd node of a captured type, with its edge set, or None."""
    call = node.metadata.get(CAPTURED_CALL)
    if call is not None:
        call.edges = (GradientEdge(node, call.captured),)  # until pass 1 is done (controller._forget_captured_edges)
    return call


def on_output_grads(call, grad_outputs):
    """A captured call's node is about to run with ``grad_outputs`` (its pre-hook, ModuleCall.on_output_grads)."""
    grad = grad_outputs[call.captured]
    receiver = call.recorder.pass_one
    if receiver.receives_output_grads():
        passed = receiver.current
        if grad is None:
            return None
        if passed.reentrant:  # a backward without inputs (reentrant checkpoints): received as the node runs
            receiver.receive_captured(call, grad)
        # A backward towards named edges; once per pass (a second backward for calls the first one missed
        # runs the others' nodes again).
        elif (passed.delivers_by_hooks and (call.by_hook or passed.proving)  # the proof: PassOne._proof_sinks
              and id(call) not in passed.captured_received):
            receiver.arrive(call, grad)
        elif call.named:  # what the node runs with: see hooked_output_grad
            call.hooked_grad = grad
        return None
    if grad is not None and grad.numel():
        receiver.refuse_if_not_from_dp_loss(call)
    return None


def hooked_output_grad(call, captured):
    """A named call's G as its layer's backward used it. Where the call's node runs in the backward, autograd
    captures the named edge's gradient before the tensor hooks on the layer's output (``output.register_hook`` in
    the model's forward) run; where it does not run, after them. The node's pre-hook keeps what the node runs
    with, which differs from ``captured`` only where such a hook returned another tensor (a hook that tripled a
    2-D Linear output's grad left book-keeping's clipped sum 41% off before 2026-11-26)."""
    hooked, call.hooked_grad = call.hooked_grad, None
    return captured if hooked is None else hooked


def check_inputs_unchanged(call) -> None:
    """Refuses an input that was modified in place after the call's forward (its rule would read the new values)."""
    for x, version in zip(call.inputs, call.input_versions):
        if x._version != version:
            raise RuntimeError(
                f"the input of module '{call.name}' ({type(call.module).__name__}) was modified in place after "
                "its forward; book-keeping reads that input to form the layer's per-example gradient norm. Fix: "
                "make the operation out of place (x = x * 2, not x.mul_(2); ReLU(inplace=False)).")
