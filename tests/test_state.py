"""State hygiene: per-step reset, trainable set read every step, double backward, eval and no_grad."""
import pytest
import torch
from torch import nn

import ghostdp
from conftest import (assert_exact, clipped_sum, ghost_clipped_sum, reference_per_example_grads, relative_error,
                      trainable)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.use_b = True

    def forward(self, x):
        return self.a(x) + (self.b(x) if self.use_b else 0)


def loss_fns(model, x):
    return (lambda: model(x).pow(2).sum(1)), (lambda i: model(x[i:i + 1]).pow(2).sum())


def test_unused_parameter_contributes_zero_not_last_steps_norm():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1e-3)
    batch, one = loss_fns(model, x)
    controller.loss(batch(), "sum").backward()
    model.use_b = False
    model.zero_grad()
    controller.loss(batch(), "sum").backward()
    controller.detach()
    ref, norms = clipped_sum(reference_per_example_grads(model, one, 5), 1e-3)
    assert torch.allclose(controller.last_norms, norms, rtol=1e-12)
    assert torch.allclose(model.a.weight.grad, ref["a.weight"], rtol=1e-10)
    assert model.b.weight.grad is None  # unused this step: no gradient, and no stale norm above


def test_freezing_and_unfreezing_after_attaching():
    model, x = Branchy(), torch.randn(5, 4)
    batch, one = loss_fns(model, x)
    controller = ghostdp.GhostClipping(model, 1.0)
    model.a.weight.requires_grad_(False)
    model.zero_grad()
    controller.loss(batch(), "sum").backward()
    controller.detach()
    per_example = reference_per_example_grads(model, one, 5)
    assert "a.weight" not in per_example[0]
    _, norms = clipped_sum(per_example, 1.0)
    assert torch.allclose(controller.last_norms, norms, rtol=1e-12)
    model.a.weight.requires_grad_(True)
    assert_exact(model, batch, one, 5)  # and back to everything trainable


def test_backward_twice_on_one_loss():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    loss = controller.loss(model(x).pow(2).sum(1))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()
    loss = controller.loss(model(x).pow(2).sum(1))
    loss.backward()
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()


def test_eval_and_no_grad_forwards_record_nothing():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    model.eval()
    out = model(x)
    assert not controller.recorder.live and out.grad_fn is not None
    with pytest.raises(RuntimeError, match=r"eval\(\) mode"):
        controller.loss(out.pow(2).sum(1)).backward()
    model.train()
    with torch.no_grad():
        model(x)
    assert not controller.recorder.live
    with torch.no_grad():
        loss = controller.loss(model(x).pow(2).sum(1))
    assert loss.grad_fn is None  # nothing to backpropagate, so no clipping can be skipped
    with pytest.raises(ValueError, match="do not require grad"):
        controller.per_example_norms(model(x).detach().sum(1))


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_trained_submodule_in_eval_mode_inside_a_training_model_is_recorded_and_exact(clipping):
    """A submodule put in eval() mode (to switch off its dropout) while the model trains went unrecorded, and
    its trainable parameters were refused as read outside their module's forward, which they were not. It is
    recorded now (the model it was attached with is in train() mode) and exact against the per-example loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 2)).double().train()
    model[0].eval()
    model[1].eval()  # no dropout: the loop below sees the same function
    x = torch.randn(6, 4, dtype=torch.float64)
    per_example = reference_per_example_grads(model, lambda i: model(x[i:i + 1]).pow(2).sum(), 6)
    C = 0.5 * float(clipped_sum(per_example, 1.0)[1].min())
    ref, ref_norms = clipped_sum(per_example, C)
    got, got_norms = ghost_clipped_sum(model, lambda: model(x).pow(2).sum(1), C, clipping)
    assert float(((got_norms - ref_norms).abs() / ref_norms).max()) < 1e-9
    assert relative_error(got, ref) < 1e-9
    assert not model[0].training and model.training


def test_forward_without_backward_leaves_no_state():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(x)
    assert controller.recorder.live
    del out
    assert not controller.recorder.live


def test_backward_of_a_loss_that_is_not_a_dp_loss_is_refused():
    model, x = Branchy(), torch.randn(5, 4)
    ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="did not come from a ghostdp loss alone"):
        model(x).sum().backward()


# Gradient that reaches the model with or after the DP loss's own: an auxiliary term added to the DP loss
# (either order), or a second backward through the graph the DP loss's backward retained. Each would put an
# unclipped, data-dependent gradient into the update.
AFTER_THE_DP_LOSS = {
    "added before": lambda dp, out: (out.pow(2).sum() * 1e3 + dp()).backward(),
    "added after": lambda dp, out: (dp() + out.pow(2).sum() * 1e3).backward(),
    "second backward": lambda dp, out: (dp().backward(retain_graph=True), (out.pow(2).sum() * 1e3).backward()),
}


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("variant", ["added before", "added after", "second backward"])
def test_a_loss_added_to_the_dp_loss_or_a_second_backward_is_refused(clipping, variant):
    """Before, in ghost mode, each of these went through: the DP loss's backward continued into the model in
    the caller's backward, and a call that pass 1 had reached let any gradient pass (p.grad moved by 1.6e4
    with C = 1e-3). Now the DP loss's backward is self-contained and any other gradient that reaches a
    recorded call is refused, before it reaches p.grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).train()
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    x = torch.randn(8, 4)
    out = model(x)
    with pytest.raises(RuntimeError, match="did not come from a ghostdp loss alone"):
        AFTER_THE_DP_LOSS[variant](lambda: controller.loss(out.pow(2).sum(1), "sum"), out)
    total = sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)
    assert float(total) ** 0.5 <= 8 * 1e-3 * (1 + 1e-6)  # at most the clipped sum of the 8 examples


