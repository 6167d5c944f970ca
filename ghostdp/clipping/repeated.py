"""Outputs shared by the batch that the model repeats to the batch itself: peft's prompt tuning and p-tuning.

An output of batch size 1 (BERT's position embeddings) is broadcast to the batch inside its call's hook
(recording.py), so that its output grad stays per example. peft's prompt tuning cannot take that: its
``PeftModel.get_prompt`` looks the virtual tokens up once, (1, n) ids into ``PromptEmbedding.embedding``, and
``repeat``s the (1, n, d) prompt to the batch itself before concatenating it with the inputs' embeddings, so a
broadcast output would be repeated B times over (the forward failed, until 2026-12-03, with a note naming the
module to freeze). The repeat's own backward sums its rows, so G at the lookup's output is the batch's sum.

Such a call is recorded without broadcast or probe, and captured (capture.py) at the repeat: its node's output
grad is the repeated prompt's, (B, n, d), one row per example (the layout proof checks that dim 0 holds the
examples, as for any broadcast output), and the Embedding rule reads it with the ids broadcast to (B, n). p-tuning's
encoder (an embedding, then an MLP or an LSTM and an MLP) is one such call of its own, its children absorbed, under
its rule (norms/peft_prompt.py). The
repeat is found once the root's forward has run, by a walk of its outputs' graph, and the lookup's output must
reach the outputs through that one repeat alone: any other use of it inside the forward would bring gradient that
no example's norm counts, and is refused with what to do instead. A use after the forward (the prompt kept and read
by the loss) lies past the root's outputs: the step's graph audit finds it, as it finds paths past a call without a
rule's outputs (audit.py, fallback_paths.uncounted_parameters), and refuses it.
"""
from __future__ import annotations

import torch

from ..norms.registry import is_instance_of
from .capture import hold_at
from .leaves import ATTRIBUTE_DEPTH, output_tensors

PROMPT_EMBEDDING = "peft.tuners.prompt_tuning.model.PromptEmbedding"
PROMPT_ENCODER = "peft.tuners.p_tuning.model.PromptEncoder"  # p-tuning's (norms/peft_prompt.py)


def repeated_by_caller(root: torch.nn.Module) -> frozenset:
    """The ids of the modules below ``root`` whose output of batch size 1 the model repeats to the batch itself:
    the lookup table of each of peft's prompt-tuning encoders, and each of its p-tuning encoders."""
    repeated = set()
    for m in root.modules():
        if is_instance_of(m, PROMPT_EMBEDDING) and type(getattr(m, "embedding", None)) is torch.nn.Embedding:
            repeated.add(id(m.embedding))
        elif is_instance_of(m, PROMPT_ENCODER):
            repeated.add(id(m))
    return frozenset(repeated)


def repeated_by_its_caller(call) -> bool:
    """Whether ``call`` is of a module whose shared output the model repeats to the batch (repeated_by_caller): the
    layout proof and the graph audit refuse its faults in words of their own."""
    return id(call.module) in call.recorder.repeated_by_caller


def capture_at_repeats(awaiting, returned, batch_size: int, captured_types: set) -> None:
    """Captures each awaiting call, (call, its output of batch size 1, the inputs its rule reads), at the one repeat
    to ``batch_size`` rows through which its output reaches what the root forward ``returned``; refuses any other use
    of that output (the module doc), and an output in which no tensor is found (the repeat is looked for below its
    tensors: leaves.output_tensors)."""
    outputs = output_tensors(returned)
    if not outputs:
        call = awaiting[0][0]
        raise RuntimeError(
            f"ghostdp: the model's forward returned {type(returned).__name__!r}, in which ghostdp found no tensor that "
            f"requires grad; it looks for peft's repeat of the prompt of module '{call.name}' "
            f"({type(call.module).__name__}, prompt tuning or p-tuning) in the graph below the forward's outputs. "
            "Fix: return the outputs as tensors, or as a tuple, list, dict, dataclass or transformers ModelOutput of "
            f"them (an object's attributes are looked into {ATTRIBUTE_DEPTH} levels deep, not its __slots__).")
    uses = {(output.grad_fn, output.output_nr): [] for _, output, _ in awaiting}
    stack, seen = [t.grad_fn for t in outputs if t.grad_fn is not None], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for edge in node.next_functions:
            if edge in uses:
                uses[edge].append(node)
            if edge[0] is not None:
                stack.append(edge[0])
    for call, output, inputs in awaiting:
        users = uses[(output.grad_fn, output.output_nr)]
        repeat = users[0] if len(users) == 1 else None
        if repeat is None or not _repeats_to_the_batch(repeat, output, batch_size):
            raise RuntimeError(
                f"ghostdp: the output of module '{call.name}' ({type(call.module).__name__}, the prompt of peft's "
                f"prompt tuning or p-tuning), of shape {tuple(output.shape)} and shared by the batch, reached the "
                f"model's output {_how(users)}, not through one repeat to the batch of {batch_size} examples: ghostdp "
                "splits its gradient by example only at such a repeat (peft's get_prompt: prompts.repeat(batch_size, "
                "1, 1)), and any other use of the shared prompt would bring gradient that no example's norm counts. "
                "Fix: use the prompt only through the model's forward, or train another adapter (LoRA).")
        hold_at(call, repeat, 0, inputs)
        call.named, call.by_hook = True, False  # pass 1 names the repeat's edge: G is the (B, n, d) prompt's
        captured_types.add(type(repeat))


def _repeats_to_the_batch(node, output, batch_size: int) -> bool:
    """Whether ``node`` is a repeat of ``output`` (batch size 1) to ``batch_size`` rows, every other dim once."""
    repeats = getattr(node, "_saved_repeats", None)
    return (type(node).__name__ == "RepeatBackward0" and repeats is not None and len(repeats) == output.dim()
            and repeats[0] == batch_size and all(r == 1 for r in repeats[1:]))


def _how(users) -> str:
    if not users:
        return "by no path the hooks could follow"
    return ("through " + ", ".join(sorted({type(u).__name__ for u in users}))
            + f" ({len(users)} {'use' if len(users) == 1 else 'uses'})")
