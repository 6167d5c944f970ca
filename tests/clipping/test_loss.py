"""The loss contract: per-example losses, reductions, error paths, and accelerate's backward."""
import pytest
import torch
from torch import nn

import ghostdp
from ghostdp import per_example_loss


def test_token_losses_are_means_over_each_examples_valid_tokens():
    logits = torch.randn(3, 4, 5)
    labels = torch.tensor([[1, 2, -100, -100], [-100, -100, -100, -100], [0, 1, 2, 3]])
    got = per_example_loss(nn.CrossEntropyLoss(), logits, labels)
    for i in range(3):
        valid = labels[i] != -100
        want = nn.functional.cross_entropy(logits[i][valid], labels[i][valid]) if valid.any() else torch.tensor(0.)
        assert torch.allclose(got[i], want, rtol=1e-12)


def test_class_weights_and_torch_layout():
    weight = torch.rand(5) + 0.5
    crit = nn.CrossEntropyLoss(weight=weight, ignore_index=4)
    logits, labels = torch.randn(2, 5, 3), torch.tensor([[0, 4, 2], [1, 1, 3]])  # torch's (B, C, d) layout
    got = per_example_loss(crit, logits, labels)
    for i in range(2):
        assert torch.allclose(got[i], nn.functional.cross_entropy(logits[i:i + 1], labels[i:i + 1], weight=weight,
                                                                  ignore_index=4), rtol=1e-12)
    single = per_example_loss(crit, torch.randn(3, 5), torch.tensor([0, 2, 4]))
    assert single[2] == 0 and single.shape == (3,)


def test_elementwise_losses_average_per_example():
    out, target = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    assert torch.allclose(per_example_loss(nn.MSELoss(), out, target), (out - target).pow(2).mean((1, 2)))
    kl = nn.KLDivLoss(reduction="batchmean")
    logp, q = torch.randn(3, 4).log_softmax(1), torch.rand(3, 4).softmax(1)
    assert torch.allclose(per_example_loss(kl, logp, q).mean(), kl(logp, q))


def test_reductions_set_the_value_but_grad_is_always_the_clipped_sum():
    lin = nn.Linear(3, 2)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    controller = ghostdp.GhostClipping(lin, 1e6)
    values, grads = [], []
    for crit in (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")):
        lin.zero_grad()
        loss = controller.criterion(crit, expected_batch_size=4)(lin(x), y)
        loss.backward()
        values.append(float(loss.detach()))
        grads.append(lin.weight.grad.clone())
    assert values[0] == pytest.approx(values[1] / 6)  # the mean of the 6 losses, whatever the expected batch
    assert torch.allclose(grads[0], grads[1])
    assert float(controller.last_loss_scale) == 1.0


def test_a_padding_loss_adds_nothing_and_counts_no_examples():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1.0)
    controller.ledger.open()
    controller.ledger.mark_next_loss(padding=True)
    controller.loss(lin(torch.randn(1, 3)).pow(2).sum(1)).backward()
    records = controller.ledger.records
    assert torch.equal(lin.weight.grad, torch.zeros(2, 3))
    assert [(r.examples, float(r.loss_scale)) for r in records] == [(0, 1.0)]
    assert not controller.ledger.next_loss_is_padding  # it applies to one loss only
    controller.loss(lin(torch.randn(1, 3)).pow(2).sum(1)).backward()
    last = controller.ledger.records[-1]
    assert lin.weight.grad.abs().sum() > 0 and (last.examples, float(last.loss_scale)) == (1, 1.0)


def test_a_scaled_loss_scales_the_clipped_sum_and_is_reported():
    lin = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    controller = ghostdp.GhostClipping(lin, 1e-3)
    controller.loss(lin(x).pow(2).sum(1)).backward()
    once = lin.weight.grad.clone()
    lin.zero_grad()
    (controller.loss(lin(x).pow(2).sum(1)) * 0.25).backward()
    assert torch.allclose(lin.weight.grad, 0.25 * once) and float(controller.last_loss_scale) == 0.25


def test_clipped_sum_without_clipping_equals_the_plain_sum_gradient():
    lin = nn.Linear(3, 2)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    controller = ghostdp.GhostClipping(lin, 1e6)
    controller.criterion(nn.CrossEntropyLoss())(lin(x), y).backward()
    got = lin.weight.grad.clone()
    controller.detach()
    lin.zero_grad()
    nn.functional.cross_entropy(lin(x), y, reduction="sum").backward()
    assert torch.allclose(got, lin.weight.grad, rtol=1e-12)


def test_loss_error_paths():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1.0)
    out = lin(torch.randn(4, 3))
    with pytest.raises(ValueError, match="one loss per example"):
        controller.loss(out.sum())
    with pytest.raises(ValueError, match="reduction must be"):
        controller.loss(out.sum(1), reduction="none")
    with pytest.raises(ValueError, match="batch size 3 but the model output has 4"):
        controller.criterion(nn.CrossEntropyLoss())(out, torch.tensor([0, 1, 1]))
    with pytest.raises(TypeError, match="no 'reduction' attribute"):
        controller.criterion(lambda a, b: (a - b).sum())
    with pytest.raises(ValueError, match="expected_batch_size"):
        controller.loss(out.sum(1), expected_batch_size=0)


