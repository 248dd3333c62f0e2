"""Memory-efficient attention: queries in blocks (lax.scan), keys in blocks, online softmax.

For each block of `bq` queries we walk the key/value blocks keeping, per query row,
the running max m, the running sum l of exp(score - m), and the running output
acc = Σ exp(score - m)·v. When a new tile raises the max, the old sums are rescaled by
exp(m_old - m_new) (Milakov & Gimelshein 2018; Rabe & Staats 2021). Only one
[B, N, bq, bk] tile of scores exists at a time, so memory is O(T + S), not O(T·S).

The backward pass is written by hand (jax.custom_vjp), FlashAttention-2 style: the
forward saves only its output O and the per-row log-sum-exp L = m + log l; the backward
recomputes each tile's probabilities P = exp(QKᵀ·scale - L) from them and accumulates
  dV += Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - rowsum(dO ∘ O)),
  dQ += dS K·scale,   dK += dSᵀ Q·scale,
so the gradient is O(T + S) memory as well. Autodiff through the loops would instead
store every tile's probabilities for the backward pass: the N×N matrix again.

Tiles that a causal or windowed mask hides entirely are never visited (loop bounds
depend on the block index), and tiles it shows entirely skip the mask arithmetic.
Inside, arrays are head-major and three-dimensional — q [X, G, T, H], k and v [X, S, H]
with X = B·K — and a tile is [X, R, bk] with R = G·bq query rows, so every tile product
is a plain batched matmul whose result needs no copy or transpose (on CPU, a per-tile
copy of the scores costs as much as the exp).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from attention_jax.attention.call import AttentionCall, Platform, target_backend
from attention_jax.attention.masks import MaskSpec, group_heads, visible


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about the call that is a Python value (hashable, fixed at trace time)."""

    causal: bool
    window: Optional[tuple[int, int]]
    scale: float
    bq: int  # query block
    bk: int  # key/value block
    q_len: int  # T before padding
    kv_len: int  # S before padding
    batch: int  # B
    kv_heads: int  # K

    def spec(self, arrays) -> MaskSpec:
        return MaskSpec(self.causal, self.window, *arrays)


def blockwise_attention(q, k, v, spec: MaskSpec, scale: float, block_q: int, block_k: int):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv]."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    st = _Static(spec.causal, spec.window, float(scale), min(block_q, t), min(block_k, s),
                 t, s, b, kh)
    arrays = (spec.q_offset, spec.q_segment_ids, spec.kv_segment_ids, spec.mask, spec.kv_lengths)
    y = _attention_vjp(st, *to_groups(q, k, v), arrays)  # [X, G, T, Hv]
    return from_groups(y, b, kh)


def auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """The last row "auto" looks at, so its reason is always given: this path runs every
    call on every backend, in O(T + S) memory."""
    return f"backend {platform.backend!r}: the portable lax.scan kernel"


