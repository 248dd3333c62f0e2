"""Checkpoints: orbax's CheckpointManager behind a small interface.

A checkpoint step directory holds three or four items:
  state   the train state pytree (params, optimizer state, step, RNG), written by every
          process for the shards it owns (tensorstore/OCDBT), restorable on any mesh;
          packed (packed_state.py) where every array is whole on each of its devices
          (one device, or replicated; one process): one flat array per top-level entry
          and dtype, 5 for GPT-2 instead of 448, since orbax's Python work per array on
          its saving threads held up the thread launching the train steps (issue 35).
  layout  with a packed state: where each array lies in the flat arrays (JSON).
  data    the data loader's state as JSON (a stream position, independent of the number
          of devices or processes, see data/loaders.py).
  digest  a checksum of every array of the state and of the data state, the mesh the
          state was saved on and the time (JSON, see digests.py).

Saving without stalling training (issue 35): with `async_save`, `save` returns without
waiting for the devices and copies nothing to the host on the calling thread. It launches
a copy of the state on its devices (the next train step donates the state's buffers) and,
on accelerators, the digest sums; a background thread (background_save.py) fetches the
sums or computes them with numpy, and hands the copy to orbax, which copies it to the host
and writes it; the device copy is freed as soon as orbax has its host copy. Cost: one more
copy of the state in device memory while a save is in flight; where the devices' memory
statistics say it would not fit, saves are synchronous, as they were before (said once).
A failed background save raises at the next `save`, `wait` or `close`. A packed state's
copy is its flat arrays, packed by one device program on an accelerator (the digest sums
then run on the state itself, launched before the next step donates it); on CPU the
saving thread packs the copy into host buffers it keeps from save to save.

Crash safety comes from orbax's commit protocol: a step is written into a temporary
directory and renamed (plus a commit marker) only once every process has finished, so
`latest_step()` never sees a half-written checkpoint; leftovers of a killed save are
removed when the next manager opens the directory.

Integrity: the digests depend on each array's global values only, so a checkpoint saved
on one mesh verifies on any other. Restoring verifies them; `restore_intact` falls back to
the newest step that restores and verifies, moving damaged steps aside (`30.corrupt`), and
`python -m attention_jax.verify WORKDIR` prints a table of every step.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from attention_jax import background_save, digests, packed_state, quiet, sharding
from attention_jax.quiet import warn
from attention_jax.errors import UserError


# orbax logs this (a warning) whenever a manager is opened read-only, as every reader of a
# run does on purpose (runs.open_run, warm starts).
READ_ONLY_WARNING = "Given directory is read only=%s"
# What orbax logs when an item's metadata file is missing: our own CheckpointDamagedError
# says it for the step, in one line (_saved_tree).
MISSING_ITEM_WARNING = ('Item "%s" was found in the checkpoint, but could not be restored. '
                        'Please provide a `CheckpointHandlerRegistry`, or call `restore` with '
                        'an appropriate `CheckpointArgs` subclass.')


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint's tree does not match the model (different depth, width, ...)."""


class CheckpointDamagedError(RuntimeError):
    """A committed checkpoint that cannot be restored or does not match its digests.
    The message is one line: the step, its folder and what is wrong."""

    def __init__(self, step: int, path, reason: str):
        self.step, self.path, self.reason = step, str(path), reason
        super().__init__(f"checkpoint step {step} in {path} is damaged: {reason}")


class NoIntactCheckpointError(UserError, RuntimeError):
    """Every committed checkpoint of a directory is damaged (or resume was told to stop)."""


class CheckpointSaveError(UserError, RuntimeError):
    """A save in the background failed (raised on the calling thread, at the next `save`,
    `wait` or `close`); the message names the step, the folder and the cause (a full
    disk, an object store gone): main's one error line, not a traceback, since it is no
    bug of the program's. The steps committed before it are intact."""


# ====================================================================== tree structure
def key_name(k) -> str:
    """The name of one step of a pytree path (dict key, attribute or index), as in
    `flat_shapes`; for callers that name one key (the weight-decay mask, MoE metrics)."""
    return jax.tree_util.keystr((k,), simple=True, separator="/")


def flat_shapes(tree) -> dict[str, tuple[int, ...]]:
    """{'params/block_0/attn/w': shape} for arrays, abstract arrays or orbax metadata."""
    return {path: tuple(getattr(leaf, "shape", ())) for path, leaf in digests.tree_paths(tree)}


def describe_mismatch(expected: dict, found: dict, limit: int = 12) -> str:
    """Human-readable difference between two {key: shape} maps ('' when they agree)."""
    lines = []
    for k in sorted(set(expected) - set(found))[:limit]:
        lines.append(f"  missing from checkpoint: {k} {expected[k]}")
    for k in sorted(set(found) - set(expected))[:limit]:
        lines.append(f"  not in model:            {k} {found[k]}")
    for k in sorted(set(expected) & set(found)):
        if expected[k] != found[k] and len(lines) < 3 * limit:
            lines.append(f"  shape differs:           {k} model {expected[k]} vs "
                         f"checkpoint {found[k]}")
    return "\n".join(lines)


