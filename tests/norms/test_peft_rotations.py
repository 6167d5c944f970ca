"""peft's orthogonal adapters, OFT, HRA and BOFT (norms/peft_rotations.py): exact against the per-example loop by their
rules, not the fallback; the declined calls."""
import peft
import pytest
import torch
from torch import nn

from conftest import assert_exact, took_fallback
from ghostdp.norms.fallback import attached_rule
from ghostdp.norms.peft_rotations import _adapts_a_frozen_linear, _boft_without_dropout, _rotates_its_input

D_IN, D_OUT, B = 8, 5, 4
# From peft 0.22 OFT rotates a 4-D input along its last dim and OFT's Conv2d rotates its base's weight (up to 0.21: the
# patches of a convolution's 4-D input, through the rotation module): the shapes and forms each version has.
ROTATES_WEIGHTS = hasattr(peft.tuners.oft.layer.OFTRotationModule, "rotate")
LINEAR_SHAPES = [(B, D_IN), (B, 3, D_IN)] + ([(B, 2, 3, D_IN)] if ROTATES_WEIGHTS else [])


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D_IN, D_OUT)
        self.head = nn.Linear(D_OUT, 3)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return self.head(h if h.dim() == 2 else h.flatten(1, -2).mean(1))


CONFIGS = {"oft": peft.OFTConfig, "hra": peft.HRAConfig, "boft": peft.BOFTConfig}


def _adapted(kind="oft", saved=("head",), **options):
    config = CONFIGS[kind](target_modules=["proj"], init_weights=False, modules_to_save=list(saved), **options)
    model = peft.get_peft_model(TwoLayers(), config)
    for name, p in model.named_parameters():
        if "boft_s" in name:  # BOFT's scales start at one: spread them
            nn.init.normal_(p, 1.0, 0.3)
    return model.double().train()


def _assert_exact_by_rules(model, x):
    labels = torch.randint(0, 3, (B,))
    criterion = nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: criterion(model(x), labels),
                 lambda i: criterion(model(x[i:i + 1]), labels[i:i + 1]).sum(), B)
    assert took_fallback(model, x) == set()


def _rotation(model):
    return model.base_model.model.proj.oft_R["default"]


@pytest.mark.parametrize("options", [
    {"r": 2, "oft_block_size": 0},
    {"oft_block_size": 4, "block_share": True},
    {"r": 2, "oft_block_size": 0, "use_cayley_neumann": False},  # the exact Cayley transform, by a solve
    {"r": 4, "oft_block_size": 0, "num_cayley_neumann_terms": 3}])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_the_rotation_is_exact_in_both_modes_by_its_rule(options, shape):
    torch.manual_seed(0)
    _assert_exact_by_rules(_adapted(**options), torch.randn(*shape, dtype=torch.float64))


@pytest.mark.parametrize("kind, options", [
    ("hra", {"r": 2}),
    ("hra", {"r": 3, "apply_GS": True}),  # the reflections orthogonalised by Gram-Schmidt
    ("boft", {"boft_block_size": 4}),
    ("boft", {"boft_block_size": 2, "boft_n_butterfly_factor": 2})])  # peft sets the factor to 1 without CUDA
@pytest.mark.parametrize("shape", [(B, D_IN), (B, 3, D_IN)])
def test_reflections_and_butterflies_are_exact_in_both_modes_by_their_rules(kind, options, shape):
    torch.manual_seed(1)
    _assert_exact_by_rules(_adapted(kind, **options), torch.randn(*shape, dtype=torch.float64))


@pytest.mark.parametrize("kind, options", [("hra", {"r": 2}), ("boft", {"boft_block_size": 4})])
def test_two_active_adapters_some_parameters_frozen(kind, options):
    """Two adapters' rotations multiplied (and BOFT's scales), one parameter of the first frozen."""
    torch.manual_seed(2)
    model = _adapted(kind, **options)
    model.add_adapter("second", CONFIGS[kind](target_modules=["proj"], init_weights=False, **options))
    model.base_model.set_adapter(["default", "second"])
    for name, p in model.named_parameters():
        if "boft_s.second" in name:
            nn.init.normal_(p, 1.0, 0.3)
    model.double().train()
    adapted = [n for n, p in model.named_parameters() if p.requires_grad and ".default" in n and "head" not in n]
    model.get_parameter(adapted[0]).requires_grad_(False)
    _assert_exact_by_rules(model, torch.randn(B, 3, D_IN, dtype=torch.float64))


