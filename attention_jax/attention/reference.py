"""Attention exactly as the lectures write it: E = QKᵀ·scale, A = softmax(E), Y = AV.

This path builds the whole [B, N, T, S] score matrix. It is the oracle every other
implementation is tested against, and the one that can hand back the attention weights
A for probing and plots. Its memory grows with T·S; use the blockwise path for length.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax.attention.call import AttentionCall, Platform
from attention_jax.attention.masks import MaskSpec, dense_mask


def reference_attention(q, k, v, spec: MaskSpec, scale: float, return_weights: bool = False):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> y [B, T, N, Hv] (and A [B, N, T, S]).

    Scores and softmax are computed in at least float32 (float64 stays float64). A query
    whose keys are all masked gets zero weights and a zero output rather than NaN.
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]: G query heads share a K/V head
    e = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=acc) * scale

    ok = dense_mask(spec, b, n, kv_heads, t, s)
    if ok is not None:
        ok = ok.reshape(b, kv_heads, n // kv_heads, t, s)
        e = jnp.where(ok, e, -jnp.inf)
    # softmax, written out so that an all-masked row gives 0 (not 0/0): the row max is
    # a constant shift (no gradient needed), and an empty row divides by 1 instead of 0.
    row_max = jax.lax.stop_gradient(jnp.max(e, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnorm = jnp.exp(e - row_max)
    total = jnp.sum(unnorm, axis=-1, keepdims=True)
    a = unnorm / jnp.where(total == 0, 1.0, total)

    y = jnp.einsum("BKGTS,BSKH->BTKGH", a.astype(v.dtype), v, preferred_element_type=acc)
    y = y.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
    if return_weights:
        return y, a.reshape(b, n, t, s)
    return y


def run(q, k, v, call: AttentionCall):
    """The dispatcher's entry: y, or (y, A) when the call asks for the weights."""
    return reference_attention(q, k, v, call.spec, call.scale, call.return_weights)


def auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Where "auto" takes the reference: only for the weights, which no other path forms
    (it holds all T·S scores)."""
    return "attention weights asked for: only the reference forms them" if call.return_weights else None
