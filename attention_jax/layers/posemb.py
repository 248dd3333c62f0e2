"""Position information: sinusoidal, learned absolute, and rotary (RoPE); and the lookup
tables every model embeds its tokens with (`Embed`, `lookup`).

Attention by itself is permutation equivariant; these are the three ways the lectures
give it word order. The first two are added to the token embeddings; RoPE instead
rotates queries and keys inside attention so that q·k depends on the offset i - j only.

    x = tok + sinusoidal(positions, D)                    # [B, T, D]
    x = tok + LearnedPositionEmbedding(max_len, D)(positions)
    q = apply_rope(q, positions)                          # [B, T, N, H], inside attention
    embed = Embed(V, D, dtype=jnp.bfloat16); x = embed(tokens); logits = embed.attend(h)
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from attention_jax import axes
from attention_jax.errors import known_values
from attention_jax.layers.linear import matmul

POSITIONS = ("learned", "sinusoidal", "rope", "none")  # what models accept by name


def sinusoidal(positions, dim: int, base: float = 10000.0, dtype: Any = jnp.float32):
    """positions [..., T] (ints) -> [..., T, D] (Vaswani et al. 2017, §3.5):

        PE(p, 2i) = sin(p / base^(2i/D)),   PE(p, 2i+1) = cos(p / base^(2i/D)).

    Wavelengths form a geometric progression from 2π to base·2π, so PE(p + k) is a
    linear function (a rotation per pair) of PE(p) for any fixed k.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal embeddings need an even dim (sin/cos pairs); got {dim}")
    exact = jnp.promote_types(dtype, jnp.float32)  # float64 tables where asked for
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=exact) / dim)  # [D/2]
    angles = jnp.asarray(positions, exact)[..., None] * inv_freq  # [..., T, D/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., T, D/2, 2]
    return pe.reshape(*angles.shape[:-1], dim).astype(dtype)  # sin at even, cos at odd


def sinusoidal_table(length: int, dim: int, base: float = 10000.0):
    """The [length, D] table of `sinusoidal` for positions 0..length-1 (for plots)."""
    return sinusoidal(jnp.arange(length), dim, base)


class LearnedPositionEmbedding(nn.Module):
    """A learned table [num_positions, D] (GPT-2, BERT, ViT): positions [B, T] -> [B, T, D]."""

    num_positions: int
    features: int
    embedding_init: Callable = nn.initializers.normal(stddev=0.02)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, positions):
        table = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, (axes.POSITION, axes.EMBED)),
            (self.num_positions, self.features), self.param_dtype)
        return lookup(table, positions, axes.POSITION).astype(self.dtype)  # [B, T, D]


def lookup(table, ids, rows_axis: str | None = axes.VOCAB):
    """Rows `ids` [B, T] of an embedding table [R, D] -> [B, T, D], in the table's dtype.

    Under FSDP the table's D is split over `fsdp` (rule embed -> fsdp). A gather from the
    split table yields [B, T, D/fsdp] pieces, which no collective turns into activations
    split by batch over (data, fsdp): XLA then falls back to replicating the result ("[SPMD]
    Involuntary full rematerialization") at every lookup, most visibly when sampling a
    few prompts. So the table is first gathered to whole rows, as FSDP gathers every
    weight before use; the rows stay split over `tensor` (a masked gather and a sum).
    """
    _check_rows(ids, table.shape[0], rows_axis)
    table = nn.with_logical_constraint(table, (rows_axis, None))
    return jnp.take(table, ids, axis=0)


def _outside(x, limit: int) -> int | None:
    """A concrete (eager) integer value of `x` outside 0..limit-1, or None (none, or `x`
    traced: under jit a gather past the end gives NaN or wraps, -1 to the last, unsaid)."""
    values = known_values(x)
    if values is None or not values.size or not np.issubdtype(values.dtype, np.integer):
        return None
    low, high = int(values.min()), int(values.max())
    return low if low < 0 else high if high >= limit else None


def _check_rows(ids, rows: int, rows_axis) -> None:
    """Out-of-range ids as an error where they can be seen. A gather under jit cannot
    raise: JAX fills an out-of-range row with NaN, and the loss turns NaN with nothing
    said. Concrete ids (a model applied eagerly, as in a notebook) are checked here, as
    PyTorch's embedding checks them; traced ones are the caller's to check."""
    bad = _outside(ids, rows)
    if bad is not None:
        what = "positions" if rows_axis == axes.POSITION else "ids"
        raise ValueError(f"{what}: {bad} is outside the table's {rows} rows; valid: "
                         f"0..{rows - 1}" + (" (the model's max_len)" if what == "positions"
                                              else " (ids of another tokenizer, or a larger "
                                                   "vocabulary than the model's?)"))


