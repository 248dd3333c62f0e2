"""The kernel ring attention (ring.py) runs on each (query chunk, key chunk) pair.

The ring needs two things of a kernel, for one pair of chunks:
  forward   (out, lse): the pair's partial softmax, out in float32 (at least) and each
            row's log-sum-exp (natural log, -inf on rows that see no key of the pair);
            the ring merges the pairs exactly, O = Σ_i exp(lse_i - L) O_i with
            L = logsumexp_i lse_i.
  backward  (dq, dk, dv) of the pair given the WHOLE softmax's output O and
            log-sum-exp L: P = exp(S - L) is then each probability of the full softmax,
            D = rowsum(dO ∘ O) its Jacobian's correction, and the pair's FlashAttention
            backward with them is exactly its share of the gradient, summed round the
            ring.
The second is why the ring calls each kernel's backward directly instead of
differentiating through the per-pair (out, lse): that would need a VJP for the lse
output (splash refuses to differentiate a kernel that returns it) and would recompute
each pair's forward inside the backward. The backward-given-L is the same computation
the kernels' own custom VJPs run, with the residuals swapped, so it costs nothing extra.

Three kernels, in three layouts (each keeps what it reads without copying):
  blockwise  blockwise.py's lax.scan kernel, head-major groups [X, G, C, H]; every
             backend, every mask. The one used on CPU.
  pallas     pallas.py's fused kernels (`forward_with_lse`, `backward_given_lse`) on
             [b, C, n, H] as the model holds it; the pair's offset, segment ids and
             key lengths are traced arrays, so one kernel serves every pair. NVIDIA GPUs
             (Triton), interpreted on CPU (tests).
  splash     JAX's splash kernel (splash.py) on [b, n, C, H]. Its mask is static, so
             every pair offset the ring can meet (static q_offset + qc·C - kc·Ck for
             the 2P × 2P chunk indices) is classified when the ring is built: hidden
             (nothing visible: zeros, never a kernel), full (one FullMask kernel for
             all of them) or partial (a kernel with that offset: under a causal mask
             only the diagonal, offset 0); each pair picks its kernel by lax.switch.
             Segment ids and key lengths become splash's SegmentIds per pair. Needs
             float32/bfloat16, a static q_offset and chunks that are multiples of 128.
             TPUs, interpreted elsewhere (tests).

`choose` is ring_inner="auto": pallas on an NVIDIA GPU, splash on a TPU, blockwise
elsewhere, and blockwise where the platform's kernel refuses the call (the reason goes
into explain()). An explicit ring_inner that cannot run is a one-sentence ValueError
(`refusal`). block_q / block_k, when given, are the pair kernel's tiles within a chunk,
with the one-device kernel's rules: blockwise any size; pallas the forward and dQ
tiles, powers of two >= 16; splash multiples of 128 that divide the chunk. A size the
asked-for kernel cannot take is refused (under "auto", that kernel is passed over,
saying why). Not given: blockwise gets the dispatcher's default_block_sizes, the fused
kernels their own (pallas.kernel_block_sizes, splash.block_sizes of the chunk).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attention_jax.attention import blockwise, pallas, splash
from attention_jax.attention.blockwise import _acc_dtype
from attention_jax.attention.call import RING_INNER, AttentionCall, Platform, target_backend
from attention_jax.attention.masks import MaskSpec

__all__ = ["RING_INNER", "Pair", "choose", "refusal", "make"]


class Pair(NamedTuple):
    """What the ring hands a kernel about one (query chunk, key chunk) pair."""

    offset: jax.Array  # [b] query 0's position relative to the key chunk's key 0
    q_seg: Optional[jax.Array]  # [b, C] segment ids of the query chunk
    kv_seg: Optional[jax.Array]  # [b, Ck]
    lengths: Optional[jax.Array]  # [b] real keys counted from the key chunk's key 0
    q_chunk: jax.Array  # global chunk indices (scalars)
    kv_chunk: jax.Array


# ----------------------------------------------------------------------------- choosing


def choose(call: AttentionCall, platform: Platform) -> tuple[str, str]:
    """(kernel, reason) for ring attention's chunk pairs on this platform."""
    if call.ring_inner != "auto":
        return call.ring_inner, f"ring_inner={call.ring_inner!r} asked for"
    platform_kernel = ("pallas" if platform.nvidia_gpu else
                       "splash" if platform.backend == "tpu" else None)
    if platform_kernel is None:
        return "blockwise", (f"backend {platform.backend!r} has no fused kernel (pallas and "
                             f"splash run interpreted here, for tests: ring_inner=...)")
    reason = refusal(platform_kernel, call, platform)
    if reason is not None:
        return "blockwise", f"not {platform_kernel}: {reason}"
    return platform_kernel, {"pallas": "the fused Pallas kernels on an NVIDIA GPU",
                             "splash": "JAX's splash kernel on a TPU"}[platform_kernel]


