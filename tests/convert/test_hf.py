"""Hugging Face conversion against PyTorch: tiny randomly initialised transformers models
(no download) saved to tmp_path, loaded here, compared output for output.

Parameters are re-drawn at O(1) scale (transformers initialises with std 0.02, where
exact and tanh GELU, or swapped norms, would agree to 1e-4 and hide a wrong mapping).
"""

import dataclasses
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from attention_jax import attention as attention_lib  # noqa: E402
from attention_jax import convert  # noqa: E402
from attention_jax.convert import hf as hf_lib  # noqa: E402
from attention_jax.models import bert, gpt, vit  # noqa: E402

TOL = 1e-4
GPT_KW = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=48,
              bos_token_id=None, eos_token_id=None)
BERT_KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               vocab_size=97, max_position_embeddings=48, type_vocab_size=3)
VIT_KW = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
              image_size=16, patch_size=4, num_channels=3)


def _randomize(model, seed=0):
    """All parameters at O(1) scale: norm scales 1 ± 0.2, everything else N(0, 0.3²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_scale = p.ndim == 1 and name.endswith("weight")
            p.copy_(1 + 0.2 * noise if is_scale else 0.3 * noise)
    return model.eval()


def _save(model, path):
    model.save_pretrained(path)
    return str(path)


def _apply(ckpt, *args, **kwargs):
    return jax.jit(lambda p, *a: ckpt.model.apply({"params": p}, *a, **kwargs))(ckpt.params, *args)


def _close(ours, theirs, tol=TOL):
    ours, theirs = np.asarray(ours), np.asarray(theirs.detach().numpy() if hasattr(theirs, "detach") else theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    err = float(np.max(np.abs(ours - theirs)))
    assert err < tol, f"max |ours - torch| = {err}"
    return err


def _tokens(seed, b=3, t=12, v=97):
    return np.random.default_rng(seed).integers(0, v, (b, t)).astype(np.int64)


def _bert_inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 97, (3, 12)).astype(np.int64)
    types = rng.integers(0, 3, (3, 12)).astype(np.int64)
    mask = np.zeros((3, 12), np.int64)
    for row, length in enumerate((12, 7, 3)):  # padded rows of unequal length
        mask[row, :length] = 1
    return ids, types, mask


# ================================================================================== GPT-2


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "GPT2Model", "untied"])
def test_gpt2_matches_pytorch(tmp_path, arch):
    kw = dict(GPT_KW, tie_word_embeddings=arch != "untied")
    cls = transformers.GPT2Model if arch == "GPT2Model" else transformers.GPT2LMHeadModel
    theirs = _randomize(cls(transformers.GPT2Config(**kw)), seed=1)
    ckpt = convert.load_hf(_save(theirs, tmp_path))
    assert ckpt.config.activation == "gelu_tanh" and ckpt.config.norm_epsilon == 1e-5
    assert ckpt.config.tie_embeddings == (arch != "untied")
    tokens = _tokens(0)
    logits, _ = _apply(ckpt, jnp.asarray(tokens, jnp.int32))
    with torch.no_grad():
        out = theirs(torch.from_numpy(tokens))
        # GPT2Model has no LM head: compare h·wteᵀ, the logits of the tied head.
        ref = out.last_hidden_state @ theirs.wte.weight.T if arch == "GPT2Model" else out.logits
    _close(logits, ref)
    # The same checkpoint read with exact GELU is measurably different: the comparison
    # above can see the activation mapping.
    exact = ckpt.model.clone(config=dataclasses.replace(ckpt.config, activation="gelu"))
    other, _ = jax.jit(exact.apply)({"params": ckpt.params}, jnp.asarray(tokens, jnp.int32))
    assert np.max(np.abs(np.asarray(other) - ref.numpy())) > 10 * TOL


def test_gpt2_export_round_trip(tmp_path):
    """A GPT trained here (random params) -> HF dir -> transformers: the same logits."""
    cfg = gpt.GPTConfig(vocab_size=97, max_len=48, num_layers=2, d_model=32, num_heads=4)
    model = gpt.GPT(cfg)
    tokens = jnp.asarray(_tokens(1), jnp.int32)
    params = _random_params(model, tokens)
    ours, _ = jax.jit(model.apply)({"params": params}, tokens)
    out = convert.export_hf(model, params, tmp_path / "gpt")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        ref = theirs(torch.from_numpy(np.asarray(tokens, np.int64))).logits
    _close(ours, ref)
    # And back: the same numbers, bit for bit.
    again = convert.load_hf(out)
    _assert_trees_equal(again.params, params)
    # The weights are as readable as config.json (safetensors alone writes them 0600).
    mode = lambda name: os.stat(os.path.join(out, name)).st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")
    convert.export_hf(model, params, out)  # an earlier export is replaced
    # A run's workdir: its config.json was replaced, and the run no longer opened.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"task": "gpt"}')
    for folder in (run, tmp_path / "notes"):
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text('{"task": "gpt"}')
        with pytest.raises(convert.ConversionError, match=rf"export_hf: '{folder}' holds a "
                                                          rf"training run .* valid: a folder of "
                                                          rf"its own, e.g. '{folder / 'hf'}'"):
            convert.export_hf(model, params, folder)
        assert (folder / "config.json").read_text() == '{"task": "gpt"}'


TEXTS = ["def f(x):\n    return x  # café, 東京 \t\r\n", "plain words, and   spaces", "é",
         "a<eos>b<pad>"]  # a special token's name as text: as ours encode it


@pytest.mark.parametrize("kind", ["char", "byte", "bpe", "wordpiece", "file"])
def test_export_with_a_tokenizer_encodes_as_ours_in_transformers(tmp_path, kind, capsys):
    """export_hf(..., tokenizer=) writes a tokenizer AutoTokenizer loads with the same ids
    for every text, the same decoding, and the special tokens in their roles."""
    from attention_jax import data
    corpus = TEXTS * 3 + ["the quick brown fox jumps over the lazy dog " * 4]
    if kind == "file":
        bpe = data.get_tokenizer("bpe", texts=corpus, vocab_size=300)
        bpe.hf.save(str(tmp_path / "own.json"))
        ours = data.get_tokenizer("file", path=str(tmp_path / "own.json"))
    else:
        ours = data.get_tokenizer(kind, texts=corpus, vocab_size=300)
    cfg = gpt.GPTConfig(vocab_size=ours.vocab_size, max_len=48, num_layers=1, d_model=16,
                        num_heads=2)
    model = gpt.GPT(cfg)
    params = _random_params(model, jnp.zeros((1, 8), jnp.int32))
    out = convert.export_hf(model, params, tmp_path / "hf", tokenizer=ours)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.model_max_length == 48
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text), (kind, text)
        if kind != "wordpiece":  # BERT's decoding normalises case and spaces either way
            assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
            if kind in ("char", "byte") or "<" not in text:  # BPE reads "<eos>" as the token
                assert ours.decode(ids) == text
    for role, i in ours.hf_roles().items():
        assert theirs.convert_tokens_to_ids(getattr(theirs, f"{role}_token")) == i
    assert getattr(ours, "eos_id", None) in (None, theirs.eos_token_id)
    # transformers' generate reads the ids from config.json: the run's, not None.
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for role in ("bos", "eos", "pad"):
        assert hf_config.get(f"{role}_token_id") == ours.hf_roles().get(role)
    with pytest.raises(ValueError, match=r"export_hf: tokenizer= a str, which has no Hugging "
                                         r"Face form; valid: one of attention_jax.data's"):
        convert.export_hf(model, params, tmp_path / "hf2", tokenizer="tokenizer.json")
    assert not (tmp_path / "hf2").exists()
    if kind == "bpe":  # another run's tokenizer, of more tokens than the table's rows
        small = gpt.GPT(dataclasses.replace(cfg, vocab_size=ours.vocab_size - 8))
        with pytest.raises(ValueError, match=rf"export_hf: tokenizer= has {ours.vocab_size} "
                                             rf"tokens, more than the model's "
                                             rf"{ours.vocab_size - 8} embedding rows"):
            convert.export_hf(small, _random_params(small, jnp.zeros((1, 8), jnp.int32)),
                              tmp_path / "hf3", tokenizer=ours)
        assert not (tmp_path / "hf3").exists()
    # Exported again without one: the earlier tokenizer files would pass for this model's.
    capsys.readouterr()
    convert.export_hf(model, params, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert ("note: export_hf: tokenizer.json, tokenizer_config.json of an earlier export "
            "removed") in capsys.readouterr().err


def test_transformers_generate_never_picks_the_padded_vocabulary(tmp_path):
    """A run pads its model's vocabulary past its tokenizer's (to a multiple of 64): the
    export's generation_config.json suppresses those ids, which transformers' generate
    picked and its tokenizer decoded to nothing, in silence."""
    from attention_jax import data
    from attention_jax.tasks.base import padded_vocab
    ours = data.get_tokenizer("byte")
    vocab = padded_vocab(ours.vocab_size)
    assert vocab > ours.vocab_size
    model = gpt.GPT(gpt.GPTConfig(vocab_size=vocab, max_len=32, num_layers=1, d_model=16,
                                  num_heads=2))
    params = _random_params(model, jnp.zeros((1, 8), jnp.int32))
    out = convert.export_hf(model, params, tmp_path / "hf", tokenizer=ours)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(ours.vocab_size, vocab))
    assert generation["eos_token_id"] == ours.hf_roles()["eos"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([ours.encode("def f")])
    # Near-uniform draws of 24 tokens: without the suppression, 61 of the 320 ids are
    # padding, and some draw is one with probability 1 - (259/320)^24 > 0.99.
    torch.manual_seed(0)
    new = hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=True,
                      temperature=100.0, top_k=0)[0, 5:]
    assert len(new) == 24 and int(new.max()) < ours.vocab_size, new
    # Exported again without the tokenizer: no generation config of the earlier export.
    convert.export_hf(model, params, tmp_path / "hf")
    assert not (tmp_path / "hf" / "generation_config.json").exists()


def test_a_path_under_home_is_expanded(tmp_path, monkeypatch):
    """'~/...' was a folder named '~' for export_hf, and 'not a directory' for load_hf."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = gpt.GPTConfig(vocab_size=97, max_len=16, num_layers=1, d_model=16, num_heads=2)
    model = gpt.GPT(cfg)
    params = _random_params(model, jnp.zeros((1, 4), jnp.int32))
    out = convert.export_hf(model, params, "~/exported")
    assert out == str(tmp_path / "exported") and (tmp_path / "exported" / "config.json").exists()
    _assert_trees_equal(convert.load_hf("~/exported").params, params)


