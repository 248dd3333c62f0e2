"""Cross-entropy statistics of a logits row in one pass through memory: Pallas kernels
(Triton on NVIDIA GPUs; interpret mode elsewhere, slow, for tests).

    lse, target_z, sum_z, first_max = row_statistics(logits, targets)        # logits [M, V]
    (lse, ...), dz = row_statistics_and_gradient(logits, targets, scale, smoothing)

Why a kernel: the logits are the largest tensor of a language model's step (GPT-2 small
at 16 × 1024: [16384, 50304], 1.65 GB in bfloat16), so the loss costs what its passes
through them cost. XLA needs two passes for the statistics (the row max, then Σ exp(z -
max)): a reduction's result cannot feed another reduction over the same data in one
kernel, and its one-pass alternative (a variadic reduction carrying the running max)
takes two exponentials per element and is compute-bound (losses.py). Here one program
walks one row a chunk at a time with the online softmax (Milakov & Gimelshein 2018, as
in FlashAttention): per chunk one exponential per element and one rescale of the running
sum, so the statistics read the row once. `row_statistics_and_gradient` then walks the
row a second time, while the program's own row may still sit in the L2 cache, and writes
dz = (softmax(z) - q)·scale over the logits in place (q the target distribution after
label smoothing ε: (1-ε)·onehot + ε/V): the forward and backward passes of the loss read
the logits twice and write them once, where XLA reads them three times and writes once.

Per row the kernels return float32 lse = log Σ exp(z), the target's logit, Σ z (for label
smoothing) and int32 the first index of the largest logit (the argmax `cross_entropy`'s
accuracy counts). Any V: the row goes in chunks of `CHUNK` and its remainder in pieces of
the powers of two that sum to it (Triton's loads have power-of-two sizes), no masks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attention_jax.kernel_tiles import interpret_off_gpu, power_of_two_pieces, triton_params

CHUNK = 4096  # logits a program loads at a time: 8 KiB of bfloat16, 16 per thread of 8 warps
NUM_WARPS = 8
# Triton's pipelining depth for the loop. Loads that feed no matmul are not staged
# through shared memory (the PTX compiled for an H100 on the CPU host has no cp.async,
# its loads are 16-byte vectors): the programs resident on an SM keep its memory busy.
NUM_STAGES = 3
# What the kernels are traced with, unless `settings` says otherwise (bench loss sweeps
# them on a GPU): how many programs share an SM, and so whether a program's row is still
# in the L2 cache when the gradient reads it again, depends on the warps a program has.
_SETTINGS = {"chunk": CHUNK, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}


@contextlib.contextmanager
def settings(chunk: Optional[int] = None, num_warps: Optional[int] = None,
             num_stages: Optional[int] = None):
    """Within: the kernels traced take these launch settings instead of the defaults
    (chunk: a power of two >= 16, logits loaded at a time; Triton's warps and stages)."""
    given = {"chunk": chunk, "num_warps": num_warps, "num_stages": num_stages}
    for name, value in given.items():
        if value is not None and (not isinstance(value, int) or value < 1 or (
                name == "chunk" and (value < 16 or value & (value - 1)))):
            raise ValueError(f"{name}={value!r}; valid: " + (
                "a power of two >= 16" if name == "chunk" else "an int >= 1"))
    before = dict(_SETTINGS)
    _SETTINGS.update({k: v for k, v in given.items() if v is not None})
    try:
        yield
    finally:
        _SETTINGS.update(before)


def _params(interpret: bool):
    return triton_params(_SETTINGS["num_warps"], _SETTINGS["num_stages"], interpret)


def _pieces(v: int, chunk: int) -> tuple[int, list[tuple[int, int]]]:
    """(full chunks, [(start, size)] of the remainder in descending powers of two)."""
    n = v // chunk
    return n, power_of_two_pieces(v - n * chunk, start=n * chunk)


def _walk(v: int, chunk: int, visit, carry):
    """carry = visit(start, size, carry) over the row's chunks, then its remainder pieces."""
    n, pieces = _pieces(v, chunk)
    if n:
        def body(j, c):
            return visit(pl.multiple_of(j * chunk, chunk), chunk, c)
        carry = lax.fori_loop(0, n, body, carry)
    for start, size in pieces:
        carry = visit(start, size, carry)
    return carry


def _statistics(z_ref, t, v: int, chunk: int):
    """(lse, target_z, sum_z, first_max) of the row z_ref [V], t its target (a scalar)."""
    f32 = jnp.float32

    def visit(start, size, carry):
        m, s, tz, sz, first = carry
        z = z_ref[pl.ds(start, size)].astype(f32)
        idx = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
        chunk_max = jnp.max(z)
        m_new = jnp.maximum(m, chunk_max)
        # A row or chunk of -inf (masked logits) must not make inf - inf: exponentials
        # are taken against a finite stand-in for the max, and add exactly 0.
        pivot = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s = s * jnp.exp(m - pivot) + jnp.sum(jnp.exp(z - pivot))
        tz = tz + jnp.sum(jnp.where(idx == t, z, 0.0))
        sz = sz + jnp.sum(z)
        # The first index of the row's max: a later chunk replaces it only when larger.
        chunk_first = jnp.min(jnp.where(z == chunk_max, idx, v))
        first = jnp.where(chunk_max > m, chunk_first, first)
        return m_new, s, tz, sz, first

    zero = jnp.zeros((), f32)
    m, s, tz, sz, first = _walk(v, chunk, visit, (jnp.full((), -jnp.inf, f32), zero, zero,
                                                  zero, jnp.zeros((), jnp.int32)))
    return m + jnp.log(s), tz, sz, first


def _store_row(refs, values):
    for ref, x in zip(refs, values):
        ref[...] = jnp.reshape(x, (1,)).astype(ref.dtype)


def _statistics_kernel(z_ref, t_ref, lse_ref, tz_ref, sz_ref, first_ref, *, v, chunk):
    t = t_ref[0]
    _store_row((lse_ref, tz_ref, sz_ref, first_ref), _statistics(z_ref, t, v, chunk))


def _gradient_kernel(z_ref, t_ref, scale_ref, lse_ref, tz_ref, sz_ref, first_ref, dz_ref, *,
                     v, chunk, smoothing):
    t, scale = t_ref[0], scale_ref[0]
    stats = _statistics(z_ref, t, v, chunk)
    _store_row((lse_ref, tz_ref, sz_ref, first_ref), stats)
    lse = stats[0]

    def visit(start, size, carry):  # dz = (softmax(z) - q)·scale, over the logits (aliased)
        z = z_ref[pl.ds(start, size)].astype(jnp.float32)
        idx = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
        q = jnp.where(idx == t, 1.0 - smoothing, 0.0) + smoothing / v
        dz_ref[pl.ds(start, size)] = ((jnp.exp(z - lse) - q) * scale).astype(dz_ref.dtype)
        return carry

    _walk(v, chunk, visit, 0)


def _row_specs(v: int):
    row = pl.BlockSpec((None, v), lambda i: (i, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    return row, one


def _stat_shapes(m: int):
    f32 = jax.ShapeDtypeStruct((m,), jnp.float32)
    return [f32, f32, f32, jax.ShapeDtypeStruct((m,), jnp.int32)]


def _check(logits, targets, scale=None):
    if logits.ndim != 2:
        raise ValueError(f"logits has shape {logits.shape}; valid: [M, V] (2 axes)")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets has shape {targets.shape}; valid: [M] = {logits.shape[:1]}")
    if scale is not None and scale.shape != logits.shape[:1]:
        raise ValueError(f"scale has shape {scale.shape}; valid: [M] = {logits.shape[:1]}")


def row_statistics(logits, targets, *, chunk: Optional[int] = None, interpret=None):
    """(lse, target_z, sum_z [M] float32, first_max [M] int32) of logits [M, V] (any
    float dtype, read once) against targets [M] ints. interpret: None = on a CPU or TPU
    (Triton's kernels compile for NVIDIA GPUs only)."""
    _check(logits, targets)
    m, v = logits.shape
    interpret = interpret_off_gpu(interpret)
    row, one = _row_specs(v)
    return pl.pallas_call(
        functools.partial(_statistics_kernel, v=v,
                          chunk=_SETTINGS["chunk"] if chunk is None else chunk),
        grid=(m,), in_specs=[row, one], out_specs=[one] * 4, out_shape=_stat_shapes(m),
        compiler_params=_params(interpret), interpret=interpret,
        name="cross_entropy_statistics",
    )(logits, targets.astype(jnp.int32))


def row_statistics_and_gradient(logits, targets, scale, smoothing: float = 0.0, *,
                                chunk: Optional[int] = None, interpret=None):
    """(row_statistics(logits, targets), dz [M, V] in logits' dtype): dz = (softmax(z) -
    q)·scale per row, written over the logits' buffer (XLA copies them first only where
    they are still used after). scale [M] float32: the row's weight in the loss (0 for
    padding)."""
    _check(logits, targets, scale)
    m, v = logits.shape
    interpret = interpret_off_gpu(interpret)
    row, one = _row_specs(v)
    *stats, dz = pl.pallas_call(
        functools.partial(_gradient_kernel, v=v,
                          chunk=_SETTINGS["chunk"] if chunk is None else chunk,
                          smoothing=float(smoothing)),
        grid=(m,), in_specs=[row, one, one], out_specs=[one] * 4 + [row],
        out_shape=_stat_shapes(m) + [jax.ShapeDtypeStruct(logits.shape, logits.dtype)],
        input_output_aliases={0: 4},
        compiler_params=_params(interpret), interpret=interpret,
        name="cross_entropy_gradient",
    )(logits, targets.astype(jnp.int32), scale.astype(jnp.float32))
    return tuple(stats), dz
