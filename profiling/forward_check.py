"""The forward check's margins on a device: how far models that keep their examples apart move, and what it finds.

    python -m profiling.forward_check                        # CPU, float32 and bfloat16
    python -m profiling.forward_check --device cuda --dtypes float32 bfloat16 float16

ghostdp reruns the model's forward on scheduled steps with the batch's first (or last) example copied to every row
and refuses a move of that example's output beyond what rounding allows (ghostdp/clipping/independence.py:
the forward's spread and a floor, 2^-14 of the output or 8 units in the last place of a 16-bit dtype). The floor
was set on a CPU, where models that keep their examples apart move by exactly 0. On a GPU a 16-bit model whose
kernels depend on the batch's content could move by more: an attention mask of all ones that transformers drops
(the copied example is unpadded, the last one the only padded), a mixture of experts whose experts see other token
counts. Per model and dtype this prints the largest relative move of the copied examples' outputs, the threshold it
had to pass, and whether the check would refuse (it must not); the same for the padding check
(ghostdp/clipping/padding.py: the batch padded by 8 more positions in eval() mode, outputs compared at the real
positions: another kernel for a longer sequence rounds otherwise) and for the batch without its last example, the
others reversed (eval() mode: another kernel for a smaller batch, every example in another row); a BERT with a head
that means over the padding must be found by the padding check; and, for a detached batch mean before a Linear (a
model that mixes), the largest batch at which the check still finds it. Each figure comes from one checked forward
of a fresh model (seeded). On a CPU (2026-12-02) the detached mean is found up to B = 16384 in float32 and bfloat16,
the largest tried (before that day's copies of one example, up to 4096 and 8); the removal's reversed rows (later
that day) move the models that keep their examples apart by exactly 0 there, in both.
"""
from __future__ import annotations

import argparse

BATCH, LENGTH, VOCAB = 8, 32, 1000


def _models():
    """name -> (build, whether its batch is text whose last example alone is padded, whether its outputs depend on
    the padding: a check that must find it)."""
    import torch
    from torch import nn
    import transformers as tf

    small = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
                 max_position_embeddings=64)

    class DetachedMean(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(x - x.detach().mean(0, keepdim=True))

    class MeanOverPadding(nn.Module):
        """BERT's encoder and a head on the mean over all positions, the padding included."""

        def __init__(self):
            super().__init__()
            self.encoder, self.head = tf.BertModel(tf.BertConfig(**small)), nn.Linear(64, 2)

        def forward(self, input_ids, attention_mask):
            return self.head(self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.mean(1))

    return {
        "bert (sdpa)": (lambda: tf.BertForSequenceClassification(tf.BertConfig(**small)), True, False),
        "llama (sdpa)": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **small)), True, False),
        "mixtral (4 experts, top 2)": (lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small)), True, False),
        "bert, mean over padding": (MeanOverPadding, True, True),
        "detached batch mean": (DetachedMean, False, False),
    }, torch


def _largest(moves):
    largest = max(moves, key=lambda m: m.relative, default=None)
    return (0.0, 0.0) if largest is None else (largest.relative, largest.threshold)


def checked_forward(build, text: bool, dtype, device, batch: int = BATCH):
    """One checked forward of a fresh model: (largest relative move, its threshold, whether it was found) of the
    replaced example and, for text, of the padding check."""
    import torch
    import ghostdp
    from ghostdp.clipping import independence
    torch.manual_seed(0)
    model = build().to(device=device, dtype=dtype).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        if text:
            ids = torch.randint(1, VOCAB, (batch, LENGTH), device=device)
            mask = torch.ones(batch, LENGTH, dtype=torch.long, device=device)
            mask[-1, LENGTH // 2:] = 0  # the only padded example: the first's copies make the mask all ones
            model(input_ids=ids, attention_mask=mask)
        else:
            model(torch.randn(batch, 64, device=device, dtype=dtype))
        check = controller.independence
        padding = (*_largest(check.last_padding_moves), check.padding_finding is not None)
        # The finding is the replaced example's, else a removed one's (the last, the first or the middle one)
        removals = (independence.REMOVED, independence.REMOVED_FIRST, independence.REMOVED_MIDDLE)
        replaced_found = check.finding is not None and check.finding.how not in removals
        removed_found = check.finding is not None and check.finding.how in removals
        removal_moves = check.last_removal_moves + check.last_first_removal_moves + check.last_middle_removal_moves
        return (*_largest(check.last_moves), replaced_found, *padding, *_largest(removal_moves), removed_found)
    finally:
        controller.detach()


def largest_batch_found(build, dtype, device, batches) -> int | None:
    """The largest of ``batches`` at which the check finds the mixing model's mixing."""
    found = [b for b in batches if checked_forward(build, False, dtype, device, batch=b)[2]]
    return max(found, default=None)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--models", nargs="+", default=None, help="a subset of the model names (default: all)")
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 16, 32, 64, 256, 1024, 4096],
                        help="batch sizes tried for the mixing model's detection limit")
    args = parser.parse_args(argv)
    models, torch = _models()
    device = torch.device(args.device)
    names = args.models or list(models)
    rows = []
    print(f"forward check on {device}: largest relative move / threshold of the first's or the last example's output "
          "with it copied to every row; of the outputs at the real positions of the batch padded further; of the "
          "other examples' outputs without the last one (the others reversed), the first or the middle one")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for name in names:
            build, text, mixes_padding = models[name]
            if text:
                (move, threshold, found, padding_move, padding_threshold, padding_found, removal_move,
                 removal_threshold, removal_found) = checked_forward(build, True, dtype, device)
                rows.append(dict(model=name, dtype=dtype_name, move=move, threshold=threshold, found=found,
                                 padding_move=padding_move, padding_threshold=padding_threshold,
                                 padding_found=padding_found, removal_move=removal_move,
                                 removal_threshold=removal_threshold, removal_found=removal_found))
                cells = []
                for m, t, f, must in ((move, threshold, found, False),
                                      (padding_move, padding_threshold, padding_found, mixes_padding),
                                      (removal_move, removal_threshold, removal_found, False)):
                    verdict = ("found" if f else "MISSED") if must else ("REFUSED (a false refusal)" if f else "passes")
                    cells.append(f"{m:9.3g} / {t:8.3g} {verdict}")
                print(f"{dtype_name:9s} {name:28s} " + ";  ".join(cells))
            else:
                limit = largest_batch_found(build, dtype, device, args.batches)
                rows.append(dict(model=name, dtype=dtype_name, largest_batch_found=limit))
                print(f"{dtype_name:9s} {name:28s} found up to B = {limit} of {args.batches}")
    return rows


if __name__ == "__main__":
    main()
