"""Mistakes that used to pass without a word: evaluating with another config than the
run's, two writers in one workdir, path mistakes that ended in tracebacks, a config
error that left an empty workdir. Each now says so in one line, or cannot happen."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tiny
from attention_jax import config as config_lib
from attention_jax import train
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError
from conftest import REPO, start_worker, subprocess_env
from test_cli import TINY_GPT, cli, one_error_line


def _wait_for(path: str, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)


# ------------------------------------------------------------ a reader uses the run's config
@pytest.fixture(scope="module")
def overridden(tmp_path_factory):
    """TINY_GPT trained with overrides of model, data and batch keys, and an evaluation
    over 2 batches at its end."""
    root = tmp_path_factory.mktemp("overridden")
    workdir = str(root / "run")
    args = [*TINY_GPT, f"--config.data.data_dir={root / 'tfds'}", "--config.eval.every=0",
            "--config.eval.steps=2", "--config.model.num_heads=2"]
    out = cli(*args, f"--workdir={workdir}")
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir, args


@pytest.mark.slow
def test_eval_of_a_run_trained_with_overrides_is_its_own_eval(overridden):
    workdir, _ = overridden
    metrics = os.path.join(workdir, "metrics.jsonl")
    before = open(metrics).read()
    final = workdir_lib.last_records(workdir)["eval"]
    # The README's plain command (the experiment named, no overrides) and no --config at
    # all: both evaluate the model and data the run trained on.
    for args in (["--config=gpt"], []):
        out = cli(*args, f"--workdir={workdir}", "--mode=eval")
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout)
        assert got["step"] == final["step"] == 2
        assert got["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert open(metrics).read() == before  # the training history is untouched
    evals = workdir_lib.read_records(os.path.join(workdir, workdir_lib.EVALS))
    assert [r["step"] for r in evals] == [2, 2] and "time" in evals[0]


@pytest.mark.slow
def test_eval_overrides_apply_only_where_reading_may_differ(overridden):
    workdir, _ = overridden
    out = cli(f"--workdir={workdir}", "--mode=eval", "--config.eval.steps=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--mode=eval: the run's config.json with eval.steps=1 (trained with 2)" in out.stderr
    line = one_error_line(cli(f"--workdir={workdir}", "--mode=eval",
                              "--config.model.num_heads=4"))
    assert line.startswith(f"error: --mode=eval uses the run's own config ({workdir}/"
                           f"config.json), and the keys given differ from it: "
                           f"model.num_heads: 2 -> 4; these cannot change after training")


def test_reading_without_a_run_or_training_without_a_config(tmp_path):
    line = one_error_line(cli(f"--workdir={tmp_path}", "--mode=eval"))
    assert line == (f"error: --mode=eval: {tmp_path}/config.json does not exist: "
                    f"'{tmp_path}' holds no trained run (train there first, or name a run's "
                    f"workdir)")  # (--config, which it named, gave "no checkpoint" next)
    line = one_error_line(cli(f"--workdir={tmp_path}"))
    assert line.startswith("error: --config is required to train: ")
    # A folder whose config.json is no run's (a Hugging Face export) is not trained as one.
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    line = one_error_line(cli(f"--workdir={tmp_path}"))
    assert line.startswith("error: --config is required to train: ")


# ------------------------------------------------------------------ one writer per workdir
@pytest.mark.slow
def test_a_second_writer_stops_in_one_line_and_the_first_finishes(tmp_path, read_json):
    workdir, out = str(tmp_path / "w"), str(tmp_path / "out.json")
    first = start_worker({"train.steps": 100000, "train.checkpoint_every": 100000,
                          "train.log_every": 1}, workdir, out)
    _wait_for(os.path.join(workdir, "metrics.jsonl"), first)
    start = time.time()
    line = one_error_line(cli("--config=gpt", f"--workdir={workdir}"))
    assert time.time() - start < 60
    assert line.startswith(f"error: {workdir} is being written by another run (host ")
    assert f"pid {first.pid}, started " in line
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output[-3000:]
    result = read_json(out)
    steps = [r["step"] for r in workdir_lib.read_records(os.path.join(workdir, "metrics.jsonl"))]
    assert steps == list(range(1, result["step"] + 1))  # one writer: no duplicate records
    assert len(os.listdir(os.path.join(workdir, "tensorboard"))) == 1


@pytest.mark.slow
def test_after_kill_9_the_next_run_takes_the_stale_lock(tmp_path):
    workdir = str(tmp_path / "w")
    proc = start_worker({"train.steps": 100000, "train.checkpoint_every": 3,
                         "train.log_every": 1}, workdir, str(tmp_path / "out.json"))
    _wait_for(os.path.join(workdir, "metrics.jsonl"), proc)
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    holder = json.load(open(os.path.join(workdir, workdir_lib.LOCK)))
    assert holder["pid"] == proc.pid  # the dead run's name is still in the file
    latest = max([int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                  if n.isdigit()], default=0)
    summary = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": latest + 2,
                                                           "train.checkpoint_every": 3,
                                                           "train.log_every": 1}), workdir)
    assert summary["step"] == latest + 2
    assert json.load(open(os.path.join(workdir, workdir_lib.LOCK)))["pid"] == os.getpid()


# ---------------------------------------------------------------- path mistakes, one line
def test_a_workdir_that_is_a_file(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    line = one_error_line(cli("--config=gpt", f"--workdir={file}"))
    assert line == (f"error: --workdir={file} is a file; valid: a directory (new, or a run to "
                    f"resume)")
    line = one_error_line(cli(f"--workdir={file}", "--mode=eval"))
    assert line == f"error: --workdir={file} is a file; valid: a run directory"


def test_a_workdir_whose_entries_are_not_what_a_run_writes(tmp_path):
    """checkpoints/ as a file was NotADirectoryError's traceback, in training and every
    reader; a config.json that is not JSON, or JSON but not an object, json's or an
    AttributeError's, after the task was built."""
    run = tmp_path / "run"
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 1}), str(run))
    os.rename(run / "checkpoints", tmp_path / "moved")
    (run / "checkpoints").write_text("x")
    said = (f"{run / 'checkpoints'} is a file; valid: a folder (the run's checkpoints/), or "
            f"no entry of that name")
    with pytest.raises(workdir_lib.RunPathError) as e:
        train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 2}), str(run))
    assert str(e.value) == said
    assert one_error_line(cli(f"--workdir={run}", "--mode=eval")) == f"error: {said}"
    odd = tmp_path / "odd"
    odd.mkdir()
    for text, why in (("not json", "not JSON: Expecting value: line 1 column 1 (char 0)"),
                      ("[1, 2]", "a JSON list, not an object")):
        (odd / "config.json").write_text(text)
        with pytest.raises(workdir_lib.RunPathError) as e:
            train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 2}), str(odd))
        assert str(e.value) == (f"{odd / 'config.json'}: not a run's config ({why}); move it "
                                f"away, or give another --workdir")
        assert [p.name for p in odd.iterdir()] == ["config.json"]  # refused before any write
    # A Hugging Face model's config.json (--workdir at its folder by mistake) was replaced
    # by the run's, with a note: the user's file was gone.
    hf = '{"model_type": "gpt2", "n_layer": 2}'
    (odd / "config.json").write_text(hf)
    with pytest.raises(workdir_lib.RunPathError, match=r"config\.json is not a run's config "
                                                       r"\(no 'task': a Hugging Face model's"):
        train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 2}), str(odd))
    assert (odd / "config.json").read_text() == hf
    assert [p.name for p in odd.iterdir()] == ["config.json"]  # no lock, no checkpoints/


