"""Shared reference: the clipped sum from a per-example autograd loop, in float64."""
import dataclasses
import os

import pytest
import torch

import ghostdp
from ghostdp.norms import registry

RTOL = 1e-9


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `make test`'s workers: one core each (see the Makefile)
        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="device of the tests that take the `device` fixture (the sensitivity audit), e.g. cuda")


@pytest.fixture
def device(request):
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda was given, but torch.cuda.is_available() is False")
    return device


@pytest.fixture(autouse=True)
def float64_and_seed():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def no_fallback(monkeypatch):
    """Fails a test in which any module call takes the exact fallback."""
    from ghostdp.clipping import pass_one

    def refused(*args, **kwargs):
        raise AssertionError("a call took the exact fallback")
    monkeypatch.setattr(pass_one, "fallback_grads", refused)


def classified_as(labels):
    """A loss_of_output for assert_exact_model: each example's cross entropy of its logits against its label."""
    return lambda out, sl: torch.nn.functional.cross_entropy(out.logits, labels[sl], reduction="none")


def assert_warned_and_refused(model, step_loss, warned: str, refused: str):
    """Attaching to ``model`` warns (``warned``, a regex), and the step on ``step_loss(model)``, the (B,) losses of a
    forward, is refused (``refused``)."""
    with pytest.warns(UserWarning, match=warned):
        controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match=refused):
            controller.loss(step_loss(model)).backward()
    finally:
        controller.detach()


def assert_twin_keeps_other_code(model, parent, attribute, subclass, twin, name):
    """``parent.<attribute>`` (named ``name`` in ``model``) replaced by an instance of ``subclass``, a transformers
    class with a method of its own sharing the original's state: validate.fix leaves it in place with its warning,
    and the twin module's ``from_transformers`` refuses it, and a module of another class, by name."""
    own = subclass.__new__(subclass)
    own.__dict__.update(getattr(parent, attribute).__dict__)
    setattr(parent, attribute, own)
    with pytest.warns(UserWarning, match=rf"left '{name}' \({subclass.__name__}\) in place because its code is not "
                                         rf"the code {twin.__name__} computes again"):
        ghostdp.validate.fix(model)
    assert getattr(parent, attribute) is own
    with pytest.raises(ValueError, match="keeps its own forward"):
        twin.from_transformers(own)
    with pytest.raises(TypeError, match=r"from_transformers takes transformers' .*, got Linear"):
        twin.from_transformers(torch.nn.Linear(2, 2))


def without_scheduled_proofs(controller):
    """Switches off the layout proofs that a schedule repeats (layout.REPROOF_EVERY), and the forward checks on
    the same schedule (independence.py), for tests of what a step between proofs does (its forwards, its
    backwards, its peak memory) or of the proofs new graph forms need."""
    controller.pass_one.layouts.reproof_every = 0
    return without_forward_checks(controller)


def without_forward_checks(controller):
    """Switches off the reruns that check the forward on scheduled steps (clipping/independence.py), for tests of
    what the training forward itself does (its copies, its ops)."""
    controller.independence.every = 0
    return controller


def fallback_gain(x, weight):
    """x * weight through an op that ghostdp takes for no elementwise use of a parameter (addcmul, not a multiply:
    norms/parameter_uses.py), so that a module applying its own parameter so keeps the exact fallback that the tests
    using it are about."""
    return torch.addcmul(torch.zeros_like(x), x, weight)


