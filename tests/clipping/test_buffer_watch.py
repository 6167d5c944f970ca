"""Buffers that a training forward changes are released without noise: one warning each (clipping/buffers.py)."""
import warnings

import pytest
import torch
import transformers
from torch import nn

import ghostdp


class RunningCenter(nn.Module):
    """Centres its input with a running mean of the earlier batches, then adds the batch's to it: a statistic of
    the data in a buffer. (Centring on a mean that holds the batch itself mixes its examples: independence.py.)"""

    def __init__(self, replace=False):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.replace = replace

    def forward(self, x):
        out = x - self.mean.clone()
        if self.training:
            with torch.no_grad():
                if self.replace:  # a new tensor in the buffer's place
                    self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
                else:
                    self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return out


def _steps(model, controller, n=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            controller.loss(model(torch.randn(8, 4)).pow(2).sum(1)).backward()
    return [w for w in caught if "buffer" in str(w.message)]


@pytest.mark.parametrize("replace", [False, True])
def test_a_running_statistic_in_a_buffer_is_warned_of_once_at_the_model_call(replace):
    model = nn.Sequential(RunningCenter(replace), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    caught = _steps(model, controller)
    assert len(caught) == 1
    assert "buffer '0.mean' changed during a training forward" in str(caught[0].message)
    assert caught[0].filename == __file__


def test_eval_forwards_and_detached_models_are_not_watched():
    model = nn.Sequential(RunningCenter(), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(8, 4))
    assert not caught
    controller.detach()
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(8, 4))
    assert not caught


def test_bert_whose_buffers_never_change_is_not_warned_of():
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=24)
    model = transformers.BertForSequenceClassification(config).train()
    assert len(list(model.buffers())) > 0
    controller = ghostdp.GhostClipping(model, 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            logits = model(input_ids=torch.randint(0, 50, (4, 6))).logits
            controller.loss(logits.pow(2).sum(1)).backward()
    assert not [w for w in caught if "buffer" in str(w.message)]


class RenormalisedLookup(nn.Module):
    """Looks its rows up with F.embedding's max_norm, which renormalises them in place (the model check knows
    nn.Embedding's option; a functional call it cannot see)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(3 * torch.randn(10, 4))

    def forward(self, ids):
        return nn.functional.embedding(ids, self.table, max_norm=1.0).sum(1)


class ClampedInForward(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


class ReplacedInForward(nn.Linear):
    def forward(self, x):
        self.weight = nn.Parameter(self.weight.detach() * 0.5)
        return super().forward(x)


# Where the forward check runs (a checked step), its reruns change the parameter first and are refused for it
# (independence.py, CHANGED_BY_A_RERUN); on other steps the training forward is.
CHANGED_IN_PLACE = {True: r"changed parameter\(s\) '{name}' in place \(or replaced them\) while ghostdp's forward "
                          r"check reran",
                    False: r"parameter '{name}' was changed in place during a training forward"}


@pytest.mark.parametrize("checked", [True, False], ids=["checked step", "unchecked step"])
@pytest.mark.parametrize("layer", [RenormalisedLookup, ClampedInForward, ReplacedInForward])
def test_a_parameter_changed_during_a_training_forward_is_refused(layer, checked):
    if layer is RenormalisedLookup:
        model, batch = RenormalisedLookup(), torch.tensor([[1, 2], [3, 3]])
    else:
        model, batch = nn.Sequential(layer(4, 4), nn.Linear(4, 2)), torch.randn(8, 4)
    model.train()
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.independence.every = 1 if checked else 0
    name = "table" if layer is RenormalisedLookup else r"0\.weight"
    expected = CHANGED_IN_PLACE[checked].format(name=name)
    with pytest.raises(RuntimeError, match=expected):
        model(batch)
    model.eval()
    model(batch)  # not a training forward: nothing is released from it


@pytest.mark.parametrize("checked", [True, False], ids=["checked step", "unchecked step"])
def test_frozen_parameters_are_watched_too(checked):
    model = nn.Sequential(ClampedInForward(4, 4).requires_grad_(False), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.independence.every = 1 if checked else 0
    with pytest.raises(RuntimeError, match=CHANGED_IN_PLACE[checked].format(name=r"0\.weight")):
        model(torch.randn(8, 4))


class LazyStatistic(nn.Module):
    """A buffer registered as None and set from the batch in the first training forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", None)

    def forward(self, x):
        if self.training:
            self.mean = x.mean(0).detach()
        return x


def test_a_buffer_registered_as_none_and_set_from_the_batch_is_warned_of():
    model = nn.Sequential(LazyStatistic(), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    caught = _steps(model, controller)
    assert len(caught) == 1 and "buffer '0.mean' changed during a training forward" in str(caught[0].message)


class _Tripled(nn.Module):
    def forward(self, weight):
        return 3 * weight


@pytest.mark.parametrize("change", ["parametrization", "deleted bias"])
def test_a_parameter_removed_after_attaching_is_refused_by_name(change):
    """A parametrization registered after attaching moves the weight into a new submodule: the watch read the
    missing tensor's version and crashed with an AttributeError (before 2026-11-26); it names it and the fix now."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    if change == "parametrization":
        torch.nn.utils.parametrize.register_parametrization(model[2], "weight", _Tripled())
        name = "2.weight"
    else:
        model[2].bias = None
        name = "2.bias"
    with pytest.raises(RuntimeError, match=f"parameter '{name}' is no longer a parameter of its module.*Fix: change "
                                           "the model before make_private"):
        model(torch.randn(8, 4))
    controller.detach()


def test_a_buffer_set_to_none_after_attaching_is_not_a_crash():
    model = nn.Sequential(RunningCenter(), nn.Linear(4, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0)
    model[0].mean = None
    model[0].forward = lambda x: x  # its forward no longer reads it
    controller.loss(model(torch.randn(8, 4)).pow(2).sum(1)).backward()
    assert model[1].weight.grad is not None
    controller.detach()
