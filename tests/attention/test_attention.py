"""The attention primitive: blockwise against the float64 reference, the lectures'
properties, masked rows, low precision, memory, and errors on bad input."""

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.attention import BackendRefusedError, dot_product_attention, explain
from attention_jax.attention.call import make_call


@dataclasses.dataclass
class Case:
    """One attention problem; `kwargs(rng)` builds the mask arguments for it."""

    name: str
    b: int = 2
    t: int = 19
    s: int = 19
    n: int = 4
    k: int = 4
    h: int = 8
    hv: int = 8
    causal: bool = False
    window: object = None
    offset: object = 0  # int, or "per-row" for a [B] array
    padding: bool = False  # kv_mask with a different number of real keys per row
    segments: object = False  # packed sequences: True (short, random) or runs' lengths
    segment_order: tuple = (0, 1, 0, 2, 3)  # the ids of those runs (an id may recur)
    dense: bool = False  # an unstructured [B, 1, T, S] mask
    scale: object = None  # None: the default 1/sqrt(H)
    block_q: int = 8
    block_k: int = 8

    def kwargs(self, rng):
        kw = dict(causal=self.causal, window=self.window, scale=self.scale)
        if self.offset == "per-row":
            kw["q_offset"] = jnp.asarray(rng.integers(0, self.s - self.t + 1, self.b), jnp.int32)
        else:
            kw["q_offset"] = self.offset
        if self.padding:
            lengths = rng.integers(1, self.s + 1, self.b)
            kw["kv_mask"] = jnp.asarray(np.arange(self.s)[None, :] < lengths[:, None])
        if isinstance(self.segments, tuple):  # runs of ids segment_order, row 2 reversed
            runs = np.repeat(np.array(self.segment_order)[:len(self.segments)], self.segments)
            kw["segment_ids"] = jnp.asarray(np.stack([runs, runs[::-1]]), jnp.int32)
        elif self.segments:
            ids = np.sort(rng.integers(0, 3, (self.b, self.t)), axis=1)
            kw["segment_ids"] = jnp.asarray(ids, jnp.int32)
        if self.dense:
            kw["mask"] = jnp.asarray(rng.random((self.b, 1, self.t, self.s)) < 0.7)
        return kw


CASES = [
    Case("full"),
    Case("causal", causal=True),
    Case("odd-lengths", t=37, s=37, block_q=16, block_k=8),
    Case("odd-causal", t=37, s=37, causal=True, block_q=8, block_k=16),
    Case("cross", t=13, s=29, block_q=4, block_k=8),
    Case("gqa-custom-scale", n=6, k=2, causal=True, scale=0.7),
    Case("mqa", n=4, k=1, t=21, s=21),
    Case("value-dim", hv=5, t=11, s=17),
    Case("padding", t=17, s=23, padding=True),
    Case("padding-causal", t=23, s=23, padding=True, causal=True),
    Case("window", t=33, s=33, window=(5, 3)),
    Case("window-causal", t=33, s=33, window=4, causal=True, block_q=4, block_k=4),
    Case("offset", t=9, s=30, offset=21, causal=True, block_q=4, block_k=8),
    Case("offset-per-row", t=5, s=26, offset="per-row", causal=True, block_q=2, block_k=4),
    Case("offset-window", t=7, s=40, offset="per-row", causal=True, window=6, block_k=4),
    Case("segments", t=31, s=31, segments=True, causal=True),
    Case("segments-padding", t=24, s=24, segments=True, padding=True),
    Case("dense-mask", t=14, s=18, dense=True, n=4, k=2),
    Case("single-block", t=5, s=7, block_q=64, block_k=64),
]


def _inputs(case, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.b, case.t, case.n, case.h))
    k = rng.standard_normal((case.b, case.s, case.k, case.h))
    v = rng.standard_normal((case.b, case.s, case.k, case.hv))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype)), case.kwargs(rng)


