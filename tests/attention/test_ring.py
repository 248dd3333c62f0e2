"""Ring attention over the `sequence` axis of real meshes of the 8 fake CPU devices:
forward and gradients against the float64 reference, the "auto" choice, errors, and
per-device memory from XLA's memory analysis."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from attention_jax import sharding
from attention_jax.attention import dot_product_attention, explain


def _mesh(sequence, data=1, tensor=1):
    devices = jax.devices()[:data * sequence * tensor]
    return sharding.make_mesh({"data": data, "fsdp": 1, "sequence": sequence, "tensor": tensor},
                              devices)


B, T, N, K, H = 2, 32, 4, 2, 8  # grouped-query heads (G = 2) in every case


def _kwargs(name, rng):
    if name == "causal":
        return dict(causal=True)
    if name == "non-causal":
        return {}
    if name == "padded":  # rows with 5 and 27 real keys: the ring skips padded chunks
        return dict(kv_mask=jnp.asarray(np.arange(T)[None] < np.array([5, 27])[:, None]))
    if name == "kv-lengths-causal":
        return dict(causal=True, kv_lengths=jnp.asarray([19, 32], jnp.int32))
    if name == "packed":  # documents that cross the chunk and device boundaries
        ids = np.sort(rng.integers(0, 4, (B, T)), axis=1)
        return dict(causal=True, segment_ids=jnp.asarray(ids, jnp.int32))
    if name == "window":
        return dict(causal=True, window=6)
    raise KeyError(name)


def _value_and_grads(impl, q, k, v, kw):
    w = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape[-1]), q.dtype)

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, implementation=impl, block_q=2, block_k=2, **kw)
        return jnp.sum(jnp.sin(y) * w), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, grads


def _inputs(dtype=jnp.float64, t=T):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, t, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, t, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, t, K, H)), dtype)
    return q, k, v, rng


def _check(mesh, name, atol=1e-10):
    q, k, v, rng = _inputs()
    kw = _kwargs(name, rng)
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw)
    with jax.set_mesh(mesh):
        y, g = _value_and_grads("ring", q, k, v, kw)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=atol)
    for letter, a, b in zip("qkv", g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"d{letter}")


@pytest.mark.parametrize("sequence", [2, 4, 8])
@pytest.mark.parametrize("name", ["causal", "non-causal", "padded", "packed"])
def test_ring_equals_reference_float64(name, sequence, x64):
    _check(_mesh(sequence), name)


@pytest.mark.parametrize("name", ["kv-lengths-causal", "window"])
def test_ring_other_masks_float64(name, x64):
    _check(_mesh(4), name)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_cross_attention_with_offsets_float64(causal, x64):
    """T = 16 queries against S = 32 keys: causal with a per-row query offset (a prefill
    after cached keys), or cross-attention with separate query/key segment ids."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 16, N, H)))
    k, v = (jnp.asarray(rng.standard_normal((B, 32, K, H))) for _ in range(2))
    if causal:
        kw = dict(causal=True, q_offset=jnp.asarray([16, 10], jnp.int32))
    else:
        kw = dict(q_segment_ids=jnp.asarray(rng.integers(0, 2, (B, 16)), jnp.int32),
                  kv_segment_ids=jnp.asarray(rng.integers(0, 2, (B, 32)), jnp.int32))
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw)
    with jax.set_mesh(_mesh(4)):
        y, g = _value_and_grads("ring", q, k, v, kw)
    for a, b in zip((y, *g), (y_ref, *g_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_ring_with_batch_and_heads_split_too(x64):
    """data=2 × sequence=2 × tensor=2: batch, sequence and K/V heads all split."""
    _check(_mesh(2, data=2, tensor=2), "packed")


def test_ring_float32_close_to_float64(x64):
    q, k, v, rng = _inputs(jnp.float32)
    kw = _kwargs("causal", rng)
    y_ref, g_ref = _value_and_grads("reference", *(x.astype(jnp.float64) for x in (q, k, v)), kw)
    with jax.set_mesh(_mesh(4)):
        y, g = _value_and_grads("ring", q, k, v, kw)
    assert y.dtype == jnp.float32
    for a, b in zip((y, *g), (y_ref, *g_ref)):
        assert float(jnp.linalg.norm(a.astype(jnp.float64) - b) / jnp.linalg.norm(b)) < 1e-5


def test_auto_picks_ring_when_the_sequence_axis_is_split():
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    assert explain(q, kv, kv, causal=True)[0] == "blockwise"  # no mesh
    with jax.set_mesh(_mesh(1)):
        assert explain(q, kv, kv, causal=True)[0] == "blockwise"  # sequence = 1
    with jax.set_mesh(_mesh(4)):
        impl, reason = explain(q, kv, kv, causal=True)
        assert impl == "ring" and "4 devices" in reason
        # What the ring cannot take falls back to the one-device choice, saying why.
        odd = jax.ShapeDtypeStruct((B, 12, N, H), jnp.float32)
        impl, reason = explain(odd, odd, odd)
        assert impl == "blockwise" and "divisible by 2 × mesh.sequence = 8" in reason
        impl, reason = explain(q, kv, kv, mask=jnp.ones((T, T), bool))
        assert impl == "blockwise" and "dense mask" in reason
        assert explain(q, kv, kv, return_weights=True)[0] == "reference"


def test_ring_errors_name_the_argument_and_valid_values():
    q, k, v = jnp.zeros((B, T, N, H)), jnp.zeros((B, T, K, H)), jnp.zeros((B, T, K, H))
    with pytest.raises(ValueError, match=r"implementation='ring' needs a mesh with a 'sequence' "
                                         r"axis.*jax.set_mesh"):
        dot_product_attention(q, k, v, implementation="ring")
    with jax.set_mesh(_mesh(4)):
        with pytest.raises(ValueError, match=r"T \(q's length\)=12 must be divisible by 2 × "
                                             r"mesh.sequence = 8.*valid: multiples of 8"):
            dot_product_attention(q[:, :12], k, v, implementation="ring")
        with pytest.raises(ValueError, match=r"a dense mask"):
            dot_product_attention(q, k, v, implementation="ring", mask=jnp.ones((T, T), bool))


def _ring_grad_temp_bytes(sequence, t):
    """Per-device temp bytes of the compiled forward + backward on `sequence` devices."""
    mesh = _mesh(sequence)
    spec = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    x = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32, sharding=spec)

    def loss(q, k, v):
        return dot_product_attention(q, k, v, causal=True, implementation="ring",
                                     block_q=64, block_k=64).sum()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_per_device_memory_falls_as_one_over_the_sequence_size():
    t = 8192
    temp = {p: _ring_grad_temp_bytes(p, t) for p in (2, 4, 8)}
    # Everything that grows with the sequence is a device's share of it; what stays
    # is the fixed blockwise tile. Halving the share must nearly halve the memory.
    assert temp[4] <= 0.6 * temp[2] and temp[8] <= 0.6 * temp[4], temp
    assert temp[8] <= 0.3 * temp[2], temp


# ----------------------------------------------------------------------------- fused pair kernels
# The ring with the fused kernels on its chunk pairs (ring_inner), interpreted on CPU: the
# Pallas kernels in float64 (exact against the reference), splash in float32 and bfloat16
# (splash tiles are 128 wide, so 2 sequence devices × 2 chunks × 128 = T 512, one head pair).


def _fused_value_and_grads(inner, q, k, v, kw):
    acc = jnp.promote_types(q.dtype, jnp.float32)  # the loss in float32, or float64
    w = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape[-1]), acc)

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, implementation="ring", ring_inner=inner, **kw)
        return jnp.sum(jnp.sin(y.astype(acc)) * w), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


