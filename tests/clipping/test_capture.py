"""Captured calls (ghostdp/clipping/capture.py): no probe on those layers. Book-keeping's pass 1 names the
edges of the output grads it keeps whole; with two passes their nodes' pre-hooks hand G over. Exact
against the per-example loop in float64; the probe's other duties (refusing a backward that is not a DP
loss's, the inputs' versions, a backward without inputs, the graph's lifetime) each triggered."""
import gc
import itertools
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ghostdp
import ghostdp.clipping.pass_one as pass_one_module
from ghostdp.clipping.capture import CAPTURED_CALL
from ghostdp.clipping.probe import ProbeIdentity
from ghostdp.norms.factors import OuterProduct
from ghostdp.norms.linear import _conv1d_holds_output_grad, _linear_holds_output_grad
from conftest import (assert_exact_model, clipped_sum, ghost_clipped_sum, reference_per_example_grads, relative_error,
                      without_forward_checks, without_scheduled_proofs)
from test_graph_audit import ReadsChildWeightSometimes
from test_models import B, classification_loss, padded_text, tiny_bert


def recorded_calls(output):
    """([captured calls], [probed calls]) in the graph below ``output``."""
    captured, probed = [], []
    stack, seen = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        call = node.metadata.get(CAPTURED_CALL)
        if call is not None:
            captured.append(call)
        if type(node) is ProbeIdentity._backward_cls:
            probed.append(node.call)
        stack.extend(n for n, _ in node.next_functions)
    return captured, probed


def recorded_modules(output):
    """({modules of captured calls}, {modules of probed calls}) in the graph below ``output``."""
    captured, probed = recorded_calls(output)
    return {c.module for c in captured}, {c.module for c in probed}


class TokenNet(nn.Module):
    """Linear layers on (B, T, d): with a bias (a view of addmm), without (mm's unsafe view), and one whose
    output an in-place ReLU modifies; a LayerNorm (always probed) and a head on (B, d)."""

    def __init__(self, d=6):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d, bias=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        h = torch.relu_(self.up(x))
        return self.head(self.norm(self.down(h) + x).mean(1))


def named_modules_of(output):
    """{modules of captured calls whose edge pass 1 names}, {modules of the other captured calls}."""
    calls = recorded_calls(output)[0]
    return {c.module for c in calls if c.named}, {c.module for c in calls if not c.named}


@pytest.mark.parametrize("budget", [None, 1])
def test_arrived_grads_wait_for_the_end_of_the_backward_unless_they_fill_the_queue_budget(monkeypatch, budget):
    """PassOne.arrive: the G that pre-hooks hand over are received once the backward is done (the Python work
    runs faster so), unless they and the norm queue hold batched.QUEUE_ELEMENTS: then each is received at
    once, inside the backward. Exact either way, in both modes."""
    from ghostdp.norms import batched
    if budget is not None:
        monkeypatch.setattr(batched, "QUEUE_ELEMENTS", budget)
    model = TokenNet().double().train()
    x = torch.randn(B, 8, 6, dtype=torch.float64)
    for clipping in ("ghost", "bookkeeping"):
        controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
        inside = []
        receive = controller.pass_one.receive_captured
        controller.pass_one.receive_captured = lambda call, grad: (inside.append((
            call.module, controller.pass_one.current.delivers_by_hooks, controller.pass_one.current.proving)),
            receive(call, grad))
        for _ in range(2):  # the layout proof's backward, then pass 1's alone
            controller.loss(model(x).pow(2).sum(1)).backward()
        # Book-keeping's pass 1 names up's and head's edges (it keeps their G whole): their G come from the result.
        # Its layout proof, which reads only a projection of each G, names only the lowest (up) and takes the
        # others' G as their nodes run (PassOne._proof_sinks).
        from_result = {False: {model.up, model.head}, True: {model.up}} if clipping == "bookkeeping" else {
            False: set(), True: set()}
        assert {m for m, _, _ in inside} == {model.up, model.down, model.norm, model.head} - (
            {model.up} - from_result[False])
        assert {proving for _, _, proving in inside} == {True, False}
        assert all(during == (budget is not None and m not in from_result[proving]) for m, during, proving in inside)
        controller.detach()
    assert_exact_model(model, x, lambda out, sl: out.pow(2).sum(1), B)


