"""BERT: sizes from the paper, padding, order-blindness without positions, heads, training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models.bert import Bert, BertConfig, VARIANTS
from attention_jax.models.losses import cross_entropy
from helpers import adam_losses, assert_loss_goes_down

B, T = 2, 8
IDS = jax.random.randint(jax.random.key(1), (B, T), 5, 128)
TYPES = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]])
MASK = jnp.arange(T)[None, :] < jnp.array([[5], [8]])  # row 0: 5 real tokens, 3 pads


def _count(cfg, head):
    shapes = jax.eval_shape(Bert(cfg, head=head).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return sum(x.size for x in jax.tree.leaves(nn.unbox(shapes["params"])))


def _model(head="pretraining", **overrides):
    """bert-tiny without dropout. The reference attention path is the cheapest to run op by
    op; the blockwise path is compared against it below."""
    cfg = dict(dropout_rate=0.0, attention_dropout_rate=0.0, implementation="reference")
    return Bert(BertConfig.from_variant("bert-tiny", **{**cfg, **overrides}), head=head)


@functools.lru_cache(maxsize=None)
def _params():
    """One set of bert-tiny parameters for every test: the pretraining head's parameters
    include those of the "encoder" head (extra ones are ignored by apply)."""
    return nn.unbox(_model().init(jax.random.key(0), IDS)["params"])


def test_parameter_counts_match_the_paper():
    # Devlin et al. Section 3: BERT-base 110M, BERT-large 340M. The encoder with pooler
    # equals Hugging Face's BertModel exactly (109,482,240 and 335,141,888); the paper's
    # 340M for large is rounded up by 1.4%.
    base, large = BertConfig.from_variant("bert-base"), BertConfig.from_variant("bert-large")
    assert _count(base, "encoder") == 109_482_240
    assert _count(BertConfig.from_variant("bert-base", scan_layers=True), "encoder") == 109_482_240
    assert _count(large, "encoder") == 335_141_888
    assert abs(_count(base, "pretraining") / 110e6 - 1) < 0.01
    assert abs(_count(large, "pretraining") / 340e6 - 1) < 0.015
    # MLM head tied: the only extra [V, D]-sized tensor would be an untied decoder.
    d, v = 768, 30522
    assert _count(base, "pretraining") - _count(base, "encoder") == d * d + d + 2 * d + v + 2 * d + 2


def test_mlm_head_is_tied_to_the_word_embedding():
    model, params = _model(), _params()
    out, aux = model.apply({"params": params}, IDS, TYPES, MASK)
    h = aux["hidden_states"] @ params["mlm_transform"]["kernel"] + params["mlm_transform"]["bias"]
    h = jax.nn.gelu(h, approximate=False)
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-12) * params["mlm_norm"]["scale"] + params["mlm_norm"]["bias"]
    manual = h @ params["word_embeddings"]["embedding"].T + params["mlm_bias"]
    np.testing.assert_allclose(out["mlm_logits"], manual, atol=1e-4, rtol=1e-4)
    # Gathering masked positions first gives the same logits at those positions.
    pos = jnp.array([[1, 3], [0, 7]])
    gathered, _ = model.apply({"params": params}, IDS, TYPES, MASK, masked_positions=pos)
    np.testing.assert_allclose(gathered["mlm_logits"],
                               jnp.take_along_axis(out["mlm_logits"], pos[..., None], 1), atol=1e-5)
    assert out["nsp_logits"].shape == (B, 2)


def test_pad_tokens_do_not_change_real_token_outputs():
    model, params = _model(), _params()
    other = jnp.where(MASK, IDS, 99)  # different ids at the padding positions
    a = model.apply({"params": params}, IDS, TYPES, MASK)[1]["hidden_states"]
    b = model.apply({"params": params}, other, TYPES, MASK)[1]["hidden_states"]
    np.testing.assert_allclose(a[0, :5], b[0, :5], atol=1e-5)
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)
    # Without the mask the pads are attended to, and real tokens see the change.
    c = model.apply({"params": params}, other, TYPES)[1]["hidden_states"]
    assert not np.allclose(a[0, :5], c[0, :5], atol=1e-3)


@pytest.mark.parametrize("positions", [False, True])
def test_encoder_without_positions_is_permutation_equivariant(positions):
    model, params = _model("encoder", position_embeddings=positions), _params()
    perm = jnp.array([3, 0, 6, 1, 7, 2, 5, 4])
    y, _ = model.apply({"params": params}, IDS, TYPES)
    y_perm, _ = model.apply({"params": params}, IDS[:, perm], TYPES[:, perm])
    equivariant = np.allclose(y_perm, y[:, perm], atol=1e-5)
    assert equivariant == (not positions)


def test_reference_and_blockwise_attention_agree_in_outputs_and_gradients():
    params = _params()
    labels = jnp.array([0, 1])

    def loss(params, implementation):
        cfg = BertConfig.from_variant("bert-tiny", dropout_rate=0.0, attention_dropout_rate=0.0,
                                      implementation=implementation)
        out, _ = Bert(cfg).apply({"params": params}, IDS, TYPES, MASK)
        total = (cross_entropy(out["mlm_logits"], IDS, MASK)[0]
                 + cross_entropy(out["nsp_logits"], labels)[0])
        return total, out

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l_ref, out_ref), g_ref = grad_fn(params, "reference")
    (l_blk, out_blk), g_blk = grad_fn(params, "blockwise")
    np.testing.assert_allclose(l_ref, l_blk, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out_ref), jax.tree.leaves(out_blk)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_blk)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4)


def test_attention_weights_hide_padding():
    model, params = _model(), _params()
    _, aux = model.apply({"params": params}, IDS, TYPES, MASK, return_weights=True)
    w = np.asarray(aux["attention_weights"]["self"])  # [L, B, N, T, T]
    assert w.shape == (2, B, 2, T, T)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(w[:, 0, :, :, 5:], 0.0)


def test_classification_head_reads_the_pooled_cls_token():
    model = _model("classification", num_labels=3)
    classifier = {"kernel": jax.random.normal(jax.random.key(2), (32, 3)), "bias": jnp.ones(3)}
    params = _params() | {"classifier": classifier}
    logits, aux = model.apply({"params": params}, IDS, TYPES, MASK)
    assert logits.shape == (B, 3)
    np.testing.assert_allclose(aux["pooled"], jnp.tanh(
        aux["hidden_states"][:, 0] @ params["pooler"]["kernel"] + params["pooler"]["bias"]), atol=1e-5)
    np.testing.assert_allclose(logits, aux["pooled"] @ params["classifier"]["kernel"]
                               + params["classifier"]["bias"], atol=1e-5)


def test_jitted_pretraining_steps_decrease_the_loss():
    model = _model(dropout_rate=0.1, attention_dropout_rate=0.1)
    params = _params()
    masked = jnp.where((jnp.arange(T) % 3 == 1)[None] & MASK, 4, IDS)  # [MASK]=4 at 1, 4, 7
    weights = (masked != IDS).astype(jnp.float32)
    nsp_labels = jnp.array([1, 0])

    def loss_fn(p, key):
        out, _ = model.apply({"params": p}, masked, TYPES, MASK, deterministic=False,
                             rngs={"dropout": key})
        return (cross_entropy(out["mlm_logits"], IDS, weights)[0]
                + cross_entropy(out["nsp_logits"], nsp_labels)[0])

    assert_loss_goes_down(adam_losses(loss_fn, params, steps=8, lr=3e-3), by=0.5)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match=r"bert-base.*bert-large"):
        BertConfig.from_variant("bert-huge")
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide.*\[1, 2, 4, 8, 16, 32\]"):
        BertConfig.from_variant("bert-tiny", num_heads=5)
    with pytest.raises(ValueError, match="activation"):
        BertConfig.from_variant("bert-tiny", activation="swish")
    cfg = BertConfig.from_variant("bert-tiny")
    with pytest.raises(ValueError, match="head"):
        jax.eval_shape(Bert(cfg, head="qa").init, jax.random.key(0), IDS)
    with pytest.raises(ValueError, match="max_len"):
        jax.eval_shape(Bert(cfg).init, jax.random.key(0), jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match="token_type_ids"):
        jax.eval_shape(Bert(cfg).init, jax.random.key(0), IDS, TYPES[:, :4])
    assert {"bert-base", "bert-large", "bert-tiny"} <= set(VARIANTS)


def test_out_of_range_masked_positions_and_token_types_are_named_eagerly():
    """masked_positions past T gave NaN MLM logits and -1 the last token's, a token type
    past the table said "ids: 2 is outside the table's 2 rows": each now names its
    argument where the values are known (a model applied eagerly)."""
    model, params = _model(), _params()
    for bad in (jnp.array([[1, 50], [2, 3]]), jnp.array([[1, -1], [2, 3]])):
        with pytest.raises(ValueError, match=rf"^masked_positions: {int(bad[0, 1])} is out of "
                                             rf"range; valid: 0..{T - 1} \(the input's T={T} "
                                             rf"tokens\)"):
            model.apply({"params": params}, IDS, masked_positions=bad)
    with pytest.raises(ValueError, match=r"^masked_positions: shape \(3,\); valid: \[B, M\]"):
        model.apply({"params": params}, IDS, masked_positions=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"^token_type_ids: 2 is out of range; valid: 0..1 "
                                         r"\(type_vocab_size=2\)"):
        model.apply({"params": params}, IDS, TYPES * 2)
    out, _ = model.apply({"params": params}, IDS, masked_positions=jnp.array([[0, 7], [3, 4]]))
    assert out["mlm_logits"].shape[:2] == (B, 2) and np.isfinite(out["mlm_logits"]).all()


def _hf_layer(sd, prefix, n, ln_names):
    """One Hugging Face encoder layer (torch state dict) in this project's layout."""
    g = lambda name: sd[f"{prefix}.{name}"].detach().numpy()
    d = g("attention.self.query.weight").shape[1]
    qkv = [g(f"attention.self.{c}.weight").T.reshape(d, n, -1) for c in ("query", "key", "value")]
    qkv_b = [g(f"attention.self.{c}.bias").reshape(n, -1) for c in ("query", "key", "value")]
    norm = lambda name: {"scale": g(f"{name}.weight"), "bias": g(f"{name}.bias")}
    return {
        "self_attention": {"qkv": np.stack(qkv, 1), "qkv_bias": np.stack(qkv_b),
                           "out": g("attention.output.dense.weight").T.reshape(n, -1, d),
                           "out_bias": g("attention.output.dense.bias")},
        "mlp": {"wi": {"kernel": g("intermediate.dense.weight").T, "bias": g("intermediate.dense.bias")},
                "wo": {"kernel": g("output.dense.weight").T, "bias": g("output.dense.bias")}},
        "self_attention_norm": norm(ln_names[0]), "mlp_norm": norm(ln_names[1])}


