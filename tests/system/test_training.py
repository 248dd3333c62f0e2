"""The trainer on meshes, across processes, through kills and restarts (tiny LM of tiny.py).

Reference: one uninterrupted 20-step run on mesh (data=8) in this process; every other
run must reproduce its losses (within float tolerance across meshes, exactly when the
mesh and program are the same).
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from attention_jax import checkpoint, sharding, steps, train
from conftest import finish, free_port, start_worker, subprocess_env

MESHES = {
    "1 device": {"mesh.num_devices": 1},
    "data=8": {"mesh.data": 8},
    "data=2,fsdp=2,tensor=2": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
    "fsdp=8": {"mesh.data": 1, "mesh.fsdp": 8},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 steps on (data=8), checkpoints at 10 and 20."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    summary = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 20}), workdir)
    return {"losses": summary["losses"], "params": tiny.flat_params(summary["state"]),
            "param_sums": tiny.param_sums(summary["state"]), "workdir": workdir}


def _close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=0)


def test_loss_trajectory_is_the_same_on_every_mesh(reference, tmp_path):
    first10 = reference["losses"][:10]
    assert first10[-1] < first10[0] - 0.5, "the tiny model should learn in 10 steps"
    for name, mesh in MESHES.items():
        summary = train.train_and_evaluate(tiny.tiny_config(**mesh), str(tmp_path / name))
        assert len(summary["losses"]) == 10, name
        _close(summary["losses"], first10)
    # The same comparison is sensitive: another seed (data order and init) differs.
    other = train.train_and_evaluate(tiny.tiny_config(**{"train.seed": 1}), str(tmp_path / "s1"))
    assert abs(other["losses"][0] - first10[0]) / first10[0] > 1e-3


def test_checkpoint_from_one_mesh_resumes_on_others(reference, tmp_path):
    """Saved on (data=2, fsdp=4); restored on (data=8) and on 1 device: the same data
    stream continues (the losses of steps 11-20 equal the uninterrupted run's)."""
    base = str(tmp_path / "base")
    saved = train.train_and_evaluate(
        tiny.tiny_config(**{"mesh.data": 2, "mesh.fsdp": 4}), base)
    _close(saved["losses"], reference["losses"][:10])
    for name, mesh in (("data8", {"mesh.data": 8}), ("one", {"mesh.num_devices": 1})):
        workdir = str(tmp_path / name)
        shutil.copytree(base, workdir)
        resumed = train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 20, **mesh}), workdir)
        assert resumed["step"] == 20 and len(resumed["losses"]) == 10, name
        _close(resumed["losses"], reference["losses"][10:])
        # The data position is part of the checkpoint: 20 steps of 16 examples.
        ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
        assert ck.data_state(20)["next_index"] == 20 * 16


def test_exact_resume_in_a_new_process(reference, tmp_path, read_json):
    """10 steps, a new process, 10 more: identical losses and parameters."""
    workdir, out = str(tmp_path / "w"), str(tmp_path / "out.json")
    finish(start_worker({"train.steps": 10}, workdir, out))
    first = read_json(out)
    assert first["losses"] == reference["losses"][:10]
    finish(start_worker({"train.steps": 20}, workdir, out))
    second = read_json(out)
    assert second["step"] == 20 and second["losses"] == reference["losses"][10:]
    params = np.load(out + ".npz")
    assert sorted(params.files) == sorted(reference["params"])
    for key, value in reference["params"].items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)


def test_two_processes_match_one(reference, tmp_path, read_json):
    """jax.distributed with 2 local processes × 4 CPU devices (gloo collectives) trains
    like 1 process × 8 devices, and both processes save and then restore one checkpoint.
    The mesh is hybrid: data parallelism across the processes (mesh.dcn_data=2, the
    processes as granules) × 4 devices each."""
    workdir = str(tmp_path / "w")

    def run_pair(steps):
        port = free_port()
        procs = [start_worker({"train.steps": steps, "mesh.distributed": True,
                               "mesh.coordinator_address": f"127.0.0.1:{port}",
                               "mesh.num_processes": 2, "mesh.process_id": i,
                               "mesh.cpu_collectives": "gloo", "mesh.dcn_data": 2},
                              workdir, str(tmp_path / f"out{i}.json"), devices=4)
                 for i in range(2)]
        for p in procs:
            finish(p, timeout=240)
        return [read_json(str(tmp_path / f"out{i}.json")) for i in range(2)]

    first = run_pair(10)
    for out in first:
        _close(out["losses"], reference["losses"][:10])
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "10"))
    second = run_pair(12)  # Both processes restore step 10 and continue.
    for out in second:
        assert out["step"] == 12
        _close(out["losses"], reference["losses"][10:12])
    assert second[0]["param_sums"] == second[1]["param_sums"]


