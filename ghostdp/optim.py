"""DPOptimizer: noise once per logical batch, scaling, checks, accounting; then the wrapped optimizer steps.

After backward, p.grad holds the clipped sum sum_i c_i g_i (ghostdp's controller puts it there).
At the end of a logical batch, step() does, for every parameter of the wrapped optimizer:
    p.grad = (p.grad + N(0, sigma^2 C^2)) / expected_batch_size     (loss_reduction="mean")
then the wrapped optimizer's step, and records (sigma, q) in the accountant (with the loader's own batches,
poisson_sampling=False: each pass over them once, at q = 1; accounting/passes.py).

With several processes (DDP), p.grad holds the average over ranks of their clipped sums; it is
multiplied by the world size back into the sum over all ranks' examples, and every rank adds the
same noise draw (shared seed), so the noise enters once. Book-keeping writes p.grad itself and no
backward reaches DDP's reducer, so the step sums the ranks' clipped sums with its own bucketed
all-reduce, once per logical batch. One small all-reduce per step checks that the gradients and
the noise agree on all ranks.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import collector
from .accounting.passes import PassAccounting
from .data import BatchTracker, any_rank, collective_device, distributed_rank_and_size
from .model_tree import ModelTree, current_tree
from .sharding import local_parts
from .unreached import UnreachedParameters


def _wide_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor as a float64 scalar, accumulated in float32 or wider.

    (``t.sum(dtype=torch.float64)`` would first copy a float32 tensor to float64: twice its memory.)
    """
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.sum().double()


class GradientNorm:
    """The 2-norm of the clipped gradients the DP optimizer checks (DPOptimizer._check_finite): ``params``, those
    holding a gradient; ``grads``, their local parts (an FSDP2 shard's own) and ``sharded``, which are shards (or
    None); ``each``, the norm of each of ``grads``, stacked on the device (read on the first steps only:
    unreached.py); ``total``, the 0-dim float64 norm on the device, not yet read (None without gradients); ``value``,
    the host's float of it, once read."""

    __slots__ = ("params", "grads", "sharded", "each", "total", "value")

    def __init__(self, params, grads, sharded, each, total):
        self.params, self.grads, self.sharded, self.each, self.total = params, grads, sharded, each, total
        self.value = None


def gradient_norm(params) -> GradientNorm:
    """The norm of ``params``' gradients, not read back (no host sync). A NaN or inf anywhere makes a tensor's
    2-norm, and the norm of all of them, non-finite: one foreach reduction over all gradients. A finite gradient
    above ~1e19 (float32) overflows its norm, so _check_finite confirms a non-finite total element by element."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return GradientNorm(params, [], None, None, None)
    grads, sharded = local_parts([p.grad for p in params])
    norms = torch._foreach_norm(grads)
    if len({n.device for n in norms}) > 1:
        norms = [n.to(params[0].device) for n in norms]
    each = torch.stack(norms)
    return GradientNorm(params, grads, sharded, each, torch.linalg.vector_norm(each, dtype=torch.float64))


BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket size


def _all_reduce_sum(grads: list[torch.Tensor]) -> int:
    """Sums every tensor over the ranks in place, in flat buckets of up to BUCKET_BYTES per dtype and
    device (a few collectives, not one per tensor); returns the number of buckets."""
    import torch.distributed as dist
    groups = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    buckets = []
    for same in groups.values():
        bucket, size = [], 0
        for g in same:
            if bucket and size + g.numel() * g.element_size() > BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        buckets.append(bucket)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        on = collective_device(flat.device)
        reduced = flat.to(on)
        dist.all_reduce(reduced)
        if reduced is not flat:
            flat.copy_(reduced)
        torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in bucket]),
                                                                            bucket)])
    return len(buckets)


def _delegated(name: str) -> property:
    """An attribute read from and written to the wrapped optimizer (so LR schedulers see its state)."""
    return property(lambda self: getattr(self.original_optimizer, name),
                    lambda self, value: setattr(self.original_optimizer, name, value))


class PrivacyStepError(RuntimeError):
    """The training loop did something that would make this step's privacy guarantee wrong."""


class DPOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer; param_groups, state and LR schedulers are the wrapped one's.

    Args:
        optimizer: the optimizer to wrap (its parameters must belong to ``controller.module``).
        controller: the GhostClipping controller attached to the model.
        noise_multiplier: sigma; the noise std is sigma * max_grad_norm.
        expected_batch_size: q * N, the divisor of the noisy sum (loss_reduction="mean").
        sample_rate: q, recorded in the accountant at each step (Poisson sampling).
        accountant: a ghostdp.accounting accountant, or None for no accounting.
        poisson_sampling: False for the loader's own batches: the accountant then records each pass over
            them once, without amplification (accounting/passes.py).
        random_source: a ghostdp.randomness.RandomSource for the noise.
        tracker: the BatchTracker of a DPDataLoader, or None when the loop uses its own loader;
            ``fixed_batch_size`` then bounds the examples of one step.
        loss_reduction: "mean" divides by expected_batch_size; "sum" does not.
        adaptive_clipping: a clipping.adaptive.AdaptiveClipNorm that moves the controller's C after
            every step (its noisy count is accounted within ``noise_multiplier``), or None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, controller, noise_multiplier: float,
                 expected_batch_size: float, sample_rate: float, accountant, random_source,
                 tracker: BatchTracker | None = None, fixed_batch_size: int | None = None,
                 loss_reduction: str = "mean", adaptive_clipping=None, poisson_sampling: bool = True):
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("this optimizer is already a DPOptimizer; pass the original optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
        self.original_optimizer = optimizer
        self.controller = controller
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = float(expected_batch_size)
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.random_source = random_source
        self.tracker = tracker
        # The loader's chunks yielded when a gradient was first accumulated outside ghostdp's passes: that logical
        # batch's, which zero_grad() drops (a loop that yields its next batch before zero_grad() keeps that one).
        self._chunks_refused = 0
        self.fixed_batch_size = fixed_batch_size
        self.poisson_sampling = poisson_sampling
        self.passes = None if poisson_sampling or accountant is None else PassAccounting(accountant)
        self.loss_reduction = loss_reduction
        self.world_size = distributed_rank_and_size()[1]
        self.adaptive_clipping = adaptive_clipping
        if adaptive_clipping is not None:
            if controller.group_norms is not None:
                raise ValueError("adaptive clipping moves one clipping norm; it cannot be combined with "
                                 "per-group clipping norms")
            adaptive_clipping.bind(self.expected_batch_size)
            adaptive_clipping.gradient_noise_multiplier(noise_multiplier)  # refuses a count noise too small
            controller.max_grad_norm = adaptive_clipping.norm
        self._param_names = {p: n for n, p in controller.module.named_parameters()}
        # Parameters updated by noise alone, their clipped sums zero at each of the first steps: warned of.
        self.unreached = UnreachedParameters({id(p): n for p, n in self._param_names.items()})
        self._model_tree = None
        self._check_params_belong_to_model()
        self._mid_logical_batch = False   # the last step() was skipped: more chunks follow
        # Whether the last step() updated the parameters (False while the chunks of a logical batch
        # run): step an LR scheduler only when it is True.
        self.last_step_taken = False
        self._expect_fresh_grads = True   # the next norm pass must find p.grad None or zero
        self.buckets_last_step = 0        # book-keeping with several processes: all-reduces of the last step
        self._sums_written_by_mode = None  # this step's backwards wrote their clipped sums past DDP's reducer
        self._weights_compared = False  # several processes: the replicas' weights were compared (add_noise)
        self.noise_scheduler = None       # set by a schedules.NoiseScheduler built on this optimizer
        self.calibrated_epsilon = None    # set by make_private_with_epsilon (a scheduler then warns)
        self.calibrated_steps = None      # the steps that calibration planned: more are warned of, once
        self._warned_past_calibration = False
        self._pending_scheduler_state = None
        # One DP optimizer per controller: one built again for it (a Trainer's new optimizer) takes the last one's
        # place in the step ledger and the accumulation watch, whose checks would otherwise run at every norm pass
        # too, on its own parameters, and keep it alive.
        controller.ledger.open(self._on_norm_pass, count_unclipped=adaptive_clipping is not None)
        controller.accumulation.refusal_listener = self._note_refused_chunks
        # The wrapped optimizer steps once per noised step (pre_step): a step of it called directly, with the
        # clipped sums left unnoised and unaccounted, is refused (_refuse_a_step_without_noise).
        self._noise_added = False
        self._inner_step_hook = optimizer.register_step_pre_hook(self._refuse_a_step_without_noise)

    # ------------------------------------------------------- the wrapped optimizer's surface
    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def state_dict(self):
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        if self.controller.group_norms is not None:
            raise ValueError("per-group clipping fixed one clipping norm per param group when attaching; a new "
                             "group would have none. Build the optimizer with all its groups before make_private.")
        self.original_optimizer.add_param_group(param_group)
        self._check_params_belong_to_model()

    def __repr__(self):
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm="
                f"{self.controller.max_grad_norm}, expected_batch_size={self.expected_batch_size}, "
                f"wrapping {self.original_optimizer!r})")

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters this step updates: those that require grad, and any other that holds a gradient
        (one frozen between the forward and the backward, whose clipped sum book-keeping wrote from the
        forward's record): the wrapped optimizer steps it, so it gets the noise too."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad or p.grad is not None]

    @property
    def max_grad_norm(self) -> float:
        return self.controller.max_grad_norm

    # ------------------------------------------------------- noise multiplier and its schedule
    def noise_state(self) -> dict:
        """The noise multiplier, the state of its scheduler and of adaptive clipping, for a checkpoint."""
        scheduler = self.noise_scheduler.state_dict() if self.noise_scheduler is not None else None
        adaptive = self.adaptive_clipping.state_dict() if self.adaptive_clipping is not None else None
        return {"noise_multiplier": self.noise_multiplier, "scheduler": scheduler, "adaptive_clipping": adaptive}

    def load_noise_state(self, state: dict) -> None:
        """Restore ``noise_state()``; a scheduler's state waits for the scheduler if none is built yet."""
        self.noise_multiplier = float(state["noise_multiplier"])
        adaptive = state.get("adaptive_clipping")
        if (adaptive is None) != (self.adaptive_clipping is None):
            raise ValueError("this checkpoint was saved with" + (" " if adaptive else "out ") + "adaptive clipping "
                             "but this optimizer has" + (" no" if adaptive else "") + " adaptive clipping; resume "
                             "with the same max_grad_norm set-up")
        if adaptive is not None:
            self.adaptive_clipping.load_state_dict(adaptive)
            self.controller.max_grad_norm = self.adaptive_clipping.norm
        scheduler = state.get("scheduler")
        if scheduler is None:
            if self.noise_scheduler is not None:
                raise ValueError("this checkpoint was saved without a noise scheduler, but this optimizer has "
                                 "one; resume with the same set-up")
            return
        if self.noise_scheduler is not None:
            self.noise_scheduler.load_state_dict(scheduler)
        else:
            self._pending_scheduler_state = scheduler

    def pop_pending_scheduler_state(self):
        state, self._pending_scheduler_state = self._pending_scheduler_state, None
        return state

    # ------------------------------------------------------- checks
    def _check_params_belong_to_model(self):
        """Every optimizer parameter is one of the model's. The model's parameters are walked again only
        when its tree of modules and parameters changed (a replaced parameter or submodule), or when an
        optimizer parameter is not among those last seen: no module walk in an ordinary step."""
        self._model_tree = current_tree(self._model_tree, self.controller.module)
        foreign = [p for group in self.param_groups for p in group["params"] if id(p) not in self._model_tree.params]
        if foreign and not self._model_tree.fresh:
            self._model_tree = ModelTree(self.controller.module)
            foreign = [p for p in foreign if id(p) not in self._model_tree.params]
        self._model_tree.fresh = False
        if foreign:
            foreign = [tuple(p.shape) for p in foreign]
            raise ValueError(
                f"{len(foreign)} of the optimizer's parameters (shapes {foreign[:5]}) are not parameters of the "
                "private model, so their updates would be neither clipped nor private. Build the optimizer "
                "from model.parameters() of the model given to make_private; if the model's parameters were "
                "replaced after make_private (e.g. .to() with torch.__future__."
                "set_overwrite_module_params_on_conversion(True), to_empty(), or load_state_dict(assign=True)), "
                "call make_private again with the new model and a new optimizer.")

    def _on_norm_pass(self, per_example_losses):
        self._refuse_trainable_parameters_outside()
        if not self._expect_fresh_grads:
            return
        self._expect_fresh_grads = False
        flags = [p.grad.ne(0).any() for p in self.params if p.grad is not None]
        if flags and bool(torch.stack(flags).any()):
            raise PrivacyStepError(
                "a new logical batch started while p.grad still holds the previous step's gradient, which "
                "would be added into this step unclipped and counted twice. Call optimizer.zero_grad() "
                "(or model.zero_grad()) after each optimizer.step().")

    def _refuse_trainable_parameters_outside(self) -> None:
        """Before a norm pass: every parameter of the model that requires grad is one this optimizer noises. The
        controller clips every trainable parameter and leaves its clipped sum in p.grad; one outside the optimizer
        keeps it there without noise, and another optimizer stepping it, or anything else that reads it (gradient
        logging), releases it. Measured before 2026-11-26: a second optimizer over a classifier head stepped it by
        the unnoised clipped sum. It reads the parameters of the model's tree as the step's check last saw it
        (_check_params_belong_to_model): one added or replaced since was not the model's at attach, which the
        graph audit and that check refuse."""
        if self._model_tree is None:
            self._model_tree = ModelTree(self.controller.module)
        ours = {id(p) for group in self.param_groups for p in group["params"]}
        attached = self.controller._parameters  # one replaced since attaching is refused by the other checks
        outside = [p for p in self._model_tree.parameters
                   if p.requires_grad and id(p) not in ours and id(p) in attached]
        if outside:
            names = [self._param_names.get(p, f"shape {tuple(p.shape)}") for p in outside]
            raise PrivacyStepError(
                f"{len(outside)} parameters of the model require grad but are not in the DP optimizer "
                f"({names[:5]}): ghostdp clips them with the others and leaves their clipped sum in p.grad, where no "
                "noise is ever added, so another optimizer stepping them, or anything that reads their gradients "
                "(gradient logging), would release them without noise. Fix: freeze what you do not train "
                "(p.requires_grad_(False)), or give the optimizer every trainable parameter (before make_private).")

    def reset_step_state(self) -> None:
        """Forget backwards that will not be stepped (the automatic physical batch search's probes)."""
        self._expect_fresh_grads = True
        self._mid_logical_batch = False

    def _examples_of_this_step(self, params):
        """(examples clipped, backward calls, unclipped examples or None, the largest C they clipped with or
        None) of this step's DP-loss backwards, and the norm of ``params``' gradients (GradientNorm, or None
        without a backward of a DP loss), which _check_finite reads: the step's one host sync reads both."""
        passes = self.controller.ledger.take()
        clipped_with = max((record.max_grad_norm for record in passes), default=None)
        written = {record.wrote_sums for record in passes}
        if len(written) > 1 and self.world_size > 1:
            raise PrivacyStepError(
                "this step's backward calls mixed clipped sums that autograd formed, which DDP or FSDP summed over "
                "the ranks (two passes with FSDP2-sharded parameters), with clipped sums that ghostdp wrote itself, "
                "which the step sums (every other backward): the model changed between the physical batches of one "
                "logical batch. Change it only between optimizer steps.")
        self._sums_written_by_mode = written.pop() if written else None
        # One host sync for all of the step's backward calls, at the step rather than inside each backward:
        # their loss scales, for adaptive clipping their counts of unclipped examples, and the gradients' norm
        # (on a GPU a second read, after the first, found the device idle and waited for it again).
        norm = gradient_norm(params) if passes else None
        reads_norm = norm is not None and norm.total is not None
        values = [record.loss_scale.reshape(()).double() for record in passes]
        values += [record.unclipped.reshape(()).double() for record in passes if record.unclipped is not None]
        values += [norm.total] if reads_norm else []
        # The first steps also read each gradient's norm, in the same read (unreached.py).
        each = [norm.each.double()] if reads_norm and self._watches_unreached(norm) else []
        if len({v.device for v in values + each}) > 1:
            values, each = [v.cpu() for v in values], [v.cpu() for v in each]
        values = torch.cat([torch.stack(values)] + each).tolist() if values else []
        if each:
            each, values = values[len(values) - len(norm.params):], values[:len(values) - len(norm.params)]
            self.unreached.note({id(p) for p in params} - {id(p) for p, n in zip(norm.params, each) if n != 0})
        if reads_norm:
            norm.value = values.pop()
        scales, counts = values[:len(passes)], values[len(passes):]
        bad_scales = sorted({s for s in scales if s != 1.0})
        if bad_scales:
            raise PrivacyStepError(
                f"the DP loss was backpropagated with an incoming gradient of {bad_scales[0]} instead of 1 (the "
                "loss was scaled before backward(): a GradScaler, or a division by gradient_accumulation_steps). "
                "The noise is calibrated to the unscaled clipped sum, so call backward() on the loss itself; "
                "split large batches with max_physical_batch_size instead of scaling.")
        unclipped = sum(counts) if self.adaptive_clipping is not None else None
        return sum(record.examples for record in passes), len(passes), unclipped, clipped_with, norm

    def _watches_unreached(self, norm: GradientNorm) -> bool:
        """Whether this step's clipped sums are watched for the parameters they never reach (unreached.py): the first
        steps only, and not with FSDP2 shards (a shard's local part may be zero where the whole gradient is not)."""
        return not self.unreached.done and not (norm.sharded is not None and any(norm.sharded))

    def _check_batch(self, chunks, examples, backward_calls, logical_batch_size=None):
        # The examples this step must have clipped: given by the caller (DPTrainer runs the logical
        # batch itself), else the loader's record, else unknown (the loop's own batches).
        expected = logical_batch_size
        if expected is None and chunks:
            expected = chunks[-1].logical_size
        if backward_calls == 0 and expected != 0:
            raise PrivacyStepError("optimizer.step() was called without a backward() of the DP loss for this "
                                   "batch. Call loss.backward() first.")
        if (expected is None and self.tracker is not None and self.poisson_sampling
                and (self.tracker.iterated or self.tracker.logical_batches == 0)):
            # Poisson sampling, and its loader has yielded nothing since the last step (or its sampler never drew).
            raise PrivacyStepError(
                "this step's batch did not come from the Poisson-sampling data loader that make_private returned "
                "(the loop iterates the loader it gave make_private, or another one): the accountant counts the "
                "step as one Poisson draw at that loader's sample rate, and batches drawn otherwise (fixed, in "
                "order or shuffled) get no such amplification, so the reported epsilon would be too small. Fix: "
                "iterate the loader that make_private returned, or pass poisson_sampling=False to train on the "
                "loader's own batches (the accountant then assumes Poisson sampling all the same: see the README).")
        if expected is None:
            if self.fixed_batch_size is not None and examples > self.fixed_batch_size:
                raise PrivacyStepError(
                    f"this step clipped {examples} examples but the data loader's batches hold at most "
                    f"{self.fixed_batch_size}, so the accountant's sample rate would be too low (gradient "
                    "accumulation over several batches). Give the loader the logical batch size and use "
                    "max_physical_batch_size to split it.")
            return
        logical_ids = sorted({c.logical_id for c in chunks})
        if logical_batch_size is None and len(logical_ids) > 1:
            raise PrivacyStepError(
                f"this step spans {len(logical_ids)} logical batches of the data loader; each is one draw of the "
                "sampled Gaussian mechanism and needs its own noise and step. Call optimizer.step() after "
                "every batch of the loader (it skips until a logical batch is complete), and make the "
                "logical batch larger (batch size of the loader) instead of accumulating.")
        if examples != expected:
            raise PrivacyStepError(
                f"this logical batch has {expected} examples but backward() clipped {examples}: a physical "
                "batch was skipped, or examples were backpropagated twice or came from elsewhere. Run "
                "exactly one forward and backward for every batch the loader yields.")

    # ------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True):
        watch = self.controller.accumulation
        if self._mid_logical_batch and watch.refusal is None:
            return  # the clipped sums of earlier chunks of this logical batch stay
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        if watch.refusal is not None:
            # A gradient accumulated outside ghostdp's passes (accumulation.py) went with the rest of p.grad: the
            # logical batch it was added to is dropped with its backward records and the loader's record of its
            # chunks (nothing of it was released: no step, no noise, nothing to account).
            self.controller.reset_step_state()
            if self.tracker is not None:
                del self.tracker.yielded[:self._chunks_refused]
            watch.clear()
            self._mid_logical_batch = False

    def _note_refused_chunks(self) -> None:
        self._chunks_refused = len(self.tracker.yielded) if self.tracker is not None else 0

    @torch.no_grad()
    def add_noise(self, expected_batch_size: float | None = None, clipped_with: float | None = None, params=None):
        """p.grad <- (p.grad + N(0, sigma^2 C^2)) [/ expected batch size]; None grads count as zero.

        With several processes p.grad is first summed over the ranks here (ghostdp wrote the clipped sums itself:
        book-keeping, and two passes since 2026-11-27), or multiplied by the world size (FSDP averaged it).
        ``expected_batch_size``: that of this step's draw (a batch-size schedule), else the initial one.
        ``clipped_with``: the clipping norm C this step's gradients were clipped with (the largest of its
        backward calls'), else the controller's now: a C changed between backward() and step() must not
        scale the noise of gradients clipped with another. ``params``: ``self.params``, where the caller has it.
        """
        sigma = self.noise_multiplier
        if self.adaptive_clipping is not None:  # part of the budget goes to the unclipped count
            sigma = self.adaptive_clipping.gradient_noise_multiplier(sigma)
        std = sigma * (self.max_grad_norm if clipped_with is None else clipped_with)
        params = self.params if params is None else params
        distributed = self.world_size > 1 and bool(params)
        if self.loss_reduction == "sum":
            divisor = 1.0
        else:
            divisor = self.expected_batch_size if expected_batch_size is None else expected_batch_size
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # FSDP2: a sharded gradient's local part is this rank's alone; it gets its own noise (randomness.py).
        grads, sharded = local_parts([p.grad for p in params])
        replicated = params if sharded is None else [p for p, s in zip(params, sharded) if not s]
        # ghostdp wrote the clipped sums itself (GhostClipping.writes_sums_itself): DDP's reducer never ran.
        written, self._sums_written_by_mode = self._sums_written_by_mode, None
        summed_here = distributed and (self.controller.mode.keeps_factors if written is None else written)
        if summed_here:
            self.buckets_last_step = _all_reduce_sum(grads)
        clipped_fingerprint = self._fingerprint([p.grad for p in replicated]) if distributed and replicated else None
        # The replicas' weights, compared at the first step: the step sums every rank's clipped sums itself, so a
        # forward that did not go through DDP (which broadcasts rank 0's weights when it wraps the model) trains
        # each rank's own replica unnoticed otherwise.
        weights = None
        if clipped_fingerprint is not None and not self._weights_compared:
            weights, self._weights_compared = self._fingerprint([p.detach() for p in replicated]), True
        if distributed and not summed_here:
            torch._foreach_mul_(grads, self.world_size)  # DDP / FSDP averaged the ranks' clipped sums
        if std > 0:  # one noise stream over all gradients, in parameter order (randomness.py)
            shared = grads if sharded is None else [g for g, s in zip(grads, sharded) if not s]
            if shared:
                self.random_source.add_gaussian_(shared, std, divisor)
            if sharded is not None and any(sharded):
                own = [g for g, s in zip(grads, sharded) if s]
                self.random_source.add_gaussian_(own, std, divisor, shard_of_rank=distributed_rank_and_size()[0])
        elif divisor != 1.0:
            torch._foreach_div_(grads, divisor)
        if clipped_fingerprint is not None:
            modes = self.controller.step_modes  # the ranks' measures ride on the same all-reduce
            modes.agree(self._check_ranks_agree(clipped_fingerprint, self._fingerprint([p.grad for p in replicated]),
                                                modes.local_measure(), weights))

    @staticmethod
    def _fingerprint(tensors) -> torch.Tensor:
        """Two float64 numbers that summarise tensors t_k (None counts as absent): sum_k (k + 1) sum(t_k), and
        sum_k |t_k|."""
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        weighted, norms = [], []
        for k, t in enumerate(tensors):
            if t is not None:
                weighted.append(((k + 1) * _wide_sum(t)).to(device))
                norms.append(torch.linalg.vector_norm(t).double().to(device))
        if not weighted:
            return torch.zeros(2, dtype=torch.float64, device=device)
        return torch.stack([torch.stack(weighted).sum(), torch.stack(norms).sum()])

    def _summed_over_ranks(self, unclipped: float, examples: int) -> tuple[float, int]:
        if self.world_size == 1:
            return unclipped, examples
        import torch.distributed as dist
        device = self.params[0].device if self.params else torch.device("cpu")
        both = torch.tensor([unclipped, examples], dtype=torch.float64, device=collective_device(device))
        dist.all_reduce(both)
        return float(both[0]), int(both[1])

    def _check_ranks_agree(self, clipped, noisy, measures: tuple, weights=None) -> tuple:
        """Refuses clipped sums, noise or (at the first step, ``weights``) model weights that differ between the
        ranks; returns each of ``measures``' largest over the ranks (what book-keeping would keep,
        clipping/modes.StepModes), taken in the same all-reduce."""
        import torch.distributed as dist
        if weights is None:  # every rank compares its weights at the same step: all pass them, or none
            weights = torch.zeros_like(clipped)
        both = torch.cat([clipped, noisy, weights.to(clipped.device)])
        largest = torch.tensor(list(measures), dtype=both.dtype, device=both.device)
        spread = torch.cat([both, -both, largest]).to(collective_device(both.device))
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        spread = spread.cpu()
        high, low = spread[:6], -spread[6:12]
        differs = (high - low).abs() > 1e-6 * (high.abs() + low.abs()) + 1e-300
        if bool(differs[:2].any()):
            raise PrivacyStepError(
                "the clipped gradients differ between processes after backward(), so they were not all-reduced "
                "and each rank would step on its own examples only. Wrap the model in DistributedDataParallel "
                "(or let accelerate / the Trainer do it) and run forward through the wrapper.")
        if bool(differs[4:].any()):
            raise PrivacyStepError(
                "the model's weights differ between processes at the first step: each rank trains a replica of its "
                "own (nothing broadcast rank 0's weights, as DistributedDataParallel does when it wraps the model), "
                "and the step would apply the summed update to different models. Wrap the model in "
                "DistributedDataParallel (or let accelerate / the Trainer do it), or build it from the same seed on "
                "every rank.")
        if bool(differs[2:4].any()):
            raise PrivacyStepError(
                "the noise differs between processes: the ranks do not share one noise stream (a "
                "noise_generator seeded differently per rank?), so the models would drift apart and the noise "
                "would not be one draw. Give every rank the same seed / generator state.")
        return tuple(spread[12:].tolist())

    def _check_finite(self, norm: "GradientNorm", examples: int | None = None, clipped_with: float | None = None):
        """Refuse a NaN or infinite clipped gradient of the parameters ``norm`` was taken of and, in one process, a
        clipped sum larger than this step's ``examples`` gradients clipped with C = ``clipped_with`` can add up to
        (``_sum_bound``). ``norm``: gradient_norm's, its value read (_examples_of_this_step)."""
        params, grads, sharded = norm.params, norm.grads, norm.sharded
        if not params:
            return
        total = norm.value
        bound = self._sum_bound(examples, clipped_with, grads)
        finite = math.isfinite(total)
        bad = [] if finite else [p for p, g in zip(params, grads) if not bool(torch.isfinite(g).all())]
        if self.world_size > 1 and sharded is not None and any(sharded):
            bad_somewhere = any_rank(bool(bad), params[0].device)  # one rank's shard: every rank must stop
            if bad_somewhere and not bad:
                raise FloatingPointError("another process found a NaN or infinite clipped gradient in its shard "
                                         "of the parameters (its error names them)")
        if bad:
            names = [self._param_names.get(p, f"shape {tuple(p.shape)}") for p in bad]
            raise FloatingPointError(
                f"the clipped gradient of {names[:5]} is NaN or infinite. With nonfinite='skip' an example's "
                "clip coefficient is 0, but NaN or inf activations still reach p.grad (0 * nan = nan); find "
                "the example (controller.last_norms) and fix the data or the model.")
        if bound is not None and total > bound:  # inf where a finite gradient's float32 norm overflowed
            raise PrivacyStepError(
                f"p.grad holds a gradient of norm {total:.6g}, more than the clipped gradients of this step's "
                f"{examples} examples can add up to ({examples} x C = {bound:.6g} with rounding): it was changed "
                "between backward() and step() (scaled up, or another gradient added to it), and the noise, "
                "calibrated to C, would not cover it. Leave p.grad as backward() wrote it (scaling it down, as "
                "clip_grad_norm_ does, is fine).")

    # Rounding allowed above examples x C: float32 or wider sums, 16-bit ones (bf16: C to about 1e-2 an example).
    SUM_BOUND_SLACK = {torch.float16: 5e-2, torch.bfloat16: 5e-2}

    def _sum_bound(self, examples, clipped_with, grads):
        """The largest norm this step's clipped sum can have, examples x C (triangle inequality) with some
        rounding slack; None where it is not known here (several processes: the ranks' sums are combined
        after this check, or DDP has already averaged them)."""
        if examples is None or clipped_with is None or self.world_size > 1:
            return None
        slack = max([self.SUM_BOUND_SLACK.get(dtype, 1e-3) for dtype in {g.dtype for g in grads}], default=1e-3)
        return examples * clipped_with * (1 + slack)

    @collector.paused()
    def pre_step(self, logical_batch_size: int | None = None) -> bool:
        """Noise and checks if a logical batch is complete; returns False while chunks remain.

        ``logical_batch_size``: the number of examples of the logical batch just backpropagated,
        for callers that run the whole logical batch themselves (it replaces the loader's chunks).
        """
        if self.controller.accumulation.refusal is not None:  # p.grad holds an unclipped gradient
            raise PrivacyStepError(self.controller.accumulation.refusal)
        chunks = self.tracker.yielded if self.tracker is not None else []
        if logical_batch_size is None and chunks and not chunks[-1].is_last:
            self._mid_logical_batch = True
            return False
        self._check_params_belong_to_model()
        params = self.params
        examples, backward_calls, unclipped, clipped_with, norm = self._examples_of_this_step(params)
        self._check_batch(chunks, examples, backward_calls, logical_batch_size)
        if self.tracker is not None:
            self.tracker.take_yielded()
        if backward_calls:
            self._check_finite(norm, examples, clipped_with)
        # The rate this batch was drawn with (a batch-size schedule gives each epoch its own).
        drawn = chunks[-1] if chunks and chunks[-1].sample_rate is not None else None
        sample_rate = drawn.sample_rate if drawn is not None else self.sample_rate
        expected = drawn.expected_size if drawn is not None else self.expected_batch_size
        self.add_noise(expected, clipped_with, params)
        if self.adaptive_clipping is not None:  # C for the next step, from the noisy unclipped count
            unclipped, examples = self._summed_over_ranks(unclipped, examples)
            self.controller.max_grad_norm = self.adaptive_clipping.update(
                unclipped, examples, expected, self.noise_multiplier, self.random_source)
        if self.passes is not None:
            self.passes.record(self.noise_multiplier, chunks[-1].pass_index if chunks else None)
        elif self.accountant is not None:
            self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=sample_rate)
        if self.accountant is not None:
            self._warn_past_calibration()
        self._mid_logical_batch = False
        self._expect_fresh_grads = True
        self._noise_added = True
        return True

    def _warn_past_calibration(self):
        """Once: the accountant has counted more steps than the noise was calibrated for (make_private_with_epsilon's
        epochs), so the epsilon spent now exceeds target_epsilon. engine.get_epsilon reports it correctly; the
        warning says that the target no longer holds."""
        if (self._warned_past_calibration or self.calibrated_steps is None
                or self.accountant.steps <= self.calibrated_steps):
            return
        self._warned_past_calibration = True
        unit = "steps" if self.passes is None else "passes over the data"
        warnings.warn(
            f"training has gone past the {self.calibrated_steps} {unit} that the noise was calibrated for "
            f"(target_epsilon={self.calibrated_epsilon}): the privacy spent now exceeds that target "
            "(engine.get_epsilon(delta) gives it). Fix: stop after the epochs given to make_private_with_epsilon, "
            "or calibrate for as many epochs as you train.", stacklevel=4)

    def _refuse_a_step_without_noise(self, optimizer, args, kwargs):
        if self._noise_added or not self.controller.attached:  # detached: the model trains as before attaching
            self._noise_added = False
            return
        if not any(p.grad is not None and bool(p.grad.any()) for group in optimizer.param_groups
                   for p in group["params"]):
            return  # no gradient, nothing of the data (torch.distributed.checkpoint steps so to make the state)
        raise PrivacyStepError(
            "the wrapped optimizer was stepped without ghostdp's noise: step() was called on the optimizer given "
            "to make_private, not on the one it returned (or twice after one noised step), so the clipped "
            "gradients would update the model without noise and the step would not be accounted. Fix: call "
            "step() on the optimizer that make_private returned (a loop of one's own that steps the wrapped "
            "optimizer itself calls dp_optimizer.pre_step() first, as DPTrainer does).")

    @collector.paused()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_taken = self.pre_step()
        if self.last_step_taken:
            self.original_optimizer.step()
        return loss
