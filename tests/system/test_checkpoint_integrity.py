"""Damaged checkpoints (issue 14): real orbax checkpoints of the tiny LM (tiny.py) on disk,
damaged the ways a disk, a copy or a person damages them; the rerun of the same training
falls back to the newest intact step and continues exactly like an uninterrupted run, or
stops with a one-line message. Also: digests detect one flipped bit and do not depend on
the mesh, the verifier's table, and metrics.jsonl after a resume.

One 15-step run (checkpoints 5, 10, 15) is shared by all cases; each case damages a copy.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from attention_jax import checkpoint, digests, train, verify
from attention_jax import config as config_lib
from attention_jax.errors import ConfigError

STEPS = {"train.checkpoint_every": 5, "train.log_every": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 20-step run (the reference losses) and the first 15 steps of it
    in another workdir (checkpoints 5, 10, 15: the one each case damages a copy of)."""
    root = tmp_path_factory.mktemp("integrity")
    full = train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}),
                                    str(root / "full"))
    base = str(root / "base")
    first = train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 15}), base)
    assert first["losses"] == full["losses"][:15]
    assert sorted(os.listdir(os.path.join(base, "checkpoints"))) == ["10", "15", "5"]
    return {"losses": full["losses"], "base": base}


def _copy(runs, tmp_path) -> str:
    workdir = str(tmp_path / "w")
    shutil.copytree(runs["base"], workdir)
    return workdir


def _step(workdir, step) -> str:
    return os.path.join(workdir, "checkpoints", str(step))