KILL_DURING_SAVE = r"""
import os, signal, sys
import jax.numpy as jnp
from attention_jax import checkpoint
ck = checkpoint.Checkpointer(sys.argv[1], save_every=1)
state = {"params": {"w": jnp.full((2048, 4096), 1.0)}, "step": jnp.int32(1)}
ck.save(1, state, {"next_index": 1}); ck.wait()
state = {"params": {"w": jnp.full((2048, 4096), 2.0)}, "step": jnp.int32(2)}
ck.save(2, state, {"next_index": 2})  # Returns once the async write has started.
# Kill only once the write has put something on disk (on a fast machine the background
# thread may not have created its temporary folder yet when save() returns).
import time
deadline = time.time() + 30
while time.time() < deadline and not [n for n in os.listdir(sys.argv[1]) if n != "1"]:
    time.sleep(0.0005)
os.kill(os.getpid(), signal.SIGKILL)
"""


_KILLED_STATE = {"params": {"w": jax.ShapeDtypeStruct((2048, 4096), np.float32)},
                 "step": jax.ShapeDtypeStruct((), np.int32)}


def _saved_whole_before_the_kill(directory: str) -> bool:
    """Whether step 2 was committed, whole and verified, before KILL_DURING_SAVE's kill:
    the write ended while the killing thread waited for a core (a loaded host), so the
    kill was not during the save. A step 2 that is there but does not restore is no
    such case (the test then fails on it)."""
    if not os.path.isdir(os.path.join(directory, "2")):
        return False
    reader = checkpoint.Checkpointer(directory, read_only=True)
    try:
        state, data_state = reader.restore(_KILLED_STATE, 2)
        return float(state["params"]["w"][0, 0]) == 2.0 and data_state == {"next_index": 2}
    except Exception:  # noqa: BLE001 - damaged: not a save that finished
        return False
    finally:
        reader.close()


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    # Up to three attempts, each in its own directory: one whose save of step 2 had
    # committed before the kill (the killing thread descheduled for the write's length)
    # says nothing about a kill during a save.
    for attempt in range(3):
        directory = str(tmp_path / f"ck{attempt}")
        proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, directory],
                              env=subprocess_env(1), capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        if not _saved_whole_before_the_kill(directory):
            break
    else:
        raise AssertionError("step 2 was committed before the kill in every attempt")
    leftovers = [n for n in os.listdir(directory) if n != "1"]
    assert leftovers and not os.path.isdir(os.path.join(directory, "2")), leftovers
    ck = checkpoint.Checkpointer(directory)
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    state, data_state = ck.restore(_KILLED_STATE)
    assert float(state["params"]["w"][0, 0]) == 1.0 and data_state == {"next_index": 1}
    ck.close()
    # The half-written step was cleaned up when the manager opened the directory.
    assert sorted(os.listdir(directory)) == ["1"]


def test_sigterm_saves_a_final_checkpoint(tmp_path, read_json):
    workdir, out = str(tmp_path / "w"), str(tmp_path / "out.json")
    proc = start_worker({"train.steps": 100000, "train.checkpoint_every": 100000,
                         "train.log_every": 3}, workdir, out)
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    finish(proc)
    result = read_json(out)
    assert result["stopped_by"] == "SIGTERM" and 0 < result["step"] < 100000
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.latest_step() == result["step"]
    # The steps since the last logged window, up to the one the signal stopped, are logged.
    with open(metrics) as f:
        assert json.loads(f.readlines()[-1])["step"] == result["step"]


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = tiny.tiny_config(**{"train.inject_nan_at": 7, "train.checkpoint_every": 5})
    workdir = str(tmp_path / "stop")
    with pytest.raises(train.NonFiniteLossError,
                       match=r"non-finite training loss at step 7 .*last good checkpoint is "
                             r"step 5 .*nonfinite=skip"):
        train.train_and_evaluate(cfg, workdir)
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.all_steps() == [5]
    # Skip mode: step 7's update is dropped, training goes on to the end.
    cfg.train.nonfinite = "skip"
    summary = train.train_and_evaluate(cfg, str(tmp_path / "skip"))
    assert summary["step"] == 10 and len(summary["losses"]) == 9
    assert all(np.isfinite(summary["losses"]))
    assert all(np.isfinite(v).all() for v in tiny.flat_params(summary["state"]).values())