class Convolved(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, 6, 3, **options), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(2).mean(2))


@pytest.mark.parametrize("conv", [{}, {"stride": 2, "padding": 1}])
@pytest.mark.parametrize("options", [{"r": 2, "oft_block_size": 0}, {"oft_block_size": 6, "block_share": True}])
def test_the_rotation_of_a_convolutions_patches_is_exact_by_its_rule(conv, options):
    """OFT on a Conv2d rotates the input's unfolded patches (of the kernel's size) and folds them back, up to peft 0.21;
    from 0.22 it rotates the base's weight (peft_rotations.oft_conv_rule), which until 2026-12-07 was refused: the
    rotation modules, which the layer no longer calls, owned its parameters."""
    torch.manual_seed(3)
    config = peft.OFTConfig(target_modules=["conv"], init_weights=False, modules_to_save=["head"], **options)
    model = peft.get_peft_model(Convolved(**conv), config).double().train()
    _assert_exact_by_rules(model, torch.randn(B, 4, 7, 7, dtype=torch.float64))


@pytest.mark.parametrize("second_trains", [True, False])
def test_two_rotations_of_a_convolution_are_exact_by_its_rule(second_trains):
    """Two active adapters on a Conv2d, the second frozen or not (peft 0.22: W rotated by each in turn; up to 0.21:
    the patches rotated by each rotation module's call)."""
    torch.manual_seed(4)
    options = {"r": 2, "oft_block_size": 0}
    config = peft.OFTConfig(target_modules=["conv"], init_weights=False, modules_to_save=["head"], **options)
    model = peft.get_peft_model(Convolved(), config)
    model.add_adapter("second", peft.OFTConfig(target_modules=["conv"], init_weights=False, **options))
    model.base_model.set_adapter(["default", "second"])
    model.double().train()
    if not second_trains:
        next(p for n, p in model.named_parameters() if "oft_R.second" in n).requires_grad_(False)
    _assert_exact_by_rules(model, torch.randn(B, 4, 7, 7, dtype=torch.float64))


def test_declined_calls():
    """An input of more than 4 dims, other arguments, and COFT, whose forward projects the weight in place
    (ghostdp's parameter watch refuses that forward anyway)."""
    rotation = _rotation(_adapted(r=2, oft_block_size=0))
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    assert attached_rule(rotation) is not None
    assert _rotates_its_input(rotation, (x,), {})
    assert _rotates_its_input(rotation, (x.reshape(B, 3, 2, 4),), {})  # a convolution's: its patches rotated
    assert not _rotates_its_input(rotation, (x.reshape(B, 3, 2, 2, 2),), {})
    assert not _rotates_its_input(rotation, (x, x), {})
    assert not _rotates_its_input(rotation, (x,), {"scale": 1.0})
    assert not _rotates_its_input(_rotation(_adapted(oft_block_size=4, coft=True)), (x,), {})


def test_declined_hra_and_boft_calls():
    """Adapters disabled or merged, other arguments, a trained base (the forwards read its weight and bias
    directly), and BOFT's dropout in training, which the fallback reads from the graph (exact there)."""
    model = _adapted("hra", r=2)
    module = model.base_model.model.proj
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    assert attached_rule(module) is not None
    assert _adapts_a_frozen_linear(module, (x,), {})
    assert not _adapts_a_frozen_linear(module, (x, x), {})
    assert not _adapts_a_frozen_linear(module, (x,), {"scale": 1.0})
    module.merge()
    assert not _adapts_a_frozen_linear(module, (x,), {})
    module.unmerge()
    with model.disable_adapter():
        assert not _adapts_a_frozen_linear(module, (x,), {})
    module.base_layer.bias.requires_grad_(True)
    assert not _adapts_a_frozen_linear(module, (x,), {})
    dropped = _adapted("boft", boft_block_size=4, boft_dropout=0.5)
    module = dropped.base_model.model.proj
    assert not _boft_without_dropout(module, (x,), {})
    assert took_fallback(dropped, x) == {"base_model.model.proj"}
    dropped.eval()
    assert _boft_without_dropout(module, (x,), {})
