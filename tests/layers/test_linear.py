"""layers/linear.py: 2-D matmuls equal the einsums they replace, values and gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from attention_jax.layers.linear import dot_general_2d, matmul


def _rand(shape, seed):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float64)


@pytest.mark.parametrize("x_shape, w_shape, in_dims, spec", [
    ((2, 5, 6), (6, 7), 1, "BTD,DF->BTF"),
    ((2, 5, 6), (6, 3, 4), 1, "BTD,DNH->BTNH"),
    ((2, 5, 3, 4), (3, 4, 6), 2, "BTNH,NHD->BTD"),
    ((9, 6), (6, 2), 1, "MD,DF->MF"),
])
def test_matmul_equals_einsum_and_its_gradients(x64, x_shape, w_shape, in_dims, spec):
    x, w = _rand(x_shape, 0), _rand(w_shape, 1)
    ours = lambda x, w: jnp.sum(jnp.sin(matmul(x, w, in_dims)))
    ref = lambda x, w: jnp.sum(jnp.sin(jnp.einsum(spec, x, w)))
    np.testing.assert_allclose(matmul(x, w, in_dims), jnp.einsum(spec, x, w), rtol=1e-12)
    for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_matmul_refuses_mismatched_axes():
    with pytest.raises(ValueError, match=r"x \(2, 5, 6\) does not end in the weight's input "
                                         r"axes \(3, 4\)"):
        matmul(jnp.zeros((2, 5, 6)), jnp.zeros((3, 4, 6)), in_dims=2)


def test_dense_with_dot_general_2d_equals_flax_dense(x64):
    x = _rand((3, 4, 5), 2)
    plain = nn.Dense(7, param_dtype=jnp.float64)
    params = plain.init(jax.random.PRNGKey(0), x)
    ours = nn.Dense(7, param_dtype=jnp.float64, dot_general=dot_general_2d)
    np.testing.assert_allclose(ours.apply(params, x), plain.apply(params, x), rtol=1e-12)
    # contractions other than Dense's go to lax.dot_general unchanged
    a, b = _rand((3, 4, 5), 3), _rand((3, 5, 2), 4)
    dims = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_allclose(dot_general_2d(a, b, dims), lax.dot_general(a, b, dims), rtol=1e-12)


def test_dot_general_2d_keeps_the_float32_accumulator_asked_for():
    # bfloat16 operands with preferred_element_type=float32: the folded path returns the
    # accumulator unrounded, as lax.dot_general does (it once rounded to bfloat16 first).
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 3, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(6), (64, 16)).astype(jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    ours = dot_general_2d(x, w, dims, preferred_element_type=jnp.float32)
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, lax.dot_general(x, w, dims, preferred_element_type=jnp.float32),
                               rtol=1e-6, atol=1e-5)
