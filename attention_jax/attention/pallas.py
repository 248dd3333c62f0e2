"""FlashAttention as fused Pallas kernels: the blockwise algorithm, one tile per program.

The algorithm is blockwise.py's (read that first: it is the teaching text); here it is
written as three GPU kernels instead of a lax.scan, so a tile of scores lives in
registers and never reaches memory:

  forward   program (query block i, batch b, head n): walks the key blocks j that the
            mask lets query block i see, keeping the running max m, sum l and output
            acc of the online softmax; writes O and the per-row log-sum-exp L.
  dQ        program (query block i, b, n): writes its rows' D = rowsum(dO ∘ O), walks
            the same key blocks as the forward, recomputing P = exp(S - L) from the
            saved L, and accumulates dQ += dS K with dS = P ∘ (dP - D).
  dK, dV    program (key block j, b, n), launched after dQ (it reads D): walks the
            query blocks that can see key block j and accumulates dV += Pᵀ dO and
            dK += dSᵀ Q.
  (FlashAttention-2, Dao 2023, algorithms 1 and 2; dQ gets its own kernel instead of
  atomic adds, so the gradient is deterministic, and computes D, FlashAttention-2's
  separate preprocessing pass, from the dO tile it loads anyway.)

Tiles are read in place from the [B, T, N, H] / [B, S, K, H] arrays: a program loads a
[rows, H] slice of one head through a strided pointer, so there is no transpose, and a
grouped-query head n reads K/V head n // G without copying K/V. Scores are kept in
base 2 (exp2 is the GPU's native exponential): S₂ = Q Kᵀ · scale · log₂e, and L is
stored in the same base, so the backward's P = exp2(S₂ - L₂) is the forward's. The
scale is never a pass of its own over a tile: the row max is taken of the raw products
(a positive scale keeps the max where it is) and P = exp2(S·c - m) is one fused
multiply-add and one exp2 a score (`_exp2`), written as PTX on Triton: ptx.py
says why (Triton's own lowering of the same is four instructions more a score).

Masks are structural, as everywhere in the package (masks.py): a program works out from
its block index, the batch row's query offset and key length which key blocks are
hidden entirely (never visited), which are visible entirely (visited without any mask
arithmetic) and which need the per-element mask (causal diagonal, window edges, a
partial last block, segment ids, a dense mask tile). Segment ids (packed documents) are
read the same way, before the kernels run (`_segment_ranges`, on the grid of tiles): a
query block walks only the key blocks whose ids can meet its own, and those inside its
one document (as packing makes them) unmasked; the kernels intersect that with the
structure's ranges. A packed row then costs what a plain causal one does, and the loops
hold no branch (a branch around a tile stops Triton pipelining the loads of K and V).
Rows with no visible key give zero output and zero gradients.

Packed q, k, v (`pallas_packed_attention`, for self-attention whose q, k and v come from
one projection): the kernels read each head's tiles from the projection's [B, T, 3, N, H]
output, a slot being a strided view as a [B, T, N, H] array is. The dQ kernel writes
slot 0 of one gradient array and the dK/dV kernel stores its tiles into slots 1 and 2 of
the same array (aliased), so the projection's backward gets one [B, T, 3, N, H]
gradient: one matmul for dx, not three whose products are summed, and no q, k, v
materialised with their biases in between. The projection's bias never touches a tile
in a loop (a tile changed between its load and a dot is not pipelined into shared
memory: with the bias added to each tile, GPT-2 small's forward took 0.198 ms a layer in
its step on an H100, 0.141 without); it is folded into the algebra instead, exactly:
  k's bias adds q_i·b_k to every score of row i: a constant per row, which softmax
            cancels. It changes nothing, and its gradient is zero (the kernels sum it
            from dk as the others, so it comes out as rounding's near-zero).
  q's bias adds b_q·k_j to the scores of key j: one number per key (`_key_term`, an
            [B, N, T] input like L), added to each tile of scores. dK gets b_q Σ_i dS_ij.
  v's bias adds b_v to every output row (the weights sum to 1): added once at the end;
            D = rowsum(dO ∘ (O - b_v)) then pairs with dP = dO Vᵀ of the raw v.
The bias's gradient is summed by the same programs over the float32 tiles they write.

Ring attention (ring.py) runs the forward on each pair of sequence chunks and merges
the pairs itself: `forward_with_lse` returns the log-sum-exp too, and
`backward_given_lse` runs the two backward kernels with the merged output and
log-sum-exp in place of the pair's own (ring_inner.py says why that is exact).

Backends: Pallas lowers these kernels through Triton on NVIDIA GPUs (run and measured
on an H100: see the README). On CPU they run with `interpret=True`, which is how the
test suite checks every mask against the float64 reference. The kernel bodies use only
what Mosaic TPU also lowers (2-D tiles, dots, exp2, where; the inline PTX is taken only
when lowering for a GPU), but they have not been run
on a TPU, and TPU block shapes have other constraints; treat TPU as untested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attention_jax.attention import ptx
from attention_jax.attention.call import AttentionCall, Platform, target_backend
from attention_jax.attention.masks import MaskSpec

LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch settings of the three kernels.

    fwd_q × fwd_k: the forward's (and the dQ kernel's) query block × key block.
    bwd_q × bwd_k: the dK/dV kernel's query block (its inner loop) × key block (one per
    program). Triton wants powers of two, at least 16 (the tensor-core dot's minimum).
    """

    fwd_q: int = 128
    fwd_k: int = 64
    bwd_q: int = 64
    bwd_k: int = 128
    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2


_TILES = ("fwd_q", "fwd_k", "bwd_q", "bwd_k")
# The longest rows (T) that take the short rows' forward tiles at H <= 64: GPT-2's 1024,
# where they were measured faster (H200, the packed kernels: causal 201 / 189 TFLOP/s
# forward / forward+backward against 185 / 181, packed documents 210 / 221 against 142 /
# 167); at 4096 (H100) 128 x 64 in 8 warps led.
SHORT_ROWS = 1024
_given_tiles: dict = {}  # what `tiles(...)` gives, within it


