"""PrivacyEngine end to end: the update equals a per-example reference with the same noise; chunks,
accumulation and resume change nothing; every misuse is refused."""
import copy
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ghostdp
from ghostdp import NonFiniteLossError, PrivacyEngine, PrivacyStepError

N, D, K = 40, 6, 3


def make_model(dropout=0.0):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(8, K))


def make_data(n=N):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, D, generator=g)
    return TensorDataset(x, torch.randint(0, K, (n,), generator=g))


def private(model=None, optimizer=None, batch_size=8, seed=3, engine=None, **kwargs):
    model = model or make_model()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.2)
    engine = engine or PrivacyEngine(seed=seed)
    kwargs.setdefault("noise_multiplier", 0.7)
    kwargs.setdefault("max_grad_norm", 0.5)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(make_data(), batch_size=batch_size),
        criterion=torch.nn.CrossEntropyLoss(), **kwargs)
    return engine, model, optimizer, criterion, loader


def train(model, optimizer, criterion, loader, steps, micro_batches=1, record=None):
    """Ordinary loop; returns after `steps` optimizer steps that were not skipped."""
    done = 0
    while True:
        for x, y in loader:
            optimizer.zero_grad()
            for xs, ys in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
                criterion(model(xs), ys).backward()
            last = optimizer.tracker.yielded[-1].is_last
            if record is not None:
                record.append((x, y, last))
            optimizer.step()
            done += last
            if done == steps:
                return


def reference_run(batches, sigma, C, lr, expected_batch, noise_seed):
    """Per-example loop: clip each gradient, sum, add the same noise, divide, plain SGD."""
    model = make_model()
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(noise_seed)
    xs, ys = [], []
    for x, y, last in batches:
        xs.append(x), ys.append(y)
        if not last:
            continue
        x, y, xs, ys = torch.cat(xs), torch.cat(ys), [], []
        total = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            loss = torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
            grads = torch.autograd.grad(loss, params)
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            c = min(1.0, C / (float(norm) + 1e-6))
            for t, g in zip(total, grads):
                t += c * g
        with torch.no_grad():  # one noise draw over all parameters, in order
            noise = torch.normal(0.0, sigma * C, size=(sum(p.numel() for p in params),), generator=gen)
            for p, t, n in zip(params, total, noise.split([p.numel() for p in params])):
                p -= lr * (t + n.view(p.shape).to(p.dtype)) / expected_batch
    return model


@pytest.mark.parametrize("max_physical, clipping", [(None, "ghost"), (3, "ghost"), (None, "bookkeeping"),
                                                    (3, "bookkeeping")])
def test_update_equals_per_example_reference_with_the_same_noise(max_physical, clipping):
    record = []
    original = make_model()
    engine, model, opt, crit, loader = private(model=original, noise_generator=torch.Generator().manual_seed(11),
                                               max_physical_batch_size=max_physical, clipping=clipping)
    assert engine.controller.mode.name == clipping
    assert model is original and isinstance(opt, ghostdp.DPOptimizer)
    train(model, opt, crit, loader, steps=4, record=record)
    ref = reference_run(record, sigma=0.7, C=0.5, lr=0.2, expected_batch=8, noise_seed=11)
    assert engine.accountant.history == [[0.7, 8 / N, 4]]
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)
    if max_physical:
        assert max(x.shape[0] for x, _, _ in record) <= max_physical


def test_chunked_logical_batches_equal_unchunked_ones():
    runs = []
    for max_physical in (None, 2, 5):
        record = []
        _, model, opt, crit, loader = private(max_physical_batch_size=max_physical)
        train(model, opt, crit, loader, steps=5, record=record)
        runs.append(([p.detach().clone() for p in model.parameters()], record))
    (base, base_record), *others = runs
    base_examples = torch.cat([x for x, _, _ in base_record])
    for params, record in others:
        assert torch.equal(torch.cat([x for x, _, _ in record]), base_examples)  # the same Poisson draws
        for p, q in zip(params, base):
            # Same examples, noise and order of steps; only the grouping of the float64 sum differs.
            torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15)


