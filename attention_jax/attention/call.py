"""One attention call, validated once: the record every backend's rules and run function read.

`make_call` checks the arguments of `dot_product_attention` (errors name the argument
and what is valid) and reduces the mask arguments to one `MaskSpec`; the dispatcher
(`__init__.py`) then asks each backend's refusal rule, `(call, platform) -> reason or
None`, about the resulting `AttentionCall`. Shape letters as in `__init__.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.attention.masks import MaskSpec
from attention_jax.errors import known_values

# The kernel ring attention runs on each pair of sequence chunks (ring_inner.py).
RING_INNER = ("auto", "pallas", "splash", "blockwise")

# Backends `compiling_for` takes; "gpu" is an NVIDIA one (JAX's CUDA plugin).
TARGETS = ("cpu", "gpu", "tpu")
_targets: list[str] = []  # compiling_for's, innermost last


def target_backend() -> str:
    """The backend attention lowers for: this process's (jax.default_backend()), or the
    one `compiling_for` names while it is open."""
    return _targets[-1] if _targets else jax.default_backend()


def compiling_for_gpu() -> bool:
    return bool(_targets) and _targets[-1] == "gpu"


@contextlib.contextmanager
def compiling_for(backend: str):
    """Lower attention for `backend` whatever this process runs on, to compile ahead of
    time for a machine of another kind (jax.experimental.topologies: an H100's step
    compiled on a CPU host, tools/bench/gpu_hlo.py). `auto` then chooses as it would
    there, and the Pallas kernels lower for Triton rather than run interpreted. Lower
    inside, a jitted function made for that target: JAX's trace cache does not know
    about the target, so a function traced here should not run on this machine after.
    Not thread-safe: one lowering at a time."""
    if backend not in TARGETS:
        raise ValueError(f"compiling_for({backend!r}); valid: {TARGETS}")
    _targets.append(backend)
    try:
        yield
    finally:
        _targets.pop()


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] and everything said about them."""

    batch: int  # B
    q_len: int  # T
    kv_len: int  # S
    heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H
    value_dim: int  # Hv
    dtype: Any  # q's (= k's = v's) dtype
    spec: MaskSpec  # causal, window and the mask arrays (traced)
    scale: float
    # q_offset was a Python or NumPy 0, so query i sits at position i. A traced offset may
    # be anything: kernels that start the causal mask at query 0 (cuDNN) cannot take it.
    offset_is_zero: bool
    return_weights: bool
    block_q: Optional[int] = None  # the tiles asked for (None: the backend's default)
    block_k: Optional[int] = None
    # q_offset when it was a Python or NumPy int (None: traced, or one per batch row), for
    # kernels whose mask is fixed when they are built (splash).
    static_offset: Optional[int] = None
    ring_inner: str = "auto"  # the kernel on each chunk pair when the ring runs (RING_INNER)


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where the call would run: what the rules read besides the call itself."""

    backend: str  # "cpu", "gpu" or "tpu" (jax.default_backend(), or explain's `backend`)
    nvidia: bool  # an NVIDIA GPU is there, so jax.nn's cuDNN path is
    sequence: Optional[int] = None  # the ambient mesh's `sequence` axis (None: no such axis)

    @property
    def nvidia_gpu(self) -> bool:
        return self.backend == "gpu" and self.nvidia


def make_call(q, k, v, *, causal: bool = False, segment_ids=None, q_segment_ids=None,
              kv_segment_ids=None, kv_mask=None, kv_lengths=None, mask=None, window=None,
              q_offset=0, scale: Optional[float] = None, block_q: Optional[int] = None,
              block_k: Optional[int] = None, return_weights: bool = False,
              ring_inner: str = "auto") -> AttentionCall:
    """Validate `dot_product_attention`'s arguments (all but `implementation`, which the
    dispatcher's table checks) and record them; see its docstring for their meaning."""
    _check_shapes(q, k, v)
    b, t, n, h = q.shape
    s, kv_heads, hv = k.shape[1], k.shape[2], v.shape[3]
    if isinstance(causal, jax.core.Tracer):
        raise ValueError("causal must be a Python bool (masks are built when tracing, so not "
                         "a traced value: under jit, mark it static, e.g. "
                         "jax.jit(f, static_argnames='causal'))")
    for name, flag in (("causal", causal), ("return_weights", return_weights)):
        if not isinstance(flag, (bool, np.bool_)):  # bool("False") is True
            raise ValueError(f"{name} must be a Python bool, True or False; got {flag!r}")
    spec = MaskSpec(
        causal=bool(causal),
        window=_check_window(window),
        q_offset=_check_offset(q_offset, b),
        **_segments(segment_ids, q_segment_ids, kv_segment_ids, kv_mask, b, t, s),
        mask=_check_dense_mask(mask, b, n, t, s),
        kv_lengths=_check_lengths(kv_lengths, b, s),
    )
    return AttentionCall(
        batch=b, q_len=t, kv_len=s, heads=n, kv_heads=kv_heads, head_dim=h, value_dim=hv,
        dtype=q.dtype, spec=spec, scale=_check_scale(scale, h),
        offset_is_zero=isinstance(q_offset, (int, np.integer)) and q_offset == 0,
        return_weights=bool(return_weights),
        block_q=_check_block("block_q", block_q), block_k=_check_block("block_k", block_k),
        static_offset=int(q_offset) if _is_int(q_offset) else None,
        ring_inner=_check_ring_inner(ring_inner))


# ----------------------------------------------------------------------------- checks


