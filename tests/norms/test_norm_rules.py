"""Every norm rule against the per-example loop, float64, every example clipped and none clipped."""
import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ghostdp
import transformers
from ghostdp.norms import factors
from conftest import assert_exact


def head_loss(out, target_weights):
    """A per-example loss that is nonlinear in the layer output."""
    return (out.tanh() * target_weights).flatten(1).sum(1) + 0.1 * out.flatten(1).pow(2).sum(1)


def check_module(model, x, B=None, forward=None, rtol=1e-9):
    B = B or x.shape[0]
    forward = forward or (lambda inp: model(inp))
    with torch.no_grad():
        w = torch.randn_like(forward(x[:1]).float().double()[0])

    def batch_losses():
        return head_loss(forward(x), w)

    def example_loss(i):
        return head_loss(forward(x[i:i + 1]), w).sum()

    return assert_exact(model, batch_losses, example_loss, B, rtol)


@pytest.mark.parametrize("shape", [(5, 8), (5, 2, 8), (5, 20, 8), (4, 3, 2, 8)], ids=["2d", "3d-gram", "3d-instantiate", "4d"])
def test_linear(shape):
    check_module(nn.Linear(8, 6), torch.randn(*shape))


def test_linear_without_bias_and_frozen_bias():
    check_module(nn.Linear(8, 6, bias=False), torch.randn(4, 3, 8))
    lin = nn.Linear(8, 6)
    lin.bias.requires_grad_(False)
    check_module(lin, torch.randn(4, 3, 8))


def test_linear_tiled_gram_and_chunked_instantiation(monkeypatch):
    monkeypatch.setattr(factors, "ELEMENT_BUDGET", 64)  # forces tiles of a few tokens and 1-example chunks
    check_module(nn.Linear(16, 16), torch.randn(3, 9, 16))  # Gram, tiled
    check_module(nn.Linear(4, 3), torch.randn(3, 30, 4))  # instantiation, chunked


def test_embedding_with_padding_and_repeats():
    emb = nn.Embedding(7, 5, padding_idx=0)
    ids = torch.tensor([[1, 1, 0, 3], [0, 0, 2, 2], [6, 5, 4, 6]])
    check_module(emb, ids)


def test_embedding_padding_rows_get_no_gradient():
    emb = nn.Embedding(7, 5, padding_idx=0)
    ids = torch.tensor([[0, 0, 1], [2, 0, 0]])
    controller = ghostdp.GhostClipping(emb, 1e-3)
    controller.loss(emb(ids).pow(2).sum((1, 2)), "sum").backward()
    assert torch.all(emb.weight.grad[0] == 0)


def bags_of(examples, layout):
    """nn.EmbeddingBag's arguments for ``examples`` (a list of (ids, weights) per example, one bag each): a 2-D
    input where every bag has one length, else a 1-D input cut at offsets (with the last offset or not)."""
    ids = [torch.tensor(i, dtype=torch.long) for i, _ in examples]
    weights = [torch.tensor(w, dtype=torch.float64) for _, w in examples]
    if layout == "2d":
        return torch.stack(ids), None, torch.stack(weights)
    offsets = torch.tensor([0] + [len(i) for i in ids]).cumsum(0)
    return torch.cat(ids), offsets if layout == "offsets-with-last" else offsets[:-1], torch.cat(weights)


@pytest.mark.parametrize("layout", ["2d", "offsets", "offsets-with-last"])
@pytest.mark.parametrize("mode,padding_idx,weighted", [("sum", None, False), ("sum", 2, True), ("mean", None, False),
                                                       ("mean", 2, False), ("max", None, False), ("max", 2, False)])