def _value_and_grads(impl, q, k, v, kw, case):
    # A fixed random projection of the output, so every output element gets a distinct
    # cotangent (a plain sum would hide errors that cancel across the row).
    w = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape[-1]), q.dtype)

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, implementation=impl, block_q=case.block_q,
                                  block_k=case.block_k, **kw)
        return jnp.sum(jnp.sin(y) * w), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_blockwise_equals_reference_float64(case, x64):
    (q, k, v), kw = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw, case)
    y_blk, g_blk = _value_and_grads("blockwise", q, k, v, kw, case)
    np.testing.assert_allclose(y_blk, y_ref, rtol=0, atol=1e-10)
    for name, a, b in zip("qkv", g_blk, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize("case", CASES[::3], ids=lambda c: c.name)
def test_blockwise_equals_reference_float32(case, x64):
    (q, k, v), kw = _inputs(case, jnp.float32)
    (q64, k64, v64), _ = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads("reference", q64, k64, v64, kw, case)
    y_blk, g_blk = _value_and_grads("blockwise", q, k, v, kw, case)
    assert y_blk.dtype == jnp.float32

    def rel(a, b):
        return float(jnp.linalg.norm(a.astype(jnp.float64) - b) / jnp.linalg.norm(b))

    assert rel(y_blk, y_ref) < 1e-5
    for a, b in zip(g_blk, g_ref):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("case", [CASES[1], CASES[8], CASES[13]], ids=lambda c: c.name)
def test_xla_path_equals_reference(case):
    (q, k, v), kw = _inputs(case, jnp.float32)
    y_ref = dot_product_attention(q, k, v, implementation="reference", **kw)
    y_xla = dot_product_attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_allclose(y_xla, y_ref, atol=2e-5)


def test_float64_is_computed_in_float64_or_refused_by_name(x64):
    """implementation="xla" ran float64 through jax.nn, whose softmax is float32: float64
    out, ~1e-7 from the float64 formula. "auto" (blockwise here) keeps float64's
    precision, and an explicit "xla" or "cudnn" is refused, by explain() too."""
    case = CASES[1]  # causal
    (q, k, v), kw = _inputs(case, jnp.float64)
    y_ref = dot_product_attention(q, k, v, implementation="reference", **kw)
    assert y_ref.dtype == jnp.float64
    # jax.nn's own path: float64's tolerance below fails it, so the refusal is needed.
    y_jax_nn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert np.abs(np.asarray(y_jax_nn) - np.asarray(y_ref)).max() > 1e-9
    assert explain(q, k, v, **kw)[0] == "blockwise"
    y = dot_product_attention(q, k, v, **kw)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-12)
    message = (r"^implementation='xla' cannot compute float64: jax.nn.dot_product_attention "
               r"computes its softmax in float32 .* Valid for float64: 'auto', 'reference', "
               r"'blockwise', 'pallas'")
    with pytest.raises(BackendRefusedError, match=message):
        dot_product_attention(q, k, v, implementation="xla", **kw)
    with pytest.raises(BackendRefusedError, match=message):
        explain(q, k, v, implementation="xla", **kw)
    # On a GPU: cuDNN refused by name, auto past it and past Triton's pallas, to blockwise.
    with pytest.raises(BackendRefusedError, match=r"^implementation='cudnn' cannot compute "
                                                  r"float64: .* 'blockwise'(?!, )"):
        explain(q, k, v, implementation="cudnn", backend="gpu", **kw)
    # cuDNN's own reason (its fused kernel takes float16/bfloat16 only, float32 neither),
    # not the XLA path's float32 softmax, which is not what stops cuDNN.
    with pytest.raises(BackendRefusedError) as refused:
        explain(q, k, v, implementation="cudnn", backend="gpu", **kw)
    assert "float16/bfloat16" in str(refused.value), refused.value
    assert "softmax in float32" not in str(refused.value), refused.value
    impl, reason = explain(q, k, v, backend="gpu", **kw)
    assert impl == "blockwise" and "not cudnn: implementation='cudnn' cannot compute float64" \
        in reason, reason
    # float32 is unchanged: still jax.nn's path.
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert explain(q32, k32, v32, implementation="xla", **kw) == ("xla", "asked for")


