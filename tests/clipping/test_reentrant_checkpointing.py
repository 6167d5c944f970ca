"""Reentrant activation checkpointing (use_reentrant=True): pass 1 is a backward without inputs that recomputes each
region, records its calls there and audits its graph afterwards; new layouts are proven before it (a region's
graph that takes a new form on another step: after it) (ghostdp/clipping/reentrant.py). Exact in float64 against
the per-example loop of the same weights without checkpointing, over two steps of one controller (the first
learns which parameters several calls share and proves the layouts), in both clipping modes; every refusal is
triggered."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
from ghostdp import per_example_loss
from ghostdp.clipping import controller as controller_module
from conftest import (CLIPPING_MODES, Scale, assert_norms_as_forms_alternate, clipped_sum, reference_per_example_grads,
                      relative_error, trainable, without_scheduled_proofs)
from test_checkpointing import Block, checkpointed_bert_step, proof_and_between_peaks
from test_models import B, classification_loss, padded_text

CE = nn.CrossEntropyLoss()
# assert_exact_over_steps and keeping_factors run per-group clipping under checkpointing on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:per-group clipping with activation checkpointing")


def assert_exact_over_steps(model, plain, call, loss_of_output, steps=2, rtol=1e-9):
    """ghostdp on ``model`` (reentrant checkpoints) == the per-example loop on ``plain`` (the same weights,
    no checkpointing), for ``steps`` steps of one controller, every example clipped and none clipped; in
    both modes and in per-group clipping with one group, whose book-keeping keeps its factors in the regions."""
    per_example = reference_per_example_grads(plain, lambda i: loss_of_output(call(plain, slice(i, i + 1)),
                                                                              slice(i, i + 1)).sum(), B)
    _, norms = clipped_sum(per_example, 1.0)
    for C in (0.5 * float(norms.min()), 2.0 * float(norms.max())):
        ref, ref_norms = clipped_sum(per_example, C)
        for clipping in CLIPPING_MODES + ("per-group bookkeeping",):
            if clipping == "per-group bookkeeping":
                controller = ghostdp.GhostClipping(model, [C], clipping="bookkeeping",
                                                   parameter_groups=[[p for _, p in trainable(model)]])
            else:
                controller = ghostdp.GhostClipping(model, C, clipping=clipping)
            try:
                for step in range(steps):
                    model.zero_grad(set_to_none=True)
                    controller.loss(loss_of_output(call(model, slice(None)), slice(None)), reduction="sum").backward()
                    got = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in trainable(model)}
                    norms_off = float(((controller.last_norms - ref_norms).abs() / ref_norms).max())
                    assert norms_off < rtol, (clipping, step, controller.last_norms, ref_norms)
                    err = relative_error(got, ref)
                    assert err < rtol, f"{clipping}, step {step}: clipped sum off by {err:.3e} at C={C}"
            finally:
                controller.detach()
                model.zero_grad(set_to_none=True)


class Net(nn.Module):
    """Embedding, blocks (each its own region unless ``checkpointed`` is False), head. ``order`` lists
    the block called at each position: a block listed twice is one module in two regions (ALBERT). ``after``: a
    function of each region's output, outside the region."""

    def __init__(self, blocks=2, order=None, region=None, after=None):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(blocks))
        self.head = nn.Linear(8, 3)
        self.order = list(range(blocks)) if order is None else order
        self.region = region  # h, block -> the region's function of h (default: the block itself)
        self.after = after
        self.checkpointed = True
        self.checkpoint = lambda function, h: checkpoint(function, h, use_reentrant=True)

    def forward(self, ids):
        h = self.emb(ids)
        for k in self.order:
            function = self.blocks[k] if self.region is None else (lambda x, b=self.blocks[k]: self.region(x, b))
            h = self.checkpoint(function, h) if self.checkpointed else function(h)
            if self.after is not None:
                h = self.after(h)
        return self.head(h.mean(1))


def plain_copy(model):
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    return plain


def net_call(model, sl, ids):
    return model(ids[sl])


def check_net(model, ids, steps=2):
    labels = torch.randint(0, 3, (B,))
    assert_exact_over_steps(model, plain_copy(model), lambda m, sl: net_call(m, sl, ids),
                            classification_loss(labels), steps)


def test_a_users_reentrant_checkpointed_blocks_are_exact_over_two_steps():
    check_net(Net(), torch.randint(0, 20, (B, 6)))


