"""The ambient mesh's axes that a logical axis ("batch", "heads", ...) maps to under flax's
logical rules (sharding.py sets both around a step): what a kernel XLA cannot partition
is split over by hand, in a shard_map (the attention kernels, layers/attention.py; the
loss's, models/losses.py)."""

from __future__ import annotations

import flax.linen as nn
import jax

from attention_jax import axes


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The ambient mesh's axes of size > 1 that `logical` maps to under the current logical
    rules (() without a mesh or rules)."""
    return array_mesh_axes((logical,))[0]


def array_mesh_axes(logical: tuple) -> tuple[tuple[str, ...], ...]:
    """mesh_axes of each dimension of an array whose dimensions are `logical` (None: no
    logical axis), as the rules map them for that array: a mesh axis one dimension takes
    is not given to another (activations [batch, length, embed] keep embed whole where
    batch takes the fsdp axis that embed maps to in parameters)."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return ((),) * len(logical)
    out = []
    for names in nn.logical_to_mesh_axes(tuple(logical), rules):
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        out.append(tuple(a for a in names if mesh.shape.get(a, 1) > 1))
    return tuple(out)


def rows_logical(n: int) -> tuple:
    """The logical axes of an activation's n leading axes: batch, length, then none."""
    return ((axes.BATCH, axes.LENGTH) + (None,) * n)[:n]


def row_mesh_axes(n: int) -> tuple[tuple[str, ...], ...]:
    """array_mesh_axes of an activation's n leading axes (rows_logical): what a row-wise
    kernel XLA cannot partition is split over by hand (the loss's, the norms')."""
    return array_mesh_axes(rows_logical(n))
