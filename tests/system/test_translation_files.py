"""Sentence pairs from the user's own files: the translation tasks (encdec, rnn_seq2seq)
with data.name="files", their records' keys naming the two languages."""

import json
import re

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attention_jax import config as config_lib
from attention_jax import main, runs, tasks, train
from attention_jax.data import files
from attention_jax.errors import ConfigError

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
MOTS = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf"]


def _pairs(n: int, offset: int = 0):
    return [{"en": f"{WORDS[i % 10]} {WORDS[(i // 10) % 10]}",
             "fr": f"{MOTS[i % 10]} {MOTS[(i // 10) % 10]}"} for i in range(offset, offset + n)]


def _config(tmp_path, *overrides, task="encdec"):
    small = (["model.d_model=16", "model.num_heads=2", "model.mlp_dim=16"] if task == "encdec"
             else ["model.hidden_dim=16", "model.embed_dim=16"])
    return config_lib.load(task, ["data.name=files", "data.vocab_size=280", "train.steps=2",
                                  "train.batch_size=8", "eval.batch_size=8", "eval.every=-1",
                                  "eval.sample_prompts=('five two',)", *small, *overrides])


def test_pairs_from_jsonl_and_parquet_train_and_read_back(tmp_path, capsys):
    """JSONL lines and parquet rows hold both languages under data.source/data.target;
    a held-out pair is never trained on; a pair with a blank side and a bad line are left
    out, and said; the run trains, and a reader (sampling) needs the tokenizer and
    weights, not the files."""
    lines = [json.dumps(p) for p in _pairs(150)] + ['{"en": "", "fr": "un"}', "not json"]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.Table.from_pylist(_pairs(100, offset=150)), tmp_path / "b.parquet")
    config = _config(tmp_path, f"data.files={tmp_path}/a.jsonl,{tmp_path}/b.parquet",
                     "data.eval_fraction=0.1")
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    seen = {bytes(task.train_source[i]["id"]) for i in range(len(task.train_source))}
    held = {bytes(task.eval_source[i]["id"]) for i in range(len(task.eval_source))}
    assert len(seen) + len(held) == 250 and not seen & held and 10 < len(held) < 45
    pairs = {(p["en"], p["fr"]) for p in _pairs(250)}
    for source in (task.train_source, task.eval_source):
        records = [source[i] for i in range(len(source))]
        assert all(set(r) == {"id", "en", "fr"} for r in records)
        assert {(r["en"].decode(), r["fr"].decode()) for r in records} <= pairs
    err = capsys.readouterr().err
    assert "a.jsonl:152: not a JSON line" in err  # counted as a bad record, said once
    left_out = re.findall(r"warning: (\d+) of the \d+ pairs of 'files' \((?:train|"
                          r"validation)\) have an empty 'en' or 'fr' \(or were bad records\): "
                          r"left out", err)
    assert sum(map(int, left_out)) == 2, err
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert np.isfinite(summary["losses"]).all()
    # analysis translation reads the run's own held-out pairs (it asked the files source
    # for a dataset of no files: a TypeError traceback)
    from attention_jax.tools import analysis
    rows = analysis.translate_split(str(tmp_path / "run"), "validation", max_examples=4)
    assert len(rows) == 4 and all((r["source"], r["reference"]) in pairs for r in rows)
    with pytest.raises(ConfigError, match=r"--split='test': a run on its own files .* has the "
                                          r"splits \['train', 'validation'\]; its held-out "
                                          r"pairs: --split=validation"):
        analysis.translate_split(str(tmp_path / "run"), "test")
    for name in ("a.jsonl", "b.parquet"):  # the data moves away
        (tmp_path / name).rename(tmp_path / f"moved-{name}")
    run = runs.open_run(str(tmp_path / "run"))  # a reader: the task built on demand
    sampled = run.task.sample(run.params, jax.random.key(0))
    assert [isinstance(t, str) for t in sampled] == [True]
    with pytest.raises(files.NoFilesError):
        len(run.task.train_source)  # the data is read only when used
    # --mode=translate: new sentences, greedy (as sample's) or by a beam search
    workdir = str(tmp_path / "run")
    greedy = main.translate_texts(main.mode_config("translate", None, [], workdir), workdir,
                                  ["five two", "nine nine", "one"])
    assert [r["source"] for r in greedy] == ["five two", "nine nine", "one"]
    assert greedy[0]["translation"] == sampled[0]
    beam_of_one = main.translate_texts(
        main.mode_config("translate", None, ["eval.beam_size=1", "eval.batch_size=2",
                                          "mesh.num_devices=1"], workdir),
        workdir, ["five two", "nine nine", "one"])  # two calls of two rows: the same
    assert beam_of_one == greedy
    # a beam of 3: each row's best beam (scores sorted best first), rows in order
    beam_config = main.mode_config("translate", None, ["eval.beam_size=3"], workdir)
    sources = ["five two", "nine nine", "one"]
    beams = main.translate_texts(beam_config, workdir, sources)
    from attention_jax.models import encdec
    tok, reader = run.tokenizer, runs.open_run(workdir, config=beam_config)
    src = np.full((3, beam_config.data.source_len), tok.pad_id, np.int32)
    for row, text in enumerate(sources):
        ids = tok.encode(text)
        src[row, :len(ids)] = ids
    with reader.mesh_context():
        tokens, scores = encdec.beam_search(reader.task.model, reader.params, src, beam_size=3,
                                            max_len=beam_config.data.target_len)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)  # best first
    best = [tok.decode(tasks.until_eos(np.asarray(t), tok.eos_id)) for t in tokens[:, 0]]
    assert [r["translation"] for r in beams] == best
    # a sentence too long is its line's error (it stopped every other line's translation)
    rows = main.translate_texts(main.mode_config("translate", None, [], workdir), workdir,
                                ["one", "nine " * 40, "five two"])
    assert rows[0] == greedy[2] and rows[2] == greedy[0]
    assert rows[1] == {"source": "nine " * 40, "error": "source 2 ('nine nine nine nine nine "
                       "nine nine ni...') is 160 tokens; valid: 1..32 tokens (data.source_len)"}
    assert ("warning: --mode=translate: 1 of the 3 source sentences cannot be translated: "
            "their lines carry \"error\" and no translation") in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["data.target=de"], r"has no 'de' in its records \(their keys: \['en', 'fr'\]\); set "
                         r"config\.data\.source and config\.data\.target to the keys"),
    (["data.target=en"], r"config\.data\.source and config\.data\.target are both 'en'"),
    (["data.files="], r"config\.data\.name='files' needs --config\.data\.files=GLOBS"),
    (["data.eval_split=test"], r"config\.data\.eval_split='test': the files source has the "
                               r"splits \['train', 'validation'\]"),
    (["data.tokenizer=wordpiece"], r"config\.data\.tokenizer='wordpiece' is BERT's"),
])
def test_bad_pair_settings_name_the_key(tmp_path, overrides, message):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(40)) + "\n")
    config = _config(tmp_path, f"data.files={tmp_path}/a.jsonl", *overrides)
    with pytest.raises((ConfigError, files.FilesError), match=message):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


