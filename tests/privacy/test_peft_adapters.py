"""Every peft adapter that trains on Linears, on two adapted layers of one model: exact against the per-example loop in
float64 (by its rule or the fallback), or refused; never trained off the loop (a hole). peft is not pinned, and its
releases change how adapters form their weights (0.22 rotated OFT's convolution weight instead of its input, and kept
AdaMSS's and TinyLoRA's parameters in nested containers, which ghostdp refused until 2026-12-07): this is the test
that a new release trips. A few adapters compute in float32 inside their forwards whatever the model's dtype: those are
compared within float32's rounding."""
from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from torch import nn

from conftest import clipped_sum, ghost_clipped_sum, reference_per_example_grads, relative_error
from ghostdp.clipping.generators import own_generators, random_states, restore_random_states

D, T, B = 16, 4, 4
_LINEARS = {"target_modules": ["a", "b"]}
# name -> the config, on Linears a and b; every one trains (its adapters' parameters set random below)
ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, **_LINEARS),
    "lora-dora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, use_dora=True, **_LINEARS),
    "lora-kasa": lambda: peft.LoraConfig(r=2, init_lora_weights=False, kasa_config=peft.KasaConfig(), **_LINEARS),
    "lora-bdlora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, **_LINEARS, use_bdlora=peft.BdLoraConfig(
        target_modules_bd_a=["a"], target_modules_bd_b=["b"], nblocks=2)),
    "adalora": lambda: peft.AdaLoraConfig(init_r=2, target_r=2, total_step=10, init_lora_weights=False, **_LINEARS),
    "ia3": lambda: peft.IA3Config(feedforward_modules=["b"], **_LINEARS),
    "loha": lambda: peft.LoHaConfig(r=2, init_weights=False, **_LINEARS),
    "lokr": lambda: peft.LoKrConfig(r=2, init_weights=False, **_LINEARS),
    "oft": lambda: peft.OFTConfig(r=2, oft_block_size=0, init_weights=False, **_LINEARS),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, init_weights=False, **_LINEARS),
    "hra": lambda: peft.HRAConfig(r=2, init_weights=False, **_LINEARS),
    "vera": lambda: peft.VeraConfig(r=2, **_LINEARS),
    "ln-tuning": lambda: peft.LNTuningConfig(**_LINEARS),
    "waveft": lambda: peft.WaveFTConfig(n_frequency=8, **_LINEARS),
    "randlora": lambda: peft.RandLoraConfig(r=2, **_LINEARS),
    "delora": lambda: peft.DeloraConfig(r=2, **_LINEARS),
    "gralora": lambda: peft.GraloraConfig(r=4, gralora_k=2, **_LINEARS),
    "hira": lambda: peft.HiraConfig(r=2, **_LINEARS),
    "shira": lambda: peft.ShiraConfig(r=2, **_LINEARS),
    "vblora": lambda: peft.VBLoRAConfig(r=2, num_vectors=8, vector_length=4, topk=2, **_LINEARS),
    "unilora": lambda: peft.UniLoraConfig(r=2, theta_d_length=16, **_LINEARS),
    "tinylora": lambda: peft.TinyLoraConfig(r=2, **_LINEARS),
    "miss": lambda: peft.MissConfig(r=2, **_LINEARS),
    "road": lambda: peft.RoadConfig(group_size=4, init_weights=False, **_LINEARS),
    "road-4": lambda: peft.RoadConfig(group_size=4, variant="road_4", init_weights=False, **_LINEARS),
    "beft": lambda: peft.BeftConfig(**_LINEARS),
    "frod": lambda: peft.FrodConfig(**_LINEARS),
    "paca": lambda: peft.PacaConfig(**_LINEARS),
    "psoft": lambda: peft.PsoftConfig(r=2, **_LINEARS),
    "supertuning": lambda: peft.SupertuningConfig(**_LINEARS),
    "c3a": lambda: peft.C3AConfig(block_size=4, **_LINEARS),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=8, **_LINEARS),
    "deft": lambda: peft.DeftConfig(**_LINEARS),
    # refused: a parameter read outside every call of its owner, or a gradient hook of its own (OSF's projection)
    "lily": lambda: peft.LilyConfig(**_LINEARS),
    "peanut": lambda: peft.PeanutConfig(**_LINEARS),
    "glora": lambda: peft.GloraConfig(**_LINEARS),
    "osf": lambda: peft.OSFConfig(**_LINEARS),
    "lora-velora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, velora_config=peft.VeloraConfig(num_groups=2),
                                           **_LINEARS),
}
REFUSED = {"lily", "peanut", "glora", "osf", "lora-velora"}
# Not here: PVeRA, which draws noise in training (the per-example loop is no reference: it is among those with
# dropout below); Shadow, which needs a transformers backbone; LoRA with MonteCLoRA, which samples in training too.
REFUSALS = ("outside the forward of the module that owns it", "have a gradient hook", "whose gradient has no dimension")
IN_FLOAT32 = {"c3a", "deft"}  # their forwards compute in float32 whatever the model's dtype
# FourierFT's forward builds its dense spectrum in the default dtype, and its set-up runs only where that is not
# float64 (peft's): model, batch, per-example loop and default dtype stay in float32.
BUILT_IN_FLOAT32 = {"fourierft"}


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))).mean(1))


