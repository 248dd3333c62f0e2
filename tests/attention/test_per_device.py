"""The Pallas kernels under a mesh (per_device.py): split over the batch and head axes the
caller names, each device runs them on its own rows and heads, with the values and
gradients of one device; where nothing divides, the call runs whole and says so; and,
compiled for two H100s on this host, no all-gather of q, k, v is left."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from attention_jax.attention import dot_product_attention, packed_self_attention
from attention_jax.tools.bench import gpu_hlo
from helpers import json_from_cuda_plugin_child


def _mesh():
    return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _grads(loss, args):
    return jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_the_kernels_run_on_each_device_s_rows_and_heads():
    """Cross-attention with every per-row mask array (offsets, key lengths, a dense mask
    per row) and grouped K/V heads, batch over data × heads over tensor."""
    rng = np.random.default_rng(0)
    b, t, s = 8, 24, 32
    q = jnp.asarray(rng.standard_normal((b, t, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, 2, 16)), jnp.float32) for _ in range(2))
    kw = dict(causal=True, q_offset=jnp.asarray(rng.integers(0, s - t + 1, b), jnp.int32),
              kv_lengths=jnp.asarray(rng.integers(t, s + 1, b), jnp.int32),
              mask=jnp.asarray(rng.random((b, 1, t, s)) < 0.8), implementation="pallas")

    def loss(q, k, v, **axes):
        return jnp.sum(jnp.sin(dot_product_attention(q, k, v, **kw, **axes)))

    whole = _grads(loss, (q, k, v))
    with jax.set_mesh(_mesh()):
        split = lambda *a: loss(*a, batch_axes=("data",), head_axes=("tensor",))  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(split)(q, k, v))
        sharded = jax.device_put((q, k, v), NamedSharding(_mesh(), P("data")))
        _close(jax.jit(lambda *a: _grads(split, a))(*sharded), whole)


def test_packed_q_k_v_and_their_bias_split_the_same_way():
    """The bias [3, N, H] is split by heads and whole over the batch: its gradient is the
    sum over every device's rows."""
    rng = np.random.default_rng(1)
    qkv = jnp.asarray(rng.standard_normal((8, 40, 3, 4, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
    ids = jnp.asarray(np.repeat([[0] * 17 + [1] * 23], 8, 0), jnp.int32)

    def loss(qkv, bias, **axes):
        y = packed_self_attention(qkv, bias, causal=True, segment_ids=ids,
                                  implementation="pallas", **axes)
        return jnp.sum(jnp.sin(y))

    whole = _grads(loss, (qkv, bias))
    with jax.set_mesh(_mesh()):
        split = lambda *a: loss(*a, batch_axes=("data",), head_axes=("tensor",))  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(split)(qkv, bias))
        _close(jax.jit(lambda *a: _grads(split, a))(qkv, bias), whole)


def test_what_does_not_divide_runs_whole_and_says_so(caplog):
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((6, 16, 3, 16)), jnp.float32) for _ in range(3))
    whole = dot_product_attention(q, k, v, causal=True, implementation="pallas")
    with jax.set_mesh(_mesh()), caplog.at_level(logging.WARNING):
        # Batch 6 over data=4 and 3 heads over tensor=2: nothing to split by.
        f = lambda q, k, v: dot_product_attention(  # noqa: E731
            q, k, v, causal=True, implementation="pallas", batch_axes=("data",),
            head_axes=("tensor",))
        assert "shard_map" not in str(jax.make_jaxpr(f)(q, k, v))
        np.testing.assert_allclose(jax.jit(f)(q, k, v), whole, rtol=1e-6, atol=1e-6)
        assert "each computes the whole call" in caplog.text
        assert "batch (6,) do not divide over mesh axes ('data',) (4 devices)" in caplog.text
        # Heads that divide still split where the batch does not, and it says which.
        q4, k4, v4 = (jnp.asarray(rng.standard_normal((5, 16, 4, 16)), jnp.float32)
                      for _ in range(3))
        caplog.clear()
        g = lambda q, k, v: dot_product_attention(  # noqa: E731
            q, k, v, causal=True, implementation="pallas", batch_axes=("data",),
            head_axes=("tensor",))
        assert "shard_map" in str(jax.make_jaxpr(g)(q4, k4, v4))
        np.testing.assert_allclose(
            jax.jit(g)(q4, k4, v4),
            dot_product_attention(q4, k4, v4, causal=True, implementation="pallas"),
            rtol=1e-6, atol=1e-6)
        assert "batch (5,) do not divide over mesh axes ('data',)" in caplog.text
        assert "heads" not in caplog.text and "whole call" not in caplog.text
        with pytest.raises(ValueError, match=r"name \['fsdp'\], which the mesh does not have; "
                                             r"its axes: \('data', 'tensor'\)"):
            dot_product_attention(q, k, v, implementation="pallas", batch_axes=("fsdp",))


