"""Pass 2 of two passes repeats pass 1's backward (pass_two.py): each layer's clipped sum reads the output
grads its norm was formed from, bit for bit, so that an example whose gradient is mostly float32 rounding still
moves the clipped sum by at most C."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ghostdp
import test_sensitivity_audit as audit
from conftest import Unsteady, fallback_gain
from test_sensitivity_audit import LinearAttentionEncoder

B, T, D = 4, 4, 8
strict_float32 = audit.strict_float32  # the audit's fixture: TF32 off on a GPU


def _losses(model, x, labels, reentrant=False):
    """``reentrant``: the whole model under a reentrant checkpoint (its input made to require grad, so that the
    region's output does), where pass 2 recomputes the region and records its calls again."""
    out = checkpoint(model, x.detach().requires_grad_(), use_reentrant=True) if reentrant else model(x)
    return torch.nn.functional.cross_entropy(out, labels, reduction="none")


def _clipped_sum(model, x, labels, C, reentrant=False):
    controller = ghostdp.GhostClipping(model, C, clipping="ghost", nonfinite="skip")
    try:
        model.zero_grad(set_to_none=True)
        controller.loss(_losses(model, x, labels, reentrant), reduction="sum").backward()
        return torch.cat([p.grad.flatten().double() for p in model.parameters()])
    finally:
        controller.detach()
        model.zero_grad(set_to_none=True)


def test_pass_two_receives_the_output_grads_that_pass_one_received_bit_for_bit(device):
    """A tensor hook on the query projection's output sees every backward of the step: the layout proof's, pass 1's
    and pass 2's. Pass 2's (before 2026-11-27: c_i times another rounding of them) equal pass 1's. (On a GPU,
    ``pytest tests/privacy --device cuda``: whether its attention backward is deterministic.)"""
    model = LinearAttentionEncoder(batch_first=True).float().to(device)
    x = torch.randn(B, T, D, dtype=torch.float32).to(device)
    labels = torch.tensor([0, 1, 2, 0], device=device)
    x[0] *= 1e4  # a saturated softmax: the example's G at the query projection is mostly rounding
    seen = []

    def watch(module, args, out):
        out.register_hook(lambda g: seen.append(g.clone()))

    model.query.register_forward_hook(watch)
    controller = ghostdp.GhostClipping(model, 0.1, clipping="ghost")
    controller.loss(_losses(model, x, labels), reduction="sum").backward()
    controller.detach()
    assert len(seen) == 3  # the layout proof, pass 1, pass 2
    assert torch.equal(seen[2], seen[1]) and seen[1][0].abs().max() > 0


@pytest.mark.parametrize("batch_first, reentrant", [(True, False), (False, False), (True, True)])
def test_an_example_whose_gradient_is_mostly_rounding_moves_the_float32_clipped_sum_by_at_most_C(batch_first,
                                                                                                reentrant, device,
                                                                                                strict_float32):
    """The sensitivity audit's adversaries (the example x 1e4, tokens of 1e8 that cancel) on several seeds of a
    Linear-projected attention: before 2026-11-27 two passes moved the clipped sum by up to 4.5 C here; through a
    reentrant checkpoint, whose region pass 2 recomputes, by 2.87 C."""
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model = LinearAttentionEncoder(batch_first).float().to(device)
        x = torch.randn(B + 1, T, D, dtype=torch.float32).to(device)
        labels = torch.randint(0, 3, (B + 1,)).to(device)
        layout = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
        probe = ghostdp.GhostClipping(model, 1.0)
        C = float(probe.per_example_norms(_losses(model, layout(x[:B]), labels[:B])).median())  # about half clipped
        probe.detach()
        cancelling = 1e8 * torch.tensor([1.0, -1.0] * (T // 2), dtype=torch.float32, device=device)[:, None] * x[B, 0]
        for adversary in (x[B] * 1e4, cancelling):
            batch = torch.cat([x[:B], adversary[None]])
            without = _clipped_sum(model, layout(x[:B]), labels[:B], C, reentrant)
            with_it = _clipped_sum(model, layout(batch), labels, C, reentrant)
            moved = float((with_it - without).norm())
            assert moved <= C * (1 + 1e-6) + 1e-5 * float(without.norm() + with_it.norm()), moved / C
            worst = max(worst, moved / C)
    assert worst > 0.5  # the adversaries are clipped: each moves the sum by about C


class _Slope(torch.nn.Module):
    """x where x > 0, a x elsewhere: PReLU's arithmetic in a module of its own, which has no norm rule (the fallback;
    nn.PReLU has one since 2026-11-28; the product through conftest.fallback_gain, which no elementwise use takes)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.25))

    def forward(self, x):
        return torch.where(x > 0, x, fallback_gain(x, self.a))


class _Wobbly(torch.nn.Module):
    """Linear, Tanh, the Unsteady identity, Linear. ``shared``: the first Linear and the Tanh twice (a parameter with
    two uses), and a _Slope (no norm rule: the fallback) before the Unsteady identity."""

    def __init__(self, checkpointing=None, shared=False):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(D, D), "1": torch.nn.Tanh(),
                                           "2": torch.nn.Linear(D, D)})
        if shared:
            self.layers["3"] = _Slope()
        self.checkpointing, self.shared = checkpointing, shared

    def _layers(self, x):
        h = self.layers["1"](self.layers["0"](x))
        if self.shared:
            h = self.layers["3"](self.layers["1"](self.layers["0"](h)) - 0.5)
        return self.layers["2"](Unsteady.apply(h))

    def forward(self, x):
        if self.checkpointing is None:
            return self._layers(x)
        return checkpoint(self._layers, x.detach().requires_grad_(self.checkpointing == "reentrant"),
                          use_reentrant=self.checkpointing == "reentrant")


def _unsteady(wobble=1e-6, checkpointing=None, on_runs=None, shared=False):
    """A model whose middle backward is Unsteady (seeded), and its per-example losses on a batch. ``checkpointing``:
    None, "non-reentrant" or "reentrant" (the whole model in one checkpoint); ``shared``: see _Wobbly."""
    torch.manual_seed(0)
    model = _Wobbly(checkpointing, shared)
    Unsteady.runs, Unsteady.wobble, Unsteady.on_runs = 0, wobble, on_runs
    return model, lambda x: model(x).pow(2).sum(1)


def _clipped_sum_by_loop(model, losses, x, C):
    """sum_i min(1, C / |g_i|) g_i, from each example's own backward (float64)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(losses(x[i:i + 1]).sum(), list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, C / (float(norm) + 1e-6))
    return total


@pytest.mark.parametrize("checkpointing, shared", [(None, False), ("non-reentrant", False), ("reentrant", False),
                                                   (None, True), ("non-reentrant", True)])
def test_a_pass_two_whose_output_grads_differ_still_writes_each_examples_clipped_gradient(checkpointing, shared):
    """Pass 2 receives twice pass 1's output grads below the Unsteady identity (a kernel that rounds differently,
    exaggerated): each parameter's sums are scaled by min(1, n1/n2), which here undoes the doubling exactly, so the
    step writes the per-example loop's clipped sums (float64); the difference is warned of (naming the module) and
    scales every later step. Before, two passes wrote the doubled gradients (up to 2 C an example) and then, on such a
    checked step, refused it after writing. ``shared``: a parameter with two uses (its norm over both, cross terms
    included) and one without a rule (its sums from pass 1's per-example gradients, not scaled)."""
    C = 1.0
    x = torch.randn(B, D)
    model, losses = _unsteady(wobble=0.0, checkpointing=checkpointing, shared=shared)  # the step's backward runs
    controller = ghostdp.GhostClipping(model, C, clipping="ghost")
    controller.loss(losses(x), reduction="sum").backward()
    controller.detach()
    last = Unsteady.runs  # pass 2's
    model, losses = _unsteady(wobble=1.0, checkpointing=checkpointing, on_runs={last}, shared=shared)
    controller = ghostdp.GhostClipping(model, C, clipping="ghost")
    with pytest.warns(UserWarning, match=r"module 'layers.0' received different ones.*differs by 3 of itself.*"
                                         r"scales its clipped sums") as caught:
        controller.loss(losses(x), reduction="sum").backward()
    differed = [w for w in caught if "received different ones" in str(w.message)]
    assert len(differed) == 1 and differed[0].filename == __file__  # the line that called backward()
    assert controller.step_modes.pass_two_rescaled
    controller.detach()
    model.checkpointing = None  # the loop's own backwards (Unsteady is the identity again)
    Unsteady.on_runs = set()
    expected = _clipped_sum_by_loop(model, lambda x: model(x).pow(2).sum(1), x, C)
    assert max(float(g.norm()) for g in expected) > 0.5 * C  # clipped examples: the doubling would show
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("check", [True, False])
def test_once_the_passes_differed_every_step_keeps_each_example_within_C(check, monkeypatch):
    """Batches whose second example's loss weighs 0, so that the step's clipped sum is the first example's clipped
    gradient (C long: C is small), and pass 2 receiving twice pass 1's output grads on every step. With the check (the
    default) each step's stays within C, also on the steps between the layout proof's once a checked step has found
    the difference. With CHECK_PASS_TWO = False nothing is compared or scaled (the caller accepts the difference),
    and the steps exceed C: the adversary is real."""
    from ghostdp.clipping import modes, pass_two
    monkeypatch.setattr(pass_two, "CHECK_PASS_TWO", check)
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)  # two passes on every step
    C, steps = 1e-3, 8  # checked: norm passes 1, 2, 4, 8
    batches = [torch.randn(2, D) for _ in range(steps)]
    first_only = torch.tensor([1.0, 0.0])

    def run(on_runs):
        model, losses = _unsteady(wobble=1.0, on_runs=on_runs)
        controller = ghostdp.GhostClipping(model, C, clipping="ghost")
        norms, last_runs = [], set()
        for x in batches:
            model.zero_grad(set_to_none=True)
            controller.loss(losses(x) * first_only, reduction="sum").backward()
            norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
            last_runs.add(Unsteady.runs)  # pass 2's run
        controller.detach()
        return norms, last_runs, controller

    _, pass_two_runs, _ = run(on_runs=set())
    norms, _, controller = run(on_runs=pass_two_runs)
    if check:
        assert max(norms) <= C * (1 + 1e-9) and min(norms) > 0.99 * C, [n / C for n in norms]
        assert controller.step_modes.pass_two_rescaled
    else:
        assert min(norms) > 1.3 * C and not controller.step_modes.pass_two_rescaled  # (layer 0 doubled, 2 not)


def test_the_scaling_is_kept_in_the_saved_state():
    """A resumed run scales its steps as the saved one did (engine.state_dict carries StepModes'); a state saved
    before the scaling existed loads without it."""
    from ghostdp.clipping.modes import CLIPPING_MODES, StepModes
    modes = StepModes(CLIPPING_MODES["ghost"], per_group=False)
    modes.pass_two_rescaled = True
    restored = StepModes(CLIPPING_MODES["ghost"], per_group=False)
    restored.load_state_dict(modes.state_dict())
    assert restored.pass_two_rescaled is True
    old = modes.state_dict()
    del old["pass_two_rescaled"]
    restored.load_state_dict(old)
    assert restored.pass_two_rescaled is False


def test_a_pass_one_whose_pass_two_never_came_is_not_repeated_by_the_next_backward():
    """Pass 1 keeps what pass 2 repeats; a step stopped between them (a refusal) leaves it behind. The next DP loss's
    backward must not repeat it: here an empty Poisson batch's, which runs no pass 1 of its own (it raised an
    internal error before 2026-11-27's fix, reading the old step's calls)."""
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, 2))
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.clip_coefficients(model(torch.randn(3, D)).pow(2).sum(1), pass_two=True)
    assert controller.pass_one.pass_two.pending()
    model.zero_grad(set_to_none=True)
    controller.loss(model(torch.randn(0, D)).pow(2).sum(1)).backward()
    assert not controller.pass_one.pass_two.pending()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
