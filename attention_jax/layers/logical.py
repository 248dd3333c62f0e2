"""The ambient mesh's axes that a logical axis ("batch", "heads", ...) maps to under flax's
logical rules (sharding.py sets both around a step): what a kernel XLA cannot partition
is split over by hand, in a shard_map (the attention kernels, layers/attention.py; the
loss's, models/losses.py)."""

from __future__ import annotations

import flax.linen as nn
import jax


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The ambient mesh's axes of size > 1 that `logical` maps to under the current logical
    rules (() without a mesh or rules)."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return ()
    names = nn.logical_to_mesh_axes((logical,), rules)[0]
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    return tuple(a for a in names if mesh.shape.get(a, 1) > 1)
