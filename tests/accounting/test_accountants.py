"""Accountants against closed forms and independent numerical integration: never optimistic, and tight."""
import math

import numpy as np
import pytest
from scipy import integrate, optimize
from scipy.stats import norm

from ghostdp.accounting import PRVAccountant, RDPAccountant, get_noise_multiplier
from ghostdp.accounting.prv import _composed, prv_epsilon
from ghostdp.accounting.rdp import rdp_sampled_gaussian


def gaussian_delta(eps, mu):
    """Exact delta(eps) of a Gaussian mechanism with mu = sensitivity / sigma (Balle & Wang 2018)."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def gaussian_epsilon(mu, delta):
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0, 200, xtol=1e-12)


# ------------------------------------------------------------------ RDP
@pytest.mark.parametrize("alpha", [1.5, 2, 7.3, 32])
def test_rdp_without_subsampling_is_the_gaussian_closed_form(alpha):
    assert rdp_sampled_gaussian(1.0, 1.7, alpha) == pytest.approx(alpha / (2 * 1.7 ** 2), rel=1e-12)


@pytest.mark.parametrize("q,sigma,alpha", [(0.01, 1.0, 2), (0.1, 0.8, 5), (0.05, 2.0, 16),
                                           (0.01, 1.0, 2.5), (0.1, 0.8, 4.7), (0.3, 1.5, 1.1)])
def test_rdp_matches_numerical_integration(q, sigma, alpha):
    # A_alpha = E_{z ~ N(0, s^2)}[(1 - q + q exp((2z - 1) / (2 s^2)))^alpha], RDP = log(A) / (alpha - 1).
    def integrand(z):
        return norm.pdf(z, scale=sigma) * (1 - q + q * math.exp((2 * z - 1) / (2 * sigma ** 2))) ** alpha
    a, _ = integrate.quad(integrand, -30 * sigma, 30 * sigma + 1, points=[0.5], epsabs=0, epsrel=1e-12, limit=500)
    assert rdp_sampled_gaussian(q, sigma, alpha) == pytest.approx(math.log(a) / (alpha - 1), rel=1e-8)


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (5.0, 100), (2.0, 10)])
def test_rdp_epsilon_is_never_below_the_exact_gaussian_epsilon(sigma, steps):
    acc = RDPAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=1.0, num_steps=steps)
    exact = gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    assert exact <= acc.get_epsilon(1e-5) <= exact * 1.3


def test_rdp_composes_additively_and_merges_history():
    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.1, sample_rate=0.02)
    acc.step(noise_multiplier=1.1, sample_rate=0.02, num_steps=7)
    assert acc.history == [[1.1, 0.02, 10]]
    single = RDPAccountant()
    single.step(noise_multiplier=1.1, sample_rate=0.02)
    np.testing.assert_allclose(acc.rdp(), 10 * single.rdp(), rtol=1e-12)


# ------------------------------------------------------------------ PRV
@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (5.0, 100), (30.0, 1000)])
def test_prv_without_subsampling_is_tight_and_never_optimistic(sigma, steps):
    exact = gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    got = prv_epsilon([[sigma, 1.0, steps]], 1e-5)
    assert exact <= got <= exact + 1e-3


def test_prv_composes_runs_with_different_noise():
    # Gaussian runs compose to a Gaussian with mu^2 = sum steps / sigma^2.
    exact = gaussian_epsilon(math.sqrt(50 / 4.0 ** 2 + 30 / 6.0 ** 2), 1e-6)
    acc = PRVAccountant()
    acc.step(noise_multiplier=4.0, sample_rate=1.0, num_steps=50)
    acc.step(noise_multiplier=6.0, sample_rate=1.0, num_steps=30)
    assert exact <= acc.get_epsilon(1e-6) <= exact + 1e-3


def _single_step_delta(eps, sigma, q, direction):
    """Exact delta(eps) of one Poisson-subsampled Gaussian step, for one adjacency direction."""
    mix_sf = lambda x: (1 - q) * norm.sf(x / sigma) + q * norm.sf((x - 1) / sigma)
    if direction == "remove":  # P = mixture, Q = N(0, s^2), L increasing in x
        if eps <= math.log1p(-q):
            return -math.expm1(eps)
        x = sigma ** 2 * math.log((math.exp(eps) - (1 - q)) / q) + 0.5
        return mix_sf(x) - math.exp(eps) * norm.sf(x / sigma)
    if math.exp(-eps) <= 1 - q:  # P = N(0, s^2), Q = mixture, L decreasing in x
        return 0.0
    x = sigma ** 2 * math.log((math.exp(-eps) - (1 - q)) / q) + 0.5
    return norm.cdf(x / sigma) - math.exp(eps) * (1 - mix_sf(x))


def _two_step_delta(eps, first, second, direction):
    # delta_2(eps) = E_{x ~ P}[delta_1(eps - L(x))]: the second step integrated over the first.
    (s1, q1), (s2, q2) = first, second
    def loss(x):
        r = np.logaddexp(math.log1p(-q1), math.log(q1) + (2 * x - 1) / (2 * s1 ** 2))
        return r if direction == "remove" else -r
    def density(x):
        if direction == "remove":
            return (1 - q1) * norm.pdf(x, scale=s1) + q1 * norm.pdf(x, loc=1, scale=s1)
        return norm.pdf(x, scale=s1)
    value, _ = integrate.quad(lambda x: density(x) * _single_step_delta(eps - loss(x), s2, q2, direction),
                              -14 * s1, 14 * s1 + 1, epsabs=1e-14, epsrel=1e-10, limit=1000)
    return value


def _brute_force_epsilon(steps, delta):
    if len(steps) == 1:
        curve = lambda e: max(_single_step_delta(e, *steps[0], d) for d in ("remove", "add"))
    else:
        curve = lambda e: max(_two_step_delta(e, steps[0], steps[1], d) for d in ("remove", "add"))
    return optimize.brentq(lambda e: curve(e) - delta, 0.0, 30.0, xtol=1e-9)


@pytest.mark.parametrize("sigma,q,steps", [(0.9, 0.1, 1), (0.9, 0.1, 2), (1.2, 0.3, 2)])
def test_prv_against_brute_force_composition(sigma, q, steps):
    exact = _brute_force_epsilon([(sigma, q)] * steps, 1e-5)
    got = prv_epsilon([[sigma, q, steps]], 1e-5)
    assert exact <= got <= exact + 2e-3


@pytest.mark.parametrize("first,second", [((0.9, 0.1), (1.3, 0.3)), ((1.5, 0.5), (0.8, 0.05))])
def test_prv_of_two_different_steps_against_brute_force(first, second):
    # Heterogeneous steps (noise and batch-size schedules): composed in either order, tight and safe.
    exact = _brute_force_epsilon([first, second], 1e-5)
    for history in ([[*first, 1], [*second, 1]], [[*second, 1], [*first, 1]]):
        got = prv_epsilon(history, 1e-5)
        assert exact <= got <= exact + 2e-3


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.01, 10000), (0.8, 0.004, 50000), (2.0, 0.1, 500),
                                           (0.6, 0.001, 100000)])
def test_prv_is_below_rdp(sigma, q, steps):
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert prv_epsilon([[sigma, q, steps]], 1e-5) < rdp.get_epsilon(1e-5)


@pytest.mark.parametrize("sigma,steps", [(5.0, 100), (30.0, 1000)])
@pytest.mark.parametrize("delta", [1e-8, 1e-10])
def test_prv_at_small_delta_is_tight_and_never_optimistic(sigma, steps, delta):
    # Float64 round-off alone would take 0.05 (or all) of delta here; long double keeps it tight.
    exact = gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    assert exact <= prv_epsilon([[sigma, 1.0, steps]], delta) <= exact + 1e-3


def test_prv_at_small_delta_on_a_long_subsampled_run_is_far_below_rdp():
    # The case: the float64 round-off bound (1e-8) used to leave only RDP's 0.86 at delta = 1e-8;
    # dp_accounting's PLD gives 0.065. Smaller delta costs more epsilon, never less.
    history = [[1.0, 1e-4, 10000]]
    rdp = RDPAccountant()
    rdp.step(noise_multiplier=1.0, sample_rate=1e-4, num_steps=10000)
    got = prv_epsilon(history, 1e-8)
    assert prv_epsilon(history, 1e-7) < got < prv_epsilon(history, 1e-9) < 0.1 * rdp.get_epsilon(1e-8)
    assert got <= 0.0655


def test_prv_in_long_double_agrees_with_float64_where_both_are_tight():
    history = [[1.0, 0.01, 2000]]
    for direction in ("remove", "add"):
        plain = _composed(history, 1e-4, direction, 1e-5)
        extended = _composed(history, 1e-4, direction, 1e-5, np.longdouble)
        assert plain.fixed < 1e-2 * 1e-5 and extended.fixed <= plain.fixed
        # Same grid, same truncations: only the smaller round-off bound (a smaller fixed delta) differs.
        assert plain.epsilon(1e-5) - 1e-4 <= extended.epsilon(1e-5) <= plain.epsilon(1e-5)


def test_prv_accountant_falls_back_to_rdp_where_that_is_smaller():
    # At delta = 1e-14 even the long double round-off bound dominates the numerical composition.
    acc, rdp = PRVAccountant(), RDPAccountant()
    for a in (acc, rdp):
        a.step(noise_multiplier=0.8, sample_rate=0.004, num_steps=50000)
    assert prv_epsilon(acc.history, 1e-14) == math.inf
    assert acc.get_epsilon(1e-14) == rdp.get_epsilon(1e-14) < math.inf


# ------------------------------------------------------------------ calibration and state
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_calibrated_noise_reaches_the_target_from_above_within_one_percent(accountant):
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=2000,
                                 accountant=accountant)
    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=2000)
    assert 0.99 * 3.0 <= acc.get_epsilon(1e-5) <= 3.0


def test_zero_noise_has_infinite_epsilon_and_no_steps_zero():
    acc = PRVAccountant()
    assert acc.get_epsilon(1e-5) == 0.0
    acc.step(noise_multiplier=0.0, sample_rate=0.1)
    assert acc.get_epsilon(1e-5) == math.inf


def test_state_dict_round_trip_and_mismatch():
    acc = PRVAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=30)
    other = PRVAccountant()
    other.load_state_dict(acc.state_dict())
    assert other.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="'prv' accountant"):
        RDPAccountant().load_state_dict(acc.state_dict())


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sample_rate=0.0), "sample_rate"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, num_steps=-2), "num_steps"),
])
def test_bad_mechanism_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RDPAccountant().step(**kwargs)


@pytest.mark.parametrize("delta", [0, 1, -0.1, 2])
def test_bad_delta_is_refused(delta):
    with pytest.raises(ValueError, match="delta"):
        PRVAccountant().get_epsilon(delta)


def test_bad_calibration_arguments_are_refused():
    with pytest.raises(ValueError, match="target_epsilon"):
        get_noise_multiplier(target_epsilon=0, target_delta=1e-5, sample_rate=0.1, steps=10)
    with pytest.raises(ValueError, match="accountant"):
        get_noise_multiplier(target_epsilon=1, target_delta=1e-5, sample_rate=0.1, steps=10, accountant="gdp")


def test_prv_epsilon_beyond_700_is_exact_not_capped():
    # q = 1: n Gaussian steps of noise sigma are one Gaussian mechanism with mu = sqrt(n) / sigma, whose
    # delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) has a closed form (Balle & Wang 2018).
    import math
    from scipy import optimize, stats
    steps = 1200
    mu = math.sqrt(steps)

    def delta_of(eps):
        return stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps + stats.norm.logcdf(-mu / 2 - eps / mu))

    truth = optimize.brentq(lambda e: delta_of(e) - 1e-5, 1, 10 * mu * mu)
    assert truth > 700
    acc = PRVAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=1.0, num_steps=steps)
    eps = acc.get_epsilon(1e-5)
    assert truth <= eps <= truth + 0.05


def test_prv_with_a_loss_range_too_wide_to_discretise_falls_back_to_rdp():
    acc, rdp = PRVAccountant(), RDPAccountant()
    for a in (acc, rdp):
        a.step(noise_multiplier=0.02, sample_rate=1.0, num_steps=3)
    assert acc.get_epsilon(1e-5) == rdp.get_epsilon(1e-5) > 700


def test_calibration_for_a_target_above_700_returns_a_noise_that_meets_it():
    sigma = get_noise_multiplier(target_epsilon=1000.0, target_delta=1e-5, sample_rate=0.5, steps=10)
    acc = PRVAccountant()
    acc.step(noise_multiplier=sigma, sample_rate=0.5, num_steps=10)
    assert 0.99 * 1000 <= acc.get_epsilon(1e-5) <= 1000


def test_prv_merges_a_long_schedule_into_few_runs_without_becoming_optimistic():
    from ghostdp.accounting.prv import merged_runs
    history = [[1.5 * 0.99 ** k, 0.02 * (1 + k / 40), 3] for k in range(40)]  # noise falls, batches grow
    merged = merged_runs(history, max_runs=24)
    assert len(merged) <= 24 and sum(n for _, _, n in merged) == 120
    exact, coarse = prv_epsilon(history, 1e-5), prv_epsilon(merged, 1e-5)
    assert exact <= coarse <= 1.08 * exact  # measured 1.064
    assert merged_runs(history, max_runs=64) == history  # few runs: unchanged
