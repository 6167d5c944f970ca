"""Schedules of the noise multiplier and of the expected batch size.

Every optimizer step is accounted with its own (noise multiplier, sample rate), so a schedule
changes what is spent, never the correctness of what ``get_epsilon`` reports.

- Noise schedulers act on a ``DPOptimizer``'s ``noise_multiplier`` the way torch's learning-rate
  schedulers act on a learning rate: build one on the optimizer, call ``step()`` once per epoch
  (or per step: the unit is yours). Value at count k: sigma_0 * factor(k), sigma_0 the noise
  multiplier when the scheduler was built.
- Batch-size schedules are given to ``make_private`` (or ``DPArguments``) and set the expected
  logical batch size b_e of each epoch e: b_e = min(N, b_0 * factor(e)), sample rate q_e = b_e / N,
  ceil(N / b_e) draws in the epoch. They are pure functions of the epoch, so a batch drawn ahead
  by a prefetching loader carries the rate it was drawn with, and the optimizer records that rate.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

from .accounting import check_noise_multiplier, check_positive


def _check_factor(factor, what: str, epoch: int) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
        raise ValueError(f"the {what} schedule gave the factor {factor!r} at epoch {epoch}; it must be a finite "
                         "number > 0")
    return float(factor)


def _check_step_size(step_size) -> None:
    if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size < 1:
        raise ValueError(f"step_size must be an integer >= 1, got {step_size!r}")


# ---------------------------------------------------------------------------------------- noise
class NoiseScheduler:
    """Sets ``optimizer.noise_multiplier`` to ``initial * factor(last_epoch)`` at each ``step()``.

    Built on a DPOptimizer (``make_private``'s optimizer). The engine's and DPTrainer's state
    dicts carry the scheduler's state, so a resumed run continues the schedule.
    """

    def __init__(self, optimizer):
        from .optim import DPOptimizer
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"a noise scheduler acts on the DPOptimizer returned by make_private, got "
                            f"{type(optimizer).__name__}")
        if optimizer.noise_scheduler is not None:
            raise ValueError("this DPOptimizer already has a noise scheduler; two would overwrite each other's "
                             "noise multiplier. Combine them into one LambdaNoise.")
        if optimizer.calibrated_epsilon is not None:
            warnings.warn(f"the noise multiplier was calibrated (make_private_with_epsilon) for epsilon "
                          f"{optimizer.calibrated_epsilon} with a constant noise multiplier; a schedule changes "
                          "what the run spends. engine.get_epsilon(delta) reports what was spent.")
        self.optimizer = optimizer
        self.initial_noise_multiplier = float(optimizer.noise_multiplier)
        self.last_epoch = 0
        optimizer.noise_scheduler = self
        pending = optimizer.pop_pending_scheduler_state()
        if pending is not None:
            self.load_state_dict(pending)
        else:
            self._apply()

    def factor(self, epoch: int) -> float:
        raise NotImplementedError

    def noise_multiplier_at(self, epoch: int) -> float:
        value = self.initial_noise_multiplier * _check_factor(self.factor(epoch), "noise", epoch)
        check_noise_multiplier(value)
        return value

    def _apply(self) -> None:
        self.optimizer.noise_multiplier = self.noise_multiplier_at(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"kind": type(self).__name__, "initial_noise_multiplier": self.initial_noise_multiplier,
                "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"this state is from a {state.get('kind')} noise scheduler, not a "
                             f"{type(self).__name__}; build the same scheduler to resume")
        self.initial_noise_multiplier = float(state["initial_noise_multiplier"])
        self.last_epoch = int(state["last_epoch"])
        self._apply()


class ExponentialNoise(NoiseScheduler):
    """sigma_k = sigma_0 * gamma ** k."""

    def __init__(self, optimizer, *, gamma: float):
        check_positive(gamma, "gamma")
        self.gamma = float(gamma)
        super().__init__(optimizer)

    def factor(self, epoch):
        return self.gamma ** epoch


class StepNoise(NoiseScheduler):
    """sigma_k = sigma_0 * gamma ** (k // step_size)."""

    def __init__(self, optimizer, *, step_size: int, gamma: float):
        _check_step_size(step_size)
        check_positive(gamma, "gamma")
        self.step_size, self.gamma = step_size, float(gamma)
        super().__init__(optimizer)

    def factor(self, epoch):
        return self.gamma ** (epoch // self.step_size)


class LambdaNoise(NoiseScheduler):
    """sigma_k = sigma_0 * noise_lambda(k). The function itself is not saved: build the same one to resume."""

    def __init__(self, optimizer, *, noise_lambda: Callable[[int], float]):
        if not callable(noise_lambda):
            raise TypeError("noise_lambda must be a function of the epoch count returning a factor")
        self.noise_lambda = noise_lambda
        super().__init__(optimizer)

    def factor(self, epoch):
        return self.noise_lambda(epoch)


# ---------------------------------------------------------------------------------------- batch size
class BatchSizeSchedule:
    """Expected logical batch size of epoch e: min(N, b_0 * factor(e)); a pure function of e."""

    def factor(self, epoch: int) -> float:
        raise NotImplementedError


class StepBatchSize(BatchSizeSchedule):
    """b_e = b_0 * gamma ** (e // step_size): growing batches for gamma > 1."""

    def __init__(self, *, step_size: int, gamma: float):
        _check_step_size(step_size)
        check_positive(gamma, "gamma")
        self.step_size, self.gamma = step_size, float(gamma)

    def factor(self, epoch):
        return self.gamma ** (epoch // self.step_size)


class LambdaBatchSize(BatchSizeSchedule):
    """b_e = b_0 * batch_lambda(e)."""

    def __init__(self, batch_lambda: Callable[[int], float]):
        if not callable(batch_lambda):
            raise TypeError("batch_lambda must be a function of the epoch returning a factor")
        self.batch_lambda = batch_lambda

    def factor(self, epoch):
        return self.batch_lambda(epoch)


class SamplingPlan:
    """(sample rate, draws) of every epoch: (sample_rate, steps_per_epoch) throughout without a schedule;
    with one, epoch e expects min(N, b_0 * factor(e)) examples, b_0 = sample_rate * N."""

    def __init__(self, sample_rate: float, steps_per_epoch: int, dataset_size: int,
                 schedule: BatchSizeSchedule | None = None):
        if schedule is not None and not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(f"batch_size_schedule must be a ghostdp.schedules.BatchSizeSchedule (StepBatchSize, "
                            f"LambdaBatchSize), got {type(schedule).__name__}")
        self.sample_rate, self.steps_per_epoch = float(sample_rate), int(steps_per_epoch)
        self.dataset_size, self.schedule = dataset_size, schedule
        self._cache = {}

    def at(self, epoch: int) -> tuple[float, int]:
        """(q_e, draws in epoch e)."""
        if self.schedule is None:
            return self.sample_rate, self.steps_per_epoch
        if epoch not in self._cache:
            factor = _check_factor(self.schedule.factor(epoch), "batch-size", epoch)
            size = min(float(self.dataset_size), self.sample_rate * self.dataset_size * factor)
            self._cache[epoch] = (size / self.dataset_size, max(1, math.ceil(self.dataset_size / size)))
        return self._cache[epoch]

    def steps(self, epochs: float) -> list[tuple[float, int]]:
        """[(q, draws)] of the first ``epochs`` epochs (a fractional last epoch runs that share of its draws)."""
        runs = []
        whole = int(epochs)
        for e in range(whole):
            runs.append(self.at(e))
        if epochs > whole:
            q, n = self.at(whole)
            runs.append((q, max(1, math.ceil((epochs - whole) * n))))
        return runs

    def first_steps(self, count: int) -> list[tuple[float, int]]:
        """[(q, draws)] of the first ``count`` draws, epoch by epoch."""
        runs, epoch = [], 0
        while count > 0:
            q, n = self.at(epoch)
            runs.append((q, min(n, count)))
            count, epoch = count - n, epoch + 1
        return runs

    def epoch_of_step(self, step: int) -> float:
        """The (fractional) epoch reached after ``step`` draws."""
        epoch = 0
        while True:
            _, n = self.at(epoch)
            if step < n:
                return epoch + step / n
            step -= n
            epoch += 1
