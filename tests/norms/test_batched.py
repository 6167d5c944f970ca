"""The batched reductions of norms/batched.py give, row by row, what each factor gives alone."""
import math

import pytest
import torch

import ghostdp
from conftest import assert_exact
from ghostdp.norms import batched, batched_sums, deferred
from ghostdp.norms.factors import Instantiated, OuterProduct, SqrtProduct, SummedTokens, acc_dtype_of
from ghostdp.norms.normalization import AffineGrad, LayerNormCall

B, T = 3, 5


def _mixed_factors():
    """Linear-like layers sharing an input (query, key, value), one with another width, a Conv1D-like one
    (input on the left), biases, explicit gradients with and without masses, one-token layers (two sharing an input,
    one with its bias), and, last,
    low-rank factors on the instantiation path (LoRA-like: two of one shape, one of another)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, wide = randn(B, T, 16), randn(B, T, 24)
    one_x, one_g = randn(B, 1, 3), randn(B, 1, 4)  # one-token layers ((B, d) rows), one input shared, with a bias
    out_q, out_k, out_v, out_w = randn(B, T, 16), randn(B, T, 12), randn(B, T, 20), randn(B, T, 16)
    # Two LayerNorm calls formed together, and one with a frozen weight (another batch key).
    norms = [LayerNormCall(randn(B, T, 16), randn(B, T, 16), (16,), 1e-5, {"weight", "bias"}) for _ in range(2)]
    bias_only = LayerNormCall(randn(B, T, 16), randn(B, T, 16), (16,), 1e-5, {"bias"})
    return [AffineGrad(norms[0], "weight"), AffineGrad(norms[1], "bias"), AffineGrad(norms[1], "weight"),
            AffineGrad(norms[0], "bias"), AffineGrad(bias_only, "bias"),

        OuterProduct(out_q, x, (16, 16), input_side="right"), SummedTokens(out_q),
        OuterProduct(out_k, x, (12, 16), input_side="right"), SummedTokens(out_k),
        OuterProduct(out_v, x, (20, 16), input_side="right"),
        OuterProduct(wide, out_w, (24, 16), input_side="left"), SummedTokens(out_w),
        OuterProduct(one_g, one_x, (4, 3)), SummedTokens(one_g), OuterProduct(randn(B, 1, 5), one_x, (5, 3)),
        Instantiated(randn(B, 16), mass=randn(B).abs()), Instantiated(randn(B, 16), mass=randn(B).abs()),
        Instantiated(randn(B, 7)),
        OuterProduct(randn(B, T, 2), x, (2, 16)), OuterProduct(randn(B, T, 2), randn(B, T, 16), (2, 16)),
        OuterProduct(randn(B, T, 24), randn(B, T, 2), (24, 2)),
    ]


def _as_tensor(mass):
    if isinstance(mass, SqrtProduct):
        return (mass.a * mass.b).clamp(min=0).sqrt()
    return mass


@pytest.mark.parametrize("budget", [None, 1])  # 1: no stacking, every Gram and LayerNorm alone
def test_reductions_equal_each_factor_alone(monkeypatch, budget):
    if budget is not None:
        monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": budget})
    factors = _mixed_factors()
    found = {}
    for done in batched.reduce_factors(factors):
        for k, r in enumerate(done.rows):
            assert r not in found
            found[r] = (done.sq[k], None if done.mass is None else done.masses()[k])
    assert sorted(found) == list(range(len(factors)))
    for r, f in enumerate(_mixed_factors()):  # the same factors, not yet reduced: each alone
        sq, mass = found[r]
        torch.testing.assert_close(sq, f.sq_norm(), rtol=1e-12, atol=0)
        expected = _as_tensor(f.token_mass())
        if expected is None:
            assert mass is None
        else:
            torch.testing.assert_close(mass, expected, rtol=1e-12, atol=0)


def test_one_token_layers_and_their_biases_are_reduced_together():
    """Weights of one token (a Linear on (B, d) rows) have rank-one gradients, |g_i|^2 = |G_i|^2 |A_i|^2: all of them
    in one Reduced, their biases in another, whatever their widths (until 2026-12-07 each was reduced alone)."""
    factors = _mixed_factors()
    one_token = [r for r, f in enumerate(factors) if type(f) is OuterProduct and f.left.shape[1] == 1]
    biases = [r for r, f in enumerate(factors) if type(f) is SummedTokens and f.tokens.shape[1] == 1]
    assert len(one_token) == 2 and len(biases) == 1
    rows = [sorted(done.rows) for done in batched.reduce_factors(factors)]
    assert one_token in rows and biases in rows


def test_an_mlp_on_rows_is_exact_in_both_modes():
    """Linears of several widths on (B, d) rows, a shared input, biases frozen in one: the rank-one batch."""
    torch.manual_seed(0)

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)
            self.head = torch.nn.Linear(5, 3, bias=False)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            return self.head(torch.tanh(self.b(h)) * torch.tanh(self.c(h)))

    model = Rows().double().train()
    model.c.bias.requires_grad_(False)
    x, labels = torch.randn(B, 6, dtype=torch.float64), torch.randint(0, 3, (B,))
    criterion = torch.nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: criterion(model(x), labels),
                 lambda i: criterion(model(x[i:i + 1]), labels[i:i + 1]).sum(), B)


def test_low_rank_factors_of_one_shape_are_reduced_from_one_stacked_product(monkeypatch):
    """Factors whose norm is that of their explicit gradients (rank r << T: a LoRA factor) are batched by shape:
    one matmul L_i^T R_i for the stacked sides of a run; sides cast to another dtype are reduced alone."""
    runs = []
    product_batch = batched._product_batch
    monkeypatch.setattr(batched, "_product_batch", lambda fs, rows: runs.append(len(fs)) or product_batch(fs, rows))
    factors = _mixed_factors()
    assert all(batched._product_key(f) is not None for f in factors[-3:])
    batched.reduce_factors(factors)
    assert sorted(runs) == [1, 2]
    cast = OuterProduct(torch.randn(B, T, 2, dtype=torch.bfloat16), torch.randn(B, T, 16), (2, 16))
    assert cast.operand_dtype is not None and batched._product_key(cast) is None


def test_a_layer_norm_formed_before_its_reduction_is_reduced_alone():
    """A LayerNorm whose bias has several uses (pending) forms its gradients for the bias's mass while its
    weight waits in the queue: the weight is then reduced from the formed gradients."""
    factors = _mixed_factors()
    assert isinstance(factors[0], AffineGrad) and factors[0].name == "weight"
    factors[3].mass  # noqa: B018  (norms[0]'s bias: forms norms[0] now)
    queued = [factors[0], factors[1], factors[2]]
    found = {r: done.sq[k] for done in batched.reduce_factors(queued) for k, r in enumerate(done.rows)}
    for r, f in enumerate(_mixed_factors()[:3]):
        torch.testing.assert_close(found[r], f.sq_norm(), rtol=1e-12, atol=0)


def test_shared_input_gets_one_gram_and_biases_reuse_their_weights_grams(monkeypatch):
    factors = _mixed_factors()[5:9]  # query and key weights (one input) and their biases
    rows = []
    gram = batched.gram
    monkeypatch.setattr(batched, "gram", lambda x, dt: rows.append(x.shape[0]) or gram(x, dt))
    batched.reduce_factors(factors)
    assert sorted(rows) == [B, 2 * B]  # width 16: x and the query's output grad; width 12: the key's


# 1: no stacking, every factor alone; 100: biases batched by their (B, n) sums, their tokens too large to stack
@pytest.mark.parametrize("budget", [None, 1, 100])
def test_weighted_sums_equal_each_factor_alone(monkeypatch, budget):
    if budget is not None:
        monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": budget})
    factors = _mixed_factors()
    weights = {0: torch.rand(B, dtype=torch.float64), 1: torch.rand(B, dtype=torch.float64)}
    uses = [(f, k % 2) for k, f in enumerate(factors)]  # two clipping groups, so batches split by weights
    alone = []
    sums = dict(batched_sums.weighted_sums(uses, lambda group, dt: weights[group].to(dt),
                                           lambda f, group: alone.append(f) or f.weighted_sum(weights[group])))
    assert sorted(sums) == list(range(len(factors))) and alone == []  # every kind here is batched
    for k, f in enumerate(_mixed_factors()):
        group = k % 2
        torch.testing.assert_close(sums[k], f.weighted_sum(weights[group]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("knob", ["QUEUE_ELEMENTS", "STACK_ELEMENTS"])  # a small queue; layers too large to stack
@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_small_queue_reduces_in_pieces_to_the_same_norms(monkeypatch, clipping, knob):
    model, x = _layer_stack(width=8, depth=4)
    whole = _norms(model, x, clipping)
    reductions = []
    reduce = batched.NormQueue.reduce
    if knob == "QUEUE_ELEMENTS":
        monkeypatch.setattr(batched, knob, 2 * B * T * 8)  # about one layer
    else:
        monkeypatch.setattr(batched, knob, {"cpu": B * T * 8})  # one tensor: no layer can be stacked
    monkeypatch.setattr(batched.NormQueue, "reduce",
                        lambda self, final=False: reductions.append(1) or reduce(self, final))
    torch.testing.assert_close(_norms(model, x, clipping), whole, rtol=1e-12, atol=0)
    assert len(reductions) > 2


def _layer_stack(width, depth):
    """(Linear, LayerNorm, Tanh) x depth in float64, and a (B, T, width) input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width),
                                                      torch.nn.Tanh()) for _ in range(depth)]).double()
    return model, torch.randn(B, T, width, dtype=torch.float64)


