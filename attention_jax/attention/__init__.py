"""Scaled dot-product attention as pure JAX functions (no Flax), with selectable backends.

Shape letters, used in every docstring, comment and einsum of the project:
  B batch            T query length        S key/value length     D model width
  N query heads      K key/value heads     G = N / K (query heads per K/V head)
  H head dim         Hv value head dim     F MLP hidden           V vocabulary
  P patches          E experts             L layers               A experts per token

    y = dot_product_attention(q, k, v, causal=True)   # q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H]
    y = packed_self_attention(qkv, bias, causal=True) # one projection's [B,T,3,N,H] and its
                                                      # bias [3,N,H]: the kernels read it in place

Implementations:
  "reference"  the lectures' formula with the whole [B, N, T, S] score matrix; the test
               oracle, and the only one that can return the attention weights.
  "blockwise"  lax.scan over query blocks, online softmax over key blocks, hand-written
               FlashAttention-2 style backward: O(T + S) memory forward and backward.
  "pallas"     the blockwise algorithm as fused Pallas kernels (pallas.py): Triton on
               NVIDIA GPUs, interpret mode on CPU (slow; for tests). Every structural mask.
  "xla"        jax.nn.dot_product_attention's XLA path (materialises the scores; jax_nn.py).
               No float64: jax.nn's softmax is float32, so float64 is refused by name.
  "cudnn"      jax.nn.dot_product_attention's fused cuDNN kernel (NVIDIA GPUs, f16/bf16),
               driven by its own causal / key-length / left-window arguments (jax_nn.py).
  "splash"     JAX's splash attention, the block-sparse TPU kernel maxtext uses (splash.py):
               compiled on TPUs, interpret mode elsewhere (slow; for tests). Causal,
               windows and a static q_offset as its static mask; segment ids, kv_mask and
               kv_lengths as its segment ids; GQA natively. T, S multiples of 128.
  "ring"       the sequence split over the ambient mesh's `sequence` axis (run under
               `jax.set_mesh(mesh)`), keys/values passed around the devices (ring.py):
               memory O(T / devices). T and S divisible by 2 × devices. Each chunk pair
               runs `ring_inner` (ring_inner.py): "auto" takes pallas on an NVIDIA GPU,
               splash on a TPU, blockwise elsewhere.
  "auto"       the first row of the table `BACKENDS` (below) that looks at this call on
               this platform and does not refuse it; `explain(...)` says which and why
               without running anything:
                 weights asked for          -> reference
                 ambient mesh with sequence > 1, lengths divisible by 2 × sequence, no
                   dense mask               -> ring
                 NVIDIA GPU, what cuDNN can express (f16/bf16, H % 8 == 0, H <= 128;
                   causal, right padding as kv_lengths, a causal left window, GQA)
                                            -> cudnn
                 NVIDIA GPU, anything else (segment ids, kv_mask, two-sided windows,
                   query offsets, float32, a dense mask)   -> pallas
                 TPU, what splash can express (float32/bfloat16, T and S multiples of
                   128, a static q_offset, no dense mask)  -> splash
                 CPU, TPU otherwise, float64               -> blockwise
               so no path builds an N×N mask unless the caller passed one.

Adding a backend: write a module that exports its run function `(q, k, v, call) -> y`
and its rules `(call, platform) -> reason or None` (call.py has the record; pallas.py
is an example), then add one `Backend` row for it to `BACKENDS`, where its place is its
place in auto's order. A kernel XLA cannot partition (a Pallas call) says so in its row
(`xla_partitions=False`): under a mesh it then runs on each device's rows and heads, as
the caller's `batch_axes` / `head_axes` split them (per_device.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.attention import blockwise, jax_nn, pallas, per_device, reference, ring, splash
from attention_jax.attention.call import (RING_INNER, AttentionCall, Platform, compiling_for,
                                         compiling_for_gpu, make_call, target_backend)
from attention_jax.attention.masks import MaskSpec
from attention_jax.attention.ring import ring_attention, sequence_axis_size
from attention_jax.attention.ring_inner import choose as choose_ring_inner
from attention_jax.errors import UserError

__all__ = ["dot_product_attention", "packed_self_attention", "reads_packed", "explain",
           "explain_packed",
           "IMPLEMENTATIONS", "BACKENDS", "MaskSpec", "RING_INNER", "default_block_sizes",
           "compiling_for", "BackendRefusedError"]


def default_block_sizes(backend: Optional[str] = None, *, heads: Optional[int] = None,
                        head_dim: int = 64, q_len: Optional[int] = None,
                        kv_len: Optional[int] = None) -> tuple[int, int]:
    """(block_q, block_k) for the blockwise path on this backend.

    A tile works on every (batch, head) pair at once: scores [B·N, bq, bk] plus the q,
    k, v and output blocks. On CPU the tile should fit in cache (2 MiB of L2 per core
    here), so its size depends on how many heads share it. `heads` (B·N), `head_dim` and
    the lengths, when given, pick the largest tile whose working set stays under 8 MiB;
    without them, the tile for one sequence of 8 heads; a problem small enough for one
    tile is one tile (no loop beats it). The sizes were chosen by `python -m
    attention_jax.tools.bench attention` on a 2-core CPU and an H100 (README, Measurements behind the code).
    """
    backend = backend or target_backend()
    if backend != "cpu":  # large tiles: the H100's measured best for the scan path
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


# ----------------------------------------------------------------------------- the table

Rule = Callable[[AttentionCall, Platform], Optional[str]]


def _never(call: AttentionCall, platform: Platform) -> Optional[str]:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One row of the dispatch table: a backend and the rules that say where it runs."""

    name: str  # what `implementation=` calls it
    run: Callable  # (q, k, v, call) -> y [B, T, N, Hv]
    # Why it cannot run this call here (None: it can). An explicit request raises it.
    refusal: Rule = _never
    # Where "auto" looks at this backend, its reason for taking it; None where it does
    # not look (everywhere, by default: such a row runs only when asked for by name).
    auto_reason: Rule = _never
    # Why "auto" passes it over although it could run the call (e.g. cuDNN would be
    # handed a dense mask).
    auto_refusal: Rule = _never
    weights: bool = False  # can return the attention weights
    # What else explain() says once this row is chosen (ring: its chunk-pair kernel).
    detail: Optional[Rule] = None
    # Where this row is the only one that runs what the call asks for (ring: a ring_inner
    # kernel by name), "auto" raises the row's refusal instead of passing it over: the
    # asked-for kernel must not be dropped silently for one that ignores the request.
    insisted: Callable[[AttentionCall], bool] = lambda call: False
    # Whether XLA's partitioner can split the backend's computation over a mesh. A Pallas
    # kernel is an opaque call XLA would gather whole onto each device: such a row runs
    # under shard_map on each device's rows and heads (per_device.py).
    xla_partitions: bool = True


