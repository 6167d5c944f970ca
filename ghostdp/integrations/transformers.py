"""DPTrainer: Hugging Face's Trainer with DP-SGD by ghost clipping.

Each Trainer batch is one Poisson-sampled logical batch. ``training_step`` splits it into physical
chunks, computes per-example losses from the logits (never the model's batch-token-mean loss),
runs ghostdp's two passes per chunk, then adds the noise once and divides by the expected batch
size, all before the Trainer reads ``grad_norm`` and steps the (unwrapped) optimizer.

Under torchrun / accelerate launch, each process Poisson-samples its own shard (expected size
per_device_train_batch_size), the Trainer's DDP averages the clipped sums, the DP optimizer turns
the average back into the sum and adds one noise draw shared by all ranks; ranks with fewer
physical chunks than the largest draw run zero-weight padding chunks so DDP stays in step.
"""
from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.data.data_collator import DataCollatorWithFlattening

from ..accounting import check_noise_multiplier, get_noise_multiplier, make_accountant
from ..clipping import GhostClipping, check_max_grad_norm, per_example_loss
from ..clipping.adaptive import AdaptiveClipNorm
from ..clipping.modes import clipping_mode
from ..data import (DPDataLoader, PoissonBatchSampler, across_ranks, distributed_rank_and_size,
                    poisson_rate_and_steps)
from ..engine import restore_streams, run_state
from ..optim import DPOptimizer
from ..randomness import RandomSource
from ..memory import PhysicalBatchSearch, choose_physical_batch_size
from ..schedules import BatchSizeSchedule

STATE_FILE = "ghostdp_state.pt"
LOSS_KINDS = ("sequence_classification", "token_classification", "causal_lm")


@dataclass
class DPArguments:
    """Privacy settings of a DPTrainer.

    Give ``target_epsilon`` (sigma is calibrated for the planned number of steps) or
    ``noise_multiplier``. ``max_grad_norm`` is the per-example clipping norm C (the Trainer's own
    ``TrainingArguments.max_grad_norm`` is turned off), or a ``ghostdp.AdaptiveClipNorm`` (each trainer
    works on its own copy; per-group clipping is PrivacyEngine's). ``loss`` is the per-example loss:
    "sequence_classification" (cross-entropy, or MSE when the model has one label),
    "token_classification" (token mean over labels != -100 per example, at the positions the batch's
    attention_mask keeps), "causal_lm" (the same after shifting labels by one), or a callable (model
    outputs, labels) -> (B,) losses.
    ``max_epsilon`` stops training before the step that would exceed it. ``clipping`` is "ghost"
    (two passes) or "bookkeeping" (one backward, more memory; with several processes the step sums
    the ranks' clipped sums in one bucketed all-reduce; with gradient_checkpointing its steps take
    ghost's two passes, so as to keep checkpointing's memory saving).
    ``noise_scheduler`` builds a noise scheduler on the DP optimizer (e.g.
    ``functools.partial(ghostdp.schedules.ExponentialNoise, gamma=0.9)``), stepped at the end of every
    epoch; ``batch_size_schedule`` (ghostdp.schedules.StepBatchSize, ...) scales the expected batch
    per_device_train_batch_size epoch by epoch. Every step is accounted with its own noise and rate.
    """
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    target_delta: float = 1e-5
    max_grad_norm: float | AdaptiveClipNorm = 1.0
    max_physical_batch_size: int | str | None = None
    memory_budget_mb: float | None = None
    max_epsilon: float | None = None
    loss: str | Callable = "sequence_classification"
    accountant: str = "prv"
    clipping: str = "ghost"
    secure_mode: bool = False
    seed: int | None = None
    noise_scheduler: Callable | None = None
    batch_size_schedule: BatchSizeSchedule | None = None

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of target_epsilon and noise_multiplier")
        if self.noise_multiplier is not None:
            check_noise_multiplier(self.noise_multiplier)
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"target_epsilon must be > 0, got {self.target_epsilon!r}")
        if isinstance(self.max_grad_norm, (list, tuple)):
            raise ValueError("per-group clipping (a list of max_grad_norm) is supported by PrivacyEngine with "
                             "clipping='bookkeeping', not by DPTrainer, whose optimizer groups are the Trainer's")
        if not isinstance(self.max_grad_norm, AdaptiveClipNorm):
            check_max_grad_norm(self.max_grad_norm)
        physical = self.max_physical_batch_size
        if physical is not None and physical != "auto" and (not isinstance(physical, int) or physical < 1):
            raise ValueError(f"max_physical_batch_size must be an integer >= 1, 'auto' or None, got {physical!r}")
        if self.memory_budget_mb is not None and physical != "auto":
            raise ValueError("memory_budget_mb is for max_physical_batch_size='auto'")
        clipping_mode(self.clipping)
        if not callable(self.loss) and self.loss not in LOSS_KINDS:
            raise ValueError(f"loss must be one of {LOSS_KINDS} or a callable, got {self.loss!r}")
        if self.noise_scheduler is not None and not callable(self.noise_scheduler):
            raise TypeError("noise_scheduler must build a scheduler from the DP optimizer, e.g. "
                            "functools.partial(ghostdp.schedules.ExponentialNoise, gamma=0.9)")
        if self.batch_size_schedule is not None and not isinstance(self.batch_size_schedule, BatchSizeSchedule):
            raise TypeError(f"batch_size_schedule must be a ghostdp.schedules.BatchSizeSchedule, got "
                            f"{type(self.batch_size_schedule).__name__}")


