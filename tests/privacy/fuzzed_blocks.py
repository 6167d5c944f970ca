"""The differential fuzzer's blocks (test_fuzzed_models.py): small custom modules over (B, T, D) activations.

Each keeps its examples apart, except MixesExamples (which DP-SGD must refuse in every form) and ReadsAChildsWeight (a
parameter read outside its module's forward, refused too). block_makers lists the makers the generator draws from.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

T, D = 4, 6


class Scale(nn.Module):
    """A raw (D,) parameter used elementwise, in one of several ways."""

    KINDS = ("mul", "exp", "affine", "twice", "div", "scalar", "squared")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.s = nn.Parameter(torch.randn(D) * 0.5 + 1)
        self.b = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x):
        s, b = self.s, self.b
        return {"mul": lambda: x * s, "exp": lambda: x * s.exp(), "affine": lambda: x * s + b,
                "twice": lambda: x * s + s * b + torch.tanh(x) * s, "div": lambda: x / (s.abs() + 1),
                "scalar": lambda: x * s.sum() + b, "squared": lambda: x * s * s + b}[self.kind]()


class RawProduct(nn.Module):
    """A raw (D, D) weight in a matrix product, in one of several ways."""

    KINDS = ("linear", "matmul", "matmul_t", "einsum", "gram", "twice", "both_sides")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.b = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x):
        w, b = self.w, self.b
        return {"linear": lambda: F.linear(x, w, b), "matmul": lambda: x @ w, "matmul_t": lambda: x @ w.t() + b,
                "einsum": lambda: torch.einsum("...d,de->...e", x, w), "gram": lambda: x @ (w @ w.t()) / D,
                "twice": lambda: x @ w + (x * x) @ w * 0.1,
                "both_sides": lambda: x @ w + torch.tanh(x) @ w.t()}[self.kind]()


class Positions(nn.Module):
    """A (1, T, D) parameter shared by the batch, broadcast by the addition."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(1, T, D) * 0.1)

    def forward(self, x):
        return x + self.p


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class OneParameterTwoOwners(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class SoftmaxAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D, bias=False)

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / D ** 0.5, -1) @ x


class SDPA(nn.Module):
    """Causal, or with keys masked by the data itself."""

    def __init__(self, masked):
        super().__init__()
        self.qkv, self.masked = nn.Linear(D, 3 * D), masked

    def forward(self, x):
        q, k, v = (t.unsqueeze(1) for t in self.qkv(x).chunk(3, -1))
        if not self.masked:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        keep = x[..., 0] > -0.5
        keep[:, 0] = True
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])[:, 0]


class EinsumAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = nn.Linear(D, D), nn.Parameter(torch.randn(D, D) / D)

    def forward(self, x):
        scores = torch.einsum("btd,bsd->bts", self.q(x), x).softmax(-1)
        return torch.einsum("bts,bsd,de->bte", scores, x, self.v)


class TorchAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(D, D, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


class Convolutions(nn.Module):
    """Conv1d over the tokens, or Conv2d and GroupNorm over (T, D) as an image."""

    def __init__(self, two_d):
        super().__init__()
        self.two_d = two_d
        if two_d:
            self.conv, self.norm, self.out = nn.Conv2d(1, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Conv2d(2, 1, 1)
        else:
            self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, x):
        if self.two_d:
            return self.out(torch.relu(self.norm(self.conv(x.unsqueeze(1))))).squeeze(1)
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class ClassToken(nn.Module):
    """A learned token concatenated to each example (ViT), the last position dropped to keep T."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, D) * 0.3)

    def forward(self, x):
        return torch.cat([self.cls.expand(x.shape[0], 1, D), x], 1)[:, :-1]


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.g = nn.Linear(D, 2 * D), nn.Parameter(torch.randn(D) * 0.2)

    def forward(self, x):
        a, b = self.up(x).chunk(2, -1)
        return a * torch.sigmoid(b + self.g)


class InPlace(nn.Module):
    """In-place ops on a layer's output and on a raw parameter's product."""

    def __init__(self):
        super().__init__()
        self.lin, self.s = nn.Linear(D, D), nn.Parameter(torch.randn(D) * 0.3 + 1)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)
        y[:, 0] = 0
        return F.relu(y * self.s, inplace=True)


class PartlyDetached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.s = nn.Linear(D, D), nn.Parameter(torch.randn(D) * 0.3 + 1)

    def forward(self, x):
        y = self.lin(x)
        return y + 0.5 * y.detach() + x * self.s.detach() + x * self.s


class DataDependent(nn.Module):
    """A gather of the tokens in an order the data sets, and a mask of a layer's output."""

    def __init__(self):
        super().__init__()
        self.lin, self.s = nn.Linear(D, D), nn.Parameter(torch.randn(D) * 0.3)

    def forward(self, x):
        order = x[..., 0].argsort(1)
        y = self.lin(torch.gather(x, 1, order.unsqueeze(-1).expand(-1, -1, D)))
        return torch.where(y > 0, y * self.s, y)


class Reshaped(nn.Module):
    """A Linear on the flattened tokens (B * T, D), on the transposed batch (T, B, D), or on the tokens and on their
    mean (one Linear, two shapes)."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(D, D), kind

    def forward(self, x):
        if self.kind == "rows":
            return self.lin(x.reshape(-1, D)).reshape(x.shape)
        if self.kind == "transposed":
            return self.lin(x.transpose(0, 1)).transpose(0, 1)
        return self.lin(x) + self.lin(x.mean(1)).unsqueeze(1)


class Transposed(nn.Module):
    """A block that acts on each token alone, run on the transposed batch (T, B, D): a layout proof (or, without a
    rule, the fallback's split) on dim 1."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(0, 1)).transpose(0, 1)


def tokenwise_makers(rng):
    """The makers of the blocks that act on each token alone (Transposed's)."""
    return [lambda: nn.Linear(D, D), lambda: nn.LayerNorm(D), lambda: Scale(rng.choice(Scale.KINDS)),
            lambda: RawProduct(rng.choice(RawProduct.KINDS)), CustomFunction, Bilinear, WeightNormed, Gated,
            lambda: RawWeightOps(rng.choice(("bmm", "addcmul", "where", "masked_fill", "sliced"))),
            lambda: FunctionalNorm(rng.choice(("layer_norm", "rms_norm"))), lambda: Parametrized(rng.random() < 0.5)]


class OnTheFirstExample(nn.Module):
    """A Linear on the first example only, the others passed as they are."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.cat([self.lin(x[:1]), x[1:]], 0)


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))

    def forward(self, x):
        return self.lin(x)


class Residual(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class ByCustomFunction(torch.autograd.Function):
    """x @ w with its own backward (a user's fused kernel)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.reshape(-1, D).t() @ g.reshape(-1, D)


class CustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)

    def forward(self, x):
        return ByCustomFunction.apply(x, self.w)


class IndexedTable(nn.Module):
    """A raw (5, D) table looked up at indices the data sets (a relative position bias), in one of several ways."""

    KINDS = ("getitem", "embedding", "index_select", "gather")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.table = nn.Parameter(torch.randn(5, D) * 0.3)

    def forward(self, x):
        index = (x[..., 0] > 0).long() + 2 * (x[..., 1] > 0).long()  # (B, T) in 0..3
        table = self.table
        return x + {"getitem": lambda: table[index], "embedding": lambda: F.embedding(index, table),
                    "index_select": lambda: table.index_select(0, index.reshape(-1)).reshape(x.shape),
                    "gather": lambda: torch.gather(table.unsqueeze(0).expand(len(x), -1, -1), 1,
                                                   index.unsqueeze(-1).expand(-1, -1, D))}[self.kind]()


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(D, D, D)

    def forward(self, x):
        return self.bilinear(x, torch.tanh(x))


class PReLU(nn.Module):
    """One slope per channel, on (B, D, T)."""

    def __init__(self):
        super().__init__()
        self.prelu = nn.PReLU(D)

    def forward(self, x):
        return self.prelu(x.transpose(1, 2)).transpose(1, 2)


class LSTM(nn.Module):
    def __init__(self, projected):
        super().__init__()
        self.lstm = nn.LSTM(D, D + 2 if projected else D, batch_first=True, proj_size=D if projected else 0)

    def forward(self, x):
        return self.lstm(x)[0]


class ShapedConvolution(nn.Module):
    """A Conv1d over the tokens with groups, dilation or stride (resized back to T)."""

    KINDS = ("groups", "dilated", "strided")

    def __init__(self, kind):
        super().__init__()
        self.conv = {"groups": lambda: nn.Conv1d(D, D, 3, padding=1, groups=2),
                     "dilated": lambda: nn.Conv1d(D, D, 2, padding=1, dilation=2),
                     "strided": lambda: nn.Conv1d(D, D, 2, stride=2)}[kind]()

    def forward(self, x):
        y = self.conv(x.transpose(1, 2))
        return (y if y.shape[-1] == T else F.interpolate(y, size=T)).transpose(1, 2)


class Checkpointed(nn.Module):
    """A Linear and a LayerNorm in an activation checkpoint, reentrant or not."""

    def __init__(self, reentrant):
        super().__init__()
        self.lin, self.norm, self.reentrant = nn.Linear(D, D), nn.LayerNorm(D), reentrant

    def forward(self, x):
        return checkpoint(lambda t: self.norm(torch.tanh(self.lin(t))), x, use_reentrant=self.reentrant)


class RawWeightOps(nn.Module):
    """Raw parameters through other ops: a slice of a weight expanded over the batch in bmm and baddbmm, addcmul,
    where, masked_fill, two slices of one weight, cdist."""

    KINDS = ("bmm", "baddbmm", "addcmul", "where", "masked_fill", "sliced", "cdist")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(D, 2 * D) / D ** 0.5)
        self.s = nn.Parameter(torch.randn(D) * 0.3 + 1)

    def forward(self, x):
        w, s, batch = self.w[:, :D], self.s, len(x)
        return {"bmm": lambda: torch.bmm(x, w.expand(batch, D, D)),
                "baddbmm": lambda: torch.baddbmm(x, x, w.unsqueeze(0).expand(batch, D, D)),
                "addcmul": lambda: torch.addcmul(x, x, s, value=0.5),
                "where": lambda: torch.where(x > 0, s.expand_as(x), x),
                "masked_fill": lambda: (x * s).masked_fill(x < -1, 0.0),
                "sliced": lambda: x @ self.w[:, D:] + x @ w.t(),
                "cdist": lambda: torch.cdist(x, self.w.t()[:T].expand(batch, T, D))[..., :1] * x}[self.kind]()


class FunctionalNorm(nn.Module):
    """F.layer_norm, F.rms_norm and F.group_norm on raw parameters, or an affine InstanceNorm1d."""

    KINDS = ("layer_norm", "rms_norm", "group_norm", "instance_norm")

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.g, self.b = nn.Parameter(torch.randn(D) * 0.3 + 1), nn.Parameter(torch.randn(D) * 0.1)
        if kind == "instance_norm":
            self.norm = nn.InstanceNorm1d(D, affine=True)

    def forward(self, x):
        if self.kind == "layer_norm":
            return F.layer_norm(x, (D,), self.g, self.b)
        if self.kind == "rms_norm":
            return F.rms_norm(x, (D,), self.g)
        channels = x.transpose(1, 2)
        out = F.group_norm(channels, 2, self.g, self.b) if self.kind == "group_norm" else self.norm(channels)
        return out.transpose(1, 2)


class Parametrized(nn.Module):
    """A Linear under torch's spectral norm (its power iteration updates buffers in every training forward) or
    orthogonal parametrization."""

    def __init__(self, spectral):
        super().__init__()
        parametrization = nn.utils.parametrizations.spectral_norm if spectral else nn.utils.parametrizations.orthogonal
        self.lin = parametrization(nn.Linear(D, D))

    def forward(self, x):
        return self.lin(x)


class MixesExamples(nn.Module):
    """A block DP-SGD must refuse: the batch's mean with or without gradient, a roll over the batch with or without
    gradient, the first example's input given to every example, the second given something of the third's without
    gradient (no example depends on the last: the removal's rerun must reverse the others to see it), adjacent pairs
    swapping something without gradient, a sort or a median over the batch, attention over the batch's examples, a
    running mean kept in a buffer and used in the same forward, BatchNorm in train() mode, the examples laid side by
    side in one row of a Linear, a raw parameter times the batch's sum."""

    KINDS = ("mean", "mean_without_gradient", "roll", "roll_without_gradient", "first_to_all",
             "second_gets_the_thirds", "pairs_without_gradient", "sorted", "median", "attention_over_the_batch",
             "running_mean", "batch_norm", "side_by_side", "raw_parameter_on_the_sum")

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(D, D), kind
        # Only the kinds that use them: a parameter of the block's own would send every kind through the fallback,
        # whose proof of its inputs reads gradients (and so sees a mixing that only the forward check should).
        if kind == "raw_parameter_on_the_sum":
            self.s = nn.Parameter(torch.randn(D) * 0.3 + 1)
        if kind == "running_mean":
            self.register_buffer("running", torch.zeros(D))
        if kind == "batch_norm":
            self.norm = nn.BatchNorm1d(D)

    def forward(self, x):
        k = self.kind
        if k == "first_to_all":
            return x + self.lin(x[:1])
        if k == "side_by_side":  # every row half its example's features, half the previous example's
            # (Until 2026-12-07 x.transpose(0, 1).reshape(-1, D): one example's token per row, interleaved, which
            # keeps the examples apart and is exact since layout.TILED_LAYOUT; refused before by the layout proof.)
            return self.lin(torch.cat([x[..., :D // 2], x.roll(1, 0)[..., D // 2:]], -1))
        if k == "raw_parameter_on_the_sum":
            return x * self.s + 0.1 * x.sum(0, keepdim=True) * self.s
        if k == "attention_over_the_batch":
            pooled = x.mean(1)
            return x + ((self.lin(pooled) @ pooled.t()).softmax(-1) @ pooled).unsqueeze(1)
        if k == "batch_norm":
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        y = self.lin(x)
        if k == "mean":
            return y - y.mean(0, keepdim=True)
        if k == "roll":
            return y + 0.1 * y.roll(1, 0)
        if k == "roll_without_gradient":
            return y + 0.3 * y.detach().roll(1, 0)
        if k == "sorted":
            return y + 0.2 * y.sort(0).values
        if k == "median":
            return y * (y > y.median(0, keepdim=True).values.detach())
        if k == "second_gets_the_thirds":
            return torch.tanh(torch.cat([y[:1], y[1:2] + torch.sin(3 * x[2:3]), y[2:]]) if len(x) > 2 else y)
        if k == "pairs_without_gradient":
            even = len(y) - len(y) % 2
            other = y.detach().clone()
            other[:even] = other[:even].reshape(even // 2, 2, *y.shape[1:]).flip(1).reshape(even, *y.shape[1:])
            return y + 0.3 * other
        if k == "running_mean":
            self.running.mul_(0.9).add_(0.1 * y.detach().mean((0, 1)))
            return y - self.running
        with torch.no_grad():
            mean = y.mean(0, keepdim=True)
        return y - mean


class ReadsAChildsWeight(nn.Module):
    """A parent that reads its child's weight outside the child's forward: refused."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight * 0.1


def block_makers(rng):
    """The makers of the blocks that keep their examples apart, each drawing its kind from ``rng`` (random.Random)."""
    return [
        lambda: nn.Linear(D, D), lambda: nn.Linear(D, D, bias=False), lambda: nn.LayerNorm(D), lambda: nn.RMSNorm(D),
        lambda: nn.GELU(), lambda: Scale(rng.choice(Scale.KINDS)), lambda: RawProduct(rng.choice(RawProduct.KINDS)),
        Positions, CalledTwice, OneParameterTwoOwners, SoftmaxAttention, lambda: SDPA(rng.random() < 0.5),
        EinsumAttention, TorchAttention, Recurrent, lambda: Convolutions(rng.random() < 0.5), ClassToken, Gated,
        InPlace, PartlyDetached, DataDependent, lambda: Reshaped(rng.choice(["rows", "transposed", "two_shapes"])),
        OnTheFirstExample, WeightNormed, CustomFunction, lambda: IndexedTable(rng.choice(IndexedTable.KINDS)),
        Bilinear, PReLU, lambda: LSTM(rng.random() < 0.5),
        lambda: ShapedConvolution(rng.choice(ShapedConvolution.KINDS)), lambda: Checkpointed(rng.random() < 0.5),
        lambda: RawWeightOps(rng.choice(RawWeightOps.KINDS)), lambda: FunctionalNorm(rng.choice(FunctionalNorm.KINDS)),
        lambda: Parametrized(rng.random() < 0.5), lambda: Transposed(rng.choice(tokenwise_makers(rng))()),
    ]
