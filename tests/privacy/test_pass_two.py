"""Pass 2 of two passes repeats pass 1's backward (pass_two.py): each layer's clipped sum reads the output
grads its norm was formed from, bit for bit, so that an example whose gradient is mostly float32 rounding still
moves the clipped sum by at most C."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ghostdp
import test_sensitivity_audit as audit
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


class Unsteady(torch.autograd.Function):
    """The identity, whose backward scales its gradient by 1 + ``wobble`` on every second run: a kernel that does not
    give the same result twice (a GPU's atomics), between pass 1 (its second run: the layout proof is the first) and
    pass 2 (its third)."""
    runs = 0
    wobble = 1e-6

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Unsteady.runs += 1
        return grad * (1 + Unsteady.wobble * (Unsteady.runs % 2))


def _unsteady(wobble=1e-6, checkpointed=False):
    """A model whose middle backward is Unsteady, and a function of its per-example losses on a batch."""
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D))
    Unsteady.runs, Unsteady.wobble = 0, wobble

    def losses(x):
        hidden = model[1](model[0](x))
        if checkpointed:
            hidden = checkpoint(lambda h: model[1](model[0](h)), x, use_reentrant=False)
        return model[2](Unsteady.apply(hidden)).pow(2).sum(1)
    return model, losses


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _clipped_sum_by_loop(model, losses, x, C):
    """sum_i min(1, C / |g_i|) g_i, from each example's own backward (float64)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(losses(x[i:i + 1]).sum(), list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, C / (float(norm) + 1e-6))
    return total


@pytest.mark.parametrize("check", [True, False])
def test_a_backward_that_differs_between_the_passes_drops_the_step_and_takes_bookkeeping(check, monkeypatch):
    """A checked step whose passes' output grads differ writes none of its clipped sums, warns (naming the module, how
    far its output grads moved, what was dropped and the fix), and the next steps take book-keeping's one backward,
    whose clipped sums equal the per-example loop's. With the check off the step runs (the caller accepts the
    difference) and the mode stays (this model keeps little: its steps would take book-keeping for that too)."""
    from ghostdp.clipping import modes, pass_two
    monkeypatch.setattr(pass_two, "CHECK_PASS_TWO", check)
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)
    model, losses = _unsteady()
    x = torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    if check:
        with pytest.warns(UserWarning, match=r"module '0' received different ones.*differs by 2e-06 of itself.*"
                                             r"clipped gradients were dropped.*counts its privacy.*book-keeping.*"
                                             r"use_deterministic_algorithms") as caught:
            controller.loss(losses(x), reduction="sum").backward()
        assert caught[0].filename == __file__  # the line that called backward()
        assert all(p.grad is None for p in model.parameters())
        assert controller.mode_for_loss().name == "bookkeeping" and controller.step_modes.pass_two_differs
    else:
        controller.loss(losses(x), reduction="sum").backward()
        assert model[0].weight.grad is not None and controller.mode_for_loss().name == "ghost"
    assert Unsteady.runs == 3  # the layout proof, pass 1, pass 2
    if check:
        model.zero_grad(set_to_none=True)
        Unsteady.wobble = 0.0
        x = torch.randn(B, D)
        controller.loss(losses(x), reduction="sum").backward()
        controller.detach()
        for p, expected in zip(model.parameters(), _clipped_sum_by_loop(model, losses, x, 1.0)):
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12)


def test_a_dropped_step_leaves_the_gradients_of_earlier_backwards_as_they_were(monkeypatch):
    """Gradient accumulation: the second backward (a checked step: norm passes 1, 2, 4, ...) differs; p.grad keeps the
    first backward's clipped sums, bit for bit (pass 2's sums and the fallback's are held until the check)."""
    from ghostdp.clipping import modes
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)  # two passes at the second step
    model, losses = _unsteady(wobble=0.0)
    model.append(torch.nn.PReLU())  # no norm rule: its clipped sum comes from the fallback, before pass 2 (on -L_i < 0)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    controller.loss(model[3](-losses(torch.randn(B, D))), reduction="sum").backward()
    first = _grads(model)
    assert all(g is not None and g.any() for g in first)
    Unsteady.wobble = 1e-6
    with pytest.warns(UserWarning, match="dropped"):
        controller.loss(model[3](-losses(torch.randn(B, D))), reduction="sum").backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(first, model.parameters()))
    controller.detach()