def test_gpt_export_rejects_options_gpt2_lacks(tmp_path):
    cfg = gpt.GPTConfig.from_variant("gpt-tiny-rope")
    with pytest.raises(ValueError, match="GPTConfig.position='rope'"):
        convert.export_hf(gpt.GPT(cfg), {}, tmp_path / "x")  # refused before params are read


def test_an_export_onto_a_file_is_one_line(tmp_path):
    model = gpt.GPT(gpt.GPTConfig(vocab_size=64, num_layers=1, num_heads=2, d_model=16, max_len=16))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(convert.ConversionError, match=r"export_hf: '.*a_file' is a file; valid: "
                                                      r"a folder"):
        convert.export_hf(model, params, tmp_path / "a_file")


# =================================================================================== BERT

BERT_ARCHS = ["BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification"]


@pytest.mark.parametrize("arch", BERT_ARCHS)
def test_bert_matches_pytorch_with_padding(tmp_path, arch):
    theirs = _randomize(getattr(transformers, arch)(transformers.BertConfig(**BERT_KW, num_labels=3)),
                        seed=2)
    ckpt = convert.load_hf(_save(theirs, tmp_path))
    assert ckpt.config.activation == "gelu" and ckpt.config.norm_epsilon == 1e-12
    ids, types, mask = _bert_inputs()
    out, aux = _apply(ckpt, jnp.asarray(ids, jnp.int32), jnp.asarray(types, jnp.int32),
                      jnp.asarray(mask, bool))
    with torch.no_grad():
        ref = theirs(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                     attention_mask=torch.from_numpy(mask), output_hidden_states=True)
    # Padded positions too: their queries attend to the real keys on both sides.
    _close(aux["hidden_states"], ref.hidden_states[-1])
    if arch == "BertModel":
        _close(out, ref.last_hidden_state)
        _close(aux["pooled"], ref.pooler_output)
    elif arch == "BertForMaskedLM":
        _close(out["mlm_logits"], ref.logits)
        assert sorted(ckpt.synthesized) == ["nsp/bias", "nsp/kernel", "pooler/bias", "pooler/kernel"]
    elif arch == "BertForPreTraining":
        _close(out["mlm_logits"], ref.prediction_logits)
        _close(out["nsp_logits"], ref.seq_relationship_logits)
    else:
        assert ckpt.config.num_labels == 3
        _close(out, ref.logits)


