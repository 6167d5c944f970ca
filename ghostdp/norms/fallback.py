"""Fallback for modules without a rule: instantiate their per-example gradients.

The per-example gradient of the module's own parameters for example i is the
vector-Jacobian product of the module's recorded forward with the output grad
masked to example i. All examples of a chunk go through one batched VJP
(``torch.autograd.grad(..., is_grads_batched=True)``, torch.func's vmap over the
backward), along the graph recorded in the real forward: no forward is re-run,
so dropout masks and other randomness are exactly those of the step.
The VJP stays in the call's region, from its outputs down to its inputs (the region the graph audit
attributes to the call): the gradient reaching an input's node is stopped there. Without the stop, a
module called twice in a chain (``m(f(m(x)))``, a weight-normalised layer reused) took, in its second
call, the first call's part of the gradient too, through its input: the first call's part counted twice,
and an example whose two parts nearly cancelled was clipped by far too little (measured: 2.57 C). It also
stops where the output grads of another call of the same parameters are taken (a state handed back to
the module through an attribute; clipping/fallback_paths.py, which also refuses paths no VJP counts).
Cost: one batched backward of the module per chunk of examples, so this is
for small or rare modules (GRU, raw nn.Parameters, custom layers).
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.utils import parametrize

from .batched_vjp import batched_vjp
from .factors import ELEMENT_BUDGET, Instantiated
from .parametrized import chained_entry
from .registry import lookup_rule, qualified_name
from .relative_bias import looks_up_per_example

# Classes whose fallback covers every parameter below them, because their
# forward uses children's parameters without calling the children.
OPAQUE_MODULES: tuple = (torch.nn.MultiheadAttention,)

# Children whose output their parent broadcasts to the batch itself, by the parent's class (qualified name): T5's
# relative attention bias is one lookup of a (q, k) table of buckets for all examples, with no batch dim, added to
# every example's attention scores, so no call of the child holds an example's gradient (its layout proof refused
# it: frozen only before 2026-11-27). Its parameters are the parent's, which takes the exact fallback: the VJP from
# the attention's outputs, per example, reaches them through the scores. The child is not hooked. Since 2026-11-28
# a parent with T5's own code looks its bias up per example instead (relative_bias.py) and owns nothing; the others
# here (UMT5's and Pix2Struct's compute_bias, LongT5's local attentions) keep the fallback. MPNet's bias belongs to
# its whole encoder (a VJP through every layer per example): refused as it is, naming the freeze and validate.fix,
# whose twin looks it up per example (layers/mpnet.py, since 2026-12-02).
_T5_ATTENTIONS = ("t5.modeling_t5.T5Attention", "mt5.modeling_mt5.MT5Attention", "umt5.modeling_umt5.UMT5Attention",
                  "longt5.modeling_longt5.LongT5Attention", "longt5.modeling_longt5.LongT5LocalAttention",
                  "longt5.modeling_longt5.LongT5TransientGlobalAttention",
                  "switch_transformers.modeling_switch_transformers.SwitchTransformersAttention",
                  "pop2piano.modeling_pop2piano.Pop2PianoAttention", "udop.modeling_udop.UdopAttention",
                  "pix2struct.modeling_pix2struct.Pix2StructTextAttention")
ABSORBED_CHILDREN: dict = {f"transformers.models.{name}": ("relative_attention_bias",) for name in _T5_ATTENTIONS}

# Parameter containers that a module holds for its descendants, which apply them, by the holder's class (qualified
# name): peft's VB-LoRA vector bank, UniLoRA's vector and TinyLoRA's vectors, one container that the tuner model and
# every adapted layer hold. The layers own its parameters (each call a use, norms/peft_deltas.py); the holder does not,
# so that a forward through it (a PeftModel with a task type calls the tuner model) is not the exact fallback of the
# whole model (VB-LoRA on a 2-layer BERT: 51 ms a step against 12 ms). A use by the holder's own forward would be a
# gradient outside every call of an owner, which the graph audit refuses.
LENT_CONTAINERS: dict = {"peft.tuners.vblora.model.VBLoRAModel": frozenset({"vblora_vector_bank"}),
                         "peft.tuners.unilora.model.UniLoraModel": frozenset({"unilora_theta_d"}),
                         "peft.tuners.tinylora.model.TinyLoraModel": frozenset({"tinylora_v"})}


# Where an absorbing parent owns its children's parameters only on some condition of the module (peft's OFT on a
# convolution, from peft 0.22 on: norms/peft_rotations.py): qualified name -> predicate(module).
ABSORBED_WHEN: dict = {}


def absorbed_children(module: torch.nn.Module) -> list:
    """(name, child) of each child of ``module`` whose parameters it owns (ABSORBED_CHILDREN, where ABSORBED_WHEN says
    so), through its MRO; none where the bias is looked up per example instead (relative_bias.py: the table is then an
    Embedding call of its own)."""
    if looks_up_per_example(type(module)):
        return []
    for cls in type(module).__mro__:
        name = qualified_name(cls)
        names, when = ABSORBED_CHILDREN.get(name), ABSORBED_WHEN.get(name)
        if names and (when is None or when(module)):
            return [(n, module._modules[n]) for n in names if module._modules.get(n) is not None]
    return []


_PARAMETER_CONTAINERS = (torch.nn.ParameterList, torch.nn.ParameterDict)


def is_parameter_container(module: torch.nn.Module) -> bool:
    """A ParameterList or ParameterDict, or a ModuleDict or ModuleList of those alone (peft's AdaMSS keeps a
    ParameterList per adapter in a ModuleDict, TinyLoRA a ParameterDict): it holds parameters for the module that holds
    it, and has no forward of its own. Until 2026-12-07 a nested one owned its parameters itself, which no call used:
    every step was refused (a gradient outside every call of their owner)."""
    if isinstance(module, _PARAMETER_CONTAINERS):
        return True
    return (isinstance(module, (torch.nn.ModuleDict, torch.nn.ModuleList)) and len(module) > 0
            and all(isinstance(m, _PARAMETER_CONTAINERS) for m in module.children()))


def owned_parameters(module: torch.nn.Module) -> dict:
    """Parameters a hook on ``module`` is responsible for, by qualified name. Those of a parametrization
    (torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal) are its module's: the module's forward
    computes the weight from them, so its call's graph holds their whole gradient (the exact fallback takes it,
    since the module then owns parameters that its class's rule does not know)."""
    if isinstance(module, OPAQUE_MODULES):
        return dict(module.named_parameters())
    owned = dict(module.named_parameters(recurse=False))
    lent = LENT_CONTAINERS.get(qualified_name(type(module)), ())
    for child_name, child in module.named_children():
        if is_parameter_container(child) and child_name not in lent:
            owned.update({f"{child_name}.{n}": p for n, p in child.named_parameters()})
    if parametrize.is_parametrized(module):
        owned.update({f"parametrizations.{n}": p for n, p in module.parametrizations.named_parameters()})
    for child_name, child in absorbed_children(module):
        owned.update({f"{child_name}.{n}": p for n, p in child.named_parameters()})
    return owned


