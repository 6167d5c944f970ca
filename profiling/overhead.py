"""Host overhead of a private step, measured on the CPU: the stand-in for a host-bound GPU step.

    python -m profiling.overhead                         # 12-layer BERT, H=64, 4 heads, B=2, T=8, 1 thread
    python -m profiling.overhead --rounds 30 --modes plain ghost bookkeeping opacus-ghost
    python -m profiling.overhead --against HEAD          # a change against its parent, in the same rounds
    python -m profiling.overhead --per-layer             # the norm queue as on an H100 at BERT-base sizes

A BERT so small that its arithmetic vanishes spends its step in Python and in dispatching ATen
ops, as a BERT-base step on an H100 does at small batch (../shared/measurements: the GPU idles 87%
of a ghost step at B=32), and it ranks the libraries as that GPU does. For each embedding setting
(trainable, frozen) the modes' steps are built in one process and interleaved round by round
(profiling.step_ratio), and the table gives:
- the median over rounds of each round's step time / plain step time;
- ATen ops dispatched per step (counted below autograd, forward and backward, noise and optimizer);
- extra host time per hooked layer: (median step - median plain step) / layers with trainable
  parameters, the cost the GPU issue counts at about 1 ms per layer;
- "GC ms": the mean time per step that Python's cyclic garbage collector ran in that mode's steps (gc.callbacks),
  which the medians leave out: a collection of the whole process (~170 ms here) every few hundred private steps
  lands in one round only (ghostdp/collector.py);
- two floors, plain steps that do only the work DP-SGD cannot skip, interleaved with the rest:
  "noise floor" adds ghostdp's noise draw (RandomSource.add_gaussian_, as the DP optimizer calls it)
  to every trained gradient: book-keeping's floor. "two-pass floor" also runs an activation-gradient
  pass first (autograd.grad of the loss to the first trained layer's output, as pass 1 reaches every
  layer's output grad): ghost's. What a mode takes above its floor is its hooks' and rules' work.
  On this stand-in the noise is compute, not host work (about 5 ns a value on one thread: 2.1M values
  with trainable embeddings), where a GPU draws it in one kernel per block.
- with frozen embeddings, "plan floor" (profiling/plan_floor.py): book-keeping's arithmetic and noise with
  every per-call decision made once and nothing else (no audit, no checks): not a private step, a bound on
  what a per-call plan could save. Measured 2026-11-25, frozen, 30 rounds: batched 1.36x and 1.48x plain
  (two runs) against book-keeping's 2.14x and 2.21x, with about as many ATen ops (1589-1599 against 1541):
  that gap is Python, not ops; per layer 1.71x against 2.91x (2317 ops against 2786). "graph floor": the same
  step with its layers found in the loss's autograd graph instead of by forward hooks (plan_floor.layers_in_graph):
  what capturing from the graph could save.
``--per-layer``: the stand-in's tensors are so small that the norm queue stacks every layer into a few
reductions. On an H100 at BERT-base sizes no layer's tensors fit the GPU's stack budget (B=32, T=128:
3.1M elements each against 4M for a stack), so the queue reduces one layer at a time, and so does it
with this flag: the stack budget and the queue bound are set to 4/3 of one (B, T, H) activation, as 4M
elements are at BERT-base B=32 on the GPU (for this ghostdp and the --against one).
Measured 2026-11-24: ghost 3.6x and book-keeping 3.5-3.7x per layer against 2.4x and 2.2x batched, as
the H100 read 3.6-3.9x at B=32: this is the stand-in for the GPU's BERT-base rows.
Timings are the shared machine's: compare the ratios of one run, never seconds across runs.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os

from profiling import plan_floor
from profiling.collector import collector_time
from profiling.bench import (GHOSTDP_MODES, MODES, add_model_arguments, available, count_aten_ops, make_step,
                             model_and_batch)
from profiling.revision import ghostdp_at
from profiling.step_ratio import median, round_order


FLOORS = ("noise floor", "two-pass floor")


def make_floor_step(floor, model, batch):
    """A plain step (bench.make_step's) plus the work no private step can skip (see the docstring)."""
    import torch
    from ghostdp.randomness import RandomSource
    ids, labels = batch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss(reduction="none")
    noise = RandomSource(seed=0)
    trained = trained_layers(model)
    outputs = []
    first = []  # the trained layer whose forward runs first, found by the first step

    def record(module, args, output):
        if not first:
            first.append(module)
        if module is first[0]:
            outputs.append(output)

    def step():
        optimizer.zero_grad(set_to_none=True)
        watching = trained if not first else first
        handles = [m.register_forward_hook(record) for m in watching] if floor == "two-pass floor" else []
        try:
            losses = criterion(model(input_ids=ids).logits, labels)
        finally:
            for h in handles:
                h.remove()
        if handles:
            first_output = outputs[0]
            outputs.clear()
            torch.autograd.grad(losses, first_output, torch.ones_like(losses), retain_graph=True)
        losses.sum().backward()
        noise.add_gaussian_([p.grad for p in params], 1.0, float(len(labels)))
        optimizer.step()
    return step


def trained_layers(model) -> list:
    """The hooked modules that own a trainable parameter."""
    from ghostdp.norms.fallback import hooked_modules
    return [m for _, m in hooked_modules(model) if any(p.requires_grad for p in m.parameters(recurse=False))]


def measure(args, freeze_embeddings: bool, against=None) -> dict:
    """{mode: {"ratio", "median_ms", "aten_ops", "ms_per_layer"}} for one embedding setting; ``against``:
    (revision, its ghostdp package), whose ghostdp modes run as "mode@revision" in the same rounds."""
    import time

    import torch
    torch.manual_seed(0)
    args = copy.copy(args)
    args.freeze_embeddings = freeze_embeddings
    template, (ids, labels) = model_and_batch(args)
    layers = len(trained_layers(template))
    steps = {}
    runs = [(mode, mode, None) for mode in args.modes]
    if against is not None:
        revision, library = against
        runs += [(f"{mode}@{revision}", mode, library) for mode in args.modes if mode in GHOSTDP_MODES]
    for name, mode, library in runs:
        try:
            steps[name] = make_step(mode, copy.deepcopy(template), args, (ids, labels), library)
            steps[name]()
        except Exception as error:  # a mode that cannot run this model is reported, not hidden
            steps.pop(name, None)
            print(f"  {name}: {type(error).__name__}: {str(error)[:120]}")
    for floor in FLOORS if args.floors else ():
        steps[floor] = make_floor_step(floor, copy.deepcopy(template), (ids, labels))
        steps[floor]()
    if args.floors and plan_floor.supports(template):
        for floor, capture in ((plan_floor.PLAN_FLOOR, "hooks"), (plan_floor.GRAPH_FLOOR, "graph")):
            steps[floor] = plan_floor.make_plan_floor_step(copy.deepcopy(template), (ids, labels),
                                                           stacked=not args.per_layer, capture=capture)
            steps[floor]()
    ops = {mode: count_aten_ops(step) for mode, step in steps.items()}
    times = {mode: [] for mode in steps}
    with collector_time(steps) as collecting:
        for round_ in range(args.warmup + args.rounds):
            for mode, step in round_order(steps, round_):
                collecting.mode = mode if round_ >= args.warmup else None
                start = time.perf_counter()
                step()
                if round_ >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
    plain = times["plain"]
    rows = {}
    for mode, ts in times.items():
        rows[mode] = {"ratio": median([t / p for t, p in zip(ts, plain)]), "median_ms": 1e3 * median(ts),
                      "aten_ops": ops[mode], "gc_ms": 1e3 * collecting.seconds[mode] / len(ts),
                      "ms_per_layer": 1e3 * (median(ts) - median(plain)) / max(1, layers)}
    rows["plain"]["hooked_layers"] = layers
    return rows


def report(name, rows):
    layers = rows["plain"]["hooked_layers"]
    print(f"\n{name} ({layers} layers with trainable parameters)")
    width = max(16, *(len(mode) + 2 for mode in rows))
    print(f"{'mode':<{width}}{'ratio':>8}{'median ms':>11}{'ATen ops':>10}{'ops/plain':>10}{'ms/layer':>10}"
          f"{'GC ms':>8}")
    for mode, r in rows.items():
        if mode == FLOORS[0]:
            print("-" * (width + 57))
        print(f"{mode:<{width}}{r['ratio']:>7.2f}x{r['median_ms']:>11.2f}{r['aten_ops']:>10}"
              f"{r['aten_ops'] / rows['plain']['aten_ops']:>9.2f}x{r['ms_per_layer']:>10.3f}{r['gc_ms']:>8.3f}")


# The GPU's stack budget and queue bound (4M elements) over one BERT-base activation at T=128, by batch size.
GPU_BUDGET_PER_ACTIVATION = {"b32": (1 << 22) / (32 * 128 * 768), "b256": (1 << 22) / (256 * 128 * 768)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.set_defaults(layers=12, hidden=64, heads=4, seq=8)  # the stand-in: compute vanishes, host work stays
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["plain", "ghost", "bookkeeping"], choices=MODES)
    p.add_argument("--embeddings", nargs="+", default=["trainable", "frozen"], choices=["trainable", "frozen"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-floors", dest="floors", action="store_false",
                   help="leave out the noise, two-pass, plan and graph floor rows")
    p.add_argument("--per-layer", nargs="?", const="b32", default=None, choices=sorted(GPU_BUDGET_PER_ACTIVATION),
                   help="the norm queue reduces one layer at a time, as on an H100 at BERT-base sizes: at B=32 "
                   "(the default), whose layers' Grams wait in DeferredGrams, or at B=256 (b256), where no two of "
                   "them fit its budget and each layer's norm is taken alone")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--against", metavar="REF", help="also run the ghostdp modes with git revision REF's ghostdp "
                   "(profiling.revision), in the same rounds")
    args = p.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("profiling.overhead measures host work on the CPU; on a GPU use profiling.bench")
    args.dtype = "fp32"
    if "plain" not in args.modes:
        args.modes.insert(0, "plain")
    return args


@contextlib.contextmanager
def per_layer_reductions(packages, activation_elements: int, batch: str = "b32"):
    """The norm queue of each ghostdp package with the stack budget and queue bound that a GPU has at
    BERT-base B=32 (or B=256: ``batch``), in proportion to this model's (B, T, H) activation: no layer's input
    and output grad fit together, so every layer is reduced alone (the modules' own budgets, restored on exit).
    At B=256 not even two of a layer's Grams fit DeferredGrams' half budget: each layer's norm is taken alone.
    The stand-in's ratios are BERT-base's but for one: a LayerNorm's (B, d) gradients are 1/T of an activation,
    1/8 here against 1/128 there, so at b256 DeferredGrams takes their dot products after every LayerNorm instead
    of every five or so."""
    budget = int(GPU_BUDGET_PER_ACTIVATION[batch] * activation_elements)
    saved = []
    try:
        for package in packages:
            batched = importlib.import_module(f"{package.__name__}.norms.batched")
            saved.append((batched, batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS))
            batched.STACK_ELEMENTS = {device: budget for device in batched.STACK_ELEMENTS}
            batched.QUEUE_ELEMENTS = budget
        yield
    finally:
        for batched, stack, queue in saved:
            batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS = stack, queue


def main(argv=None):
    import torch

    import ghostdp
    args = parse(argv)
    missing = [m for m in args.modes if not available(m)]
    if missing:
        raise SystemExit(f"{missing}: opacus is not installed (pip install 'ghostdp[compare]')")
    against = (args.against, ghostdp_at(args.against)) if args.against else None
    torch.set_num_threads(args.threads)
    print(f"{args.model} L={args.layers} H={args.hidden} heads={args.heads} B={args.batch} T={args.seq}, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds")
    if args.per_layer:
        print(f"the norm queue reduces one layer at a time (--per-layer {args.per_layer}), as on an H100 at BERT-base "
              f"sizes, B={args.per_layer[1:]}")
    results = {}
    packages = [ghostdp] + ([against[1]] if against else [])
    per_layer = per_layer_reductions(packages, args.batch * args.seq * args.hidden, args.per_layer or "b32")
    with per_layer if args.per_layer else contextlib.nullcontext():
        for setting in args.embeddings:
            results[setting] = measure(args, freeze_embeddings=setting == "frozen", against=against)
            report(f"embeddings {setting}", results[setting])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return results


if __name__ == "__main__":
    main()