def test_a_subclass_of_torchs_checkpoint_function_is_exact():
    from torch.utils.checkpoint import CheckpointFunction

    class MyCheckpoint(CheckpointFunction):
        pass

    model = Net()
    model.checkpoint = lambda function, h: MyCheckpoint.apply(function, True, h)
    check_net(model, torch.randint(0, 20, (B, 6)))


def test_a_region_that_is_a_plain_function_of_modules_is_exact():
    check_net(Net(region=lambda h, block: 0.5 * block(h) + h), torch.randint(0, 20, (B, 6)))


def test_a_residual_after_each_region_is_exact():
    """h + tanh(h) on each region's output: the graph audit's walk met the checkpoint's node from both terms before
    visiting it and listed it twice; its region was then audited twice, the second time after the first had
    released its calls' edges, and its parameters were refused as used outside their modules (before 2026-12-02,
    found by the differential fuzzer)."""
    check_net(Net(after=lambda h: h + torch.tanh(h)), torch.randint(0, 20, (B, 6)))


def test_one_block_in_two_regions_is_exact_from_the_first_step():
    # The first step reduces nothing on arrival: the second region's use of the block is not known yet.
    check_net(Net(blocks=1, order=[0, 0]), torch.randint(0, 20, (B, 6)), steps=3)


def test_a_sequence_first_layer_with_as_many_tokens_as_examples_gets_its_layout_proven_inside_a_region():
    # (T, B, d) with T == B: only the proof can tell that dim 1 holds the examples.
    check_net(Net(region=lambda h, block: block(h.transpose(0, 1)).transpose(0, 1)), torch.randint(0, 20, (B, B)))


def test_a_layer_that_mixes_examples_inside_a_region_is_refused():
    mix = nn.Linear(B, B)
    model = Net(region=lambda h, block: block(mix(h.transpose(0, 2)).transpose(0, 2)))
    model.mix = mix
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="mixes several examples"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_region_that_starts_mixing_examples_on_a_later_step_is_refused(clipping):
    """Inside a reentrant region the graph is seen only as pass 1 recomputes it, and a region that mixed
    examples (a batch mean) only from some step on, with the same shapes, went through once earlier steps
    had proven the layouts. A region's calls now get their layouts when its graph has been audited, and
    a region graph with a new signature is proven again (the first step's proof runs before pass 1, a later
    new form's after it); the proven one takes no new proof."""
    mixing = []
    model = Net(region=lambda h, block: block(h + 10 * h.mean(0, keepdim=True) if mixing else h))
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    without_scheduled_proofs(controller)  # count the proofs new forms need, not the scheduled ones
    proofs = []
    before, after = controller.pass_one._prove_reentrant_layouts, controller.pass_one._prove_deferred_layouts
    controller.pass_one._prove_reentrant_layouts = lambda *args: (proofs.append("before"), before(*args))
    controller.pass_one._prove_deferred_layouts = lambda: (proofs.append("after"), after())
    ids = torch.randint(0, 20, (B, 6))
    for _ in range(2):
        controller.loss(model(ids).pow(2).sum(1), "sum").backward()
        model.zero_grad()
    assert proofs == ["before"]
    mixing.append(True)
    with pytest.raises(RuntimeError, match="gradient mixes several examples"):
        controller.loss(model(ids).pow(2).sum(1), "sum").backward()
    model.zero_grad()
    mixing.clear()
    controller.loss(model(ids).pow(2).sum(1), "sum").backward()
    assert proofs == ["before", "after"]


