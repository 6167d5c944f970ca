"""Step time and peak memory of private training modes next to plain PyTorch, each in a fresh process.

    python -m profiling.bench                                   # BERT L=2 H=256, B=16, T=128, CPU
    python -m profiling.bench --batches 8 16 32 --budget-mb 2000
    python -m profiling.bench --model gpt2 --freeze-embeddings --device cuda --dtype bf16
    python -m profiling.bench --batches 8 16 32 --checkpointing  # activation checkpointing, every mode
    python -m profiling.bench --checkpointing reentrant --cpu-memory tensors  # exact tensor bytes on CPU

Modes: plain (non-private, the limit), ghost and bookkeeping (ghostdp), opacus-ghost and
opacus-hooks (when opacus is installed: pip install ghostdp[compare]). A mode that fails prints
its error in the table instead of a time. Peak memory: on CUDA, peak allocated above the
allocation before the first step; on CPU, peak resident set size of the process above its
resident size before the first step (Linux: /proc/self/clear_refs resets the peak), or with
--cpu-memory tensors the exact peak of live tensor bytes in one more step above those alive before
it (from torch.profiler's memory timeline): RSS also counts the heap the allocator keeps and
varies by +-20 MB between runs; tensor bytes are the same in every run.
Writes a table (stdout), results.json and PNG plots into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

MODES = ("plain", "ghost", "bookkeeping", "opacus-ghost", "opacus-hooks")


# ----------------------------------------------------------------------------- one measurement (worker)
def build_model(args):
    import torch
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config,
                              GPT2ForSequenceClassification)
    torch.manual_seed(0)
    if args.model.startswith("llama"):
        return _llama_lora(args)
    if args.model.startswith("torch-encoder"):
        model = _torch_encoder(args)
    elif args.model.startswith("bert"):
        config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                            max_position_embeddings=max(512, args.seq), num_labels=2,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = BertForSequenceClassification(config)
    else:
        config = GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                            n_positions=max(512, args.seq), num_labels=2, pad_token_id=0,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2ForSequenceClassification(config)
    _enable_checkpointing(model, args)
    if args.model.endswith("lora"):
        from peft import LoraConfig, get_peft_model
        targets = ["query", "value"] if args.model.startswith("bert") else ["c_attn"]
        model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, lora_dropout=0.0,
                                                 fan_in_fan_out=not args.model.startswith("bert"),
                                                 modules_to_save=["classifier", "score"]))
    if args.freeze_embeddings:
        for name, p in model.named_parameters():
            if "embeddings" in name or ".wte." in name or ".wpe." in name:
                p.requires_grad_(False)
    if getattr(args, "train", "all") == "last-layer":
        _train_last_layer_only(model)
    return model


def _train_last_layer_only(model) -> None:
    """Freezes all but the last encoder layer, the pooler and the classifier: the Fast Gradient Clipping
    post's set-up (BERT-base, ~7.6M trained parameters)."""
    if not hasattr(model, "bert"):
        raise ValueError("--train last-layer is the BERT set-up of the Fast Gradient Clipping post: use --model bert")
    last = len(model.bert.encoder.layer) - 1
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith((f"bert.encoder.layer.{last}.", "bert.pooler.", "classifier.")))


def _enable_checkpointing(model, args) -> None:
    kind = getattr(args, "checkpointing", None)
    if kind and not hasattr(model, "gradient_checkpointing_enable"):
        raise ValueError(f"--checkpointing needs a transformers model, not --model {args.model}")
    if kind:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})