def test_gradient_accumulation_over_micro_batches_equals_one_batch():
    results = []
    for micro in (1, 3):
        _, model, opt, crit, loader = private()
        train(model, opt, crit, loader, steps=4, micro_batches=micro)
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15)


def test_an_empty_dataset_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="training dataset is empty"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(make_data(0), batch_size=8), noise_multiplier=1.0,
                                     max_grad_norm=1.0)


def test_empty_logical_batches_still_add_noise_and_count():
    record = []
    # q = 1/40: about a third of the logical batches are empty.
    engine, model, opt, crit, loader = private(batch_size=1, noise_generator=torch.Generator().manual_seed(5))
    train(model, opt, crit, loader, steps=12, record=record)
    empties = [x for x, _, _ in record if x.shape[0] == 0]
    assert empties and all(x.shape == (0, D) for x in empties)
    assert engine.accountant.steps == 12
    ref = reference_run(record, sigma=0.7, C=0.5, lr=0.2, expected_batch=1, noise_seed=5)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_save_and_resume_gives_the_same_trajectory_and_epsilon(dropout):
    def build(seed):
        model = make_model(dropout)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        return private(model=model, optimizer=opt, seed=seed, max_physical_batch_size=3)

    engine, model, opt, crit, loader = build(seed=21)
    train(model, opt, crit, loader, steps=8)  # crosses an epoch boundary (5 steps per epoch)
    straight = [p.detach().clone() for p in model.parameters()]

    engine, model, opt, crit, loader = build(seed=21)
    train(model, opt, crit, loader, steps=3)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()})

    new_engine = PrivacyEngine(seed=999)
    torch.manual_seed(12345)  # whatever the new process did with the global RNG: the saved state wins
    new_engine.load_state_dict(saved["engine"])  # before make_private: applied when it runs
    model = make_model(dropout)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _, model, opt, crit, loader = private(model=model, optimizer=opt, engine=new_engine, max_physical_batch_size=3)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, crit, loader, steps=5)
    for p, q in zip(model.parameters(), straight):
        assert torch.equal(p, q)
    assert new_engine.accountant.steps == 8
    reference = PrivacyEngine()
    reference.accountant.step(noise_multiplier=0.7, sample_rate=8 / N, num_steps=8)
    assert new_engine.get_epsilon(1e-5) == reference.get_epsilon(1e-5)


def test_make_private_with_epsilon_spends_at_most_the_target():
    model = make_model()
    engine = PrivacyEngine(accountant="rdp", seed=0)
    model, opt, crit, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(make_data(), batch_size=8),
        criterion=torch.nn.CrossEntropyLoss(), target_epsilon=4.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the planned steps draw no warning
        train(model, opt, crit, loader, steps=2 * len(loader))
    assert 0.99 * 4.0 <= engine.get_epsilon(1e-5) <= 4.0
    with pytest.warns(UserWarning, match=f"gone past the {2 * len(loader)} steps that the noise was calibrated for"):
        train(model, opt, crit, loader, steps=1)
    assert engine.get_epsilon(1e-5) > 4.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        train(model, opt, crit, loader, steps=1)


def test_lr_scheduler_and_param_groups_work_through_the_dp_optimizer():
    model = make_model()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.01},
                             {"params": model[3].parameters(), "lr": 0.02}])  # model[2] is the Dropout
    _, model, opt, crit, loader = private(model=model, optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, crit, loader, steps=1)
    sched.step()
    assert [g["lr"] for g in opt.original_optimizer.param_groups] == [0.005, 0.01]


def test_fixed_batches_without_poisson_sampling():
    engine, model, opt, crit, loader = private(poisson_sampling=False)
    sizes = []
    for x, y in loader:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sizes.append(x.shape[0])
    # One pass: one Gaussian mechanism without amplification (it was five Poisson draws at q = 0.2 before
    # 2026-11-26: optimistic; tests/accounting/test_fixed_batches.py).
    assert sizes == [8] * 5 and engine.accountant.history == [[0.7, 1.0, 1]]


