"""The whole GPU table of ../shared/measurements in one command: every row, every mode, interleaved.

    python -m profiling.suite --device cuda --out suite_h100      # BERT-base rows, GPT-2 + LoRA, Llama LoRA
    python -m profiling.suite --tiny                              # the same rows scaled down, on CPU (a test)
    python -m profiling.suite --device cuda --against d9e76db     # also that revision's ghostdp, same rounds

Rows: BERT-base (L=12, H=768, T=128, bf16 weights) at B=32 and B=256 with embeddings frozen and
trainable; fp32 weights under bf16 autocast (B=256, frozen); T=512 (B=32, frozen); GPT-2 with LoRA r=8
on c_attn (B=64); a Llama-shaped 1.1B model (22 layers, H=2048, GQA 32/4 heads) with LoRA r=16 on
q/k/v/o (T=512, B=16); the Fast Gradient Clipping post's set-up (BERT-base in fp32, only the last
encoder layer, the pooler and the classifier train; B=512 and 2048). Modes: plain, ghost, bookkeeping,
and opacus-ghost when Opacus is installed
(a mode that cannot run a row is reported with its error). Within a row, every mode's step is built
in one process and the modes alternate round by round; time is the median over rounds of each
round's step / plain step, memory the step's working set (CUDA: peak allocated above the allocation
before the step; CPU: peak resident above resident) over plain's, and the ATen ops one step dispatches
(the host work that bounds a small-batch GPU step: each op that is not a view launches a kernel). Writes suite.json and suite.png
into --out and prints the table. ``--against REF`` adds columns ghost@REF and bookkeeping@REF, trained
with git revision REF's ghostdp in the same rounds (see profiling.step_ratio).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time

from ghostdp.memory import peak_mb_since, reset_peak
from profiling.bench import GHOSTDP_MODES, available, count_aten_ops, make_step, model_and_batch, timed
from profiling.revision import ghostdp_at
from profiling.step_ratio import median, round_order

BERT = dict(model="bert", layers=12, hidden=768, heads=12, vocab=30522, seq=128, dtype="bf16")
ROWS = [
    ("B=32, embeddings frozen", dict(BERT, batch=32, freeze_embeddings=True)),
    ("B=32, all trainable", dict(BERT, batch=32, freeze_embeddings=False)),
    ("B=256, embeddings frozen", dict(BERT, batch=256, freeze_embeddings=True)),
    ("B=256, all trainable", dict(BERT, batch=256, freeze_embeddings=False)),
    ("B=256, fp32 weights + bf16 autocast, frozen", dict(BERT, batch=256, freeze_embeddings=True, dtype="amp")),
    ("T=512, B=32, frozen", dict(BERT, batch=32, seq=512, freeze_embeddings=True)),
    ("GPT-2 + LoRA r=8 on c_attn, B=64", dict(BERT, model="gpt2-lora", vocab=50257, batch=64,
                                               freeze_embeddings=False)),
    ("Llama-shaped 1.1B + LoRA r=16, T=512, B=16", dict(model="llama-lora", layers=22, hidden=2048, heads=32,
                                                         vocab=32000, seq=512, batch=16, dtype="bf16",
                                                         freeze_embeddings=False)),
    ("FGC set-up: fp32, last layer + pooler + classifier, B=512", dict(BERT, batch=512, dtype="fp32",
                                                                      freeze_embeddings=False, train="last-layer")),
    ("FGC set-up: fp32, last layer + pooler + classifier, B=2048", dict(BERT, batch=2048, dtype="fp32",
                                                                       freeze_embeddings=False, train="last-layer")),
]
# --tiny: the same rows with compute that vanishes (a CPU test that keeps the suite from rotting).
TINY = dict(layers=1, hidden=32, heads=2, vocab=64)


def row_settings(settings: dict, tiny: bool, device: str) -> argparse.Namespace:
    settings = dict(settings, device=device)
    if tiny:
        settings.update(TINY, seq=min(settings["seq"], 16), batch=min(settings["batch"], 4))
    return argparse.Namespace(**settings)


def _working_set(step, device) -> tuple[float, float]:
    """(seconds, MB above the memory before the step) of one synchronised step."""
    base = reset_peak(device)
    return timed(step, device), peak_mb_since(device, base)


def interleaved(steps: dict, device, rounds: int, warmup: int) -> dict:
    """{column: {"ms", "mb", "mb_max", "aten_ops"} and, beside a "plain" column, "ratio", "mem_ratio",
    "max_mem_ratio"} for built ``steps`` {column: step}, run in alternating order round by round (the first
    ``warmup`` rounds not counted). ``aten_ops``: the ATen ops one step dispatches, counted in one more step after
    the rounds (host work: on a GPU each one that is not a view launches a kernel)."""
    times = {column: [] for column in steps}
    memory = {column: [] for column in steps}
    for round_ in range(warmup + rounds):
        for column, step in round_order(steps, round_):
            seconds, mb = _working_set(step, device)
            if round_ >= warmup:
                times[column].append(seconds)
                memory[column].append(mb)
    plain, out = times.get("plain"), {}
    for column in steps:
        # "mb": the median step's working set; "mb_max": the largest over the rounds, which takes in ghostdp's
        # scheduled proof steps (1, 2, 4, ...: a layout proof and the forward check's reruns), where a run's
        # peak may lie (before 2026-11-26 book-keeping's proof steps and those under activation checkpointing
        # held much more than the others; the median left them out).
        row = {"ms": 1e3 * median(times[column]), "mb": median(memory[column]), "mb_max": max(memory[column]),
               "aten_ops": count_aten_ops(steps[column])}
        if plain:
            row["ratio"] = median([t / p for t, p in zip(times[column], plain)])
            plain_mb, plain_max = median(memory["plain"]), max(memory["plain"])
            # Below 1 MB (tiny CPU rows) the resident-memory reading is allocator noise: no ratio.
            row["mem_ratio"] = row["mb"] / plain_mb if plain_mb >= 1.0 else None
            row["max_mem_ratio"] = row["mb_max"] / plain_max if plain_max >= 1.0 else None
        out[column] = row
    return out


def measure_row(args, modes, rounds, warmup, libraries=None) -> dict:
    """{mode: the ``interleaved`` row or {"error"}} for one row, modes interleaved.
    ``libraries``: {column: (mode, ghostdp package)} for columns trained with another revision's ghostdp."""
    import torch
    torch.manual_seed(0)
    device = torch.device(args.device)
    template, (ids, labels) = model_and_batch(args)
    steps, out = {}, {}
    columns = {mode: (mode, None) for mode in modes if mode not in (libraries or {})}
    columns.update(libraries or {})
    for mode, (trained, library) in columns.items():
        try:
            steps[mode] = make_step(trained, copy.deepcopy(template), args, (ids, labels), library)
            steps[mode]()
        except Exception as error:  # reported in the table, not hidden
            steps.pop(mode, None)
            out[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}
    del template
    out.update(interleaved(steps, device, rounds, warmup))
    steps.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def print_table(results, modes):
    width = max(len(name) for name in results) + 2
    print(f"{'configuration':<{width}}" + "".join(f"{m:>34}" for m in modes))
    for name, row in results.items():
        cells = []
        for mode in modes:
            r = row.get(mode, {"error": "not run"})
            if "error" in r:
                cells.append(f"{'failed':>34}")
            elif mode == "plain":
                cells.append(f"{r['ms']:>10.1f} ms, {r['mb']:>7.0f} MB, {r['aten_ops']:>6} ops")
            else:
                memory = f"{r['mem_ratio']:>6.2f}x" if r["mem_ratio"] is not None else f"{'-':>7}"
                cells.append(f"{r['ratio']:>13.2f}x, {memory}, {r['aten_ops']:>6} ops")
        print(f"{name:<{width}}" + "".join(cells))
    largest = [f"  {name} / {mode}: {r['mb_max']:.0f} MB ({r['max_mem_ratio']:.2f}x plain's largest)"
               for name, row in results.items() for mode, r in row.items()
               if mode != "plain" and "error" not in r and r.get("max_mem_ratio") is not None]
    if largest:
        print("largest working set over the rounds (the proof steps' included):")
        print("\n".join(largest))
    for name, row in results.items():
        for mode, r in row.items():
            if "error" in r:
                print(f"  {name} / {mode}: {r['error']}")


