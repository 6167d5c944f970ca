"""Property-based checks over shapes, ranks, padding and clipping norms."""
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from conftest import CLIPPING_MODES, clipped_sum, ghost_clipped_sum, reference_per_example_grads, relative_error

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def check(model, x, C_scale, loss=lambda out: out.tanh().flatten(1).sum(1) + out.flatten(1).pow(2).sum(1)):
    torch.set_default_dtype(torch.float64)
    model = model.double()
    B = x.shape[0]
    per_example = reference_per_example_grads(model, lambda i: loss(model(x[i:i + 1])).sum(), B)
    _, norms = clipped_sum(per_example, 1.0)
    C = C_scale * float(norms.median()) + 1e-12
    ref, _ = clipped_sum(per_example, C)
    for clipping in CLIPPING_MODES:
        got, got_norms = ghost_clipped_sum(model, lambda: loss(model(x)), C, clipping)
        assert torch.allclose(got_norms, norms, rtol=1e-9)
        assert relative_error(got, ref) < 1e-9, clipping


@SETTINGS
@given(batch=st.integers(1, 4), lead=st.lists(st.integers(1, 5), max_size=2), d=st.integers(1, 9),
       p=st.integers(1, 9), bias=st.booleans(), c=st.floats(0.05, 5.0))
def test_linear_any_rank(batch, lead, d, p, bias, c):
    torch.manual_seed(batch * 100 + d * 10 + p)
    check(nn.Linear(d, p, bias=bias), torch.randn(batch, *lead, d, dtype=torch.float64), c)


@SETTINGS
@given(batch=st.integers(1, 4), T=st.integers(1, 8), vocab=st.integers(2, 12), H=st.integers(1, 6),
       pad=st.booleans(), c=st.floats(0.05, 5.0), data=st.data())
def test_embedding_any_ids(batch, T, vocab, H, pad, c, data):
    torch.manual_seed(T * 10 + vocab)
    ids = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=T, max_size=T),
                                          min_size=batch, max_size=batch)))
    if pad:
        ids[0, 0] = vocab - 1  # at least one real token, so some example has a gradient
    check(nn.Embedding(vocab, H, padding_idx=0 if pad else None), ids, c)


@SETTINGS
@given(batch=st.integers(1, 3), cin=st.sampled_from([2, 4]), groups=st.sampled_from([1, 2]),
       k=st.integers(1, 3), stride=st.integers(1, 2), dilation=st.integers(1, 2), padding=st.integers(0, 2),
       size=st.integers(5, 8), c=st.floats(0.05, 5.0))
def test_conv2d_any_geometry(batch, cin, groups, k, stride, dilation, padding, size, c):
    torch.manual_seed(size * 7 + k)
    conv = nn.Conv2d(cin, 4, k, stride=stride, dilation=dilation, padding=padding, groups=groups)
    check(conv, torch.randn(batch, cin, size, size - 1, dtype=torch.float64), c)
