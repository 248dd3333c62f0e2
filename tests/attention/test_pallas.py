"""The fused Pallas kernels (interpret mode on CPU) against the float64 reference on the
whole mask matrix, key lengths on every path, and what `auto` picks on each backend."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.attention import dot_product_attention, explain
from tests.attention.test_attention import CASES, Case, _inputs, _value_and_grads

# Pallas tiles are powers of two >= 16 (the interpret-mode default is 16 × 16), so the
# cases' own tile sizes are dropped; "aligned" cases hit the path where no tile needs a
# mask at all, which the odd lengths above never do.
PALLAS_CASES = [dataclasses.replace(c, block_q=None, block_k=None) for c in CASES] + [
    Case("aligned", t=32, s=48, block_q=None, block_k=None),
    Case("aligned-causal-gqa", t=48, s=48, n=4, k=2, causal=True, block_q=None, block_k=None),
    Case("aligned-tiles-32", t=64, s=64, causal=True, block_q=32, block_k=16),
    # Id 0 recurs after id 1: not runs the kernels can narrow to, every tile is masked.
    Case("recurring-ids", t=64, s=64, causal=True, segments=(36, 12, 16), block_q=None,
         block_k=None),
    # Packed long documents (ids 1, 2, then 0 as padding; reversed in row 2): most 16 × 16
    # tiles lie inside one document (visited unmasked), some straddle two.
    Case("long-documents", t=64, s=64, causal=True, segments=(37, 16, 11),
         segment_order=(1, 2, 0), block_q=None, block_k=None),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", PALLAS_CASES, ids=lambda c: c.name)
def test_pallas_equals_reference_float64(case, x64):
    (q, k, v), kw = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw, case)
    y, g = _value_and_grads("pallas", q, k, v, kw, case)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"d{name}")


@pytest.mark.parametrize("case", PALLAS_CASES[1::4], ids=lambda c: c.name)
def test_pallas_float32_close_to_float64_reference(case, x64):
    (q, k, v), kw = _inputs(case, jnp.float32)
    (q64, k64, v64), _ = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads("reference", q64, k64, v64, kw, case)
    y, g = _value_and_grads("pallas", q, k, v, kw, case)
    assert y.dtype == jnp.float32
    for a, b in zip((y, *g), (y_ref, *g_ref)):
        assert float(jnp.linalg.norm(a.astype(jnp.float64) - b) / jnp.linalg.norm(b)) < 1e-5


def test_pallas_bfloat16_close_to_float32():
    case = Case("bf16", t=40, s=40, h=32, hv=32, causal=True, block_q=None, block_k=None)
    (q, k, v), kw = _inputs(case, jnp.float32)
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw, case)
    y, g = _value_and_grads("pallas", *(x.astype(jnp.bfloat16) for x in (q, k, v)), kw, case)
    assert y.dtype == jnp.bfloat16
    for a, b in zip((y, *g), (y_ref, *g_ref)):
        assert float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)) < 2e-2


@pytest.mark.parametrize("scale", [-0.25, 0.0, -1.0])
def test_a_scale_of_zero_or_below_equals_the_reference(scale, x64):
    """The kernels take the row max of the raw scores and apply the scale in their
    exponent's multiply-add, which holds for a positive scale only: for one of zero or
    below (uniform weights, or reversed) they scale first. Causal (masked -inf scores)
    and scores spread wide (a reversed max would overflow exp2)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 16)) * 3, jnp.float64)
               for _ in range(3))

    def run(impl):
        def loss(q, k, v):
            y = dot_product_attention(q, k, v, causal=True, scale=scale, implementation=impl)
            return jnp.sum(jnp.sin(y)), y
        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return y, g

    (y, g), (y_ref, g_ref) = run("pallas"), run("reference")
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    for name, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"d{name}")


