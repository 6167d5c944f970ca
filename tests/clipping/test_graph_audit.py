"""The graph audit runs every step: no parameter gets gradient outside a recorded call of its module."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ghostdp
from conftest import assert_exact


class ReadsChildWeightSometimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if (x[:, 0] == 7).any():  # a data-dependent path that reads the child's weight directly
            h = h + F.linear(x, self.lin.weight)
        return h


def test_a_stray_read_on_a_data_dependent_path_is_refused_on_the_step_that_takes_it():
    model = ReadsChildWeightSometimes()
    controller = ghostdp.GhostClipping(model, 1.0)
    clean = torch.randn(4, 4)
    controller.loss(model(clean).pow(2).sum(1)).backward()  # audited: clean
    model.zero_grad()
    controller.loss(model(clean + 1).pow(2).sum(1)).backward()  # same pattern again: still checked
    model.zero_grad()
    poisoned = clean.clone()
    poisoned[2, 0] = 7
    with pytest.raises(RuntimeError, match=r"'lin.weight' outside the forward"):
        controller.loss(model(poisoned).pow(2).sum(1)).backward()


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_the_refusal_holds_in_both_modes(clipping):
    model = ReadsChildWeightSometimes()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    x = torch.randn(3, 4)
    x[0, 0] = 7
    with pytest.raises(RuntimeError, match="outside the forward"):
        controller.loss(model(x).pow(2).sum(1)).backward()


def test_an_input_made_to_require_grad_is_no_stray_parameter():
    # transformers' enable_input_require_grads (every QLoRA recipe) makes the frozen embeddings'
    # output require grad: a leaf that is no parameter, never stepped, so nothing to bound.
    import transformers
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=12, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(cfg)
    model.bert.embeddings.requires_grad_(False)
    model.enable_input_require_grads()
    ids = torch.randint(1, 30, (3, 5))
    labels = torch.tensor([0, 1, 1])
    ce = nn.CrossEntropyLoss(reduction="none")

    def batch_losses():
        return ce(model(input_ids=ids).logits, labels)

    def example_loss(i):
        return ce(model(input_ids=ids[i:i + 1]).logits, labels[i:i + 1]).sum()

    assert_exact(model, batch_losses, example_loss, 3)


class _ReleasedNode:
    """A Python Function's node as torch 2.11 leaves it once its graph is freed: its edges cannot be read."""

    @property
    def next_functions(self):
        raise RuntimeError("Attribute 'next_functions' is invalid for this instance of _C._FunctionBase.")


def test_a_released_node_is_walked_through_its_recorded_edges_and_refused_without_them():
    from ghostdp.clipping.audit import audit_graph
    weight = nn.Parameter(torch.randn(3))
    edge = weight.view(3).grad_fn.next_functions[0]  # (weight's gradient accumulator, 0)
    node = _ReleasedNode()
    found = audit_graph([node], {id(weight): weight}, recorded={node: (edge,)})
    assert found.stray == [weight] and found.calls == []  # the recorded edge into the weight is seen (no call covers it)
    with pytest.raises(RuntimeError, match=r"cannot read the edges of the autograd node _ReleasedNode.*use_reentrant=False"):
        audit_graph([node], {id(weight): weight})


def test_a_region_tracer_records_the_edges_of_python_functions_nodes_while_they_are_alive():
    from ghostdp.clipping.reentrant import RegionTracer

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    x = torch.randn(2, 3, requires_grad=True)
    with RegionTracer({id(x)}, frozenset(), "fix") as tracer:
        y = Double.apply(x.cos())
        z = y.sin()
    node = y.grad_fn
    assert node in tracer.nodes and z.grad_fn in tracer.nodes
    assert tracer.function_edges == {node: node.next_functions}  # only the Python Function's node
