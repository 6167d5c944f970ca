"""peft's adapters that add x dW^T, dW formed from their own parameters (norms/peft_deltas.py): exact against the
per-example loop by the rule, not the fallback; a call with a dropout in training is declined (the fallback)."""
import peft
import pytest
import torch
from torch import nn

from conftest import assert_exact, took_fallback

D_IN, D_OUT, B = 8, 8, 4
CONFIGS = {
    "waveft": lambda **o: peft.WaveFTConfig(n_frequency=8, **o),
    "randlora": lambda **o: peft.RandLoraConfig(r=2, **o),
    "delora": lambda **o: peft.DeloraConfig(r=2, **o),
    "gralora": lambda **o: peft.GraloraConfig(r=4, gralora_k=2, **o),
    "c3a": lambda **o: peft.C3AConfig(block_size=4, **o),
    "hira": lambda **o: peft.HiraConfig(r=2, **o),
    "shira": lambda **o: peft.ShiraConfig(r=2, **o),
    "vblora": lambda **o: peft.VBLoRAConfig(r=2, num_vectors=8, vector_length=4, topk=2, **o),
    "unilora": lambda **o: peft.UniLoraConfig(r=2, theta_d_length=16, **o),
    "tinylora": lambda **o: peft.TinyLoraConfig(r=2, **o),
}
SHARED = ("vblora", "unilora", "tinylora")  # one vector bank (or vector, or vectors by groups) for the adapted layers
BANKS = ("vector_bank", "theta_d", "tinylora_v")  # their names


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(D_IN, D_OUT), nn.Linear(D_OUT, 3)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return self.head(h if h.dim() == 2 else h.mean(1))


def _adapted(kind, **options):
    torch.manual_seed(0)
    model = peft.get_peft_model(TwoLayers(), CONFIGS[kind](target_modules=["proj"], modules_to_save=["head"],
                                                           **options)).double().train()
    for name, p in model.named_parameters():
        if p.requires_grad and "proj" in name:  # several adapters start at zero
            nn.init.normal_(p, std=0.3)
    return model


def _assert_exact(model, x):
    labels = torch.randint(0, 3, (B,))
    criterion = nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: criterion(model(x), labels), lambda i: criterion(model(x[i:i + 1]), labels[i:i + 1]).sum(),
                 B, rtol=1e-6)


@pytest.mark.parametrize("shape", [(B, D_IN), (B, 3, D_IN)])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_each_adapter_is_exact_in_both_modes_by_the_rule(kind, shape):
    model = _adapted(kind)
    x = torch.randn(*shape, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


def test_an_adapter_with_a_dropout_in_training_takes_the_exact_fallback():
    model = _adapted("randlora", randlora_dropout=0.5)
    x = torch.randn(B, D_IN, dtype=torch.float64)
    assert took_fallback(model, x) == {"base_model.model.proj"}


class ThreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Linear(D_IN, D_OUT), nn.Linear(D_OUT, D_OUT), nn.Linear(D_OUT, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))).mean(1))


@pytest.mark.parametrize("through_the_tuner", [False, True])
@pytest.mark.parametrize("kind", SHARED)
def test_a_bank_shared_by_two_adapted_layers_is_exact_by_the_rule(kind, through_the_tuner):
    """VB-LoRA's vector bank (UniLoRA's vector, TinyLoRA's vectors by groups) is a parameter of both layers: its
    per-example gradient is the sum of both calls' (a use each), and its norm takes their cross terms. The tuner model that holds it for them owns none
    of it (fallback.LENT_CONTAINERS): a forward through it, as a PeftModel with a task type runs, took the exact
    fallback of the whole model before 2026-12-07."""
    torch.manual_seed(0)
    model = peft.get_peft_model(ThreeLayers(), CONFIGS[kind](target_modules=["first", "second"])).double().train()
    if through_the_tuner:
        model = model.base_model
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    banks = [p for n, p in model.named_parameters() if p.requires_grad and any(b in n for b in BANKS)]
    assert banks
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == set()


@pytest.mark.parametrize("kind", SHARED)
def test_a_bank_used_by_its_holder_itself_is_refused(kind):
    """The tuner model does not own the bank it lends its layers: were its own forward to read the bank, that gradient
    would lie outside every call of an owner, and the audit refuses it (not a zero that no norm counts)."""
    import ghostdp
    torch.manual_seed(0)
    model = peft.get_peft_model(ThreeLayers(), CONFIGS[kind](target_modules=["first", "second"])).base_model.train()
    bank = next(p for n, p in model.named_parameters() if any(b in n for b in BANKS))
    forward = type(model).forward
    model.forward = lambda x: forward(model, x) + bank.sum()  # the holder's own forward reads the bank
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="outside the forward of the module that owns it"):
            controller.loss(model(torch.randn(B, 3, D_IN)).pow(2).sum(1), reduction="sum").backward()
    finally:
        controller.detach()



class NestedContainers(nn.Module):
    """A Linear plus x A_0 + x A_1, its A_k in a ModuleDict of ParameterLists (as peft's AdaMSS keeps its subspaces),
    and a scale in a ModuleList of ParameterDicts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, D_OUT)
        self.subspaces = nn.ModuleDict({"default": nn.ParameterList([nn.Parameter(torch.randn(D_IN, D_OUT))
                                                                    for _ in range(2)])})
        self.scales = nn.ModuleList([nn.ParameterDict({"s": nn.Parameter(torch.randn(D_OUT))})])

    def forward(self, x):
        return (self.lin(x) + sum(x @ a for a in self.subspaces["default"])) * self.scales[0]["s"]


class WithNestedContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = NestedContainers(), nn.Linear(D_OUT, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.block(x)).mean(1))


def test_parameters_in_nested_containers_are_their_holders_and_exact():
    """A ModuleDict (or ModuleList) of ParameterLists and ParameterDicts holds parameters for the module that holds it
    (fallback.is_parameter_container). Until 2026-12-07 the ModuleDict owned them, which no call used, and every step
    was refused (peft's AdaMSS, TinyLoRA); now its holder does, exact by the fallback."""
    from ghostdp.norms.fallback import owned_parameters
    torch.manual_seed(0)
    model = WithNestedContainers().double().train()
    assert set(owned_parameters(model.block)) == {"subspaces.default.0", "subspaces.default.1", "scales.0.s"}
    x = torch.randn(B, 3, D_IN, dtype=torch.float64)
    _assert_exact(model, x)
    assert took_fallback(model, x) == {"block"}


