"""Splash attention: JAX's block-sparse TPU kernel behind this package's masks.

Why JAX's kernel and not one of our own: `jax.experimental.pallas.ops.tpu.splash_attention`
is the TPU attention kernel maxtext trains with; it is kept up to date with Mosaic and
each TPU generation by the people who write the compiler, and it already has what a
hand-written TPU port of pallas.py would need to earn (a forward, a dQ and a dK/dV
kernel under one custom VJP; a per-tile table of which key blocks each query block
visits, so hidden tiles are never loaded). A well-kept kernel beats a hand-written one.

How our masks (masks.py) become splash's:
  causal, window, static q_offset
      -> one static splash mask per head: FullMask, CausalMask(offset) or
         LocalMask((left, right), offset), evaluated by numpy when the kernel is built,
         which is how splash learns which tiles to skip. Query i sits at position
         offset + i, as everywhere here; T != S is fine.
  segment ids, kv_mask (make_call already turned it into kv segment ids of -1 - max),
  kv_lengths
      -> splash's SegmentIds, one pair per batch row (vmapped): keys at positions
         >= kv_lengths[b] get a kv id no query has. Data-dependent, so per element, not
         per tile: padding does not skip tiles here as it does in pallas.py.
  rows with no visible key
      -> an attention sink of -1e30 per head: splash starts each row's running max at
         the sink and its sum at 1, so a row that sees nothing (or whose every tile is
         skipped) gives 0 / 1 = 0 with zero gradients, while exp(-1e30 - score) = 0
         leaves every other row exactly as it was.
  GQA / MQA
      -> splash's multi-head form takes k, v as [K, S, H] and lets query head n read
         K/V head n // G (our convention), so K/V are never repeated per head.
Layout: our [B, T, N, H] becomes splash's [N, T, H] per batch row (a transpose, then
vmap over B). Splash does not scale the scores, so q is multiplied by `scale` first.

What it refuses (one sentence each, in `refusal`): a dense mask; a traced or per-row
q_offset (the mask is fixed when the kernel is built); dtypes other than float32 and
bfloat16; T or S not a multiple of 128 (a kernel tile spans 128 lanes, and its grid is
lengths // blocks); block_q / block_k that are not multiples of 128 dividing T / S. The
attention weights are refused by the dispatcher, as for every kernel.

Tiles: 512 on a TPU (maxtext's default), or the largest of 256 / 128 that divides the
length; 128 everywhere else, where it runs with `interpret=True` (slow, for tests), so
a 256-long test walks 2 × 2 tiles. The same sizes for the forward, dQ and dK/dV kernels.

Ring attention (ring.py, ring_inner.py) runs splash on each pair of sequence chunks:
`ring_pair_kernel` builds the pair's kernel saving its log-sum-exp, `forward_with_lse`
and `backward_given_lse` run it and splash's backward kernels with the ring's merged
statistics (the latter through a private function of splash; its docstring says why).

On a TPU this has not been run here (no TPU in the sessions that wrote it); the numbers
in the tests come from interpret mode on CPU, and tests/attention/test_splash.py holds
one test, marked `tpu`, for the compiled kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from attention_jax.attention.call import AttentionCall, Platform, target_backend

LANES = 128  # splash's tiles are multiples of the TPU's 128 lanes
_SINK = -1e30  # above splash's masked score (-0.7 × float32 max), far below any real one
_DTYPES = (jnp.float32, jnp.bfloat16)


def block_sizes(q_len: int, kv_len: int, backend: str, block_q: Optional[int] = None,
                block_k: Optional[int] = None) -> tuple[int, int]:
    """(block_q, block_kv) for splash: the ones asked for, else 512 on a TPU (or the
    largest of 256, 128 that divides the length), 128 elsewhere (interpret mode)."""
    def pick(length, asked):
        if asked is not None:
            return asked
        preferred = (512, 256, 128) if backend == "tpu" else (128,)
        return next(b for b in preferred if length % b == 0)

    return pick(q_len, block_q), pick(kv_len, block_k)


def run(q, k, v, call: AttentionCall):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv] through splash."""
    spec = call.spec
    if _sees_nothing(call):  # splash cannot build a kernel for an empty mask; every row is 0
        return jnp.zeros((call.batch, call.q_len, call.heads, call.value_dim), q.dtype)
    backend = target_backend()
    bq, bk = block_sizes(call.q_len, call.kv_len, backend, call.block_q, call.block_k)
    kernel = _kernel(call.heads, call.q_len, call.kv_len, spec.left, spec.right,
                     call.static_offset, bq, bk, interpret=backend != "tpu")
    q = (q.astype(jnp.float32) * call.scale).astype(q.dtype)  # splash leaves scores unscaled
    qx = jnp.transpose(q, (0, 2, 1, 3))  # [B, N, T, H]
    kx = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, S, H]
    vx = jnp.transpose(v, (0, 2, 1, 3))  # [B, K, S, Hv]
    sinks = jnp.full((call.heads,), _SINK, jnp.float32)
    q_ids, kv_ids = _segment_ids(call)
    if q_ids is None:
        y = _without_x64(jax.vmap(lambda a, b, c: kernel(a, b, c, sinks=sinks)))(qx, kx, vx)
    else:
        y = _without_x64(jax.vmap(lambda a, b, c, qi, ki: kernel(
            a, b, c, segment_ids=kernel_lib.SegmentIds(qi, ki), sinks=sinks)))(
                qx, kx, vx, q_ids, kv_ids)
    return jnp.transpose(y, (0, 2, 1, 3))  # [B, T, N, Hv]