@pytest.mark.slow
def test_matches_hugging_face_bert_for_pretraining():
    """Same weights, same outputs: post-norm, exact GELU, eps 1e-12, pooler and tied MLM
    head are the architecture of the released checkpoints."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = BertConfig.from_variant("bert-tiny", dropout_rate=0.0, attention_dropout_rate=0.0)
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.mlp_dim, hidden_act="gelu",
        max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.norm_epsilon,
        initializer_range=0.3)  # wide weights: activations O(1), where GELU variants differ
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_cfg).eval()
    sd = hf.state_dict()
    g = lambda name: sd[name].detach().numpy()
    norm = lambda name: {"scale": g(f"{name}.weight"), "bias": g(f"{name}.bias")}
    dense = lambda name: {"kernel": g(f"{name}.weight").T, "bias": g(f"{name}.bias")}
    params = {
        "word_embeddings": {"embedding": g("bert.embeddings.word_embeddings.weight")},
        "position_embeddings": {"embedding": g("bert.embeddings.position_embeddings.weight")},
        "token_type_embeddings": {"embedding": g("bert.embeddings.token_type_embeddings.weight")},
        "embeddings_norm": norm("bert.embeddings.LayerNorm"),
        "encoder": {f"layer_{i}": _hf_layer(sd, f"bert.encoder.layer.{i}", cfg.num_heads,
                                            ("attention.output.LayerNorm", "output.LayerNorm"))
                    for i in range(cfg.num_layers)},
        "pooler": dense("bert.pooler.dense"),
        "mlm_transform": dense("cls.predictions.transform.dense"),
        "mlm_norm": norm("cls.predictions.transform.LayerNorm"),
        "mlm_bias": g("cls.predictions.bias"),
        "nsp": dense("cls.seq_relationship"),
    }
    out, aux = Bert(cfg).apply({"params": params}, IDS, TYPES, MASK)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(np.asarray(IDS)), token_type_ids=torch.tensor(np.asarray(TYPES)),
                 attention_mask=torch.tensor(np.asarray(MASK, np.int64)))
    np.testing.assert_allclose(out["mlm_logits"], ref.prediction_logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out["nsp_logits"], ref.seq_relationship_logits.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,field,value", [
    ("bert", "num_labels", 2.5), ("bert", "num_heads", 0), ("vit", "patch_size", 4.0),
    ("vit", "num_classes", True), ("cnn", "width", -8), ("rnn", "hidden_dim", 16.0)])
def test_every_family_refuses_sizes_that_are_not_positive_integers(family, field, value):
    """A float size (a config value written 4.0) or a bool was taken as a size and failed
    deep in the model, or trained on; now one line names the field and what is valid."""
    from attention_jax.models import bert, cnn, rnn, vit
    config_cls = {"bert": bert.BertConfig, "vit": vit.ViTConfig, "cnn": cnn.CNNConfig,
                  "rnn": rnn.RNNConfig}[family]
    required = (dict(vocab_size=32, embed_dim=8, hidden_dim=8, attention_dim=8, readout_dim=8)
                if family == "rnn" else {})
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer; got "
                                         rf"{value!r} \(valid: an integer >= 1\)$"):
        config_cls(**{**required, field: value})


@pytest.mark.parametrize("family", ["gpt", "bert", "vit", "cnn", "rnn", "encdec"])
def test_every_family_refuses_a_dtype_that_is_no_float(family):
    """GPTConfig(dtype='floatx') was taken until init said "data type 'floatx' not
    understood"; an integer dtype until the first matmul."""
    from attention_jax.models import bert, cnn, encdec, gpt, rnn, vit
    config_cls = {"gpt": gpt.GPTConfig, "bert": bert.BertConfig, "vit": vit.ViTConfig,
                  "cnn": cnn.CNNConfig, "rnn": rnn.RNNConfig,
                  "encdec": encdec.EncDecConfig}[family]
    required = (dict(vocab_size=32, embed_dim=8, hidden_dim=8, attention_dim=8, readout_dim=8)
                if family == "rnn" else {})
    for bad in ("floatx", "int32"):
        with pytest.raises(ValueError, match=rf"^dtype={bad!r} is no floating dtype; valid: "
                                             rf"one of \['float32', 'bfloat16', 'float16', "
                                             rf"'float64'\]"):
            config_cls(**{**required, "dtype": bad})
    config_cls(**{**required, "dtype": "bfloat16"})


