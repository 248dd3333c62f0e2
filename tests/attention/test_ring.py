"""Ring attention over the `sequence` axis of real meshes of the 8 fake CPU devices:
forward and gradients against the float64 reference, the "auto" choice, errors, and
per-device memory from XLA's memory analysis."""

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
