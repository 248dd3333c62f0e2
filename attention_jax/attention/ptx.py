"""Exponentials and multiply-adds in the Pallas kernels as PTX, where they lower for Triton
on an NVIDIA GPU (attention/pallas.py, models/loss_kernel.py, layers/norm_kernel.py).

    y = exp2_fma(x, c, a, inline=lowers_to_triton(interpret))   # exp2(x·c + a)
    y = fma(a, b, c, inline=...)                                 # a·b + c, rounded once

A softmax takes exp(x - m) of every score or logit; on a GPU that is exp2(x·log₂e - m·log₂e),
one multiply-add and one exp2. Written in jnp, Triton makes more of it, as the H100's SASS
shows (ptxas and nvdisasm on the PTX that `bench gpu-hlo` compiles, no GPU needed):
  - the multiply and the add stay two instructions: Triton's PTX gives each an explicit
    rounding (`mul.rn.f32`, `sub.rn.f32`), and PTX forbids ptxas to fuse those;
  - exp2 becomes MUFU.EX2 with a compare and two predicated multiplies around it, which
    make results below 2⁻¹²⁶ come out as denormals instead of zero;
  - exp (loss_kernel's, through libdevice's expf) is seven instructions.
Here the two are written as PTX (`fma.rn.ftz.f32`, `ex2.approx.ftz.f32`): FFMA and MUFU.EX2.
The first point holds for any product that feeds a sum in a kernel: `fma` writes one
`fma.rn.f32`, an FFMA, where Triton's PTX keeps a `mul.rn` and an `add.rn` (the norm
kernels' x̂·γ + β, g - x̂·c₁ and dx·rstd + dr; a product summed by a reduction stays a
multiply, the reduction's adds being Triton's).
Flushing a result below 2⁻¹²⁶ to zero changes no softmax: with the row max as the shift
the row's largest term is 1, and with its log-sum-exp the terms are the probabilities
themselves, which sum to 1; a term that small is nothing beside either.

Elsewhere (interpret mode on a CPU, which is how the tests run the kernels, and Mosaic on
a TPU) the same function is jnp's exp2(x * c + a), and so it is on a GPU too with the
environment variable ATTENTION_JAX_INLINE_PTX=0 (for an A/B of the two, or a way out
should a GPU disagree; read when a kernel is traced).
"""

from __future__ import annotations

import os
import struct

import jax
import jax.numpy as jnp

from attention_jax.attention.call import target_backend

# `$1·c + $2` rounded once, then its exp2; c goes in as PTX's float32 literal.
_FMA_EXP2 = "{{ .reg .f32 t; fma.rn.ftz.f32 t, $1, {c}, $2; ex2.approx.ftz.f32 $0, t; }}"


def lowers_to_triton(interpret: bool) -> bool:
    """A kernel traced now with this `interpret` lowers for Triton (an NVIDIA GPU's), and
    may write PTX (unless ATTENTION_JAX_INLINE_PTX=0)."""
    return (not interpret and target_backend() == "gpu"
            and os.environ.get("ATTENTION_JAX_INLINE_PTX", "1") != "0")


def float32_literal(c: float) -> str:
    """PTX's float32 literal of c: 0f and its bits in hex (0.5 -> 0f3F000000)."""
    return "0f" + struct.pack(">f", c).hex().upper()


def exp2_fma(x, c: float, a, *, inline: bool):
    """exp2(x·c + a) of a float32 array x, a float32 array a broadcast against it and a
    Python float c. inline: write it as PTX for Triton (the module's text: one FFMA and
    one MUFU.EX2 a value, results below 2⁻¹²⁶ flushed to zero); else jnp's."""
    a = jnp.broadcast_to(a, x.shape).astype(x.dtype)
    if not inline or x.dtype != jnp.float32:
        return jnp.exp2(x * c + a)
    from jax.experimental.pallas import triton as plgpu  # only meaningful when lowering to Triton
    (y,) = plgpu.elementwise_inline_asm(
        _FMA_EXP2.format(c=float32_literal(c)), args=[x, a], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


_FMA = "fma.rn.f32 $0, $1, $2, $3;"


def fma(a, b, c, *, inline: bool):
    """a·b + c of arrays broadcast to one shape. inline (lowering for Triton, float32):
    one `fma.rn.f32`, rounded once; else jnp's a * b + c."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
    dtype = jnp.result_type(a, b, c)
    if not inline or dtype != jnp.float32:
        return a * b + c
    from jax.experimental.pallas import triton as plgpu  # only meaningful when lowering to Triton
    (y,) = plgpu.elementwise_inline_asm(
        _FMA, args=[jnp.broadcast_to(x, shape).astype(dtype) for x in (a, b, c)],
        constraints="=f,f,f,f", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])
    return y
