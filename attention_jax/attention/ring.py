"""Ring attention: the sequence split over the `sequence` mesh axis, keys and values
passed around the devices (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers"; maxtext calls it context parallelism).

    with jax.set_mesh(mesh):   # a mesh with a "sequence" axis of P devices
        y = dot_product_attention(q, k, v, causal=True, implementation="ring")

Each of the P devices keeps its 1/P of the queries and, for them, the running softmax
statistics: the output so far and its log-sum-exp (the max and the sum of the blockwise
kernel folded into one number per row). Its keys and values go round the ring: at step
r, device d holds the block that started on device d - r, hands it on with
`lax.ppermute` (issued before the compute on it, so the transfer can overlap the
compute) and folds it into its statistics with the pair kernel (below), whose
(out, lse) result is merged exactly as the online softmax merges tiles. After P
steps every query has seen every key. (The loop is one lax.scan of P identical steps,
so it also sends on the last one, returning each block home: one transfer in P spent
to compile the step once.) Nothing larger than a device's own share of the
sequence exists on any device: memory O(T / P) for activations, plus the pair
kernel's tile.

The backward (custom_vjp) goes round the ring again: each device runs the pair
kernel's backward with the whole softmax's output and log-sum-exp (so it recomputes
the probabilities of its queries against the visiting block exactly), adds to its own
dQ, and adds to the visiting block's dK/dV accumulators, which travel with the block
and arrive home after P steps.

Layout. Each device holds two chunks of T / (2P) tokens. Under a causal mask, device d
gets chunks d and 2P-1-d (zig-zag): with contiguous shards, device 0's queries would
see one block and the last device's P, so device 0 would idle most of the ring; with
the zig-zag every device does the same work at every step (two chunk pairs' worth:
at step 0 two causal diagonals and one full pair, later two full pairs), and pairs
that lie entirely in the future are skipped (lax.cond). The model's activations stay
in natural order, sharded contiguously (device d: chunks 2d, 2d+1); the attention call
moves its chunks to the zig-zag owners with two ppermutes in and two out. Positions
(causal, window, q_offset, key lengths) are computed from each chunk's index, so they
follow the tokens wherever they are. Without a positional mask nothing is unbalanced
and the chunks stay where they are.

Within a device, each (query chunk, key chunk) pair is an ordinary one-device
attention call with q_offset shifted by the chunks' distance, so segment ids, padding
(kv_mask as segment ids, kv_lengths shifted to the chunk), windows and grouped-query
heads are handled by the very code the one-device path runs: the pair kernel of
ring_inner.py, the fused Pallas kernels on an NVIDIA GPU, JAX's splash kernel on a
TPU, the blockwise lax.scan kernel elsewhere (dot_product_attention's `ring_inner`
picks another; ring_inner.py says how each is driven and why the backward calls the
kernels' own backward with the merged statistics). Batch and heads stay split over
the mesh's (data, fsdp) and tensor axes when they divide them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from attention_jax import axes
from attention_jax.attention import ring_inner
from attention_jax.attention.blockwise import _acc_dtype
from attention_jax.attention.call import AttentionCall, Platform, target_backend
from attention_jax.attention.masks import MaskSpec
from attention_jax.attention.ring_inner import Pair


def sequence_axis_size(mesh=None) -> Optional[int]:
    """Size of the `sequence` axis of `mesh` (default: the ambient `jax.set_mesh` mesh),
    or None when there is no such mesh or axis, or when the caller is already inside a
    shard_map over it (the axis is manual: each device sees only its own shard)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or axes.SEQUENCE not in mesh.axis_names:
        return None
    if axes.SEQUENCE in getattr(mesh, "manual_axes", ()):
        return None
    return int(mesh.shape[axes.SEQUENCE])


