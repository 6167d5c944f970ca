"""A module's own parameter used by one elementwise op of its forward (norms/parameter_uses.py): BEiT's and
Data2Vec-vision's layer scales, a value written at masked positions. Each use is captured at its op, exact against
the per-example loop in float64 in both modes with nothing of it on the fallback; a parameter used otherwise takes
the exact fallback as before, and a use whose G mixes examples is refused."""
import math

import pytest
import torch
import transformers
from torch import nn

import ghostdp
from ghostdp.norms import parameter_uses
from conftest import CLIPPING_MODES, assert_exact, assert_exact_model

B = 3


@pytest.fixture
def use_calls(monkeypatch):
    """{kind: the factors the uses' rules have formed since the test began}."""
    counts = {kind: 0 for kind in parameter_uses.ENTRIES}
    for kind, entry in parameter_uses.ENTRIES.items():
        def counted(*args, _rule=entry.rule, _kind=kind):
            counts[_kind] += 1
            return _rule(*args)
        monkeypatch.setitem(parameter_uses.ENTRIES, kind, type(entry)(**{**entry.__dict__, "rule": counted}))
    return counts


def exact_by_slices(model, losses):
    """assert_exact for ``losses(sl)``: the (n,) per-example losses of the batch's examples ``sl``."""
    assert_exact(model, losses, lambda i: losses(slice(i, i + 1)).sum(), B)


def squares(output, sl):
    """Each example's sum of its squared (B, T, d) outputs."""
    return output.pow(2).sum((1, 2))


def used(counts):
    """The kinds of use that formed factors, with their counts."""
    return {kind: n for kind, n in counts.items() if n}


def _spread(model, suffixes):
    with torch.no_grad():  # layer scales start at one constant: spread, so that a wrong channel or example shows
        for name, p in model.named_parameters():
            if name.endswith(suffixes):
                p.uniform_(-1, 1)
    return model


def _vision(family):
    config = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16, image_size=8,
                  patch_size=4, num_labels=3, layer_scale_init_value=0.1, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, drop_path_rate=0.0)  # (BEiT's default draws a drop path)
    if family == "beit":
        model = transformers.BeitForImageClassification(transformers.BeitConfig(**config))
    else:
        model = transformers.Data2VecVisionForImageClassification(transformers.Data2VecVisionConfig(**config))
    return _spread(model, ("lambda_1", "lambda_2", "cls_token"))


@pytest.mark.parametrize("family", ["beit", "data2vec-vision"])
def test_the_layer_scales_of_beit_and_data2vec_vision_are_exact_as_uses(family, use_calls):
    model = _vision(family)
    owners = [name for name, m in model.named_modules()
              if type(m).__name__ in ("BeitLayer", "BeitEmbeddings", "Data2VecVisionLayer", "Data2VecVisionEmbeddings")]
    assert sorted(ghostdp.validate.fallback_modules(model)) == sorted(owners)  # no rule: scales, the class token
    pixels, labels = torch.randn(B, 3, 8, 8), torch.tensor([0, 2, 1])

    def losses(sl=slice(None)):
        return nn.functional.cross_entropy(model(pixel_values=pixels[sl]).logits, labels[sl], reduction="none")

    exact_by_slices(model, losses)
    # two scales in each of two layers, two values of C, pass 1 of both modes and ghost's pass 2; the class token
    assert use_calls[parameter_uses.SCALED] == 4 * 2 * 3 and use_calls[parameter_uses.EXPANDED] == 2 * 3


class ScaledAndWritten(nn.Module):
    """gamma scales a Linear's (B, T, d) output; token_embed replaces the positions whose input's first feature is
    positive (a mask of each example's own data, as SpecAugment's is its own draw), written into a tensor that is not
    a view; beta, when used twice, is no single use."""

    def __init__(self, d=4, beta_twice=False):
        super().__init__()
        self.inner, self.head = nn.Linear(d, d), nn.Linear(d, 2)
        self.gamma = nn.Parameter(torch.linspace(-1.0, 1.5, d))
        self.token_embed = nn.Parameter(torch.linspace(0.5, -0.7, d))
        self.beta = nn.Parameter(torch.full((d,), 0.3)) if beta_twice else None

    def forward(self, x):
        h = torch.tanh(self.inner(x)) + 1.0  # a tensor nothing saved, not a view: written in place
        h[x[..., 0] > 0] = self.token_embed
        h = self.gamma * h
        if self.beta is not None:
            h = h * self.beta + self.beta
        return self.head(h).sum(1)