def _norms(model, x, clipping):
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        return controller.per_example_norms(model(x).pow(2).flatten(1).sum(1))
    finally:
        controller.detach()


def test_layer_norm_gradients_formed_together_are_summed_from_their_stack():
    """Book-keeping's clipped sums read LayerNorm gradients formed in one stack as that stack (no row picked
    and stacked again) when the factors are its rows in order; in any other order, row by row. Equal either way."""
    from ghostdp.norms.normalization import form_layer_norms, stacked_grads
    g = torch.Generator().manual_seed(1)
    calls = [LayerNormCall(torch.randn(B, T, 8, generator=g, dtype=torch.float64),
                           torch.randn(B, T, 8, generator=g, dtype=torch.float64), (8,), 1e-5, {"weight", "bias"})
             for _ in range(3)]
    in_order = [AffineGrad(c, "weight") for c in calls]
    mixed = [AffineGrad(calls[0], "weight"), AffineGrad(calls[1], "bias")]
    stacked = form_layer_norms(calls)
    weights = torch.rand(B, dtype=torch.float64, generator=g)
    assert stacked_grads(in_order) is stacked["weight"][0]
    for factors in (in_order, in_order[::-1], in_order[:2], mixed):
        if factors is not in_order:
            assert stacked_grads(factors) is None
        sums = dict(batched_sums.weighted_sums([(f, 0) for f in factors], lambda group, dt: weights.to(dt), None))
        for k, f in enumerate(factors):
            expected = weights @ f.grads.reshape(B, -1)
            torch.testing.assert_close(sums[k], expected.reshape(f.param_shape), rtol=1e-12, atol=1e-14)


