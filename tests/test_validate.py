"""Model checks: each rejection names the module and the fix; fix() makes a BatchNorm net trainable."""
import pytest
import torch
from torch import nn

import ghostdp
from ghostdp.validate import ModelNotPrivatizable
from conftest import assert_exact_model
from ghostdp import per_example_loss


def net_with_batchnorm():
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 2),
                         nn.BatchNorm1d(2))


def test_batchnorm_is_rejected_with_the_fix():
    with pytest.raises(ModelNotPrivatizable, match=r"'1' \(BatchNorm2d\).*ghostdp.validate.fix") as err:
        ghostdp.GhostClipping(net_with_batchnorm(), 1.0)
    assert "'5' (BatchNorm1d)" in str(err.value)


def test_fix_replaces_batchnorm_by_groupnorm_and_training_is_exact():
    model = ghostdp.validate.fix(net_with_batchnorm())
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 6 and model[1].num_channels == 6
    assert isinstance(model[5], nn.GroupNorm) and model[5].num_groups == 1
    assert ghostdp.validate.find_problems(model) == []
    labels = torch.randint(0, 2, (4,))
    assert_exact_model(model, torch.randn(4, 3, 6, 6),
                       lambda out, sl: per_example_loss(nn.CrossEntropyLoss(), out, labels[sl]), 4)


def test_lazy_module_is_rejected():
    with pytest.raises(ModelNotPrivatizable, match="LazyLinear.*run one forward"):
        ghostdp.GhostClipping(nn.Sequential(nn.LazyLinear(3)), 1.0)


def test_embedding_options_that_couple_examples_are_rejected():
    with pytest.raises(ModelNotPrivatizable, match="scale_grad_by_freq=False"):
        ghostdp.GhostClipping(nn.Embedding(5, 2, scale_grad_by_freq=True), 1.0)
    with pytest.raises(ModelNotPrivatizable, match="sparse=False"):
        ghostdp.GhostClipping(nn.Embedding(5, 2, sparse=True), 1.0)
    frozen = nn.Embedding(5, 2, sparse=True)
    frozen.weight.requires_grad_(False)
    ghostdp.GhostClipping(frozen, 1.0)  # a frozen one is harmless


def test_fix_refuses_a_bare_batchnorm():
    with pytest.raises(ModelNotPrivatizable, match="wrap it"):
        ghostdp.validate.fix(nn.BatchNorm1d(3))


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ghostdp.GhostClipping(lambda x: x, 1.0)
