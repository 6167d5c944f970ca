"""Step-time ratios to plain training for model families whose layers need rules of their own, on the CPU.

    python -m profiling.families                                   # every family, 20 interleaved rounds
    python -m profiling.families --families convnext vit --against 3de8fb7

A tiny configuration of each family (one CPU thread, B=2) is host-bound as profiling.overhead's BERT is, so a
module that takes the exact fallback (one batched VJP per chunk of examples, through the module's graph) where a
rule would do shows as a step several times plain. For each family the modes' steps (plain, book-keeping, ghost,
and with ``--against REF`` the ghostdp modes of that revision) are built in one process and interleaved round by
round (profiling.step_ratio.round_order); the table gives the median over rounds of each round's step / plain
step, the median step, and the modules that take the fallback in this checkout (trainable parameters, no rule).

Measured 2026-11-27 against 3de8fb7 (15 rounds; ConvBERT 20): book-keeping ConvNext 5.98x -> 3.05x (a depthwise
convolution was one factor per channel; its LayerNorm took the fallback), ConvNextV2 5.07x -> 2.38x (its GRN too),
ConvBERT 3.65x -> 2.05x (depthwise Conv1d, its separable convolution's bias); the others within noise. OPT and BART
against 4b409cc (20 rounds), their learned positional embeddings by a rule since then (they took the fallback):
book-keeping 2.10x -> 1.98x and 2.05x -> 1.94x, ghost 2.40x -> 2.25x and 2.32x -> 2.00x; at B=32, T=64 (OPT, 2 layers,
d=64, two threads, a scratch run) book-keeping 2.13x -> 1.56x. ConvNext's blocks' layer scales by a rule against
4b20105 (15 rounds): book-keeping 2.85x -> 2.59x, ghost 3.07x -> 2.69x (at B=32 on 64x64 images, two threads, a
scratch run: 3.39x -> 2.18x). T5 trained its relative attention bias through the fallback (the first attention of each
stack) until 2026-11-28 (looked up per example since: norms/relative_bias.py). Opacus's layers that took the fallback
until 2026-11-27, against 9c51384 (20 rounds): "embedding-bag" (nn.EmbeddingBag, mean) book-keeping 5.01x -> 4.49x,
ghost 5.53x -> 5.31x; "instance-norm" (two InstanceNorm2d) 3.97x -> 3.02x and 3.73x -> 3.26x; at B=2 the fallback is
cheap: at B=64 (one thread, a scratch run) the EmbeddingBag classifier (5000 x 64 table) took 294x plain through the
fallback and 7.2x by its rule (ghost), the InstanceNorm CNN (32 x 32 images) 13.1x and 2.3x. "conv-transpose" against
fed6f04 (20 rounds), its transposed convolutions by a rule since (the fallback's before): book-keeping 3.23x -> 2.75x,
ghost 3.82x -> 3.41x (at B=64, a scratch run: 12.6x -> 2.3x). Timings are the shared machine's: compare the ratios of
one run.
"""
from __future__ import annotations

import argparse
import copy

from profiling.revision import ghostdp_at
from profiling.step_ratio import ratios, run_rounds

MODES = ("bookkeeping", "ghost")


def _image_model(config_name, model_name, fix=False, **config):
    """``fix``: ghostdp.validate.fix first (Swin v2's self-attention: ghostdp.layers.swinv2)."""
    import torch
    import transformers

    def build():
        cfg = getattr(transformers, config_name)(num_labels=3, **config)
        size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
        model = getattr(transformers, model_name)(cfg)
        if fix:
            import ghostdp
            ghostdp.validate.fix(model)
        return model, {"pixel_values": torch.randn(2, 3, size, size)}
    return build


def _text_model(config_name, model_name, eos_token_id=None, fix=False, frozen=(), **config):
    """``eos_token_id``: each text ends in that token (BART's classification head reads it there); ``fix``:
    ghostdp.validate.fix first (DeBERTa's attention: ghostdp.layers.deberta); ``frozen``: the parameters whose names
    start so are frozen."""
    import torch
    import transformers

    def build():
        extra = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
        cfg = getattr(transformers, config_name)(vocab_size=100, num_labels=3, pad_token_id=0, **extra, **config)
        ids = torch.randint(1 if eos_token_id is None else 3, 100, (2, 8))  # BART's: 0-2 are its special tokens
        if eos_token_id is not None:
            ids[:, -1] = eos_token_id
        model = getattr(transformers, model_name)(cfg)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(frozen))
        if fix:
            import ghostdp
            ghostdp.validate.fix(model)
        return model, {"input_ids": ids}
    return build