def test_rows_whose_scores_are_all_far_below_zero_after_a_hidden_tile():
    """A row whose first key tile is hidden from it (a causal left window: rows 19..31
    see nothing of keys 0..15) and whose visible scores all lie near -100 is a softmax
    like any other. The forward once kept 0 as such a row's running max after the hidden
    tile, so exp2 of every later score underflowed: output 0 and zero gradients."""
    rng = np.random.default_rng(0)
    w = np.zeros(16)
    w[0] = 10.0
    q = jnp.asarray(-w + 0.3 * rng.standard_normal((1, 32, 1, 16)), jnp.float32)
    k = jnp.asarray(w + 0.3 * rng.standard_normal((1, 32, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 32, 1, 16)), jnp.float32)

    def run(impl):
        def loss(q, k, v):
            y = dot_product_attention(q, k, v, causal=True, window=(3, 0), scale=1.0,
                                      block_q=16, block_k=16, implementation=impl)
            return jnp.sum(y * v[:, ::-1]), y
        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return y, g

    (y, g), (y_ref, g_ref) = run("pallas"), run("reference")
    for name, a, b in zip(("y", "dq", "dk", "dv"), (y, *g), (y_ref, *g_ref)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5, name


@pytest.mark.parametrize("impl", ["reference", "blockwise", "pallas", "xla"])
def test_kv_lengths_equal_a_prefix_kv_mask(impl):
    """Right padding given as lengths (what cuDNN takes) is the same mask as kv_mask."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 20, 2, 8)), jnp.float32) for _ in range(3))
    lengths = jnp.array([20, 7, 0])
    kv_mask = jnp.arange(20)[None, :] < lengths[:, None]

    def run(**mask):
        def loss(q, k, v):
            y = dot_product_attention(q, k, v, causal=True, implementation=impl, **mask)
            return jnp.sum(jnp.sin(y)), y
        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return y, g

    y_len, g_len = run(kv_lengths=lengths)
    y_mask, g_mask = run(kv_mask=kv_mask)
    assert float(jnp.abs(y_len[2]).max()) == 0.0  # no real key: zero, not NaN
    for a, b in zip((y_len, *g_len), (y_mask, *g_mask)):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_pallas_fully_masked_rows_are_zero_with_zero_gradients():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 4)), jnp.float32) for _ in range(3))
    kv_mask = jnp.asarray(np.array([[True] * 9, [False] * 9]))

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, kv_mask=kv_mask, implementation="pallas")
        return jnp.sum(y ** 2), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert float(jnp.abs(y[1]).max()) == 0.0 and float(jnp.abs(y[0]).max()) > 0
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g[1]).max()) == 0.0


def test_pallas_memory_grows_linearly():
    """Compiled temp memory of the kernels' forward and gradient is O(T), not O(T²)."""
    def temp(n, grad):
        x = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)
        def forward(q, k, v):
            return dot_product_attention(q, k, v, causal=True, implementation="pallas")

        fn = jax.grad(lambda *a: forward(*a).sum(), argnums=(0, 1, 2)) if grad else forward
        return jax.jit(fn).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    for grad in (False, True):
        small, large = temp(512, grad), temp(1024, grad)
        assert large <= 2.2 * small, (grad, small, large)
        assert large < 1024 * 1024 * 4  # one float32 score matrix would already be 4 MiB


# ----------------------------------------------------------------------------- auto


def _spec(t=64, s=64, n=8, k=8, h=64, dtype=jnp.bfloat16, b=2):
    return (jax.ShapeDtypeStruct((b, t, n, h), dtype), jax.ShapeDtypeStruct((b, s, k, h), dtype),
            jax.ShapeDtypeStruct((b, s, k, h), dtype))


IDS = jax.ShapeDtypeStruct((2, 64), jnp.int32)


@pytest.mark.parametrize("shapes, kwargs, chosen", [
    (_spec(), dict(causal=True), "cudnn"),
    (_spec(k=2), dict(causal=True), "cudnn"),  # GQA natively
    (_spec(), dict(kv_lengths=jax.ShapeDtypeStruct((2,), jnp.int32)), "cudnn"),
    (_spec(), dict(causal=True, window=(16, 0)), "cudnn"),
    (_spec(), dict(causal=True, segment_ids=IDS), "pallas"),
    (_spec(), dict(kv_mask=jax.ShapeDtypeStruct((2, 64), jnp.bool_)), "pallas"),
    (_spec(), dict(window=(16, 4)), "pallas"),
    (_spec(t=1), dict(causal=True, q_offset=63), "pallas"),
    (_spec(dtype=jnp.float32), dict(causal=True), "pallas"),
    (_spec(h=256), dict(causal=True), "pallas"),
    (_spec(t=32), dict(causal=True), "pallas"),  # causal cross-attention
    (_spec(), dict(mask=jax.ShapeDtypeStruct((2, 1, 64, 64), jnp.bool_)), "pallas"),
    (_spec(dtype=jnp.float64), dict(causal=True), "blockwise"),
    (_spec(), dict(return_weights=True), "reference"),
])
def test_auto_on_a_gpu_never_builds_a_dense_mask(shapes, kwargs, chosen, x64):
    impl, reason = explain(*shapes, backend="gpu", **kwargs)
    assert impl == chosen, reason
    assert reason


def test_auto_on_cpu_is_blockwise_and_explain_checks_arguments():
    assert explain(*_spec(), causal=True)[0] == "blockwise"
    with pytest.raises(ValueError, match="segment_ids is for self-attention"):
        explain(*_spec(t=32), segment_ids=IDS)
    with pytest.raises(ValueError, match="implementation='cudnn' needs an NVIDIA GPU"):
        explain(*_spec(), implementation="cudnn")