@pytest.mark.parametrize("head", ["pretraining", "classification"])
def test_bert_export_round_trip(tmp_path, head):
    cfg = bert.BertConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                          max_len=48, type_vocab_size=2, num_labels=3)
    model = bert.Bert(cfg, head=head)
    ids, types, mask = _bert_inputs(1)
    types = types % 2
    args = (jnp.asarray(ids, jnp.int32), jnp.asarray(types, jnp.int32), jnp.asarray(mask, bool))
    params = _random_params(model, *args)
    ours, _ = jax.jit(model.apply)({"params": params}, *args)
    out = convert.export_hf(model, params, tmp_path / head)
    with open(os.path.join(out, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    theirs = getattr(transformers, arch).from_pretrained(out).eval()
    with torch.no_grad():
        ref = theirs(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                     attention_mask=torch.from_numpy(mask))
    if head == "pretraining":
        assert arch == "BertForPreTraining"
        _close(ours["mlm_logits"], ref.prediction_logits)
        _close(ours["nsp_logits"], ref.seq_relationship_logits)
    else:
        assert arch == "BertForSequenceClassification"
        _close(ours, ref.logits)
    _assert_trees_equal(convert.load_hf(out).params, params)


def test_a_bert_exported_with_its_tokenizer_has_the_tokenizer_s_vocabulary(tmp_path):
    """A run pads its vocabulary past the tokenizer's (to a multiple of 64): exported as
    such, fill-mask ranked ids that decode to nothing. With tokenizer= the export keeps
    the tokenizer's rows only, and its logits are ours over those ids."""
    from attention_jax import data
    from attention_jax.tasks.base import padded_vocab
    corpus = ["the quick brown fox jumps over the lazy dog", "a cat sat on the mat"] * 4
    tok = data.get_tokenizer("char", texts=corpus)
    vocab = padded_vocab(tok.vocab_size)
    assert vocab > tok.vocab_size
    # The width, the MLP and the position table as large as the padded vocabulary: only
    # the vocabulary's own rows may be cut.
    cfg = bert.BertConfig(vocab_size=vocab, d_model=vocab, num_layers=1, num_heads=4,
                          mlp_dim=vocab, max_len=vocab, type_vocab_size=2)
    model = bert.Bert(cfg, head="pretraining")
    ids = np.asarray([tok.encode("the cat sat on the mat")], np.int32)
    types, mask = np.zeros_like(ids), np.ones_like(ids, bool)
    args = (jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
    params = _random_params(model, *args)
    ours, _ = jax.jit(model.apply)({"params": params}, *args)
    out = convert.export_hf(model, params, tmp_path / "bert", tokenizer=tok)
    assert json.loads((tmp_path / "bert" / "config.json").read_text())["vocab_size"] == tok.vocab_size
    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    with torch.no_grad():
        ref = theirs(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                     attention_mask=torch.from_numpy(mask))
    assert ref.prediction_logits.shape[-1] == tok.vocab_size
    _close(ours["mlm_logits"][..., :tok.vocab_size], ref.prediction_logits)
    back = convert.load_hf(out)  # and back: the real rows as they were
    np.testing.assert_array_equal(
        np.asarray(back.params["word_embeddings"]["embedding"])[:tok.vocab_size],
        np.asarray(params["word_embeddings"]["embedding"])[:tok.vocab_size])


# ==================================================================================== ViT


@pytest.mark.parametrize("arch", ["ViTModel", "ViTForImageClassification"])
def test_vit_matches_pytorch(tmp_path, arch):
    theirs = _randomize(getattr(transformers, arch)(transformers.ViTConfig(**VIT_KW, num_labels=5)),
                        seed=3)
    if arch == "ViTModel":
        with pytest.warns(UserWarning, match="pooler.dense.weight"):  # reported, not loaded
            ckpt = convert.load_hf(_save(theirs, tmp_path))
        assert ckpt.unused == ["pooler.dense.weight", "pooler.dense.bias"]
    else:
        ckpt = convert.load_hf(_save(theirs, tmp_path))
    images = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    logits, aux = _apply(ckpt, jnp.asarray(images.transpose(0, 2, 3, 1)))  # NCHW -> NHWC
    with torch.no_grad():
        ref = theirs(pixel_values=torch.from_numpy(images), output_hidden_states=True)
    if arch == "ViTModel":
        _close(aux["hidden_states"], ref.last_hidden_state)
    else:
        _close(aux["hidden_states"][:, 0], theirs.vit.layernorm(ref.hidden_states[-1])[:, 0])
        _close(logits, ref.logits)


def _vit_ours(**kw):
    cfg = vit.ViTConfig(**{**dict(image_size=16, patch_size=4, num_channels=3, d_model=32,
                                  num_layers=2, num_heads=4, mlp_dim=48, num_classes=5,
                                  norm_epsilon=1e-12), **kw})
    return vit.ViT(cfg)


def test_vit_export_round_trip(tmp_path):
    """A ViT trained here (random params) -> HF dir -> transformers' ViTForImageClassification:
    the same logits and final [CLS] state; and ViTModel (no head): the same token states."""
    model = _vit_ours()
    images = np.random.default_rng(1).standard_normal((2, 16, 16, 3)).astype(np.float32)
    params = _random_params(model, jnp.asarray(images))
    logits, aux = jax.jit(model.apply)({"params": params}, jnp.asarray(images))
    out = convert.export_hf(model, params, tmp_path / "vit")  # no architecture=: the classifier
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["ViTForImageClassification"]
    theirs = transformers.ViTForImageClassification.from_pretrained(out).eval()
    pixels = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())  # NHWC -> NCHW
    with torch.no_grad():
        ref = theirs(pixel_values=pixels, output_hidden_states=True)
        ref_cls = theirs.vit.layernorm(ref.hidden_states[-1])[:, 0]
    _close(logits, ref.logits)
    _close(aux["pooled"], ref_cls)
    _assert_trees_equal(convert.load_hf(out).params, params)

    body = {k: v for k, v in params.items() if k != "head"}
    out = convert.export_hf(model, body, tmp_path / "vit_body", architecture="ViTModel")
    encoder = transformers.ViTModel.from_pretrained(out, add_pooling_layer=False).eval()
    with torch.no_grad():
        _close(aux["hidden_states"], encoder(pixel_values=pixels).last_hidden_state)


@pytest.mark.parametrize("channels", [3, 1])
def test_an_exported_vit_reads_images_as_the_run_did(tmp_path, channels, capsys):
    """image_preprocess= (a run's eval_transform) goes out as preprocessor_config.json:
    transformers' image-classification pipeline reads an image of any shape into the same
    pixels as the run (so the same probabilities as --mode=classify), grey for a grey
    model: the shorter side resized, the centre cut, with the same roundings."""
    from PIL import Image

    from attention_jax.data import images as images_lib
    model = _vit_ours(num_channels=channels)
    params = _random_params(model, jnp.zeros((1, 16, 16, channels)))
    mean = (0.485, 0.456, 0.406)[:channels] if channels == 3 else (0.4,)
    prep = images_lib.Preprocess(image_size=16, channels=channels, mean=mean, std=(0.25,))
    out = convert.export_hf(model, params, tmp_path / "vit", image_preprocess=prep,
                            class_names=["a", "b", "c", "d", "e"])
    assert "no image_preprocess" not in capsys.readouterr().err
    rng = np.random.default_rng(0)
    mode = "RGB" if channels == 3 else "L"
    for h, w in ((24, 24), (24, 40), (37, 23)):  # (37 - 23) * 16 / 23: an odd margin
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pixels = images_lib.resize_box(pixels, (0, 0, w, h), 4)  # smooth: as a photo is
        image = Image.fromarray(pixels).resize((w, h), Image.BILINEAR).convert(mode)
        image.save(tmp_path / "x.png")
        ours = prep({"image": images_lib.decode(str(tmp_path / "x.png"), channels),
                     "label": 0}, np.random.default_rng(0))["image"]
        processor = transformers.AutoImageProcessor.from_pretrained(out)
        theirs = processor(image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        np.testing.assert_allclose(theirs, ours, atol=1e-5)
    wide = Image.fromarray(rng.integers(0, 256, (24, 33, 3), dtype=np.uint8)).convert(mode)
    ours = jax.nn.softmax(model.apply({"params": params}, prep(
        {"image": np.asarray(wide).reshape(24, 33, channels), "label": 0},
        np.random.default_rng(0))["image"][None])[0][0])
    theirs = transformers.AutoModelForImageClassification.from_pretrained(out).eval()
    with torch.no_grad():
        logits = theirs(**processor(wide, return_tensors="pt")).logits
    np.testing.assert_allclose(torch.softmax(logits, -1)[0].numpy(), np.asarray(ours), atol=1e-5)
    if channels == 3:  # the pipeline converts every image to RGB: a grey model's cannot run
        classify = transformers.pipeline("image-classification", model=out, top_k=5)
        got = {r["label"]: r["score"] for r in classify(wide)}
        np.testing.assert_allclose([got[c] for c in "abcde"], np.asarray(ours), atol=1e-4)


def test_an_image_processor_is_the_model_s_or_none(tmp_path, capsys):
    """A ViT exported without image_preprocess says what pipelines then lack, and an
    earlier export's preprocessor_config.json goes (it would pass for this model's); one
    of another size, or given for a text model, is refused."""
    from attention_jax.data import images as images_lib
    model = _vit_ours()
    params = _random_params(model, jnp.zeros((1, 16, 16, 3)))
    prep = images_lib.Preprocess(image_size=16)
    convert.export_hf(model, params, tmp_path / "vit", image_preprocess=prep)
    assert (tmp_path / "vit" / "preprocessor_config.json").exists()
    capsys.readouterr()
    convert.export_hf(model, params, tmp_path / "vit")
    assert not (tmp_path / "vit" / "preprocessor_config.json").exists()
    assert "note: export_hf: no image_preprocess" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"image_preprocess makes 32² images of 3 channel\(s\), "
                                         r"the model reads 16² of 3"):
        convert.export_hf(model, params, tmp_path / "vit", image_preprocess=images_lib.Preprocess(
            image_size=32))
    gpt_model = gpt.GPT(gpt.GPTConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                      mlp_dim=64, max_len=16))
    with pytest.raises(ValueError, match=r"image_preprocess= given for a GPTConfig, which reads "
                                         r"no images; valid: image_preprocess=None"):
        convert.export_hf(gpt_model, {}, tmp_path / "gpt", image_preprocess=prep)


def test_vit_export_errors_name_the_argument(tmp_path):
    model = _vit_ours()
    with pytest.raises(ValueError, match=r"^export_hf: architecture='ViTMAEModel' cannot export a "
                                         r"ViTConfig model; valid: \['ViTModel', "
                                         r"'ViTForImageClassification'\]$"):
        convert.export_hf(model, {}, tmp_path / "x", architecture="ViTMAEModel")
    params = _random_params(model, jnp.zeros((1, 16, 16, 3)))
    with pytest.raises(ValueError, match=r"architecture='ViTModel' has no place for the params' "
                                         r"head \['head/bias', 'head/kernel'\]"):
        convert.export_hf(model, params, tmp_path / "x", architecture="ViTModel")
    with pytest.raises(ValueError, match=r"ViTConfig.pool='gap' has no transformers ViT "
                                         r"equivalent; valid: 'cls'"):
        convert.export_hf(_vit_ours(pool="gap"), {}, tmp_path / "x")
    assert not os.path.exists(tmp_path / "x")  # refused before anything is written


def test_class_names_become_the_exported_labels(tmp_path):
    """A run's classes went out as LABEL_0, LABEL_1, ... (classes.json left behind): with
    class_names= transformers' config, and so its pipelines, name them."""
    model = _vit_ours()
    params = _random_params(model, jnp.zeros((1, 16, 16, 3)))
    n = model.config.num_classes
    names = [f"class {i}" for i in range(n)]
    out = convert.export_hf(model, params, tmp_path / "vit", class_names=names)
    theirs = transformers.AutoConfig.from_pretrained(out)
    assert [theirs.id2label[i] for i in range(n)] == names
    assert theirs.label2id == {name: i for i, name in enumerate(names)}
    for bad in (names[:-1], [names[0]] * n):
        with pytest.raises(ValueError, match=rf"^export_hf: class_names has {len(bad)} names "
                                             rf"\({len(set(bad))} distinct\); valid: {n} "
                                             rf"distinct names"):
            convert.export_hf(model, params, tmp_path / "x", class_names=bad)
    body = {k: v for k, v in params.items() if k != "head"}
    with pytest.raises(ValueError, match=r"class_names given for ViTModel, which has no "
                                         r"classifier head"):
        convert.export_hf(model, body, tmp_path / "x", architecture="ViTModel", class_names=names)
    assert not os.path.exists(tmp_path / "x")


# ====================================================== attention backends on loaded models


def test_blockwise_equals_reference_on_loaded_models(tmp_path, monkeypatch):
    """Tiles of 8 so that 20 tokens span several (ragged) blocks; padding and causality."""
    monkeypatch.setattr(attention_lib, "default_block_sizes", lambda *args, **kwargs: (8, 8))
    g = _save(_randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT_KW)), 4),
              tmp_path / "gpt")
    b = _save(_randomize(transformers.BertModel(transformers.BertConfig(**BERT_KW)), 5),
              tmp_path / "bert")
    tokens = jnp.asarray(_tokens(2, t=20), jnp.int32)
    mask = jnp.arange(20)[None] < jnp.array([[20], [13], [5]])
    outs = {}
    for impl in ("reference", "blockwise"):
        outs[impl, "gpt"] = _apply(convert.load_hf(g, implementation=impl), tokens)[0]
        outs[impl, "bert"] = _apply(convert.load_hf(b, implementation=impl), tokens,
                                    jnp.zeros_like(tokens), mask)[0]
    for family in ("gpt", "bert"):
        np.testing.assert_allclose(outs["blockwise", family], outs["reference", family],
                                   atol=2e-5, rtol=0)