def test_reference_weights_are_a_distribution():
    (q, k, v), kw = _inputs(Case("w", causal=True, padding=True), jnp.float32)
    y, a = dot_product_attention(q, k, v, return_weights=True, **kw)
    assert a.shape == (2, 4, 19, 19)
    assert float(a.min()) >= 0
    visible_rows = a.sum(-1)
    assert np.all((np.abs(visible_rows - 1) < 1e-5) | (visible_rows == 0))
    causal_part = np.triu(np.ones((19, 19), bool), k=1)
    assert float(jnp.abs(a[:, :, causal_part]).max()) == 0.0  # nothing from the future
    # Y = AV, per head.
    np.testing.assert_allclose(jnp.einsum("BNTS,BSNH->BTNH", a, v), y, atol=1e-5)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_self_attention_is_permutation_equivariant(impl):
    """Without positions, permuting the tokens permutes the outputs the same way."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 23, 4, 8)), jnp.float32)
    perm = rng.permutation(23)
    attend = lambda x: dot_product_attention(x, x, x, implementation=impl, block_q=8, block_k=8)
    np.testing.assert_allclose(attend(x[:, perm]), attend(x)[:, perm], atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_causal_output_ignores_the_future(impl):
    """Changing tokens after position i leaves outputs 0..i unchanged, and changes later ones."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 20, 2, 8)), jnp.float32) for _ in range(3))
    i = 11
    k2 = k.at[:, i + 1:].set(jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.float32))
    v2 = v.at[:, i + 1:].add(1.0)
    f = lambda k, v: dot_product_attention(q, k, v, causal=True, implementation=impl,
                                           block_q=4, block_k=4)
    y, y2 = f(k, v), f(k2, v2)
    np.testing.assert_array_equal(y[:, : i + 1], y2[:, : i + 1])
    assert float(jnp.abs(y[:, i + 1:] - y2[:, i + 1:]).min()) > 0


def test_scaling_keeps_score_variance_near_one():
    """For unit-variance q, k, q·k has variance H; dividing by √H brings it back to 1."""
    for h in (16, 64, 256):
        kq, kk = jax.random.split(jax.random.key(h))
        q = jax.random.normal(kq, (4, 64, 4, h))
        k = jax.random.normal(kk, (4, 64, 4, h))
        raw = jnp.einsum("BTNH,BSNH->BNTS", q, k)
        assert abs(float(jnp.var(raw)) / h - 1) < 0.1
        assert abs(float(jnp.var(raw / np.sqrt(h))) - 1) < 0.1


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla"])
def test_fully_masked_rows_are_zero_with_finite_gradients(impl):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 4)), jnp.float32) for _ in range(3))
    kv_mask = jnp.asarray(np.array([[True] * 9, [False] * 9]))  # row 1 sees nothing

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, kv_mask=kv_mask, implementation=impl,
                                  block_q=4, block_k=4)
        return jnp.sum(y ** 2), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert float(jnp.abs(y[1]).max()) == 0.0
    assert float(jnp.abs(y[0]).max()) > 0
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g)))
        assert float(jnp.abs(g[1]).max()) == 0.0