def _blockwise(q, k, v, call: AttentionCall):
    default_q, default_k = default_block_sizes(heads=call.batch * call.heads,
                                               head_dim=call.head_dim, q_len=call.q_len,
                                               kv_len=call.kv_len)
    return blockwise.blockwise_attention(q, k, v, call.spec, call.scale,
                                         call.block_q or default_q, call.block_k or default_k)


def _ring(q, k, v, call: AttentionCall):
    """Ring attention; the tiles asked for go to the pair kernel, and a blockwise pair
    kernel without them gets default_block_sizes for one device's chunk."""
    sequence = sequence_axis_size()
    inner, _ = choose_ring_inner(call, _platform())
    block_q, block_k = call.block_q, call.block_k
    if inner == "blockwise":
        default_q, default_k = default_block_sizes(
            heads=call.batch * call.heads, head_dim=call.head_dim,
            q_len=call.q_len // (2 * sequence), kv_len=call.kv_len // (2 * sequence))
        block_q, block_k = block_q or default_q, block_k or default_k
    return ring_attention(q, k, v, call.spec, call.scale, block_q, block_k, inner=inner,
                          static_offset=call.static_offset)


# In auto's order: the first row whose auto_reason speaks and whose rules do not refuse.
# (blockwise and ring read their tiles from default_block_sizes above, so their run
# functions are here.)
BACKENDS = (
    Backend("reference", reference.run, auto_reason=reference.auto_reason, weights=True),
    Backend("ring", _ring, refusal=ring.refusal, auto_reason=ring.auto_reason,
            detail=ring.inner_reason, insisted=lambda call: call.ring_inner != "auto"),
    Backend("cudnn", jax_nn.cudnn, refusal=jax_nn.cudnn_refusal,
            auto_reason=jax_nn.cudnn_auto_reason, auto_refusal=jax_nn.cudnn_auto_refusal),
    Backend("pallas", pallas.run, refusal=pallas.refusal, auto_reason=pallas.auto_reason,
            xla_partitions=False),
    Backend("splash", splash.run, refusal=splash.refusal, auto_reason=splash.auto_reason,
            xla_partitions=False),
    Backend("blockwise", _blockwise, auto_reason=blockwise.auto_reason),
    Backend("xla", jax_nn.xla, refusal=jax_nn.xla_refusal),
)
_BY_NAME = {row.name: row for row in BACKENDS}
IMPLEMENTATIONS = ("auto",) + tuple(_BY_NAME)


# ----------------------------------------------------------------------------- entry points


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
    ring_inner: str = "auto",
    batch_axes: Sequence[str] = (),
    head_axes: Sequence[str] = (),
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
      block_q, block_k: tile sizes for "blockwise" (defaults: `default_block_sizes()`),
        for "pallas"'s forward and dQ kernels (powers of two >= 16; defaults:
        `pallas.kernel_block_sizes()`) and for "splash"'s kernels (multiples of 128
        dividing T / S; defaults: `splash.block_sizes()`); for "ring", its chunk-pair
        kernel's tiles within a chunk, by the same rules (splash: dividing the chunk).
      return_weights: also return the attention weights [B, N, T, S] (reference only).
      ring_inner: the kernel "ring" runs on each pair of sequence chunks: "auto" (pallas
        on an NVIDIA GPU, splash on a TPU, blockwise elsewhere or where those refuse),
        "pallas", "splash" or "blockwise" (ring_inner.py). Ignored by the other backends
        (explain() says so).
      batch_axes, head_axes: the ambient mesh's axes that split q's batch and heads (the
        layers pass what the logical rules map "batch" and "heads" to). A backend XLA
        cannot partition (pallas) then runs on each device's share (per_device.py);
        without them it is gathered whole onto every device. The others ignore them.

    Returns:
      [B, T, N, Hv] in q's dtype (and the weights if asked). Rows with no visible key
      are zero, with zero gradients, never NaN.
    """
    call = make_call(q, k, v, causal=causal, segment_ids=segment_ids,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     kv_mask=kv_mask, kv_lengths=kv_lengths, mask=mask, window=window,
                     q_offset=q_offset, scale=scale, block_q=block_q, block_k=block_k,
                     return_weights=return_weights, ring_inner=ring_inner)
    impl, _ = _choose(implementation, call, _platform())
    return _run(impl, _BY_NAME[impl].run, call, (q, k, v), _QKV_ROLES, batch_axes, head_axes)


# q, k, v [B, T|S, N|K, H]: which dimensions are the batch and the heads (per_device.py)
_QKV_ROLES = (("B", None, "N", None),) * 3


def _run(impl: str, fn: Callable, call: AttentionCall, inputs: tuple, roles: tuple,
         batch_axes: Sequence[str], head_axes: Sequence[str]):
    """fn(*inputs, call), on each device's share where XLA cannot partition `impl`."""
    if not _BY_NAME[impl].xla_partitions:
        split = per_device.split_of(call, batch_axes, head_axes, impl)
        if split is not None:
            return per_device.run(fn, call, split, inputs, roles)
    return fn(*inputs, call)


