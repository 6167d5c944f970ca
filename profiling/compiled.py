"""What torch.compile does to a private step: each mode eager and compiled, on the host-overhead stand-in.

    python -m profiling.compiled                               # plain, ghost, book-keeping; eager and inductor
    python -m profiling.compiled --modes plain bookkeeping --steps 60 --backends eager inductor

ghostdp hooks every trained layer; under torch.compile those hooks break the forward into many small graphs, each
with its own guards, so a compiled private step can be slower than an eager one (ghostdp warns once when a forward
runs compiled: clipping/recording.COMPILED_FORWARD). Each setting runs in a process of its own (compiled code of one
model's class would otherwise be reused by the next, whose hooks dynamo does not check), on profiling.overhead's
model (BERT L=12, H=64, B=2, T=8, one thread, CPU, embeddings frozen unless --embeddings trainable). Per setting:
the median step after the warm-up (compilation included there), and the graph breaks dynamo counted.
Measured 2026-11-26 (60 steps): plain 8.9 ms eager, 5.4 ms inductor; book-keeping 17.7 and 45.5 ms; ghost 23.2 and
52.5 ms (~100 graph breaks).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings

from profiling.bench import MODES


def run_one(mode: str, backend: str, steps: int, warmup: int, frozen: bool, model_args: list) -> dict:
    """One setting in this process: {"median_ms", "graph_breaks"}; ``backend`` "none" runs eagerly."""
    import statistics

    import torch

    from profiling import overhead
    from profiling.bench import build_model, make_step
    args = overhead.parse(model_args)
    args.freeze_embeddings = frozen
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, 2, (args.batch,))
    warnings.filterwarnings("ignore")  # dynamo's graph-break warnings and ghostdp's compile warning
    step = make_step(mode, build_model(args).train(), args, (ids, labels),
                     compile_backend=None if backend == "none" else backend)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    breaks = 0
    if backend != "none":
        from torch._dynamo.utils import counters
        breaks = sum(counters["graph_break"].values())
    return {"median_ms": 1e3 * statistics.median(times), "graph_breaks": breaks}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["plain", "ghost", "bookkeeping"], choices=MODES)
    p.add_argument("--backends", nargs="+", default=["inductor"], help="torch.compile backends, besides eager")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--embeddings", choices=["trainable", "frozen"], default="frozen")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--one", nargs=2, metavar=("MODE", "BACKEND"), help=argparse.SUPPRESS)  # a child process's run
    return p.parse_known_args(argv)


def main(argv=None):
    args, model_args = parse(argv)
    frozen = args.embeddings == "frozen"
    if args.one is not None:
        mode, backend = args.one
        print(json.dumps(run_one(mode, backend, args.steps, args.warmup, frozen, model_args)))
        return None
    results = []
    print(f"{'mode':<13}{'compiled':>10}{'median ms':>11}{'x eager':>9}{'graph breaks':>14}")
    for mode in args.modes:
        eager = None
        for backend in ["none", *args.backends]:
            command = [sys.executable, "-m", "profiling.compiled", "--one", mode, backend, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--embeddings", args.embeddings, *model_args]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            row = {"mode": mode, "backend": backend, **json.loads(done.stdout.strip().splitlines()[-1])}
            eager = row["median_ms"] if backend == "none" else eager
            results.append(row)
            print(f"{mode:<13}{'no' if backend == 'none' else backend:>10}{row['median_ms']:>11.2f}"
                  f"{row['median_ms'] / eager:>8.2f}x{row['graph_breaks']:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
