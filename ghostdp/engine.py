"""PrivacyEngine: turns a model, optimizer, loader and criterion into their DP-SGD counterparts."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from .accounting import check_noise_multiplier, get_noise_multiplier, make_accountant
from .clipping import DPCriterion, GhostClipping, check_max_grad_norm
from .clipping.adaptive import AdaptiveClipNorm
from .clipping.modes import clipping_mode
from .clipping import per_example_loss
from .data import (BatchTracker, DPDataLoader, PoissonBatchSampler, distributed_rank_and_size,
                   poisson_rate_and_steps)
from .sharding import has_sharded_parameters, is_sharded
from .memory import PhysicalBatchSearch, choose_physical_batch_size
from .optim import DPOptimizer
from .randomness import RandomSource
from .schedules import SamplingPlan

_LOADER_SETTINGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device")


def _sampling_plan(data_loader, world_size: int) -> tuple[float, int, int]:
    """(q, dataset size, steps per epoch) of ``data_loader`` (data.poisson_rate_and_steps). In one process an epoch
    is the loader's own length (drop_last included), and a loader without batch_size has q = 1 / len(loader)."""
    n = len(data_loader.dataset)
    batch_size = data_loader.batch_size
    if world_size > 1 and not batch_size:
        raise ValueError("with several processes the data loader needs a batch_size (each process's expected "
                         "batch), from which the sample rate batch_size * world_size / len(dataset) follows")
    sample_rate, steps_per_epoch = poisson_rate_and_steps(batch_size or 1, world_size, n)  # refuses an empty dataset
    if world_size == 1:
        sample_rate = sample_rate if batch_size else min(1.0, 1 / len(data_loader))
        steps_per_epoch = len(data_loader)
    return sample_rate, n, steps_per_epoch


def _users_sampler(data_loader):
    """The name of the loader's own sampler or batch sampler, or None for torch's standard ones (a DataLoader
    with shuffle=True or False, a DistributedSampler) and ghostdp's Poisson batches: a weighted, balanced or
    with-replacement one."""
    sampler, batch_sampler = data_loader.sampler, data_loader.batch_sampler
    standard = (type(sampler) is torch.utils.data.SequentialSampler or type(sampler) is DistributedSampler
                or (type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement))
    if not standard:
        return type(sampler).__name__ + (" (with replacement)" if getattr(sampler, "replacement", False) else "")
    if batch_sampler is not None and type(batch_sampler) not in (torch.utils.data.BatchSampler, PoissonBatchSampler):
        return type(batch_sampler).__name__
    return None


def _check_sampler(data_loader, poisson_sampling: bool) -> None:
    """Poisson sampling replaces the loader's sampler: a warning where it was the user's own (its weighting is
    lost). Without it the loader's batches are used as they are, and the accountant assumes that each example is
    in at most one batch a pass: refused for a sampler that draws some examples more often or twice in a batch."""
    own = _users_sampler(data_loader)
    if own is None:
        if not poisson_sampling:
            _check_one_batch_a_pass(data_loader.sampler, len(data_loader.dataset))
        return
    if poisson_sampling:
        warnings.warn(f"the data loader's {own} is not used: with Poisson sampling every example joins each batch "
                      "with the same probability (batch size / dataset size), which the privacy accounting "
                      "assumes, so a weighted or balanced sampler's weighting is not applied. Weight the "
                      "examples' losses instead.")
        return
    raise ValueError(
        f"with poisson_sampling=False the data loader's {own} draws the batches, but the accountant assumes each "
        "example is in at most one batch a pass over the loader: a weighted, balanced or "
        "with-replacement sampler puts some examples in more batches (or twice in one, clipped twice), so their "
        "privacy loss would exceed the epsilon reported. Fix: poisson_sampling=True (the default), or a "
        "DataLoader with shuffle=True or False.")