# ================================================================================= errors


def _bert_dir(tmp_path, arch="BertModel", **kw):
    model = getattr(transformers, arch)(transformers.BertConfig(**{**BERT_KW, **kw}))
    return _save(model, tmp_path / arch)


def _edit_tensors(path, edit):
    from safetensors.numpy import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_extra_and_misshaped_tensors_are_named(tmp_path):
    path = _bert_dir(tmp_path)

    def edit(t):
        del t["encoder.layer.1.attention.self.key.weight"]
        t["encoder.layer.0.intermediate.dense.weight"] = np.zeros((40, 32), np.float32)
        t["encoder.layer.7.output.dense.weight"] = np.zeros((2, 2), np.float32)
        t["embeddings.position_ids"] = np.arange(48)[None]  # a buffer: not an error
    _edit_tensors(path, edit)
    with pytest.raises(convert.ConversionError) as e:
        convert.load_hf(path)
    msg = str(e.value)
    assert "missing: encoder.layer.1.attention.self.key.weight (32, 32)" in msg
    assert "unexpected: encoder.layer.7.output.dense.weight (2, 2)" in msg
    assert ("shape mismatch: encoder.layer.0.intermediate.dense.weight: checkpoint (40, 32), "
            "expected (48, 32)") in msg
    assert "unexpected: encoder.layer.0.intermediate" not in msg  # said once, as a mismatch
    assert "position_ids" not in msg


