"""Model checks: reject what makes per-example gradients undefined, with the fix in the message."""
from __future__ import annotations

import warnings

import torch

from . import layers
from .layers.twins import twin_of
from .norms.fallback import attached_rule, hooked_modules, owned_parameters
from .norms.registry import is_instance_of

# torch.nn modules that ghostdp.layers has twins of, whose weights the Linear rule covers (``fix``)
_TWINNED = (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN, torch.nn.MultiheadAttention)
# peft's LoRA on a parameter (LoraConfig(target_parameters=...)): refused by find_problems
PEFT_PARAMETER_LORA = "peft.tuners.lora.layer.ParamWrapper"
# peft's DoRA magnitude of an embedding (LoraConfig(use_dora=True) on an nn.Embedding): refused by find_problems
PEFT_DORA_EMBEDDING = "peft.tuners.lora.dora.DoraEmbeddingLayer"
# peft's LoRA on an nn.MultiheadAttention itself, which merges into its packed weight in every forward: refused
PEFT_ATTENTION_LORA = "peft.tuners.lora.layer.MultiheadAttention"
PEFT_ADALORA_MODEL = "peft.tuners.adalora.model.AdaLoraModel"


class ModelNotPrivatizable(ValueError):
    """The model cannot be trained with per-example clipping as it is."""


def find_problems(model: torch.nn.Module) -> list[str]:
    """One message per offending module; empty when the model is fine."""
    problems = []
    for name, m in model.named_modules():
        label = f"'{name or '<root>'}' ({type(m).__name__})"
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            problems.append(
                f"module {label} normalises with batch statistics, which mixes examples across the batch, "
                "so per-example gradients are undefined. Fix: ghostdp.validate.fix(model) replaces every "
                "BatchNorm by a GroupNorm (or use LayerNorm/GroupNorm yourself).")
        elif isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            problems.append(
                f"module {label} has uninitialised lazy parameters. Fix: run one forward pass on a sample "
                "batch before making the model private.")
        elif isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.scale_grad_by_freq and any(
                p.requires_grad for p in m.parameters()):
            problems.append(
                f"module {label} has scale_grad_by_freq=True, which scales gradients by token counts over "
                "the whole batch and couples examples. Fix: set scale_grad_by_freq=False.")
        elif isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None:
            problems.append(
                f"module {label} has max_norm={m.max_norm}: each forward renormalises, in place, the rows of the "
                "table that the batch looks up, a change of the model that depends on the data and that no "
                "clipping bounds (one example moved the table by 7.4 with C = 1e-3). Fix: set max_norm=None "
                "and renormalise the whole table outside the forward, e.g. after each optimizer step: "
                "with torch.no_grad(): emb.weight.copy_(torch.renorm(emb.weight, 2, 0, max_norm)).")
        elif isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and any(
                p.requires_grad for p in m.parameters()):
            problems.append(
                f"module {label} produces sparse gradients, which ghostdp's noise cannot cover. "
                "Fix: set sparse=False.")
        elif is_instance_of(m, PEFT_PARAMETER_LORA) and any(p.requires_grad for p in m.parameters()):
            problems.append(
                f"module {label} is peft's LoRA on a parameter (LoraConfig(target_parameters=...)), which registers a "
                "parametrization on the wrapped parameter at every forward and removes it afterwards: the forward "
                "moves that parameter (which ghostdp refuses, as any change of a parameter inside a forward), and "
                "its adapters reach the model only through that weight, which no norm rule reads. On a mixture of "
                "experts peft sets such targets itself: with transformers 5 it turns target_modules='all-linear', "
                "or names of the experts' projections or of the router ('gate'), into target_parameters on the "
                "fused experts' and the router's weights. Fix: put the adapters on modules by name "
                "(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'], the attention's projections, which the "
                "Linear rule covers); a mixture of experts' experts can also train whole (their rule: "
                "ghostdp.norms.experts).")
        elif is_instance_of(m, PEFT_DORA_EMBEDDING) and any(p.requires_grad for p in m.parameters()):
            problems.append(
                f"module {label} is peft's DoRA magnitude of an embedding (LoraConfig(use_dora=True) on an "
                "nn.Embedding): it returns its scale, the magnitude over the table's weight norm, as one vector of "
                "shape (embedding_dim,) for the whole batch, which its layer then multiplies into every example's "
                "lookups, so the magnitude's gradient is the batch's sum and no norm rule can split it by example. "
                "Fix: DoRA on the Linear and convolution layers only (exact), and plain LoRA on the embeddings "
                "(leave them out of that LoraConfig's target_modules, or give them a LoraConfig of their own with "
                "use_dora=False).")
        elif is_instance_of(m, PEFT_ATTENTION_LORA) and any(p.requires_grad for p in m.parameters()):
            problems.append(
                f"module {label} is peft's LoRA on an nn.MultiheadAttention itself, which merges its adapter into "
                "the attention's packed in_proj_weight, in place, in every forward and unmerges it after: the forward "
                "moves a parameter (which ghostdp refuses), and the adapter reaches the model only through that "
                "weight, inside torch's attention function, which no norm rule reads. Fix: ghostdp.validate.fix(model) "
                "before get_peft_model (ghostdp.layers.MultiheadAttention has Linear projections) and target them: "
                "target_modules=['q_proj', 'k_proj', 'v_proj', 'out_proj'], which the Linear rule covers.")
    return problems


