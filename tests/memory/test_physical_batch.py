"""max_physical_batch_size="auto": the largest physical batch whose private step fits, found by real
steps that leave no state behind, with the logical batch and the accounting unchanged."""
import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ghostdp import PrivacyEngine

N, D = 60, 6


class FitsUpTo(torch.nn.Module):
    """A model whose forward runs out of memory above ``limit`` examples, as a GPU would."""

    def __init__(self, limit, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.limit = limit
        self.net = torch.nn.Sequential(torch.nn.Linear(D, width), torch.nn.Dropout(0.2), torch.nn.Linear(width, 3))

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"out of memory: {x.shape[0]} examples")
        return self.net(x)


def data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, 3, (N,), generator=g))


def private(model, physical, **kwargs):
    engine = PrivacyEngine(seed=2)
    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=30), criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, max_physical_batch_size=physical, **kwargs)
    return engine, model, optimizer, criterion, loader


def train(model, optimizer, criterion, loader, steps):
    done = 0
    while True:
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            done += optimizer.last_step_taken
            if done == steps:
                return


def test_the_search_finds_the_largest_batch_that_fits_and_leaves_no_state(caplog):
    model = FitsUpTo(7)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        engine, model, optimizer, criterion, loader = private(model, "auto", memory_budget_mb=1e6)
    assert loader.max_physical_batch_size == 7
    assert "max_physical_batch_size='auto' chose 7" in caplog.text
    assert all(p.grad is None for p in model.parameters())
    assert engine.accountant.steps == 0 and engine.controller.ledger.records == []
    # The probes' measures of what book-keeping keeps left no trace: the first training step takes the configured
    # mode, as without the search (this model keeps about what its graph saves: its later steps take one backward).
    assert engine.controller.step_modes.kept_of_saved is None and engine.controller.step_modes.kept_fraction is None
    assert torch.equal(torch.get_rng_state(), rng)  # the probes' dropout masks left no trace
    assert optimizer.sample_rate == 0.5 and optimizer.expected_batch_size == 30
    train(model, optimizer, criterion, loader, steps=3)

    reference = FitsUpTo(7)
    torch.manual_seed(5)
    _, reference, ref_optimizer, ref_criterion, ref_loader = private(reference, 7)
    train(reference, ref_optimizer, ref_criterion, ref_loader, steps=3)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert engine.accountant.history == [[1.0, 0.5, 3]]


def test_every_probe_of_the_search_takes_the_layout_proof_that_training_repeats_on_a_schedule(monkeypatch):
    """Training proves the layouts again at passes 1, 2, 4, ... (clipping/layout.py), a backward more: the
    chosen batch must fit those steps too, so each probe that runs its step proves."""
    from ghostdp.clipping.pass_one import PassOne
    proofs, forwards = [], []
    prove = PassOne._prove_layouts
    monkeypatch.setattr(PassOne, "_prove_layouts", lambda self, *a: (proofs.append(1), prove(self, *a)))
    model = FitsUpTo(7)
    model.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape[0] if torch.is_grad_enabled()
                                                                    else "rerun"))
    engine, model, _, _, _ = private(model, "auto", memory_budget_mb=1e6)
    trained = [f for f in forwards if f != "rerun"]
    assert len(trained) > 2 and len(proofs) == len(trained)
    assert engine.controller.pass_one.layouts.reproof_every == 256  # the schedule is back after the search
    # Each probe's forward is checked too (independence.py: three reruns without gradient, the batch and the first
    # or the last example copied to every row, and in eval() mode the batch, without its last example, without its
    # first and, from three examples on, without its middle one), and the schedule and count of forwards are as
    # before the search.
    expected = sum(6 + (b > 2) for b in trained if b > 1)  # a batch of one has no other example
    assert forwards.count("rerun") == expected
    assert engine.controller.independence.every == 256 and engine.controller.independence.forwards == 0