TWO_DP_LOSSES = {
    "added": lambda first, second: (first + second).backward(),
    "one after the other": lambda first, second: (first.backward(), second.backward()),
}


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("variant", list(TWO_DP_LOSSES))
@pytest.mark.parametrize("heads", ["one head", "two heads on a shared body"])
def test_two_dp_losses_of_one_forward_are_refused_naming_the_fix(clipping, variant, heads):
    """Each DP loss clips an example's gradient to C, so two of one forward would let it move the update by
    up to 2C. Both were refused before, but with messages about something else (a parameter read outside its
    module; autograd's "backward through the graph a second time"): now the message says what happened."""
    torch.manual_seed(0)
    body, head_a, head_b = nn.Linear(4, 5), nn.Linear(5, 2), nn.Linear(5, 2)
    model = nn.ModuleList([body, head_a, head_b])
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    h = torch.tanh(body(torch.randn(8, 4)))
    out_a = head_a(h)
    out_b = out_a if heads == "one head" else head_b(h)
    first, second = controller.loss(out_a.pow(2).sum(1), "sum"), controller.loss(out_b.abs().sum(1), "sum")
    with pytest.raises(RuntimeError, match="already reached by the backward of another ghostdp loss.*one DP loss per"):
        TWO_DP_LOSSES[variant](first, second)


def test_autograd_grad_of_another_loss_after_the_dp_loss_is_refused():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(x)
    controller.loss(out.pow(2).sum(1)).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="did not come from a ghostdp loss alone"):
        torch.autograd.grad(out.sum(), list(model.parameters()))


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_on_a_trainable_parameter_is_refused_until_removed(clipping, kind):
    """Before, in ghost mode a hook scaling a weight's gradient by 1e4 took the update 1e4 times past C, and
    book-keeping skipped any such hook silently. A hook added after attaching counts too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).train()
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    x = torch.randn(8, 4)
    hook = (lambda g: g * 1e4) if kind == "register_hook" else (lambda p: p.grad.mul_(1e4) and None)
    handle = getattr(model[2].weight, kind)(hook)
    with pytest.raises(RuntimeError, match=r"'2.weight' have a gradient hook"):
        controller.loss(model(x).pow(2).sum(1), "sum").backward()
    assert all(p.grad is None for p in model.parameters())  # refused before anything was written
    handle.remove()
    controller.loss(model(x).pow(2).sum(1), "sum").backward()
    total = sum(p.grad.pow(2).sum() for p in model.parameters())
    assert float(total) ** 0.5 <= 8 * 1e-3 * (1 + 1e-6)


def _private_classifier(**options):
    """(model, DP optimizer, DP criterion, loader) of a small classifier made private on 8 examples, one batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return ghostdp.PrivacyEngine(seed=0).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8), criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, **options)