def test_a_non_finite_gradient_of_a_finite_loss_is_said_as_such(tmp_path):
    """A finite loss whose gradient is NaN (0 * sqrt(0)'s derivative): the error said
    "non-finite training loss ... (loss=6.6, ...)"."""
    cfg = tiny.tiny_config(**{"train.steps": 2, "train.log_every": 1})
    task = tiny.make_tiny_task(cfg)

    def loss(params, batch, rng, is_train):
        nll, metrics = task.loss(params, batch, rng, is_train)
        w = params["embed"][0, 0]
        return nll + 0.0 * jnp.sqrt(w - jax.lax.stop_gradient(w)), metrics
    with pytest.raises(train.NonFiniteLossError,
                       match=r"^non-finite gradient at step 1 \(loss=6\.\d+, grad_norm=nan\)"):
        train.train_and_evaluate(cfg, str(tmp_path / "w"), task=dataclasses.replace(task, loss=loss))


def test_the_host_waits_only_at_sync_points_and_prefetch_resumes_exactly(reference, tmp_path,
                                                                         monkeypatch):
    """With batches prefetched 3 ahead, the host fetches device values only when it logs
    or checkpoints (not once per step), the losses are the uninterrupted run's, and the
    checkpoint records the position of the batches the steps took, not of those read
    ahead: the resumed run continues with the same data. A non-finite last step in skip
    mode still gets the final checkpoint."""
    fetches = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: fetches.append(1) or device_get(x))
    cfg = tiny.tiny_config(**{"train.prefetch": 3, "train.log_every": 10, "eval.every": -1})
    workdir = str(tmp_path / "w")
    first = train.train_and_evaluate(cfg, workdir)  # 10 steps, a checkpoint at 10
    assert first["losses"] == reference["losses"][:10]
    assert len(fetches) <= 3, f"{len(fetches)} fetches from the device in 10 steps"
    monkeypatch.setattr(jax, "device_get", device_get)
    cfg.train.steps, cfg.train.inject_nan_at, cfg.train.nonfinite = 20, 20, "skip"
    rest = train.train_and_evaluate(cfg, workdir)
    assert rest["losses"] == reference["losses"][10:19]  # step 20 was skipped
    ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ck.all_steps() == [10, 20]


def test_gradient_accumulation_and_bfloat16(reference, tmp_path):
    """Two micro-batches of 8 make the same steps as one batch of 16; bfloat16 compute
    (float32 parameters) trains too, close to the float32 run."""
    accum = train.train_and_evaluate(tiny.tiny_config(**{"optim.grad_accum": 2}), str(tmp_path / "a"))
    _close(accum["losses"], reference["losses"][:10], rtol=2e-5)
    bf16 = train.train_and_evaluate(tiny.tiny_config(**{"train.compute_dtype": "bfloat16"}),
                                    str(tmp_path / "b"))
    _close(bf16["losses"], reference["losses"][:10], rtol=5e-2)
    assert all(v.dtype == np.float32 for v in tiny.flat_params(bf16["state"]).values())


def _weighted_tiny_task(config):
    """The tiny LM with per-token weights, reporting its means' weight where the batch
    carries example weights (the Task contract an eval batch relies on)."""
    from attention_jax.data import loaders
    from attention_jax.models import losses
    task = tiny.make_tiny_task(config)

    def loss(params, batch, rng, is_train):
        logits, _ = task.model.apply({"params": params}, batch["inputs"], train=is_train,
                                     rngs={"dropout": rng})
        example_weight = batch.get(loaders.EXAMPLE_WEIGHT)
        weights = losses.example_weighted(batch["weights"], example_weight)
        nll, metrics = losses.cross_entropy(logits, batch["targets"], weights)
        if example_weight is not None:
            metrics[losses.WEIGHT] = jnp.sum(weights)
        return nll, metrics
    return dataclasses.replace(task, loss=loss)