def _array_files(step_dir) -> list[str]:
    """The OCDBT data files the restore reads, largest first: orbax merges the files of
    each process (ocdbt.process_N/d) into state/d when the save commits."""
    d = os.path.join(step_dir, "state", "d")
    if not os.path.isdir(d):
        d = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
    return sorted((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize, reverse=True)


def _overwrite(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# Each damage, done to one step folder, as the table lists them.
def _delete_array_file(d):
    os.remove(_array_files(d)[0])


def _truncate_array_file(d):
    path = _array_files(d)[0]
    os.truncate(path, os.path.getsize(path) // 2)


def _overwrite_array_file(d):
    path = _array_files(d)[0]
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(size))


def _garbage_in_the_middle(d):
    path = _array_files(d)[0]
    _overwrite(path, os.path.getsize(path) // 2, np.random.default_rng(1).bytes(64))


def _state_of_another_step(d):
    """Valid files holding other values (a mixed-up copy, or a bad disk sector that a
    file system remapped): only the digests can tell."""
    other = os.path.join(os.path.dirname(d), "5", "state")
    shutil.rmtree(os.path.join(d, "state"))
    shutil.copytree(other, os.path.join(d, "state"))


def _delete_metadata(d):
    os.remove(os.path.join(d, "state", "_METADATA"))


def _garbage_metadata(d):
    with open(os.path.join(d, "state", "_METADATA"), "w") as f:
        f.write('{"tree_metadata": {"params": 7')


def _delete_manifests(d):
    os.remove(os.path.join(d, "state", "manifest.ocdbt"))
    os.remove(os.path.join(d, "state", "ocdbt.process_0", "manifest.ocdbt"))


def _delete_data_state(d):
    os.remove(os.path.join(d, "data", "metadata"))


def _garbage_data_state(d):
    with open(os.path.join(d, "data", "metadata"), "w") as f:
        f.write("{\"next_index\": 2")


def _edited_data_state(edit):
    """A damage that leaves the data state valid JSON, edited by `edit`: only the digest
    can tell."""
    def damage(d):
        path = os.path.join(d, "data", "metadata")
        with open(path) as f:
            state = json.load(f)
        edit(state)
        with open(path, "w") as f:
            json.dump(state, f)
    return damage


def _moved_on(state):  # another position
    state["next_index"] += 16


def _other_records(state):  # read alone (the early check of changed data), it was
    state["num_records"] += 1  # refused as "the training data changed"


def _without_a_key(state):  # a KeyError traceback, read alone
    del state["num_records"]


# The reason each should give (any of): OCDBT keeps the arrays' headers in the same
# files as their values, so a damaged array file can fail the metadata read already.
UNREADABLE = ("state metadata unreadable", "arrays could not be read")
DAMAGES = {
    "array file deleted": (_delete_array_file, UNREADABLE),
    "array file truncated": (_truncate_array_file, UNREADABLE),
    "array file overwritten": (_overwrite_array_file, UNREADABLE),
    "64 garbage bytes in an array file": (_garbage_in_the_middle,
                                          UNREADABLE + ("does not match its digest",)),
    "state of another step": (_state_of_another_step, ("corrupt: arrays ",)),
    "state/_METADATA deleted": (_delete_metadata, ("state metadata missing (no state/_METADATA)",)),
    "state/_METADATA garbage": (_garbage_metadata, ("state metadata unreadable",)),
    "ocdbt manifests deleted": (_delete_manifests, UNREADABLE),
    "data-loader state deleted": (_delete_data_state, ("data-loader state could not be read",)),
    "data-loader state garbage": (_garbage_data_state, ("data-loader state could not be read",)),
    "data-loader state altered": (_edited_data_state(_moved_on),
                                  ("data-loader state does not match its digest",)),
    "data-loader state of other records": (_edited_data_state(_other_records),
                                           ("data-loader state does not match its digest",)),
    "data-loader state without a key": (_edited_data_state(_without_a_key),
                                        ("data-loader state does not match its digest",
                                         "data-loader state could not be read")),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_falls_back_to_the_newest_intact_step(runs, tmp_path, capsys, damage):
    damage_fn, reason = DAMAGES[damage]
    workdir = _copy(runs, tmp_path)
    damage_fn(_step(workdir, 15))
    summary = train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}), workdir)
    streams = capsys.readouterr()
    out = streams.out + streams.err  # (the warnings on stderr, the run's progress on stdout)
    assert "damaged" in streams.err and "damaged" not in streams.out
    # Steps 11-20 are those of the uninterrupted run: restored from step 10, bitwise.
    assert summary["step"] == 20 and summary["losses"] == runs["losses"][10:]
    said = [line for line in out.splitlines() if "damaged" in line]
    assert said and f"checkpoint step 15 in {_step(workdir, 15)} is damaged: " in said[0], out
    assert any(r in said[0] for r in reason), said[0]
    assert len(said[0].replace(workdir, "W")) < 420, said[0]  # the cause, shortened
    assert "falling back to step 10" in out and "resumed from" in out
    # The note about the changed config names the step resumed, not the damaged newest.
    assert "resuming step 10 with config changes: train.steps: 15 -> 20" in out
    # Moved aside, not deleted; training wrote a new step 15 and 20 in its place.
    ckdir = os.path.join(workdir, "checkpoints")
    assert os.path.isdir(os.path.join(ckdir, "15.corrupt", "state"))
    assert {"15", "20", "15.corrupt"} <= set(os.listdir(ckdir))


def test_stop_instead_of_falling_back(runs, tmp_path):
    workdir = _copy(runs, tmp_path)
    _state_of_another_step(_step(workdir, 15))
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    config = tiny.tiny_config(**STEPS, **{"train.steps": 20,
                                          "train.checkpoint_on_damage": "stop"})
    with pytest.raises(checkpoint.NoIntactCheckpointError) as e:
        train.train_and_evaluate(config, workdir)
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"checkpoint step 15 in {_step(workdir, 15)} is damaged: corrupt: arrays "), message
    assert "checkpoint_on_damage='stop'" in message and "[5, 10]" in message
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before  # untouched


def test_no_intact_checkpoint_lists_every_step(runs, tmp_path):
    workdir = _copy(runs, tmp_path)
    _delete_metadata(_step(workdir, 15))
    _state_of_another_step(_step(workdir, 10))
    _delete_data_state(_step(workdir, 5))
    with pytest.raises(checkpoint.NoIntactCheckpointError) as e:
        train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}), workdir)
    message = str(e.value)
    assert "\n" not in message
    for step, why in ((15, "state metadata"), (10, "do not match their digests"),
                      (5, "data-loader state")):
        assert f"step {step}: " in message and why in message.split(f"step {step}: ")[1], message
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "15", "5"]
    assert f"python -m attention_jax.verify {workdir}/checkpoints`" in message, message
    assert "The damaged steps were left as they are" in message


def test_a_step_folder_without_commit_marker_is_ignored(runs, tmp_path):
    """A stray '20' (empty, or a partial copy without orbax's commit marker) does not stop
    the run: step 15 is restored, the stray folder moved aside, and step 20 written anew."""
    for kind in ("empty", "partial"):
        workdir = _copy(runs, tmp_path / kind)
        stray = _step(workdir, 20)
        if kind == "empty":
            os.makedirs(stray)
        else:
            shutil.copytree(_step(workdir, 15), stray)
            os.remove(os.path.join(stray, "commit_success.txt"))
            os.remove(_array_files(stray)[0])
        summary = train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}),
                                           workdir)
        assert summary["losses"] == runs["losses"][15:], kind
        names = os.listdir(os.path.join(workdir, "checkpoints"))
        assert "20.uncommitted" in names and "20" in names, names