def test_window_before_any_key_gives_zero_rows():
    """Queries whose window reaches no key (a window behind the cache start) are empty."""
    q = jnp.ones((1, 4, 1, 4))
    kv = jnp.ones((1, 8, 1, 4))
    for impl in ("reference", "blockwise"):
        y = dot_product_attention(q, kv, kv, window=(0, 1), q_offset=-6, implementation=impl,
                                  block_q=2, block_k=2)
        # positions -6..-3 see keys up to -5..-2: none exist.
        assert float(jnp.abs(y).max()) == 0.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_close_to_float32(dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 70, 4, 48)).astype(np.float32) for _ in range(3))
    ref = dot_product_attention(*(jnp.asarray(x) for x in (q, k, v)), causal=True,
                                implementation="reference")
    y = dot_product_attention(*(jnp.asarray(x, dtype) for x in (q, k, v)), causal=True,
                              implementation="blockwise", block_q=16, block_k=32)
    assert y.dtype == dtype
    err = jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert float(err) <= 1e-2
    # The backward in half precision on this backend too, with GQA, against the float32
    # reference. Default blocks (one tile here): XLA:CPU once failed on a bf16 dot of
    # that program ("Unsupported element type for DotThunk").
    kv = jnp.asarray(k[:, :, :2])

    def g(q, kv, impl):
        return jax.grad(lambda q, kv: (dot_product_attention(
            q, kv, kv, causal=True, implementation=impl).astype(jnp.float32) ** 2).sum(),
            (0, 1))(q, kv)

    g16 = g(jnp.asarray(q, dtype), kv.astype(dtype), "blockwise")
    g32 = g(jnp.asarray(q), kv, "reference")
    for a, b in zip(g16, g32):
        assert float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)) <= 2e-2


# ----------------------------------------------------------------------------- memory


def _temp_bytes(fn, n):
    x = jax.ShapeDtypeStruct((1, n, 4, 32), jnp.float32)
    return jax.jit(fn).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_memory_grows_linearly_for_blockwise_and_quadratically_for_reference(causal):
    def forward(impl):
        return lambda q, k, v: dot_product_attention(q, k, v, causal=causal, implementation=impl,
                                                     block_q=128, block_k=128)

    def gradient(impl):
        return jax.grad(lambda q, k, v: forward(impl)(q, k, v).sum(), argnums=(0, 1, 2))

    for make in (forward, gradient):
        blk = [_temp_bytes(make("blockwise"), n) for n in (1024, 2048, 4096)]
        ref = [_temp_bytes(make("reference"), n) for n in (1024, 2048)]
        assert blk[2] <= 2.2 * blk[1] and blk[1] <= 2.2 * blk[0], (make.__name__, blk)
        assert ref[1] >= 3.5 * ref[0], (make.__name__, ref)
        assert blk[1] * 10 < ref[1], (make.__name__, blk, ref)


# ----------------------------------------------------------------------------- bad input


def _ok():
    return jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 10, 2, 16)), jnp.zeros((2, 10, 2, 16))


@pytest.mark.parametrize("implementation", ["reference", "xla", "blockwise"])
def test_a_window_wider_than_int32_reaches_is_no_window(implementation):
    """window=2**31 - 1, a common "unlimited": added to int32 positions it wrapped to
    negative, and keys it should keep were masked (every backend's values two-sided,
    blockwise's gradients as a causal left window); 2**31 was an OverflowError."""
    r = np.random.RandomState(0)
    q, k, v = (jnp.asarray(r.randn(1, 8, 1, 4), jnp.float32) for _ in range(3))
    tiles = dict(block_q=2, block_k=2) if implementation == "blockwise" else {}

    def values_and_grads(**kw):
        f = lambda q, k, v: dot_product_attention(q, k, v, implementation=implementation,
                                                  **tiles, **kw)
        return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(q, k, v)

    big = 2 ** 31 - 1
    for wide, plain in ((dict(window=(big - 4, big - 4)), {}),
                        (dict(causal=True, window=(big, 0)), dict(causal=True)),
                        (dict(causal=True, window=(2 ** 31, 0)), dict(causal=True))):
        got, want = values_and_grads(**wide), values_and_grads(**plain)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=str(wide))


