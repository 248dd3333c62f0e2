"""Multi-head attention as a Flax module: projections around `attention.dot_product_attention`.

    y, aux = MultiHeadAttention(num_heads=8)(x, causal...)       # self-attention
    y, aux = MultiHeadAttention(num_heads=8)(x, context=enc)     # cross-attention

Parameters are per head, their axes following the shape letters (gemma's einsum style):
  self-attention, K == N  "qkv"   [D, 3, N, H]   one fused matmul for q, k and v
  otherwise               "query" [D, N, H] and "kv" [Dc, 2, K, H] (k and v fused)
  output                  "out"   [N, H, D]
Grouped-query attention (Ainslie et al. 2023) uses K < N key/value heads, multi-query
attention (Shazeer 2019) K = 1: fewer K/V heads shrink the decoding cache by N/K.

Decoding cache (prefill, then one token at a time). The cache holds the keys and values
of every earlier token, "key"/"value" [B, S_max, K, H] in the "cache" collection, where
S_max is the length of the dummy input the cache was created with. In decode mode the
caller passes `positions` [B, T], the absolute positions of the new tokens, contiguous
per row; their keys/values are written at slots positions[:, 0] ... + T - 1 and the
queries attend causally with q_offset = positions[:, 0]. Batches of prompts of different
lengths are RIGHT-padded: prefill the padded [B, T] block at positions 0..T-1, then feed
row b's next token at position len_b. The padding slots len_b..T-1 hold junk keys, but
causality hides every slot after the current position, and each is overwritten by a real
token before any query can see it — so no padding mask is needed while decoding.
Writing past S_max is an error where positions are known (a layer applied eagerly); inside
jit, and inside a model's scanned or rematerialised layers (where positions are traced
even in an eager call), it cannot be checked (dynamic_update_slice would clamp): the
caller (e.g. `models.gpt.generate`) sizes the cache for prompt + new tokens.

Dropout (`dropout_rate`) acts on the per-head outputs before the output projection: the
blockwise and fused kernels never form the attention weights, so dropping weights
(Vaswani's attention dropout) would make implementations disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from attention_jax import axes
from attention_jax.attention import (IMPLEMENTATIONS, dot_product_attention,
                                     packed_self_attention, reads_packed)
from attention_jax.errors import check_rates_and_epsilon, known_values
from attention_jax.layers.linear import matmul
from attention_jax.layers.logical import mesh_axes
from attention_jax.layers.posemb import apply_rope
from attention_jax.quiet import warn_once


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(d_model: int, num_heads: int, num_kv_heads: Optional[int] = None,
                head_dim: Optional[int] = None, *,
                head_dim_settable: bool = True) -> tuple[int, int, int]:
    """(N, K, H) after validation; raises ValueError naming the valid choices.
    head_dim_settable: whether the caller has a head_dim field the message may suggest
    (a model config whose head dim is always D / N has none)."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive; got {num_heads}")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(
                f"num_heads={num_heads} does not divide the model width D={d_model} ("
                + ("set head_dim explicitly, or " if head_dim_settable else "")
                + f"use num_heads in {_divisors(d_model)})")
        head_dim = d_model // num_heads
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if kv <= 0 or num_heads % kv:
        raise ValueError(f"num_kv_heads={kv} must divide num_heads={num_heads}; "
                         f"valid: {_divisors(num_heads)}")
    return num_heads, kv, head_dim


def _check_cache_room(positions, slots: int) -> None:
    """New tokens past the cache's slots as an error where positions are known (eager
    decoding, as in a notebook): under jit dynamic_update_slice would clamp the write and
    the outputs would be wrong with nothing said."""
    known = known_values(positions)
    last = int(known.max()) if known is not None and known.size else -1
    if last >= slots:
        raise ValueError(f"decode: position {last} is past the cache's {slots} slots (the "
                         f"length of the input it was created with); valid: positions "
                         f"0..{slots - 1}, or a cache created with a longer input")


