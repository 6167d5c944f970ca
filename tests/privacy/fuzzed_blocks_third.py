"""The fuzzer's third generation of blocks (test_fuzzed_models.py, 2026-12-07): the shapes of modern models and of
training tricks over (B, T, D) activations, each keeping its examples apart, and MixesExamplesFurther, more ways of
mixing them that DP-SGD must refuse. third_generation_makers lists the makers the generator draws from.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from fuzzed_blocks import D


class Rotary(nn.Module):
    """Attention with rotary position embeddings on its queries and keys."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype).unsqueeze(-1) * torch.arange(1, D // 2 + 1, dtype=x.dtype)
        cos, sin = pos.cos(), pos.sin()

        def rot(h):
            a, b = h[..., : D // 2], h[..., D // 2:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
        w = (rot(self.q(x)) @ rot(self.k(x)).transpose(1, 2) / math.sqrt(D)).softmax(-1)
        return w @ self.v(x)


class GroupedQuery(nn.Module):
    """Causal SDPA with two query heads sharing one key and value head (expanded, and repeated)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(D, D), nn.Linear(D, D)  # q: 2 heads of 3; k, v: one head of 3 each

    def forward(self, x):
        B, L, _ = x.shape
        q = self.q(x).view(B, L, 2, 3).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, 3).unbind(2)
        k, v = k.unsqueeze(1).expand(B, 2, L, 3), v.unsqueeze(1).repeat_interleave(2, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)


class TopOneExperts(nn.Module):
    """Each token routed to one of two experts by its own router score: dense (masks) or sparse (the tokens gathered
    per expert, rows of every example in one call, in an order the data sets)."""

    def __init__(self, sparse):
        super().__init__()
        self.router, self.sparse = nn.Linear(D, 2), sparse
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        choice = scores.argmax(-1)
        if not self.sparse:
            return sum((choice == e).unsqueeze(-1) * scores[..., e:e + 1] * ex(x) for e, ex in enumerate(self.experts))
        flat, c, s = x.reshape(-1, D), choice.reshape(-1), scores.reshape(-1, 2)
        out = torch.zeros_like(flat)
        for e, ex in enumerate(self.experts):
            rows = (c == e).nonzero().squeeze(-1)
            if len(rows):
                out = out.index_add(0, rows, ex(flat[rows]) * s[rows, e:e + 1])
        return out.view(x.shape)


class SqueezeExcite(nn.Module):
    """A gate per example from a Linear of its tokens' maximum: a (B, D) call beside (B, T, D) ones."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x * torch.sigmoid(self.lin(x.amax(1))).unsqueeze(1)


class FeatureSplit(nn.Module):
    """Two Linears on the two halves of the features, concatenated."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D // 2, D // 2), nn.Linear(D // 2, D // 2, bias=False)

    def forward(self, x):
        return torch.cat([self.a(x[..., : D // 2]), self.b(x[..., D // 2:])], -1)


class Cumulative(nn.Module):
    """A causal running mean over the positions of a Linear's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        return y.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).unsqueeze(-1)


class Fourier(nn.Module):
    """FNet's mixing of the positions: the real part of an FFT over them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.fft.fft(self.lin(x), dim=1).real


class RearrangedBatch(nn.Module):
    """One Linear on views of the batch stacked on dim 0 (2B rows: the batch and a scaled copy, concatenated, or the
    batch repeated; layout.TILED_LAYOUT), on the two parts of a batch chunked (refused: no call holds the batch), or
    on the batch in reverse order (refused: a permutation is no layout the proof tries)."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(D, D), kind

    def forward(self, x):
        B = len(x)
        if self.kind == "cat":
            y = self.lin(torch.cat([x, 0.5 * x]))
            return y[:B] + y[B:]
        if self.kind == "repeat":
            return self.lin(x.repeat(2, 1, 1)).view(2, B, *x.shape[1:]).mean(0)
        if self.kind == "chunks":
            return torch.cat([self.lin(c) for c in x.chunk(2)])
        return self.lin(x.flip(0)).flip(0)  # "flipped"


class TupleOutput(nn.Module):
    """A module with parameters of its own and no rule (the fallback) returning a tuple, or a dict."""

    def __init__(self, as_dict):
        super().__init__()
        self.w, self.s = nn.Parameter(torch.randn(D, D) / D ** 0.5), nn.Parameter(torch.ones(D))
        self.as_dict = as_dict

    def forward(self, x):
        a, b = x @ self.w, torch.tanh(x) * self.s
        return {"a": a, "b": b} if self.as_dict else (a, b)


class TakesTuple(nn.Module):
    """TupleOutput's two outputs summed."""

    def __init__(self, as_dict):
        super().__init__()
        self.inner = TupleOutput(as_dict)

    def forward(self, x):
        out = self.inner(x)
        a, b = (out["a"], out["b"]) if isinstance(out, dict) else out
        return a + 0.5 * b


class MaskedByData(nn.Module):
    """Each example's own data masks its tokens: masked mean pooled back in."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        m = (x[..., :1] > 0).to(x.dtype)
        y = self.lin(x) * m
        return y + (y.sum(1, keepdim=True) / (m.sum(1, keepdim=True) + 1))


class EmbeddingOfArgmax(nn.Module):
    """An Embedding of ids the activations set: each token's argmax feature."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(D, D)

    def forward(self, x):
        return x + self.emb(x.argmax(-1))


class Conv2dOnTokens(nn.Module):
    """A 3x3 Conv2d over (positions, features) as an image of one channel."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(x.unsqueeze(1)).squeeze(1)


class GradientHookScale(nn.Module):
    """A tensor hook on a Linear's output that doubles its gradient (per example: no mixing)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(lambda g: 2 * g)
        return y


class SubclassedLinear(nn.Linear):
    """A Linear subclass whose forward is not Linear's."""

    KINDS = ("scaled_weight", "extra_bias", "normalised_input", "transposed_weight", "super")

    def __init__(self, kind):
        super().__init__(D, D)
        self.kind = kind

    def forward(self, x):
        k = self.kind
        if k == "scaled_weight":
            return F.linear(x, 2 * self.weight, self.bias)
        if k == "extra_bias":
            return super().forward(x) + self.bias
        if k == "normalised_input":
            return super().forward(F.normalize(x, dim=-1))
        if k == "transposed_weight":
            return x @ self.weight + self.bias
        return super().forward(x) * 1.5


class MixesExamplesFurther(nn.Module):
    """More blocks DP-SGD must refuse: a scale by the batch's norm, a maximum or a standard deviation over the batch,
    each without gradient; a capacity over the batch's tokens; a gradient hook or a custom backward averaging the
    gradient over the batch; a scale by the batch size; the first example's data masking or added into the others
    without gradient; the others shuffled in an order the data sets; means over chunks of the batch; a cumulative sum
    or a normalisation over the batch; a detached mean in train() mode only; an attention mask from the batch's mean;
    a count over the batch; a Linear subclass whose forward centres its input on the batch."""

    KINDS = ("global_norm_without_gradient", "capacity", "gradient_hook_mean", "custom_backward_mean",
             "by_batch_size", "max_without_gradient", "masked_by_first", "std_without_gradient", "shuffled_by_data",
             "chunk_mean", "cumsum_over_batch", "norm_over_batch", "train_only_mean_without_gradient",
             "mask_from_the_batch", "count_of_the_batch", "subclass_centering", "in_place_from_first")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = _Centring(D, D) if kind == "subclass_centering" else nn.Linear(D, D)

    def forward(self, x):
        k = self.kind
        if k == "in_place_from_first":
            x = x.clone()
            with torch.no_grad():
                x[1:] += 0.3 * x[:1]
            return self.lin(x)
        if k == "mask_from_the_batch":
            mask = x.detach().mean(0)[..., 0] > 0  # (T,): shared by the batch
            w = (self.lin(x) @ x.transpose(1, 2)).masked_fill(~mask, -1e4).softmax(-1)
            return w @ x
        if k == "masked_by_first":
            return self.lin(x) * (x.detach()[:1] > 0)
        y = self.lin(x)
        if k == "global_norm_without_gradient":
            return y / y.detach().norm()
        if k == "capacity":
            flat = y.reshape(-1, D)
            keep = flat[:, 0].detach().topk(len(flat) // 2).indices
            return torch.zeros_like(flat).index_copy(0, keep, flat[keep]).view(y.shape)
        if k == "gradient_hook_mean":
            if y.requires_grad:
                y.register_hook(lambda g: g - g.mean(0, keepdim=True))
            return y
        if k == "custom_backward_mean":
            return _MeanInBackward.apply(y)
        if k == "by_batch_size":
            return y * len(x) / 5
        if k == "max_without_gradient":
            return y - y.detach().amax(0, keepdim=True)
        if k == "std_without_gradient":
            return y / (y.detach().std(0, keepdim=True) + 1) if len(x) > 1 else y
        if k == "shuffled_by_data":
            return y + 0.3 * y.detach()[x.detach()[:, 0, 0].argsort()]
        if k == "chunk_mean":
            return torch.cat([c - c.mean(0, keepdim=True) for c in y.split(2)])
        if k == "cumsum_over_batch":
            return y.cumsum(0)
        if k == "norm_over_batch":
            return F.layer_norm(y.transpose(0, -1), (len(y),)).transpose(0, -1)
        if k == "train_only_mean_without_gradient":
            return y - y.detach().mean(0, keepdim=True) if self.training else y
        if k == "count_of_the_batch":
            return y / ((x.detach() > 0).sum() + 1)
        return y  # subclass_centering: the Linear's own forward mixes


class _Centring(nn.Linear):
    """A Linear whose forward takes the batch's detached mean off its input."""

    def forward(self, x):
        return super().forward(x - x.detach().mean(0, keepdim=True))


class _MeanInBackward(torch.autograd.Function):
    """The identity, whose backward gives every example the batch's mean gradient."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g.mean(0, keepdim=True).expand_as(g).contiguous()


def third_generation_makers(rng):
    """The makers of the third generation's blocks that keep their examples apart (``rng``: random.Random)."""
    return [Rotary, GroupedQuery, lambda: TopOneExperts(rng.random() < 0.5), SqueezeExcite, FeatureSplit, Cumulative,
            Fourier, lambda: RearrangedBatch(rng.choice(["cat", "repeat", "chunks", "flipped"])),
            lambda: TakesTuple(rng.random() < 0.5), MaskedByData, EmbeddingOfArgmax, Conv2dOnTokens,
            GradientHookScale, lambda: SubclassedLinear(rng.choice(SubclassedLinear.KINDS))]
