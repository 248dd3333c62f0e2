"""LayerNorm and RMSNorm with their own backward pass (layers/norms.py): the float64
formula's values and gradients, flax's modules' values and parameters (so checkpoints
and converted weights load), and less memory kept for the backward pass than autodiff."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.norms import LayerNorm, RMSNorm, make_norm, normalize

EPS = 1e-5


def _norm_formula(x, scale, bias, centered):
    """The textbook formula (two-pass variance), for autodiff in float64."""
    mean = x.mean(-1, keepdims=True) if centered else 0.0
    y = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * scale
    return y + bias if bias is not None else y


def _inputs(dtype, use_bias=True):
    k = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(k[0], (3, 5, 48)) * 2.0 + 0.7).astype(dtype)
    scale = 1.0 + 0.5 * jax.random.normal(k[1], (48,))
    bias = jax.random.normal(k[2], (48,)) if use_bias else None
    w = jax.random.normal(k[3], (3, 5, 48))  # a loss that weighs every output differently
    return x, scale, bias, w


@pytest.mark.parametrize("centered, use_bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 4e-2)])
def test_values_and_gradients_match_float64(centered, use_bias, dtype, tol):
    x, scale, bias, w = _inputs(dtype, use_bias)
    y = normalize(x, scale, bias, centered=centered, epsilon=EPS)
    assert y.dtype == dtype

    def loss(norm, w, x, scale, bias):
        return jnp.sum(jnp.sin(norm(x, scale, bias).astype(w.dtype)) * w)

    ours = lambda x, scale, bias: normalize(x, scale, bias, centered=centered, epsilon=EPS)
    argnums = (2, 3, 4) if use_bias else (2, 3)
    grads = jax.grad(loss, argnums)(ours, w, x, scale, bias)
    assert grads[0].dtype == dtype and grads[1].dtype == scale.dtype
    with jax.enable_x64(True):  # the reference: autodiff of the formula in float64
        x64, scale64, bias64, w64 = [None if a is None else jnp.asarray(np.asarray(a, np.float64))
                                     for a in (x, scale, bias, w)]
        formula = lambda x, scale, bias: _norm_formula(x, scale, bias, centered)
        np.testing.assert_allclose(np.asarray(y, np.float64),
                                   formula(x64, scale64, bias64), rtol=tol, atol=tol)
        want = jax.grad(loss, argnums)(formula, w64, x64, scale64, bias64)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref),
                                   rtol=tol, atol=tol * float(np.abs(ref).max()))


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_a_row_far_from_zero_beside_its_spread_normalises_exactly(kernel):
    """Rows near 1e3 with a spread of 0.1 (|μ| / σ = 1e4) in float32: the one-pass
    variance E[x²] - E[x]² lost every digit to cancellation (outputs up to hundreds of
    times too large, on the XLA path only: the kernel took two passes). Both paths
    against float64, values and the input's gradient."""
    from attention_jax.layers.norms import add_normalize
    rng = np.random.default_rng(0)
    x = (1000.0 + 0.1 * rng.standard_normal((2, 8, 64))).astype(np.float32)
    scale, bias, g = np.ones(64, np.float32), np.zeros(64, np.float32), rng.standard_normal(
        (2, 8, 64)).astype(np.float32)
    f = lambda x: add_normalize(x, None, None, scale, bias, kernel=kernel, epsilon=EPS)[1]
    y, vjp = jax.vjp(f, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(g))
    with jax.enable_x64(True):
        x64 = jnp.asarray(x, jnp.float64)  # the float32 values, exactly
        ref = lambda x: _norm_formula(x, jnp.asarray(scale, jnp.float64), None, True)
        y64, vjp64 = jax.vjp(ref, x64)
        (dx64,) = vjp64(jnp.asarray(g, jnp.float64))
    np.testing.assert_allclose(np.asarray(y, np.float64), y64, atol=2e-3)
    np.testing.assert_allclose(np.asarray(dx, np.float64), dx64,
                               atol=2e-3 * float(np.abs(dx64).max()))


@pytest.mark.parametrize("kind, ours, theirs", [
    # flax's two-pass variance (use_fast_variance=False), as ours takes it
    ("layernorm", LayerNorm(epsilon=EPS), nn.LayerNorm(epsilon=EPS, use_fast_variance=False)),
    ("layernorm, no bias", LayerNorm(epsilon=EPS, use_bias=False),
     nn.LayerNorm(epsilon=EPS, use_bias=False, use_fast_variance=False)),
    ("rmsnorm", RMSNorm(epsilon=EPS), nn.RMSNorm(epsilon=EPS)),
])
def test_flax_modules_values_and_parameters(kind, ours, theirs):
    """The same parameter tree as flax's module, the same values, and the same gradients
    as autodiff through flax's module (float32)."""
    x, _, _, w = _inputs(jnp.float32)
    params = theirs.init(jax.random.key(1), x)
    assert (jax.tree.map(jnp.shape, nn.meta.unbox(ours.init(jax.random.key(1), x)))
            == jax.tree.map(jnp.shape, params)), kind
    params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape), params)
    np.testing.assert_array_equal(ours.apply(params, x), theirs.apply(params, x))
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)) * w)
    for got, want in zip(jax.tree.leaves(jax.grad(loss(ours), argnums=(0, 1))(params, x)),
                         jax.tree.leaves(jax.grad(loss(theirs), argnums=(0, 1))(params, x))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_keeps_less_for_the_backward_pass_than_flax():
    """value_and_grad of LayerNorm then a matmul on a bfloat16 [B, T, D] input: XLA's
    compiled temporary memory is smaller than with flax's LayerNorm, whose autodiff keeps
    float32 [B, T, D] intermediates of the formula: by at least 2 bytes per element at
    this size (XLA:CPU; 8 bytes at GPT-2's [16, 1024, 768], too large for a test)."""
    b, t, d = 4, 128, 256
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (b, t, d), jnp.bfloat16)
    w = jax.random.normal(k[1], (d, d), jnp.bfloat16) * 0.05

    def temp_bytes(module):
        params = module.init(jax.random.key(1), x)

        def loss(p, x):
            return jnp.sum((module.apply(p, x) @ w).astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ours = temp_bytes(LayerNorm(dtype=jnp.bfloat16))
    flax_ = temp_bytes(nn.LayerNorm(dtype=jnp.bfloat16))
    assert ours <= flax_ - b * t * d * 2, (ours, flax_)


def test_make_norm_names_the_valid_kinds():
    assert isinstance(make_norm("layernorm"), LayerNorm)
    assert isinstance(make_norm("rmsnorm"), RMSNorm)
    with pytest.raises(ValueError, match=r"norm='batchnorm' is unknown; valid: \('layernorm', 'rmsnorm'\)"):
        make_norm("batchnorm")
