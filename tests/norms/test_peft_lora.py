"""peft's LoRA on an embedding, DoRA's magnitude and AdaLoRA's SVD adapter (norms/peft_lora.py): exact against the
per-example loop, by their rules, not the fallback."""
import peft
import pytest
import torch
from torch import nn

import ghostdp
from conftest import CLIPPING_MODES, assert_exact
from ghostdp.norms.fallback import attached_rule
from ghostdp.norms.peft_lora import (_computes_the_adapters, _computes_the_svd_adapters, _known_dora_call,
                                      lora_embedding_rule)

V, D, B = 13, 4, 5


class Looked(nn.Module):
    """Ids looked up, averaged over their positions, classified. ``sequence_first``: the ids are looked up as (T, B)."""

    def __init__(self, padding_idx=None, sequence_first=False, table=None):
        super().__init__()
        self.embed = table if table is not None else nn.Embedding(V, D, padding_idx=padding_idx)
        self.head = nn.Linear(D, 3)
        self.sequence_first = sequence_first

    def forward(self, ids):
        dtype = self.head.weight.dtype  # a float32 table's lookup, before a float64 head
        if self.sequence_first:
            return self.head(self.embed(ids.t()).to(dtype).mean(0))  # (T, B, D)
        h = self.embed(ids).to(dtype)
        return self.head(h.reshape(h.shape[0], -1, D).mean(1))


class ScaledTable(nn.Embedding):
    """transformers' scaled word embeddings (Gemma's): the lookup times embed_scale, which peft's adapter applies too."""

    def __init__(self):
        super().__init__(V, D)
        self.register_buffer("embed_scale", torch.tensor(1.7))

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


def _adapted(base, alpha=4, trained=("A", "B")):
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=alpha, target_modules=["embed"],
                                                      init_lora_weights=False, modules_to_save=["head"]))
    for name, p in model.named_parameters():
        if "lora_embedding_" in name and name.split("lora_embedding_")[1][0] not in trained:
            p.requires_grad_(False)
    return model.double().train()


def _assert_exact(model, ids, labels):
    criterion = nn.CrossEntropyLoss(reduction="none")
    assert_exact(model, lambda: criterion(model(ids), labels),
                 lambda i: criterion(model(ids[i:i + 1]), labels[i:i + 1]).sum(), len(labels))


def _assert_by_rules(model, inputs, clipping):
    """A step on ``inputs`` takes no fallback, and every trained parameter gets a gradient."""
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        controller.loss(model(inputs).pow(2).sum(1), reduction="sum").backward()
        assert controller.pass_one.took_fallback == set()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        controller.detach()


def _ids(shape, padding_idx=None):
    ids = torch.randint(1, V, shape)
    if padding_idx is not None and ids.dim() > 1:
        ids[0, -2:] = padding_idx  # some positions of one example at the padding index: no gradient there
    return ids


@pytest.mark.parametrize("shape", [(B,), (B, 6), (B, 2, 3)])
@pytest.mark.parametrize("trained", [("A", "B"), ("A",), ("B",)])
def test_the_adapter_is_exact_in_both_modes(shape, trained):
    torch.manual_seed(0)
    model = _adapted(Looked(), alpha=3, trained=trained)
    _assert_exact(model, _ids(shape), torch.randint(0, 3, (B,)))


def test_positions_at_the_padding_index_give_the_adapter_no_gradient():
    torch.manual_seed(1)
    model = _adapted(Looked(padding_idx=0))
    _assert_exact(model, _ids((B, 6), padding_idx=0), torch.randint(0, 3, (B,)))


def test_ids_looked_up_sequence_first_are_exact():
    torch.manual_seed(2)
    model = _adapted(Looked(sequence_first=True))
    _assert_exact(model, _ids((B, 6)), torch.randint(0, 3, (B,)))


def test_a_scaled_table_scales_the_adapter_too():
    torch.manual_seed(3)
    model = _adapted(Looked(table=ScaledTable()))
    _assert_exact(model, _ids((B, 6)), torch.randint(0, 3, (B,)))


