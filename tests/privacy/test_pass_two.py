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
def test_a_backward_that_differs_between_the_passes_is_refused_on_checked_steps(check, monkeypatch):
    """The refusal names the module, how far its output grads moved and the fixes, and none of the step's clipped sums
    is written; the fix it names (book-keeping) then gives the per-example loop's clipped sums. With the check off the
    step runs (the caller accepts the difference)."""
    from ghostdp.clipping import pass_two
    monkeypatch.setattr(pass_two, "CHECK_PASS_TWO", check)
    model, losses = _unsteady()
    x = torch.randn(B, D)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    if check:
        with pytest.raises(RuntimeError, match=r"module '0' received different ones.*differs by 2e-06 of itself.*"
                                               r"None of this step's clipped sums was written\. Fix: "
                                               r"torch.use_deterministic_algorithms.*clipping='bookkeeping'"):
            controller.loss(losses(x), reduction="sum").backward()
        assert all(p.grad is None for p in model.parameters())
    else:
        controller.loss(losses(x), reduction="sum").backward()
        assert model[0].weight.grad is not None
    assert Unsteady.runs == 3  # the layout proof, pass 1, pass 2
    controller.detach()
    if check:
        controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
        controller.loss(losses(x), reduction="sum").backward()  # Unsteady still differs between runs
        controller.detach()
        Unsteady.wobble = 0.0
        for p, expected in zip(model.parameters(), _clipped_sum_by_loop(model, losses, x, 1.0)):
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-8)  # (book-keeping read G once)


def test_a_refused_step_leaves_the_gradients_of_earlier_backwards_as_they_were(monkeypatch):
    """Gradient accumulation: the second backward (a checked step: norm passes 1, 2, 4, ...) differs; p.grad keeps the
    first backward's clipped sums, bit for bit (pass 2's sums and the fallback's are held until the check: before,
    the refusal came after they were written)."""
    from ghostdp.clipping import modes
    monkeypatch.setattr(modes, "ONE_BACKWARD_WHERE_KEEPING_LITTLE", False)  # two passes at the second step
    model, losses = _unsteady(wobble=0.0)
    model.append(torch.nn.PReLU())  # no norm rule: its clipped sum comes from the fallback, before pass 2 (on -L_i < 0)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    controller.loss(model[3](-losses(torch.randn(B, D))), reduction="sum").backward()
    first = _grads(model)
    assert all(g is not None and g.any() for g in first)
    Unsteady.wobble = 1e-6
    with pytest.raises(RuntimeError, match="None of this step's clipped sums was written"):
        controller.loss(model[3](-losses(torch.randn(B, D))), reduction="sum").backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(first, model.parameters()))
    controller.detach()


def test_a_checkpointed_step_whose_passes_differ_is_refused_with_the_fix_that_works_there():
    """Under activation checkpointing book-keeping takes two passes too: the refusal names deterministic kernels as
    the fix, not clipping='bookkeeping'; nothing was written."""
    model, losses = _unsteady(checkpointed=True)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="ghost")
    with pytest.raises(RuntimeError, match=r"module '.*' received different ones.*None of this step's clipped sums "
                                           r"was written\. Fix: torch.use_deterministic_algorithms.*; "
                                           r"clipping='bookkeeping' takes two passes under activation checkpointing"):
        controller.loss(losses(torch.randn(B, D)), reduction="sum").backward()
    assert all(p.grad is None for p in model.parameters())
    controller.detach()


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
