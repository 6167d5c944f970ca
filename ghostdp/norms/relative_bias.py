"""T5's relative attention bias, looked up for each example.

T5's attention adds to every example's attention scores a bias that one lookup of its ``relative_attention_bias``
table (an nn.Embedding) gives for the whole batch: (1, heads, q, k) from the (q, k) buckets of the relative
positions (``compute_bias``). The first attention of each stack looks it up and hands it to the later ones through
its second output. No call of the table holds an example's gradient then, so until 2026-11-28 the attention owned
the table and took the exact fallback (fallback.ABSORBED_CHILDREN): a batched VJP per chunk of examples through the
attention, about a plain step's time at B=32, T=32 (book-keeping 2.75x plain with the table trained, 1.73x a plain
step with it frozen).

Where an attention's ``forward`` and ``compute_bias`` have T5's code (T5, mT5, LongT5's full attention, Switch
Transformers, Pop2Piano, UDOP), a forward pre-hook (recording.py) passes the bias in as ``position_bias``, which
that forward uses as it is: looked up as ``compute_bias`` looks it up, but as a batch of one, (1, q, k) ids, whose
output the table's own hook broadcasts to the batch (a view: no copy per example). The table's call then has an
output grad per example, and the Embedding rule forms each example's gradient, over every layer's use of the bias
(the later layers add this same tensor); a table of fewer rows than q x k keeps its explicit (B, rows, heads)
gradients (EmbeddingGather._keeps_explicit). The values are compute_bias's, row by row.
"""
from __future__ import annotations

import functools

import torch

from .registry import body_text, forward_body, parsed_function

# T5Attention.compute_bias's body (registry.forward_body), which per_example_position_bias repeats as a batch of one
# (tests/norms/test_relative_bias.py checks that transformers' T5 has it).
T5_COMPUTE_BIAS_BODY = (
    "if device is None:\n    device = self.relative_attention_bias.weight.device ; context_position = "
    "torch.arange(query_length, dtype=torch.long, device=device)[:, None] + past_seen_tokens ; memory_position = "
    "torch.arange(key_length, dtype=torch.long, device=device)[None, :] ; relative_position = memory_position - "
    "context_position ; relative_position_bucket = self._relative_position_bucket(relative_position, "
    "bidirectional=not self.is_decoder, num_buckets=self.relative_attention_num_buckets, "
    "max_distance=self.relative_attention_max_distance) ; values = self.relative_attention_bias("
    "relative_position_bucket) ; values = values.permute([2, 0, 1]).unsqueeze(0) ; return values")


# T5Attention.forward(hidden_states, mask, key_value_states, position_bias, cache, ...): position_bias's place.
POSITION_BIAS_ARGUMENT = 3


def _code(fn) -> tuple | None:
    """What runs when ``fn`` is called: its body (registry.forward_body), or for a function wrapped by one decorator
    (T5's forward: transformers' deprecate_kwarg) the wrapper's code object, the decorator's arguments (the
    wrapper's closure but the wrapped function) and the wrapped function's body; None where one cannot be read."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None:
        body = forward_body(fn)
        return None if body is None else (body,)
    if getattr(fn, "__code__", None) is None or hasattr(wrapped, "__wrapped__"):
        return None
    function = parsed_function(wrapped)
    if function is None or len(function.decorator_list) != 1:
        return None
    arguments = tuple(repr(cell.cell_contents) for cell in fn.__closure__ or () if not callable(cell.cell_contents))
    return fn.__code__, arguments, body_text(function)


@functools.cache
def _t5_forward_code() -> tuple | None:
    """T5Attention.forward's code (_code), read from transformers once; None without transformers' T5."""
    try:
        from transformers.models.t5.modeling_t5 import T5Attention
    except ImportError:
        return None
    return _code(T5Attention.forward)


@functools.cache
def looks_up_per_example(cls) -> bool:
    """Whether an attention class has T5's forward and compute_bias, so that its bias can be looked up per example
    (the module doc)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "compute_bias")):
        return False
    forward = _t5_forward_code()
    return (forward is not None and forward_body(cls.compute_bias) == T5_COMPUTE_BIAS_BODY
            and _code(cls.forward) == forward)


def per_example_position_bias(module, args, kwargs) -> torch.Tensor | None:
    """The position bias that ``module``'s forward (a self-attention with T5's code, called with ``args`` and
    ``kwargs``) would compute, its table looked up as a batch of one: (B, heads, q, k) in a recorded forward, where
    the table's hook broadcasts its output to the batch, else (1, heads, q, k). None where the call is not a
    self-attention with its own bias (the forward then does as it does)."""
    names = ("hidden_states", "mask", "key_value_states", "position_bias", "cache")  # (POSITION_BIAS_ARGUMENT)
    arguments = dict(zip(names, args))
    arguments.update((k, v) for k, v in kwargs.items() if k in names)
    hidden = arguments.get("hidden_states")
    if (not module.has_relative_attention_bias or arguments.get("position_bias") is not None
            or arguments.get("key_value_states") is not None or not isinstance(hidden, torch.Tensor)):
        return None
    cache = arguments.get("cache", kwargs.get("past_key_values"))
    past = cache.get_seq_length(module.layer_idx) if cache is not None else 0  # as the forward reads it
    query_length = hidden.shape[1]
    context = torch.arange(query_length, dtype=torch.long, device=hidden.device)[:, None] + past
    memory = torch.arange(past + query_length, dtype=torch.long, device=hidden.device)[None, :]
    buckets = module._relative_position_bucket(memory - context, bidirectional=not module.is_decoder,
                                               num_buckets=module.relative_attention_num_buckets,
                                               max_distance=module.relative_attention_max_distance)
    # A batch of one lookup, whose output the table's forward hook broadcasts to the batch (recording.py: an output
    # of size 1 on dim 0 is shared by the batch), so that its gradient stays per example: (B, q, k, heads), a view.
    values = module.relative_attention_bias(buckets.unsqueeze(0))
    return values.permute([0, 3, 1, 2])
