"""GPT-2's GELU with its own backward pass (layers/mlp.py gelu_tanh): the values and
gradients of the formula, and less memory kept for the backward pass than autodiff."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.mlp import ACTIVATIONS, gelu_tanh


def _gelu_tanh_float64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


# atol: where tanh(u) is near -1, 1 + tanh(u) cancels; float32 keeps about 1e-6 of it.
@pytest.mark.parametrize("dtype, rtol, atol", [(jnp.float32, 1e-5, 5e-6), (jnp.bfloat16, 1e-2, 1e-2)])
def test_values_and_gradient_match_float64(dtype, rtol, atol):
    x = jnp.linspace(-8.0, 8.0, 257).astype(dtype)
    np.testing.assert_allclose(np.asarray(gelu_tanh(x), np.float64), _gelu_tanh_float64(x),
                               rtol=rtol, atol=atol)
    # d/dx by central differences of the float64 formula (step 1e-6 at float64).
    xs = np.asarray(x, np.float64)
    want = (_gelu_tanh_float64(xs + 1e-6) - _gelu_tanh_float64(xs - 1e-6)) / 2e-6
    g = jax.grad(lambda v: jnp.sum(gelu_tanh(v).astype(jnp.float32) * 1.0))(x)
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=rtol, atol=atol)
    # the same as autodiff through jax.nn.gelu, in float32
    if dtype == jnp.float32:
        auto = jax.grad(lambda v: jnp.sum(jax.nn.gelu(v, approximate=True)))(x)
        np.testing.assert_allclose(np.asarray(g), np.asarray(auto), rtol=1e-5, atol=atol)


def test_the_gradient_in_float64_is_float64_accurate(x64):
    """The backward pass computed in float32 whatever x was: in float64 (a numerics
    check) the gradient was only float32-accurate, 7e-7 off autodiff's."""
    x = jnp.linspace(-4.0, 4.0, 101, dtype=jnp.float64)
    g = jax.vmap(jax.grad(gelu_tanh))(x)
    auto = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(g), np.asarray(auto), rtol=1e-12, atol=1e-14)


def test_the_mlp_keeps_less_for_the_backward_pass_than_autodiff():
    """value_and_grad of a GPT-2-sized MLP (x·W1 + b, GELU, ·W2) in bfloat16: XLA's
    compiled temporary memory is smaller with gelu_tanh than with autodiff through
    the formula, which keeps intermediates of the formula besides x."""
    b, d, f = 512, 256, 1024
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (b, d), jnp.bfloat16)
    params = (jax.random.normal(keys[1], (d, f), jnp.bfloat16) * 0.05, jnp.zeros(f, jnp.bfloat16),
              jax.random.normal(keys[2], (f, d), jnp.bfloat16) * 0.05)

    def temp_bytes(act):
        def loss(p, x):
            w1, b1, w2 = p
            return jnp.sum((act(x @ w1 + b1) @ w2).astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ours = temp_bytes(gelu_tanh)
    autodiff = temp_bytes(functools.partial(jax.nn.gelu, approximate=True))
    hidden = b * f * 2  # one [B, F] bfloat16 activation
    assert ours <= autodiff - hidden, (ours, autodiff, hidden)


def test_gpt2s_activation_is_this_one():
    assert ACTIVATIONS["gelu_tanh"] is gelu_tanh
