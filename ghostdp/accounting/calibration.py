"""The smallest noise multiplier whose epsilon stays within a target."""
from __future__ import annotations

import math

from .base import check_delta, check_mechanism


def make_accountant(kind: str):
    from .prv import PRVAccountant
    from .rdp import RDPAccountant
    accountants = {"prv": PRVAccountant, "rdp": RDPAccountant}
    if kind not in accountants:
        raise ValueError(f"accountant must be one of {sorted(accountants)}, got {kind!r}")
    return accountants[kind]()


def epsilon_for(noise_multiplier, sample_rate, steps, delta, accountant="prv") -> float:
    return _plan_epsilon(noise_multiplier, [(sample_rate, steps)], delta, accountant)


def _plan_epsilon(noise_multiplier, plan, delta, accountant) -> float:
    acc = make_accountant(accountant)
    for sample_rate, steps in plan:
        acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=steps)
    return acc.get_epsilon(delta)


def get_noise_multiplier(*, target_epsilon: float, target_delta: float, sample_rate: float | None = None,
                         steps: int | None = None, accountant: str = "prv", epsilon_tolerance: float = 0.005,
                         plan: list[tuple[float, int]] | None = None) -> float:
    """Noise multiplier sigma with target_epsilon * (1 - epsilon_tolerance) <= eps(sigma) <= target_epsilon.

    The run is ``steps`` steps at ``sample_rate``, or, for a batch-size schedule, ``plan``: a list of
    (sample rate, steps) runs, all with the same sigma. Brackets sigma by doubling, then bisects;
    the sigma returned always meets the target (it is the upper end of the bracket), so the
    guarantee is never optimistic.
    """
    if not isinstance(target_epsilon, (int, float)) or not 0 < target_epsilon < math.inf:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    check_delta(target_delta)
    if plan is None:
        plan = [(sample_rate, steps)]
    elif sample_rate is not None or steps is not None:
        raise ValueError("give sample_rate and steps, or a plan, not both")
    if not plan:
        raise ValueError("the plan has no steps")
    for rate, count in plan:
        check_mechanism(1.0, rate, count)
        if count < 1:
            raise ValueError(f"steps must be >= 1, got {count!r}")
    if not 0 < epsilon_tolerance < 1:
        raise ValueError(f"epsilon_tolerance must be in (0, 1), got {epsilon_tolerance!r}")

    def eps(sigma):
        return _plan_epsilon(sigma, plan, target_delta, accountant)

    low, high = 0.0, 1.0
    eps_high = eps(high)
    while eps_high > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon {target_epsilon} at delta "
                             f"{target_delta} over the (sample rate, steps) runs {plan}")
        eps_high = eps(high)
    while eps_high < target_epsilon * (1 - epsilon_tolerance) and high - low > 1e-9 * high:
        mid = (low + high) / 2
        eps_mid = eps(mid)
        if eps_mid <= target_epsilon:
            high, eps_high = mid, eps_mid
        else:
            low = mid
    return high
