"""Accounting of the data loader's own batches (``poisson_sampling=False``): one Gaussian mechanism a pass.

A pass over a loader whose sampler is a permutation (shuffle=True or False; a DistributedSampler that pads
nothing) puts each example in at most one batch. Replace the example by one whose gradient is zero: only that
batch's clipped sum changes, by at most C, so whatever the order the pass is at most one Gaussian mechanism of
noise sigma * C at sensitivity C, without amplification. A shuffled order is drawn independently of the data,
so by joint convexity of the hockey-stick divergence it is bounded by the worst fixed order (Chua et al. 2024,
"How Private are DP-SGD Implementations?"). The example may be in any of the pass's steps: the pass is
accounted at the smallest sigma among them. The accountant records it as one step at sample rate 1.

Accounting such steps as Poisson draws at batch size / N (as is common) has no proof for these batches and can
be optimistic (ibid.), so ghostdp does not.
"""
from __future__ import annotations

import warnings


class PassAccounting:
    """Records each pass of the loader's own batches once in ``accountant``; a batch the loader did not yield
    (``pass_index`` None) may hold any example, so its step is recorded on its own."""

    def __init__(self, accountant):
        self.accountant = accountant
        self.current_pass = None    # the pass index last recorded
        self.recorded_sigma = None  # the noise multiplier that pass is recorded with
        self.recorded_steps = None  # the accountant's steps just after: another history (a restored state) differs
        self._warned_foreign = False

    def record(self, noise_multiplier: float, pass_index: int | None) -> None:
        if pass_index is None:
            self._warn_foreign_batch()
            self.accountant.step(noise_multiplier=noise_multiplier, sample_rate=1.0)
            self.current_pass = None
            return
        if pass_index != self.current_pass or not self._last_step_is_this_pass():
            self.accountant.step(noise_multiplier=noise_multiplier, sample_rate=1.0)
        elif noise_multiplier < self.recorded_sigma:
            self.accountant.restate_last_step(noise_multiplier=noise_multiplier, sample_rate=1.0)
        else:
            return
        self.current_pass, self.recorded_sigma = pass_index, noise_multiplier
        self.recorded_steps = self.accountant.steps

    def _last_step_is_this_pass(self) -> bool:
        history = self.accountant.history
        return (bool(history) and history[-1][:2] == [self.recorded_sigma, 1.0]
                and self.accountant.steps == self.recorded_steps)

    def _warn_foreign_batch(self) -> None:
        if self._warned_foreign:
            return
        self._warned_foreign = True
        warnings.warn(
            "with poisson_sampling=False this step's batch did not come from the data loader that make_private "
            "returned, so nothing shows that each example is in one batch a pass: every such step is accounted "
            "as a Gaussian mechanism that may hold any example (sample rate 1), and epsilon grows with every "
            "step. Fix: iterate the loader that make_private returned (each pass is then accounted once).",
            stacklevel=4)