def test_a_checkpointed_step_whose_passes_differ_is_refused_without_writing_its_sums():
    """Under activation checkpointing book-keeping takes two passes too: the step is refused, and says that the fix
    is deterministic kernels (not clipping='bookkeeping'); nothing was written. BOOKKEEPING_WHERE_PASS_TWO_DIFFERS
    = False refuses without a checkpoint, naming book-keeping as a fix."""
    model, losses = _unsteady(checkpointed=True)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    with pytest.raises(RuntimeError, match=r"module '.*' received different ones.*None of this step's clipped sums "
                                           r"was written.*use_deterministic_algorithms.*'bookkeeping' takes two passes "
                                           r"under activation checkpointing too"):
        controller.loss(losses(torch.randn(B, D)), reduction="sum").backward()
    assert all(p.grad is None for p in model.parameters()) and not controller.step_modes.pass_two_differs
    controller.detach()


def test_without_the_switch_a_backward_that_differs_is_refused(monkeypatch):
    from ghostdp.clipping import modes
    monkeypatch.setattr(modes, "BOOKKEEPING_WHERE_PASS_TWO_DIFFERS", False)
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)
    model, losses = _unsteady()
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    with pytest.raises(RuntimeError, match=r"module '0' received different ones.*None of this step's clipped sums "
                                           r"was written.*use_deterministic_algorithms.*clipping='bookkeeping'"):
        controller.loss(losses(torch.randn(B, D)), reduction="sum").backward()
    assert all(p.grad is None for p in model.parameters()) and controller.mode_for_loss().name == "ghost"
    controller.detach()


def test_the_switch_is_kept_in_the_saved_state_and_agreed_between_processes():
    """A resumed run keeps book-keeping; with several processes a rank's finding rides on the optimizer's all-reduce
    (the largest of each rank's measures) and every rank switches at the same step."""
    from ghostdp.clipping.modes import StepModes, CLIPPING_MODES
    modes = StepModes(CLIPPING_MODES["ghost"], per_group=False)
    assert modes.local_measure()[2] == 0.0
    modes.pass_two_differs = True
    restored = StepModes(CLIPPING_MODES["ghost"], per_group=False)
    restored.load_state_dict(modes.state_dict())
    assert restored.for_loss(lambda: False, False, lambda: False).name == "bookkeeping"
    assert restored.for_loss(lambda: True, False, lambda: False).name == "ghost"  # under a checkpoint
    assert restored.for_loss(lambda: False, False, lambda: True).name == "ghost"  # FSDP2-sharded parameters
    other = StepModes(CLIPPING_MODES["ghost"], per_group=False)
    assert other.for_loss(lambda: False, True, lambda: False).name == "ghost"
    assert restored.for_loss(lambda: False, True, lambda: False).name == "ghost"  # not agreed yet
    largest = tuple(max(a, b) for a, b in zip(restored.local_measure(), other.local_measure()))
    for rank in (restored, other):
        rank.agree(largest)
        assert rank.for_loss(lambda: False, True, lambda: False).name == "bookkeeping"
    old = restored.state_dict()
    del old["pass_two_differs"], old["agreed_pass_two_differs"]  # saved before the switch existed
    restored.load_state_dict(old)
    assert restored.for_loss(lambda: False, False, lambda: False).name == "ghost"


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


def test_a_private_training_loop_goes_on_past_a_dropped_step(monkeypatch):
    """make_private and its DP optimizer: the dropped step adds noise and is accounted; later steps train."""
    from ghostdp.clipping import modes
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)
    model, losses = _unsteady()
    data = torch.utils.data.TensorDataset(torch.randn(16, D))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping="ghost")
    before = [p.detach().clone() for p in model.parameters()]
    steps = 0
    with pytest.warns(UserWarning, match="dropped") as caught:
        for (x,) in loader:
            optimizer.zero_grad(set_to_none=True)
            engine.controller.loss(losses(x)).backward()
            optimizer.step()
            steps += 1
    assert len([w for w in caught if "dropped" in str(w.message)]) == 1
    assert engine.controller.mode_for_loss().name == "bookkeeping"
    assert engine.accountant.steps == steps and steps >= 2
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
