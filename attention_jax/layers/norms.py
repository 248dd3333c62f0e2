"""Normalisation layers by name: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

    norm = make_norm("rmsnorm", epsilon=1e-6)   # a flax module, applied to [..., D]

Both compute what flax's nn.LayerNorm and nn.RMSNorm compute, with the same parameters
("scale", and "bias" for LayerNorm; checkpoints and converted weights load either way),
their scale and bias on the NORM logical axis. What differs is the backward pass.
Autodiff through flax's modules keeps float32 intermediates of the formula for it: two
[..., D] float32 tensors per norm (x - mean and rsqrt(var)·scale broadcast over D), four
times the bytes of a bfloat16 input. `normalize` here keeps the input itself and the
per-row statistics, and its backward recomputes x̂ from them in float32:

    x̂ = (x - μ)·r,  y = x̂·s + b,  g = dL/dy,  ĝ = g·s
    dx = r·(ĝ - mean(ĝ) - x̂·mean(ĝ·x̂)),  ds = Σ g·x̂,  db = Σ g

(RMSNorm: μ = 0 and no mean(ĝ) term.) The memory this saves is measured with XLA's
compiled memory analysis (README, Measurements behind the code; tests/layers/test_norms.py asserts it is less).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes

NORMS = ("layernorm", "rmsnorm")


def normalize(x, scale, bias=None, *, centered: bool = True, epsilon: float = 1e-6,
              dtype: Any = None):
    """LayerNorm (centered) or RMSNorm (not centered) of x [..., D] over its last axis.

    scale [D], bias [D] or None. Statistics and arithmetic in float32 (float64 for
    float64 x); E[x²] - E[x]² for the variance, clipped at 0, as flax computes it.
    Returns y in `dtype` (default x's)."""
    dtype = jnp.dtype(dtype or x.dtype)
    return _normalize(bool(centered), float(epsilon), dtype, x, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _normalize(centered, epsilon, dtype, x, scale, bias):
    return _normalize_forward(centered, epsilon, dtype, x, scale, bias)[0]


def _compute_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


def _normalize_forward(centered, epsilon, dtype, x, scale, bias):
    xf = x.astype(_compute_dtype(x))
    mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True)
    if centered:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.maximum(mean_sq - mean * mean, 0.0)
    else:
        mean, var = jnp.zeros((), xf.dtype), mean_sq
    rstd = jax.lax.rsqrt(var + epsilon)  # [..., 1]
    y = (xf - mean) * (rstd * scale.astype(xf.dtype))
    if bias is not None:
        y = y + bias.astype(xf.dtype)
    return y.astype(dtype), (x, mean, rstd, scale, bias)


def _normalize_backward(centered, epsilon, dtype, residuals, g):
    x, mean, rstd, scale, bias = residuals
    xf = x.astype(_compute_dtype(x))
    g = g.astype(xf.dtype)
    x_hat = (xf - mean) * rstd
    g_hat = g * scale.astype(xf.dtype)
    dx = g_hat - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True)
    if centered:
        dx = dx - jnp.mean(g_hat, axis=-1, keepdims=True)
    rows = tuple(range(x.ndim - 1))  # every axis but D: the parameters' gradients sum over them
    dscale = jnp.sum(g * x_hat, axis=rows).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g, axis=rows).astype(bias.dtype)
    return (dx * rstd).astype(x.dtype), dscale, dbias


_normalize.defvjp(_normalize_forward, _normalize_backward)


def _norm_param(module: nn.Module, name: str, init, d: int):
    return module.param(name, nn.with_logical_partitioning(init, (axes.NORM,)), (d,),
                        module.param_dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (`normalize`, centered): flax's nn.LayerNorm's values
    and parameters, the leaner backward pass."""
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = _norm_param(self, "scale", nn.initializers.ones, d)
        bias = _norm_param(self, "bias", nn.initializers.zeros, d) if self.use_bias else None
        return normalize(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis (`normalize`, not centered): flax's nn.RMSNorm's values
    and parameters, the leaner backward pass."""
    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = _norm_param(self, "scale", nn.initializers.ones, x.shape[-1])
        return normalize(x, scale, centered=False, epsilon=self.epsilon, dtype=self.dtype)


def make_norm(kind: str, *, epsilon: float = 1e-6, use_bias: bool = True,
              dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
              name: str | None = None) -> nn.Module:
    """A LayerNorm or RMSNorm over the last axis, its scale (and bias) on the NORM axis.

    kind: "layernorm" (centre and scale, learned scale and bias) or "rmsnorm" (scale by
      the root mean square only: no mean, no bias; cheaper, used by LLaMA-style models).
    use_bias: LayerNorm only; RMSNorm has no bias by definition.
    Statistics are computed in float32 even when `dtype` is lower precision.
    """
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is unknown; valid: {NORMS}")
    if kind == "layernorm":
        return LayerNorm(epsilon=epsilon, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, name=name)
    return RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name)