def hooked_modules(root: torch.nn.Module):
    """(qualified name, module) for every module that needs a hook, skipping the
    parameter containers, the children of opaque modules and the parametrizations (owned_parameters)."""
    opaque_prefixes = []
    absorbed = set()  # the names of absorbed children (their own children start with one of opaque_prefixes)
    for name, module in root.named_modules():
        if name in absorbed or any(name.startswith(p) for p in opaque_prefixes):
            continue
        if is_parameter_container(module):  # its parameters are the holder's (owned_parameters)
            opaque_prefixes.append(name + ".")
            continue
        if isinstance(module, parametrize.ParametrizationList):
            opaque_prefixes.append(name + ".")
            continue
        if isinstance(module, OPAQUE_MODULES):
            opaque_prefixes.append(name + "." if name else "")
        for child, _ in absorbed_children(module):
            absorbed.add(f"{name}.{child}" if name else child)
            opaque_prefixes.append(f"{name}.{child}." if name else f"{child}.")
        if owned_parameters(module):
            yield name, module


def attached_rule(module):
    """The rule entry ghostdp attaches to a hooked module, or None: its own parameters take the fallback (an opaque
    module, no rule, or parameters the rule does not cover: a subclass with parameters of its own)."""
    entry = None if isinstance(module, OPAQUE_MODULES) else lookup_rule(module)
    if entry is not None and parametrize.is_parametrized(module):
        entry = chained_entry(module, entry)  # a weight_norm under the layer's rule (parametrized.py), or None
    if entry is not None and not set(owned_parameters(module)) <= entry.covers(module):
        return None
    return entry