class TransposedRegion(nn.Module):
    """A Linear below a region that applies another Linear to (B, T, d) hidden states with T == B, on some
    steps (``flip``) to them transposed and back: the same function, another form of the region's graph."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin = nn.Linear(3, 3), nn.Linear(3, 3)
        self.flip = False

    def region(self, h):
        return self.lin(h.transpose(0, 1)).transpose(0, 1) if self.flip else self.lin(h)

    def forward(self, x):
        return checkpoint(self.region, self.inp(x), use_reentrant=True)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_region_whose_layer_holds_its_examples_on_another_dim_in_another_form_gets_each_forms_layout(clipping):
    """The reentrant twin of test_batch_layout's: the layouts of a region's calls are kept per form of the
    region's graph, so going back to the first form does not read each example's norm from the rows the
    other form proved (it did: 1.1e4 for an example of norm 1.5e4, 2.4e3 for one of 5.4)."""
    torch.manual_seed(0)
    n = 4
    model = TransposedRegion().double()
    x = torch.randn(n, n, 3, dtype=torch.float64)
    x[0] *= 100
    plain = copy.deepcopy(model)  # its region called directly: no checkpoint in the loop
    per_example = reference_per_example_grads(plain, lambda i: plain.region(plain.inp(x[i:i + 1])).pow(2).sum(), n)
    _, ref_norms = clipped_sum(per_example, 1.0)
    assert_norms_as_forms_alternate(model, x, ref_norms, clipping)


def test_the_whole_model_checkpointed_leaves_the_input_without_gradient_as_without_reentrant_checkpointing():
    """Pass 1 through reentrant checkpoints is a backward without inputs, and so is pass 2, which repeats it
    (pass_two.py): the gradients they accumulate into the graph's leaves (the input here) are set aside and
    dropped, as neither pass forms one without reentrant checkpointing (book-keeping too takes two passes under
    checkpointing: modes.mode_of_step). Until 2026-11-27 pass 2 was a backward of sum_i c_i L_i, which left the
    input a clipped gradient. The parameters' clipped sums agree."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(B, 4)
    grads = {}
    for clipping in CLIPPING_MODES:
        for reentrant in (True, False):
            controller = ghostdp.GhostClipping(model, 0.1, clipping=clipping)
            leaf = x.clone().requires_grad_()
            model.zero_grad(set_to_none=True)
            controller.loss(checkpoint(model, leaf, use_reentrant=reentrant).pow(2).sum(1)).backward()
            controller.detach()
            grads[clipping, reentrant] = (leaf.grad, [p.grad.clone() for p in model.parameters()])
        (x_reentrant, p_reentrant), (x_plain, p_plain) = grads[clipping, True], grads[clipping, False]
        assert x_reentrant is None and x_plain is None
        for a, b in zip(p_reentrant, p_plain):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_gradients_accumulated_before_the_step_are_kept():
    model = Net()
    ids = torch.randint(0, 20, (B, 6))
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    controller.loss(model(ids).pow(2).sum(1)).backward()
    first = [p.grad.clone() for p in model.parameters()]
    controller.loss(model(ids).pow(2).sum(1)).backward()  # a second physical batch adds to p.grad
    for p, g in zip(model.parameters(), first):
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-12, atol=0)


def test_a_parameter_read_directly_inside_a_region_is_refused():
    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h):
            return self.lin(h) + 0.1 * (h @ self.lin.weight.T)  # the second use: outside the Linear's call

    model = Net(region=lambda h, block: model.reader(block(h)))
    model.reader = Reader()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="'reader.lin.weight' outside the forward of the module"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()
    assert all(p.grad is None for p in model.parameters())  # nothing was written


