"""Whole models from tiny transformers configs (and plain PyTorch nets) against the per-example loop."""
import pytest
import torch
from torch import nn

import ghostdp
from ghostdp import per_example_loss
from ghostdp.clipping.recording import SHARED_BY_THE_BATCH
from conftest import assert_exact, assert_exact_model

B = 4
CE = nn.CrossEntropyLoss()


def classification_loss(labels):
    return lambda out, sl: per_example_loss(CE, out.logits if hasattr(out, "logits") else out, labels[sl])


def padded_text(vocab, T=7):
    ids = torch.randint(1, vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for i, n in enumerate([7, 5, 3, 6]):
        mask[i, n:] = 0
        ids[i, n:] = 0
    return ids, mask


def tiny_bert(**extra):
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=16, type_vocab_size=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, **extra)
    return BertForSequenceClassification(cfg).double()


def test_bert_with_trainable_embeddings_and_padding():
    model = tiny_bert()
    ids, mask = padded_text(30)
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask, token_type_ids=types),
                       classification_loss(labels), B)


def test_bert_given_each_example_twice_in_one_forward_is_exact():
    """R-Drop's loss: the batch and a second view of it in one forward (2B rows), each example's loss over both of its
    outputs. Its layers hold the examples in stacked views on dim 0 (layout.TILED_LAYOUT; refused before 2026-12-07,
    the position embeddings first). The forward check cannot replace examples in a batch of 2B rows and says so."""
    model = tiny_bert()
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    ce = nn.CrossEntropyLoss(reduction="none")

    def losses(rows):
        n = len(rows)
        logits = model(input_ids=torch.cat([ids[rows], ids[rows].flip(1)]),
                       attention_mask=torch.cat([mask[rows], mask[rows].flip(1)])).logits
        first, second = logits[:n], logits[n:]
        agreement = (first.softmax(-1) - second.softmax(-1)).pow(2).sum(1)
        return ce(first, labels[rows]) + ce(second, labels[rows]) + agreement

    with pytest.warns(UserWarning, match="could not check that the model's forward keeps the examples apart"):
        assert_exact(model, lambda: losses(list(range(B))), lambda i: losses([i]).sum(), B)


def test_gpt2_tied_embeddings_with_ignored_labels():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = padded_text(25)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100

    def loss(out, sl):  # causal LM: token t predicts token t+1
        return per_example_loss(CE, out.logits[:, :-1], labels[sl][:, 1:])

    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), loss, B)


def test_vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=20, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=3)
    model = ViTForImageClassification(cfg).double()
    pixels = torch.randn(B, 3, 8, 8)
    assert_exact_model(model, dict(pixel_values=pixels), classification_loss(torch.randint(0, 3, (B,))), B)


def test_swin_windows_hold_several_rows_of_each_example():
    """Swin runs its attention on (B * windows, tokens, d), and adds to every row's scores a relative position bias
    that a table read by index gives for all of them: trained too (since 2026-11-28: norms/window_bias.py; before,
    ghostdp's broadcast broke the model's shapes and its error asked to freeze the tables)."""
    from transformers import SwinConfig, SwinForImageClassification
    cfg = SwinConfig(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4,
                     num_labels=3, drop_path_rate=0.0)
    model = SwinForImageClassification(cfg).double()
    pixels = torch.randn(B, 3, 16, 16)
    assert_exact_model(model, dict(pixel_values=pixels), classification_loss(torch.randint(0, 3, (B,))), B)


def test_a_model_that_broadcasts_a_shared_output_itself_fails_naming_the_module_to_freeze():
    """DeBERTa's relative embeddings are computed once for the batch and broadcast (repeated) by the model; ghostdp
    had broadcast them already, and the model's own error (a bmm or sdpa size mismatch) did not say why. (Swin's
    relative position bias failed so too until 2026-11-28: it trains since, norms/window_bias.py.)"""
    import transformers as tf
    model = tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
        pos_att_type=["p2c", "c2p"], num_labels=3, **_small()))
    model.deberta.encoder.rel_embeddings.weight.requires_grad_(False)  # read by the encoder directly
    inputs, culprit = dict(input_ids=padded_text(30)[0]), "deberta.encoder.layer.0.attention.self.pos_query_proj"
    controller = ghostdp.GhostClipping(model, 1.0)
    with pytest.raises(RuntimeError) as caught:
        model(**inputs)
    controller.detach()
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert f"broadcast the output of module '{culprit}'" in notes and "Fix: freeze that module's parameters" in notes
    assert SHARED_BY_THE_BATCH in notes