def test_a_tokenizer_file_without_an_end_of_text_token_is_refused(tmp_path):
    """A target ends with the end-of-text token: a tokenizer.json without one was a
    TypeError in a loader thread once training began (after a note about packed
    documents, which translation does not pack)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"{p['en']} {p['fr']}" for p in _pairs(40)], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<s>"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(40)) + "\n")
    config = _config(tmp_path, f"data.files={tmp_path}/a.jsonl",
                     f"data.tokenizer={tmp_path / 'tokenizer.json'}")
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer='.*tokenizer\.json' has no "
                                          r"end-of-text token, which ends every target"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


def test_the_rnn_translates_by_beam_search_too(tmp_path):
    """rnn_seq2seq's eval.beam_size is a beam search of its decoder (it was refused): the
    task's translation of a sentence is the best beam rnn.beam_search gives it over the
    tokenizer's ids (here with the initial weights, a beam of 3; those past them, which
    pad the model's vocabulary, decode to nothing); each family's beam_search refuses
    the other's model in one line (it failed deep inside JAX)."""
    import flax.linen as nn

    from attention_jax.models import encdec, rnn
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(40)) + "\n")
    config = _config(tmp_path, f"data.files={tmp_path}/a.jsonl", "eval.beam_size=3",
                     task="rnn_seq2seq")
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    params = nn.meta.unbox(task.init(jax.random.key(1)))
    task.save_assets(str(tmp_path / "assets"))  # the tokenizer the task encodes with
    from attention_jax import data, workdir as workdir_lib
    tok = data.load_tokenizer(workdir_lib.path(str(tmp_path / "assets"), workdir_lib.TOKENIZER))
    n = config.data.source_len
    sentences = ["five two", "nine nine one"]
    src = np.full((2, n), tok.pad_id, np.int32)
    for row, text in enumerate(sentences):
        ids = tok.encode(text)
        src[row, :len(ids)] = ids
    tokens, scores = rnn.beam_search(task.model, params, src, beam_size=3,
                                     max_len=config.data.target_len, vocab_size=tok.vocab_size)
    assert np.asarray(tokens).max() < tok.vocab_size
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)  # best first
    best = [tok.decode(tasks.until_eos(np.asarray(t), tok.eos_id)) for t in tokens[:, 0]]
    assert task.translate(params, sentences) == best
    with pytest.raises(ValueError, match=r"^beam_search: model is a RNNSeq2Seq; valid: an "
                                         r"encdec\.EncoderDecoder \(an RNNSeq2Seq's: "
                                         r"rnn\.beam_search\)"):
        encdec.beam_search(task.model, {}, src, beam_size=2, max_len=4)
    big = _config(tmp_path, f"data.files={tmp_path}/a.jsonl", "eval.beam_size=1000000000",
                  task="rnn_seq2seq")  # (a traceback from top_k's int32 indices)
    with pytest.raises(ConfigError, match=r"^config\.eval\.beam_size=1000000000: more beams "
                                          r"than the target vocabulary's \d+ tokens; valid: "
                                          r"1\.\.\d+ \(Vaswani et al\. used 4\)$"):
        tasks.TASKS[big.task](big, str(tmp_path / "run"))
    other = encdec.EncoderDecoder(encdec.get_config("transformer-tiny"))
    with pytest.raises(ValueError, match=r"^beam_search: model is a EncoderDecoder; valid: "
                                         r"an rnn\.RNNSeq2Seq"):
        rnn.beam_search(other, {}, src, beam_size=2, max_len=4)