# Backends that read q, k and v where one projection wrote them, [B, T, 3, N, H] (their
# run function for it: (qkv, bias, call) -> y). The others are handed q, k, v sliced out.
_PACKED_RUN = {"pallas": pallas.run_packed}


def packed_self_attention(qkv, bias=None, *, implementation: str = "auto",
                          batch_axes: Sequence[str] = (), head_axes: Sequence[str] = (),
                          **kwargs):
    """Self-attention of one fused projection's output: qkv [B, T, 3, N, H] (q, k and v in
    slots 0, 1, 2) and its bias [3, N, H] or None -> [B, T, N, H].

    The same as `dot_product_attention(q + bias[0], k + bias[1], v + bias[2], ...)`, chosen
    the same way (keyword arguments as there; no q_offset or weights: a cached decode
    and the reference's weights take q, k, v apart), except that "auto" takes the Pallas
    kernels over cuDNN where they were faster with cuDNN's slicing counted
    (pallas.packed_auto_reason: plain causal rows at head dim 64, T <= 1024; `explain_packed`
    says which and why). Where the choice reads packed inputs (`reads_packed`: the
    Pallas kernels), nothing is copied between the projection and the kernels, forward or
    backward (pallas.pallas_packed_attention); elsewhere q, k and v are sliced out and
    biased first, copies that three separate projections avoid. The bias may be in
    another float dtype than qkv (a model's float32 parameter): the kernels read it as
    it is (no launch to cast it; they add it in float32, and its gradient keeps its
    dtype); elsewhere it is cast to qkv's dtype and added.
    """
    if getattr(qkv, "ndim", None) != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [B, T, 3, N, H] (q, k, v in slots 0, 1, 2); got shape "
                         f"{getattr(qkv, 'shape', type(qkv).__name__)}")
    impl, call, _ = _packed_choice(qkv, implementation, kwargs, batch_axes, head_axes)
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (3, *qkv.shape[3:]):
            raise ValueError(f"bias must be [3, N, H]={[3, *qkv.shape[3:]]} or None; got "
                             f"{bias.shape}")
    if impl in _PACKED_RUN:  # (the kernels read the bias as given, in float32 arithmetic)
        packed = (("B", None, None, "N", None), (None, "N", None))  # qkv, bias [3, N, H]
        if bias is None:
            return _run(impl, lambda qkv, call: _PACKED_RUN[impl](qkv, None, call), call,
                        (qkv,), packed[:1], batch_axes, head_axes)
        return _run(impl, _PACKED_RUN[impl], call, (qkv, bias), packed, batch_axes, head_axes)
    q, k, v = (qkv[:, :, c] if bias is None else qkv[:, :, c] + bias[c].astype(qkv.dtype)
               for c in range(3))
    return _run(impl, _BY_NAME[impl].run, call, (q, k, v), _QKV_ROLES, batch_axes, head_axes)


