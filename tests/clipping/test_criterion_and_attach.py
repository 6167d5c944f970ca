"""Criteria that would mix examples are refused; a model is attached to one controller at a time."""
import pytest
import torch
from torch import nn

import ghostdp


def test_a_loss_that_broadcasts_across_the_batch_is_refused():
    model = nn.Linear(3, 1)
    controller = ghostdp.GhostClipping(model, 1.0)
    criterion = controller.criterion(nn.MSELoss())
    x, y = torch.randn(4, 3), torch.randn(4)
    with pytest.raises(ValueError, match="would mix examples"):
        criterion(model(x), y)  # (4, 1) against (4,): torch would broadcast to (4, 4)
    criterion(model(x), y.unsqueeze(1)).backward()  # same shapes: fine
    criterion(model(x).squeeze(1), y)  # also fine


def test_class_index_targets_of_another_rank_are_still_accepted():
    logits, labels = torch.randn(4, 5, requires_grad=True), torch.randint(0, 5, (4,))
    assert ghostdp.per_example_loss(nn.CrossEntropyLoss(), logits, labels).shape == (4,)
    assert ghostdp.per_example_loss(nn.MultiMarginLoss(), logits, labels).shape == (4,)


def test_attaching_twice_is_refused_until_the_first_is_detached():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    first = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="already has ghostdp hooks"):
        ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="already has ghostdp hooks"):
        ghostdp.GhostClipping(nn.Sequential(model), 1.0)  # a parent of an attached model
    engine = ghostdp.PrivacyEngine(seed=0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
                                         batch_size=4)
    with pytest.raises(RuntimeError, match=r"engine.controller.detach\(\)"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=loader, criterion=nn.MSELoss(), noise_multiplier=1.0, max_grad_norm=1.0)
    first.detach()
    second = ghostdp.GhostClipping(model, 1.0)
    second.loss(model(torch.randn(4, 3)).pow(2).sum(1)).backward()
    assert second.last_norms.shape == (4,)
