"""Self-attention from one projection's [B, T, 3, N, H] output (`packed_self_attention`):
the Pallas kernels reading q, k, v in place with the bias folded into their algebra, and
writing the gradient as one array, against the float64 reference on q + bias[0],
k + bias[1], v + bias[2]."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pallas_calls

from attention_jax.attention import (compiling_for, dot_product_attention, explain_packed,
                                     packed_self_attention, pallas, reads_packed)
from tests.attention.test_attention import Case

# Self-attention cases (T == S, K == N, Hv == H): lengths and head dims the kernels pad
# (19, 37, H = 8 -> 16), every kind of mask, and whole tiles (64, long documents).
CASES = [
    Case("causal-padded", t=19, s=19, causal=True, block_q=None, block_k=None),
    Case("full-odd", t=37, s=37, block_q=None, block_k=None),
    Case("window", t=33, s=33, window=(5, 3), block_q=None, block_k=None),
    Case("padding-causal", t=23, s=23, padding=True, causal=True, block_q=None, block_k=None),
    Case("dense-mask", t=14, s=14, dense=True, block_q=None, block_k=None),
    Case("long-documents", t=64, s=64, causal=True, segments=(37, 16, 11),
         segment_order=(1, 2, 0), block_q=None, block_k=None),
    Case("tiles-32x16", t=64, s=64, causal=True, segments=True, block_q=32, block_k=16),
]


def _inputs(case, dtype, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((case.b, case.t, 3, case.n, case.h)), dtype)
    b = jnp.asarray(rng.standard_normal((3, case.n, case.h)), dtype) if bias else None
    kw = case.kwargs(rng)
    kw.pop("q_offset")  # self-attention from one projection starts at position 0
    return qkv, b, kw


def _value_and_grads(attend, qkv, bias, case):
    w = jnp.asarray(np.random.default_rng(1).standard_normal(case.h), qkv.dtype)

    def loss(qkv, bias):
        y = attend(qkv, bias)
        return jnp.sum(jnp.sin(y) * w), y

    argnums = (0, 1) if bias is not None else 0
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(qkv, bias)
    return y, jax.tree.leaves(grads)


def _packed(kw, case, implementation="pallas"):
    return lambda qkv, bias: packed_self_attention(
        qkv, bias, implementation=implementation, block_q=case.block_q, block_k=case.block_k,
        **kw)


def _unpacked(kw, implementation="reference"):
    def attend(qkv, bias):
        x = qkv if bias is None else qkv + bias
        return dot_product_attention(x[:, :, 0], x[:, :, 1], x[:, :, 2],
                                     implementation=implementation, **kw)
    return attend


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_packed_kernels_equal_the_reference_float64(case, x64):
    qkv, bias, kw = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads(_unpacked(kw), qkv, bias, case)
    y, g = _value_and_grads(_packed(kw, case), qkv, bias, case)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    for name, a, b in zip(("dqkv", "dbias"), g, g_ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=name)


def test_without_a_bias_and_in_bfloat16_as_the_unpacked_kernels(x64):
    """No bias: the gradient is qkv's alone, and in bfloat16 the kernels do the unpacked
    kernels' arithmetic exactly (the same tiles, read from another layout)."""
    case = CASES[0]
    qkv, _, kw = _inputs(case, jnp.float64, bias=False)
    y_ref, g_ref = _value_and_grads(_unpacked(kw), qkv, None, case)
    y, g = _value_and_grads(_packed(kw, case), qkv, None, case)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    assert len(g) == 1
    np.testing.assert_allclose(g[0], g_ref[0], rtol=0, atol=1e-10)

    case = CASES[5]
    qkv, _, kw = _inputs(case, jnp.bfloat16, bias=False)
    y_ref, g_ref = _value_and_grads(_unpacked(kw, "pallas"), qkv, None, case)
    y, g = _value_and_grads(_packed(kw, case), qkv, None, case)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(g[0], g_ref[0])


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[6]], ids=lambda c: c.name)
def test_a_folded_bias_in_bfloat16_is_as_close_as_one_added_first(case, x64):
    """With a bias, in bfloat16: the kernels fold it into the algebra (the module's text)
    instead of adding it to q, k and v, which rounds q + b to bfloat16 as the layer's XLA
    add does before the unpacked kernels. Against the float64 attention of the same
    bfloat16 qkv and bias: the output, dqkv and dbias are about as close as that (within
    a quarter more: the two round in other places) and each within 2^-7 of its largest
    element. (The bias's gradient: the kernels sum their float32 tiles over the rows
    before rounding; autodiff sums the rounded rows.) q's bias term b_q·k_j is float32."""
    qkv, bias, kw = _inputs(case, jnp.bfloat16)
    y, g = _value_and_grads(_packed(kw, case), qkv, bias, case)
    assert y.dtype == g[0].dtype == g[1].dtype == jnp.bfloat16
    y_first, g_first = _value_and_grads(_unpacked(kw, "pallas"), qkv, bias, case)
    y_exact, g_exact = _value_and_grads(_unpacked(kw), qkv.astype(jnp.float64),
                                        bias.astype(jnp.float64), case)
    for name, folded, first, exact in zip(("out", "dqkv", "dbias"), (y, *g), (y_first, *g_first),
                                          (y_exact, *g_exact)):
        exact = np.asarray(exact)
        error = np.abs(np.asarray(folded, np.float64) - exact).max()
        assert error <= 1.25 * np.abs(np.asarray(first, np.float64) - exact).max(), name
        assert error <= 2 ** -7 * np.abs(exact).max(), name
    term = pallas._key_term(qkv, bias)
    exact = np.einsum("btnh,nh->bnt", np.asarray(qkv[:, :, 1], np.float64),
                      np.asarray(bias[0], np.float64))
    assert term.dtype == jnp.float32
    np.testing.assert_allclose(term, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_rows_that_see_no_key_are_zero_with_the_bias_folded_in(causal, x64):
    """A batch row of no real keys (kv_lengths 0): its output is zero, not v's bias (the
    fold adds that bias only to rows that see a key), and its gradients are zero; the
    other row as the float64 reference."""
    case = CASES[0]
    qkv, bias, _ = _inputs(case, jnp.float64)
    kw = dict(causal=causal, kv_lengths=jnp.asarray([0, 5], jnp.int32))
    y_ref, g_ref = _value_and_grads(_unpacked(kw), qkv, bias, case)
    y, g = _value_and_grads(_packed(kw, case), qkv, bias, case)
    assert not np.any(np.asarray(y)[0]) and not np.any(np.asarray(g[0])[0])
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_other_backends_are_handed_q_k_v_sliced_out(x64):
    case = CASES[3]
    qkv, bias, kw = _inputs(case, jnp.float64)
    y_ref, g_ref = _value_and_grads(_unpacked(kw), qkv, bias, case)
    y, g = _value_and_grads(_packed(kw, case, "blockwise"), qkv, bias, case)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-10)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_which_backends_read_packed():
    qkv = jax.ShapeDtypeStruct((2, 256, 3, 4, 64), jnp.bfloat16)
    ids = jnp.zeros((2, 256), jnp.int32)
    assert not reads_packed(qkv, causal=True)  # CPU: blockwise
    assert reads_packed(qkv, causal=True, implementation="pallas")
    assert not reads_packed(qkv, causal=True, implementation="xla")
    with compiling_for("gpu"):
        # packed documents on a GPU: the kernels; plain causal rows at GPT-2's head size
        # and length too (measured faster than cuDNN with its slicing, an H100)
        assert reads_packed(qkv, causal=True, segment_ids=ids)
        assert reads_packed(qkv, causal=True)
        # beyond what was measured, and masks other than plain causal: cuDNN, unpacked
        long_rows = jax.ShapeDtypeStruct((2, 2048, 3, 4, 64), jnp.bfloat16)
        large_heads = jax.ShapeDtypeStruct((2, 256, 3, 4, 128), jnp.bfloat16)
        assert not reads_packed(long_rows, causal=True)
        assert not reads_packed(large_heads, causal=True)
        assert not reads_packed(qkv, causal=True, window=64)
        assert not reads_packed(qkv, causal=True, kv_lengths=jnp.full((2,), 200))
        assert not reads_packed(qkv)  # not causal
        # asked for by name, cuDNN stays cuDNN
        assert not reads_packed(qkv, causal=True, implementation="cudnn")
        # other head sizes (unmeasured), and tile sizes given (cuDNN ignored them; the
        # kernels would refuse 96): cuDNN
        assert not reads_packed(jax.ShapeDtypeStruct((2, 256, 3, 4, 32), jnp.bfloat16),
                                causal=True)
        assert not reads_packed(qkv, causal=True, block_q=96)
        impl, reason = explain_packed(qkv, causal=True)
        assert impl == "pallas" and "read the projection's q, k, v in place" in reason
        assert explain_packed(long_rows, causal=True)[0] == "cudnn"
        assert explain_packed(qkv, causal=True, segment_ids=ids)[0] == "pallas"
        # under a mesh, only where the kernels would run on each device's share alone:
        # XLA splits cuDNN's attention by itself, but would gather the kernels' inputs
        mesh = jax.make_mesh((4, 2), ("data", "tensor"))
        eight = jax.ShapeDtypeStruct((8, 256, 3, 4, 64), jnp.bfloat16)
        with jax.set_mesh(mesh):
            assert reads_packed(eight, causal=True, batch_axes=("data",), head_axes=("tensor",))
            assert not reads_packed(eight, causal=True, batch_axes=("data",))  # tensor: whole
            assert not reads_packed(eight, causal=True)
            assert not reads_packed(qkv, causal=True, batch_axes=("data",),  # 2 rows over 4
                                    head_axes=("tensor",))
            three = jax.ShapeDtypeStruct((8, 256, 3, 3, 64), jnp.bfloat16)  # 3 heads over 2
            assert not reads_packed(three, causal=True, batch_axes=("data",),
                                    head_axes=("tensor",))