TWO_H100 = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from attention_jax.attention import compiling_for, dot_product_attention
from attention_jax.tools.bench.gpu_hlo import target_config
topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(),
                                        topology="1x1x2")
mesh = topologies.make_mesh(topology, (2,), ("data",))
rows = NamedSharding(mesh, P("data"))
x = jax.ShapeDtypeStruct((4, 256, 4, 64), jnp.bfloat16, sharding=rows)
ids = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=rows)
found = {}
for name, axes in (("split", ("data",)), ("whole", ())):
    def loss(q, k, v, ids):
        y = dot_product_attention(q, k, v, causal=True, segment_ids=ids,
                                  implementation="pallas", batch_axes=axes)
        return jnp.sum(y.astype(jnp.float32))
    with jax.set_mesh(mesh), compiling_for("gpu"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, ids).compile().as_text()
    found[name] = {"all_gathers": text.count("all-gather-start"),
                   "triton_calls": text.count('custom_call_target="__gpu$xla.gpu.triton"')}
print(json.dumps(found))
"""


@pytest.mark.skipif(gpu_hlo.plugin_path() is None,
                    reason="JAX's CUDA plugin is not installed (make install puts it in "
                           ".venv/gpu-aot)")
def test_compiled_for_two_h100s_the_kernels_gather_nothing():
    """Data-parallel over two H100s (deviceless, JAX's CUDA plugin): split, each GPU runs
    the three kernels on its own rows; whole, XLA gathers q, k, v and the ids first."""
    found = json_from_cuda_plugin_child(TWO_H100)
    assert found["split"] == {"all_gathers": 0, "triton_calls": 3}  # forward, dK/dV, dQ
    assert found["whole"]["all_gathers"] >= 1


def test_splash_splits_the_same_way():
    """JAX's splash kernel (a Pallas kernel for TPUs; interpreted here) likewise."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 128, 2, 16)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.repeat([[0] * 50 + [1] * 78], 8, 0), jnp.int32)

    def loss(q, k, v, **axes):
        y = dot_product_attention(q, k, v, causal=True, segment_ids=ids,
                                  implementation="splash", **axes)
        return jnp.sum(jnp.sin(y))

    whole = _grads(loss, (q, k, v))
    with jax.set_mesh(_mesh()):
        split = lambda *a: loss(*a, batch_axes=("data",), head_axes=("tensor",))  # noqa: E731
        assert "shard_map" in str(jax.make_jaxpr(split)(q, k, v))
        _close(jax.jit(lambda *a: _grads(split, a))(q, k, v), whole)


def test_the_layer_splits_as_the_logical_rules_say():
    """MultiHeadAttention under a mesh and the trainer's logical rules hands the kernels
    the batch's and the heads' mesh axes: they run per device, packed q, k, v included."""
    import flax.linen as nn

    from attention_jax import sharding
    from attention_jax.layers import MultiHeadAttention
    x = jnp.ones((8, 16, 32))
    layer = MultiHeadAttention(num_heads=4, causal=True, implementation="pallas")
    params = layer.init(jax.random.PRNGKey(0), x)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        jaxpr = str(jax.make_jaxpr(lambda p: layer.apply(p, x)[0])(params))
    # qkv [B, T, 3, N, H] and its bias [3, N, H]: the batch over data × fsdp, heads over tensor
    # (and q_offset [B] with the batch)
    assert ("in_specs=(P(('data', 'fsdp'), None, None, 'tensor', None), "
            "P(None, 'tensor', None), P(('data', 'fsdp'),))") in jaxpr