CHOSEN_BATCH_STEP = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from ghostdp import PrivacyEngine
from ghostdp.memory import peak_mb_since, reset_peak
torch.manual_seed(0)
wide = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256),
                           torch.nn.Flatten(), torch.nn.Linear(32 * 256, 2))
dataset = TensorDataset(torch.randn(300, 32, 256), torch.randint(0, 2, (300,)))
engine = PrivacyEngine(seed=0)
wide, optimizer, criterion, loader = engine.make_private(
    module=wide, optimizer=torch.optim.SGD(wide.parameters(), lr=0.1),
    data_loader=DataLoader(dataset, batch_size=150), criterion=torch.nn.CrossEntropyLoss(),
    noise_multiplier=1.0, max_grad_norm=1.0, max_physical_batch_size="auto", memory_budget_mb=60)
chosen = loader.max_physical_batch_size
x, y = dataset[:chosen]
peaks = []
for _ in range(3):  # two passes, then book-keeping's one backward (this model keeps about what its graph saves)
    optimizer.zero_grad(set_to_none=True)
    base = reset_peak(torch.device("cpu"))
    criterion(wide(x), y).backward()
    peaks.append(peak_mb_since(torch.device("cpu"), base))
print(chosen, max(peaks))
"""


def test_on_a_cpu_the_chosen_batch_keeps_a_real_step_within_the_budget():
    """In a process of its own: the resident set that the search reads on a CPU depends on what the process
    allocated and freed before (glibc reuses freed heap memory without growing it), so after the rest of the suite
    its readings came out low and the chosen batch's step read 84 MiB against the 60 MiB budget (2026-11-27)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", CHOSEN_BATCH_STEP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen, peak = done.stdout.split()[-2:]
    assert 2 <= int(chosen) < 150  # ~1 MiB per example: far from both ends
    assert float(peak) <= 1.3 * 60  # resident-set readings are noisy


def test_a_probe_for_other_batch_structures():
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"x": data()[i][0], "label": data()[i][1]}

    model = FitsUpTo(4)
    engine = PrivacyEngine(seed=0)
    probe = lambda module, batch: torch.nn.functional.cross_entropy(module(batch["x"]), batch["label"],
                                                                   reduction="none")
    _, _, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(Dicts(), batch_size=30),
        noise_multiplier=1.0, max_grad_norm=1.0, max_physical_batch_size="auto", memory_budget_mb=1e6,
        physical_batch_probe=probe)
    assert loader.max_physical_batch_size == 4


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_physical_batch_size="auto"), ValueError, "on a CPU needs memory_budget_mb"),
    (dict(max_physical_batch_size=4, memory_budget_mb=100), ValueError, "are for max_physical_batch_size='auto'"),
    (dict(max_physical_batch_size="auto", memory_budget_mb=1e-9), MemoryError, "one example's private step"),
    (dict(max_physical_batch_size="many"), ValueError, "'auto' or None"),
])
def test_automatic_search_misuse_is_refused_and_leaves_the_model_unhooked(kwargs, error, match):
    # Wide enough that one example's step allocates fresh pages (its gradients: 2.3 MB): the CPU reading is
    # the process's resident set, which a step served from already-resident heap would not move.
    model = FitsUpTo(100, width=1 << 16)
    with pytest.raises(error, match=match):
        private(model, **kwargs) if "max_physical_batch_size" not in kwargs else private(
            model, kwargs.pop("max_physical_batch_size"), **kwargs)
    PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 data_loader=DataLoader(data(), batch_size=30), noise_multiplier=1.0, max_grad_norm=1.0)


def test_automatic_search_needs_a_way_to_run_a_step():
    model = FitsUpTo(100)
    with pytest.raises(ValueError, match="give make_private the criterion"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(data(), batch_size=30), noise_multiplier=1.0,
                                     max_grad_norm=1.0, max_physical_batch_size="auto", memory_budget_mb=100)