def dropped_losses(model: torch.nn.Module) -> list[str]:
    """One message per term that a module adds to its outputs' loss and that ghostdp's per-example losses leave out
    (they are computed from the outputs, not read from ``outputs.loss``)."""
    dropped = []
    for name, m in model.named_modules():
        if not is_instance_of(m, PEFT_ADALORA_MODEL):
            continue
        config = m.peft_config.get(m.trainable_adapter_name)
        if getattr(config, "orth_reg_weight", 0) > 0:
            dropped.append(
                f"module '{name or '<root>'}' is peft's AdaLoRA, which adds an orthogonal regulariser of its "
                f"adapters (orth_reg_weight={config.orth_reg_weight} times the mean of ||A A^T - I|| and "
                "||B^T B - I||) to outputs.loss when the model is given labels. ghostdp trains on per-example "
                "losses computed from the outputs (DPTrainer pops the labels and computes them from the logits), "
                "which leave that term out: the adapters train without it. It reads no example, but ghostdp cannot "
                "add a term outside the per-example losses yet. Set orth_reg_weight=0 in the AdaLoraConfig to train "
                "so knowingly, without this warning.")
    return dropped


def check(model: torch.nn.Module) -> None:
    """Raise ModelNotPrivatizable listing every problem, or return."""
    problems = find_problems(model)
    if problems:
        raise ModelNotPrivatizable("the model cannot be trained privately as it is:\n- " + "\n- ".join(problems))


def fallback_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """{module name: its trainable parameters} of the modules whose own parameters no norm rule covers, so that
    ghostdp forms their per-example gradients with the exact fallback: one batched backward of the module per
    chunk of examples, from output grads masked to each example, O(B^2) elements a step (at B=2 on a CPU a
    ConvNext step took 6x plain with its norms there). Fix: freeze them (requires_grad_(False)) or register a
    rule (ghostdp.register_norm_rule, ghostdp.norms.registry.register_forward_rule). Calls that a rule declines
    (RuleEntry.accepts: ViT's embeddings with mask tokens, ...) are not listed. A module whose own parameters its
    forward applies each by one elementwise op (BEiT's layer scales and class token, wav2vec2's masked_spec_embed) is
    listed too: whether a call does so shows only in its graph, and where it does, the call is captured op by op
    instead (norms/parameter_uses.py)."""
    found = {}
    for name, module in hooked_modules(model):
        trainable = [n for n, p in owned_parameters(module).items() if p.requires_grad]
        if trainable and attached_rule(module) is None:
            found[name or "<root>"] = trainable
    return found


def _group_count(channels: int, max_groups: int = 32) -> int:
    return max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)