def _reference_float64(q, k, v, kw):
    """The float64 reference's y and grads, as numpy."""
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in (q, k, v)]
        w = jnp.asarray(np.random.default_rng(1).standard_normal(v.shape[-1]), jnp.float32)

        def loss(q, k, v):
            y = dot_product_attention(q, k, v, implementation="reference", **kw)
            return jnp.sum(jnp.sin(y) * w.astype(jnp.float64)), y

        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*f64)
        return [np.asarray(x) for x in (y, *g)]


def _relative_errors(got, want):
    got = [np.asarray(x.astype(jnp.float32), np.float64) for x in got]
    return {name: float(np.linalg.norm(a - b) / np.linalg.norm(b))
            for name, a, b in zip(("y", "dq", "dk", "dv"), got, want)}


@pytest.mark.parametrize("name", ["causal", "non-causal"])
def test_ring_with_pallas_pairs_equals_reference_float64(name, x64):
    """The fused Pallas kernels (interpret mode) on every chunk pair of a 4-device ring,
    backward through their dK/dV and dQ kernels given the merged statistics."""
    q, k, v, rng = _inputs()
    kw = _kwargs(name, rng)
    if name == "causal":  # documents crossing chunks too: segment ids through the kernel
        kw = _kwargs("packed", rng)
    y_ref, g_ref = _value_and_grads("reference", q, k, v, kw)
    with jax.set_mesh(_mesh(4)):
        assert explain(q, k, v, implementation="ring", ring_inner="pallas", **kw)[1] == (
            "asked for; chunk pairs on pallas (ring_inner='pallas' asked for)")
        (_, y), g = _fused_value_and_grads("pallas", q, k, v, kw)
    for letter, a, b in zip(("y", "dq", "dk", "dv"), (y, *g), (y_ref, *g_ref)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=letter)


