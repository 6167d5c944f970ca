"""A sweep of transformers' model types: each built from a tiny config, trained one ghostdp step against the loop.

    python tests/privacy/transformers_sweep.py                         # every sequence classifier, float64
    python tests/privacy/transformers_sweep.py --head causal-lm --lora # every causal LM, LoRA on all-linear
    python tests/privacy/transformers_sweep.py --float32 mixtral qwen3_moe   # grouped experts have no float64

For each model type of the head's auto mapping (127 sequence classifiers and 200 causal LMs in transformers 5.25):
a config shrunk to a few dims (TINY; dropout 0, as the loop's batches of one draw other masks), B = 3 examples of
T = 6 tokens, C half the smallest per-example norm (every example clipped), both clipping modes. The outcome:
- "exact": ghostdp's clipped sum equals the per-example autograd loop's (conftest) to TOLERANCE;
- "off": it does not: a defect (silently wrong, or one example moving the others' gradients);
- "refused": ghostdp stopped the step with its error (the first line is kept: it names the module and the fix);
- "crashed": the model failed under ghostdp but not without it;
- "unbuilt": the tiny config, the model's forward or the loop failed without ghostdp (not a finding).
tests/privacy/test_transformers_sweep.py runs a few types, so that it cannot rot. Measured 2026-12-08 (transformers
5.25.0, peft 0.22.0): every sequence classifier that builds is exact or refused with a clear error (BigBird-Pegasus'
positions were refused, and train since); see the README's "Tests".
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import signal
import sys
import traceback
import warnings
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # conftest, run as a script

import torch  # noqa: E402
import transformers  # noqa: E402

import ghostdp  # noqa: E402
from conftest import clipped_sum, ghost_clipped_sum, reference_per_example_grads, relative_error  # noqa: E402

B, T, VOCAB, LABELS = 3, 6, 99, 3
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # float64 models that cast inside to float32 read ~2e-9
SECONDS = 120  # per type and mode
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            vocab_size=VOCAB, max_position_embeddings=64, head_dim=8, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, n_embd=32,
            n_layer=2, n_head=4, d_ff=48, d_kv=8, num_layers=2, num_heads=4, embedding_size=32,
            moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            shared_expert_intermediate_size=16, n_shared_experts=1, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, attention_window=4, sliding_window=4,
            attention_hidden_size=32, entity_vocab_size=50)
TWEAKS = {"gptj": dict(rotary_dim=4), "codegen": dict(rotary_dim=4), "deberta": dict(pooler_hidden_size=32),
          "deberta-v2": dict(pooler_hidden_size=32), "t5": dict(decoder_start_token_id=0),
          "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
          "reformer": dict(axial_pos_embds_dim=(16, 16), axial_pos_shape=(2, 3), lsh_attn_chunk_length=3,
                           local_attn_chunk_length=3)}
TOO_LARGE = frozenset({"perceiver"})  # its latents are not among TINY's names: ~10 GB
HEADS = {"seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
         "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM")}


class Outcome(NamedTuple):
    kind: str
    clipping: str
    status: str  # exact, off, refused, crashed, unbuilt
    detail: str  # the relative error, or the error's first line


def model_types(head: str) -> list[str]:
    from transformers.models.auto import modeling_auto
    return sorted(k for k in getattr(modeling_auto, HEADS[head][0]) if k not in TOO_LARGE)


def _shrink(config) -> None:
    for name, value in TINY.items():
        if hasattr(config, name) and not isinstance(getattr(config, name), (list, dict)):
            with contextlib.suppress(Exception):
                setattr(config, name, value)
    if isinstance(getattr(config, "layer_types", None), list):  # every kind of layer, cycled over the layers
        kinds = list(dict.fromkeys(config.layer_types))
        with contextlib.suppress(Exception):
            config.layer_types = (kinds * config.num_hidden_layers)[:config.num_hidden_layers]
    for name in list(vars(config)):
        if "drop" in name and isinstance(getattr(config, name), float):
            with contextlib.suppress(Exception):
                setattr(config, name, 0.0)


def tiny_config(kind: str):
    config = transformers.AutoConfig.for_model(kind)
    for sub in [config] + [v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig)]:
        _shrink(sub)
        with contextlib.suppress(Exception):
            sub.pad_token_id = 0  # a classifier reads the last token that is not padding
    for name, value in TWEAKS.get(kind, {}).items():
        setattr(config, name, value)
    config.num_labels, config.pad_token_id = LABELS, 0
    return config


def _model_and_losses(kind: str, head: str, lora: bool, dtype):
    torch.manual_seed(0)
    config = tiny_config(kind)
    model = getattr(transformers, HEADS[head][1]).from_config(config).to(dtype)
    if kind == "xmod":
        model.set_default_language("en_XX")
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            task_type="SEQ_CLS" if head == "seq-cls" else "CAUSAL_LM", target_modules="all-linear", r=4,
            lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)).to(dtype)  # B != 0: A has a gradient
    model.train()
    eos = getattr(config, "eos_token_id", None)
    ids = torch.randint(3, VOCAB, (B, T))
    ids[:, -1] = eos if isinstance(eos, int) and eos < VOCAB else 2  # seq2seq classifiers read the last <eos>
    labels = torch.randint(0, LABELS, (B,))
    ce = torch.nn.CrossEntropyLoss()

    def losses(sl):
        logits = model(input_ids=ids[sl]).logits
        if head == "seq-cls":
            return ghostdp.per_example_loss(ce, logits, labels[sl])
        return ghostdp.per_example_loss(ce, logits[:, :-1], ids[sl][:, 1:])
    return model, losses


PACKAGE = pathlib.Path(ghostdp.__file__).resolve().parent


def _raised_by_ghostdp(error: BaseException) -> bool:
    """Whether the error was raised in the package's own code (not by a library below a folder named ghostdp, as a
    clone's .venv is)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and PACKAGE in pathlib.Path(frames[-1].filename).resolve().parents


