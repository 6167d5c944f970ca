"""DPTrainer inside transformers' own training loop: exact steps, epsilon in the logs, budget, resume."""
import copy
import os

import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, Trainer,
                          TrainerCallback, TrainingArguments)
from transformers.data.data_collator import DataCollatorWithFlattening

from ghostdp.data import PoissonBatchSampler
from ghostdp.integrations.transformers import DPArguments, DPTrainer, per_example_losses
from ghostdp.randomness import RandomSource

N, T = 24, 10


class Examples(torch.utils.data.Dataset):
    def __init__(self, causal=False, n=N):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 60, (n, T), generator=g)
        self.mask = torch.ones(n, T, dtype=torch.long)
        self.mask[::3, 7:] = 0
        self.causal = causal
        self.labels = self.ids.masked_fill(self.mask == 0, -100) if causal else (self.ids[:, 0] > 30).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def bert(dropout=0.0):
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))


def gpt2_lora():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True))


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=0.5, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0, max_steps=1, report_to=[], use_cpu=True,
                logging_steps=1, save_strategy="no", max_grad_norm=0.0, dataloader_pin_memory=False)
    base.update(kw)
    return TrainingArguments(**base)


def reference_step(model, data, indices, C, lr, expected, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in indices:
        item = data[i]
        out = model(input_ids=item["input_ids"][None], attention_mask=item["attention_mask"][None])
        grads = torch.autograd.grad(loss_fn(out.logits, item["labels"][None]), params)
        c = min(1.0, C / (float(torch.sqrt(sum(g.pow(2).sum() for g in grads))) + 1e-6))
        for t, g in zip(total, grads):
            t += c * g
    with torch.no_grad():
        for p, t in zip(params, total):
            p -= lr * t / expected
    return model


def first_batch(seed, data, rate):
    return PoissonBatchSampler(len(data), rate, 3, source=RandomSource(seed=seed)).draw(0, 0)


def cross_entropy(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels)


def causal_token_mean(logits, labels):
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)


@pytest.mark.parametrize("physical, clipping", [(None, "ghost"), (3, "ghost"), (3, "bookkeeping")])
def test_a_trainer_step_equals_the_per_example_reference(tmp_path, physical, clipping):
    data, model = Examples(), bert()
    reference = reference_step(copy.deepcopy(model), data, first_batch(7, data, 8 / N), 0.3, 0.5, 8, cross_entropy)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=0.3, max_physical_batch_size=physical, seed=7,
                     clipping=clipping)
    DPTrainer(model=model, args=args(tmp_path), train_dataset=data, dp_args=dp).train()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)


def test_label_smoothing_of_the_training_arguments_is_applied_to_each_examples_loss(tmp_path):
    """TrainingArguments.label_smoothing_factor was ignored: DPTrainer builds the per-example losses itself,
    and trained on unsmoothed cross-entropy without a word. It is applied now (torch's label_smoothing, as
    the Trainer's LabelSmoother), and refused where it has no meaning."""
    data, model = Examples(), bert()

    def smoothed(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.2)

    # No example clipped (C = 100): with two classes smoothing keeps each gradient's direction, so a clipped
    # one would not show it.
    reference = reference_step(copy.deepcopy(model), data, first_batch(7, data, 8 / N), 100.0, 0.5, 8, smoothed)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=100.0, seed=7)
    DPTrainer(model=model, args=args(tmp_path, label_smoothing_factor=0.2), train_dataset=data, dp_args=dp).train()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)
    unsmoothed = reference_step(copy.deepcopy(bert()), data, first_batch(7, data, 8 / N), 100.0, 0.5, 8,
                                cross_entropy)
    assert not all(torch.allclose(p, u) for p, u in zip(model.parameters(), unsmoothed.parameters()))
    for loss, model in ((lambda out, labels: out.logits.pow(2).sum(1), bert()),
                        ("sequence_classification", BertForSequenceClassification(BertConfig(
                            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=24, num_labels=1)))):
        with pytest.raises(ValueError, match="label_smoothing_factor=0.2 applies to DPTrainer's cross-entropy"):
            DPTrainer(model=model, args=args(tmp_path, label_smoothing_factor=0.2), train_dataset=data,
                      dp_args=DPArguments(noise_multiplier=1.0, loss=loss))