def test_an_unfinished_save_s_temporary_folder_is_named_as_it_is_deleted(runs, tmp_path, capsys):
    """A run stopped while orbax wrote step 20 locally leaves `20.orbax-checkpoint-tmp-...`,
    which the checkpoint manager deleted as it opened, unsaid: the run resumed from step 15
    with no word of the step it had been saving."""
    workdir = _copy(runs, tmp_path / "run")
    tmp = _step(workdir, 20) + ".orbax-checkpoint-tmp-1764316800"
    shutil.copytree(_step(workdir, 15), tmp)
    os.remove(os.path.join(tmp, "commit_success.txt"))
    summary = train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}), workdir)
    assert summary["losses"] == runs["losses"][15:]
    err = capsys.readouterr().err
    assert (f"warning: checkpoint folder {tmp}: the save of step 20 did not finish (the run "
            f"stopped during it): deleted, as orbax deletes unfinished saves") in err, err
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "20"
    assert not os.path.exists(tmp)


def test_a_flipped_bit_on_disk_never_restores_silently(runs, tmp_path):
    """One flipped bit at several places of the largest array file: each restore either
    raises CheckpointDamagedError or gives back exactly the saved values."""
    config = tiny.tiny_config(**STEPS)
    s = train.setup(config, runs["base"], read_only=True)
    with jax.set_mesh(s.mesh):
        saved, _ = s.ckpt.restore(s.abstract, 15)
    saved = jax.tree.map(np.asarray, jax.device_get(saved))
    s.ckpt.close()
    size = os.path.getsize(_array_files(_step(runs["base"], 15))[0])
    outcomes = []
    for i, offset in enumerate(np.linspace(0, size - 1, 9).astype(int)):
        workdir = _copy(runs, tmp_path / str(i))
        path = _array_files(_step(workdir, 15))[0]
        with open(path, "rb") as f:
            f.seek(offset)
            byte = f.read(1)[0]
        _overwrite(path, offset, bytes([byte ^ (1 << (i % 8))]))
        ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
        try:
            with jax.set_mesh(s.mesh):
                state, _ = ck.restore(s.abstract, 15)
            for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(saved),
                            strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
            outcomes.append("unchanged")
        except checkpoint.CheckpointDamagedError as e:
            assert "checkpoint step 15" in str(e) and "\n" not in str(e)
            outcomes.append("detected")
        finally:
            ck.close()
    assert "detected" in outcomes, outcomes


def test_digest_detects_one_flipped_bit_in_any_array(runs):
    """Flip one bit of one element of each array of a trained state: its digest changes
    (and only its digest)."""
    config = tiny.tiny_config(**STEPS)
    s = train.setup(config, runs["base"], read_only=True)
    with jax.set_mesh(s.mesh):
        state, _ = s.ckpt.restore(s.abstract, 15)
    s.ckpt.close()
    host = jax.tree.map(np.asarray, jax.device_get(state))
    recorded = digests.state_digests(host)
    assert recorded == digests.state_digests(state)  # numpy and sharded: the same
    rng = np.random.default_rng(0)
    paths = digests.tree_paths(host)
    for path, leaf in paths:
        words = leaf.copy().reshape(-1).view(np.uint32)
        words[rng.integers(words.size)] ^= np.uint32(1 << int(rng.integers(32)))
        flipped = dict(paths)
        flipped[path] = words.view(leaf.dtype).reshape(leaf.shape)
        changed = digests.state_digests(flipped)
        assert changed[path]["digest"] != recorded[path]["digest"], path
        assert sum(changed[p] != recorded[p] for p, _ in paths) == 1
    # Two elements swapped: the sum of the words is the same, the position-weighted part not.
    w = host["params"]["embed"].copy()
    w[[0, 1]] = w[[1, 0]]
    assert (digests.state_digests({"w": w})["w"]["digest"][8:]
            != digests.state_digests({"w": host["params"]["embed"]})["w"]["digest"][8:])