def _tokens():
    torch.manual_seed(1)
    x = torch.randn(B, 5, 4)
    x[0, :, 0] = -1.0  # one example with no written position: its token_embed gradient is 0
    return x


def test_a_scale_and_a_value_written_at_masked_positions_are_exact_as_uses(use_calls):
    model = ScaledAndWritten()
    x, labels = _tokens(), torch.tensor([0, 1, 1])

    def losses(sl=slice(None)):
        return nn.functional.cross_entropy(model(x[sl]), labels[sl], reduction="none")

    exact_by_slices(model, losses)
    assert used(use_calls) == {parameter_uses.SCALED: 2 * 3, parameter_uses.WRITTEN: 2 * 3}


def test_a_parameter_used_twice_takes_the_exact_fallback_with_its_module(use_calls):
    model = ScaledAndWritten(beta_twice=True)
    x, labels = _tokens(), torch.tensor([0, 1, 1])

    def losses(sl=slice(None)):
        return nn.functional.cross_entropy(model(x[sl]), labels[sl], reduction="none")

    exact_by_slices(model, losses)
    assert not any(use_calls.values())  # the whole module: one fallback


class ScaledThenMixed(nn.Module):
    """A scale whose output the forward then centres over the batch: its G mixes the examples."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.linspace(-1.0, 1.5, d))

    def forward(self, x):
        h = self.gamma * torch.tanh(self.inner(x))
        return (h - h.mean(0)).sum(1)


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_use_whose_output_grad_mixes_examples_is_refused(clipping):
    model = ScaledThenMixed()
    controller = ghostdp.GhostClipping(model, 1.0, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match="mixes several examples"):
            controller.loss(model(torch.randn(B, 5, 4)).pow(2).sum(1), "sum").backward()
    finally:
        controller.detach()


class SpeechEncoder(nn.Module):
    """A wav2vec2-family model (its feature encoder frozen, as fine-tuning recipes do) under a head, given SpecAugment's
    time mask: the model writes masked_spec_embed into the masked steps of its feature projection's output, a view of
    that Linear's matmul (autograd's CopySlices)."""

    def __init__(self, family, feature_encoder_frozen=True):
        super().__init__()
        config = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                      conv_dim=(4, 4), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                      num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.05)
        if family == "wav2vec2":
            self.encoder = transformers.Wav2Vec2Model(transformers.Wav2Vec2Config(**config))
        else:
            self.encoder = transformers.HubertModel(transformers.HubertConfig(**config))
        if feature_encoder_frozen:
            self.encoder.feature_extractor._freeze_parameters()
        self.encoder.encoder.pos_conv_embed.requires_grad_(False)  # weight norm: not what is tested here
        with torch.no_grad():
            self.encoder.masked_spec_embed.uniform_(-1, 1)
        self.head = nn.Linear(8, 2)

    def forward(self, input_values, mask_time_indices):
        hidden = self.encoder(input_values, mask_time_indices=mask_time_indices).last_hidden_state
        return self.head(hidden).pow(2).mean((1, 2))


@pytest.mark.parametrize("family", ["wav2vec2", "hubert"])
def test_masked_spec_embed_written_into_a_view_is_exact_as_a_use(family, use_calls):
    torch.manual_seed(0)
    model = SpeechEncoder(family)
    audio = torch.randn(B, 160)  # 15 time steps
    steps = model.encoder._get_feat_extract_output_lengths(torch.tensor(160)).item()
    mask = torch.zeros(B, steps, dtype=torch.bool)
    mask[0, 2:5], mask[1, [0, 7, 8, 14]] = True, True  # the third example has no masked step

    def losses(sl=slice(None)):
        return model(audio[sl], mask[sl])

    exact_by_slices(model, losses)
    assert used(use_calls) == {parameter_uses.WRITTEN: 2 * 3}


def test_a_trained_feature_encoder_fails_with_a_note_naming_the_freezes_and_is_exact_with_the_embed_frozen():
    """A feature encoder that trains sets requires_grad on a view of the audio (for gradient checkpointing). The
    audio had gone through the input sink of Wav2Vec2Model, whose own masked_spec_embed shows itself a use only once
    the forward has run: a non-leaf, so the model's forward failed with torch's bare message before 2026-12-02; it
    now carries ghostdp's note, naming the module, its parameter and both freezes. With masked_spec_embed frozen
    the module owns nothing trained, no sink is placed, and the model, feature encoder trained, is exact."""
    torch.manual_seed(0)
    model = SpeechEncoder("wav2vec2", feature_encoder_frozen=False).train()
    audio = torch.randn(B, 160)
    controller = ghostdp.GhostClipping(model, 1.0)
    try:
        with pytest.raises(RuntimeError, match="requires_grad flags of leaf variables") as caught:
            model(audio, None)
    finally:
        controller.detach()
    note = "".join(getattr(caught.value, "__notes__", []))
    assert "module 'encoder' (Wav2Vec2Model)" in note and "('masked_spec_embed')" in note, note
    assert "freeze_feature_encoder()" in note and "requires_grad_(False)" in note, note
    model.encoder.masked_spec_embed.requires_grad_(False)
    model.double()
    audio = audio.double()
    mask = torch.zeros(B, 15, dtype=torch.bool)
    mask[0, 2:5] = True

    def losses(sl=slice(None)):
        return model(audio[sl], mask[sl])

    assert model.encoder.feature_extractor.conv_layers[0].conv.weight.requires_grad
    exact_by_slices(model, losses)


class ScaledInPlace(nn.Module):
    """A scale applied in place to a Linear's (B, T, d) output, a view of its matmul: autograd's CopySlices hides the
    op, whose gradient for gamma is no gather of G's rows, so the module takes the exact fallback."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.linspace(-1.0, 1.5, d))

    def forward(self, x):
        h = self.inner(x)
        h.mul_(self.gamma)
        return h.pow(2).sum((1, 2))