@pytest.mark.parametrize("share_att_key", [True, False], ids=["deberta-v3", "deberta-v2"])
def test_deberta_with_relative_attention_trains_exactly_with_what_the_error_names_frozen(share_att_key):
    """Without validate.fix (tests/layers/test_deberta.py has it), what SHARED_BY_THE_BATCH said to freeze before
    2026-12-02, frozen (the projections of the shared relative embeddings, the embeddings and their LayerNorm): the
    rest of the model, tokens' query and key projections too where they are other modules, exact against the
    per-example loop."""
    import transformers as tf
    model = tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0, relative_attention=True,
        position_buckets=4, pos_att_type=["p2c", "c2p"], share_att_key=share_att_key, norm_rel_ebd="layer_norm",
        num_labels=3, **_small())).double()
    shared = ("query_proj", "key_proj") if share_att_key else ("pos_query_proj", "pos_key_proj")
    for name, p in model.named_parameters():
        frozen = (name.startswith(("deberta.encoder.rel_embeddings.", "deberta.encoder.LayerNorm."))
                  or name.rsplit(".", 2)[-2] in shared)
        p.requires_grad_(not frozen)
    assert any(p.requires_grad for n, p in model.named_parameters() if "attention.self" in n)
    ids, mask = padded_text(30)
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask),
                       classification_loss(torch.randint(0, 3, (B,))), B)


def test_blenderbots_positions_shared_by_the_batch_train_exactly():
    """Blenderbot's learned positions are (T, d): one lookup for the whole batch, with no batch dim, that the model
    adds to every example's tokens. The layout proof refused them until 2026-11-28, naming the freeze; since, the
    recorder gives their output a batch dim (RuleEntry.unbatched_output) and they train, exact."""
    import transformers as tf
    cfg = tf.BlenderbotSmallConfig(vocab_size=30, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                   decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, pad_token_id=0, decoder_start_token_id=1)
    model = tf.BlenderbotSmallForConditionalGeneration(cfg).double()
    ids = torch.randint(3, 30, (B, B + 2))  # T != B: no dim of the positions' own output can hold the examples
    inputs = dict(input_ids=ids, decoder_input_ids=ids.flip(1))

    def loss(out, sl):
        return per_example_loss(CE, out.logits[:, :-1], ids[sl].flip(1)[:, 1:])

    assert_exact_model(model, inputs, loss, B)


@pytest.mark.parametrize("base", ["bert", "roberta", "gpt2", "llama"])
def test_peft_lora(base):
    from peft import LoraConfig, get_peft_model
    if base == "bert":
        model = tiny_bert()
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    elif base == "roberta":
        from transformers import RobertaConfig, RobertaForSequenceClassification
        model = RobertaForSequenceClassification(RobertaConfig(
            vocab_size=25, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
            pad_token_id=0)).double()
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    elif base == "llama":
        from transformers import LlamaConfig, LlamaForSequenceClassification
        model = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=25, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, num_labels=3, pad_token_id=0)).double()
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                         modules_to_save=["score"])
    else:
        from transformers import GPT2Config, GPT2ForSequenceClassification
        model = GPT2ForSequenceClassification(GPT2Config(
            vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, num_labels=3, pad_token_id=0)).double()
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], modules_to_save=["score"],
                         fan_in_fan_out=True)
    model = get_peft_model(model, cfg)
    for n, p in model.named_parameters():  # LoRA B starts at zero; make the test non-degenerate
        if "lora_B" in n:
            nn.init.normal_(p, std=0.5)
    ids, mask = padded_text(25)
    # LlamaRMSNorm computes in float32 even in a float64 model, so a gradient scaled by c_i before the
    # backward (pass 2, and any weighted loss) and one scaled after it (the per-example reference) round
    # differently, by about 1e-8; the norms still agree to 1e-16.
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask),
                       classification_loss(torch.randint(0, 3, (B,))), B, rtol=1e-6 if base == "llama" else 1e-9)
    # Frozen base weights cost no norm work: a forward records only the trainable (adapter, head) parameters.
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(input_ids=ids, attention_mask=mask)  # its graph keeps the recorded uses alive
    trainable_params = {p for p in model.parameters() if p.requires_grad}
    assert set(controller.recorder.live) == {id(p) for p in trainable_params}
    assert len(trainable_params) < len(list(model.parameters())) / 2 and out.logits.requires_grad
    controller.detach()