def test_a_text_file_is_no_pair_and_files_need_the_files_source(tmp_path):
    """A .txt is one document, not a pair; data.files with a dataset's name would be
    ignored in silence."""
    (tmp_path / "a.txt").write_text("five two\n")
    config = _config(tmp_path, f"data.files={tmp_path}/a.txt", task="rnn_seq2seq")
    with pytest.raises(files.FilesError, match=r"a\.txt: a text file is one document; pairs "
                                               r"\(en, fr\) come from \.jsonl, \.parquet, "
                                               r"\.csv or \.tsv records"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))
    config.data.name = "number_translation/small"
    with pytest.raises(ConfigError, match=r"config\.data\.files=.* is read only with "
                                          r"config\.data\.name='files'"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


def test_a_bpe_smaller_than_asked_is_said(tmp_path, capsys):
    """data.vocab_size=5000 on a few pairs trained a BPE of a few hundred tokens and said
    nothing (config.json still says 5000)."""
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(40)) + "\n")
    config = _config(tmp_path, f"data.files={tmp_path}/a.jsonl", "data.vocab_size=5000")
    tasks.TASKS[config.task](config, str(tmp_path / "run"))
    learned = re.search(r"note: config\.data\.vocab_size=5000: the BPE learned (\d+) tokens",
                        capsys.readouterr().err)
    assert learned and 260 <= int(learned.group(1)) < 5000


def test_the_pairs_kept_carry_their_split_s_identity():
    """Leaving pairs out wrapped the split, and a tfds split's identity (the resume's
    check against a dataset rebuilt with other examples) was lost with it."""
    from attention_jax.data import loaders
    from attention_jax.tasks.translation import _whole_pairs

    class Split(list):
        fingerprint = "tfds user/1.0.0 train: 3 records, contents abc"
    import ml_collections
    opts = ml_collections.ConfigDict({"source": "en", "target": "fr", "name": "user",
                                      "train_split": "train"})
    pairs = [{"en": b"a", "fr": b"x"}, {"en": b"", "fr": b"y"}, {"en": b"c", "fr": b"z"}]
    kept = _whole_pairs(opts, Split(pairs), "train_split")
    assert len(kept) == 2 and kept[1] == pairs[2]
    assert loaders.source_id(kept).startswith("tfds user/1.0.0 train: 3 records, contents abc, "
                                              "records ")
    assert loaders.source_id(kept) != loaders.source_id(
        _whole_pairs(opts, Split(pairs[:2]), "train_split"))
    assert loaders.source_id(_whole_pairs(opts, pairs, "train_split")) == ""  # none to carry


