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

Integrity: a third item, `digest`, records beside the arrays a checksum of every array of
the state and of the data state, the mesh the state was saved on and the time (JSON,
committed with the step). The checksum is a function of each array's global values only
(see `array_digest`), so a checkpoint saved on one mesh verifies on any other. Restoring
verifies it; `restore_intact` falls back to the newest step that restores and verifies,
moving damaged steps aside (`30.corrupt`), and `python -m attention_jax.checkpoint verify
WORKDIR` prints a table of every step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import sys
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from attention_jax import quiet
from attention_jax.errors import UserError


# orbax logs this (a warning) whenever a manager is opened read-only, as every reader of a
# run does on purpose (runs.open_run, warm starts).
READ_ONLY_WARNING = "Given directory is read only=%s"


class CheckpointMismatchError(UserError, ValueError):
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


class CheckpointDamagedError(RuntimeError):
    """A committed checkpoint that cannot be restored or does not match its digests.
    The message is one line: the step, its folder and what is wrong."""

    def __init__(self, step: int, path, reason: str):
        self.step, self.path, self.reason = step, str(path), reason
        super().__init__(f"checkpoint step {step} in {path} is damaged: {reason}")


class NoIntactCheckpointError(UserError, RuntimeError):
    """Every committed checkpoint of a directory is damaged (or resume was told to stop)."""


# ============================================================================== digests
# A checksum of an array's global values that does not depend on how it is sharded:
# over the array's bytes read as unsigned words w[i] (i: the flat index in the global
# array), two sums modulo 2**32,
#     A = sum_i w[i]          B = sum_i i * w[i].
# Both are sums over elements, so each process adds up the shards it owns (one replica
# of each) and the partial sums add up to the same digest on any mesh, on any number of
# processes; nothing is gathered but two integers per array. Any change of one element
# (one flipped bit included) changes A by a nonzero amount, so it is always detected;
# B catches elements that moved. Computed with numpy on host views of the shards: on CPU
# this is ~4x faster than the same sums under jit, where XLA materialises the bitcast
# and reduces integers without vectorising (measured: tools/bench checkpoint).
_MOD = 1 << 32


def _words(a: np.ndarray) -> np.ndarray:
    """The array's bytes as unsigned integers, one per element (two trailing words per
    element for 64-bit types)."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize in (1, 2, 4):
        return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a.view(np.uint32).reshape(*a.shape, a.dtype.itemsize // 4)


def _shard_sums(words: np.ndarray, offsets, global_shape) -> tuple[int, int]:
    """(A, B) of one shard placed at `offsets` in an array of `global_shape`.

    B = sum over axes d of stride_d * sum_i (offset_d + l_d) * w[l]: each axis needs only
    the shard's sums along the other axes (one vectorised pass per axis)."""
    if words.size == 0:
        return 0, 0
    if words.ndim == 0:
        return int(words) % _MOD, 0
    a, b, stride = None, 0, 1
    for d in reversed(range(words.ndim)):
        others = tuple(i for i in range(words.ndim) if i != d)
        marginal = words.sum(axis=others, dtype=np.uint32) if others else words.astype(np.uint32)
        if a is None:
            a = int(marginal.sum(dtype=np.uint32))
        local = int(np.dot(np.arange(marginal.size, dtype=np.uint32), marginal))
        b += stride * (offsets[d] * a + local)
        stride *= global_shape[d]
    return a % _MOD, b % _MOD


def array_digest_partial(x) -> tuple[int, int]:
    """This process's share of `x`'s (A, B): its shards with replica_id 0."""
    if not isinstance(x, jax.Array):  # a host value, the same on every process: counted once
        if jax.process_index() != 0:
            return 0, 0
        words = _words(np.asarray(x))
        return _shard_sums(words, (0,) * words.ndim, words.shape)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys
        x = jax.random.key_data(x)
    a = b = 0
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        words = _words(np.asarray(shard.data))
        offsets = [sl.start or 0 for sl in shard.index] + [0] * (words.ndim - x.ndim)
        pa, pb = _shard_sums(words, offsets, tuple(x.shape) + words.shape[x.ndim:])
        a, b = (a + pa) % _MOD, (b + pb) % _MOD
    return a, b