# A term added to the DP loss that reads a parameter outside the model's recorded calls: its gradient reaches p.grad
# through no recorded call and lies outside the graph the step's audit walks. Built before the model's forward, the
# caller's backward accumulates it after the DP loss's backward; built after, before it.
TERM_READING_A_WEIGHT = {
    "built before the forward": True,
    "built after the forward": False,
}


@pytest.mark.filterwarnings("error::UserWarning")  # the batch after the refusal is the loader's, accounted as such
@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("order", list(TERM_READING_A_WEIGHT))
def test_a_term_reading_a_weight_outside_the_model_added_to_the_dp_loss_is_refused_and_not_stepped(clipping, order):
    """Before 2026-11-26 both modes took the step: the term's gradient, 1e-3 * sum_i x_i, was too small for the DP
    optimizer's sum bound (8 x C), and one example's share of it is not bounded by C at all."""
    model, optimizer, criterion, loader = _private_classifier(clipping=clipping)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    if TERM_READING_A_WEIGHT[order]:
        term = 1e-3 * (x @ model[0].weight.T).sum()
        loss = criterion(model(x), y)
    else:
        loss = criterion(model(x), y)
        term = 1e-3 * (x @ model[0].weight.T).sum()
    with pytest.raises(RuntimeError, match="reached the parameter '0.weight' through a backward that did not come "
                                           "from ghostdp's passes"):
        (loss + term).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ghostdp.optim.PrivacyStepError, match="accumulated it into p.grad unclipped"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing stepped
    for x, y in loader:  # the usual loop: its zero_grad() drops p.grad and the refused batch, not this one
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_backward_of_a_term_that_reaches_only_parameters_is_refused_and_autograd_grad_is_not():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="reached the parameter 'a.weight'"):
        model.a.weight.pow(2).sum().backward()
    model.zero_grad()
    torch.autograd.grad(model.a.weight.pow(2).sum(), [model.a.weight])  # nothing accumulates into p.grad
    controller.loss(model(x).pow(2).sum(1)).backward()
    assert model.a.weight.grad is not None
    controller.detach()  # a detached model trains as any other
    model.a.weight.pow(2).sum().backward()


def test_parameter_read_outside_its_module_is_refused():
    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) @ self.emb.weight.T

    model = ReadsWeight()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match="'emb.weight' outside the forward"):
        controller.loss(model(torch.randn(3, 4)).sum(1)).backward()


def test_trainable_tensor_outside_the_model_is_clipped_nowhere_and_cannot_be_stepped():
    # A tensor that requires grad but is not a model parameter (peft's enable_input_require_grads makes
    # the embeddings' output one) is never stepped by the DP optimizer, so the controller lets it be;
    # an optimizer over a parameter outside the model is refused, and so (since 2026-11-26) is the DP loss's
    # backward into one (a bare controller's user could step it: two passes gave it an unclipped gradient).
    lin = nn.Linear(3, 3)
    temperature = nn.Parameter(torch.tensor(2.0))
    engine = ghostdp.PrivacyEngine(seed=0)
    with pytest.raises(ValueError, match="not the model's|not parameters of the model|model"):
        engine.make_private(module=lin, optimizer=torch.optim.SGD([temperature, *lin.parameters()], lr=0.1),
                            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
                                torch.randn(8, 3), torch.randn(8, 3)), batch_size=4),
                            criterion=nn.MSELoss(), noise_multiplier=1.0, max_grad_norm=1.0)
    controller = ghostdp.GhostClipping(nn.Linear(3, 3), 1.0)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="were not parameters of the model when it was made private"):
        controller.loss((controller.module(x) * temperature).sum(1)).backward()
    controller.loss((controller.module(x) * 2.0).sum(1)).backward()
    assert controller.module.weight.grad is not None and controller.last_norms.shape == (4,)


def test_output_without_batch_dimension_is_refused():
    class PositionsFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(5, 3)

        def forward(self, positions, x):  # the first tensor is not batch-major: no batch size known
            return x + self.pos(positions)

    model = PositionsFirst()
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(torch.arange(5).unsqueeze(0), torch.randn(4, 5, 3))
    with pytest.raises(RuntimeError, match="no dimension of size 4 that could hold the examples"):
        controller.loss(out.pow(2).sum((1, 2))).backward()