def test_prefixed_names_are_quoted_as_in_the_file(tmp_path):
    path = _bert_dir(tmp_path, "BertForSequenceClassification")
    _edit_tensors(path, lambda t: t.pop("bert.pooler.dense.bias"))
    with pytest.raises(convert.ConversionError, match=r"missing: pooler.dense.bias"):
        convert.load_hf(path)
    _edit_tensors(path, lambda t: t.update({"bert.pooler.dense.bias": np.zeros(32, np.float32),
                                            "classifier.extra": np.zeros(3, np.float32)}))
    with pytest.raises(convert.ConversionError, match=r"unexpected: classifier.extra \(3,\)"):
        convert.load_hf(path)


def test_a_loaded_masked_lm_exports_as_one(tmp_path, capsys):
    """load_hf of a BertForMaskedLM fills our pooler and NSP head with zeros; exporting it
    wrote BertForPreTraining with those zero heads. It exports as BertForMaskedLM now (a
    note says so; transformers loads it with no weight left out or newly made), and
    architecture= still picks BertForPreTraining."""
    theirs = _randomize(transformers.BertForMaskedLM(transformers.BertConfig(**BERT_KW)), 5)
    ckpt = convert.load_hf(_save(theirs, tmp_path / "mlm"))
    out = convert.export_hf(ckpt.model, ckpt.params, tmp_path / "again")
    assert "exported as BertForMaskedLM without them" in capsys.readouterr().err
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["BertForMaskedLM"]
    again, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ids, types, mask = _bert_inputs()
    inputs = dict(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                  attention_mask=torch.from_numpy(mask))
    with torch.no_grad():
        _close(again.eval()(**inputs).logits.numpy(), theirs.eval()(**inputs).logits)
    out = convert.export_hf(ckpt.model, ckpt.params, tmp_path / "pretraining",
                            architecture="BertForPreTraining")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["BertForPreTraining"]
    assert "note" not in capsys.readouterr().err
    # A masked-LM run warm-started from a BertModel (MiniLM): a pooler of its own, the NSP
    # head still zero. It went out as BertForPreTraining with a zero NSP head, unsaid.
    warm = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 if "pooler" in jax.tree_util.keystr(path) else x, ckpt.params)
    out = convert.export_hf(ckpt.model, warm, tmp_path / "warm")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["BertForPreTraining"]
    assert ("note: export_hf: the NSP head is all zero (untrained) but the pooler is not"
            in capsys.readouterr().err)


