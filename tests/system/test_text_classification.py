"""Text classification (bert_classify): BERT's sentence-level fine-tuning on labelled texts,
from a tfds ClassLabel or the user's own .jsonl/.parquet records."""

import io
import json
import re

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attention_jax import config as config_lib
from attention_jax import main as main_lib
from attention_jax import runs, tasks, train
from attention_jax.data import builders, files, loaders, objectives
from attention_jax.errors import ConfigError

GOOD = ["great", "wonderful", "loved", "superb", "fine", "lovely"]
BAD = ["awful", "boring", "hated", "dull", "poor", "bleak"]
THINGS = ["film", "plot", "cast", "story", "ending", "music", "score", "script"]


def _reviews(n: int, labels=("neg", "pos"), offset: int = 0):
    """Records whose label is the sentiment word's side: learnable from one word."""
    out = []
    for i in range(offset, offset + n):
        good = i % 2 == 0
        words = (GOOD if good else BAD)[(i // 2) % 6]
        out.append({"review": f"the {THINGS[(i // 12) % 8]} was {words}",
                    "stars": labels[1] if good else labels[0]})
    return out


def _config(*overrides):
    return config_lib.load("bert_classify", [
        "data.name=files", "data.text_key=review", "data.label_key=stars",
        "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64", "model.num_layers=1",
        "train.steps=2", "train.batch_size=8", "eval.batch_size=8", "eval.every=-1",
        "train.progress=False", *overrides])


def _write_jsonl(path, records, extra=()):
    path.write_text("\n".join([*(json.dumps(r) for r in records), *extra]) + "\n")


def test_own_jsonl_labels_train_classify_and_resume_on_the_same_classes(tmp_path, capsys):
    """Text labels of a user's JSONL become the classes in sorted order (kept in
    classes.json); a record with an empty text or a bad line is left out and said; the
    held-out records are never trained on; the run trains, classifies stdin's lines by
    name, and a resume on files whose labels changed stops naming them."""
    _write_jsonl(tmp_path / "r.jsonl", _reviews(200),
                 extra=['{"review": "", "stars": "pos"}', "not json",
                        '{"review": "ok", "stars": 2.5}'])
    config = _config(f"data.files={tmp_path}/r.jsonl", "data.eval_fraction=0.1")
    work = str(tmp_path / "run")
    task = tasks.TASKS[config.task](config, work)
    assert task.class_names == ("neg", "pos")
    seen = {bytes(task.train_source[i]["id"]) for i in range(len(task.train_source))}
    held = {bytes(task.eval_source[i]["id"]) for i in range(len(task.eval_source))}
    assert len(seen) + len(held) == 200 and not seen & held and 5 < len(held) < 40
    err = capsys.readouterr().err
    assert "r.jsonl:202: not a JSON line" in err
    assert ('''r.jsonl:203: 'stars' is the float 2.5, not text or an integer; a class '''
            '''named so is written as text ("2.5"); skipped''' in err)
    left = re.findall(r"warning: (\d+) of the \d+ records of (?:train|validation) have an "
                      r"empty 'review' or 'stars' \(or were bad records\): left out", err)
    assert sum(map(int, left)) == 3, err
    example = task.train_transform(task.train_source[0], None)
    assert set(example) == {"inputs", "token_types", "mask", "label"}
    assert example["inputs"][0] == 101 and example["label"] in (0, 1)  # [CLS] of WordPiece

    summary = train.train_and_evaluate(config, work)
    assert summary["step"] == 2
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == ["neg", "pos"]
    rows = main_lib.classify_texts(runs.load_config(work), work, ["a superb plot", "dull"])
    assert [r["text"] for r in rows] == ["a superb plot", "dull"]
    # Each row is the run's model on that text as training read it: its argmax class, by
    # name, and that class's softmax probability.
    run = runs.open_run(work)
    for row in rows:
        example = task.train_transform({"review": row["text"], "stars": "pos"}, None)
        logits, _ = run.task.model.apply({"params": run.params}, example["inputs"][None],
                                         example["token_types"][None],
                                         attention_mask=example["mask"][None])
        p = np.asarray(jax.nn.softmax(logits[0]))
        assert row["label"] == ("neg", "pos")[int(p.argmax())]
        assert row["probability"] == pytest.approx(float(p.max()), abs=1e-4)

    _write_jsonl(tmp_path / "r.jsonl", _reviews(200, labels=("bad", "good")))
    with pytest.raises(ConfigError, match=r"classes\.json holds the 2 classes this run trained "
                                          r"on; the data now has 2 \(differing: \['bad', "
                                          r"'good', 'neg', 'pos'\]\)"):
        tasks.TASKS[config.task](config, work)
    # The same classes on other records (every label swapped): the loader's state no longer
    # matches what the files hold, so the resume stops too.
    _write_jsonl(tmp_path / "r.jsonl", _reviews(200, labels=("pos", "neg")))
    config.train.steps = 4
    with pytest.raises(loaders.DataChangedError, match=r"labelled records, contents \w+ then, "
                                                       r"\d+ labelled records, contents \w+ now"):
        train.train_and_evaluate(config, work)


@pytest.mark.parametrize("kind", ["int64", "float64", "jsonl floats", "csv"])
def test_integer_labels_of_a_parquet_column_sort_as_numbers(tmp_path, kind):
    """An integer label column is read as its numbers' text, ordered numerically (2 before
    10), and each record's label index is its number's place in that order. Whole floats
    (pandas writes an integer column with a missing value as float64) read as integers:
    they were refused (Parquet) or a skipped record each, then an error (JSONL)."""
    labels = [10, 2, 1] * 20
    texts = [f"the film was {GOOD[i % 6]}" for i in range(60)]
    if kind == "csv":  # a table's header naming the columns, a quoted field with a comma
        file = tmp_path / "r.csv"
        file.write_text("review,stars\n" + "".join(f'"{t}, truly",{n}\n'
                                                  for t, n in zip(texts, labels)))
    elif kind == "jsonl floats":
        file = tmp_path / "r.jsonl"
        file.write_text("".join(json.dumps({"review": t, "stars": float(n)}) + "\n"
                                for t, n in zip(texts, labels)))
    else:
        file = tmp_path / "r.parquet"
        pq.write_table(pa.table({"review": texts, "stars": pa.array(labels, kind)}), file)
    config = _config(f"data.files={file}")
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    assert task.class_names == ("1", "2", "10")
    for source in (task.train_source, task.eval_source):
        for i in range(len(source)):
            record = source[i]
            label = task.train_transform(record, None)["label"]
            assert task.class_names[label] == record["stars"].decode()


def test_a_classifier_learns_its_labels_and_predicts_them(tmp_path):
    """A tiny BERT trained on the reviews predicts the held-out ones (words it saw, other
    sentences) above 90%: the pooled [CLS] carries what the label depends on. On one
    device: what it asserts is learning, not sharding, and its 60 steps over the 8 fake
    CPU devices hit jaxlib 0.10.2's CPU all-reduce rendezvous timing out, which aborts
    the process (3 runs in 10 alone on a 2-core Intel Xeon, at session 33's main too)."""
    _write_jsonl(tmp_path / "r.jsonl", _reviews(240))
    config = _config(f"data.files={tmp_path}/r.jsonl", "train.steps=60",
                     "optim.warmup_steps=5", "optim.lr=2e-3", "model.dropout_rate=0.0",
                     "model.attention_dropout_rate=0.0", "train.batch_size=16",
                     "mesh.num_devices=1")
    work = str(tmp_path / "run")
    train.train_and_evaluate(config, work)
    reviews = [r for r in _reviews(48, offset=240)]
    rows = main_lib.classify_texts(runs.load_config(work), work,
                                   [r["review"] for r in reviews])
    right = np.mean([row["label"] == r["stars"] for row, r in zip(rows, reviews)])
    assert right >= 0.9, rows


def test_pairs_get_their_token_types_and_a_tab_on_stdin(tmp_path, monkeypatch, capsys):
    """data.pair_key: [CLS] A [SEP] B [SEP] with token types 1 on B's part; --mode=classify
    takes a pair as its two texts around a tab, and a line without one gets an "error"."""
    records = [{"premise": f"the film was {GOOD[i % 6]}", "hypothesis": f"it was {w}",
                "label": "entails" if w in GOOD else "contradicts"}
               for i in range(40) for w in (GOOD[i % 6], BAD[i % 6])]
    _write_jsonl(tmp_path / "p.jsonl", records)
    config = config_lib.load("bert_classify", [
        "data.name=files", f"data.files={tmp_path}/p.jsonl", "data.text_key=premise",
        "data.pair_key=hypothesis", "model.d_model=32", "model.num_heads=2",
        "model.mlp_dim=64", "model.num_layers=1", "train.steps=1", "train.batch_size=8",
        "eval.batch_size=8", "eval.every=-1", "train.progress=False"])
    work = str(tmp_path / "run")
    task = tasks.TASKS[config.task](config, work)
    example = task.train_transform(task.train_source[0], None)
    n = int(example["mask"].sum())
    ids, types = example["inputs"][:n].tolist(), example["token_types"][:n].tolist()
    first_sep = ids.index(102)
    assert ids[0] == 101 and ids[-1] == 102 and ids.count(102) == 2
    assert types == [0] * (first_sep + 1) + [1] * (n - first_sep - 1)
    train.train_and_evaluate(config, work)
    monkeypatch.setattr("sys.stdin", io.StringIO("the film was great\tit was great\n"))
    rows = main_lib.classify_texts(runs.load_config(work), work)
    assert rows[0]["label"] in ("contradicts", "entails")
    # A line that is no pair gets a line saying why; the others their labels (one bad line
    # stopped them all, nothing written).
    got = main_lib.classify_texts(runs.load_config(work), work, [
        "no tab here", "the film was great\tit was great", "great\t"])
    assert got[1] == rows[0]
    assert [set(g) for g in (got[0], got[2])] == [{"text", "error"}] * 2
    assert re.match(r"^'no tab here' holds 0 tab\(s\); task 'bert_classify' classifies pairs",
                    got[0]["error"])
    assert re.match(r"^'great\\t' holds 1 tab\(s\) and an empty side", got[2]["error"])
    assert ("warning: --mode=classify: 2 of the 3 lines are no pair of texts: their lines "
            "carry \"error\" and no label") in capsys.readouterr().err
    # The attention maps read the pair as the model does: B's part of token type 1.
    task = runs.open_run(work).task
    got = task.attention_input(None, "the film was great\tit was dull")
    assert got.labels["self"][0] == ["<cls>", "the", "film", "was", "great", "<sep>", "it",
                                     "was", "dull", "<sep>"]
    assert got.inputs[1].tolist() == [[0] * 6 + [1] * 4]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"fine\tgood\r\n")))
    assert [r["text"] for r in main_lib.classify_texts(runs.load_config(work), work)] == \
        ["fine\tgood"]  # a Windows line end is no part of the text
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"fine\tgood\r\n\xff\n")))
    with pytest.raises(main_lib.InputError, match=r"^--mode=classify: line 2 of stdin is not "
                                                  r"UTF-8"):
        main_lib.classify_texts(runs.load_config(work), work)