def _check_one_batch_a_pass(sampler, dataset_size: int) -> None:
    """torch's standard samplers that still repeat examples within a pass: a RandomSampler asked for more
    examples than the dataset has (it chains permutations) and a DistributedSampler that pads its shards with
    examples of other ranks' (drop_last=False and a dataset size its world size does not divide)."""
    if type(sampler) is torch.utils.data.RandomSampler and sampler.num_samples > dataset_size:
        raise ValueError(
            f"with poisson_sampling=False the loader's RandomSampler draws {sampler.num_samples} examples a pass "
            f"from a dataset of {dataset_size}, so some examples are in two batches of a pass and the accounting "
            "(one Gaussian mechanism a pass) would be optimistic. Fix: num_samples <= len(dataset) (train more "
            "epochs instead), or poisson_sampling=True.")
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last and dataset_size % sampler.num_replicas:
        raise ValueError(
            f"with poisson_sampling=False the DistributedSampler pads the {dataset_size} examples to "
            f"{sampler.total_size} for {sampler.num_replicas} processes by repeating some, which are then in two "
            "batches of a pass and the accounting (one Gaussian mechanism a pass) would be optimistic. Fix: "
            "DistributedSampler(..., drop_last=True), a dataset size the number of processes divides, or "
            "poisson_sampling=True.")


def _check_batch_size_schedule(schedule, data_loader, poisson_sampling) -> None:
    if schedule is None:
        return
    if not poisson_sampling:
        raise ValueError("a batch_size_schedule draws each epoch's batches at its own sample rate, which needs "
                         "poisson_sampling=True")
    if not data_loader.batch_size:
        raise ValueError("a batch_size_schedule scales the data loader's batch_size; give the loader one")


def run_state(accountant, random_source, data_loader, optimizer) -> dict:
    """What a resumed run needs besides model and optimizer: accountant history, random streams,
    loader position, noise multiplier and its schedule (shared by PrivacyEngine and DPTrainer
    checkpoints)."""
    return {"accountant": accountant.state_dict(), "random": random_source.state_dict(),
            "data_loader": data_loader.state_dict() if data_loader is not None else {},
            "noise": optimizer.noise_state() if optimizer is not None else None}


def restore_streams(state: dict, random_source, data_loader, optimizer) -> None:
    """The random streams, loader position and noise of ``run_state`` (the accountant is restored on
    its own, at once, while these wait until the loader and optimizer exist)."""
    random_source.load_state_dict(state["random"])
    if data_loader is not None:
        data_loader.load_state_dict(state["data_loader"])
    if optimizer is not None and state.get("noise") is not None:
        optimizer.load_noise_state(state["noise"])