def test_accumulation_is_the_big_batch_s_mean_over_real_tokens(tmp_path):
    """Micro-batches with 8 and 128 real tokens (rows of padding): the accumulated step's
    loss, gradient and update are the one big batch's, whose mean is over its 136 tokens;
    the mean of the two micro-batches' means (what accumulation once took) is not."""
    from attention_jax.data import loaders
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tiny.VOCAB, (16, tiny.SEQ + 1)).astype(np.int32)
    weights = np.zeros((16, tiny.SEQ), np.float32)
    weights[0::2, 0] = 1  # micro-batch 0 (rows 0, 2, ...): one real token a row
    weights[1::2] = 1     # micro-batch 1: every token real
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}
    # A batch's own example weights (the last 12 rows weigh 0) are kept, not replaced.
    own = {**batch, loaders.EXAMPLE_WEIGHT: (np.arange(16) < 4).astype(np.float32)}
    for batch in (batch, own):
        out = {}
        for accum in (1, 2):
            cfg = tiny.tiny_config(**{"optim.grad_accum": accum, "mesh.data": 2,
                                      "mesh.num_devices": 2, "optim.warmup_steps": 0})
            s = train.setup(cfg, str(tmp_path / str(accum)), task=_weighted_tiny_task(cfg))
            step, _ = steps.jit_steps(s, cfg)
            with jax.set_mesh(s.mesh):
                state, metrics = step(s.init_state(), sharding.shard_batch(batch, s.mesh))
            out[accum] = (steps.fetch(metrics), tiny.flat_params(state))
        (one, params_one), (two, params_two) = out[1], out[2]
        for key in ("loss", "accuracy", "grad_norm"):
            np.testing.assert_allclose(two[key], one[key], rtol=1e-5, err_msg=key)
        for name in params_one:
            np.testing.assert_allclose(params_two[name], params_one[name], rtol=1e-5,
                                       atol=1e-7, err_msg=name)


def test_the_logged_lr_is_the_lr_applied_after_a_skipped_step(tmp_path):
    """With AdamW's moments memoryless (b1 = b2 = 0) and no decay or clipping, each
    parameter moves by exactly the lr applied. A skipped step (train.nonfinite=skip)
    leaves the optimizer's counts where they were, so the schedule runs a step behind
    the step counter; the logged lr once read the step counter and said otherwise."""
    cfg = tiny.tiny_config(**{"train.nonfinite": "skip", "train.inject_nan_at": 2,
                              "mesh.num_devices": 1, "optim.warmup_steps": 5,
                              "optim.b1": 0.0, "optim.b2": 0.0, "optim.eps": 1e-12,
                              "optim.weight_decay": 0.0, "optim.clip_norm": 0.0})
    s = train.setup(cfg, str(tmp_path))
    step, _ = steps.jit_steps(s, cfg)
    rng = np.random.default_rng(0)
    logged, applied = [], []
    with jax.set_mesh(s.mesh):
        state = s.init_state()
        for _ in range(4):
            tokens = rng.integers(0, tiny.VOCAB, (16, tiny.SEQ + 1)).astype(np.int32)
            batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
            before = tiny.flat_params(state)
            state, metrics = step(state, sharding.shard_batch(batch, s.mesh))
            after = tiny.flat_params(state)
            logged.append(float(steps.fetch(metrics)["lr"]))
            applied.append(max(float(np.abs(after[k] - before[k]).max()) for k in after))
    # warmup 0, 0.002, 0.004, ... a step; step 2 (the second) skipped: nothing applied
    # (its lr logged is the one it would have had), and the next takes that lr
    np.testing.assert_allclose(applied, [0.0, 0.0, 0.002, 0.004], atol=1e-6)
    np.testing.assert_allclose(logged, [0.0, 0.002, 0.002, 0.004], atol=1e-7)


@pytest.mark.parametrize("nonfinite, most_copies", [("stop", 2), ("skip", None)])
def test_the_default_step_copies_no_optimizer_state(tmp_path, nonfinite, most_copies):
    """In "stop" mode the compiled step copies none of the AdamW moments (the non-finite
    guard that makes XLA copy each of them, every step, is compiled only for "skip");
    in "skip" mode the guard is there, and so are the copies."""
    import re
    cfg = tiny.tiny_config(**{"train.nonfinite": nonfinite, "mesh.num_devices": 1})
    s = train.setup(cfg, str(tmp_path))
    step, _ = steps.jit_steps(s, cfg)
    with jax.set_mesh(s.mesh):
        batch = {k: jax.ShapeDtypeStruct((16, tiny.SEQ), np.int32) for k in ("inputs", "targets")}
        text = step.lower(s.abstract, batch).compile().as_text()
    entry = text[text.index("ENTRY"):]
    copied = re.findall(r"= \S+ copy\(%([\w.\-]+)\)", entry)
    moments = [c for c in copied if "__mu__" in c or "__nu__" in c]
    if most_copies is None:
        assert moments, "skip mode's guard no longer copies: the comment in train.py is stale"
    else:
        assert not moments and len(copied) <= most_copies, copied