def _speech_model(config_name, model_name, fix=False, **config):
    """A speech classifier on 2 x 1600 samples of noise, its feature encoder frozen as fine-tuning recipes freeze it;
    ``fix``: ghostdp.validate.fix first (WavLM's attention: ghostdp.layers.wavlm)."""
    import torch
    import transformers

    def build():
        model = getattr(transformers, model_name)(getattr(transformers, config_name)(num_labels=3, **config))
        model.freeze_feature_encoder()
        if fix:
            import ghostdp
            ghostdp.validate.fix(model)
        return model, {"input_values": torch.randn(2, 1600)}
    return build


def _torch_model(name):
    """A torch.nn model called as model(input=...).logits: "embedding-bag", a mean of nn.EmbeddingBag rows and a head;
    "instance-norm", two convolutions with InstanceNorm2d(affine=True); "conv-transpose", an image encoder-decoder
    whose upsampling path is three ConvTranspose2d (a generator's, or a segmentation net's)."""
    import types

    import torch
    from torch import nn

    class Logits(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, input):
            return types.SimpleNamespace(logits=self.layers(input))

    def build():
        if name == "embedding-bag":
            return Logits(nn.Sequential(nn.EmbeddingBag(100, 64, mode="mean"), nn.Linear(64, 3))), {
                "input": torch.randint(0, 100, (2, 8))}
        if name == "conv-transpose":
            return Logits(nn.Sequential(
                nn.Conv2d(3, 16, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 4, stride=2, padding=1),
                nn.ReLU(), nn.ConvTranspose2d(32, 32, 4, stride=2, padding=1), nn.ReLU(),
                nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(), nn.ConvTranspose2d(16, 3, 3, padding=1),
                nn.AdaptiveAvgPool2d(1), nn.Flatten())), {"input": torch.randn(2, 3, 16, 16)}
        return Logits(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.InstanceNorm2d(16, affine=True), nn.ReLU(),
                                    nn.Conv2d(16, 16, 3, padding=1), nn.InstanceNorm2d(16, affine=True), nn.ReLU(),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))), {
            "input": torch.randn(2, 3, 16, 16)}
    return build


_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
_VIT = {"image_size": 16, "patch_size": 4, "hidden_size": 64, "num_hidden_layers": 12, "num_attention_heads": 4,
        **_NO_DROPOUT}
_CONVNEXT = {"num_channels": 3, "num_stages": 4, "hidden_sizes": [16, 32, 64, 128], "depths": [2, 2, 4, 2],
             "image_size": 32}
_DECODER = {"hidden_size": 64, "num_hidden_layers": 12, "num_attention_heads": 4, "intermediate_size": 256}
_SPEECH = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 256,
           "conv_dim": (32, 32, 32), "conv_stride": (5, 2, 2), "conv_kernel": (10, 3, 3), "num_conv_pos_embeddings": 16,
           "num_conv_pos_embedding_groups": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0,
           "activation_dropout": 0.0, "feat_proj_dropout": 0.0, "layerdrop": 0.0, "final_dropout": 0.0,
           "mask_time_prob": 0.0, "classifier_proj_size": 32}
FAMILIES = {
    "convnext": _image_model("ConvNextConfig", "ConvNextForImageClassification", **_CONVNEXT),
    "convnextv2": _image_model("ConvNextV2Config", "ConvNextV2ForImageClassification", **_CONVNEXT),
    "vit": _image_model("ViTConfig", "ViTForImageClassification", intermediate_size=256, **_VIT),
    "deit": _image_model("DeiTConfig", "DeiTForImageClassification", intermediate_size=256, **_VIT),
    "dinov2": _image_model("Dinov2Config", "Dinov2ForImageClassification", mlp_ratio=4, **_VIT),
    "swinv2": _image_model("Swinv2Config", "Swinv2ForImageClassification", fix=True, image_size=32, patch_size=2,
                           embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4, drop_path_rate=0.0),
    "convbert": _text_model("ConvBertConfig", "ConvBertForSequenceClassification", **_DECODER, **_NO_DROPOUT),
    "falcon": _text_model("FalconConfig", "FalconForSequenceClassification", hidden_size=64, num_hidden_layers=12,
                          num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0),
    "olmo2": _text_model("Olmo2Config", "Olmo2ForSequenceClassification", **_DECODER),
    "opt": _text_model("OPTConfig", "OPTForSequenceClassification", hidden_size=64, num_hidden_layers=12,
                       num_attention_heads=4, ffn_dim=256, word_embed_proj_dim=64, dropout=0.0,
                       attention_dropout=0.0),
    "t5": _text_model("T5Config", "T5ForSequenceClassification", eos_token_id=1, d_model=64, d_ff=256, d_kv=16,
                      num_layers=6, num_decoder_layers=6, num_heads=4, dropout_rate=0.0, classifier_dropout=0.0,
                      decoder_start_token_id=0),
    "deberta-v3": _text_model("DebertaV2Config", "DebertaV2ForSequenceClassification", fix=True,
                              frozen=("deberta.encoder.rel_embeddings.", "deberta.encoder.LayerNorm."),
                              relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"],
                              share_att_key=True, norm_rel_ebd="layer_norm", **_DECODER, **_NO_DROPOUT),
    "mpnet": _text_model("MPNetConfig", "MPNetForSequenceClassification", fix=True, **_DECODER, **_NO_DROPOUT),
    "bart": _text_model("BartConfig", "BartForSequenceClassification", eos_token_id=2, d_model=64, encoder_layers=6,
                        decoder_layers=6, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                        decoder_ffn_dim=256, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        classifier_dropout=0.0),
    "wav2vec2": _speech_model("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", **_SPEECH),
    "wavlm": _speech_model("WavLMConfig", "WavLMForSequenceClassification", fix=True, **_SPEECH),
    "embedding-bag": _torch_model("embedding-bag"),
    "instance-norm": _torch_model("instance-norm"),
    "conv-transpose": _torch_model("conv-transpose"),
}