def refusal(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why ring attention cannot run this call under this mesh (a sentence naming the
    argument and the valid values), or None if it can: the ring's own conditions, then
    those of a pair kernel asked for by ring_inner."""
    reason = _refusal(call.spec, call.q_len, call.kv_len, platform.sequence)
    if reason is None and call.ring_inner != "auto":
        reason = ring_inner.refusal(call.ring_inner, call, platform)
    return reason


def inner_reason(call: AttentionCall, platform: Platform) -> str:
    """The dispatcher's note on a ring call: its pair kernel and why."""
    kernel, reason = ring_inner.choose(call, platform)
    return f"chunk pairs on {kernel} ({reason})"


def auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Where "auto" looks at the ring, its reason for taking it: under a mesh that splits
    the sequence, where activations are sharded along T already."""
    if platform.sequence is None or platform.sequence <= 1:
        return None
    return f"the mesh splits the sequence over {platform.sequence} devices"


def _refusal(spec: MaskSpec, q_len: int, kv_len: int, devices: Optional[int]) -> Optional[str]:
    if devices is None:
        return (f"implementation='ring' needs a mesh with a {axes.SEQUENCE!r} axis: run under "
                f"`with jax.set_mesh(mesh):` with mesh.sequence > 1 (train config "
                f"mesh.sequence), or use implementation 'blockwise'")
    chunks = 2 * devices
    for name, length in (("T (q's length)", q_len), ("S (k's length)", kv_len)):
        if length % chunks:
            return (f"{name}={length} must be divisible by 2 × mesh.sequence = {chunks} "
                    f"(ring attention gives each of the {devices} devices two chunks); valid: "
                    f"multiples of {chunks}, e.g. {max(chunks, length // chunks * chunks)}")
    if spec.mask is not None:
        return ("a dense mask: a [.., T, S] array cannot be split around the ring; express it "
                "with causal / window / segment_ids / kv_mask / kv_lengths")
    return None


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static description of one ring call (hashable: custom_vjp's nondiff arg)."""

    devices: int  # P
    chunk: int  # C = T / (2P) queries (and S / (2P) keys) per chunk
    kv_chunk: int
    zigzag: bool  # chunks (d, 2P-1-d) on device d; else (2d, 2d+1)
    causal: bool
    window: Optional[tuple[int, int]]
    inner: object  # the kernel for one (query chunk, key chunk) pair (ring_inner.py)

    def chunk_ids(self, device):
        """Global indices [2] of the two chunks device `device` (traced) holds."""
        if self.zigzag:
            return jnp.stack([device, 2 * self.devices - 1 - device])
        return jnp.stack([2 * device, 2 * device + 1])


def ring_attention(q, k, v, spec: MaskSpec, scale: float, block_q: Optional[int] = None,
                   block_k: Optional[int] = None, mesh=None, inner: str = "blockwise",
                   static_offset: Optional[int] = None):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv], under a mesh
    with a `sequence` axis (`mesh` or the ambient one); see `refusal` for what it
    needs. inner: the kernel on each chunk pair, "blockwise", "pallas" or "splash"
    (ring_inner.py; splash needs `static_offset`, q_offset as a Python int). block_q /
    block_k: that kernel's tiles within a chunk (ring_inner.check says which it takes;
    None: its own, for blockwise one tile per chunk)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    p = sequence_axis_size(mesh)
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if inner not in ring_inner.RING_INNER[1:]:
        raise ValueError(f"inner must be one of {ring_inner.RING_INNER[1:]}; got {inner!r}")
    reason = _refusal(spec, t, s, p) or ring_inner.check(
        inner, q.dtype, static_offset, t, s, p, target_backend(), block_q, block_k)
    if reason:
        raise ValueError(reason)
    # Batch over the data axes and heads over tensor, where they divide; anything that
    # does not divide is replicated (correct, and GSPMD gathers it).
    batch_axes = tuple(a for a in (axes.DATA, axes.FSDP) if a in mesh.axis_names)
    if b % math.prod(mesh.shape[a] for a in batch_axes):
        batch_axes = ()
    head_axis = axes.TENSOR if (axes.TENSOR in mesh.axis_names
                                and kh % mesh.shape[axes.TENSOR] == 0) else None
    local_b = b // math.prod(mesh.shape[a] for a in batch_axes)
    local_kh = kh // (mesh.shape[head_axis] if head_axis else 1)
    c, ck = t // (2 * p), s // (2 * p)
    pair_kernel = ring_inner.make(
        inner, causal=spec.causal, window=spec.window, scale=scale, devices=p, chunk=c,
        kv_chunk=ck, batch=local_b, heads=local_kh * (n // kh), kv_heads=local_kh,
        block_q=block_q, block_k=block_k, static_offset=static_offset)
    ring = _Ring(p, c, ck, zigzag=spec.right is not None or spec.left is not None,
                 causal=spec.causal, window=spec.window, inner=pair_kernel)

    bspec = batch_axes or None
    seq = PartitionSpec(bspec, axes.SEQUENCE)
    heads = PartitionSpec(bspec, axes.SEQUENCE, head_axis, None)
    named = {"q_offset": spec.q_offset, "q_segment_ids": spec.q_segment_ids,
             "kv_segment_ids": spec.kv_segment_ids, "kv_lengths": spec.kv_lengths}
    arrays = {name: x for name, x in named.items() if x is not None}
    array_specs = {name: (seq if name.endswith("segment_ids") else PartitionSpec(bspec))
                   for name in arrays}
    local = functools.partial(_local, ring)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, array_specs),
                         out_specs=heads, check_vma=False)(q, k, v, arrays)


# ----------------------------------------------------------------------------- layout


def _owner(c: int, p: int) -> int:
    """The device that holds chunk c in the zig-zag layout."""
    return c if c < p else 2 * p - 1 - c