def output_batch_dims(module, n_outputs):
    """Batch dim of each tensor output, in the order of the flattened output."""
    if isinstance(module, torch.nn.RNNBase):
        first = 0 if module.batch_first else 1
        return [first] + [1] * (n_outputs - 1)  # h_n (and c_n) are (layers, B, H)
    if isinstance(module, torch.nn.MultiheadAttention):
        return [0 if module.batch_first else 1] + [0] * (n_outputs - 1)
    return [0] * n_outputs


def _masked_cotangents(grad, dim, lo, hi, expanded, batch_size=None):
    """(k, *edge_shape) cotangents: row j carries example lo+j's grad, zeros elsewhere. ``batch_size``: the output
    holds each example's rows together on dim 0 (layout ("rows",): a module on flattened tokens, (B * T, ...)),
    masked as (B, T, ...)."""
    k = hi - lo
    if batch_size is not None:
        by_example = grad.reshape(batch_size, grad.shape[0] // batch_size, *grad.shape[1:])
        return _masked_cotangents(by_example, 0, lo, hi, False).reshape(k, *grad.shape)
    per_example = grad.narrow(dim, lo, k).movedim(dim, 0)
    if expanded:  # the recorded tensor had size 1 on the batch dim and was broadcast
        return per_example.unsqueeze(dim + 1)
    cot = grad.new_zeros((k,) + tuple(grad.shape))
    idx = torch.arange(k, device=grad.device)
    cot.movedim(dim + 1, 1)[idx, lo + idx] = per_example
    return cot


def fallback_grads(params: dict, edges, grads, batch_dims, expanded, batch_size, stops=frozenset(), rows=None):
    """{name: Instantiated((B, *shape))} for the given own parameters of one module call; ``stops``: the autograd
    nodes where its VJP ends: its inputs' (module doc), and where the output grads of other calls of these
    parameters are taken (clipping/fallback_paths.py). ``rows``: per output, whether its proven layout holds each
    example's rows together on dim 0 (("rows",): the module runs on flattened tokens, (B * T, ...)) instead of the
    examples on its batch dim."""
    rows = rows or (False,) * len(edges)
    live = [(e, g, d, x, r) for e, g, d, x, r in zip(edges, grads, batch_dims, expanded, rows) if g is not None]
    names = list(params)
    chunks = {n: [] for n in names}
    if not live:
        return {n: Instantiated(params[n].new_zeros((batch_size,) + params[n].shape)) for n in names}
    per_example = sum(g.numel() for _, g, _, _, _ in live) + sum(p.numel() for p in params.values())
    step = max(1, ELEMENT_BUDGET // per_example)
    with _stopped_at(stops):
        for lo in range(0, batch_size, step):
            _vjp_chunk(params, names, live, lo, min(batch_size, lo + step), chunks, batch_size)
    return {n: Instantiated(torch.cat(chunks[n])) for n in names}


@contextlib.contextmanager
def _stopped_at(nodes):
    """While inside: gradient that reaches one of ``nodes`` in a backward other than the one running now (the
    fallback's own VJPs, started here) goes no further (an undefined gradient: nothing below gets any)."""
    running = torch._C._current_graph_task_id()  # pass 1's backward, or -1 after it

    def stop(grad_outputs):
        if torch._C._current_graph_task_id() == running:
            return None  # that backward's gradient, unchanged
        return (None,) * len(grad_outputs)

    handles = [node.register_prehook(stop) for node in nodes]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _vjp_chunk(params, names, live, lo, hi, chunks, batch_size):
    """Appends the per-example gradients of examples lo..hi-1 to ``chunks`` (name -> list)."""
    cots = [_masked_cotangents(g, d, lo, hi, x, batch_size if r else None) for _, g, d, x, r in live]
    grads = batched_vjp([e for e, _, _, _, _ in live], [params[n] for n in names], cots)
    for n, g in zip(names, grads):
        if g.layout != torch.strided:
            raise NotImplementedError(
                f"the parameter '{n}' of a module without a norm rule gets a {g.layout} gradient (e.g. "
                "F.embedding(..., sparse=True) on a weight of its own): its clipped sum in p.grad would be sparse, "
                "and ghostdp's noise covers dense gradients only. Fix: sparse=False (nn.Embedding's rule is "
                "exact and fast).")
        chunks[n].append(g)


__all__ = ["owned_parameters", "hooked_modules", "fallback_grads", "output_batch_dims", "OPAQUE_MODULES"]
