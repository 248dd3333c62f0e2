"""A train state written as a few flat arrays: checkpoint.py's packed format.

orbax writes each array of a pytree as its own tensorstore array, with Python work per
array on its saving threads (asyncio tasks, specs, metadata): 0.9 ms of CPU per array and
save on the 2-core CPU host, 0.40-0.48 s for GPT-2 small's 448 arrays with AdamW, however
small they are (10 arrays: 0.03 s). That work holds the interpreter, which the thread
launching the train steps needs too: on an H200 (2026-11-26) the device then idled 3-7 ms
a step, and a save cost its windows 255-396 ms without a garbage collection (issue 35).

Packed, the state is one flat array per top-level entry and dtype (`params/float32`,
`opt_state/float32`, `step/int32`, ...: 5 arrays for GPT-2 with AdamW), the same bytes,
in tree order, and a `Layout` (JSON, the checkpoint's `layout` item) says where each
array of the state lies in them: its path (as digests.tree_paths names it), group,
offset and shape. The top-level entry is a group of its own so that a warm start reads the
parameters without the optimizer state.

Only states whose every array is whole on each of its devices (one device, or
replicated) are packed: the flat arrays then need no communication to build, and any
process holds all of them. A sharded state keeps orbax's per-array format, which each
process writes for the shards it owns. Restoring unpacks onto any sharding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import digests

FORMAT = "attention_jax packed state"
VERSION = 1
# Chunks of a flat array written by tensorstore: small enough that its compression and
# writes spread over the host's cores (a flat array of 1.4 GB in one chunk compresses on
# one), large enough that a chunk's own overhead does not count.
CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # digests.tree_paths' name of the array
    group: str  # "<top-level entry>/<dtype>": the flat array it lies in
    offset: int  # in elements
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each array of a state lies in its flat arrays (in tree order)."""
    entries: tuple[Entry, ...]
    groups: dict[str, int]  # group -> its flat array's length

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "groups": dict(self.groups),
                "arrays": [[e.path, e.group, e.offset, list(e.shape)] for e in self.entries]}

    @classmethod
    def from_json(cls, data) -> "Layout":
        """Raises ValueError naming what is wrong with a layout that does not parse."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a packed-state layout: {str(data)[:80]!r}")
        if data.get("version") != VERSION:
            raise ValueError(f"packed-state layout version {data.get('version')!r}; this "
                             f"attention_jax reads version {VERSION}")
        try:
            groups = {str(g): int(n) for g, n in data["groups"].items()}
            entries = tuple(Entry(str(p), str(g), int(o), tuple(int(d) for d in s))
                            for p, g, o, s in data["arrays"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"packed-state layout unreadable: {e}") from None
        for e in entries:
            if e.group not in groups or e.offset < 0 or e.offset + e.size > groups[e.group]:
                raise ValueError(f"packed-state layout: {e.path} lies outside its flat "
                                 f"array {e.group}")
        return cls(entries, groups)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{path: shape}, as checkpoint.flat_shapes gives for a state."""
        return {e.path: e.shape for e in self.entries}

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        """{path: ShapeDtypeStruct}: a flat tree whose paths are the state's."""
        return {e.path: jax.ShapeDtypeStruct(e.shape, _split(e.group)[1]) for e in self.entries}

    def packed_abstract(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
        """The flat arrays' tree as orbax holds it: {top: {dtype: ShapeDtypeStruct}}."""
        return _nest({group: jax.ShapeDtypeStruct((length,), _split(group)[1])
                      for group, length in self.groups.items()})


def _group(path: str, dtype_name: str) -> str:
    return f"{path.split('/', 1)[0]}/{dtype_name}"


def _split(group: str) -> tuple[str, str]:
    """(top-level entry, dtype name) of a group."""
    top, dtype = group.rsplit("/", 1)
    return top, dtype


def layout_of(state) -> Layout:
    """The layout of `state`'s arrays (or abstract arrays). Computed once per tree
    structure, shapes and dtypes (from `digests.describe`, which a save asks for on the
    thread that launches the training steps anyway: 1.5 ms of Python per save for 360
    arrays on the CPU host when each save worked it out)."""
    return _layout(digests.describe(state))


@functools.lru_cache(maxsize=16)
def _layout(described: tuple) -> Layout:
    entries, groups = [], {}
    for path, shape, dtype_name in described:
        group = _group(path, dtype_name)
        entries.append(Entry(path, group, groups.get(group, 0), shape))
        groups[group] = groups.get(group, 0) + entries[-1].size
    return Layout(tuple(entries), groups)


def packable(state) -> bool:
    """Whether `state` is written packed: one process, every leaf a jax.Array of a plain
    dtype, each whole on every device it is on, all on the same devices."""
    if jax.process_count() != 1:
        return False
    leaves = jax.tree.leaves(state)
    if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
        return False
    devices = leaves[0].sharding.device_set
    return all(x.sharding.is_fully_replicated and x.sharding.device_set == devices
               and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves)


def _nest(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for group, x in flat.items():
        top, dtype = _split(group)
        out.setdefault(top, {})[dtype] = x
    return out


def _parts(arrays, entries: tuple[Entry, ...]) -> dict[str, list]:
    """{group: its arrays raveled, in tree order} (jnp or np arrays)."""
    parts: dict[str, list] = {}
    for e, x in zip(entries, arrays):
        parts.setdefault(e.group, []).append(x.reshape(-1))
    return parts


@functools.cache
def _device_program(entries: tuple[Entry, ...]):
    def pack(arrays):
        # A copy where a group has one array: a new buffer, never the input forwarded.
        return _nest({g: jnp.concatenate(p) if len(p) > 1 else jnp.copy(p[0])
                      for g, p in _parts(arrays, entries).items()})
    return jax.jit(pack)


def pack_on_device(state, program=None):
    """The flat arrays on the state's devices: one jitted program, launched and not
    waited for (new buffers: the next step's donation leaves them alone). program: that
    program compiled ahead (`device_program(state).lower(...).compile()`)."""
    return (program or device_program(state))(jax.tree.leaves(state))


def device_program(state):
    """pack_on_device's jitted program for `state`'s layout (to lower and compile ahead)."""
    return _device_program(layout_of(state).entries)


def host_buffers(layout: Layout) -> dict[str, dict[str, np.ndarray]]:
    """Empty flat arrays for `pack_on_host(..., out=)`."""
    return jax.tree.map(lambda a: np.empty(a.shape, a.dtype), layout.packed_abstract())


def pack_on_host(state, out=None):
    """The flat arrays as numpy arrays, copied from host views of `state`'s arrays (CPU
    devices, where a jitted program would run on the calling thread; or fetched from an
    accelerator): for the saving thread. out: flat arrays to copy into (`host_buffers`),
    reused from save to save: the first touch of 1.4 GB of fresh memory took 1.5-3 s of
    page faults on the 2-core CPU host, the copy into touched memory 0.14 s."""
    arrays = [np.asarray(x) for x in jax.tree.leaves(state)]
    parts = _parts(arrays, layout_of(state).entries)
    if out is None:
        return _nest({g: np.concatenate(p) for g, p in parts.items()})
    for group, p in parts.items():
        top, dtype = _split(group)
        np.concatenate(p, out=out[top][dtype])
    return out


def save_args(layout: Layout, make):
    """orbax's per-array save arguments for the flat arrays: `make(chunk_byte_size)`."""
    return jax.tree.map(lambda _: make(CHUNK_BYTES), layout.packed_abstract())


def host_templates(layout: Layout, tops=None):
    """Numpy stand-ins of the flat arrays (shape and dtype, no memory) that make orbax
    restore them as numpy arrays; `tops`: only those top-level entries."""
    return {top: jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape), by_dtype)
            for top, by_dtype in layout.packed_abstract().items() if tops is None or top in tops}


def unpack(packed, layout: Layout, abstract_state):
    """The state of `abstract_state`'s tree from the flat (numpy) arrays: each array
    placed onto its abstract leaf's sharding (any mesh; its dtype where that differs).
    Only the abstract state's paths are read: a subtree works (warm start)."""
    by_path = {e.path: e for e in layout.entries}
    flat, treedef = jax.tree_util.tree_flatten(abstract_state)
    out = []
    for (path, _), leaf in zip(digests.tree_paths(abstract_state), flat):
        e = by_path[path]
        top, dtype = _split(e.group)
        host = np.asarray(packed[top][dtype][e.offset:e.offset + e.size]).reshape(e.shape)
        if host.dtype != leaf.dtype:
            host = host.astype(leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            out.append(jax.device_put(host))
        else:
            out.append(jax.make_array_from_callback(e.shape, sharding, lambda i, h=host: h[i]))
    return jax.tree_util.tree_unflatten(treedef, out)
