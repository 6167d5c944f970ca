"""The loader's own batches (poisson_sampling=False): each pass is one Gaussian mechanism at sample rate 1, at the
smallest noise multiplier of its steps; batches from elsewhere count one each; samplers that repeat an example
within a pass are refused; calibration plans passes."""
import math
import warnings

import pytest
import torch
from scipy import optimize
from scipy.stats import norm
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from ghostdp import PrivacyEngine
from ghostdp.accounting import PRVAccountant, RDPAccountant, get_noise_multiplier

N, D, K, BATCH = 40, 5, 3, 8
SIGMA, DELTA = 0.9, 1e-5
FOREIGN = "did not come from the data loader that make_private returned"


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))


def private(loader=None, engine=None, **kwargs):
    torch.manual_seed(1)
    model = torch.nn.Linear(D, K)
    engine = engine or PrivacyEngine(seed=2)
    kwargs.setdefault("noise_multiplier", SIGMA)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader or DataLoader(dataset(), batch_size=BATCH, shuffle=True),
        criterion=torch.nn.CrossEntropyLoss(), max_grad_norm=1.0, poisson_sampling=False, **kwargs)
    return engine, model, optimizer, criterion, loader


def step(model, optimizer, criterion, x, y):
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()


def gaussian_epsilon(mu, delta):
    """Exact epsilon of a Gaussian mechanism with mu = sensitivity / sigma (Balle & Wang 2018)."""
    def delta_at(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    return optimize.brentq(lambda e: delta_at(e) - delta, 0, 200, xtol=1e-12)


def test_each_pass_is_one_gaussian_mechanism_and_an_unfinished_pass_counts():
    """Two whole passes and two steps of a third: three Gaussian mechanisms, i.e. one of mu = sqrt(3) / sigma,
    against 5 + 5 + 2 Poisson draws at q = 1/5 that the loader never made."""
    engine, model, optimizer, criterion, loader = private()
    for epoch in range(3):
        for index, (x, y) in enumerate(loader):
            if epoch == 2 and index == 2:
                break
            step(model, optimizer, criterion, x, y)
    assert engine.accountant.history == [[SIGMA, 1.0, 3]]
    exact = gaussian_epsilon(math.sqrt(3) / SIGMA, DELTA)
    assert exact <= engine.get_epsilon(DELTA) <= 1.01 * exact
    poisson = PRVAccountant()
    poisson.step(noise_multiplier=SIGMA, sample_rate=BATCH / N, num_steps=12)
    assert poisson.get_epsilon(DELTA) < 0.7 * exact  # what steps accounted as Poisson draws would have claimed


def test_the_chunks_of_a_batch_and_a_batch_sampler_without_batch_size_are_one_pass():
    """Physical chunks belong to their logical batch's pass; a loader built from a BatchSampler (no batch_size)
    is the loader's own batches too (it was taken for Poisson sampling: a step at q per batch)."""
    engine, model, optimizer, criterion, loader = private(max_physical_batch_size=3)
    for x, y in loader:  # zero_grad() keeps the sums until the last chunk has stepped
        step(model, optimizer, criterion, x, y)
    assert optimizer.tracker.passes == 1 and engine.accountant.history == [[SIGMA, 1.0, 1]]
    sampler = BatchSampler(RandomSampler(dataset()), batch_size=BATCH, drop_last=False)
    engine, model, optimizer, criterion, loader = private(loader=DataLoader(dataset(), batch_sampler=sampler))
    for _ in range(2):
        for x, y in loader:
            step(model, optimizer, criterion, x, y)
    assert engine.accountant.history == [[SIGMA, 1.0, 2]]


def test_a_pass_is_accounted_at_the_smallest_noise_multiplier_of_its_steps():
    """The example may be in any step of the pass: the one with the least noise bounds it. A later pass starts
    a new mechanism; lowering the noise within a pass restates it (also out of a run merged with the last)."""
    engine, model, optimizer, criterion, loader = private(loader=DataLoader(dataset(), batch_size=BATCH))
    schedule = [[1.0, 0.6, 0.8, 0.7, 1.0], [0.6, 0.6, 0.3, 0.6, 0.6], [2.0] * 5]
    for sigmas in schedule:
        for sigma, (x, y) in zip(sigmas, loader):
            optimizer.noise_multiplier = sigma
            step(model, optimizer, criterion, x, y)
    assert engine.accountant.history == [[0.6, 1.0, 1], [0.3, 1.0, 1], [2.0, 1.0, 1]]


def test_batches_from_elsewhere_count_one_mechanism_each_with_a_warning():
    """Nothing shows that a batch the returned loader did not yield keeps each example to one batch a pass."""
    engine, model, optimizer, criterion, _ = private()
    with pytest.warns(UserWarning, match=FOREIGN) as caught:
        for x, y in DataLoader(dataset(), batch_size=BATCH):
            step(model, optimizer, criterion, x, y)
    assert sum(FOREIGN in str(w.message) for w in caught) == 1
    assert engine.accountant.history == [[SIGMA, 1.0, 5]]


@pytest.mark.parametrize("sampler,message", [
    (lambda data: RandomSampler(data, num_samples=N + 1), "draws 41 examples a pass from a dataset of 40"),
    (lambda data: DistributedSampler(data, num_replicas=3, rank=0, shuffle=False), "pads the 40 examples to 42"),
])
def test_samplers_that_repeat_an_example_within_a_pass_are_refused(sampler, message):
    data = dataset()
    with pytest.raises(ValueError, match=message):
        private(loader=DataLoader(data, batch_size=BATCH, sampler=sampler(data)))


@pytest.mark.parametrize("sampler", [
    lambda data: RandomSampler(data, num_samples=N),
    lambda data: DistributedSampler(data, num_replicas=3, rank=0, drop_last=True),
    lambda data: DistributedSampler(data, num_replicas=4, rank=1),
])
def test_samplers_that_keep_an_example_to_one_batch_a_pass_are_taken(sampler):
    data = dataset()
    engine, model, optimizer, criterion, loader = private(loader=DataLoader(data, batch_size=BATCH,
                                                                            sampler=sampler(data)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in loader:
            step(model, optimizer, criterion, x, y)
    assert engine.accountant.history == [[SIGMA, 1.0, 1]]


def test_calibration_plans_one_mechanism_a_pass_and_warns_past_the_passes():
    engine = PrivacyEngine(seed=2)
    torch.manual_seed(1)
    model = torch.nn.Linear(D, K)
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset(), batch_size=BATCH, shuffle=True), criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=4.0, target_delta=DELTA, epochs=3, max_grad_norm=1.0, poisson_sampling=False)
    assert optimizer.noise_multiplier == get_noise_multiplier(target_epsilon=4.0, target_delta=DELTA,
                                                              plan=[(1.0, 3)])
    assert optimizer.calibrated_steps == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for x, y in loader:
                step(model, optimizer, criterion, x, y)
    assert 0.99 * 4.0 <= engine.get_epsilon(DELTA) <= 4.0
    x, y = next(iter(loader))
    with pytest.warns(UserWarning, match="past the 3 passes over the data that the noise was calibrated for"):
        step(model, optimizer, criterion, x, y)


@pytest.mark.parametrize("accountant", [RDPAccountant, PRVAccountant])
def test_restating_the_last_step(accountant):
    acc = accountant()
    with pytest.raises(ValueError, match="no step to restate"):
        acc.restate_last_step(noise_multiplier=1.0, sample_rate=1.0)
    acc.step(noise_multiplier=1.0, sample_rate=1.0, num_steps=2)
    acc.restate_last_step(noise_multiplier=0.5, sample_rate=1.0)
    assert acc.history == [[1.0, 1.0, 1], [0.5, 1.0, 1]]
    acc.restate_last_step(noise_multiplier=0.4, sample_rate=1.0)
    assert acc.history == [[1.0, 1.0, 1], [0.4, 1.0, 1]]
    with pytest.raises(ValueError, match="sample_rate must be in"):
        acc.restate_last_step(noise_multiplier=0.4, sample_rate=0.0)
    assert acc.history == [[1.0, 1.0, 1], [0.4, 1.0, 1]]


def test_a_restored_history_is_never_restated():
    """A state loaded in the middle of a pass replaces the history: the pass's next step records itself again
    (an over-count) rather than restate a step of the loaded history."""
    engine, model, optimizer, criterion, loader = private(loader=DataLoader(dataset(), batch_size=BATCH))
    batches = iter(loader)
    step(model, optimizer, criterion, *next(batches))
    saved = engine.state_dict()
    step(model, optimizer, criterion, *next(batches))
    engine.accountant.step(noise_multiplier=5.0, sample_rate=0.5)  # another mechanism recorded after the pass's
    optimizer.noise_multiplier = 0.5
    step(model, optimizer, criterion, *next(batches))
    assert engine.accountant.history == [[SIGMA, 1.0, 1], [5.0, 0.5, 1], [0.5, 1.0, 1]]
    engine.load_state_dict(saved)
    optimizer.noise_multiplier = 0.4
    step(model, optimizer, criterion, *next(batches))
    assert engine.accountant.history == [[SIGMA, 1.0, 1], [0.4, 1.0, 1]]