def test_book_keeping_names_the_layers_whose_g_it_keeps_and_hooks_the_rest_above_them(monkeypatch):
    """Book-keeping names the edges of the layers whose G it keeps whole (Linear layers in full fine-tuning);
    a layer above one of those (the LayerNorm) is captured too, its G taken from its node's pre-hook."""
    model = TokenNet().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    out = model(torch.randn(B, 3, 6))
    assert recorded_modules(out) == ({model.up, model.down, model.norm, model.head}, set())
    assert named_modules_of(out) == ({model.up, model.down, model.head}, {model.norm})
    # 8 tokens: down's explicit (6, 12) gradients are smaller than its factors, so book-keeping keeps those
    # and drops G: its G is not held to the end of pass 1 but taken from its node's pre-hook.
    out = model(torch.randn(B, 8, 6))
    assert named_modules_of(out) == ({model.up, model.head}, {model.down, model.norm})
    named, by_hooks = watch_pass_one(controller, monkeypatch)
    controller.loss(out.pow(2).sum(1)).backward()
    # The layout proof names only up's edge (the lowest: PassOne._proof_sinks), pass 1 up's and head's; no probe.
    assert named == [1, 2]
    assert len(by_hooks) == 8  # each call once in the proof and once in pass 1
    proof, norm_pass = by_hooks[:4], by_hooks[4:]
    assert {m for m, hooked in proof if hooked} == {model.down, model.norm, model.head}
    assert {m for m, hooked in proof if not hooked} == {model.up}
    assert {m for m, hooked in norm_pass if hooked} == {model.down, model.norm}
    assert {m for m, hooked in norm_pass if not hooked} == {model.up, model.head}


def watch_pass_one(controller, monkeypatch):
    """Lists how many inputs each backward of pass 1 names, and for each captured grad received whether its
    node's pre-hook handed it over during the backward (PassOne.arrive), else the backward's result."""
    named, by_hooks, arrived = [], [], set()
    backward = pass_one_module._backward_to_probes
    monkeypatch.setattr(pass_one_module, "_backward_to_probes",
                        lambda losses, inputs, *a: (named.append(len(inputs)), backward(losses, inputs, *a))[1])
    arrive, receive = controller.pass_one.arrive, controller.pass_one.receive_captured

    def watched_arrive(call, grad):
        assert controller.pass_one.current.delivers_by_hooks  # during a backward of pass 1
        arrived.add(id(call))
        arrive(call, grad)

    def watched_receive(call, grad):
        by_hooks.append((call.module, id(call) in arrived))
        arrived.discard(id(call))
        receive(call, grad)

    controller.pass_one.arrive, controller.pass_one.receive_captured = watched_arrive, watched_receive
    return named, by_hooks


def test_two_passes_capture_every_call_above_the_lowest_and_take_their_grads_from_hooks(monkeypatch):
    """Ghost: the lowest ruled call (no input with a graph) keeps its probe, a sink of pass 1; every other one
    is captured, LayerNorms too. Pass 1 names only the probes, and the captured calls' G come from their
    nodes' pre-hooks as autograd reaches them (none is held to the end of pass 1). Exact against the loop."""
    model = TokenNet().train()
    controller = without_scheduled_proofs(ghostdp.GhostClipping(model, 1.0, clipping="ghost"))
    captured, probed = recorded_modules(model(torch.randn(B, 3, 6)))
    assert captured == {model.down, model.norm, model.head} and probed == {model.up}
    named, by_hooks = watch_pass_one(controller, monkeypatch)
    for _ in range(2):  # the first step proves the layouts: a backward of its own
        controller.loss(model(torch.randn(B, 3, 6)).pow(2).sum((1,))).backward()
    assert named == [1] * 5  # the one probe leaf, in the proof and in each pass 1 and pass 2 (pass 1's again)
    assert {m for m, _ in by_hooks} == {model.down, model.norm, model.head} and all(h for _, h in by_hooks)
    assert len(by_hooks) == 15
    # Once its norm is formed a captured call holds its inputs no longer: pass 2 frees the saved activations.
    out = model(torch.randn(B, 3, 6))
    controller.per_example_norms(out.pow(2).sum((1,)))
    calls = recorded_calls(out)[0]
    assert {c.module for c in calls} == {model.down, model.norm, model.head} and all(c.inputs == () for c in calls)
    controller.detach()
    assert_exact_model(model, torch.randn(B, 3, 6), classification_loss(torch.randint(0, 3, (B,))), B)


class SideBranch(nn.Module):
    """A probed side branch (its input has no graph) next to a layer whose input does."""

    def __init__(self, d=6):
        super().__init__()
        self.up, self.side, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.up(x) + self.side(torch.ones_like(x))))