def test_embedding_bag(layout, mode, padding_idx, weighted):
    """Modes sum (with per_sample_weights), mean and max (since 2026-11-28; the fallback's before) by the rule;
    padding_idx left out."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=padding_idx, include_last_offset=layout == "offsets-with-last")
    if layout == "2d":
        examples = [([1, 2, 1], [0.5, -1.0, 2.0]), ([2, 2, 7], [1.0, 3.0, -2.0]), ([8, 0, 3], [1.5, 0.5, 1.0])]
    else:  # bags of several lengths
        examples = [([1, 2, 1, 5], [0.5, -1.0, 2.0, 1.0]), ([4], [3.0]), ([8, 0, 3], [1.5, 0.5, 1.0]),
                    ([2, 6, 2], [1.0, 2.0, -1.0])]
    head = torch.randn(4)

    def losses(chosen):
        ids, offsets, weights = bags_of(chosen, layout)
        out = bag(ids, offsets, per_sample_weights=weights if weighted else None)
        return (out.tanh() @ head) + 0.1 * out.pow(2).sum(1)

    from ghostdp.norms.embedding import embedding_bag_rule
    assert ghostdp.norms.find_norm_rule(bag) is embedding_bag_rule
    model = nn.Sequential(bag)
    assert_exact(model, lambda: losses(examples), lambda i: losses([examples[i]]).sum(), len(examples))


def test_a_1d_embedding_bag_used_twice_and_tied_to_a_head_is_exact():
    """Cross terms of a table read by two 1-D nn.EmbeddingBag calls (their positions merged) and by a tied output
    layer (a product through materialised gradients)."""
    torch.manual_seed(0)
    bag, head = nn.EmbeddingBag(9, 4), nn.Linear(4, 9, bias=False)
    head.weight = bag.weight
    model = nn.ModuleDict({"bag": bag, "head": head})
    examples = [([1, 2, 1, 5], [3, 3]), ([4], [8, 0, 2]), ([8, 0, 3], [7]), ([2, 6, 2], [2, 2, 2, 2])]

    def losses(chosen):
        first = bags_of([(a, [1.0] * len(a)) for a, _ in chosen], "offsets")
        second = bags_of([(b, [1.0] * len(b)) for _, b in chosen], "offsets")
        out = bag(first[0], first[1]) + 0.5 * bag(second[0], second[1])
        return head(out.tanh()).pow(2).sum(1)

    assert_exact(model, lambda: losses(examples), lambda i: losses([examples[i]]).sum(), len(examples))


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_a_1d_embedding_bag_is_recorded_without_waiting_for_the_device_and_keeps_its_positions(mode):
    """A training forward of a 1-D nn.EmbeddingBag, its rule and its factor's norm dispatch no op whose output size
    depends on the values (the longest bag read back to pad every bag to it: a host sync in each forward on a GPU,
    before 2026-11-28), and the factor holds a row of G per position, not bags x the longest bag."""
    from ghostdp.norms.embedding import bag_members, embedding_bag_rule
    from norms.test_embedding_factor import VALUE_SIZED, dispatched_ops
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=0)
    ids, offsets = torch.randint(0, 9, (53,)), torch.tensor([0, 50, 51, 52])  # one long bag, three of one
    controller = ghostdp.GhostClipping(bag, 1.0)
    made = {}

    def forward_rule_and_norm():
        made["out"] = bag(ids, offsets)
        made["factor"] = embedding_bag_rule(bag, bag_members(bag, (ids, offsets), {}), torch.randn(4, 4),
                                            {"weight"})["weight"]
        made["factor"].sq_norm(), made["factor"].token_mass()

    try:
        seen = dispatched_ops(forward_rule_and_norm)
        controller.loss(made["out"].pow(2).sum(1), "sum").backward()
    finally:
        controller.detach()
    assert "embedding_bag" in "".join(seen) and not [op for op in seen if op in VALUE_SIZED], seen
    assert made["factor"].grads.shape == (53, 4)


def test_a_1d_embedding_bag_in_a_batch_of_no_bags_has_the_tables_shape_and_no_gradient():
    """An empty batch (Poisson sampling): the rule's factor still has the table's shape, and sums to zeros."""
    from ghostdp.norms.embedding import bag_members, embedding_bag_rule
    bag = nn.EmbeddingBag(9, 4)
    inputs = bag_members(bag, (torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.long)), {})
    factor = embedding_bag_rule(bag, inputs, torch.zeros(0, 4), {"weight"})["weight"]
    assert factor.param_shape == bag.weight.shape and factor.sq_norm().shape == (0,)
    assert torch.equal(factor.weighted_sum(torch.zeros(0)), torch.zeros(9, 4))


def test_embedding_bag_with_several_bags_per_example_is_refused_with_the_fix():
    bag, head = nn.EmbeddingBag(9, 4), nn.Linear(8, 1)
    model = nn.ModuleDict({"bag": bag, "head": head})
    ids, offsets = torch.randint(0, 9, (12,)), torch.arange(0, 12, 2)  # 6 bags: 2 for each of 3 examples
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="module 'bag' .*give each example one bag"):
        controller.loss(head(bag(ids, offsets).reshape(3, 8)).squeeze(-1).pow(2), "sum").backward()
    controller.detach()


@pytest.mark.parametrize("layout", ["2d", "offsets", "offsets-with-last"])
def test_embedding_bag_max_factor_is_each_examples_gradient(layout):
    """Mode "max": the rule's factor equals each bag's own autograd gradient, where a bag repeats a row, where two
    rows tie (torch's backward gives G to the row its forward picked) and with padding_idx 0 (a bag of padding alone is
    empty, and torch's CPU kernel names row 0 as its pick); its norm and clipped sum too. (Before 2026-11-28 mode
    "max" took the fallback, and bag_members read it as a sum.)"""
    from ghostdp.norms.embedding import bag_members, embedding_bag_rule
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 4, mode="max", padding_idx=0, include_last_offset=layout == "offsets-with-last").double()
    with torch.no_grad():
        bag.weight[5] = bag.weight[3]  # a tie in every feature: torch picks one of the two rows
    if layout == "2d":
        examples = [[1, 2, 1], [3, 5, 7], [0, 0, 0], [8, 8, 2]]
    else:
        examples = [[1, 2, 1, 5], [5, 3], [0, 0], [8, 2, 3, 8, 6]]
    ids, offsets, _ = bags_of([(e, [1.0] * len(e)) for e in examples], layout)
    out = bag(ids, offsets)
    G = torch.randn_like(out)
    factor = embedding_bag_rule(bag, bag_members(bag, (ids, offsets), {}), G, {"weight"})["weight"]
    reference = []
    for i, e in enumerate(examples):
        one_ids, one_offsets, _ = bags_of([(e, [1.0] * len(e))], layout)
        grad, = torch.autograd.grad(bag(one_ids, one_offsets), bag.weight, G[i:i + 1])
        reference.append(grad)
    reference = torch.stack(reference)
    assert reference[2].abs().sum() == 0  # an all-padding bag
    torch.testing.assert_close(factor.materialize(0, len(examples)), reference, rtol=1e-12, atol=0)
    torch.testing.assert_close(factor.sq_norm(), reference.flatten(1).pow(2).sum(1), rtol=1e-12, atol=0)
    weights = torch.randn(len(examples), dtype=torch.float64)
    torch.testing.assert_close(factor.weighted_sum(weights), torch.tensordot(weights, reference, dims=1),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_empty_and_all_padding_bags_have_no_gradient(mode):
    """torch leaves padding_idx out of a bag's reduction (and of its mean's count): such a bag's output is zeros."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=2)
    ids, offsets = torch.tensor([1, 2, 5, 2, 2, 7, 7, 2]), torch.tensor([0, 3, 3, 5])  # bags: [1 2 5] [] [2 2] [7 7 2]
    controller = ghostdp.GhostClipping(bag, 1e3)
    out = bag(ids, offsets)
    controller.loss((out + 1).pow(2).sum(1), "sum").backward()
    norms = controller.last_norms
    controller.detach()
    expected = []
    for lo, hi in ((0, 3), (3, 3), (3, 5), (5, 8)):
        grad, = torch.autograd.grad((bag(ids[lo:hi], torch.tensor([0])) + 1).pow(2).sum(), bag.weight)
        expected.append(grad.norm())
    assert norms[1] == 0 and norms[2] == 0
    torch.testing.assert_close(norms, torch.stack(expected), rtol=1e-12, atol=0)
    _, scales, bag_of = ghostdp.norms.embedding.bag_members(bag, (ids, offsets), {})
    assert bag_of.tolist() == [0, 0, 0, 2, 2, 3, 3, 3]  # the empty bag 1 has no position
    assert scales[bag_of == 2].abs().sum() == 0 and (scales[bag_of == 3] != 0).any()  # bag 2 is all padding


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(stride=2, padding=1),
    dict(dilation=2, padding="same"),
    dict(groups=2, padding=1, padding_mode="reflect"),
    dict(padding=2, padding_mode="circular", bias=False),
])
def test_conv2d(kwargs):
    check_module(nn.Conv2d(4, 6, 3, **kwargs), torch.randn(3, 4, 7, 6))


