"""Per-example gradients on demand (``controller.grad_samples()``): p.grad_sample equals autograd's
per-example gradient in float64 for every norm rule, shared parameters and the fallback, in both
clipping modes, without changing the clipped sum; bounded in memory; misuse refused."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers.pytorch_utils import Conv1D

import ghostdp
from conftest import CLIPPING_MODES, Scale, clipped_sum, reference_per_example_grads, trainable

B, T, V, H = 5, 6, 13, 8


class EveryRule(torch.nn.Module):
    """One layer of every rule family: Embedding (with padding_idx), Linear on tokens and on vectors,
    a Linear called twice (shared weights), transformers' Conv1D, Conv1d, Conv2d, LayerNorm, RMSNorm,
    GroupNorm, and a module that falls back."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H, padding_idx=0)
        self.shared = torch.nn.Linear(H, H)
        self.conv1d_hf = Conv1D(H, H)
        self.conv1d = torch.nn.Conv1d(H, H, kernel_size=3, padding=1)
        self.conv2d = torch.nn.Conv2d(1, 2, kernel_size=3, padding=1)
        self.layer_norm = torch.nn.LayerNorm(H)
        self.rms_norm = torch.nn.RMSNorm(H)
        self.group_norm = torch.nn.GroupNorm(2, H)
        self.scale = Scale(H)
        self.head = torch.nn.Linear(H, 3)

    def forward(self, ids):
        h = torch.tanh(self.shared(self.emb(ids)))                        # (B, T, H)
        h = self.layer_norm(self.conv1d_hf(self.shared(h)))
        h = self.conv1d(h.transpose(1, 2))                                 # (B, H, T)
        h = self.group_norm(h).transpose(1, 2)
        h = h + self.conv2d(h.unsqueeze(1)).mean(1)
        h = self.scale(self.rms_norm(h))
        return self.head(h.mean(1))


def data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :2] = 0  # padding tokens
    return ids, torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_grad_samples_equal_autograd_per_example_gradients_for_every_rule(clipping):
    torch.manual_seed(0)
    model = EveryRule()
    ids, labels = data()
    per_example = reference_per_example_grads(
        model, lambda i: torch.nn.functional.cross_entropy(model(ids[i:i + 1]), labels[i:i + 1]), B)
    C = 0.5 * float(clipped_sum(per_example, 1.0)[1].min())
    ref_sum, _ = clipped_sum(per_example, C)
    controller = ghostdp.GhostClipping(model, C, clipping=clipping)
    with controller.grad_samples():
        losses = torch.nn.functional.cross_entropy(model(ids), labels, reduction="none")
        controller.loss(losses, reduction="sum").backward()
    for name, p in trainable(model):
        want = torch.stack([g[name] for g in per_example])
        assert p.grad_sample.shape == (B, *p.shape) and p.grad_sample.dtype == p.dtype
        torch.testing.assert_close(p.grad_sample, want, rtol=1e-10, atol=1e-14, msg=name)
        torch.testing.assert_close(p.grad, ref_sum[name], rtol=1e-10, atol=1e-14, msg=name)  # unchanged
    # Outside the block the next backward computes none, and leaves the last ones alone.
    model.zero_grad()
    controller.loss(torch.nn.functional.cross_entropy(model(ids[:2]), labels[:2], reduction="none")).backward()
    assert model.head.weight.grad_sample.shape[0] == B


def test_grad_samples_of_chosen_parameters_through_the_engine_and_the_memory_bound():
    torch.manual_seed(0)
    model = EveryRule()
    ids, labels = data()
    engine = ghostdp.PrivacyEngine(seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, labels), batch_size=B), criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    x, y = next(iter(loader))
    with engine.controller.grad_samples(params=[model.head.weight, model.emb.weight]):
        criterion(model(x), y).backward()
    assert model.head.weight.grad_sample.shape == (B, 3, H) and model.emb.weight.grad_sample.shape == (B, V, H)
    assert getattr(model.shared.weight, "grad_sample", None) is None
    torch.testing.assert_close(model.emb.weight.grad_sample[:, 0], torch.zeros(B, H))  # padding_idx row
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(ValueError, match=r"would hold .* MiB .* above max_bytes=100"):
        with engine.controller.grad_samples(max_bytes=100):
            criterion(model(x), y).backward()
    with pytest.raises(ValueError, match="not parameters of the private model"):
        with engine.controller.grad_samples(params=[torch.nn.Parameter(torch.zeros(2))]):
            pass
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        with engine.controller.grad_samples(max_bytes=0):
            pass


def test_grad_samples_of_a_parameter_unused_this_step_are_none():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    controller = ghostdp.GhostClipping(model, 1.0)
    x = torch.randn(4, 3)
    with controller.grad_samples():
        controller.loss(model["used"](x).pow(2).sum(1)).backward()
    assert model["used"].weight.grad_sample.shape == (4, 2, 3)
    assert model["unused"].weight.grad_sample is None
