"""Trainable parameters that no clipped gradient reaches: warned of once, after the first few noised steps.

The DP optimizer noises every parameter it updates at every step (a None gradient counts as zero), so a
parameter that the forward never uses, or whose output never reaches the loss, is updated by noise alone:
nothing fails, and it trains nothing. peft's LoRA on ``nn.MultiheadAttention``'s ``out_proj`` is one such
case: torch applies ``out_proj.weight`` inside its functional attention and never calls the adapter module
(the LoRA fuzzer met it: a per-example loop over such a model gets no gradient at all). A parameter whose
clipped sum is zero on some steps is not named for it (LoRA's A factor at the first step, while B is still
zero; an expert no token was routed to; a layer dropped at random): only one whose clipped sum was None or
exactly zero at each of the first UNREACHED_STEPS steps.
"""
from __future__ import annotations

import warnings

UNREACHED_STEPS = 8  # noised steps (with a DP loss's backward) before the parameters never reached are named

UNREACHED = (
    "ghostdp: {count} trained parameter(s) got a clipped gradient of exactly zero (or none) at each of the first "
    "{steps} steps: {names}. The DP optimizer adds noise to them at every step, so they are updated by noise alone "
    "and train nothing. Either the forward never uses them (peft's LoRA on nn.MultiheadAttention's out_proj: torch "
    "applies out_proj.weight inside its own attention function and never calls the adapter; "
    "ghostdp.validate.fix(model), before or after get_peft_model, swaps in ghostdp.layers.MultiheadAttention, which "
    "calls out_proj and its adapter), or what they compute does not reach the loss. Fix: freeze them "
    "(p.requires_grad_(False)) or use them in the forward.")


class UnreachedParameters:
    """The parameters (by id) whose clipped sum has been None or zero at every step so far, until UNREACHED_STEPS
    steps are in."""

    def __init__(self, names: dict):
        self._names = names       # id(parameter) -> its name in the model
        self._unreached = None    # ids zero at every step so far (None before the first)
        self._steps = 0

    @property
    def done(self) -> bool:
        return self._steps >= UNREACHED_STEPS

    def note(self, zero: set) -> None:
        """One step: ``zero``, the ids of the parameters it updates whose clipped sum is None or exactly zero. Warns
        once, at the UNREACHED_STEPS-th step, of those zero at every step."""
        if self.done:
            return
        self._unreached = set(zero) if self._unreached is None else self._unreached & zero
        self._steps += 1
        if self.done and self._unreached:
            names = sorted(self._names.get(key, "<unnamed>") for key in self._unreached)
            listed = ", ".join(f"'{n}'" for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            warnings.warn(UNREACHED.format(count=len(names), steps=UNREACHED_STEPS, names=listed), stacklevel=4)