def test_a_signal_during_the_last_step_s_eval_still_stops(tmp_path, monkeypatch):
    """A SIGTERM after the loop's last check (during the final eval or save) was lost:
    the run returned as not stopped, and a sweep went on to train its next point."""
    from attention_jax import steps as steps_lib
    evaluate = steps_lib.evaluate

    def evaluate_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler takes it
        return evaluate(*args, **kwargs)
    monkeypatch.setattr(steps_lib, "evaluate", evaluate_then_signal)
    cfg = tiny.tiny_config(**{"train.steps": 4, "eval.every": 4})
    summary = train.train_and_evaluate(cfg, str(tmp_path / "w"))
    assert summary["step"] == 4 and summary["stopped_by"] == "SIGTERM"


def test_the_summary_line_names_the_step_of_an_eval_older_than_the_run_s_end(tmp_path,
                                                                            monkeypatch):
    """A run stopped between evaluations (or extended with no evaluation) ended with
    "stopped by SIGTERM at step 6; eval loss ...": the loss of step 4's model, read as
    step 6's."""
    from attention_jax import main
    advance, taken = train.Progress.advance, []

    def advance_then_signal(self):
        advance(self)
        taken.append(1)
        if len(taken) == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler takes it
    monkeypatch.setattr(train.Progress, "advance", advance_then_signal)
    workdir = str(tmp_path / "w")
    cfg = tiny.tiny_config(**{"train.steps": 8, "eval.every": 4})
    summary = train.train_and_evaluate(cfg, workdir)
    assert summary["step"] == 6 and summary["stopped_by"] == "SIGTERM"
    line = main._summary_line(summary, workdir)
    assert line.startswith("stopped by SIGTERM at step 6; eval (step 4) accuracy "), line
    monkeypatch.setattr(train.Progress, "advance", advance)
    summary = train.train_and_evaluate(cfg, workdir)  # resumed: evaluated at its step 8
    assert main._summary_line(summary, workdir).startswith("done: step 8; eval accuracy "), summary
    # Extended without evaluating: the eval shown is read back from metrics.jsonl.
    cfg.train.steps, cfg.eval.every = 10, -1
    summary = train.train_and_evaluate(cfg, workdir)
    assert main._summary_line(summary, workdir).startswith("done: step 10; eval (step 8) accuracy ")


@pytest.mark.parametrize("process", [0, 1])
def test_eval_lines_and_stop_notes_come_from_process_0_only(tmp_path, monkeypatch, capsys,
                                                            process):
    """tqdm.write prints whether or not the bar is disabled: every process of a
    multi-process run printed each eval line and the stop note (N copies in a job's
    merged log), where every other line of the run comes from process 0."""
    monkeypatch.setattr(jax, "process_index", lambda *a: process)
    progress = train.Progress(tiny.tiny_config(), str(tmp_path), "tokens", 0)
    progress.eval(5, {"loss": 1.5, "examples": 32})
    progress.note("SIGTERM: saved checkpoint at step 5")
    progress.close()
    out = capsys.readouterr().out
    if process == 0:
        assert "step 5 eval: loss=1.5, examples=32" in out and "SIGTERM: saved" in out
    else:
        assert out == ""


