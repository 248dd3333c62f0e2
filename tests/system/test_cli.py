"""The command line as a newcomer meets it: every mistake one `error: ...` line and exit
code 1 (no traceback), --help that helps, quiet runs that say where their outputs went,
a plain progress log when stdout is a file, and resuming a changed config only on
request. Each test runs `python -m attention_jax.main` in a subprocess (8 CPU devices)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from attention_jax import workdir as workdir_lib
from conftest import REPO, subprocess_env

# The GPT experiment at test size: one small layer, six corpus files, two steps.
TINY_GPT = ["--config=gpt", "--config.data.max_files=6",
            "--config.data.seq_len=32", "--config.model.num_layers=1",
            "--config.model.d_model=16", "--config.train.steps=2",
            "--config.optim.warmup_steps=1", "--config.train.batch_size=8",
            "--config.train.log_every=2", "--config.eval.every=-1", "--config.eval.steps=1",
            "--config.eval.batch_size=8", "--config.eval.sample_tokens=4"]


def cli(*args, cache: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = subprocess_env(8)
    if not cache:  # XLA only warns while compiling: a cache hit would hide its warnings.
        for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
            env.pop(key)
    return subprocess.run([sys.executable, "-m", "attention_jax.main", *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run failed with exit code 1 and exactly one line on stderr: `error: ...`."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
    assert lines[0].startswith("error: ")
    return lines[0]


# ------------------------------------------------------------------ mistakes, one line each
def test_misspelt_config_argument_and_stray_argument(tmp_path):
    line = one_error_line(cli("--config=gtp", f"--workdir={tmp_path}"))
    assert line.startswith("error: --config=gtp is not a shipped config (did you mean 'gpt'?); "
                           "valid: [")
    assert "'vit'" in line and "or a path to a .py file with get_config()" in line
    line = one_error_line(cli("--config=nowhere/mine.py", f"--workdir={tmp_path}"))
    assert line.startswith("error: --config=nowhere/mine.py: no such file; shipped configs: ")
    # A misspelt experiment argument never trains the default silently.
    line = one_error_line(cli("--config=gpt:varient=gpt-tiny-rope", f"--workdir={tmp_path}"))
    assert line == ("error: --config=gpt:varient=gpt-tiny-rope: 'varient' is not an argument of "
                    "this config (did you mean 'variant'?); valid: ['variant'] as "
                    ":key=value,key=value")
    line = one_error_line(cli("--config=char_gpt:size=huge", f"--workdir={tmp_path}"))
    assert line.startswith("error: --config=char_gpt:size=huge: :size='huge' is unknown; valid: [")
    line = one_error_line(cli("--config=gpt", f"--workdir={tmp_path}", "steps=5"))
    assert line.startswith("error: unexpected argument steps=5: ")
    assert "--config.group.key=value" in line
    assert not os.path.exists(tmp_path / "config.json")


def test_an_override_s_value_may_follow_as_the_next_word():
    """--config.train.steps 2 (absl's own flags take `--name value`) set train.steps=true
    and left 2 as a stray argument. tools.prepare takes them the same way."""
    from attention_jax import config as config_lib
    rest, overrides = config_lib.split_overrides(
        ["main", "--config=gpt", "--config.train.steps", "2", "--config.train.progress",
         "--workdir=/tmp/w", "--config.optim.lr", "1e-3", "--noconfig.eval.every_epoch",
         "--config.eval.every", "-1", "--config.train.progress", "--mode=eval"])
    assert rest == ["main", "--config=gpt", "--workdir=/tmp/w", "--mode=eval"]
    assert overrides == ["train.steps=2", "train.progress=true", "optim.lr=1e-3",
                         "eval.every_epoch=false", "eval.every=-1", "train.progress=true"]


def test_old_experiments_paths_and_a_users_own_config_file(tmp_path):
    # The configs lived in experiments/ of the repository: those paths still name them.
    out = cli("--config=experiments/gpt.py", "--help")
    assert out.returncode == 0 and "  data.name = 'python_stdlib'" in out.stdout
    mine = tmp_path / "mine.py"
    mine.write_text("from attention_jax.configs import gpt\n\n"
                    "def get_config(arg=None):\n"
                    "    c = gpt.get_config(arg)\n"
                    "    c.optim.lr = 0.0123  # found by my sweep\n"
                    "    return c\n")
    out = cli(f"--config={mine}:variant=gpt-tiny-rope", "--help")
    assert out.returncode == 0, out.stderr
    assert "  optim.lr = 0.0123" in out.stdout and "  model.variant = 'gpt-tiny-rope'" in out.stdout
    # the user's own comment explains the key, after the general meaning
    assert ("  optim.lr = 0.0123\n      peak learning rate, reached after warmup. This config: "
            "found by my sweep.\n") in out.stdout


def test_help_exits_0_with_modes_configs_and_a_configs_keys():
    out = cli("--help")
    assert out.returncode == 0, out.stderr
    assert "[--mode=train|eval|sample|embed|classify|translate]" in out.stdout
    assert "\n  gpt " in out.stdout and "\n  bert_mlm " in out.stdout
    assert "\n  bert_classify " in out.stdout
    assert "--resume_changed" in out.stdout
    assert "optim.lr = " not in out.stdout  # keys need a config: the help says how
    assert "add --help to a command with --config=NAME" in out.stdout
    out = cli("--config=gpt", "--help")
    assert out.returncode == 0
    assert "  optim.lr = 0.003" in out.stdout and "  data.name = 'python_stdlib'" in out.stdout
    # each key with what it means, wrapped under it
    assert ("  train.keep_checkpoints = 3\n      the newest checkpoints kept in the workdir; "
            "older are deleted.\n  train.log_every = 20\n") in out.stdout
    assert "  eval.sample_top_k = 40" in out.stdout
    assert "each 'This config:' comment" not in out.stdout
    # A key set beside --help: the user's value, the config's own and why; and a word that
    # the config's comments are of its own values.
    out = cli("--config=gpt", "--help", "--config.data.seq_len=64")
    assert ("  data.seq_len = 64\n      Set on the command line; the config gives 128: tokens "
            "per packed row.\n") in out.stdout
    assert ("  (each 'This config:' comment is of the config's own value; one that derives "
            "from a key set\n   on the command line") in out.stdout
    # A task that samples nothing lists no sampling keys, and says where they go.
    out = cli("--config=bert_classify", "--help")
    assert "eval.sample_top_k =" not in out.stdout and "  eval.batch_size = 64" in out.stdout
    assert ("  (left out, as task 'bert_classify' does not read them: config.eval.sample_prompts "
            "(read by\n   encdec, gpt, rnn_seq2seq); config.eval.sample_tokens, "
            "config.eval.sample_temperature,\n   config.eval.sample_top_k, "
            "config.eval.sample_top_p, config.train.loss_chunk_size,\n   "
            "config.train.loss_kernel (read by gpt); config.eval.beam_size (read by encdec,\n"
            "   rnn_seq2seq))\n  data.cache_dir = ''\n") in out.stdout
    out = cli("--config=encdec", "--help")  # greedy translations: the prompts only
    assert "  eval.sample_prompts = " in out.stdout and "eval.sample_top_k =" not in out.stdout
    assert "train.loss_kernel =" not in out.stdout  # the GPT's loss alone reads it
    # A config's own :ARG arguments are in its docstring, not among its keys: shown too.
    out = cli("--config=gated_mlp", "--help")
    assert "About --config=gated_mlp:\n" in out.stdout
    assert "Argument `mlp=relu|gelu|swiglu|geglu`" in out.stdout
    # The shipped configs' lines end where their first paragraph does, not mid-sentence.
    assert "(Devlin et al. 2019) on the offline stdlib corpus." in cli("--help").stdout


def test_out_of_range_values_fail_before_anything_runs(tmp_path):
    line = one_error_line(cli("--config=gpt", f"--workdir={tmp_path}",
                              "--config.optim.lr=-1e-3"))
    assert line == "error: config.optim.lr=-0.001 is out of range; valid: optim.lr > 0"
    line = one_error_line(cli("--config=gpt", f"--workdir={tmp_path}",
                              "--config.optim.warmup_steps=-7"))
    assert line.startswith("error: config.optim.warmup_steps=-7 is out of range")
    line = one_error_line(cli("--config=gpt", f"--workdir={tmp_path}", "--config.optim.lr=fast"))
    assert line == "error: config.optim.lr='fast' must be a float (now 0.003)"
    assert not os.path.exists(tmp_path / "config.json")


def test_unknown_dataset_tokenizer_and_unprepared_catalogue_dataset(tmp_path, data_dir):
    work = f"--workdir={tmp_path}"
    line = one_error_line(cli(*TINY_GPT, work, f"--config.data.data_dir={data_dir}",
                              "--config.data.name=pyhton_stdlib"))
    assert line.startswith("error: config.data.name='pyhton_stdlib' (did you mean "
                           "'python_stdlib'?): Unknown dataset 'pyhton_stdlib'")
    line = one_error_line(cli(*TINY_GPT, work, f"--config.data.data_dir={data_dir}",
                              "--config.data.tokenizer=bytes"))
    assert line == ("error: config.data.tokenizer='bytes' is unknown; valid: ['char', 'byte', "
                    "'wordpiece', 'bpe'] (did you mean 'byte'?)")
    # Not prepared: the message goes on with the command that prepares it (no traceback).
    out = cli(*TINY_GPT, work, f"--config.data.data_dir={tmp_path / 'empty'}",
              "--config.data.name=lm1b")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: config.data.name='lm1b': Dataset 'lm1b' is not "
                                 "prepared in data_dir")
    assert "tfds build lm1b" in out.stderr


def test_eval_without_a_checkpoint(tmp_path, data_dir):
    line = one_error_line(cli(*TINY_GPT, f"--workdir={tmp_path}", "--mode=eval",
                              f"--config.data.data_dir={data_dir}"))
    assert line == (f"error: --mode=eval: no checkpoint in {tmp_path}/checkpoints: train "
                    f"first (--mode=train with this --workdir)")


# ---------------------------------------------------------- a run, quiet, in a log file
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TINY_GPT trained on an fsdp × tensor mesh into a fresh data dir (so the offline
    dataset is built here), without the XLA cache so compile-time warnings show."""
    root = tmp_path_factory.mktemp("cli")
    workdir, data = str(root / "run"), str(root / "tfds")
    args = [*TINY_GPT, f"--workdir={workdir}", f"--config.data.data_dir={data}",
            "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
    return workdir, args, cli(*args, cache=False)


@pytest.mark.slow
def test_a_run_says_where_its_outputs_are_and_prints_no_third_party_noise(trained):
    workdir, _, out = trained
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("building the offline dataset text_corpus/python_stdlib_first6 ")
    assert lines[0].endswith("(once; nothing is downloaded)")
    assert lines[1] == (f"workdir {workdir}: config.json, checkpoints/ (every 200 steps and "
                        f"at the end), metrics.jsonl and tensorboard/ (every 2 steps), tokenizer/")
    # stdout is a pipe: one plain line per logged window, no carriage-return bar.
    assert any(line.startswith("step 2/2  loss ") and "tokens/s" in line for line in lines)
    assert "\r" not in out.stdout + out.stderr
    assert f"workdir {workdir}: checkpoints/ up to step 2, metrics.jsonl" in out.stdout
    assert "--- sample from 'def '" in out.stdout
    for noise in ("Downloading and preparing", "downloaded and prepared",
                  "Using custom data configuration", "read only", "read_only=True",
                  "Involuntary full rematerialization", "Traceback"):
        assert noise not in out.stdout + out.stderr, noise


@pytest.mark.slow
def test_sampling_on_an_fsdp_tensor_mesh_reshards_nothing(trained):
    """Three prompts on a mesh whose batch axes hold 4 devices (data 2 × fsdp 2), no XLA
    cache: the sampling jit compiles without an involuntary full rematerialization."""
    workdir, args, _ = trained
    out = cli(*args, "--mode=sample", cache=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("--- prompt ") == 3
    assert "Involuntary full rematerialization" not in out.stderr
    assert "read only" not in out.stderr and "read_only=True" not in out.stderr
    none = cli(*args, "--mode=sample", "--config.eval.sample_prompts=()")  # it printed nothing
    assert none.returncode == 0 and ("\nnothing to sample: config.eval.sample_prompts is "
                                     "empty") in none.stderr


@pytest.mark.slow
def test_resuming_a_changed_config_stops_unless_asked(trained):
    workdir, args, first = trained
    assert first.returncode == 0
    line = one_error_line(cli(*args, "--config.optim.lr=1e-3", "--config.optim.b2=0.99"))
    assert line == (f"error: {workdir} holds a run at step 2 trained with another config: "
                    f"optim.b2: 0.95 -> 0.99, optim.lr: 0.003 -> 0.001. To resume it with the "
                    f"new values anyway pass --resume_changed (train_and_evaluate(..., "
                    f"resume_changed=True)); to train from scratch use a new --workdir.")
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["optim"]["lr"] == 0.003  # untouched

    out = cli(*args, "--config.optim.lr=1e-3", "--config.train.steps=3", "--resume_changed")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"resuming step 2 with config changes: optim.lr: 0.003 -> 0.001, train.steps: "
            f"2 -> 3 (the learning-rate schedule now spans 3 steps, not 2; to keep the old "
            f"one, stop this run and run it again with --config.optim.decay_steps=2 "
            f"--resume_changed, or next time extend with --config.optim.decay_steps=2 beside "
            f"--config.train.steps); the previous config is kept "
            f"as {workdir}/config_until_step_2.json") in out.stdout
    with open(os.path.join(workdir, "config_until_step_2.json")) as f:
        assert json.load(f)["optim"]["lr"] == 0.003
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["optim"]["lr"] == 0.001
    # The end of the run is one line; the records are in the file it names.
    assert "done: step 3; " in out.stdout and " loss " in out.stdout
    assert f"; every record in {workdir}/metrics.jsonl" in out.stdout
    # The window of step 3 began at the resume: one step of a log_every=2 window, marked.
    assert workdir_lib.last_records(workdir)["train"]["steps_in_window"] == 1

    # Nothing left to do: the summary shows the last records of metrics.jsonl.
    out = cli(*args, "--config.optim.lr=1e-3", "--config.train.steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: step 3; " in out.stdout
    assert workdir_lib.last_records(workdir)["train"]["step"] == 3
    assert "resuming" not in out.stdout  # same config as config.json now: no note

    # Extending it needs neither --config nor its overrides again ("--config is required
    # to train" before, and without an override: "data.max_files: 6 -> 0").
    out = cli(f"--workdir={workdir}", "--config.train.steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"training the run's own config ({workdir}/config.json) with train.steps=4" in out.stderr
    assert "done: step 4; " in out.stdout


# ------------------------------------------------------------------ installed, not editable
@pytest.mark.slow
def test_a_wheel_install_trains_a_shipped_config_from_any_directory(tmp_path, data_dir):
    """`pip install .` (a wheel, not the editable checkout): the configs ship inside the
    package, so the console script trains one by name from a directory that holds
    nothing of the repository."""
    pip = [sys.executable, "-m", "pip", "-q"]
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), REPO],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("attention_jax-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = subprocess_env(8)
    env["PYTHONPATH"] = str(site)  # the wheel's files only, not the checkout
    where = subprocess.run([sys.executable, "-c", "import attention_jax.configs as c; "
                            "print(c.__file__)"], env=env, cwd=elsewhere, capture_output=True,
                           text=True, timeout=60)
    assert where.stdout.startswith(str(site)), where
    out = subprocess.run([str(site / "bin" / "attention-jax"), *TINY_GPT,
                          f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}"],
                         env=env, cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "2")


def test_a_model_too_large_for_the_device_is_one_line_not_a_hang(tmp_path):
    """An init that could not allocate its parameters (a 4 TiB MLP here) left the run
    waiting forever, idle, in device_get of the step counter (an output of the same
    computation); a step too large for memory was XLA's 50-line traceback."""
    line = one_error_line(cli(*TINY_GPT, f"--workdir={tmp_path / 'big'}",
                              "--config.model.mlp_dim=68719476736", "--config.mesh.num_devices=1",
                              timeout=120))
    assert line.startswith("error: the run does not fit this device's memory (RESOURCE_EXHAUSTED"
                           ": Out of memory allocating "), line
    assert "valid: a smaller train.batch_size" in line and "model.remat_policy" in line


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_metric_writer_leaves_torch_unimported(tmp_path):
    """tensorboardX imports torch wherever it is installed (1.2 s of every run's start on
    the 2-core CPU host); the run's writer keeps it out, and torch still imports after."""
    code = ("import sys\n"
            "from attention_jax import workdir\n"
            "w = workdir.MetricWriter(sys.argv[1])\n"
            "w.write(1, 'train', {'loss': 1.5})\n"
            "w.close()\n"
            "print('torch' in sys.modules)\n"
            "import torch\n"
            "print(torch.tensor([2.0]).item())\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "2.0"]
    assert len(os.listdir(tmp_path / "tensorboard")) == 1  # the events were written


def _maps_jaxlib(pid: int) -> bool:
    """Whether process `pid` has loaded a library of jaxlib (it is importing JAX)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f"{os.sep}jaxlib{os.sep}" in f.read()
    except OSError:  # gone
        return False


@pytest.mark.parametrize("when", ["importing", "starting"])
def test_ctrl_c_outside_training_s_loop_is_one_line(tmp_path, when):
    """A SIGINT while Python imports JAX, or while the run loads its data and compiles,
    before training's own handler exists: it printed Python's KeyboardInterrupt
    traceback (and, inside XLA's compiler, a segmentation fault after it); now exit code
    130 and one line."""
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "attention_jax.main", *TINY_GPT,
                          "--config.train.steps=100000", f"--workdir={tmp_path / 'run'}"],
                         env=subprocess_env(8), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = []
    if when == "importing":
        # Once jaxlib's libraries are mapped, Python is importing JAX, and main.py set its
        # handler before its first import. (A fixed second's sleep raced a loaded host's
        # interpreter start-up: a SIGINT before the handler is Python's own traceback.)
        deadline = time.time() + 120
        while not _maps_jaxlib(p.pid):
            assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:]
            time.sleep(0.01)
    else:
        for line in p.stdout:  # printed once the config and workdir are set up
            seen.append(line)
            if line.startswith("workdir "):
                break
    p.send_signal(signal.SIGINT)
    out = "".join(seen) + p.communicate(timeout=120)[0]
    lines = [line for line in out.splitlines() if line.strip()]
    if any("received SIGINT" in line for line in lines):  # a very fast host: in the loop
        assert p.returncode == 130 and "saved checkpoint" in out
        return
    assert p.returncode == 130, out[-3000:]
    assert lines[-1] == ("stopped by SIGINT: the workdir keeps its last committed checkpoint "
                         "(a save still being written is dropped); run again to resume")
    assert "Traceback" not in out


def test_an_error_s_exit_leaves_threads_that_never_end():
    """A checkpoint save that failed as the object store went away left orbax's threads
    (no daemons) waiting for each other's signals for 5 minutes; Python's exit joins them
    first, so the run said its error and hung on. main's exit after an error waits
    THREAD_GRACE_S for such threads, then leaves without them and says so; a clean exit
    is untouched."""
    program = (
        "import threading, time, sys\n"
        "from attention_jax import main\n"
        "main.THREAD_GRACE_S = 3.0\n"
        "stuck = threading.Event().wait if sys.argv[1] == '1' else lambda: time.sleep(1)\n"
        "threading.Thread(target=stuck, name='save_finalize').start()\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('joined', flush=True)),\n"
        "                 name='done').start()\n"
        "main.exit_with(int(sys.argv[1]))\n")
    p = subprocess.run([sys.executable, "-c", program, "1"], env=subprocess_env(1), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "joined\n"  # the grace lets a thread end
    assert p.stderr.strip().splitlines()[-1] == (
        "note: exiting without 1 background thread(s) still waiting after the error "
        "(save_finalize)")
    # A clean exit is Python's own: it joins every thread, one of 1 s here.
    p = subprocess.run([sys.executable, "-c", program, "0"], env=subprocess_env(1), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, "joined\n", "")