def test_saved_on_2x2x2_verifies_and_resumes_on_1_and_4_devices(runs, tmp_path):
    mesh222 = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
    base = str(tmp_path / "base")
    train.train_and_evaluate(tiny.tiny_config(**STEPS, **mesh222), base)
    rows, _ = verify.verify_directory(base)
    assert [(r["step"], r["mesh"], r["status"]) for r in rows] == [
        (10, "data=2 fsdp=2 sequence=1 tensor=2", "ok"), (5, "data=2 fsdp=2 sequence=1 tensor=2", "ok")]
    for name, mesh in (("one", {"mesh.num_devices": 1}),
                       ("four", {"mesh.num_devices": 4, "mesh.data": 1, "mesh.fsdp": 2,
                                 "mesh.tensor": 2})):
        workdir = str(tmp_path / name)
        shutil.copytree(base, workdir)
        resumed = train.train_and_evaluate(tiny.tiny_config(**STEPS, **mesh,
                                                            **{"train.steps": 15}), workdir)
        # The restore verified every array's digest (saved on 8 devices, read on 1 or 4).
        np.testing.assert_allclose(resumed["losses"], runs["losses"][10:15], rtol=1e-5)
        assert os.listdir(os.path.join(workdir, "checkpoints")).count("10.corrupt") == 0


def test_verifier_table(runs, tmp_path, capsys, monkeypatch):
    workdir = _copy(runs, tmp_path)
    _state_of_another_step(_step(workdir, 15))
    _delete_data_state(_step(workdir, 5))
    os.makedirs(_step(workdir, 25))
    from absl import logging as absl_logging
    verbosity = absl_logging.get_verbosity()
    assert verify.main([workdir]) == 1
    # absl's warnings back on after: called in a process, main() left them off for good
    # (the loss kernels' warnings then went unseen by a later test in the same process)
    assert absl_logging.get_verbosity() == verbosity != absl_logging.ERROR
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "saved", "at", "(UTC)", "size", "mesh", "status"]
    rows = {int(line.split()[0]): line for line in lines[1:4]}
    assert sorted(rows) == [5, 10, 15]
    for step, line in rows.items():
        assert "data=8 fsdp=1 sequence=1 tensor=1" in line and " KB " in line, line
    assert rows[10].endswith("  ok")
    assert "DAMAGED: corrupt: arrays opt_state/1/0/count, " in rows[15], rows[15]
    assert rows[15].endswith("do not match their digests"), rows[15]
    assert "DAMAGED: data-loader state could not be read" in rows[5]
    assert rows[5].endswith("; its arrays verify: eval and sampling read this step, training "
                            "resumes from an older one")  # as --mode=eval reads it
    assert lines[4].startswith("25: no commit marker")
    # All intact: exit status 0; nothing was moved by the verifier. A relative path
    # too (orbax wants absolute ones: every step read as DAMAGED).
    assert verify.main([runs["base"]]) == 0
    capsys.readouterr()
    monkeypatch.chdir(os.path.dirname(runs["base"]))
    assert verify.main([os.path.basename(runs["base"])]) == 0
    assert capsys.readouterr().out.count("  ok\n") == 3
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "15", "25", "5"]
    # The folder holding the runs: one line naming them (was an empty table and a "not
    # a checkpoint step" line per run).
    assert verify.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path} is neither a run's workdir nor its checkpoints folder; the runs "
        f"in it: {os.path.basename(workdir)} (verify each: python -m attention_jax.verify ")


def test_verifier_command_line(tmp_path):
    """The command the README and the no-intact-checkpoint message give: a workdir that
    does not exist is exit status 2 with a one-line message; an empty one is status 1;
    a folder of files with no step folder (a text corpus) is neither a workdir nor a
    checkpoints folder (it said "(no committed checkpoints)")."""
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    for workdir, status, said in (
            (tmp_path / "nowhere", 2, "nowhere does not exist"),
            (tmp_path / "corpus" / "a_file", 2, "a_file is a file; valid: a run's"),
            (tmp_path / "corpus", 2, "corpus is neither a run's workdir nor its checkpoints"),
            (tmp_path / "empty", 1, "(no committed checkpoints)")):
        done = subprocess.run([sys.executable, "-m", "attention_jax.verify", str(workdir)],
                              env=subprocess_env(1), cwd=REPO, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == status and said in done.stdout + done.stderr, (
            done.stdout + done.stderr)[-3000:]


def test_metrics_have_one_record_per_step_after_a_resume(runs, tmp_path):
    """The 15-step run logged steps 1-15; the rerun falls back to step 10 (15 damaged) and
    logs 11-20: the file holds each step once, in order, as an uninterrupted run's."""
    workdir = _copy(runs, tmp_path)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 16, "split": "tr')  # a record torn by the crash
    _garbage_in_the_middle(_step(workdir, 15))
    train.train_and_evaluate(tiny.tiny_config(**STEPS, **{"train.steps": 20}), workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 21))
    np.testing.assert_allclose([r["loss"] for r in records], runs["losses"], rtol=1e-6)