def test_the_window_of_the_compiling_step_leaves_the_compilation_out(tmp_path):
    """Logged every step, a resumed run's first window (its step compiled there) reported
    a throughput of the compile time and a time left of hours."""
    from attention_jax import workdir as workdir_lib
    workdir = str(tmp_path / "w")
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 4, "train.log_every": 1}), workdir)
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 12, "train.log_every": 1}), workdir)
    records = [r for r in workdir_lib.read_records(workdir_lib.path(workdir, workdir_lib.METRICS))
               if r.get("split") == "train"]
    rate = {r["step"]: next(v for k, v in r.items() if k.endswith("_per_sec")) for r in records}
    later = sorted(rate[s] for s in range(7, 13))
    # A window with the compile in it runs about a thousand times slower than the steps
    # after (the resumed run's trace, lowering and cache read: 0.2 s against 0.2 ms on an
    # idle 2-core host, 2026-11-28); without it the first window is still slower, 15-18x
    # for step 1 and 7x for step 5 on that idle host, which a margin of 20 left a
    # millisecond's stall of room (at 5 a test beside it once made step 5 6.5x slower).
    # 100 leaves a loaded host 20 ms and still finds a compile by a factor of ten.
    for first in (1, 5):  # the first step of each run
        assert rate[first] > later[len(later) // 2] / 100, rate
    # A resumed run whose compiling step is a save's sync point, not a log step (5 of
    # checkpoint_every 5, log_every 2): its window left the compilation out too.
    saved_first = str(tmp_path / "s")
    for steps in (4, 16):
        train.train_and_evaluate(tiny.tiny_config(**{
            "train.steps": steps, "train.log_every": 2, "train.checkpoint_every": 5}), saved_first)
    records = [r for r in workdir_lib.read_records(workdir_lib.path(saved_first, workdir_lib.METRICS))
               if r.get("split") == "train"]
    rate = {r["step"]: next(v for k, v in r.items() if k.endswith("_per_sec")) for r in records}
    assert rate[6] > sorted(rate[s] for s in (8, 10, 12, 14, 16))[2] / 100, rate
    line = train._progress_line(5, 12, {"loss": 1.0, "lr": 1e-3, "examples_per_sec": 900.0},
                                "examples", 0.01, 0, compile_s=2.25)
    assert line == "step 5/12  loss 1.0000  lr 1.00e-03  900 examples/s  (compiled in 2.2s)"
    line = train._progress_line(9, 12, {"loss": 1.0, "lr": 1e-3, "examples_per_sec": 900.0},
                                "examples", 4.0, 4)
    assert line.endswith("900 examples/s  0m03s left")


def test_each_window_reports_the_share_of_its_checkpoint_saves(tmp_path):
    """metrics.jsonl says where each window's host time went: a save made at a logged
    step falls in the next window (host_checkpoint_frac > 0 there, 0 where none ran), and
    the host's shares never add up to more than the window."""
    from attention_jax import workdir as workdir_lib
    cfg = tiny.tiny_config(**{"train.steps": 12, "train.log_every": 3,
                              "train.checkpoint_every": 6, "eval.every": -1})
    workdir = str(tmp_path / "w")
    train.train_and_evaluate(cfg, workdir)
    windows = {r["step"]: r for r in workdir_lib.read_records(workdir_lib.path(workdir, workdir_lib.METRICS))
               if r.get("split") == "train"}
    assert sorted(windows) == [3, 6, 9, 12]
    shares = {s: windows[s]["host_checkpoint_frac"] for s in windows}
    assert shares[3] == shares[6] == shares[12] == 0.0 and shares[9] > 0, shares
    # The learning rate is the schedule's at the window's last step (its mean over a
    # warmup lagged the logged step: lr 1.9e-4 beside a warning that it stops at 4e-4).
    from attention_jax.optimizer import make_optimizer
    _, schedule = make_optimizer(cfg.optim, cfg.optim.decay_steps or cfg.train.steps)
    for step, record in windows.items():  # the step counter before the window's last update
        assert record["lr"] == pytest.approx(float(schedule(step - 1)), rel=1e-6)
    for r in windows.values():
        assert r["host_data_frac"] + r["host_dispatch_frac"] + r["host_checkpoint_frac"] <= 1.0
        assert 0.0 <= r["host_gc_frac"] <= 1.0  # apart: it overlaps the others
    # Python collects young objects many times a second: some window holds some.
    assert any(r["host_gc_frac"] > 0 for r in windows.values())


@pytest.mark.parametrize("process", [0, 1])
def test_an_eval_record_is_written_by_process_0_only(tmp_path, monkeypatch, process):
    """--mode=eval on several processes: every process appended the same record to
    evals.jsonl (2 copies of each evaluation with 2 processes; in a bucket, each
    rewrote the object from what it had read, racing)."""
    from attention_jax import workdir as workdir_lib
    monkeypatch.setattr(jax, "process_index", lambda *a: process)
    file = workdir_lib.append_eval_record(str(tmp_path), {"step": 4, "loss": 1.5})
    assert file == workdir_lib.path(str(tmp_path), workdir_lib.EVALS)
    records = workdir_lib.read_records(file)
    assert [r["step"] for r in records] == ([4] if process == 0 else [])


@pytest.mark.parametrize("process", [0, 1])
def test_a_result_line_is_printed_by_process_0_only(capsys, monkeypatch, process):
    """--mode=eval, embed, classify and translate printed their JSON on every process (with
    2 processes, each result twice on a shared log), as the run's summary line did."""
    from attention_jax import main as main_lib
    monkeypatch.setattr(jax, "process_index", lambda *a: process)
    main_lib._say('{"loss": 1.5}')
    assert capsys.readouterr().out == ('{"loss": 1.5}\n' if process == 0 else "")
