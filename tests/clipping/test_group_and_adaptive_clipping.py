"""Per-group clipping (one norm per parameter group) and adaptive clipping (C follows a quantile of the
norms through a noisy count): exact against a per-example loop in float64, accounted, resumable, and
every misuse refused."""
import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ghostdp
from ghostdp import AdaptiveClipNorm, PrivacyEngine
from conftest import Scale, reference_per_example_grads, trainable

B, T, V, H = 6, 5, 11, 8


class Mixed(torch.nn.Module):
    """Embedding, a Linear called twice (shared weights), LayerNorm, a fallback layer, a classifier."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.shared = torch.nn.Linear(H, H)
        self.norm = torch.nn.LayerNorm(H)
        self.scale = Scale(H)
        self.head = torch.nn.Linear(H, 3)

    def forward(self, ids):
        h = torch.tanh(self.shared(self.emb(ids)))
        h = self.scale(self.norm(self.shared(h)))
        return self.head(h.mean(1))


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


def groups_of(model):
    """Three groups that split modules and even a layer's weight from its bias."""
    return [[model.emb.weight, model.shared.weight],
            [model.shared.bias, model.norm.weight, model.norm.bias, model.scale.gain],
            [model.head.weight, model.head.bias]]


def reference_group_clipped_sum(model, ids, labels, groups, norms_c):
    def example_loss(i):
        return torch.nn.functional.cross_entropy(model(ids[i:i + 1]), labels[i:i + 1])
    per_example = reference_per_example_grads(model, example_loss, B)
    names = {id(p): n for n, p in trainable(model)}
    total = {n: torch.zeros_like(p) for n, p in trainable(model)}
    group_norms = torch.zeros(len(groups), B)
    for i, grads in enumerate(per_example):
        for k, (params, C) in enumerate(zip(groups, norms_c)):
            members = [names[id(p)] for p in params]
            norm = math.sqrt(sum(float(grads[n].pow(2).sum()) for n in members))
            group_norms[k, i] = norm
            c = min(1.0, C / (norm + 1e-6))
            for n in members:
                total[n] += c * grads[n]
    return total, group_norms


@pytest.mark.parametrize("every_example_clipped", [True, False])
def test_per_group_clipping_equals_the_per_example_loop(every_example_clipped):
    torch.manual_seed(0)
    model = Mixed()
    ids, labels = data()
    groups = groups_of(model)
    _, group_norms = reference_group_clipped_sum(model, ids, labels, groups, [1.0] * 3)
    if every_example_clipped:
        norms_c = (0.5 * group_norms.min(1).values).tolist()
    else:  # each group's median: in every group some examples are clipped and some are not
        norms_c = group_norms.median(1).values.tolist()
    ref, ref_group_norms = reference_group_clipped_sum(model, ids, labels, groups, norms_c)
    controller = ghostdp.GhostClipping(model, norms_c, clipping="bookkeeping", parameter_groups=groups)
    losses = torch.nn.functional.cross_entropy(model(ids), labels, reduction="none")
    controller.loss(losses, reduction="sum").backward()
    torch.testing.assert_close(controller.last_group_norms, ref_group_norms, rtol=1e-10, atol=0)
    for n, p in trainable(model):
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-10, atol=1e-14)
    assert controller.max_grad_norm == pytest.approx(math.sqrt(sum(c * c for c in norms_c)))
    assert controller.last_coefficients.shape == (3, B)
    if every_example_clipped:
        assert bool((controller.last_coefficients < 1).all())
    else:
        assert bool((controller.last_coefficients == 1).any(1).all()) and bool((controller.last_coefficients < 1).any(1).all())
    torch.testing.assert_close(controller.last_norms, ref_group_norms.pow(2).sum(0).sqrt(), rtol=1e-10, atol=0)


def test_per_group_clipping_through_the_engine_noises_with_the_total_sensitivity():
    torch.manual_seed(0)
    model = Mixed()
    ids, labels = data()
    optimizer = torch.optim.SGD([{"params": g} for g in groups_of(model)], lr=0.1)
    engine = PrivacyEngine(seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(ids, labels), batch_size=B),
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=2.0, max_grad_norm=[0.3, 0.4, 1.2],
        clipping="bookkeeping", poisson_sampling=False)
    assert optimizer.max_grad_norm == pytest.approx(1.3)  # sqrt(0.09 + 0.16 + 1.44)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(x) * 0, y).backward()  # no signal: p.grad is the noise alone
    optimizer.pre_step()
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert noise.std().item() == pytest.approx(2.0 * 1.3 / B, rel=0.15)  # ~190 draws