@pytest.mark.parametrize("family", ["gpt", "bert", "vit", "cnn", "rnn", "encdec"])
def test_every_family_refuses_a_dropout_rate_outside_0_1_and_a_norm_epsilon_not_positive(
        family):
    """A model built in a notebook took dropout_rate=1.5 (training's activations all
    zeros) and -0.5 (scaled by 1/1.5) unsaid; only the trainer's config checks refused."""
    from attention_jax.models import bert, cnn, encdec, gpt, rnn, vit
    config_cls = {"gpt": gpt.GPTConfig, "bert": bert.BertConfig, "vit": vit.ViTConfig,
                  "cnn": cnn.CNNConfig, "rnn": rnn.RNNConfig,
                  "encdec": encdec.EncDecConfig}[family]
    required = (dict(vocab_size=32, embed_dim=8, hidden_dim=8, attention_dim=8, readout_dim=8)
                if family == "rnn" else {})
    names = [n for n in ("dropout_rate", "attention_dropout_rate")
             if n in config_cls.__dataclass_fields__]
    assert "dropout_rate" in names
    for name in names:
        for bad in (1.5, 1.0, -0.5):
            with pytest.raises(ValueError, match=rf"^{name}={bad!r} is out of range; valid: "
                                                 rf"0 <= {name} < 1$"):
                config_cls(**{**required, name: bad})
        config_cls(**{**required, name: 0.3})
        config_cls(**{**required, name: np.float32(0.25)})  # a NumPy float is a number
        with pytest.raises(ValueError, match=rf"^{name}='0.1' is no number; valid: a float"):
            config_cls(**{**required, name: "0.1"})
    if "norm_epsilon" in config_cls.__dataclass_fields__:
        config_cls(**{**required, "norm_epsilon": np.float32(1e-5)})
        with pytest.raises(ValueError, match=r"^norm_epsilon=-1e-06 is out of range; valid: "
                                             r"norm_epsilon > 0"):
            config_cls(**{**required, "norm_epsilon": -1e-6})