def test_an_in_place_scale_of_a_view_takes_the_exact_fallback(use_calls):
    model = ScaledInPlace()
    x = _tokens()
    assert_exact_model(model, x, lambda out, sl: out, B)
    assert not any(use_calls.values())


class KeepsProduct(nn.Module):
    """A scale that keeps its product on itself (``self.last``), which the parent reads besides the output."""

    def __init__(self, d=3):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x):
        self.last = x * self.weight
        return torch.tanh(self.last)


class ParentReadsKeptProduct(nn.Module):
    """Paths from the product past the module's output (the fallback's VJP from its outputs would miss them, so the
    fallback refuses them: tests/clipping/test_fallback_paths.py): the use's G, taken at the product itself, sums
    every path."""

    def __init__(self, d=3):
        super().__init__()
        self.gain = KeepsProduct(d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        h = self.gain(x) * self.scale + self.gain.last
        return self.head(h + self.gain.last ** 2)


def test_paths_from_a_scaled_product_past_its_modules_output_are_exact_as_a_use(use_calls):
    torch.manual_seed(0)
    model = ParentReadsKeptProduct()
    x = torch.randn(B, 4, 3)
    assert_exact_model(model, x, squares, B)
    assert use_calls[parameter_uses.SCALED] == 2 * 2 * 3  # the gain's and the parent's scale


class SequenceFirstScale(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.5, d))

    def forward(self, x):  # (T, B, d)
        return self.weight * torch.tanh(self.inner(x))