def reads_packed(qkv, *, implementation: str = "auto", batch_axes: Sequence[str] = (),
                 head_axes: Sequence[str] = (), **kwargs) -> bool:
    """Whether `packed_self_attention(qkv, ...)` with these arguments runs a backend that
    reads the packed array in place; qkv may be a `jax.ShapeDtypeStruct` [B, T, 3, N, H].
    A layer asks before projecting: three projections suit the other backends better."""
    return _packed_choice(qkv, implementation, kwargs, batch_axes, head_axes)[0] in _PACKED_RUN


def explain_packed(qkv, *, implementation: str = "auto", batch_axes: Sequence[str] = (),
                   head_axes: Sequence[str] = (), **kwargs) -> tuple[str, str]:
    """(implementation, reason) `packed_self_attention(qkv, ...)` would take: `explain`'s
    for q, k, v of qkv's slots, except where auto takes the kernels that read the packed
    array over cuDNN (pallas.packed_auto_reason)."""
    impl, _, reason = _packed_choice(qkv, implementation, kwargs, batch_axes, head_axes)
    return impl, reason


def _packed_choice(qkv, implementation: str, kwargs, batch_axes: Sequence[str] = (),
                   head_axes: Sequence[str] = ()) -> tuple[str, AttentionCall, str]:
    """(implementation, call, reason) of a packed self-attention: `_choose`'s, except that where
    auto would take cuDNN the kernels that read the packed array may be faster with
    cuDNN's slicing counted (pallas.packed_auto_reason) - where they would run on each
    device's share alone, and with no tile sizes given for cuDNN's sake."""
    for name in ("q_offset", "return_weights"):
        if name in kwargs:
            raise TypeError(f"packed_self_attention() takes no {name} (use dot_product_attention)")
    b, t, _, n, h = qkv.shape
    slot = jax.ShapeDtypeStruct((b, t, n, h), qkv.dtype)
    call = make_call(slot, slot, slot, **kwargs)
    platform = _platform()
    impl, reason = _choose(implementation, call, platform)
    why = pallas.packed_auto_reason(call, platform) if implementation == "auto" else None
    if (impl == "cudnn" and why is not None
            and _refusal(_BY_NAME["pallas"], call, platform) is None
            and call.block_q is None and call.block_k is None
            and per_device.divides(call, batch_axes, head_axes)):
        return "pallas", call, why
    return impl, call, reason


_CALL_ARGUMENTS = tuple(inspect.signature(make_call).parameters)[3:]  # after q, k, v


