"""torch.compile'd models: exact, and no errors from recorded calls copied during tracing."""
import gc
import sys

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