def test_untied_mlm_decoder_is_an_error(tmp_path):
    path = _bert_dir(tmp_path, "BertForMaskedLM")
    _edit_tensors(path, lambda t: t.update(
        {"cls.predictions.decoder.weight": np.ones((97, 32), np.float32)}))
    # (it was listed as a "shape mismatch", the shapes equal, and said untied heads were
    # unsupported, where GPT-2's are)
    with pytest.raises(convert.ConversionError, match=r"not tied: cls\.predictions\.decoder\."
                                                      r"weight differs from .*word_embeddings.*"
                                                      r"\(untied ones are not supported\)"):
        convert.load_hf(path)


@pytest.mark.parametrize("key,value,match", [
    ("position_embedding_type", "relative_key", "position_embedding_type='relative_key'"),
    ("hidden_act", "mish", "hidden_act='mish'"),
    ("is_decoder", True, "is_decoder=True"),
    ("model_type", "roberta", "model_type='roberta'"),
    ("architectures", ["BertForTokenClassification"], "BertForTokenClassification"),
])
def test_unsupported_options_are_named(tmp_path, key, value, match):
    path = _bert_dir(tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        convert.load_hf(path)


def test_no_weights_file_is_named(tmp_path):
    path = _bert_dir(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        convert.load_hf(path)


def test_pytorch_bin_and_bf16_safetensors(tmp_path):
    model = _randomize(transformers.BertModel(transformers.BertConfig(**BERT_KW)), 6)
    ref = convert.load_hf(_save(model, tmp_path / "st")).params
    os.makedirs(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with open(tmp_path / "bin" / "config.json", "w") as f:
        f.write(model.config.to_json_string())
    _assert_trees_equal(convert.load_hf(tmp_path / "bin").params, ref)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    low = convert.load_hf(tmp_path / "bf16").params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=0.02, rtol=0.01), low, ref)


# ============================================================================ warm start


def test_init_params_from_hf_pads_vocab_and_adds_a_head(tmp_path):
    """Fine-tuning a BertForMaskedLM checkpoint as a classifier with our padded vocab."""
    theirs = _randomize(transformers.BertForMaskedLM(transformers.BertConfig(**BERT_KW)), 7)
    path = _save(theirs, tmp_path)
    implied = convert.config_from_hf(path)[0]
    cfg = dataclasses.replace(implied, vocab_size=128, num_labels=4, scan_layers=True)
    model = bert.Bert(cfg, head="classification")
    params = convert.init_params_from_hf(path, model, verbose=False)
    emb = params["word_embeddings"]["embedding"]
    np.testing.assert_array_equal(emb[:97], theirs.bert.embeddings.word_embeddings.weight.detach().numpy())
    np.testing.assert_array_equal(emb[97:], 0)
    assert params["encoder"]["layers"]["mlp"]["wi"]["kernel"].shape == (2, 32, 48)
    assert params["classifier"]["kernel"].shape == (32, 4)
    assert 0.01 < np.std(params["pooler"]["kernel"]) < 0.03  # new head: N(0, 0.02²), not zeros
    np.testing.assert_array_equal(params["classifier"]["bias"], 0)
    ids, types, mask = _bert_inputs()
    _, aux = jax.jit(model.apply)({"params": params}, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(types, jnp.int32), jnp.asarray(mask, bool))
    with torch.no_grad():
        ref = theirs.bert(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types),
                          attention_mask=torch.from_numpy(mask))
    _close(aux["hidden_states"], ref.last_hidden_state)  # the body is the checkpoint's


