"""Normalisation layers by name: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

    norm = make_norm("rmsnorm", epsilon=1e-6)   # a flax module, applied to [..., D]

Both compute what flax's nn.LayerNorm (with use_fast_variance=False: the variance in two
passes, exact where the mean is large) and nn.RMSNorm compute, with the same parameters
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

A pre-norm block adds a sublayer's output to the residual stream and normalises the sum
for the next sublayer: `add_normalize` (and the modules called with y) does both, as
XLA's ops or, on NVIDIA GPUs, as the kernels of layers/norm_kernel.py (the add, the
projection's bias and the norm in one kernel each way; NORM_KERNELS).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.attention.call import target_backend
from attention_jax.layers import norm_kernel
from attention_jax.quiet import warn_once

NORMS = ("layernorm", "rmsnorm")
# How add_normalize computes: "xla" as XLA's ops (normalize); "pallas" the kernels of
# norm_kernel.py; "auto" pallas on NVIDIA GPUs (or compiling for them) where the rows
# divide into its programs and the mesh leaves the features whole, xla elsewhere.
NORM_KERNELS = ("auto", "xla", "pallas")


def normalize(x, scale, bias=None, *, centered: bool = True, epsilon: float = 1e-6,
              dtype: Any = None):
    """LayerNorm (centered) or RMSNorm (not centered) of x [..., D] over its last axis.

    scale [D], bias [D] or None. Statistics and arithmetic in float32 (float64 for
    float64 x); the variance as the mean of (x - μ)², which flax's default (E[x²] -
    E[x]², one pass) loses where |μ| is large beside the spread. Returns y in `dtype`
    (default x's)."""
    dtype = jnp.dtype(dtype or x.dtype)
    return _normalize(bool(centered), float(epsilon), dtype, x, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _normalize(centered, epsilon, dtype, x, scale, bias):
    return _normalize_forward(centered, epsilon, dtype, x, scale, bias)[0]


def _compute_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


def _normalize_forward(centered, epsilon, dtype, x, scale, bias):
    xf = x.astype(_compute_dtype(x))
    if centered:
        # Two passes, the variance as the mean of (x - μ)², as PyTorch and the GPU kernel
        # (norm_kernel) take it. One pass, E[x²] - E[x]² (flax's default), cancels where
        # |μ| is large beside the spread: rows near 1e3 with a spread of 0.1 came out
        # hundreds of times too large. (What it costs where XLA's norm runs on a GPU,
        # not the default there, is in README, Measurements behind the code.)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    else:
        mean, var = jnp.zeros((), xf.dtype), jnp.mean(xf * xf, axis=-1, keepdims=True)
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


def choose_norm_kernel(kernel: str, x_shape, dtype) -> str:
    """"xla" or "pallas" for `kernel` (NORM_KERNELS) and an x of this shape and dtype.

    auto takes pallas on NVIDIA GPUs (or compiling for them) for x other than float64
    whose rows divide into the kernels' programs on each device, backward programs of
    norm_kernel.MIN_PROGRAM_ROWS rows or more by default (a multiple of 8 rows), unless
    the mesh splits the features D or would hand every device all the rows (several
    devices and nothing in the logical rules splitting the batch or length,
    norm_kernel.gathers_rows).
    pallas where the kernels cannot take x (norm_kernel.unsupported) answers xla and says
    so once per shape."""
    if kernel not in NORM_KERNELS:
        raise ValueError(f"norm kernel {kernel!r} is unknown; valid: {NORM_KERNELS}")
    why = norm_kernel.unsupported(tuple(x_shape))
    if kernel == "pallas" and why:
        # Asked for, but not for this call's shape (a sampler's prompts, an odd batch):
        # XLA's ops compute it, said once, rather than the run failing at that call.
        warn_once(__name__, ("unsupported", tuple(x_shape)), "norm_kernel='pallas' cannot "
                  "take x %s here (%s): XLA's ops compute this call", tuple(x_shape), why)
        return "xla"
    if kernel == "pallas" and jnp.dtype(dtype) == jnp.float64:
        # The kernels compute in float32: a float64 residual stream would lose its digits.
        warn_once(__name__, ("float64",), "norm_kernel='pallas' computes in float32; float64 "
                  "activations keep XLA's ops")
        return "xla"
    if kernel == "pallas" and norm_kernel.gathers_rows(x_shape):
        warn_once(__name__, ("gathers", tuple(x_shape)), "norm_kernel='pallas' on x %s: "
                  "nothing splits its rows over the devices (no mesh, or no logical rule for "
                  "its batch or length), so each device computes all of them; 'auto' would "
                  "take XLA's ops", tuple(x_shape))
    if kernel != "auto":
        return kernel
    unsuited = (target_backend() != "gpu" or jnp.dtype(dtype) == jnp.float64
                or len(x_shape) < 2 or norm_kernel.gathers_rows(x_shape))
    if unsuited or why:
        return "xla"
    program = norm_kernel.launch(norm_kernel.rows_per_device(tuple(x_shape[:-1])), x_shape[-1])
    few = (program["program_rows"] < norm_kernel.MIN_PROGRAM_ROWS
           and not norm_kernel.SETTINGS.given("program_rows"))  # (a sweep's setting stands)
    return "xla" if few else "pallas"


def add_normalize(x, y=None, y_bias=None, scale=None, bias=None, *, centered: bool = True,
                  epsilon: float = 1e-6, dtype: Any = None, kernel: str = "auto"):
    """(r, normalize(r, scale, bias)) with r = x + y + y_bias: a residual add and the norm
    after it (y None: r = x). y_bias [D] is the bias of the projection that made y, kept
    apart so the kernel adds it as it loads y. kernel: NORM_KERNELS."""
    if y is None and y_bias is not None:
        raise ValueError("y_bias without y: valid only with y (the bias of y's projection)")
    choice = choose_norm_kernel(kernel, x.shape, x.dtype)
    if choice == "pallas" and (kernel == "pallas" or y is None or y.dtype == x.dtype):
        # (auto leaves a y of another dtype to XLA, which promotes; asked for, the kernel
        # says that it takes x's dtype only)
        return norm_kernel.add_norm(x, y, y_bias, scale, bias, centered=centered,
                                    epsilon=epsilon, dtype=dtype)
    r = x
    if y is not None:
        r = x + (y if y_bias is None else y + y_bias.astype(y.dtype))
    return r, normalize(r, scale, bias, centered=centered, epsilon=epsilon, dtype=dtype)


def _no_addend(y, y_bias):
    if y is not None or y_bias is not None:
        raise ValueError("a norm called with y or y_bias adds them to x: call it with "
                         "residual=True, which returns (x + y + y_bias, its norm)")


def _norm_param(module: nn.Module, name: str, init, d: int):
    return module.param(name, nn.with_logical_partitioning(init, (axes.NORM,)), (d,),
                        module.param_dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (`normalize`, centered): the values of flax's
    nn.LayerNorm(use_fast_variance=False) and its parameters, the leaner backward pass."""
    epsilon: float = 1e-6
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel: str = "auto"  # NORM_KERNELS, for a call with residual=True

    @nn.compact
    def __call__(self, x, y=None, y_bias=None, *, residual: bool = False):
        """norm(x); with residual=True (r, norm(r)), r = x + y + y_bias (add_normalize)."""
        d = x.shape[-1]
        scale = _norm_param(self, "scale", nn.initializers.ones, d)
        bias = _norm_param(self, "bias", nn.initializers.zeros, d) if self.use_bias else None
        if not residual:
            _no_addend(y, y_bias)
            return normalize(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)
        return add_normalize(x, y, y_bias, scale, bias, epsilon=self.epsilon, dtype=self.dtype,
                             kernel=self.kernel)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis (`normalize`, not centered): flax's nn.RMSNorm's values
    and parameters, the leaner backward pass."""
    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel: str = "auto"  # NORM_KERNELS, for a call with residual=True

    @nn.compact
    def __call__(self, x, y=None, y_bias=None, *, residual: bool = False):
        """norm(x); with residual=True (r, norm(r)), r = x + y + y_bias (add_normalize)."""
        scale = _norm_param(self, "scale", nn.initializers.ones, x.shape[-1])
        if not residual:
            _no_addend(y, y_bias)
            return normalize(x, scale, centered=False, epsilon=self.epsilon, dtype=self.dtype)
        return add_normalize(x, y, y_bias, scale, centered=False, epsilon=self.epsilon,
                             dtype=self.dtype, kernel=self.kernel)


def make_norm(kind: str, *, epsilon: float = 1e-6, use_bias: bool = True,
              dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
              kernel: str = "auto", name: str | None = None) -> nn.Module:
    """A LayerNorm or RMSNorm over the last axis, its scale (and bias) on the NORM axis.

    kind: "layernorm" (centre and scale, learned scale and bias) or "rmsnorm" (scale by
      the root mean square only: no mean, no bias; cheaper, used by LLaMA-style models).
    use_bias: LayerNorm only; RMSNorm has no bias by definition.
    Statistics are computed in float32 even when `dtype` is lower precision.
    kernel: NORM_KERNELS, how a call with residual=True computes (add_normalize).
    """
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is unknown; valid: {NORMS}")
    if kind == "layernorm":
        return LayerNorm(epsilon=epsilon, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, kernel=kernel, name=name)
    return RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, kernel=kernel,
                   name=name)
