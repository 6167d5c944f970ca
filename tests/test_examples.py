"""The plain-PyTorch example runs end to end and keeps its privacy budget."""
import importlib.util
import pathlib

import torch

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mnist_style_cnn_learns_within_its_budget():
    torch.set_default_dtype(torch.float32)
    result = load("mnist_style_cnn").main(["--epochs", "2", "--train-size", "1500", "--epsilon", "3"])
    assert 0.99 * 3 <= result["epsilon"] <= 3.0
    assert result["accuracy"] > 0.5  # four classes: chance is 0.25
