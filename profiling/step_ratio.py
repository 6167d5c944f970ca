"""Step-time ratios to plain training, measured in one process with the modes' steps interleaved.

    python -m profiling.step_ratio                       # BERT L=2 H=256, B=16, T=128, CPU
    python -m profiling.step_ratio --modes plain bookkeeping --rounds 30

Each mode gets its own copy of the model (same weights) and its own optimizer; one round runs one
full step of every mode in turn (forward, backward, noise, optimizer step). A machine whose speed
drifts (a shared VM: +-15% between runs) slows all modes of a round alike, so the median over rounds
of each round's time ratio is far steadier than a ratio of medians taken in separate processes.
Memory is not measured here (the models share one process): use profiling.bench for that.
"""
from __future__ import annotations

import argparse
import copy
import time

from profiling.bench import MODES, WEIGHT_DTYPES, add_model_arguments, available, build_model, make_step, weight_dtype


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def interleaved_times(args) -> dict:
    """{mode: [seconds of its step in each measured round]}."""
    import torch
    torch.manual_seed(0)
    device = torch.device(args.device)
    template = build_model(args).to(device=device, dtype=weight_dtype(args)).train()
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), device=device)
    labels = torch.randint(0, 2, (args.batch,), device=device)
    steps = {mode: make_step(mode, copy.deepcopy(template), args, (ids, labels)) for mode in args.modes}
    times = {mode: [] for mode in args.modes}
    for round_ in range(args.warmup + args.rounds):
        for mode, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_ >= args.warmup:
                times[mode].append(time.perf_counter() - start)
    return times


def report(times) -> dict:
    """{mode: (median ms, median of the per-round ratios to plain)}, printed as a table."""
    plain = times["plain"]
    rows = {}
    print(f"{'mode':<14}{'median ms':>10}{'ratio':>8}   (ratio: median over rounds of step / plain step)")
    for mode, ts in times.items():
        ratio = median([t / p for t, p in zip(ts, plain)])
        rows[mode] = (1e3 * median(ts), ratio)
        print(f"{mode:<14}{rows[mode][0]:>10.1f}{ratio:>7.2f}x")
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
