"""Scaled dot-product attention as pure JAX functions (no Flax), with selectable backends.

Shape letters, used in every docstring, comment and einsum of the project:
  B batch            T query length        S key/value length     D model width
  N query heads      K key/value heads     G = N / K (query heads per K/V head)
  H head dim         Hv value head dim     F MLP hidden           V vocabulary
  P patches          E experts             L layers               A experts per token

    y = dot_product_attention(q, k, v, causal=True)   # q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H]

Implementations:
  "reference"  the lectures' formula with the whole [B, N, T, S] score matrix; the test
               oracle, and the only one that can return the attention weights.
  "blockwise"  lax.scan over query blocks, online softmax over key blocks, hand-written
               FlashAttention-2 style backward: O(T + S) memory forward and backward.
  "pallas"     the blockwise algorithm as fused Pallas kernels (pallas.py): Triton on
               NVIDIA GPUs, interpret mode on CPU (slow; for tests). Every structural mask.
  "xla"        jax.nn.dot_product_attention's XLA path (materialises the scores).
  "cudnn"      jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPUs, f16/bf16),
               driven by its own causal / key-length / left-window arguments.
  "ring"       the sequence split over the ambient mesh's `sequence` axis (run under
               `jax.set_mesh(mesh)`), keys/values passed around the devices, blockwise on
               each (ring.py): memory O(T / devices). T and S divisible by 2 × devices.
  "auto"       per backend, dtype and mask; `explain(...)` says which and why without
               running anything:
                 weights asked for          -> reference
                 ambient mesh with sequence > 1, lengths divisible by 2 × sequence, no
                   dense mask               -> ring
                 NVIDIA GPU, what cuDNN can express (f16/bf16, H % 8 == 0, H <= 128;
                   causal, right padding as kv_lengths, a causal left window, GQA)
                                            -> cudnn
                 NVIDIA GPU, anything else (segment ids, kv_mask, two-sided windows,
                   query offsets, float32, a dense mask)   -> pallas
                 CPU, TPU, float64          -> blockwise
               so no path builds an N×N mask unless the caller passed one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.attention.blockwise import blockwise_attention
from attention_jax.attention.masks import MaskSpec, dense_mask
from attention_jax.attention.pallas import pallas_attention
from attention_jax.attention.pallas import default_block_sizes as pallas_block_sizes
from attention_jax.attention.reference import reference_attention
from attention_jax.attention.ring import ring_attention, ring_refusal, sequence_axis_size

__all__ = ["dot_product_attention", "explain", "IMPLEMENTATIONS", "MaskSpec",
           "default_block_sizes"]

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "pallas", "xla", "cudnn", "ring")


def default_block_sizes(backend: Optional[str] = None, *, heads: Optional[int] = None,
                        head_dim: int = 64, q_len: Optional[int] = None,
                        kv_len: Optional[int] = None) -> tuple[int, int]:
    """(block_q, block_k) for the blockwise path on this backend.

    A tile works on every (batch, head) pair at once: scores [B·N, bq, bk] plus the q,
    k, v and output blocks. On CPU the tile should fit in cache (2 MiB of L2 per core
    here), so its size depends on how many heads share it. `heads` (B·N), `head_dim` and
    the lengths, when given, pick the largest tile whose working set stays under 8 MiB;
    without them, the tile for one sequence of 8 heads. Measured (2-core CPU,
    `python -m attention_jax.tools.bench attention` and the train benchmark's shapes):
    8 heads at N=4096 run fastest at 256×512 (working set 7.3 MiB); 96 heads (batch 16 ×
    6) at N=256 causal at 64×64, 28% faster forward+backward than one 256×256 tile; at
    N ≤ 128 one tile of the whole problem beats any loop.
    """
    backend = backend or jax.default_backend()
    if backend != "cpu":  # H100, bf16, H = 128, T = 4096: 1024² ran 1.2-1.3× faster than 512²
        return 1024, 1024
    if heads is None:
        return 256, 512
    if q_len is not None and kv_len is not None and q_len <= 128 and kv_len <= 128:
        return q_len, kv_len
    for bq, bk in ((256, 512), (256, 256), (128, 256), (128, 128), (64, 128), (64, 64)):
        working_set = 4 * heads * (bq * bk + 2 * (bq + bk) * head_dim)  # float32 bytes
        if working_set <= 8 * 2**20:
            return bq, bk
    return 32, 64


def dot_product_attention(
    q, k, v, *,
    causal: bool = False,
    segment_ids=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    kv_mask=None,
    kv_lengths=None,
    mask=None,
    window: Union[int, tuple[int, int], None] = None,
    q_offset=0,
    scale: Optional[float] = None,
    implementation: str = "auto",
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    return_weights: bool = False,
):
    """softmax(q kᵀ · scale) v over heads, with structural masks.

    Args:
      q: [B, T, N, H] queries.  k: [B, S, K, H] keys.  v: [B, S, K, Hv] values.
        K must divide N (grouped-query attention: query head n reads K/V head n // G).
      causal: query i sees keys j <= i (positions include `q_offset`).
      segment_ids: [B, T] ids for self-attention (T == S); queries attend only to keys
        of the same segment, e.g. packed documents. Or give q_segment_ids [B, T] and
        kv_segment_ids [B, S] separately (cross-attention).
      kv_mask: [B, S] bool, True for real keys: padding. Keys that are False are unseen.
      kv_lengths: [B] ints, the number of real keys of each row when the padding is on
        the right (keys at positions >= kv_lengths[b] are unseen). The same mask as a
        prefix kv_mask, in a form cuDNN takes natively and the kernels use to skip tiles.
      mask: dense bool mask broadcastable to [B, N, T, S], for masks with no structure.
      window: local attention. int w: keys within w positions either side; (left, right):
        query i sees keys i-left .. i+right. With causal, right is 0.
      q_offset: int or [B] ints, position of query 0 relative to key 0 (decoding
        against a cache of earlier keys: T new queries after q_offset cached ones).
      scale: multiplies the scores; default 1/sqrt(H) (keeps score variance near 1).
      implementation: one of IMPLEMENTATIONS.
      block_q, block_k: tile sizes for "blockwise" (defaults: `default_block_sizes()`)
        and for "pallas"'s forward and dQ kernels (powers of two >= 16).
      return_weights: also return the attention weights [B, N, T, S] (reference only).

    Returns:
      [B, T, N, Hv] in q's dtype (and the weights if asked). Rows with no visible key
      are zero, with zero gradients, never NaN.
    """
    spec, scale = _prepare(q, k, v, causal, segment_ids, q_segment_ids, kv_segment_ids,
                           kv_mask, kv_lengths, mask, window, q_offset, scale, implementation)
    b, t, n, h = q.shape
    s = k.shape[1]
    offset_is_zero = isinstance(q_offset, (int, np.integer)) and q_offset == 0
    sequence = sequence_axis_size()
    impl, _ = _choose(implementation, q.dtype, h, (t, s), spec, return_weights, offset_is_zero,
                      jax.default_backend(), _cudnn_available(), sequence)
    if return_weights and impl != "reference":
        raise ValueError(
            f"return_weights=True needs implementation='reference' (or 'auto'); got "
            f"{implementation!r}, which never forms the weights")
    if impl == "reference":
        return reference_attention(q, k, v, spec, scale, return_weights)
    if impl == "blockwise":
        default_q, default_k = default_block_sizes(heads=b * n, head_dim=h, q_len=t, kv_len=s)
        block_q = _check_block("block_q", block_q, default_q)
        block_k = _check_block("block_k", block_k, default_k)
        return blockwise_attention(q, k, v, spec, scale, block_q, block_k)
    if impl == "ring":  # the blockwise tiles, sized for one device's chunk of the ring
        chunk_q, chunk_k = t // (2 * sequence), s // (2 * sequence)
        default_q, default_k = default_block_sizes(heads=b * n, head_dim=h, q_len=chunk_q,
                                                   kv_len=chunk_k)
        return ring_attention(q, k, v, spec, scale, _check_block("block_q", block_q, default_q),
                              _check_block("block_k", block_k, default_k))
    if impl == "pallas":
        blocks = pallas_block_sizes(h, q.dtype)
        blocks = dataclasses.replace(
            blocks, fwd_q=_check_block("block_q", block_q, blocks.fwd_q, pow2=True),
            fwd_k=_check_block("block_k", block_k, blocks.fwd_k, pow2=True))
        return pallas_attention(q, k, v, spec, scale, blocks)
    return _jax_nn(q, k, v, spec, scale, impl, offset_is_zero)


def explain(q, k, v, *, causal: bool = False, segment_ids=None, q_segment_ids=None,
            kv_segment_ids=None, kv_mask=None, kv_lengths=None, mask=None, window=None,
            q_offset=0, implementation: str = "auto", return_weights: bool = False,
            backend: Optional[str] = None) -> tuple[str, str]:
    """(implementation, reason): what `dot_product_attention` would run, without running it.

    Takes the same arguments; arrays may be `jax.ShapeDtypeStruct`s. `backend` ("cpu",
    "gpu", "tpu"; default: this process's) asks what would happen on another backend,
    so the choice for a GPU can be checked on a laptop:

        explain(q, k, v, causal=True, segment_ids=ids, backend="gpu")
        # ('pallas', 'segment ids (or kv_mask): cuDNN has no argument for them')
    """
    backend = backend or jax.default_backend()
    offset_is_zero = isinstance(q_offset, (int, np.integer)) and q_offset == 0
    answer = []

    def trace(q, k, v, segment_ids, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths,
              mask, q_offset):
        spec, _ = _prepare(q, k, v, causal, segment_ids, q_segment_ids, kv_segment_ids,
                           kv_mask, kv_lengths, mask, window, q_offset, None, implementation)
        answer.append(_choose(implementation, q.dtype, q.shape[-1], (q.shape[1], k.shape[1]),
                              spec, return_weights, offset_is_zero, backend, backend == "gpu",
                              sequence_axis_size()))

    jax.eval_shape(trace, q, k, v, segment_ids, q_segment_ids, kv_segment_ids, kv_mask,
                   kv_lengths, mask, q_offset)
    return answer[0]


# ----------------------------------------------------------------------------- backends


def _cudnn_available() -> bool:
    return any(d.platform == "gpu" and "NVIDIA" in getattr(d, "device_kind", "NVIDIA")
               for d in jax.devices())


def _prepare(q, k, v, causal, segment_ids, q_segment_ids, kv_segment_ids, kv_mask,
             kv_lengths, mask, window, q_offset, scale, implementation):
    """Validate everything and reduce the mask arguments to one MaskSpec."""
    _check_shapes(q, k, v)
    b, t, n, h = q.shape
    s = k.shape[1]
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is unknown; valid: {IMPLEMENTATIONS}")
    spec = MaskSpec(
        causal=bool(causal),
        window=_check_window(window),
        q_offset=_check_offset(q_offset, b),
        **_segments(segment_ids, q_segment_ids, kv_segment_ids, kv_mask, b, t, s),
        mask=_check_dense_mask(mask, b, n, t, s),
        kv_lengths=_check_lengths(kv_lengths, b),
    )
    return spec, _check_scale(scale, h)


def _cudnn_refusal(dtype, head_dim, spec: MaskSpec, offset_is_zero, t, s) -> Optional[str]:
    """Why cuDNN (through jax.nn's own arguments) cannot run this call, or None if it can."""
    if dtype not in (jnp.float16, jnp.bfloat16):
        return f"dtype {jnp.dtype(dtype).name}: cuDNN runs float16/bfloat16 only"
    if head_dim % 8 or head_dim > 128:
        return f"head dim {head_dim}: cuDNN needs a multiple of 8, at most 128"
    if spec.q_segment_ids is not None:
        return "segment ids (or kv_mask): cuDNN has no argument for them"
    if spec.mask is not None:
        return "a dense mask: cuDNN would take it as an N×N bias"
    if not offset_is_zero:
        return "a query offset: cuDNN's causal mask starts at query 0"
    if spec.window is not None and not spec.causal:
        return f"window {spec.window} without causal: cuDNN takes left windows with causal only"
    if spec.causal and t != s:
        return f"causal cross-attention (T={t}, S={s}): left to the kernels that define it"
    return None


def _choose(implementation, dtype, head_dim, lengths, spec: MaskSpec, return_weights,
            offset_is_zero, backend: str, nvidia: bool,
            sequence: Optional[int] = None) -> tuple[str, str]:
    """(implementation, reason) for this call on this backend; lengths is (T, S);
    sequence: the ambient mesh's sequence-axis size (None: no such axis)."""
    if implementation == "ring" or (implementation == "auto" and not return_weights
                                    and sequence is not None and sequence > 1):
        refusal = ring_refusal(spec, *lengths, sequence)
        if refusal is None:
            return "ring", (f"the mesh splits the sequence over {sequence} devices" if
                            implementation == "auto" else "asked for")
        if implementation == "ring":
            raise ValueError(refusal)
        impl, reason = _choose(implementation, dtype, head_dim, lengths, spec, return_weights,
                               offset_is_zero, backend, nvidia)  # the one-device choice
        return impl, f"{reason}; not ring: {refusal}"
    if implementation == "cudnn" and not nvidia:
        raise ValueError(
            f"implementation='cudnn' needs an NVIDIA GPU; this backend is "
            f"{backend!r}. Valid here: 'auto', 'reference', 'blockwise', 'pallas', 'xla'")
    if implementation == "pallas" and backend != "cpu" and dtype == jnp.float64:
        raise ValueError("implementation='pallas' takes float16, bfloat16 or float32 on a "
                         "GPU; got float64 (use 'blockwise' or 'reference')")
    if implementation != "auto":
        return implementation, "asked for"
    if return_weights:
        return "reference", "attention weights asked for: only the reference forms them"
    if backend == "gpu" and nvidia:
        refusal = _cudnn_refusal(dtype, head_dim, spec, offset_is_zero, *lengths)
        if refusal is None:
            return "cudnn", "cuDNN expresses this mask through its own arguments"
        if dtype != jnp.float64:
            return "pallas", refusal
        return "blockwise", refusal + "; the Pallas kernel has no float64 either"
    return "blockwise", f"backend {backend!r}: the portable lax.scan kernel"


def _jax_nn(q, k, v, spec: MaskSpec, scale, impl, offset_is_zero):
    """jax.nn.dot_product_attention, with the mask in its own arguments where they can say it.

    is_causal, key_value_seq_lengths and a causal left window are structural (cuDNN skips
    the hidden tiles); anything else becomes one dense [B, N, T, S] mask, which is why
    "auto" never sends such calls here.
    """
    b, t, n, _ = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    structural = (spec.q_segment_ids is None and spec.mask is None and offset_is_zero
                  and (spec.window is None or (spec.causal and impl == "cudnn")))
    if structural:
        window = None if spec.window is None else (spec.window[0], 0)
        y = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=spec.causal, key_value_seq_lengths=spec.kv_lengths,
            local_window_size=window, implementation=impl)
        if spec.kv_lengths is not None:  # a row of no real keys is zero, as on every path
            y = jnp.where((spec.kv_lengths > 0)[:, None, None, None], y, 0)
        return y
    full = dense_mask(spec, b, n, kv_heads, t, s)
    y = jax.nn.dot_product_attention(q, k, v, scale=scale, mask=full, implementation=impl)
    if full is not None:  # jax.nn gives rows with no visible key the mean of v
        any_visible = jnp.any(full, axis=-1)  # [B, N, T]
        y = jnp.where(jnp.transpose(any_visible, (0, 2, 1))[..., None], y, 0)
    return y


# ----------------------------------------------------------------------------- validation


def _check_shapes(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 ({'[B, T, N, H]' if name == 'q' else '[B, S, K, H]'}); "
                f"got shape {getattr(x, 'shape', type(x).__name__)}")
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype} "
            f"(cast them, e.g. to {jnp.result_type(q, k, v)})")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v need the same length S: k {k.shape}, v {v.shape}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need the same number of heads K: k {k.shape}, v {v.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k need the same head dim H: q {q.shape}, k {k.shape}")
    n, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == 0 or n % kv_heads:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"k has K={kv_heads} heads, which must divide q's N={n} heads; valid K: {divisors}")
    if min(q.shape[1], k.shape[1]) == 0:
        raise ValueError(f"empty sequence: q {q.shape}, k {k.shape}")


def _check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    try:
        if isinstance(scale, (bool, np.bool_, str, bytes)):
            raise TypeError
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a finite number (a Python or NumPy float or int) or "
                         f"None for 1/sqrt(head_dim); got {scale!r}") from None
    if not np.isfinite(value):
        raise ValueError(f"scale must be a finite number; got {value}")
    return value


