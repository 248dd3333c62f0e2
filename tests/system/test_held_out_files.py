"""A run evaluated on its data.eval_files alone: its training files moved away (another
machine, deleted after training), --mode=eval reads the held-out files and neither lists
nor reads the training ones. It failed on the missing training glob for the text tasks
(the token cache's key and the files' indexing took both), as the image folder once did."""

import json

import pytest

from attention_jax import config as config_lib
from attention_jax import main, train
from attention_jax.data import files

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
MOTS = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf"]


def _pairs(n: int, offset: int = 0):
    return [{"en": f"{WORDS[i % 10]} {WORDS[(i // 10) % 10]}",
             "fr": f"{MOTS[i % 10]} {MOTS[(i // 10) % 10]}"} for i in range(offset, offset + n)]


def _write_lm(tmp_path):
    (tmp_path / "train.txt").write_text(" ".join(WORDS * 60))
    (tmp_path / "held.txt").write_text(" ".join(reversed(WORDS * 12)))
    return ["data.name=files", f"data.files={tmp_path}/train.txt", "data.seq_len=16",
            f"data.eval_files={tmp_path}/held.txt", f"data.cache_dir={tmp_path}/cache",
            "model.num_layers=1", "model.d_model=32", "model.num_heads=2",
            "eval.sample_prompts=()"], "train.txt"


def _write_pairs(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(120)))
    (tmp_path / "held.jsonl").write_text("\n".join(json.dumps(p) for p in _pairs(20, 120)))
    return ["data.name=files", f"data.files={tmp_path}/train.jsonl", "data.vocab_size=280",
            f"data.eval_files={tmp_path}/held.jsonl", f"data.cache_dir={tmp_path}/cache",
            "model.d_model=16", "model.num_heads=2", "model.mlp_dim=16",
            "eval.sample_prompts=('five two',)"], "train.jsonl"


def _write_labelled(tmp_path):
    records = [{"review": f"{WORDS[i % 10]} {WORDS[i % 7]}", "stars": i % 3} for i in range(90)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records[:72]))
    (tmp_path / "held.jsonl").write_text("\n".join(json.dumps(r) for r in records[72:]))
    return ["data.name=files", f"data.files={tmp_path}/train.jsonl", "data.text_key=review",
            "data.label_key=stars", f"data.eval_files={tmp_path}/held.jsonl",
            f"data.cache_dir={tmp_path}/cache", "model.d_model=32", "model.num_heads=2",
            "model.mlp_dim=64", "model.num_layers=1"], "train.jsonl"


@pytest.mark.parametrize("task, write", [("gpt", _write_lm), ("encdec", _write_pairs),
                                         ("bert_classify", _write_labelled)])
def test_an_evaluation_of_held_out_files_needs_no_training_file(tmp_path, task, write):
    overrides, train_file = write(tmp_path)
    config = config_lib.load(task, [*overrides, "train.steps=2", "train.batch_size=8",
                                    "eval.batch_size=8", "eval.every=0",
                                    "train.progress=False"])
    workdir = str(tmp_path / "run")
    trained = train.train_and_evaluate(config, workdir)["eval"]
    cached = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*"))
    (tmp_path / train_file).rename(tmp_path / "elsewhere")
    after = main.evaluate_checkpoint(main.mode_config("eval", None, [], workdir), workdir)
    # The run's own evaluation, from the caches training made (the same keys): no new one.
    assert after["examples"] > 0 and after["loss"] == pytest.approx(trained["loss"], rel=1e-6)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache").rglob("*")) == cached
    # Training still needs them, and says which are missing.
    with pytest.raises(files.NoFilesError, match=rf"config\.data\.files='[^']*{train_file}'"):
        train.train_and_evaluate(config_lib.load(task, [*overrides, "train.steps=4"]),
                                 str(tmp_path / "another"))


def test_the_held_out_split_alone_is_the_same_documents(tmp_path, capsys):
    """file_splits(held_out_only=True) is the validation split of the whole call, and
    refuses a call without eval_files, naming it."""
    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text(f"training {i}")
        (tmp_path / f"e{i}.txt").write_text(f"held out {i}")
    whole = files.file_splits(f"{tmp_path}/t*.txt", f"{tmp_path}/e*.txt")
    alone = files.file_splits(f"{tmp_path}/missing*.txt", f"{tmp_path}/e*.txt",
                              held_out_only=True)
    assert "note: eval_files not checked against files, which cannot be listed now" in (
        capsys.readouterr().err)
    assert list(alone) == ["validation"]
    assert ([alone["validation"][i] for i in range(3)]
            == [whole["validation"][i] for i in range(3)])
    assert {alone["validation"][i]["text"] for i in range(3)} == {
        f"held out {i}".encode() for i in range(3)}
    # A reader naming a training file as held out is refused while those can be listed.
    with pytest.raises(files.FilesError, match=r"t1\.txt is in both files and eval_files"):
        files.file_splits(f"{tmp_path}/t*.txt", f"{tmp_path}/t1.txt", held_out_only=True)
    with pytest.raises(files.FilesError, match=r"^config\.data\.eval_files is empty"):
        files.file_splits("x.txt", "", held_out_only=True, arg="config.data.")