class Scaled(torch.autograd.Function):
    """x * w with its own backward: no norm rule sees it, so its module takes the exact fallback."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).reshape(-1, w.shape[0]).sum(0)


class ScaledByAFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return Scaled.apply(x, self.w)


class SequenceFirstCall(nn.Module):
    """Takes (B, T, 3) and calls its module without a rule on (T, B, 3)."""

    def __init__(self):
        super().__init__()
        self.scale, self.head = ScaledByAFunction(), nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(x.transpose(0, 1)).transpose(0, 1)).mean(1))


@pytest.mark.parametrize("T", [5, 4])
def test_a_module_without_a_rule_called_sequence_first_is_split_on_its_proven_dim_and_exact(T):
    """Its fallback splits each output grad by example on the dim the layout proof found (dim 1 here), also where
    T equals the batch size. Until 2026-12-02 it split on dim 0 only and the call was refused (peft's DoRA on a
    Linear of a (T, B, d) input, found by the differential fuzzer)."""
    torch.manual_seed(0)
    model, x = SequenceFirstCall().double(), torch.randn(4, T, 3, dtype=torch.float64)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[i:i + 1]).pow(2).sum(), 4)


class ScaledTransposed(nn.Module):
    """A module without a rule whose (3, B) output holds the examples on its last dim, its features' place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return Scaled.apply(x, self.w).t()


def test_a_module_without_a_rule_with_the_examples_on_its_last_dim_is_refused_naming_the_dim():
    class ExamplesLast(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.head = ScaledTransposed(), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.scale(x)).t())

    model = ExamplesLast()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match=r"module 'scale' \(ScaledTransposed\) produced an output of shape \(3, 4\) "
                                           r"whose gradient has the batch's size only on its last dim \(1\), which "
                                           r"ghostdp takes for the output's features.*put the examples on an earlier"):
        controller.loss(model(torch.randn(4, 3)).pow(2).sum(1)).backward()


def test_a_sequence_first_rnn_given_a_batch_first_input_is_refused_naming_the_dims():
    """nn.GRU(batch_first=False) on (B, T, d): its fallback splits on dim 1, where the batch is not (the GRU runs
    its recurrence over the examples); the message names both dims and the fix."""

    class BatchFirstIntoSequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.GRU(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0].mean(1))

    model = BatchFirstIntoSequenceFirst()
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError, match=r"module 'rnn' \(GRU\) produced an output of shape \(4, 5, 4\) whose "
                                           r"gradient has the batch's size on dim 0, not on dim 1.*run it batch-first"):
        controller.loss(model(torch.randn(4, 5, 3)).pow(2).sum(1)).backward()


def test_nonfinite_losses_are_named_or_skipped():
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)
    poison = torch.tensor([1.0, float("nan"), 1.0, float("inf"), 1.0])
    with pytest.raises(ghostdp.NonFiniteLossError, match=r"examples \[1, 3\]"):
        controller.loss(model(x).pow(2).sum(1) * poison).backward()
    skipping = ghostdp.GhostClipping(Branchy(), 1.0, nonfinite="skip")
    losses = skipping.module(x).pow(2).sum(1) * poison
    coeffs = skipping.clip_coefficients(losses)
    assert coeffs[1] == 0 and coeffs[3] == 0 and torch.all(coeffs[[0, 2, 4]] > 0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1"])
def test_invalid_clipping_norm(bad):
    with pytest.raises(ValueError, match="max_grad_norm"):
        ghostdp.GhostClipping(nn.Linear(2, 2), bad)


def test_model_is_not_wrapped_and_detach_restores_it():
    model = Branchy()
    keys = list(model.state_dict())
    controller = ghostdp.GhostClipping(model, 1.0)
    assert controller.module is model and list(model.state_dict()) == keys
    controller.detach()
    model(torch.randn(2, 4)).sum().backward()  # no hook left: an ordinary backward works
    assert all(p.grad is not None for _, p in trainable(model))


def test_a_checkpoint_function_of_another_library_that_refuses_grad_is_refused_with_the_fix():
    # torch's reentrant checkpoints (and subclasses) are supported: tests/clipping/test_reentrant_checkpointing.py.
    # Another library's copy (DeepSpeed has one) refuses the norm pass's autograd.grad as torch's did.
    class ForeignCheckpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if not torch.autograd._is_checkpoint_valid():
                raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
            return grad * 2

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(ForeignCheckpoint.apply(model[0](torch.randn(5, 4))))
    with pytest.raises(NotImplementedError, match="not recognised.*use_reentrant=False"):
        controller.loss(out.pow(2).sum(1)).backward()


def test_fsdp1_is_refused_with_the_fix():
    # FSDP1 refuses to build without an accelerator, so the wrapper is made without its __init__: the check
    # reads only the module types (accelerate's FSDP plugin wraps with it unless fsdp_version=2).
    from torch.distributed.fsdp import FullyShardedDataParallel
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(wrapper)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), wrapper)
    with pytest.raises(NotImplementedError, match=r"FSDP1 .*wrapping \['1'\].*fsdp_version=2"):
        ghostdp.GhostClipping(model, 1.0)


