"""peft's LoHa and LoKr on a Linear or a convolution (norms/peft_lycoris.py): exact against the per-example loop, by
their rule, not the fallback; every declined call exact by the fallback."""
import peft
import pytest
import torch
from torch import nn

from conftest import assert_exact, took_fallback
from ghostdp.norms.fallback import attached_rule
from ghostdp.norms.peft_lycoris import _adapters_applied, _computes_the_adapters

D_IN, D_OUT, B = 6, 5, 4


class TwoLayers(nn.Module):
    """A Linear on (B, T, in) or (B, in) inputs, then a head; ``transposed``: the input handed over non-contiguous."""

    def __init__(self, transposed=False, d_in=D_IN, d_out=D_OUT):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)
        self.head = nn.Linear(d_out, 3)
        self.transposed = transposed

    def forward(self, x):
        if self.transposed:  # (B, in, T) -> (B, T, in), a non-contiguous view: F.linear adds the bias by itself
            x = x.transpose(1, 2)
        h = torch.tanh(self.proj(x))
        return self.head(h if h.dim() == 2 else h.mean(1))


def _config(kind, saved=("head",), r=2, target_modules=("proj",), **options):
    config = peft.LoHaConfig if kind == "loha" else peft.LoKrConfig
    return config(r=r, alpha=3, target_modules=list(target_modules), init_weights=False,
                  modules_to_save=list(saved), **options)


def _adapted(kind, model=None, **options):
    model = peft.get_peft_model(model or TwoLayers(), _config(kind, **options))
    return model.double().train()


def _adapter_module(model):
    return model.base_model.model.proj


def _adapter_module_of(model, name):
    return model.base_model.model.get_submodule(name)


def _assert_exact(model, x):
    labels = torch.randint(0, 3, (x.shape[0],))
    criterion = nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: criterion(model(x), labels),
                 lambda i: criterion(model(x[i:i + 1]), labels[i:i + 1]).sum(), len(labels))


