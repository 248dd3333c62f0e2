"""Checkpoints: orbax's CheckpointManager behind a small interface.

A checkpoint step directory holds two items:
  state  the train state pytree (params, optimizer state, step, RNG), written by every
         process for the shards it owns (tensorstore/OCDBT), restorable on any mesh.
  data   the data loader's state as JSON (a stream position, independent of the number
         of devices or processes, see data/loaders.py).

Crash safety comes from orbax's commit protocol: a step is written into a temporary
directory and renamed (plus a commit marker) only once every process has finished, so
`latest_step()` never sees a half-written checkpoint; leftovers of a killed save are
removed when the next manager opens the directory.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from attention_jax import quiet


# orbax logs this (a warning) whenever a manager is opened read-only, as every reader of a
# run does on purpose (runs.open_run, warm starts).
READ_ONLY_WARNING = "Given directory is read only=%s"


class CheckpointMismatchError(ValueError):
    """The checkpoint's tree does not match the model (different depth, width, ...)."""


def key_name(k) -> str:
    """The name of one step of a pytree path (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flat_shapes(tree) -> dict[str, tuple[int, ...]]:
    """{'params/block_0/attn/w': shape} for arrays, abstract arrays or orbax metadata."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(key_name(k) for k in path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in flat}


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


class Checkpointer:
    """Saves and restores (state, data_state) in `directory` (usually workdir/checkpoints).

    Args:
      directory: where step directories live.
      save_every: a regular save every this many steps (others are skipped unless forced).
      keep: keep the last `keep` checkpoints (older ones are deleted after a save commits).
      async_save: write in a background thread; training continues after the device ->
        host copy. `wait()` blocks until the write has committed.
    """

    def __init__(self, directory, *, save_every: int = 1000, keep: int = 3,
                 async_save: bool = True, read_only: bool = False):
        self.directory = epath.Path(directory)
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            # A read-only manager saves and deletes nothing; saying so up front spares
            # orbax's warnings that it overrides these two.
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            # Temporary directories left by a killed save are garbage: remove on open.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        # Handlers named up front so that a fresh manager can read metadata (structure
        # checks) before the first restore.
        with quiet.drop_log_messages(READ_ONLY_WARNING):  # read-only is what we asked for
            self.manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={"state": ocp.StandardCheckpointHandler(),
                               "data": ocp.JsonCheckpointHandler()})

    # ------------------------------------------------------------------------- query
    def latest_step(self) -> int | None:
        """The newest committed step (never a half-written one), or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    # -------------------------------------------------------------------------- save
    def save(self, step: int, state, data_state: dict[str, Any], *, force: bool = False) -> bool:
        """Starts saving `state` at `step`; True if a save was started.

        Not forced: only when `step` is a multiple of `save_every`. Every process must
        call this with the same step (the write is a collective).
        """
        # The interval is decided here (orbax's own policy would also save the first
        # step of every run); `force` tells orbax to save whatever its policy says.
        if not force and int(step) % self.save_every:
            return False
        if int(step) in self.all_steps():
            return False  # Already saved (e.g. a forced final save on a regular step).
        return self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    data=ocp.args.JsonSave(dict(data_state))),
            force=True)

    def wait(self) -> None:
        """Blocks until pending async saves have committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def data_state(self, step: int) -> dict[str, Any]:
        """Only the data-loader state of `step` (cheap: no arrays are read)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        return dict(restored["data"])

    # ----------------------------------------------------------------------- restore
    def check_structure(self, abstract_state, step: int) -> None:
        """Raises CheckpointMismatchError naming the keys that differ from the model."""
        found = flat_shapes(self.manager.item_metadata(step)["state"].tree)
        expected = flat_shapes(abstract_state)
        # Compare the parameters key by key (what users change: depth, width, heads);
        # the optimizer state mirrors them, so the rest is compared as a leaf count.
        exp_p = {k: v for k, v in expected.items() if k.startswith("params/")}
        found_p = {k: v for k, v in found.items() if k.startswith("params/")}
        diff = describe_mismatch(exp_p, found_p)
        if not diff and len(expected) != len(found):
            diff = describe_mismatch(expected, found)
            diff = diff or f"  {len(expected)} arrays in the model, {len(found)} in the checkpoint"
        if diff:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match the model "
                f"(was it written with another model config or optimizer?):\n{diff}")

    def restore(self, abstract_state, step: int | None = None):
        """Restores (state, data_state) onto the shardings of `abstract_state`.

        `abstract_state` is a tree of jax.ShapeDtypeStruct carrying the *current*
        run's NamedShardings: each process reads only the shards it owns, so a
        checkpoint written on one mesh restores onto any other.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        self.check_structure(abstract_state, step)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                          data=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["data"] or {})


def restore_params(directory, abstract_params, step: int | None = None):
    """Only the parameters of another run's checkpoint (warm start, `init_from`).

    Reads the `params` subtree without touching optimizer state, onto the shardings of
    `abstract_params`; mismatching keys raise CheckpointMismatchError.
    """
    ckpt = Checkpointer(directory, read_only=True)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"init_from={str(directory)!r}: no committed checkpoint there")
    meta = ckpt.manager.item_metadata(step)["state"].tree
    diff = describe_mismatch(flat_shapes({"params": abstract_params}),
                             flat_shapes({"params": meta["params"]}))
    if diff:
        raise CheckpointMismatchError(
            f"init_from checkpoint {ckpt.directory / str(step)} does not match the model:\n{diff}")
    ckpt.close()
    # A partial restore: the tree we ask for names only `params`; the optimizer state is
    # never read. Only the PyTree handler (same files as the standard one) restores a
    # subtree, so this read-only manager registers it for "state".
    with quiet.drop_log_messages(READ_ONLY_WARNING):
        reader = ocp.CheckpointManager(
            ckpt.directory, options=ocp.CheckpointManagerOptions(
                read_only=True, create=False, save_interval_steps=0),
            item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding),
                                {"params": abstract_params})
    restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": abstract_params}, restore_args=restore_args, partial_restore=True)))
    reader.close()
    return restored["state"]["params"], step


# ------------------------------------------------------------------------- preemption
class StopRequest(contextlib.AbstractContextManager):
    """Turns SIGTERM/SIGINT into a flag the training loop polls between steps.

    Saving inside a signal handler would race with the step in flight; instead the
    loop finishes the current step, saves a final checkpoint and exits. A second
    signal while stopping restores the default behaviour (a user pressing Ctrl-C twice
    wants out now). With several processes, `requested()` is true on all of them as
    soon as any one received a signal, so they agree on the step they stop at.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def _handler(self, signum, frame):
        if self.signal is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signal = signum
        logging.warning("received %s: stopping after this step with a final checkpoint",
                        signal.Signals(signum).name)

    def __enter__(self):
        # Signal handlers can only be installed from the main thread (tests call the
        # trainer from worker threads sometimes): then there is simply no handler.
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        return False

    def requested(self) -> bool:
        local = self.signal is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.int32(self.signal or 0))
        nonzero = np.asarray(flags).ravel()
        nonzero = nonzero[nonzero != 0]
        if nonzero.size and self.signal is None:
            self.signal = int(nonzero[0])
        return bool(nonzero.size)