def test_int64_segment_ids_past_int32_are_refused_not_wrapped():
    """Hashed document ids as int64: 2**32 read as 0, the two documents merged into one
    with nothing said."""
    q = jnp.zeros((1, 4, 1, 4))
    ids = np.array([[0, 0, 2 ** 32, 2 ** 32]], np.int64)
    with pytest.raises(ValueError, match=r"^segment_ids holds 4294967296, no int32 id; "
                                         r"valid: -2147483647\.\.2147483647 \(renumber"):
        dot_product_attention(q, q, q, segment_ids=ids)
    with pytest.raises(ValueError, match=r"^kv_segment_ids holds -2147483648, no int32 id"):
        dot_product_attention(q, q, q, q_segment_ids=np.zeros((1, 4), np.int64),
                              kv_segment_ids=np.array([[0, 0, 0, -2 ** 31]]))
    small = np.array([[0, 0, 7, 7]], np.int64)  # int64 within int32: taken as it is
    np.testing.assert_array_equal(dot_product_attention(q, q, q, segment_ids=small),
                                  dot_product_attention(q, q, q, segment_ids=small.astype(np.int32)))


def test_the_rows_cudnn_is_asked_to_zero_are_those_the_mask_leaves_without_a_key():
    """The structural path (jax.nn's own causal, lengths and left-window arguments, as
    cuDNN takes them) zeroes the rows with no visible key, whose jax.nn output is the mean
    of v. It zeroed only rows of no real key: with a causal left window, query t sees
    nothing once t - L reaches the row's length (row 0 below from query 5 on)."""
    from attention_jax.attention import jax_nn
    from attention_jax.attention.call import make_call
    from attention_jax.attention.masks import dense_mask
    x = jnp.zeros((3, 8, 2, 8), jnp.bfloat16)
    lengths = jnp.array([3, 8, 0])
    for kw in (dict(causal=True, window=(2, 0)), dict(causal=True, window=(0, 0)),
               dict(causal=True), dict(causal=False), dict(causal=True, window=(9, 0))):
        call = make_call(x, x, x, kv_lengths=lengths, **kw)
        want = np.asarray(dense_mask(call.spec, 3, 2, 2, 8, 8)).any(-1)[:, 0]  # [B, T]
        np.testing.assert_array_equal(jax_nn.rows_with_keys(call), want, err_msg=str(kw))
    call = make_call(x, x, x, kv_lengths=lengths, causal=True, window=(2, 0))
    assert np.asarray(jax_nn.rows_with_keys(call))[0].tolist() == [True] * 5 + [False] * 3