def test_layer_norm_gradients_formed_in_several_stacks_are_summed_from_those_stacks():
    """LayerNorms formed one at a time (the per-layer regime), or in runs: their gradients are read as their
    stacks concatenated, one op, where the factors are the stacks' rows in order, stack after stack; a stack
    read in part, or out of order, goes row by row. The sums are equal either way."""
    from ghostdp.norms.normalization import form_layer_norms, stacked_grads
    g = torch.Generator().manual_seed(2)

    def calls():
        return [LayerNormCall(torch.randn(B, T, 8, generator=torch.Generator().manual_seed(k), dtype=torch.float64),
                              torch.randn(B, T, 8, generator=torch.Generator().manual_seed(10 + k),
                                          dtype=torch.float64), (8,), 1e-5, {"weight", "bias"}) for k in range(3)]

    alone, runs, reference = calls(), calls(), calls()
    factors = {"alone": [AffineGrad(c, "bias") for c in alone], "runs": [AffineGrad(c, "bias") for c in runs]}
    expected = torch.stack([AffineGrad(c, "bias").grads for c in reference])
    for c in alone:
        form_layer_norms([c])
    form_layer_norms(runs[:2])
    form_layer_norms(runs[2:])
    weights = torch.rand(B, dtype=torch.float64, generator=g)
    for formed, these in factors.items():
        torch.testing.assert_close(stacked_grads(these), expected, rtol=0, atol=0)
        if formed == "alone":  # every order and every subset is whole stacks
            torch.testing.assert_close(stacked_grads(these[::-1]), expected.flip(0), rtol=0, atol=0)
            torch.testing.assert_close(stacked_grads(these[1:]), expected[1:], rtol=0, atol=0)
        else:  # the first stack out of order, or half of it
            assert stacked_grads(these[::-1]) is None and stacked_grads(these[1:]) is None
        sums = dict(batched_sums.weighted_sums([(f, 0) for f in these], lambda group, dt: weights.to(dt), None))
        for k in range(3):
            torch.testing.assert_close(sums[k], weights @ expected[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shared_input", [False, True])  # three layers with their own inputs; query, key, value
def test_layers_whose_grams_lie_at_equal_steps_are_read_through_views(monkeypatch, shared_input):
    """Three Linear-like layers of one width: their output grads' Grams are consecutive in one stacked matmul
    and their inputs' follow them (or are one, repeated), so each side is a view of it (no index tensor, no
    indexed copy), and the norms and masses equal each layer's alone."""
    g = torch.Generator().manual_seed(2)

    def layers():
        sides = [torch.randn(B, T, 8, generator=g, dtype=torch.float64) for _ in range(6)]
        inputs = [sides[0]] * 3 if shared_input else sides[0::2]
        return [f for k in range(3) for f in (OuterProduct(sides[2 * k + 1], inputs[k], (8, 8), input_side="right"),
                                               SummedTokens(sides[2 * k + 1]))]

    def no_index(pattern, device):
        raise AssertionError(f"an index tensor for {pattern}: these Grams lie at equal steps")

    monkeypatch.setattr(batched._INDICES, "get", no_index)
    factors = layers()
    g.manual_seed(2)
    found = {r: (done.sq[k], done.masses()[k]) for done in batched.reduce_factors(factors) for k, r in enumerate(done.rows)}
    g.manual_seed(2)
    for r, f in enumerate(layers()):
        torch.testing.assert_close(found[r][0], f.sq_norm(), rtol=1e-12, atol=0)
        torch.testing.assert_close(found[r][1], _as_tensor(f.token_mass()), rtol=1e-12, atol=0)


def test_a_sixteen_bit_grams_input_is_widened_once_on_a_cpu():
    """Off the tensor-core path (a CPU), a bf16 tensor's Gram in float32 converts it once for both of its
    sides (it converted each side: the tensor and its transpose), in the pass's cache and in a stacked Gram
    batch alike; the Grams equal the product of the widened tensor with its transpose, bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from ghostdp.norms.factors import InputGrams

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, T, 16, generator=g).to(torch.bfloat16)
    wide = x.float()
    with Copies() as copies:
        cached = InputGrams().whole(x, torch.float32)
    assert copies.count == 1 and torch.equal(cached, torch.bmm(wide, wide.transpose(1, 2)))
    factors = [OuterProduct(torch.randn(B, T, 8, generator=g).to(torch.bfloat16), x, (8, 16)) for _ in range(2)]
    with Copies() as copies:
        (done,) = batched.reduce_factors(factors)
    assert copies.count == 2  # the stack of the two output grads, and the input, each once
    for k, f in enumerate(factors):
        torch.testing.assert_close(done.sq[k], f.sq_norm(), rtol=1e-6, atol=0)


def test_sums_written_in_a_narrower_dtype_are_rounded_once_per_batch():
    """A batch whose sums all go to bf16 parameters is rounded in one op, to exactly what rounding each
    parameter's sum gives; a batch with a sum kept wide (a parameter with several uses) is left wide."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rounding(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rounded = []  # rows of each conversion to bf16

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
                self.rounded.append(out.shape[0])
            return out

    g = torch.Generator().manual_seed(6)

    def bf16(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    x = bf16(B, T, 16)
    factors = [OuterProduct(bf16(B, T, 8), x, (8, 16)) for _ in range(3)]  # one batch of weights
    factors += [SummedTokens(bf16(B, T, 8)) for _ in range(4)]             # one batch of biases
    weights = torch.rand(B, generator=g)

    def sums(written_in):
        with Rounding() as watch:
            found = dict(batched_sums.weighted_sums([(f, 0) for f in factors], lambda group, dt: weights.to(dt),
                                                    None, written_in))
        return found, watch.rounded

    wide, rounded = sums(None)
    assert rounded == [] and all(t.dtype == torch.float32 for t in wide.values())
    narrow, rounded = sums([torch.bfloat16] * len(factors))
    assert sorted(rounded) == [3, 4]  # one conversion per batch, of all its rows
    for k in range(len(factors)):
        assert narrow[k].dtype == torch.bfloat16 and torch.equal(narrow[k], wide[k].to(torch.bfloat16))
    # The second bias is one of two uses of its parameter: its batch stays wide, the weights' is rounded.
    mixed, rounded = sums([torch.bfloat16] * 4 + [None] + [torch.bfloat16] * 2)
    assert rounded == [3]
    assert all(mixed[k].dtype == torch.float32 and torch.equal(mixed[k], wide[k]) for k in range(3, 7))


def test_weighted_sums_are_formed_one_batch_at_a_time(monkeypatch):
    """The caller can write and drop each batch's sums before the next batch is formed."""
    factors = [f for f in _mixed_factors() if isinstance(f, OuterProduct)]
    formed = []
    summed_batch = batched_sums._summed_batch
    monkeypatch.setattr(batched_sums, "_summed_batch",
                        lambda kind, key, fs, *rest: formed.append(len(fs)) or summed_batch(kind, key, fs, *rest))
    weights = torch.rand(B, dtype=torch.float64)
    sums = batched_sums.weighted_sums([(f, 0) for f in factors], lambda group, dt: weights.to(dt), None)
    assert formed == []
    next(sums)
    assert len(formed) == 1
    assert len(list(sums)) + 1 == len(factors) and len(formed) > 1


def test_book_keeping_drops_each_factor_once_its_sum_is_written(monkeypatch):
    """What book-keeping kept is released parameter by parameter while the clipped sums are written, so the
    gradients written replace it instead of adding to it; the sums equal each factor's alone."""
    import weakref

    from ghostdp.clipping.modes import BookKeeping, ClippedSums, new_factor_store
    g = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.zeros(n, 8, dtype=torch.float64)) for n in (4, 6, 10)]  # three shapes
    kept, alive = new_factor_store(), []
    for p in params:
        left = torch.randn(B, T, p.shape[0], generator=g, dtype=torch.float64)
        right = torch.randn(B, T, 8, generator=g, dtype=torch.float64)
        kept[p].append(OuterProduct(left, right, tuple(p.shape), input_side="right"))
        alive.append((weakref.ref(left), weakref.ref(right)))
    c = torch.rand(B, dtype=torch.float64, generator=g)
    expected = [kept[p][0].weighted_sum(c) for p in params]
    seen = []
    write = ClippedSums._write

    def watch(param, clipped):
        seen.append(sum(left() is not None for left, _ in alive))
        write(param, clipped)

    monkeypatch.setattr(ClippedSums, "_write", staticmethod(watch))
    del left, right
    assert BookKeeping().grad_of_losses(kept, c, torch.ones(B, dtype=torch.float64), torch.zeros(B)) is None
    assert seen == [2, 1, 0] and not kept  # at each write, only the factors still to be summed are alive
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=0)


