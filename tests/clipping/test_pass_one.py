"""Pass 1 computes activation gradients only: no weight gradient is ever formed."""
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ghostdp
from conftest import without_forward_checks


class OutputShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def make():
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 13), nn.Tanh(), nn.Linear(13, 5))
    x = torch.randn(3, 2, 7)
    return model, x


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear")


def weight_shaped(shapes, model):
    """Matrix products whose result has a weight's shape: a weight gradient being formed."""
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    return [(f, s) for f, s in shapes if s in weights and f.startswith(MATMULS)]


def test_pass_one_forms_no_weight_gradient():
    model, x = make()
    controller = ghostdp.GhostClipping(model, 1.0)
    losses = model(x).pow(2).sum((1, 2))
    with OutputShapes() as mode:
        norms = controller.per_example_norms(losses)
    assert norms.shape == (3,) and torch.all(norms > 0)
    assert weight_shaped(mode.shapes, model) == []
    assert all(p.grad is None for p in model.parameters())


def test_the_detector_sees_weight_gradients_of_an_ordinary_backward():
    model, x = make()
    with OutputShapes() as mode:
        model(x).pow(2).sum().backward()
    assert len(weight_shaped(mode.shapes, model)) >= 3


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_probe_copies_no_layer_output():
    # A Linear layer on (B, T, d) returns a view of its matmul result; the probe must attach without a copy.
    model = nn.Sequential(nn.Linear(7, 11), nn.ReLU(inplace=True), nn.LayerNorm(11), nn.Linear(11, 5))
    x = torch.randn(3, 4, 7)
    controller = without_forward_checks(ghostdp.GhostClipping(model, 1.0))  # its reruns copy the batch
    with OpNames() as mode:
        out = model(x)
    assert out.shape == (3, 4, 5)
    copies = [n for n in mode.names if n.startswith(("aten.clone", "aten.copy"))]
    assert copies == [], copies
    controller.detach()


def test_norms_read_outside_a_backward_hold_no_graph():
    """controller.per_example_norms / clip_coefficients called by a user (grad mode on): the norms are formed
    from the layers' inputs, which require grad; before, the norms carried their graph (the activations held
    as long as the norms, and float() of one warned)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    controller = ghostdp.GhostClipping(model, 1.0)
    assert not controller.per_example_norms(model(torch.randn(5, 3)).sum(1)).requires_grad
    assert not controller.clip_coefficients(model(torch.randn(5, 3)).sum(1)).requires_grad
