"""A forward's tensors inside objects that pytree keeps whole (clipping/leaves.py): a batch passed in a
SimpleNamespace or a dataclass, and outputs returned in one. The forward check's refusals through them are in
test_forward_independence.py, the prompt's capture below them in test_repeated_outputs.py."""
import dataclasses
import types

import pytest
import torch
import transformers
from torch import nn
from torch.utils._pytree import keystr

from conftest import assert_exact
from ghostdp.clipping.leaves import flatten, output_leaves, output_tensors, unflatten


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor = None
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    ids: torch.Tensor


class OwnOutput:  # a class of one's own with attributes
    def __init__(self, logits):
        self.logits = logits


def test_flatten_looks_into_namespaces_and_dataclasses_and_unflatten_rebuilds_copies():
    ids, mask, extra = torch.arange(6).reshape(2, 3), torch.ones(2, 3), torch.zeros(2)
    batch = Batch(ids, mask)
    tree = ((types.SimpleNamespace(batch=batch, extra=[extra]),), {"frozen": FrozenBatch(ids), "n": 3})
    flat, spec = flatten(tree)
    assert [x is y for x, y in zip(flat, [ids, mask, "kept", extra, ids, 3])] == [True] * 6
    doubled = unflatten([x * 2 if isinstance(x, torch.Tensor) else x for x in flat], spec)
    (namespace,), kwargs = doubled
    assert isinstance(namespace.batch, Batch) and namespace.batch is not batch and batch.ids is ids  # a copy
    assert torch.equal(namespace.batch.ids, 2 * ids) and torch.equal(namespace.extra[0], 2 * extra)
    assert namespace.batch.note == "kept" and kwargs["n"] == 3
    assert isinstance(kwargs["frozen"], FrozenBatch) and torch.equal(kwargs["frozen"].ids, 2 * ids)


def test_flatten_stops_at_its_depth_and_at_objects_that_are_not_containers():
    deep = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace(t=1))))
    flat, _ = flatten(deep)
    assert len(flat) == 1 and isinstance(flat[0], types.SimpleNamespace) and flat[0].t == 1  # 3 levels looked into
    own = OwnOutput(torch.ones(2))
    assert flatten([own])[0] == [own]  # a class of one's own is an argument as it is


def test_output_leaves_name_their_paths_and_look_into_any_object_only_where_no_tensor_is_found():
    logits = torch.ones(2, 3, requires_grad=True) * 2
    leaves = output_leaves({"out": types.SimpleNamespace(logits=logits)})
    assert [(keystr(path), leaf is logits) for path, leaf in leaves] == [("['out'].logits", True)]
    assert [keystr(path) for path, _ in output_leaves(OwnOutput(logits))] == [".logits"]
    cache = OwnOutput(torch.ones(2, 3))  # beside a tensor (a language model's cache): kept whole
    assert [leaf is cache for _, leaf in output_leaves((logits, cache))] == [False, True]
    assert output_tensors((logits, cache)) == [logits]


def _bert_reading_its_batch():
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)

    class ReadsItsBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = transformers.BertForSequenceClassification(config)

        def forward(self, batch):
            return self.bert(input_ids=batch.ids, attention_mask=batch.mask).logits

    return ReadsItsBatch().double()


@pytest.mark.parametrize("make_batch", [lambda ids, mask: types.SimpleNamespace(ids=ids, mask=mask), Batch],
                         ids=["namespace", "dataclass"])
def test_a_bert_whose_batch_comes_in_an_object_is_exact(make_batch):
    """The batch size is read inside the object: the position embeddings, shared by the batch, are broadcast to it
    (refused before 2026-12-03: an output of batch size 1 with no dim of the batch's size)."""
    torch.manual_seed(0)
    model = _bert_reading_its_batch()
    ids, mask = torch.randint(1, 30, (4, 6)), torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    assert_exact(model, lambda: model(make_batch(ids, mask)).pow(2).sum(1),
                 lambda i: model(make_batch(ids[i:i + 1], mask[i:i + 1])).pow(2).sum(), 4)


@dataclasses.dataclass
class Scaled:
    h: torch.Tensor


class ScalesByItsWeight(nn.Module):
    """A module without a rule that returns its output in ``returns`` (the exact fallback, through its graph)."""

    def __init__(self, returns):
        super().__init__()
        self.weight, self.returns = nn.Parameter(torch.linspace(0.5, 1.5, 4)), returns

    def forward(self, x):
        return self.returns(h=torch.tanh(x * self.weight))


@pytest.mark.parametrize("returns", [types.SimpleNamespace, Scaled], ids=["namespace", "dataclass"])
def test_a_module_without_a_rule_whose_output_comes_in_an_object_is_exact(returns):
    """Its output grads are taken inside the object (refused before 2026-12-03, its parameter's gradient reaching it
    outside every recorded call)."""
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.head = ScalesByItsWeight(returns), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.scale(x).h)

    net = Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    assert_exact(net, lambda: net(x).pow(2).sum(1), lambda i: net(x[i:i + 1]).pow(2).sum(), 5)
