"""Median step time of ghost clipping vs plain training, one process, side by side.

python profiling/step_ratio.py [--layers 2 --hidden 256 --batch 16 --seq 128 --steps 10]
A first probe until the full suite (issue 5): prints both medians and their ratio.
"""
import argparse
import time

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

import ghostdp


def median_step(private, args):
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        intermediate_size=4 * args.hidden, num_labels=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ce = nn.CrossEntropyLoss()
    criterion = ghostdp.GhostClipping(model, 1.0).criterion(ce) if private else ce
    ids = torch.randint(0, 30522, (args.batch, args.seq))
    labels = torch.randint(0, 2, (args.batch,))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        criterion(model(input_ids=ids).logits, labels).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    warm = sorted(times[2:])
    return warm[len(warm) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    for name, default in [("layers", 2), ("hidden", 256), ("batch", 16), ("seq", 128), ("steps", 10)]:
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    plain_a = median_step(False, args)
    ghost = median_step(True, args)
    plain_b = median_step(False, args)  # plain twice, around ghost, to expose drift
    print(f"plain {plain_a * 1e3:.0f} / {plain_b * 1e3:.0f} ms, ghost {ghost * 1e3:.0f} ms, "
          f"ratio {ghost / min(plain_a, plain_b):.2f}")


if __name__ == "__main__":
    main()