def explain(q, k, v, *, implementation: str = "auto", backend: Optional[str] = None,
            **kwargs) -> tuple[str, str]:
    """(implementation, reason): what `dot_product_attention` would run, without running it.

    Takes the same arguments (checked the same way); arrays may be `jax.ShapeDtypeStruct`s.
    `backend` ("cpu", "gpu", "tpu"; default: this process's) asks what would happen on
    another backend, so the choice for a GPU can be checked on a laptop:

        explain(q, k, v, causal=True, segment_ids=ids, backend="gpu")
        # ('pallas', 'the fused Pallas kernels take every mask, tile by tile; '
        #  'not cudnn: segment ids (or kv_mask): cuDNN has no argument for them')

    The reason is auto's reason for its choice, then why each backend it looked at first
    passed ("; not cudnn: ..."); an explicit `implementation` that can run says "asked for".
    """
    if backend not in (None, "cpu", "gpu", "tpu"):
        raise ValueError(f"backend={backend!r} is unknown; valid: 'cpu', 'gpu', 'tpu', or None "
                         f"for this process's ({jax.default_backend()!r})")
    for name in ("batch_axes", "head_axes"):  # how it runs under a mesh, not what runs
        kwargs.pop(name, None)
    unknown = sorted(set(kwargs) - set(_CALL_ARGUMENTS))
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {unknown}; valid: "
                        f"dot_product_attention's {_CALL_ARGUMENTS} and implementation, backend")
    platform = _platform(backend)
    # Arrays and ShapeDtypeStructs are traced; Python values stay static, as in a real
    # call (a static q_offset of 0 is what lets cuDNN take a causal mask).
    arrays = {name: x for name, x in kwargs.items()
              if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))}
    static = {name: x for name, x in kwargs.items() if name not in arrays}
    answer = []

    def trace(q, k, v, arrays):
        answer.append(_choose(implementation, make_call(q, k, v, **static, **arrays), platform))

    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in arrays.values()):
        # Values seen now, as dot_product_attention sees them eagerly: traced, a length
        # past S (kv_lengths=[99, 2] for 4 keys) passed unsaid.
        make_call(q, k, v, **static, **arrays)
    jax.eval_shape(trace, q, k, v, arrays)
    return answer[0]


# ----------------------------------------------------------------------------- choosing


def _platform(backend: Optional[str] = None) -> Platform:
    """This process's platform, or `backend` as explain's "what if" (a GPU then counts as
    an NVIDIA one)."""
    if backend is None:
        backend = target_backend()
        nvidia = compiling_for_gpu() or any(
            d.platform == "gpu" and "NVIDIA" in getattr(d, "device_kind", "NVIDIA")
            for d in jax.devices())
    else:
        nvidia = backend == "gpu"
    return Platform(backend, nvidia, sequence_axis_size())


def _refusal(row: Backend, call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why `row` cannot run `call` here: its own rule, then the weights, which only the
    rows marked `weights` form."""
    reason = row.refusal(call, platform)
    if reason is None and call.return_weights and not row.weights:
        valid = " or ".join(repr(r.name) for r in BACKENDS if r.weights)
        reason = (f"return_weights=True needs implementation={valid} (or 'auto'); got "
                  f"{row.name!r}, which never forms the weights")
    return reason


def _with_detail(row: Backend, reason: str, call: AttentionCall, platform: Platform) -> str:
    if row.detail is not None:
        reason = f"{reason}; {row.detail(call, platform)}"
    if call.ring_inner != "auto" and row.name != "ring":
        # Not refused: models hand their ring_inner to every call, also to those that
        # switch to another backend (the reference, for the weights).
        reason = f"{reason}; ring_inner={call.ring_inner!r} unused (only 'ring' reads it)"
    return reason


class BackendRefusedError(UserError, ValueError):
    """An implementation asked for (or insisted on, as the ring under a mesh that splits
    the sequence) cannot run this call: the message says why and what would. A request's
    mistake, so the command line says it in one line (a ValueError as before)."""


def _choose(implementation: str, call: AttentionCall, platform: Platform) -> tuple[str, str]:
    """(implementation, reason) for this call on this platform; raises, naming the reason,
    when an explicit implementation cannot run it."""
    if implementation != "auto":
        if implementation not in _BY_NAME:
            raise ValueError(f"implementation={implementation!r} is unknown; valid: "
                             f"{IMPLEMENTATIONS}")
        reason = _refusal(_BY_NAME[implementation], call, platform)
        if reason is not None:
            raise BackendRefusedError(reason)
        return implementation, _with_detail(_BY_NAME[implementation], "asked for", call,
                                            platform)
    passed_over = []
    for row in BACKENDS:
        taken_because = row.auto_reason(call, platform)
        if taken_because is None:
            continue
        refusal = _refusal(row, call, platform)
        if refusal is not None and row.insisted(call):
            raise BackendRefusedError(refusal)
        refusal = refusal or row.auto_refusal(call, platform)
        if refusal is None:
            return row.name, _with_detail(row, "; ".join([taken_because] + passed_over),
                                          call, platform)
        passed_over.append(f"not {row.name}: {refusal}")
    raise AssertionError(f"no row of BACKENDS takes this call ({passed_over}); the last row "
                         f"auto looks at must take every call")
