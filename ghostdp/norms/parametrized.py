"""A weight-normalised weight under its layer's own rule.

``torch.nn.utils.parametrizations.weight_norm`` makes a layer compute its weight in every forward from two
parameters of its parametrization, W = g * v / ||v|| (the norm over every dim but ``dim``): wav2vec2's, HuBERT's,
WavLM's and their kin's positional convolution (``dim=2``), which every pretrained checkpoint trains. The layer then
owns parameters its class's rule does not know, and until 2026-12-02 it took the exact fallback: one batched VJP of
the layer per chunk of examples (a 4-layer d=128 wav2vec2 at B=8: 1.63x plain with it trained, 1.27x with it
frozen, book-keeping, CPU).

Here the layer's rule forms each example's gradient of W as for any such layer, and each example's gradients of g
and v are J^T of it: W depends on g and v alone, not on the data, so a VJP of the parametrization's own small graph,
recomputed from g and v and batched over the examples (``is_grads_batched``, in chunks of ELEMENT_BUDGET elements),
gives them exactly. Only weight_norm is taken so: it has no state, where spectral_norm's power iteration updates its
vectors in place at every forward (recomputing it would move them) and other parametrizations are unknown; those
keep the fallback, as does a layer whose rule does not cover the parametrized tensor.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch.nn.utils.parametrizations import _WeightNorm

from .batched_vjp import grads_through
from .registry import RuleEntry


def chained_entry(module: torch.nn.Module, entry: RuleEntry) -> RuleEntry | None:
    """The entry for a parametrized ``module`` whose class's rule is ``entry``: that rule with the gradients of its
    weight-normalised tensors chained to their parametrizations' parameters; None where a parametrization is not a
    weight_norm alone, or is on a tensor the rule does not cover."""
    names = tuple(module.parametrizations.keys())
    covered = entry.covers(module)
    for name in names:
        chain = module.parametrizations[name]
        if name not in covered or len(chain) != 1 or not isinstance(chain[0], _WeightNorm):
            return None
    originals = {f"parametrizations.{name}.{o}" for name in names
                 for o, _ in module.parametrizations[name].named_parameters()}
    return dataclasses.replace(entry, rule=functools.partial(_chained_rule, entry.rule, names),
                               params=frozenset((covered - set(names)) | originals), holds_output_grad=None)


def _chained_rule(rule, names, module, inputs, output_grad, trainable) -> dict:
    """``rule``'s factors, those of each parametrized tensor in ``names`` replaced by its parameters' (module doc)."""
    originals = {name: [(f"parametrizations.{name}.{o}", p) for o, p in module.parametrizations[name].named_parameters()
                        if f"parametrizations.{name}.{o}" in trainable] for name in names}
    asked = {n for n in trainable if not n.startswith("parametrizations.")} | {n for n in names if originals[n]}
    factors = rule(module, inputs, output_grad, asked)
    for name in names:
        factor = factors.pop(name, None)
        if factor is not None and originals[name]:
            factors.update(_through(module.parametrizations[name], factor, originals[name]))
    return factors


def _through(chain, factor, originals) -> dict:
    """{name: Instantiated (B, *shape)}: each example's gradient of each parameter of ``chain`` (a ParametrizationList)
    from the factor of the tensor it computes, by a batched VJP of the chain recomputed from those parameters."""
    with torch.enable_grad():
        weight = chain()
    grads = grads_through(weight, [p for _, p in originals], factor)
    return {name: g for (name, _), g in zip(originals, grads)}