def _write_cache(cache, new, start):
    """cache [B, S, K, H] with new [B, T, K, H] written at row b's slots start[b].. ."""
    def one(c, x, s):  # the indices of one dtype (literal zeros are int64 under x64)
        zero = jnp.zeros_like(s)
        return lax.dynamic_update_slice(c, x.astype(c.dtype), (s, zero, zero))
    return jax.vmap(one)(cache, new, start.astype(jnp.int32))


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped/multi-query) attention with output projection.

    Attributes:
      num_heads: N query heads.  num_kv_heads: K key/value heads (default N; must divide N).
      head_dim: H (default D // N).  out_features: output width (default the input's D).
      causal: query i sees keys j <= i (decoders).  window: local attention, see
        `dot_product_attention`.
      use_bias: biases on the projections (GPT-2, BERT, Vaswani: yes; LLaMA: no).
      dropout_rate: on per-head outputs before the output projection (see module doc).
      implementation: the attention backend ("auto" default: cuDNN or the Pallas kernels on a
        GPU, attention.explain / explain_packed say which; blockwise on CPU; "reference"
        to get weights).
      ring_inner: the kernel on each chunk pair when the ring runs (a `sequence` mesh axis):
        "auto" (Pallas on an NVIDIA GPU, splash on a TPU, blockwise elsewhere) or one of
        attention.RING_INNER to force it (tests force the fused kernels on CPU).
      rope_base: if set, rotary embeddings with this base on q and k (self-attention only).
      scale: the logits' multiplier (default 1/sqrt(H); 1.0 turns the scaling off, for the
        ablation that shows why it is there).
      fuse_qkv: one [D, 3, N, H] projection for self-attention when K == N.
      defer_output_bias: return y without the output projection's bias and the bias in
        aux["output_bias"], for the caller to add (a pre-norm block's next norm adds it in
        its kernel as it reads y, layers/norms.py add_normalize). The bias is the
        parameter as it is, in param_dtype: cast it to y's dtype before adding it
        yourself (y + bias of a bfloat16 y and a float32 bias is float32).
      kernel_init: overrides the per-kernel fan-in initialiser (any shape-agnostic init).
    """

    num_heads: int
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    out_features: Optional[int] = None
    causal: bool = False
    window: Union[int, tuple[int, int], None] = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    implementation: str = "auto"
    ring_inner: str = "auto"
    rope_base: Optional[float] = None
    scale: Optional[float] = None
    fuse_qkv: bool = True
    defer_output_bias: bool = False
    kernel_init: Optional[Callable] = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _param(self, name, shape, names, in_axis, out_axis):
        init = self.kernel_init or nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)
        return self.param(name, nn.with_logical_partitioning(init, names), shape, self.param_dtype)

    def _bias(self, name, shape, names, cast: bool = True):
        """The bias `name` in dtype (cast=False: in param_dtype, for a kernel that reads it
        so: no launch of its own to cast it, its gradient summed in float32)."""
        if not self.use_bias:
            return 0.0
        init = nn.with_logical_partitioning(nn.initializers.zeros, names)
        bias = self.param(name, init, shape, self.param_dtype)
        return bias.astype(self.dtype) if cast else bias

    @nn.compact
    def __call__(self, x, context=None, *, positions=None, segment_ids=None, kv_mask=None,
                 mask=None, deterministic: bool = True, decode: bool = False,
                 return_weights: bool = False):
        """x [B, T, D] (queries), context [B, S, Dc] or None (self-attention).

        positions: [B, T] int positions of x's tokens; used by RoPE, and required for
          self-attention in decode mode (see the module doc). Default arange(T).
        segment_ids [B, T] (self-attention, packed sequences), kv_mask [B, S] bool (True =
          real key; padding), mask: dense bool broadcastable to [B, N, T, S].
        decode: use and update the "cache" collection (call with mutable=["cache"]).
        return_weights: also return weights [B, N, T, S] in aux (reference path).
        Returns (y [B, T, out_features or D], aux) with aux {"attention_weights": ...}
        when asked, and {"output_bias": [D]} with defer_output_bias and use_bias.
        """
        if x.ndim != 3 or (context is not None and context.ndim != 3):
            raise ValueError(f"x: shape {x.shape}" + (f", context: shape {context.shape}"
                                                      if context is not None else "")
                             + "; valid: [B, T, D] (one sequence: x[None])")
        b, t, d = x.shape
        check_rates_and_epsilon(self)  # dropout_rate=10 (a percentage) zeroed every output
        self_attention = context is None
        if not self_attention:  # each was left out of a cross-attention without a word
            given = [name for name, on in (("causal=True", self.causal),
                                           ("segment_ids", segment_ids is not None),
                                           ("rope_base", self.rope_base is not None)) if on]
            if given:
                raise ValueError(f"{', '.join(given)}: for self-attention (context=None); a "
                                 f"cross-attention (context given) attends to every context "
                                 f"key; valid there: kv_mask [B, S] or mask for the context's "
                                 f"padding")
        n, k_heads, h = check_heads(d, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={self.implementation!r} is unknown; "
                             f"valid: {IMPLEMENTATIONS}")
        x = x.astype(self.dtype)
        # q, k and v are separate 2-D matmuls even from the fused [D, 3, N, H] kernel:
        # slicing one [B, T, 3, N, H] product apart copies it (layers/linear.py). Only a
        # backend that reads the one product in place (attention.reads_packed: the Pallas
        # kernels, which fold the bias into their algebra) gets it whole.
        def project(src, w, bias, c):  # src · w[:, c] + bias[c]: [B, T, D] -> [B, T, heads, H]
            return matmul(src, w[:, c]) + (bias[c] if self.use_bias else 0.0)

        def output(out):  # dropout on the heads' outputs [B, T, N, H], the output projection
            out = nn.Dropout(self.dropout_rate)(out, deterministic=deterministic)
            d_out = self.out_features or d
            wo = self._param("out", (n, h, d_out), (axes.HEADS, axes.HEAD_DIM, axes.EMBED),
                             (0, 1), 2)
            y = matmul(out, wo.astype(self.dtype), in_dims=2)  # [B, T, D]
            defer = self.defer_output_bias and self.use_bias
            bias = self._bias("out_bias", (d_out,), (axes.EMBED,), cast=not defer)
            if defer:
                aux["output_bias"] = bias
            else:
                y = y + bias
            return nn.with_logical_constraint(y, (axes.BATCH, axes.LENGTH, axes.EMBED))

        aux = {}
        # Where the kernels are ones XLA cannot partition, they run split as these say.
        split = dict(batch_axes=mesh_axes(axes.BATCH), head_axes=mesh_axes(axes.HEADS))
        masks = dict(causal=self.causal and self_attention, window=self.window,
                     segment_ids=segment_ids if self_attention else None, kv_mask=kv_mask,
                     mask=mask, scale=self.scale, ring_inner=self.ring_inner)
        if self_attention and k_heads == n and self.fuse_qkv:
            w = self._param("qkv", (d, 3, n, h), (axes.EMBED, None, axes.HEADS, axes.HEAD_DIM),
                            0, (1, 2, 3)).astype(self.dtype)
            # (in param_dtype for the kernels reading qkv packed; cast for project)
            bias = self._bias("qkv_bias", (3, n, h), (None, axes.HEADS, axes.HEAD_DIM),
                              cast=False)
            if (self.rope_base is None and not decode and not return_weights and reads_packed(
                    jax.ShapeDtypeStruct((b, t, 3, n, h), self.dtype),
                    implementation=self.implementation, **split, **masks)):
                qkv = nn.with_logical_constraint(
                    matmul(x, w), (axes.BATCH, axes.LENGTH, None, axes.HEADS, axes.HEAD_DIM))
                out = packed_self_attention(qkv, bias if self.use_bias else None,
                                            implementation=self.implementation,
                                            **split, **masks)
                return output(out), aux
            bias = bias.astype(self.dtype) if self.use_bias else bias
            q, k, v = (project(x, w, bias, c) for c in range(3))  # each [B, T, N, H]
        else:
            src = x if self_attention else context.astype(self.dtype)
            wq = self._param("query", (d, n, h), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), 0, (1, 2))
            q = matmul(x, wq.astype(self.dtype))
            q = q + self._bias("query_bias", (n, h), (axes.HEADS, axes.HEAD_DIM))
            wkv = self._param("kv", (src.shape[-1], 2, k_heads, h),
                              (axes.EMBED, None, axes.KV_HEADS, axes.HEAD_DIM), 0, (1, 2, 3))
            wkv = wkv.astype(self.dtype)
            bkv = self._bias("kv_bias", (2, k_heads, h), (None, axes.KV_HEADS, axes.HEAD_DIM))
            k, v = (project(src, wkv, bkv, c) for c in range(2))  # [B, S, K, H]
        q = nn.with_logical_constraint(q, (axes.BATCH, axes.LENGTH, axes.HEADS, axes.HEAD_DIM))
        kv_names = (axes.BATCH, axes.LENGTH, axes.HEADS if k_heads == n else axes.KV_HEADS,
                    axes.HEAD_DIM)
        k = nn.with_logical_constraint(k, kv_names)
        v = nn.with_logical_constraint(v, kv_names)

        if positions is None:
            if decode and self_attention:
                raise ValueError("decode=True needs positions [B, T]: the absolute positions of "
                                 "the new tokens (where their keys go in the cache)")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if self.rope_base is not None and self_attention:
            q = apply_rope(q, positions, self.rope_base)
            k = apply_rope(k, positions, self.rope_base)

        q_offset = 0
        if decode and self_attention:
            if not self.causal:
                raise ValueError("decode=True needs a causal self-attention (causal=True): a "
                                 "cache of earlier keys only makes sense left to right")
            if segment_ids is not None or kv_mask is not None or mask is not None:
                raise ValueError("decode=True takes no segment_ids/kv_mask/mask: cached slots "
                                 "are hidden by causality (right-padded prompts, see module doc)")
            if not self.is_initializing() and not self.has_variable("cache", "key"):
                raise ValueError("decode=True without a cache: create it with init(..., "
                                 "decode=True) on an input as long as the longest sequence, "
                                 "then apply with {'params': ..., 'cache': ...} and "
                                 "mutable=['cache']")
            cached_k = self.variable("cache", "key", jnp.zeros, k.shape, k.dtype)
            cached_v = self.variable("cache", "value", jnp.zeros, v.shape, v.dtype)
            start = positions[:, 0]  # [B]
            _check_cache_room(positions, cached_k.value.shape[1])
            cached_k.value = _write_cache(cached_k.value, k, start)
            cached_v.value = _write_cache(cached_v.value, v, start)
            k, v, q_offset = cached_k.value, cached_v.value, start  # [B, S_max, K, H]

        implementation = "reference" if return_weights else self.implementation
        if decode and self_attention and (implementation == "ring"
                                          or self.ring_inner != "auto"):
            # A cached step's queries (a prompt of any length, then one token a row at
            # per-row offsets) are no sequence to split over a ring: a ring asked for, or a
            # ring_inner kernel, is the training's request, so decoding takes auto's
            # choice, and says so once.
            warn_once(__name__, ("decode", implementation, self.ring_inner),
                      "decoding with the KV cache takes implementation='auto' (ring_inner="
                      "'auto'), not implementation=%r, ring_inner=%r: a cached step is no "
                      "sequence to split over a ring", implementation, self.ring_inner)
            masks["ring_inner"] = "auto"
            implementation = "auto" if implementation == "ring" else implementation
        out = dot_product_attention(
            q, k, v, q_offset=q_offset, implementation=implementation,
            return_weights=return_weights, **split, **masks)
        if return_weights:
            out, aux["attention_weights"] = out  # [B, N, T, S]
        return output(out), aux