def test_book_keeping_writes_bf16_sums_rounded_once_per_batch(monkeypatch):
    """Book-keeping hands each parameter's dtype to the batched sums where the sum is the parameter's whole
    clipped sum: bf16 biases of one shape are written from one rounding of their batch, equal to rounding
    each; a parameter with two uses (tied) is summed wide and rounded once, after its uses are added."""
    from ghostdp.clipping.modes import BookKeeping, ClippedSums, new_factor_store
    g = torch.Generator().manual_seed(8)
    biases = [torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16)) for _ in range(3)]
    tied = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))  # another shape: a batch of its own
    kept = new_factor_store()
    for p in biases + [tied, tied]:
        kept[p].append(SummedTokens(torch.randn(B, T, p.shape[0], generator=g).to(torch.bfloat16)))
    c = torch.rand(B, generator=g)
    expected = {p: sum(f.weighted_sum(c) for f in kept[p]).to(torch.bfloat16) for p in biases + [tied]}
    written = []
    write = ClippedSums._write
    monkeypatch.setattr(ClippedSums, "_write",
                        staticmethod(lambda param, clipped: written.append(clipped.dtype) or write(param, clipped)))
    BookKeeping().grad_of_losses(kept, c, torch.ones(B), torch.zeros(B))
    assert written == [torch.bfloat16] * 3 + [torch.float32]  # the tied sum goes wide to its write
    for p, e in expected.items():
        assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, e)