def _global_rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_global_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class PrivacyEngine:
    """DP-SGD with ghost clipping, Opacus-style.

    Args:
        accountant: "prv" (tight numerical composition, default) or "rdp".
        secure_mode: draw noise and Poisson samples from OS entropy (slower; not reproducible).
        seed: seed of the noise and sampling streams (default mode only; random if None).
    """

    def __init__(self, accountant: str = "prv", secure_mode: bool = False, seed: int | None = None):
        self.accountant = make_accountant(accountant)
        self.secure_mode = bool(secure_mode)
        self._seed = seed
        self.random_source = RandomSource(secure=self.secure_mode, seed=seed)
        self.controller = None
        self.optimizer = None
        self.data_loader = None
        self._pending_state = None
        self._prepared = None  # what private_data_loader() built, for make_private

    # ------------------------------------------------------------------ make_private
    def private_data_loader(self, data_loader, *, poisson_sampling: bool = True,
                            max_physical_batch_size: int | None = None, batch_size_schedule=None):
        """The private loader alone, for frameworks that ask for the data before the optimizer exists
        (Lightning): give the loader returned here to ``make_private`` as its data_loader later, with
        the same sampling arguments. Calling it again returns the same loader (its position kept)."""
        if self._prepared is not None:
            return self._prepared[0]
        if distributed_rank_and_size()[1] > 1:
            self.random_source.agree_across_ranks(seed_given=self._seed is not None)
        self._prepared = self._private_loader(data_loader, poisson_sampling, max_physical_batch_size,
                                              batch_size_schedule)
        return self._prepared[0]

    def make_private(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, data_loader,
                     criterion: torch.nn.Module | None = None, noise_multiplier: float, max_grad_norm: float,
                     poisson_sampling: bool = True, clipping: str = "ghost",
                     max_physical_batch_size: int | None = None, loss_reduction: str = "mean",
                     nonfinite: str = "error", noise_generator: torch.Generator | None = None,
                     batch_size_schedule=None, memory_budget_mb: float | None = None, physical_batch_probe=None):
        """Returns (module, optimizer, criterion, data_loader), ready for an ordinary training loop.

        The module is the same object with hooks attached. The criterion (built from the one
        given, which must support reduction="none") returns the DP loss; without a criterion,
        build losses with ``engine.controller.loss(per_example_losses)``. With
        poisson_sampling=True the loader is rebuilt to draw Poisson batches of expected size
        batch_size; with False the loader's own batches are kept (shuffled or in order), each example
        is in at most one batch a pass, and the accountant records each pass as one Gaussian
        mechanism without amplification (accounting/passes.py): a proven bound, larger than
        Poisson's. Accounting such batches as Poisson draws, as Opacus and others do, can be optimistic.

        Several processes (torchrun / accelerate, process group initialised first): batch_size is
        each process's expected share (q = batch_size * world_size / len(dataset)), each rank
        samples its own shard, all ranks share rank 0's seed so that they add one identical noise
        draw, and the model must run forward through DistributedDataParallel (before or after this
        call). With clipping="bookkeeping" the step sums the ranks' clipped sums itself (bucketed
        all-reduce; DDP's own hooks never fire), except in steps under activation checkpointing,
        which take ghost's two passes (DDP sums their second; clipping/modes.py). secure_mode is
        single-process only, except under FSDP2.
        FSDP2 (``fully_shard`` before building the optimizer; ghost clipping): each rank adds the noise
        of the gradient shards it owns, from its own stream (sharding.py, randomness.py).

        ``max_grad_norm``: the clipping norm C; a list [C_1, ..., C_K], one per param group of the
        optimizer (per-group clipping, clipping="bookkeeping"; the noise is calibrated to
        sqrt(sum_k C_k^2)); or an ``AdaptiveClipNorm`` (C follows a quantile of the norms).

        ``max_physical_batch_size="auto"`` runs a few real private steps (forward and both passes, no
        optimizer step) on the dataset's first examples and keeps the largest physical batch that fits:
        on CUDA within 90% of the free memory (or ``memory_budget_mb``), on a CPU within
        ``memory_budget_mb``. It needs the criterion and (inputs, target) batches, or
        ``physical_batch_probe(module, batch) -> per-example losses``. The choice is logged and set
        as ``loader.max_physical_batch_size``; the logical batch and the accounting do not change.

        ``batch_size_schedule`` (ghostdp.schedules: StepBatchSize, LambdaBatchSize) changes the
        expected logical batch size epoch by epoch, from the loader's batch_size; each step is
        accounted with the rate its batch was drawn with. Noise schedules are built on the
        returned optimizer (ghostdp.schedules.ExponentialNoise(optimizer, gamma=...)).
        """
        check_noise_multiplier(noise_multiplier)
        if max_physical_batch_size != "auto" and (memory_budget_mb is not None or physical_batch_probe is not None):
            raise ValueError("memory_budget_mb and physical_batch_probe are for max_physical_batch_size='auto'")
        if max_physical_batch_size == "auto" and distributed_rank_and_size()[1] > 1 and has_sharded_parameters(module):
            raise ValueError(
                "max_physical_batch_size='auto' is not supported with FSDP2 over several processes: every probe "
                "step gathers and reduce-scatters weights across the ranks, whose searches may take different "
                "numbers of probes and would then wait on each other forever. Fix: give max_physical_batch_size "
                "as a number.")
        adaptive, parameter_groups = None, None
        if isinstance(max_grad_norm, AdaptiveClipNorm):
            adaptive, max_grad_norm = max_grad_norm, max_grad_norm.norm
        elif isinstance(max_grad_norm, (list, tuple)):  # per-group: one norm per param group
            parameter_groups = [group["params"] for group in optimizer.param_groups]
        else:
            check_max_grad_norm(max_grad_norm)
        clipping_mode(clipping)  # a clear error for an unknown mode before anything is built
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if self.controller is not None:
            raise RuntimeError("this PrivacyEngine already made a model private; use one engine per model "
                               "(its accountant belongs to that training run)")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if criterion is not None:
            reduction = getattr(criterion, "reduction", None)
            if reduction is not None and {"sum": "sum"}.get(reduction, "mean") != loss_reduction:
                raise ValueError(f"the criterion's reduction is {reduction!r} but loss_reduction is "
                                 f"{loss_reduction!r}; they must agree")
        if noise_generator is not None:
            if self.secure_mode:
                raise ValueError("secure_mode draws noise from OS entropy; do not pass a noise_generator")
            self.random_source = RandomSource(seed=self.random_source.seed, noise_generator=noise_generator)
        if distributed_rank_and_size()[1] > 1:
            trained = [p for p in module.parameters() if p.requires_grad]
            self.random_source.agree_across_ranks(seed_given=self._seed is not None,
                                                  sharded_only=bool(trained) and all(map(is_sharded, trained)))

        if self._prepared is not None and data_loader is self._prepared[0]:  # from private_data_loader()
            loader, sample_rate, expected_batch_size, tracker, fixed = self._prepared
        else:
            loader, sample_rate, expected_batch_size, tracker, fixed = self._private_loader(
                data_loader, poisson_sampling, max_physical_batch_size, batch_size_schedule)
        controller = GhostClipping(module, max_grad_norm, nonfinite=nonfinite, clipping=clipping,
                                   parameter_groups=parameter_groups)
        try:
            dp_optimizer = DPOptimizer(
                optimizer, controller=controller, noise_multiplier=float(noise_multiplier),
                expected_batch_size=expected_batch_size, sample_rate=sample_rate, accountant=self.accountant,
                random_source=self.random_source, tracker=tracker, fixed_batch_size=fixed,
                loss_reduction=loss_reduction, adaptive_clipping=adaptive, poisson_sampling=poisson_sampling)
        except Exception:
            controller.detach()
            raise
        dp_criterion = None
        if criterion is not None:
            dp_criterion = DPCriterion(criterion, controller, expected_batch_size)
        loader.controller = controller
        if max_physical_batch_size == "auto":
            try:
                chosen = self._automatic_physical_batch(module, loader, controller, dp_optimizer, criterion,
                                                        physical_batch_probe, memory_budget_mb)
            except BaseException:
                controller.detach()
                raise
            loader.set_max_physical_batch_size(chosen)
        self.controller, self.optimizer, self.data_loader = controller, dp_optimizer, loader
        self._apply_pending_state()
        return module, dp_optimizer, dp_criterion, loader

    def _automatic_physical_batch(self, module, loader, controller, optimizer, criterion, probe, budget_mb) -> int:
        """The largest physical batch whose private step fits (memory.py); the state is as before."""
        dataset = loader.dataset
        device = next(module.parameters()).device
        if probe is None and criterion is None:
            raise ValueError("max_physical_batch_size='auto' runs real steps: give make_private the criterion "
                             "(for (inputs, target) batches) or physical_batch_probe(module, batch) -> per-example "
                             "losses")

        def losses_of(batch):
            if probe is not None:
                return probe(module, batch)
            if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                raise ValueError(f"max_physical_batch_size='auto' with a criterion expects (inputs, target, ...) "
                                 f"batches, got a {type(batch).__name__}; give physical_batch_probe(module, batch) "
                                 "-> per-example losses")
            return per_example_loss(criterion, module(batch[0]), batch[1])

        def run(b):
            batch = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                             loader.collate_fn([dataset[i] for i in range(b)]))
            training = module.training
            module.train()
            # A DDP-wrapped module must not all-reduce: the ranks' searches may take different numbers of probes.
            no_sync = module.no_sync() if hasattr(module, "no_sync") else contextlib.nullcontext()
            try:
                with no_sync:
                    controller.loss(losses_of(batch)).backward()
            finally:
                module.train(training)

        modes_before = controller.step_modes.state_dict()  # restored after each probe

        def clean():
            for p in module.parameters():
                p.grad = None
            controller.reset_step_state(step_modes=modes_before)
            optimizer.reset_step_state()

        logical = loader.logical_batches
        if isinstance(logical, PoissonBatchSampler):
            largest = logical.largest_batch()
        else:  # the loader's own fixed batches
            largest = min(getattr(logical, "batch_size", None) or len(dataset), len(dataset))
        # Training proves the layouts and checks the forward on a schedule (layout.py, independence.py).
        with controller.pass_one.layouts.proving_every_pass(), controller.independence.checking_every_forward():
            return choose_physical_batch_size(PhysicalBatchSearch(run, clean, device, largest, budget_mb))

    def _private_loader(self, data_loader, poisson_sampling, max_physical_batch_size, batch_size_schedule=None):
        if not isinstance(data_loader, DataLoader):
            if poisson_sampling or max_physical_batch_size is not None:
                raise TypeError(f"data_loader is a {type(data_loader).__name__}; Poisson sampling and physical "
                                "batches need a torch.utils.data.DataLoader over a dataset with len()")
            raise TypeError("with poisson_sampling=False, data_loader must still be a torch DataLoader so that "
                            "the sample rate (batch_size / len(dataset)) is known")
        dataset = data_loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("DP-SGD needs a map-style dataset with len() (each example must be addressable to "
                            "sample it); an IterableDataset cannot be Poisson-sampled")
        world_size = distributed_rank_and_size()[1]
        if world_size > 1 and not poisson_sampling and not isinstance(data_loader.sampler, DistributedSampler):
            raise ValueError(
                "with several processes and poisson_sampling=False, the data loader must shard the data with a "
                "torch DistributedSampler; otherwise every process trains on the same examples and the sample "
                "rate (and epsilon) would be wrong. Use Poisson sampling (each rank draws from its own shard).")
        sample_rate, n, steps_per_epoch = _sampling_plan(data_loader, world_size)
        _check_batch_size_schedule(batch_size_schedule, data_loader, poisson_sampling)
        _check_sampler(data_loader, poisson_sampling)
        expected_batch_size = sample_rate * n
        settings = {k: getattr(data_loader, k) for k in _LOADER_SETTINGS if hasattr(data_loader, k)}
        if settings.get("num_workers", 0) == 0:
            settings.pop("prefetch_factor", None)
            settings["persistent_workers"] = False
        tracker = BatchTracker()
        if poisson_sampling:
            if data_loader.drop_last:
                warnings.warn("drop_last is ignored with Poisson sampling: batches have random sizes")
            logical = PoissonBatchSampler(n, sample_rate, steps_per_epoch, source=self.random_source,
                                          batch_size_schedule=batch_size_schedule)
            fixed = None
        else:
            logical = data_loader.batch_sampler
            fixed = data_loader.batch_size
        if max_physical_batch_size == "auto":
            max_physical_batch_size = None  # set by make_private once the search has run
        loader = DPDataLoader(dataset, logical, max_physical_batch_size=max_physical_batch_size,
                              tracker=tracker, collate_fn=data_loader.collate_fn, **settings)
        return loader, sample_rate, expected_batch_size, tracker, fixed

    def make_private_with_epsilon(self, *, module, optimizer, data_loader, criterion=None,
                                  target_epsilon: float, target_delta: float, epochs: int,
                                  max_grad_norm: float, **kwargs):
        """make_private with the smallest noise multiplier whose epsilon after ``epochs`` stays <= target_epsilon."""
        if "noise_multiplier" in kwargs:
            raise ValueError("make_private_with_epsilon chooses noise_multiplier; do not pass one")
        sampling = dict(batch_size_schedule=kwargs.get("batch_size_schedule"),
                        poisson_sampling=kwargs.get("poisson_sampling", True))
        sigma = self.noise_for_epsilon(data_loader, target_epsilon=target_epsilon, target_delta=target_delta,
                                       epochs=epochs, **sampling)
        private = self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                    criterion=criterion, noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs)
        self.optimizer.calibrated_epsilon = target_epsilon
        self.optimizer.calibrated_steps = self.calibrated_steps(data_loader, epochs=epochs, **sampling)
        return private

    def noise_for_epsilon(self, data_loader, *, target_epsilon: float, target_delta: float, epochs: int,
                          batch_size_schedule=None, poisson_sampling: bool = True) -> float:
        """The smallest noise multiplier whose epsilon after ``epochs`` of this loader (and batch-size
        schedule) stays <= target_epsilon, with this engine's accountant."""
        plan = self._calibration_plan(data_loader, epochs, batch_size_schedule, poisson_sampling)
        return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta, plan=plan,
                                    accountant=self.accountant.mechanism)

    def calibrated_steps(self, data_loader, *, epochs: int, batch_size_schedule=None,
                         poisson_sampling: bool = True) -> int:
        """The steps of ``epochs`` of this loader (and batch-size schedule): what noise_for_epsilon calibrates for.
        Set as the DP optimizer's ``calibrated_steps``, it warns once training goes past them. With
        poisson_sampling=False, the passes over the data (``epochs``): what the accountant counts then."""
        return sum(steps for _, steps in self._calibration_plan(data_loader, epochs, batch_size_schedule,
                                                                poisson_sampling))

    def _calibration_plan(self, data_loader, epochs, batch_size_schedule, poisson_sampling) -> list:
        """(sample rate, steps) of each run of ``epochs`` of the loader; the loader's own batches are one Gaussian
        mechanism (sample rate 1) a pass (accounting/passes.py)."""
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        if not isinstance(data_loader, DataLoader) or not hasattr(data_loader.dataset, "__len__"):
            raise TypeError("calibrating the noise needs a torch DataLoader over a dataset with len()")
        sample_rate, n, steps_per_epoch = _sampling_plan(data_loader, distributed_rank_and_size()[1])
        _check_batch_size_schedule(batch_size_schedule, data_loader, poisson_sampling)
        if not poisson_sampling:
            return [(1.0, epochs)]
        return SamplingPlan(sample_rate, steps_per_epoch, n, batch_size_schedule).steps(epochs)

    # ------------------------------------------------------------------ privacy spent, state
    def get_epsilon(self, delta: float) -> float:
        return self.accountant.get_epsilon(delta)

    def state_dict(self) -> dict:
        """Accountant history, sampler position and random state (the noise and sampling streams, and
        torch's global RNG, which draws dropout masks), and the measures that pick each step's clipping mode: save
        with the model and optimizer."""
        state = dict(run_state(self.accountant, self.random_source, self.data_loader, self.optimizer),
                     torch_rng=_global_rng_state())
        if self.controller is not None:  # the measures that pick each step's clipping mode (clipping/modes.py)
            state["step_modes"] = self.controller.step_modes.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved run; before make_private the sampler and noise parts wait until it is called."""
        self.accountant.load_state_dict(state["accountant"])
        self._pending_state = state
        if self.controller is not None:
            self._apply_pending_state()

    def _apply_pending_state(self):
        state = self._pending_state
        if state is None:
            return
        restore_streams(state, self.random_source, self.data_loader, self.optimizer)
        if "torch_rng" in state:
            _restore_global_rng(state["torch_rng"])
        if "step_modes" in state:
            self.controller.step_modes.load_state_dict(state["step_modes"])
        self._pending_state = None
