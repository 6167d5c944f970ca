"""The probe on layer outputs: never breaks a producer that saved its output."""
import pytest
import torch
from torch import nn

from conftest import assert_exact


class SavesOutput(torch.autograd.Function):
    """y = exp(x) * w, saving y itself (under no _saved_result name) for its backward."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.exp(x) * w
        ctx.save_for_backward(y, x, w)
        return y

    @staticmethod
    def backward(ctx, g):
        y, x, w = ctx.saved_tensors
        return g * y, (g * torch.exp(x)).sum(0) if g.dim() > 1 else g * torch.exp(x)


class CustomLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return SavesOutput.apply(x, self.w)


def test_a_custom_function_that_saves_its_output_keeps_working_and_is_exact():
    B = 4
    model = nn.Sequential(nn.Linear(3, 3), CustomLayer(), nn.Linear(3, 2))
    x = torch.randn(B, 3)

    def batch_losses():
        return model(x).pow(2).sum(1)

    def example_loss(i):
        return model(x[i:i + 1]).pow(2).sum()

    assert_exact(model, batch_losses, example_loss, B)


@pytest.mark.parametrize("batch_first", [False, True])
def test_float32_lstm_runs_in_both_layouts(batch_first, device):
    # mkldnn's LSTM (CPU) and cuDNN's (--device cuda) save their output for backward (the probe
    # used to mark it dirty).
    torch.set_default_dtype(torch.float32)
    B, T = 3, 4
    lstm = nn.LSTM(5, 6, batch_first=batch_first).to(device)
    head = nn.Linear(6, 1).to(device)
    model = nn.ModuleDict(dict(lstm=lstm, head=head))
    import ghostdp
    controller = ghostdp.GhostClipping(model, 1.0)
    x = torch.randn(B, T, 5) if batch_first else torch.randn(T, B, 5)
    out, _ = lstm(x.to(device))
    last = out[:, -1] if batch_first else out[-1]
    controller.loss(head(last).pow(2).sum(1)).backward()
    assert controller.last_norms.shape == (B,) and lstm.weight_ih_l0.grad is not None