def test_init_params_from_hf_names_architecture_differences(tmp_path):
    path = _save(transformers.BertModel(transformers.BertConfig(**BERT_KW)), tmp_path)
    cfg = dataclasses.replace(convert.config_from_hf(path)[0], num_layers=3, activation="gelu_tanh")
    with pytest.raises(ValueError, match=r"num_layers=3 \(checkpoint: 2\).*activation='gelu_tanh'"):
        convert.init_params_from_hf(path, bert.Bert(cfg))


def test_restore_params_from_hf_onto_abstract_params(tmp_path):
    """The CLI path (train.warm_start_params with init_from=hf:<dir>): only shapes known;
    a ViT fine-tuned at another resolution with another number of classes."""
    theirs = _randomize(transformers.ViTForImageClassification(
        transformers.ViTConfig(**VIT_KW, num_labels=5)), 8)
    path = _save(theirs, tmp_path)
    cfg = dataclasses.replace(convert.config_from_hf(path)[0], image_size=24, num_classes=10)
    abstract = _abstract_params(vit.ViT(cfg), jnp.zeros((1, 24, 24, 3)))
    params, step = convert.restore_params_from_hf(path, abstract)
    assert step == 0
    assert params["position_embeddings"].shape == (1 + 36, 32)  # 4x4 grid resized to 6x6
    assert params["head"]["kernel"].shape == (32, 10)
    np.testing.assert_array_equal(params["head"]["bias"], 0)
    np.testing.assert_array_equal(params["cls"], theirs.vit.embeddings.cls_token.detach().numpy()[0])
    deeper = _abstract_params(vit.ViT(dataclasses.replace(cfg, num_layers=3)),
                              jnp.zeros((1, 24, 24, 3)))
    with pytest.raises(convert.ConversionError, match="missing: encoder/layer_2/mlp/wi/bias"):
        convert.restore_params_from_hf(path, deeper)


def test_a_warm_start_with_another_tokenizer_s_vocabulary_is_refused(tmp_path):
    """A bert-base-cased-like checkpoint (its own 28,996 tokens) warm-started a run on the
    bundled uncased vocabulary (30,522) unsaid: each row stood for another token."""
    path = _save(transformers.BertModel(transformers.BertConfig(**BERT_KW)), tmp_path)
    cfg = dataclasses.replace(convert.config_from_hf(path)[0], vocab_size=192)
    abstract = _abstract_params(bert.Bert(cfg), jnp.ones((1, 8), jnp.int32))
    theirs = BERT_KW["vocab_size"]  # 97
    # Fits: its rows past the tokenizer are padding (our own export of a padded table),
    # or the tokenizer adds a few tokens (new rows).
    for tokenizer in (theirs - 40, theirs, theirs + 3):
        params, _ = convert.restore_params_from_hf(path, abstract, model_config=cfg,
                                                   vocab_size=tokenizer)
        assert max(p.shape[0] for p in jax.tree.leaves(params) if p.ndim == 2) == 192  # the table
    with pytest.raises(convert.ConversionError, match=rf"its vocabulary holds {theirs} tokens "
                                                      rf".* the run's tokenizer 162 in a table "
                                                      rf"of 192 rows: its embedding rows"):
        convert.restore_params_from_hf(path, abstract, model_config=cfg, vocab_size=162)
    small = dataclasses.replace(cfg, vocab_size=64)  # a table the checkpoint cannot fit
    with pytest.raises(convert.ConversionError, match=r"the run's tokenizer 60 in a table of 64"):
        convert.restore_params_from_hf(
            path, _abstract_params(bert.Bert(small), jnp.ones((1, 8), jnp.int32)),
            model_config=small, vocab_size=60)


def test_a_warm_start_of_other_sizes_is_one_line_naming_the_fields(tmp_path):
    """The CLI's error listed every mismatching tensor: about 45 lines."""
    path = _save(transformers.BertModel(transformers.BertConfig(**BERT_KW)), tmp_path)
    cfg = dataclasses.replace(convert.config_from_hf(path)[0], d_model=16, num_layers=3,
                              mlp_dim=40)
    abstract = _abstract_params(bert.Bert(cfg), jnp.ones((1, 8), jnp.int32))
    with pytest.raises(convert.ConversionError) as e:
        convert.restore_params_from_hf(path, abstract, model_config=cfg)
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("config.model does not match the checkpoint's architecture: "
                                 "d_model=16 (checkpoint: 32), num_layers=3 (checkpoint: 2), "
                                 "mlp_dim=40 (checkpoint: 48); valid: the checkpoint's values "
                                 "(--config.model.KEY=...)")