def _splash_inputs(dtype, t=512, s=None):
    rng = np.random.default_rng(0)
    s = s or t
    shapes = ((1, t, 2, 16), (1, s, 1, 16), (1, s, 1, 16))  # MQA: 2 query heads, 1 K/V head
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes]


SPLASH_CASES = {
    # causal with packed documents that cross the chunk and device boundaries
    "causal-packed": lambda t: dict(causal=True, segment_ids=jnp.asarray(
        np.sort(np.random.default_rng(2).integers(0, 3, (1, t)), axis=1), jnp.int32)),
    # every pair full (one FullMask kernel), right padding: keys past 300 skipped or masked
    "full-lengths": lambda t: dict(kv_lengths=jnp.asarray([300], jnp.int32)),
    # T = 512 queries after 448 cached keys of S = 1024 (chunks of 128 and 256), a causal
    # left window of 300: pair offsets off the chunk grid, several partial masks
    "cross-offset-window": lambda t: dict(causal=True, q_offset=448, window=(300, 0)),
}


@pytest.mark.parametrize("name", list(SPLASH_CASES))
def test_ring_with_splash_pairs_matches_reference_float32(name):
    """JAX's splash kernel (interpret mode) on every chunk pair, its backward kernels given
    the merged statistics; float32 against the float64 reference."""
    q, k, v = _splash_inputs(jnp.float32, s=1024 if name.startswith("cross") else None)
    kw = SPLASH_CASES[name](q.shape[1])
    with jax.set_mesh(_mesh(2)):
        (_, y), g = _fused_value_and_grads("splash", q, k, v, kw)
    assert y.dtype == jnp.float32
    errors = _relative_errors((y, *g), _reference_float64(q, k, v, kw))
    assert max(errors.values()) < 1e-5, errors


