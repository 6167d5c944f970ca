"""Every gradient path into a parameter of a module without a rule is counted by one call (clipping/fallback_paths.py).

The fallback takes a call's per-example gradients by a VJP from the outputs its forward returned, with the
output grads taken there. A tensor that the forward keeps (on the module) and that is used after the forward
opens other paths into the call: a state handed back to the module was counted twice (the norm 23 times too
small below); a kept tensor read by the parent was counted by no call. The first is now exact, the second refused.
"""
import pytest
import torch
from torch import nn

import ghostdp
from conftest import CLIPPING_MODES, Gain, HandsStateBack, assert_exact, fallback_gain

SEED = 1295  # an example whose two parts nearly cancel (a search over seeds)
UNCOUNTED = "does not go through the outputs its forward returned"


class KeepsLast(Gain):
    """A gain that keeps its last output on itself (``self.last``)."""

    def forward(self, x):
        self.last = fallback_gain(x, self.weight)
        return self.last


class ReadsOwnState(nn.Module):
    """The module reads back, in its next call, the output it kept: that call's VJP counts the path."""

    def __init__(self, d=3):
        super().__init__()
        self.gain = KeepsLast(d)

    def forward(self, x):
        h = self.gain(x)
        return self.gain(torch.tanh(h)) + 0.5 * h


class OwnStateGain(Gain):
    def forward(self, x):
        y = fallback_gain(x, self.weight)
        if getattr(self, "previous", None) is not None:
            y = y + self.previous
        self.previous = y
        return y


def _handed_back_example():
    """The model and one example whose gain gradient the double count shrank 23-fold (checked, so that the test
    cannot pass vacuously: without the stop, the second call's VJP adds the first call's part once more)."""
    model = HandsStateBack().double()
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.gain.weight.copy_(torch.randn(2, dtype=torch.float64))
        model.mix.weight.copy_(torch.randn(2, 2, dtype=torch.float64))
    x = torch.randn(1, 2, dtype=torch.float64)
    true, = torch.autograd.grad(model(x).sum(), model.gain.weight)
    counted_twice = true + x[0]  # the state's path (d out / d state = 1) once more: x of the first call's use
    assert float(true.norm() / counted_twice.norm()) > 10, "degenerate test: the two parts do not cancel"
    return model, x, true


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_one_example_through_a_state_handed_back_moves_the_sum_by_at_most_C(clipping):
    model, x, true = _handed_back_example()
    C = 1e-3 * float(true.norm())
    controller = ghostdp.GhostClipping(model, C, clipping=clipping)
    controller.loss(model(x).sum(1), reduction="sum").backward()
    torch.testing.assert_close(controller.last_norms, true.norm().reshape(1), rtol=1e-12, atol=0)
    assert float(model.gain.weight.grad.norm()) <= C * (1 + 1e-9)  # before: 23 C


def test_a_state_handed_back_to_a_module_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(HandsStateBack(3), nn.Linear(3, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), 5)


@pytest.mark.parametrize("model_class", [ReadsOwnState, lambda: nn.Sequential(OwnStateGain(3), nn.Tanh(), OwnStateGain(3))])
def test_a_module_reading_back_what_it_kept_stays_exact(model_class):
    torch.manual_seed(0)
    model = model_class().double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def losses(batch):
        for m in model.modules():
            m.previous = None
        return model(batch).pow(2).sum(1)

    assert_exact(model, lambda: losses(x), lambda i: losses(x[i:i + 1]).sum(), 4)


class ParentReadsKept(nn.Module):
    """The parent reads the module's kept output instead of the one it returned (the same values, another
    tensor: the path through it passes none of the module's outputs)."""

    def __init__(self, d=3):
        super().__init__()
        self.gain = KeepsLast(d)
        self.mix = nn.Linear(d, d).requires_grad_(False)

    def forward(self, x):
        h = self.gain(x)
        return self.gain(torch.tanh(self.mix(self.gain.last))) + 0.1 * h


class LossReadsKept(nn.Module):
    def __init__(self, d=3):
        super().__init__()
        self.gain = KeepsLast(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.gain(x)) + self.gain.last[:, :2] ** 2


class KeepsInterior(nn.Module):
    """A module without a rule that keeps an intermediate it does not return."""

    def __init__(self, d=3):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x):
        self.interior = fallback_gain(x, self.weight)
        return torch.tanh(self.interior)


class ParentWithoutRuleReadsChild(nn.Module):
    """A module without a rule reads its child's kept tensor: the path passes the parent's outputs, which
    count only the parent's own parameters."""

    def __init__(self, d=3):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.child = KeepsInterior(d)

    def forward(self, x):
        return fallback_gain(self.child(x), self.scale) + self.child.interior


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("model_class", [ParentReadsKept, LossReadsKept, ParentWithoutRuleReadsChild])
def test_a_path_past_every_output_of_a_module_without_a_rule_is_refused(model_class, clipping):
    torch.manual_seed(0)
    model = model_class()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    with pytest.raises(RuntimeError, match=UNCOUNTED):
        controller.loss(model(torch.randn(4, 3)).sum(1)).backward()
    assert all(p.grad is None for p in model.parameters())


class TiedHead(nn.Module):
    """An output layer without a rule that shares the embedding's table (tied weights)."""

    def __init__(self, embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h):
        return h @ self.weight.T


def test_weights_tied_between_a_ruled_module_and_one_without_a_rule_stay_exact():
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 4)
    model = nn.Sequential(embedding, nn.Tanh(), nn.Linear(4, 4), TiedHead(embedding)).double()
    ids = torch.randint(0, 7, (5, 3))
    assert_exact(model, lambda: model(ids).pow(2).sum((1, 2)), lambda i: model(ids[i:i + 1]).pow(2).sum(), 5)
