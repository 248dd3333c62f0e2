"""Structural attention masks, evaluated on any rectangle of (query, key) positions.

Every path computes visibility from the same rule, so the reference (which evaluates
it on the whole T×S grid) and the blockwise kernel (which evaluates it one tile at a
time) cannot disagree. Nothing here builds an N×N array unless asked to for a full grid.

A key at position j is visible to a query at position i when all of these hold:
  - causal:           j <= i
  - window (L, R):    i - L <= j <= i + R
  - segment ids:      q_segment[i] == kv_segment[j]
  - key lengths:      j < kv_lengths[b]   (right padding: the first kv_lengths[b] keys are real)
  - dense mask:       mask[..., i, j]
Query positions are `q_offset + arange(T)`: the offset places the queries after a cache
of earlier keys when decoding (query 0 of a decode step sits at position `q_offset`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """What restricts attention, in a form both implementations read.

    causal / window are static Python values; the arrays are traced.
      q_offset:        int32 [B] position of the first query (0 for self-attention).
      q_segment_ids:   int32 [B, T] or None.
      kv_segment_ids:  int32 [B, S] or None (-1 marks a padding key no query matches).
      mask:            bool [B|1, N|1, T, S] or None, a dense mask where one must be given.
      kv_lengths:      int32 [B] or None: keys at positions >= kv_lengths[b] are padding.
    """

    causal: bool = False
    window: Optional[tuple[int, int]] = None  # (left, right), both >= 0
    q_offset: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    mask: Optional[jax.Array] = None
    kv_lengths: Optional[jax.Array] = None

    @property
    def left(self) -> Optional[int]:
        """How far back a query may look (None: unbounded)."""
        return None if self.window is None else self.window[0]

    @property
    def right(self) -> Optional[int]:
        """How far ahead a query may look (None: unbounded)."""
        if self.causal:
            return 0 if self.window is None else min(self.window[1], 0)
        return None if self.window is None else self.window[1]

    @property
    def has_positional(self) -> bool:
        return self.left is not None or self.right is not None

    @property
    def has_data_dependent(self) -> bool:
        """Masks that depend on array contents, so no tile can be assumed fully visible."""
        return (self.q_segment_ids is not None or self.mask is not None
                or self.kv_lengths is not None)


def visible(spec: MaskSpec, q_pos, k_pos, q_seg=None, k_seg=None, dense=None, k_len=None):
    """Boolean visibility on a grid, broadcast to [B, 1, 1, Tq, Sk].

    q_pos: [B, Tq] absolute query positions; k_pos: [Sk] key positions.
    q_seg / k_seg: [B, Tq] / [B, Sk] segment ids of this rectangle (or None).
    dense: [B|1, N|1, Tq, Sk] slice of the dense mask (or None), reshaped by the caller.
    k_len: [B] number of real keys per batch row (or None).
    Returns None when nothing restricts this rectangle.
    """
    ok = None

    def both(a, b):
        return b if a is None else a & b

    qi = q_pos[:, None, None, :, None]
    kj = k_pos[None, None, None, None, :]
    if spec.right is not None:
        ok = both(ok, kj <= qi + spec.right)
    if spec.left is not None:
        ok = both(ok, kj >= qi - spec.left)
    if q_seg is not None:
        ok = both(ok, q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    if k_len is not None:
        ok = both(ok, kj < k_len[:, None, None, None, None])
    if dense is not None:
        ok = both(ok, dense)
    return ok


def dense_mask(spec: MaskSpec, batch: int, num_heads: int, num_kv_heads: int,
               q_len: int, kv_len: int):
    """The full boolean mask [B, N, T, S] (or None), for paths that need one."""
    q_pos = spec.q_offset[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    k_pos = jnp.arange(kv_len, dtype=jnp.int32)
    dense = None
    if spec.mask is not None:
        dense = group_heads(spec.mask, num_kv_heads)
    ok = visible(spec, q_pos, k_pos, spec.q_segment_ids, spec.kv_segment_ids, dense,
                 spec.kv_lengths)
    if ok is None:
        return None
    ok = jnp.broadcast_to(ok, (ok.shape[0], ok.shape[1], ok.shape[2], q_len, kv_len))
    ok = ok.reshape(ok.shape[0], -1, q_len, kv_len)
    return jnp.broadcast_to(ok, (batch, num_heads, q_len, kv_len))


def group_heads(mask, num_kv_heads: int):
    """[B|1, N|1, T, S] -> [B|1, K|1, G|1, T, S], matching the grouped-query layout."""
    b, n, t, s = mask.shape
    if n == 1:
        return mask[:, :, None]
    return mask.reshape(b, num_kv_heads, n // num_kv_heads, t, s)
