"""The Opacus-paper benchmark: its networks have the paper's sizes, and a scaled-down run of every task times
every mode, trains privately within its epsilon, and writes its table, JSON and PNG."""
import json

import pytest
import torch

from benchmarks import opacus_paper
from tests.benchmarks.idx_files import data_dir  # noqa: F401  (a fixture)

import ghostdp


def size(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("task,parameters", [("mnist", 26_010), ("cifar10", 605_226), ("embedding", 160_098),
                                             ("lstm", 1_081_402)])
def test_networks_have_the_papers_sizes(task, parameters):
    assert size(opacus_paper.build(task, "plain")) == parameters
    assert size(opacus_paper.build(task, "ghost")) == parameters


def test_ghostdp_modes_train_the_lstm_through_ghostdp_layers():
    assert isinstance(opacus_paper.build("lstm", "ghost").lstm, ghostdp.layers.LSTM)
    assert type(opacus_paper.build("lstm", "plain").lstm) is torch.nn.LSTM


def test_snippets_become_padded_ids_over_a_capped_vocabulary():
    data = opacus_paper.vader_snippets(limit=300)
    ids = data.train_x
    assert ids.max() < opacus_paper.VOCAB + opacus_paper.SPECIALS and ids.min() >= 0
    real = ids != opacus_paper.PAD
    assert bool((real.cumsum(1) == real.sum(1, keepdim=True)).logical_or(real).all()), "padding is not at the end"
    assert len(data.train_y) == 300 and set(data.train_y.tolist()) == {0, 1}


def test_scaled_down_run_of_every_task(tmp_path, data_dir, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setitem(opacus_paper.RECIPES, "mnist", dict(batch_size=32, epochs=1, lr=1e-3, max_grad_norm=1.0))
    out = opacus_paper.main(["--batches", "8", "--rounds", "1", "--limit", "48", "--data-dir", data_dir,
                             "--epsilon", "4", "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")])
    timings = {t["task"]: t for t in out["timings"]}
    assert set(timings) == set(opacus_paper.TASKS)
    for t in timings.values():
        assert t["failed"] == {}, t["failed"]
        assert {"plain", "ghost", "bookkeeping"} <= set(t["epoch_seconds"])
        assert all(v > 0 for v in t["epoch_seconds"].values())
        assert t["steps_per_epoch"] == 6
    accuracy = {(a["task"], a["private"]): a for a in out["accuracy"]}
    assert set(accuracy) == {(task, private) for task in ("mnist", "embedding", "lstm") for private in (True, False)}
    for (task, private), a in accuracy.items():
        assert 0 <= a["test_accuracy"] <= 1
        assert a["epsilon"] <= 4 + 1e-6 if private else a["epsilon"] == float("inf")
    assert json.loads((tmp_path / "r.json").read_text())["timings"] == out["timings"]
    assert (tmp_path / "r.png").stat().st_size > 0
    assert "| lstm | 8 |" in capsys.readouterr().out