def test_two_active_adapters_are_each_exact():
    torch.manual_seed(4)
    model = _adapted(Looked())
    model.add_adapter("second", peft.LoraConfig(r=3, lora_alpha=2, target_modules=["embed"],
                                                init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    model.double().train()
    trained = [n for n, p in model.named_parameters() if p.requires_grad and "lora_embedding_" in n]
    assert len(trained) == 4, trained
    _assert_exact(model, _ids((B, 6)), torch.randint(0, 3, (B,)))


def test_an_adapter_wider_than_its_frozen_table_takes_the_output_grad_in_its_own_dtype():
    """peft adds the adapter's float64 output to the float32 lookup and casts the sum to float32: the adapter's
    backward gets G in float32, cast up."""
    torch.manual_seed(5)
    model = _adapted(Looked())
    model.base_model.model.embed.base_layer.float()
    _assert_exact(model, _ids((B, 6)), torch.randint(0, 3, (B,)))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_the_adapted_embedding_takes_its_rule_and_not_the_fallback(clipping):
    """Until 2026-12-03 the fallback's (book-keeping 1.76x plain on a tiny BERT with LoRA on its word embeddings,
    1.36x by the rule: norms/peft_lora.py)."""
    torch.manual_seed(6)
    model = _adapted(Looked())
    adapted = model.base_model.model.embed
    assert attached_rule(adapted).rule is lora_embedding_rule
    _assert_by_rules(model, _ids((B, 6)), clipping)


def test_calls_that_do_not_add_the_adapters_as_the_rule_assumes_are_declined():
    torch.manual_seed(7)
    model = _adapted(Looked())
    adapted = model.base_model.model.embed
    ids = _ids((B, 6))
    assert _computes_the_adapters(adapted, (ids,), {})
    assert not _computes_the_adapters(adapted, (ids,), {"adapter_names": ["default"] * B})  # a mixed batch
    with model.disable_adapter():
        assert not _computes_the_adapters(adapted, (ids,), {})
    model.merge_adapter()
    assert not _computes_the_adapters(adapted, (ids,), {})
    model.unmerge_adapter()
    adapted.base_layer.max_norm = 1.0  # F.embedding would renormalise the transposed A in place
    assert not _computes_the_adapters(adapted, (ids,), {})


def test_merged_adapters_are_not_read_and_get_no_gradient():
    """Merged, the forward is the frozen base's lookup alone: nothing of the call requires grad, so nothing is
    recorded (no rule, no fallback); the adapters get no gradient, and the trained head does."""
    torch.manual_seed(8)
    model = _adapted(Looked())
    model.merge_adapter()
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss(model(_ids((B, 6))).pow(2).sum(1), reduction="sum").backward()
        assert controller.pass_one.took_fallback == set()
        named = dict(model.named_parameters())
        assert all(named[n].grad is None or not named[n].grad.any() for n in named if "lora_embedding" in n)
        assert all(named[n].grad is not None for n in named if "modules_to_save" in n)
    finally:
        controller.detach()


class Projected(nn.Module):
    """A Linear on (B, T, D) inputs (or (B, D), or (T, B, D) read sequence-first), then a head on the mean."""

    def __init__(self, bias=True, sequence_first=False):
        super().__init__()
        self.proj = nn.Linear(D, D, bias=bias)
        self.head = nn.Linear(D, 3)
        self.sequence_first = sequence_first

    def forward(self, x):
        if self.sequence_first:
            return self.head(self.proj(x.transpose(0, 1)).mean(0))
        h = self.proj(x)
        return self.head(h.mean(1) if h.dim() == 3 else h)


def _dora(base, trained=("lora_A", "lora_B", "magnitude"), **config):
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=3, target_modules=["proj"], use_dora=True,
                                                      init_lora_weights=False, modules_to_save=["head"], **config))
    for name, p in model.named_parameters():
        if p.requires_grad and "modules_to_save" not in name and not any(t in name for t in trained):
            p.requires_grad_(False)
    return model.double().train()


