"""Checkpoint digests: a checksum of every array of a train state and of the data-loader
state, recorded beside a checkpoint (its `digest` item, see checkpoint.py) and checked
when the checkpoint is restored.

The checksum is a function of an array's global values only, not of how it is sharded:
over the array's bytes read as unsigned words w[i] (i: the flat index in the global
array), two sums modulo 2**32,
    A = sum_i w[i]          B = sum_i i * w[i].
Both are sums over elements, so each process adds up the shards it owns (one replica of
each) and the partial sums add up to the same digest on any mesh, on any number of
processes; nothing is gathered but two integers per array. Any change of one element (one
flipped bit included) changes A by a nonzero amount, so it is always detected; B catches
elements that moved. So a checkpoint saved on one mesh verifies on any other.

Computed with numpy on host views of the shards: on CPU this is ~4x faster than the same
sums under jit, where XLA materialises the bitcast and reduces integers without
vectorising (measured: tools/bench checkpoint). On an accelerator the sums run where the
state lives (`device_sums`).

A save computes them in two halves (`start_record`): on the training thread only what
launches device programs (the device sums, in program order on every process), and the
rest -- fetching the sums, or the numpy pass and adding up the processes' shares --
wherever the caller likes, e.g. checkpoint.py's background saver.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

_MOD = 1 << 32


def tree_paths(tree) -> list[tuple[str, Any]]:
    """[('params/block_0/attn/w', leaf), ...] in tree order: the names digests are
    recorded under (dict keys, attribute names and indices joined by '/')."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
            for path, leaf in flat]


# ================================================================== one array, on host
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


# ============================================================== all arrays, on device
def _on_accelerator(x) -> bool:
    return isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.sharding.device_set)


@jax.jit
def device_sums(arrays):
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


# ====================================================================== a whole state
Gather = Callable[[np.ndarray], np.ndarray]  # this process's [n, 2] -> every process's [P, n, 2]


def _allgather(sums: np.ndarray) -> np.ndarray:
    """The processes' partial sums through a device collective: main thread only."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(sums))


def start_state_digests(state, on_device: bool | None = None, gather: Gather = _allgather,
                        program=None) -> Callable[[], dict[str, dict[str, Any]]]:
    """Launches what `state_digests(state)` runs on the devices and returns the function
    that finishes it (it waits for the devices; call it from any thread).

    On an accelerator (`on_device` None: any array lives on one) the sums run there in
    one jitted program, launched here, and only the 2 words per array come back, instead
    of copying the whole state to the host for numpy (orbax copies it for the write
    anyway, but in its own format). On CPU numpy over the shards is faster (see above),
    done by the returned function; with several processes each adds up its own shards and
    `gather` collects the partial sums (the default is a device collective: pass another,
    e.g. through the coordination service, to finish off the main thread). `program`:
    the sums' program compiled ahead for this state's arrays (then they run on the
    devices, on CPU too)."""
    arrays = jax.tree_util.tree_leaves(state)
    described = describe(state)
    if on_device is None:
        on_device = program is not None or any(_on_accelerator(x) for x in arrays)
    if on_device and all(isinstance(x, jax.Array) for x in arrays):
        launched = (program or device_sums)(arrays)  # not waited for
        arrays = None  # the returned function needs only the sums

        def sums() -> np.ndarray:
            return np.asarray(launched.addressable_data(0), np.uint64)
    else:
        def sums() -> np.ndarray:
            mine = np.array([array_digest_partial(x) for x in arrays], np.uint64).reshape(-1, 2)
            if jax.process_count() == 1:
                return mine
            gathered = gather(mine.astype(np.uint32))
            return gathered.astype(np.uint64).sum(axis=0) % _MOD

    def finish() -> dict[str, dict[str, Any]]:
        return {path: {"shape": list(shape), "dtype": dtype, "digest": f"{int(a):08x}{int(b):08x}"}
                for (path, shape, dtype), (a, b) in zip(described, sums())}
    return finish


def state_digests(state, on_device: bool | None = None) -> dict[str, dict[str, Any]]:
    """{path: {'shape', 'dtype', 'digest'}} for every array of `state` (on the devices
    or with numpy: see `start_state_digests`)."""
    return start_state_digests(state, on_device)()


def _dtype_of(x):
    dtype = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dtype is None else dtype


def describe(state) -> tuple[tuple[str, tuple, str], ...]:
    """(path, shape, dtype name) of each array of `state` (or abstract array), in tree
    order: the digests' names, and packed_state's layout. Worked out once per tree
    structure, shapes and dtypes, since a save asks on the thread that launches the
    training steps, and naming paths and dtypes is Python work per array."""
    arrays, treedef = jax.tree_util.tree_flatten(state)
    return _described(treedef, tuple((tuple(np.shape(x)), _dtype_of(x)) for x in arrays))


@functools.lru_cache(maxsize=16)
def _described(treedef, shapes: tuple) -> tuple[tuple[str, tuple, str], ...]:
    described = jax.tree_util.tree_unflatten(treedef, [_Leaf(*x) for x in shapes])
    return tuple((path, x.shape, _dtype_name(x.dtype)) for path, x in tree_paths(described))


class _Leaf:
    """An array's shape and dtype, where the array was in the tree (not a pytree node)."""

    def __init__(self, shape: tuple, dtype):
        self.shape, self.dtype = shape, dtype


def _dtype_name(dtype) -> str:
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


# ========================================================== the checkpoint's digest item
def start_record(step: int, state, data_state, gather: Gather = _allgather, program=None
                 ) -> Callable[[], dict[str, Any]]:
    """Launches the device half of `record` (see `start_state_digests`, whose `gather`
    and `program` these are) and returns the function that completes the digest item."""
    item = {
        "format": 1,
        "step": int(step),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mesh": _mesh_of(state),
        "process_count": jax.process_count(),
    }
    arrays = start_state_digests(state, gather=gather, program=program)
    data = data_digest(data_state)
    return lambda: {**item, "arrays": arrays(), "data": data}


def record(step: int, state, data_state) -> dict[str, Any]:
    """The `digest` item saved with a checkpoint (JSON): the digests of the state and of
    the data state, and, for a person reading the verifier's table, the mesh the state
    was saved on and the time. `data_state` as it will read back (JSON round trip)."""
    return start_record(step, state, data_state)()


def verify_against(recorded: dict[str, Any], found: dict[str, dict], data_state) -> str:
    """'' when `found` (state_digests of what was read) and `data_state` match the
    recorded digest item, else what differs (one line, naming the arrays)."""
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