def test_a_captured_call_with_no_probe_below_it_is_named_in_a_second_backward(monkeypatch):
    """An input that requires grad gives the first layer's input a graph, so two passes capture it; but the
    one probe (the side branch's) is not below it, so the backward that names the probes does not run its
    node: a second backward names its edge. With no probe at all, the first backward names every captured
    call, and each call whose node runs hands its G over by its pre-hook. Exact."""
    model = SideBranch().train()
    controller = without_scheduled_proofs(ghostdp.GhostClipping(model, 1.0, clipping="ghost"))
    x = torch.randn(B, 6, requires_grad=True)
    assert recorded_modules(model(x * 1.0)) == ({model.up, model.head}, {model.side})
    named, by_hooks = watch_pass_one(controller, monkeypatch)
    controller.loss(model(x * 1.0).pow(2).sum(1)).backward()
    controller.loss(model(x * 1.0).pow(2).sum(1)).backward()
    # The layout proof names the probe and up's edge at once (up has no probe or captured call below it:
    # PassOne._proof_sinks); pass 1 and pass 2 (pass 1's backwards again), on each step: the probe, then up's edge.
    assert named == [2] + [1, 1] * 4
    assert by_hooks == [(model.head, True), (model.up, False)] * 5
    controller.detach()
    assert_exact_model(model, x, classification_loss(torch.randint(0, 3, (B,))), B)
    mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).train()
    controller = ghostdp.GhostClipping(mlp, 1.0, clipping="ghost")
    inputs = torch.randn(B, 4, requires_grad=True)
    assert recorded_modules(mlp(inputs * 1.0)) == ({mlp[0], mlp[2]}, set())
    named, by_hooks = watch_pass_one(controller, monkeypatch)
    controller.loss(mlp(inputs * 1.0).pow(2).sum(1)).backward()
    assert named == [1, 2, 2]  # the proof (the lowest layer's edge: PassOne._proof_sinks), then passes 1 and 2
    # The top layer's node runs (the first layer's named edge lies below it): its G comes by its pre-hook.
    assert by_hooks == [(mlp[2], True), (mlp[0], False)] * 3
    controller.detach()
    assert_exact_model(mlp, inputs, lambda out, sl: out.pow(2).sum(1), B)


def test_captured_layers_are_exact_including_an_output_modified_in_place():
    for tokens in (3, 8):  # down captured, then probed
        assert_exact_model(TokenNet(), torch.randn(B, tokens, 6), classification_loss(torch.randint(0, 3, (B,))), B)


def test_bert_in_book_keeping_captures_every_layer_but_the_position_embeddings_and_is_exact():
    model = tiny_bert().train()
    ids, mask = padded_text(30)
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    out = model(input_ids=ids, attention_mask=mask).logits
    captured, probed = recorded_modules(out)
    embeddings = model.bert.embeddings
    linear = {m for m in model.modules() if isinstance(m, nn.Linear)}
    layer_norms = {m for m in model.modules() if isinstance(m, nn.LayerNorm)}
    # The position embeddings' output is one row for the whole batch, broadcast to it by a probe. The
    # LayerNorms, whose G book-keeping does not keep, are captured above the named layers.
    assert named_modules_of(out) == (linear | {embeddings.word_embeddings, embeddings.token_type_embeddings},
                                     layer_norms)
    assert probed == {embeddings.position_embeddings}
    controller.detach()
    assert_exact_model(model, {"input_ids": ids, "attention_mask": mask},
                       classification_loss(torch.randint(0, 3, (B,))), B)


class FirstTokenHead(nn.Module):
    """A pooler: a Linear on the first token of (B, T, d) hidden states, as BERT's. ``hidden_alive`` lists, for
    each backward that reaches the body's output grad, whether the hidden states were alive then."""

    def __init__(self, d=6):
        super().__init__()
        self.body, self.pooler = nn.Linear(d, d), nn.Linear(d, 3)
        self.hidden_alive = []

    def forward(self, x):
        below = self.body(x)
        hidden = below * 2.0  # saves no tensor for its backward: only the pooler's input holds hidden
        alive = weakref.ref(hidden)
        if below.requires_grad:  # not in ghostdp's reruns without gradient (independence.py)
            below.register_hook(lambda grad: self.hidden_alive.append(alive() is not None))
        return self.pooler(hidden[:, 0])