def test_a_scale_of_a_sequence_first_tensor_is_exact_as_a_use_its_examples_proven_on_dim_1(use_calls):
    """The scale is the same at every position, so the layout proof may find the examples on any leading dim (as a
    Linear's): here dim 1, where the model's first argument made the batch size look like T (dim 0 of the input)."""
    torch.manual_seed(0)
    model = SequenceFirstScale()
    x = torch.randn(B, 5, 4)  # batch first: the reference slices examples on dim 0

    def losses(sl=slice(None)):
        return model(x[sl].transpose(0, 1)).pow(2).sum((0, 2))

    exact_by_slices(model, losses)
    assert use_calls[parameter_uses.SCALED] == 2 * 3


class CentredThenScaled(nn.Module):
    """A scale of the batch-centred data: each example's scaled operand depends on every example."""

    def __init__(self, d=4):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.5, d))

    def forward(self, x):
        return self.weight * (x - x.mean(0))


@pytest.mark.parametrize("clipping", CLIPPING_MODES)
def test_a_use_whose_operand_mixes_examples_is_refused_by_the_forward_check(clipping):
    """No gradient shows the mixing (the data has none, nothing trained lies below): the forward check's reruns do,
    as they do for a ruled layer's mixed input."""
    model = CentredThenScaled()
    controller = ghostdp.GhostClipping(model, 1e-3, clipping=clipping)
    try:
        with pytest.raises(RuntimeError, match="the model's forward mixes examples"):
            controller.loss(model(torch.randn(8, 4)).pow(2).sum(1), "sum").backward()
    finally:
        controller.detach()


class ChannelScaled(nn.Module):
    """A per-channel scale viewed to (C, 1, 1) before it multiplies a (B, C, H, W) map (PoolFormer's layer scales), and
    a per-channel bias seen through a permute that moves only dims of size 1."""

    def __init__(self, c=3, moves_data=False):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.gamma = nn.Parameter(torch.linspace(-1.0, 1.5, c))
        self.beta = nn.Parameter(torch.linspace(0.5, -0.5, c * 2).view(c, 2))
        self.moves_data = moves_data

    def forward(self, x):
        h = self.gamma.unsqueeze(-1).unsqueeze(-1) * torch.tanh(self.conv(x))  # (B, C, H, W)
        if self.moves_data:  # (C, 2) read as (2, C): the transpose moves its elements
            return h.flatten(2)[..., :2].transpose(1, 2) + self.beta.transpose(0, 1)
        return h.flatten(2)[..., :2] + self.beta[:, None].permute(1, 0, 2)  # (C, 1, 2) -> (1, C, 2)


def test_parameters_seen_through_views_that_keep_their_order_are_exact_as_uses(use_calls):
    torch.manual_seed(0)
    model = ChannelScaled()
    x = torch.randn(B, 3, 4, 4)
    assert_exact_model(model, x, squares, B)
    assert used(use_calls) == {parameter_uses.SCALED: 2 * 3, parameter_uses.ADDED: 2 * 3}


def test_a_parameter_seen_through_a_transpose_of_its_data_takes_the_fallback(use_calls):
    """beta.transpose(0, 1): a transpose that moves its elements, so its gradient is not the operand's reshaped."""
    torch.manual_seed(0)
    model = ChannelScaled(moves_data=True)
    x = torch.randn(B, 3, 4, 4)
    assert_exact_model(model, x, squares, B)
    assert not any(use_calls.values())  # gamma is a use, beta not: the whole module takes the fallback


