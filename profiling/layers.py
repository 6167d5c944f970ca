"""Where the time of a private step goes, and whether the Linear rule picks the cheaper norm method.

    python -m profiling.layers                      # BERT L=2 H=256, B=16, T=128, CPU
    python -m profiling.layers --device cuda --hidden 768 --layers 12

Part 1 profiles one ghost and one book-keeping step (torch.profiler; the controller marks its
regions with record_function) next to a plain step: forward, pass 1 split into the norm rules by
module type and the backward itself, pass 2 or the book-keeping clipped sums, optimizer step.

Part 2 times the two ways of a Linear layer's per-example squared norms at several (T, d, p):
Gram <A_i A_i^T, G_i G_i^T>, O(T^2 (d + p)), and instantiation ||G_i^T A_i||^2, O(T d p), and
reports which one the rule's cost model picks and which one was faster.
"""
from __future__ import annotations

import argparse
import bisect
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from profiling.bench import add_model_arguments, build_model


def profiled_step(args, mode):
    import ghostdp
    model = build_model(args).to(args.device, getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[
        getattr(args, "dtype", "fp32")])).train()
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), device=args.device)
    labels = torch.randint(0, 2, (args.batch,), device=args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    if mode == "plain":
        def loss():
            return F.cross_entropy(model(input_ids=ids).logits.float(), labels)
    else:
        controller = ghostdp.GhostClipping(model, 1.0, clipping=mode)
        criterion = controller.criterion(torch.nn.CrossEntropyLoss())

        def loss():
            return criterion(model(input_ids=ids).logits.float(), labels)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with record_function("step.forward"):
            value = loss()
        with record_function("step.backward"):
            value.backward()
        with record_function("step.optimizer"):
            optimizer.step()

    for _ in range(args.warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
            if args.device == "cuda":
                torch.cuda.synchronize()
    events = prof.events()
    regions = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.name.startswith(REGIONS)]
    if args.device == "cuda":
        # Kernel time, attributed to the regions whose host interval contains the launching op: the
        # backward's ops run on autograd's device thread, outside the main thread's step.backward
        # range, so attribution goes by time, not by the parent chain. (A region's own
        # device_time_total counts no kernels: it once read ghost at 1.02x plain and pass 2 < 0.)
        launches = [(e.time_range.start, sum(k.duration for k in e.kernels)) for e in events if e.kernels]
        totals = device_time_by_region(regions, launches)
    else:
        totals = defaultdict(float)
        for name, start, end in regions:
            totals[name] += end - start
    return {name: value / 1e3 / args.steps for name, value in totals.items()}


REGIONS = ("step.", "ghostdp.")


def device_time_by_region(regions, launches) -> dict:
    """{region name: summed duration of the kernels launched inside it} (microseconds).

    ``regions``: (name, host start, host end) of every profiled range, nested or not, any thread;
    ``launches``: (host start of the launching op, duration of its kernels). A kernel counts in every
    range around its launch, so nested ranges add up like host times (pass 1 within the backward)."""
    totals = defaultdict(float)
    ordered = sorted(launches)
    starts = [t for t, _ in ordered]
    prefix = [0.0]
    for _, duration in ordered:
        prefix.append(prefix[-1] + duration)
    for name, start, end in regions:
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_right(starts, end)
        totals[name] += prefix[hi] - prefix[lo]
    return totals


def breakdown(args):
    runs = {mode: profiled_step(args, mode) for mode in ("plain", "ghost", "bookkeeping")}
    plain_step = sum(runs["plain"][k] for k in ("step.forward", "step.backward", "step.optimizer"))
    what = ("GPU kernel time, by the region that launched each kernel" if args.device == "cuda"
            else "host time of each region")
    print(f"Part 1: one step, ms of {what} (mean of {args.steps} profiled steps after {args.warmup} "
          "warm-up steps)")
    for mode, t in runs.items():
        step = sum(t[k] for k in ("step.forward", "step.backward", "step.optimizer"))
        print(f"\n{mode}: step {step:.1f} ms ({step / plain_step:.2f}x plain)")
        print(f"  forward                     {t['step.forward']:8.1f}")
        print(f"  backward                    {t['step.backward']:8.1f}")
        if mode != "plain":
            pass1 = t.get("ghostdp.pass1", 0.0)
            norms = {k: v for k, v in t.items() if k.startswith("ghostdp.norms.")}
            norm_total = sum(norms.values())
            print(f"    pass 1                    {pass1:8.1f}")
            print(f"      norm rules              {norm_total:8.1f}")
            for key, value in sorted(norms.items(), key=lambda kv: -kv[1]):
                print(f"        {key[len('ghostdp.norms.'):]:<22}{value:8.1f}")
            print(f"      backward (activations)  {pass1 - norm_total:8.1f}")
            if mode == "ghost":
                print(f"    pass 2 (plain backward)   {t['step.backward'] - pass1:8.1f}")
            else:
                clipped = t.get("ghostdp.clipped_sum", 0.0)
                print(f"    clipped sums (c*G)^T A    {clipped:8.1f}")
                print(f"    rest                      {t['step.backward'] - pass1 - clipped:8.1f}")
        print(f"  optimizer step              {t['step.optimizer']:8.1f}")
    if args.device == "cuda":
        print("\n(kernel time only: a host-bound step's wall time also holds the GPU's idle time, which "
              "profiling.step_ratio and profiling.suite measure)")
    return runs


def best_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


GRID = [(T, d, p) for T in (16, 64, 128, 256, 512) for d, p in ((256, 256), (256, 1024), (768, 768), (768, 3072))]


def gram_versus_instantiate(args, grid=GRID):
    """Returns [(T, d, p, gram seconds, instantiate seconds, picked, faster, one-tile gram seconds)].

    "gram" is the rule's tiling (only tiles on or above the diagonal, see gram_tile); "1 tile" is the
    whole Gram in one product, to check that splitting T pays on this device.
    """
    from ghostdp.norms.factors import OuterProduct, PerExampleGrad, gram_sq_norm, gram_tile, prefers_gram
    print("\nPart 2: Linear-layer squared norms, ms per call (B = %d)" % args.batch)
    print(f"{'T':>6}{'d':>6}{'p':>6}{'tile':>6}{'gram':>9}{'1 tile':>9}{'instantiate':>13}  "
          f"{'rule picks':<12}{'faster':<12}")
    rows = []
    for T, d, p in grid:
        G = torch.randn(args.batch, T, p, device=args.device)
        A = torch.randn(args.batch, T, d, device=args.device)
        factor = OuterProduct(G, A, (p, d))
        tile = gram_tile(args.batch, T, torch.device(args.device).type)
        gram = best_time(lambda: gram_sq_norm(G, A, torch.float32, tile), args.repeats)
        whole = best_time(lambda: gram_sq_norm(G, A, torch.float32, T), args.repeats) if tile < T else gram
        inst = best_time(lambda: PerExampleGrad.sq_norm(factor), args.repeats)
        picks = "gram" if prefers_gram(T, p, d, tile) else "instantiate"
        faster = "gram" if gram < inst else "instantiate"
        rows.append((T, d, p, gram, inst, picks, faster, whole))
        print(f"{T:>6}{d:>6}{p:>6}{tile:>6}{gram * 1e3:>9.2f}{whole * 1e3:>9.2f}{inst * 1e3:>13.2f}  "
              f"{picks:<12}{faster:<12}")
    agree = sum(r[5] == r[6] for r in rows)
    print(f"the cost model picked the faster method in {agree} of {len(rows)} cases")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--skip-breakdown", action="store_true")
    p.add_argument("--skip-gram", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if not args.skip_breakdown:
        breakdown(args)
    if not args.skip_gram:
        gram_versus_instantiate(args)


if __name__ == "__main__":
    main()
