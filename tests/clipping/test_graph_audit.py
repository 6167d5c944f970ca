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


class BodyAndHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


FOREIGN = "get gradient from the DP loss but were not parameters of the model when it was made private"


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_module_added_after_attaching_is_refused(clipping):
    """Its parameters were in no recorded call and not among the model's at attach: the audit took their leaves for
    inputs. Two passes gave the new head an unclipped gradient (1000 times C * B below, before 2026-11-26);
    book-keeping silently none."""
    torch.manual_seed(0)
    model, x = BodyAndHead().double(), 100 * torch.randn(6, 3, dtype=torch.float64)
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    model.head = nn.Linear(3, 2).double()  # a new classification head
    unclipped, = torch.autograd.grad(model(x).pow(2).sum(), model.head.weight)
    assert float(unclipped.norm()) > 100 * 1e-3 * 6, "degenerate test: the head's gradient is within C * B"
    with pytest.raises(RuntimeError, match=r"'head.bias', 'head.weight' " + FOREIGN + ".*Fix: make every trained"):
        controller.loss(model(x).pow(2).sum(1), reduction="sum").backward()
    assert model.head.weight.grad is None
    controller.detach()


def test_a_parameter_held_outside_the_model_is_refused_and_a_tensor_that_requires_grad_is_not():
    model = BodyAndHead()
    controller = ghostdp.GhostClipping(model, 1.0)
    x = torch.randn(6, 3)
    temperature = nn.Parameter(torch.tensor(2.0))  # a learned scale the training script keeps
    with pytest.raises(RuntimeError, match=r"'\(\)' " + FOREIGN):
        controller.loss((model(x) * temperature).pow(2).sum(1)).backward()
    model.zero_grad()
    shift = torch.ones(3, requires_grad=True)  # an input made to require grad: never stepped, no concern
    controller.loss(model(x + shift).pow(2).sum(1)).backward()
    assert model.head.weight.grad is not None
    controller.detach()


def test_a_weight_penalty_in_the_loss_is_refused_with_weight_decay_as_the_fix():
    """Its gradient reaches every parameter outside the modules' forwards, in no example's norm."""
    model = BodyAndHead()
    controller = ghostdp.GhostClipping(model, 1.0)
    penalty = 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
    with pytest.raises(RuntimeError, match="outside the forward.*a penalty on the weights.*use the optimizer's "
                                           "weight_decay"):
        controller.loss(model(torch.randn(4, 3)).pow(2).sum(1) + penalty).backward()
    controller.detach()


def test_a_forward_in_eval_mode_is_refused_naming_train_mode():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    controller = ghostdp.GhostClipping(model, 1.0)
    model.eval()
    with pytest.raises(RuntimeError, match=r"no call of a trainable layer was recorded.*eval\(\) mode.*"
                                           r"model\.train\(\)"):
        controller.loss(model(torch.randn(5, 3)).pow(2).sum(1)).backward()
    controller.detach()


class ReadsASharedVector(nn.Module):
    """Its only trained parameter belongs to a module that is never called: every layer reads it (peft's TinyLoRA
    shares one vector so). Nothing is recorded, in train mode."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Module()
        self.shared.v = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x):
        return self.lin(x * self.shared.v)


def test_parameters_read_only_outside_their_modules_are_named_not_taken_for_an_eval_mode_forward():
    """Until late 2026-12-02 this said that the forward ran in eval() mode."""
    model = ReadsASharedVector()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match=r"gradient reaches the parameter\(s\) 'shared\.v' outside the forward of "
                                           r"the module that owns it.*No call of a trainable layer was recorded"):
        controller.loss(model(torch.randn(5, 3)).pow(2).sum(1)).backward()
    controller.detach()