class ClassBalanced(torch.utils.data.BatchSampler):
    """A user's own batch sampler (it draws the same batches as torch's, but ghostdp cannot know that)."""


USERS_SAMPLERS = {
    "weighted": lambda data: dict(sampler=torch.utils.data.WeightedRandomSampler(torch.rand(len(data)), len(data))),
    "with replacement": lambda data: dict(sampler=torch.utils.data.RandomSampler(data, replacement=True)),
    "own batch sampler": lambda data: dict(batch_sampler=ClassBalanced(torch.utils.data.RandomSampler(data), 8,
                                                                       False)),
}


@pytest.mark.parametrize("kind", list(USERS_SAMPLERS))
def test_a_users_own_sampler_is_refused_without_poisson_sampling_and_replaced_with_a_warning(kind):
    """Without Poisson sampling the loader's batches were used as they came, with epsilon accounted as if each
    example joined each batch with probability batch size / dataset size: a weighted or with-replacement
    sampler puts some examples in far more batches (or twice in one, clipped twice), so epsilon was optimistic
    for them, silently. Now refused; with Poisson sampling (the default) the sampler is replaced, with a warning
    that its weighting is lost."""
    data = make_data()

    def make(loader, poisson):
        model = make_model()
        return PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                  data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
                                                  noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson)

    sampling = USERS_SAMPLERS[kind](data)
    own = DataLoader(data, **({} if "batch_sampler" in sampling else {"batch_size": 8}), **sampling)
    with pytest.raises(ValueError, match="poisson_sampling=False the data loader's .* exceed the epsilon reported"):
        make(own, False)
    with pytest.warns(UserWarning, match="is not used: with Poisson sampling every example joins each batch"):
        make(own, True)
    for shuffle in (True, False):  # torch's standard loaders: neither refused nor warned of
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            make(DataLoader(data, batch_size=8, shuffle=shuffle), False)


def test_secure_mode_draws_from_os_entropy():
    engine, model, opt, crit, loader = private(engine=PrivacyEngine(secure_mode=True))
    train(model, opt, crit, loader, steps=2)
    noise = engine.random_source.gaussian_like(torch.zeros(200_000), std=2.0)
    assert abs(float(noise.std()) - 2.0) < 0.02 and abs(float(noise.mean())) < 0.02
    assert engine.state_dict()["random"] == {"secure": True}


# ------------------------------------------------------------------ misuse is refused
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
    (dict(noise_multiplier=math.nan), ValueError, "noise_multiplier"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(clipping="per_layer"), ValueError, "clipping"),
    (dict(loss_reduction="max"), ValueError, "loss_reduction"),
    (dict(max_physical_batch_size=0), ValueError, "max_physical_batch_size"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        private(**kwargs)


def test_criterion_without_reduction_none_is_refused():
    class Loss(torch.nn.Module):
        def forward(self, out, y):
            return out.sum()
    model = make_model()
    engine = PrivacyEngine(seed=0)
    with pytest.raises(TypeError, match="reduction"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(make_data(), batch_size=8), criterion=Loss(),
                            noise_multiplier=1.0, max_grad_norm=1.0)


def test_criterion_reduction_must_match_loss_reduction():
    model = make_model()
    with pytest.raises(ValueError, match="must agree"):
        PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           data_loader=DataLoader(make_data(), batch_size=8),
                                           criterion=torch.nn.CrossEntropyLoss(reduction="sum"),
                                           noise_multiplier=1.0, max_grad_norm=1.0)


def test_labels_with_another_batch_size_are_refused():
    _, model, opt, crit, loader = private()
    x, y = next(iter(loader))
    with pytest.raises(ValueError, match="batch size"):
        crit(model(x), torch.cat([y, y]))


