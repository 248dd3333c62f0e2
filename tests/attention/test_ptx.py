"""attention/ptx.py: the kernels' exponentials, exp2(x·c + a). Off Triton it is jnp's, which
the kernels' float64 tests run; lowering for Triton it is one inline PTX block, and
compiled for an H100 on this host (JAX's CUDA plugin, no GPU) every exponential of the
attention and loss kernels over their tiles is that block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns, json_from_cuda_plugin_child

from attention_jax.attention import ptx
from attention_jax.tools.bench import gpu_hlo


def test_off_triton_it_is_jnp_s_exp2_of_the_multiply_add():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(4, 1)), jnp.float32)  # broadcast along the rows
    got = ptx.exp2_fma(x, 0.18, -a, inline=False)
    np.testing.assert_array_equal(got, jnp.exp2(x * 0.18 - a))
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(got, 2.0 ** (x64 * 0.18 - np.asarray(a, np.float64)), rtol=1e-6)


def test_for_triton_it_is_one_inline_block_with_c_as_ptx_s_literal():
    assert ptx.float32_literal(0.5) == "0f3F000000"
    assert ptx.float32_literal(-2.0) == "0fC0000000"
    x = jnp.zeros((16, 16), jnp.float32)
    traced = jax.make_jaxpr(lambda x, a: ptx.exp2_fma(x, 0.5, a, inline=True))(x, x[:, :1])
    (asm,) = [e for e in traced.jaxpr.eqns if e.primitive.name == "elementwise_inline_asm_p"]
    assert "fma.rn.ftz.f32 t, $1, 0f3F000000, $2" in asm.params["asm"]
    assert "ex2.approx.ftz.f32 $0, t" in asm.params["asm"]
    assert asm.params["constraints"] == "=f,f,f" and asm.params["pack"] == 1
    assert asm.invars[0] is traced.jaxpr.invars[0]  # $1 is x (multiplied by c), $2 is a
    assert asm.invars[1].aval.shape == (16, 16)  # a broadcast to x's shape first


def test_fma_is_one_rounding_on_triton_and_jnp_s_elsewhere(x64):
    a = jnp.asarray([[1.5, -2.0]], jnp.float32)
    b, c = jnp.asarray([[2.0], [3.0]], jnp.float32), jnp.float32(0.25)
    np.testing.assert_array_equal(ptx.fma(a, b, c, inline=False), a * b + c)  # [2, 2]
    a64 = jnp.asarray([1 / 3], jnp.float64)  # float64 (interpret mode only) stays float64
    assert ptx.fma(a64, a64, a64, inline=True).dtype == jnp.float64
    traced = jax.make_jaxpr(lambda a, b, c: ptx.fma(a, b, c, inline=True))(a, b, c)
    (asm,) = [e for e in traced.jaxpr.eqns if e.primitive.name == "elementwise_inline_asm_p"]
    assert asm.params["asm"] == "fma.rn.f32 $0, $1, $2, $3;"
    assert asm.params["constraints"] == "=f,f,f,f"
    assert [v.aval.shape for v in asm.invars] == [(2, 2)] * 3  # broadcast to one shape


def _exponentials(jaxpr):
    """(the out shapes of every exp and exp2, the number of inline asm blocks) in a kernel's
    jaxpr, its loops' bodies and its branches included."""
    eqns = list(all_eqns(jaxpr))
    return ([e.outvars[0].aval.shape for e in eqns if e.primitive.name in ("exp", "exp2")],
            sum(e.primitive.name == "elementwise_inline_asm_p" for e in eqns))