def _llama_lora(args):
    """A Llama-architecture classifier (GQA: heads // 8 key-value heads) with LoRA r=16 on q/k/v/o."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=(11 * args.hidden) // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 8), max_position_embeddings=max(512, args.seq),
                         num_labels=2, pad_token_id=0)
    model = LlamaForSequenceClassification(config)
    _enable_checkpointing(model, args)
    return get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            lora_dropout=0.0, modules_to_save=["score"]))


def _torch_encoder(args):
    """A torch.nn.TransformerEncoder classifier (post-LN, GELU, batch-first, learned positions) called as
    model(input_ids=...).logits. "torch-encoder": torch.nn.MultiheadAttention, which no norm rule covers (the exact
    fallback takes its projections); "torch-encoder-fixed": the same model after ghostdp.validate.fix, whose
    ghostdp.layers.MultiheadAttention projections the Linear rule covers (same weights and outputs)."""
    import types

    import torch
    from torch import nn

    class EncoderClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = nn.Embedding(args.vocab, args.hidden)
            self.position_embeddings = nn.Embedding(args.seq, args.hidden)
            layer = nn.TransformerEncoderLayer(args.hidden, args.heads, 4 * args.hidden, dropout=0.0,
                                               activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.classifier = nn.Linear(args.hidden, 2)

        def forward(self, input_ids):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, T), as BERT's
            x = self.embeddings(input_ids) + self.position_embeddings(positions)
            return types.SimpleNamespace(logits=self.classifier(self.encoder(x)[:, 0]))

    model = EncoderClassifier()
    if args.model == "torch-encoder-fixed":
        import ghostdp
        ghostdp.validate.fix(model)
    return model


# Weights and compute: "amp" keeps float32 weights and runs forward and loss under bf16 autocast.
WEIGHT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "amp": "float32"}


def weight_dtype(args):
    import torch
    return getattr(torch, WEIGHT_DTYPES[getattr(args, "dtype", "fp32")])


def model_and_batch(args):
    """The model of ``args`` (build_model) on ``args.device`` in its weight dtype, in train mode, and a batch for it:
    (ids (batch, seq) of random tokens, labels (batch,) of two classes), drawn after the model's weights."""
    import torch
    device = torch.device(args.device)
    model = build_model(args).to(device=device, dtype=weight_dtype(args)).train()
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), device=device)
    labels = torch.randint(0, 2, (args.batch,), device=device)
    return model, (ids, labels)


GHOSTDP_MODES = ("ghost", "bookkeeping")  # the modes trained with a ghostdp package


def make_step(mode, model, args, batch, library=None, compile_backend=None):
    """A closure running one full training step (forward, backward, optimizer step). ``library``: the
    ghostdp package to train with (another version of it: profiling.step_ratio --against); default ghostdp.
    ``compile_backend``: the forward runs through torch.compile with this backend (profiling.compiled)."""
    import torch
    ids, labels = batch
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch)
    if mode in GHOSTDP_MODES:
        if library is None:
            import ghostdp as library
        engine = library.PrivacyEngine(accountant="rdp", seed=0)
        # Every step takes the same batch, not one the returned loader yields: accounted on its own, warned of.
        warnings.filterwarnings("ignore", message="with poisson_sampling=False this step's batch did not come")
        model, optimizer, criterion, _ = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
            noise_multiplier=1.0, max_grad_norm=1.0, clipping=mode, poisson_sampling=False)  # its own batch
    elif mode != "plain":
        from opacus import PrivacyEngine
        engine = PrivacyEngine(accountant="rdp")
        grad_sample_mode = mode.split("-")[1]
        made = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                   criterion=criterion, noise_multiplier=1.0,
                                   max_grad_norm=1.0, grad_sample_mode=grad_sample_mode, poisson_sampling=False)
        model, optimizer = made[0], made[1]
        criterion = made[2] if grad_sample_mode == "ghost" else criterion

    autocast = getattr(args, "dtype", "fp32") == "amp"
    device_type = ids.device.type
    forward = model if compile_backend is None else torch.compile(model, backend=compile_backend)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss = criterion(forward(input_ids=ids).logits.float(), labels)
        loss.backward()
        optimizer.step()
    step.controller = engine.controller if mode in GHOSTDP_MODES else None
    return step


def _proof_layouts(step):
    """The LayoutProver of the step's ghostdp controller (its count of norm passes and its schedule of proofs),
    or None: plain, Opacus, or a ghostdp from before the schedule."""
    layouts = getattr(getattr(getattr(step, "controller", None), "pass_one", None), "layouts", None)
    return layouts if hasattr(layouts, "reproof_every") else None