def test_squared_masses_are_rooted_together_with_the_masses_of_other_reductions():
    """A Gram batch hands over the squares of its token masses; the pass roots all of them in one expression
    and adds the masses that came rooted: the total equals each factor's own mass summed, in any dtype mix."""
    from ghostdp.clipping.records import NormPass
    factors = _mixed_factors()
    reductions = batched.reduce_factors(factors)
    assert any(not done.rooted for done in reductions) and any(done.rooted and done.mass is not None for done in reductions)
    passed = NormPass(B)
    for done in reductions:
        if done.mass is not None:
            passed._add_mass_rows(done.mass, done.mass_dtype, done.rooted)
    passed._add_mass_rows(torch.ones(2, B, dtype=torch.float32) * 4, torch.float32, rooted=False)  # another dtype
    expected = sum(_as_tensor(f.token_mass()) for f in _mixed_factors() if f.token_mass() is not None) + 2 * 2
    torch.testing.assert_close(passed.total_mass(), expected, rtol=1e-12, atol=0)


def test_layers_reduced_one_at_a_time_share_their_inputs_gram_through_the_pass_cache(monkeypatch):
    """Where each reduction holds one layer (on a GPU, a BERT-base layer's tensors are too large to stack),
    the layer is reduced alone through the pass's Gram cache: query, key and value form their shared input's
    Gram once, and the norms and masses equal each factor's own."""
    from ghostdp.norms import factors as factors_module
    from ghostdp.norms.factors import InputGrams
    layers = _mixed_factors()[5:11]  # query, key, value weights (one input) and the query's and key's biases
    per_layer = [[layers[0], layers[1]], [layers[2], layers[3]], [layers[4]]]
    formed = []
    wide_matmul = factors_module.wide_matmul
    monkeypatch.setattr(factors_module, "wide_matmul", lambda a, b, dt: formed.append(a.shape) or wide_matmul(a, b, dt))
    grams = InputGrams()
    found = []
    for queued in per_layer:
        found.extend(done for done in batched.reduce_factors(queued, grams))
    assert len(formed) == 4  # the shared input once, and each layer's output grad
    expected = [f for f in _mixed_factors()[5:11]]
    rows = [(done.sq[0], done.masses()[0]) for done in found]
    for (sq, mass), f in zip(rows, expected):
        torch.testing.assert_close(sq, f.sq_norm(), rtol=1e-12, atol=0)
        torch.testing.assert_close(mass, _as_tensor(f.token_mass()), rtol=1e-12, atol=0)