def _to_zigzag(x, p: int, dim: int = 1):
    """This device's natural chunks (2d, 2d+1) along `dim` -> its zig-zag (d, 2P-1-d).

    Chunk 2d goes to owner(2d) and chunk 2d+1 to owner(2d+1); both maps are
    permutations of the devices, so two ppermutes move everything. An even device d
    receives chunk d (< P) through the first and 2P-1-d through the second; an odd one
    the other way round.
    """
    a, b = jnp.split(x, 2, axis=dim)
    a = lax.ppermute(a, axes.SEQUENCE, [(d, _owner(2 * d, p)) for d in range(p)])
    b = lax.ppermute(b, axes.SEQUENCE, [(d, _owner(2 * d + 1, p)) for d in range(p)])
    even = lax.axis_index(axes.SEQUENCE) % 2 == 0
    return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=dim)


def _from_zigzag(x, p: int, dim: int = 1):
    """The inverse of `_to_zigzag`."""
    first, second = jnp.split(x, 2, axis=dim)
    even = lax.axis_index(axes.SEQUENCE) % 2 == 0
    a, b = jnp.where(even, first, second), jnp.where(even, second, first)  # chunks 2d', 2d'+1
    a = lax.ppermute(a, axes.SEQUENCE, [(_owner(2 * d, p), d) for d in range(p)])
    b = lax.ppermute(b, axes.SEQUENCE, [(_owner(2 * d + 1, p), d) for d in range(p)])
    return jnp.concatenate([a, b], axis=dim)


def _local(ring: _Ring, q, k, v, arrays):
    """One device's part: q [b, 2C, n, H] (its contiguous shard) -> y [b, 2C, n, Hv]."""
    b, kh = q.shape[0], k.shape[2]
    move, unmove = ((functools.partial(_to_zigzag, p=ring.devices),
                     functools.partial(_from_zigzag, p=ring.devices)) if ring.zigzag
                    else (lambda x: x, lambda x: x))
    q, k, v = move(q), move(k), move(v)
    inner = ring.inner
    qx, kx, vx = inner.layout(q, k, v)  # the pair kernel's layout

    def chunks(x, dim):  # the two chunks on a new leading axis
        return jnp.stack(jnp.split(x, 2, axis=dim))

    q_seg, kv_seg = arrays.get("q_segment_ids"), arrays.get("kv_segment_ids")
    pair_arrays = (arrays["q_offset"],
                   None if q_seg is None else chunks(move(q_seg), 1),  # [2, b, C]
                   None if kv_seg is None else chunks(move(kv_seg), 1),
                   arrays.get("kv_lengths"))
    y = _ring_vjp(ring, chunks(qx, inner.q_axis), chunks(kx, inner.kv_axis),
                  chunks(vx, inner.kv_axis), pair_arrays)
    y = jnp.concatenate([y[0], y[1]], axis=inner.q_axis)
    return unmove(inner.unlayout(y, b, kh))


# ----------------------------------------------------------------------------- the ring


def _shift(tree, p: int):
    """Hand every array to the next device of the ring (d -> d + 1)."""
    return lax.ppermute(tree, axes.SEQUENCE, [(d, (d + 1) % p) for d in range(p)])


def _pair_visible(ring: _Ring, offset, kv_chunk_id, kv_lengths):
    """False when no query of the pair can see any key of it: the key chunk lies
    entirely beyond the causal/right window or before the left window, or in every
    row's padding. Queries sit at offset + [0, C), keys at [0, Ck) (offset: [B])."""
    spec = MaskSpec(ring.causal, ring.window)
    visible = jnp.bool_(True)
    if spec.right is not None:  # the first key must be within the last query's reach
        visible &= jnp.max(offset) + ring.chunk - 1 + spec.right >= 0
    if spec.left is not None:  # the last key must be within the first query's reach
        visible &= ring.kv_chunk - 1 >= jnp.min(offset) - spec.left
    if kv_lengths is not None:
        visible &= kv_chunk_id * ring.kv_chunk < jnp.max(kv_lengths)
    return visible


def _pairs(ring: _Ring, arrays, kv_seg, q_ids, kv_ids, body, carry):
    """Run body(carry, i, j, pair_arrays) for the four (query chunk i, key chunk j) pairs
    of this step (a lax.scan, so the blockwise call is compiled once), skipping pairs
    in which nothing is visible."""
    offset, q_seg, _, lengths = arrays

    def one(carry, index):
        i, j = index // 2, index % 2
        qc, kc = q_ids[i], kv_ids[j]
        # Query positions relative to this key chunk's first key.
        # (int32 as the kernels' own offsets, also when x64 makes the loop indices int64)
        pair_offset = (offset + qc * ring.chunk - kc * ring.kv_chunk).astype(jnp.int32)
        pair_lengths = (None if lengths is None
                        else (lengths - kc * ring.kv_chunk).astype(jnp.int32))
        pair = Pair(pair_offset, None if q_seg is None else q_seg[i],
                    None if kv_seg is None else kv_seg[j], pair_lengths, qc, kc)
        run = functools.partial(body, i=i, j=j, pair=pair)
        return lax.cond(_pair_visible(ring, pair_offset, kc, lengths), run,
                        lambda c: c, carry), None

    carry, _ = lax.scan(one, carry, jnp.arange(4))
    return carry