@pytest.mark.parametrize("kwargs, message", [
    (dict(implementation="pallas", block_q=24), r"block_q must be a power of two >= 16"),
    (dict(implementation="pallas", block_k=8), r"block_k must be a power of two >= 16"),
    (dict(kv_lengths=jnp.zeros((3,), jnp.int32)), r"kv_lengths must be an int array of shape \[B\]=\[2\]"),
])
def test_bad_pallas_arguments(kwargs, message):
    q, k = jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 10, 2, 16))
    with pytest.raises(ValueError, match=message):
        dot_product_attention(q, k, k, **kwargs)


def test_auto_on_a_gpu_passes_the_kernels_over_for_tiles_they_cannot_take():
    """The tile rule was checked only where the kernels' tiles were made: on a GPU, auto
    took the kernels for block_q=8 (explain said so) and the call then failed on it."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float32)
    assert explain(q, q, q, causal=True, backend="gpu")[0] == "pallas"
    name, reason = explain(q, q, q, causal=True, block_q=8, block_k=8, backend="gpu")
    assert name == "blockwise"
    assert "not pallas: block_q must be a power of two >= 16" in reason, reason
    # explain's values are checked as the call's are (traced, a length past S passed)
    x = jnp.ones((2, 4, 1, 8))
    with pytest.raises(ValueError, match=r"^kv_lengths: 99 is not a length of the S=4 keys"):
        explain(x, x, x, kv_lengths=np.array([99, 2]))
    assert explain(jax.ShapeDtypeStruct(x.shape, x.dtype), x, x,
                   kv_lengths=np.array([3, 2]))[0] == "blockwise"


def test_tiles_given_within_reach_the_kernels_and_end_with_it():
    """pallas.tiles (bench gpu-hlo --pallas-tiles compiles a whole step with them): the
    kernels traced within take the tiles given (a row of 64 in query blocks of 32, where
    the CPU's default is 16), compute the same, and the defaults are back after; a bad
    value or name is said with the valid ones."""
    from helpers import pallas_calls

    from attention_jax.attention import pallas
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 16)), jnp.float32)

    def grids():  # a new function each time: JAX caches a trace by the function
        attend = lambda q: dot_product_attention(q, q, q, implementation="pallas", causal=True)
        return [e.params["grid_mapping"].grid[0] for e in
                pallas_calls(jax.make_jaxpr(jax.grad(lambda q: attend(q).sum()))(q).jaxpr)]
    with pallas.tiles(fwd_q=32, bwd_k=32):
        assert pallas.kernel_block_sizes(16, jnp.float32).fwd_q == 32
        inside = grids()
        y = dot_product_attention(q, q, q, implementation="pallas", causal=True)
    assert inside == [64 // 32, 64 // 32, 64 // 32] and grids() == [64 // 16] * 3
    np.testing.assert_allclose(
        y, dot_product_attention(q, q, q, implementation="pallas", causal=True), rtol=1e-5,
        atol=1e-6)
    for bad, says in (({"fwd_q": 48}, "fwd_q=48; valid: a power of two >= 16"),
                      ({"num_warps": 0}, "num_warps=0; valid: a power of two >= 1"),
                      ({"bwd_num_warps": 6}, "bwd_num_warps=6; valid: a power of two >= 1"),
                      ({"num_stages": 0}, "num_stages=0; valid: an int >= 1"),
                      ({"warps": 4}, "warps=...: not a tile setting; valid: fwd_q, ")):
        with pytest.raises((ValueError, TypeError), match=re.escape(says)):
            with pallas.tiles(**bad):
                pass


def test_short_rows_take_smaller_forward_tiles_on_a_gpu():
    """On a GPU, bfloat16 rows of at most SHORT_ROWS at H <= 64 take 64 x 64 forward and
    dQ tiles in 4 warps (measured faster at GPT-2's T = 1024 on an H200); longer rows, an
    unknown length and H = 128 keep 128 x 64 in 8 warps. The layer's packed q, k, v at
    T = 1024 traced for a GPU launches T / 64 query blocks a (batch row, head); within
    `tiles`, what is given still wins."""
    from helpers import pallas_calls

    from attention_jax.attention import compiling_for, packed_self_attention, pallas
    sizes = lambda h, t: pallas.kernel_block_sizes(h, jnp.bfloat16, "gpu", length=t)  # noqa: E731
    launch = lambda b: (b.fwd_q, b.fwd_k, b.num_warps, b.bwd_q, b.bwd_k, b.bwd_num_warps)  # noqa: E731
    assert launch(sizes(64, 1024)) == launch(sizes(32, 200)) == (64, 64, 4, 64, 64, 4)
    assert launch(sizes(64, 2048)) == launch(sizes(64, None)) == (128, 64, 8, 64, 64, 4)
    assert launch(sizes(128, 1024)) == (128, 64, 8, 64, 128, 8)
    with pallas.tiles(fwd_q=128, num_warps=8):
        assert launch(sizes(64, 1024))[:3] == (128, 64, 8)
    qkv = jax.ShapeDtypeStruct((2, 1024, 3, 2, 64), jnp.bfloat16)
    with compiling_for("gpu"):
        traced = jax.make_jaxpr(lambda x: packed_self_attention(
            x, implementation="pallas", causal=True))(qkv)
    assert [e.params["grid_mapping"].grid for e in pallas_calls(traced.jaxpr)] == [(16, 2, 2)]


def test_pallas_refuses_float64_on_a_gpu(x64):
    with pytest.raises(ValueError, match="implementation='pallas' takes float16, bfloat16 or float32"):
        explain(*_spec(dtype=jnp.float64), implementation="pallas", backend="gpu")


# ----------------------------------------------------------------------------- GPU
# The long-documents case at the GPU's tiles (128 × 64): whole tiles inside a document.
LONG_DOCUMENTS_GPU = dataclasses.replace(PALLAS_CASES[-1], name="long-documents-512", t=512,
                                         s=512, segments=(288, 96, 128))
RECURRING_IDS_GPU = dataclasses.replace(PALLAS_CASES[-2], name="recurring-ids-512", t=512,
                                        s=512, segments=(288, 96, 128))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", PALLAS_CASES[::4] + [LONG_DOCUMENTS_GPU, RECURRING_IDS_GPU],
                         ids=lambda c: c.name)
def test_pallas_on_gpu_equals_reference(case):
    """The Triton-compiled kernels, bf16 and f32, against the float32 reference."""
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
        (q, k, v), kw = _inputs(dataclasses.replace(case, h=64, hv=64), jnp.float32)
        with jax.default_matmul_precision("highest"):
            y_ref, g_ref = _value_and_grads("reference", q, k, v, kw, case)
        y, g = _value_and_grads("pallas", *(x.astype(dtype) for x in (q, k, v)), kw, case)
        for a, b in zip((y, *g), (y_ref, *g_ref)):
            err = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.maximum(jnp.linalg.norm(b), 1e-6)
            assert float(err) < tol


def test_segment_ranges_narrow_each_block_to_its_documents():
    """The key blocks each 16-row query block walks, from packed documents' ids: never
    one holding a key the block can see outside [lo, hi), only tiles of one shared id
    in [a, b), and for packed documents the tiles inside one document found whole; a
    row whose ids recur falls back to masked tiles, still covering every visible key."""
    from attention_jax.attention.pallas import _segment_ranges
    packed = np.repeat([1, 2, 0], [40, 20, 4])  # two documents, then padding
    recurring = np.repeat([1, 2, 1], [40, 20, 4])
    for t in (64, 40):  # 40: rows past T (padding to whole blocks) widen nothing
        ids = np.stack([packed, recurring])
        got = np.asarray(_segment_ranges(jnp.asarray(ids[:, :t], jnp.int32),
                                         jnp.asarray(ids, jnp.int32), 64, 64, 16, 16))
        for row in range(2):
            for i, (lo, a, b, hi) in enumerate(got[row]):
                assert lo <= a <= b <= hi
                q_ids = ids[row, i * 16:min(i * 16 + 16, t)]
                seen = np.flatnonzero(np.isin(ids[row], q_ids)) // 16
                assert seen.size == 0 or (lo <= seen.min() and seen.max() < hi), (row, i)
                for j in range(a, b):
                    assert set(q_ids) == set(ids[row, j * 16:j * 16 + 16]) and len(set(q_ids)) == 1
        # Packed: query blocks 0 and 1 (document 1) walk key blocks 0-1 whole.
        np.testing.assert_array_equal(got[0][:2, 1:3], [[0, 2], [0, 2]])
        if t == 64:  # block 2 holds two documents (masked), as does block 3 (document 2
            # and padding, whose id 0 spans the range of document 1's: walked, masked)
            np.testing.assert_array_equal(got[0][2:], [[0, 0, 0, 4], [0, 0, 0, 4]])
        else:  # rows 32-39 are document 1's (whole again); block 3 is padding only
            np.testing.assert_array_equal(got[0][2:], [[0, 0, 2, 4], [4, 4, 4, 4]])