def to_groups(q, k, v):
    """The kernel's head-major layout: the G query heads of a group share one K/V head.

    q [B, T, N, H] -> [B·K, G, T, H];  k [B, S, K, H] -> [B·K, S, H];  v likewise.
    """
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
    qx = jnp.transpose(q.reshape(b, t, kh, n // kh, h), (0, 2, 3, 1, 4)).reshape(b * kh, -1, t, h)
    kx = jnp.transpose(k, (0, 2, 1, 3)).reshape(b * kh, s, h)  # [X, S, H], never copied per head
    vx = jnp.transpose(v, (0, 2, 1, 3)).reshape(b * kh, s, hv)
    return qx, kx, vx


def from_groups(y, batch: int, kv_heads: int):
    """[B·K, G, T, Hv] -> [B, T, N, Hv], the inverse of `to_groups` for outputs."""
    _, g, t, hv = y.shape
    y = jnp.transpose(y.reshape(batch, kv_heads, g, t, hv), (0, 3, 1, 2, 4))
    return y.reshape(batch, t, kv_heads * g, hv)


# ----------------------------------------------------------------------------- helpers


def _acc_dtype(dtype):
    """Accumulate in float32 at least; float64 inputs stay float64."""
    return jnp.promote_types(dtype, jnp.float32)


def _cpu_dot_inputs(*operands):
    """The operands of a dot XLA:CPU may not run in bfloat16: it folds the transpose of
    kj_t into the dot, and for bf16 × bf16 → f32 contracting a middle axis it has no
    kernel (it fails at run time: "Unsupported element type for DotThunk"). There the
    operands are widened to float32 (the same result: the products are exact in f32);
    other backends keep them narrow."""
    if target_backend() != "cpu" or all(x.dtype != jnp.bfloat16 for x in operands):
        return operands
    return tuple(x.astype(jnp.float32) for x in operands)


def _pad_to(x, axis: int, multiple: int, value=0):
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


class _Tiles:
    """Padded inputs and the per-tile views both passes need."""

    def __init__(self, st: _Static, q, k, v, arrays):
        self.st = st
        offset, q_seg, kv_seg, dense, self.kv_lengths = arrays
        self.q = _pad_to(q, 2, st.bq)  # [X, G, Tp, H]
        self.k = _pad_to(k, 1, st.bk)  # [X, Sp, H]
        self.v = _pad_to(v, 1, st.bk)
        self.groups = q.shape[1]
        self.nq = self.q.shape[2] // st.bq
        self.nk = self.k.shape[1] // st.bk
        self.offset = offset  # [B]
        self.off_min, self.off_max = jnp.min(offset), jnp.max(offset)
        self.q_seg = None if q_seg is None else _pad_to(q_seg, 1, st.bq)
        self.kv_seg = None if kv_seg is None else _pad_to(kv_seg, 1, st.bk, value=-1)
        self.dense = None
        if dense is not None:
            dense = _pad_to(_pad_to(dense, 2, st.bq), 3, st.bk, value=False)
            self.dense = group_heads(dense, st.kv_heads)  # [B|1, K|1, G|1, Tp, Sp]
        self.spec = st.spec(arrays)
        self.kv_padded = self.k.shape[1] != st.kv_len
        self.data_dependent = self.spec.has_data_dependent

    def q_rows(self, x, i):
        """Query block i of an [X, G, Tp, ...] array, as [X, R, ...] rows (R = G·bq)."""
        tile = _slice(x, i * self.st.bq, self.st.bq, 2)
        return tile.reshape(tile.shape[0], -1, *tile.shape[3:])

    def kv_tile(self, x, j):
        """Key block j of an [X, Sp, ...] array."""
        return _slice(x, j * self.st.bk, self.st.bk, 1)

    def unrows(self, rows):
        """[X, R, ...] -> [X, G, bq, ...], to write a block back."""
        return rows.reshape(rows.shape[0], self.groups, self.st.bq, *rows.shape[2:])

    def scores(self, qi, kj):
        """[X, R, H] x [X, bk, H] -> [X, R, bk] in the accumulation dtype."""
        return jnp.einsum("XRH,XSH->XRS", qi, kj, preferred_element_type=_acc_dtype(qi.dtype))

    def tile_mask(self, i, j, transposed=False):
        """Visibility [X, R, bk] of tile (i, j) ([X, bk, R] if transposed), or None."""
        st = self.st
        q_pos = self.offset[:, None] + i * st.bq + jnp.arange(st.bq, dtype=jnp.int32)[None, :]
        k_pos = j * st.bk + jnp.arange(st.bk, dtype=jnp.int32)
        q_seg = None if self.q_seg is None else _slice(self.q_seg, i * st.bq, st.bq, 1)
        k_seg = None if self.kv_seg is None else _slice(self.kv_seg, j * st.bk, st.bk, 1)
        dense = None
        if self.dense is not None:
            dense = _slice(_slice(self.dense, i * st.bq, st.bq, 3), j * st.bk, st.bk, 4)
        ok = visible(self.spec, q_pos, k_pos, q_seg, k_seg, dense,
                     self.kv_lengths)  # [B|1, K|1, G|1, bq, bk]
        if self.kv_padded:
            real = (k_pos < st.kv_len)[None, None, None, None, :]
            ok = real if ok is None else ok & real
        if ok is None:
            return None
        ok = jnp.broadcast_to(ok, (st.batch, st.kv_heads, self.groups, st.bq, st.bk))
        if transposed:
            ok = jnp.transpose(ok, (0, 1, 4, 2, 3))  # [B, K, bk, G, bq]
            return ok.reshape(st.batch * st.kv_heads, st.bk, self.groups * st.bq)
        return ok.reshape(st.batch * st.kv_heads, self.groups * st.bq, st.bk)

    # Which tiles to visit. Query block i holds positions offset + [i·bq, i·bq + bq); key
    # block j holds [j·bk, j·bk + bk). A key j is visible to query p when
    # p - left <= j <= p + right. "lo/hi" bound the blocks with any visible pair (for any
    # batch row); "full" are those where every pair is visible, so no mask is needed.

    def kv_blocks_for(self, i):
        st, spec = self.st, self.spec
        q_min = self.off_min + i * st.bq
        q_max = self.off_max + jnp.minimum(i * st.bq + st.bq, st.q_len) - 1
        lo, hi, nk = 0, self.nk, self.nk
        full_lo, full_hi = lo, hi
        if spec.left is not None:
            lo = jnp.clip(jnp.floor_divide(q_min - spec.left, st.bk), 0, nk)
            full_lo = -jnp.floor_divide(-(q_max - spec.left), st.bk)  # ceil
        if spec.right is not None:
            hi = jnp.clip(jnp.floor_divide(q_max + spec.right, st.bk) + 1, 0, nk)
            full_hi = jnp.floor_divide(q_min + spec.right + 1, st.bk)
        if self.kv_padded:
            full_hi = jnp.minimum(full_hi, nk - 1)
        return self._ranges(lo, hi, full_lo, full_hi)

    def q_blocks_for(self, j):
        st, spec = self.st, self.spec
        k_min = j * st.bk
        k_max = jnp.minimum(j * st.bk + st.bk, st.kv_len) - 1
        lo, hi, nq = 0, self.nq, self.nq
        full_lo, full_hi = lo, hi
        if spec.right is not None:
            lo = jnp.clip(jnp.floor_divide(k_min - spec.right - self.off_max, st.bq), 0, nq)
            full_lo = -jnp.floor_divide(-(k_max - spec.right - self.off_min), st.bq)  # ceil
        if spec.left is not None:
            hi = jnp.clip(jnp.floor_divide(k_max + spec.left - self.off_min, st.bq) + 1, 0, nq)
            full_hi = jnp.floor_divide(k_min + spec.left - self.off_max + 1, st.bq)
        if self.kv_padded:
            full_hi = jnp.where(j == self.nk - 1, full_lo, full_hi)
        return self._ranges(lo, hi, full_lo, full_hi)

    def _ranges(self, lo, hi, full_lo, full_hi):
        """[(start, stop, masked), ...]: the blocks to visit, split by whether they need a mask.

        Only the loops that can be non-empty are built (each loop is compiled code).
        """
        if self.data_dependent:
            return [(lo, hi, True)]
        if not self.spec.has_positional and not self.kv_padded:
            return [(lo, hi, False)]
        a = jnp.clip(full_lo, lo, hi)
        b = jnp.clip(full_hi, a, hi)
        return [(lo, a, True), (a, b, False), (b, hi, True)]


def _run_blocks(ranges, body, carry):
    """Run body(index, carry, masked) over each (start, stop, masked) range in turn."""
    for start, stop, masked in ranges:
        carry = lax.fori_loop(start, stop, functools.partial(_call_masked, body, masked), carry)
    return carry


def _call_masked(body, masked, index, carry):
    return body(index, carry, masked)


# ----------------------------------------------------------------------------- forward


def _folds_scale(scale: float, dtype) -> bool:
    """Whether Q may carry the softmax scale (one multiply of [T, H], not of every [T, S]
    score tile): where Q·scale is exact in Q's dtype, as in float32 and wider, or for a
    power of two (1/8 at head dim 64). Rounded to bfloat16, 1/sqrt(48)'s Q added a
    relative error of 2^-9 to every score (about twice the reference's error at H = 48
    against float64); then the scores take the scale, in float32."""
    if jnp.dtype(dtype) == _acc_dtype(dtype):
        return True
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5


def _forward(st: _Static, q, k, v, arrays, out_dtype=None):
    """Returns y [X, G, T, Hv] (in out_dtype, default q's) and the log-sum-exp
    [X, G, Tp] (+inf on empty rows). Ring attention (ring.py) calls it once per pair of
    sequence chunks, with out_dtype the accumulation dtype, and merges the results."""
    acc_t = _acc_dtype(q.dtype)
    fold = _folds_scale(st.scale, q.dtype)
    if fold:
        q = (q.astype(acc_t) * st.scale).astype(q.dtype)  # the scale in Q, once
    tiles = _Tiles(st, q, k, v, arrays)
    x, g, tp, _ = tiles.q.shape
    rows, hv = g * st.bq, v.shape[-1]

    def q_block(carry, i):
        out, lse = carry
        qi = tiles.q_rows(tiles.q, i)  # [X, R, H]

        def kv_step(j, state, masked):
            m, l, acc = state  # [X, R], [X, R], [X, R, Hv]
            s = tiles.scores(qi, tiles.kv_tile(tiles.k, j))  # [X, R, bk]
            if not fold:
                s = s * st.scale
            ok = tiles.tile_mask(i, j) if masked else None
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            if ok is not None:  # a row with nothing visible yet keeps m = -inf; shift by 0 instead
                m_new_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            else:
                m_new_safe = m_new
            p = jnp.exp(s - m_new_safe[..., None])
            rescale = jnp.exp(m - m_new_safe)
            l = l * rescale + jnp.sum(p, axis=-1)
            pv = jnp.einsum("XRS,XSH->XRH", p.astype(v.dtype), tiles.kv_tile(tiles.v, j),
                            preferred_element_type=acc_t)
            return m_new, l, acc * rescale[..., None] + pv

        init = (jnp.full((x, rows), -jnp.inf, acc_t), jnp.zeros((x, rows), acc_t),
                jnp.zeros((x, rows, hv), acc_t))
        m, l, acc = _run_blocks(tiles.kv_blocks_for(i), kv_step, init)
        y = acc / jnp.where(l == 0, 1.0, l)[..., None]  # empty rows: 0, not 0/0
        row_lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, tiles.unrows(y.astype(out.dtype)), i * st.bq, 2)
        lse = lax.dynamic_update_slice_in_dim(lse, tiles.unrows(row_lse), i * st.bq, 2)
        return (out, lse), None

    init = (jnp.zeros((x, g, tp, hv), out_dtype or q.dtype), jnp.zeros((x, g, tp), acc_t))
    (out, lse), _ = lax.scan(q_block, init, jnp.arange(tiles.nq))
    return out[:, :, : st.q_len], lse


# ----------------------------------------------------------------------------- backward


def _backward(st: _Static, q, k, v, arrays, out, lse, d_out, delta=None, grad_dtype=None):
    """Gradients with key blocks outside and query blocks inside.

    lse is the forward's (padded) log-sum-exp. Ring attention passes the final output,
    log-sum-exp and `delta` [X, G, T] (rowsum(dO ∘ O)) of the whole sequence, so that
    one call gives this pair of chunks' share of dQ, dK and dV, returned in grad_dtype
    (default: the inputs' dtypes) to be summed around the ring.

    Tiles are computed transposed, [X, bk, R] (keys × query rows), so that the two
    products accumulated per key block, dV += Pᵀ dO and dK += dSᵀ Q, are plain matmuls;
    in the forward's [X, R, bk] orientation both would contract over the rows, which
    XLA's CPU matmuls run several times slower. dQ is then accumulated transposed too.
    """
    acc_t = _acc_dtype(q.dtype)
    fold = _folds_scale(st.scale, q.dtype)
    q_scaled = (q.astype(acc_t) * st.scale).astype(q.dtype) if fold else q
    tiles = _Tiles(st, q_scaled, k, v, arrays)
    # D_i = rowsum(dO ∘ O) = Σ_j P_ij dP_ij: the softmax Jacobian's correction term.
    if delta is None:
        delta = jnp.einsum("XGTH,XGTH->XGT", d_out.astype(acc_t), out.astype(acc_t))
    d_out = _pad_to(d_out, 2, st.bq)  # padded rows: dO = 0 and L = +inf, so P = 0 there
    delta = _pad_to(delta, 2, st.bq)
    x, g, tp, h = tiles.q.shape
    sp, hv = tiles.k.shape[1], v.shape[-1]

    def kv_block(carry, j):
        dq_t, dk, dv = carry  # dq_t: [X, G, H, Tp], dQ transposed
        kj, vj = tiles.kv_tile(tiles.k, j), tiles.kv_tile(tiles.v, j)  # [X, bk, H]
        kj_t = jnp.swapaxes(kj, 1, 2)  # [X, H, bk], once per key block

        def q_step(i, state, masked):
            dq_t, dk_j, dv_j = state
            qi = tiles.q_rows(tiles.q, i)  # [X, R, H], scaled where the scale folds
            doi = tiles.q_rows(d_out, i)  # [X, R, Hv]
            s_t = jnp.einsum("XSH,XRH->XSR", kj, qi, preferred_element_type=acc_t)
            if not fold:
                s_t = s_t * st.scale
            ok = tiles.tile_mask(i, j, transposed=True) if masked else None
            if ok is not None:
                s_t = jnp.where(ok, s_t, -jnp.inf)
            # Exactly the forward's probabilities, from its saved log-sum-exp.
            p_t = jnp.exp(s_t - tiles.q_rows(lse, i)[:, None, :])  # [X, bk, R]
            dv_j = dv_j + jnp.einsum("XSR,XRH->XSH", p_t.astype(doi.dtype), doi,
                                     preferred_element_type=acc_t)
            dp_t = jnp.einsum("XSH,XRH->XSR", vj, doi, preferred_element_type=acc_t)
            ds_t = p_t * (dp_t - tiles.q_rows(delta, i)[:, None, :])
            # With Q pre-scaled, dK = dSᵀ (Q·scale) needs no extra factor; dQ does.
            dk_step = jnp.einsum("XSR,XRH->XSH", ds_t.astype(qi.dtype), qi,
                                 preferred_element_type=acc_t)
            dk_j = dk_j + (dk_step if fold else dk_step * st.scale)
            dq_i = jnp.einsum("XHS,XSR->XHR", *_cpu_dot_inputs(kj_t, ds_t.astype(kj.dtype)),
                              preferred_element_type=acc_t) * st.scale  # [X, H, R]
            dq_i = jnp.swapaxes(dq_i.reshape(x, h, g, st.bq), 1, 2)  # [X, G, H, bq]
            dq_block = _slice(dq_t, i * st.bq, st.bq, 3) + dq_i
            return lax.dynamic_update_slice_in_dim(dq_t, dq_block, i * st.bq, 3), dk_j, dv_j

        init = (dq_t, jnp.zeros((x, st.bk, h), acc_t), jnp.zeros((x, st.bk, hv), acc_t))
        dq_t, dk_j, dv_j = _run_blocks(tiles.q_blocks_for(j), q_step, init)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, j * st.bk, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, j * st.bk, 1)
        return (dq_t, dk, dv), None

    init = (jnp.zeros((x, g, h, tp), acc_t), jnp.zeros((x, sp, h), acc_t),
            jnp.zeros((x, sp, hv), acc_t))
    (dq_t, dk, dv), _ = lax.scan(kv_block, init, jnp.arange(tiles.nk))
    dq = jnp.swapaxes(dq_t[..., : st.q_len], 2, 3)  # [X, G, T, H]
    return (dq.astype(grad_dtype or q.dtype), dk[:, : st.kv_len].astype(grad_dtype or k.dtype),
            dv[:, : st.kv_len].astype(grad_dtype or v.dtype))


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_vjp(st, q, k, v, arrays):
    return _forward(st, q, k, v, arrays)[0]


def _attention_fwd(st, q, k, v, arrays):
    out, lse = _forward(st, q, k, v, arrays)
    return out, (q, k, v, arrays, out, lse)


def _attention_bwd(st, residuals, d_out):
    q, k, v, arrays, out, lse = residuals
    dq, dk, dv = _backward(st, q, k, v, arrays, out, lse, d_out)
    # Offsets, segment ids and masks are integers/booleans: they have no gradient.
    return dq, dk, dv, jax.tree.map(lambda _: None, arrays)


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)