def test_layers_reduced_one_at_a_time_leave_their_grams_to_be_reduced_together(monkeypatch):
    """Layers too large to stack are reduced one at a time, but their Grams (B, T, T) are small: they wait in
    the queue's DeferredGrams and their norms and squared masses are taken for several layers at once, once
    the Grams fill half a stack budget or the pass ends. Each row equals its factor's own norm and mass, with
    its clipping group: weights sharing an input (one Gram for it), biases that read their weight's left Gram
    (query, key) or its right one (a Conv1D-like layer: stacked on their own), and a layer of another T
    (reduced alone: the Grams held are of one shape). LayerNorms formed alone leave their (B, d) gradients
    likewise, for one dot product per flush, and so does a low-rank layer on the instantiation path (LoRA)."""
    from ghostdp.norms.factors import InputGrams
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 4 * B * T * T})  # two Grams held, no layer stacked
    g = torch.Generator().manual_seed(3)
    longer = OuterProduct(torch.randn(B, T + 2, 6, generator=g, dtype=torch.float64),
                          torch.randn(B, T + 2, 9, generator=g, dtype=torch.float64), (6, 9))
    low_rank = OuterProduct(torch.randn(B, T, 2, generator=g, dtype=torch.float64),  # explicit gradients kept
                            torch.randn(B, T, 24, generator=g, dtype=torch.float64), (2, 24))

    def layer_norm(seed, names=("weight", "bias")):
        g = torch.Generator().manual_seed(seed)
        call = LayerNormCall(torch.randn(B, T, 16, generator=g, dtype=torch.float64),
                             torch.randn(B, T, 16, generator=g, dtype=torch.float64), (16,), 1e-5, set(names))
        return [AffineGrad(call, name) for name in names]

    def all_layers():
        return [_mixed_factors()[5:7], layer_norm(1), _mixed_factors()[7:9], _mixed_factors()[9:10], [longer],
                layer_norm(2, ("bias",)), [low_rank], layer_norm(3), _mixed_factors()[10:12]]

    layers, reference = all_layers(), [f for layer in all_layers() for f in layer]
    flushes, explicit = [], []
    gram_rows, explicit_rows = deferred.DeferredGrams._gram_rows, deferred.DeferredGrams._explicit_rows
    monkeypatch.setattr(deferred.DeferredGrams, "_gram_rows",
                        lambda self, first_row: flushes.append(len(self.weights) + len(self.biases))
                        or gram_rows(self, first_row))
    monkeypatch.setattr(deferred.DeferredGrams, "_explicit_rows",
                        lambda self, *a: explicit.append(sum(map(len, self.explicit.values())))
                        or explicit_rows(self, *a))
    queue = batched.NormQueue(InputGrams(), deferred.DeferredGrams())
    rows, position = [], 0  # (squared norm, mass, clipping group) of every row reduced
    for n, layer in enumerate(layers):
        for f in layer:
            queue.push(f, group=position % 2)
            position += 1
        assert queue.full()  # every layer is too large to stack
        reductions, groups = queue.reduce(final=n == len(layers) - 1)
        rows += [(done.sq[k], done.masses()[k], groups[r]) for done in reductions for k, r in enumerate(done.rows)]
    assert flushes and max(flushes) > 1 and sum(flushes) == 7  # the Linear-like factors but the longer layer
    assert max(explicit) > 1 and sum(explicit) == 6  # the LayerNorms' 5 and the low-rank layer's
    assert not queue.pending() and len(rows) == len(reference)
    for position, f in enumerate(reference):  # each factor's norm and mass come back once, with its group
        match = [(mass, group) for sq, mass, group in rows if torch.allclose(sq, f.sq_norm(), rtol=1e-12, atol=0)]
        assert len(match) == 1 and match[0][1] == position % 2
        torch.testing.assert_close(match[0][0], _as_tensor(f.token_mass()), rtol=1e-12, atol=0)
    # The LayerNorms formed alone left their masses' sqrt(T) to the flush; a row read alone is scaled all the same.
    queued_norms = [(f, r) for f, r in zip((f for layer in layers for f in layer), reference) if type(f) is AffineGrad]
    assert all(f.call.mass_scale == math.sqrt(T) for f, _ in queued_norms)
    for f, r in queued_norms:
        torch.testing.assert_close(f.mass, r.mass, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layers_whose_grams_are_too_large_to_defer_leave_their_masses_as_products(monkeypatch, dtype):
    """Where even one layer's two Grams exceed DeferredGrams' budget (a GPU at BERT-base B=256 or T=512), each
    layer is reduced alone from the pass's Gram cache, and its token mass leaves as the factors of a product
    (tr(L L^T), tr(R R^T); a bias's tr(G G^T) and T): the pass multiplies and roots them all in a few ops at the
    end, not one to three ops per layer. Its totals equal each factor's own norm and mass summed, also with
    masses of other reductions and dtypes, and a bias asked its sum dtype does not sum its tokens."""
    from ghostdp.clipping.records import NormPass
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 2 * B * T * T})  # half of it: less than two Grams
    layers = _in_dtype(_mixed_factors()[5:12], dtype)
    per_layer = [layers[0:2], layers[2:4], layers[4:5], layers[5:7]]  # query, key (shared input), value, Conv1D-like
    passed = NormPass(B)
    deferred_takes = []
    take = deferred.DeferredGrams.take
    monkeypatch.setattr(deferred.DeferredGrams, "take", lambda self, *a: deferred_takes.append(take(self, *a))
                        or deferred_takes[-1])
    for layer in per_layer:
        for f in layer:
            passed.queue.push(f, 0)
        assert passed.queue.full()
        passed.reduce_queue()
    passed.reduce_queue(final=True)
    assert deferred_takes and not any(deferred_takes)  # no Gram was deferred
    products = [m for m in passed.squared_masses if isinstance(m, SqrtProduct)]
    assert len(products) == len(layers) and not passed.masses
    assert {type(m.b) for m in products} == {torch.Tensor, float}  # the weights' trace pairs, the biases' T
    bias = layers[1]
    assert bias.sum_dtype() == acc_dtype_of(dtype) and bias._grads is None
    passed._add_mass_rows(torch.full((1, B), 2.0, dtype=torch.float64), torch.float64)  # rooted, another dtype
    reference = _mixed_factors()[5:12]
    expected_sq = sum(f.sq_norm() for f in reference)
    expected_mass = sum(_as_tensor(f.token_mass()) for f in reference) + 2.0
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(passed.total_sq()[0], expected_sq, rtol=tolerance, atol=0)
    torch.testing.assert_close(passed.total_mass().double(), expected_mass, rtol=tolerance, atol=0)