def tree_paths(tree) -> list[tuple[str, Any]]:
    """[('params/block_0/attn/w', leaf), ...] in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(key_name(k) for k in path), leaf) for path, leaf in flat]


def _on_accelerator(x) -> bool:
    return isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.sharding.device_set)


@jax.jit
def _device_sums(arrays):
    """[len(arrays), 2] uint32: (A, B) of every array, computed where it lives (uint32
    arithmetic wraps modulo 2**32 as the numpy sums do, so the digests are the same)."""
    out = []
    for x in arrays:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        bits = 8 * x.dtype.itemsize
        if x.dtype == jnp.bool_:
            words = x.astype(jnp.uint32)  # one byte, 0 or 1
        else:
            words = jax.lax.bitcast_convert_type(x, jnp.uint32 if bits == 64 else
                                                 jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
        index = jnp.zeros(words.shape, jnp.uint32)
        stride = 1
        for d in reversed(range(words.ndim)):  # the flat index i, modulo 2**32
            index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) * jnp.uint32(
                stride % _MOD)
            stride *= words.shape[d]
        out.append(jnp.stack([words.sum(dtype=jnp.uint32), (index * words).sum(dtype=jnp.uint32)]))
    return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def state_digests(state, on_device: bool | None = None) -> dict[str, dict[str, Any]]:
    """{path: {'shape', 'dtype', 'digest'}} for every array of `state`.

    On an accelerator (`on_device` None: any array lives on one) the sums run there in
    one jitted program and only the 2 words per array come back, instead of copying the
    whole state to the host for numpy (orbax copies it for the write anyway, but in its
    own format). On CPU numpy over the shards is faster (see above); with several
    processes each adds up its own shards and the partial sums are all-gathered."""
    leaves = tree_paths(state)
    if on_device is None:
        on_device = any(_on_accelerator(x) for _, x in leaves)
    if on_device and all(isinstance(x, jax.Array) for _, x in leaves):
        sums = np.asarray(_device_sums([x for _, x in leaves]).addressable_data(0), np.uint64)
    else:
        sums = np.array([array_digest_partial(x) for _, x in leaves], np.uint64).reshape(-1, 2)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            gathered = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32)))
            sums = gathered.astype(np.uint64).sum(axis=0) % _MOD
    return {path: {"shape": list(np.shape(x)), "dtype": _dtype_name(x),
                   "digest": f"{int(a):08x}{int(b):08x}"}
            for (path, x), (a, b) in zip(leaves, sums)}


def _dtype_name(x) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return str(np.asarray(x).dtype)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)  # e.g. key<fry>: a typed PRNG key
    return str(np.dtype(dtype))


def data_digest(data_state) -> str:
    """sha256 of the data state's canonical JSON."""
    text = json.dumps(data_state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _mesh_of(state) -> dict[str, int]:
    """The mesh axes of the first array sharded on a named mesh ({} on one device)."""
    for x in jax.tree.leaves(state):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None and hasattr(mesh, "shape"):
            return {str(k): int(v) for k, v in mesh.shape.items()}
    return {}


def _one_line(e: BaseException, where=None, limit: int = 300) -> str:
    """The root cause of an orbax/tensorstore error as one short line (paths inside the
    folder `where` written relative to it: the message names the folder already)."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
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


def _is_committed(path: epath.Path) -> bool:
    """Orbax's commit marker, written once every item of the step is on disk."""
    return (path / "commit_success.txt").exists()


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


def _all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (a damaged shard read by one process fails
    the step for all, so they fall back together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.int32(ok)))))