# ============================ step folders, orbax's errors, agreement between processes
def _is_committed(path: epath.Path) -> bool:
    """Orbax's commit marker, written once every item of the step is on disk."""
    return (path / "commit_success.txt").exists()


def step_folders(directory: epath.Path) -> dict[int, epath.Path]:
    """The step folders of a checkpoints folder (committed or not), by step."""
    if not directory.exists():
        return {}
    return {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()}


# What orbax appends to a step's folder name while it writes it (its atomicity module).
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def unfinished_saves(directory: epath.Path) -> dict[int, epath.Path]:
    """The temporary folders of saves that did not finish, by step."""
    if not directory.exists():
        return {}
    found = {}
    for p in directory.iterdir():
        step, suffix, _ = p.name.partition(ORBAX_TMP_SUFFIX)
        if suffix and step.isdigit() and p.is_dir():
            found[int(step)] = p
    return found


def committed_steps_in(directory) -> list[int]:
    """Steps whose folder carries orbax's commit marker, oldest first (no manager opened)."""
    return sorted(s for s, p in step_folders(epath.Path(directory)).items() if _is_committed(p))


def latest_step_in(directory) -> int | None:
    """The newest committed step of `directory`, or None (no manager opened)."""
    steps = committed_steps_in(directory)
    return steps[-1] if steps else None


def _move_aside(path: epath.Path, suffix: str) -> epath.Path:
    """Renames `path` to `path.<suffix>` (or .<suffix>.1, ...): never deleted, so a
    person can inspect it; invisible to orbax, whose steps are integer names."""
    target, n = path.parent / f"{path.name}.{suffix}", 0
    while target.exists():
        n += 1
        target = path.parent / f"{path.name}.{suffix}.{n}"
    if jax.process_index() == 0:
        with quiet.drop_gcsfs(quiet.GCSFS_MOVE_FALLBACK):
            path.rename(target)  # in an object store: a copy of every object, then a delete
    _sync(f"attention_jax_move_aside_{path.name}")
    return target


def _handlers(state) -> dict:
    """CheckpointManager's keyword naming the items' handlers, `state` that of the
    state. orbax finds the handler of an item's arguments (StandardSave, JsonSave, ...)
    by the handler's exact class, so a handler of another class (_StateHandler) goes
    into a registry with the arguments it takes."""
    items = {"state": state, "data": ocp.JsonCheckpointHandler(),
             "digest": ocp.JsonCheckpointHandler(), "layout": ocp.JsonCheckpointHandler()}
    if type(state) is ocp.StandardCheckpointHandler:
        return {"item_handlers": items}
    json_args = (ocp.args.JsonSave, ocp.args.JsonRestore)
    takes = {"state": (ocp.args.StandardSave, ocp.args.StandardRestore),
             "data": json_args, "digest": json_args, "layout": json_args}
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for name, handler in items.items():
        for args in takes[name]:
            registry.add(name, args, handler)
    return {"handler_registry": registry}


def state_handler(pinned_host: bool | None = None, compression: bool = True):
    """orbax's handler of the state item: its StandardCheckpointHandler, or where an
    option differs from orbax's defaults, one whose inner PyTree handler (orbax's own,
    which writes the files) has them set; it keeps the standard handler's name in the
    checkpoint's metadata, so the files and their description are the same."""
    if pinned_host is None and compression:
        return ocp.StandardCheckpointHandler()
    if pinned_host and not all(any(m.kind == "pinned_host" for m in d.addressable_memories())
                               for d in jax.local_devices()):
        # orbax would copy through pageable memory without a word
        logging.warning("checkpoints: pinned_host=True, but these devices have no pinned "
                        "host memory: orbax copies the arrays through pageable memory")
    return _StateHandler(enable_pinned_host_transfer=pinned_host, use_compression=compression)


class _StateHandler(ocp.StandardCheckpointHandler):
    def __init__(self, **options):
        super().__init__()
        if not isinstance(getattr(self, "_impl", None), ocp.PyTreeCheckpointHandler):
            raise RuntimeError(f"orbax-checkpoint {ocp.__version__}: StandardCheckpointHandler "
                               f"no longer delegates to a PyTreeCheckpointHandler; the save "
                               f"options {options} cannot be set")
        # The standard handler's limits on bytes in flight, as it sets them.
        defaults = inspect.signature(ocp.StandardCheckpointHandler.__init__).parameters
        limits = {k: defaults[k].default for k in ("save_concurrent_gb", "restore_concurrent_gb")
                  if k in defaults}
        self._impl = ocp.PyTreeCheckpointHandler(**limits, **options)

    @classmethod
    def typestr(cls) -> str:
        return ocp.StandardCheckpointHandler.typestr()


def _saved_items(step_path: epath.Path) -> list[str]:
    """The items orbax recorded in the step's _CHECKPOINT_METADATA ([] if unreadable)."""
    try:
        meta = json.loads((step_path / "_CHECKPOINT_METADATA").read_text())
        return list(meta.get("item_handlers") or [])
    except Exception:  # noqa: BLE001
        return []


