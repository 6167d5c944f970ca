"""The bytes a graph's nodes saved (clipping/saved_bytes.py): each storage once, the model's parameters and buffers
left out, a Python Function's saved tensors counted, and a tensor saved under saved-tensor hooks neither counted nor
unpacked (a non-reentrant checkpoint's unpack would recompute its region)."""
import torch
from torch import nn

from ghostdp.clipping.saved_bytes import saved_bytes, storage_keys


def nodes_below(t):
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return seen


class SavesItsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_each_storage_once_without_the_model_s_parameters():
    layer = nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = layer(x).exp()          # addmm saves x and the weight (a parameter); exp saves its result y
    z = (y * y).sum()           # mul saves y twice: one storage
    assert saved_bytes(nodes_below(z), storage_keys(layer.parameters())) == 2 * 4 * 6 * 8
    assert saved_bytes(nodes_below(z), set()) == 2 * 4 * 6 * 8 + 6 * 6 * 8  # the weight too


def test_a_python_function_s_saved_tensors_count():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = SavesItsInput.apply(x.exp()).sum()  # exp saves its result, which the Function saves again
    assert saved_bytes(nodes_below(y), set()) == 5 * 3 * 8


def test_tensors_saved_under_hooks_are_neither_counted_nor_unpacked():
    def unpack(packed):
        raise AssertionError("unpacked")

    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = x.exp()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t), unpack):
        z = y.sin().cos()  # sin saves y, cos saves sin's result: both packed
    assert saved_bytes(nodes_below(z.sum()), set()) == 4 * 6 * 8  # exp's result only