def _is_int(w) -> bool:
    # bool is an int to Python, but window=True is a mistake, not a window of 1.
    return isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))


def _check_window(window):
    if window is None:
        return None
    valid = ("window must be a non-negative int or a (left, right) pair of them, or None "
             "(Python or NumPy ints: masks are built when tracing, so not a float, bool or "
             "array)")
    if _is_int(window):
        pair = (window, window)
    elif isinstance(window, (tuple, list)):
        pair = tuple(window)
    else:
        raise ValueError(f"{valid}; got {window!r}")
    if len(pair) != 2 or any(not _is_int(w) or w < 0 for w in pair):
        raise ValueError(f"{valid}; got {window!r}")
    return int(pair[0]), int(pair[1])


def _check_block(name, value, default, pow2=False):
    if value is None:
        return default
    if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    if pow2 and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= 16 for implementation='pallas'; "
                         f"got {value!r}")
    return int(value)


def _check_lengths(kv_lengths, batch):
    if kv_lengths is None:
        return None
    lengths = jnp.asarray(kv_lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths must be an int array of shape [B]=[{batch}]; "
                         f"got {lengths.dtype} {lengths.shape}")
    return lengths.astype(jnp.int32)


def _check_offset(q_offset, batch):
    offset = jnp.asarray(q_offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer) or offset.ndim not in (0, 1) or (
            offset.ndim == 1 and offset.shape[0] != batch):
        raise ValueError(
            f"q_offset must be an int or an int array of shape [B]=[{batch}]; "
            f"got {offset.dtype} with shape {offset.shape}")
    return jnp.broadcast_to(offset.astype(jnp.int32), (batch,))