def _step(library, mode, model, inputs, labels=None):
    """One training step of ``model`` on ``inputs`` (model(**inputs).logits), plain (``library`` None) or by that
    ghostdp's ``mode``; ``labels``: the batch's classes (default: the families' two examples')."""
    import torch
    labels = torch.tensor([0, 2]) if labels is None else labels
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if library is None:
        def step():
            optimizer.zero_grad()
            criterion(model(**inputs).logits, labels).backward()
            optimizer.step()
        return step
    controller = library.GhostClipping(model, 1.0, clipping=mode)

    def step():
        optimizer.zero_grad()
        controller.loss(library.per_example_loss(criterion, model(**inputs).logits, labels)).backward()
        optimizer.step()
    return step


def measure(family: str, rounds: int, warmup: int, against: str | None) -> dict:
    """{row: (median ms, median ratio to plain)} of one family, and its fallback modules under "fallback"."""
    import torch
    torch.manual_seed(0)
    template, inputs = FAMILIES[family]()
    return measure_model(template, inputs, None, rounds, warmup, against)


def measure_model(template, inputs, labels, rounds: int, warmup: int, against: str | None) -> dict:
    """The rows and fallback modules of ``measure`` for one model (a copy per mode) on ``inputs`` and ``labels``."""
    import torch

    import ghostdp
    template.train()
    libraries = [("", ghostdp)] + ([(f"@{against}", ghostdp_at(against))] if against else [])
    steps = {"plain": _step(None, "plain", copy.deepcopy(template), inputs, labels)}
    for mode in MODES:
        for suffix, library in libraries:
            steps[mode + suffix] = _step(library, mode, copy.deepcopy(template), inputs, labels)
    rows = ratios(run_rounds(steps, rounds, warmup, torch.device("cpu")))
    return {"rows": rows, "fallback": list(ghostdp.validate.fallback_modules(template))}


def print_rows(name: str, result: dict, width: int = 15) -> None:
    """One model's rows of the table main prints, its fallback modules on the first."""
    fallback = result["fallback"]
    listed = ", ".join(fallback[:3]) + (f", ... ({len(fallback)})" if len(fallback) > 3 else "")
    for n, (row, (ms, ratio)) in enumerate(result["rows"].items()):
        print(f"{name:<{width}}{row:<24}{ratio:>6.2f}x{ms:>11.1f}   {listed if n == 0 else ''}")


def main(argv=None) -> dict:
    return table_main(argv, __doc__, "families", FAMILIES, measure, "family")


def table_main(argv, doc: str, what: str, models: dict, measure_one, label: str, width: int = 15) -> dict:
    """Parses ``argv`` (``--{what}`` of ``models``, rounds, warmup, threads, against), measures each model named with
    ``measure_one(name, rounds, warmup, against)`` and prints the table, its first column headed ``label``:
    {name: its result}."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(f"--{what}", nargs="+", default=list(models), choices=list(models))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--against", default=None, help="also run the ghostdp modes of this git revision")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1: the ratios are medians over the measured rounds")
    import torch
    torch.set_num_threads(args.threads)
    results = {}
    print(f"{label:<{width}}{'mode':<24}{'ratio':>7}{'median ms':>11}   fallback modules (this checkout)")
    for name in getattr(args, what):
        results[name] = measure_one(name, args.rounds, args.warmup, args.against)
        print_rows(name, results[name], width)
    return results


if __name__ == "__main__":
    main()
