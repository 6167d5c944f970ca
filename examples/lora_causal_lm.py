"""Private LoRA fine-tuning of a small causal LM through DPTrainer.

No pretrained decoder ships offline, so the model is a small GPT-2 from a config, and the
"corpus" is synthetic: sequences that count upwards from a random start (mod the vocabulary),
which a model can only predict after training. Only the LoRA adapters are trained (peft),
with per-example losses over each sequence's own tokens (causal shift, padding = -100).
    python examples/lora_causal_lm.py --epsilon 8 --epochs 3
"""
import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

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


def make_model(seed=0):
    torch.manual_seed(seed)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4))
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
    args = parser.parse_args(argv)

    model = make_model()
    train, test = CountingSequences(args.train_size, seed=1), CountingSequences(500, seed=2)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters (LoRA + head): {trainable} of {sum(p.numel() for p in model.parameters())}")
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
            learning_rate=args.lr, report_to=[], save_strategy="no", logging_steps=5, max_grad_norm=0.0,
            use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True)
        trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                            dp_args=DPArguments(target_epsilon=args.epsilon, loss="causal_lm", max_grad_norm=1.0,
                                                max_physical_batch_size=64, seed=0))
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        after = trainer.evaluate()["eval_loss"]
    result = {"loss_before": before, "loss_after": after, "epsilon": trainer.epsilon()}
    print(f"test loss {before:.3f} -> {after:.3f}, epsilon {result['epsilon']:.2f} (delta 1e-5)")
    return result


if __name__ == "__main__":
    main()