def one_line_error(e: BaseException, where=None, limit: int = 300) -> str:
    """The root cause of an orbax/tensorstore error as one short line (paths inside the
    folder `where` written relative to it: the message names the folder already)."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    # (a StopIteration in the chain is control flow, e.g. json's scanner under its
    # "Expecting value" error: 'StopIteration: 0' said nothing of a garbled file)
    seen = [err for err in seen if not isinstance(err, StopIteration)] or seen
    for err in reversed(seen):  # the innermost message that says something
        text = " ".join(str(err).split())
        if text:
            break
    else:
        err, text = seen[-1], ""
    if where is not None:
        text = text.replace(f"{where}/", "").replace(str(where), ".")
    # tensorstore appends the whole JSON spec of the failed read: noise to a person.
    text = re.sub(r"\s*\[tensorstore_spec=.*?(\]\s*$|$)", "", text)
    text = text.replace('Error opening "zarr" driver: ', "")
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _ignore_late_tensorstore_callbacks() -> None:
    """After a failed read, tensorstore's remaining reads finish on their own threads and
    call back into the event loop orbax has closed by then: each prints a 'RuntimeError:
    Event loop is closed' traceback (dozens for one damaged file) that would bury the
    one-line message. Only those are dropped; every other unraisable error still shows."""
    previous = sys.unraisablehook
    if getattr(previous, "_attention_jax", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook._attention_jax = True
    sys.unraisablehook = hook


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a damaged shard read by one process fails
    the step for all, so they fall back together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.int32(ok)))))


# Where orbax's array writer (tensorstore) can reach: its kvstore is built for gs://
# (tensorstore's gcs driver) or an absolute local path, nothing else (orbax 0.12).
SUPPORTED_URLS = ("gs://",)


def fresh_listings() -> None:
    """gcsfs and s3fs cache directory listings for the life of the process, and only
    their own writes refresh them: a checkpoint step written by tensorstore, or by
    another process, would stay invisible to a reader that listed the folder before (a
    notebook's second open_run, seen here against the emulator). Listings are asked
    for afresh instead: a request per listing, a few per checkpoint or log step. Set
    before the first remote path is touched (filesystems are cached with their options)."""
    import fsspec
    for protocol in ("gcs", "gs", "s3"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


class CheckpointLocationError(UserError, ValueError):
    """Checkpoints asked for in a place orbax cannot write arrays to."""


def check_supported(directory) -> None:
    """One line when `directory` is an object-store URL orbax cannot write arrays to
    (s3://: orbax hands tensorstore only gs:// and local paths)."""
    text = str(directory)
    if "://" in text:
        fresh_listings()
    if "://" in text and not text.startswith(SUPPORTED_URLS):
        raise CheckpointLocationError(
            f"checkpoints in {text}: orbax writes arrays only to gs:// buckets and local "
            f"(or mounted) paths, not {text.split('://')[0]}://; valid: a gs:// workdir, a "
            f"local path, or the bucket mounted as a folder (e.g. mountpoint-s3)")


class _Manager(ocp.CheckpointManager):
    """orbax's CheckpointManager, minus its reading of JAX's preemption sync point.

    JAX's preemption sync manager remembers the last step passed to
    `reached_preemption_sync_point`, and after a SIGTERM agrees on (largest such step of
    any process) + 1 as the step to stop at. The training loop calls it once per step
    (train.StopRequest). orbax calls it too, with a checkpoint's step, when a save starts
    and when it commits, from its own threads, long after the loop has moved on: a save
    of step 4 committing while the loop was at step 7 made the agreed step 5, which every
    process had passed, and a preempted multi-process run trained on until killed. Our
    saves at a stop are forced, so orbax's check only fed its logs and metrics."""

    def reached_preemption(self, step: int) -> bool:
        return False

    def close(self) -> None:
        # orbax removes the temporary folders of killed saves on a thread it starts when
        # it opens, and only its first save waits for that thread. A run that stopped
        # before one (a config mistake found at resume) exited under it: its asyncio work
        # then failed to schedule on the executors the interpreter had shut down, and a
        # traceback followed the run's one-line error. (No such thread: older orbax.)
        await_cleanup = getattr(self, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        super().close()


class Checkpointer:
    """Saves and restores (state, data_state) in `directory` (usually workdir/checkpoints).

    Args:
      directory: where step directories live.
      save_every: a regular save every this many steps (others are skipped unless forced).
      keep: keep the last `keep` checkpoints (older ones are deleted after a save commits).
      async_save: `save` launches a device copy of the state (and the digest sums on an
        accelerator) and returns; a background thread does the rest in order: digests,
        orbax's device -> host copy (the device copy is freed then) and the write. Costs
        one more copy of the state in device memory while a save is in flight; if that
        would not fit (judged at the first save from the devices' peak memory use), saves
        are synchronous: training waits for the digests and the host copy. `wait()`
        blocks until every save has committed; a failed one raises there or at the next
        `save`.
      read_only: for readers of a run that may still be training: nothing is cleaned up,
        moved or written.
      pinned_host: orbax's device -> host copy of the arrays through pinned host memory
        (None: orbax's default, on for a GPU); compression: orbax's zstd compression of
        the arrays (tensorstore compresses on every core of the host). Both exist for
        `bench profile --save`'s A/B of what slows training during a save (issue 35);
        the files read back either way.
      packed: write a state whose arrays are each whole on every device they are on (one
        device, or replicated; one process) as a few flat arrays with their layout
        (packed_state.py: orbax's work per array, in Python on its saving threads, took
        the interpreter from the thread launching the train steps); False: one array in
        the files per array of the state, as a sharded state is always written. Both
        formats restore, onto any mesh.
    """

    def __init__(self, directory, *, save_every: int = 1000, keep: int = 3,
                 async_save: bool = True, read_only: bool = False,
                 pinned_host: bool | None = None, compression: bool = True,
                 packed: bool = True):
        check_supported(directory)
        # A local path made absolute: orbax refuses a relative one ("Checkpoint path
        # should be absolute"), which `verify` given ./run reported as every step DAMAGED.
        directory = str(directory)
        if "://" not in directory:
            directory = os.path.abspath(os.path.expanduser(directory))
        self.directory = epath.Path(directory)
        self.packed = packed
        self.save_every = save_every
        self.read_only = read_only
        self._saves = None if read_only or not async_save else background_save.SaveThread()
        self._snapshots = background_save.Snapshots(agree=all_agree)
        self._programs: background_save.SavePrograms | None = None  # see prepare
        self._host_flat = None  # (layout entries, flat host arrays): see _pack_and_write
        self._writing: int | None = None  # the step orbax may still be writing
        self._reported = None  # orbax's error of that write, once raised (see _wait_for_orbax)
        self._closed = False
        processes = None
        if self._saves is not None and jax.process_count() > 1:
            # orbax's save waits at barriers that are device collectives by default
            # (multihost_utils.sync_global_devices), which must not run on the saving
            # thread beside the train steps; naming the processes makes them barriers of
            # the coordination service (orbax's multihost.get_barrier_sync_fn). orbax
            # then leaves creating the folder to us.
            processes = set(range(jax.process_count()))
            if jax.process_index() == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
        if not read_only:
            self._move_aside_uncommitted()  # (its barrier: the folder exists for all)
        options = ocp.CheckpointManagerOptions(
            # A read-only manager saves and deletes nothing; saying so up front spares
            # orbax's warnings that it overrides these two.
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            # Temporary directories left by a killed save are garbage: remove on open.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only and processes is None,
            multiprocessing_options=ocp.options.MultiprocessingOptions(active_processes=processes),
        )
        # Handlers named up front so that a fresh manager can read metadata (structure
        # checks) before the first restore.
        with quiet.drop_log_messages(READ_ONLY_WARNING):  # read-only is what we asked for
            self.manager = _Manager(
                self.directory, options=options,
                **_handlers(state_handler(pinned_host, compression)))


    # ------------------------------------------------------------------------- query
    def committed_steps(self) -> list[int]:
        """Steps whose folder carries orbax's commit marker, oldest first."""
        return committed_steps_in(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step (never a half-written one), or None."""
        return latest_step_in(self.directory)

    def all_steps(self) -> list[int]:
        """Steps saved, being written or queued to be (committed ones: committed_steps)."""
        # The thread's first: its step is in orbax's list before the thread ends.
        running = self._saves.step() if self._saves is not None else None
        return sorted(set(self.manager.all_steps()) | ({running} - {None}))

    def step_path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _move_aside_uncommitted(self) -> None:
        """A step folder without a commit marker is a save that never finished (or a
        stray copy): orbax would list it and fail on it, and a new save of that step
        would collide with it."""
        uncommitted = [p for _, p in sorted(step_folders(self.directory).items())
                       if not _is_committed(p)]
        # Every process lists before process 0 renames: one listing after the rename would
        # skip _move_aside's sync and leave process 0 waiting in it (a save killed in a
        # gs:// workdir leaves such a folder: orbax writes a step in place there).
        sharding.sync_processes("checkpoint_listing")
        if uncommitted and str(self.directory).startswith(SUPPORTED_URLS):  # gs://
            # In an object store orbax takes a folder without its commit marker for an
            # unfinished save and deletes it as the manager opens: a copy made beside it
            # (a rename is a copy of every object there) was deleted too, after it was
            # said to be kept.
            warn(f"checkpoint folder(s) {', '.join(map(str, uncommitted))} have no commit "
                 f"marker (saves that did not finish): ignored, and deleted as orbax deletes "
                 f"unfinished saves in an object store")
            return
        for path in uncommitted:
            target = _move_aside(path, "uncommitted")
            warn(f"checkpoint folder {path} has no commit marker (a save that did not "
                 f"finish): ignored, moved aside to {target}")
        # On a local disk orbax writes a step into `<step>.orbax-checkpoint-tmp...` and
        # renames it when done; a run stopped during a save leaves that folder, which the
        # manager deletes as it opens (cleanup_tmp_directories). Say so: the run then
        # resumes from an older step than the one it was saving.
        for step, path in sorted(unfinished_saves(self.directory).items()):
            warn(f"checkpoint folder {path}: the save of step {step} did not finish (the run "
                 f"stopped during it): deleted, as orbax deletes unfinished saves")

    # -------------------------------------------------------------------------- save
    def prepare(self, state, *, device_programs: bool | None = None,
                on_compiled: Callable[[], object] | None = None) -> None:
        """Compiles the device programs of an async save of `state` (its copy and digest
        sums) on a thread of their own, so that the first `save` only launches them:
        call it once the state exists (after restoring or initialising it), beside the
        train step's compilation. device_programs: save through them; None: where the
        state lives on an accelerator (on CPU buffer copies and numpy digests are faster
        and compile nothing); True: on CPU too. on_compiled: called on their thread once
        they are compiled (the loop's heap.FrozenHeap.settle: what compiling them made
        lives as long as the loop)."""
        if self._saves is None:
            return
        if device_programs is None:
            device_programs = any(d.platform != "cpu" for x in jax.tree.leaves(state)
                                  if isinstance(x, jax.Array) for d in x.sharding.device_set)
        if device_programs:
            self._programs = background_save.SavePrograms(state, on_compiled=on_compiled,
                                                          packed=self._packs(state))

    def due(self, step: int) -> bool:
        """Whether `step` is one of the regular saves (a multiple of save_every)."""
        return int(step) % self.save_every == 0

    def save(self, step: int, state, data_state: dict[str, Any], *, force: bool = False) -> bool:
        """Starts saving `state` at `step`; True if a save was started.

        Not forced: only when `step` is a multiple of `save_every`. Every process must
        call this with the same step (the write is a collective). The digests are
        committed with the arrays as the step's `digest` item. With `async_save` this
        only launches device work (see the class docstring): `state` may be donated to
        the next step as soon as it returns. A background save that failed raises here.
        """
        # The interval is decided here (orbax's own policy would also save the first
        # step of every run); `force` tells orbax to save whatever its policy says.
        if not force and not self.due(step):
            return False
        if self._saves is not None:
            # One save on the thread at a time, so one copy of the state: the previous
            # one is done unless saves come faster than orbax writes them (orbax would
            # wait for the previous write here too).
            with background_save.said_while_waiting(self._say_waiting):
                self._saves.wait()
            self._raise_failure()
        if int(step) in self.all_steps():
            return False  # Already saved or queued (e.g. a forced final save on a regular step).
        data_state = json.loads(json.dumps(dict(data_state)))  # as it will read back
        layout = packed_state.layout_of(state) if self._packs(state) else None
        packed = layout is not None
        programs = self._programs.get(state, packed) if self._programs is not None else None
        # Where a packed state's copy is packed: by a device program, or on the host by
        # the saving thread (CPU devices without programs compiled ahead).
        packed_on_device = packed and background_save.packs_on_device(
            state, programs and programs.copy)
        copy = (self._snapshots.take(state, programs and programs.copy, packed_on_device)
                if self._saves is not None else None)
        if copy is None:  # synchronous: packed on the host (a device copy did not fit)
            digest = digests.start_record(step, state, data_state)
            if packed:
                state = packed_state.pack_on_host(state)
            return self._write(step, state, data_state, digest, layout)
        # The sums are launched here too, in program order on every process (they may
        # hold collectives); the thread only waits for them. A copy packed on the devices
        # is no longer the state's arrays: then the sums run on the state, launched before
        # the next step can donate it.
        digest = digests.start_record(step, state if packed_on_device else copy, data_state,
                                      gather=background_save.gather_through_coordination(
                                          f"{self.directory}/{int(step)}"),
                                      program=programs and programs.sums)
        write = self._write
        if packed and not packed_on_device:  # a copy on CPU: the saving thread packs it
            write = self._pack_and_write
        self._saves.start(step, functools.partial(write, step, copy, data_state, digest,
                                                  layout))
        return True

    def _packs(self, state) -> bool:
        return self.packed and packed_state.packable(state)

    def _pack_and_write(self, step: int, copy, data_state, digest, layout) -> bool:
        """On the saving thread, a copy of a state on CPU: its digests (numpy over the
        copy), then its flat arrays, copied into host buffers kept from save to save
        (once orbax has written the previous save from them), then orbax's write."""
        digest = digest()
        self._wait_for_orbax()
        if self._host_flat is None or self._host_flat[0] != layout.entries:
            self._host_flat = layout.entries, packed_state.host_buffers(layout)
        flat = packed_state.pack_on_host(copy, out=self._host_flat[1])
        del copy  # the flat arrays hold the same bytes: the copy goes before the write
        return self._write(step, flat, data_state, lambda: digest, layout)

    def _write(self, step: int, state, data_state, digest: Callable[[], dict],
               layout: packed_state.Layout | None = None) -> bool:
        """orbax's save: waits for the previous write to commit (first, so that its
        failure names its step) and for the device -> host copy of `state`, then writes
        on orbax's thread (async) or here. layout: `state` is that layout's flat arrays,
        written in chunks, with the layout as the step's `layout` item."""
        self._wait_for_orbax()
        items = {"data": ocp.args.JsonSave(data_state), "digest": ocp.args.JsonSave(digest())}
        if layout is None:
            items["state"] = ocp.args.StandardSave(state)
        else:
            items["state"] = ocp.args.StandardSave(state, save_args=packed_state.save_args(
                layout, lambda chunk: ocp.SaveArgs(chunk_byte_size=chunk)))
            items["layout"] = ocp.args.JsonSave(layout.to_json())
        self._writing = int(step)  # before orbax's save starts: a wait meanwhile names it
        return self.manager.save(int(step), args=ocp.args.Composite(**items), force=True)

    def _wait_for_orbax(self) -> None:
        """Waits for orbax's write in flight; its failure raises as CheckpointSaveError."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise anything
            if e is self._reported:
                return  # orbax raises it once on each thread that waits: said once here
            self._reported = e
            raise CheckpointSaveError(f"saving checkpoint step {self._writing} in "
                                      f"{self.directory} failed: "
                                      f"{one_line_error(e, self.directory)}") from e

    def _raise_failure(self) -> None:
        """Raises the failure of the background save, once (after `_saves.wait()`)."""
        failure = self._saves.failure() if self._saves is not None else None
        if not failure:
            return
        step, error = failure
        if isinstance(error, CheckpointSaveError):  # it found the previous write failed
            raise CheckpointSaveError(f"{error}; not saved either: step {step}") from error.__cause__
        raise CheckpointSaveError(f"saving checkpoint step {step} in {self.directory} failed: "
                                  f"{one_line_error(error, self.directory)}") from error

    def wait(self) -> None:
        """Blocks until every save started has committed; a failed one raises here
        (once) if it has not at a `save` already."""
        with background_save.said_while_waiting(self._say_waiting):
            if self._saves is not None:
                self._saves.wait()
            try:
                self._wait_for_orbax()
            finally:
                self._raise_failure()

    def _say_waiting(self, seconds: float) -> None:
        # orbax's write in flight is what waits (a save on the thread waits for it too)
        step = (self._writing if self.manager.is_saving_in_progress() or self._saves is None
                else self._saves.step() or self._writing)
        logging.warning("checkpoints: waiting %.0f s for the write of step %s to %s (a store "
                        "that cannot be reached makes tensorstore retry for minutes before "
                        "the save fails; training waits for it)", seconds, step, self.directory)

    def saving(self) -> bool:
        """Whether a save is still in flight (on the background thread or in orbax's
        write); never waits."""
        return ((self._saves is not None and self._saves.step() is not None)
                or self.manager.is_saving_in_progress())

    def close(self) -> None:
        """Waits for the saves in flight (raising a failed one's error), then closes.
        Once: closing a closed Checkpointer does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self.manager.close()

    # ----------------------------------------------------------------------- restore
    def data_state(self, step: int) -> dict[str, Any]:
        """Only the data-loader state of `step` (cheap: no arrays are read)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        return dict(restored["data"])

    def intact_data_state(self, step: int) -> dict[str, Any] | None:
        """The data-loader state of `step`, read alone (no arrays), where it reads and
        matches its recorded digest in every process; else None (restore then says what
        is damaged)."""
        try:
            data_state = self.data_state(step)
            recorded = self.recorded_digest(step) or {}
            intact = not recorded.get("data") or digests.data_digest(data_state) == recorded["data"]
        except Exception:  # noqa: BLE001 - damage of any kind: restore's to name
            intact = False
        return data_state if all_agree(intact) else None

    def _restore_item(self, step: int, name: str, args):
        restored = self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        if name == "data" and not isinstance(restored, dict):
            raise ValueError(f"expected a JSON object, found {str(restored)[:60]!r}")
        return restored

    def recorded_digest(self, step: int) -> dict[str, Any] | None:
        """The digest item of `step` (None for checkpoints saved before digests)."""
        if not (self.step_path(step) / "digest").exists():
            if "digest" in _saved_items(self.step_path(step)):
                raise FileNotFoundError(f"{self.step_path(step) / 'digest'} was deleted")
            return None
        restored = self.manager.restore(step, args=ocp.args.Composite(digest=ocp.args.JsonRestore()))
        digest = restored["digest"]
        if not isinstance(digest, dict) or not isinstance(digest.get("arrays"), dict):
            raise ValueError(f"digest file has no arrays: {str(digest)[:80]!r}")
        return digest

    def layout(self, step: int) -> packed_state.Layout | None:
        """The layout of a step saved packed (its `layout` item), None for one saved an
        array per array. Raises CheckpointDamagedError where the item was saved and is
        missing or unreadable."""
        path = self.step_path(step)
        if not (path / "layout").exists():
            if "layout" in _saved_items(path):
                raise CheckpointDamagedError(step, path, "packed-state layout deleted")
            return None
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                layout=ocp.args.JsonRestore()))["layout"]
            return packed_state.Layout.from_json(restored)
        except Exception as e:  # noqa: BLE001 - orbax raises anything from here
            raise CheckpointDamagedError(step, path, f"packed-state layout unreadable "
                                                     f"({one_line_error(e, path)})") from None

    def state_tree(self, step: int):
        """The saved tree's metadata (shapes, dtypes): read from state/_METADATA and the
        arrays' headers inside the OCDBT database, so damage to either shows here. For a
        step saved packed: {path: ShapeDtypeStruct} of the state's arrays, from its
        layout, once orbax's metadata agrees that the flat arrays are the layout's."""
        return self._saved_tree(step)[0]

    def _saved_tree(self, step: int):
        """(state_tree, the step's layout or None)."""
        layout = self.layout(step)
        try:
            with quiet.drop_log_messages(MISSING_ITEM_WARNING):
                item = self.manager.item_metadata(step)["state"]
            tree = None if item is None else item.tree
        except Exception as e:  # noqa: BLE001 - orbax raises anything from here
            _ignore_late_tensorstore_callbacks()
            raise CheckpointDamagedError(step, self.step_path(step),
                                         f"state metadata unreadable "
                                         f"({one_line_error(e, self.step_path(step))})") from None
        if item is None:  # orbax's answer when the item's metadata file is gone
            raise CheckpointDamagedError(step, self.step_path(step),
                                         "state metadata missing (no state/_METADATA)")
        if not tree:
            raise CheckpointDamagedError(step, self.step_path(step), "state metadata is empty")
        if layout is None:
            return tree, None
        if flat_shapes(tree) != flat_shapes(layout.packed_abstract()):
            raise CheckpointDamagedError(step, self.step_path(step),
                                         "state metadata does not match its packed layout")
        return layout.abstract(), layout

    def check_structure(self, abstract_state, step: int) -> packed_state.Layout | None:
        """Raises CheckpointMismatchError naming the keys that differ from the model;
        returns the step's layout (None: saved an array per array)."""
        tree, layout = self._saved_tree(step)
        found = flat_shapes(tree)
        expected = flat_shapes(abstract_state)
        # The parameters key by key first (what users change: depth, width, heads), and
        # only those, since the optimizer state mirrors them; then the rest by name (an
        # optimizer of as many arrays, clipping on or off, was orbax's "tree structures do
        # not match" at restore: every step called damaged).
        exp_p = {k: v for k, v in expected.items() if k.startswith("params/")}
        found_p = {k: v for k, v in found.items() if k.startswith("params/")}
        diff = describe_mismatch(exp_p, found_p)
        if not diff and expected.keys() != found.keys():
            diff = describe_mismatch(expected, found)
            diff = diff or f"  {len(expected)} arrays in the model, {len(found)} in the checkpoint"
        if diff:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match the model "
                f"(was it written with another model config or optimizer?):\n{diff}")
        return layout

    def _restore_arrays(self, step: int, abstract_state, layout: packed_state.Layout | None):
        if layout is None:
            return self._restore_item(step, "state", ocp.args.StandardRestore(abstract_state))
        # The flat arrays come to the host whole (every process: all of them), then each
        # array goes onto its sharding in the abstract state.
        flat = self._restore_item(step, "state", ocp.args.StandardRestore(
            packed_state.host_templates(layout)))
        return packed_state.unpack(flat, layout, abstract_state)

    def restore(self, abstract_state, step: int | None = None, need_data: bool = True):
        """Restores (state, data_state) of `step` (default: the newest committed one)
        onto the shardings of `abstract_state` and verifies them against the digests.
        need_data=False (a reader: eval, sampling): a data-loader state that cannot be
        read is no damage (data_state {}), and only the arrays are verified.

        `abstract_state` is a tree of jax.ShapeDtypeStruct carrying the *current*
        run's NamedShardings: each process reads only the shards it owns, so a
        checkpoint written on one mesh restores onto any other. Raises
        CheckpointDamagedError (one line: step, folder, what is wrong) when the step
        cannot be read or does not match its digests, CheckpointMismatchError when it
        was written for another model.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        path = self.step_path(step)
        layout = self.check_structure(abstract_state, step)
        # Each item is read on its own so that the message names the one that failed;
        # the processes agree after each (orbax's reads have barriers).
        stages = (("digest file", lambda: self.recorded_digest(step)),
                  ("data-loader state", lambda: self._restore_item(step, "data", ocp.args.JsonRestore())),
                  ("arrays", lambda: self._restore_arrays(step, abstract_state, layout)))
        read = {}
        for what, fn in stages:
            error = None
            try:
                read[what] = fn()
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise anything
                _ignore_late_tensorstore_callbacks()
                if what == "data-loader state" and not need_data:
                    read[what] = None  # a reader's: the arrays are what it restores
                else:
                    error = f"{what} could not be read ({one_line_error(e, path)})"
            if not all_agree(error is None):
                raise CheckpointDamagedError(step, path, error or f"another process could not "
                                                                  f"read the {what}")
        digest, data_state, state = read["digest file"], read["data-loader state"], read["arrays"]
        if not need_data:  # the arrays alone are checked
            digest = None if digest is None else {**digest, "data": None}
            data_state = data_state or {}
        if digest is None:
            warn(f"checkpoint step {step} in {path} has no digests (saved before they were "
                 f"recorded): restored without verification")
            return state, dict(data_state)
        bad = digests.verify_against(digest, digests.state_digests(state), data_state)
        if bad:
            raise CheckpointDamagedError(step, path, bad)
        return state, dict(data_state)

    def restore_intact(self, abstract_state, *, on_damage: str = "fall_back",
                       say: Callable[[str], None] = warn, need_data: bool = True):
        """(state, data_state, step) of the newest committed step that restores and
        verifies; None when there is no committed step.

        on_damage: 'fall_back' tries older steps, and once one is intact moves the
        damaged newer ones aside (`30.corrupt`, never deleted; not in read-only mode) so
        that training can write those steps again; 'stop' raises the first damage.
        Every damaged step is reported through `say` in one line. Raises
        NoIntactCheckpointError listing every step tried when none is intact (then
        nothing is moved: rerunning gives the same message until a person decides).
        """
        if on_damage not in ("fall_back", "stop"):
            raise ValueError(f"on_damage={on_damage!r} is invalid; valid: ['fall_back', 'stop']")
        steps = self.committed_steps()
        if not steps:
            return None
        damaged: list[CheckpointDamagedError] = []
        for step in reversed(steps):
            try:
                state, data_state = self.restore(abstract_state, step, need_data)
            except CheckpointDamagedError as e:
                damaged.append(e)
                if on_damage == "stop":
                    raise NoIntactCheckpointError(
                        f"{e}; not resuming (train.checkpoint_on_damage='stop'; 'fall_back' "
                        f"would try the older steps {sorted(set(steps) - {step})})") from None
                say(f"{e}; trying an older checkpoint")
                continue
            for e in damaged:
                if self.read_only:
                    say(f"falling back to step {step}: step {e.step} is damaged (left in place, "
                        f"read-only)")
                else:
                    moved = _move_aside(epath.Path(e.path), "corrupt")
                    say(f"falling back to step {step}: damaged step {e.step} moved aside to "
                        f"{moved}")
            if damaged and not self.read_only:
                self.manager.reload()
            return state, data_state, step
        raise NoIntactCheckpointError(
            f"no intact checkpoint in {self.directory}; tried " + "; ".join(
                f"step {e.step}: {e.reason}" for e in damaged)
            + ". The damaged steps were left as they are: inspect them with `python -m "
            f"attention_jax.verify {self.directory}`, or move the checkpoints folder away to "
            "start from scratch")


def restore_params(directory, abstract_params, step: int | None = None):
    """Only the parameters of another run's checkpoint (warm start, `init_from`).

    Reads the `params` subtree without touching optimizer state, onto the shardings of
    `abstract_params`; mismatching keys raise CheckpointMismatchError.
    """
    ckpt = Checkpointer(directory, read_only=True)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint in {str(directory)!r}")
        layout = ckpt.layout(step)
        if layout is None:
            found = flat_shapes({"params": ckpt.manager.item_metadata(step)["state"].tree["params"]})
        else:
            found = {path: shape for path, shape in layout.shapes().items()
                     if path.startswith("params/")}
        diff = describe_mismatch(flat_shapes({"params": abstract_params}), found)
        if diff:
            raise CheckpointMismatchError(
                f"init_from checkpoint {ckpt.directory / str(step)} does not match the model:\n{diff}")
        recorded = _recorded_digest_or_damage(ckpt, step)
    finally:
        ckpt.close()
    # A partial restore: the tree we ask for names only `params` (packed: its flat
    # arrays); the optimizer state is never read. Only the PyTree handler (same files as
    # the standard one) restores a subtree, so this read-only manager registers it for
    # "state".
    with quiet.drop_log_messages(READ_ONLY_WARNING):
        reader = ocp.CheckpointManager(
            ckpt.directory, options=ocp.CheckpointManagerOptions(
                read_only=True, create=False, save_interval_steps=0),
            item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    if layout is None:
        item = {"params": abstract_params}
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), item)
    else:
        item = packed_state.host_templates(layout, tops=("params",))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True)))["state"]
    reader.close()
    if layout is not None:
        restored = packed_state.unpack(restored, layout, {"params": abstract_params})
    _verify_params(recorded, ckpt.step_path(step), step, restored["params"])
    return restored["params"], step


def _recorded_digest_or_damage(ckpt: "Checkpointer", step: int) -> dict[str, Any] | None:
    """`ckpt.recorded_digest(step)`, its failure to read as CheckpointDamagedError."""
    try:
        return ckpt.recorded_digest(step)
    except Exception as e:  # noqa: BLE001 - orbax raises anything from here
        path = ckpt.step_path(step)
        raise CheckpointDamagedError(step, path, f"digest file could not be read "
                                                 f"({one_line_error(e, path)})") from None


def _verify_params(recorded: dict[str, Any] | None, path, step: int, params) -> None:
    """Raises CheckpointDamagedError where warm-started `params` do not match the digests
    `recorded` with `step` (a warm start read them unchecked: another step's arrays, or
    a flipped bit, were trained on in silence). An array restored in another dtype than
    it was saved in (cast onto the model's) cannot be compared and is left out."""
    if recorded is None:
        warn(f"checkpoint step {step} in {path} has no digests (saved before they were "
             f"recorded): its params restored without verification")
        return
    found = digests.state_digests({"params": params})
    wanted = {k: v for k, v in recorded["arrays"].items()
              if k in found and found[k]["dtype"] == v["dtype"]}
    bad = digests.verify_against({"arrays": wanted, "data": None},
                                 {k: v for k, v in found.items() if k in wanted}, None)
    if bad:
        raise CheckpointDamagedError(step, path, bad)
