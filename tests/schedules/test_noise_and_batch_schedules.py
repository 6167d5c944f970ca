"""Noise and batch-size schedules: each step's noise and rate are what the accountant records, the
update equals a per-example reference, calibration over a schedule meets its target, resume continues
the schedule exactly, and misuse is refused."""
import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ghostdp import PrivacyEngine
from ghostdp.accounting import get_noise_multiplier
from ghostdp.accounting.calibration import epsilon_for
from ghostdp.accounting.rdp import DEFAULT_ORDERS, rdp_sampled_gaussian, rdp_to_epsilon
from ghostdp.schedules import (ExponentialNoise, LambdaBatchSize, LambdaNoise, SamplingPlan, StepBatchSize,
                               StepNoise)

N, D, K = 40, 5, 3


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, 6), torch.nn.Tanh(), torch.nn.Linear(6, K))


def make_data():
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))


def private(engine=None, model=None, batch_size=8, noise_multiplier=0.8, **kwargs):
    engine = engine or PrivacyEngine(accountant="rdp", seed=4)
    model = model or make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return (engine, *engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(make_data(), batch_size=batch_size),
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=noise_multiplier, max_grad_norm=0.5, **kwargs))


def run_epochs(model, optimizer, criterion, loader, epochs, scheduler=None, record=None):
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            if record is not None:
                record.append((x.shape[0], optimizer.noise_multiplier))
            optimizer.step()
        if scheduler is not None:
            scheduler.step()


# ------------------------------------------------------------------------------------ noise
def test_noise_schedulers_set_the_noise_multiplier_like_lr_schedulers():
    _, _, optimizer, _, _ = private(noise_multiplier=2.0)
    scheduler = ExponentialNoise(optimizer, gamma=0.5)
    values = [optimizer.noise_multiplier]
    for _ in range(3):
        scheduler.step()
        values.append(optimizer.noise_multiplier)
    assert values == [2.0, 1.0, 0.5, 0.25]

    _, _, optimizer, _, _ = private(noise_multiplier=2.0)
    scheduler = StepNoise(optimizer, step_size=2, gamma=0.1)
    values = [optimizer.noise_multiplier]
    for _ in range(4):
        scheduler.step()
        values.append(optimizer.noise_multiplier)
    assert values == pytest.approx([2.0, 2.0, 0.2, 0.2, 0.02])

    _, _, optimizer, _, _ = private(noise_multiplier=2.0)
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda k: 1 + k)
    scheduler.step()
    assert optimizer.noise_multiplier == 4.0


def test_every_step_is_accounted_with_its_own_noise_and_equals_composing_by_hand():
    engine, model, optimizer, criterion, loader = private(noise_multiplier=1.2)
    scheduler = ExponentialNoise(optimizer, gamma=0.8)
    record = []
    run_epochs(model, optimizer, criterion, loader, 3, scheduler, record)
    steps = len(loader)
    sigmas = [1.2, 1.2 * 0.8, 1.2 * 0.8 ** 2]
    assert engine.accountant.history == [[pytest.approx(s), 8 / N, steps] for s in sigmas]
    assert [s for _, s in record] == pytest.approx([s for s in sigmas for _ in range(steps)])
    # By hand: the run's RDP at every order is the sum of its steps' RDP, then the conversion.
    rdp = [sum(rdp_sampled_gaussian(8 / N, s, a) for s in sigmas for _ in range(steps)) for a in DEFAULT_ORDERS]
    by_hand = rdp_to_epsilon(rdp, DEFAULT_ORDERS, 1e-5)[0]
    assert engine.get_epsilon(1e-5) == pytest.approx(by_hand, rel=1e-9)
    # And above the epsilon of the least noisy third alone, below that of all steps at the lowest noise.
    assert epsilon_for(sigmas[2], 8 / N, steps, 1e-5, "rdp") < by_hand < epsilon_for(sigmas[2], 8 / N, 3 * steps,
                                                                                      1e-5, "rdp")


def test_the_noise_drawn_is_the_scheduled_one():
    # With no clipped signal (learning rate 0 elsewhere: check p.grad), the noise's spread follows sigma.
    engine, model, optimizer, criterion, loader = private(noise_multiplier=4.0, batch_size=40)
    scheduler = StepNoise(optimizer, step_size=1, gamma=0.25)
    spreads = []
    for _ in range(2):
        x, y = next(iter(loader))
        optimizer.zero_grad()
        criterion(model(x) * 0, y).backward()  # zero gradient: p.grad is the noise alone
        optimizer.pre_step()
        spreads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).std().item())
        optimizer.zero_grad()
        scheduler.step()
    # std = sigma * C / expected batch = 4 * 0.5 / 40, then a quarter of it (59 draws: +-20%).
    assert spreads[0] == pytest.approx(0.05, rel=0.25) and spreads[1] == pytest.approx(0.0125, rel=0.25)