def _adapted(config, dtype=torch.float64):
    """TwoLinears adapted by ``config()`` (a function making the peft config), in ``dtype``, in train mode, every
    adapter parameter random."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # built as users build them (PSOFT's and FourierFT's set-up need it)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on custom models, ghostdp's on the fallback
            model = peft.get_peft_model(TwoLinears(), config())
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).train()
    for n, p in model.named_parameters():
        if p.requires_grad and "head" not in n:  # several adapters start at zero (or the identity)
            nn.init.normal_(p, std=0.3)
    return model


def _outcomes(name):
    """[(mode, error or None, sum error, norm error)] for both modes."""
    dtype = torch.float32 if name in BUILT_IN_FLOAT32 else torch.float64
    model = _adapted(ADAPTERS[name], dtype)
    x, y = torch.randn(B, T, D, dtype=dtype), torch.randint(0, 3, (B,))
    criterion = nn.CrossEntropyLoss(reduction="none")
    state = copy.deepcopy(model.state_dict())

    def example_loss(i):
        model.load_state_dict(state)
        return criterion(model(x[i:i + 1]), y[i:i + 1]).sum()

    per_example = reference_per_example_grads(model, example_loss, B)
    _, norms = clipped_sum(per_example, 1.0)
    C = 0.5 * float(norms[norms > 0].min())  # every example clipped (one with no gradient sets no C)
    ref, ref_norms = clipped_sum(per_example, C)
    outcomes = []
    for clipping in ("ghost", "bookkeeping"):
        model.load_state_dict(state)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got, got_norms = ghost_clipped_sum(model, lambda: criterion(model(x), y), C, clipping)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as error:
            outcomes.append((clipping, error, None, None))
            continue
        scale = torch.where(ref_norms > 0, ref_norms, torch.ones_like(ref_norms))
        norm_error = float(((got_norms - ref_norms).abs() / scale).max())
        outcomes.append((clipping, None, relative_error(got, ref), norm_error))
    return outcomes


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_adapter_is_exact_or_refused(name):
    tolerance = 1e-5 if name in IN_FLOAT32 | BUILT_IN_FLOAT32 else 1e-8
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if name in BUILT_IN_FLOAT32 else default)
    try:
        outcomes = _outcomes(name)
    finally:
        torch.set_default_dtype(default)
    for clipping, error, sum_error, norm_error in outcomes:
        if name in REFUSED:
            assert error is not None, f"{clipping}: trained, expected a refusal"
            assert any(cause in str(error) for cause in REFUSALS), (clipping, error)
        else:
            assert error is None, f"{clipping}: {type(error).__name__}: {error}"
            assert sum_error < tolerance and norm_error < tolerance, (clipping, sum_error, norm_error)


WITH_DROPOUT = {  # adapters whose dropout draws in training: the reference is the batch's own backward, same draws
    "lora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, lora_dropout=0.3, **_LINEARS),
    "lora-dora": lambda: peft.LoraConfig(r=2, init_lora_weights=False, lora_dropout=0.3, use_dora=True, **_LINEARS),
    "loha": lambda: peft.LoHaConfig(r=2, init_weights=False, rank_dropout=0.3, **_LINEARS),
    "vera": lambda: peft.VeraConfig(r=2, vera_dropout=0.3, **_LINEARS),
    "randlora": lambda: peft.RandLoraConfig(r=2, randlora_dropout=0.3, **_LINEARS),
    "hira": lambda: peft.HiraConfig(r=2, hira_dropout=0.3, **_LINEARS),
    # PVeRA samples its noise in training, from the global generator or (generator_seed) from one of its own
    "pvera": lambda: peft.PveraConfig(r=2, pvera_dropout=0.3, **_LINEARS),
    "pvera-seeded": lambda: peft.PveraConfig(r=2, generator_seed=0, **_LINEARS),
}


@pytest.mark.parametrize("clipping", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("name", sorted(WITH_DROPOUT))
def test_each_adapter_with_its_dropout_drawing_is_exact_for_the_batchs_own_draws(name, clipping):
    """With the dropout active the per-example loop draws other masks, so the reference is each example's gradient
    through the batch's own forward (clipped_sum_through_the_batch, one-hot cotangents), from the same generator
    state: the forward check's reruns put it back, so the training forward draws what it would without ghostdp."""
    from conftest import clipped_sum_through_the_batch
    model = _adapted(WITH_DROPOUT[name])
    state = copy.deepcopy(model.state_dict())
    x, y = torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    criterion = nn.CrossEntropyLoss(reduction="none")
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    own = random_states(generators=own_generators(model))  # and the model's own generators (PVeRA's)
    torch.manual_seed(123)
    reference = clipped_sum_through_the_batch(criterion(model(x), y), [p for _, p in trained], C=0.5)
    model.load_state_dict(state)
    restore_random_states(own)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = ghost_clipped_sum(model, lambda: criterion(model(x), y), 0.5, clipping)
    got = torch.cat([got[n].flatten() for n, _ in trained])
    assert float(reference.norm()) > 0
    assert float((got - reference).norm() / reference.norm()) < 1e-10
