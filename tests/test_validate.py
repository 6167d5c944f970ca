"""Model checks: each rejection names the module and the fix; fix() makes a BatchNorm net trainable."""
import pytest
import torch
from torch import nn

import ghostdp
from ghostdp.validate import ModelNotPrivatizable
from conftest import assert_exact_model, fallback_gain
from ghostdp import per_example_loss


def net_with_batchnorm():
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 2),
                         nn.BatchNorm1d(2))


def test_batchnorm_is_rejected_with_the_fix():
    with pytest.raises(ModelNotPrivatizable, match=r"'1' \(BatchNorm2d\).*ghostdp.validate.fix") as err:
        ghostdp.GhostClipping(net_with_batchnorm(), 1.0)
    assert "'5' (BatchNorm1d)" in str(err.value)


def test_fix_replaces_batchnorm_by_groupnorm_and_training_is_exact():
    model = ghostdp.validate.fix(net_with_batchnorm())
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 6 and model[1].num_channels == 6
    assert isinstance(model[5], nn.GroupNorm) and model[5].num_groups == 1
    assert ghostdp.validate.find_problems(model) == []
    labels = torch.randint(0, 2, (4,))
    assert_exact_model(model, torch.randn(4, 3, 6, 6),
                       lambda out, sl: per_example_loss(nn.CrossEntropyLoss(), out, labels[sl]), 4)


def test_lazy_module_is_rejected():
    with pytest.raises(ModelNotPrivatizable, match="LazyLinear.*run one forward"):
        ghostdp.GhostClipping(nn.Sequential(nn.LazyLinear(3)), 1.0)


def test_embedding_options_that_couple_examples_are_rejected():
    for table in (nn.Embedding, nn.EmbeddingBag):
        with pytest.raises(ModelNotPrivatizable, match=f"{table.__name__}.*scale_grad_by_freq=False"):
            ghostdp.GhostClipping(table(5, 2, scale_grad_by_freq=True), 1.0)
    with pytest.raises(ModelNotPrivatizable, match="sparse=False"):
        ghostdp.GhostClipping(nn.Embedding(5, 2, sparse=True), 1.0)
    frozen = nn.Embedding(5, 2, sparse=True)
    frozen.weight.requires_grad_(False)
    ghostdp.GhostClipping(frozen, 1.0)  # a frozen one is harmless