def fix(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` trainable privately at ghost cost, in place; returns the model.

    - Every BatchNorm becomes a GroupNorm on the same device and dtype. BatchNorm2d/3d get the largest
      group count <= 32 that divides the channels; BatchNorm1d gets one group: its input is often (B, C),
      where a group per channel would normalise single values to zero.
    - Every torch.nn LSTM, GRU and RNN becomes its ``ghostdp.layers`` twin, with the same settings,
      weights, state_dict keys and outputs, whose weights the Linear norm rule covers (torch.nn's go
      to the per-example fallback, O(batch) in time and memory). An LSTM with ``proj_size`` and
      subclasses that override ``forward`` stay, with a warning.
    - Every torch.nn.MultiheadAttention becomes ``ghostdp.layers.MultiheadAttention``, with the same settings,
      weights, state_dict keys and outputs, whose projections the Linear norm rule covers (torch.nn's go to the
      per-example fallback: a VJP per example through the attention). Subclasses that override ``forward`` stay,
      with a warning.
    - Every transformers WavLMAttention becomes ``ghostdp.layers.wavlm.WavLMAttention``, which takes over its
      children and parameters and computes the same outputs with its projections called as Linear layers
      (transformers' hands their weights to ``F.multi_head_attention_forward``, which ghostdp refuses: gradient
      reaches them outside their modules); every Swinv2SelfAttention becomes ``ghostdp.layers.swinv2``'s, whose
      continuous position bias has a row per example (transformers' merges ghostdp's per-example copies, which
      ghostdp refuses); every DeBERTa-v2 DisentangledSelfAttention becomes ``ghostdp.layers.deberta``'s, which
      repeats its relative position projections only where ghostdp has not broadcast them (transformers' repeats
      ghostdp's per-example views again, and the forward fails); every MPNetEncoder becomes
      ``ghostdp.layers.mpnet``'s, which looks its relative attention bias up per example (transformers' looks it up
      once for the batch, which ghostdp refuses). One whose code is not the one ghostdp knows (a
      subclass with methods of its own, another transformers version) stays, with a warning (layers/twins.py).
    """
    if isinstance(model, torch.nn.modules.batchnorm._BatchNorm):
        raise ModelNotPrivatizable("the model itself is a BatchNorm; wrap it in a parent module to fix it")
    if isinstance(model, _TWINNED):
        raise ModelNotPrivatizable(f"the model itself is a torch.nn.{type(model).__name__}; use "
                                   f"ghostdp.layers.from_torch(model) or wrap it in a parent module to fix it")
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
                setattr(m, child_name, _group_norm_for(child))
            elif isinstance(child, _TWINNED) or twin_of(child) is not None:
                replacement = _twin_for(child, f"{name}.{child_name}" if name else child_name)
                if replacement is not None:
                    setattr(m, child_name, replacement)
    return model


def _group_norm_for(batch_norm) -> torch.nn.GroupNorm:
    ref = next(iter(batch_norm.buffers()), None) if batch_norm.weight is None else batch_norm.weight
    groups = 1 if isinstance(batch_norm, torch.nn.BatchNorm1d) else _group_count(batch_norm.num_features)
    gn = torch.nn.GroupNorm(groups, batch_norm.num_features, eps=batch_norm.eps, affine=batch_norm.affine)
    if ref is not None:
        gn = gn.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None)
    gn.train(batch_norm.training)
    return gn


def swappable_modules(model: torch.nn.Module) -> list:
    """The names of the torch.nn LSTM, GRU, RNN and MultiheadAttention modules and the transformers modules of
    layers/twins.py (WavLM's attention, Swin v2's self-attention, DeBERTa-v2's attention, MPNet's encoder) with
    trainable parameters that ``fix`` would swap for their ghostdp.layers twins (torch.nn's take the fallback, the
    transformers ones are refused). The model itself is not listed: ``fix`` swaps children
    (ghostdp.layers.from_torch converts one torch.nn module)."""
    return [name for name, m in model.named_modules()
            if name and (isinstance(m, _TWINNED) or twin_of(m) is not None)
            and _why_kept(m) is None and any(p.requires_grad for p in m.parameters())]


def _why_kept(module) -> str | None:
    """Why ``fix`` leaves a torch.nn recurrent layer or MultiheadAttention, or a transformers module of
    layers/twins.py, in place, or None: it swaps it."""
    twin = twin_of(module)
    if twin is not None:
        return None if twin.has_known_code(module) else f"its code is not the code {twin.__name__} computes again"
    if type(module).forward not in [cls.forward for cls in _TWINNED]:
        return "its class overrides forward"
    if getattr(module, "proj_size", 0):
        return "ghostdp.layers.LSTM has no proj_size"
    return None


def _twin_for(module, name):
    """The ghostdp.layers twin of a torch.nn recurrent layer or MultiheadAttention, or of a transformers module of
    layers/twins.py, or None (warned)."""
    reason, twin = _why_kept(module), twin_of(module)
    if reason is None:
        return layers.from_torch(module) if twin is None else twin.from_transformers(module)
    consequence = ("it trains through the exact per-example fallback, O(batch) in time and memory" if twin is None
                   else f"it {twin.WHY}: freeze its parameters or give it the code ghostdp knows")
    warnings.warn(f"ghostdp.validate.fix left '{name}' ({type(module).__name__}) in place because {reason}: "
                  f"{consequence}", stacklevel=3)
    return None
