"""Checkpoint saves off the training thread: the machinery of checkpoint.Checkpointer.

`Checkpointer.save` runs at a sync point of the training loop and the next train step
donates the state's buffers right after it returns. So on the calling thread it only
*launches* device work: `snapshot`, a copy of the state on its devices (new buffers that
the donation cannot touch), and the digest sums where they run on the devices. Everything
that waits (fetching those sums, numpy digests, orbax's save with its device -> host
copy) runs on a `SaveThread`, one save at a time, in order.

Why only launching stays on the calling thread: with several processes every process
must launch the same device programs in the same order, and a program with collectives
(the digest sums of a sharded state) launched from a thread would interleave with the
training steps differently on different processes and deadlock NCCL/gloo. The thread
waits only on the coordination service (orbax's barriers, see Checkpointer, and
`gather_through_coordination`), never on a device collective.

Cost: one more copy of the state in device memory from `save` until orbax has its host
copy (the thread drops it then); `Snapshots` makes one only where it fits beside training.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from attention_jax import packed_state


# ------------------------------------------------------------------ the state's copy
@jax.jit
def _copy_program(arrays):
    return [jnp.copy(x) for x in arrays]  # a new buffer each, with the input's sharding


def _copy_buffers(arrays):
    """The same copy as buffer copies, shard by shard. XLA:CPU runs a program inline on
    the calling thread when its inputs are ready (the jitted copy of 0.6 GB: 0.3 s on 2
    cores), while these copies run on its thread pool (measured: tools/bench checkpoint).
    Shard by shard because device_put of an array spanning processes onto its own
    sharding is a jitted identity, which forwards its input instead of copying it."""
    shards = [shard for x in arrays for shard in x.addressable_shards]
    copies = iter(jax.device_put([shard.data for shard in shards],
                                 [shard.device for shard in shards], may_alias=False))
    return [jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [next(copies) for _ in x.addressable_shards]) for x in arrays]


def on_cpu(state) -> bool:
    """Whether every array of `state` lives on CPU devices."""
    return all(d.platform == "cpu" for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
               for d in x.sharding.device_set)


def packs_on_device(state, program=None) -> bool:
    """Whether a packed save's copy is packed by a device program (on an accelerator, or
    wherever its programs were compiled ahead) rather than on the host by the saving
    thread (numpy, on CPU devices: XLA:CPU would run the program on the calling thread)."""
    return program is not None or not on_cpu(state)


def snapshot(state, program=None, packed_on_device: bool = False):
    """A copy of `state` that the next train step's donation leaves alone: its arrays
    copied on their devices, launched and not waited for (one jitted program on an
    accelerator, over arrays on one set of devices as a train state's are, or `program`,
    that program compiled ahead by `SavePrograms`; buffer copies on CPU). Leaves that are
    not jax.Arrays (host values) are kept as they are. packed_on_device (a packed save
    where `packs_on_device`): the copy is the state's flat arrays
    (packed_state.pack_on_device), which `program` then makes."""
    if packed_on_device:
        return packed_state.pack_on_device(state, program)
    leaves, treedef = jax.tree.flatten(state)
    at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    arrays = [leaves[i] for i in at]
    if program is None:
        program = _copy_buffers if on_cpu(state) else _copy_program
    for i, copy in zip(at, program(arrays)):
        leaves[i] = copy
    return jax.tree.unflatten(treedef, leaves)


class SavePrograms:
    """The device programs of an async save, compiled ahead on a thread of their own
    for one layout of the state (the shapes, dtypes and shardings of its arrays): the
    state's copy (`snapshot`) and its digest sums (`digests.start_state_digests`).

    Compiled by the first save, they cost the training thread seconds: the first `save`
    of GPT-2 small's 446 arrays held it 6-7 s on an H100, where they compiled (the sums
    alone compile in 2 s on the CPU host). Compiling them while the train step compiles
    and the first steps run leaves that save only their launch. `get` hands them out once compiled, or
    None for a state of another layout (the jitted programs then compile as before).

    on_compiled: called on that thread once both are compiled (the training loop's
    `heap.FrozenHeap.settle`: compiling them for GPT-2 small's 448 arrays left about
    290,000 objects that live as long as the loop, outside a heap frozen before they
    were done; on an H200, 2026-11-26, each full collection then walked them for
    100-170 ms in every other save)."""

    def __init__(self, state, name: str = "checkpoint-compile",
                 on_compiled: Callable[[], object] | None = None, packed: bool = False):
        from attention_jax import digests  # digests imports nothing of this module
        arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
        self._serves = _layout(state), packed  # what `get` hands them out for
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in arrays]
        self.copy = self.sums = None
        self._error: BaseException | None = None
        self._said_layout = False  # a state of another layout was said once

        def compile_both():
            try:
                if packed:  # the copy is the flat arrays; the sums run on the state itself
                    self.copy = packed_state.device_program(state).lower(abstract).compile()
                    self.sums = digests.device_sums.lower(abstract).compile()
                else:
                    self.copy = _copy_program.lower(abstract).compile()
                    # The sums run on the copy: its arrays as the copy program lays them out.
                    copies = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in
                              zip(abstract, self.copy.output_shardings)]
                    self.sums = digests.device_sums.lower(copies).compile()
            except BaseException as e:  # noqa: BLE001 - the save compiles them itself then
                self._error = e
                return
            if on_compiled is not None:
                on_compiled()
        self._thread = threading.Thread(target=compile_both, name=name, daemon=True)
        self._thread.start()

    def get(self, state, packed: bool = False) -> "SavePrograms | None":
        """Self once both programs are compiled for `state`'s layout, packed or not
        (waits for the compilation if it is still running); None if they cannot serve it."""
        self._thread.join()
        if self._error is not None:
            _say_compiled_on_save(f"compiling them ahead failed ({str(self._error)[:200]})")
            self._error, self._serves = None, None  # said once; never used
        if self._serves is None:
            return None
        if (_layout(state), packed) != self._serves:
            if not self._said_layout:
                _say_compiled_on_save("a state laid out unlike the one they were compiled for")
                self._said_layout = True
            return None
        return self


def _say_compiled_on_save(why: str) -> None:
    logging.warning("checkpoints: the save's device programs: %s; the save compiles them on "
                    "the training thread", why)


def _layout(state):
    """What a compiled save program is specific to: the tree and each array's shape,
    dtype and sharding (host values: their type)."""
    leaves, treedef = jax.tree.flatten(state)
    return treedef, [(x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else type(x)
                     for x in leaves]


# Fragmentation and the allocator's own rounding: a copy that fits only to the byte
# does not fit.
HEADROOM = 0.05


def snapshot_fits(state) -> tuple[bool, str]:
    """(whether a copy of `state` fits in each local device's memory beside the most
    training has used there so far, one line saying why not). True where devices report
    no memory statistics (CPU: the copy is host memory)."""
    need: dict = collections.Counter()
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                need[shard.device] += shard.data.nbytes
    for device, nbytes in need.items():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            continue
        peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))
        limit = stats["bytes_limit"]
        if peak + nbytes > (1 - HEADROOM) * limit:
            gib = 2 ** 30
            return False, (f"a device copy of the train state ({nbytes / gib:.2f} GiB on "
                           f"{device}) does not fit beside training (peak {peak / gib:.2f} of "
                           f"{limit / gib:.2f} GiB)")
    return True, ""


class Snapshots:
    """`take(state)`: a copy of the state to save from, or None to save synchronously.
    Copies are made while they fit: decided at the first save, by all processes together
    (`agree(ok)`: whether `ok` holds on every process), from the devices' memory
    statistics, so that a run near its memory limit does not die at its first checkpoint
    after hours; and given up if one cannot be allocated after all. Said once."""

    def __init__(self, agree: Callable[[bool], bool]):
        self._agree = agree
        self.enabled: bool | None = None

    def take(self, state, program=None, packed_on_device: bool = False):
        """program: the copy compiled ahead (`SavePrograms.copy`), or None;
        packed_on_device: see `snapshot`."""
        if self.enabled is None:
            fits, why = snapshot_fits(state)
            self.enabled = self._agree(fits)
            if not self.enabled:
                _say_synchronous(why or "another process has no room for a copy of the state")
        if not self.enabled:
            return None
        try:
            return snapshot(state, program, packed_on_device)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            self.enabled = False
            _say_synchronous("no device memory for a copy of the train state")
            return None


def _say_synchronous(why: str) -> None:
    if jax.process_index() == 0:
        logging.warning("checkpoints: %s: saving synchronously (training waits for each "
                        "save's digests and device-to-host copy)", why)


# ------------------------------------------------- digest sums of several processes
def gather_through_coordination(name: str, timeout_s: float = 600):
    """A `digests.Gather` that exchanges the processes' partial digest sums (a few KB)
    through the coordination service's key-value store instead of a device collective,
    so that it may run on the saving thread. Every process calls it with the same `name`
    (unique among the exchanges in flight: the checkpoint's folder and step); the keys
    are deleted once every process has read them."""
    def gather(mine: np.ndarray) -> np.ndarray:
        from jax._src import distributed  # JAX's client, as sharding._client reads it
        client, me = distributed.global_state.client, jax.process_index()
        key = f"attention_jax/digests/{name}"
        client.key_value_set_bytes(f"{key}/{me}", mine.astype(np.uint32).tobytes())
        parts = [np.frombuffer(client.blocking_key_value_get_bytes(
            f"{key}/{p}", int(timeout_s * 1000)), np.uint32).reshape(mine.shape)
            for p in range(jax.process_count())]
        client.wait_at_barrier(f"{key}/read", int(timeout_s * 1000))  # all read: clean up
        client.key_value_delete(f"{key}/{me}")
        return np.stack(parts)
    return gather


# ------------------------------------------------------------------------ the thread
WAIT_NOTE_S = 60.0  # how often a wait for a save that has not finished is said


@contextlib.contextmanager
def said_while_waiting(say: Callable[[float], None], every: float | None = None):
    """Within: say(seconds waited so far) every `every` seconds (WAIT_NOTE_S) until the
    block ends. A save into an object store that has gone away waits through
    tensorstore's retries, many minutes before it fails; the wait is then said, not
    silent."""
    every = WAIT_NOTE_S if every is None else every
    done, start = threading.Event(), time.monotonic()

    def watch():
        while not done.wait(every):
            say(time.monotonic() - start)
    watcher = threading.Thread(target=watch, name="checkpoint-wait-note", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class SaveThread:
    """Runs one save at a time (a checkpoint step and the function that saves it) on a
    thread of its own; `start` waits for the previous one, so saves run in order and at
    most one copy of the state is held. A save that raises hands its error to the
    calling thread through `failure()`.

    Not a daemon: a script that ends without waiting still finishes its save before the
    interpreter exits."""

    def __init__(self, name: str = "checkpoint-save"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._failure = None  # (step, exception)

    def step(self) -> int | None:
        """The step being saved, or None."""
        thread = self._thread
        return self._step if thread is not None and thread.is_alive() else None

    def start(self, step: int, save: Callable[[], object]) -> None:
        self.wait()
        self._step = int(step)
        self._thread = threading.Thread(target=self._run, args=(save,), name=self.name)
        self._thread.start()

    def wait(self) -> None:
        """Blocks until the save in flight has run (not until orbax has written it)."""
        if self._thread is not None:
            self._thread.join()

    def failure(self):
        """(step, exception) of a save that raised, once; else None. After `wait`."""
        failure, self._failure = self._failure, None
        return failure

    def _run(self, save) -> None:
        try:
            save()  # returning drops the state's copy, once orbax holds its host copy
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            traceback.clear_frames(e.__traceback__)  # its frames hold the state's copy
            self._failure = (self._step, e)