def test_config_rejects_an_unknown_damage_policy():
    config = tiny.tiny_config(**{"train.checkpoint_on_damage": "ignore"})
    with pytest.raises(ConfigError, match=r"checkpoint_on_damage='ignore'.*fall_back"):
        config_lib.validate(config)


def test_digest_is_the_same_for_every_sharding():
    """One array, four layouts (replicated, split over 2, 4 and 8 devices in 1 and 2
    dimensions): one digest."""
    x = jnp.arange(8 * 12 * 3, dtype=jnp.float32).reshape(8, 12, 3) * 0.37
    want = digests.state_digests({"x": np.asarray(x)})
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    P = jax.sharding.PartitionSpec
    for spec in (P(), P("a"), P(None, "b"), P("b", "a"), P(("a", "b"))):
        y = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        assert digests.state_digests({"x": y}) == want, spec


def test_the_arrays_names_and_dtypes_are_worked_out_once_per_structure():
    """A save describes the state on the thread that launches the steps: the same
    structure, shapes and dtypes reuse the description (a Python int, numpy scalars and a
    typed PRNG key named as before); another dtype gets its own."""
    state = {"w": jnp.ones((3, 2)), "n": 5, "s": np.float32(2.5), "key": jax.random.key(1)}
    first = digests.state_digests(state)
    assert {k: (v["shape"], v["dtype"]) for k, v in first.items()} == {
        "w": ([3, 2], "float32"), "n": ([], "int64"), "s": ([], "float32"),
        "key": ([], "key<fry>")}
    hits = digests._described.cache_info().hits
    again = digests.state_digests({**state, "w": jnp.zeros((3, 2))})
    assert digests._described.cache_info().hits == hits + 1
    assert again["w"]["digest"] != first["w"]["digest"] and again["n"] == first["n"]
    assert digests.state_digests({**state, "w": jnp.ones((3, 2), jnp.bfloat16)})["w"]["dtype"] == "bfloat16"


def test_digest_computed_on_the_devices_equals_the_host_one():
    """The accelerator path (one jitted program over the sharded arrays) gives the numpy
    digests, for every dtype a train state holds and several layouts; forced here, on
    the CPU devices. Also for a trained state, and it still tells a flipped bit."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(0)
    values = {"f32": rng.standard_normal((8, 12, 3)).astype(np.float32),
              "bf16": rng.standard_normal((4, 16)).astype(jnp.bfloat16),
              "i32": rng.integers(-2**31, 2**31 - 1, (8, 5), dtype=np.int32),
              "u8": rng.integers(0, 255, (16,), dtype=np.uint8),
              "bool": rng.random((8, 2)) < 0.5,
              "step": np.int32(123456), "empty": np.zeros((0, 4), np.float32)}
    want = digests.state_digests(values)
    for spec in (P(), P("a"), P(("a", "b"))):
        sharded = {k: jax.device_put(v, jax.sharding.NamedSharding(
            mesh, spec if np.ndim(v) and np.shape(v)[0] % 8 == 0 else P())) for k, v in values.items()}
        sharded["key"] = jax.random.key(7)
        got = digests.state_digests(sharded, on_device=True)
        assert {k: v for k, v in got.items() if k != "key"} == want, spec
        assert got["key"] == digests.state_digests({"key": jax.random.key(7)},
                                                      on_device=False)["key"]
    flipped = values["f32"].copy()
    flipped.view(np.uint32)[3, 7, 1] ^= np.uint32(1 << 20)
    assert (digests.state_digests({"f32": jnp.asarray(flipped)}, on_device=True)["f32"]
            != want["f32"])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_digest_on_a_gpu_takes_the_device_path_and_equals_numpy():
    """A state that lives on the GPU is digested there (the default path), with the
    numpy digests of its host copy."""
    rng = np.random.default_rng(1)
    host = {"w": rng.standard_normal((64, 48)).astype(np.float32),
            "h": rng.standard_normal((32,)).astype(jnp.bfloat16),
            "step": np.int32(7), "rng": np.asarray(jax.random.key_data(jax.random.key(3)))}
    state = jax.device_put(host, jax.devices()[0])
    assert digests._on_accelerator(state["w"])
    assert digests.state_digests(state) == digests.state_digests(host)


def test_read_metrics_of_a_file_written_before_the_fix(tmp_path):
    """A metrics.jsonl with a resume's repeated steps (as older versions wrote it): the
    analysis tools see each (step, split) once, the resumed run's record winning."""
    from attention_jax.tools import analysis
    rows = ([{"step": s, "split": "train", "loss": 10.0 - s} for s in range(1, 6)]
            + [{"step": 4, "split": "eval", "loss": 9.0}]
            + [{"step": s, "split": "train", "loss": 20.0 - s} for s in range(3, 7)])
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    records = analysis.read_metrics(str(tmp_path))
    assert [(r["step"], r["split"]) for r in records] == [(s, "train") for s in range(1, 7)]
    assert [r["loss"] for r in records] == [9.0, 8.0, 17.0, 16.0, 15.0, 14.0]


