"""Linear layers on degenerate inputs."""
import torch
from torch import nn

import ghostdp


def test_a_zero_length_sequence_has_norm_zero_in_both_modes():
    for clipping in ("ghost", "bookkeeping"):
        lin = nn.Linear(3, 2)
        controller = ghostdp.GhostClipping(lin, 1.0, clipping=clipping)
        controller.loss(lin(torch.randn(4, 0, 3)).sum((1, 2)), reduction="sum").backward()
        assert torch.equal(controller.last_norms, torch.zeros(4, dtype=torch.float64))
        assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
        controller.detach()


def test_a_zero_length_sequence_next_to_ordinary_tokens_adds_nothing():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1e6)
    x = torch.randn(4, 5, 3)
    controller.loss(lin(x).sum((1, 2)) + lin(x[:, :0]).sum((1, 2)), reduction="sum").backward()
    with_empty = controller.last_norms.clone()
    lin.zero_grad()
    controller.loss(lin(x).sum((1, 2)), reduction="sum").backward()
    torch.testing.assert_close(with_empty, controller.last_norms)