def plot(results, modes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    others = [m for m in modes if m != "plain"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(names) + 2), sharey=True)
    for ax, key, label in ((axes[0], "ratio", "step time / plain"), (axes[1], "mem_ratio", "working set / plain")):
        for k, mode in enumerate(others):
            values = [results[n].get(mode, {}).get(key) or 0.0 for n in names]
            ax.barh([i + k / (len(others) + 1) for i in range(len(names))], values,
                    height=1 / (len(others) + 1), label=mode)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel(label)
    axes[0].set_yticks([i + 0.3 for i in range(len(names))], names)
    axes[0].invert_yaxis()
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_json(args, modes, rows, results):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump({"device": args.device, "tiny": args.tiny, "rounds": args.rounds, "modes": modes,
                   "against": args.against, "rows": {name: dict(settings) for name, settings in rows},
                   "results": results}, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="every row scaled down (CPU test)")
    p.add_argument("--rows", nargs="+", type=int, help="only these rows (0-based), e.g. --rows 0 2")
    p.add_argument("--modes", nargs="+", default=["plain", "ghost", "bookkeeping", "opacus-ghost"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="profiling_output/suite")
    p.add_argument("--against", metavar="REF", help="also run the ghostdp modes with git revision REF's ghostdp")
    args = p.parse_args(argv)
    modes = [m for m in args.modes if available(m)]
    if len(modes) < len(args.modes):
        print(f"skipped {sorted(set(args.modes) - set(modes))}: opacus is not installed (pip install 'ghostdp[compare]')")
    if "plain" not in modes:
        modes.insert(0, "plain")
    libraries = {}
    if args.against is not None:
        library = ghostdp_at(args.against)
        libraries = {f"{m}@{args.against}": (m, library) for m in modes if m in GHOSTDP_MODES}
        modes += list(libraries)
    rows = [ROWS[i] for i in args.rows] if args.rows else ROWS
    results = {}
    started = time.perf_counter()
    for name, settings in rows:
        row_args = row_settings(settings, args.tiny, args.device)
        results[name] = measure_row(row_args, modes, args.rounds, args.warmup, libraries)
        print(f"  measured '{name}' ({time.perf_counter() - started:.0f} s so far): {json.dumps(results[name])}",
              flush=True)
        write_json(args, modes, rows, results)  # after every row: a run stopped at a time limit keeps its rows
    print(f"ghostdp suite on {args.device}{' (tiny rows)' if args.tiny else ''}; {args.rounds} interleaved rounds "
          "per row; time: median of per-round ratios to plain; memory: the step's working set over plain's; "
          "ops: ATen ops one step dispatches")
    print_table(results, modes)
    plot(results, modes, os.path.join(args.out, "suite.png"))
    print(f"wrote {args.out}/suite.json and suite.png")
    return results


if __name__ == "__main__":
    main()