def test_deberta_v1s_query_and_value_biases_are_exact_as_uses(use_calls):
    """DeBERTa's attention adds q_bias and v_bias, viewed per head ((1, 1, H, d) permuted to (1, H, 1, d)), to its
    queries and values; without relative attention it owns nothing else."""
    torch.manual_seed(0)
    model = transformers.DebertaForSequenceClassification(transformers.DebertaConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, num_labels=3,
        relative_attention=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_bias", "v_bias")):
                p.uniform_(-1, 1)
    ids, labels = torch.randint(1, 30, (B, 5)), torch.tensor([0, 2, 1])

    def losses(sl=slice(None)):
        return nn.functional.cross_entropy(model(input_ids=ids[sl]).logits, labels[sl], reduction="none")

    exact_by_slices(model, losses)
    assert used(use_calls) == {parameter_uses.ADDED: 2 * 2 * 3}


def test_poolformers_layer_scales_viewed_per_channel_are_exact_as_uses(use_calls):
    """PoolFormer's blocks own their layer scales, (C,) viewed to (C, 1, 1) before they multiply each branch."""
    torch.manual_seed(0)
    model = _spread(transformers.PoolFormerForImageClassification(transformers.PoolFormerConfig(
        hidden_sizes=[4, 8], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[3, 3], strides=[2, 2],
        padding=[1, 1], num_labels=3, pool_size=3, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        layer_scale_init_value=0.5)), ("layer_scale_1", "layer_scale_2"))
    pixels, labels = torch.randn(B, 3, 8, 8), torch.tensor([0, 2, 1])

    def losses(sl=slice(None)):
        return nn.functional.cross_entropy(model(pixel_values=pixels[sl]).logits, labels[sl], reduction="none")

    exact_by_slices(model, losses)
    assert used(use_calls) == {parameter_uses.SCALED: 2 * 2 * 2 * 3}  # two scales a block, two blocks


class Slope(nn.Module):
    """PReLU's arithmetic with one slope, a 0-dim parameter: x where x > 0, a x elsewhere."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.a = nn.Parameter(torch.tensor(0.25))

    def forward(self, x):
        h = self.inner(x)
        return torch.where(h > 0, h, self.a * h)


def test_a_scalar_scale_is_exact_as_a_use(use_calls):
    torch.manual_seed(0)
    model = Slope()
    x = torch.randn(B, 5, 4)
    assert_exact_model(model, x, squares, B)
    assert used(use_calls) == {parameter_uses.SCALED: 2 * 3}


class PlainGain(nn.Module):
    """x * weight: an elementwise use (conftest's Gain takes the fallback)."""

    def __init__(self, d=4):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.5, 1.5, d))

    def forward(self, x):
        return x * self.weight


class ScaleTwice(nn.Module):
    """One scale called twice in a chain: two uses of one parameter, whose norm takes their cross terms."""

    def __init__(self, d=4):
        super().__init__()
        self.scale, self.mix, self.head = PlainGain(d), nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.scale(torch.tanh(self.mix(self.scale(x)))))


def test_a_module_whose_use_is_called_twice_is_exact_with_its_cross_terms(use_calls):
    torch.manual_seed(0)
    model = ScaleTwice()
    x = torch.randn(B, 5, 4)
    assert_exact_model(model, x, squares, B)
    assert used(use_calls) == {parameter_uses.SCALED: 2 * 2 * 3}


class ThroughFunctions(nn.Module):
    """Its own parameters applied through elementwise functions: a gate's tanh (gated cross-attention), Swin v2's
    clamp(logit_scale, max=log 100).exp() with one head's scale above the clamp (f' = 0 there), a sigmoid shift added;
    ``swap``: the gate through a sigmoid instead (another function of the same parameter, of the same kind and shape)."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, d))
        self.logit_scale = nn.Parameter(torch.tensor([[1.0], [5.0]]))  # exp(5) > 100: clamped
        self.shift = nn.Parameter(torch.linspace(-2.0, 2.0, d))
        self.swap = False

    def forward(self, x):
        h = self.inner(x) * (torch.sigmoid(self.gate) if self.swap else self.gate.tanh())
        h = (h.view(*h.shape[:-1], 2, -1) * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()).flatten(-2)
        return h + torch.sigmoid(self.shift)


def test_parameters_through_elementwise_functions_are_exact_as_uses(use_calls):
    torch.manual_seed(0)
    model = nn.Sequential(ThroughFunctions(), nn.Tanh(), nn.Linear(4, 2)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    calls = used(use_calls)
    assert set(calls) == {parameter_uses.SCALED, parameter_uses.ADDED} and calls[parameter_uses.SCALED] == \
        2 * calls[parameter_uses.ADDED], calls  # the gate and the scale, the shift: none on the fallback


class GatedEmbedding(nn.Module):
    """Mllama's gated position embeddings: ``(1 - gate.tanh()) * x`` and a squared scale, ``scale.pow(2) * x``."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.tensor([0.4]))
        self.scale = nn.Parameter(torch.linspace(-1.5, 1.5, d))

    def forward(self, x):
        return ((1 - self.gate.tanh()) * self.inner(x)) * self.scale.pow(2)