def test_a_model_without_head_dim_names_only_the_head_counts_that_divide():
    """BERT's and ViT's head dim is always D / N: the message suggested a head_dim field
    they do not have."""
    with pytest.raises(ValueError, match=r"^num_heads=4 does not divide the model width "
                                         r"D=30 \(use num_heads in \[1, 2, 3, 5, 6, 10, "
                                         r"15, 30\]\)$"):
        BertConfig(d_model=30, num_heads=4)


@pytest.mark.parametrize("family", ["gpt", "encdec", "cnn"])
def test_logits_are_float32_at_least_and_stay_float64(family):
    """The families that widen their logits (bfloat16 -> float32, for the loss) kept them
    float32 under dtype='float64' too, so a float64 numerics check lost its precision at the
    model's last step. (Shapes and dtypes only: jax.eval_shape compiles nothing.)"""
    from attention_jax.models import cnn, encdec, gpt
    for dtype, want in (("bfloat16", jnp.float32), ("float64", jnp.float64)):
        with jax.enable_x64(dtype == "float64"):
            kw = dict(dtype=dtype, param_dtype="float64" if dtype == "float64" else "float32")
            if family == "gpt":
                model, args = gpt.GPT(gpt.get_config("gpt-tiny", **kw)), (jnp.ones((1, 8), int),)
            elif family == "encdec":
                model = encdec.EncoderDecoder(encdec.get_config("transformer-tiny", **kw))
                args = (jnp.ones((1, 8), int),) * 2
            else:
                model = cnn.CNN(cnn.CNNConfig.from_variant("resnet-tiny", dtype=dtype))
                args = (jnp.ones((1, 8, 8, 1)),)
            logits = jax.eval_shape(lambda: model.apply(
                model.init(jax.random.key(0), *args), *args)[0])
            assert logits.dtype == want, (dtype, logits.dtype)


