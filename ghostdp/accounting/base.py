"""What every accountant shares: the history of (noise multiplier, sample rate, steps) and its checks."""
from __future__ import annotations

import math


def check_positive(value, name: str) -> float:
    """``value`` as a float, refused unless it is a finite number > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_noise_multiplier(noise_multiplier):
    if not isinstance(noise_multiplier, (int, float)) or isinstance(noise_multiplier, bool) \
            or not noise_multiplier >= 0 or math.isinf(noise_multiplier):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")


def check_mechanism(noise_multiplier, sample_rate, num_steps=1):
    check_noise_multiplier(noise_multiplier)
    if not isinstance(sample_rate, (int, float)) or isinstance(sample_rate, bool) \
            or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r} (the probability that an "
                         "example is in a batch: expected batch size / dataset size)")
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0:
        raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")


def check_delta(delta):
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; the usual choice is below 1 / dataset size")


class Accountant:
    """Privacy accounting of DP-SGD steps, each a Poisson-subsampled Gaussian mechanism.

    ``history`` holds [noise_multiplier, sample_rate, num_steps] runs in order; consecutive
    steps with the same mechanism are merged. A step at sample rate 1 is a Gaussian mechanism without
    amplification: what one pass of fixed batches (poisson_sampling=False) is recorded as, so ``steps``
    counts optimizer steps with Poisson sampling and passes over the data without it.
    """

    mechanism = ""

    def __init__(self):
        self.history: list[list] = []

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        check_mechanism(noise_multiplier, sample_rate, num_steps)
        if num_steps == 0:
            return
        noise_multiplier, sample_rate = float(noise_multiplier), float(sample_rate)
        if self.history and self.history[-1][:2] == [noise_multiplier, sample_rate]:
            self.history[-1][2] += num_steps
        else:
            self.history.append([noise_multiplier, sample_rate, num_steps])

    def restate_last_step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Replaces the last step recorded by another: a pass of fixed batches (passes.py) is recorded at its
        first step and restated when a later step of it has a smaller noise multiplier."""
        if not self.history:
            raise ValueError("there is no step to restate")
        check_mechanism(noise_multiplier, sample_rate)
        self.history[-1][2] -= 1
        if self.history[-1][2] == 0:
            self.history.pop()
        self.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def get_epsilon(self, delta: float) -> float:
        """The smallest epsilon this accountant can certify for ``delta`` (an upper bound, never optimistic)."""
        check_delta(delta)
        if not self.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self.history):
            return math.inf
        return self._epsilon(self.history, delta)

    def _epsilon(self, history, delta) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"mechanism": self.mechanism, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mechanism") != self.mechanism:
            raise ValueError(f"this state is from a {state.get('mechanism')!r} accountant; this one is "
                             f"{self.mechanism!r}. Build the engine with the same accountant to resume.")
        history = [list(h) for h in state["history"]]
        for sigma, q, n in history:
            check_mechanism(sigma, q, n)
        self.history = history

    def __len__(self):
        return self.steps