def _in_dtype(factors, dtype):
    """Linear-like factors and biases with their tensors in ``dtype``, a tensor shared by several still shared."""
    converted = {}

    def to(x):
        return converted.setdefault(id(x), x.to(dtype))

    return [OuterProduct(to(f.left), to(f.right), f.param_shape, input_side=f.input_side)
            if isinstance(f, OuterProduct) else SummedTokens(to(f.tokens)) for f in factors]


def test_norms_read_while_layers_wait_in_the_queue_are_refused():
    """The pass's totals are read only once every queued factor and deferred Gram is reduced: a layer left out
    would be clipped too little."""
    from ghostdp.clipping.records import NormPass
    passed = NormPass(B)
    passed.queue.push(_mixed_factors()[5], 0)
    with pytest.raises(RuntimeError, match="norm queue still held layers"):
        passed.total_sq()
    passed.reduce_queue(final=True)
    assert passed.total_sq().shape == (1, B)


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_model_reduced_one_layer_at_a_time_takes_its_norms_from_deferred_grams(monkeypatch, clipping):
    """The per-layer regime of a GPU at BERT-base sizes, scaled down: each layer's input and output grad exceed
    the queue's bound, their Grams fit half a stack (and the LayerNorms' gradients are left likewise). The norms
    equal those of the batched reductions."""
    model, x = _layer_stack(width=16, depth=5)  # 16 wide: the Gram path (T (d + p) < d p)
    whole = _norms(model, x, clipping)
    flushes, explicit = [], []
    gram_rows, explicit_rows = deferred.DeferredGrams._gram_rows, deferred.DeferredGrams._explicit_rows
    monkeypatch.setattr(deferred.DeferredGrams, "_gram_rows",
                        lambda self, first_row: flushes.append(len(self.weights)) or gram_rows(self, first_row))
    monkeypatch.setattr(deferred.DeferredGrams, "_explicit_rows",
                        lambda self, *a: explicit.append(sum(map(len, self.explicit.values())))
                        or explicit_rows(self, *a))
    activation = B * T * 16
    monkeypatch.setattr(batched, "QUEUE_ELEMENTS", activation + activation // 3)  # one layer fills it
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 8 * B * T * T})  # two layers' Grams, no stack of A, G
    torch.testing.assert_close(_norms(model, x, clipping), whole, rtol=1e-12, atol=0)
    assert sum(flushes) == 5 and max(flushes) == 2  # pairs of layers, the last one with the end of the pass
    assert sum(explicit) == 10 and max(explicit) > 2  # the LayerNorms' weights and biases


@pytest.mark.parametrize("grams_deferred", [True, False])
def test_bert_reduced_one_layer_at_a_time_is_exact(monkeypatch, grams_deferred):
    """A tiny BERT with the queue bound and stack budget of the per-layer regime (profiling.overhead
    --per-layer): every Linear's Grams and every LayerNorm's gradients wait in DeferredGrams, and the clipped
    step equals the per-example loop in float64, in both modes. With a budget below two Grams (BERT-base at
    B=256 or T=512 on a GPU), each layer is reduced alone, its masses left as products: exact too."""
    from conftest import assert_exact_model
    from test_models import B as examples, classification_loss, padded_text, tiny_bert
    model = tiny_bert().double().train()
    ids, mask = padded_text(30)
    activation = ids.numel() * model.config.hidden_size
    monkeypatch.setattr(batched, "QUEUE_ELEMENTS", activation + activation // 3)  # one layer fills it
    gram = ids.numel() * ids.shape[1]  # one layer's (B, T, T) Gram
    # T = 7 against H = 16: Grams fit half the budget, or two of them do not
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 4 * activation if grams_deferred else 2 * gram})
    taken = []
    take = deferred.DeferredGrams.take
    monkeypatch.setattr(deferred.DeferredGrams, "take", lambda self, *a: taken.append(take(self, *a)) or taken[-1])
    assert_exact_model(model, {"input_ids": ids, "attention_mask": mask},
                       classification_loss(torch.randint(0, 3, (examples,))), examples)
    assert sum(taken) > 10 if grams_deferred else taken and not any(taken)