def test_conv1d_and_conv3d():
    check_module(nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=1), torch.randn(4, 3, 11))
    check_module(nn.Conv1d(4, 4, 3, groups=4), torch.randn(3, 4, 9))  # depthwise
    check_module(nn.Conv3d(2, 3, (2, 3, 2), padding=(1, 0, 1), stride=(1, 2, 1)), torch.randn(3, 2, 4, 5, 3))


def test_transformers_conv1d():
    from transformers.pytorch_utils import Conv1D
    check_module(Conv1D(6, 8), torch.randn(4, 3, 8))


@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.LayerNorm(6), (4, 3, 6)),
    (lambda: nn.LayerNorm((3, 6), bias=False), (4, 2, 3, 6)),
    (lambda: nn.RMSNorm(6), (4, 3, 6)),
    (lambda: nn.RMSNorm(6, eps=1e-3), (4, 6)),
    (lambda: nn.GroupNorm(2, 4), (3, 4, 5, 2)),
    (lambda: nn.GroupNorm(2, 4), (3, 4)),
    (lambda: nn.InstanceNorm1d(4, affine=True), (3, 4, 5)),
    (lambda: nn.InstanceNorm2d(4, affine=True, eps=1e-3), (3, 4, 5, 2)),
    (lambda: nn.InstanceNorm3d(2, affine=True), (3, 2, 3, 2, 2)),
])
def test_normalization_layers(layer, shape):
    torch.manual_seed(1)
    m = layer()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    check_module(m, torch.randn(*shape))


@pytest.mark.parametrize("cls", [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d])
def test_instance_norms_have_a_rule_not_the_fallback(cls):
    from ghostdp.norms.normalization import instance_norm_rule
    assert ghostdp.norms.find_norm_rule(cls(4, affine=True)) is instance_norm_rule
    assert ghostdp.validate.fallback_modules(nn.Sequential(cls(4, affine=True))) == {}