def test_accelerate_backward_runs_both_passes():
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    lin = nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin, opt = accelerator.prepare(lin, opt)
    controller = ghostdp.GhostClipping(lin, 1e-3)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    accelerator.backward(controller.criterion(nn.CrossEntropyLoss())(lin(x), y))
    assert controller.last_norms is not None and torch.all(controller.last_coefficients < 1)
    got = lin.weight.grad.clone()
    controller.detach()
    ref = torch.zeros_like(got)
    for i in range(5):
        g, = torch.autograd.grad(nn.functional.cross_entropy(lin(x[i:i + 1]), y[i:i + 1]), lin.weight)
        b, = torch.autograd.grad(nn.functional.cross_entropy(lin(x[i:i + 1]), y[i:i + 1]), lin.bias)
        norm = torch.sqrt(g.pow(2).sum() + b.pow(2).sum())
        ref += min(1.0, 1e-3 / (float(norm) + 1e-6)) * g
    assert torch.allclose(got, ref, rtol=1e-10)


def test_a_mask_keeps_an_elementwise_loss_to_the_real_positions_however_far_the_batch_is_padded():
    """MSE on (B, T, d): without a mask each example's loss means over every position, the padding included, so
    padding the batch further (dynamic padding: another example is longer) moves it; with the attention mask it is
    the mean over the example's own positions."""
    g = torch.Generator().manual_seed(0)
    B, T, d = 3, 5, 2
    output, target = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    losses = per_example_loss(nn.MSELoss(), output, target, mask=mask)
    for i in range(B):
        n = int(mask[i].sum())
        assert torch.allclose(losses[i], nn.functional.mse_loss(output[i, :n], target[i, :n]), rtol=1e-12)
    longer = [torch.cat([t, torch.randn(B, 4, d, generator=g)], 1) for t in (output, target)]
    longer_mask = torch.cat([mask, torch.zeros(B, 4, dtype=torch.long)], 1)
    assert torch.allclose(per_example_loss(nn.MSELoss(), *longer, mask=longer_mask), losses, rtol=1e-12)
    unmasked = per_example_loss(nn.MSELoss(), output, target)
    assert not torch.allclose(per_example_loss(nn.MSELoss(), *longer), unmasked)


def test_a_mask_with_class_weights_and_ignored_labels_counts_the_tokens_both_keep():
    g = torch.Generator().manual_seed(1)
    B, T, V = 2, 4, 5
    logits, labels = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    labels[0, 1] = -100
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    criterion = nn.CrossEntropyLoss(weight=torch.rand(V, generator=g) + 0.5)
    losses = per_example_loss(criterion, logits, labels, mask=mask)
    for i in range(B):
        keep = (mask[i] == 1) & (labels[i] != -100)
        expected = nn.functional.cross_entropy(logits[i][keep], labels[i][keep], weight=criterion.weight)
        assert torch.allclose(losses[i], expected, rtol=1e-12)


def test_the_dp_criterion_passes_the_mask_on():
    model = nn.Linear(2, 2)
    controller = ghostdp.GhostClipping(model, 1.0)
    criterion = ghostdp.DPCriterion(nn.MSELoss(reduction="sum"), controller)
    x, target = torch.randn(2, 3, 2), torch.randn(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = criterion(model(x), target, mask)
    expected = per_example_loss(nn.MSELoss(), model(x), target, mask=mask).sum()
    assert torch.allclose(loss, expected, rtol=1e-12)
    loss.backward()
    controller.detach()


def test_a_mask_that_does_not_match_the_losses_is_refused():
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3\) does not match the leading dims of the "
                                         r"elementwise losses, \(2, 4, 1\)"):
        per_example_loss(nn.MSELoss(), torch.zeros(2, 4, 1), torch.zeros(2, 4, 1), mask=torch.ones(2, 3))


class TokenTagger(nn.Module):
    """A label per token, called as a transformers model is: input ids and their attention mask."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        return self.head(self.embed(input_ids))


def test_a_dp_criterion_without_a_mask_refuses_targets_that_count_the_padding():
    """Labels copied from the padded input ids count the padding in each example's loss: with batches padded to
    their longest example one example's length then moves the others' clipped gradients (5.3 C measured through
    DPTrainer's loss before 2026-11-26, which reads the mask now). On the forwards the forward check runs on, a DP
    criterion called without a mask refuses such targets; the mask, or -100 at the padding, is accepted."""
    model = TokenTagger().double()
    controller = ghostdp.GhostClipping(model, 1.0)
    criterion = ghostdp.DPCriterion(nn.CrossEntropyLoss(), controller)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    ids = torch.randint(1, 10, (3, 4), generator=torch.Generator().manual_seed(1)) * mask
    labels = ids % 3  # the padding's label is a class (0), not -100
    with pytest.raises(ValueError, match=r"the loss counts positions that the batch's attention mask excludes.*"
                                         r"not the criterion's ignore_index \(-100\).*criterion\(output, target, "
                                         r"attention_mask\)"):
        criterion(model(ids, mask), labels)
    with controller.independence.checking_every_forward():
        criterion(model(ids, mask), labels, mask).backward()
        criterion(model(ids, mask), labels.masked_fill(mask == 0, -100)).backward()
        criterion(model(ids, torch.ones_like(mask)), labels).backward()  # no padding
        with pytest.raises(ValueError, match="the loss counts positions"):  # a causal LM's shifted targets
            criterion(model(ids, mask)[:, :-1], labels[:, 1:])
        criterion(model(ids, mask)[:, :-1], labels[:, 1:], mask[:, 1:]).backward()
        tagger = ghostdp.DPCriterion(nn.MSELoss(), controller)  # a float target: every padded position counts
        with pytest.raises(ValueError, match="the loss counts positions"):
            tagger(model(ids, mask), torch.zeros(3, 4, 3, dtype=torch.float64))
        tagger(model(ids, mask), torch.zeros(3, 4, 3, dtype=torch.float64), mask).backward()
    controller.independence.every = 0  # no forward checked: nothing refused
    criterion(model(ids, mask), labels).backward()
    controller.detach()