def test_noise_schedule_is_saved_and_resumed_with_the_engine():
    def build():
        engine, model, optimizer, criterion, loader = private(engine=PrivacyEngine(accountant="rdp", seed=9))
        return engine, model, optimizer, criterion, loader

    engine, model, optimizer, criterion, loader = build()
    scheduler = ExponentialNoise(optimizer, gamma=0.7)
    run_epochs(model, optimizer, criterion, loader, 3, scheduler)
    straight = [p.detach().clone() for p in model.parameters()]
    straight_history = copy.deepcopy(engine.accountant.history)

    engine, model, optimizer, criterion, loader = build()
    scheduler = ExponentialNoise(optimizer, gamma=0.7)
    run_epochs(model, optimizer, criterion, loader, 2, scheduler)
    saved = copy.deepcopy({"model": model.state_dict(), "engine": engine.state_dict()})

    # Restored before make_private, and the scheduler built afterwards: it picks up its saved state.
    engine = PrivacyEngine(accountant="rdp", seed=9)
    engine.load_state_dict(saved["engine"])
    engine, model, optimizer, criterion, loader = private(engine=engine)
    model.load_state_dict(saved["model"])
    scheduler = ExponentialNoise(optimizer, gamma=0.7)
    assert scheduler.last_epoch == 2 and optimizer.noise_multiplier == pytest.approx(0.8 * 0.49)
    run_epochs(model, optimizer, criterion, loader, 1, scheduler)
    assert engine.accountant.history == straight_history
    for p, q in zip(model.parameters(), straight):
        assert torch.equal(p, q)


def test_noise_scheduler_misuse_is_refused():
    _, _, optimizer, _, _ = private()
    with pytest.raises(TypeError, match="DPOptimizer"):
        ExponentialNoise(optimizer.original_optimizer, gamma=0.9)
    with pytest.raises(ValueError, match="gamma"):
        ExponentialNoise(optimizer, gamma=-1.0)
    with pytest.raises(ValueError, match="step_size"):
        StepNoise(optimizer, step_size=0, gamma=0.5)
    scheduler = LambdaNoise(optimizer, noise_lambda=lambda k: 1.0 if k == 0 else float("nan"))
    with pytest.raises(ValueError, match="factor nan at epoch 1"):
        scheduler.step()
    with pytest.raises(ValueError, match="already has a noise scheduler"):
        ExponentialNoise(optimizer, gamma=0.9)
    _, _, optimizer, _, _ = private()
    ExponentialNoise(optimizer, gamma=0.9)
    state = optimizer.noise_state()
    _, _, other, _, _ = private()
    with pytest.raises(ValueError, match="ExponentialNoise noise scheduler, not a StepNoise"):
        other.load_noise_state(state)
        StepNoise(other, step_size=1, gamma=0.5)


def test_a_schedule_after_calibration_warns_that_epsilon_will_differ():
    model = make_model()
    engine = PrivacyEngine(accountant="rdp", seed=0)
    _, optimizer, _, _ = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(make_data(), batch_size=8), criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="calibrated .* for epsilon 3.0"):
        ExponentialNoise(optimizer, gamma=0.9)


# ------------------------------------------------------------------------------------ batch size
def test_sampling_plan_of_a_growing_batch():
    plan = SamplingPlan(8 / N, 5, N, StepBatchSize(step_size=2, gamma=2.0))
    assert [plan.at(e) for e in range(5)] == [(0.2, 5), (0.2, 5), (0.4, 3), (0.4, 3), (0.8, 2)]
    assert plan.steps(2.5) == [(0.2, 5), (0.2, 5), (0.4, 2)]
    assert plan.first_steps(12) == [(0.2, 5), (0.2, 5), (0.4, 2)]
    assert plan.epoch_of_step(11) == pytest.approx(2 + 1 / 3)
    capped = SamplingPlan(8 / N, 5, N, LambdaBatchSize(lambda e: 100.0))
    assert capped.at(0) == (1.0, 1)  # never above the dataset
    assert SamplingPlan(0.2, 7, N).at(3) == (0.2, 7)