def _timed_out(*_):
    raise TimeoutError(f"over {SECONDS} s")


def sweep_one(kind: str, head: str = "seq-cls", clipping: str = "ghost", lora: bool = False,
              dtype=torch.float64) -> Outcome:
    """One type, one mode: the outcome of one step (see the module doc)."""
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(SECONDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, losses = _model_and_losses(kind, head, lora, dtype)
                losses(slice(None))  # the batch's forward without ghostdp
                per_example = reference_per_example_grads(model, lambda i: losses(slice(i, i + 1)).sum(), B)
                _, norms = clipped_sum(per_example, 1.0)
                if not bool(torch.isfinite(norms).all()) or float(norms.min()) <= 0:
                    return Outcome(kind, clipping, "unbuilt", f"per-example norms {norms.tolist()}")
            except Exception as error:
                return Outcome(kind, clipping, "unbuilt", f"{type(error).__name__}: {str(error).splitlines()[0]}")
            C = 0.5 * float(norms.min())
            ref, _ = clipped_sum(per_example, C)
            try:
                got, _ = ghost_clipped_sum(model, lambda: losses(slice(None)), C, clipping)
            except Exception as error:
                refused = isinstance(error, ghostdp.validate.ModelNotPrivatizable) or _raised_by_ghostdp(error)
                first = (str(error).splitlines() or [""])[0]
                return Outcome(kind, clipping, "refused" if refused else "crashed", f"{type(error).__name__}: {first}")
            try:
                error = relative_error(got, ref)
            except RuntimeError as error:  # out of memory: a table the tiny config left large
                return Outcome(kind, clipping, "unbuilt", f"comparing the sums: {str(error).splitlines()[0]}")
            return Outcome(kind, clipping, "exact" if error < TOLERANCE[dtype] else "off", f"{error:.2e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every type of the head's auto mapping)")
    parser.add_argument("--head", choices=sorted(HEADS), default="seq-cls")
    parser.add_argument("--lora", action="store_true", help="peft LoRA on all-linear (and the head trained)")
    parser.add_argument("--float32", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    dtype = torch.float32 if args.float32 else torch.float64
    counts = {}
    for kind in args.types or model_types(args.head):
        outcomes = [sweep_one(kind, args.head, clipping, args.lora, dtype) for clipping in ("ghost", "bookkeeping")]
        for o in outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        print(f"{kind:<24}" + "  ".join(f"{o.clipping}: {o.status} ({o.detail[:160]})" for o in outcomes), flush=True)
    print("outcomes (type x mode):", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts.get("off") or counts.get("crashed") else 0


if __name__ == "__main__":
    sys.exit(main())