def test_instance_norm_in_eval_mode_reads_its_running_statistics_and_the_rule_updates_none():
    torch.manual_seed(1)
    norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    x = torch.randn(3, 4, 5, 2)
    with torch.no_grad():
        norm(3 * torch.randn(6, 4, 5, 2) + 1)  # running statistics away from the batch's own
        norm.weight.add_(torch.randn(4))
        norm.bias.add_(torch.randn(4))
    with torch.no_grad():  # (the running statistics matter here)
        assert not torch.allclose(norm.eval()(x), F.instance_norm(x, None, None, norm.weight, norm.bias, eps=norm.eps))

    class KeptInEval(nn.Module):  # assert_exact sets training mode: this parent leaves its norm in eval
        def __init__(self):
            super().__init__()
            self.norm = norm.eval()

        def train(self, mode=True):
            self.training = mode
            return self

        def forward(self, inp):
            return self.norm(inp)

    stats = norm.running_mean.clone(), norm.running_var.clone()
    check_module(KeptInEval(), x)
    assert torch.equal(norm.running_mean, stats[0]) and torch.equal(norm.running_var, stats[1])
    # in training the forward updates them once a step (the buffer watch warns of it); the rule never does
    plain = copy.deepcopy(norm).train()
    with torch.no_grad():
        plain(x)
    norm.train()
    controller = ghostdp.GhostClipping(norm, 1.0)
    with pytest.warns(UserWarning, match="changed during a training forward") as warned:
        controller.loss(norm(x).pow(2).sum((1, 2, 3)), "sum").backward()
    assert {"running_mean", "running_var"} <= {str(w.message).split("'")[1] for w in warned}
    controller.detach()
    assert torch.equal(norm.running_mean, plain.running_mean) and torch.equal(norm.running_var, plain.running_var)


@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.LayerNorm(6), (4, 11, 6)),
    (lambda: nn.LayerNorm((3, 6)), (4, 5, 3, 6)),  # positions over one dim before the normalised ones
    (lambda: nn.LayerNorm(6), (4, 3, 5, 6)),       # over two: runs of the first
])
def test_layer_norm_above_the_element_budget_is_formed_over_runs_of_positions(monkeypatch, layer, shape):
    """A LayerNorm whose xhat would exceed ELEMENT_BUDGET forms xhat and G * xhat over runs of positions (at
    the Fast Gradient Clipping post's set-up two float32 temporaries as large as the input): exact against the
    per-example loop, and the same gradients and token masses as formed at once."""
    from ghostdp.norms import normalization
    torch.manual_seed(2)
    m = layer().double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    x, G = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)

    def formed(scale_masses=True):
        call = normalization.LayerNormCall(x, G, m.normalized_shape, m.eps, {"weight", "bias"})
        return call, normalization.form_layer_norms([call], scale_masses=scale_masses)

    whole = formed()[1]
    normalizations = []
    layer_norm = normalization.F.layer_norm
    monkeypatch.setattr(normalization, "ELEMENT_BUDGET", x.numel() // 3)
    monkeypatch.setattr(normalization.F, "layer_norm", lambda *a, **k: normalizations.append(a[0].shape) or
                        layer_norm(*a, **k))
    for name, (grads, mass) in formed()[1].items():
        torch.testing.assert_close(grads, whole[name][0], rtol=1e-12, atol=0)
        torch.testing.assert_close(mass, whole[name][1], rtol=1e-12, atol=0)
    # Formed for DeferredGrams, the masses lack sqrt(positions), which the call keeps and a row read alone applies.
    call, unscaled = formed(scale_masses=False)
    assert call.mass_scale == math.sqrt(math.prod(shape[1:-len(m.normalized_shape)]))
    for name, (grads, mass) in unscaled.items():
        torch.testing.assert_close(mass * call.mass_scale, whole[name][1], rtol=1e-12, atol=0)
        torch.testing.assert_close(call.form()[name].mass, whole[name][1][0], rtol=1e-12, atol=0)
    assert len(normalizations) >= 3 and all(math.prod(s) <= x.numel() // 3 for s in normalizations)
    check_module(m, torch.randn(*shape, dtype=torch.float64))


def test_transformers_rms_norms_have_a_rule_and_are_exact():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    from ghostdp.norms.normalization import transformers_rms_norm_rule
    # GemmaRMSNorm (and OLMo 2's, which casts as Gemma's) forms its own weight gradient in float32 even in a
    # float64 model, so the batched backward (pass 2) carries float32 rounding that no rule can remove: 1e-6.
    for m, rtol in ((LlamaRMSNorm(6), 1e-9), (MixtralRMSNorm(6), 1e-9), (T5LayerNorm(6), 1e-9), (GemmaRMSNorm(6), 1e-6),
                    (Gemma3RMSNorm(6), 1e-6), (Olmo2RMSNorm(6), 1e-6), (Gemma4RMSNorm(6), 1e-6)):
        assert ghostdp.norms.find_norm_rule(m) is transformers_rms_norm_rule
        with torch.no_grad():
            m.weight.add_(torch.randn(6))
        check_module(m, torch.randn(4, 3, 6), rtol=rtol)


def test_layer_norms_written_out_in_float32_have_a_rule_and_are_exact():
    """DeBERTa's (float32 statistics, xhat cast back, then the affine) and Cohere's (no bias, the product in float32,
    as Gemma's: 1e-6), by their code: the fallback's before 2026-11-27. Inputs off zero mean, so that a rule without
    the centring would be off."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.deberta.modeling_deberta import DebertaLayerNorm
    from ghostdp.norms.normalization import cohere_layer_norm_rule, deberta_layer_norm_rule
    for m, rule, rtol in ((DebertaLayerNorm(6), deberta_layer_norm_rule, 1e-9),
                          (CohereLayerNorm(6), cohere_layer_norm_rule, 1e-6)):
        assert ghostdp.norms.find_norm_rule(m) is rule
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(6))
        check_module(m, torch.randn(4, 3, 6) + torch.linspace(-2, 2, 6), rtol=rtol)


def test_subclass_of_a_transformers_rms_norm_keeps_its_rule():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class MyNorm(LlamaRMSNorm):
        pass

    m = MyNorm(6)
    with torch.no_grad():
        m.weight.add_(torch.randn(6))
    check_module(m, torch.randn(4, 3, 6))


class UnknownNorm(nn.Module):
    """A norm layer no rule knows: the fallback handles it exactly."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class CopiedLlamaNorm(nn.Module):
    """LlamaRMSNorm's forward, copied as transformers copies it into other model families."""

    def __init__(self, d=6):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states):
        """A docstring and comments are not part of the body."""
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)  # a comment
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class AlmostLlamaNorm(CopiedLlamaNorm):
    def forward(self, hidden_states):  # mean over dim -2: another function, in one token
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-2, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _doubled(forward):
    @functools.wraps(forward)
    def wrapper(self, hidden_states):
        return 2 * forward(self, hidden_states)
    return wrapper