def _without_x64(f):
    """f, its forward and backward traced with 64-bit types off. With jax_enable_x64,
    JAX's splash kernels divide an int32 grid index by a Python int made int64 in their
    index maps (a TypeError in lax.div wherever T != S, heads are grouped or q_offset is
    set); their inputs are float32 or bfloat16 and int32 ids either way."""
    @jax.custom_vjp
    def g(*args):
        with jax.enable_x64(False):
            return f(*args)

    def forward(*args):
        with jax.enable_x64(False):
            return jax.vjp(f, *args)  # (y, the pullback: a pytree of the residuals)

    def backward(pullback, dy):
        with jax.enable_x64(False):
            return pullback(dy)
    g.defvjp(forward, backward)
    return g


def refusal(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why splash cannot run this call (None: it can, on any backend; interpreted off TPU)."""
    spec = call.spec
    fallback = "use 'blockwise'"
    if call.dtype not in _DTYPES:
        return (f"implementation='splash' takes float32 or bfloat16 q, k, v (its kernel "
                f"accumulates in float32); got {jnp.dtype(call.dtype).name}: {fallback}")
    if spec.mask is not None:
        return ("implementation='splash' cannot take a dense mask= (its masks are static per "
                "head): pass the structure as causal, window, segment_ids, kv_mask or "
                f"kv_lengths, or {fallback}")
    if call.static_offset is None:
        return ("implementation='splash' needs q_offset as a Python int (its mask is fixed "
                "when the kernel is built); got a traced or per-row [B] offset: "
                f"{fallback}")
    for name, length in (("T", call.q_len), ("S", call.kv_len)):
        if length % LANES:
            return (f"implementation='splash' needs T and S to be multiples of {LANES} (its "
                    f"tiles span {LANES} lanes); got {name}={length}: {fallback}")
    for name, block, length, letter in (("block_q", call.block_q, call.q_len, "T"),
                                        ("block_k", call.block_k, call.kv_len, "S")):
        if block is not None and (block % LANES or length % block):
            return (f"{name}={block} must be a multiple of {LANES} that divides "
                    f"{letter}={length} for implementation='splash'")
    return None


def auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Where "auto" looks at splash, its reason for taking it: TPUs only (elsewhere it runs
    interpreted, for tests)."""
    if platform.backend != "tpu":
        return None
    return "splash attention, JAX's block-sparse TPU kernel, takes this mask"


# ----------------------------------------------------------------------------- helpers


def _segment_ids(call: AttentionCall):
    """(q ids [B, T], kv ids [B, S]) for splash, with key padding folded in; (None, None)
    when nothing but the static mask restricts attention."""
    spec = call.spec
    q_ids, kv_ids = spec.q_segment_ids, spec.kv_segment_ids
    if spec.kv_lengths is None:
        return q_ids, kv_ids
    if q_ids is None:
        q_ids = jnp.zeros((call.batch, call.q_len), jnp.int32)
        kv_ids = jnp.zeros((call.batch, call.kv_len), jnp.int32)
    real = jnp.arange(call.kv_len)[None, :] < spec.kv_lengths[:, None]  # [B, S]
    return q_ids, jnp.where(real, kv_ids, -1 - jnp.max(jnp.abs(q_ids)))  # matches no query


def _sees_nothing(call: AttentionCall) -> bool:
    """Whether the static mask (causal, window, offset) hides every key from every query."""
    spec = call.spec
    position = call.static_offset + np.arange(call.q_len)  # query i's position
    first = position - spec.left if spec.left is not None else np.zeros_like(position)
    last = position + spec.right if spec.right is not None else position * 0 + call.kv_len - 1
    return not np.any(np.maximum(first, 0) <= np.minimum(last, call.kv_len - 1))


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, q_len: int, kv_len: int, left: Optional[int], right: Optional[int],
            offset: int, bq: int, bk: int, interpret: bool, save_residuals: bool = False):
    """The splash kernel for one static mask and tiling, built once (building evaluates
    the mask tile by tile in numpy). With save_residuals it also returns each row's
    log-sum-exp and cannot be differentiated (ring.py's own VJP calls
    `backward_given_lse` instead)."""
    shape = (q_len, kv_len)
    if left is None and right is None:
        mask = mask_lib.FullMask(shape)
    elif left is None and right == 0:
        mask = mask_lib.CausalMask(shape, offset=offset)
    else:
        mask = mask_lib.LocalMask(shape, window_size=(left, right), offset=offset)
    blocks = kernel_lib.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk,
        block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk,
        block_q_dq=bq, block_kv_dq=bk)
    # Eagerly: the kernel holds its tile tables as arrays, which must not be tracers of
    # the jit that first asked for it, since the cache hands it to later ones.
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha_single_device(
            mask_lib.MultiHeadMask([mask] * heads), block_sizes=blocks, interpret=interpret,
            save_residuals=save_residuals)