def test_one_minus_a_function_and_a_power_of_a_parameter_are_exact_as_uses(use_calls):
    torch.manual_seed(0)
    model = nn.Sequential(GatedEmbedding(), nn.Tanh(), nn.Linear(4, 2)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert set(used(use_calls)) == {parameter_uses.SCALED}


class CalledWithEach(nn.Module):
    """The same module twice in a chain, its gate through tanh, then through a sigmoid: two uses of one parameter
    of one kind and shape, each with its own f'."""

    def __init__(self):
        super().__init__()
        self.block = ThroughFunctions()

    def forward(self, x):
        self.block.swap = False
        h = torch.tanh(self.block(x))
        self.block.swap = True
        return self.block(h)


def test_one_parameter_through_two_functions_in_two_calls_takes_each_its_derivative(use_calls):
    torch.manual_seed(0)
    model = CalledWithEach().double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert used(use_calls)[parameter_uses.SCALED] > 0


class SoftmaxWeights(nn.Module):
    """softmax(p) * x: a function of p whose Jacobian is not diagonal, so not a use."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.logits = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x):
        return self.inner(x) * torch.softmax(self.logits, dim=0)


def test_a_function_of_a_parameter_that_mixes_its_elements_takes_the_exact_fallback(use_calls):
    torch.manual_seed(0)
    model = nn.Sequential(SoftmaxWeights(), nn.Tanh(), nn.Linear(4, 2)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert not any(use_calls.values())


def test_mllamas_tanh_gated_cross_attention_layer_is_exact_with_nothing_on_the_fallback(no_fallback):
    """transformers' MllamaCrossAttentionDecoderLayer owns its gates, ``residual + gate.tanh() * h`` after its
    attention and its MLP: uses through tanh, where the whole layer took the fallback before 2026-12-02."""
    torch.manual_seed(0)
    config = transformers.MllamaTextConfig(
        vocab_size=64, pad_token_id=0, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1], max_position_embeddings=32)
    model = transformers.MllamaForCausalLM(config).double()
    with torch.no_grad():  # (zeros at initialisation: the gated paths would carry no gradient)
        model.model.layers[1].cross_attn_attn_gate.fill_(0.3)
        model.model.layers[1].cross_attn_mlp_gate.fill_(-0.6)
    ids, states = torch.randint(1, 64, (B, 6)), torch.randn(B, 5, 16, dtype=torch.float64)
    mask = torch.ones(B, 1, 6, 5)

    def losses(sl=slice(None)):
        logits = model(input_ids=ids[sl], cross_attention_states=states[sl], cross_attention_mask=mask[sl]).logits
        return logits.pow(2).mean((1, 2))

    exact_by_slices(model, losses)


class RawProducts(nn.Module):
    """Raw weights in matrix products on every token: ``F.linear(x, w)`` (an mm of the (B * T, d) rows) and ``h @ v``
    (v (d, m), no transpose); ``bias``: w's bias trained beside it (one addmm for both)."""

    def __init__(self, d=4, m=3, bias=False):
        super().__init__()
        torch.manual_seed(3)
        self.w = nn.Parameter(torch.randn(5, d))
        self.v = nn.Parameter(torch.randn(5, m))
        self.b = nn.Parameter(torch.randn(5)) if bias else None

    def forward(self, x):
        h = torch.tanh(nn.functional.linear(x, self.w, self.b))
        return h @ self.v


def test_raw_weights_of_matrix_products_are_exact_as_uses(use_calls, no_fallback):
    """A router's weight (transformers' MoE routers: F.linear on the flattened tokens) or any raw weight of a product:
    the Linear's factors of the product's rows, G at its node, the rows its saved input (since 2026-12-02: the
    exact fallback's before)."""
    model = RawProducts()
    x = _tokens()
    exact_by_slices(model, lambda sl=slice(None): model(x[sl]).pow(2).sum((1, 2)))
    assert set(used(use_calls)) == {parameter_uses.LINEAR, parameter_uses.MATMUL}


def test_a_product_with_its_trained_bias_is_one_use_of_both(use_calls, no_fallback):
    """F.linear(x, w, b) with b trained: one addmm reads both, captured as one use (a Linear's factors: G^T x and the
    sum of G's rows), as GPT-OSS's router is."""
    model = RawProducts(bias=True)
    x = _tokens()
    exact_by_slices(model, lambda sl=slice(None): model(x[sl]).pow(2).sum((1, 2)))
    assert set(used(use_calls)) == {parameter_uses.LINEAR, parameter_uses.MATMUL}


class BiasAddedByHand(nn.Module):
    """torch.addmm(b, x, w.t()) with beta 2: no Linear's bias (the fallback)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.w, self.b = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(5))

    def forward(self, x):
        return torch.addmm(self.b, x.reshape(-1, 4), self.w.t(), beta=2.0).reshape(*x.shape[:-1], 5)


def test_an_addmm_that_scales_its_bias_takes_the_exact_fallback(use_calls):
    model = BiasAddedByHand()
    x = _tokens()
    exact_by_slices(model, lambda sl=slice(None): model(x[sl]).pow(2).sum((1, 2)))
    assert not any(use_calls.values())


class ConstantMultiples(nn.Module):
    """Its own parameters times constants before their ops: a Python number (autograd wraps it as a 0-dim tensor of no
    edge) on either side, and a 0-dim buffer."""

    def __init__(self, d=4):
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.linspace(-1.0, 1.0, d))
        self.shift = nn.Parameter(torch.linspace(-2.0, 2.0, d))
        self.register_buffer("c", torch.tensor(0.7))

    def forward(self, x):
        return self.inner(x) * (2.5 * self.scale.tanh()) + (self.shift * 3) * self.c


def test_parameters_times_constants_are_exact_as_uses(use_calls, no_fallback):
    torch.manual_seed(0)
    model = nn.Sequential(ConstantMultiples(), nn.Tanh(), nn.Linear(4, 2)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert set(used(use_calls)) == {parameter_uses.SCALED, parameter_uses.ADDED}


@pytest.mark.parametrize("feedforward", [False, True])
def test_peft_ia3_vectors_in_their_parameter_dict_are_exact_as_uses(feedforward, use_calls, no_fallback):
    """peft's IA3 scales a Linear's output (or, on a feed-forward layer, its input) by ``1 * l.flatten()``, l in a
    ParameterDict of the layer's own (``ia3_l.default``): a scale's use, until 2026-12-03 the fallback's through the
    whole layer (a tiny BERT with IA3 on key, value and the feed-forward output, B=16, T=32, one CPU thread,
    book-keeping 4.06x -> 1.81x plain)."""
    import peft
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model = peft.get_peft_model(base, peft.IA3Config(target_modules=["0", "2"], feedforward_modules=["2"] if
                                                     feedforward else [], init_ia3_weights=False)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert used(use_calls) == {parameter_uses.SCALED: used(use_calls)[parameter_uses.SCALED]}


def test_peft_vera_vectors_are_exact_as_uses(use_calls, no_fallback):
    """VeRA's two vectors scale its frozen random projections (``lambda_b * F.linear(lambda_d * F.linear(x, A), B)``),
    each in a ParameterDict of the layer's own: two scales' uses (the fallback's through the layer before 2026-12-03)."""
    import peft
    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)),
                                peft.VeraConfig(r=2, target_modules=["0"], init_weights=False)).double()
    assert_exact_model(model, torch.randn(B, 5, 4), squares, B)
    assert set(used(use_calls)) == {parameter_uses.SCALED}