class DecoratedLlamaNorm(CopiedLlamaNorm):
    """The copied body under a decorator that doubles the output: the source shows the body, not what runs."""
    forward = _doubled(CopiedLlamaNorm.forward)


class MarkedLlamaNorm(CopiedLlamaNorm):
    @torch.no_grad()
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GroupedGemmaNorm(nn.Module):
    """Gemma's forward over another _norm (normalising groups of features, as one transformers class does)."""

    def __init__(self, d=6):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.5, 0.5, d))
        self.eps = 1e-6

    def _norm(self, x):
        x = x.reshape(*x.shape[:-1], -1, 3)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def test_a_forward_matched_by_its_body_needs_the_methods_it_calls_to_match_too():
    from ghostdp.norms.normalization import GEMMA_RMS_NORM_BODY
    from ghostdp.norms.registry import forward_body
    assert forward_body(GroupedGemmaNorm.forward) == GEMMA_RMS_NORM_BODY
    assert ghostdp.norms.find_norm_rule(GroupedGemmaNorm()) is None
    check_module(GroupedGemmaNorm(), torch.randn(4, 3, 6), rtol=1e-6)  # the fallback's (float32 inside)
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    gemma = GemmaRMSNorm(6)
    assert ghostdp.norms.find_norm_rule(gemma) is not None
    gemma._norm = GroupedGemmaNorm._norm.__get__(gemma)  # replaced on the instance: not the body that was checked
    assert ghostdp.norms.find_norm_rule(gemma) is None
    check_module(gemma, torch.randn(4, 3, 6), rtol=1e-6)


def test_a_class_with_a_registered_forward_body_takes_its_rule_and_one_token_off_does_not():
    from ghostdp.norms.normalization import LLAMA_RMS_NORM_BODY, transformers_rms_norm_rule
    from ghostdp.norms.registry import forward_body
    assert forward_body(CopiedLlamaNorm.forward) == LLAMA_RMS_NORM_BODY
    assert ghostdp.norms.find_norm_rule(CopiedLlamaNorm()) is transformers_rms_norm_rule
    check_module(CopiedLlamaNorm(), torch.randn(4, 3, 6))
    assert ghostdp.norms.find_norm_rule(AlmostLlamaNorm()) is None
    check_module(AlmostLlamaNorm(), torch.randn(4, 3, 6))  # the fallback's, exact
    for decorated in (DecoratedLlamaNorm, MarkedLlamaNorm):  # what runs is not the body the source shows
        assert ghostdp.norms.find_norm_rule(decorated()) is None
    check_module(DecoratedLlamaNorm(), torch.randn(4, 3, 6))  # the fallback's, exact
    made_at_run_time = type("Made", (nn.Module,), {"forward": eval("lambda self, hidden_states: hidden_states")})
    assert forward_body(made_at_run_time.forward) is None and ghostdp.norms.find_norm_rule(made_at_run_time()) is None


