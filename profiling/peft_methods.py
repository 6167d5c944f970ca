"""Step-time ratios to plain training for peft's methods, on the CPU: which adapters take a rule, at what cost.

    python -m profiling.peft_methods                                  # every method, 20 interleaved rounds
    python -m profiling.peft_methods --methods lora loha prompt --against 2a21944

A tiny BERT (L=2, H=64, 4 heads, B=16, T=32, vocabulary 2000, no dropout, one CPU thread) with each method on query
and value (unless its name says otherwise), and a 3-layer convolution net (32 channels, 16x16 images, B=32) with the
methods that adapt convolutions on its last two layers ("conv-" rows). The modes' steps (plain, book-keeping, ghost,
and with ``--against REF`` the ghostdp modes of that revision) are built in one process and interleaved round by round
(profiling.step_ratio); the table gives the median over rounds of each round's step / plain step, the median step,
and the modules that take the exact fallback in this checkout.

The layout proof runs on steps 1, 2, 4, 8, 16, ... and costs more: keep --rounds at 15 or more, so that the medians
are of steps without it.

Measured 2026-12-03 (a scratch script of the same models, steps through PrivacyEngine with its noise; 20 rounds,
12-15 for the convolution net; this module's own run agreed within 0.1x: LoRA 1.38x / 1.41x, LoHa 1.77x / 1.78x,
prompt tuning 1.29x / 1.26x), book-keeping /
ghost, against the fallback before: LoHa 3.19x / 3.05x -> 1.81x / 1.76x, LoKr 3.40x / 3.51x -> 1.71x / 1.69x, OFT
3.10x / 3.06x -> 1.70x / 1.69x, HRA 3.28x -> 1.77x, BOFT 4.51x -> 2.13x, trainable tokens 2.04x / 1.94x -> 1.40x /
1.36x, prompt tuning and p-tuning (failed before) 1.30x / 1.27x and 1.44x / 1.44x; LoRA 1.46x / 1.43x; on the
convolution net LoHa 8.62x -> 1.63x, LoKr 9.17x -> 1.44x, OFT 24.6x -> 1.99x (book-keeping). Late 2026-12-03
(--against 767135b, 20 rounds), the adapters of norms/peft_deltas.py against the fallback before: FourierFT 3.42x /
3.39x -> 2.16x / 2.24x, WaveFT 3.08x / 3.21x -> 2.27x / 2.13x, RandLoRA 6.14x / 6.03x -> 2.91x / 2.95x, DeLoRA 2.89x /
2.99x -> 1.95x / 2.08x, GraLoRA 5.65x / 5.70x -> 2.04x / 2.16x, C3A 7.36x / 8.46x -> 1.73x / 2.13x, HiRA 3.22x / 3.17x
-> 1.86x / 1.98x; VB-LoRA 5.32x / 4.92x and SHiRA 4.73x / 4.72x, still by the fallback. 2026-12-07 (--against
a62ea1b, 20 rounds), the rest of them by that module's rule against the fallback: SHiRA 6.57x / 6.49x -> 1.74x / 1.88x,
VB-LoRA 5.38x / 5.34x -> 2.15x / 2.25x, UniLoRA 5.11x / 5.37x -> 1.90x / 2.08x; TinyLoRA (refused before 54bed3f,
then by the fallback) 3.98x / 4.37x -> 1.91x / 2.32x (--against 54bed3f, a test run sharing the cores). Timings are the
shared machine's: compare the ratios of one run.
"""
from __future__ import annotations

import warnings