class Checkpointer:
    """Saves and restores (state, data_state) in `directory` (usually workdir/checkpoints).

    Args:
      directory: where step directories live.
      save_every: a regular save every this many steps (others are skipped unless forced).
      keep: keep the last `keep` checkpoints (older ones are deleted after a save commits).
      async_save: write in a background thread; training continues after the device ->
        host copy. `wait()` blocks until the write has committed.
      read_only: for readers of a run that may still be training: nothing is cleaned up,
        moved or written.
    """

    def __init__(self, directory, *, save_every: int = 1000, keep: int = 3,
                 async_save: bool = True, read_only: bool = False):
        self.directory = epath.Path(directory)
        self.save_every = save_every
        self.read_only = read_only
        if not read_only:
            self._move_aside_uncommitted()
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
                               "data": ocp.JsonCheckpointHandler(),
                               "digest": ocp.JsonCheckpointHandler()})

    # ------------------------------------------------------------------------- query
    def _step_folders(self) -> dict[int, epath.Path]:
        if not self.directory.exists():
            return {}
        return {int(p.name): p for p in self.directory.iterdir()
                if p.is_dir() and p.name.isdigit()}

    def committed_steps(self) -> list[int]:
        """Steps whose folder carries orbax's commit marker, oldest first."""
        return sorted(s for s, p in self._step_folders().items() if _is_committed(p))

    def latest_step(self) -> int | None:
        """The newest committed step (never a half-written one), or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def step_path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def _move_aside(self, path: epath.Path, suffix: str) -> epath.Path:
        """Renames `path` to `path.<suffix>` (or .<suffix>.1, ...): never deleted, so a
        person can inspect it; invisible to orbax, whose steps are integer names."""
        target, n = path.parent / f"{path.name}.{suffix}", 0
        while target.exists():
            n += 1
            target = path.parent / f"{path.name}.{suffix}.{n}"
        if jax.process_index() == 0:
            os.rename(os.fspath(path), os.fspath(target))
        _sync(f"attention_jax_move_aside_{path.name}")
        return target

    def _move_aside_uncommitted(self) -> None:
        """A step folder without a commit marker is a save that never finished (or a
        stray copy): orbax would list it and fail on it, and a new save of that step
        would collide with it."""
        for step, path in sorted(self._step_folders().items()):
            if not _is_committed(path):
                target = self._move_aside(path, "uncommitted")
                logging.warning("checkpoint folder %s has no commit marker (a save that did "
                                "not finish): ignored, moved aside to %s", path, target)

    # -------------------------------------------------------------------------- save
    def due(self, step: int) -> bool:
        """Whether `step` is one of the regular saves (a multiple of save_every)."""
        return int(step) % self.save_every == 0

    def save(self, step: int, state, data_state: dict[str, Any], *, force: bool = False) -> bool:
        """Starts saving `state` at `step`; True if a save was started.

        Not forced: only when `step` is a multiple of `save_every`. Every process must
        call this with the same step (the write is a collective). The digests are
        computed here, before the state's buffers can be donated to the next step, and
        committed with the arrays as the step's `digest` item.
        """
        # The interval is decided here (orbax's own policy would also save the first
        # step of every run); `force` tells orbax to save whatever its policy says.
        if not force and not self.due(step):
            return False
        if int(step) in self.all_steps():
            return False  # Already saved (e.g. a forced final save on a regular step).
        data_state = json.loads(json.dumps(dict(data_state)))  # as it will read back
        digest = {
            "format": 1,
            "step": int(step),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mesh": _mesh_of(state),
            "process_count": jax.process_count(),
            "arrays": state_digests(state),
            "data": data_digest(data_state),
        }
        return self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    data=ocp.args.JsonSave(data_state),
                                    digest=ocp.args.JsonSave(digest)),
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

    def _restore_item(self, step: int, name: str, args):
        restored = self.manager.restore(step, args=ocp.args.Composite(**{name: args}))[name]
        if name == "data" and not isinstance(restored, dict):
            raise ValueError(f"expected a JSON object, found {str(restored)[:60]!r}")
        return restored

    def recorded_digest(self, step: int) -> dict[str, Any] | None:
        """The digest item of `step` (None for checkpoints saved before digests)."""
        if not (self.step_path(step) / "digest").exists():
            if "digest" in self._saved_items(step):
                raise FileNotFoundError(f"{self.step_path(step) / 'digest'} was deleted")
            return None
        restored = self.manager.restore(step, args=ocp.args.Composite(digest=ocp.args.JsonRestore()))
        digest = restored["digest"]
        if not isinstance(digest, dict) or not isinstance(digest.get("arrays"), dict):
            raise ValueError(f"digest file has no arrays: {str(digest)[:80]!r}")
        return digest

    def _saved_items(self, step: int) -> list[str]:
        """The items orbax recorded in the step's _CHECKPOINT_METADATA ([] if unreadable)."""
        try:
            meta = json.loads((self.step_path(step) / "_CHECKPOINT_METADATA").read_text())
            return list(meta.get("item_handlers") or [])
        except Exception:  # noqa: BLE001
            return []

    # ----------------------------------------------------------------------- restore
    def _state_tree(self, step: int):
        """The saved tree's metadata (shapes, dtypes): read from state/_METADATA and the
        arrays' headers inside the OCDBT database, so damage to either shows here."""
        try:
            tree = self.manager.item_metadata(step)["state"].tree
        except Exception as e:  # noqa: BLE001 - orbax raises anything from here
            _ignore_late_tensorstore_callbacks()
            raise CheckpointDamagedError(step, self.step_path(step),
                                         f"state metadata unreadable "
                                         f"({_one_line(e, self.step_path(step))})") from None
        if not tree:
            raise CheckpointDamagedError(step, self.step_path(step), "state metadata is empty")
        return tree

    def check_structure(self, abstract_state, step: int) -> None:
        """Raises CheckpointMismatchError naming the keys that differ from the model."""
        found = flat_shapes(self._state_tree(step))
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
        """Restores (state, data_state) of `step` (default: the newest committed one)
        onto the shardings of `abstract_state` and verifies them against the digests.

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
        self.check_structure(abstract_state, step)
        # Each item is read on its own so that the message names the one that failed;
        # the processes agree after each (orbax's reads have barriers).
        stages = (("digest file", lambda: self.recorded_digest(step)),
                  ("data-loader state", lambda: self._restore_item(step, "data", ocp.args.JsonRestore())),
                  ("arrays", lambda: self._restore_item(
                      step, "state", ocp.args.StandardRestore(abstract_state))))
        read = {}
        for what, fn in stages:
            error = None
            try:
                read[what] = fn()
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise anything
                _ignore_late_tensorstore_callbacks()
                error = f"{what} could not be read ({_one_line(e, path)})"
            if not _all_agree(error is None):
                raise CheckpointDamagedError(step, path, error or f"another process could not "
                                                                  f"read the {what}")
        digest, data_state, state = read["digest file"], read["data-loader state"], read["arrays"]
        if digest is None:
            logging.warning("checkpoint step %d in %s has no digests (saved before they were "
                            "recorded): restored without verification", step, path)
            return state, dict(data_state)
        bad = verify_against(digest, state_digests(state), data_state)
        if bad:
            raise CheckpointDamagedError(step, path, bad)
        return state, dict(data_state)

    def restore_intact(self, abstract_state, *, on_damage: str = "fall_back",
                       say: Callable[[str], None] = logging.warning):
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
                state, data_state = self.restore(abstract_state, step)
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
                    moved = self._move_aside(epath.Path(e.path), "corrupt")
                    say(f"falling back to step {step}: damaged step {e.step} moved aside to "
                        f"{moved}")
            if damaged and not self.read_only:
                self.manager.reload()
            return state, data_state, step
        raise NoIntactCheckpointError(
            f"no intact checkpoint in {self.directory}; tried " + "; ".join(
                f"step {e.step}: {e.reason}" for e in damaged)
            + ". Nothing was moved or deleted: inspect them with `python -m "
            "attention_jax.checkpoint verify`, or move the checkpoints folder away to start "
            "from scratch")


def verify_against(recorded: dict[str, Any], found: dict[str, dict], data_state) -> str:
    """'' when `found` (state_digests of what was read) and `data_state` match the
    recorded digest, else what differs (one line, naming the arrays)."""
    bad = []
    for path, want in recorded["arrays"].items():
        got = found.get(path)
        if got is None:
            bad.append(f"{path} missing")
        elif (got["shape"], got["dtype"]) != (list(want["shape"]), want["dtype"]):
            bad.append(f"{path} is {got['dtype']}{got['shape']}, saved as "
                       f"{want['dtype']}{list(want['shape'])}")
        elif got["digest"] != want["digest"]:
            bad.append(path)
    extra = sorted(set(found) - set(recorded["arrays"]))
    if extra:
        bad.append(f"{extra[0]} not in the digest")
    parts = []
    if bad:
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        parts.append(f"corrupt: array {names} does not match its digest" if len(bad) == 1 else
                     f"corrupt: arrays {names} do not match their digests")
    if recorded.get("data") and data_digest(data_state) != recorded["data"]:
        parts.append("corrupt: data-loader state does not match its digest")
    return "; ".join(parts)


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


# ============================================================================= verifier
def _size(path: epath.Path) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(os.fspath(path)) for f in files)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def verify_step(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    """Restores `step` onto this process's first device, in its saved shapes, and checks
    it against its digests: {'step', 'saved_at', 'size', 'mesh', 'status'} where status
    is 'ok', 'ok (no digests: not verified)' or what is damaged."""
    path = ckpt.step_path(step)
    row = {"step": step, "saved_at": "?", "size": _size(path), "mesh": "?", "status": "ok"}
    try:
        digest = ckpt.recorded_digest(step)
    except Exception:  # noqa: BLE001 - reported by restore below
        digest = None
    if digest:
        row["saved_at"] = str(digest.get("saved_at", "?")).replace("T", " ").replace("+00:00", "")
        mesh = digest.get("mesh") or {}
        row["mesh"] = " ".join(f"{k}={v}" for k, v in mesh.items()) or "1 device"
        if digest.get("process_count", 1) > 1:
            row["mesh"] += f" ({digest['process_count']} processes)"
    else:
        try:  # orbax's own commit time, for checkpoints saved before digests
            meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
            row["saved_at"] = datetime.datetime.fromtimestamp(
                meta["commit_timestamp_nsecs"] / 1e9, datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S")
        except Exception:  # noqa: BLE001
            pass
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    try:
        tree = ckpt._state_tree(step)
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                tree)
        with _quiet_orbax():
            ckpt.restore(abstract, step)
        if digest is None:
            row["status"] = "ok (no digests: not verified)"
    except CheckpointDamagedError as e:
        row["status"] = "DAMAGED: " + e.reason
    except Exception as e:  # noqa: BLE001 - a table row, not a traceback
        row["status"] = "DAMAGED: " + _one_line(e)
    return row


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax and tensorstore log their own tracebacks for a failed read; the verifier
    reports the cause in its table instead."""
    import logging as std_logging
    loggers = [std_logging.getLogger(n) for n in ("absl", "orbax", "asyncio", "jax")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(std_logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def verify_directory(workdir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of `verify_step` for every committed step of a workdir (or of its
    checkpoints folder), newest first, and the names of folders that are not committed
    steps (half-written, moved aside)."""
    directory = workdir
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{workdir} has no checkpoints folder")
    ckpt = Checkpointer(directory, read_only=True)
    try:
        committed = ckpt.committed_steps()
        rows = [verify_step(ckpt, step) for step in reversed(committed)]
    finally:
        ckpt.close()
    others = sorted(n for n in os.listdir(directory)
                    if os.path.isdir(os.path.join(directory, n))
                    and not (n.isdigit() and int(n) in committed))
    return rows, others


def format_table(rows: list[dict[str, Any]], others: list[str]) -> str:
    header = ("step", "saved at (UTC)", "size", "mesh", "status")
    cells = [[str(r["step"]), r["saved_at"], _human(r["size"]), r["mesh"], r["status"]]
             for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    if not rows:
        lines.append("(no committed checkpoints)")
    for name in others:
        why = ("moved aside after it failed to restore or verify" if ".corrupt" in name else
               "no commit marker (a save that did not finish), ignored" if name.isdigit()
               or ".uncommitted" in name else
               "temporary folder of a save in progress or killed" if "tmp" in name else
               "not a checkpoint step")
        lines.append(f"{name}: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attention_jax.checkpoint",
        description="Check every checkpoint of a workdir against the digests saved with it.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="restore every committed step and print a table")
    verify.add_argument("workdir", help="a run's workdir or its checkpoints folder")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.ERROR)
    try:
        rows, others = verify_directory(args.workdir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, others))
    return 0 if rows and all(r["status"].startswith("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