@pytest.mark.parametrize("method", ["ia3", "loha", "prefix-tuning"])
def test_more_peft_methods(method):
    """IA3 (learned scalings: scales' uses, norms/parameter_uses.py), LoHa (Hadamard product of two low-rank factors,
    formed inside its layer: norms/peft_lycoris.py) and prefix tuning (virtual keys and values from a prompt encoder,
    passed as past_key_values)."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel
    if method == "loha":
        model, cfg = tiny_bert(), peft.LoHaConfig(r=2, target_modules=["query", "value"])
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=25, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double()
        cfg = (peft.IA3Config(task_type="CAUSAL_LM", target_modules=["c_attn", "mlp.c_proj"],
                              feedforward_modules=["mlp.c_proj"]) if method == "ia3"
               else peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    model = peft.get_peft_model(model, cfg).double()
    for p in model.parameters():  # adapters that start at zero or one: make the test non-degenerate
        if p.requires_grad:
            nn.init.normal_(p, mean=1.0 if method == "ia3" else 0.0, std=0.3)
    ids, mask = padded_text(25)
    if method == "loha":
        loss = classification_loss(torch.randint(0, 3, (B,)))
    else:
        def loss(out, sl):
            return out.logits.pow(2).mean((1, 2))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), loss, B)


class SequenceFirstEncoder(nn.Module):
    """torch's encoder layer with its default batch_first=False, on (T, B, 8), mean-pooled into a head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer(x).mean(0))


@pytest.mark.parametrize("T", [5, 3])
def test_peft_dora_in_a_sequence_first_encoder_layer(T):
    """DoRA's magnitude (peft's DoraLinearLayer, no rule: the fallback) on the layer's (T, B, d) activations: split
    by example on dim 1, where the proof finds them, also with T = B. Refused before late 2026-12-02."""
    import peft
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=2, target_modules=["linear1", "linear2"], use_dora=True, init_lora_weights=False,
                          modules_to_save=["head"])
    model = peft.get_peft_model(SequenceFirstEncoder(), cfg).double()
    x = torch.randn(T, 3, 8, dtype=torch.float64)
    assert_exact(model, lambda: model(x).pow(2).sum(1), lambda i: model(x[:, i:i + 1]).pow(2).sum(), 3)


_QV = ["query", "value"]
# peft 0.21's methods that train adapters of their own (FourierFT, exact in a scratch run, fails in peft itself under
# the suite's float64 default dtype: its dense spectrum takes the default dtype, its values float32)
PEFT_METHODS_ON_BERT = {
    "adalora": lambda peft: peft.AdaLoraConfig(r=2, target_modules=_QV, total_step=10, init_r=2, target_r=2),
    "lokr": lambda peft: peft.LoKrConfig(r=2, target_modules=_QV),
    "boft": lambda peft: peft.BOFTConfig(boft_block_size=4, target_modules=_QV),
    "oft": lambda peft: peft.OFTConfig(r=2, target_modules=_QV, oft_block_size=0),
    "vera": lambda peft: peft.VeraConfig(r=2, target_modules=_QV),
    "hra": lambda peft: peft.HRAConfig(r=2, target_modules=_QV),
    "vblora": lambda peft: peft.VBLoRAConfig(r=2, target_modules=_QV, num_vectors=8, vector_length=8),
    "ln_tuning": lambda peft: peft.LNTuningConfig(target_modules=["LayerNorm"]),
    "c3a": lambda peft: peft.C3AConfig(block_size=4, target_modules=_QV),
    "shira": lambda peft: peft.ShiraConfig(r=2, target_modules=_QV),
    "miss": lambda peft: peft.MissConfig(r=2, target_modules=_QV),
    "randlora": lambda peft: peft.RandLoraConfig(r=2, target_modules=_QV),
    "delora": lambda peft: peft.DeloraConfig(r=2, target_modules=_QV),
    "waveft": lambda peft: peft.WaveFTConfig(n_frequency=8, target_modules=_QV),
    "unilora": lambda peft: peft.UniLoraConfig(r=2, target_modules=_QV),
    "hira": lambda peft: peft.HiraConfig(r=2, target_modules=_QV),
    "gralora": lambda peft: peft.GraloraConfig(r=4, target_modules=_QV, gralora_k=2),
    "trainable_tokens": lambda peft: peft.TrainableTokensConfig(target_modules=["word_embeddings"],
                                                                token_indices=list(range(30))),
}


