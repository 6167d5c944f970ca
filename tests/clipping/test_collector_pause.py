"""The cyclic garbage collector is paused in the DP loss's backward and the optimizer step, and restored (collector.py)."""
import gc

import pytest
import torch
from torch import nn

import ghostdp
from ghostdp import collector
from ghostdp.norms import registry


class Scaled(nn.Module):
    """A gain with a norm rule of its own (below) that notes whether the collector runs while the rule runs."""

    def __init__(self, d=3):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x):
        return x * self.weight


COLLECTOR_ON_IN_RULE = []


@pytest.fixture
def scaled_rule():
    from ghostdp.norms.factors import Instantiated

    def rule(module, inputs, grad, names):
        COLLECTOR_ON_IN_RULE.append(gc.isenabled())
        return {"weight": Instantiated(inputs[0] * grad)}

    ghostdp.register_norm_rule(Scaled, rule, params=("weight",))
    COLLECTOR_ON_IN_RULE.clear()
    yield
    registry._RULES.pop(Scaled)


def _private(clipping="ghost"):
    model = Scaled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=4)
    engine = ghostdp.PrivacyEngine(seed=0)
    model, optimizer, _, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                 noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping,
                                                 poisson_sampling=False)
    return model, optimizer, engine


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_the_collector_is_paused_in_the_dp_backward_and_the_step_and_runs_again_after(scaled_rule, clipping):
    model, optimizer, engine = _private(clipping)
    x = torch.randn(4, 3)
    seen_in_step = []
    optimizer.original_optimizer.register_step_pre_hook(lambda *_: seen_in_step.append(gc.isenabled()))
    assert gc.isenabled()
    engine.controller.loss((model(x) ** 2).sum(1)).backward()
    # The rule runs in pass 1, and in ghost's pass 2 (pass 1's backward again, forming the clipped sums).
    assert COLLECTOR_ON_IN_RULE == [False] * (2 if clipping == "ghost" else 1) and gc.isenabled()
    optimizer.step()
    assert seen_in_step == [False] and gc.isenabled()


def test_a_refusal_inside_the_backward_leaves_the_collector_running(scaled_rule):
    model, _, engine = _private()
    x = torch.randn(4, 3)
    loss = engine.controller.loss((model(x) ** 2).sum(1))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated once"):
        loss.backward()
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off_and_the_switch_turns_the_pause_off(scaled_rule, monkeypatch):
    model, optimizer, engine = _private()
    x = torch.randn(4, 3)
    gc.disable()
    try:
        engine.controller.loss((model(x) ** 2).sum(1)).backward()
        optimizer.step()
        assert not gc.isenabled()
    finally:
        gc.enable()
    optimizer.zero_grad()
    monkeypatch.setattr(collector, "PAUSE", False)
    engine.controller.loss((model(x) ** 2).sum(1)).backward()
    # Passes 1 and 2 of the first step; the second's one or two (it may take book-keeping's one backward: modes.py).
    assert COLLECTOR_ON_IN_RULE[:2] == [False, False] and COLLECTOR_ON_IN_RULE[2:] and all(COLLECTOR_ON_IN_RULE[2:])


class NotesCollector(nn.Module):
    """Scaled, noting in its forward whether the collector runs, and raising there when asked to."""

    def __init__(self):
        super().__init__()
        self.scaled = Scaled()
        self.seen, self.fail = [], False

    def forward(self, x):
        self.seen.append(gc.isenabled())
        if self.fail:
            raise ValueError("the model's own error")
        return self.scaled(x)


def test_the_collector_is_paused_through_a_training_forward_only_and_runs_again_after_one_that_raised(scaled_rule):
    model = NotesCollector()
    ghostdp.GhostClipping(model, max_grad_norm=1.0)
    x = torch.randn(4, 3)

    def seen_in(forward):
        model.seen.clear()
        forward()
        return set(model.seen)  # the forward check's reruns on a proof step run the forward too

    assert seen_in(lambda: model(x)) == {False} and gc.isenabled()
    with torch.no_grad():
        assert seen_in(lambda: model(x)) == {True}  # no training forward: nothing recorded, nothing paused
    model.eval()
    assert seen_in(lambda: model(x)) == {True}
    model.train()
    model.fail = True
    with pytest.raises(ValueError, match="the model's own error"):
        model(x)
    assert model.seen[-1] is False and gc.isenabled()
    model.fail = False
    gc.disable()  # a collector the caller turned off stays off
    try:
        model(x)
        assert not gc.isenabled()
    finally:
        gc.enable()