def to_a_step_between_proofs(step):
    """Runs ``step`` until ghostdp's next step proves no layout again (clipping.layout.proof_scheduled): the
    step measured alone is then a steady one (the first step, also proving, is in the whole run's peak)."""
    _run_until(step, proof=False)


def to_a_proof_step(step) -> bool:
    """Runs ``step`` until ghostdp's next step is one its schedule proves again; False (nothing run) where there is
    no such step: plain, Opacus, or the schedule switched off."""
    return _run_until(step, proof=True)


def _run_until(step, proof: bool) -> bool:
    layouts = _proof_layouts(step)
    if layouts is None or (proof and not layouts.reproof_every):
        return False
    from ghostdp.clipping.layout import proof_scheduled
    while proof_scheduled(layouts.passes, layouts.reproof_every) != proof:
        step()
    return True


def steady_and_proof_peaks(step) -> tuple:
    """(tensor peak of a step between ghostdp's scheduled proofs, of a proof step (a layout proof and the forward
    check's reruns: clipping.layout.proof_scheduled) or None without them), each measured right after a profiled
    step: torch.profiler misreads a step that frees tensors allocated outside any profiled step (the last step's
    p.grad, freed by zero_grad), by their size either way (BERT L=4, H=256, B=16: plain read 140 MB in its first
    profiled step, 97 MB in each later one; a synthetic step 20 against 30 MB). A run's peak is the larger."""
    layouts = _proof_layouts(step)
    if layouts is None or not layouts.reproof_every:
        tensor_peak_mb(step)
        return tensor_peak_mb(step), None
    from ghostdp.clipping.layout import proof_scheduled

    def scheduled(n):
        return proof_scheduled(n, layouts.reproof_every)

    while not scheduled(layouts.passes + 1):  # unprofiled up to the step before a proof
        step()
    tensor_peak_mb(step)
    proof = tensor_peak_mb(step)
    while scheduled(layouts.passes):  # proofs in a row (1, 2)
        tensor_peak_mb(step)
    return tensor_peak_mb(step), proof


