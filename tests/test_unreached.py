"""Parameters the clipped gradient never reaches, updated by noise alone: warned of once (ghostdp/unreached.py)."""
import warnings

import pytest
import torch
from torch import nn

import ghostdp
from ghostdp.unreached import UNREACHED_STEPS


def _train(model, steps, clipping="bookkeeping", before_step=lambda step: None):
    """``steps`` private steps of two examples each (``before_step(k)`` before the k-th); the warnings of unreached
    parameters, by the step they came."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2 * steps, 5, 8), torch.randint(0, 2, (2 * steps,)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trained = [p for p in model.parameters() if p.requires_grad]
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attaching's notes (the fallback of nn.MultiheadAttention)
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(trained, lr=0.1), data_loader=loader,
            criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, clipping=clipping,
            poisson_sampling=False)
    found = []
    for step, (x, y) in enumerate(loader, start=1):
        before_step(step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
        found += [(step, str(w.message)) for w in caught if "got a clipped gradient of exactly zero" in str(w.message)]
    return found


class Attention(nn.Module):
    def __init__(self, fixed):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)
        if fixed:  # ghostdp.layers.MultiheadAttention, which calls its out_proj
            ghostdp.validate.fix(self)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0].mean(1))


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_lora_on_multihead_attentions_out_proj_is_named_once_after_the_first_steps(clipping):
    """torch applies out_proj.weight inside its attention function and never calls peft's adapter on it: the
    adapters' clipped sums are zero at every step, and the DP optimizer moves them by noise alone."""
    import peft
    model = peft.get_peft_model(Attention(fixed=False), peft.LoraConfig(r=2, target_modules=["out_proj"],
                                                                        modules_to_save=["head"]))
    found = _train(model, 2 * UNREACHED_STEPS, clipping)
    assert [step for step, _ in found] == [UNREACHED_STEPS]
    message = found[0][1]
    assert "2 trained parameter(s)" in message and "ghostdp.validate.fix(model)" in message
    assert "'base_model.model.attn.out_proj.lora_A.default.weight'" in message
    assert "'base_model.model.attn.out_proj.lora_B.default.weight'" in message and "modules_to_save" not in message


def test_lora_on_the_fixed_attentions_out_proj_trains_and_is_not_named():
    """After validate.fix the adapter is called; its A factor's clipped sum is zero at the first step only (peft
    starts B at zero), which is not named."""
    import peft
    model = peft.get_peft_model(Attention(fixed=True), peft.LoraConfig(r=2, target_modules=["out_proj"],
                                                                       modules_to_save=["head"]))
    assert _train(model, UNREACHED_STEPS + 1) == []


class SometimesUsed(nn.Module):
    """``unused`` is never called; ``sometimes`` only where ``use_sometimes`` is set (the loop sets it for one
    step: a flag the batch does not set, which the forward check would refuse)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 2)
        self.unused, self.sometimes = nn.Linear(8, 8), nn.Linear(8, 8)
        self.use_sometimes = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.use_sometimes:
            h = self.sometimes(h)
        return self.head(h.mean(1))


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
def test_a_layer_never_called_is_named_and_one_called_on_one_step_is_not(clipping):
    model = SometimesUsed()

    def before_step(step):
        model.use_sometimes = step == 3

    found = _train(model, UNREACHED_STEPS, clipping, before_step)
    assert len(found) == 1 and found[0][0] == UNREACHED_STEPS
    assert "2 trained parameter(s)" in found[0][1] and "'unused.bias', 'unused.weight'" in found[0][1]
    assert "sometimes" not in found[0][1]