def kernel_block_sizes(head_dim: int, dtype, backend: Optional[str] = None,
                       length: Optional[int] = None) -> BlockSizes:
    """Tile sizes measured fastest on a Hopper GPU (bf16; the sweeps are in the README,
    Measurements behind the code). `length`: the query rows' length T, where known.

    Float32 tiles
    and H > 128 tiles are twice the bytes and must be smaller to fit the 227 KiB of
    shared memory a block may use. At H <= 64 and T <= SHORT_ROWS the forward and dQ
    programs take 64 x 64 tiles in 4 warps (four forward and three dQ programs an SM,
    where 128 x 64 in 8 warps holds two); at T = 4096 128 x 64 led. In interpret mode
    (CPU) speed means nothing; small
    tiles make the tests walk several blocks per row, so that loop bounds and partial
    masks are exercised. Within `tiles(...)`, the fields it gives replace these.
    """
    backend = backend or target_backend()
    if backend == "cpu":
        blocks = BlockSizes(fwd_q=16, fwd_k=16, bwd_q=16, bwd_k=16)
    elif jnp.dtype(dtype).itemsize > 2 or head_dim > 128:
        blocks = BlockSizes(fwd_q=64, fwd_k=32, bwd_q=32, bwd_k=64, num_warps=4,
                            num_stages=2, bwd_num_warps=4, bwd_num_stages=2)
    elif head_dim > 64:
        blocks = BlockSizes(fwd_q=128, fwd_k=64, bwd_q=64, bwd_k=128, num_warps=8,
                            num_stages=3, bwd_num_warps=8, bwd_num_stages=3)
    elif length is not None and length <= SHORT_ROWS:
        blocks = BlockSizes(fwd_q=64, fwd_k=64, bwd_q=64, bwd_k=64, num_warps=4,
                            num_stages=3, bwd_num_warps=4, bwd_num_stages=3)
    else:
        blocks = BlockSizes(fwd_q=128, fwd_k=64, bwd_q=64, bwd_k=64, num_warps=8,
                            num_stages=3, bwd_num_warps=4, bwd_num_stages=3)
    return dataclasses.replace(blocks, **_given_tiles) if _given_tiles else blocks


@contextlib.contextmanager
def tiles(**fields):
    """Within (a context manager): `kernel_block_sizes` gives these BlockSizes fields in
    place of its own, for every head size and backend, so that a whole model's kernels
    take them (`bench gpu-hlo --pallas-tiles` compiles the step so; `bench attention
    --pallas-tiles` hands the kernels BlockSizes itself). Read when a kernel is traced:
    a function traced before keeps its tiles. A call's own block_q and block_k
    (dot_product_attention's) still replace fwd_q and fwd_k. Tiles: powers of two >= 16;
    warps: powers of two (Triton's rule); stages: ints >= 1."""
    names = [f.name for f in dataclasses.fields(BlockSizes)]
    for name, value in fields.items():
        if name not in names:
            raise TypeError(f"{name}=...: not a tile setting; valid: {', '.join(names)}")
        least, power_of_two = (16 if name in _TILES else 1), "stages" not in name
        if (not isinstance(value, int) or isinstance(value, bool) or value < least
                or (power_of_two and value & (value - 1))):
            raise ValueError(f"{name}={value!r}; valid: "
                             + (f"a power of two >= {least}" if power_of_two else "an int >= 1"))
    global _given_tiles
    before, _given_tiles = _given_tiles, {**_given_tiles, **fields}
    try:
        yield
    finally:
        _given_tiles = before


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about the call fixed at trace time (hashable, for custom_vjp)."""

    causal: bool
    left: Optional[int]  # how far back a query looks (None: unbounded)
    right: Optional[int]  # how far ahead (None: unbounded; 0 when causal)
    scale: float
    q_len: int  # T before padding
    kv_len: int  # S before padding
    heads: int  # N
    groups: int  # G = N / K
    has_lengths: bool
    has_segments: bool
    mask_shape: Optional[tuple[int, int]]  # (B|1, N|1) of the dense mask, or None
    blocks: BlockSizes
    interpret: bool
    # q, k, v read from one [B, T, 3, N, H] array (slots 0, 1, 2), the gradient written
    # into one such array (`pallas_packed_attention`).
    packed: bool = False
    biased: bool = False  # a [3, N, H] bias of q, k, v (folded in: see the module's text)

    @property
    def kv_padded(self) -> bool:
        """Keys past S exist (S padded to whole blocks) and must be masked."""
        return self.kv_len % max(self.blocks.fwd_k, self.blocks.bwd_k) != 0

    @property
    def may_mask(self) -> bool:
        """Whether any tile can need the per-element mask (else one unmasked loop)."""
        return (self.left is not None or self.right is not None or self.has_lengths
                or self.data_dependent or self.kv_padded)

    @property
    def data_dependent(self) -> bool:
        """Masks read from arrays: a tile's visibility needs a look at them."""
        return self.has_segments or self.mask_shape is not None


