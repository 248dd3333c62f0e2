"""Position-wise feed-forward layers: the two-layer `MLP` and `GatedMLP` (SwiGLU, GeGLU).

    MLP:     y = W2 act(W1 x + b1) + b2          hidden F = 4D (Vaswani 2017 §3.3)
    SwiGLU:  y = W2 (silu(Wg x) ∘ (W1 x))       (Shazeer 2020, "GLU Variants Improve
             Transformer"); a third matrix, so F ≈ 8D/3 keeps the parameter count of the
             4D MLP; F is rounded up to a multiple (default 128) so the matmuls tile
             cleanly on accelerators (LLaMA's 11008 for D=4096 is the same rule with 256).
    GeGLU:   y = W2 (gelu(Wg x) ∘ (W1 x))       the same paper's GELU-gated variant.
Kernels carry logical axes [D, F] = (EMBED, MLP) and [F, D] = (MLP, EMBED).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.errors import check_positive_ints, check_rates_and_epsilon
from attention_jax.layers.linear import dot_general_2d

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# GPT-2's GELU, 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), with a backward pass that
# keeps only x. Autodiff keeps five [B, T, F] intermediates of the formula for the
# backward pass, and XLA writes at least tanh's out in the forward and reads it back:
# two passes through memory per layer over the largest activation. Here the backward
# recomputes the derivative from x (the matmul's output, kept anyway), in float32 (or
# float64, given that). It writes tanh as 2·sigmoid(2u) - 1 so that XLA does not merge
# it with the forward's tanh and keep that after all. The values are
# jax.nn.gelu(approximate=True)'s.
@jax.custom_vjp
def gelu_tanh(x):
    """GPT-2's tanh-approximated GELU (Hendrycks & Gimpel 2016), elementwise."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_forward(x):
    return gelu_tanh(x), x


def _gelu_tanh_backward(x, g):
    exact = jnp.promote_types(x.dtype, jnp.float32)  # float64 stays float64 (a check)
    xf = x.astype(exact)
    t = 2.0 * jax.nn.sigmoid(2.0 * _SQRT_2_OVER_PI * (xf + 0.044715 * xf ** 3)) - 1.0  # tanh(u)
    du_dx = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * xf * xf)
    dy_dx = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * du_dx
    return ((g.astype(exact) * dy_dx).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_tanh_forward, _gelu_tanh_backward)

ACTIVATIONS: dict[str, Callable] = {
    "relu": nn.relu,
    "gelu": functools.partial(nn.gelu, approximate=False),  # exact erf form (BERT)
    "gelu_tanh": gelu_tanh,  # GPT-2's tanh approximation
    "silu": nn.silu,
}
# The feed-forward kinds a block can use (moe: layers/moe.py).
MLPS = ("mlp", "glu", "swiglu", "geglu", "moe")
# The gated kinds and the activation of their gate (Shazeer 2020, eq. 5-6; GeGLU's GELU
# exact); "glu"'s gate is the block's `activation` (relu: ReGLU, silu: SwiGLU, ...).
GATED_MLPS = {"glu": None, "swiglu": "silu", "geglu": "gelu"}


def gate_activation(mlp: str, activation_name: str, default: str = "gelu") -> str:
    """The activation of a gated MLP kind's gate. The named kinds fix theirs, so an
    `activation` other than theirs or the config's `default` (left as it is) would be
    ignored: refused, pointing at "glu", whose gate is `activation`."""
    activation(activation_name)  # an unknown name first, with the valid ones
    fixed = GATED_MLPS[mlp]
    if fixed is None:
        return activation_name
    if activation_name not in (fixed, default):
        raise ValueError(f"activation={activation_name!r} is not used by mlp={mlp!r}, whose "
                         f"gate is {fixed!r}; valid: {fixed!r} or the default {default!r} (left "
                         f"as it is), or mlp='glu' for a gate of activation={activation_name!r}")
    return fixed


