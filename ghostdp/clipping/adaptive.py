"""Adaptive clipping: C follows a target quantile of the per-example gradient norms (Andrew, Thakkar,
McMahan, Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping").

Each step releases, besides the noisy clipped sum, a noisy count of the examples that were not
clipped, shifted so that its sensitivity is 1/2 whether the batch size is known or not:
    b = (sum_i (1[n_i <= C] - 1/2) + N(0, s_b^2)) / m + 1/2        (m: expected batch size)
then updates C geometrically:  C <- C * exp(-eta * (b - gamma)).
The two releases together are one Gaussian mechanism on the same Poisson sample with noise
multiplier sigma, where sigma^-2 = sigma_g^-2 + (2 s_b)^-2 (their Theorem 1): the accountant records
sigma (the ``noise_multiplier`` given), and the gradient noise uses sigma_g = (sigma^-2 - (2 s_b)^-2)^-1/2.
"""
from __future__ import annotations

import math

import torch

from ..accounting.base import check_positive


class AdaptiveClipNorm:
    """Pass as ``max_grad_norm`` to make_private to let C track a quantile of the gradient norms.

    Args:
        initial: C of the first step.
        target_quantile: gamma, the share of examples that should end up unclipped (0.5: the median).
        learning_rate: eta of the geometric update (the paper uses 0.2).
        count_noise_std: s_b, the std of the noise on the unclipped count; default expected batch / 20,
            the paper's choice. It must exceed noise_multiplier / 2: the count then takes the share
            (sigma / (2 s_b))^2 of the privacy budget, and the gradient noise grows to make up for it.
        min_norm, max_norm: optional bounds on C.
    """

    def __init__(self, initial: float = 1.0, *, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_noise_std: float | None = None, min_norm: float | None = None,
                 max_norm: float | None = None):
        self.norm = check_positive(initial, "initial")
        if isinstance(target_quantile, bool) or not isinstance(target_quantile, (int, float)) \
                or not 0 <= target_quantile <= 1:
            raise ValueError(f"target_quantile must be in [0, 1], got {target_quantile!r}")
        self.target_quantile = float(target_quantile)
        self.learning_rate = check_positive(learning_rate, "learning_rate")
        self.count_noise_std = None if count_noise_std is None else check_positive(count_noise_std, "count_noise_std")
        self.min_norm = None if min_norm is None else check_positive(min_norm, "min_norm")
        self.max_norm = None if max_norm is None else check_positive(max_norm, "max_norm")
        if self.min_norm is not None and self.max_norm is not None and self.min_norm > self.max_norm:
            raise ValueError(f"min_norm {min_norm} is above max_norm {max_norm}")
        self.last_unclipped_share = None  # the privatised share b of the last step

    def bind(self, expected_batch_size: float) -> None:
        """Fix the default count noise once the expected batch size is known."""
        if self.count_noise_std is None:
            self.count_noise_std = expected_batch_size / 20

    def gradient_noise_multiplier(self, noise_multiplier: float) -> float:
        """sigma_g with sigma_g^-2 + (2 s_b)^-2 = sigma^-2."""
        if noise_multiplier == 0:
            return 0.0
        rest = noise_multiplier ** -2 - (2 * self.count_noise_std) ** -2
        if rest <= 0:
            raise ValueError(
                f"adaptive clipping: the count noise std {self.count_noise_std} is not above half the noise "
                f"multiplier ({noise_multiplier} / 2), so the count alone would spend the whole privacy budget. "
                "Raise AdaptiveClipNorm(count_noise_std=...) or the expected batch size.")
        return rest ** -0.5

    def update(self, unclipped: float, examples: int, expected_batch_size: float, noise_multiplier: float,
               random_source) -> float:
        """The next C from this step's count of unclipped examples among the ``examples`` it clipped."""
        released = torch.tensor([unclipped - 0.5 * examples], dtype=torch.float64)
        if noise_multiplier > 0:  # noise 0 means no privacy anywhere: the count is exact then
            random_source.add_gaussian_([released], self.count_noise_std)
        share = float(released) / expected_batch_size + 0.5
        self.last_unclipped_share = share
        norm = self.norm * math.exp(-self.learning_rate * (share - self.target_quantile))
        if self.min_norm is not None:
            norm = max(norm, self.min_norm)
        if self.max_norm is not None:
            norm = min(norm, self.max_norm)
        self.norm = norm
        return norm

    def state_dict(self) -> dict:
        return {"norm": self.norm, "count_noise_std": self.count_noise_std}

    def load_state_dict(self, state: dict) -> None:
        self.norm, self.count_noise_std = float(state["norm"]), state["count_noise_std"]