def test_edited_pairs_have_another_identity_and_moved_ones_the_same(tmp_path):
    """The files' pairs carry a digest of what they hold (read in the pass that leaves out
    empty sides): an edit that keeps every count (a target changed) is another identity,
    so a resume on it stops; the same files elsewhere are the same."""
    from attention_jax.data import loaders
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "p.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(60)) + "\n")
    ident = lambda where: loaders.source_id(tasks.TASKS["encdec"](  # noqa: E731
        _config(tmp_path, f"data.files={where}/p.jsonl"), str(tmp_path / "run")).train_source)
    first = ident(tmp_path / "a")
    assert re.fullmatch(r"\d+ sentence pairs, contents [0-9a-f]{16}", first), first
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "p.jsonl").write_text((tmp_path / "a" / "p.jsonl").read_text())
    assert ident(tmp_path / "b") == first
    edited = [dict(p, fr=p["fr"].replace("un", "nu")) for p in _pairs(60)]
    (tmp_path / "b" / "p.jsonl").write_text("\n".join(json.dumps(p) for p in edited) + "\n")
    assert ident(tmp_path / "b") != first


def test_a_restart_on_the_same_files_reads_no_pair_again(tmp_path, monkeypatch, capsys):
    """The pass over every pair (which are whole, their digest) and the length check
    (every pair encoded) ran at each start: minutes at tens of millions of pairs. They
    are kept in the records cache by the files' listing: a second start on the same files
    reads none of them, says the same warning and has the same identity; an edited file
    is read again."""
    lines = [json.dumps(p) for p in _pairs(80)] + ['{"en": "", "fr": "un"}']
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    reads = []
    document = files.Corpus.document
    monkeypatch.setattr(files.Corpus, "document",
                        lambda self, n: reads.append(n) or document(self, n))
    cache = tmp_path / "cache"
    config = _config(tmp_path, f"data.files={tmp_path}/p.jsonl", f"data.cache_dir={cache}",
                     "data.tokenizer=byte")  # a restart's tokenizer reads no text either

    def start():
        reads.clear()
        files._splits.cache_clear()  # a new process: nothing indexed
        task = tasks.TASKS["encdec"](config, str(tmp_path / "run"))
        return task, len(reads), capsys.readouterr().err
    first, first_reads, first_err = start()
    assert first_reads >= 2 * 80  # the pass and the length check
    again, again_reads, again_err = start()
    assert again_reads <= 2, again_reads  # the first record (its languages), no pass
    assert "1 of the" in first_err and "1 of the" in again_err  # the pair left out, said
    from attention_jax.data import loaders
    assert loaders.source_id(again.train_source) == loaders.source_id(first.train_source)
    assert len(again.train_source) == len(first.train_source)
    assert [again.train_source[i] for i in range(3)] == [first.train_source[i] for i in range(3)]
    assert len(list((cache / "records").glob("*.npz"))) == 4  # 2 splits x 2 passes
    # An edit (another size, mtime) is another entry: read again, another identity.
    (tmp_path / "p.jsonl").write_text("\n".join(lines[:-5]) + "\n")
    edited, edited_reads, _ = start()
    assert edited_reads >= 2 * 70
    assert loaders.source_id(edited.train_source) != loaders.source_id(first.train_source)


def test_the_length_check_is_kept_per_tokenizer_and_still_refuses(tmp_path):
    """The longest pair in tokens is a function of the tokenizer too: a run with another
    vocabulary finds its own lengths, and a kept length still refuses a source_len too
    short on the next start."""
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(60)) + "\n")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    ok = _config(tmp_path, f"data.files={tmp_path}/p.jsonl", cache)
    tasks.TASKS["encdec"](ok, str(tmp_path / "a"))
    byte = _config(tmp_path, f"data.files={tmp_path}/p.jsonl", cache, "data.tokenizer=byte",
                   "data.source_len=6")
    with pytest.raises(ConfigError, match=r"source_len=6: the longest source .* has 1\d tokens"):
        tasks.TASKS["encdec"](byte, str(tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"source_len=6: the longest source"):  # kept, refused
        tasks.TASKS["encdec"](byte, str(tmp_path / "c"))
    short = _config(tmp_path, f"data.files={tmp_path}/p.jsonl", cache, "data.source_len=2")
    with pytest.raises(ConfigError, match="source_len=2: the longest source"):
        tasks.TASKS["encdec"](short, str(tmp_path / "d"))
