"""torch.compile'd models: exact, and no errors from recorded calls copied during tracing."""
import gc
import sys
import warnings

import pytest
import torch
from torch import nn

import ghostdp
from conftest import assert_exact


def test_a_compiled_forward_is_exact_and_leaves_no_unraisable_errors(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager")  # dynamo traces the hooks; no C++ compiler needed
    x = torch.randn(5, 4)
    assert_exact(model, lambda: compiled(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), 5)
    controller = ghostdp.GhostClipping(model, 1.0)
    for _ in range(2):
        model.zero_grad()
        controller.loss(compiled(torch.randn(5, 4)).pow(2).sum(1)).backward()
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)))


@pytest.mark.parametrize("compiled_part", ["the model", "a submodule"])
def test_code_compiled_before_attaching_is_refused_with_the_compile_fix(compiled_part):
    """A forward compiled before ghostdp attached runs without the hooks added later (dynamo does not guard on
    them): its layers go unrecorded. The audit refuses that (no call recorded, or gradient outside every recorded
    call); the refusal names torch.compile and the fix, after which the step is exact."""
    torch._dynamo.reset()  # no code compiled by the tests before
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Tanh(), nn.Linear(2, 2))
    if compiled_part == "the model":
        forward = torch.compile(model, backend="eager")
    else:
        model[0].compile(backend="eager")
        forward = model
    x = torch.randn(5, 4)
    forward(x)  # compiled without ghostdp's hooks
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match=r"(no call of a trainable layer|gradient reaches the parameter).*"
                                           r"torch.compile has compiled code.*torch._dynamo.reset\(\)"):
        controller.loss(forward(x).pow(2).sum(1)).backward()
    controller.detach()
    torch._dynamo.reset()
    assert_exact(model, lambda: forward(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), 5)


def test_a_compiled_forward_is_warned_of_once_as_slower_than_eager():
    """ghostdp's hooks break a compiled forward into many small graphs: a compiled private step measured 2.6x
    slower than an eager one (recording.COMPILED_FORWARD). Warned once per controller, never for an eager forward."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    controller = ghostdp.GhostClipping(model, 1.0)

    def warned(forward, steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                controller.loss(forward(torch.randn(5, 4)).pow(2).sum(1)).backward()
        return sum("the model's forward runs under torch.compile" in str(w.message) for w in caught)

    assert warned(model, 2) == 0
    assert warned(torch.compile(model, backend="eager"), 3) == 1
    assert warned(model, 1) == 0
    controller.detach()