@pytest.mark.parametrize("head_dim", [48, 64])
def test_blockwise_bfloat16_is_as_exact_as_the_reference_whatever_the_scale(head_dim):
    """In bfloat16, Q·(1/sqrt(48)) rounded back to bfloat16 added 2^-9 to every score:
    blockwise's error against float64 was twice the reference's (which scales the float32
    scores). 1/8 (head dim 64) is exact in any dtype and still folds into Q."""
    r = np.random.RandomState(0)
    q, k, v = (jnp.asarray(r.randn(2, 64, 4, head_dim) * s, jnp.bfloat16)
               for s in (2.5, 2.5, 1.0))
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    e = np.einsum("btnh,bsnh->bnts", q64, k64) / np.sqrt(head_dim)
    e = np.where(np.tril(np.ones((64, 64), bool)), e, -np.inf)
    a = np.exp(e - e.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", a / a.sum(-1, keepdims=True), v64)
    err = {impl: np.abs(np.asarray(dot_product_attention(q, k, v, causal=True,
                                                         implementation=impl),
                                   np.float64) - want).mean()
           for impl in ("reference", "blockwise")}
    assert err["blockwise"] <= 1.25 * err["reference"], err


def test_compiling_for_a_gpu_lowers_attention_as_on_one():
    """Inside compiling_for("gpu") (an H100's step compiled on a CPU host, bench gpu-hlo)
    attention chooses and lowers as on an NVIDIA GPU: auto picks cuDNN for plain causal
    bfloat16 and the Pallas kernels with segment ids, and those kernels lower for Triton,
    not interpreted; outside, and after an error inside, this process's CPU again."""
    from attention_jax.attention import compiling_for, default_block_sizes, pallas
    from attention_jax.attention.masks import MaskSpec
    q, k, v = (jnp.zeros((2, 128, 4, 64), jnp.bfloat16) for _ in range(3))
    ids = jnp.ones((2, 128), jnp.int32)
    spec = MaskSpec(causal=True)
    assert explain(q, k, v, causal=True)[0] == "blockwise"
    assert pallas._prepare(q, k, v, spec, 0.125, None, None)[0].interpret
    with compiling_for("gpu"):
        assert explain(q, k, v, causal=True)[0] == "cudnn"
        assert explain(q, k, v, causal=True, segment_ids=ids)[0] == "pallas"
        assert not pallas._prepare(q, k, v, spec, 0.125, None, None)[0].interpret
        assert default_block_sizes() == (1024, 1024)
        with compiling_for("cpu"):  # nested: the innermost holds
            assert explain(q, k, v, causal=True)[0] == "blockwise"
        assert explain(q, k, v, causal=True)[0] == "cudnn"
    with pytest.raises(RuntimeError), compiling_for("gpu"):
        raise RuntimeError("a lowering failed")
    assert explain(q, k, v, causal=True)[0] == "blockwise"
    assert pallas._prepare(q, k, v, spec, 0.125, None, None)[0].interpret
    with pytest.raises(ValueError, match=r"compiling_for\('cuda'\); valid: \('cpu', 'gpu', 'tpu'\)"):
        with compiling_for("cuda"):
            pass


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q[0], k, v), r"q must have rank 4 \(\[B, T, N, H\]\); got shape \(8, 4, 16\)"),
    (lambda q, k, v: (q.tolist(), k, v), r"^q must be an array \(jax or numpy\) of rank 4; got a list$"),
    (lambda q, k, v: (q, k[:1], v), r"batch sizes differ"),
    (lambda q, k, v: (q, k, v[:, :9]), r"k and v need the same length S"),
    (lambda q, k, v: (q, k[..., :8], v), r"same head dim H"),
    (lambda q, k, v: (q[:, :, :3], k, v), r"K=2 heads, which must divide q's N=3 heads; valid K: \[1, 3\]"),
    (lambda q, k, v: (q.astype(jnp.bfloat16), k, v), r"must share one dtype.*bfloat16"),
    (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)),
     r"floating point"),
])
def test_bad_shapes_and_dtypes(change, message):
    with pytest.raises(ValueError, match=message):
        dot_product_attention(*change(*_ok()))