def test_non_finite_norm_names_the_example_or_is_skipped():
    x = torch.randn(4, D)
    x[2] = 1e200  # finite activations and loss, but the squared norm overflows
    y = torch.tensor([0, 1, 2, 0])
    _, model, opt, crit, _ = private()
    with pytest.raises(NonFiniteLossError, match=r"examples \[2\]"):
        crit(model(x), y).backward()

    _, model, opt, crit, _ = private(model=torch.nn.Linear(D, K), nonfinite="skip", noise_multiplier=0.0)
    opt.zero_grad()
    crit(model(x), y).backward()
    skipped = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    crit(model(x[[0, 1, 3]]), y[[0, 1, 3]]).backward()
    for g, h in zip(skipped, model.parameters()):
        torch.testing.assert_close(g, h.grad)


def test_nan_activations_are_refused_at_step_even_when_skipping():
    _, model, opt, crit, loader = private(nonfinite="skip", poisson_sampling=False)
    x, y = next(iter(loader))
    x[1] = math.nan
    crit(model(x), y).backward()
    with pytest.raises(FloatingPointError, match="NaN or infinite"):
        opt.step()


def test_a_finite_gradient_whose_norm_overflows_is_not_called_nan():
    # The check reduces each gradient to its 2-norm, which overflows float32 above ~1e19. Such a gradient is
    # no clipped sum of 8 examples either: it is refused as one changed after backward(), not as a NaN.
    torch.set_default_dtype(torch.float32)
    _, model, opt, crit, loader = private(model=torch.nn.Linear(D, K), noise_multiplier=0.0, poisson_sampling=False)
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    model.weight.grad[0, 0] = 1e30
    with pytest.raises(PrivacyStepError, match="of norm inf, more than the clipped gradients of this step's 8"):
        opt.step()
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_gradient_scaled_up_between_backward_and_step_is_refused(clipping):
    """The noise is calibrated to C: a clipped sum scaled by 1e3 after backward() was noised and stepped as
    if it were one. The step now refuses a p.grad larger than examples x C; scaling down stays allowed."""
    _, model, opt, crit, loader = private(clipping=clipping, poisson_sampling=False)
    x, y = next(iter(loader))
    opt.zero_grad()
    crit(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # down: still a bound the noise covers
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    crit(model(x), y).backward()
    for p in model.parameters():
        p.grad.mul_(1e3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyStepError, match="changed between backward\\(\\) and step\\(\\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_optimizer_over_other_parameters_is_refused():
    model, other = make_model(), make_model()
    with pytest.raises(ValueError, match="not parameters of the private model"):
        private(model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_trainable_parameters_outside_the_dp_optimizer_are_refused_before_any_gradient_is_written():
    """A DP optimizer over the body while the head still requires grad: the head's clipped sum would stay in p.grad
    without noise, and a second optimizer over it (as here) stepped it by that unnoised sum before 2026-11-26.
    Refused at the norm pass, before any gradient is written; freezing the head is the fix."""
    model = make_model()
    _, model, opt, crit, loader = private(model=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1))
    head = torch.optim.SGD(model[3].parameters(), lr=0.1)
    x, y = next(iter(loader))
    with pytest.raises(PrivacyStepError, match=r"require grad but are not in the DP optimizer \(\['3.weight', "
                                               r"'3.bias'\]\)"):
        crit(model(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    head.step()  # nothing to step: no gradient was written
    model[3].requires_grad_(False)
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()
    assert model[0].weight.grad is not None and model[3].weight.grad is None


def test_a_parameter_unfrozen_after_make_private_and_outside_the_optimizer_is_refused():
    model = make_model()
    model[3].requires_grad_(False)
    _, model, opt, crit, loader = private(model=model, optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1))
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    model[3].bias.requires_grad_(True)
    with pytest.raises(PrivacyStepError, match=r"\['3.bias'\]"):
        crit(model(x), y).backward()


@pytest.mark.parametrize("poisson", [True, False])
def test_step_without_backward_is_refused(poisson):
    _, model, opt, crit, loader = private(poisson_sampling=poisson, batch_size=20)
    for x, y in loader:
        if x.shape[0]:
            break
    with pytest.raises(PrivacyStepError, match="without a backward"):
        opt.step()


def test_stepping_the_wrapped_optimizer_directly_is_refused():
    """A loop that keeps calling step() on the optimizer it gave make_private (not the returned one) updated
    the model with clipped but unnoised gradients, and the accountant never counted a step."""
    inner = None

    def make_optimizer(model):
        nonlocal inner
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        return inner

    model = make_model()
    engine, model, opt, crit, loader = private(model=model, optimizer=make_optimizer(model), poisson_sampling=False)
    batches = iter(loader)
    x, y = next(batches)
    opt.zero_grad()
    crit(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PrivacyStepError, match="stepped without ghostdp's noise.*step\\(\\) on the optimizer that "
                                               "make_private returned"):
        inner.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert engine.accountant.steps == 0
    opt.step()  # the DP step steps the wrapped optimizer once
    assert engine.accountant.steps == 1
    with pytest.raises(PrivacyStepError, match="twice after one noised step"):
        inner.step()
    x, y = next(batches)
    opt.zero_grad()
    crit(model(x), y).backward()
    assert opt.pre_step() is True  # a loop that steps the wrapped optimizer itself (DPTrainer)
    inner.step()
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inner.step()  # zero gradients carry nothing of the data (torch.distributed.checkpoint makes the state so)
    engine.controller.detach()  # not private any more: the optimizer is the user's again
    torch.nn.functional.cross_entropy(model(x), y).backward()
    inner.step()


FOREIGN_BATCH = "did not come from the Poisson-sampling data loader that make_private returned"


def test_batches_not_drawn_by_the_returned_poisson_loader_are_refused():
    """A loop over the loader it gave make_private (the variable kept its old name) got its steps accounted as
    Poisson draws that never happened: fixed batches, here in order, each example in one known step of an
    epoch: an optimistic epsilon. Refused at the first step, and later too, once the returned loader has been
    used. (poisson_sampling=False trains on the loader's own batches by design: see the next test.)"""
    original = DataLoader(make_data(), batch_size=8)
    model = make_model()
    engine = PrivacyEngine(seed=3)
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2), data_loader=original,
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=0.7, max_grad_norm=0.5)
    x, y = next(iter(original))
    opt.zero_grad()
    crit(model(x), y).backward()
    with pytest.raises(PrivacyStepError, match=FOREIGN_BATCH):
        opt.step()
    assert engine.accountant.steps == 0
    opt.reset_step_state()
    train(model, opt, crit, loader, steps=2)  # the returned loader: fine
    opt.zero_grad()
    crit(model(x), y).backward()
    with pytest.raises(PrivacyStepError, match=FOREIGN_BATCH):
        opt.step()


def test_without_poisson_sampling_the_loaders_own_batches_may_come_from_elsewhere():
    """Each such step is accounted on its own, with a warning (tests/accounting/test_fixed_batches.py)."""
    engine, model, opt, crit, loader = private(poisson_sampling=False)
    for x, y in DataLoader(make_data(), batch_size=8):  # the same fixed batches the returned loader yields
        opt.zero_grad()
        crit(model(x), y).backward()
        with pytest.warns(UserWarning, match="did not come from the data loader that make_private returned"):
            opt.step()
        break
    assert engine.accountant.history == [[0.7, 1.0, 1]]


def test_parameters_replaced_after_make_private_are_refused():
    _, model, opt, crit, loader = private(poisson_sampling=False)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float32)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    x, y = next(iter(loader))
    crit(model(x.float()), y).backward()
    with pytest.raises(ValueError, match="replaced after make_private"):
        opt.step()


