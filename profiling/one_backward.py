"""What book-keeping would keep against what the graph saved, and the peak of each way, for full fine-tuning.

    python -m profiling.one_backward                                  # the table of modes.KEPT_OF_SAVED, CPU
    python -m profiling.one_backward --model bert --layers 12 --hidden 768 --heads 12 --seq 128 --batch 32 \\
        --dtype bf16 --device cuda                                    # BERT-base on a GPU

A two-pass step takes book-keeping's one backward where what book-keeping keeps is at most KEPT_OF_SAVED of the
bytes the graph saved (clipping/modes.py). For each set-up this prints the measure the controller took (kept /
saved), the mode its steps then take, and the peak above the step's start of three steps in their own models:
two passes (the switch off), book-keeping, and two passes with the switch on, which must equal the lower of the
two where it switches. Peaks: on CPU the exact tensor bytes of one step (profiling.bench.tensor_peak_mb); on CUDA
the peak allocated. Models: ``gpt2-lm`` (a causal LM with its tied head, the mean token loss per example),
``bert`` (sequence classification), ``linear`` (a stack of Linear layers and ReLUs on (batch, seq, hidden)).
Without ``--model``, the set-ups measured on 2026-11-26 and 2026-11-27 for modes.KEPT_OF_SAVED.
"""
from __future__ import annotations

import argparse
import warnings

SET_UPS = [  # (model, layers, hidden, vocab, seq, batch, dtype)
    ("gpt2-lm", 4, 256, 8192, 256, 8, "fp32"), ("gpt2-lm", 4, 256, 8192, 64, 8, "fp32"),
    ("gpt2-lm", 4, 256, 2048, 256, 8, "bf16"), ("bert", 4, 256, 1000, 128, 16, "fp32"),
    ("bert", 4, 256, 1000, 160, 8, "fp32"), ("bert", 4, 256, 1000, 256, 8, "fp32"),
    ("bert", 4, 256, 1000, 32, 16, "bf16"), ("bert", 4, 256, 1000, 256, 8, "bf16"),
    ("bert", 4, 256, 1000, 320, 4, "bf16"), ("bert", 4, 256, 1000, 512, 4, "bf16"),
    ("linear", 4, 256, 0, 16, 64, "fp32"),
]


def build(kind, layers, hidden, vocab, seq, heads=4):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if kind == "gpt2-lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                          n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=max(seq, 512), hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=2))
    stack = []
    for _ in range(layers):
        stack += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*stack, torch.nn.Linear(hidden, 2))


def make_step(kind, model, batch, clipping=None):
    """One step of ``model`` on ``batch``: plain (``clipping`` None) or private with a ghostdp controller."""
    import torch
    import torch.nn.functional as F

    import ghostdp
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    controller = None if clipping is None else ghostdp.GhostClipping(model, 1.0, clipping=clipping)

    def step():
        optimizer.zero_grad(set_to_none=True)
        if kind == "linear":
            losses = model(batch).float().pow(2).mean((1, 2))
        elif kind == "gpt2-lm":
            logits = model(input_ids=batch).logits[:, :-1].float()
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                     reduction="none").view(len(batch), -1).mean(1)
        else:
            losses = F.cross_entropy(model(input_ids=batch).logits.float(), batch[:, 0] % 2, reduction="none")
        (losses.mean() if controller is None else controller.loss(losses)).backward()
        optimizer.step()
    step.controller = controller
    return step


def peak_mb(step, device) -> float:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    from profiling.bench import tensor_peak_mb
    tensor_peak_mb(step)  # profiled, so that the next read is right (bench.tensor_peak_mb)
    return tensor_peak_mb(step)


def measure(kind, layers, hidden, vocab, seq, batch_size, dtype="fp32", device="cpu", heads=4) -> dict:
    """{mode: peak MB} for plain, two passes, book-keeping and two passes that may switch; the measure and mode."""
    import torch

    from ghostdp.clipping import modes
    device = torch.device(device)
    weights = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(1)
    batch = (torch.randn(batch_size, seq, hidden, dtype=weights) if kind == "linear"
             else torch.randint(0, vocab, (batch_size, seq))).to(device)
    out, switch = {}, modes.ONE_BACKWARD_WHERE_KEEPING_LITTLE
    try:
        for name, clipping, switching in (("plain", None, False), ("two passes", "ghost", False),
                                          ("book-keeping", "bookkeeping", False), ("ghost", "ghost", True)):
            modes.ONE_BACKWARD_WHERE_KEEPING_LITTLE = switching
            step = make_step(kind, build(kind, layers, hidden, vocab, seq, heads).to(device, weights).train(), batch,
                             clipping)
            for _ in range(3):
                step()
            out[name] = peak_mb(step, device)
            if switching:
                out["kept / saved"] = step.controller.step_modes.kept_of_saved
                out["mode"] = step.controller.mode_for_loss().name
    finally:
        modes.ONE_BACKWARD_WHERE_KEEPING_LITTLE = switch
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["gpt2-lm", "bert", "linear"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    set_ups = SET_UPS if args.model is None else [(args.model, args.layers, args.hidden, args.vocab, args.seq,
                                                   args.batch, args.dtype)]
    print(f"{'set-up':44s} {'kept/saved':>10s} {'mode':>12s}   peak MB: {'plain':>8s} {'two passes':>10s} "
          f"{'book-keeping':>12s} {'ghost':>8s}")
    rows = []
    for kind, layers, hidden, vocab, seq, batch, dtype in set_ups:
        got = measure(kind, layers, hidden, vocab, seq, batch, dtype, args.device, args.heads)
        vocabulary = f" V={vocab}" if kind != "linear" else ""
        label = f"{kind} L={layers} H={hidden}{vocabulary} T={seq} B={batch} {dtype}"
        ratio = got["kept / saved"]
        print(f"{label:44s} {('-' if ratio is None else f'{ratio:.2f}'):>10s} {got['mode']:>12s}   "
              f"{got['plain']:17.2f} {got['two passes']:10.2f} {got['book-keeping']:12.2f} {got['ghost']:8.2f}")
        rows.append((label, got))
    return rows


if __name__ == "__main__":
    main()