def test_ring_with_splash_pairs_runs_with_x64_on(x64):
    """With jax_enable_x64 on (float32 inputs), splash's index maps divided an int32 grid
    index by an int64 Python int on the ring's pairs too (a TypeError at the pair offset
    off the chunk grid): the pairs' forward and backward now trace with 64-bit types off."""
    q, k, v = _splash_inputs(jnp.float32, s=1024)
    kw = SPLASH_CASES["cross-offset-window"](q.shape[1])
    with jax.set_mesh(_mesh(2)):
        (_, y), g = _fused_value_and_grads("splash", q, k, v, kw)
    assert y.dtype == jnp.float32
    errors = _relative_errors((y, *g), _reference_float64(q, k, v, kw))
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("inner", ["splash", "pallas"])
def test_ring_bfloat16_with_fused_pairs_close_to_reference(inner):
    """bfloat16 through the ring: each pair's output and gradients rounded to bfloat16 by
    the kernel, merged in float32; relative error at bfloat16's resolution (2^-8)."""
    t, sequence = (512, 2) if inner == "splash" else (64, 4)
    q, k, v = _splash_inputs(jnp.bfloat16, t)
    kw = SPLASH_CASES["causal-packed"](t)
    with jax.set_mesh(_mesh(sequence)):
        (_, y), g = _fused_value_and_grads(inner, q, k, v, kw)
    assert y.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in g)
    errors = _relative_errors((y, *g), _reference_float64(q, k, v, kw))
    assert max(errors.values()) < 1.5e-2, errors


def test_explain_names_the_ring_pair_kernel_per_platform():
    x = jax.ShapeDtypeStruct((1, 1024, 2, 16), jnp.bfloat16)
    short = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.bfloat16)
    with jax.set_mesh(_mesh(4)):
        impl, reason = explain(x, x, x, causal=True, backend="gpu")
        assert impl == "ring" and reason.endswith(
            "chunk pairs on pallas (the fused Pallas kernels on an NVIDIA GPU)")
        assert explain(x, x, x, causal=True, backend="tpu")[1].endswith(
            "chunk pairs on splash (JAX's splash kernel on a TPU)")
        # Chunks of 64 / 8 = 8 tokens: splash refuses, auto takes blockwise and says why.
        assert "chunk pairs on blockwise (not splash: ring_inner='splash' needs chunks of " \
               "T / (2 × mesh.sequence) = 8 tokens to be a multiple of 128" in explain(
                   short, short, short, causal=True, backend="tpu")[1]
        assert explain(x, x, x, causal=True, backend="cpu")[1].endswith(
            "chunk pairs on blockwise (backend 'cpu' has no fused kernel (pallas and splash "
            "run interpreted here, for tests: ring_inner=...))")
        # An explicit pair kernel that cannot run: one sentence, naming what is valid.
        with pytest.raises(ValueError, match=r"^ring_inner='splash' needs chunks of T / \(2 × "
                                             r"mesh.sequence\) = 8 tokens to be a multiple of "
                                             r"128 .*T a multiple of 1024, or use 'blockwise'"):
            explain(short, short, short, implementation="ring", ring_inner="splash")
        with pytest.raises(ValueError, match=r"^ring_inner='splash' needs q_offset as a Python"):
            explain(x, x, x, implementation="ring", ring_inner="splash",
                    q_offset=jnp.zeros((1,), jnp.int32))
        with pytest.raises(ValueError, match=r"^ring_inner='pallas' runs on NVIDIA GPUs"):
            explain(x, x, x, implementation="ring", ring_inner="pallas", backend="tpu")
    with pytest.raises(ValueError, match=r"^ring_inner must be one of \('auto', 'pallas', "
                                         r"'splash', 'blockwise'\); got 'flash'"):
        explain(x, x, x, ring_inner="flash")


# ----------------------------------------------------------------------------- GPU / TPU
# The compiled kernels inside the ring, on whatever devices the machine has (one device: a
# ring of one, which still runs every chunk pair through the pair kernel). Never run in
# the sessions that wrote them (no GPU or TPU there).