@pytest.mark.parametrize("shape", [(B, 6, D), (B, D)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("trained", [("lora_A", "lora_B", "magnitude"), ("magnitude",)])
def test_doras_magnitude_is_exact_in_both_modes(shape, bias, trained):
    torch.manual_seed(10)
    model = _dora(Projected(bias=bias), trained=trained)
    _assert_exact(model, torch.randn(shape, dtype=torch.float64), torch.randint(0, 3, (B,)))


def test_doras_magnitude_is_exact_where_the_adapter_drops_its_input_and_multiplies_it_again():
    """With the adapter's dropout active the call gets no base output and forms x W^T itself (p = 0 here, so the
    per-example loop is a reference)."""
    torch.manual_seed(11)
    model = _dora(Projected(), lora_dropout=0.5)
    dropout = model.base_model.model.proj.lora_dropout["default"]
    assert isinstance(dropout, nn.Dropout)
    dropout.p = 0.0
    _assert_exact(model, torch.randn(B, 6, D, dtype=torch.float64), torch.randint(0, 3, (B,)))


def test_doras_magnitude_is_exact_sequence_first():
    torch.manual_seed(12)
    model = _dora(Projected(sequence_first=True))
    _assert_exact(model, torch.randn(B, 6, D, dtype=torch.float64), torch.randint(0, 3, (B,)))


def test_doras_magnitude_on_gpt2s_conv1d_is_exact():
    """transformers' Conv1D holds W as (in, out): peft's fan_in_fan_out."""
    import transformers
    torch.manual_seed(13)
    config = transformers.GPT2Config(vocab_size=V, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = peft.get_peft_model(transformers.GPT2Model(config), peft.LoraConfig(
        r=2, target_modules=["c_attn"], use_dora=True, init_lora_weights=False, fan_in_fan_out=True)).double().train()
    ids = _ids((B, 6))
    assert_exact(model, lambda: model(ids).last_hidden_state.pow(2).sum((1, 2)),
                 lambda i: model(ids[i:i + 1]).last_hidden_state.pow(2).sum(), B)


def test_a_dora_call_on_a_parametrized_base_takes_the_fallback_and_is_exact():
    """A second read of a parametrized weight computes it again (spectral norm moves its vectors as it does): the
    rule declines, and the fallback is exact."""
    torch.manual_seed(15)
    base = Projected()
    torch.nn.utils.parametrizations.weight_norm(base.proj)
    model = _dora(base)
    x, labels = torch.randn(B, 6, D, dtype=torch.float64), torch.randint(0, 3, (B,))
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        controller.loss(model(x).pow(2).sum(1), reduction="sum").backward()
        assert controller.pass_one.took_fallback == {"base_model.model.proj.lora_magnitude_vector.default"}
    finally:
        controller.detach()
        model.zero_grad(set_to_none=True)
    _assert_exact(model, x, labels)


def test_dora_calls_with_what_the_rule_does_not_know_are_declined():
    torch.manual_seed(16)
    model = _dora(Projected())
    layer = model.base_model.model.proj
    magnitude = layer.lora_magnitude_vector["default"]
    x = torch.randn(B, 6, D, dtype=torch.float64)
    kwargs = dict(lora_A=layer.lora_A["default"], lora_B=layer.lora_B["default"], scaling=1.5,
                  base_layer=layer.base_layer, base_result=None, adapter_name="default")
    assert _known_dora_call(magnitude, (x,), kwargs)
    assert not _known_dora_call(magnitude, (x,), {**kwargs, "other": 1})
    assert not _known_dora_call(magnitude, (x, x), kwargs)
    biased_b = nn.Linear(2, D).double()  # its bias would enter the weight's norm (peft's lora_bias)
    assert not _known_dora_call(magnitude, (x,), {**kwargs, "lora_B": biased_b})
    assert not _known_dora_call(magnitude, (x,), {**kwargs, "base_layer": nn.Identity()})


def _adalora(base, trained=("lora_A", "lora_B", "lora_E"), **config):
    model = peft.get_peft_model(base, peft.AdaLoraConfig(init_r=3, target_r=2, total_step=10, lora_alpha=5,
                                                         target_modules=["proj"], modules_to_save=["head"], **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(t in name for t in ("lora_A", "lora_B", "lora_E")):
                p.normal_(0.0, 0.5)  # E starts at zero, which gives A and B no gradient
                p.requires_grad_(any(t in name for t in trained))
    return model.double().train()


@pytest.mark.parametrize("shape", [(B, 6, D), (B, D)])
@pytest.mark.parametrize("trained", [("lora_A", "lora_B", "lora_E"), ("lora_E",), ("lora_A",)])
def test_adaloras_svd_adapter_is_exact_in_both_modes(shape, trained):
    torch.manual_seed(20)
    model = _adalora(Projected(), trained=trained)
    _assert_exact(model, torch.randn(shape, dtype=torch.float64), torch.randint(0, 3, (B,)))


def test_adaloras_svd_adapter_is_exact_sequence_first_and_with_singular_values_masked():
    """The rank allocator zeroes singular values in place as it prunes: the rule reads E as it is."""
    torch.manual_seed(21)
    model = _adalora(Projected(sequence_first=True))
    with torch.no_grad():
        model.base_model.model.proj.lora_E["default"][1] = 0.0
    _assert_exact(model, torch.randn(B, 6, D, dtype=torch.float64), torch.randint(0, 3, (B,)))


def test_an_adalora_call_with_its_dropout_active_takes_the_fallback():
    torch.manual_seed(23)
    model = _adalora(Projected(), lora_dropout=0.5)
    layer = model.base_model.model.proj
    x = torch.randn(B, 6, D, dtype=torch.float64)
    assert not _computes_the_svd_adapters(layer, (x,), {})
    layer.lora_dropout["default"].p = 0.0  # still a Dropout: declined, and the fallback is exact
    _assert_exact(model, x, torch.randint(0, 3, (B,)))
    layer.lora_dropout["default"] = nn.Identity()
    assert _computes_the_svd_adapters(layer, (x,), {})
    assert not _computes_the_svd_adapters(layer, (x,), {"scale": 1.0})
    with model.disable_adapter():
        assert not _computes_the_svd_adapters(layer, (x,), {})


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
@pytest.mark.parametrize("adapter", ["dora", "adalora"])
def test_doras_and_adaloras_adapters_take_their_rules_and_not_the_fallback(adapter, clipping):
    """Until 2026-12-03 the fallback's: book-keeping on a tiny BERT with the adapter on query and value, DoRA 2.56x
    plain (1.48x by its rule), AdaLoRA 4.52x (1.54x)."""
    torch.manual_seed(14)
    model = (_dora if adapter == "dora" else _adalora)(Projected())
    _assert_by_rules(model, torch.randn(B, 6, D, dtype=torch.float64), clipping)