def test_lora_causal_lm_step_equals_the_reference(tmp_path):
    data, model = Examples(causal=True), gpt2_lora()
    reference = reference_step(copy.deepcopy(model), data, first_batch(3, data, 8 / N), 0.2, 0.5, 8,
                               causal_token_mean)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=0.2, loss="causal_lm", seed=3, max_physical_batch_size=4)
    DPTrainer(model=model, args=args(tmp_path), train_dataset=data, dp_args=dp).train()
    trained = dict(model.named_parameters())
    for name, r in reference.named_parameters():
        torch.testing.assert_close(trained[name], r, rtol=1e-9, atol=1e-12)
        if not r.requires_grad:
            assert torch.equal(trained[name], r)


def test_prompt_tuning_step_equals_the_reference(tmp_path):
    """peft's prompt, repeated to the batch by peft itself, captured at that repeat (clipping/repeated.py), with
    physical batches of 3 and the classifier peft trains beside it."""
    from peft import PromptTuningConfig, get_peft_model
    data = Examples()
    model = get_peft_model(bert(), PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=3))
    assert model.get_parameter("prompt_encoder.default.embedding.weight").requires_grad
    reference = reference_step(copy.deepcopy(model), data, first_batch(5, data, 8 / N), 0.3, 0.5, 8, cross_entropy)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=0.3, seed=5, max_physical_batch_size=3)
    DPTrainer(model=model, args=args(tmp_path), train_dataset=data, dp_args=dp).train()
    trained = dict(model.named_parameters())
    for name, r in reference.named_parameters():
        torch.testing.assert_close(trained[name], r, rtol=1e-9, atol=1e-12)


def test_token_losses_count_only_the_positions_the_attention_mask_keeps(tmp_path):
    """Labels copied from the padded input ids (not -100 at the padding) counted the padding in each example's token
    mean before 2026-11-26: with batches padded to their longest example, one example's length moved the others'
    losses and clipped gradients. DPTrainer's token losses read the attention mask now: the step equals the
    reference on the real targets, and an example's loss does not move when its batch is padded further."""
    masked, model = Examples(causal=True), gpt2_lora()
    unmasked = Examples(causal=True)
    unmasked.labels = unmasked.ids.clone()  # the padded positions' labels are tokens, not -100
    reference = reference_step(copy.deepcopy(model), masked, first_batch(3, masked, 8 / N), 0.2, 0.5, 8,
                               causal_token_mean)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=0.2, loss="causal_lm", seed=3)
    DPTrainer(model=model, args=args(tmp_path), train_dataset=unmasked, dp_args=dp).train()
    trained = dict(model.named_parameters())
    for name, r in reference.named_parameters():
        torch.testing.assert_close(trained[name], r, rtol=1e-9, atol=1e-12)
    item = unmasked[0]  # 7 tokens and 3 of padding
    ids, mask, labels = (item[k][None] for k in ("input_ids", "attention_mask", "labels"))
    further = [torch.cat([t, t.new_zeros(1, 5)], 1) for t in (ids, mask, labels)]  # 5 more, labelled with pad id 0
    for kind in ("causal_lm", "token_classification"):
        with torch.no_grad():
            short = per_example_losses(kind, model(input_ids=ids, attention_mask=mask), labels, attention_mask=mask)
            long = per_example_losses(kind, model(input_ids=further[0], attention_mask=further[1]), further[2],
                                      attention_mask=further[1])
        torch.testing.assert_close(short, long, rtol=1e-12, atol=0)


class Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_epsilon_reaches_every_callback_and_the_budget_stops_training(tmp_path):
    logs = Logs()
    dp = DPArguments(noise_multiplier=0.8, max_epsilon=6.0, seed=1)
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=50), train_dataset=Examples(), dp_args=dp,
                        callbacks=[logs])
    trainer.train()
    steps = trainer.accountant.steps
    assert 0 < steps < 50 and trainer.state.global_step == steps
    assert trainer.epsilon() <= 6.0
    trainer.accountant.step(noise_multiplier=0.8, sample_rate=8 / N)
    assert trainer.accountant.get_epsilon(1e-5) > 6.0  # one more step would have exceeded the budget
    eps = [log["epsilon"] for log in logs.logs if "loss" in log]
    assert len(eps) == steps and eps == sorted(eps)
    assert trainer._train_loader.tracker.yielded == []  # each step takes its chunk records


def test_the_budget_recomputed_mid_run_counts_the_steps_already_taken(tmp_path):
    """_steps_within, as redone when the noise changes mid-run (a noise scheduler): the steps taken count with
    their own noise; forgetting them would let the run go past max_epsilon."""
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=6), train_dataset=Examples(),
                        dp_args=DPArguments(noise_multiplier=0.5, seed=3))
    trainer.train()
    done, rate = trainer.accountant.steps, 8 / N
    assert done == 6
    # A budget that the next steps at a larger noise reach only after a few more.
    budget = copy.deepcopy(trainer.accountant)
    budget.step(noise_multiplier=2.0, sample_rate=rate, num_steps=10)
    max_epsilon = budget.get_epsilon(1e-5)
    stop = trainer._steps_within(max_epsilon, [(rate, 100)], 2.0)
    assert stop is not None and done < stop < done + 100
    within, beyond = copy.deepcopy(trainer.accountant), copy.deepcopy(trainer.accountant)
    within.step(noise_multiplier=2.0, sample_rate=rate, num_steps=stop - done)
    beyond.step(noise_multiplier=2.0, sample_rate=rate, num_steps=stop - done + 1)
    assert within.get_epsilon(1e-5) <= max_epsilon < beyond.get_epsilon(1e-5)


def test_target_epsilon_is_met_over_the_planned_steps(tmp_path):
    dp = DPArguments(target_epsilon=5.0, seed=2, accountant="rdp")
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=6), train_dataset=Examples(), dp_args=dp)
    trainer.train()
    assert trainer.accountant.steps == 6 and 0.99 * 5.0 <= trainer.epsilon() <= 5.0