def test_every_transformers_class_with_a_registered_forward_body_finds_its_rule():
    """The bodies are written as ast.unparse writes transformers' source: a scan of the installed transformers finds
    the classes that have each (and the bodies of the methods it names), LlamaRMSNorm's in well over 50 families,
    and a sample of them, imported, gets the rule (a formatting change in transformers would leave them to the
    fallback: slower, still exact)."""
    import ast
    import importlib
    import pathlib

    import transformers
    from transformers.integrations import moe
    from ghostdp.norms import registry
    root = pathlib.Path(transformers.__file__).parent / "models"
    experts_gate = registry.forward_body(moe._default_apply_gate)
    having = {body: [] for body in registry._FORWARD_RULES}
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text()
        if not any(word in text for word in ("variance_epsilon", "lambda1", "self._norm(", "data_format",
                                             "global_features", "cls_token", "self.pointwise", "embed_scale",
                                             "self.offset", "class_embedding", "pwconv2", "pointwise_conv2",
                                             "relative_position_bias_table", "input_ids_shape", "top_k_index")):
            continue
        for node in ast.parse(text).body:
            methods = {f.name: registry.body_text(f) for f in getattr(node, "body", [])
                       if isinstance(f, ast.FunctionDef)}
            if any("use_experts_implementation" in ast.unparse(d) for d in getattr(node, "decorator_list", [])):
                methods.setdefault("_apply_gate", experts_gate)  # what the decorator sets where the class has none
            entry = registry._FORWARD_RULES.get(methods.get("forward")) if isinstance(node, ast.ClassDef) else None
            if entry is not None and all(registry.body_matches(methods.get(name), body)
                                         for name, body in entry.methods):
                having[methods["forward"]].append(f"transformers.models.{path.parent.name}.{path.stem}.{node.name}")
    assert all(having.values()) and len(sum(having.values(), [])) > 50, {k[:40]: len(v) for k, v in having.items()}
    for body, names in having.items():
        for name in names[:: max(1, len(names) // 6)]:
            module_name, class_name = name.rsplit(".", 1)
            cls = getattr(importlib.import_module(module_name), class_name)
            assert registry.lookup_rule(cls.__new__(cls)) is registry._FORWARD_RULES[body], name


class LayerScale(nn.Module):
    """transformers' LayerScale forward (DINOv2's and ten other classes'), with any shape of scale."""

    def __init__(self, shape):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.linspace(-1.5, 1.5, math.prod(shape)).reshape(shape))

    def forward(self, hidden_state):
        return hidden_state * self.lambda1


@pytest.mark.parametrize("x_shape,scale_shape", [((5, 3, 6), (6,)), ((5, 6), (6,)), ((4, 3, 2, 6), (6,)),
                                                 ((5, 3, 6), (3, 1)), ((5, 3, 6), (3, 6)), ((5, 3, 6), (1, 1)),
                                                 ((5, 3, 6), (1, 1, 6)), ((5, 6), (1, 6))])
def test_layer_scale_is_ruled_by_its_forward_and_exact(x_shape, scale_shape):
    from ghostdp.norms.elementwise import layer_scale_rule
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale
    assert ghostdp.norms.find_norm_rule(Dinov2LayerScale.__new__(Dinov2LayerScale)) is layer_scale_rule
    m = LayerScale(scale_shape)
    assert ghostdp.norms.find_norm_rule(m) is layer_scale_rule
    check_module(m, torch.randn(*x_shape))


def test_a_layer_scale_on_a_sequence_first_input_is_exact_or_refused():
    """A vector scale scales every position alike, so a (T, B, d) input's batch may lie on dim 1: exact. A (T, d)
    scale meets that input's batch dim, giving each example its own row (the batch of 3 is T): not tokenwise,
    so no layout holds and the step is refused; the rule read it batch-first before, and the clipped sum was not
    the gradient."""
    x = torch.randn(3, 4, 6)  # (T, B, d)
    w = torch.randn(3, 4, 6)
    vector = LayerScale((6,))

    def losses(m, sl=slice(None)):
        return (m(x[:, sl]) * w[:, sl]).sum((0, 2)).pow(2)

    assert_exact(vector, lambda: losses(vector), lambda i: losses(vector, slice(i, i + 1)).sum(), 4)
    by_position = LayerScale((3, 6))
    x = torch.randn(3, 3, 6)  # T == B: the (T, d) scale broadcasts against the batch dim
    w = torch.randn(3, 3, 6)
    for clipping in ("ghost", "bookkeeping"):
        controller = ghostdp.GhostClipping(by_position, 1.0, clipping=clipping)
        with pytest.raises(RuntimeError, match="mixes several examples in each of its candidate batch dimensions"):
            controller.loss(losses(by_position), reduction="sum").backward()
        controller.detach()


def test_convnext_v2_global_response_norm_is_ruled_by_its_forward_and_exact():
    from ghostdp.norms.elementwise import global_response_norm_rule
    from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN
    grn = ConvNextV2GRN(6)
    with torch.no_grad():  # zeros at init
        grn.weight.uniform_(-1, 1)
        grn.bias.uniform_(-1, 1)
    assert ghostdp.norms.find_norm_rule(grn) is global_response_norm_rule
    check_module(grn, torch.randn(4, 3, 5, 6))  # (B, H, W, C)
    grn.weight.requires_grad_(False)
    check_module(grn, torch.randn(4, 3, 5, 6))


def test_convberts_separable_convolution_bias_is_ruled_by_its_forward_and_exact():
    from ghostdp.norms.elementwise import separable_conv_rule
    from transformers.models.convbert.modeling_convbert import SeparableConv1D
    conv = SeparableConv1D(transformers.ConvBertConfig(), 4, 6, 3)
    with torch.no_grad():  # zeros at init
        conv.bias.uniform_(-1, 1)
    assert ghostdp.norms.find_norm_rule(conv) is separable_conv_rule
    check_module(conv, torch.randn(4, 4, 7))  # (B, C, T)


def test_a_scale_that_spans_the_batch_dim_is_refused_with_the_fix():
    m = LayerScale((5, 3, 6))
    controller = ghostdp.GhostClipping(m, 1.0)
    with pytest.raises(ValueError, match="cannot be split by example. Fix: freeze it"):
        controller.loss(m(torch.randn(5, 3, 6)).sum((1, 2)), reduction="sum").backward()
    controller.detach()


def test_unknown_norm_layer_uses_the_fallback_exactly():
    assert ghostdp.norms.find_norm_rule(UnknownNorm()) is None
    check_module(UnknownNorm(), torch.randn(4, 3, 6))


@pytest.mark.parametrize("batch_first", [True, False])
def test_gru_and_lstm_fallback_with_hidden_state(batch_first):
    for cls in (nn.GRU, nn.LSTM):
        rnn = cls(4, 5, num_layers=2, batch_first=batch_first)

        def forward(inp, rnn=rnn):
            seq = inp if batch_first else inp.transpose(0, 1)
            out, hidden = rnn(seq)
            h = hidden[0] if isinstance(hidden, tuple) else hidden
            out = out if batch_first else out.transpose(0, 1)
            return torch.cat([out.mean(1), h[-1]], -1)

        check_module(rnn, torch.randn(4, 3, 4), forward=forward)


def test_multihead_attention_fallback():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    check_module(mha, torch.randn(3, 4, 8), forward=lambda x: mha(x, x, x)[0])


class ScaledMLP(nn.Module):
    """A raw parameter next to child modules: the parent's fallback covers `scale` only."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.scale = nn.Parameter(torch.randn(5))
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(5))])

    def forward(self, x):
        return self.inner(x * self.scale).sigmoid() + self.extra[0]


def test_raw_parameters_next_to_children():
    m = ScaledMLP()
    check_module(m, torch.randn(4, 3, 5))


class LinearWithGain(nn.Linear):
    """A Linear subclass that owns an extra parameter: its forward differs, so it gets the fallback."""

    def __init__(self, *a):
        super().__init__(*a)
        self.gain = nn.Parameter(torch.tensor(1.7))

    def forward(self, x):
        return super().forward(x) * self.gain


def test_subclass_with_extra_parameter():
    check_module(LinearWithGain(4, 3), torch.randn(5, 2, 4))


class TwiceAndTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=8)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.emb.weight  # tied embedding / output layer

    def forward(self, ids):
        h = self.emb(ids)
        h = self.mid(torch.tanh(self.mid(h)))  # one module called twice
        return self.head(h) + self.head(h[:, :1])  # and the tied head twice


def test_module_called_twice_and_tied_weights():
    check_module(TwiceAndTied(), torch.tensor([[1, 2, 8, 1], [3, 3, 3, 8], [0, 7, 6, 5]]))


class SharedPositions(nn.Module):
    """Position embeddings looked up with ids of batch size 1 and broadcast, as BERT does."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.pos = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        bias = self.proj(torch.ones(1, ids.shape[1], 4))  # a Linear whose input is shared too
        return self.tok(ids) + self.pos(positions) + bias


def test_batch_shared_inputs():
    check_module(SharedPositions(), torch.randint(0, 10, (4, 5)))


def test_wide_matmul_accumulates_16_bit_inputs_in_float32(monkeypatch):
    a = torch.randn(3, 5, 7).to(torch.bfloat16)
    b = torch.randn(3, 7, 4).to(torch.bfloat16)
    got = factors.wide_matmul(a, b, torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.bmm(a.float(), b.float()))  # CPU: the inputs are upcast first
    assert not factors._tensor_core_path(a, b, torch.float32)
    # The CUDA path (16-bit inputs, cuBLAS returning float32), run on meta tensors: no GPU needed.
    monkeypatch.setattr(factors, "_tensor_core_path", lambda x, y, dt: True)
    for left, right in ((a, b), (a[0], b[0])):
        out = factors.wide_matmul(left.to("meta"), right.to("meta"), torch.float32)
        assert out.dtype == torch.float32 and out.shape == got.shape[3 - left.dim():]


@pytest.mark.parametrize("T", [0, 1, 5, 64, 130])
def test_gram_tiles_on_and_above_the_diagonal_give_the_full_sum(T):
    left, right = torch.randn(3, T, 6), torch.randn(3, T, 4)
    exact = torch.bmm(left.transpose(1, 2), right).pow(2).sum((1, 2))
    for tile in (1, 7, 64, max(T, 1)):
        assert torch.allclose(factors.gram_sq_norm(left, right, torch.float64, tile), exact, rtol=1e-12, atol=0)
    tile = factors.gram_tile(3, T, "cpu")
    assert 1 <= tile and (T < 128 and tile >= T or tile < T)  # split in two from 2 * 64 rows on


def test_the_cost_model_counts_only_the_tiles_it_forms():
    assert factors.gram_fraction(128, 128) == 1.0 and factors.gram_fraction(128, 64) == 0.75
    # T (m + n) = 1.25 m n: instantiation is cheaper for one tile, the Gram once split in two.
    assert not factors.prefers_gram(160, 256, 256) and factors.prefers_gram(160, 256, 256, tile=80)


class SharedInputProjections(nn.Module):
    """Query, key and value projections of one input, as in a transformer's attention."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 12), nn.Linear(16, 20)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        return torch.cat([q.tanh() * k.sum(-1, keepdim=True), v], -1)


def test_layers_reading_one_input_share_its_gram(monkeypatch):
    from ghostdp.norms import batched
    model = SharedInputProjections()
    x = torch.randn(3, 4, 16)  # T (m + n) <= m n for all three: the Gram method
    check_module(model, x)
    gram_rows = []
    gram = batched.gram

    def counting(x, dt):
        gram_rows.append(x.shape[0])
        return gram(x, dt)

    monkeypatch.setattr(batched, "gram", counting)
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.per_example_norms(model(x).pow(2).flatten(1).sum(1))
    controller.detach()
    # Grams of x (once for the three layers) and of the three output grads: 4 tensors of 3 examples,
    # in one batched matmul per width (16: x and the query's output grad; 12; 20).
    assert sorted(gram_rows) == [3, 3, 6]


def test_whole_grams_are_shared_by_views_and_never_found_by_another_tensor():
    grams = factors.InputGrams()
    x = torch.randn(2, 5, 3)
    first = grams.whole(x.view(2, 5, 3), torch.float64)
    assert grams.whole(x.reshape(2, 5, 3), torch.float64) is first       # views of one owner: shared
    assert grams.cached_key(x, torch.float64) is not None
    assert grams.cached_key(x.clone(), torch.float64) is None            # equal values, another tensor
    del first
    data_ptr = x.data_ptr()
    del x  # its memory may go to the next tensor of that size: a weak reference tells them apart
    y = torch.randn(2, 5, 3)
    assert grams.cached_key(y, torch.float64) is None, (data_ptr == y.data_ptr())
    x = torch.randn(2, 5, 3)
    x.mul_(1.0)  # a new version: formed again
    before = grams.whole(x, torch.float64)
    x.mul_(2.0)
    assert grams.whole(x, torch.float64) is not before


def test_input_grams_are_reused_only_for_the_same_unchanged_tensor():
    grams = factors.InputGrams()
    x = torch.randn(2, 5, 3)
    first = grams.tiles(x, torch.float64, 5).get(0, 0, x, x)
    assert grams.tiles(x.reshape(2, 5, 3), torch.float64, 5).get(0, 0, x, x) is first  # a view of x: shared
    x.mul_(2)  # changed in place: its version moved on, the Gram is formed again
    again = grams.tiles(x, torch.float64, 5).get(0, 0, x, x)
    assert again is not first and torch.allclose(again, 4 * first)
    y = x.clone()  # equal values, another tensor: not shared
    assert grams.tiles(y, torch.float64, 5).get(0, 0, y, y) is not again


@pytest.mark.parametrize("layer,shape", [
    (lambda: nn.LayerNorm(16), (4, 12, 16)),
    (lambda: nn.RMSNorm(16), (4, 12, 16)),
    (lambda: nn.GroupNorm(2, 16), (4, 16, 12)),
])
def test_16_bit_normalisation_rules_read_their_inputs_in_their_own_dtype(layer, shape):
    # No float32 tensor as large as the input (x, G, xhat or G * xhat upcast) is made: on a GPU those
    # copies cost 1.8x the layer's own backward and a fifth more working set (BERT-base, B=512). The
    # norms still match float64 to bf16's precision.
    from torch.utils._python_dispatch import TorchDispatchMode
    m = layer()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    x, G = torch.randn(*shape), torch.randn(*shape)
    rule = ghostdp.norms.find_norm_rule(m)
    reference = rule(m, (x,), G, {"weight", "bias"})
    wide_outputs = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype != torch.bfloat16 and t.numel() >= x.numel():
                    wide_outputs.append((str(func), t.dtype))
            return out

    m.to(torch.bfloat16)
    with Watch():
        factors = rule(m, (x.bfloat16(),), G.bfloat16(), {"weight", "bias"})
        norms = {n: f.sq_norm() for n, f in factors.items()}
    assert wide_outputs == []
    for n, f in factors.items():
        assert f.grads.dtype == torch.float32 and norms[n].dtype == torch.float32
        torch.testing.assert_close(norms[n].double(), reference[n].sq_norm(), rtol=3e-2, atol=0)


def test_a_16_bit_embeddings_clipped_sum_is_written_in_its_dtype_from_float32_row_sums():
    # Book-keeping writes a bf16 table's clipped sum without a float32 copy of the whole table: the rows
    # of each id are summed in float32, then rounded once, as the dense float32 sum would be.
    ids = torch.randint(0, 50, (4, 7))
    ids[0, :3] = 5  # an id repeated within an example and across examples
    ids[1, 0] = 5
    grads = torch.randn(4, 7, 6, dtype=torch.bfloat16)
    factor = factors.EmbeddingGather(ids, grads, 50, padding_idx=0)
    weights = torch.tensor([0.5, 1.0, 0.25, 0.75], dtype=torch.float32)
    dense = factor.weighted_sum(weights)
    compact = factor.weighted_sum(weights, out_dtype=torch.bfloat16)
    assert dense.dtype == torch.float32 and compact.dtype == torch.bfloat16
    assert torch.equal(compact, dense.to(torch.bfloat16))
