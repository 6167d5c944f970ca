"""The Fashion-MNIST benchmark: its idx reader, its model, and a scaled-down private run on idx files
written here (the real data are a Debian package that CI need not have)."""
import struct

import numpy as np
import pytest
import torch

from benchmarks import fashion_mnist
from tests.benchmarks.idx_files import data_dir, write_idx  # noqa: F401  (data_dir is a fixture)


def test_idx_files_are_read_exactly(tmp_path):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", array)
    assert np.array_equal(fashion_mnist.read_idx(str(tmp_path / "a.gz")), array)
    (tmp_path / "bad").write_bytes(struct.pack(">HBB", 0, 0x0D, 1) + struct.pack(">I", 1) + b"\0\0\0\0")
    with pytest.raises(ValueError, match="not an idx file of unsigned bytes"):
        fashion_mnist.read_idx(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        fashion_mnist.load("train", str(tmp_path / "nowhere"))


def test_the_model_is_the_papers_26010_parameters():
    model = fashion_mnist.cnn()
    assert sum(p.numel() for p in model.parameters()) == 26010
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_a_scaled_down_private_run_learns_and_spends_its_epsilon(data_dir):
    result = fashion_mnist.train(8.0, epochs=3, batch_size=256, lr=2.0, max_grad_norm=1.0, data_dir=data_dir,
                                 log=lambda _: None)
    assert result["epsilon"] <= 8.0 and result["train_examples"] == 300
    assert result["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