def count_aten_ops(step) -> int:
    """ATen operators one call of ``step`` dispatches (each op once, at the backend level), counted on the
    second of two calls: under a dispatch mode autograd records some ops with other node types (reshape's
    alias node), so the first step's graph is new to ghostdp and takes a layout proof (audit.py); and a step
    between the proofs that ghostdp repeats on a schedule (to_a_step_between_proofs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        step()
        to_a_step_between_proofs(step)
        Counter.count = 0
        step()
    return Counter.count


def timed(step, device) -> float:
    """Seconds of one call of ``step``, the device synchronised before and after (CUDA runs asynchronously)."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args) -> dict:
    from ghostdp.memory import peak_mb_since, reset_peak
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = torch.device(args.device)
    model, batch = model_and_batch(args)
    step = make_step(args.mode, model, args, batch)
    cuda = device.type == "cuda"
    base = reset_peak(device)
    times = [timed(step, device) for _ in range(args.steps)]
    peak = peak_mb_since(device, base)
    proof_peak = None
    if not cuda and getattr(args, "cpu_memory", "rss") == "tensors":
        peak, proof_peak = steady_and_proof_peaks(step)
    warm = sorted(times[args.warmup:])
    return {"median_ms": 1e3 * warm[len(warm) // 2], "peak_mb": peak, "proof_peak_mb": proof_peak}


def tensor_peak_mb(step) -> float:
    """The peak of live CPU tensor bytes during one call of ``step``, above those alive when it starts,
    from torch.profiler's memory timeline (every allocation and free of a tensor, in order).

    Right only on a call made right after a profiled call of the same step: the CPU allocator tells the profiler
    the size of a freed block from a table it fills only while profiling (c10's ProfiledCPUMemoryReporter), and
    a table entry of a block freed unprofiled stays behind. So the first profiled call reads a free of a tensor
    allocated unprofiled (the last step's p.grad, freed by zero_grad) as nothing, or as the size of an older
    tensor that had its address: by how much depends on where malloc placed what, so on the process (a 2-layer
    Linear stack's two-pass step read 0.0265 MB on every second call and 0.0357 to 0.0396 MB on first calls in
    ten processes; the lower of a first and a second call read 0.0226 MB once in CI, 2026-11-27)."""
    import tempfile
    import warnings
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        with warnings.catch_warnings():  # "deprecated" in favour of a CUDA-only memory history
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device="cpu")  # [times, bytes by category at each time]
        with open(path) as f:
            _, sizes = json.load(f)
    totals = [sum(row) for row in sizes]
    return (max(totals) - totals[0]) / 2 ** 20  # the first row: the tensors alive before the step


# ----------------------------------------------------------------------------- the driver
def run_fresh(args, mode, batch) -> dict:
    """One measurement in a new Python process (no caches, allocator state or hooks shared)."""
    argv = [sys.executable, "-m", "profiling.bench", "--worker", "--mode", mode, "--batch", str(batch)]
    for key in ("model", "layers", "hidden", "heads", "vocab", "seq", "steps", "warmup", "device", "dtype",
                "threads", "cpu_memory"):
        value = getattr(args, key)
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    if args.freeze_embeddings:
        argv.append("--freeze-embeddings")
    if args.train != "all":
        argv += ["--train", args.train]
    if getattr(args, "checkpointing", None):
        argv += ["--checkpointing", args.checkpointing]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(argv, capture_output=True, text=True, cwd=root, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "out of memory" in done.stderr.lower() or done.returncode in (-9, 137):
            error = "out of memory"
        return {"error": error[:160]}
    return json.loads(lines[-1])


def available(mode) -> bool:
    if not mode.startswith("opacus"):
        return True
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def largest_batch(args, mode, budget_mb, start) -> int:
    """The largest batch whose peak memory stays within budget_mb: doubling, then bisection."""
    def fits(batch):
        result = run_fresh(args, mode, batch)
        return "error" not in result and result["peak_mb"] <= budget_mb
    if not fits(1):
        return 0
    low, high = 1, max(2, start)
    while fits(high):
        low, high = high, high * 2
    while high - low > max(1, low // 16):  # within about 6%
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def print_table(results, modes, batches):
    """One row per mode and batch. With --cpu-memory tensors, ghostdp's rows also give the peak of a step that
    its schedule proves again (steady_and_proof_peaks), against plain's steady peak: the run's peak is the larger."""
    proofs = any(r.get("proof_peak_mb") is not None for by_batch in results.values() for r in by_batch.values())
    print(f"{'mode':<14}{'batch':>6}{'step ms':>10}{'peak MB':>10}{'time/plain':>12}{'mem/plain':>11}"
          + (f"{'proof MB':>10}{'proof/plain':>13}" if proofs else ""))
    for b in batches:
        plain = results["plain"][b]
        for mode in modes:
            r = results[mode][b]
            if "error" in r:
                print(f"{mode:<14}{b:>6}   failed: {r['error']}")
                continue
            ratios, proof = "", ""
            if "error" not in plain:
                ratios = f"{r['median_ms'] / plain['median_ms']:>11.2f}x{r['peak_mb'] / plain['peak_mb']:>10.2f}x"
            if r.get("proof_peak_mb") is not None:
                proof = f"{r['proof_peak_mb']:>10.0f}"
                if "error" not in plain:
                    proof += f"{r['proof_peak_mb'] / plain['peak_mb']:>12.2f}x"
            print(f"{mode:<14}{b:>6}{r['median_ms']:>10.1f}{r['peak_mb']:>10.0f}{ratios}{proof}")


def plot(results, modes, batches, budget, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = 3 if budget else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for key, ax, label in (("median_ms", axes[0], "median step time (ms)"), ("peak_mb", axes[1], "peak memory (MB)")):
        for mode in modes:
            points = [(b, results[mode][b][key]) for b in batches if "error" not in results[mode][b]]
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend()
    if budget:
        names = list(budget)
        axes[2].bar(names, [budget[m] for m in names])
        axes[2].set_ylabel("largest batch within budget")
        axes[2].tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path = os.path.join(out, "bench.png")
    fig.savefig(path, dpi=100)
    return path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model options shared by bench and layers (defaults: the issue's BERT L=2, H=256, T=128)."""
    p.add_argument("--model", default="bert", choices=["bert", "gpt2", "bert-lora", "gpt2-lora", "llama-lora",
                                                            "torch-encoder", "torch-encoder-fixed"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--freeze-embeddings", action="store_true", help="so that Opacus can run on BERT")
    p.add_argument("--train", default="all", choices=["all", "last-layer"],
                   help="last-layer: only BERT's last encoder layer, pooler and classifier train (the Fast "
                        "Gradient Clipping post's set-up)")
    p.add_argument("--checkpointing", nargs="?", const="non-reentrant", choices=["non-reentrant", "reentrant"],
                   help="activation checkpointing of every layer, in every mode (default: non-reentrant)")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", default=[16])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=list(WEIGHT_DTYPES),
                   help="amp: float32 weights, forward and loss under bf16 autocast")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-memory", default="rss", choices=["rss", "tensors"],
                   help="on CPU, peak resident set size (default) or the exact peak of live tensor bytes (of a step "
                        "between ghostdp's scheduled proofs, and of one of those)")
    p.add_argument("--budget-mb", type=float, default=None, help="find each mode's largest batch within this")
    p.add_argument("--repeats", type=int, default=1, help="measure each point this many times, keep the median")
    p.add_argument("--out", default="profiling_output")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the median is taken over the "
                "steps after the warm-up ones")
    return args


def main(argv=None):
    args = parse(argv)
    if args.worker:
        print(json.dumps(measure(args)))
        return None
    modes = [m for m in args.modes if available(m)]
    skipped = [m for m in args.modes if m not in modes]
    if skipped:
        print(f"skipped {skipped}: opacus is not installed (pip install 'ghostdp[compare]')")
    if "plain" not in modes:
        modes.insert(0, "plain")
    results = {m: {} for m in modes}
    for b in args.batches:
        for _ in range(args.repeats):  # interleave modes so drift hits all of them alike
            for mode in modes:
                r = run_fresh(args, mode, b)
                results[mode].setdefault(b, []).append(r)
    for mode in modes:
        for b in args.batches:
            runs = [r for r in results[mode][b] if "error" not in r]
            if not runs:
                results[mode][b] = results[mode][b][0]
                continue
            runs.sort(key=lambda r: r["median_ms"])
            proofs = sorted(r["proof_peak_mb"] for r in runs if r.get("proof_peak_mb") is not None)
            results[mode][b] = {"median_ms": runs[len(runs) // 2]["median_ms"],
                                "peak_mb": sorted(r["peak_mb"] for r in runs)[len(runs) // 2],
                                "proof_peak_mb": proofs[len(proofs) // 2] if proofs else None}
    print(f"{args.model} L={args.layers} H={args.hidden} T={args.seq} {args.dtype} on {args.device}"
          f"{', embeddings frozen' if args.freeze_embeddings else ''}"
          f"{', only the last layer, pooler and classifier train' if args.train == 'last-layer' else ''}"
          f"{f', {args.checkpointing} activation checkpointing' if args.checkpointing else ''}; {args.steps} steps, median of the last "
          f"{args.steps - args.warmup}, each mode in a fresh process")
    print_table(results, modes, args.batches)
    budget = None
    if args.budget_mb:
        budget = {m: largest_batch(args, m, args.budget_mb, max(args.batches)) for m in modes}
        print(f"largest batch within {args.budget_mb:.0f} MB: " + ", ".join(f"{m} {b}" for m, b in budget.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": {m: {str(b): r for b, r in v.items()} for m, v in results.items()},
                   "largest_batch": budget}, f, indent=1)
    print(f"wrote {plot(results, modes, args.batches, budget, args.out)} and results.json")
    return results


if __name__ == "__main__":
    main()