def test_submodule_replaced_after_steps_is_refused():
    """The step's check walks the model again only when its tree changed: a replaced submodule is seen. A trained
    replacement is refused at the backward already (the graph audit: its parameters were not the model's); a
    frozen one gets no gradient there, and the optimizer's parameters that left the model are refused at the step."""
    _, model, opt, crit, loader = private(poisson_sampling=False)
    train(model, opt, crit, loader, steps=1)
    name, child = next((n, c) for n, c in model.named_children() if isinstance(c, torch.nn.Linear))
    x, y = next(iter(loader))
    setattr(model, name, torch.nn.Linear(child.in_features, child.out_features))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="were not parameters of the model when it was made private"):
        crit(model(x), y).backward()
    setattr(model, name, torch.nn.Linear(child.in_features, child.out_features).requires_grad_(False))
    opt.zero_grad()
    crit(model(x), y).backward()
    with pytest.raises(ValueError, match="replaced after make_private"):
        opt.step()


def test_scaled_loss_is_refused():
    _, model, opt, crit, loader = private(poisson_sampling=False)
    x, y = next(iter(loader))
    (crit(model(x), y) / 4).backward()
    with pytest.raises(PrivacyStepError, match="incoming gradient of 0.25"):
        opt.step()


def test_accumulating_several_poisson_batches_is_refused():
    _, model, opt, crit, loader = private(batch_size=20)
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        crit(model(x), y).backward()
    with pytest.raises(PrivacyStepError, match="spans 2 logical batches"):
        opt.step()