def test_a_warm_start_across_a_tied_and_an_untied_head_is_refused(tmp_path):
    """An untied GPT-2 into a tied config dropped its trained lm_head, and a tied one
    into an untied config started the head at random, both as 'heads' (the shapes fit
    either way); a GPT2Model, which has no head, may get a new one."""
    for tied, arch in ((False, "lm"), (True, "lm"), (True, "base")):
        cls = transformers.GPT2LMHeadModel if arch == "lm" else transformers.GPT2Model
        path = _save(cls(transformers.GPT2Config(**GPT_KW, tie_word_embeddings=tied)),
                     tmp_path / f"{tied}{arch}")
        ours = dataclasses.replace(convert.config_from_hf(path)[0], tie_embeddings=not tied)
        abstract = _abstract_params(gpt.GPT(ours), jnp.ones((1, 8), jnp.int32))
        if arch == "base":  # untied, its head new
            params, _ = convert.restore_params_from_hf(path, abstract, model_config=ours)
            assert "lm_head" in params
            continue
        with pytest.raises(convert.ConversionError, match=rf"config\.model\.tie_embeddings="
                                                          rf"{not tied} \(its config\.json: "
                                                          rf"{tied}\), which its weights cannot "
                                                          rf"show"):
            convert.restore_params_from_hf(path, abstract, model_config=ours)


def test_a_damaged_model_dir_is_named_with_its_file(tmp_path):
    """A corrupt config.json (a bare JSONDecodeError), a truncated model.safetensors
    (safetensors' "invalid header length", no file named), a shard its index names that
    is missing (a raw FileNotFoundError), and a config.json without its sizes
    (KeyError: 'n_embd'; transformers takes its defaults)."""
    import json
    import shutil
    good = _save(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT_KW)), tmp_path / "g")

    def one_shard_gone(d):
        (d / "model.safetensors").rename(d / "part.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"wte.weight": "part.safetensors", "wpe.weight": "gone.safetensors"}}))
    for name, damage, message in (
            ("config", lambda d: (d / "config.json").write_text("{x"),
             r"config\.json: not JSON \(.*\); valid: a Hugging Face model's config\.json"),
            ("weights", lambda d: (d / "model.safetensors").write_bytes(b"\x01" * 12),
             r"model\.safetensors: unreadable weights \(SafetensorError: .*\); valid: the "
             r"file as save_pretrained wrote it"),
            ("shard", one_shard_gone,
             r"gone\.safetensors: a weights file its index names is not there")):
        broken = tmp_path / name
        shutil.copytree(good, broken)
        damage(broken)
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            convert.load_hf(str(broken))
    sizes = tmp_path / "sizes"
    shutil.copytree(good, sizes)
    cfg = json.loads((sizes / "config.json").read_text())
    del cfg["n_embd"]  # transformers: 768
    (sizes / "config.json").write_text(json.dumps(cfg))
    assert convert.config_from_hf(str(sizes))[0].d_model == 768


# ================================================================================ helpers


def _abstract_params(model, *inputs):
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *inputs))["params"]
    return nn.meta.unbox(boxed)


def _random_params(model, *inputs, seed=0):
    """Params of a model trained here, stand-in: O(1) random values of the model's shapes
    (our init leaves norms at 1/0 and biases at 0, which would hide swapped tensors).
    Drawn with numpy from the abstract shapes: compiling model.init costs seconds."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(_abstract_params(model, *inputs))
    return jax.tree.unflatten(treedef, [rng.normal(1.0 if x.ndim == 1 else 0.0, 0.2, x.shape)
                                        .astype(np.float32) for x in leaves])


def _assert_trees_equal(a, b):
    fa, fb = hf_lib.flatten(a), hf_lib.flatten(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


def test_warm_start_hf_prefix_onto_a_mesh(tmp_path):
    """The trainer's hook: train.warm_start_params('hf:<dir>') places params on the
    run's shardings (8 fake devices; the padded vocabulary split over them)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from attention_jax import train
    theirs = _randomize(transformers.BertForMaskedLM(transformers.BertConfig(**BERT_KW)), 9)
    path = _save(theirs, tmp_path)
    cfg = dataclasses.replace(convert.config_from_hf(path)[0], vocab_size=104)
    abstract = _abstract_params(bert.Bert(cfg), jnp.zeros((1, 4), jnp.int32))
    mesh = jax.make_mesh((8,), ("data",))
    spec = lambda x: P("data") if x.shape[0] == 104 else P()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=NamedSharding(mesh, spec(x))),
                            abstract)
    params = train.warm_start_params(f"hf:{path}", abstract, cfg)
    emb = params["word_embeddings"]["embedding"]
    assert emb.sharding.spec == P("data") and len(emb.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(emb)[:97],
                                  theirs.bert.embeddings.word_embeddings.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(params["mlm_bias"])[:97],
                                  theirs.cls.predictions.bias.detach().numpy())
    # What the weights cannot show is compared with the run's model config: the note
    # said "config.model must set the same (check)", leaving the user to check.
    from attention_jax.errors import ConfigError
    other = dataclasses.replace(cfg, norm_epsilon=1e-5)
    with pytest.raises(ConfigError, match=rf"config.model.norm_epsilon=1e-05 \(its config.json: "
                                          rf"{cfg.norm_epsilon!r}\), which its weights cannot "
                                          rf"show; valid: the checkpoint's values"):
        train.warm_start_params(f"hf:{path}", abstract, other)


def test_keys_a_config_json_lacks_take_the_transformers_defaults():
    """A GPT-2 config.json without resid_pdrop fine-tuned without dropout here, with 0.1
    in transformers (its GPT2Config default, which the mapping says it follows)."""
    from attention_jax.convert.hf_gpt2 import GPT2Family
    ours = GPT2Family().config({"model_type": "gpt2"}, "GPT2LMHeadModel")
    theirs = transformers.GPT2Config()
    assert (ours.dropout_rate, ours.vocab_size, ours.max_len, ours.num_layers, ours.d_model,
            ours.num_heads, ours.norm_epsilon) == (
        theirs.resid_pdrop, theirs.vocab_size, theirs.n_positions, theirs.n_layer,
        theirs.n_embd, theirs.n_head, theirs.layer_norm_epsilon)