def _merge(out, lse, out_new, lse_new):
    """Two partial softmax results over disjoint keys -> one (lse: -inf on empty rows).

    The online softmax's rescaling: with m the larger max, each part is weighted by
    exp(lse_part - m), i.e. by its sum of exponentials relative to the common max.
    """
    m = jnp.maximum(lse, lse_new)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w, w_new = jnp.exp(lse - m), jnp.exp(lse_new - m)
    total = w + w_new
    out = (out * w[..., None] + out_new * w_new[..., None]) / jnp.where(
        total == 0, 1.0, total)[..., None]
    return out, jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def _ring_forward(ring: _Ring, q, k, v, arrays):
    """q [2, ...q chunk, H], k/v [2, ...kv chunk, H] (the pair kernel's layout) -> out
    [2, ...q chunk, Hv] (q's dtype) and lse [2, ...q chunk] (+inf on rows that see no
    key, as blockwise's)."""
    acc_t = _acc_dtype(q.dtype)
    p = ring.devices
    me = lax.axis_index(axes.SEQUENCE)
    q_ids = ring.chunk_ids(me)
    kv_seg = arrays[2]

    def step(carry, r):
        out, lse, k, v, kv_seg = carry
        visiting = (k, v, kv_seg)
        k_next, v_next, seg_next = _shift(visiting, p)  # in flight while we compute
        kv_ids = ring.chunk_ids((me - r) % p)

        def body(carry, i, j, pair):
            out, lse = carry
            o, l = ring.inner.forward(q[i], k[j], v[j], pair)
            o, l = _merge(out[i], lse[i], o, l)
            return out.at[i].set(o), lse.at[i].set(l)

        out, lse = _pairs(ring, arrays, kv_seg, q_ids, kv_ids, body, (out, lse))
        return (out, lse, k_next, v_next, seg_next), None

    rows = q.shape[:-1]  # [2, ...q chunk]
    init = (jnp.zeros((*rows, v.shape[-1]), acc_t), jnp.full(rows, -jnp.inf, acc_t),
            k, v, kv_seg)
    (out, lse, *_), _ = lax.scan(step, init, jnp.arange(p))
    return out.astype(q.dtype), jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def _ring_backward(ring: _Ring, q, k, v, arrays, out, lse, d_out):
    acc_t = _acc_dtype(q.dtype)
    p = ring.devices
    me = lax.axis_index(axes.SEQUENCE)
    q_ids = ring.chunk_ids(me)
    kv_seg = arrays[2]

    def step(carry, r):
        dq, k, v, kv_seg, dk, dv = carry
        k_next, v_next, seg_next = _shift((k, v, kv_seg), p)  # in flight while we compute
        kv_ids = ring.chunk_ids((me - r) % p)

        def body(carry, i, j, pair):
            dq, dk, dv = carry
            # The whole softmax's O and L: this pair's exact share of the gradient.
            dq_p, dk_p, dv_p = ring.inner.backward(q[i], k[j], v[j], pair, out[i], lse[i],
                                                   d_out[i])
            return dq.at[i].add(dq_p), dk.at[j].add(dk_p), dv.at[j].add(dv_p)

        dq, dk, dv = _pairs(ring, arrays, kv_seg, q_ids, kv_ids, body, (dq, dk, dv))
        dk, dv = _shift((dk, dv), p)  # the accumulators follow their block
        return (dq, k_next, v_next, seg_next, dk, dv), None

    init = (jnp.zeros(q.shape, acc_t), k, v, kv_seg, jnp.zeros(k.shape, acc_t),
            jnp.zeros(v.shape, acc_t))
    (dq, _, _, _, dk, dv), _ = lax.scan(step, init, jnp.arange(p))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_vjp(ring, q, k, v, arrays):
    return _ring_forward(ring, q, k, v, arrays)[0]


def _ring_fwd(ring, q, k, v, arrays):
    out, lse = _ring_forward(ring, q, k, v, arrays)
    return out, (q, k, v, arrays, out, lse)


def _ring_bwd(ring, residuals, d_out):
    q, k, v, arrays, out, lse = residuals
    dq, dk, dv = _ring_backward(ring, q, k, v, arrays, out, lse, d_out)
    return dq, dk, dv, jax.tree.map(lambda _: None, arrays)


_ring_vjp.defvjp(_ring_fwd, _ring_bwd)
