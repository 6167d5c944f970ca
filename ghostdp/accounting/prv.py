"""Tight accounting by numerical composition of privacy loss distributions (PRV / PLD accounting).

For one step of the Poisson-subsampled Gaussian mechanism (sensitivity 1, noise sigma, rate q),
with mu0 = N(0, sigma^2), mu1 = N(1, sigma^2), mix = (1 - q) mu0 + q mu1, the two adjacency
directions are the pairs (P, Q) = (mix, mu0) ("remove") and (mu0, mix) ("add"). For a pair, the
privacy loss is L = log(dP/dQ)(X), X ~ P, and for any composition
    delta(eps) = E[(1 - exp(eps - sum_i L_i))_+]   (Gopi, Lee, Wutschitz 2021; Koskela et al. 2020).

Every approximation here can only increase delta(eps), so the epsilon returned is an upper bound:
- each step's L is discretised onto the grid h * Z by "connect the dots" (Doroshenko et al. 2022):
  an atom of P-mass at l in (l_k, l_k+1] is split between l_k and l_k+1 so that the curve
  x -> E[(1 - x e^-L)_+] is replaced by its chord, which lies above this convex curve; P- and
  Q-mass are conserved, so the result is a valid pair that dominates the true one, and
  domination survives composition;
- mass below the grid is moved up to its first point, mass above it to +infinity;
- after each FFT convolution, tail mass is moved up (the lower tail to the first kept point, the
  upper tail to +infinity); all such moves together are at most 1e-3 * delta, and each moved unit
  of mass can raise delta by at most one unit. A bound on the FFT round-off (in l1) is added to delta;
- epsilon is taken as the larger of the two directions.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

# scipy's modules are imported where they are used: `import ghostdp` would otherwise spend ~1 s on them.
from .base import Accountant
from .rdp import RDPAccountant

TAIL = 1e-20            # per-step probability left outside the discretised range (moved pessimistically)
TAIL_BUDGET = 1e-3      # fraction of delta that all truncations after convolutions may move, together
# Share of delta that the fixed terms (mass moved to +inf, the round-off bound) may take before the
# composition is redone in extended precision (long double: 64-bit mantissa on x86-64).
ROUNDOFF_SHARE = 1e-2
EXTENDED = np.longdouble if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps else None


class PLD:
    """A discretised privacy loss distribution: P-mass pmf[j] at loss h * (offset + j), plus mass at +inf.

    ``slack`` bounds the l1 error of pmf from floating-point convolution; it is added to delta. The
    pmf's dtype (float64 or long double) sets the unit round-off the bound is computed with.
    """

    __slots__ = ("h", "offset", "pmf", "inf_mass", "slack")

    def __init__(self, h, offset, pmf, inf_mass, slack=0.0):
        self.h, self.offset, self.pmf, self.inf_mass, self.slack = h, offset, pmf, inf_mass, slack

    def compose(self, other: "PLD", tail: float) -> "PLD":
        from scipy import signal
        a, b = self.pmf, other.pmf
        pmf = signal.fftconvolve(a, b)
        n = pmf.shape[0]
        norms = float(np.linalg.norm(a) + np.linalg.norm(b) + np.linalg.norm(pmf))
        # l1 error of an FFT convolution <= sqrt(n) * l2 error, and the l2 error is
        # O(u log2 n (|a|_2 + |b|_2 + |c|_2)) for |a|_1, |b|_1 <= 1; 5 is a safety factor.
        unit_roundoff = float(np.finfo(pmf.dtype).eps) / 2
        fft_error = 5 * unit_roundoff * math.log2(max(n, 2)) * math.sqrt(n) * norms
        np.clip(pmf, 0, None, out=pmf)
        inf_mass = 1 - (1 - self.inf_mass) * (1 - other.inf_mass)
        out = PLD(self.h, self.offset + other.offset, pmf, inf_mass, self.slack + other.slack + fft_error)
        # Below the round-off bound the entries are noise; cutting at least that much keeps the
        # support from growing without bound (still pessimistic, only less tight).
        return out.truncated(max(tail, fft_error))

    def truncated(self, tail: float) -> "PLD":
        """Moves at most ``tail`` mass from each end: the lower end up to the first kept point, the upper to +inf."""
        pmf = self.pmf
        low = np.cumsum(pmf)
        first = int(np.searchsorted(low, tail, side="right"))  # pmf[:first] sums to <= tail
        high = np.cumsum(pmf[::-1])
        last = pmf.shape[0] - int(np.searchsorted(high, tail, side="right"))  # pmf[last:] sums to <= tail
        if first >= last:
            return self
        kept = pmf[first:last].copy()
        kept[0] += low[first - 1] if first > 0 else 0.0      # moved up to the first kept point
        moved_up = high[pmf.shape[0] - last - 1] if last < pmf.shape[0] else 0.0  # moved to +inf
        return PLD(self.h, self.offset + first, kept, self.inf_mass + moved_up, self.slack)

    def self_compose(self, count: int, budget: float) -> "PLD":
        """``count``-fold composition by repeated squaring.

        Mass moved in a factor that stands for m steps is repeated in up to count / m copies of
        the result, so the tail allowed there is budget * m / (count * convolutions); all moves
        then add up to at most ``budget`` (and each unit of moved mass raises delta by at most one).
        """
        convolutions = 2 * count.bit_length()
        result, result_steps = None, 0
        base, base_steps, remaining = self, 1, count
        while remaining:
            if remaining & 1:
                result_steps += base_steps
                tail = budget * result_steps / (count * convolutions)
                result = base if result is None else result.compose(base, tail)
            remaining >>= 1
            if remaining:
                base_steps *= 2
                base = base.compose(base, budget * base_steps / (count * convolutions))
        return result

    def astype(self, dtype) -> "PLD":
        return PLD(self.h, self.offset, self.pmf.astype(dtype), self.inf_mass, self.slack)

    @property
    def fixed(self) -> float:
        """The part of delta(eps) that no eps removes: mass at +inf and the round-off bound."""
        return self.inf_mass + self.slack

    def epsilon(self, delta: float) -> float:
        """The smallest eps with delta(eps) <= delta (an upper bound on the true one).

        For eps in [l_{j-1}, l_j): delta(eps) = fixed + SP[j] - e^eps SQ[j], with the suffix sums
        SP[j] = sum_{k>=j} p_k and SQ[j] = sum_{k>=j} p_k e^{-l_k}. The products e^eps SQ are formed in
        log space, so losses of any size (far beyond exp's range of about 700) are exact.
        """
        fixed = self.fixed
        if fixed >= delta:
            return math.inf
        losses = self.h * (self.offset + np.arange(self.pmf.shape[0]))
        sp = np.cumsum(self.pmf[::-1])[::-1]
        with np.errstate(divide="ignore"):
            log_terms = np.log(self.pmf) - losses
        log_sq = np.logaddexp.accumulate(log_terms[::-1])[::-1]          # log SQ[j]
        log_sq_next = np.append(log_sq[1:], -np.inf)
        sp_next = np.append(sp[1:], 0.0)
        at_grid = fixed + sp_next - np.exp(losses + log_sq_next)           # delta(l_j); exponent <= 0
        j = int(np.argmax(at_grid <= delta))  # first grid point that meets delta (the last one always does)
        remaining = fixed + sp[j] - delta
        eps = math.log(remaining) - log_sq[j] if remaining > 0 and log_sq[j] > -np.inf else losses[j]
        if j > 0:
            eps = max(eps, losses[j - 1])
        return float(min(eps, losses[j]))


def _log_mix_ratio(x, sigma, q):
    """log(dmix/dmu0)(x) = log(1 - q + q exp((2x - 1) / (2 sigma^2)))."""
    z = (2 * x - 1) / (2 * sigma ** 2)
    if q == 1.0:
        return z
    return np.logaddexp(math.log1p(-q), math.log(q) + z)


def _x_of_log_ratio(r, sigma, q):
    """Inverse of _log_mix_ratio: the x with log(dmix/dmu0)(x) = r (-inf where r <= log(1 - q))."""
    r = np.asarray(r, dtype=float)
    if q == 1.0:
        return sigma ** 2 * r + 0.5
    with np.errstate(divide="ignore", invalid="ignore"):
        inner = r + np.log(-np.expm1(np.log1p(-q) - r))  # log(e^r - (1 - q))
        x = sigma ** 2 * (inner - math.log(q)) + 0.5
    return np.where(r > math.log1p(-q), x, -np.inf)


def _gauss_mass(lo, hi, mean, sigma):
    """N(mean, sigma^2) mass of [lo, hi], accurate in both tails."""
    from scipy import special
    a, b = (lo - mean) / sigma, (hi - mean) / sigma
    return np.where(a > 0, special.ndtr(-a) - special.ndtr(-b), special.ndtr(b) - special.ndtr(a))


def _masses(lo, hi, sigma, q):
    """(mu0 mass, mix mass) of the x-intervals [lo, hi]."""
    m0 = _gauss_mass(lo, hi, 0.0, sigma)
    m1 = _gauss_mass(lo, hi, 1.0, sigma)
    return m0, (1 - q) * m0 + q * m1


@lru_cache(maxsize=64)
def single_step_pld(sigma: float, q: float, h: float, direction: str) -> PLD:
    from scipy import special
    z = -float(special.ndtri(TAIL))
    x_lo, x_hi = -sigma * z, 1 + sigma * z  # both mu0 and mu1 put <= TAIL outside
    r_lo, r_hi = _log_mix_ratio(np.array([x_lo, x_hi]), sigma, q)
    if direction == "remove":   # P = mix, Q = mu0, L = r(x), increasing in x
        l_lo, l_hi = r_lo, r_hi
    else:                       # P = mu0, Q = mix, L = -r(x), decreasing in x
        l_lo, l_hi = -r_hi, -r_lo
    k_lo, k_hi = math.floor(l_lo / h), math.ceil(l_hi / h)
    losses = h * np.arange(k_lo, k_hi + 1)
    # x-boundaries of the loss intervals (l_k, l_k+1], extended by the tails.
    if direction == "remove":
        xs = _x_of_log_ratio(losses, sigma, q)
        edges_lo, edges_hi = xs[:-1], xs[1:]
        below_lo, below_hi = -np.inf, xs[0]
        above_lo, above_hi = xs[-1], np.inf
    else:
        xs = _x_of_log_ratio(-losses, sigma, q)   # decreasing in the loss
        edges_lo, edges_hi = xs[1:], xs[:-1]
        below_lo, below_hi = xs[0], np.inf
        above_lo, above_hi = -np.inf, xs[-1]
    mu0, mix = _masses(edges_lo, edges_hi, sigma, q)
    (b0, bmix), (a0, amix) = _masses(np.array([below_lo, above_lo]), np.array([below_hi, above_hi]), sigma, q)
    p_int, q_int = (mix, mu0) if direction == "remove" else (mu0, mix)
    p_below, p_above = (bmix, amix) if direction == "remove" else (b0, a0)
    # Connect the dots on each interval: P-mass P_k with Q-mass Q_k = E_P[e^-L] goes
    # (e^{l_k+1} Q_k - P_k) / expm1(h) to l_k and e^h (P_k - e^{l_k} Q_k) / expm1(h) to l_k+1.
    e_lo, e_hi = np.exp(losses[:-1]), np.exp(losses[1:])
    to_lower = np.clip(e_hi * q_int - p_int, 0, None) / math.expm1(h)
    to_upper = math.exp(h) * np.clip(p_int - e_lo * q_int, 0, None) / math.expm1(h)
    pmf = np.zeros(losses.shape[0])
    pmf[:-1] += to_lower
    pmf[1:] += to_upper
    pmf[0] += float(p_below)
    return PLD(h, k_lo, pmf, float(p_above)).truncated(0.0)


def _composed(history, h, direction, delta_scale, dtype=np.float64) -> PLD:
    """The composition of all runs; truncations move at most TAIL_BUDGET * delta_scale in all."""
    budget = TAIL_BUDGET * delta_scale / (len(history) + 1)
    total = None
    for sigma, q, steps in history:
        pld = single_step_pld(sigma, q, h, direction).astype(dtype).self_compose(int(steps), budget)
        total = pld if total is None else total.compose(pld, budget / len(history))
    return total


# Largest grid (points) of one step's privacy loss: a wider loss range (tiny sigma, q near 1) would take
# gigabytes to compose; the accountant then uses the RDP bound instead.
MAX_STEP_POINTS = 1 << 20


def _step_points(sigma, q, h):
    from scipy import special
    z = -float(special.ndtri(TAIL))
    r_lo, r_hi = _log_mix_ratio(np.array([-sigma * z, 1 + sigma * z]), sigma, q)
    return (r_hi - r_lo) / h


def prv_epsilon(history, delta, h=1e-4):
    """The PLD epsilon, or inf where the loss range is too wide to discretise (see MAX_STEP_POINTS)."""
    if any(_step_points(sigma, q, h) > MAX_STEP_POINTS for sigma, q, _ in history):
        return math.inf
    try:
        return max(_direction_epsilon(history, delta, h, d) for d in ("remove", "add"))
    except MemoryError:
        return math.inf


def _direction_epsilon(history, delta, h, direction):
    """Composes in float64; where round-off and moved mass take over ROUNDOFF_SHARE of delta (small
    delta, long runs of concentrated losses), composes again in long double, whose round-off bound is
    about 2000 times smaller (about 13 times slower)."""
    pld = _composed(history, h, direction, delta)
    if pld.fixed > ROUNDOFF_SHARE * delta and EXTENDED is not None:
        pld = _composed(history, h, direction, delta, EXTENDED)
    return pld.epsilon(delta)


class PRVAccountant(Accountant):
    """Tight numerical accountant (privacy loss distributions, both adjacency directions).

    Its epsilon is an upper bound that is usually within 1e-3 of the exact one. For small delta it
    composes in long double (x86-64), whose FFT round-off bound (about 1e-11 on long runs, against
    1e-8 in float64) keeps it tight down to delta of about 1e-9; below that, or for a very wide loss
    range (tiny sigma, q near 1), it returns the RDP bound where that is smaller (both are valid
    upper bounds, so their minimum is one too).
    ``value_interval`` is the grid spacing of the privacy loss (smaller: tighter and slower).
    """

    mechanism = "prv"

    def __init__(self, value_interval: float = 1e-4):
        super().__init__()
        if not 0 < value_interval <= 0.1:
            raise ValueError(f"value_interval must be in (0, 0.1], got {value_interval!r}")
        self.value_interval = value_interval
        self._rdp = RDPAccountant()

    def _epsilon(self, history, delta):
        runs = merged_runs(history)
        numerical = prv_epsilon(runs, delta, self.value_interval)
        return max(0.0, min(numerical, self._rdp._epsilon(runs, delta)))


# Each distinct (sigma, q) run costs one FFT composition (~75 ms). A schedule stepped at every step
# gives thousands of them; beyond MAX_RUNS they are merged onto a grid, pessimistically (below).
MAX_RUNS = 64


def merged_runs(history, max_runs: int = MAX_RUNS):
    """At most ``max_runs`` runs whose composition dominates the history's: every sigma rounded down and
    every q rounded up onto a geometric grid, as fine as allows it, and equal runs merged (composition
    commutes). Per step, a smaller sigma or a larger q gives a dominating pair of distributions (joint
    convexity of the hockey-stick divergence: the rate-q mixture is a mixture of the rate-q' one and
    N(0, sigma^2)), and dominance survives composition, so the epsilon stays an upper bound."""
    runs = {}
    for sigma, q, steps in history:
        runs[(sigma, q)] = runs.get((sigma, q), 0) + steps
    ratio = 1e-4
    while len(runs) > max_runs:
        ratio *= 1.25
        coarse = {}
        for (sigma, q), steps in runs.items():
            key = (math.exp(math.floor(math.log(sigma) / ratio) * ratio),
                   min(1.0, math.exp(math.ceil(math.log(q) / ratio) * ratio)))
            coarse[key] = coarse.get(key, 0) + steps
        if len(coarse) <= max_runs:
            runs = coarse
    return [[sigma, q, steps] for (sigma, q), steps in runs.items()]
