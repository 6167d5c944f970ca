"""DPOptimizer (ghostdp/optim.py): the host reads of a step, which on a GPU each wait for the device."""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ghostdp
from ghostdp.clipping.layout import proof_scheduled


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host: aten._local_scalar_dense (``item()``, ``float()``, ``bool()``
    of a tensor) and ``Tensor.tolist`` (counted by ``count_tolist``), each a host sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def count_tolist(self, monkeypatch):
        tolist = torch.Tensor.tolist

        def counted(tensor):
            self.count += 1
            return tolist(tensor)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)


def private_mlp(clipping):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    data = torch.utils.data.TensorDataset(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping,
        poisson_sampling=False)

    def step(batches=None):  # ``batches``: an iterator of the loader, started before (starting one draws a seed)
        for x, y in batches or loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    return step, loader, engine.controller.pass_one.layouts


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_step_between_layout_proofs_reads_the_device_twice(monkeypatch, clipping):
    """The clip coefficients' check for non-finite or imprecise examples reads one flag after pass 1, and the
    optimizer's pre-step reads the loss scales and the gradients' norm (the finite check) together: two reads a
    step. The pre-step read them one after the other before 2026-12-01 (three reads, the last one with a GPU that
    had gone idle)."""
    step, loader, layouts = private_mlp(clipping)
    reads = HostReads()
    with reads:  # autograd records some ops with other node types under a dispatch mode: a graph to prove anew
        step()
        while proof_scheduled(layouts.passes, layouts.reproof_every):
            step()
        batches = iter(loader)
        batches = itertools.chain([next(batches)], batches)  # its first batch drawn: its generator has started
        reads.count = 0
        reads.count_tolist(monkeypatch)
        step(batches)
    assert reads.count == 2


def test_a_gradient_changed_after_backward_is_still_refused_by_the_one_read():
    """The finite check's norm, read with the loss scales, still refuses a p.grad scaled up after backward()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    model.weight.grad.mul_(1e3)
    with pytest.raises(ghostdp.optim.PrivacyStepError, match="more than the clipped gradients"):
        optimizer.step()
