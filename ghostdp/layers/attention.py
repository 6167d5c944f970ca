"""MultiheadAttention with torch.nn's constructor, state_dict keys and outputs, whose projections are nn.Linear
children that the Linear norm rule covers.

torch.nn.MultiheadAttention applies its projections with F.linear to its own packed ``in_proj_weight``, inside one
functional call, so no norm rule sees them and ghostdp forms their per-example gradients with the exact fallback:
a VJP per example through the whole attention. Here the query, key, value and output projections are Linear
calls on batch-first (B, tokens, features) tensors, and what lies between them (scaled dot-product attention) has
no parameter, so each projection's per-example norm and clipped sum are the Linear rule's (Gram or instantiation,
summed over tokens), at the cost of the layer's own matmuls.

- Same seed, same weights as torch.nn's: the output projection is built (and its default initialisation drawn)
  where torch builds it, and the packed (3E, E) input projection is drawn in one ``xavier_uniform_``, as torch
  draws it, then split into the three Linear weights.
- state_dict keys are torch's (``in_proj_weight``, ``in_proj_bias``, or ``q_proj_weight``, ... where kdim or vdim
  differ from embed_dim; ``out_proj.*``, ``bias_k``, ``bias_v``), so checkpoints load either way.
- ``in_proj_weight`` / ``in_proj_bias`` are properties, the concatenation of the projections' current values, for
  code that reads them (torch's TransformerEncoderLayer reads them on its inference fast path). They are copies,
  made as inference tensors so that writing into them (``nn.init.xavier_uniform_(m.in_proj_weight)`` after
  ``fix``) or differentiating through them raises instead of silently changing nothing: initialise and train the
  projections themselves. ``q_proj_weight``, ``k_proj_weight`` and ``v_proj_weight`` (kdim or vdim ≠ embed_dim) are
  the projections' own weights, detached.
- ``add_bias_kv``: ``bias_k`` and ``bias_v`` stay parameters of this module, used outside any Linear call, so the
  exact fallback forms their per-example gradients (a VJP per example from this module's outputs); the projections
  keep their rule.
- ``from_torch`` carries an output projection that is not a plain Linear (peft's LoRA on ``out_proj``) over as it
  is, and calls it: torch's attention reads only ``out_proj.weight`` and ``bias``, so such an adapter never ran
  there (ghostdp's optimizer warns of its parameters, trained by noise alone: unreached.py). Its state_dict keys
  are the wrapper's own (``out_proj.base_layer.weight``, ...), as they were.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention (same arguments, state_dict keys, outputs and attention weights) whose projections
    are Linear layers (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``) that ghostdp's Linear norm rule covers."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None):
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MultiheadAttention: {name} must be a positive integer, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads})")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1) or isinstance(dropout, bool):
            raise ValueError(f"MultiheadAttention: dropout must be a number in [0, 1], got {dropout!r}")
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first, self.add_zero_attn = float(dropout), batch_first, add_zero_attn
        factory = dict(device=torch.get_default_device() if device is None else device, dtype=dtype)
        # skip_init: no random draws here, so that the output projection's are torch's (module doc)
        self.q_proj = nn.utils.skip_init(nn.Linear, embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.utils.skip_init(nn.Linear, self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.utils.skip_init(nn.Linear, self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.register_state_dict_post_hook(_save_with_torch_names)
        self.register_load_state_dict_pre_hook(_load_torch_names)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's initialisation, in its order of random draws."""
        projections = [getattr(self, name).weight for name in _PROJECTIONS]
        with torch.no_grad():
            if self._qkv_same_embed_dim:  # one draw over the packed (3E, E) matrix: its fans are torch's
                packed = torch.empty((3 * self.embed_dim, self.embed_dim), device=projections[0].device,
                                     dtype=projections[0].dtype)
                nn.init.xavier_uniform_(packed)
                for weight, part in zip(projections, packed.chunk(3)):
                    weight.copy_(part)
            else:
                for weight in projections:
                    nn.init.xavier_uniform_(weight)
            for linear in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                if linear.bias is not None:
                    linear.bias.zero_()
            if self.bias_k is not None:
                nn.init.xavier_normal_(self.bias_k)
                nn.init.xavier_normal_(self.bias_v)

    # torch.nn.MultiheadAttention's parameters, as values to read (the module doc)
    @property
    def in_proj_weight(self):
        if not self._qkv_same_embed_dim:
            return None
        with torch.inference_mode():  # a copy that refuses writes and autograd (the module doc)
            return torch.cat([getattr(self, name).weight for name in _PROJECTIONS])

    @property
    def in_proj_bias(self):
        if self.q_proj.bias is None:
            return None
        with torch.inference_mode():
            return torch.cat([getattr(self, name).bias for name in _PROJECTIONS])

    @property
    def q_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.q_proj.weight.detach()

    @property
    def k_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.k_proj.weight.detach()

    @property
    def v_proj_weight(self):
        return None if self._qkv_same_embed_dim else self.v_proj.weight.detach()

    def _torch_names(self) -> list:
        """(torch.nn's state_dict key, [our keys whose values it concatenates]) in torch.nn's order."""
        names = ([("in_proj_weight", [f"{p}.weight" for p in _PROJECTIONS])] if self._qkv_same_embed_dim
                 else [(f"{p}_weight", [f"{p}.weight"]) for p in _PROJECTIONS])
        if self.q_proj.bias is not None:
            names.append(("in_proj_bias", [f"{p}.bias" for p in _PROJECTIONS]))
        if self.bias_k is not None:
            names += [("bias_k", ["bias_k"]), ("bias_v", ["bias_v"])]
        names.append(("out_proj.weight", ["out_proj.weight"]))
        if self.out_proj.bias is not None:
            names.append(("out_proj.bias", ["out_proj.bias"]))
        return names

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """torch.nn.MultiheadAttention.forward: (attention output, attention weights or None)."""
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"MultiheadAttention: query, key and value must all be batched (3 dims) or all "
                             f"unbatched (2 dims), got {query.dim()}, {key.dim()} and {value.dim()} dims")
        batched = query.dim() == 3
        if not batched:  # one sequence: a batch of one
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (tokens, B, E): the projections run batch-first, on views
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise ValueError(f"MultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} must have "
                             f"the query's batch size and the same number of tokens")
        key_padding_mask = _additive(key_padding_mask, "key_padding_mask", query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("MultiheadAttention: is_causal is a hint that attn_mask is the causal mask, so it needs "
                               "attn_mask: pass nn.Transformer.generate_square_subsequent_mask(L) with it")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # SDPA's own causal mask (as torch.nn's)
        else:
            attn_mask, is_causal = _additive(attn_mask, "attn_mask", query.dtype), False
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(query).view(B, L, H, D).transpose(1, 2)
        k, v = self.k_proj(key), self.v_proj(value)
        if attn_mask is not None:
            attn_mask = self._attention_mask_4d(attn_mask, B, L, S)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(f"MultiheadAttention: key_padding_mask must be (batch, source tokens) = {(B, S)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask.view(B, 1, 1, S)
        if self.bias_k is not None:  # one more key and value, shared by the batch
            k = torch.cat([k, self.bias_k.expand(B, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, self.embed_dim)], dim=1)
            attn_mask, key_padding_mask = _one_more_key(attn_mask), _one_more_key(key_padding_mask)
        k = k.view(B, k.shape[1], H, D).transpose(1, 2)
        v = v.view(B, v.shape[1], H, D).transpose(1, 2)
        if self.add_zero_attn:  # one more key and value of zeros
            k = torch.cat([k, k.new_zeros(B, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(B, H, 1, D)], dim=2)
            attn_mask, key_padding_mask = _one_more_key(attn_mask), _one_more_key(key_padding_mask)
        mask = (key_padding_mask if attn_mask is None else attn_mask if key_padding_mask is None
                else attn_mask + key_padding_mask)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:  # softmax(Q K^T / sqrt(D) + mask), as torch.nn's (which returns them after dropout)
            scores = torch.matmul(q * math.sqrt(1.0 / D), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _attention_mask_4d(self, attn_mask, B, L, S):
        """attn_mask (L, S) or (B * num_heads, L, S), as (1, 1, L, S) or (B, num_heads, L, S)."""
        if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (L, S):
            return attn_mask.view(1, 1, L, S)
        if attn_mask.dim() == 3 and tuple(attn_mask.shape) == (B * self.num_heads, L, S):
            return attn_mask.view(B, self.num_heads, L, S)
        raise ValueError(f"MultiheadAttention: attn_mask must be (target tokens, source tokens) = {(L, S)} or "
                         f"(batch * num_heads, target, source) = {(B * self.num_heads, L, S)}, got "
                         f"{tuple(attn_mask.shape)}")

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """torch.nn.MultiheadAttention.merge_masks (its inference fast path's mask and mask type)."""
        mask_type, merged = None, None
        if key_padding_mask is not None:
            mask_type, merged = 1, key_padding_mask
        if attn_mask is not None:
            batch_size, seq_len, _ = query.shape
            mask_type = 2
            if attn_mask.dim() == 3:
                merged = attn_mask.view(batch_size, -1, seq_len, seq_len)
            else:
                merged = attn_mask.view(1, 1, seq_len, seq_len).expand(batch_size, self.num_heads, -1, -1)
            if key_padding_mask is not None:
                merged = merged + key_padding_mask.view(batch_size, 1, 1, seq_len).expand(-1, self.num_heads, -1, -1)
        return merged, mask_type

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}")


def _additive(mask, name, dtype):
    """A boolean mask (True: not attended) as 0 / -inf in ``dtype``; a float mask as given (added to the scores)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"MultiheadAttention: {name} must be a bool or float tensor, got {mask.dtype}")
    return mask


def _one_more_key(mask):
    """A mask with one more (attended) source position at its end."""
    return None if mask is None else F.pad(mask, (0, 1))


def _save_with_torch_names(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: our keys (q_proj.weight, ...) become torch.nn's (in_proj_weight, ...), in its order."""
    values = []
    for torch_name, ours in module._torch_names():
        if all(prefix + key in state_dict for key in ours):
            parts = [state_dict.pop(prefix + key) for key in ours]
            values.append((prefix + torch_name, parts[0] if len(parts) == 1 else torch.cat(parts)))
    state_dict.update(values)


def _load_torch_names(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: torch.nn's keys (in_proj_weight, ...) load into our parameters."""
    for torch_name, ours in module._torch_names():
        if prefix + torch_name in state_dict and torch_name not in ours:
            value = state_dict.pop(prefix + torch_name)
            parts = [value] if len(ours) == 1 else value.chunk(len(ours))
            state_dict.update((prefix + key, part) for key, part in zip(ours, parts))


def from_torch(module: nn.MultiheadAttention) -> MultiheadAttention:
    """The ghostdp module equal to a torch.nn.MultiheadAttention: same settings, weights, frozen parameters, device,
    dtype and mode."""
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes a torch.nn.MultiheadAttention, got {type(module).__name__}")
    weight = module.out_proj.weight
    new = MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                             bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                             add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                             batch_first=module.batch_first, device=weight.device, dtype=weight.dtype)
    if type(module.out_proj) not in (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear):
        new.out_proj = module.out_proj  # a wrapper (peft's LoRA): called here, where torch never called it
    new.load_state_dict(module.state_dict())
    frozen = {torch_name for torch_name, p in module.named_parameters() if not p.requires_grad}
    for torch_name, ours in new._torch_names():
        if torch_name in frozen:
            for key in ours:
                new.get_parameter(key).requires_grad_(False)
    new.train(module.training)
    return new
