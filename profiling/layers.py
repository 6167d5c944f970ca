"""Where the time of a private step goes, and whether the Linear rule picks the cheaper norm method.

    python -m profiling.layers                      # BERT L=2 H=256, B=16, T=128, CPU
    python -m profiling.layers --device cuda --hidden 768 --layers 12

Part 1 times one ghost and one book-keeping step next to a plain step: forward, pass 1 split into
the norm rules by module type and the backward itself, pass 2 or the book-keeping clipped sums,
optimizer step. The controller's regions are timed through its ``region_timer``: on a GPU by CUDA
events on the stream (the device's own clock; the regions of a step add up to it), elsewhere by
the host clock.

Part 2 times the two ways of a Linear layer's per-example squared norms at several (T, d, p):
Gram <A_i A_i^T, G_i G_i^T>, O(T^2 (d + p)), and instantiation ||G_i^T A_i||^2, O(T d p), and
reports which one the rule's cost model picks and which one was faster.

Part 3 times the LayerNorm and Linear rules against their floors (the layer's own backward; a
bare Gram and instantiation) at BERT-base shapes, in the model's dtype: back to back, and by their ops
alone (on a GPU the kernels' durations: a rule of a dozen small ops is host-bound back to back, so only
the second line tells whether its kernels are at their floor).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from profiling.bench import add_model_arguments, model_and_batch, weight_dtype


class RegionTimer:
    """Times named regions with events on the device's stream (CUDA events on a GPU, the host clock
    elsewhere): the time the device spends from the region's first queued work to its last, idle
    gaps included, so the step's top-level regions add up to its device time. Set as a controller's
    ``region_timer``, it also times pass 1, each norm rule and the clipped sums."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.spans = defaultdict(list)  # name -> [(start, end)]

    def _event(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name):
        start = self._event()
        try:
            yield
        finally:
            self.spans[name].append((start, self._event()))

    def totals_ms(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(a.elapsed_time(b) for a, b in spans) for n, spans in self.spans.items()}
        return {n: 1e3 * sum(b - a for a, b in spans) for n, spans in self.spans.items()}


def profiled_step(args, mode):
    """{region: ms per step} of ``args.steps`` steps of ``mode``, timed by a RegionTimer."""
    import ghostdp
    model, (ids, labels) = model_and_batch(args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    timer = RegionTimer(args.device)
    if mode == "plain":
        def loss():
            return F.cross_entropy(model(input_ids=ids).logits.float(), labels)
    else:
        controller = ghostdp.GhostClipping(model, 1.0, clipping=mode)
        criterion = controller.criterion(torch.nn.CrossEntropyLoss())
        controller.region_timer = timer

        def loss():
            return criterion(model(input_ids=ids).logits.float(), labels)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with timer("step.forward"):
            value = loss()
        with timer("step.backward"):
            value.backward()
        with timer("step.optimizer"):
            optimizer.step()

    for _ in range(args.warmup):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    timer.spans.clear()
    for _ in range(args.steps):
        step()
    return {name: value / args.steps for name, value in timer.totals_ms().items()}


def breakdown(args):
    runs = {mode: profiled_step(args, mode) for mode in ("plain", "ghost", "bookkeeping")}
    plain_step = sum(runs["plain"][k] for k in ("step.forward", "step.backward", "step.optimizer"))
    what = ("GPU time between CUDA events around each region" if args.device == "cuda"
            else "time of each region")
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
            clipped = t.get("ghostdp.clipped_sum", 0.0)  # ghost: formed in pass 2, as its G arrive
            print(f"    clipped sums (c*G)^T A    {clipped:8.1f}")
            rest = "pass 2 (pass 1's backward)" if mode == "ghost" else "rest"
            print(f"    {rest:<26}{t['step.backward'] - pass1 - clipped:8.1f}")
        print(f"  optimizer step              {t['step.optimizer']:8.1f}")
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


def device_ms(fn, device: str, repeats: int = 20) -> float:
    """Mean ms per call of ``fn`` over ``repeats`` back-to-back calls: CUDA events on a GPU (the
    device's clock; host-bound calls show their host time), the host clock elsewhere."""
    for _ in range(3):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - begin) / repeats


