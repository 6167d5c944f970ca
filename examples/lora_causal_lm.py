"""Private LoRA fine-tuning of a causal LM through DPTrainer.

No pretrained decoder ships offline, so the model is a small GPT-2 or Llama from a config (or,
on a machine that has one, any Llama-architecture checkpoint: --model), and the "corpus" is
synthetic: sequences that count upwards from a random start (mod 64), which a model can only
predict after training. Only the LoRA adapters (and the LM head) are trained (peft), with
per-example losses over each sequence's own tokens (causal shift, padding = -100).
    python examples/lora_causal_lm.py --epsilon 8 --epochs 3
    python examples/lora_causal_lm.py --arch llama --bf16 --gradient-checkpointing --physical auto \
        --memory-budget-mb 2000                                     # a tiny Llama, on the CPU
    python examples/lora_causal_lm.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --device cuda --bf16 \
        --gradient-checkpointing --physical auto --batch-size 256   # a real one, on a GPU
"""
import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, TrainingArguments

from ghostdp.integrations.transformers import DPArguments, DPTrainer

VOCAB = 64


class CountingSequences(torch.utils.data.Dataset):
    def __init__(self, n, length=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.ids = (starts + torch.arange(length)) % VOCAB
        self.mask = (torch.arange(length)[None] < lengths[:, None]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100)}


def make_model(seed=0, arch="gpt2", name=None, dtype=torch.float32):
    torch.manual_seed(seed)
    if name is not None:  # a Llama-architecture checkpoint (on a machine that can reach or holds it)
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(name, torch_dtype=dtype)
        arch = "llama"
    elif arch == "llama":
        # Padding id outside the data: its embedding row is zero, and RMSNorm of a zero vector has
        # gradient 1/sqrt(eps), which the precision guard rightly refuses for a real token.
        base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 1, hidden_size=64, intermediate_size=172,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, pad_token_id=VOCAB)).to(dtype)
    else:
        base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4)).to(dtype)
    if arch == "llama":
        config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                            lora_dropout=0.0)
    else:
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                            lora_dropout=0.0, modules_to_save=["lm_head"])
    return get_peft_model(base, config)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    parser.add_argument("--model", default=None, help="a Llama-architecture checkpoint (name or path)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 weights and compute")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--physical", default="64", help="the physical batch, or 'auto'")
    parser.add_argument("--memory-budget-mb", type=float, default=None, help="for --physical auto on a CPU")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    model = make_model(arch=args.arch, name=args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    train, test = CountingSequences(args.train_size, seed=1), CountingSequences(500, seed=2)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters (LoRA + head): {trainable} of {sum(p.numel() for p in model.parameters())}")
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=args.lr, report_to=[], save_strategy="no", logging_steps=5, max_grad_norm=0.0,
            use_cpu=args.device == "cpu", dataloader_pin_memory=False, disable_tqdm=True,
            gradient_checkpointing=args.gradient_checkpointing)
        physical = "auto" if args.physical == "auto" else int(args.physical)
        trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                            dp_args=DPArguments(target_epsilon=args.epsilon, loss="causal_lm", max_grad_norm=1.0,
                                                max_physical_batch_size=physical, seed=0,
                                                memory_budget_mb=args.memory_budget_mb))
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
    result = {"loss_before": before, "loss_after": after, "epsilon": trainer.epsilon(),
              "physical_batch_size": physical if physical != "auto" else trainer._physical}
    print(f"test loss {before:.3f} -> {after:.3f}, epsilon {result['epsilon']:.2f} (delta 1e-5)")
    return result


if __name__ == "__main__":
    main()
