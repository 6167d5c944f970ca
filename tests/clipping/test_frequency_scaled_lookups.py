"""An embedding lookup with scale_grad_by_freq=True couples the examples in its backward (clipping/audit.py).

Its backward divides each row's gradient by how often the row's index occurs in the whole batch, so one example's
gradient depends on the others' indices. The layout proof looks at the graph's data flow, where nothing mixes,
and a module without a rule took its per-example gradients from that backward: one example with a zero gradient
of its own moved the clipped sum by 2.1 C (and more with more examples sharing its tokens). nn.Embedding and
nn.EmbeddingBag with the flag are refused at attach (validate.py); every step's audit refuses any such lookup in
the graph: functional ones inside a module without a rule, and a module's flag set after attaching.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from conftest import CLIPPING_MODES, assert_exact, clipped_sum_through_the_batch

V, D, K = 40, 2, 8  # table rows, width, examples sharing one token with the added example
PAD, SHARED = 0, 1
REFUSED = "scales the gradient of 'table.weight' by how often each index occurs in the whole batch"


class Lookup(nn.Module):
    """No norm rule: a table read with F.embedding (``bag``: F.embedding_bag, summing each row of indices)."""

    def __init__(self, scale_grad_by_freq, bag=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, D))
        self.scale_grad_by_freq, self.bag = scale_grad_by_freq, bag

    def forward(self, ids):
        if self.bag:
            return F.embedding_bag(ids, self.weight, mode="sum", scale_grad_by_freq=self.scale_grad_by_freq)
        return F.embedding(ids, self.weight, scale_grad_by_freq=self.scale_grad_by_freq)


class Scored(nn.Module):
    """Per-example loss <lookup(ids_i), v_i>: the output grad at each token is the example's own v."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, ids, v):
        return (self.table(ids) * v).flatten(1).sum(1)


def _neighbouring_batches():
    """D: K examples, example m reading its own token 2 + m and one token all share; D + j: j reads the K own
    tokens with a zero loss, so its own clipped gradient is 0 and all it changes is the others' token counts."""
    ids, v = [], []
    for m in range(K):
        ids.append([2 + m, SHARED] + [PAD] * (K - 2))
        vm = torch.zeros(K, D, dtype=torch.float64)
        vm[0, 0], vm[1, 1] = 200.0, 100.0 * K
        v.append(vm)
    D_ = torch.tensor(ids), torch.stack(v)
    Dj = torch.tensor(ids + [[2 + m for m in range(K)]]), torch.stack(v + [torch.zeros(K, D, dtype=torch.float64)])
    return D_, Dj


def _clipped_sum_from_the_batch_backward(model, ids, v):
    """The table's clipped sum as the batch's backward forms each example's gradient (the counts are the batch's:
    conftest.clipped_sum_through_the_batch): what the fallback's per-example VJP computed."""
    return clipped_sum_through_the_batch(model(ids, v), [model.table.weight])


def _assert_refused(model, ids, v, clipping, match=REFUSED, flag_after_attaching=False):
    """The DP loss's backward is refused; ``flag_after_attaching``: the model's ``table`` gets the flag once attached."""
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        if flag_after_attaching:
            model.table.scale_grad_by_freq = True
        with pytest.raises(RuntimeError, match=match):
            controller.loss(model(ids, v), reduction="sum").backward()
    finally:
        controller.detach()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_lookup_scaled_by_batch_counts_inside_a_module_without_a_rule_is_refused(clipping):
    model = Scored(Lookup(scale_grad_by_freq=True)).double()
    (ids, v), (ids_j, v_j) = _neighbouring_batches()
    moved = _clipped_sum_from_the_batch_backward(model, ids_j, v_j) - _clipped_sum_from_the_batch_backward(model, ids, v)
    assert float(moved.norm()) > 2.0, "degenerate test: the added example does not move the others' clipped sum"
    _assert_refused(model, ids, v, clipping, match=REFUSED + r".*Fix: scale_grad_by_freq=False")
    assert model.table.weight.grad is None  # refused before anything reached p.grad


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_bag_lookup_scaled_by_batch_counts_is_refused(clipping):
    model = Scored(Lookup(scale_grad_by_freq=True, bag=True)).double()
    (ids, _), _ = _neighbouring_batches()
    _assert_refused(model, ids, torch.randn(K, D, dtype=torch.float64), clipping)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_an_embedding_whose_flag_is_set_after_attaching_is_refused_at_the_step(clipping):
    """nn.Embedding has a norm rule that knows nothing of counts; the attach-time check saw the flag off."""
    model = Scored(nn.Embedding(V, D)).double()
    (ids, v), _ = _neighbouring_batches()
    _assert_refused(model, ids, v, clipping, flag_after_attaching=True)


class CheckpointedLookup(nn.Module):
    """A ruled embedding and a trained gain inside one reentrant checkpoint: pass 1 audits the region's graph."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(D, D)
        self.table = nn.Embedding(V, D)

    def forward(self, ids, v):
        h = checkpoint(lambda x: x + self.table(ids), self.scale(v), use_reentrant=True)
        return h.flatten(1).sum(1)


def test_a_frequency_scaled_lookup_inside_a_reentrant_checkpoint_is_refused_by_the_region_audit():
    model = CheckpointedLookup().double()
    (ids, _), _ = _neighbouring_batches()
    _assert_refused(model, ids, torch.randn(K, K, D, dtype=torch.float64), "ghost", flag_after_attaching=True)


@pytest.mark.parametrize("bag", [False, True])
def test_lookups_without_the_flag_are_exact_and_not_refused(bag):
    model = Scored(Lookup(scale_grad_by_freq=False, bag=bag)).double()
    torch.manual_seed(0)
    ids = torch.randint(0, 6, (4, 5))  # few distinct tokens: the examples share rows
    v = torch.randn(4, *((D,) if bag else (5, D)), dtype=torch.float64)
    assert_exact(model, lambda: model(ids, v), lambda i: model(ids[i:i + 1], v[i:i + 1]).sum(), 4)