def refusal(kernel: str, call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why `kernel` cannot run this ring call's chunk pairs (a sentence), or None."""
    return check(kernel, call.dtype, call.static_offset, call.q_len, call.kv_len,
                 platform.sequence or 1, platform.backend, call.block_q, call.block_k)


def check(kernel: str, dtype, static_offset: Optional[int], q_len: int, kv_len: int,
          devices: int, backend: str, block_q: Optional[int] = None,
          block_k: Optional[int] = None) -> Optional[str]:
    """`refusal` from the values themselves (ring_attention's own check)."""
    blocks = (("block_q", block_q, q_len), ("block_k", block_k, kv_len))
    if kernel == "pallas":
        if backend == "tpu":
            return ("ring_inner='pallas' runs on NVIDIA GPUs (and interpreted on CPU); the "
                    "Pallas kernels have never run on a TPU: use 'splash' or 'blockwise'")
        if backend != "cpu" and dtype == jnp.float64:
            return ("ring_inner='pallas' takes float16, bfloat16 or float32 on a GPU; got "
                    "float64 (use 'blockwise')")
        for name, block, _ in blocks:
            if block is not None and (block < 16 or block & (block - 1)):
                return (f"{name}={block} must be a power of two >= 16 for "
                        f"ring_inner='pallas' (its forward and dQ tiles), or None for its own")
    if kernel == "splash":
        if dtype not in (jnp.float32, jnp.bfloat16):
            return (f"ring_inner='splash' takes float32 or bfloat16; got "
                    f"{jnp.dtype(dtype).name} (use 'blockwise')")
        if static_offset is None:
            return ("ring_inner='splash' needs q_offset as a Python int (its masks are built "
                    "before the ring runs); got a traced or per-row offset (use 'blockwise')")
        for name, length in (("T", q_len), ("S", kv_len)):
            chunk = length // (2 * devices)
            if chunk % splash.LANES:
                return (f"ring_inner='splash' needs chunks of {name} / (2 × mesh.sequence) = "
                        f"{chunk} tokens to be a multiple of {splash.LANES} (its tiles span "
                        f"{splash.LANES} lanes): {name} a multiple of "
                        f"{2 * devices * splash.LANES}, or use 'blockwise'")
        for name, block, length in blocks:
            chunk = length // (2 * devices)
            if block is not None and (block % splash.LANES or chunk % block):
                return (f"{name}={block} must be a multiple of {splash.LANES} that divides "
                        f"the chunk of {chunk} tokens for ring_inner='splash', or None for "
                        f"its own")
    return None


# ----------------------------------------------------------------------------- kernels


def make(kernel: str, *, causal: bool, window, scale: float, devices: int, chunk: int,
         kv_chunk: int, batch: int, heads: int, kv_heads: int, block_q: Optional[int],
         block_k: Optional[int], static_offset: Optional[int]):
    """The pair kernel `kernel` for one ring call (local batch and heads: this device's).
    block_q / block_k: its tiles, checked by `check` (None: the kernel's own; blockwise:
    one tile per chunk)."""
    if kernel == "blockwise":
        return BlockwiseInner(blockwise._Static(causal, window, float(scale),
                                                min(block_q or chunk, chunk),
                                                min(block_k or kv_chunk, kv_chunk),
                                                chunk, kv_chunk, batch, kv_heads))
    if kernel == "pallas":
        return PallasInner(causal, window, float(scale), block_q, block_k)
    spec = MaskSpec(causal, window)
    return SplashInner(float(scale), heads, chunk, kv_chunk, target_backend(), 2 * devices,
                       _splash_masks(spec.left, spec.right, devices, chunk, kv_chunk,
                                     static_offset or 0), block_q, block_k)


@dataclasses.dataclass(frozen=True)
class BlockwiseInner:
    """blockwise.py's kernel on head-major groups: q [X, G, C, H], k/v [X, Ck, H]."""

    st: blockwise._Static
    q_axis = 2  # the sequence axis of q (and out) in this layout
    kv_axis = 1

    def layout(self, q, k, v):
        return blockwise.to_groups(q, k, v)

    def unlayout(self, y, batch: int, kv_heads: int):
        return blockwise.from_groups(y, batch, kv_heads)

    def _arrays(self, pair: Pair):
        return pair.offset, pair.q_seg, pair.kv_seg, None, pair.lengths

    def forward(self, q, k, v, pair: Pair):
        out, lse = blockwise._forward(self.st, q, k, v, self._arrays(pair),
                                      out_dtype=_acc_dtype(q.dtype))
        lse = lse[..., :self.st.q_len]
        return out, jnp.where(jnp.isposinf(lse), -jnp.inf, lse)

    def backward(self, q, k, v, pair: Pair, out, lse, d_out):
        acc_t = _acc_dtype(q.dtype)
        # The blockwise backward reads L padded to its query tiles (padded rows: +inf,
        # probability 0) and D = rowsum(dO ∘ O) of the whole softmax.
        lse = blockwise._pad_to(lse, 2, self.st.bq, value=jnp.inf)
        delta = jnp.einsum("XGTH,XGTH->XGT", d_out.astype(acc_t), out.astype(acc_t))
        return blockwise._backward(self.st, q, k, v, self._arrays(pair), out, lse, d_out,
                                   delta=delta, grad_dtype=acc_t)


@dataclasses.dataclass(frozen=True)
class PallasInner:
    """pallas.py's fused kernels on the model's layout: q [b, C, n, H], k/v [b, Ck, kh, H]."""

    causal: bool
    window: Optional[tuple[int, int]]
    scale: float
    block_q: Optional[int] = None  # the forward and dQ tiles asked for (None: the kernels')
    block_k: Optional[int] = None
    q_axis = 1
    kv_axis = 1

    def layout(self, q, k, v):
        return q, k, v

    def unlayout(self, y, batch: int, kv_heads: int):
        return y

    def _blocks(self, q) -> pallas.BlockSizes:
        """The kernels' tiles for q, with the asked-for forward and dQ tiles in."""
        blocks = pallas.kernel_block_sizes(q.shape[-1], q.dtype, length=q.shape[1])
        return dataclasses.replace(blocks, fwd_q=self.block_q or blocks.fwd_q,
                                   fwd_k=self.block_k or blocks.fwd_k)

    def _spec(self, pair: Pair) -> MaskSpec:
        return MaskSpec(self.causal, self.window, pair.offset, pair.q_seg, pair.kv_seg,
                        None, pair.lengths)

    def forward(self, q, k, v, pair: Pair):
        out, lse = pallas.forward_with_lse(q, k, v, self._spec(pair), self.scale,
                                           self._blocks(q), out_dtype=_acc_dtype(q.dtype))
        lse = jnp.swapaxes(lse, 1, 2)  # [b, n, C] -> [b, C, n], out's rows
        return out, jnp.where(jnp.isposinf(lse), -jnp.inf, lse)

    def backward(self, q, k, v, pair: Pair, out, lse, d_out):
        return pallas.backward_given_lse(q, k, v, self._spec(pair), self.scale, out,
                                         jnp.swapaxes(lse, 1, 2), d_out.astype(q.dtype),
                                         self._blocks(q), grad_dtype=_acc_dtype(q.dtype))


# Kinds of chunk pair for splash's static masks.
_HIDDEN, _FULL = -1, None


def _splash_masks(left, right, devices: int, chunk: int, kv_chunk: int, offset: int):
    """For every (query chunk, key chunk) pair, row-major over the 2P × 2P indices: the
    pair's static mask as a hashable key, _HIDDEN (nothing visible), _FULL (everything)
    or (left, right, pair offset) for a partial mask."""
    rows = np.arange(chunk)
    kinds = []
    for qc in range(2 * devices):
        for kc in range(2 * devices):
            d = offset + qc * chunk - kc * kv_chunk  # query 0's position in the key chunk
            first = rows + d - left if left is not None else np.zeros_like(rows)
            last = rows + d + right if right is not None else rows * 0 + kv_chunk - 1
            first, last = np.maximum(first, 0), np.minimum(last, kv_chunk - 1)
            if not np.any(first <= last):
                kinds.append(_HIDDEN)
            elif np.all(first == 0) and np.all(last == kv_chunk - 1):
                kinds.append(_FULL)
            else:
                kinds.append((left, right, int(d)))
    return tuple(kinds)


@dataclasses.dataclass(frozen=True)
class SplashInner:
    """splash's kernel, one example at a time (vmapped): q [b, n, C, H], k/v [b, kh, Ck, H]."""

    scale: float
    heads: int  # this device's query heads
    chunk: int
    kv_chunk: int
    backend: str
    chunks: int  # 2P, the chunk indices' range
    kinds: tuple  # `_splash_masks`
    block_q: Optional[int] = None  # the tiles asked for (None: splash.block_sizes')
    block_k: Optional[int] = None
    q_axis = 2
    kv_axis = 2

    def layout(self, q, k, v):
        return tuple(jnp.transpose(x, (0, 2, 1, 3)) for x in (q, k, v))

    def unlayout(self, y, batch: int, kv_heads: int):
        return jnp.transpose(y, (0, 2, 1, 3))

    def _branches(self):
        """The distinct visible masks (full first) and each pair's branch: 0 hidden, then
        1 + the index of its mask."""
        masks = sorted({k for k in self.kinds if k != _HIDDEN},
                       key=lambda k: (k is not _FULL, k or ()))
        table = [0 if k == _HIDDEN else 1 + masks.index(k) for k in self.kinds]
        kernels = [splash.ring_pair_kernel(self.heads, self.chunk, self.kv_chunk,
                                           *(m if m is not _FULL else (None, None, 0)),
                                           backend=self.backend, block_q=self.block_q,
                                           block_k=self.block_k) for m in masks]
        return kernels, jnp.asarray(np.array(table, np.int32))

    def _branch(self, table, pair: Pair):
        return table[pair.q_chunk * self.chunks + pair.kv_chunk]

    def _segment_ids(self, pair: Pair):
        """splash's SegmentIds [b, C] / [b, Ck] for the pair, key lengths folded in."""
        q_ids, kv_ids = pair.q_seg, pair.kv_seg
        if pair.lengths is None:
            return q_ids, kv_ids
        b = pair.offset.shape[0]
        if q_ids is None:
            q_ids = jnp.zeros((b, self.chunk), jnp.int32)
            kv_ids = jnp.zeros((b, self.kv_chunk), jnp.int32)
        real = jnp.arange(self.kv_chunk)[None, :] < pair.lengths[:, None]
        return q_ids, jnp.where(real, kv_ids, -1 - jnp.max(jnp.abs(q_ids)))

    def _scaled(self, q):
        return (q.astype(jnp.float32) * self.scale).astype(q.dtype)  # splash leaves scores unscaled

    def forward(self, q, k, v, pair: Pair):
        kernels, table = self._branches()
        q_ids, kv_ids = self._segment_ids(pair)
        acc_t = _acc_dtype(q.dtype)

        def run(kernel, q, k, v, q_ids, kv_ids):
            def one(q, k, v, qi, ki):
                ids = None if qi is None else splash.kernel_lib.SegmentIds(qi, ki)
                return splash.forward_with_lse(kernel, q, k, v, ids)
            out, lse = jax.vmap(one)(q, k, v, q_ids, kv_ids)
            return out.astype(acc_t), lse.astype(acc_t)

        def hidden(q, k, v, q_ids, kv_ids):
            shape = q.shape[:-1]
            return jnp.zeros((*shape, v.shape[-1]), acc_t), jnp.full(shape, -jnp.inf, acc_t)

        branches = [hidden] + [lambda *a, kernel=kernel: run(kernel, *a) for kernel in kernels]
        return lax.switch(self._branch(table, pair), branches, self._scaled(q), k, v, q_ids,
                          kv_ids)

    def backward(self, q, k, v, pair: Pair, out, lse, d_out):
        kernels, table = self._branches()
        q_ids, kv_ids = self._segment_ids(pair)
        acc_t = _acc_dtype(q.dtype)

        def run(kernel, q, k, v, q_ids, kv_ids, out, lse, d_out):
            def one(q, k, v, qi, ki, out, lse, d_out):
                ids = None if qi is None else splash.kernel_lib.SegmentIds(qi, ki)
                return splash.backward_given_lse(kernel, q, k, v, ids, out, lse, d_out)
            dq, dk, dv = jax.vmap(one)(q, k, v, q_ids, kv_ids, out, lse, d_out)
            # dq is with respect to the scaled q: the chain rule's factor.
            return (dq.astype(acc_t) * self.scale, dk.astype(acc_t), dv.astype(acc_t))

        def hidden(q, k, v, *_):
            return tuple(jnp.zeros(x.shape, acc_t) for x in (q, k, v))

        branches = [hidden] + [lambda *a, kernel=kernel: run(kernel, *a) for kernel in kernels]
        return lax.switch(self._branch(table, pair), branches, self._scaled(q), k, v, q_ids,
                          kv_ids, out, lse, d_out.astype(q.dtype))
