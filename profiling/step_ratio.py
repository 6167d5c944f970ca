"""Step-time ratios to plain training, measured in one process with the modes' steps interleaved.

    python -m profiling.step_ratio                       # BERT L=2 H=256, B=16, T=128, CPU
    python -m profiling.step_ratio --modes plain bookkeeping --rounds 30
    python -m profiling.step_ratio --against 7664c8d    # this checkout's ghostdp against that commit's

Each mode gets its own copy of the model (same weights) and its own optimizer; one round runs one
full step of every mode in turn (forward, backward, noise, optimizer step). A machine whose speed
drifts (a shared VM: +-15% between runs) slows all modes of a round alike, so the median over rounds
of each round's time ratio is far steadier than a ratio of medians taken in separate processes.
Memory is not measured here (the models share one process): use profiling.bench for that.

``--against REF`` also runs each ghostdp mode with the ghostdp package of git revision REF (rows
"ghost@REF"), extracted from this checkout's repository and imported under another name, in the same
rounds: a change is then measured against its parent in one process, where separate runs of this
machine's stand-in moved by +-0.1x between processes.
"""
from __future__ import annotations

import argparse
import copy

from profiling.bench import (GHOSTDP_MODES, MODES, WEIGHT_DTYPES, add_model_arguments, available, make_step,
                             model_and_batch, timed)
from profiling.revision import ghostdp_at


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def round_order(steps: dict, round_: int) -> list:
    """The (mode, step) pairs of one round: in order on even rounds, reversed on odd ones. A step runs
    faster or slower for its place in the round (caches, the allocator, the CPU's clock): with a fixed
    order, one build of ghostdp measured against itself read 1.78x and 1.74x plain."""
    items = list(steps.items())
    return items if round_ % 2 == 0 else items[::-1]


def interleaved_times(args) -> dict:
    """{mode: [seconds of its step in each measured round]}; with ``args.against``, also "mode@REF" for each
    ghostdp mode, trained with that revision's ghostdp."""
    import torch
    against = getattr(args, "against", None)
    library = ghostdp_at(against) if against is not None else None
    torch.manual_seed(0)
    device = torch.device(args.device)
    template, batch = model_and_batch(args)
    steps = {mode: make_step(mode, copy.deepcopy(template), args, batch) for mode in args.modes}
    if library is not None:
        for mode in [m for m in args.modes if m in GHOSTDP_MODES]:
            steps[f"{mode}@{against}"] = make_step(mode, copy.deepcopy(template), args, batch, library)
    return run_rounds(steps, args.rounds, args.warmup, device)


def run_rounds(steps: dict, rounds: int, warmup: int, device) -> dict:
    """{name: [seconds of its step in each measured round]}: every step once a round (round_order), ``warmup``
    rounds first that are not kept."""
    times = {name: [] for name in steps}
    for round_ in range(warmup + rounds):
        for name, step in round_order(steps, round_):
            seconds = timed(step, device)
            if round_ >= warmup:
                times[name].append(seconds)
    return times


def ratios(times) -> dict:
    """{mode: (median ms, median of the per-round ratios to the "plain" step)}."""
    plain = times["plain"]
    return {mode: (1e3 * median(ts), median([t / p for t, p in zip(ts, plain)])) for mode, ts in times.items()}


def report(times) -> dict:
    """``ratios(times)``, printed as a table."""
    rows = ratios(times)
    width = max(14, *(len(mode) + 2 for mode in times))
    print(f"{'mode':<{width}}{'median ms':>10}{'ratio':>8}   (ratio: median over rounds of step / plain step)")
    for mode, (ms, ratio) in rows.items():
        print(f"{mode:<{width}}{ms:>10.1f}{ratio:>7.2f}x")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["plain", "ghost", "bookkeeping"], choices=MODES,
                   help="opacus-ghost and opacus-hooks need opacus and, on BERT, --freeze-embeddings")
    p.add_argument("--dtype", default="fp32", choices=list(WEIGHT_DTYPES))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--against", metavar="REF", help="also run the ghostdp modes with git revision REF's ghostdp")
    args = p.parse_args(argv)
    missing = [m for m in args.modes if not available(m)]
    if missing:
        raise SystemExit(f"{missing}: opacus is not installed (pip install 'ghostdp[compare]')")
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")
    print(f"{args.model} L={args.layers} H={args.hidden} T={args.seq} B={args.batch} {args.dtype} on {args.device}"
          f"{', embeddings frozen' if args.freeze_embeddings else ''}; {args.rounds} interleaved rounds")
    return report(interleaved_times(args))


if __name__ == "__main__":
    main()