def test_training_into_a_folder_that_is_not_a_run_says_so(tmp_path, capsys):
    folder = tmp_path / "home"
    folder.mkdir()
    for name in ("notes.txt", "thesis.tex", "data", "a", "b", "c", ".DS_Store"):  # hidden: not shown
        (folder / name).write_text("x")
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 1}), str(folder))
    out = capsys.readouterr().out
    assert (f"note: --workdir={folder} is not a run (no config.json) and holds a, b, c, data, "
            f"notes.txt and 1 more; the run writes config.json") in out
    assert (folder / "thesis.tex").read_text() == "x"  # beside them, nothing removed
    # The run resumed, or a new folder: no note.
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 2}), str(folder))
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 1}), str(tmp_path / "new"))
    assert "is not a run" not in capsys.readouterr().out


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anything: nothing to refuse")
def test_a_workdir_that_cannot_be_written(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = one_error_line(cli("--config=gpt", f"--workdir={locked}"))
        assert line.startswith(f"error: --workdir={locked} is not writable")
    finally:
        locked.chmod(0o755)


def test_a_path_where_a_dataset_name_is_expected(tmp_path, data_dir):
    for name in (str(tmp_path), "./my_corpus.jsonl"):
        line = one_error_line(cli(*TINY_GPT, f"--workdir={tmp_path / 'w'}",
                                  f"--config.data.data_dir={data_dir}",
                                  f"--config.data.name={name}"))
        assert line.startswith(f"error: config.data.name='{name}' is a path, but "
                               f"config.data.name names a dataset; valid: ['")
    assert not os.path.exists(tmp_path / "w")  # a mistake leaves no empty workdir behind


def test_a_tools_output_under_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    out = subprocess.run([sys.executable, "-m", "attention_jax.tools.analysis", "runs",
                          f"--out={tmp_path / 'f' / 'report'}", f"a={tmp_path}"],
                         env=subprocess_env(1), cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"error: --out={tmp_path / 'f' / 'report'}: "
                                  f"{tmp_path / 'f'} is a file, not a folder")


def test_a_config_error_leaves_no_empty_workdir(tmp_path, data_dir):
    workdir = tmp_path / "new"
    line = one_error_line(cli(*TINY_GPT, f"--workdir={workdir}", f"--config.data.data_dir={data_dir}",
                              "--config.mesh.tensor=8"))
    assert "is not divisible by mesh.tensor=8" in line
    assert not os.path.exists(workdir)


# ------------------------------------------------------------------------- smaller things
def test_the_sequence_axis_hint_lists_only_sizes_that_divide_the_devices():
    shape = {"sequence": 4, "tensor": 1}
    with pytest.raises(ConfigError, match=r"valid: seq_len a multiple of 8, or mesh\.sequence "
                                          r"in \[1\]$"):
        config_lib.check_model_fits_mesh(object(), shape, seq_len=30)
    with pytest.raises(ConfigError, match=r"mesh\.sequence in \[1, 2, 4\]$"):
        config_lib.check_model_fits_mesh(object(), {"sequence": 3}, seq_len=40)
    # A ViT's 17 positions (16 patches and [CLS]) on mesh.sequence=8: auto's attention
    # took another backend than the ring, unsaid, and the axis's devices split nothing.
    with pytest.raises(ConfigError, match=r"^config\.mesh\.sequence=8: the model's 17 "
                                          r"positions an example are not divisible by 2 × "
                                          r"mesh\.sequence = 16 .*valid: mesh\.sequence in "
                                          r"\[1\]$"):
        config_lib.check_model_fits_mesh(object(), {"sequence": 8}, positions=17)
    config_lib.check_model_fits_mesh(object(), {"sequence": 8}, positions=16)  # GAP: no [CLS]
    config_lib.check_model_fits_mesh(object(), {"sequence": 8}, seq_len=32, positions=17)