def test_a_region_that_uses_a_parameter_without_any_module_call_is_refused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.inner = nn.Module()
            self.inner.w = nn.Parameter(torch.randn(8, 8))
            self.head = nn.Linear(8, 2)

        def forward(self, ids):
            h = checkpoint(lambda x: torch.tanh(x @ self.inner.w), self.emb(ids), use_reentrant=True)
            return self.head(h.mean(1))

    model = Model()
    controller = ghostdp.GhostClipping(model, 1.0, check_model=False)
    with pytest.raises(RuntimeError, match="'inner.w' outside the forward"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()


def test_a_module_without_a_norm_rule_inside_a_region_is_refused_with_the_fix():
    model = Net(region=lambda h, block: model.scale(block(h)))
    model.scale = Scale(8)
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(NotImplementedError, match="no norm rule, inside a reentrant activation checkpoint"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()


def test_t5s_relative_bias_trained_inside_a_region_is_refused_with_the_fix():
    """Its bias is looked up per example as a recorded forward runs (norms/relative_bias.py); a reentrant checkpoint's
    forward runs without gradient, so its recomputation would take another shape: refused there. (Before 2026-11-28
    the attention owned the bias and took the fallback, refused in a region too; before that, torch's checkpoint
    failed on the shapes first, with no note.)"""
    import transformers
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=20, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
        dropout_rate=0.0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    controller = ghostdp.GhostClipping(model, 1.0)
    ids = torch.randint(3, 20, (B, 6))
    out = model(input_ids=ids, decoder_input_ids=ids.flip(1))
    with pytest.raises(NotImplementedError, match="relative attention bias of T5Attention is trained inside a "
                                                  "reentrant activation checkpoint.*use_reentrant': False"):
        controller.loss(out.logits.pow(2).flatten(1).sum(1)).backward()


def test_a_reentrant_checkpoint_inside_another_is_refused_with_the_fix():
    model = Net(region=lambda h, block: checkpoint(block, h, use_reentrant=True))
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(NotImplementedError, match="inside another one.*use_reentrant': False"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()


def test_several_processes_are_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(controller_module, "distributed_rank_and_size", lambda: (0, 2))
    model = Net()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(NotImplementedError, match="several processes or FSDP.*use_reentrant=False"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()


def test_a_parameter_used_again_after_its_norm_was_formed_alone_is_refused_then_learned():
    """Two regions that called two blocks call the first block twice, on a step without a layout proof (the graph
    and the regions' forms look as before): the steps before learned its parameters as used once, so its first
    call's norm is formed alone and the second is refused; a step after the refusal is exact. (A step with a
    proof counts every parameter's calls in its proof, before pass 1: below.)"""
    model = Net(blocks=2, order=[0, 1])
    ids = torch.randint(0, 20, (B, 6))
    controller = ghostdp.GhostClipping(model, 1.0)
    without_scheduled_proofs(controller)
    controller.loss(model(ids).pow(2).sum(1)).backward()  # each block's parameters used once
    model.order = [0, 0]
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="used again in this step"):
        controller.loss(model(ids).pow(2).sum(1)).backward()
    assert all(p.grad is None for p in model.parameters())
    controller.detach()
    check_net(model, ids)  # and a step after the refusal is exact


def test_a_block_called_in_a_second_region_on_a_step_with_a_proof_is_exact_at_once():
    """The step's graph outside the regions is new (a second region), so its layouts are proven before pass 1,
    and that proof's recomputation counts the block's two calls: before 2026-11-26 such a step was refused
    ("used again in this step") and only the next one learned it."""
    model = Net(blocks=1, order=[0])
    ids, labels = torch.randint(0, 20, (B, 6)), torch.randint(0, 3, (B,))
    controller = ghostdp.GhostClipping(model, 1e-3)
    controller.loss(model(ids).pow(2).sum(1)).backward()  # one region: the block's parameters used once
    model.order = [0, 0]
    model.zero_grad(set_to_none=True)
    controller.loss(per_example_loss(CE, model(ids), labels)).backward()
    got = {n: p.grad.clone() for n, p in trainable(model)}
    controller.detach()
    plain = plain_copy(model)
    expected, _ = clipped_sum(reference_per_example_grads(plain, lambda i: CE(plain(ids[i:i + 1]), labels[i:i + 1]),
                                                          B), 1e-3)
    assert relative_error(got, expected) < 1e-9


def checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    return model


def check_transformers(model, inputs, loss, rtol=1e-9):
    plain = copy.deepcopy(model)
    plain.gradient_checkpointing_disable()
    checkpointing(model)

    def call(m, sl):
        return m(**{k: v[sl] for k, v in inputs.items()})

    assert_exact_over_steps(model, plain, call, loss, rtol=rtol)


def test_bert_with_reentrant_checkpointing():
    from transformers import BertConfig, BertForSequenceClassification
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    ids, mask = padded_text(30)
    check_transformers(model, dict(input_ids=ids, attention_mask=mask), classification_loss(torch.randint(0, 3, (B,))))


def test_gpt2_tied_with_reentrant_checkpointing():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids, mask = padded_text(25)
    labels = ids.masked_fill(mask == 0, -100)
    check_transformers(model, dict(input_ids=ids, attention_mask=mask),
                       lambda out, sl: per_example_loss(CE, out.logits[:, :-1], labels[sl][:, 1:]))


def test_llama_with_reentrant_checkpointing():
    from transformers import LlamaConfig, LlamaForSequenceClassification
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, num_labels=3, pad_token_id=0))
    ids, mask = padded_text(30)
    # LlamaRMSNorm computes in float32 even in a float64 model (as in test_models.py).
    check_transformers(model, dict(input_ids=ids, attention_mask=mask),
                       classification_loss(torch.randint(0, 3, (B,))), rtol=1e-6)


def test_the_norm_pass_frees_each_parameters_gradient_as_soon_as_it_is_accumulated():
    # Otherwise pass 1 would hold a whole model's worth of unclipped gradients (profiling.bench
    # --checkpointing reentrant --cpu-memory tensors: ghost at 1.27x plain's peak instead of 1.06x).
    from ghostdp.clipping import reentrant
    model = Net()
    seen = []  # at each gradient dropped: which parameters still hold one (a user's gradient hook is refused)
    drop = reentrant._drop_grad

    def watch(p):
        drop(p)
        seen.append([n for n, q in model.named_parameters() if q.grad is not None])

    controller = keeping_factors(model)  # one backward: pass 1 only
    reentrant._drop_grad = watch
    try:
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()
    finally:
        reentrant._drop_grad = drop
    assert len(seen) >= len(list(model.parameters())) and all(held == [] for held in seen), seen
    assert all(p.grad is not None for p in model.parameters())  # then the clipped sums are written


def keeping_factors(model):
    """Book-keeping that keeps its factors under checkpointing: per-group clipping (one group), which has
    no two-pass form (a single norm's book-keeping takes two passes there: modes.mode_of_step)."""
    return ghostdp.GhostClipping(model, [1.0], clipping="bookkeeping",
                                 parameter_groups=[[p for _, p in trainable(model)]])


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping", "per-group bookkeeping"])
def test_a_regions_graph_and_its_inputs_gradient_are_freed_when_its_backward_is_done(clipping):
    # The region's calls held their nodes (book-keeping: its kept factors too), and through them the
    # recomputation's detached input and its gradient, to the end of pass 1: 21 MB at BERT L=4, B=32
    # (profiling.bench --checkpointing reentrant --cpu-memory tensors).
    import weakref
    recomputed, alive_at_next = [], []

    def region(h, block):
        if torch.is_grad_enabled() and h.is_leaf and h.requires_grad:  # the checkpoint's detached input
            alive_at_next.append([ref() is not None for ref in recomputed])
            recomputed.append(weakref.ref(h))
        return block(h)

    model = Net(blocks=3, region=region)
    if clipping == "per-group bookkeeping":
        controller = keeping_factors(model)
    else:
        controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    ids = torch.randint(0, 20, (B, 6))
    controller.loss(model(ids).pow(2).sum(1)).backward()  # the first step also proves the layouts
    recomputed.clear(), alive_at_next.clear()
    controller.loss(model(ids).pow(2).sum(1)).backward()
    assert alive_at_next[:3] == [[], [False], [False, False]]  # pass 1's regions; ghost's pass 2 follows


def test_a_tensor_that_requires_grad_but_is_no_parameter_read_inside_a_region_is_refused_with_the_fix():
    gain = torch.ones(8, requires_grad=True)  # the region's closure reads it; pass 1 would add to gain.grad
    model = Net(region=lambda h, block: block(h) * gain)
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(NotImplementedError, match=r"shape \(8,\) that requires grad but is not a trainable parameter"):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()
    assert gain.grad is None


@pytest.mark.parametrize("used_outside", [True, False])
def test_a_tensor_from_outside_a_region_read_inside_without_being_its_input_is_refused(used_outside):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.block, self.head = nn.Embedding(20, 8), Block(8), nn.Linear(8, 3)

        def forward(self, ids):
            h = self.emb(ids)
            context = torch.tanh(h)  # of the graph outside the region, read by its closure
            out = checkpoint(lambda x: self.block(x) + context, h, use_reentrant=True).mean(1)
            return self.head(out + context.mean(1) if used_outside else out)

    model = Model()
    controller = ghostdp.GhostClipping(model, 1.0)
    # Used outside too, the tensor's node is in the step's audited graph: refused as the region reads it. Used
    # only inside, the forward (no graph in the region) left it out of that graph; torch refuses the second
    # backward through it that the checkpoint's own backward causes, before any gradient is written.
    match = "computed outside a reentrant activation checkpoint" if used_outside else "backward through the graph"
    with pytest.raises((NotImplementedError, RuntimeError), match=match):
        controller.loss(model(torch.randint(0, 20, (B, 6))).pow(2).sum(1)).backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_layout_proof_under_reentrant_checkpointing_stays_at_the_steps_between_proofs_peak(clipping):
    """Exact tensor bytes: the proof of a reentrant step ran after pass 1, and every call whose layout it was to
    prove held its output grad and inputs through pass 1: a proof step peaked at 6-12x plain's checkpointed peak
    (BERT L=4, H=256, B=8-32; here 4.4x the steps between proofs) before 2026-11-26. The proof now runs first, so
    that pass 1 forms each norm as its G arrives."""
    proof, between = proof_and_between_peaks(clipping, use_reentrant=True)
    assert proof <= 1.05 * between, (proof, between)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_the_first_reentrant_step_forms_each_norm_as_it_arrives(clipping):
    """Exact tensor bytes of the first step (which forms every gradient, in both): its pass 1 could not know which
    parameters several regions share and held every layer's factors to its end (2.9x plain's first step at BERT
    L=4, H=256, B=16 before 2026-11-26; here 2.4x, now 1.02x). The proof before it now counts every parameter's
    calls."""
    from profiling.bench import tensor_peak_mb
    plain = tensor_peak_mb(checkpointed_bert_step(None, use_reentrant=True))
    private = tensor_peak_mb(checkpointed_bert_step(clipping, use_reentrant=True))
    assert private <= 1.3 * plain, (private, plain)