def _check_shapes(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim"):  # a list or a number: what it is, then what is valid
            raise ValueError(f"{name} must be an array (jax or numpy) of rank 4; got a "
                             f"{type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 ({'[B, T, N, H]' if name == 'q' else '[B, S, K, H]'}); "
                f"got shape {x.shape}")
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
    # (a ZeroDivisionError from deep in the blocking, or from the default scale 1/sqrt(H))
    if q.shape[0] == 0:
        raise ValueError(f"empty batch: q {q.shape}; valid: B >= 1")
    if q.shape[3] == 0 or v.shape[3] == 0:
        raise ValueError(f"empty heads: q {q.shape}, v {v.shape}; valid: head dims >= 1")


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
    # Wider than any two positions are apart (OFFSET_LIMIT) is the same window, and
    # within int32 when added to a position.
    return min(int(pair[0]), WINDOW_LIMIT), min(int(pair[1]), WINDOW_LIMIT)


def _check_block(name, value):
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def _check_ring_inner(value):
    if value not in RING_INNER:
        raise ValueError(f"ring_inner must be one of {RING_INNER}; got {value!r}")
    return value


def _check_lengths(kv_lengths, batch, kv_len):
    if kv_lengths is None:
        return None
    lengths = jnp.asarray(kv_lengths)
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"kv_lengths must be an int array of shape [B]=[{batch}]; "
                         f"got {lengths.dtype} {lengths.shape}")
    known = known_values(lengths)
    if known is not None and known.size and (known.min() < 0 or known.max() > kv_len):
        bad = int(known.min() if known.min() < 0 else known.max())
        raise ValueError(f"kv_lengths: {bad} is not a length of the S={kv_len} keys; valid: "
                         f"0..{kv_len}")
    return lengths.astype(jnp.int32)


# How far from 0 a query offset may put positions. The masks add windows and lengths to
# int32 positions (a query's position plus its right window, a tile's last key plus the
# left window less the smallest offset): with |q_offset| <= 2**29, T and S below 2**28
# and each window side clamped at 2**30 (`_check_window`: no two positions are farther
# apart, so the clamp changes nothing) every such sum stays within int32. A window of
# 2**31 - 1, a common "unlimited", wrapped to negative and masked keys it should keep.
OFFSET_LIMIT = 2 ** 29
WINDOW_LIMIT = 2 ** 30


def _check_offset(q_offset, batch):
    valid = (f"valid: -{OFFSET_LIMIT}..{OFFSET_LIMIT} (positions are int32, and the masks "
             f"add windows to them)")
    if _is_int(q_offset) and abs(int(q_offset)) > OFFSET_LIMIT:
        # (jnp.asarray raised OverflowError past int32, naming no argument)
        raise ValueError(f"q_offset={int(q_offset)} is out of range; {valid}")
    if isinstance(q_offset, (list, tuple)):  # (jnp.asarray raised OverflowError for big ints)
        q_offset = np.asarray(q_offset)
    # Every offset a row of them holds, where it can be seen: an int64 (numpy's default)
    # or uint32 array past int32 wrapped when cast (2**32 + 3 read as 3).
    if (isinstance(q_offset, (np.ndarray, jax.Array)) and np.issubdtype(q_offset.dtype, np.integer)
            and q_offset.size):
        known = known_values(q_offset)
        if known is not None:
            values = known.astype(object).ravel()
            bad = [int(x) for x in values if abs(int(x)) > OFFSET_LIMIT]
            if bad:
                raise ValueError(f"q_offset holds {bad[0]}, out of range; {valid}")
    offset = jnp.asarray(q_offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer) or offset.ndim not in (0, 1) or (
            offset.ndim == 1 and offset.shape[0] != batch):
        raise ValueError(
            f"q_offset must be an int or an int array of shape [B]=[{batch}]; "
            f"got {offset.dtype} with shape {offset.shape}")
    return jnp.broadcast_to(offset.astype(jnp.int32), (batch,))


def _check_ids(name, ids, batch, length):
    if isinstance(ids, (list, tuple)):
        ids = np.asarray(ids)
    wide = (isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer)
            and (np.iinfo(ids.dtype).bits > 32 or ids.dtype == np.uint32))
    if wide and ids.size:
        # int64 ids (numpy's default; hashed document ids) wrapped when cast: 2**32 read as
        # 0, two documents merged into one with nothing said. The padding's id is one
        # below -max|id|, so int32's least value is out too.
        low, high = -np.iinfo(np.int32).max, np.iinfo(np.int32).max
        out = ids > high if ids.dtype.kind == "u" else (ids < low) | (ids > high)
        if out.any():
            raise ValueError(f"{name} holds {int(ids[out].flat[0])}, no int32 id; valid: "
                             f"{low}..{high} (renumber the segments: only which ids are "
                             f"equal matters)")
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
    q_name, kv_name = (("segment_ids",) * 2 if segment_ids is not None
                       else ("q_segment_ids", "kv_segment_ids"))
    q_ids = None if q_segment_ids is None else _check_ids(q_name, q_segment_ids, b, t)
    kv_ids = None if kv_segment_ids is None else _check_ids(kv_name, kv_segment_ids, b, s)
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
    given = mask.shape  # as the caller wrote it: the error names that, not the padded one
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    mb, mn, mt, ms = mask.shape
    if mb not in (1, b) or mn not in (1, n) or mt not in (1, t) or ms not in (1, s):
        raise ValueError(f"mask must broadcast to [B, N, T, S]=[{b}, {n}, {t}, {s}]; got {given}")
    return jnp.broadcast_to(mask, (mb, mn, t, s))
