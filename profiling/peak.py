"""What a step's memory peak holds, on CPU: the tensors alive at the peak, by the op and Python frames that made them.

    python -m profiling.peak --layers 4 --batch 8 --mode bookkeeping        # a step between ghostdp's proofs
    python -m profiling.peak --layers 4 --batch 8 --mode ghost --proof      # a step the schedule proves again
    python -m profiling.peak --layers 12 --hidden 768 --heads 12 --train last-layer --mode plain

profiling.bench gives a step's peak (exact tensor bytes from torch.profiler's memory timeline); this says what
makes it up. From the same profile it replays every tensor's allocation and release, finds the moment the
step's own tensors peak (above those alive when it starts, as bench reads it), and lists the tensors alive then,
grouped by the op that allocated each (an op of the model's forward, or an autograd node; "[memory]" for a
buffer allocated outside any op, such as a gradient the backward engine forms) and the innermost Python frames
outside torch above it. The op running at the peak is printed too. Tensors that the step frees but that were
allocated before it (the last step's p.grad, freed by zero_grad) are left out, so the sum can exceed bench's
figure by their size. It found book-keeping's embedding table written beside every kept factor (2026-11-26:
1.95x plain at BERT L=4, B=8) and placed ghost's pass-1 peak of the Fast Gradient Clipping set-up at the
GELU's backward.

It reads torch.profiler's private memory profile (``profile._memory_profile()``), as
``export_memory_timeline`` does; tests/test_profiling.py runs it on a small model.
"""
from __future__ import annotations

import argparse
import collections

from profiling.bench import (GHOSTDP_MODES, add_model_arguments, make_step, model_and_batch, to_a_proof_step,
                             to_a_step_between_proofs)


def _innermost(roots, t: int):
    """The deepest profiled event whose time range holds ``t`` (ns), or None."""
    best, level = None, list(roots)
    while level:
        inside = [e for e in level if e.start_time_ns <= t <= e.end_time_ns]
        if not inside:
            break
        best = inside[-1]
        level = best.children
    return best


def _frames(event, depth: int) -> list:
    """The names of up to ``depth`` Python frames above ``event`` that lie outside torch's own files."""
    frames = []
    while event is not None and len(frames) < depth:
        name = event.name
        path = name.split("(", 1)[0]
        if ".py(" in name and not (path.startswith("torch/") or "/torch/" in path):
            frames.append(name.rsplit("/", 1)[-1])
        event = event.parent
    return frames


def peak_holdings(step, depth: int = 3) -> dict:
    """One call of ``step`` under torch.profiler: {"peak_mb": the peak of the tensors it allocates, above its
    start; "at": the op running then, with its frames; "holders": [(MB, label)] of the tensors alive at the peak,
    grouped by label (the allocating op and ``depth`` frames), largest first}."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    memory = prof._memory_profile()
    roots = prof.profiler.kineto_results.experimental_event_tree()
    made_by = {}  # tensor key -> the op whose outputs hold it
    for node in memory._data_flow_graph.flow_nodes:
        for key in node.outputs:
            made_by.setdefault(key, node._event)
    alive, born, size_now, peak, at_peak, peak_time = {}, {}, 0, 0, {}, None
    for t, action, key_version, size in memory.timeline:
        key = key_version[0] if isinstance(key_version, tuple) else key_version
        if action == Action.CREATE:
            alive[key], born[key] = size, t
            size_now += size
        elif action == Action.DESTROY:
            size_now -= alive.pop(key, 0)  # 0: allocated before the step (PREEXISTING)
        if size_now > peak:
            peak, at_peak, peak_time = size_now, dict(alive), t
    holders = collections.Counter()
    for key, size in at_peak.items():
        event = made_by.get(key) or _innermost(roots, born[key])
        name = event.name if event is not None else "?"
        holders[" <- ".join([name] + _frames(event, depth))] += size
    running = _innermost(roots, peak_time) if peak_time is not None else None
    at = " <- ".join([running.name] + _frames(running, depth)) if running is not None else "?"
    return {"peak_mb": peak / 2 ** 20, "at": at,
            "holders": [(size / 2 ** 20, label) for label, size in holders.most_common()]}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--mode", default="bookkeeping", choices=("plain",) + GHOSTDP_MODES)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--proof", action="store_true",
                   help="read a step that ghostdp's schedule proves again (a layout proof and the forward check), "
                        "not one between")
    p.add_argument("--top", type=int, default=15, help="the largest groups to print")
    p.add_argument("--frames", type=int, default=3, help="Python frames per group")
    return p.parse_args(argv)


def main(argv=None):
    import torch
    args = parse(argv)
    if args.device != "cpu":
        raise SystemExit("profiling.peak reads CPU tensors (torch.profiler's memory profile); on a GPU use "
                         "torch.cuda.memory._record_memory_history")
    torch.manual_seed(0)
    model, batch = model_and_batch(args)
    step = make_step(args.mode, model, args, batch)
    step()
    step()
    proving = args.proof and to_a_proof_step(step)
    if not proving:
        to_a_step_between_proofs(step)
    held = peak_holdings(step, args.frames)
    kind = "a proof step" if proving else "a step between proofs"
    print(f"{args.mode}, {kind}: peak {held['peak_mb']:.1f} MB above the step's start, while running {held['at']}")
    for size, label in held["holders"][:args.top]:
        print(f"{size:9.2f} MB  {label}")


if __name__ == "__main__":
    main()