def test_per_group_clipping_misuse_is_refused():
    model = Mixed()
    groups = groups_of(model)
    with pytest.raises(NotImplementedError, match="needs clipping='bookkeeping'"):
        ghostdp.GhostClipping(model, [1.0, 1.0, 1.0], parameter_groups=groups)
    with pytest.raises(ValueError, match="3 clipping norms but there are 2 parameter groups"):
        ghostdp.GhostClipping(model, [1.0, 1.0, 1.0], clipping="bookkeeping", parameter_groups=groups[:2])
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0, got -1"):
        ghostdp.GhostClipping(model, [1.0, -1, 1.0], clipping="bookkeeping", parameter_groups=groups)
    with pytest.raises(ValueError, match="parameter_groups are for per-group clipping"):
        ghostdp.GhostClipping(model, 1.0, parameter_groups=groups)
    controller = ghostdp.GhostClipping(model, [1.0, 1.0], clipping="bookkeeping", parameter_groups=groups[:2])
    with pytest.raises(AttributeError, match="per-group clipping"):
        controller.max_grad_norm = 2.0
    ids, labels = data()
    losses = torch.nn.functional.cross_entropy(model(ids), labels, reduction="none")
    with pytest.raises(ValueError, match="'head.weight' is trained but in no clipping group"):
        controller.loss(losses).backward()
    controller.detach()
    optimizer = torch.optim.SGD([{"params": g} for g in groups], lr=0.1)
    with pytest.raises(ValueError, match="cannot be combined with per-group"):
        from ghostdp.optim import DPOptimizer
        from ghostdp.randomness import RandomSource
        controller = ghostdp.GhostClipping(model, [1.0, 1.0, 1.0], clipping="bookkeeping", parameter_groups=groups)
        DPOptimizer(optimizer, controller=controller, noise_multiplier=1.0, expected_batch_size=4, sample_rate=0.5,
                    accountant=None, random_source=RandomSource(seed=0), adaptive_clipping=AdaptiveClipNorm())


# ------------------------------------------------------------------------------------ adaptive
N = 40