def test_traced_for_a_gpu_no_exponential_over_a_tile_is_left_to_jnp():
    """Traced as for an H100 (no GPU needed to trace), every exponential over a tile of
    scores (2-D) or a chunk of logits (1-D) is ptx.py's block; what jnp still takes is a
    row's rescale (the attention's [rows] vectors, the loss's scalars)."""
    from helpers import pallas_calls

    from attention_jax.attention import compiling_for, packed_self_attention
    from attention_jax.models import loss_kernel

    qkv, bias = jnp.zeros((1, 256, 3, 2, 64), jnp.bfloat16), jnp.zeros((3, 2, 64), jnp.bfloat16)
    z, t, scale = jnp.zeros((4, 5000), jnp.bfloat16), jnp.zeros(4, jnp.int32), jnp.ones(4)

    def attention(qkv, bias):
        y = packed_self_attention(qkv, bias, implementation="pallas", causal=True)
        return jnp.sum(y.astype(jnp.float32))

    def loss(z):
        return loss_kernel.row_statistics_and_gradient(z, t, scale), loss_kernel.row_statistics(
            z, t, sums=False)

    with compiling_for("gpu"):
        traced = [jax.make_jaxpr(jax.grad(attention, argnums=(0, 1)))(qkv, bias),
                  jax.make_jaxpr(loss)(z)]
    kernels = {e.params["name"]: _exponentials(e.params["jaxpr"])
               for j in traced for e in pallas_calls(j.jaxpr)}
    assert set(kernels) == {"flash_forward", "flash_backward_dq", "flash_backward_dkdv",
                            "cross_entropy_gradient", "cross_entropy_statistics"}
    for name, (shapes, blocks) in kernels.items():
        most = 1 if name.startswith("flash_") else 0
        assert blocks > 0 and all(len(shape) <= most for shape in shapes), (name, shapes)


KERNELS = r"""
import json, os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=DUMP").strip()
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from attention_jax.attention import compiling_for, packed_self_attention
from attention_jax.models import loss_kernel
from attention_jax.tools.bench import gpu_hlo
topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_hlo.target_config(),
                                        topology="1x1x1")
whole = NamedSharding(topologies.make_mesh(topology, (1,), ("d",)), P())
shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)
def attention(qkv, bias):
    y = packed_self_attention(qkv, bias, implementation="pallas", causal=True)
    return jnp.sum(y.astype(jnp.float32) ** 2)
def loss(z, t, scale):
    (lse, *_), dz = loss_kernel.row_statistics_and_gradient(z, t, scale)
    return jnp.sum(lse), dz, loss_kernel.row_statistics(z, t, sums=False)[0]
with compiling_for("gpu"):
    jax.jit(jax.grad(attention, argnums=(0, 1))).lower(
        shaped((2, 256, 3, 2, 64), jnp.bfloat16), shaped((3, 2, 64), jnp.bfloat16)).compile()
    jax.jit(loss).lower(shaped((64, 50304), jnp.bfloat16), shaped((64,), jnp.int32),
                        shaped((64,), jnp.float32)).compile()
print(json.dumps({"done": True}))
"""


@pytest.mark.skipif(gpu_hlo.plugin_path() is None,
                    reason="JAX's CUDA plugin is not installed (make install puts it in "
                           ".venv/gpu-aot)")
def test_compiled_for_an_h100_each_tile_exponential_is_one_ffma_and_one_mufu(tmp_path):
    """The packed attention's three kernels (causal, with the projection's bias) and the
    loss's two at GPT-2's vocabulary (twelve chunks, two pieces): what is left of `ex2`
    outside ptx.py's block is a few per row (the online softmax's rescale, once in each
    of the forward's three loops and in each of the loss's loop and pieces), none per
    score or logit. Before ptx.py each exponential was four SASS instructions (the loss's
    libdevice exp seven), and the multiply-add before it two."""
    json_from_cuda_plugin_child(KERNELS.replace("DUMP", str(tmp_path)))
    code = {r["kernel"]: r for r in gpu_hlo.kernel_code(tmp_path)}
    assert set(code) >= {"flash_forward", "flash_backward_dq", "flash_backward_dkdv",
                         "cross_entropy_gradient", "cross_entropy_statistics"}, sorted(code)
    for name, row in code.items():
        if name.startswith(("flash_", "cross_entropy_")):
            assert row["fused_exp2"] >= 16 and row["exp2"] - row["fused_exp2"] <= 4, row