def test_book_keeping_holds_a_copy_of_a_first_token_not_the_whole_hidden_states():
    """The pooler's input is a view of the (B, T, d) hidden states. Book-keeping holds the inputs of its layers
    until the clipped sums; holding that view would keep all T tokens alive through pass 1, where the layer's own
    backward frees them once it has run. It holds a copy of the first token: the hidden states are freed before
    pass 1 reaches the layer below, and the step stays exact. (Ghost's pass 2 needs the whole graph again.)"""
    model = FirstTokenHead().double().train()
    x = torch.randn(B, 16, 6, dtype=torch.float64)
    for clipping, alive in (("bookkeeping", False), ("ghost", True)):
        controller = without_scheduled_proofs(ghostdp.GhostClipping(model, 1.0, clipping=clipping))
        for _ in range(2):  # the layout proof's backward and pass 1, then pass 1 alone
            model.hidden_alive.clear()
            controller.loss(model(x).pow(2).sum(1)).backward()
        assert model.hidden_alive[0] is alive, clipping  # pass 1's (ghost's pass 2 follows)
        controller.detach()
    assert_exact_model(model, x, lambda out, sl: out.pow(2).sum(1), B)


def test_lora_a_is_named_for_its_narrow_output_and_lora_b_hooked_above_it():
    """A rank-2 adapter on T=16 tokens: book-keeping keeps its explicit gradients and drops G. lora_A's G
    (B, T, 2) is a sixteenth of its (B, T, 32) input (capture.narrow_output), so pass 1 names its edge and
    holds that small G instead of probing it; lora_B (a wide output), with lora_A's named node right below
    it, takes G from its node's pre-hook and is not named. No adapter keeps a probe. Exact."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_bert(), LoraConfig(r=2, target_modules=["query", "value"])).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    ids = torch.randint(1, 30, (B, 16))
    out = model(input_ids=ids).logits
    lora_a = {m for n, m in model.named_modules() if n.endswith("lora_A.default")}
    lora_b = {m for n, m in model.named_modules() if n.endswith("lora_B.default")}
    captured, probed = recorded_modules(out)
    assert len(lora_a) == 4 and not probed & (lora_a | lora_b) and captured >= lora_a | lora_b
    named, hooked = named_modules_of(out)
    assert named & (lora_a | lora_b) == lora_a and hooked & (lora_a | lora_b) == lora_b
    controller.detach()
    assert_exact_model(model, {"input_ids": ids}, classification_loss(torch.randint(0, 3, (B,))), B)


def test_a_narrow_output_is_named_only_by_book_keeping():
    """capture.narrow_output: an output with at most 1/8 of its input's elements. Book-keeping names such a
    layer's edge though it keeps explicit gradients (a lowest call, no sink below: it would otherwise be
    probed); with two passes the lowest call stays a probe. Exact in both modes."""
    from ghostdp.clipping.capture import narrow_output
    assert narrow_output((torch.zeros(2, 4, 16),), torch.zeros(2, 4, 2))
    assert not narrow_output((torch.zeros(2, 4, 16),), torch.zeros(2, 4, 3))
    model = nn.Sequential(nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False)).double().train()
    x = torch.randn(B, 32, 16, dtype=torch.float64)
    for clipping, named in (("bookkeeping", {model[0]}), ("ghost", set())):
        controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
        out = model(x)
        assert named_modules_of(out)[0] == named
        assert (model[0] in recorded_modules(out)[1]) == (clipping == "ghost")
        del out
        controller.detach()
    assert_exact_model(model, x, lambda out, sl: out.pow(2).sum((1, 2)), B)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float64, torch.float64)])
def test_the_forward_predicate_agrees_with_what_book_keeping_keeps(dtypes):
    """_linear_holds_output_grad (from the forward's shapes) == the weight's factor keeping G (OuterProduct.kept),
    over widths, token counts and dtypes; with a trainable bias G is always held (its summed tokens)."""
    out_dtype, in_dtype = dtypes
    for T, d, p in itertools.product((1, 2, 3, 8, 64), (2, 16, 96), (2, 16, 96)):
        x, out = torch.zeros(3, T, d, dtype=in_dtype), torch.zeros(3, T, p, dtype=out_dtype)
        factor = OuterProduct(out, x, (p, d), input_side="right")
        keeps_g = factor.kept() is factor
        assert _linear_holds_output_grad(None, (x,), out, {"weight": None}) == keeps_g, (T, d, p)
        conv = OuterProduct(x, out, (d, p), input_side="left")  # transformers' Conv1D: x @ W
        assert _conv1d_holds_output_grad(None, (x,), out, {"weight": None}) == (conv.kept() is conv), (T, d, p)
        assert _linear_holds_output_grad(None, (x,), out, {"weight": None, "bias": None})
        assert not _linear_holds_output_grad(None, (x,), out, {})


def test_a_backward_that_is_not_a_dp_loss_is_refused_at_a_captured_layer():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).train()
    ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    out = model(torch.randn(B, 4))
    assert set(recorded_modules(out)[0]) == {model[0], model[2]}
    with pytest.raises(RuntimeError, match="did not come from a ghostdp loss alone"):
        out.sum().backward()


def test_an_input_modified_in_place_after_the_forward_is_refused():
    """Autograd refuses that itself where pass 1 runs the layer's node (it unpacks what the node saved); the
    lowest captured layer's node never runs in pass 1, so the call checks its inputs' versions."""
    class ScalesAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 2)

        def forward(self, x):
            out = self.first(x)
            x.mul_(2.0)  # after first read it: its rule would see the doubled values
            return out

    model = ScalesAfter().train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    losses = model(torch.randn(B, 4)).pow(2).sum(1)
    with pytest.raises(RuntimeError, match="module 'first' .* was modified in place after its forward"):
        controller.loss(losses, reduction="sum").backward()


def test_two_forwards_under_one_dp_loss_are_exact():
    """Two views of each example through the same model (a contrastive set-up): every captured call of
    both forwards is found in the loss's graph, and each parameter's two calls give its cross terms."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).train()
    a, b = torch.randn(B, 3), torch.randn(B, 3)

    def losses(sl):
        return (model(a[sl]) * model(b[sl])).sum(1)

    per_example = reference_per_example_grads(model, lambda i: losses(slice(i, i + 1)).sum(), B)
    ref, ref_norms = clipped_sum(per_example, 0.1)
    got, got_norms = ghost_clipped_sum(model, lambda: losses(slice(None)), 0.1, "bookkeeping")
    assert relative_error(got, ref) < 1e-9
    assert float(((got_norms - ref_norms).abs() / ref_norms).max()) < 1e-9


def test_a_forward_without_backward_frees_its_captured_calls_with_its_graph():
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).train()
    controller = ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping")
    x = torch.randn(B, 4)
    out = model(x)
    assert len(recorded_calls(out)[0]) == 2
    held = weakref.ref(x)  # the first call holds its input
    del x
    assert controller.recorder.live and held() is not None
    del out
    assert held() is None and not controller.recorder.live