class Epochs(TrainerCallback):
    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logged.append(logs["epoch"])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_from_checkpoint_keeps_epsilon_the_trajectory_and_the_epoch(tmp_path, dropout):
    # 3 steps per epoch; the checkpoint at step 5 is in the middle of the second epoch.
    dp = DPArguments(noise_multiplier=1.0, seed=5)
    straight, straight_epochs = bert(dropout), Epochs()
    DPTrainer(model=straight, args=args(tmp_path / "a", max_steps=8), train_dataset=Examples(), dp_args=dp,
              callbacks=[straight_epochs]).train()

    first = bert(dropout)
    DPTrainer(model=first, args=args(tmp_path / "b", max_steps=8, save_strategy="steps", save_steps=5),
              train_dataset=Examples(), dp_args=dp).train()
    resumed_model, resumed_epochs = bert(dropout), Epochs()
    trainer = DPTrainer(model=resumed_model, args=args(tmp_path / "b", max_steps=8), train_dataset=Examples(),
                        dp_args=DPArguments(noise_multiplier=1.0, seed=99), callbacks=[resumed_epochs])
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-5"))
    assert trainer.accountant.steps == 8
    for p, q in zip(resumed_model.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert resumed_epochs.logged == pytest.approx(straight_epochs.logged[5:]) == [2.0, 7 / 3, 8 / 3]


def test_evaluate_and_save_are_those_of_a_plain_trainer(tmp_path):
    model = bert()
    trainer = DPTrainer(model=model, args=args(tmp_path), train_dataset=Examples(), eval_dataset=Examples(),
                        dp_args=DPArguments(noise_multiplier=1.0, seed=0))
    trainer.train()
    assert "eval_loss" in trainer.evaluate()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = BertForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    assert loaded.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("sharding, match", [("is_fsdp_enabled", "DPTrainer with FSDP .* is not supported yet"),
                                             ("is_deepspeed_enabled", "DPTrainer with DeepSpeed is not supported")])
def test_fsdp_and_deepspeed_are_refused_with_the_fix(tmp_path, monkeypatch, sharding, match):
    # On a CPU accelerate never shards (it runs DDP): the flag the Trainer reads from accelerate's state is set
    # here as a GPU run under an FSDP or DeepSpeed config would set it.
    from transformers import Trainer
    build = Trainer.create_accelerator_and_postprocess

    def sharded_accelerator(self):
        build(self)
        setattr(self, sharding, True)

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", sharded_accelerator)
    with pytest.raises(NotImplementedError, match=match):
        DPTrainer(model=bert(), args=args(tmp_path), train_dataset=Examples(), dp_args=DPArguments(noise_multiplier=1.0))


def test_unsupported_settings_are_refused(tmp_path):
    dp = DPArguments(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        DPTrainer(model=bert(), args=args(tmp_path, gradient_accumulation_steps=2), train_dataset=Examples(),
                  dp_args=dp)
    with pytest.raises(ValueError, match="auto_find_batch_size=True halves.*max_physical_batch_size='auto'"):
        DPTrainer(model=bert(), args=args(tmp_path, auto_find_batch_size=True), train_dataset=Examples(), dp_args=dp)
    with pytest.raises(ValueError, match="padding-free"):
        DPTrainer(model=bert(), args=args(tmp_path), train_dataset=Examples(), dp_args=dp,
                  data_collator=DataCollatorWithFlattening())
    user_args = args(tmp_path, max_grad_norm=2.0)
    with pytest.warns(UserWarning, match="max_grad_norm=2.0 is not used"):
        trainer = DPTrainer(model=bert(), args=user_args, train_dataset=Examples(), dp_args=dp)
    assert trainer.args.max_grad_norm == 0 and user_args.max_grad_norm == 2.0  # the user's object is unchanged
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TrainingArguments' default max_grad_norm (1.0): nothing to warn about
        defaults = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
        trainer = DPTrainer(model=bert(), args=defaults, train_dataset=Examples(), dp_args=dp)
    assert trainer.args.max_grad_norm == 0 and defaults.max_grad_norm == 1.0
    sampling = ({"train_sampling_strategy": "group_by_length"}
                if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__ else {"group_by_length": True})
    for setting in (sampling, {"dataloader_drop_last": True}):  # the Poisson sampler replaces the Trainer's
        (name, value), = setting.items()
        with pytest.warns(UserWarning, match=f"{name}={value!r} is not used: DP-SGD draws Poisson batches"):
            DPTrainer(model=bert(), args=args(tmp_path, **setting), train_dataset=Examples(), dp_args=dp)
    with pytest.raises(ValueError, match="exactly one"):
        DPArguments(target_epsilon=3.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="loss"):
        DPArguments(noise_multiplier=1.0, loss="masked_lm")


def test_an_empty_training_dataset_is_refused(tmp_path):
    trainer = DPTrainer(model=bert(), args=args(tmp_path), train_dataset=Examples(n=0),
                        dp_args=DPArguments(noise_multiplier=1.0))
    with pytest.raises(ValueError, match="training dataset is empty"):
        trainer.train()


def test_a_compute_loss_of_ones_own_is_warned_of_as_unused_for_training(tmp_path):
    """A Trainer subclass's compute_loss (mixed in with DPTrainerMixin, or a subclass of DPTrainer) was silently
    skipped in training: DPTrainer's training_step forms the per-example losses from DPArguments.loss."""
    from ghostdp.integrations.transformers import DPTrainerMixin

    class WeightedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Mixed(DPTrainerMixin, WeightedTrainer):
        pass

    class Sub(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    dp = DPArguments(noise_multiplier=1.0)
    for trainer_class, name in ((Mixed, "WeightedTrainer"), (Sub, "Sub")):
        with pytest.warns(UserWarning, match=f"{name}.compute_loss is not used for training.*DPArguments.loss"):
            trainer_class(model=bert(), args=args(tmp_path), train_dataset=Examples(), dp_args=dp)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DPTrainer(model=bert(), args=args(tmp_path), train_dataset=Examples(), dp_args=dp)


def test_logged_loss_is_the_mean_per_example_loss_and_empty_batches_step_without_a_forward(tmp_path):
    model = bert()
    seen = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                seen.append(logs["loss"])

    data = Examples()
    trainer = DPTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=2, max_steps=12,
                                               learning_rate=0.0),
                        train_dataset=data, dp_args=DPArguments(noise_multiplier=0.0, seed=3),
                        callbacks=[Losses()])
    forwards, sizes, batches = [], [], []
    # Training forwards: ghostdp's check of the forward reruns it without gradient on some steps (independence.py).
    model.register_forward_pre_hook(lambda m, a, kw: forwards.append(1) if torch.is_grad_enabled() else None,
                                    with_kwargs=True)
    original_step = trainer.training_step

    def counting_step(model, inputs, num_items_in_batch=None):
        sizes.append(len(inputs["labels"]))
        batches.append({k: v.clone() for k, v in inputs.items()})
        return original_step(model, inputs, num_items_in_batch)

    trainer.training_step = counting_step
    trainer.train()
    assert trainer.accountant.steps == 12 and len(sizes) == 12
    # At q = 2/24 (seed 3) some logical batches are empty: they step (noise, accounting), no forward.
    assert 0 in sizes and len(forwards) == sum(1 for n in sizes if n > 0)
    expected = []
    with torch.no_grad():  # learning rate 0: the model of every step is the initial one
        for batch in batches:
            if len(batch["labels"]) == 0:
                expected.append(0.0)
                continue
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            expected.append(float(torch.nn.functional.cross_entropy(logits, batch["labels"])))
    assert seen == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_the_privacy_state_is_inside_each_checkpoint_before_rotation(tmp_path):
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
                                                save_total_limit=1),
                        train_dataset=Examples(), dp_args=DPArguments(noise_multiplier=1.0, seed=0))
    written = []
    original = trainer._save_rng_state

    def spy(output_dir):
        original(output_dir)
        # By the time the Trainer could rotate, the state file already sits in the new checkpoint.
        written.append(os.path.exists(os.path.join(output_dir, "ghostdp_state.pt")))

    trainer._save_rng_state = spy
    trainer.train()
    assert written == [True, True, True]
    kept = [d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")]
    assert kept == ["checkpoint-3"] and os.path.exists(tmp_path / "checkpoint-3" / "ghostdp_state.pt")
    assert not any(name.endswith(".partial") for name in os.listdir(tmp_path / "checkpoint-3"))


def test_noise_and_batch_size_schedules_run_epoch_by_epoch_in_the_trainer(tmp_path):
    import functools
    from ghostdp.schedules import ExponentialNoise, StepBatchSize
    # 24 examples, batch 4 -> 8 -> 16: epochs of 6, 3 and 2 steps, the noise halved after each epoch.
    dp = DPArguments(noise_multiplier=1.0, seed=3, accountant="rdp",
                     noise_scheduler=functools.partial(ExponentialNoise, gamma=0.5),
                     batch_size_schedule=StepBatchSize(step_size=1, gamma=2.0))
    epochs = Epochs()
    trainer = DPTrainer(model=bert(), args=args(tmp_path, per_device_train_batch_size=4, max_steps=-1,
                                                 num_train_epochs=3), train_dataset=Examples(), dp_args=dp,
                        callbacks=[epochs])
    trainer.train()
    assert trainer.accountant.history == [[1.0, 1 / 6, 6], [0.5, 1 / 3, 3], [0.25, 2 / 3, 2]]
    assert trainer.state.global_step == 11
    assert epochs.logged == pytest.approx([k / 6 for k in range(1, 7)] + [1 + k / 3 for k in range(1, 4)]
                                          + [2.5, 3.0])


def test_schedules_resume_mid_run_in_the_trainer(tmp_path):
    import functools
    from ghostdp.schedules import ExponentialNoise, StepBatchSize

    def dp(seed):
        return DPArguments(noise_multiplier=1.0, seed=seed, accountant="rdp",
                           noise_scheduler=functools.partial(ExponentialNoise, gamma=0.5),
                           batch_size_schedule=StepBatchSize(step_size=1, gamma=2.0))
    run = dict(per_device_train_batch_size=4, max_steps=-1, num_train_epochs=3)
    straight = bert()
    reference = DPTrainer(model=straight, args=args(tmp_path / "a", **run), train_dataset=Examples(), dp_args=dp(5))
    reference.train()
    DPTrainer(model=bert(), args=args(tmp_path / "b", save_strategy="steps", save_steps=7, **run),
              train_dataset=Examples(), dp_args=dp(5)).train()
    resumed = bert()
    trainer = DPTrainer(model=resumed, args=args(tmp_path / "b", **run), train_dataset=Examples(), dp_args=dp(77))
    trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-7"))  # inside the second epoch
    assert trainer.accountant.history == reference.accountant.history
    assert trainer.dp_optimizer.noise_scheduler.last_epoch == 3
    for p, q in zip(resumed.parameters(), straight.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_target_and_budget_hold_over_schedules_in_the_trainer(tmp_path):
    import functools
    from ghostdp.schedules import ExponentialNoise, StepBatchSize
    growing = StepBatchSize(step_size=1, gamma=2.0)
    run = dict(per_device_train_batch_size=4, max_steps=-1, num_train_epochs=3)
    trainer = DPTrainer(model=bert(), args=args(tmp_path / "a", **run), train_dataset=Examples(),
                        dp_args=DPArguments(target_epsilon=4.0, seed=1, accountant="rdp", batch_size_schedule=growing))
    trainer.train()
    assert trainer.accountant.steps == 11 and 0.99 * 4.0 <= trainer.epsilon() <= 4.0
    # A decaying noise: the budget is re-planned at every change of the noise and still holds.
    trainer = DPTrainer(model=bert(), args=args(tmp_path / "b", **run), train_dataset=Examples(),
                        dp_args=DPArguments(noise_multiplier=1.5, max_epsilon=4.0, seed=1, accountant="rdp",
                                            noise_scheduler=functools.partial(ExponentialNoise, gamma=0.7),
                                            batch_size_schedule=growing))
    trainer.train()
    steps = trainer.accountant.steps
    assert 6 < steps < 11 and trainer.epsilon() <= 4.0
    assert trainer.accountant.history[-1][0] == pytest.approx(1.5 * 0.7)  # stopped in the second epoch
    # The next step, at the noise and rate it would have had, would have exceeded the budget.
    rate = trainer.plan.at(int(trainer.plan.epoch_of_step(steps)))[0]
    trainer.accountant.step(noise_multiplier=trainer.dp_optimizer.noise_multiplier, sample_rate=rate)
    assert trainer.accountant.get_epsilon(1e-5) > 4.0


def test_adaptive_clipping_in_the_trainer_follows_the_rule_and_is_checkpointed(tmp_path):
    import math
    from ghostdp import AdaptiveClipNorm
    norm = AdaptiveClipNorm(0.5, target_quantile=0.5, learning_rate=0.2, count_noise_std=1.0)
    dp = DPArguments(noise_multiplier=0.0, seed=4, max_grad_norm=norm)
    trainer = DPTrainer(model=bert(), args=args(tmp_path, max_steps=1), train_dataset=Examples(), dp_args=dp)
    trainer.train()
    assert norm.norm == 0.5  # the trainer works on its own copy
    norms = trainer.controller.last_norms
    share = (float((norms <= 0.5).sum()) - 0.5 * norms.shape[0]) / 8 + 0.5
    assert trainer.controller.max_grad_norm == pytest.approx(0.5 * math.exp(-0.2 * (share - 0.5)), rel=1e-12)
    assert trainer._state()["noise"]["adaptive_clipping"]["norm"] == trainer.controller.max_grad_norm
    with pytest.raises(ValueError, match="per-group clipping"):
        DPArguments(noise_multiplier=1.0, max_grad_norm=[1.0, 2.0])


def test_automatic_physical_batch_in_the_trainer_equals_a_fixed_one(tmp_path, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        dp = DPArguments(noise_multiplier=0.0, seed=4, max_physical_batch_size="auto", memory_budget_mb=1e6)
        automatic = DPTrainer(model=bert(), args=args(tmp_path / "a", max_steps=2), train_dataset=Examples(),
                              dp_args=dp)
        automatic.train()
    chosen = automatic._physical
    assert f"max_physical_batch_size='auto' chose {chosen}" in caplog.text and chosen >= 8
    fixed = DPTrainer(model=bert(), args=args(tmp_path / "b", max_steps=2), train_dataset=Examples(),
                      dp_args=DPArguments(noise_multiplier=0.0, seed=4, max_physical_batch_size=chosen))
    fixed.train()
    assert automatic.accountant.history == fixed.accountant.history
    for p, q in zip(automatic.model.parameters(), fixed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="memory_budget_mb is for max_physical_batch_size='auto'"):
        DPArguments(noise_multiplier=1.0, memory_budget_mb=100)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_trainer_step_with_gradient_checkpointing_equals_the_per_example_reference(tmp_path, clipping, reentrant):
    data, model = Examples(), bert()
    reference = reference_step(copy.deepcopy(model), data, first_batch(7, data, 8 / N), 0.3, 0.5, 8, cross_entropy)
    dp = DPArguments(noise_multiplier=0.0, max_grad_norm=0.3, max_physical_batch_size=3, seed=7, clipping=clipping)
    training = args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    trainer = DPTrainer(model=model, args=training, train_dataset=data, dp_args=dp)
    trainer.train()
    assert model.is_gradient_checkpointing
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-9, atol=1e-12)


class VariableLengths(torch.utils.data.Dataset):
    """Examples of 3 to 14 tokens, padded by ``pad_to_longest`` to each batch's longest (dynamic padding)."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(1, 60, (int(k),), generator=g) for k in torch.randint(3, 15, (n,), generator=g)]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": int(self.ids[i][0] > 30)}


def pad_to_longest(items):
    length = max((len(item["input_ids"]) for item in items), default=1)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for k, item in enumerate(items):
        ids[k, :len(item["input_ids"])], mask[k, :len(item["input_ids"])] = item["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.tensor([item["labels"] for item in items], dtype=torch.long)}


def roomy_bert():
    """bert() with room for more positions than the longest batch and the 8 the padding check adds."""
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class MeanOverPadding(torch.nn.Module):
    """BERT's encoder and a head on the mean over all positions, the padding included."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head = roomy_bert().bert, torch.nn.Linear(16, 2)
        self.config = self.encoder.config

    def forward(self, input_ids, attention_mask, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return SequenceClassifierOutput(logits=self.head(hidden.mean(1)))


@pytest.mark.parametrize("head", ["bert", "mean over padding"])
def test_dynamic_padding_in_the_trainer(tmp_path, head):
    """Batches padded to their longest example: BERT's own head (the attention mask keeps padding out) trains; a
    head that means over the padding is refused (clipping/padding.py), since one example's length moves the others'."""
    model = roomy_bert() if head == "bert" else MeanOverPadding()
    training = args(tmp_path, max_steps=4, remove_unused_columns=False)
    trainer = DPTrainer(model=model, args=training, train_dataset=VariableLengths(), data_collator=pad_to_longest,
                        dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0, seed=3))
    if head == "bert":
        trainer.train()
        assert len(trainer.controller.independence.lengths) == 2 and trainer.controller.independence.last_padding_moves
        assert trainer.controller.independence.padding_finding is None
    else:
        with pytest.raises(RuntimeError, match="depend on how far the batch is padded"):
            trainer.train()