def ops_ms(fn, device: str, repeats: int = 20) -> float:
    """Mean ms per call of the work of ``fn``'s ops alone, without the host's Python between them (torch.profiler): on
    a GPU the summed durations of its kernels, memory copies and sets (the device's clock, however host-bound the
    calls), elsewhere the summed self times of its ATen ops (profiled, so a little above their unprofiled time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device == "cuda":
        total_us = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
    else:
        total_us = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::"))
    return total_us / 1e3 / repeats


RULE_POINTS = [(256, 128, 768), (32, 512, 768)]


def rules_against_floors(args, points=RULE_POINTS) -> list:
    """[(B, T, d, LayerNorm rule, its layer's backward, Linear rule, bare Gram, instantiation, and the same five
    for their ops alone)] in ms.

    The LayerNorm rule (weight and bias norms and token masses) against the layer's own backward;
    the Linear rule (d x d, weight and bias, as pass 1 runs it: masses, then norms, sharing the
    pass's Gram cache) against a bare Gram (two batched products and one product-sum) and against
    instantiation. In the model's dtype (--dtype). Each is timed twice: back to back (device_ms: CUDA events
    on a GPU, where a call of a dozen small ops is host-bound and reads the host's time) and by its ops alone
    (ops_ms: on a GPU its kernels' durations, the GPU-speed issue's kernel floors)."""
    from ghostdp.norms.factors import InputGrams, wide_matmul
    from ghostdp.norms.linear import linear_rule
    from ghostdp.norms.normalization import layer_norm_rule
    dtype = weight_dtype(args)
    print(f"\nPart 3: norm rules against their floors, ms per call ({args.dtype} on {args.device})")
    print(f"{'B':>5}{'T':>5}{'d':>6}{'LN rule':>9}{'LN bwd':>8}{'Linear rule':>13}{'bare Gram':>11}"
          f"{'instantiate':>13}")
    rows = []
    for B, T, d in points:
        ln = torch.nn.LayerNorm(d).to(args.device, dtype)
        lin = torch.nn.Linear(d, d).to(args.device, dtype)
        x = torch.randn(B, T, d, device=args.device, dtype=dtype, requires_grad=True)
        G = torch.randn(B, T, d, device=args.device, dtype=dtype)
        y = ln(x)
        A = x.detach()
        both = {"weight", "bias"}

        def rule_of(rule, module):
            def run():
                grams = InputGrams()
                return [(f.token_mass(grams), f.sq_norm(grams)) for f in rule(module, (A,), G, both).values()]
            return run

        def bare():
            aa, gg = wide_matmul(A, A.transpose(1, 2), torch.float32), wide_matmul(G, G.transpose(1, 2), torch.float32)
            return (aa * gg).sum((1, 2))

        measured = (rule_of(layer_norm_rule, ln),
                    lambda: torch.autograd.grad(y, [x, ln.weight, ln.bias], G, retain_graph=True),
                    rule_of(linear_rule, lin), bare,
                    lambda: wide_matmul(G.transpose(1, 2), A, torch.float32).pow(2).sum((1, 2)))
        row = (B, T, d, *[device_ms(fn, args.device) for fn in measured], *[ops_ms(fn, args.device) for fn in measured])
        rows.append(row)
        widths = (9, 8, 13, 11, 13)
        print(f"{B:>5}{T:>5}{d:>6}" + "".join(f"{v:>{w}.3f}" for v, w in zip(row[3:8], widths)))
        print(f"{'(their ops alone)':>16}" + "".join(f"{v:>{w}.3f}" for v, w in zip(row[8:], widths)))
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
    p.add_argument("--skip-rules", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if not args.skip_breakdown:
        breakdown(args)
    if not args.skip_gram:
        gram_versus_instantiate(args)
    if not args.skip_rules:
        rules_against_floors(args)


if __name__ == "__main__":
    main()