@pytest.mark.parametrize("family, field", [("bert", "position_embeddings"),
                                           ("vit", "scan_layers"),
                                           ("encdec", "share_embeddings"),
                                           ("rnn", "attention")])
def test_a_bool_field_given_a_string_is_named(family, field):
    """A string was taken by its truth value (position_embeddings="False" kept the
    position embeddings; rnn attention="False" kept the attention), unsaid; GPT's
    config already refused it."""
    from attention_jax.models import encdec, rnn, vit
    make = {"bert": lambda **kw: BertConfig.from_variant("bert-tiny", **kw),
            "vit": lambda **kw: vit.ViTConfig.from_variant("vit-tiny/2", **kw),
            "encdec": lambda **kw: encdec.get_config("transformer-tiny", **kw),
            "rnn": lambda **kw: rnn.RNNConfig.from_variant("tiny", **kw)}[family]
    with pytest.raises(ValueError, match=rf"^{field}='False' is no bool; valid: True or False"):
        make(**{field: "False"})
    assert getattr(make(**{field: False}), field) is False


@pytest.mark.parametrize("family", ["gpt", "bert", "vit", "encdec", "rnn", "cnn"])
def test_a_call_s_switch_given_a_string_is_named(family):
    """deterministic="False" is truthy: a training call ran without dropout, unsaid.
    (Shapes only: jax.eval_shape compiles nothing.)"""
    from attention_jax.models import cnn, encdec, gpt, rnn, vit
    ids, images = jnp.ones((1, 8), int), jnp.ones((1, 8, 8, 1))
    model, args = {
        "gpt": (gpt.GPT(gpt.get_config("gpt-tiny")), (ids,)),
        "bert": (Bert(BertConfig.from_variant("bert-tiny")), (ids,)),
        "vit": (vit.ViT(vit.ViTConfig.from_variant("vit-tiny/2", image_size=8, num_channels=1)),
                (images,)),
        "encdec": (encdec.EncoderDecoder(encdec.get_config("transformer-tiny")), (ids, ids)),
        "rnn": (rnn.RNNSeq2Seq(rnn.RNNConfig.from_variant("tiny")), (ids, ids)),
        "cnn": (cnn.CNN(cnn.CNNConfig.from_variant("resnet-tiny", num_channels=1)), (images,)),
    }[family]
    variables = jax.eval_shape(model.init, jax.random.key(0), *args)
    with pytest.raises(ValueError, match=r"^deterministic='False' is no bool; valid: True or "
                                         r"False"):
        jax.eval_shape(lambda v: model.apply(v, *args, deterministic="False"), variables)
    jax.eval_shape(lambda v: model.apply(v, *args, deterministic=np.bool_(True)), variables)