def _compiled_ring_check(backend_kernel, t_per_chunk):
    p = max(d for d in (1, 2, 4, 8) if d <= jax.device_count())
    t = 2 * p * t_per_chunk
    q, k, v = (jnp.asarray(x) for x in _splash_inputs(jnp.float32, t))
    kw = SPLASH_CASES["causal-packed"](t)
    with jax.set_mesh(_mesh(p)):
        reason = explain(q, k, v, implementation="ring", **kw)[1]
        assert f"chunk pairs on {backend_kernel}" in reason, reason
        with jax.default_matmul_precision("highest"):
            y_ref, g_ref = _value_and_grads("reference", q, k, v, kw)
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
            (_, y), g = _fused_value_and_grads("auto", *(x.astype(dtype) for x in (q, k, v)), kw)
            for a, b in zip((y, *g), (y_ref, *g_ref)):
                err = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)
                assert float(err) < tol, (dtype, float(err))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_ring_with_compiled_pallas_pairs_on_a_gpu():
    _compiled_ring_check("pallas", 512)


@pytest.mark.tpu
def test_ring_with_compiled_splash_pairs_on_a_tpu():
    _compiled_ring_check("splash", 512)


def _pair_kernel_grids(inner, t, **kw):
    """The grids of the Pallas calls a 2-device ring's forward traces (no compile)."""
    x = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    with jax.set_mesh(_mesh(2)):
        jaxpr = jax.make_jaxpr(lambda q: dot_product_attention(
            q, q, q, implementation="ring", ring_inner=inner, **kw))(x)
    return set(re.findall(r"grid=\(([^)]*)\)", str(jaxpr)))


def test_ring_pair_kernels_take_the_tiles_asked_for():
    """block_q / block_k reach the fused pair kernels (fewer, larger tiles per chunk), and
    a size the pair kernel cannot take is one sentence naming the argument."""
    # pallas: chunks of 128 / 4 = 32 queries, 16-row tiles on CPU by default.
    assert _pair_kernel_grids("pallas", 128) == {"2, 1, 2"}
    assert _pair_kernel_grids("pallas", 128, block_q=32) == {"1, 1, 2"}
    # splash: chunks of 1024 / 4 = 256, 128-wide tiles on CPU by default.
    assert _pair_kernel_grids("splash", 1024) == {"2, 2, 2"}
    assert _pair_kernel_grids("splash", 1024, block_q=256, block_k=256) == {"2, 1, 1"}
    x = jax.ShapeDtypeStruct((1, 1024, 2, 16), jnp.float32)
    with jax.set_mesh(_mesh(2)):
        with pytest.raises(ValueError, match=r"^block_q=24 must be a power of two >= 16 for "
                                             r"ring_inner='pallas'"):
            explain(x, x, x, implementation="ring", ring_inner="pallas", block_q=24)
        with pytest.raises(ValueError, match=r"^block_k=512 must be a multiple of 128 that "
                                             r"divides the chunk of 256 tokens for "
                                             r"ring_inner='splash'"):
            explain(x, x, x, implementation="ring", ring_inner="splash", block_k=512)
        # "auto" on a TPU passes splash over for a tile it cannot take, and says so.
        assert "chunk pairs on blockwise (not splash: block_q=64 must be a multiple" in explain(
            x, x, x, block_q=64, backend="tpu")[1]


def test_explain_says_ring_inner_is_unused_off_the_ring():
    """ring_inner is not refused where the ring does not run (models pass theirs to every
    call, the reference's for the weights too), but explain() says it goes unused."""
    x = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    assert explain(x, x, x, implementation="blockwise", ring_inner="pallas") == (
        "blockwise", "asked for; ring_inner='pallas' unused (only 'ring' reads it)")
    impl, reason = explain(x, x, x, causal=True, ring_inner="splash", backend="cpu")
    assert impl == "blockwise" and reason.endswith("; ring_inner='splash' unused (only 'ring' "
                                                   "reads it)"), reason
    assert "unused" not in explain(x, x, x, implementation="blockwise")[1]
    with jax.set_mesh(_mesh(2)):
        assert "unused" not in explain(x, x, x, ring_inner="blockwise")[1]
