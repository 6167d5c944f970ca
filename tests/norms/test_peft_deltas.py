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
}


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
