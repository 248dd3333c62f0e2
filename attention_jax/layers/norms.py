"""Normalisation layers by name: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019).

Both are flax's own modules; this file only adds logical axis names to their parameters
(so sharding rules can see them) and a factory that picks one by a config string.

    norm = make_norm("rmsnorm", epsilon=1e-6)   # a flax module, applied to [..., D]
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes

NORMS = ("layernorm", "rmsnorm")


def make_norm(kind: str, *, epsilon: float = 1e-6, use_bias: bool = True,
              dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
              name: str | None = None) -> nn.Module:
    """A LayerNorm or RMSNorm over the last axis, its scale (and bias) on the NORM axis.

    kind: "layernorm" (centre and scale, learned scale and bias) or "rmsnorm" (scale by
      the root mean square only: no mean, no bias; cheaper, used by LLaMA-style models).
    use_bias: LayerNorm only; RMSNorm has no bias by definition.
    Statistics are computed in float32 by flax even when `dtype` is lower precision.
    """
    scale_init = nn.with_logical_partitioning(nn.initializers.ones, (axes.NORM,))
    if kind == "layernorm":
        return nn.LayerNorm(
            epsilon=epsilon, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
            scale_init=scale_init,
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes.NORM,)),
            name=name)
    if kind == "rmsnorm":
        return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                          scale_init=scale_init, name=name)
    raise ValueError(f"norm={kind!r} is unknown; valid: {NORMS}")
