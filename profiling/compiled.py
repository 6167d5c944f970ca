"""What torch.compile does to a private step: each mode eager and compiled.

    python -m profiling.compiled                               # the overhead stand-in, CPU; eager and inductor
    python -m profiling.compiled --modes plain bookkeeping --steps 60 --backends eager inductor
    python -m profiling.compiled --device cuda --hidden 768 --heads 12 --seq 128 --batch 32 --dtype bf16 \
        --threads 0 --steps 30                                 # BERT-base on a GPU (not yet run)

ghostdp hooks every trained layer; under torch.compile those hooks break the forward into many small graphs, each
with its own guards, so a compiled private step can be slower than an eager one (ghostdp warns once when a forward
runs compiled: clipping/recording.COMPILED_FORWARD). Each setting runs in a process of its own (compiled code of one
model's class would otherwise be reused by the next, whose hooks dynamo does not check). The model: by default
profiling.overhead's (BERT L=12, H=64, B=2, T=8, one thread, CPU; embeddings frozen unless --embeddings trainable),
or bench's model options. Per setting: the median step after the warm-up (compilation included there), and the
graph breaks dynamo counted. Measured 2026-11-26 on the stand-in (60 steps): plain 10.6 ms eager, 6.7 ms inductor;
ghost 25.9 and 63.3 ms; book-keeping 23.1 and 57.5 ms (88 and 101 graph breaks).
"""
from __future__ import annotations

import argparse
import json
import warnings

from profiling.bench import MODES, timed
from profiling.collector import in_own_process


def model_arguments(model_args: list) -> argparse.Namespace:
    """bench's model options, with profiling.overhead's stand-in as the defaults."""
    from profiling.bench import WEIGHT_DTYPES, add_model_arguments
    p = argparse.ArgumentParser(prog="profiling.compiled")
    add_model_arguments(p)
    p.set_defaults(layers=12, hidden=64, heads=4, seq=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    p.add_argument("--dtype", default="fp32", choices=list(WEIGHT_DTYPES))
    return p.parse_args(model_args)


def run_one(mode: str, backend: str, steps: int, warmup: int, frozen: bool, model_args: list) -> dict:
    """One setting in this process: {"median_ms", "graph_breaks"}; ``backend`` "none" runs eagerly."""
    import statistics

    import torch

    from profiling.bench import make_step, model_and_batch
    args = model_arguments(model_args)
    args.freeze_embeddings = frozen
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")  # dynamo's graph-break warnings and ghostdp's compile warning
    model, batch = model_and_batch(args)
    step = make_step(mode, model, args, batch, compile_backend=None if backend == "none" else backend)
    for _ in range(warmup):
        step()
    times = [timed(step, device) for _ in range(steps)]
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
            row = {"mode": mode, "backend": backend, **in_own_process(
                "profiling.compiled", ["--one", mode, backend, "--steps", str(args.steps), "--warmup", str(args.warmup),
                                       "--embeddings", args.embeddings, *model_args])}
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