def pallas_attention(q, k, v, spec: MaskSpec, scale: float,
                     blocks: Optional[BlockSizes] = None, interpret: Optional[bool] = None):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] -> [B, T, N, Hv], fused kernels."""
    st, (qp, kp, vp), arrays = _prepare(q, k, v, spec, scale, blocks, interpret)
    y = _flash(st, qp, kp, vp, arrays)
    return y[:, :q.shape[1], :, :v.shape[3]]


def forward_with_lse(q, k, v, spec: MaskSpec, scale: float, blocks: Optional[BlockSizes] = None,
                     interpret: Optional[bool] = None, out_dtype=None):
    """The forward kernel alone, for callers that merge partial softmaxes (ring.py):
    (out [B, T, N, Hv] in out_dtype (default q's), lse [B, N, T]: each row's log-sum-exp
    of its scaled scores, natural log, +inf on rows that see no key). No gradient."""
    st, (qp, kp, vp), arrays = _prepare(q, k, v, spec, scale, blocks, interpret)
    out, lse2 = _forward(st, qp, kp, vp, arrays, out_dtype=out_dtype)
    t = q.shape[1]
    return out[:, :t, :, :v.shape[3]], lse2[:, :, :t] / LOG2_E  # base 2 -> natural


def backward_given_lse(q, k, v, spec: MaskSpec, scale: float, out, lse, d_out,
                       blocks: Optional[BlockSizes] = None, interpret: Optional[bool] = None,
                       grad_dtype=None):
    """The backward kernels given the output `out` [B, T, N, Hv] and log-sum-exp `lse`
    [B, N, T] (natural log, +inf on empty rows) of a softmax that may span more keys than
    k holds: P = exp(S - lse) and D = rowsum(d_out ∘ out) are then the whole softmax's,
    and (dq, dk, dv) are this block of keys' share of the gradient (ring.py sums them).
    Returned in grad_dtype (default: the inputs' dtypes)."""
    st, (qp, kp, vp), arrays = _prepare(q, k, v, spec, scale, blocks, interpret)
    tp, hvp = qp.shape[1], vp.shape[3]
    outp, dop = (_pad(_pad(x, 1, tp), 3, hvp) for x in (out, d_out))
    lse2 = _pad(lse.astype(_acc(q.dtype)) * LOG2_E, 2, tp, value=jnp.inf)  # padded rows: P = 0
    dq, dk, dv = _backward(st, qp, kp, vp, arrays, outp, lse2, dop, grad_dtype=grad_dtype)
    t, s, h = q.shape[1], k.shape[1], q.shape[3]
    return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :v.shape[3]]


def _prepare(q, k, v, spec: MaskSpec, scale: float, blocks: Optional[BlockSizes],
             interpret: Optional[bool]):
    """The kernels' static description and their padded inputs."""
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
    if interpret is None:
        interpret = target_backend() == "cpu"
    blocks = blocks or kernel_block_sizes(h, q.dtype, length=t)
    st = _Static(
        causal=spec.causal, left=spec.left, right=spec.right, scale=float(scale), q_len=t,
        kv_len=s, heads=n, groups=n // kh, has_lengths=spec.kv_lengths is not None,
        has_segments=spec.q_segment_ids is not None,
        mask_shape=None if spec.mask is None else tuple(spec.mask.shape[:2]),
        blocks=blocks, interpret=bool(interpret))
    # Pad lengths to whole blocks and head dims to a power of two (zeros change no
    # product); the kernels mask the padded keys, and the padded rows are cut off.
    tp, sp = _round_up(t, max(blocks.fwd_q, blocks.bwd_q)), _round_up(s, max(blocks.fwd_k, blocks.bwd_k))
    hp, hvp = _pow2_at_least_16(h), _pow2_at_least_16(hv)
    qp = _pad(_pad(q, 1, tp), 3, hp)
    kp = _pad(_pad(k, 1, sp), 3, hp)
    vp = _pad(_pad(v, 1, sp), 3, hvp)
    return st, (qp, kp, vp), _mask_arrays(st, spec, tp, sp)


def _mask_arrays(st: _Static, spec: MaskSpec, tp: int, sp: int):
    """The mask's arrays as the kernels read them, padded to tp queries and sp keys."""
    ranges = (None, None)
    if st.has_segments:
        q_seg, kv_seg, blocks = spec.q_segment_ids, spec.kv_segment_ids, st.blocks
        ranges = (_segment_ranges(q_seg, kv_seg, tp, sp, blocks.fwd_q, blocks.fwd_k),
                  _segment_ranges(kv_seg, q_seg, sp, tp, blocks.bwd_k, blocks.bwd_q))
    arrays = (spec.q_offset, spec.kv_lengths, spec.q_segment_ids, spec.kv_segment_ids,
              None if spec.mask is None else spec.mask.astype(jnp.int8), *ranges)
    return _pad_arrays(arrays, tp, sp)


def pallas_packed_attention(qkv, bias, spec: MaskSpec, scale: float,
                            blocks: Optional[BlockSizes] = None,
                            interpret: Optional[bool] = None):
    """Self-attention of one projection's output: qkv [B, T, 3, N, H] (q, k, v in slots
    0, 1, 2) and its bias [3, N, H] (or None) -> [B, T, N, H].

    The same kernels as `pallas_attention`, reading each head's q, k and v tiles where
    the projection wrote them (strided, as they read [B, T, N, H]), with the bias folded
    into their algebra (the module's text); the backward writes dq, dk and dv into one
    [B, T, 3, N, H] array. So nothing is copied between the projection and the kernels, either way: no
    q, k, v with their biases materialised in the forward, and in the backward one
    matmul x·Wᵀ over the three (K = 3·N·H) instead of three whose products are summed.
    """
    b, t, three, n, h = qkv.shape
    if three != 3:
        raise ValueError(f"qkv must be [B, T, 3, N, H] (q, k, v in slots 0, 1, 2); got {qkv.shape}")
    if bias is not None and bias.shape != (3, n, h):
        raise ValueError(f"bias must be [3, N, H]=[3, {n}, {h}] or None; got {bias.shape}")
    if interpret is None:
        interpret = target_backend() == "cpu"
    blocks = blocks or kernel_block_sizes(h, qkv.dtype, length=t)
    st = _Static(
        causal=spec.causal, left=spec.left, right=spec.right, scale=float(scale), q_len=t,
        kv_len=t, heads=n, groups=1, has_lengths=spec.kv_lengths is not None,
        has_segments=spec.q_segment_ids is not None,
        mask_shape=None if spec.mask is None else tuple(spec.mask.shape[:2]),
        blocks=blocks, interpret=bool(interpret), packed=True, biased=bias is not None)
    # One array holds queries and keys, so one padded length serves both walks.
    length = _round_up(t, max(blocks.fwd_q, blocks.bwd_q, blocks.fwd_k, blocks.bwd_k))
    hp = _pow2_at_least_16(h)
    qkvp = _pad(_pad(qkv, 1, length), 4, hp)
    biasp = None if bias is None else _pad(bias, 2, hp)  # read as given: added in float32
    y = _flash_packed(st, qkvp, biasp, _mask_arrays(st, spec, length, length))
    return y[:, :t, :, :h]


def run(q, k, v, call: AttentionCall):
    """The dispatcher's entry: `pallas_attention` with `kernel_block_sizes`, whose forward
    and dQ tiles `call.block_q` / `call.block_k` replace when given."""
    return pallas_attention(q, k, v, call.spec, call.scale, _call_blocks(call))


def run_packed(qkv, bias, call: AttentionCall):
    """`run` for self-attention handed one projection's output qkv [B, T, 3, N, H] and
    its bias [3, N, H] (or None): `pallas_packed_attention` with run's tiles."""
    return pallas_packed_attention(qkv, bias, call.spec, call.scale, _call_blocks(call))


def _call_blocks(call: AttentionCall) -> BlockSizes:
    blocks = kernel_block_sizes(call.head_dim, call.dtype, length=call.q_len)
    return dataclasses.replace(blocks, fwd_q=_pow2_block("block_q", call.block_q, blocks.fwd_q),
                               fwd_k=_pow2_block("block_k", call.block_k, blocks.fwd_k))


def refusal(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why the kernels cannot run this call here: Triton has no float64 (interpret mode
    on CPU has, which is how the tests compare against the float64 reference)."""
    if platform.backend != "cpu" and call.dtype == jnp.float64:
        return ("implementation='pallas' takes float16, bfloat16 or float32 on a GPU; got "
                "float64 (use 'blockwise' or 'reference')")
    # Here, not only where the tiles are made: "auto" took the kernels for tiles they
    # cannot have (block_q=8 on a GPU) and failed, where it could pass them over.
    for name, value in (("block_q", call.block_q), ("block_k", call.block_k)):
        if value is not None and (value < 16 or value & (value - 1)):
            return (f"{name} must be a power of two >= 16 for implementation='pallas'; got "
                    f"{value!r}")
    return None


def auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Where "auto" looks at the kernels, its reason for taking them: NVIDIA GPUs only (on
    CPU they run interpreted, slow, for tests; on TPU they have never run)."""
    return "the fused Pallas kernels take every mask, tile by tile" if platform.nvidia_gpu else None


# The packed self-attentions for which "auto" takes these kernels over cuDNN's: those
# measured (H100, GPT-2 small's step: head dim 64, T = 1024), and shorter rows, where
# cuDNN's slicing weighs more against its kernel (attention grows as T², the slicing as T).
PACKED_OVER_CUDNN = {"head_dims": (64,), "max_length": 1024}


def packed_auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Where "auto" would hand a packed self-attention (`pallas_packed_attention`'s
    input) to cuDNN, its reason for taking these kernels instead, or None. cuDNN's kernel
    is the faster of the two alone, but it needs q, k and v sliced out of the projection
    and biased (three copies), and their gradients concatenated back (one more): with
    those, the kernels reading the projection in place were faster on an H100 at GPT-2
    small's shape, a plain causal mask at head dim 64 and T = 1024 (the README,
    Measurements behind the code). Other head sizes, and longer rows, where cuDNN's
    kernel gains more, stay with cuDNN until measured."""
    spec = call.spec
    plain_causal = (spec.causal and spec.window is None and spec.kv_lengths is None
                    and spec.q_segment_ids is None and spec.mask is None)
    if (platform.nvidia_gpu and plain_causal and call.dtype in (jnp.bfloat16, jnp.float16)
            and call.head_dim in PACKED_OVER_CUDNN["head_dims"]
            and call.q_len <= PACKED_OVER_CUDNN["max_length"]):
        return ("the fused Pallas kernels read the projection's q, k, v in place; cuDNN "
                "needs them sliced out and biased, and with that counted the kernels were "
                "faster at head dim 64, T <= 1024 (an H100)")
    return None


def _pow2_block(name: str, value: Optional[int], default: int) -> int:
    if value is None:
        return default
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 for implementation='pallas'; "
                         f"got {value!r}")
    return value


# ----------------------------------------------------------------------------- helpers


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _pow2_at_least_16(x: int) -> int:
    return max(16, 1 << (x - 1).bit_length())


def _pad(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_arrays(arrays, tp, sp):
    offset, lengths, q_seg, kv_seg, mask, *ranges = arrays
    if q_seg is not None:
        q_seg, kv_seg = _pad(q_seg, 1, tp), _pad(kv_seg, 1, sp)
    if mask is not None:
        mask = _pad(_pad(mask, 2, tp), 3, sp)
    return offset, lengths, q_seg, kv_seg, mask, *ranges


def _segment_ranges(ids, other_ids, tp: int, sp: int, bq: int, bk: int):
    """[B, tp // bq, 4] int32: for each block of bq rows of `ids` [B, T] (T <= tp), the
    blocks of bk columns of `other_ids` [B, S] (S <= sp) that segment ids let it see, as
    (lo, a, b, hi): blocks outside [lo, hi) share no id with it, and [a, b) are whole
    (every row and column of the tile has one and the same id).

    Queries against keys (the forward and dQ walks) or keys against queries (dK/dV).
    Each block is summed up by its smallest and largest id: two blocks whose id ranges
    do not overlap share no id, and a block pair of one id each, the same, is whole. So
    the answer is exact for any ids (a tile inside [lo, hi) may still see nothing; the
    per-element mask says so), and for packed documents, whose ids form runs, it is
    tight: each query block walks the documents it holds, the tiles inside its own
    document unmasked. Computed on the tile grid, [B, T / bq, S / bk]: no sort, a few
    small fused kernels before the attention ones."""
    int32 = jnp.iinfo(jnp.int32)

    def block_bounds(x, padded: int, block: int):  # [B, padded // block] smallest, largest id
        real = jnp.arange(padded) < x.shape[1]  # rows past T (padding) have no id
        x = _pad(x, 1, padded)
        def blocked(y):
            return y.reshape(y.shape[0], padded // block, block)
        return (blocked(jnp.where(real, x, int32.max)).min(-1),
                blocked(jnp.where(real, x, int32.min)).max(-1))

    q_min, q_max = (y[:, :, None] for y in block_bounds(ids, tp, bq))
    k_min, k_max = (y[:, None, :] for y in block_bounds(other_ids, sp, bk))
    meet = (k_min <= q_max) & (k_max >= q_min)  # [B, nq, nk]
    whole = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
    nk = sp // bk
    j = jnp.arange(nk)
    lo = jnp.min(jnp.where(meet, j, nk), -1)
    hi = jnp.maximum(jnp.max(jnp.where(meet, j + 1, 0), -1), lo)
    a = jnp.min(jnp.where(whole, j, nk), -1)
    b = jnp.max(jnp.where(whole, j + 1, 0), -1)
    # Whole tiles are walked as one range: only where they are one (an id that recurs
    # after another may leave gaps; then every tile is masked).
    one_range = (b > a) & (jnp.sum(whole, -1) == b - a)
    a, b = jnp.where(one_range, a, lo), jnp.where(one_range, b, lo)
    return jnp.stack([lo, a, b, hi], -1).astype(jnp.int32)


def _intersect(ranges, seg_ref):
    """The structure's (lo, a, b, hi) narrowed by segment ids' (`_segment_ranges`, one
    program's four numbers in `seg_ref`); the structure's alone without segment ids."""
    if seg_ref is None:
        return ranges
    lo, a, b, hi = ranges
    lo = jnp.maximum(lo, seg_ref[0])
    hi = jnp.maximum(jnp.minimum(hi, seg_ref[3]), lo)
    a = jnp.clip(jnp.maximum(a, seg_ref[1]), lo, hi)
    b = jnp.clip(jnp.minimum(b, seg_ref[2]), a, hi)
    return lo, a, b, hi


def _div(a, b: int):
    """a // b for a >= 0 (lax.div truncates, which is floor for non-negative a)."""
    return lax.div(a, jnp.int32(b))


def _kv_blocks(st: _Static, bk: int, q_first, q_last, length):
    """Key blocks for queries at positions [q_first, q_last]: (lo, a, b, hi).

    Blocks [lo, hi) hold some visible key; of those, [a, b) are visible entirely and
    need no mask. Query p sees key j when p - left <= j <= p + right and j < length.
    """
    nk = _round_up(st.kv_len, bk) // bk
    lo, hi = jnp.int32(0), jnp.int32(nk)
    full_lo, full_hi = jnp.int32(0), jnp.int32(st.kv_len // bk)  # a partial last block is masked
    if st.right is not None:
        hi = jnp.minimum(hi, _div(jnp.maximum(q_last + st.right + bk, 0), bk))
        full_hi = jnp.minimum(full_hi, _div(jnp.maximum(q_first + st.right + 1, 0), bk))
    if st.left is not None:
        lo = jnp.minimum(_div(jnp.maximum(q_first - st.left, 0), bk), hi)
        full_lo = _div(jnp.maximum(q_last - st.left, 0) + bk - 1, bk)
    if length is not None:
        hi = jnp.minimum(hi, _div(length + bk - 1, bk))
        full_hi = jnp.minimum(full_hi, _div(length, bk))
    return _split(lo, hi, full_lo, full_hi, st.mask_shape is not None)


def _q_blocks(st: _Static, bq: int, nq: int, k_first, k_last, offset, length):
    """Query blocks that can see keys at positions [k_first, k_last]: (lo, a, b, hi).

    Query block i holds positions offset + [i·bq, i·bq + bq). The inverse of
    `_kv_blocks`: a query p sees key j when j - right <= p <= j + left.
    """
    lo, hi = jnp.int32(0), jnp.int32(nq)
    full_lo, full_hi = jnp.int32(0), jnp.int32(nq)
    if st.right is not None:
        lo = jnp.minimum(_div(jnp.maximum(k_first - st.right - offset, 0), bq), hi)
        full_lo = _div(jnp.maximum(k_last - st.right - offset, 0) + bq - 1, bq)
    if st.left is not None:
        hi = jnp.minimum(hi, _div(jnp.maximum(k_last + st.left - offset + bq, 0), bq))
        full_hi = _div(jnp.maximum(k_first + st.left - offset + 1, 0), bq)
    partial = k_last >= st.kv_len  # this key block holds padding keys: every tile masked
    if length is not None:
        hi = jnp.where(k_first >= length, lo, hi)  # every key of the block is padding
        partial = partial | (k_last >= length)
    full_hi = jnp.where(partial, full_lo, full_hi)
    return _split(lo, hi, full_lo, full_hi, st.mask_shape is not None)


def _split(lo, hi, full_lo, full_hi, dense: bool):
    """(lo, a, b, hi): [a, b) the tiles the structure shows whole, none under a dense
    mask (only its values can say). Segment ids narrow them further (`_intersect`)."""
    if dense:
        return lo, hi, hi, hi
    a = jnp.clip(full_lo, lo, hi)
    b = jnp.clip(full_hi, a, hi)
    return lo, a, b, hi


def _visible(st: _Static, q_pos, k_pos, length, q_seg, k_seg, dense):
    """Visibility of a [len(q_pos), len(k_pos)] tile (None if nothing restricts it)."""
    conditions = []
    q, kk = q_pos[:, None], k_pos[None, :]
    if st.right is not None:
        conditions.append(kk <= q + st.right)
    if st.left is not None:
        conditions.append(kk >= q - st.left)
    if st.kv_padded:
        conditions.append(kk < st.kv_len)
    if length is not None:
        conditions.append(kk < length)
    if q_seg is not None:
        conditions.append(q_seg[:, None] == k_seg[None, :])
    if dense is not None:
        conditions.append(dense != 0)
    return functools.reduce(jnp.logical_and, conditions) if conditions else None


def _acc(dtype):
    """Accumulate in float32 at least (float64 stays float64, in interpret mode only)."""
    return jnp.promote_types(dtype, jnp.float32)


def _dot(a, b, trans_b=False):
    """A tile product a·b (a·bᵀ if trans_b) with float32 accumulation; float32 inputs get
    exact float32 products, not TF32."""
    contract = ((1,), (1,)) if trans_b else ((1,), (0,))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=_acc(a.dtype))


def _loop(st: _Static, ranges, body, carry):
    """Visit [lo, a) masked, [a, b) unmasked, [b, hi) masked; body(j, carry, masked).

    Each loop is compiled code, so a call whose mask can never restrict a tile gets one.
    """
    lo, a, b, hi = ranges
    if not st.may_mask:
        return lax.fori_loop(lo, hi, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    return lax.fori_loop(b, hi, functools.partial(body, masked=True), carry)


class _Refs:
    """The optional inputs of a kernel, unpacked by what the call has."""

    def __init__(self, st: _Static, refs):
        refs = list(refs)
        self.offset = refs.pop(0)
        self.lengths = refs.pop(0) if st.has_lengths else None
        self.q_seg = refs.pop(0) if st.has_segments else None
        self.kv_seg = refs.pop(0) if st.has_segments else None
        self.mask = refs.pop(0) if st.mask_shape is not None else None
        self.seg_ranges = refs.pop(0) if st.has_segments else None  # this program's 4
        # A packed call with a bias: the keys' terms b_q·k_j of this program's head, and
        # one [H] row of the bias (v's in the forward and dQ kernels, q's in dK/dV's).
        self.key_term, self.bias = (refs.pop(0), refs.pop(0)) if st.biased else (None, None)
        self.rest = refs


def _scores(q, k, key_term=None):
    """The raw scores q·kᵀ of a [bq, H] and a [bk, H] tile, plus the keys' [bk] bias terms
    b_q·k_j when q has a bias."""
    s = _dot(q, k, trans_b=True)
    if key_term is not None:
        s = s + key_term[None, :]
    return s


def _for_exp2(st: _Static, s):
    """(s, c) with S₂ = c·s, of a tile of raw scores. For a positive scale (any but a
    deliberate one) s stays raw and c = scale·log₂e: the max commutes with c, a mask's
    -inf stays -inf, and `_exp2` applies c in its multiply-add. A scale ≤ 0 would turn a
    masked -inf into +inf or NaN, so there s is scaled first and c = 1."""
    c = st.scale * LOG2_E
    return (s, c) if c > 0 else (s * c, 1.0)


def _exp2(st: _Static, s, c: float, shift):
    """P = exp2(s·c - shift) of a float32 tile s, shift in base-2 units (a row max or L,
    broadcast against s): on Triton one fused multiply-add and one flush-to-zero exp2 a
    score (ptx.py)."""
    return ptx.exp2_fma(s, c, -shift, inline=ptx.lowers_to_triton(st.interpret))


# ----------------------------------------------------------------------------- kernels


class _QueryBlock:
    """What the forward and dQ programs share: program (query block i, batch b, head n)
    holds queries at positions offset[b] + [i·bq, i·bq + bq) and walks the key blocks
    they can see."""

    def __init__(self, st: _Static, r: _Refs, nq: int, bq: int, bk: int):
        self.st, self.r, self.bk = st, r, bk
        i, b = nq - 1 - pl.program_id(0), pl.program_id(1)  # heaviest causal rows first
        offset = r.offset[b]
        self.length = None if r.lengths is None else r.lengths[b]
        self.q_first = offset + i * bq
        self.q_last = offset + jnp.minimum(i * bq + bq, st.q_len) - 1
        self.q_pos = self.q_first + lax.iota(jnp.int32, bq)
        self.q_seg = None if r.q_seg is None else r.q_seg[...]

    def visible(self, j):
        """[bq, bk] visibility of key block j."""
        keys, r = pl.ds(j * self.bk, self.bk), self.r
        return _visible(self.st, self.q_pos, j * self.bk + lax.iota(jnp.int32, self.bk),
                        self.length, self.q_seg, None if r.kv_seg is None else r.kv_seg[keys],
                        None if r.mask is None else r.mask[:, keys])

    def walk(self, tile, carry):
        """carry = tile(j, carry, masked) over the key blocks j these queries can see."""
        ranges = _kv_blocks(self.st, self.bk, self.q_first, self.q_last, self.length)
        return _loop(self.st, _intersect(ranges, self.r.seg_ranges), tile, carry)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, st: _Static, nq: int):
    bk = st.blocks.fwd_k
    r = _Refs(st, refs)
    o_ref, lse_ref = r.rest
    block = _QueryBlock(st, r, nq, st.blocks.fwd_q, bk)
    q = q_ref[...]  # [bq, H]

    def tile(j, carry, masked):
        m, l, acc = carry  # [bq], [bq], [bq, Hv]: the online softmax's state
        keys = pl.ds(j * bk, bk)
        s, c = _for_exp2(st, _scores(q, k_ref[keys, :],
                                     None if r.key_term is None else r.key_term[keys]))
        if masked:
            s = jnp.where(block.visible(j), s, -jnp.inf)
        # The max of S₂ = s·c is c times s's: c > 0, and rounding keeps the order.
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
        # A row with nothing visible yet keeps m = -inf and is shifted by 0 instead. The
        # 0 must not become its running max: a later tile's scores, all far below 0
        # (every visible score under -87 or so), would then underflow exp2 to 0 and the
        # row would read as one that sees no key (output 0, zero gradients).
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = _exp2(st, s, c, shift[:, None])
        rescale = jnp.exp2(m - shift)
        l = l * rescale + jnp.sum(p, axis=1)
        acc = acc * rescale[:, None] + _dot(p.astype(v_ref.dtype), v_ref[keys, :])
        return m_new, l, acc

    rows, acc_t = q.shape[0], _acc(q.dtype)
    init = (jnp.full((rows,), -jnp.inf, acc_t), jnp.zeros((rows,), acc_t),
            jnp.zeros((rows, v_ref.shape[-1]), acc_t))
    m, l, acc = block.walk(tile, init)
    seen = l > 0  # rows with no visible key: output 0, L = +inf (so backward P = 0)
    l = jnp.where(seen, l, 1.0)
    out = acc / l[:, None]
    if r.bias is not None:  # v's bias: the weights of a row that sees a key sum to 1
        out = out + jnp.where(seen[:, None], r.bias[...][None, :].astype(out.dtype), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l), jnp.inf)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static, nq: int):
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    j, b = pl.program_id(0), pl.program_id(1)
    r = _Refs(st, refs)
    offset = r.offset[b]
    length = None if r.lengths is None else r.lengths[b]
    k_pos = j * bk + lax.iota(jnp.int32, bk)
    k, v = k_ref[...], v_ref[...]  # [bk, H], [bk, Hv]: stay in registers
    k_seg = None if r.kv_seg is None else r.kv_seg[...]
    key_term = None if r.key_term is None else r.key_term[...]  # [bk]

    def tile(i, carry, masked):
        dk, dv, ds_sum = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        # Transposed tiles [bk, bq], so that both accumulations are plain products.
        s_t = _dot(k, q, trans_b=True)
        if key_term is not None:
            s_t = s_t + key_term[:, None]
        s_t, c = _for_exp2(st, s_t)
        if masked:
            ok = _visible(st, offset + i * bq + lax.iota(jnp.int32, bq), k_pos, length,
                          None if r.q_seg is None else r.q_seg[rows], k_seg,
                          None if r.mask is None else r.mask[rows, :])
            s_t = jnp.where(ok.T, s_t, -jnp.inf)
        p_t = _exp2(st, s_t, c, lse_ref[rows][None, :])  # the forward's P, transposed
        dv = dv + _dot(p_t.astype(do.dtype), do)
        dp_t = _dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - delta_ref[rows][None, :])
        dk = dk + _dot(ds_t.astype(q.dtype), q)
        if r.bias is not None:  # Σ_i dS_ij, for q's bias's share of dk_j
            ds_sum = ds_sum + jnp.sum(ds_t, axis=1)
        return dk, dv, ds_sum

    acc_t = _acc(k.dtype)
    init = (jnp.zeros(k.shape, acc_t), jnp.zeros(v.shape, acc_t), jnp.zeros(k.shape[:1], acc_t))
    k_last = j * bk + bk - 1
    ranges = _q_blocks(st, bq, nq, j * bk, k_last, offset, length)
    dk, dv, ds_sum = _loop(st, _intersect(ranges, r.seg_ranges), tile, init)
    if r.bias is not None:  # dk_j = Σ_i dS_ij (q_i + b_q)
        dk = dk + ds_sum[:, None] * r.bias[...][None, :].astype(acc_t)
    dk = dk * st.scale  # S = scale · Q Kᵀ
    if st.packed:  # the whole [B, T, 3, N, H] gradient: this program's tiles of slots 1, 2
        # (its outputs come after the dQ kernel's gradient and bias sums, which they alias)
        grad_ref, *bias_refs = r.rest[-2:] if st.biased else r.rest[-1:]
        keys, h = pl.ds(j * bk, bk), pl.program_id(2)
        grad_ref[b, keys, 1, h, :] = dk.astype(grad_ref.dtype)
        grad_ref[b, keys, 2, h, :] = dv.astype(grad_ref.dtype)
        if st.biased:  # the k and v biases' gradients: this block's sums over its real keys
            _store_bias_sums(bias_refs[0], {1: dk, 2: dv}, k_pos < st.kv_len)
        return
    dk_ref, dv_ref = r.rest
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, *refs, st: _Static, nq: int):
    bk = st.blocks.fwd_k
    r = _Refs(st, refs)
    # dq (packed: slot 0 of the whole gradient), D, and with a bias the bias sums' rows.
    dq_ref, delta_ref, *bias_refs = r.rest
    block = _QueryBlock(st, r, nq, st.blocks.fwd_q, bk)
    q, do = q_ref[...], do_ref[...]
    lse = lse_ref[...]
    # D_i = rowsum(dO ∘ O) = Σ_j P_ij dP_ij, the softmax Jacobian's correction term, from
    # the dO tile this program reads anyway; the dK/dV kernel, launched after, reads it.
    # With v's bias, dP pairs with the raw v, so D with O less that bias.
    o = o_ref[...].astype(lse.dtype)
    if r.bias is not None:
        o = o - r.bias[...][None, :].astype(lse.dtype)
    delta = jnp.sum(do.astype(lse.dtype) * o, axis=1)
    delta_ref[...] = delta

    def tile(j, dq, masked):
        keys = pl.ds(j * bk, bk)
        k = k_ref[keys, :]
        s, c = _for_exp2(st, _scores(q, k, None if r.key_term is None else r.key_term[keys]))
        if masked:
            s = jnp.where(block.visible(j), s, -jnp.inf)
        p = _exp2(st, s, c, lse[:, None])
        dp = _dot(do, v_ref[keys, :], trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = block.walk(tile, jnp.zeros(q.shape, _acc(q.dtype))) * st.scale
    dq_ref[...] = dq.astype(dq_ref.dtype)
    if bias_refs:  # the q bias's gradient: this block's sum over its real queries
        rows = (nq - 1 - pl.program_id(0)) * q.shape[0] + lax.iota(jnp.int32, q.shape[0])
        _store_bias_sums(bias_refs[0], {0: dq}, rows < st.q_len)


def _store_bias_sums(ref, tiles, real):
    """A program's row [3, H] of the bias gradient's partial sums: for each slot (q 0, k 1,
    v 2) in `tiles` its [rows, H] accumulator tile summed over the `real` rows (each had
    the bias added), zeros in the others."""
    for slot in range(3):
        tile = tiles.get(slot)
        total = (jnp.zeros(ref.shape[-1:], ref.dtype) if tile is None else
                 jnp.sum(jnp.where(real[:, None], tile, 0.0), axis=0).astype(ref.dtype))
        ref[slot, :] = total


# ----------------------------------------------------------------------------- launches


def _mask_inputs(st: _Static, arrays, q_spec, kv_spec, mask_spec, ranges_spec, backward: bool):
    """The optional inputs and their BlockSpecs, in the order `_Refs` unpacks them;
    `backward`: the dK/dV grid's segment ranges instead of the query blocks'."""
    offset, lengths, q_seg, kv_seg, mask, fwd_ranges, bwd_ranges = arrays
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    inputs, specs = [offset], [whole(offset)]
    if st.has_lengths:
        inputs.append(lengths)
        specs.append(whole(lengths))
    if st.has_segments:
        inputs += [q_seg, kv_seg]
        specs += [q_spec, kv_spec]
    if st.mask_shape is not None:
        inputs.append(mask)
        specs.append(mask_spec)
    if st.has_segments:
        inputs.append(bwd_ranges if backward else fwd_ranges)
        specs.append(ranges_spec)
    return inputs, specs


def _mask_index(st: _Static, b, n):
    """Block index of the dense mask's (batch, head) for program (b, n): 0 where broadcast."""
    mb, mn = st.mask_shape
    return (b if mb > 1 else 0), (n if mn > 1 else 0)


def _query_grid_masks(st: _Static, arrays, bq: int, sp: int, rev):
    """Mask inputs of the forward and dQ grids (query block rev(i), batch b, head h)."""
    return _mask_inputs(
        st, arrays,
        q_spec=pl.BlockSpec((None, bq), lambda i, b, h: (b, rev(i))),
        kv_spec=pl.BlockSpec((None, sp), lambda i, b, h: (b, 0)),
        mask_spec=pl.BlockSpec((None, None, bq, sp),
                               lambda i, b, h: (*_mask_index(st, b, h), rev(i), 0)),
        ranges_spec=pl.BlockSpec((None, None, 4), lambda i, b, h: (b, rev(i), 0)),
        backward=False)


def _head_tile(st: _Static, slot: int, rows: int, width: int, index_map):
    """BlockSpec of one head's [rows, width] tile, index_map(*grid) -> (batch, row block,
    head): of a [B, L, heads, H] array, or in a packed call of slot `slot` (q 0, k 1,
    v 2) of the one [B, L, 3, N, H] array."""
    if not st.packed:
        return pl.BlockSpec((None, rows, None, width), lambda *grid: (*index_map(*grid), 0))

    def packed_map(*grid):
        b, r, h = index_map(*grid)
        return b, r, slot, h, 0
    return pl.BlockSpec((None, rows, None, None, width), packed_map)


def _query_grid_tiles(st: _Static, bq: int, rev, hp: int, sp: int, hvp: int):
    """BlockSpecs of q, k, v on the forward's and dQ's grid (query block rev(i), batch b,
    head h): h's [bq, H] query tile and the whole keys and values of its K/V head."""
    g = st.groups
    return [_head_tile(st, 0, bq, hp, lambda i, b, h: (b, rev(i), h)),
            _head_tile(st, 1, sp, hp, lambda i, b, h: (b, 0, h // g)),
            _head_tile(st, 2, sp, hvp, lambda i, b, h: (b, 0, h // g))]


def _key_term(qkv, bias):
    """[B, N, T]: b_q·k_j, what q's bias adds to every score of key j, in the
    accumulators' precision (a packed call's q's bias; see the module's text)."""
    acc = _acc(qkv.dtype)
    return jnp.einsum("btnh,nh->bnt", qkv[:, :, 1].astype(acc), bias[0].astype(acc),
                      precision=lax.Precision.HIGHEST)


def _bias_inputs(st: _Static, bias, key_term, slot: int, keys):
    """A biased packed call's extra inputs and their BlockSpecs (nothing without a bias):
    its key terms [B, N, T], of which a program (grid (·, b, h)) reads `keys` = (rows,
    index_map(*grid) -> row block) of its batch row and head, and the row of slot `slot`
    of the bias [3, N, H] for its head (v's, 2, on the query grids; q's, 0, on the dK/dV
    grid; a packed call has one K/V head per query head)."""
    if not st.biased:
        return [], []
    rows, block = keys
    return [key_term, bias], [
        pl.BlockSpec((None, None, rows), lambda *grid: (grid[1], grid[2], block(*grid))),
        pl.BlockSpec((None, None, bias.shape[-1]), lambda *grid: (slot, grid[2], 0))]


def _shapes(st: _Static, q, k, v):
    """(B, padded T, N, padded H, padded S, padded Hv) of the kernels' inputs."""
    if st.packed:
        bsz, length, _, n, hp = q.shape
        return bsz, length, n, hp, length, hp
    return (*q.shape, k.shape[1], v.shape[3])


def _params(num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu  # only meaningful when lowering to Triton
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(st: _Static, q, k, v, arrays, out_dtype=None, bias=None, key_term=None):
    """(out, lse); a packed call passes its [B, T, 3, N, H] array as q, k and v (with a
    bias, its `_key_term` too)."""
    bsz, tp, n, hp, sp, hvp = _shapes(st, q, k, v)
    bq = st.blocks.fwd_q
    nq = tp // bq
    rev = lambda i: nq - 1 - i  # noqa: E731  (program 0 takes the last, heaviest causal block)
    inputs, specs = _query_grid_masks(st, arrays, bq, sp, rev)
    bias_inputs, bias_specs = _bias_inputs(st, bias, key_term, 2, (sp, lambda *_: 0))
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, st=st, nq=nq),
        grid=(nq, bsz, n),
        in_specs=[*_query_grid_tiles(st, bq, rev, hp, sp, hvp), *specs, *bias_specs],
        out_specs=[
            pl.BlockSpec((None, bq, None, hvp), lambda i, b, h: (b, rev(i), h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, rev(i)))],
        out_shape=[jax.ShapeDtypeStruct((bsz, tp, n, hvp), out_dtype or q.dtype),
                   jax.ShapeDtypeStruct((bsz, n, tp), _acc(q.dtype))],
        compiler_params=_params(st.blocks.num_warps, st.blocks.num_stages),
        interpret=st.interpret, name="flash_forward",
    )(q, k, v, *inputs, *bias_inputs)
    return out, lse


def _backward(st: _Static, q, k, v, arrays, out, lse, d_out, grad_dtype=None, bias=None,
              key_term=None):
    """dq, dk, dv in grad_dtype (default: the inputs' dtypes); a packed call's (q, k and v
    its one array) gets its gradient as one array of that shape, and with a bias (and
    its `_key_term`) that bias's gradient: (grad, d_bias)."""
    bsz, tp, n, hp, sp, hvp = _shapes(st, q, k, v)
    kh, g = n // st.groups, st.groups
    nk = sp // st.blocks.bwd_k

    # dQ first: one program per query block and head, the forward's loop again. Each also
    # writes its rows' D = rowsum(dO ∘ O) for the dK/dV kernel (no pass of its own).
    bq = st.blocks.fwd_q
    nq = tp // bq
    rev = lambda i: nq - 1 - i  # noqa: E731
    inputs, specs = _query_grid_masks(st, arrays, bq, sp, rev)
    bias_inputs, bias_specs = _bias_inputs(st, bias, key_term, 2, (sp, lambda *_: 0))
    dq_spec = _head_tile(st, 0, bq, hp, lambda i, b, h: (b, rev(i), h))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, rev(i)))
    out_specs = [dq_spec, row_spec]
    out_shape = [jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype),
                 jax.ShapeDtypeStruct((bsz, n, tp), lse.dtype)]
    if st.packed and st.biased:
        # The bias gradient's partial sums, a row [3, H] a program: [B, nk + nq, 3, N, H],
        # the dK/dV programs' k and v sums in rows [0, nk), the dQ programs' q sums after,
        # so that one reduction sums them all.
        out_specs.append(pl.BlockSpec((None, None, 3, None, hp),
                                      lambda i, b, h: (b, nk + rev(i), 0, h, 0)))
        out_shape.append(jax.ShapeDtypeStruct((bsz, nk + nq, 3, n, hp), _acc(q.dtype)))
    dq, delta, *bias_sums = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, nq=nq),
        grid=(nq, bsz, n),
        in_specs=[
            *_query_grid_tiles(st, bq, rev, hp, sp, hvp),
            pl.BlockSpec((None, bq, None, hvp), lambda i, b, h: (b, rev(i), h, 0)),
            row_spec,
            pl.BlockSpec((None, bq, None, hvp), lambda i, b, h: (b, rev(i), h, 0)),
            *specs, *bias_specs],
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params(st.blocks.num_warps, st.blocks.num_stages),
        interpret=st.interpret, name="flash_backward_dq",
    )(q, k, v, d_out, lse, out, *inputs, *bias_inputs)

    # dK, dV: one program per key block and query head. With G > 1 query heads per K/V
    # head, each program writes its head's share in float32 and the G shares are summed.
    bq, bk = st.blocks.bwd_q, st.blocks.bwd_k
    nq = tp // bq
    inputs, specs = _mask_inputs(
        st, arrays,
        q_spec=pl.BlockSpec((None, tp), lambda j, b, h: (b, 0)),
        kv_spec=pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
        mask_spec=pl.BlockSpec((None, None, tp, bk),
                               lambda j, b, h: (*_mask_index(st, b, h), 0, j)),
        ranges_spec=pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0)),
        backward=True)
    bias_inputs, bias_specs = _bias_inputs(st, bias, key_term, 0, (bk, lambda j, b, h: j))
    kv_dtype = grad_dtype or k.dtype
    if st.packed:  # each program stores its tiles of dk and dv into dQ's whole gradient
        out_specs = [pl.BlockSpec(q.shape, lambda *_: (0,) * q.ndim)]
        if st.biased:  # and its row of the bias sums
            out_specs.append(pl.BlockSpec((None, None, 3, None, hp),
                                          lambda j, b, h: (b, j, 0, h, 0)))
        aliased = [dq, *bias_sums]
        out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased]
    else:
        out_specs = [pl.BlockSpec((None, bk, None, hp), lambda j, b, h: (b, j, h, 0)),
                     pl.BlockSpec((None, bk, None, hvp), lambda j, b, h: (b, j, h, 0))]
        out_shape = [jax.ShapeDtypeStruct((bsz, sp, n, width), kv_dtype if g == 1 else _acc(kv_dtype))
                     for width in (hp, hvp)]
        aliased = []
    inputs = [q, k, v, d_out, lse, delta, *inputs, *bias_inputs, *aliased]
    grads = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, nq=nq),
        grid=(nk, bsz, n),
        in_specs=[
            _head_tile(st, 0, tp, hp, lambda j, b, h: (b, 0, h)),
            _head_tile(st, 1, bk, hp, lambda j, b, h: (b, j, h // g)),
            _head_tile(st, 2, bk, hvp, lambda j, b, h: (b, j, h // g)),
            pl.BlockSpec((None, tp, None, hvp), lambda j, b, h: (b, 0, h, 0)),
            pl.BlockSpec((None, None, tp), lambda j, b, h: (b, h, 0)),
            pl.BlockSpec((None, None, tp), lambda j, b, h: (b, h, 0)),
            *specs, *bias_specs, *out_specs[:len(aliased)]],
        out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={len(inputs) - len(aliased) + k: k for k in range(len(aliased))},
        compiler_params=_params(st.blocks.bwd_num_warps, st.blocks.bwd_num_stages),
        interpret=st.interpret, name="flash_backward_dkdv",
    )(*inputs)
    if st.packed:
        # [B, T, 3, N, H]: dq, dk, dv in their slots; with a bias, its gradient [3, N, H]
        # from the programs' sums (in the accumulators' precision, before rounding).
        grad, *bias_sums = grads
        return grad, (bias_sums[0].sum((0, 1)) if st.biased else None)
    dk, dv = grads
    if g > 1:
        dk = dk.reshape(bsz, sp, kh, g, hp).sum(axis=3).astype(grad_dtype or k.dtype)
        dv = dv.reshape(bsz, sp, kh, g, hvp).sum(axis=3).astype(grad_dtype or v.dtype)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, arrays):
    return _forward(st, q, k, v, arrays)[0]


def _flash_fwd(st, q, k, v, arrays):
    out, lse = _forward(st, q, k, v, arrays)
    return out, (q, k, v, arrays, out, lse)


def _flash_bwd(st, residuals, d_out):
    q, k, v, arrays, out, lse = residuals
    dq, dk, dv = _backward(st, q, k, v, arrays, out, lse, d_out)
    # Offsets, lengths, segment ids and masks are integers: they have no gradient.
    return dq, dk, dv, jax.tree.map(lambda _: None, arrays)


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_packed(st, qkv, bias, arrays):
    return _flash_packed_fwd(st, qkv, bias, arrays)[0]


def _flash_packed_fwd(st, qkv, bias, arrays):
    key_term = None if bias is None else _key_term(qkv, bias)
    out, lse = _forward(st, qkv, qkv, qkv, arrays, bias=bias, key_term=key_term)
    return out, (qkv, bias, key_term, arrays, out, lse)


def _flash_packed_bwd(st, residuals, d_out):
    qkv, bias, key_term, arrays, out, lse = residuals
    # The bias was added to every row of q, k and v: its gradient sums theirs over the
    # real rows, which the kernels do as they write them (no second pass through them).
    grad, d_bias = _backward(st, qkv, qkv, qkv, arrays, out, lse, d_out, bias=bias,
                             key_term=key_term)
    return grad, None if bias is None else d_bias.astype(bias.dtype), jax.tree.map(
        lambda _: None, arrays)


_flash_packed.defvjp(_flash_packed_fwd, _flash_packed_bwd)