@pytest.mark.parametrize("table", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_that_renormalises_its_rows_in_the_forward_is_refused(table):
    """max_norm renormalises in place the rows the batch looks up: a change of the model made by the data.
    Frozen too: the frozen table is released with the model."""
    for trainable in (True, False):
        model = table(5, 2, max_norm=1.0).requires_grad_(trainable)
        with pytest.raises(ModelNotPrivatizable, match=r"max_norm=1.0.*renormalise the whole table"):
            ghostdp.GhostClipping(nn.Sequential(model, nn.Linear(2, 2)), 1.0)


def test_peft_lora_on_parameters_is_refused_when_attaching():
    """peft's LoRA on a mixture of experts' 3-D parameters (target_parameters) parametrizes them inside every forward:
    refused by name at attach, not at the first step as a parameter "changed in place during a training forward"."""
    import peft
    import transformers
    config = transformers.MixtralConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, vocab_size=30,
        max_position_embeddings=32, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    model = peft.get_peft_model(transformers.MixtralForCausalLM(config), peft.LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"]))
    with pytest.raises(ModelNotPrivatizable, match=r"'base_model\.model\.model\.layers\.0\.mlp\.experts' "
                                                   r"\(ParamWrapper\) is peft's LoRA on a parameter.*target_modules"):
        ghostdp.GhostClipping(model, 1.0)
    lora_on_modules = peft.get_peft_model(transformers.MixtralForCausalLM(config), peft.LoraConfig(
        r=2, target_modules=["q_proj"]))
    ghostdp.GhostClipping(lora_on_modules, 1.0).detach()  # the same adapters on modules only: accepted


def test_peft_all_linear_on_a_mixture_of_experts_is_refused_naming_the_modules_to_target():
    """peft (0.22, with transformers 5) turns target_modules='all-linear' on a mixture of experts into LoRA on the
    fused experts' and the router's parameters (found by a scratch sweep, 2026-12-08): refused at attach, the message
    saying that 'all-linear' did it and naming the attention's projections, which train exactly."""
    import peft
    import transformers
    config = transformers.MixtralConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24, vocab_size=30,
        max_position_embeddings=32, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    all_linear = peft.get_peft_model(transformers.MixtralForCausalLM(config), peft.LoraConfig(
        r=2, target_modules="all-linear"))
    assert all_linear.peft_config["default"].target_parameters  # what peft made of 'all-linear'
    with pytest.raises(ModelNotPrivatizable, match=r"mlp\.gate' \(ParamWrapper\).*target_modules='all-linear'.*"
                                                   r"\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]"):
        ghostdp.GhostClipping(all_linear, 1.0)
    projections = peft.get_peft_model(transformers.MixtralForCausalLM(config).float(), peft.LoraConfig(
        r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False))
    ids = torch.randint(0, 30, (3, 5))
    assert_exact_model(projections, ids, lambda out, sl: per_example_loss(nn.CrossEntropyLoss(), out.logits[:, :-1],
                                                                          ids[sl][:, 1:]), 3, rtol=1e-4)


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.conv, self.head = nn.Embedding(20, 4), nn.Conv1d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.conv(self.emb(ids).transpose(1, 2)).mean(2))


def test_peft_dora_on_an_embedding_is_refused_when_attaching_and_on_a_convolution_is_not():
    """DoRA's magnitude of an embedding scales every example's lookups by one vector for the batch: refused by name
    at attach (before, at the first step, as an output with "no dimension of size B"). On a convolution its scale
    has a batch dim of one, which ghostdp broadcasts: exact."""
    import peft
    dora_everywhere = peft.get_peft_model(Tokens(), peft.LoraConfig(r=2, target_modules=["emb", "conv"],
                                                                    use_dora=True, modules_to_save=["head"]))
    with pytest.raises(ModelNotPrivatizable, match=r"'base_model\.model\.emb\.lora_magnitude_vector\.default' "
                                                   r"\(DoraEmbeddingLayer\) is peft's DoRA magnitude of an embedding"
                                                   r".*use_dora=False"):
        ghostdp.GhostClipping(dora_everywhere, 1.0)
    torch.manual_seed(0)
    dora_on_the_convolution = peft.get_peft_model(Tokens(), peft.LoraConfig(
        r=2, target_modules=["conv"], use_dora=True, init_lora_weights=False, modules_to_save=["head"])).double()
    assert_exact_model(dora_on_the_convolution, torch.randint(0, 20, (4, 5)), lambda out, sl: out.pow(2).sum(1), 4)


class Attending(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def test_peft_lora_on_a_multihead_attention_itself_is_refused_when_attaching_with_the_fix_that_trains():
    """peft's LoRA on the nn.MultiheadAttention module merges into in_proj_weight in every forward: refused by name at
    attach (before, at the first step, as a parameter "changed in place during a training forward"). The fix it
    names, validate.fix first and LoRA on the twin's projections, is exact."""
    import peft
    wrapped = peft.get_peft_model(Attending(), peft.LoraConfig(r=2, target_modules=["attn"], modules_to_save=["head"]))
    with pytest.raises(ModelNotPrivatizable, match=r"'base_model\.model\.attn' \(MultiheadAttention\) is peft's "
                                                   r"LoRA on an nn\.MultiheadAttention itself.*validate\.fix\(model\) "
                                                   r"before get_peft_model.*'q_proj', 'k_proj', 'v_proj', 'out_proj'"):
        ghostdp.GhostClipping(wrapped, 1.0)
    torch.manual_seed(0)
    fixed = peft.get_peft_model(ghostdp.validate.fix(Attending()), peft.LoraConfig(
        r=2, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"], init_lora_weights=False,
        modules_to_save=["head"])).double()
    assert_exact_model(fixed, torch.randn(4, 3, 4, dtype=torch.float64), lambda out, sl: out.pow(2).sum(1), 4)


@pytest.mark.parametrize("weight", [0.5, 0.0])
def test_adaloras_orthogonal_regulariser_left_out_of_the_per_example_losses_is_warned_of(weight):
    """peft adds it to outputs.loss, which ghostdp's per-example losses (from the logits) do not read."""
    import warnings

    import peft
    import transformers
    config = transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=2)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), peft.AdaLoraConfig(
        target_modules=["query"], total_step=10, init_r=2, target_r=2, orth_reg_weight=weight))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ghostdp.GhostClipping(model, 1.0).detach()
    said = [str(w.message) for w in caught if "orthogonal regulariser" in str(w.message)]
    if weight:
        assert len(said) == 1 and "orth_reg_weight=0.5" in said[0] and "Set orth_reg_weight=0" in said[0], said
    else:
        assert said == []


def test_fix_refuses_a_bare_batchnorm():
    with pytest.raises(ModelNotPrivatizable, match="wrap it"):
        ghostdp.validate.fix(nn.BatchNorm1d(3))


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ghostdp.GhostClipping(lambda x: x, 1.0)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 3)
        self.lstm = nn.LSTM(3, 4, batch_first=True, bidirectional=True)
        self.stack = nn.Sequential(nn.GRU(8, 4, batch_first=True), nn.RNN(4, 4, batch_first=True))
        self.projected = nn.LSTM(3, 4, proj_size=2, batch_first=True)
        self.head = nn.Linear(4 + 2, 2)

    def forward(self, ids):
        x = self.emb(ids)
        out, _ = self.lstm(x)
        out, _ = self.stack[0](out)
        out, _ = self.stack[1](out)
        projected, _ = self.projected(x)
        return self.head(torch.cat([out[:, -1], projected[:, -1]], 1))