def _check_ids(name, ids, batch, length):
    ids = jnp.asarray(ids)
    if ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int array of shape [{batch}, {length}]; "
                         f"got {ids.dtype} {ids.shape}")
    return ids.astype(jnp.int32)


def _segments(segment_ids, q_segment_ids, kv_segment_ids, kv_mask, b, t, s):
    """Reduce segment ids and key padding to one (q ids, kv ids) pair."""
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("give segment_ids, or q_segment_ids with kv_segment_ids, not both")
        if t != s:
            raise ValueError(f"segment_ids is for self-attention (T == S); got T={t}, S={s}: "
                             "use q_segment_ids and kv_segment_ids")
        q_segment_ids = kv_segment_ids = segment_ids
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    q_ids = None if q_segment_ids is None else _check_ids("q_segment_ids", q_segment_ids, b, t)
    kv_ids = None if kv_segment_ids is None else _check_ids("kv_segment_ids", kv_segment_ids, b, s)
    if kv_mask is not None:
        kv_mask = jnp.asarray(kv_mask)
        if kv_mask.shape != (b, s) or kv_mask.dtype != jnp.bool_:
            raise ValueError(f"kv_mask must be a bool array of shape [B, S]=[{b}, {s}]; "
                             f"got {kv_mask.dtype} {kv_mask.shape}")
        if q_ids is None:  # every query is segment 0; padding keys get -1, which no query has
            q_ids = jnp.zeros((b, t), jnp.int32)
            kv_ids = jnp.zeros((b, s), jnp.int32)
        kv_ids = jnp.where(kv_mask, kv_ids, -1 - jnp.max(jnp.abs(q_ids)))  # matches no query
    return {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids}


def _check_dense_mask(mask, b, n, t, s):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = attend); got {mask.dtype}")
    if mask.ndim > 4:
        raise ValueError(f"mask must broadcast to [B, N, T, S]=[{b}, {n}, {t}, {s}]; got {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mb, mn, mt, ms = mask.shape
    if mb not in (1, b) or mn not in (1, n) or mt not in (1, t) or ms not in (1, s):
        raise ValueError(f"mask must broadcast to [B, N, T, S]=[{b}, {n}, {t}, {s}]; got {mask.shape}")
    return jnp.broadcast_to(mask, (mb, mn, t, s))
