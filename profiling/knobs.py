"""ghostdp's internal budgets at other settings, against the shipped ones, in the same interleaved rounds: what a
change to one of them would buy, measured where it matters (a GPU) before it is made.

    python -m profiling.knobs --device cuda --dtype bf16 --batch 32 --knobs deferred=2,4 queue=4
    python -m profiling.knobs --tiny                     # every knob scaled down on CPU (a test)

Knobs, each scaled by the factors given (one variant per knob and factor, the others as shipped):
- ``deferred``: the Grams DeferredGrams holds before it takes their products (norms/deferred.py: half a stack
  budget). Larger: fewer flushes of ~12 kernels each (~30 a step at BERT-base, B=32, on a GPU), more Grams held.
- ``stack``: the most elements one batched reduction stacks (norms/batched.py: STACK_ELEMENTS on CPU,
  ACCELERATOR_STACK_ELEMENTS elsewhere). Larger: layers reduced together instead of alone, copies of them.
- ``queue``: the factors the norm queue holds before it reduces them (norms/batched.py: QUEUE_ELEMENTS).
Each variant trains a copy of one model on one batch, interleaved round by round with plain PyTorch and the
shipped settings: per mode, the median over rounds of each round's step / plain step, the working set (peak
above the memory before the step; the median step's) over plain's, and the ATen ops one step dispatches. The
budgets are module-level values, set while a variant's step runs and restored after it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy

from profiling.bench import GHOSTDP_MODES, add_model_arguments, make_step, model_and_batch
from profiling.suite import interleaved

BERT_BASE = dict(model="bert", layers=12, hidden=768, heads=12, vocab=30522, seq=128)
TINY = dict(model="bert", layers=1, hidden=32, heads=2, vocab=64, seq=8, batch=2)


def _settings(name: str, factor: float) -> list:
    """[(module, attribute, value)] that scale ghostdp's ``name`` budget by ``factor``."""
    from ghostdp.norms import batched, deferred
    if name == "deferred":
        shipped = deferred._deferred_budget
        return [(deferred, "_deferred_budget", lambda device: int(shipped(device) * factor))]
    if name == "stack":
        return [(batched, "STACK_ELEMENTS", {k: int(v * factor) for k, v in batched.STACK_ELEMENTS.items()}),
                (batched, "ACCELERATOR_STACK_ELEMENTS", int(batched.ACCELERATOR_STACK_ELEMENTS * factor))]
    if name == "queue":
        return [(batched, "QUEUE_ELEMENTS", int(batched.QUEUE_ELEMENTS * factor))]
    raise ValueError(f"unknown knob {name!r}: the knobs are deferred, stack and queue")


@contextlib.contextmanager
def knob(name: str, factor: float):
    """ghostdp's ``name`` budget times ``factor`` inside the block."""
    settings = _settings(name, factor)
    shipped = [(module, attribute, getattr(module, attribute)) for module, attribute, _ in settings]
    for module, attribute, value in settings:
        setattr(module, attribute, value)
    try:
        yield
    finally:
        for module, attribute, value in shipped:
            setattr(module, attribute, value)


def parse_knobs(specs) -> list[tuple[str, float]]:
    """["deferred=2,4", "queue=4"] -> [("deferred", 2.0), ("deferred", 4.0), ("queue", 4.0)]."""
    variants = []
    for spec in specs:
        name, _, factors = spec.partition("=")
        if not factors:
            raise ValueError(f"a knob is NAME=FACTOR[,FACTOR...], got {spec!r}")
        _settings(name, 1.0)  # refuses an unknown name here, before any model is built
        variants += [(name, float(factor)) for factor in factors.split(",")]
    return variants


def _under(step, name, factor):
    def varied():
        with knob(name, factor):
            step()
    return varied


def measure(args, modes, variants, rounds: int, warmup: int) -> dict:
    """profiling.suite.interleaved's rows for plain, each mode as shipped, and each mode under each variant
    ("bookkeeping deferred x4")."""
    import torch
    torch.manual_seed(0)
    template, batch = model_and_batch(args)
    steps = {"plain": make_step("plain", copy.deepcopy(template), args, batch)}
    for mode in modes:
        steps[mode] = make_step(mode, copy.deepcopy(template), args, batch)
        for name, factor in variants:
            with knob(name, factor):
                built = make_step(mode, copy.deepcopy(template), args, batch)
            steps[f"{mode} {name} x{factor:g}"] = _under(built, name, factor)
    del template
    for step in steps.values():
        step()
    return interleaved(steps, torch.device(args.device), rounds, warmup)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.set_defaults(**{k: v for k, v in BERT_BASE.items()})
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "amp"])
    p.add_argument("--modes", nargs="+", default=list(GHOSTDP_MODES), choices=GHOSTDP_MODES)
    p.add_argument("--knobs", nargs="+", default=["deferred=2,4"], help="NAME=FACTOR[,FACTOR...]")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a model so small that compute vanishes, on CPU (a test)")
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        args.dtype = "fp32"
    return args


def main(argv=None):
    args = parse(argv)
    variants = parse_knobs(args.knobs)
    results = measure(args, args.modes, variants, args.rounds, args.warmup)
    print(f"{args.model} L={args.layers} H={args.hidden} T={args.seq} B={args.batch} {args.dtype} on {args.device}, "
          f"embeddings {'frozen' if args.freeze_embeddings else 'trainable'}; {args.rounds} interleaved rounds")
    print(f"{'column':32s} {'ratio':>7s} {'ms':>9s} {'MB':>9s} {'MB/plain':>9s} {'ATen ops':>9s}")
    for column, r in results.items():
        mem = f"{r['mem_ratio']:.3f}x" if r["mem_ratio"] is not None else "-"
        print(f"{column:32s} {r['ratio']:6.2f}x {r['ms']:9.2f} {r['mb']:9.1f} {mem:>9s} {r['aten_ops']:9d}")
    return results


if __name__ == "__main__":
    main()
