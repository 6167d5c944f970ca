"""Rényi DP of the Poisson-subsampled Gaussian mechanism (Mironov, Talwar, Zhang 2019).

For sampling rate q and noise multiplier sigma, one step at order alpha has
RDP = log(A_alpha) / (alpha - 1) with A_alpha = E_{z ~ N(0, s^2)}[(1 - q + q mu1(z)/mu0(z))^alpha]
(mu0 = N(0, s^2), mu1 = N(1, s^2)). Integer alpha: the binomial expansion (their eq. 3.3);
fractional alpha: the two-sided series (their Section 3.3). RDP composes by addition.
"""
from __future__ import annotations

import functools
import math

import numpy as np

# scipy's modules are imported where they are used: `import ghostdp` would otherwise spend ~1 s on them.
from .base import Accountant

DEFAULT_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [80, 128, 256, 512, 1024])


def _log_add(a, b):
    hi, lo = max(a, b), min(a, b)
    if hi == -math.inf:
        return -math.inf
    return hi + math.log1p(math.exp(lo - hi))


def _log_sub(a, b):
    """log(exp(a) - exp(b)) for a >= b."""
    if b == -math.inf:
        return a
    if a < b:
        raise ArithmeticError("log of a negative number")
    if a == b:
        return -math.inf
    return a + math.log1p(-math.exp(b - a))


def _log_erfc(x):
    from scipy import special
    return math.log(2) + special.log_ndtr(-x * math.sqrt(2))


def _log_a_integer(q, sigma, alpha):
    from scipy import special
    log_a = -math.inf
    for i in range(alpha + 1):
        log_coef = (special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
                    + i * math.log(q) + (alpha - i) * math.log1p(-q))
        log_a = _log_add(log_a, log_coef + (i * i - i) / (2 * sigma ** 2))
    return log_a


def _log_a_fractional(q, sigma, alpha):
    from scipy import special
    # Split the integral at z0, where the mixture and mu0 cross; each half is an alternating-free
    # series in the generalised binomial coefficients once signs are tracked.
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma ** 2 * math.log(1 / q - 1) + 0.5
    i = 0
    while True:
        coef = special.binom(alpha, i)
        log_coef = math.log(abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log1p(-q)
        log_t1 = log_coef + j * math.log(q) + i * math.log1p(-q)
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma ** 2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma ** 2) + log_e1
        if coef > 0:
            log_a0, log_a1 = _log_add(log_a0, log_s0), _log_add(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30 and i > alpha:
            break
    return _log_add(log_a0, log_a1)


def rdp_sampled_gaussian(q: float, sigma: float, alpha: float) -> float:
    """RDP of one step at order alpha > 1."""
    if sigma == 0:
        return math.inf
    if q == 1.0:
        return alpha / (2 * sigma ** 2)
    if float(alpha).is_integer():
        log_a = _log_a_integer(q, sigma, int(alpha))
    else:
        log_a = _log_a_fractional(q, sigma, alpha)
    return log_a / (alpha - 1)


@functools.lru_cache(maxsize=8192)
def _rdp_curve(q: float, sigma: float, orders: tuple) -> tuple:
    """One step's RDP at every order, computed once per (q, sigma): a schedule's history repeats them
    at every get_epsilon."""
    return tuple(rdp_sampled_gaussian(q, sigma, a) for a in orders)


def rdp_to_epsilon(rdp, orders, delta):
    """Smallest epsilon over orders, by the conversion of Balle et al. 2020 (Theorem 21):
    eps = rdp + log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1).
    Returns (epsilon, best order)."""
    orders = np.asarray(orders, dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    eps = rdp + np.log1p(-1 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(orders[best])


class RDPAccountant(Accountant):
    """Rényi-DP accountant: a valid but loose upper bound (use PRVAccountant for a tight one)."""

    mechanism = "rdp"

    def __init__(self, orders=DEFAULT_ORDERS):
        super().__init__()
        if any(a <= 1 for a in orders):
            raise ValueError("RDP orders must be > 1")
        self.orders = tuple(float(a) for a in orders)

    def rdp(self, history=None):
        history = self.history if history is None else history
        total = np.zeros(len(self.orders))
        for sigma, q, steps in history:
            total += steps * np.array(_rdp_curve(q, sigma, self.orders))
        return total

    def _epsilon(self, history, delta):
        return rdp_to_epsilon(self.rdp(history), self.orders, delta)[0]