@pytest.mark.parametrize("method", sorted(PEFT_METHODS_ON_BERT))
def test_peft_methods_on_bert(method):
    """Each adapter's parameters drawn at random (several start at zero or at the identity)."""
    import peft
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_bert(), PEFT_METHODS_ON_BERT[method](peft)).double()
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.3)
    ids, mask = padded_text(25)
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask),
                       classification_loss(torch.randint(0, 3, (B,))), B, rtol=1e-6)


def test_conv_net_with_groupnorm_and_inplace_relu():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    x = torch.randn(B, 3, 9, 9)
    assert_exact_model(model, x, classification_loss(torch.randint(0, 5, (B,))), B)


class TokenMLP(nn.Module):
    """Linear layers on (B, T, d) inputs whose outputs are then changed in place."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(9, 4)

    def forward(self, x):
        h = torch.relu_(self.up(x))
        y = self.down(h)
        y.mul_(2.0).add_(x[..., :4])
        return y.mean(1)


def test_token_linear_outputs_modified_in_place():
    assert_exact_model(TokenMLP(), torch.randn(B, 5, 6), classification_loss(torch.randint(0, 4, (B,))), B)


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.gru = nn.GRU(6, 7, batch_first=True)
        self.head = nn.Linear(7, 3)

    def forward(self, ids):
        _, h = self.gru(self.emb(ids))
        return self.head(h[-1])


def test_model_with_gru():
    assert_exact_model(GRUClassifier(), torch.randint(0, 20, (B, 6)),
                       classification_loss(torch.randint(0, 3, (B,))), B)


def test_model_with_4d_linear_input():
    model = nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 2))
    x = torch.randn(B, 3, 4, 5)
    target = torch.randn(B, 3, 4, 2)
    mse = nn.MSELoss()
    assert_exact_model(model, x, lambda out, sl: per_example_loss(mse, out, target[sl]), B)


def test_bfloat16_model_norms_accumulate_in_float32_or_better():
    import ghostdp
    model = tiny_bert().to(torch.bfloat16)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    controller = ghostdp.GhostClipping(model, 1.0)
    out = model(input_ids=ids, attention_mask=mask).logits
    losses = per_example_loss(CE, out.double(), labels)
    norms = controller.per_example_norms(losses)
    controller.detach()
    assert norms.dtype == torch.float64
    ref = []
    for i in range(B):
        model.zero_grad()
        per_example_loss(CE, model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits.double(),
                         labels[i:i + 1]).sum().backward()
        ref.append(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())))
    # bf16 gradients carry ~3 significant digits; the norms must agree to that, not drift further
    assert torch.allclose(norms, torch.stack(ref), rtol=3e-2)


def test_bfloat16_model_both_clipping_modes_agree():
    import ghostdp
    model = tiny_bert().to(torch.bfloat16)
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    grads = {}
    for clipping in ("ghost", "bookkeeping"):
        controller = ghostdp.GhostClipping(model, 0.1, clipping=clipping)  # C small: every example is clipped
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask).logits
        controller.loss(per_example_loss(CE, out.float(), labels), reduction="sum").backward()
        controller.detach()
        assert bool((controller.last_coefficients < 1).all())
        grads[clipping] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    scale = grads["ghost"].abs().max()
    assert float((grads["ghost"] - grads["bookkeeping"]).abs().max() / scale) < 2e-2


def _small(**extra):
    return dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, vocab_size=30,
                max_position_embeddings=32, **extra)


MORE_TRANSFORMERS = {
    # one layer's parameters shared by every layer (cross terms across the calls), factorised embeddings
    "albert": lambda tf: tf.AlbertForSequenceClassification(tf.AlbertConfig(
        embedding_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        num_labels=3, **_small())),
    "distilbert": lambda tf: tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=30, dim=16, n_layers=2, n_heads=2, hidden_dim=24, dropout=0.0, attention_dropout=0.0,
        seq_classif_dropout=0.0, max_position_embeddings=32, num_labels=3)),
    # rotary positions, a parallel attention and MLP residual
    "gpt-neox": lambda tf: tf.GPTNeoXForSequenceClassification(tf.GPTNeoXConfig(
        hidden_dropout=0.0, attention_dropout=0.0, num_labels=3, pad_token_id=0, **_small())),
    # global attention on the first token: its projections run sequence-first on one position, (1, B, d), an
    # output of size 1 on dim 0 that is not shared by the batch (it was broadcast to it: the forward crashed)
    "longformer": lambda tf: tf.LongformerForSequenceClassification(tf.LongformerConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attention_window=4, pad_token_id=0,
        num_labels=3, **_small())),
    # NoNorm (an elementwise affine without statistics: the fallback) and bottlenecks
    "mobilebert": lambda tf: tf.MobileBertForSequenceClassification(tf.MobileBertConfig(
        embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_feedforward_networks=1, num_labels=3, **_small())),
    # families fine-tuned most often today, exact since they met ghostdp (2026-12-02), kept so:
    # ModernBERT: local and global attention layers, a gated MLP (Wi's output chunked), no biases
    "modernbert": lambda tf: tf.ModernBertForSequenceClassification(tf.ModernBertConfig(
        global_attn_every_n_layers=2, local_attention=4, attention_dropout=0.0, embedding_dropout=0.0,
        mlp_dropout=0.0, classifier_dropout=0.0, pad_token_id=0, num_labels=3, **_small())),
    # grouped-query attention with RMSNorms on the queries and keys (Qwen3), sliding windows (Mistral), fused
    # qkv and gate-up projections (Phi-3), Gemma 3's scaled embeddings and four norms per layer
    "qwen3": lambda tf: tf.Qwen3ForSequenceClassification(tf.Qwen3Config(
        num_key_value_heads=1, head_dim=8, pad_token_id=0, num_labels=3, **_small())),
    "mistral": lambda tf: tf.MistralForSequenceClassification(tf.MistralConfig(
        num_key_value_heads=1, sliding_window=4, pad_token_id=0, num_labels=3, **_small())),
    "phi3": lambda tf: tf.Phi3ForSequenceClassification(tf.Phi3Config(
        num_key_value_heads=1, pad_token_id=0, num_labels=3, **_small())),
    "gemma3": lambda tf: tf.Gemma3ForSequenceClassification(tf.Gemma3TextConfig(
        num_key_value_heads=1, head_dim=8, pad_token_id=0, num_labels=3, **_small())),
    # ESM (protein language model): rotary positions, its token dropout's rescaling of the embeddings
    "esm": lambda tf: tf.EsmForSequenceClassification(tf.EsmConfig(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, position_embedding_type="rotary",
        pad_token_id=0, num_labels=3, **_small())),
}


@pytest.mark.parametrize("name", list(MORE_TRANSFORMERS))
def test_more_transformers_with_padding(name):
    import transformers
    model = MORE_TRANSFORMERS[name](transformers).double()
    ids, mask = padded_text(30)
    labels = torch.randint(0, 3, (B,))
    assert_exact_model(model, dict(input_ids=ids, attention_mask=mask), classification_loss(labels), B)