@pytest.mark.parametrize("own_loader", [False, True])
def test_accumulating_several_fixed_batches_is_refused(own_loader):
    _, model, opt, crit, loader = private(poisson_sampling=False)
    # Batches from the returned loader are tracked; the loop's own batches are bounded by the batch size.
    batches = iter(DataLoader(make_data(), batch_size=8) if own_loader else loader)
    for _ in range(2):
        x, y = next(batches)
        crit(model(x), y).backward()
    with pytest.raises(PrivacyStepError, match="at most 8" if own_loader else "spans 2 logical batches"):
        opt.step()


def test_skipped_physical_batch_is_refused():
    _, model, opt, crit, loader = private(batch_size=20, max_physical_batch_size=4)
    for x, y in loader:
        last = opt.tracker.yielded[-1]
        if last.index == 0 and last.count > 2:
            crit(model(x), y).backward()  # the first chunk only
        if last.is_last and last.count > 2:
            with pytest.raises(PrivacyStepError, match="backward\\(\\) clipped"):
                opt.step()
            return
        opt.step() if last.count <= 2 else None
    pytest.fail("no logical batch with more than two chunks")


def test_forgotten_zero_grad_is_refused():
    _, model, opt, crit, loader = private(poisson_sampling=False)
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    x, y = next(batches)
    with pytest.raises(PrivacyStepError, match="zero_grad"):
        crit(model(x), y).backward()


def test_one_engine_per_model_and_map_style_data():
    engine, *_ = private()
    with pytest.raises(RuntimeError, match="one engine per model"):
        private(engine=engine)

    class Stream(IterableDataset):
        def __iter__(self):
            yield from make_data()
    model = make_model()
    with pytest.raises(TypeError, match="map-style"):
        PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           data_loader=DataLoader(Stream(), batch_size=8),
                                           criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                           max_grad_norm=1.0)
    with pytest.raises(TypeError, match="DataLoader"):
        PrivacyEngine(seed=0).make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           data_loader=[(torch.zeros(2, D), torch.zeros(2))],
                                           criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0,
                                           max_grad_norm=1.0)


def test_secure_mode_cannot_be_seeded():
    with pytest.raises(ValueError, match="cannot be seeded"):
        PrivacyEngine(secure_mode=True, seed=3)
    with pytest.raises(ValueError, match="noise_generator"):
        private(engine=PrivacyEngine(secure_mode=True), noise_generator=torch.Generator())