def check_below(name: str, x, limit: int, what: str) -> None:
    """Concrete (eager) values of `x` outside 0..limit-1 as an error naming `name`."""
    bad = _outside(x, limit)
    if bad is not None:
        raise ValueError(f"{name}: {bad} is out of range; valid: 0..{limit - 1} ({what})")


def check_ids(name: str, x, shape=None, allow_bool: bool = False) -> None:
    """Raises, naming `name`, unless x is an integer (or, with allow_bool, bool) array of
    shape [B, T] (`shape` when given): a 1-D or float input fails deep inside JAX's
    indexing otherwise."""
    dtype = getattr(x, "dtype", None)
    ok_dtype = dtype is not None and (jnp.issubdtype(dtype, jnp.integer)
                                      or (allow_bool and dtype == jnp.bool_))
    if (getattr(x, "ndim", None) != 2 or not ok_dtype
            or (shape is not None and tuple(x.shape) != tuple(shape))):
        want = f"[B, T]={list(shape)}" if shape is not None else "[B, T]"
        got = f"{dtype} {tuple(x.shape)}" if dtype is not None else type(x).__name__
        raise ValueError(f"{name} must be an {'int/bool' if allow_bool else 'int'} array of "
                         f"shape {want}; got {got}")


class Embed(nn.Module):
    """A lookup table [R, D] (tokens, token types): ids [...] -> rows [..., D] in `dtype`,
    and `attend(x)` = x · tableᵀ, the output head tied to it. The parameter is flax's
    nn.Embed's ("embedding", [R, D]), so checkpoints and converted weights load either way.

    What differs is where mixed precision happens. nn.Embed casts the whole table to
    `dtype` and then gathers; the gradient of a gather is a scatter-add of every
    occurrence of a row, which then accumulates in bfloat16: a frequent token's thousands
    of contributions lose their low bits, and on a GPU a bfloat16 scatter-add has no
    native atomic (a compare-and-swap loop; 2.5 ms a step into GPT-2's [50304, 768] table
    on an H100, issue #35). Here the rows are gathered from the table in `param_dtype`
    (float32) and cast after: the scatter-add accumulates in float32, as in a model
    trained on float32 parameters. The trainer passes the float32 parameters (steps.py)."""

    num_embeddings: int
    features: int
    embedding_init: Callable = nn.initializers.normal(stddev=1.0)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    rows_axis: Any = axes.VOCAB  # the logical axis of the table's rows (lookup)

    def setup(self):
        self.embedding = self.param("embedding", self.embedding_init,
                                    (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, ids):
        return lookup(self.embedding, ids, self.rows_axis).astype(self.dtype)  # [..., D]

    def attend(self, x):
        """x [..., D] -> [..., R]: x · Eᵀ in `dtype` (a tied output head)."""
        return matmul(x.astype(self.dtype), self.embedding.astype(self.dtype).T)


def rope_angles(positions, head_dim: int, base: float = 10000.0, dtype: Any = jnp.float32):
    """positions [B, T] -> angles [B, T, H/2]: position p rotates pair i by p·base^(-2i/H),
    computed in `dtype` (float32, or float64 for a float64 x)."""
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of coordinates: head_dim must be even; got {head_dim}")
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim)  # [H/2]
    return jnp.asarray(positions, dtype)[..., None] * inv_freq


def apply_rope(x, positions, base: float = 10000.0):
    """Rotary position embedding (Su et al. 2021, RoFormer): x [B, T, N, H] -> [B, T, N, H].

    Each pair of coordinates (x_i, x_{i+H/2}) is rotated by the angle p·θ_i. Rotations
    compose, R(p)ᵀR(p') = R(p' - p), so (R(p) q)·(R(p') k) = q·R(p' - p) k depends only on
    the offset. Pairs are (i, i + H/2) (the GPT-NeoX/LLaMA layout, no strided slices)
    rather than RoFormer's (2i, 2i+1): a fixed permutation of coordinates, same model.
    """
    positions = jnp.asarray(positions)
    if x.ndim != 4 or positions.ndim != 2 or positions.shape[1] != x.shape[1] \
            or positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"apply_rope: x shape {tuple(x.shape)}, positions shape "
                         f"{tuple(positions.shape)}; valid: x [B, T, N, H] with positions "
                         f"[B, T] or [1, T] (one sequence: x[None], positions[None])")
    h = x.shape[-1]
    exact = jnp.promote_types(x.dtype, jnp.float32)
    angles = rope_angles(positions, h, base, exact)[:, :, None, :]  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(exact), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