@pytest.mark.parametrize("args, kwargs, message", [
    ((jnp.zeros((2, 8, 4, 16)),), {}, r"qkv must be \[B, T, 3, N, H\].*got shape \(2, 8, 4, 16\)"),
    ((jnp.zeros((2, 8, 2, 4, 16)),), {}, r"qkv must be \[B, T, 3, N, H\]"),
    ((jnp.zeros((2, 8, 3, 4, 16)), jnp.zeros((3, 16))), {}, r"bias must be \[3, N, H\]=\[3, 4, 16\]"),
    ((jnp.zeros((2, 8, 3, 4, 16)),), {"q_offset": 3}, r"takes no q_offset"),
    ((jnp.zeros((2, 8, 3, 4, 16)),), {"implementation": "fused"}, r"implementation='fused' is unknown"),
])
def test_bad_packed_arguments_say_what_is_valid(args, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        packed_self_attention(*args, **kwargs)


# The GPU's tiles (128 × 64) on GPT-2's head size, a packed row of three documents.
GPU_CASES = [dataclasses.replace(CASES[0], name="causal-512", t=512, s=512, h=64),
             dataclasses.replace(CASES[5], name="long-documents-512", t=512, s=512, h=64,
                                 segments=(288, 96, 128))]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_packed_kernels_on_gpu_equal_the_reference(case):
    """Triton-compiled (strided slot tiles, the bias folded in, the gradient stored by two
    kernels into one array), bf16 and f32, against the float32 reference."""
    qkv, bias, kw = _inputs(case, jnp.float32)
    with jax.default_matmul_precision("highest"):
        y_ref, g_ref = _value_and_grads(_unpacked(kw), qkv, bias, case)
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
        y, g = _value_and_grads(_packed(kw, case), qkv.astype(dtype), bias.astype(dtype), case)
        for a, b in zip((y, *g), (y_ref, *g_ref)):
            err = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.maximum(jnp.linalg.norm(b), 1e-6)
            assert float(err) < tol


def _dot_operands(jaxpr, known=()):
    """For each dot_general in a kernel's jaxpr, nested jits and loops included: where its
    two operands come from, "load" (a ref read as it was, perhaps converted) or
    "computed" (anything else)."""
    origin, found = dict(known), []

    def of(v):
        return "computed" if isinstance(v, jax.extend.core.Literal) else origin.get(v, "computed")

    for eqn in jaxpr.eqns:
        name, out = eqn.primitive.name, "computed"
        if name == "get":
            out = "load"
        elif name == "convert_element_type":
            out = of(eqn.invars[0])
        elif name == "dot_general":
            found.append((of(eqn.invars[0]), of(eqn.invars[1])))
        elif name == "jit":
            inner = eqn.params["jaxpr"].jaxpr
            found += _dot_operands(inner, zip(inner.invars, map(of, eqn.invars)))
        elif name == "while":  # a loop body sees its constants as they were outside
            body, skip = eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_nconsts"]
            consts = eqn.invars[skip:skip + eqn.params["body_nconsts"]]
            found += _dot_operands(body, zip(body.invars[:len(consts)], map(of, consts)))
        for v in eqn.outvars:
            origin[v] = out
    return found


@pytest.mark.parametrize("packed", [True, False], ids=["packed-with-bias", "separate"])
def test_every_tile_product_reads_its_second_tile_as_loaded(packed):
    """On a GPU, the second operand of a tile product (wgmma's B) is read from shared
    memory, where Triton's pipeline puts a tile while the loop computes: only a tile used
    as it was loaded gets there. A bias added to k, v or q tiles in the loops (as the
    packed kernels did) made GPT-2's forward 1.4x slower on an H100. So in the three
    kernels (forward 2 products, dQ 3, dK/dV 4) every such operand is a load."""
    qkv = jnp.zeros((1, 64, 3, 2, 16), jnp.bfloat16)
    bias = jnp.zeros((3, 2, 16), jnp.bfloat16)
    if packed:
        attend = lambda qkv, bias: packed_self_attention(qkv, bias, implementation="pallas",
                                                          causal=True)
    else:
        attend = lambda qkv, bias: dot_product_attention(
            *(qkv[:, :, c] + bias[c] for c in range(3)), implementation="pallas", causal=True)
    grad = jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), argnums=(0, 1))
    products = {eqn.params["name"]: _dot_operands(eqn.params["jaxpr"])
                for eqn in pallas_calls(jax.make_jaxpr(grad)(qkv, bias).jaxpr)}
    # each product three times: a causal walk has a masked, an unmasked and a masked loop
    assert {k: len(v) for k, v in products.items()} == {
        "flash_forward": 2 * 3, "flash_backward_dq": 3 * 3, "flash_backward_dkdv": 4 * 3}
    assert all(b == "load" for found in products.values() for _, b in found), products