def per_example_losses(kind, outputs, labels, num_labels=None, label_smoothing=0.0,
                       attention_mask=None) -> torch.Tensor:
    """(B,) losses from model outputs and labels for one of LOSS_KINDS, or a callable. ``label_smoothing``:
    TrainingArguments.label_smoothing_factor, for the cross-entropy kinds (as the Trainer's LabelSmoother).
    ``attention_mask``: the batch's; a token loss counts only the positions it keeps. A label left at a
    padded position (labels copied from the padded input ids, not set to -100) would otherwise count, and
    with batches padded to their longest example each example's loss would depend on the others' lengths."""
    if callable(kind):
        return kind(outputs, labels)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    if kind == "sequence_classification" and num_labels == 1:
        return per_example_loss(torch.nn.MSELoss(), logits.squeeze(-1), labels.to(logits.dtype))
    mask = None
    if (kind != "sequence_classification" and isinstance(attention_mask, torch.Tensor)
            and attention_mask.shape == labels.shape):
        mask = attention_mask
    if kind == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
        mask = None if mask is None else mask[:, 1:]  # the positions of the targets
    return per_example_loss(torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=label_smoothing),
                            logits, labels, mask)


def _pop_labels(inputs: dict) -> torch.Tensor:
    for key in ("labels", "label", "label_ids"):
        if key in inputs:
            return inputs.pop(key)
    raise ValueError("the batch has no 'labels': DPTrainer computes each example's loss from the logits "
                     "and the labels, so the collator must provide them")


