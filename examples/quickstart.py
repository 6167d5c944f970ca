"""Ghost clipping on a small BERT, on synthetic data: exactness and cost next to plain training.

Runs on CPU in about a minute. It shows:
1. the clipped gradient sum from ghostdp equals a per-example autograd loop (float64);
2. a few clipped training steps, and their time next to ordinary (non-private) steps.
Full DP-SGD (noise, Poisson sampling, accounting) through ghostdp.PrivacyEngine: examples/mnist_style_cnn.py.
"""
import argparse
import time

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

import ghostdp


def make_model(dtype):
    cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).to(dtype)


def batch(B, T, generator):
    ids = torch.randint(1, 500, (B, T), generator=generator)
    labels = (ids[:, 0] > 250).long()  # a learnable rule: the first token's id
    return ids, labels


def exactness(B=8, T=16):
    torch.manual_seed(0)
    model = make_model(torch.float64)
    ids, labels = batch(B, T, torch.Generator().manual_seed(1))
    ce = nn.CrossEntropyLoss()
    C = 0.05
    controller = ghostdp.GhostClipping(model, C)
    controller.criterion(ce)(model(input_ids=ids).logits, labels).backward()
    ghost = torch.cat([p.grad.flatten() for p in model.parameters()])
    controller.detach()
    ref = torch.zeros_like(ghost)
    for i in range(B):
        model.zero_grad()
        ce(model(input_ids=ids[i:i + 1]).logits, labels[i:i + 1]).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters()])
        ref += min(1.0, C / (float(g.norm()) + 1e-6)) * g
    return float((ghost - ref).abs().max() / ref.abs().max())


def train(private, steps, B, T, lr):
    torch.manual_seed(0)
    model = make_model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ce = nn.CrossEntropyLoss()
    criterion = ghostdp.GhostClipping(model, 1.0).criterion(ce) if private else ce
    gen = torch.Generator().manual_seed(2)
    times, losses = [], []
    for step in range(steps):
        ids, labels = batch(B, T, gen)
        start = time.perf_counter()
        opt.zero_grad()
        loss = criterion(model(input_ids=ids).logits, labels)
        loss.backward()
        if private:  # the clipped *sum* is in p.grad; average it like the mean loss does
            for p in model.parameters():
                p.grad /= B
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    ids, labels = batch(256, T, torch.Generator().manual_seed(3))
    with torch.no_grad():
        acc = float((model.eval()(input_ids=ids).logits.argmax(1) == labels).float().mean())
    return sorted(times[2:])[len(times[2:]) // 2], losses, acc


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"1) exactness, float64, every example clipped: max relative error {exactness():.2e}")
    plain_t, plain_losses, plain_acc = train(False, args.steps, args.batch_size, args.seq_len, 1e-3)
    ghost_t, ghost_losses, ghost_acc = train(True, args.steps, args.batch_size, args.seq_len, 1e-3)
    print(f"2) {args.steps} steps, batch {args.batch_size}, {args.seq_len} tokens, all parameters trainable")
    print(f"   plain:          median step {plain_t * 1e3:7.1f} ms, final loss {plain_losses[-1]:.3f}, "
          f"accuracy {plain_acc:.3f}")
    print(f"   ghost clipping: median step {ghost_t * 1e3:7.1f} ms, final loss {ghost_losses[-1]:.3f}, "
          f"accuracy {ghost_acc:.3f}   ({ghost_t / plain_t:.2f}x plain)")


if __name__ == "__main__":
    main()
