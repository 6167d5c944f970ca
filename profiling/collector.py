"""What Python's cyclic garbage collector costs a private step, with ghostdp's pause on and off.

    python -m profiling.collector                          # book-keeping, frozen embeddings, 600 steps a run
    python -m profiling.collector --modes plain ghost bookkeeping --steps 400 --repeats 2

ghostdp pauses the collector in the DP loss's backward and the optimizer step (ghostdp/collector.py). The
collector runs when the count of tracked objects allocated since its last run passes a threshold, whoever
allocated them, so two steps interleaved in one process (profiling.overhead) share its collections: each
setting here runs in a process of its own (the overhead benchmark's model, one thread, CPU), the settings
alternating run by run. Per run: the mean and median step, the collector's time per step (gc.callbacks), and
its collections per step by generation. A collection of generation 2 walks every object of the process
(~376k with torch and transformers loaded, ~170 ms), once every few hundred private steps: it shows in the
means and in the collector's time, not in the medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time

from profiling.bench import MODES


class CollectorClock:
    """Seconds Python's cyclic garbage collector ran, and its collections by generation, during each mode's
    measured steps (``mode``: the mode whose step runs now, None between measured steps)."""

    def __init__(self, modes):
        self.seconds = {mode: 0.0 for mode in modes}
        self.collections = {mode: [0, 0, 0] for mode in modes}
        self.mode, self._start = None, None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self.mode is not None and self._start is not None:
            self.seconds[self.mode] += time.perf_counter() - self._start
            self.collections[self.mode][info["generation"]] += 1


@contextlib.contextmanager
def collector_time(modes):
    """A CollectorClock in gc.callbacks for the block (profiling.overhead's "GC ms", run_one's figures)."""
    import gc
    clock = CollectorClock(modes)
    gc.callbacks.append(clock)
    try:
        yield clock
    finally:
        gc.callbacks.remove(clock)


def run_one(mode: str, pause: bool, steps: int, frozen: bool, model_args: list) -> dict:
    """One setting in this process: {"mean_ms", "median_ms", "gc_ms", "collections"}."""
    import statistics

    import torch

    from ghostdp import collector
    from profiling import overhead
    from profiling.bench import make_step, model_and_batch
    args = overhead.parse(model_args)
    args.freeze_embeddings = frozen
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    collector.PAUSE = pause
    model, batch = model_and_batch(args)
    step = make_step(mode, model, args, batch)
    for _ in range(args.warmup):
        step()
    times = []
    with collector_time([mode]) as clock:
        clock.mode = mode
        for _ in range(steps):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
    return {"mean_ms": 1e3 * statistics.mean(times), "median_ms": 1e3 * statistics.median(times),
            "gc_ms": 1e3 * clock.seconds[mode] / steps, "collections": [c / steps for c in clock.collections[mode]]}


def in_own_process(module: str, argv: list) -> dict:
    """What ``python -m module *argv`` printed as its last line, JSON: one setting measured in a process of its own
    (here and profiling.compiled: the collector's counts, and dynamo's compiled code, are the whole process's)."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["bookkeeping"], choices=MODES)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeats", type=int, default=1, help="runs of each setting, alternating")
    p.add_argument("--embeddings", choices=["trainable", "frozen"], default="frozen")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--one", nargs=2, metavar=("MODE", "PAUSE"), help=argparse.SUPPRESS)  # a child process's run
    return p.parse_known_args(argv)


def main(argv=None):
    args, model_args = parse(argv)
    frozen = args.embeddings == "frozen"
    if args.one is not None:
        mode, pause = args.one
        print(json.dumps(run_one(mode, pause == "on", args.steps, frozen, model_args)))
        return None
    results = []
    print(f"{'mode':<13}{'pause':>6}{'mean ms':>9}{'median ms':>11}{'GC ms':>8}   collections per step (gen 0, 1, 2)")
    for _ in range(args.repeats):
        for mode in args.modes:
            for pause in (["off"] if mode == "plain" else ["off", "on"]):
                row = {"mode": mode, "pause": pause, **in_own_process(
                    "profiling.collector", ["--one", mode, pause, "--steps", str(args.steps), "--embeddings",
                                            args.embeddings, *model_args])}
                results.append(row)
                counts = ", ".join(f"{c:.4f}" for c in row["collections"])
                print(f"{mode:<13}{pause:>6}{row['mean_ms']:>9.2f}{row['median_ms']:>11.2f}{row['gc_ms']:>8.3f}   {counts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