def test_classification_example_cuts_the_longer_text_and_keeps_both_starts():
    """A pair is cut as transformers' fast tokenizers cut one ('longest_first'): the shorter
    text (the first on a tie) keeps up to half the room, the other the rest; a single
    text keeps its start."""
    cut = lambda la, lb, n: [int((objectives.classification_example(  # noqa: E731
        [1] * la, [2] * lb, seq_len=n, start_id=90, end_id=91)["inputs"] == k).sum())
        for k in (1, 2)]
    # Popping one token at a time from the longer, as BERT's own code does, gives [6, 7]
    # and [7, 6] here: transformers (and so an export) keeps the other way round.
    assert cut(34, 11, 16) == [7, 6] and cut(20, 20, 16) == [6, 7] and cut(10, 3, 16) == [10, 3]
    ex = objectives.classification_example([1, 2, 3, 4, 5, 6], [7, 8], seq_len=8,
                                           start_id=90, end_id=91, pad_id=0)
    assert ex["inputs"].tolist() == [90, 1, 2, 3, 91, 7, 8, 91]
    assert ex["token_types"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert ex["mask"].tolist() == [1] * 8
    one = objectives.classification_example([1, 2, 3, 4, 5, 6], seq_len=5, start_id=90,
                                            end_id=91, pad_id=0)
    assert one["inputs"].tolist() == [90, 1, 2, 3, 91]
    short = objectives.classification_example([5], [6], seq_len=7, start_id=90, end_id=91,
                                              pad_id=0)
    assert short["inputs"].tolist() == [90, 5, 91, 6, 91, 0, 0]
    assert short["mask"].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert short["token_types"].tolist() == [0, 0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match=r"seq_len=4 leaves no room .*valid: seq_len >= 5"):
        objectives.classification_example([1], [2], seq_len=4, start_id=90, end_id=91)


def test_bad_labelled_data_is_one_line_naming_the_key(tmp_path, data_dir):
    """Held-out labels the training split lacks, a single class, a label key the files
    lack, 'id' as a key, and a tfds field that is no ClassLabel: each a one-line error."""
    _write_jsonl(tmp_path / "train.jsonl", _reviews(40))
    _write_jsonl(tmp_path / "eval.jsonl", _reviews(4, labels=("neg", "meh")))
    make = lambda config: tasks.TASKS[config.task](config, str(tmp_path / "run"))  # noqa: E731
    with pytest.raises(ConfigError, match=r"config\.data\.eval_files: the labels \['meh'\] of "
                                          r"the held-out records are not among the 2 labels"):
        make(_config(f"data.files={tmp_path}/train.jsonl",
                     f"data.eval_files={tmp_path}/eval.jsonl"))
    _write_jsonl(tmp_path / "one.jsonl", _reviews(40, labels=("pos", "pos")))
    with pytest.raises(ConfigError, match=r"the training records have 1 label \(\['pos'\]\); "
                                          r"valid: two classes or more"):
        make(_config(f"data.files={tmp_path}/one.jsonl"))
    with pytest.raises(files.FilesError, match=r"has no 'label' in its records \(their keys: "
                                               r"\['review', 'stars'\]\); set config\.data\."
                                               r"text_key and config\.data\.label_key"):
        make(_config(f"data.files={tmp_path}/train.jsonl", "data.label_key=label"))
    with pytest.raises(ConfigError, match=r"a key is 'id'"):
        make(_config(f"data.files={tmp_path}/train.jsonl", "data.label_key=id"))
    tfds_config = config_lib.load("bert_classify", [
        "data.name=number_translation/small", f"data.data_dir={data_dir}",
        "data.text_key=en", "data.label_key=fr"])
    with pytest.raises(ConfigError, match=r"config\.data\.label_key='fr' is not a class label "
                                          r"of 'number_translation/small' \(a tfds "
                                          r"ClassLabel\); valid: none: it has no ClassLabel "
                                          r"field, or your own records' labels"):
        make(tfds_config)
    tfds_config.data.text_key = "english"
    with pytest.raises(ConfigError, match=r"config\.data\.text_key='english' is not a text "
                                          r"field of 'number_translation/small'; valid: "
                                          r"\['de', 'en', 'fr'\]"):
        make(tfds_config)


def test_number_languages_are_disjoint_deterministic_and_unambiguous(tmp_path):
    """Every record's words are num2words' for its number in its language; no text has
    two languages for one number; the integers of the splits are disjoint; and a second
    build gives the same records."""
    from num2words import num2words

    from attention_jax import data
    opts = dict(num_train=40, num_validation=10, num_test=10, max_digits=4, seed=3)
    runs_ = [{s: [data.get_dataset("number_languages", s, tmp_path / r, **opts)[i]
                  for i in range(len(data.get_dataset("number_languages", s, tmp_path / r,
                                                      **opts)))]
              for s in ("train", "validation", "test")} for r in ("a", "b")]
    for split, records in runs_[0].items():
        assert [(int(x["number"]), x["text"], int(x["label"])) for x in records] == \
               [(int(x["number"]), x["text"], int(x["label"])) for x in runs_[1][split]]
    numbers = {s: {int(r["number"]) for r in recs} for s, recs in runs_[0].items()}
    assert [len(numbers[s]) for s in ("train", "validation", "test")] == [40, 10, 10]
    assert not (numbers["train"] & numbers["validation"] or numbers["train"] & numbers["test"])
    for record in runs_[0]["train"]:
        lang = builders.CLASS_LANGUAGES[int(record["label"])]
        assert record["text"].decode() == num2words(int(record["number"]), lang=lang)
    by_number = {}
    for record in runs_[0]["train"]:
        by_number.setdefault(int(record["number"]), []).append(record["text"])
    assert all(len(set(texts)) == len(texts) for texts in by_number.values())
    assert ("es", "seis") not in builders.language_records(6)  # Portuguese's too
    assert ("de", "sechs") in builders.language_records(6)


def test_attention_maps_and_flops_of_a_text_classifier(tmp_path):
    """The attention input is [CLS] text [SEP] with the tokens' labels; a text longer than
    seq_len is refused before any compute; FLOPs count the encoder, not the word table."""
    _write_jsonl(tmp_path / "r.jsonl", _reviews(40))
    config = _config(f"data.files={tmp_path}/r.jsonl", "data.seq_len=8")
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    params = task.init(jax.random.key(0))
    got = task.attention_input(params, "a lovely film")
    assert got.labels["self"][0] == ["<cls>", "a", "lovely", "film", "<sep>"]
    _, aux = task.model.apply({"params": params}, *got.inputs, return_weights=True)
    assert aux["attention_weights"]["self"].shape == (1, 1, 2, 5, 5)
    with pytest.raises(tasks.InputTooLongError):
        task.attention_input(params, "the film was great and the music was lovely too")
    from attention_jax.models import flops
    shapes = jax.eval_shape(task.init, jax.random.key(0))
    encoder = flops.matmul_params(shapes, flops.LOOKUP_TABLES + ("word_embeddings",))
    assert task.flops_per_unit(shapes) == 8 * flops.flops_per_token(encoder, 1, 8, 32)
    assert encoder < flops.matmul_params(shapes) - 30000 * 32  # the word table left out


def test_labels_with_spaces_short_seq_len_and_a_failed_start(tmp_path):
    """' neg ' is the class 'neg'; a seq_len with no room for a text is one line naming it;
    classes.json left by a start that saved no checkpoint does not block a new start."""
    records = _reviews(40)
    for r in records[::3]:
        r["stars"] = f" {r['stars']} "
    _write_jsonl(tmp_path / "r.jsonl", records)
    work = tmp_path / "run"
    work.mkdir()
    (work / "classes.json").write_text(json.dumps(["a", "b", "c"]))  # a failed start's
    config = _config(f"data.files={tmp_path}/r.jsonl")
    task = tasks.TASKS[config.task](config, str(work))
    assert task.class_names == ("neg", "pos")
    labels = {task.train_transform(task.train_source[i], None)["label"].item()
              for i in range(len(task.train_source))}
    assert labels == {0, 1}
    for pair, seq_len, least in (("", 2, 3), ("stars", 4, 5)):
        with pytest.raises(ConfigError, match=rf"^config\.data\.seq_len={seq_len} leaves no "
                                              rf"room .*valid: seq_len >= {least}$"):
            make = _config(f"data.files={tmp_path}/r.jsonl", f"data.seq_len={seq_len}",
                           f"data.pair_key={'review2' if pair else ''}")
            if pair:
                _write_jsonl(tmp_path / "r.jsonl", [{**r, "review2": "x"} for r in records])
            tasks.TASKS[make.task](make, str(tmp_path / "other"))


def test_a_held_out_split_without_some_label_is_said(tmp_path, capsys):
    """A small eval_fraction may hold out records of one label only: the eval metrics
    then leave the other out, said; a split with both says nothing."""
    _write_jsonl(tmp_path / "r.jsonl", _reviews(40))
    seen = set()
    for fraction in (0.02, 0.05, 0.1, 0.3):
        config = _config(f"data.files={tmp_path}/r.jsonl", f"data.eval_fraction={fraction}")
        task = tasks.TASKS[config.task](config, str(tmp_path / f"run{fraction}"))
        held = {task.eval_source[i]["stars"].decode() for i in range(len(task.eval_source))}
        err = capsys.readouterr().err
        if held == {"neg", "pos"}:
            assert "held-out records hold" not in err
        else:
            (missing,) = {"neg", "pos"} - held
            assert (f"note: config.data.eval_fraction={fraction}: the {len(task.eval_source)} "
                    f"held-out records hold 1 of the 2 labels (none of ['{missing}']): the "
                    f"eval metrics leave those out; give a larger config.data.eval_fraction, "
                    f"or held-out records of every label in config.data.eval_files=GLOBS"
                    ) in err
        seen.add(held == {"neg", "pos"})
    assert seen == {True, False}  # both cases met


def test_a_rare_label_drawn_into_the_held_out_split_names_eval_fraction(tmp_path):
    records = _reviews(60) + [{"review": "so so", "stars": "meh"}]
    _write_jsonl(tmp_path / "r.jsonl", records)
    for fraction in (0.05, 0.1, 0.2, 0.3, 0.5):  # one draw that holds it out
        config = _config(f"data.files={tmp_path}/r.jsonl", f"data.eval_fraction={fraction}")
        try:
            tasks.TASKS[config.task](config, str(tmp_path / "run"))
        except ConfigError as e:
            assert re.match(r"config\.data\.eval_fraction: the labels \['meh'\] of the held-out "
                            r"records are not among the 2 labels .*valid: more records of "
                            r"those labels .*config\.data\.eval_files=GLOBS", str(e)), e
            return
    pytest.fail("no eval_fraction drew the one 'meh' record into the held-out split")


def test_an_unlabelled_tfds_split_is_refused_and_an_index_outside_the_classes_raises():
    """GLUE's test splits label every record -1: refused before training or evaluating
    (their -1s counted as a wrong class, said nowhere); an index outside the classes in
    any later record raises in the transform rather than training on it."""
    from attention_jax.tasks import text_classes
    o = config_lib.load("bert_classify", ["data.name=glue/sst2", "data.text_key=sentence",
                                          "data.eval_split=test"]).data
    classes = ("negative", "positive")
    with pytest.raises(ConfigError, match=r"^config\.data\.eval_split='test' of 'glue/sst2': "
                                          r"its records' 'label' is -1, no class of 2 \(an "
                                          r"unlabelled split\); valid: a labelled split$"):
        text_classes._check_labelled(o, [{"sentence": b"fine", "label": -1}], "eval_split",
                                     classes)
    text_classes._check_labelled(o, [{"sentence": b"fine", "label": 1}], "eval_split", classes)
    from attention_jax import data
    tok = data.get_tokenizer("wordpiece")
    transform = data.TextClassification(tok, 8, tok.cls_id, tok.sep_id, classes,
                                        text_key="sentence", by_index=True)
    assert transform({"sentence": b"fine", "label": 1}, None)["label"] == 1
    with pytest.raises(ValueError, match=r"label='2' is not one of the 2 classes"):
        transform({"sentence": b"fine", "label": 2}, None)
    # a run whose classes were a table's float-written labels, read as integers since
    named = data.TextClassification(tok, 8, tok.cls_id, tok.sep_id, ("1.0", "5.0"),
                                    text_key="sentence")
    with pytest.raises(ValueError, match=r"label='5' is not one of the 2 classes \['1\.0', "
                                         r"'5\.0'\] \(its classes were read as 5\.0 from a CSV or "
                                         r"TSV, which now reads whole numbers as integers: train "
                                         r"a new run\)"):
        named({"sentence": b"fine", "label": b"5"}, None)


def test_an_exported_pair_classifier_reads_what_the_run_read(tmp_path):
    """A BPE run's export adds <bos>/<eos> as the run did, gives the model token types for
    a pair, and cuts a long pair where the run does (max_length=seq_len): transformers'
    tokenizer gives the same ids and types, and its model the same logits."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    records = [{"premise": f"the film was {GOOD[i % 6]} and the cast {BAD[i % 6]}",
                "hypothesis": f"it was {w}", "label": int(w in GOOD)}
               for i in range(30) for w in (GOOD[i % 6], BAD[i % 6])]
    _write_jsonl(tmp_path / "p.jsonl", records)
    config = config_lib.load("bert_classify", [
        "data.name=files", f"data.files={tmp_path}/p.jsonl", "data.text_key=premise",
        "data.pair_key=hypothesis", "data.tokenizer=bpe", "data.vocab_size=300",
        "data.seq_len=12", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64",
        "model.num_layers=1", "train.steps=1", "train.batch_size=8", "eval.batch_size=8",
        "eval.every=-1", "train.progress=False"])
    work = str(tmp_path / "run")
    train.train_and_evaluate(config, work)
    run = runs.open_run(work)
    from attention_jax import convert
    out = str(tmp_path / "hf")
    convert.export_hf(run.task.model, run.params, out, tokenizer=run.tokenizer,
                      class_names=run.task.class_names, max_length=config.data.seq_len)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.id2label == {0: "0", 1: "1"}
    a, b = records[0]["premise"], "it was wonderful and lovely and fine"
    enc = hf_tok(a, b, truncation=True, return_tensors="pt")
    ours = run.task.train_transform({"premise": a, "hypothesis": b, "label": "1"}, None)
    n = int(ours["mask"].sum())
    assert n == 12  # cut to seq_len: both texts lost tokens
    assert enc["input_ids"][0].tolist() == ours["inputs"][:n].tolist()
    assert enc["token_type_ids"][0].tolist() == ours["token_types"][:n].tolist()
    with torch.no_grad():
        theirs = model(**enc).logits[0].numpy()
    logits, _ = run.task.model.apply({"params": run.params}, ours["inputs"][None, :n],
                                     ours["token_types"][None, :n])
    np.testing.assert_allclose(np.asarray(logits)[0], theirs, atol=2e-5)


def test_a_reader_evaluates_a_tfds_set_only_by_the_run_s_class_names(tmp_path, data_dir):
    """A reader takes the run's classes.json (sampling, maps and classify need no data);
    evaluating a tfds split whose ClassLabel names are not those (another copy, prepared
    with another order) is refused, not scored with crossed labels."""
    work = tmp_path / "run"
    (work / "checkpoints" / "1").mkdir(parents=True)
    names = list(builders.CLASS_LANGUAGES)
    (work / "classes.json").write_text(json.dumps(names[1:] + names[:1]))
    config = config_lib.load("bert_classify", [f"data.data_dir={data_dir}"])
    with tasks.data_on_demand():
        task = tasks.TASKS[config.task](config, str(work))
        assert task.class_names == tuple(names[1:] + names[:1])
        with pytest.raises(ConfigError, match=r"classes\.json holds the 6 classes this run "
                                              r"trained on; .*\(differing: their order\)"):
            len(task.eval_source)
    (work / "classes.json").write_text(json.dumps(names))
    with tasks.data_on_demand():
        assert len(tasks.TASKS[config.task](config, str(work)).eval_source) > 1000


def test_texts_longer_than_seq_len_are_cut_and_said(tmp_path, capsys):
    """A text longer than data.seq_len is cut to its first tokens, in training and when
    classified; both say so in one line rather than read less of it unsaid."""
    _write_jsonl(tmp_path / "r.jsonl", _reviews(40))  # "the X was Y": 4-5 word pieces
    config = _config(f"data.files={tmp_path}/r.jsonl", "data.seq_len=5")
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    n = len(task.train_source)
    err = capsys.readouterr().err
    assert re.search(rf"note: config\.data\.seq_len=5: {n} of the first {n} training texts "
                     r"are longer \(with their special tokens\) and are cut", err), err
    config = _config(f"data.files={tmp_path}/r.jsonl", "data.seq_len=16")
    tasks.TASKS[config.task](config, str(tmp_path / "run2"))
    assert "are cut" not in capsys.readouterr().err
    params = task.init(jax.random.key(0))
    probabilities, unusable = task.label_texts(
        params, ["fine", "the film was fine and the music was lovely"])
    assert probabilities.shape == (2, len(task.class_names)) and unusable == {}
    assert re.search(r"note: 1 of the 2 texts are longer than config\.data\.seq_len=5 tokens",
                     capsys.readouterr().err)