def test_a_value_head_dim_jax_nn_cannot_take_is_refused_by_name():
    """Hv != H reached jax.nn and failed inside it ("value shape should be ..."), where
    the other backends take it."""
    q, k, v = _ok()
    v = v[..., :8]
    with pytest.raises(BackendRefusedError, match=r"^implementation='xla': v's head dim Hv=8 "
                                                  r"differs from q's and k's H=16, which "
                                                  r"jax.nn.dot_product_attention cannot take"):
        dot_product_attention(q, k, v, implementation="xla")
    np.testing.assert_allclose(dot_product_attention(q, k, v),
                               dot_product_attention(q, k, v, implementation="reference"),
                               atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_q=0), r"block_q must be a positive int; got 0"),
    (dict(block_k=-4), r"block_k must be a positive int; got -4"),
    (dict(implementation="flash"), r"implementation='flash' is unknown; valid: \('auto'"),
    (dict(implementation="cudnn"), r"implementation='cudnn' needs an NVIDIA GPU; this backend is 'cpu'"),
    (dict(implementation="blockwise", return_weights=True), r"return_weights=True needs implementation='reference'"),
    (dict(window=-1), r"window must be a non-negative int"),
    (dict(window=(1, 2, 3)), r"window must be"),
    (dict(q_offset=jnp.zeros(3, jnp.int32)), r"q_offset must be an int or an int array of shape \[B\]=\[2\]"),
    (dict(kv_mask=jnp.ones((2, 8), bool)), r"kv_mask must be a bool array of shape \[B, S\]=\[2, 10\]"),
    (dict(segment_ids=jnp.zeros((2, 8), jnp.int32)), r"segment_ids is for self-attention \(T == S\)"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), r"must be given together"),
    (dict(mask=jnp.ones((2, 4, 8, 9), bool)), r"mask must broadcast to \[B, N, T, S\]=\[2, 4, 8, 10\]"),
    # the shape as given, not padded to rank 4
    (dict(mask=jnp.ones((8, 9), bool)), r"=\[2, 4, 8, 10\]; got \(8, 9\)$"),
    (dict(mask=jnp.ones((8, 10))), r"mask must be boolean"),
    (dict(scale=float("nan")), r"scale must be a finite number"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dot_product_attention(*_ok(), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=2.5), r"window must be a non-negative int .*; got 2\.5$"),
    (dict(window=jnp.array(3)), r"window must be a non-negative int .*not a float, bool or array\); got Array\(3"),
    (dict(window=True), r"window must be a non-negative int .*; got True$"),
    (dict(window=(2, 1.0)), r"window must be a non-negative int .*; got \(2, 1\.0\)$"),
    (dict(window="3"), r"window must be .*; got '3'$"),
    (dict(scale="a"), r"scale must be a finite number .* or None for 1/sqrt\(head_dim\); got 'a'$"),
    (dict(scale=True), r"scale must be a finite number .*; got True$"),
    (dict(scale=[0.5]), r"scale must be a finite number .*; got \[0\.5\]$"),
])
def test_window_and_scale_of_the_wrong_type(kwargs, message):
    """Each names the argument and what is valid (was: an unrelated TypeError, a bool
    taken as window 1, float()'s message without the argument's name)."""
    with pytest.raises(ValueError, match=message):
        dot_product_attention(*_ok(), **kwargs)


def test_a_backend_that_cannot_run_the_call_is_a_user_error():
    """The command line says a request's mistake in one line (UserError) and keeps the
    traceback for a bug: a ring or splash choice that cannot run was a traceback."""
    from attention_jax.errors import UserError
    with pytest.raises(BackendRefusedError, match=r"implementation='cudnn' needs an NVIDIA GPU") as e:
        dot_product_attention(*_ok(), implementation="cudnn")
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    with pytest.raises(BackendRefusedError, match=r"implementation='ring' needs a mesh"):
        dot_product_attention(*_ok(), implementation="ring")


def test_a_traced_causal_names_the_argument():
    """Under jit, a causal passed as an argument was JAX's TracerBoolConversionError."""
    run = jax.jit(lambda causal: dot_product_attention(*_ok(), causal=causal))
    with pytest.raises(ValueError, match=r"causal must be a Python bool .* static_argnames"):
        run(True)


def test_window_and_scale_of_numpy_types_are_accepted():
    q, k, v = _ok()
    a = dot_product_attention(q, k, v, window=np.int64(2), scale=np.float32(0.5))
    b = dot_product_attention(q, k, v, window=(2, 2), scale=0.5)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_explain_takes_the_arguments_of_dot_product_attention():
    """One signature: explain forwards its keywords to make_call, which
    dot_product_attention's keywords (and their defaults) mirror."""
    def keywords(fn):
        return {name: p.default for name, p in inspect.signature(fn).parameters.items()
                if p.kind == p.KEYWORD_ONLY}

    # batch_axes / head_axes say how a call runs under a mesh, not what runs: explain
    # takes them and passes over them.
    assert keywords(dot_product_attention) == {**keywords(make_call), "implementation": "auto",
                                               "batch_axes": (), "head_axes": ()}
    q, k, v = _ok()
    cpu = ("blockwise", "backend 'cpu': the portable lax.scan kernel")
    assert explain(q, k, v, scale=0.5, block_q=16, window=2, q_offset=np.int64(3)) == cpu
    assert explain(q, k, v, causal=True, batch_axes=("data",)) == explain(q, k, v, causal=True)
    assert explain(q, k, v, causal=True, backend="tpu")[0] == "blockwise"
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['causel'\]; valid: "
                                        r"dot_product_attention's \('causal'"):
        explain(q, k, v, causel=True)
    with pytest.raises(ValueError, match=r"backend='cuda' is unknown; valid: 'cpu', 'gpu', 'tpu'"):
        explain(q, k, v, backend="cuda")
    # What the call would refuse, explain refuses too.
    with pytest.raises(ValueError, match=r"return_weights=True needs implementation='reference' "
                                         r"\(or 'auto'\); got 'xla'"):
        explain(q, k, v, implementation="xla", return_weights=True)
    with pytest.raises(ValueError, match=r"block_q must be a positive int; got 0"):
        explain(q, k, v, block_q=0)