TWO_PROCESSES = r"""
import os, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from attention_jax import checkpoint, digests
mesh = jax.make_mesh((2, 2), ("data", "tensor"))  # 2 devices on each process
x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) * 0.3
w = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data", "tensor")),
                                 lambda i: x[i])
state = {"w": w, "step": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
# Each process adds up its own shards; the digest is that of the whole array.
assert digests.state_digests(state) == digests.state_digests({"w": x, "step": np.int32(3)})
ck = checkpoint.Checkpointer(sys.argv[3], save_every=1)
ck.save(1, state, {"next_index": 1})
ck.save(2, state, {"next_index": 2})
ck.wait()
ck.close()
if jax.process_index() == 0:  # step 2's data-loader state: valid JSON, wrong position
    with open(os.path.join(sys.argv[3], "2", "data", "metadata"), "w") as f:
        f.write('{"next_index": 7}')
multihost_utils.sync_global_devices("damaged")
ck = checkpoint.Checkpointer(sys.argv[3], save_every=1)
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)
restored, data_state, step = ck.restore_intact(abstract, say=print)
assert step == 1 and data_state == {"next_index": 1}, (step, data_state)
assert sorted(os.listdir(sys.argv[3])) == ["1", "2.corrupt"], os.listdir(sys.argv[3])
ck.close()
print("RESTORED", jax.process_index(), step)
"""


def test_two_processes_digest_save_and_fall_back_together(tmp_path):
    """jax.distributed with 2 processes × 2 CPU devices: the digest of an array split over
    both processes equals the one-process digest, and both processes agree to fall back
    when a step does not verify (process 0 moves it aside once)."""
    import subprocess
    import sys

    from conftest import REPO, free_port, subprocess_env
    address, directory = f"127.0.0.1:{free_port()}", str(tmp_path / "ck")
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(i), address, directory],
                              env=subprocess_env(2), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"RESTORED {i} 1" in out, out[-3000:]
    assert "falling back to step 1: damaged step 2 moved aside" in outputs[0]


def test_a_reader_restores_a_step_whose_loader_state_alone_is_lost(runs, tmp_path, capsys):
    """Evaluating or sampling needs the arrays, not the data-loader state: a newest step
    whose loader state was lost fell back to an older step for a reader too. Training
    still refuses it (the data position is gone) and falls back."""
    from attention_jax import runs as runs_lib
    workdir = _copy(runs, tmp_path)
    _delete_data_state(_step(workdir, 15))
    run = runs_lib.open_run(workdir)
    said = capsys.readouterr()
    assert run.step == 15 and "falling back" not in said.out + said.err
    setup = train.setup(tiny.tiny_config(**STEPS), workdir, read_only=True)
    try:
        with pytest.raises(checkpoint.CheckpointDamagedError, match="data-loader state could "
                                                                     "not be read"):
            setup.ckpt.restore(setup.abstract, 15)
        # a damaged array is damage for a reader as well
        _state_of_another_step(_step(workdir, 15))
        with pytest.raises(checkpoint.CheckpointDamagedError, match="corrupt"):
            setup.ckpt.restore(setup.abstract, 15, need_data=False)
    finally:
        setup.ckpt.close()


def test_a_garbled_json_file_is_said_as_json_s_error():
    """A data-loader state of garbage bytes was said as "could not be read (StopIteration:
    0)": the chain's innermost exception was json's scanner's control flow, not its
    error."""
    import json

    from attention_jax.checkpoint import one_line_error
    try:
        json.loads("garbage\x00")
    except ValueError as e:
        said = one_line_error(e)
    assert said == "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
