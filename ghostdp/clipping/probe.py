"""The probe: an identity on each hooked layer's output that hands its output grad to the controller.

Pass 1 differentiates the loss towards one zero-size leaf (the probe) that enters
every hooked output through ``ProbeIdentity``. Autograd therefore computes
exactly the activation gradients on the way to those outputs, and no weight
gradient (no weight is an input of that ``autograd.grad`` call).

For a module with a norm rule (whose forward is known) the identity marks its input
dirty instead of returning a view or a copy, so a later in-place op
(``ReLU(inplace=True)``) stays legal and memory is unchanged. The output of any other
module (the fallback's) is copied: its producer may have saved it for its own backward.
A Linear layer on a (B, T, d) input returns a view of its (B*T, p) matmul result:
there the probe goes on that result and the view is taken again after it, so no
copy is made either. Where the output was saved by its own producer (tanh,
sigmoid), or is another kind of view or a leaf, bumping its version would break
the backward, so a copy is returned.

A ruled module's inputs (the rule's activations A) are saved on the probe's autograd node, not
held by the controller: inside a non-reentrant activation checkpoint they are then dropped after
the forward like every other saved tensor, and the norm pass's unpacking recomputes them.
"""
from __future__ import annotations

import sys

import torch


def can_mark_dirty(t: torch.Tensor) -> bool:
    return (t.grad_fn is not None and not t._is_view()
            and not hasattr(t.grad_fn, "_saved_result"))


def reshaped_base(t: torch.Tensor):
    """The tensor that the view ``t`` merely reshapes (same elements, same order), or None."""
    base = t._base if t._is_view() else None
    if (base is None or base.numel() != t.numel() or not base.is_contiguous() or not t.is_contiguous()
            or t.storage_offset() != base.storage_offset()):
        return None
    return base


def _reshaped_base(t: torch.Tensor):
    """The tensor that ``t`` merely reshapes, if it may be marked dirty."""
    base = reshaped_base(t)
    return base if base is not None and can_mark_dirty(base) else None


class ProbeIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, probe, spec):
        # spec: (call, slot, in_place, output_shape, inputs), one argument: Function.apply's per-argument
        # work is per call of every hooked layer.
        call, slot, in_place, output_shape, inputs = spec
        ctx.call, ctx.slot, ctx.output_shape = call, slot, output_shape
        ctx.has_inputs = bool(inputs)
        if inputs:  # not inputs of this Function (a tuple argument): no graph edge, only saved
            ctx.save_for_backward(*inputs)
        # No zeros for a missing gradient: after book-keeping's pass 1 nothing flows further back,
        # and zeros would run a whole useless backward.
        ctx.set_materialize_grads(False)
        if in_place:
            ctx.mark_dirty(out)
            return out
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        # The probe itself gets no gradient: autograd runs every node on the way to it all the same, and a
        # zero-size one from each call would be summed into pass 1's result (one op per hooked layer).
        if grad is None:
            return None, None, None
        call = ctx.call
        receiver = call.recorder.pass_one
        if receiver.receives_output_grads():
            shaped = grad if ctx.output_shape is None else grad.view(ctx.output_shape)
            if ctx.has_inputs:
                # Unpacked in every pass, the layout proof's too, which reads only G: inside a non-reentrant
                # activation checkpoint each backward recomputes them, and a saved tensor left unpacked keeps its
                # recomputed copy as long as the graph (BERT L=4, H=256, B=16: a proof step peaked at 72.6 MB
                # against 9.7 MB, every layer's inputs recomputed at once, before 2026-11-26).
                inputs = ctx.saved_tensors  # recomputed here inside an activation checkpoint
                if receiver.needs_inputs():
                    call.inputs = inputs
            receiver.receive(call, ctx.slot, shaped)
        elif grad.numel():  # a gradient with no rows (an empty batch) carries no example
            receiver.refuse_if_not_from_dp_loss(call)
        return grad, None, None


class InputSink(torch.autograd.Function):
    """A copy of a tensor that does not require grad, on the graph through a zero-size leaf (the recorder's
    sink leaf): a float input of a module without a rule, so that the layout proof can read that input's
    gradient (pass_one.PassOne._prove_fallback_inputs). Pass 1 never asks for the sink leaf, so nothing
    runs there; the backward hands nothing on."""

    @staticmethod
    def forward(ctx, x, sink):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


# ProbeIdentity.apply without Function.apply's Python preamble (default-argument binding, functorch's
# dead-wrapper unwrapping): about half of its cost, once per hooked layer and forward. Used outside
# functorch transforms and torch.compile's tracing, where that preamble does real work.
_DIRECT_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, ProbeIdentity)


COMPILED_BEFORE_ATTACHING = (
    " torch.compile has compiled code in this process: a forward compiled before ghostdp attached runs without the "
    "hooks added after it (dynamo does not check a module's hooks again), which leaves its layers unrecorded "
    "exactly so. If that is the case: make the model private before its first compiled call, or call "
    "torch._dynamo.reset() after attaching.")


def compiled_code_note() -> str:
    """COMPILED_BEFORE_ATTACHING where torch.compile has compiled a frame in this process, else "" (dynamo is not
    imported for it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return COMPILED_BEFORE_ATTACHING if utils is not None and utils.counters["frames"]["ok"] > 0 else ""


def tracing_or_transforming() -> bool:
    """Whether functorch transforms are active or torch.compile is tracing: a probe then needs
    Function.apply's preamble, and a call is not captured (capture.py)."""
    return torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()


def _apply(out, probe, spec):
    if tracing_or_transforming():
        return ProbeIdentity.apply(out, probe, spec)
    return _DIRECT_APPLY(out, probe, spec)


def add_probe(out: torch.Tensor, probe: torch.Tensor, call, slot: int, known_forward: bool,
              inputs: tuple = ()) -> torch.Tensor:
    """``out`` with the probe attached. ``known_forward``: the module is one whose forward a norm rule
    knows (Linear, Conv1D, ...), so nothing inside it saved the base of a view output. ``inputs``:
    what the rule reads, saved on the probe's node."""
    if not known_forward:
        # Any producer may have saved its output for its backward, under any name (cuDNN's and
        # mkldnn's RNNs, a custom autograd.Function): marking it dirty would break that backward.
        return _apply(out, probe, (call, slot, False, None, inputs))
    if can_mark_dirty(out):
        return _apply(out, probe, (call, slot, True, None, inputs))
    base = _reshaped_base(out)
    if base is not None:
        return _apply(base, probe, (call, slot, True, out.shape, inputs)).view(out.shape)
    return _apply(out, probe, (call, slot, False, None, inputs))
