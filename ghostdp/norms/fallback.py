"""Fallback for modules without a rule: instantiate their per-example gradients.

The per-example gradient of the module's own parameters for example i is the
vector-Jacobian product of the module's recorded forward with the output grad
masked to example i. All examples of a chunk go through one batched VJP
(``torch.autograd.grad(..., is_grads_batched=True)``, torch.func's vmap over the
backward), along the graph recorded in the real forward: no forward is re-run,
so dropout masks and other randomness are exactly those of the step.
Cost: one batched backward of the module per chunk of examples, so this is
for small or rare modules (GRU, raw nn.Parameters, custom layers).
"""
from __future__ import annotations

import warnings

import torch

from .factors import ELEMENT_BUDGET, Instantiated

# Classes whose fallback covers every parameter below them, because their
# forward uses children's parameters without calling the children.
OPAQUE_MODULES: tuple = (torch.nn.MultiheadAttention,)


def owned_parameters(module: torch.nn.Module) -> dict:
    """Parameters a hook on ``module`` is responsible for, by qualified name."""
    if isinstance(module, OPAQUE_MODULES):
        return dict(module.named_parameters())
    owned = dict(module.named_parameters(recurse=False))
    for child_name, child in module.named_children():
        if isinstance(child, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            owned.update({f"{child_name}.{n}": p for n, p in child.named_parameters()})
    return owned


def hooked_modules(root: torch.nn.Module):
    """(qualified name, module) for every module that needs a hook, skipping the
    parameter containers and the children of opaque modules."""
    opaque_prefixes = []
    for name, module in root.named_modules():
        if any(name.startswith(p) for p in opaque_prefixes):
            continue
        if isinstance(module, (torch.nn.ParameterList, torch.nn.ParameterDict)):
            continue
        if isinstance(module, OPAQUE_MODULES):
            opaque_prefixes.append(name + "." if name else "")
        if owned_parameters(module):
            yield name, module


def output_batch_dims(module, n_outputs):
    """Batch dim of each tensor output, in the order of the flattened output."""
    if isinstance(module, torch.nn.RNNBase):
        first = 0 if module.batch_first else 1
        return [first] + [1] * (n_outputs - 1)  # h_n (and c_n) are (layers, B, H)
    if isinstance(module, torch.nn.MultiheadAttention):
        return [0 if module.batch_first else 1] + [0] * (n_outputs - 1)
    return [0] * n_outputs


def _masked_cotangents(grad, dim, lo, hi, expanded):
    """(k, *edge_shape) cotangents: row j carries example lo+j's grad, zeros elsewhere."""
    k = hi - lo
    per_example = grad.narrow(dim, lo, k).movedim(dim, 0)
    if expanded:  # the recorded tensor had size 1 on the batch dim and was broadcast
        return per_example.unsqueeze(dim + 1)
    cot = grad.new_zeros((k,) + tuple(grad.shape))
    idx = torch.arange(k, device=grad.device)
    cot.movedim(dim + 1, 1)[idx, lo + idx] = per_example
    return cot


def fallback_grads(params: dict, edges, grads, batch_dims, expanded, batch_size):
    """{name: Instantiated((B, *shape))} for the given own parameters of one module call."""
    live = [(e, g, d, x) for e, g, d, x in zip(edges, grads, batch_dims, expanded) if g is not None]
    names = list(params)
    chunks = {n: [] for n in names}
    if not live:
        return {n: Instantiated(params[n].new_zeros((batch_size,) + params[n].shape)) for n in names}
    per_example = sum(g.numel() for _, g, _, _ in live) + sum(p.numel() for p in params.values())
    step = max(1, ELEMENT_BUDGET // per_example)
    for lo in range(0, batch_size, step):
        hi = min(batch_size, lo + step)
        cots = [_masked_cotangents(g, d, lo, hi, x) for _, g, d, x in live]
        outs = [e for e, _, _, _ in live]
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*performance drop.*")
                res = torch.autograd.grad(outs, [params[n] for n in names], cots, retain_graph=True,
                                          allow_unused=True, is_grads_batched=True)
        except RuntimeError:
            # Some backward formulas have no batching rule: one VJP per example instead.
            res = [[] for _ in names]
            for j in range(hi - lo):
                one = torch.autograd.grad(outs, [params[n] for n in names], [c[j] for c in cots],
                                          retain_graph=True, allow_unused=True)
                for r, g in zip(res, one):
                    r.append(g)
            res = [None if r[0] is None else torch.stack(r) for r in res]
        for n, g in zip(names, res):
            chunks[n].append(g if g is not None else params[n].new_zeros((hi - lo,) + params[n].shape))
    return {n: Instantiated(torch.cat(chunks[n])) for n in names}


__all__ = ["owned_parameters", "hooked_modules", "fallback_grads", "output_batch_dims", "OPAQUE_MODULES"]