def test_a_loop_steps_an_empty_batch_without_a_forward_and_says_which_steps_were_taken():
    import transformers
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    data = torch.utils.data.TensorDataset(torch.randint(1, 30, (40, 6)), torch.randint(0, 2, (40,)))
    engine = PrivacyEngine(seed=2)
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=2),
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, max_physical_batch_size=1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    empty = taken = skipped = 0
    for ids, labels in loader:  # the README's loop
        opt.zero_grad()
        if len(labels):  # a model never sees a batch of 0 rows; the step still adds noise and is accounted
            crit(model(input_ids=ids).logits, labels).backward()
        else:
            empty += 1
        opt.step()
        if opt.last_step_taken:
            scheduler.step()
            taken += 1
        else:
            skipped += 1  # an earlier physical chunk of a logical batch
    assert empty > 0 and skipped > 0 and taken == engine.accountant.steps == len(loader.batch_sampler)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** taken)


def test_a_logical_batch_mixing_sums_summed_by_ddp_with_sums_written_by_ghostdp_is_refused_with_several_processes(
        monkeypatch):
    """Every backward writes its clipped sums itself (the step sums the ranks'), except two passes with FSDP2-sharded
    parameters, whose second backward leaves them to FSDP's reduce-scatter: a logical batch with both would be
    summed over the ranks in part. No model switches between the two within a logical batch (its parameters are
    sharded or not), so the first chunk's backward is made to report autograd's sums here."""
    _, model, opt, crit, loader = private(batch_size=20, max_physical_batch_size=4, clipping="ghost")
    opt.world_size = 2  # as under torchrun: the refusal comes before any collective
    controller = opt.controller
    writes = controller.writes_sums_itself
    for x, y in loader:
        chunk = opt.tracker.yielded[-1]
        monkeypatch.setattr(controller, "writes_sums_itself", (lambda mode=None: False) if chunk.index == 0 else writes)
        crit(model(x), y).backward()
        if chunk.is_last:
            assert chunk.count >= 2  # the seeded draw's first logical batch has several chunks
            with pytest.raises(PrivacyStepError, match="mixed clipped sums that autograd formed"):
                opt.step()
            return


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_the_noise_is_scaled_to_the_clipping_norm_the_gradients_were_clipped_with(clipping):
    """A C lowered between backward() and step() (a schedule set at the wrong point) scaled the noise of
    gradients clipped with the old C: at 1e-6, sigma * 1e-6 against a sensitivity of 0.5. The step now adds
    noise for the largest C its backward calls clipped with; the new C applies from the next backward."""
    engine, model, optimizer, criterion, loader = private(clipping=clipping)
    stds = []
    add = engine.random_source.add_gaussian_
    engine.random_source.add_gaussian_ = lambda tensors, std, *a, **k: stds.append(std) or add(tensors, std, *a, **k)
    batches = iter(loader)
    x, y = next(batches)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    engine.controller.max_grad_norm = 1e-6
    optimizer.step()
    assert stds == [pytest.approx(0.7 * 0.5)]
    x, y = next(batches)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    assert stds[-1] == pytest.approx(0.7 * 1e-6)


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_parameter_frozen_between_forward_and_backward_is_not_stepped_without_noise(clipping):
    """Book-keeping writes the clipped sum of every parameter its forward recorded as trainable; one frozen
    before backward() still got it and the wrapped optimizer stepped it, but the noise skipped parameters
    that do not require grad: a clipped, unnoised update. Now whatever holds a gradient gets the noise."""
    engine, model, optimizer, criterion, loader = private(clipping=clipping, poisson_sampling=False)
    noised = []
    add = engine.random_source.add_gaussian_
    engine.random_source.add_gaussian_ = lambda tensors, *a, **k: noised.extend(tensors) or add(tensors, *a, **k)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    out = model(x)
    first = model[0].weight
    first.requires_grad_(False)
    criterion(out, y).backward()
    before = first.detach().clone()
    optimizer.step()
    if first.grad is None:  # two passes: autograd does not accumulate into a parameter that no longer requires grad
        assert torch.equal(first, before)
    else:  # book-keeping wrote its clipped sum: then it is noised with the others
        assert any(t is first.grad for t in noised)