def test_a_parameter_unfrozen_after_attaching_is_watched_from_its_next_step():
    model, x = Branchy(), torch.randn(5, 4)
    model.b.weight.requires_grad_(False)
    controller = ghostdp.GhostClipping(model, 1.0)
    model.b.weight.requires_grad_(True)
    controller.loss(model(x).pow(2).sum(1)).backward()  # the step's audit hooks it
    with pytest.raises(RuntimeError, match="reached the parameter 'b.weight'"):
        model.b.weight.sum().backward()


def test_a_refused_accumulation_in_a_logical_batch_of_chunks_is_dropped_by_zero_grad_with_the_batch():
    """zero_grad() inside a logical batch keeps the chunks' clipped sums; after a refused accumulation it clears
    p.grad and the batch's records, so that the next logical batch trains as usual."""
    model, optimizer, criterion, loader = _private_classifier(max_physical_batch_size=4)
    chunks = iter(loader)
    x, y = next(chunks)
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()  # the first of two chunks: no step yet
    x, y = next(chunks)
    with pytest.raises(RuntimeError, match="through a backward that did not come from ghostdp's passes"):
        (criterion(model(x), y) + 1e-3 * (x @ model[0].weight.T).sum()).backward()
    with pytest.raises(ghostdp.optim.PrivacyStepError, match="unclipped"):
        optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    for x, y in loader:  # the next logical batch, two chunks
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert optimizer.last_step_taken


@pytest.mark.filterwarnings("error::UserWarning")
def test_a_refused_backward_between_steps_costs_the_next_batch_nothing():
    """A backward of an evaluation loss between two steps (refused: it would reach p.grad) drops no chunk of the
    batch the loop yields next, before its zero_grad()."""
    model, optimizer, criterion, loader = _private_classifier()
    model.eval()
    with pytest.raises(RuntimeError, match="did not come from ghostdp's passes"):
        model(torch.randn(8, 4)).sum().backward()
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert optimizer.last_step_taken


def test_a_dp_optimizer_built_again_for_the_controller_leaves_the_old_one_to_be_freed():
    """A DP optimizer built again for a controller (a Trainer's new optimizer) takes the old one's place: the old one's
    norm-pass checks ran at every pass too and kept it, its state included, alive; the watch's listener is the new
    one's. The new one refuses the step after a refused accumulation."""
    import gc
    import weakref
    from ghostdp.randomness import RandomSource
    model, x = Branchy(), torch.randn(5, 4)
    controller = ghostdp.GhostClipping(model, 1.0)

    def dp_optimizer():
        return ghostdp.DPOptimizer(torch.optim.Adam(model.parameters()), controller=controller, noise_multiplier=1.0,
                                   expected_batch_size=5, sample_rate=0.1, accountant=None,
                                   random_source=RandomSource(seed=0))

    old = weakref.ref(dp_optimizer())
    new = dp_optimizer()
    gc.collect()
    assert old() is None
    model.eval()  # nothing recorded: the backward reaches the parameters' accumulators, where the watch refuses it
    with pytest.raises(RuntimeError, match="did not come from ghostdp's passes"):
        model(x).sum().backward()
    with pytest.raises(ghostdp.PrivacyStepError, match="unclipped"):
        new.step()