def test_book_keeping_reduces_the_named_layers_once_after_the_backward_with_deferred_grams_in_bounds(monkeypatch):
    """Book-keeping's pass 1 returns every named layer's G at once. Where each layer is too large to stack (a
    GPU at BERT-base sizes), the queue waits for all of them and reduces them in one reduction, each layer
    alone, instead of one reduction per layer; DeferredGrams still takes the products of its Grams whenever
    they fill its budget (pairs of layers here), within that one reduction. The norms are unchanged."""
    model, x = _layer_stack(width=32, depth=5)  # T (d + p) < d p: the Gram path; Grams (B, T, T) << (B, T, d)
    whole = _norms(model, x, "bookkeeping")
    weights_per_reduction, flushes = [], []
    reduce_factors, gram_rows = batched.reduce_factors, deferred.DeferredGrams._gram_rows
    monkeypatch.setattr(batched, "reduce_factors", lambda factors, *a: weights_per_reduction.append(
        sum(type(f) is OuterProduct for f in factors)) or reduce_factors(factors, *a))
    monkeypatch.setattr(deferred.DeferredGrams, "_gram_rows",
                        lambda self, first_row: flushes.append(len(self.weights)) or gram_rows(self, first_row))
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 8 * B * T * T})  # < x and G of a layer; 2 layers' Grams
    torch.testing.assert_close(_norms(model, x, "bookkeeping"), whole, rtol=1e-12, atol=0)
    assert [n for n in weights_per_reduction if n] == [5]  # one reduction for the five Linear layers
    assert sum(flushes) == 5 and max(flushes) == 2 and len(flushes) == 3


def test_named_layers_reduced_together_keep_each_rows_clipping_group(monkeypatch):
    """Per-group clipping through the same one reduction (and its flushes between layers): each layer's norm
    lands in its own group, as with the default budgets."""
    model, x = _layer_stack(width=32, depth=5)
    groups = [list(model[:2].parameters()), list(model[2:].parameters())]

    def group_norms():
        controller = ghostdp.GhostClipping(model, [1.0, 2.0], clipping="bookkeeping", parameter_groups=groups)
        try:
            controller.per_example_norms(model(x).pow(2).flatten(1).sum(1))
            return controller.last_group_norms
        finally:
            controller.detach()

    whole = group_norms()
    weights_per_reduction, reduce_factors = [], batched.reduce_factors
    monkeypatch.setattr(batched, "reduce_factors", lambda factors, *a: weights_per_reduction.append(
        sum(type(f) is OuterProduct for f in factors)) or reduce_factors(factors, *a))
    monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": 8 * B * T * T})
    torch.testing.assert_close(group_norms(), whole, rtol=1e-12, atol=0)
    assert [n for n in weights_per_reduction if n] == [5] and not torch.equal(whole[0], whole[1])


def test_explicit_gradients_are_stacked_within_the_stack_budget(monkeypatch):
    """Explicit per-example gradients of one shape are stacked in runs of at most STACK_ELEMENTS (one above it
    is reduced alone, uncopied), as every other batch is: the queue may hold several large ones at once
    (book-keeping's named layers wait for each other)."""
    g = torch.Generator().manual_seed(3)
    factors = [Instantiated(torch.randn(B, 40, generator=g, dtype=torch.float64), mass=torch.rand(B, generator=g,
                                                                                                     dtype=torch.float64))
               for _ in range(3)]
    rows_per_reduction = {}
    for budget in (1 << 16, 2 * B * 40, B * 40 - 1):
        monkeypatch.setattr(batched, "STACK_ELEMENTS", {"cpu": budget})
        done = batched.reduce_factors(factors)
        rows_per_reduction[budget] = [d.rows for d in done]
        for d in done:
            for k, r in enumerate(d.rows):
                torch.testing.assert_close(d.sq[k], factors[r].sq_norm(), rtol=1e-12, atol=0)
                torch.testing.assert_close(d.masses()[k], factors[r].mass, rtol=0, atol=0)
    assert rows_per_reduction == {1 << 16: [[0, 1, 2]], 2 * B * 40: [[0, 1], [2]], B * 40 - 1: [[0], [1], [2]]}