from profiling.families import measure_model, table_main
_QV = ["query", "value"]
# method -> (model, peft config maker): "bert" is the tiny BERT, "conv" the convolution net
METHODS = {
    "lora": ("bert", lambda peft: peft.LoraConfig(r=8, target_modules=_QV, lora_dropout=0.0)),
    "lora-embeddings": ("bert", lambda peft: peft.LoraConfig(r=8, target_modules=_QV + ["word_embeddings"],
                                                             lora_dropout=0.0)),
    "dora": ("bert", lambda peft: peft.LoraConfig(r=8, target_modules=_QV, lora_dropout=0.0, use_dora=True)),
    "ia3": ("bert", lambda peft: peft.IA3Config(target_modules=["key", "value", "output.dense"],
                                                feedforward_modules=["output.dense"])),
    "adalora": ("bert", lambda peft: peft.AdaLoraConfig(target_modules=_QV, total_step=10, init_r=8, target_r=8,
                                                        orth_reg_weight=0.0)),
    "vera": ("bert", lambda peft: peft.VeraConfig(r=8, target_modules=_QV)),
    "loha": ("bert", lambda peft: peft.LoHaConfig(r=8, target_modules=_QV)),
    "lokr": ("bert", lambda peft: peft.LoKrConfig(r=8, target_modules=_QV)),
    "oft": ("bert", lambda peft: peft.OFTConfig(r=8, oft_block_size=0, target_modules=_QV)),
    "hra": ("bert", lambda peft: peft.HRAConfig(r=8, target_modules=_QV)),
    "boft": ("bert", lambda peft: peft.BOFTConfig(boft_block_size=4, target_modules=_QV)),
    "fourierft": ("bert", lambda peft: peft.FourierFTConfig(n_frequency=256, target_modules=_QV)),
    "waveft": ("bert", lambda peft: peft.WaveFTConfig(n_frequency=256, target_modules=_QV)),
    "randlora": ("bert", lambda peft: peft.RandLoraConfig(r=8, target_modules=_QV)),
    "delora": ("bert", lambda peft: peft.DeloraConfig(r=8, target_modules=_QV)),
    "gralora": ("bert", lambda peft: peft.GraloraConfig(r=8, gralora_k=2, target_modules=_QV)),
    "c3a": ("bert", lambda peft: peft.C3AConfig(block_size=16, target_modules=_QV)),
    "hira": ("bert", lambda peft: peft.HiraConfig(r=8, target_modules=_QV)),
    "vblora": ("bert", lambda peft: peft.VBLoRAConfig(r=4, num_vectors=64, vector_length=16, target_modules=_QV)),
    "shira": ("bert", lambda peft: peft.ShiraConfig(r=8, target_modules=_QV)),
    "unilora": ("bert", lambda peft: peft.UniLoraConfig(r=8, theta_d_length=1024, target_modules=_QV)),
    "tinylora": ("bert", lambda peft: peft.TinyLoraConfig(r=8, target_modules=_QV)),
    "trainable-tokens": ("bert", lambda peft: peft.TrainableTokensConfig(target_modules=["word_embeddings"],
                                                                         token_indices=list(range(30)))),
    "prompt": ("bert", lambda peft: peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=8)),
    "p-tuning": ("bert", lambda peft: peft.PromptEncoderConfig(task_type="SEQ_CLS", num_virtual_tokens=8,
                                                               encoder_hidden_size=32)),
    "conv-loha": ("conv", lambda peft: peft.LoHaConfig(r=4, target_modules=["c2", "c3"], modules_to_save=["head"])),
    "conv-lokr": ("conv", lambda peft: peft.LoKrConfig(r=4, target_modules=["c2", "c3"], modules_to_save=["head"])),
    "conv-oft": ("conv", lambda peft: peft.OFTConfig(oft_block_size=32, target_modules=["c2", "c3"],
                                                     modules_to_save=["head"])),
}


def _bert():
    import torch
    import transformers
    config = transformers.BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return (transformers.BertForSequenceClassification(config), {"input_ids": torch.randint(0, 2000, (16, 32))},
            torch.randint(0, 2, (16,)))


def _conv():
    import types

    import torch
    from torch import nn

    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = (nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1),
                                         nn.Conv2d(32, 32, 3, padding=1))
            self.head = nn.Linear(32, 10)

        def forward(self, pixel_values):
            h = torch.relu(self.c3(torch.relu(self.c2(torch.relu(self.c1(pixel_values))))))
            return types.SimpleNamespace(logits=self.head(h.mean((2, 3))))

    return ConvNet(), {"pixel_values": torch.randn(32, 3, 16, 16)}, torch.randint(0, 10, (32,))


def measure(method: str, rounds: int, warmup: int, against: str | None) -> dict:
    """{row: (median ms, median ratio to plain)} of one method, and its fallback modules under "fallback"."""
    import peft
    import torch
    torch.manual_seed(0)
    kind, config = METHODS[method]
    base, inputs, labels = _bert() if kind == "bert" else _conv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's and ghostdp's notes on the configurations
        return measure_model(peft.get_peft_model(base, config(peft)), inputs, labels, rounds, warmup, against)


def main(argv=None) -> dict:
    return table_main(argv, __doc__, "methods", METHODS, measure, "method", width=18)


if __name__ == "__main__":
    main()