def test_values_that_would_silently_change_the_result_are_named():
    """causal="False" ran a causal attention (bool of a non-empty string), and kv_lengths
    past S counted keys that are not there; both now name the argument."""
    q, k, v = _ok()
    for bad in ("False", "no", 1, None):
        with pytest.raises(ValueError, match=rf"causal must be a Python bool, True or False; "
                                             rf"got {re.escape(repr(bad))}"):
            dot_product_attention(q, k, v, causal=bad)
    dot_product_attention(q, k, v, causal=np.bool_(True))  # NumPy's bool is a bool
    # return_weights="no" returned (y, weights); a q_offset past int32 an OverflowError.
    with pytest.raises(ValueError, match=r"return_weights must be a Python bool, True or "
                                         r"False; got 'no'"):
        dot_product_attention(q, k, v, return_weights="no")
    with pytest.raises(ValueError, match=r"q_offset=2147483648 is out of range; valid: "
                                         r"-536870912\.\.536870912 \(positions are int32"):
        dot_product_attention(q, k, v, q_offset=2 ** 31)
    # As an int64 array (numpy's default), one per row: it wrapped, 2**32 + 3 read as 3.
    with pytest.raises(ValueError, match=r"^q_offset holds 4294967299, out of range"):
        dot_product_attention(q, k, v, q_offset=np.array([2 ** 32 + 3, 0]))
    with pytest.raises(ValueError, match=r"^q_offset holds 4294967295, out of range"):
        dot_product_attention(q, k, v, q_offset=np.array([2 ** 32 - 1, 0], np.uint32))
    with pytest.raises(ValueError, match=r"^q_offset holds 1099511627776, out of range"):
        dot_product_attention(q, k, v, q_offset=[2 ** 40, 0])  # (an OverflowError)
    # Within int32 but near its end: the positions q_offset + i wrapped (all-zero rows).
    with pytest.raises(ValueError, match=r"^q_offset holds 2147483646, out of range"):
        dot_product_attention(q, k, v, q_offset=jnp.full((q.shape[0],), 2 ** 31 - 2))
    # An empty batch or head dim: ZeroDivisionErrors from the blocking and the scale.
    with pytest.raises(ValueError, match=r"^empty batch: q \(0, "):
        dot_product_attention(q[:0], k[:0], v[:0])
    with pytest.raises(ValueError, match=r"^empty heads: q "):
        dot_product_attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(ValueError, match=r"kv_lengths: 11 is not a length of the S=10 keys; "
                                         r"valid: 0..10"):
        dot_product_attention(q, k, v, kv_lengths=jnp.array([11, 4]))
    with pytest.raises(ValueError, match=r"kv_lengths: -1 is not a length"):
        dot_product_attention(q, k, v, kv_lengths=np.array([-1, 4]))
    # Traced lengths cannot be checked: they run as before.
    jax.jit(lambda n: dot_product_attention(q, k, v, kv_lengths=n))(jnp.array([10, 4]))