def adaptive_run(clipping="ghost", noise_multiplier=0.0, steps=3, lr=0.1, seed=5, **adaptive):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g) * torch.linspace(0.1, 3, N)[:, None]  # a spread of norms
    y = torch.randint(0, 2, (N,), generator=g)
    engine = PrivacyEngine(accountant="rdp", seed=seed)
    adaptive.setdefault("count_noise_std", 1.0)
    norm = AdaptiveClipNorm(0.5, **adaptive)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10), criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=noise_multiplier, max_grad_norm=norm, clipping=clipping)
    trace = []
    done = 0
    while done < steps:
        for xb, yb in loader:
            C = engine.controller.max_grad_norm
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            trace.append((xb, yb, C, [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
            done += 1
            if done == steps:
                break
    return engine, model, optimizer, norm, trace


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_adaptive_clipping_follows_the_formula_and_clips_exactly(clipping):
    engine, model, optimizer, norm, trace = adaptive_run(clipping, steps=4, learning_rate=0.3, target_quantile=0.7)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    params = list(reference.parameters())
    C = 0.5
    for xb, yb, used_C, grads in trace:
        assert used_C == pytest.approx(C, rel=1e-12)
        total = [torch.zeros_like(p) for p in params]
        unclipped = 0
        for i in range(xb.shape[0]):
            g = torch.autograd.grad(torch.nn.functional.cross_entropy(reference(xb[i:i + 1]), yb[i:i + 1]), params)
            n = float(torch.sqrt(sum(t.pow(2).sum() for t in g)))
            unclipped += n <= C
            for t, gi in zip(total, g):
                t += min(1.0, C / (n + 1e-6)) * gi
        for got, want in zip(grads, total):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= 0.1 * t / 10
        share = (unclipped - 0.5 * xb.shape[0]) / 10 + 0.5  # noise 0: the count is exact
        C = C * math.exp(-0.3 * (share - 0.7))
    assert engine.controller.max_grad_norm == pytest.approx(C, rel=1e-12)
    for p, q in zip(model.parameters(), params):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-14)


def test_adaptive_clipping_reaches_the_target_quantile():
    # A fixed model (learning rate 0): C settles where about 30% of the norms are below it.
    engine, model, optimizer, norm, trace = adaptive_run(steps=120, lr=0.0, learning_rate=0.3, target_quantile=0.3)
    norms = []
    for xb, yb, _, _ in trace[-12:]:
        criterion_losses = torch.nn.functional.cross_entropy(model(xb), yb, reduction="none")
        norms.append(engine.controller.per_example_norms(criterion_losses))
    share = float((torch.cat(norms) <= engine.controller.max_grad_norm).double().mean())
    assert 0.2 <= share <= 0.4


def test_adaptive_clipping_spends_sigma_and_noises_gradients_with_sigma_g():
    engine, model, optimizer, norm, trace = adaptive_run(noise_multiplier=1.0, steps=2, count_noise_std=2.0)
    # 1 / sigma^2 = 1 / sigma_g^2 + 1 / (2 s_b)^2  ->  sigma_g = 1 / sqrt(1 - 1/16)
    assert norm.gradient_noise_multiplier(1.0) == pytest.approx(1 / math.sqrt(1 - 1 / 16))
    assert engine.accountant.history == [[1.0, 0.25, 2]]  # the accountant records sigma itself
    noise_free = adaptive_run(noise_multiplier=0.0, steps=2, count_noise_std=2.0)[3]
    assert norm.norm != noise_free.norm
    again = adaptive_run(noise_multiplier=1.0, steps=2, count_noise_std=2.0)[3]
    assert again.norm == norm.norm  # the count's noise comes from the seeded stream


def test_adaptive_clipping_resumes_with_its_norm():
    engine, model, optimizer, norm, _ = adaptive_run(noise_multiplier=1.0, steps=3, count_noise_std=2.0)
    saved = copy.deepcopy(engine.state_dict())
    fresh_engine, _, fresh_optimizer, fresh_norm, _ = adaptive_run(noise_multiplier=1.0, steps=0, count_noise_std=2.0)
    fresh_engine.load_state_dict(saved)
    assert fresh_engine.controller.max_grad_norm == norm.norm == fresh_norm.norm
    plain_engine = adaptive_run(steps=0, noise_multiplier=1.0, count_noise_std=2.0)[0]
    saved["noise"]["adaptive_clipping"] = None
    with pytest.raises(ValueError, match="saved without adaptive clipping"):
        plain_engine.load_state_dict(saved)


def test_adaptive_clipping_misuse_is_refused():
    with pytest.raises(ValueError, match="not above half the noise multiplier"):
        adaptive_run(noise_multiplier=3.0, steps=0, count_noise_std=1.0)
    with pytest.raises(ValueError, match="target_quantile"):
        AdaptiveClipNorm(1.0, target_quantile=1.5)
    with pytest.raises(ValueError, match="learning_rate"):
        AdaptiveClipNorm(1.0, learning_rate=0)
    with pytest.raises(ValueError, match="min_norm 2 is above max_norm 1"):
        AdaptiveClipNorm(1.0, min_norm=2, max_norm=1)
    _, _, _, norm, _ = adaptive_run(steps=3, learning_rate=5.0, target_quantile=0.0, min_norm=0.4)
    assert norm.norm == 0.4  # held at its floor


def test_the_gradient_noise_is_drawn_with_sigma_g():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    engine = PrivacyEngine(seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=AdaptiveClipNorm(0.5, count_noise_std=0.6), poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(11))
    xb, yb = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(xb) * 0, yb).backward()  # no signal: p.grad is the noise alone
    optimizer.pre_step()
    sigma_g = 1 / math.sqrt(1 - 1 / 1.2 ** 2)
    total = sum(p.numel() for p in model.parameters())
    expected = torch.normal(0.0, sigma_g * 0.5, size=(total,), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]) * 8, expected,
                               rtol=1e-12, atol=1e-14)
