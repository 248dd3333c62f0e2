"""Checkpoints off the critical path (issue 35): with async_save, `Checkpointer.save` only
launches device work and returns; a background thread waits for the devices, copies to
the host and writes. Real orbax, real files. Speed is never asserted as time: causal
order is (a state that is not computed yet stays not computed across `save`).
"""

import functools
import gc
import logging
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import background_save, checkpoint, digests


@functools.partial(jax.jit, static_argnums=1)
def _slow(a, steps: int = 800):
    """About a second of matmuls on CPU (800 steps): its result is not ready for a while."""
    return jax.lax.fori_loop(0, steps, lambda i, v: jnp.tanh(v @ a), a)


@pytest.fixture(scope="module")
def seed_matrix():
    a = jnp.full((512, 512), 1e-3) + jnp.eye(512) * 0.5
    _slow(a).block_until_ready()  # compiled once for the module
    return a


def _unfinished_state(a, steps: int = 800):
    """A train-state-like tree whose arrays are outputs of a computation still running."""
    w = _slow(a, steps)
    return {"params": {"w": w, "b": w[0] * 2}, "step": jnp.int32(7) + w[0, 0].astype(jnp.int32)}


def _saved_while_computing(directory, seed_matrix, step: int, steps: int = 800):
    """(checkpointer, state) after `save(step, state)` returned while `state` was still
    being computed, as it must: a save that waited for the devices fails every attempt.
    Up to three attempts, each in its own directory: a process sharing two cores with a
    suite's others can be descheduled for seconds (CI once saw a four-second state ready
    when save returned, where save takes milliseconds), which says nothing about save."""
    for attempt in range(3):
        ck = checkpoint.Checkpointer(f"{directory}/attempt{attempt}", save_every=1)
        state = _unfinished_state(seed_matrix, steps)
        computing = not state["params"]["w"].is_ready()
        assert ck.save(step, state, {"next_index": step})
        if computing and not state["params"]["w"].is_ready():
            return ck, state
        ck.close()  # waits for that save
    raise AssertionError("the state was ready whenever save returned: save waited for the devices")


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def test_save_does_not_wait_for_the_devices(tmp_path, seed_matrix):
    """`save` returns while the state it saves is still being computed; `wait` then
    commits it, and it restores, verifies and equals the values."""
    ck, state = _saved_while_computing(tmp_path, seed_matrix, 5)
    # The step counts as saved while queued: a forced save of the same step is skipped.
    assert ck.all_steps() == [5] and not ck.save(5, state, {"next_index": 5}, force=True)
    ck.wait()
    assert ck.latest_step() == 5 and ck.all_steps() == [5]
    restored, data_state = ck.restore(_abstract(state))  # verifies the digests
    assert data_state == {"next_index": 5}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    assert ck.recorded_digest(5)["arrays"] == digests.state_digests(state)
    ck.close()


def test_the_saved_state_survives_its_donation(tmp_path, seed_matrix):
    """The next train step donates the state's buffers as soon as `save` returns; the
    checkpoint holds the values at save time, not the updated ones, and the device copy
    it was written from is freed once the save is done."""
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"), save_every=1)
    state = _unfinished_state(seed_matrix)
    gc.collect()
    live_before = len(jax.live_arrays())
    assert ck.save(1, state, {"next_index": 1})
    update = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    new_state = update(state)  # launched before the save's thread has read anything
    assert state["params"]["w"].is_deleted()  # donated
    ck.wait()
    # The state's copy the save was written from is gone: the updated state took the
    # place of the donated one, and that is all.
    gc.collect()
    assert len(jax.live_arrays()) <= live_before
    restored, _ = ck.restore(_abstract(new_state))
    expected = jax.tree.map(lambda x: (np.asarray(x) - 1) // 3 if x.dtype == np.int32
                            else (np.asarray(x, np.float64) - 1) / 3, jax.device_get(new_state))
    for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ck.close()


@pytest.mark.parametrize("copy", ["snapshot", "_copy_program"])
def test_snapshot_is_new_buffers_with_the_same_shardings(copy):
    """Both ways of copying (buffer copies on CPU, the jitted program an accelerator
    runs, here on the CPU devices): new buffers, same shardings and values, which outlive
    the donation of the originals."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    P = jax.sharding.PartitionSpec
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8),
                                 jax.sharding.NamedSharding(mesh, P("a", "b"))),
             "rng": jax.random.key(3)}
    want = digests.state_digests(state)
    if copy == "snapshot":
        copied = background_save.snapshot({**state, "host": np.int32(4)})
        assert copied.pop("host") == 4
    else:
        copied = dict(zip(state, background_save._copy_program(list(state.values()))))
    assert copied["w"].sharding == state["w"].sharding
    assert ({s.data.unsafe_buffer_pointer() for s in copied["w"].addressable_shards}.isdisjoint(
        s.data.unsafe_buffer_pointer() for s in state["w"].addressable_shards))
    jax.jit(lambda s: jax.tree.map(lambda x: x, s), donate_argnums=0)(state)
    assert state["w"].is_deleted() and digests.state_digests(copied) == want
    # On CPU the devices report no memory statistics: the copy is always made.
    assert background_save.snapshot_fits(copied) == (True, "")


FAILING_WRITES = r"""
import os, resource, signal, sys
import jax, jax.numpy as jnp
from attention_jax import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
ck = checkpoint.Checkpointer(sys.argv[1], save_every=1)
small = {"w": jnp.ones((16, 16))}
big = {"w": jax.random.normal(jax.random.key(0), (1 << 20,))}  # 4 MB, incompressible
ck.save(1, big, {}); ck.wait()  # compiles the copies before the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
ck.save(2, big, {})  # orbax's thread fails to write it
try:
    ck.wait()