# ----------------------------------------------------------------------------- for the ring


def ring_pair_kernel(heads: int, q_len: int, kv_len: int, left: Optional[int],
                     right: Optional[int], offset: int, backend: str,
                     block_q: Optional[int] = None, block_k: Optional[int] = None):
    """The kernel of one (query chunk, key chunk) pair of ring attention (ring.py): the
    static mask at this pair's offset, saving its log-sum-exp. left = right = None: the
    pair is fully visible (FullMask). block_q / block_k as `block_sizes` takes them."""
    bq, bk = block_sizes(q_len, kv_len, backend, block_q, block_k)
    return _kernel(heads, q_len, kv_len, left, right, offset, bq, bk,
                   interpret=backend != "tpu", save_residuals=True)


def forward_with_lse(kernel, q, k, v, segment_ids=None):
    """One example through a `ring_pair_kernel`: q [N, T, H] (already scaled), k [K, S, H],
    v [K, S, Hv] -> (out [N, T, Hv] in q's dtype, lse [N, T] natural log, -inf on rows
    that see no key). The sink makes such rows 0 instead of 0/0 (see the module doc)."""
    sinks = jnp.full((q.shape[0],), _SINK, jnp.float32)
    with jax.enable_x64(False):  # as `_without_x64`: splash's index maps under x64
        out, (lse,) = kernel(q, k, v, segment_ids=segment_ids, sinks=sinks)
    return out, jnp.where(lse <= _SINK / 2, -jnp.inf, lse)  # only the sink: nothing seen


def backward_given_lse(kernel, q, k, v, segment_ids, out, lse, d_out):
    """(dq, dk, dv) of one example through `kernel`'s keys, given the output `out` [N, T, Hv]
    and log-sum-exp `lse` [N, T] (+inf on empty rows) of a softmax over more keys than k
    holds (ring.py): splash's own dQ and dK/dV kernels, so P = exp(S - lse) and
    D = rowsum(d_out ∘ out) are the whole softmax's. dq is with respect to the q the
    kernel was given (scaled). In q's, k's and v's dtypes.

    Splash's public VJP closes over its own residuals (this block's out and lse) and
    refuses to differentiate a kernel that returns its log-sum-exp, so this calls its
    backward, `_splash_attention_bwd`, with the residuals replaced: a private function
    of jax.experimental. tests/attention/test_ring.py runs it against the float64
    reference, so a change of its signature in a new jax fails there, not silently."""
    kw = kernel.kwargs
    residuals = (q, k, v, segment_ids, None, out, lse.astype(jnp.float32),
                 _collapse(kernel.dq_mask_info), _collapse(kernel.dkv_mask_info))
    with jax.enable_x64(False):  # as `_without_x64`: splash's index maps under x64
        grads = kernel_lib._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
            kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], residuals, d_out)
    return grads[3], grads[4], grads[5]  # (.., q, k, v, segment_ids, sinks)


def _collapse(info):
    """A mask table as splash's entry point hands it to its kernels: partial-mask blocks
    with their leading (head, q block, kv block) axes in one (a no-op for static masks)."""
    if info is None or info.partial_mask_blocks is None:
        return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))