@pytest.mark.parametrize("kind", ["loha", "lokr"])
@pytest.mark.parametrize("shape", [(B, D_IN), (B, 3, D_IN)])
def test_the_adapter_is_exact_in_both_modes_by_its_rule(kind, shape):
    torch.manual_seed(0)
    model = _adapted(kind)
    x = torch.randn(*shape, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


@pytest.mark.parametrize("options, forms", [
    ({"r": 1, "decompose_both": True}, {"lokr_w1_a": (2, 1), "lokr_w1_b": (1, 3), "lokr_w2_a": (4, 1),
                                        "lokr_w2_b": (1, 4)}),
    ({"r": 1}, {"lokr_w1": (2, 3), "lokr_w2_a": (4, 1), "lokr_w2_b": (1, 4)}),
    ({"r": 8}, {"lokr_w1": (2, 3), "lokr_w2": (4, 4)}),
    ({"r": 8, "decompose_factor": 2}, {"lokr_w1": (2, 2), "lokr_w2": (4, 6)})])
def test_each_form_of_lokrs_kronecker_factors_is_exact(options, forms):
    """Each factor of kron(W1, W2) a matrix or a product of two; its shape chosen by decompose_factor."""
    torch.manual_seed(1)
    model = _adapted("lokr", TwoLayers(d_in=12, d_out=8), **options)
    got = {n.split(".")[-2]: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad and "lokr" in n}
    assert got == forms
    x = torch.randn(B, 3, 12, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_some_of_the_adapters_parameters_trained_and_two_adapters_active(kind):
    torch.manual_seed(2)
    model = _adapted(kind)
    model.add_adapter("second", _config(kind, saved=()))
    model.base_model.set_adapter(["default", "second"])
    model.double().train()
    first = next(n for n, p in model.named_parameters() if p.requires_grad and n.endswith(".default"))
    model.get_parameter(first).requires_grad_(False)
    _assert_exact(model, torch.randn(B, 3, D_IN, dtype=torch.float64))


def test_a_non_contiguous_input_whose_base_adds_its_bias_itself_is_exact_by_the_rule():
    """F.linear adds the bias to a non-contiguous input's product in a sum of its own: not counted as an adapter."""
    torch.manual_seed(3)
    model = _adapted("loha", TwoLayers(transposed=True))
    x = torch.randn(B, D_IN, 3, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_rank_or_module_dropout_in_training_takes_the_fallback(kind):
    """Both draw at random in the forward (a mask of dW's rows; the adapter skipped): the fallback reads the graph."""
    for options in ({"rank_dropout": 0.5}, {"module_dropout": 0.5}):
        model = _adapted(kind, **options)
        module = _adapter_module(model)
        x = torch.randn(B, 3, D_IN, dtype=torch.float64)
        assert not _computes_the_adapters(module, (x,), {})
        assert took_fallback(model, x) == {"base_model.model.proj"}
        model.eval()
        assert _computes_the_adapters(module, (x,), {})


def test_declined_calls_take_the_fallback():
    model = _adapted("loha")
    module = _adapter_module(model)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    assert attached_rule(module) is not None
    assert _computes_the_adapters(module, (x,), {})
    assert not _computes_the_adapters(module, (x,), {"scale": 2.0})
    assert not _computes_the_adapters(module, (x, x), {})
    module.merge()
    assert not _computes_the_adapters(module, (x,), {})
    module.unmerge()
    with model.disable_adapter():
        assert not _computes_the_adapters(module, (x,), {})


def test_a_skipped_adapter_is_seen_in_the_output_graph():
    """peft skips an adapter where torch.rand(1) <= module_dropout, even 0 (a draw of exactly 0): the output's graph
    then holds no sum for it, and the call takes the fallback instead of a gradient the call did not have."""
    torch.manual_seed(4)
    model = _adapted("lokr")
    module = _adapter_module(model)
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    assert _adapters_applied(module, (x,), {}, module(x)) == (x,)
    skipped = module.base_layer(x)  # what the forward returns where the draw skipped the adapter
    assert _adapters_applied(module, (x,), {}, skipped) is None
    xt = torch.randn(B, D_IN, 3, dtype=torch.float64, requires_grad=True).transpose(1, 2)
    skipped = module.base_layer(xt)  # F.linear's own sum with the bias, on a non-contiguous input
    assert type(skipped.grad_fn).__name__ == "AddBackward0"
    assert _adapters_applied(module, (xt,), {}, skipped) is None
    assert _adapters_applied(module, (xt,), {}, module(xt)) == (xt,)


def test_an_adapter_skipped_by_a_draw_of_zero_trains_by_the_fallback(monkeypatch):
    """Every draw 0, so peft skips the adapter at module_dropout 0: exact (its parameters without gradient)."""
    torch.manual_seed(5)
    model = _adapted("loha")
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *size, **options: torch.zeros(*size, **options))
    _assert_exact(model, x)


class Convolved(nn.Module):
    """A convolution (2-D or 1-D) on (B, 4, ...) inputs, mean-pooled into a head."""

    def __init__(self, dim=2, **options):
        super().__init__()
        self.conv = (nn.Conv2d if dim == 2 else nn.Conv1d)(4, 6, 3, **options)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(2).mean(2))


def _convolved(kind, dim=2, r=2, conv=None, **options):
    model = Convolved(dim, **(conv or {}))
    return peft.get_peft_model(model, _config(kind, r=r, target_modules=["conv"], **options)).double().train()


@pytest.mark.parametrize("kind, dim, r, conv, options, forms", [
    ("loha", 2, 2, {"stride": 2, "padding": 1}, {}, None),
    ("loha", 2, 2, {"dilation": 2, "groups": 2}, {}, None),
    ("loha", 1, 2, {"padding": 1}, {}, None),
    ("lokr", 2, 8, {"stride": 2, "padding": 1}, {}, {"lokr_w1": (2, 2), "lokr_w2": (3, 2, 3, 3)}),
    ("lokr", 2, 1, {"dilation": 2, "groups": 2}, {"decompose_both": True},
     {"lokr_w1": (2, 1), "lokr_w2_a": (3, 1), "lokr_w2_b": (1, 18)})])
def test_the_adapter_on_a_convolution_is_exact_by_its_rule(kind, dim, r, conv, options, forms):
    """dW as the base's convolution's weight: its factor is the convolution rule's (conv.py); LoKr's W2 whole with
    the kernel's dims, or a product whose columns hold them."""
    torch.manual_seed(6)
    model = _convolved(kind, dim, r, conv, **options)
    if forms is not None:
        got = {n.split(".")[-2]: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad and "lokr" in n}
        assert got == forms
    x = torch.randn(B, 4, 9, 9, dtype=torch.float64) if dim == 2 else torch.randn(B, 4, 11, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


@pytest.mark.parametrize("kind, dim, conv, options", [
    ("loha", 2, {}, {"use_effective_conv2d": True}),  # the CP form: a core tensor
    ("loha", 2, {"padding": 1, "padding_mode": "reflect"}, {}),  # dW's convolution pads with zeros
    ("lokr", 1, {"padding": 1}, {})])  # a 3-D W2, which torch.kron aligns from the left
def test_the_forms_the_rule_does_not_know_take_the_fallback_exactly(kind, dim, conv, options):
    torch.manual_seed(7)
    model = _convolved(kind, dim, 2, conv, **options)
    x = torch.randn(B, 4, 9, 9, dtype=torch.float64) if dim == 2 else torch.randn(B, 4, 11, dtype=torch.float64)
    assert not _computes_the_adapters(_adapter_module_of(model, "conv"), (x,), {})
    _assert_exact(model, x)
    assert took_fallback(model, x) == {"base_model.model.conv"}