class Gain(torch.nn.Module):
    """No norm rule (the fallback): an elementwise gain of either sign (fallback_gain)."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.5, 1.5, d))

    def forward(self, x):
        return fallback_gain(x, self.weight)


class StatefulGain(Gain):
    """No norm rule: a gain that adds a state its parent sets on it (``self.state``), as a recurrent cell may keep
    one (clipping/fallback_paths.py)."""

    def __init__(self, d):
        super().__init__(d)
        self.state = None

    def forward(self, x):
        y = fallback_gain(x, self.weight)
        return y if self.state is None else y + self.state


class HandsStateBack(torch.nn.Module):
    """The parent keeps the first call's returned output as the second call's state."""

    def __init__(self, d=2):
        super().__init__()
        self.gain = StatefulGain(d)
        self.mix = torch.nn.Linear(d, d, bias=False).requires_grad_(False)

    def forward(self, x):
        self.gain.state = None
        h = self.gain(x)
        self.gain.state = h
        out = self.gain(torch.tanh(self.mix(h)))
        self.gain.state = None
        return out


class Scale(torch.nn.Module):
    """No norm rule: its gradients come from the fallback."""

    def __init__(self, d):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return x * self.gain.exp()


class Unsteady(torch.autograd.Function):
    """The identity, whose backward scales its gradient by 1 + ``wobble`` on every second run, or on the runs in
    ``on_runs`` (counted from 1; any container): a kernel that does not give the same result twice (a GPU's
    atomics). A step of two passes runs it in the layout proof's backward (on checked steps), pass 1's and pass 2's
    (tests/privacy/test_pass_two.py, the FSDP case in distributed_worker.py)."""
    runs = 0
    wobble = 1e-6
    on_runs = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Unsteady.runs += 1
        scaled = Unsteady.runs % 2 == 1 if Unsteady.on_runs is None else Unsteady.runs in Unsteady.on_runs
        return grad * (1 + Unsteady.wobble * scaled)


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def reference_per_example_grads(model, example_loss, batch_size):
    """[{name: grad}] from one backward per example (example_loss(i) -> scalar). backward(), not
    autograd.grad: a reentrant activation checkpoint refuses the latter. p.grad is left as it was."""
    params = trainable(model)
    before = [p.grad for _, p in params]
    out = []
    try:
        for i in range(batch_size):
            for _, p in params:
                p.grad = None
            example_loss(i).backward()
            out.append({n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in params})
    finally:
        for (_, p), grad in zip(params, before):
            p.grad = grad
    return out


def clipped_sum_through_the_batch(losses, params, C=1.0):
    """Each example's gradient of ``params`` as the batch's backward forms it (one-hot cotangents on the batch's
    (B,) ``losses``, so whatever the batch shares in its forward or backward is the batch's), clipped to C and
    summed, flattened over the parameters: the per-example definition for a model that mixes examples, which a
    per-example loop (one example at a time) cannot reproduce."""
    total = 0
    for i in range(len(losses)):
        grads = torch.autograd.grad(losses, params, torch.eye(len(losses), dtype=losses.dtype)[i], retain_graph=True)
        g = torch.cat([t.flatten() for t in grads])
        total = total + g * min(1.0, C / (float(g.norm()) + 1e-6))
    return total


def clipped_sum(per_example, C):
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in grads.values())) for grads in per_example])
    total = {n: torch.zeros_like(g) for n, g in per_example[0].items()}
    for grads, norm in zip(per_example, norms):
        c = min(1.0, C / (float(norm) + 1e-6))
        for n, g in grads.items():
            total[n] += c * g
    return total, norms


CLIPPING_MODES = ("ghost", "bookkeeping")


def ghost_clipped_sum(model, batch_losses, C, clipping="ghost"):
    """The clipped sum ghostdp leaves in p.grad for batch_losses() -> (B,) losses."""
    controller = ghostdp.GhostClipping(model, C, clipping=clipping)
    try:
        model.zero_grad(set_to_none=True)
        controller.loss(batch_losses(), reduction="sum").backward()
        grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in trainable(model)}
        return grads, controller.last_norms
    finally:
        controller.detach()
        model.zero_grad(set_to_none=True)


def relative_error(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    diff = torch.cat([(got[n] - ref[n]).flatten() for n in ref])
    scale = torch.cat([ref[n].flatten() for n in ref]).abs().max()
    return float(diff.abs().max() / scale)


def assert_exact(model, batch_losses, example_loss, batch_size, rtol=RTOL):
    """ghostdp == per-example loop, in both clipping modes, with every example clipped and with none clipped."""
    model.train()
    per_example = reference_per_example_grads(model, example_loss, batch_size)
    _, norms = clipped_sum(per_example, 1.0)
    assert float(norms.min()) > 0, "degenerate test: an example has zero gradient"
    for C in (0.5 * float(norms.min()), 2.0 * float(norms.max())):
        ref, ref_norms = clipped_sum(per_example, C)
        for clipping in CLIPPING_MODES:
            got, got_norms = ghost_clipped_sum(model, batch_losses, C, clipping)
            assert float(((got_norms - ref_norms).abs() / ref_norms).max()) < rtol, (got_norms, ref_norms)
            err = relative_error(got, ref)
            assert err < rtol, f"{clipping}: clipped sum off by {err:.3e} at C={C}"
    return norms


def took_fallback(model, x, clipping="bookkeeping") -> set:
    """The names of the modules that took the exact fallback in one step on ``x`` (a DP loss of the sum of squares
    of each example's outputs), after checking that every trained parameter got a gradient."""
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        controller.loss(model(x).pow(2).sum(1), reduction="sum").backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        return set(controller.pass_one.took_fallback)
    finally:
        controller.detach()


def assert_exact_model(model, inputs, loss_of_output, batch_size, rtol=RTOL):
    """Convenience for models called as model(**inputs) or model(inputs) with batch-first tensors."""

    def call(sl):
        if isinstance(inputs, dict):
            return model(**{k: v[sl] for k, v in inputs.items()})
        return model(inputs[sl])

    def batch_losses():
        return loss_of_output(call(slice(None)), slice(None))

    def example_loss(i):
        return loss_of_output(call(slice(i, i + 1)), slice(i, i + 1)).sum()

    return assert_exact(model, batch_losses, example_loss, batch_size, rtol)


def assert_norms_as_forms_alternate(model, x, ref_norms, clipping):
    """ghostdp's per-example norms equal ``ref_norms`` at every step while ``model.flip`` switches the model's
    graph between two forms and back (a DP loss of the sum of squares of each example's outputs, C = 1e-3)."""
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    try:
        for flip in (False, True, False, True):
            model.flip = flip
            controller.loss(model(x).pow(2).sum(tuple(range(1, x.dim()))), "sum").backward()
            model.zero_grad()
            assert torch.allclose(controller.last_norms, ref_norms, rtol=1e-9), (flip, controller.last_norms,
                                                                                  ref_norms)
    finally:
        controller.detach()


def count_forward_rule_calls(monkeypatch, bodies: dict) -> dict:
    """{key: the calls that the rule registered for the forward body ``bodies[key]`` has formed}, counted from now
    on: each entry is replaced, for the test, by one whose rule counts and then forms as before."""
    calls = {}
    for key, body in bodies.items():
        entry = registry._FORWARD_RULES[body]

        def counted(*args, key=key, rule=entry.rule):
            calls[key] = calls.get(key, 0) + 1
            return rule(*args)

        monkeypatch.setitem(registry._FORWARD_RULES, body, dataclasses.replace(entry, rule=counted))
    monkeypatch.setattr(registry, "_BY_CLASS", {})
    return calls