def test_a_refused_step_leaves_no_reference_cycle_through_the_graph():
    """The audit gives a captured call its edge (a reference to its node, which holds the call): dropped
    after pass 1 and on a refusal, or the graph would outlive the step. (The model's branch for the whole batch on one
    example's data mixes the examples, which the forward check finds: off here, for the graph's lifetime alone.)"""
    model = ReadsChildWeightSometimes().train()
    controller = without_forward_checks(ghostdp.GhostClipping(model, 1.0, clipping="bookkeeping"))
    for refused in (True, False):
        x = torch.randn(B, 4)
        if refused:
            x[0, 0] = 7.0  # takes the path that reads the child's weight outside its forward
        out = model(x)
        assert len(recorded_calls(out)[0]) == 1
        held = weakref.ref(x)  # the captured call holds its input while it lives
        loss = controller.loss(out.pow(2).sum(1), reduction="sum")
        del out, x
        if refused:
            with pytest.raises(RuntimeError, match="outside the forward of the module"):
                loss.backward()
        else:
            loss.backward()
        del loss
        assert held() is None and not controller.recorder.live
        model.zero_grad(set_to_none=True)


def test_reentrant_checkpoints_hand_captured_grads_over_through_the_pre_hook():
    """Pass 1 through reentrant checkpoints is a backward without inputs: the first layer (captured: it runs
    before the region; layers after a checkpointed one are probed) gets its grad from its node's pre-hook;
    exact against the loop without checkpointing."""
    class Net(nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            self.first, self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
            self.checkpointed = checkpointed

        def forward(self, x):
            h = torch.tanh(self.first(x))
            h = checkpoint(self.body, h, use_reentrant=True) if self.checkpointed else self.body(h)
            return self.head(torch.tanh(h))

    plain, model = Net(False), Net(True)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(B, 4)
    losses = lambda m, sl: m(x[sl]).pow(2).sum(1)
    per_example = reference_per_example_grads(plain, lambda i: losses(plain, slice(i, i + 1)).sum(), B)
    ref, _ = clipped_sum(per_example, 0.1)
    controller = ghostdp.GhostClipping(model.train(), 0.1, clipping="bookkeeping")
    received = []
    original = controller.pass_one.receive_captured
    controller.pass_one.receive_captured = lambda call, grad: (received.append(call.module), original(call, grad))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        controller.loss(losses(model, slice(None)), reduction="sum").backward()
        got = {n: p.grad for n, p in model.named_parameters()}
        assert relative_error(got, ref) < 1e-9
    assert set(received) == {model.first} and len(received) >= 2  # each step (and a layout proof)