def test_fix_swaps_recurrent_layers_for_ghostdp_layers_with_the_same_outputs():
    model = Recurrent()
    ids = torch.randint(0, 9, (4, 5))
    before, keys = model(ids), list(model.state_dict())
    with pytest.warns(UserWarning, match=r"'projected' \(LSTM\).*proj_size"):
        ghostdp.validate.fix(model)
    assert isinstance(model.lstm, ghostdp.layers.LSTM) and model.lstm.bidirectional
    assert isinstance(model.stack[0], ghostdp.layers.GRU) and isinstance(model.stack[1], ghostdp.layers.RNN)
    assert type(model.projected) is nn.LSTM
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(ids), before, rtol=1e-12, atol=1e-12)
    labels = torch.randint(0, 2, (4,))
    assert_exact_model(model, ids, lambda out, sl: per_example_loss(nn.CrossEntropyLoss(), out, labels[sl]), 4)


def test_fix_refuses_a_bare_recurrent_layer_and_leaves_subclasses_that_override_forward():
    with pytest.raises(ModelNotPrivatizable, match="from_torch"):
        ghostdp.validate.fix(nn.GRU(3, 4))

    class LastStep(nn.GRU):
        def forward(self, x):
            return super().forward(x)[0][:, -1]

    model = nn.Sequential(LastStep(3, 4, batch_first=True))
    with pytest.warns(UserWarning, match="overrides forward"):
        ghostdp.validate.fix(model)
    assert type(model[0]) is LastStep


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # raw, no rule: the fallback
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        return self.linear(x) * self.scale * self.frozen


class _LinearWithExtra(nn.Linear):  # keeps nn.Linear's forward, owns a parameter the rule does not cover
    def __init__(self):
        super().__init__(4, 4)
        self.extra = nn.Parameter(torch.zeros(4))


def test_fallback_modules_lists_the_trainable_parameters_no_rule_covers():
    model = nn.Sequential(_Scaled(), _LinearWithExtra(), nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 2))
    # A raw parameter beside a ruled child; a Linear owning another parameter (the whole module falls back); an
    # opaque MultiheadAttention (its children's too); not the ruled Linear, nor a frozen parameter.
    assert ghostdp.validate.fallback_modules(model) == {
        "0": ["scale"], "1": ["weight", "bias", "extra"],
        "2": ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]}
    model[0].scale.requires_grad_(False)  # frozen: nothing to form
    assert "0" not in ghostdp.validate.fallback_modules(model)


def test_attaching_logs_the_modules_that_take_the_fallback_once_and_names_them(caplog):
    """On the ghostdp logger (info: the fallback is exact, only slower); nothing where every trainable module has a
    rule."""
    import logging
    model = nn.Sequential(_Scaled(), nn.Linear(4, 2))
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        controller = ghostdp.GhostClipping(model, 1.0)
    controller.detach()
    notes = [r.getMessage() for r in caplog.records if "take the exact fallback" in r.getMessage()]
    assert len(notes) == 1 and "1 module(s)" in notes[0] and ": 0." in notes[0]
    caplog.clear()
    model[0].scale.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        ghostdp.GhostClipping(model, 1.0).detach()
    assert not [r for r in caplog.records if "take the exact fallback" in r.getMessage()]


class _Gained(nn.Module):
    """A raw parameter applied by addcmul: not an elementwise use ghostdp knows, so the fallback."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return fallback_gain(x, self.gain)


def test_the_first_norm_pass_logs_which_listed_modules_took_the_fallback_and_which_were_uses(caplog):
    """_Scaled's scale is a use (norms/parameter_uses.py), found only in its call's graph: listed when attaching,
    not among the modules the first norm pass names; _Gained's gain took the fallback. Logged once."""
    import logging
    model = nn.Sequential(_Scaled(), _Gained(), nn.Linear(4, 2))
    with caplog.at_level(logging.INFO, logger="ghostdp"):
        controller = ghostdp.GhostClipping(model, 1.0)
        for _ in range(2):
            controller.loss(model(torch.randn(3, 4)).pow(2).sum(1)).backward()
    controller.detach()
    attached = [r.getMessage() for r in caplog.records if "take the exact fallback" in r.getMessage()]
    assert len(attached) == 1 and "2 module(s)" in attached[0] and ": 0, 1." in attached[0], attached
    taken = [r.getMessage() for r in caplog.records if "in the first norm pass" in r.getMessage()]
    assert taken == ["ghostdp: in the first norm pass, 1 module(s) took the exact fallback: '1'; the other 1 listed "
                     "when attaching ('0') were captured at their parameters' elementwise uses or not called."], taken