def activation(name: str) -> Callable:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is unknown; valid: {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def gated_hidden(d_model: int, multiple_of: int = 128) -> int:
    """F = 8D/3 rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


def dense_init():
    """LeCun normal with fan-in over the first axis: keeps activations' variance near 1."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class _DenseBiasApart(nn.Module):
    """nn.Dense's parameters ("kernel" [K, F], "bias" [F]) and product, the bias returned
    beside it, not added: (x · kernel, bias), for a caller that adds it in a kernel of its
    own (a pre-norm block's next norm, layers/norms.py add_normalize). The bias stays in
    param_dtype: the norm kernel reads it so (cast, it was a launch of its own each step,
    and its gradient was rounded to dtype); XLA's ops cast it where they add it."""

    features: int
    dtype: Any
    param_dtype: Any
    kernel_init: Callable
    bias_init: Callable

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                            self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        y = dot_general_2d(x.astype(self.dtype), kernel.astype(self.dtype),
                           (((x.ndim - 1,), (0,)), ((), ())))
        return y, bias


def _dense(features, in_axis, out_axis, use_bias, dtype, param_dtype, name, kernel_init=None,
           bias_apart: bool = False):
    """A projection to `features` with logical axes (in_axis, out_axis); bias_apart (with
    use_bias): called, it returns (product, bias) (_DenseBiasApart)."""
    inits = dict(
        kernel_init=nn.with_logical_partitioning(kernel_init or dense_init(), (in_axis, out_axis)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)))
    if bias_apart and use_bias:
        return _DenseBiasApart(features, dtype, param_dtype, name=name, **inits)
    return nn.Dense(
        features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, name=name,
        dot_general=dot_general_2d,  # 2-D matmuls, forward and backward (layers/linear.py)
        **inits)


class MLP(nn.Module):
    """Two-layer MLP [B, T, D] -> [B, T, D] with hidden F (default 4D).

    defer_output_bias (with use_bias): return (y without wo's bias, that bias [D] in
    param_dtype), for the caller to add (a pre-norm block's next norm adds it in its
    kernel; cast it to y's dtype to add it yourself)."""

    hidden: Optional[int] = None
    activation: str = "gelu"
    use_bias: bool = True
    dropout_rate: float = 0.0  # on the hidden activations
    kernel_init: Optional[Callable] = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    defer_output_bias: bool = False

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        check_rates_and_epsilon(self)  # dropout_rate=10 (a percentage) zeroed every output
        # hidden=0 was read as the default 4D, unsaid
        check_positive_ints(self, ["hidden"], {"hidden": "4 times the input's width"})
        d = x.shape[-1]
        f = self.hidden or 4 * d
        act = activation(self.activation)
        h = _dense(f, axes.EMBED, axes.MLP, self.use_bias, self.dtype, self.param_dtype,
                   "wi", self.kernel_init)(x)  # [B, T, F]
        h = nn.with_logical_constraint(act(h), (axes.BATCH, axes.LENGTH, axes.MLP))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        y = _dense(d, axes.MLP, axes.EMBED, self.use_bias, self.dtype, self.param_dtype,
                   "wo", self.kernel_init, self.defer_output_bias)(h)  # [B, T, D]
        return _with_bias_apart(y, self.defer_output_bias, self.use_bias)


class GatedMLP(nn.Module):
    """Gated MLP [B, T, D] -> [B, T, D]: act(x Wg) ∘ (x W1), then W2. No biases by default.

    gate_activation "silu" is SwiGLU, "gelu" GeGLU (any name in ACTIVATIONS);
    defer_output_bias as MLP's."""

    hidden: Optional[int] = None  # default gated_hidden(D, multiple_of)
    gate_activation: str = "silu"
    multiple_of: int = 128
    use_bias: bool = False
    dropout_rate: float = 0.0
    kernel_init: Optional[Callable] = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    defer_output_bias: bool = False

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        check_rates_and_epsilon(self)
        check_positive_ints(self, ["hidden", "multiple_of"],  # hidden=0 read as the default
                            {"hidden": "8/3 of the input's width, rounded up to multiple_of"})
        d = x.shape[-1]
        f = self.hidden or gated_hidden(d, self.multiple_of)
        args = (self.use_bias, self.dtype, self.param_dtype)
        gate = _dense(f, axes.EMBED, axes.MLP, *args, "wg", self.kernel_init)(x)  # [B, T, F]
        up = _dense(f, axes.EMBED, axes.MLP, *args, "wi", self.kernel_init)(x)  # [B, T, F]
        h = nn.with_logical_constraint(activation(self.gate_activation)(gate) * up, (axes.BATCH, axes.LENGTH, axes.MLP))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        y = _dense(d, axes.MLP, axes.EMBED, *args, "wo", self.kernel_init,
                   self.defer_output_bias)(h)  # [B, T, D]
        return _with_bias_apart(y, self.defer_output_bias, self.use_bias)


def _with_bias_apart(y, defer: bool, use_bias: bool):
    """An MLP's output: y, or with defer_output_bias (y, its bias or None)."""
    if not defer:
        return y
    return y if use_bias else (y, None)