except checkpoint.CheckpointSaveError as e:
    from attention_jax.errors import UserError
    print("AT WAIT:", e)
    print("ONE LINE IN MAIN:", isinstance(e, UserError))
ck.wait()  # said once
ck.save(3, big, {})  # fails on orbax's thread ...
ck.save(4, small, {})  # ... which the save of step 4 finds first on its thread
ck._saves.wait()
try:
    ck.save(5, small, {})
except checkpoint.CheckpointSaveError as e:
    print("AT SAVE:", e)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
ck.save(6, small, {})
ck.close()
print("COMMITTED", ck.committed_steps())
"""


def test_a_failed_background_save_raises_on_the_calling_thread(tmp_path):
    """Writes the file system refuses (a file size limit: a full disk's stand-in, and
    real even for root, whom permissions do not stop): the failure raises at `wait`,
    or at the next `save` when the saving thread found it, naming the step and the
    cause, once; the saves after it work again."""
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    directory = str(tmp_path / "ck")
    proc = subprocess.run([sys.executable, "-c", FAILING_WRITES, directory], cwd=REPO,
                          env=subprocess_env(1), capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert re.search(rf"^AT WAIT: saving checkpoint step 2 in {re.escape(directory)} failed: "
                     r"\w+Error: .*Error writing", out, re.M), out
    assert re.search(r"^AT SAVE: saving checkpoint step 3 in .* failed: \w+Error: .*; "
                     r"not saved either: step 4$", out, re.M), out
    assert "COMMITTED [1, 6]" in out, out
    assert "ONE LINE IN MAIN: True" in out  # a full disk or a store gone is no bug: one line


def test_a_wait_for_a_save_is_said_while_it_lasts():
    """A save that does not finish (an object store gone: tensorstore retries its writes
    for many minutes) is said at each interval while the caller waits, with the time so
    far, and not after the wait ends."""
    said, three = [], threading.Event()

    def say(seconds):
        said.append(seconds)
        if len(said) == 3:
            three.set()
    saves = background_save.SaveThread()
    saves.start(7, lambda: three.wait(30))  # a save that ends once three notes are said
    with background_save.said_while_waiting(say, every=0.05):
        saves.wait()
    after = len(said)
    time.sleep(0.3)
    # Three or more: a fourth may fall between the third and the wait's end on a loaded
    # host (the save's thread and this one each to be scheduled within 0.05 s).
    assert after >= 3 and len(said) == after, said  # none after the wait ended
    assert said == sorted(said) and said[0] >= 0.05


def test_the_checkpointer_says_a_wait_for_its_saves(tmp_path, seed_matrix, monkeypatch, caplog):
    """Checkpointer.wait (and save, waiting for the save before) said as above: the step
    and the folder named."""
    monkeypatch.setattr(background_save, "WAIT_NOTE_S", 0.05)
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"), save_every=1, async_save=True)
    started, noted = threading.Event(), threading.Event()

    # The store stays slow until the wait has said a note (at most 30 s), not for a
    # fixed 0.5 s: a test thread descheduled that long on a loaded host reached `wait`
    # after the write had ended, with nothing left to say.
    def slow_write(*args, **kwargs):  # the real write, after a store's slowness
        started.set()
        noted.wait(30)
        return write(*args, **kwargs)
    write = ck._write
    monkeypatch.setattr(ck, "_write", slow_write)
    say = ck._say_waiting

    def say_and_note(seconds):
        say(seconds)
        noted.set()
    monkeypatch.setattr(ck, "_say_waiting", say_and_note)
    with caplog.at_level(logging.WARNING):
        ck.save(1, {"w": seed_matrix}, {})
        started.wait(10)
        ck.wait()
    notes = [r.getMessage() for r in caplog.records if "checkpoints: waiting" in r.getMessage()]
    assert notes and all(f"the write of step 1 to {tmp_path / 'ck'}" in n for n in notes), notes
    assert ck.committed_steps() == [1]
    ck.close()


def test_synchronous_saves_still_work(tmp_path):
    ck = checkpoint.Checkpointer(str(tmp_path / "ck"), save_every=1, async_save=False)
    state = {"w": jnp.arange(12.0), "step": jnp.int32(2)}
    assert ck.save(2, state, {"next_index": 2}) and ck.latest_step() == 2
    restored, _ = ck.restore(_abstract(state))
    np.testing.assert_array_equal(restored["w"], state["w"])
    ck.close()


def test_prepared_programs_leave_the_first_save_nothing_to_compile(tmp_path, monkeypatch):
    """`prepare` compiles the save's device programs (the state's copy and its digest
    sums) on a thread of its own; the first `save` then compiles nothing on the calling
    thread, and its copy and digests come from those programs (the CPU paths they
    replace are made to fail here), on a state sharded over 8 devices. A state of
    another layout gets none of them."""
    from jax import monitoring
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((8,), ("data",))
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("data"))),
             "b": jax.device_put(jnp.arange(4, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
             "step": jax.device_put(jnp.int32(3), NamedSharding(mesh, P()))}
    compiles = []  # (thread) of every XLA compilation while recording
    recording = [True]

    def listen(event, duration, **kwargs):
        if recording[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(threading.current_thread().name)
    monitoring.register_event_duration_secs_listener(listen)
    try:
        ck = checkpoint.Checkpointer(str(tmp_path / "ck"), save_every=1)
        ck.prepare(state, device_programs=True)
        assert ck._programs.get(state) is ck._programs
        compiled_ahead = list(compiles)
        assert compiled_ahead == ["checkpoint-compile"] * 2, compiled_ahead
        # The CPU paths of the copy and of the digests would fail: the programs serve.
        monkeypatch.setattr(background_save, "_copy_buffers", None)
        monkeypatch.setattr(digests, "array_digest_partial", None)
        assert ck.save(3, state, {"next_index": 3})
        assert compiles == compiled_ahead, compiles  # nothing compiled by the save
        ck.wait()
    finally:
        recording[0] = False
    monkeypatch.undo()
    restored, _ = ck.restore(_abstract(state))  # verifies the digests the programs made
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
    assert ck.recorded_digest(3)["arrays"] == digests.state_digests(state, on_device=False)
    other = {**state, "w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("data")))}
    assert ck._programs.get(other) is None
    ck.close()


def test_saving_says_a_save_is_in_flight_until_it_has_committed(tmp_path, seed_matrix):
    """`saving()` (what bench profile --save polls between windows) is True from `save`
    until the checkpoint has committed, and never waits for it."""
    fresh = checkpoint.Checkpointer(str(tmp_path / "fresh"), save_every=1)
    assert not fresh.saving()
    fresh.close()
    ck, state = _saved_while_computing(tmp_path, seed_matrix, 3)
    assert ck.saving()
    ck.wait()
    assert not ck.saving() and ck.latest_step() == 3
    ck.close()


@pytest.mark.parametrize("pinned_host", [True, False])
def test_orbax_copy_options_write_checkpoints_any_checkpointer_reads(tmp_path, pinned_host,
                                                                     caplog):
    """The save options behind bench profile --save's A/B: orbax's copy through pinned
    host memory (the CPU client has that memory too, so the path runs here) and without
    compression. The files are the standard handler's: a default Checkpointer restores
    and verifies them, the step's metadata names the standard handler, and without
    compression a state of zeros takes far more room on disk than with it."""
    state = {"params": {"w": jnp.zeros((256, 1024)), "b": jnp.arange(8.0)}, "step": jnp.int32(4)}
    sizes = {}
    for compression in (True, False):
        where = tmp_path / f"compression_{compression}"
        # One array per array (a sharded state's format): a packed state on CPU is
        # numpy arrays by the time orbax has it, with no device copy to configure.
        ck = checkpoint.Checkpointer(str(where), save_every=1, pinned_host=pinned_host,
                                     compression=compression, packed=False)
        with caplog.at_level(logging.INFO, logger="absl"):
            assert ck.save(4, state, {"next_index": 4})
            ck.close()
        # orbax says how it moves the arrays to the host
        assert f"enable_pinned_host_transfer={pinned_host}" in caplog.text
        caplog.clear()
        reader = checkpoint.Checkpointer(str(where), read_only=True)
        restored, _ = reader.restore(_abstract(state))  # verifies the digests
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored),
                     jax.device_get(state))
        reader.close()
        meta = (where / "4" / "_CHECKPOINT_METADATA").read_text()
        assert "StandardCheckpointHandler" in meta and "_StateHandler" not in meta
        sizes[compression] = sum(f.stat().st_size for f in (where / "4" / "state").rglob("*")
                                 if f.is_file())
    assert sizes[False] > 20 * sizes[True]  # 1 MiB of zeros: stored, not compressed away


def test_closing_before_any_save_waits_for_orbax_s_cleanup_of_killed_saves(tmp_path):
    """orbax removes the temporary folder of a killed save on a thread it starts when the
    manager opens, and only its first save waits for it. `close` waits too: a run that
    stopped before its first save (a changed config found at resume) exited under that
    thread, whose asyncio work then failed on executors the interpreter had shut down
    and printed a traceback after the run's one-line error. Closing twice is a no-op."""
    directory = tmp_path / "ck"
    killed = directory / "3.orbax-checkpoint-tmp-1700000000000"
    killed.mkdir(parents=True)
    (killed / "partial").write_text("half a save")
    ck = checkpoint.Checkpointer(str(directory), save_every=1)
    ck.close()
    assert not killed.exists() and os.listdir(directory) == []
    ck.close()