class _PrivateRunCallback(TrainerCallback):
    """Stops training before the step that would take epsilon above max_epsilon; keeps the epoch exact;
    steps the noise scheduler at the end of every epoch."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        # One step is one logical batch: the epoch is exact from the step count, also after a resume in
        # the middle of an epoch (where the Trainer, which does not skip batches of the private loader,
        # would count the resumed epoch's steps from its start).
        trainer = self.trainer
        if trainer.plan is not None:
            state.epoch = trainer.plan.epoch_of_step(state.global_step)
            steps = trainer.accountant.steps
            scheduler = trainer.dp_optimizer.noise_scheduler if trainer.dp_optimizer is not None else None
            if scheduler is not None and steps and \
                    int(trainer.plan.epoch_of_step(steps)) > int(trainer.plan.epoch_of_step(steps - 1)):
                scheduler.step()
                trainer._limit_epsilon()
        if trainer.allowed_steps is not None and trainer.accountant.steps >= trainer.allowed_steps:
            control.should_training_stop = True
        return control


class DPTrainerMixin:
    """Mix into a transformers.Trainer (subclass): ``class MyDPTrainer(DPTrainerMixin, MyTrainer)``."""

    def __init__(self, *args, dp_args: DPArguments, **kwargs):
        if not isinstance(dp_args, DPArguments):
            raise TypeError("dp_args must be a ghostdp.integrations.transformers.DPArguments")
        super().__init__(*args, **kwargs)
        self.dp_args = dp_args
        self._refuse_unsupported()
        self._private_training_arguments()
        self.accountant = make_accountant(dp_args.accountant)
        self.random_source = RandomSource(secure=dp_args.secure_mode, seed=dp_args.seed)
        if distributed_rank_and_size()[1] > 1:
            self.random_source.agree_across_ranks(seed_given=dp_args.seed is not None)
        self.adaptive_clipping = None
        clip_norm = dp_args.max_grad_norm
        if isinstance(clip_norm, AdaptiveClipNorm):  # a copy: the state is this trainer's
            self.adaptive_clipping = copy.deepcopy(clip_norm)
            clip_norm = clip_norm.norm
        self.controller = GhostClipping(self.model, clip_norm, clipping=dp_args.clipping)
        self.noise_multiplier = dp_args.noise_multiplier
        self.dp_optimizer = None
        self.allowed_steps = None
        self.plan = None  # (sample rate, steps) of every epoch
        self._train_loader = None
        self._pending_state = None
        self._pending_noise = None
        self._physical = None  # the automatic physical batch, once found
        self._epsilon_cache = (None, None)
        self.add_callback(_PrivateRunCallback(self))

    # ------------------------------------------------------------------ what is refused
    def _refuse_unsupported(self):
        args = self.args
        if args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}: accumulating several sampled "
                "batches into one step breaks the privacy accounting. Set it to 1, make "
                "per_device_train_batch_size the logical batch size, and set DPArguments.max_physical_batch_size "
                "to what fits in memory.")
        if getattr(args, "auto_find_batch_size", False):
            raise ValueError(
                "auto_find_batch_size=True halves per_device_train_batch_size after an out-of-memory error and "
                "restarts: the logical batch, so the sampling rate the accountant uses, would change mid-run. Fix: "
                "DPArguments(max_physical_batch_size='auto') keeps the logical batch and splits it into physical "
                "batches that fit in memory.")
        if args.fp16:
            raise ValueError("fp16 training uses a GradScaler whose scaled gradients would change the noise "
                             "calibration; use bf16=True or float32.")
        if args.n_gpu > 1:
            raise ValueError("DataParallel (several GPUs in one process) is not supported: launch one process "
                             "per GPU (torchrun / accelerate launch) instead.")
        if self.is_fsdp_enabled:  # accelerate shards the model (on a CPU it ignores an FSDP config: DDP then)
            raise NotImplementedError(
                "DPTrainer with FSDP (TrainingArguments(fsdp=...) or an accelerate FSDP config) is not supported "
                "yet: each FSDP rank draws the noise of the gradient shard it owns from a stream of its own, while "
                "DPTrainer's checkpoints keep one process's streams, so a resumed run would repeat earlier noise on "
                "the other ranks' shards; and the path is untested on GPUs. Fix: PrivacyEngine with FSDP2 "
                "(fully_shard, or accelerate: Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))"
                ".prepare(model), then make_private; see the README), or DPTrainer with DDP (torchrun / accelerate "
                "launch without an FSDP config).")
        if self.is_deepspeed_enabled:
            raise NotImplementedError(
                "DPTrainer with DeepSpeed is not supported: DeepSpeed's engine partitions, reduces and scales the "
                "gradients itself, past ghostdp's clipped sums and noise. Fix: DDP (torchrun / accelerate launch "
                "without a DeepSpeed config), or PrivacyEngine with FSDP2 for models past one GPU.")
        if args.label_smoothing_factor and (callable(self.dp_args.loss) or (
                self.dp_args.loss == "sequence_classification"
                and getattr(getattr(self.model, "config", None), "num_labels", None) == 1)):
            raise ValueError(
                f"label_smoothing_factor={args.label_smoothing_factor} applies to DPTrainer's cross-entropy losses; "
                "with a callable DPArguments.loss, smooth the labels inside it, and a regression (num_labels=1) has "
                "no classes to smooth over. Set label_smoothing_factor=0.")
        if isinstance(self.data_collator, DataCollatorWithFlattening) or getattr(self.data_collator,
                                                                                 "padding_free", False):
            raise ValueError("packing / padding-free collators merge examples into one row, so a row is no "
                             "longer one example; use a padding collator.")

    def _private_training_arguments(self):
        """A copy of the user's TrainingArguments with what DP-SGD needs (the user's object is unchanged):
        no clipping of the noisy batch gradient, and no skipping of batches on resume (the private loader
        resumes from its own saved position)."""
        args = copy.copy(self.args)
        default = TrainingArguments.__dataclass_fields__["max_grad_norm"].default
        if args.max_grad_norm and args.max_grad_norm != default:
            warnings.warn(f"TrainingArguments.max_grad_norm={args.max_grad_norm} is not used: DP-SGD clips each "
                          "example's gradient (DPArguments.max_grad_norm); clipping the noisy batch gradient "
                          "again would only distort it.")
        args.max_grad_norm = 0.0
        # What the Trainer's sampler would do (group_by_length before transformers 5, train_sampling_strategy since).
        replaced = [f"{name}=True" for name in ("group_by_length", "dataloader_drop_last") if getattr(args, name, False)]
        if getattr(args, "train_sampling_strategy", "random") != "random":
            replaced.append(f"train_sampling_strategy={args.train_sampling_strategy!r}")
        for setting in replaced:
            warnings.warn(f"TrainingArguments.{setting} is not used: DP-SGD draws Poisson batches (each example in "
                          "each batch with probability batch size / dataset size), which the privacy accounting "
                          "assumes.")
        args.ignore_data_skip = True
        self.args = args
        overriding = next((c for c in type(self).__mro__ if "compute_loss" in c.__dict__
                           and c not in (DPTrainerMixin, Trainer)), None)
        if overriding is not None:  # a Trainer subclass's own loss (mixed in, or a subclass of DPTrainer)
            warnings.warn(f"{overriding.__name__}.compute_loss is not used for training: DPTrainer forms each "
                          "example's loss in its training_step, from DPArguments.loss, and clips it (a batch loss "
                          "from compute_loss cannot be clipped per example). Fix: pass your loss as "
                          "DPArguments.loss, a callable (outputs, labels) -> (batch,) per-example losses; "
                          "compute_loss still serves evaluation.")

    # ------------------------------------------------------------------ data and optimizer
    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("DP-SGD needs a map-style train_dataset with len() to Poisson-sample it")
        n = len(dataset)
        # Each process draws its own shard; the logical batch is the union over processes.
        sample_rate, steps_per_epoch = poisson_rate_and_steps(self.args.per_device_train_batch_size,
                                                              distributed_rank_and_size()[1], n)
        self.sample_rate, self.expected_batch_size = sample_rate, sample_rate * n
        sampler = PoissonBatchSampler(n, sample_rate, steps_per_epoch, source=self.random_source,
                                      batch_size_schedule=self.dp_args.batch_size_schedule)
        self.plan = sampler.plan
        # One batch per logical batch; training_step splits it and keeps the ranks' chunk counts equal.
        loader = DPDataLoader(dataset, sampler, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
                              pin_memory=self.args.dataloader_pin_memory, pad_ranks=False)
        self._train_loader = loader
        self._padding_row = loader.collate_fn([dataset[0]])  # stand-in for padding chunks (several processes)
        self._calibrate()
        self._apply_pending_state()
        return loader

    def _planned_runs(self) -> list[tuple[float, int]]:
        """(sample rate, steps) of the whole planned run, epoch by epoch."""
        if self.args.max_steps and self.args.max_steps > 0:
            return self.plan.first_steps(self.args.max_steps)
        return self.plan.steps(self.args.num_train_epochs)

    def _calibrate(self):
        dp = self.dp_args
        runs = self._planned_runs()
        if dp.target_epsilon is not None:
            self.noise_multiplier = get_noise_multiplier(
                target_epsilon=dp.target_epsilon, target_delta=dp.target_delta, plan=runs, accountant=dp.accountant)
        if self.dp_optimizer is not None:  # a new optimizer plans it in create_optimizer, at its noise
            self._limit_epsilon()

    def set_initial_training_values(self, args, dataloader):
        """With a batch-size schedule the epochs differ in length: the Trainer runs the planned steps in
        the planned epochs, each Trainer epoch one epoch of the private loader."""
        values = super().set_initial_training_values(args, dataloader)
        if self.dp_args.batch_size_schedule is None:
            return values
        if not isinstance(values, tuple) or len(values) != 7:
            raise NotImplementedError("DPArguments.batch_size_schedule needs transformers' Trainer."
                                      "set_initial_training_values of transformers >= 4.57 (7 values)")
        _, _, examples, samples, total_batch, _, _ = values
        runs = self._planned_runs()
        longest = max(steps for _, steps in runs)
        return len(runs), longest, examples, samples, total_batch, longest, sum(steps for _, steps in runs)

    def _steps_within(self, max_epsilon, runs, noise_multiplier):
        """The step count (from the start) after which one more step of the planned run would take epsilon
        above max_epsilon, at the current noise multiplier; None if the whole plan stays within it."""
        done = self.accountant.steps
        rates = [rate for rate, steps in runs for _ in range(steps)][done:]
        so_far = self.accountant.state_dict()

        def eps(steps):
            acc = make_accountant(self.dp_args.accountant)
            acc.load_state_dict(so_far)  # the steps taken, then the planned ones
            for rate in rates[:steps]:
                acc.step(noise_multiplier=noise_multiplier, sample_rate=rate)
            return acc.get_epsilon(self.dp_args.target_delta)
        if eps(len(rates)) <= max_epsilon:
            return None
        low, high = 0, len(rates)  # eps(low) <= max_epsilon < eps(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if eps(mid) <= max_epsilon else (low, mid)
        return done + low

    def _limit_epsilon(self):
        """Where training must stop to keep epsilon <= max_epsilon; redone when the noise changes."""
        if self.dp_args.max_epsilon is not None:
            noise = self.dp_optimizer.noise_multiplier if self.dp_optimizer is not None else self.noise_multiplier
            self.allowed_steps = self._steps_within(self.dp_args.max_epsilon, self._planned_runs(), noise)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.dp_optimizer is None or self.dp_optimizer.original_optimizer is not optimizer:
            if self.noise_multiplier is None:
                raise RuntimeError("the noise multiplier is calibrated when the train dataloader is built")
            self.dp_optimizer = DPOptimizer(
                optimizer, controller=self.controller, noise_multiplier=self.noise_multiplier,
                expected_batch_size=self.expected_batch_size, sample_rate=self.sample_rate,
                accountant=self.accountant, random_source=self.random_source, tracker=self._train_loader.tracker,
                adaptive_clipping=self.adaptive_clipping)
            if self._pending_noise is not None:
                self.dp_optimizer.load_noise_state(self._pending_noise)
                self._pending_noise = None
            if self.dp_args.noise_scheduler is not None:
                scheduler = self.dp_args.noise_scheduler(self.dp_optimizer)
                if self.dp_optimizer.noise_scheduler is not scheduler:
                    raise TypeError("DPArguments.noise_scheduler must return a ghostdp.schedules.NoiseScheduler "
                                    "built on the optimizer it is given")
            self._limit_epsilon()  # at the noise multiplier of this run (resumed, scheduled)
        return optimizer

    # ------------------------------------------------------------------ the private step
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        labels = _pop_labels(inputs)
        count = labels.shape[0]
        # DDP needs the same number of forward and backward calls on every rank: a rank whose own
        # examples run out runs padding chunks of one stand-in row whose loss weighs 0.
        largest = int(across_ranks(count, self.args.device))  # every rank calls it once per step
        size = self._physical_batch_size(model) or max(1, largest)
        num_labels = getattr(getattr(self.model, "config", None), "num_labels", None)
        total = torch.zeros((), device=self.args.device)  # sum of the per-example losses of this rank's batch
        for start in range(0, math.ceil(largest / size) * size, size):
            chunk = {k: (v[start:start + size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                     for k, v in inputs.items()}
            chunk_labels = labels[start:start + size]
            padding = chunk_labels.shape[0] == 0
            if padding:
                chunk = self._prepare_inputs(dict(self._padding_row))
                chunk_labels = _pop_labels(chunk)
                self.controller.ledger.mark_next_loss(padding=True)
            self.controller.ledger.mark_next_batch(chunk_labels.shape[0])
            with self.compute_loss_context_manager():
                outputs = model(**chunk)
                losses = per_example_losses(self.dp_args.loss, outputs, chunk_labels, num_labels,
                                            self.args.label_smoothing_factor, chunk.get("attention_mask"))
                if losses.dim() != 1 or losses.shape[0] != chunk_labels.shape[0]:
                    raise ValueError(f"the per-example loss returned shape {tuple(losses.shape)}; it must be "
                                     f"({chunk_labels.shape[0]},), one loss per example")
                loss = self.controller.loss(losses, "mean", self.expected_batch_size)
            self.accelerator.backward(loss)
            if not padding:
                total += losses.detach().sum().to(total.device)
        self.dp_optimizer.pre_step(logical_batch_size=count)  # noise once, before the Trainer's grad_norm
        # The Trainer logs this: the mean per-example loss of the examples this rank saw (0 for none).
        return total / max(1, count)

    def _physical_batch_size(self, model):
        """DPArguments.max_physical_batch_size, the automatic one found at the first step (memory.py)."""
        if self.dp_args.max_physical_batch_size != "auto":
            return self.dp_args.max_physical_batch_size
        if self._physical is None:
            self._physical = self._search_physical_batch(model)
        return self._physical

    def _search_physical_batch(self, model):
        dataset, collate = self._train_loader.dataset, self._train_loader.collate_fn
        num_labels = getattr(getattr(self.model, "config", None), "num_labels", None)

        def run(b):
            inputs = self._prepare_inputs(collate([dataset[i] for i in range(b)]))
            labels = _pop_labels(inputs)
            # No gradient all-reduce: the ranks' searches may take different numbers of probes.
            with self.accelerator.no_sync(model):
                with self.compute_loss_context_manager():
                    losses = per_example_losses(self.dp_args.loss, model(**inputs), labels, num_labels,
                                                self.args.label_smoothing_factor, inputs.get("attention_mask"))
                self.controller.loss(losses).backward()

        modes_before = self.controller.step_modes.state_dict()  # restored after each probe

        def clean():
            for p in self.model.parameters():
                p.grad = None
            self.controller.reset_step_state(step_modes=modes_before)
            self.dp_optimizer.reset_step_state()

        largest = self._train_loader.logical_batches.largest_batch()
        # Training proves the layouts and checks the forward on a schedule (layout.py, independence.py).
        controller = self.controller
        with controller.pass_one.layouts.proving_every_pass(), controller.independence.checking_every_forward():
            return choose_physical_batch_size(PhysicalBatchSearch(run, clean, self.args.device, largest,
                                                                  self.dp_args.memory_budget_mb))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training and torch.is_grad_enabled():
            raise RuntimeError("DPTrainer computes training losses in training_step; a training-mode forward "
                               "through compute_loss would not be clipped")
        return super().compute_loss(model, inputs, return_outputs=return_outputs)

    # ------------------------------------------------------------------ epsilon in the logs, checkpoints
    def epsilon(self) -> float:
        steps = self.accountant.steps
        if self._epsilon_cache[0] != steps:
            self._epsilon_cache = (steps, self.accountant.get_epsilon(self.dp_args.target_delta))
        return self._epsilon_cache[1]

    def log(self, logs, *args, **kwargs):
        if self.accountant.steps:
            logs = dict(logs, epsilon=self.epsilon())
        return super().log(logs, *args, **kwargs)

    def _state(self):
        return run_state(self.accountant, self.random_source, self._train_loader, self.dp_optimizer)

    def _save_rng_state(self, output_dir):
        # Inside the checkpoint folder, before the Trainer rotates older checkpoints away: a kill after
        # rotation must not leave only checkpoints without the privacy state. Written to a temporary
        # name and renamed, so a kill mid-write leaves no truncated state file.
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            partial = os.path.join(output_dir, STATE_FILE + ".partial")
            torch.save(self._state(), partial)
            os.replace(partial, os.path.join(output_dir, STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: without the saved accountant, resuming would restart "
                                    "epsilon from zero. Resume from a checkpoint written by DPTrainer.")
        state = torch.load(path, weights_only=False)
        self.accountant.load_state_dict(state["accountant"])
        self._pending_state = state

    def _apply_pending_state(self):
        state = self._pending_state
        if state is None:
            return
        restore_streams(state, self.random_source, self._train_loader, None)
        # The optimizer is built later (create_optimizer): its noise multiplier and scheduler wait.
        self._pending_noise = state["noise"]
        self.noise_multiplier = state["noise"]["noise_multiplier"]
        self._pending_state = None


class DPTrainer(DPTrainerMixin, Trainer):
    """``DPTrainer(model=..., args=TrainingArguments(...), train_dataset=..., dp_args=DPArguments(...), ...)``."""
