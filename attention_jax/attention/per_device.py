"""Kernels XLA cannot partition, run on each device's share of a call.

XLA's SPMD partitioner splits its own operations over a mesh, and cuDNN's attention comes
with a partitioning rule, but a Pallas kernel is an opaque custom call: handed q, k, v
split over the batch, XLA gathers them whole onto every device and each device computes
the attention of the whole batch (found compiling a data-parallel step for two H100s on
a CPU host, 2026-11-26). Attention is independent across batch rows and heads, so such a
backend runs here under `jax.shard_map` instead: each device on its own rows and heads,
with a call record of those local sizes, and nothing crosses devices.

Which mesh axes split the batch and the heads is the caller's to say (`batch_axes`,
`head_axes` of `dot_product_attention`; the layers pass what the logical rules map
"batch" and "heads" to). An axis of size 1, one already manual (inside a shard_map of the
caller's) or a split that does not divide what it splits is left out, and said once: those
rows or heads are then whole on each device, as XLA would have them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import jax
from jax.sharding import PartitionSpec

from attention_jax.attention.call import AttentionCall
from attention_jax.quiet import warn_once

@dataclasses.dataclass(frozen=True)
class Split:
    """The ambient mesh's axes that split the batch and the heads of one call."""

    batch: tuple[str, ...]
    heads: tuple[str, ...]

    def spec(self, roles: Sequence[Optional[str]]) -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions are `roles` ("B" batch, "N"
        heads, None neither)."""
        by_role = {"B": self.batch or None, "N": self.heads or None}
        return PartitionSpec(*(by_role.get(r) if r else None for r in roles))


def _free_axes() -> Optional[dict[str, int]]:
    """The ambient mesh's axes that have devices to split over (more than one, not manual
    already), by name; None without a mesh of several devices."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return {a: mesh.shape[a] for a in mesh.axis_names
            if a not in getattr(mesh, "manual_axes", ()) and mesh.shape[a] > 1}


def _split_axes(names: Sequence[str], free: dict[str, int], *sizes: int):
    """The axes of `names` with devices (in `free`), or None where their devices do not
    divide every one of `sizes`."""
    names = tuple(a for a in names if a in free)
    devices = math.prod(free[a] for a in names)
    return None if names and any(s % devices for s in sizes) else names


def split_of(call: AttentionCall, batch_axes: Sequence[str], head_axes: Sequence[str],
             backend: str) -> Optional[Split]:
    """How to split `call` over the ambient mesh (None: run it whole, as it is)."""
    free = _free_axes()
    if free is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    unknown = sorted((set(batch_axes) | set(head_axes)) - set(mesh.axis_names))
    if unknown:
        raise ValueError(f"batch_axes={tuple(batch_axes)}, head_axes={tuple(head_axes)} name "
                         f"{unknown}, which the mesh does not have; its axes: {mesh.axis_names}")

    def usable(what, names, *sizes):
        axes = _split_axes(names, free, *sizes)
        if axes is None:
            names = tuple(a for a in names if a in free)
            warn_once(__name__, (backend, what, sizes, names),
                      "attention %r: %s %s do not divide over mesh axes %s (%d devices): "
                      "each device computes all of them", backend, what, sizes, names,
                      math.prod(free[a] for a in names))
            return ()
        return axes

    split = Split(usable("batch", batch_axes, call.batch),
                  usable("heads", head_axes, call.heads, call.kv_heads))
    if not split.batch and not split.heads:
        warn_once(__name__, backend, "attention %r under a mesh of %d devices with nothing to "
                  "split it by (batch_axes=%s, head_axes=%s): XLA gathers q, k, v whole onto "
                  "every device, and each computes the whole call", backend, mesh.size,
                  tuple(batch_axes), tuple(head_axes))
        return None
    return split


def divides(call: AttentionCall, batch_axes: Sequence[str], head_axes: Sequence[str]) -> bool:
    """Whether such a backend would run `call` on each device's share alone here: no mesh
    (or one device), or every mesh axis with devices among `batch_axes` and `head_axes`,
    each dividing what it splits. Else some rows or heads are computed whole on several
    devices, where XLA would have split cuDNN's attention. Says nothing (split_of warns)."""
    free = _free_axes()
    if free is None:
        return True
    batch = _split_axes(batch_axes, free, call.batch)
    heads = _split_axes(head_axes, free, call.heads, call.kv_heads)
    return batch is not None and heads is not None and set(free) <= set(batch) | set(heads)


def run(fn: Callable, call: AttentionCall, split: Split, inputs: tuple,
        roles: tuple[tuple[Optional[str], ...], ...]):
    """fn(*inputs, call) on each device's share: `inputs` split by their dimensions'
    `roles`, the mask's arrays by theirs, the output [B, T, N, Hv] by batch and heads."""
    mesh = jax.sharding.get_abstract_mesh()
    devices = lambda names: math.prod(mesh.shape[a] for a in names)  # noqa: E731
    spec = call.spec
    dense = None if spec.mask is None else (
        "B" if spec.mask.shape[0] > 1 else None, "N" if spec.mask.shape[1] > 1 else None,
        None, None)
    masks = {"q_offset": ("B",), "q_segment_ids": ("B", None), "kv_segment_ids": ("B", None),
             "kv_lengths": ("B",), "mask": dense}
    masks = {name: r for name, r in masks.items() if getattr(spec, name) is not None}
    local = dataclasses.replace(call, batch=call.batch // devices(split.batch),
                                heads=call.heads // devices(split.heads),
                                kv_heads=call.kv_heads // devices(split.heads))

    def body(inputs, mask_arrays):
        return fn(*inputs, dataclasses.replace(local, spec=dataclasses.replace(spec, **mask_arrays)))

    in_specs = (tuple(split.spec(r) for r in roles),
                {name: split.spec(r) for name, r in masks.items()})
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=split.spec(("B", None, "N", None)), check_vma=False)(
        inputs, {name: getattr(spec, name) for name in masks})