def test_growing_batches_are_drawn_and_accounted_at_their_own_rate():
    engine, model, optimizer, criterion, loader = private(
        noise_multiplier=0.0, batch_size=4, batch_size_schedule=StepBatchSize(step_size=1, gamma=2.0))
    sizes = []
    for epoch in range(3):
        sizes.append([])
        assert len(loader) == [10, 5, 3][epoch]
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            clipped = [p.grad.clone() for p in model.parameters()]
            optimizer.pre_step()  # sigma = 0: p.grad = clipped sum / expected batch size of this epoch
            for g, c in zip(model.parameters(), clipped):
                torch.testing.assert_close(g.grad, c / (4 * 2 ** epoch), rtol=1e-12, atol=0)
            sizes[-1].append(x.shape[0])
    assert [len(s) for s in sizes] == [10, 5, 3]
    assert engine.accountant.history == [[0.0, 0.1, 10], [0.0, 0.2, 5], [0.0, 0.4, 3]]
    means = [sum(s) / len(s) for s in sizes]
    assert means[0] < means[1] < means[2]


def test_a_batch_drawn_ahead_keeps_the_rate_it_was_drawn_with():
    # Two workers prefetch across the epoch boundary; each step still records its own batch's rate.
    engine = PrivacyEngine(accountant="rdp", seed=4)
    model = make_model()
    loader = DataLoader(make_data(), batch_size=4, num_workers=2, prefetch_factor=4)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=0.5,
        batch_size_schedule=StepBatchSize(step_size=1, gamma=2.0))
    run_epochs(model, optimizer, criterion, loader, 2)
    assert engine.accountant.history == [[1.0, 0.1, 10], [1.0, 0.2, 5]]


def test_calibration_over_a_batch_schedule_meets_the_target():
    model = make_model()
    engine = PrivacyEngine(accountant="rdp", seed=0)
    schedule = StepBatchSize(step_size=1, gamma=2.0)
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(make_data(), batch_size=4), criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=6.0, target_delta=1e-5, epochs=3, max_grad_norm=1.0, batch_size_schedule=schedule)
    run_epochs(model, optimizer, criterion, loader, 3)
    assert [h[1:] for h in engine.accountant.history] == [[0.1, 10], [0.2, 5], [0.4, 3]]
    assert 0.99 * 6.0 <= engine.get_epsilon(1e-5) <= 6.0
    constant = get_noise_multiplier(target_epsilon=6.0, target_delta=1e-5, sample_rate=0.1, steps=30,
                                    accountant="rdp")
    assert optimizer.noise_multiplier > constant  # larger rates later cost more than the constant plan


def test_batch_schedule_resumes_mid_run():
    schedule = StepBatchSize(step_size=1, gamma=2.0)
    engine, model, optimizer, criterion, loader = private(batch_size=4, batch_size_schedule=schedule)
    run_epochs(model, optimizer, criterion, loader, 3)
    straight = [p.detach().clone() for p in model.parameters()]
    history = copy.deepcopy(engine.accountant.history)

    engine, model, optimizer, criterion, loader = private(batch_size=4, batch_size_schedule=schedule)
    run_epochs(model, optimizer, criterion, loader, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "engine": engine.state_dict()})
    engine = PrivacyEngine(accountant="rdp", seed=4)
    engine.load_state_dict(saved["engine"])
    engine, model, optimizer, criterion, loader = private(engine=engine, batch_size=4, batch_size_schedule=schedule)
    model.load_state_dict(saved["model"])
    assert len(loader) == 3
    run_epochs(model, optimizer, criterion, loader, 1)
    assert engine.accountant.history == history
    for p, q in zip(model.parameters(), straight):
        assert torch.equal(p, q)


def test_batch_schedule_misuse_is_refused():
    with pytest.raises(ValueError, match="poisson_sampling=True"):
        private(batch_size_schedule=StepBatchSize(step_size=1, gamma=2.0), poisson_sampling=False)
    with pytest.raises(TypeError, match="BatchSizeSchedule"):
        private(batch_size_schedule=lambda e: 2.0)
    with pytest.raises(ValueError, match="gamma"):
        StepBatchSize(step_size=1, gamma=0.0)
    engine, model, optimizer, criterion, loader = private(batch_size_schedule=LambdaBatchSize(lambda e: 1 - e))
    with pytest.raises(ValueError, match="batch-size schedule gave the factor 0 at epoch 1"):
        run_epochs(model, optimizer, criterion, loader, 2)
