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
label smoothing ε: (1-ε)·onehot + ε/V), from the row's end back to its start (the chunks
read last first, while they are likeliest still cached): the forward and backward passes
of the loss read the logits twice and write them once, where XLA reads them three times
and writes once. What stays cached is said to the cache: the first pass loads with the
L2's evict_last priority, the second loads and stores with evict_first (PTX's cache
eviction priorities; the L2 otherwise keeps what was touched last, which is the second
pass's own reads and writes, used no more).

Per row the kernels return float32 lse = log Σ exp(z), the target's logit, Σ z (only with
label smoothing, which needs it) and int32 the first index of the largest logit (the
argmax `cross_entropy`'s accuracy counts). Any V: the row goes in chunks of `CHUNK` and
its remainder in pieces of the powers of two that sum to it (Triton's loads have
power-of-two sizes), no masks.

What a logit costs besides its load is kept to what the softmax needs, because at GPT-2's
size (824 M logits a step) the instructions weigh as much as the bytes. Compiled for an
H100 (`bench gpu-hlo --kernel-code`: SASS instructions in each loop), the kernels took 44
SASS instructions a logit, 1.08 ms a step at the H100's issue rate (one warp instruction
a cycle on each of its 528 schedulers) against 0.98 ms for the bytes at 3.35 TB/s; now
16 (0.40 ms) when the branches below are not taken. A chunk takes two block reductions
(its max and Σ exp; each is a round of shuffles and a barrier), each exponential is one
FFMA and one MUFU.EX2 (attention/ptx.py), the target's logit is one load after the loop,
the first index of the max is looked for only in a chunk whose max beats every earlier
one, and the gradient compares indices only in the chunk that holds the target (both
under a `cond`, whose branch all of a program's threads take alike).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from attention_jax.attention import ptx
from attention_jax.kernel_tiles import (AT_LEAST_1, Settings, interpret_off_gpu, power_of_two,
                                        power_of_two_pieces, triton_params)

CHUNK = 4096  # logits a program loads at a time: 8 KiB of bfloat16, 16 per thread of 8 warps
NUM_WARPS = 8
LOG2_E = math.log2(math.e)
# Triton's pipelining depth for the loop. Loads that feed no matmul are not staged
# through shared memory (the PTX compiled for an H100 on the CPU host has no cp.async,
# its loads are 16-byte vectors): the programs resident on an SM keep its memory busy.
NUM_STAGES = 3
# What the kernels are traced with, unless `settings` says otherwise (bench loss sweeps
# them on a GPU): how many programs share an SM, and so whether a program's row is still
# in the L2 cache when the gradient reads it again, depends on the warps a program has.
# The gradient kernel's L2 eviction priorities (the module's text): 1 on, 0 off (the
# cache's default for every load and store), for an A/B on a GPU.
CACHE_HINTS = 1
SETTINGS = Settings(chunk=(CHUNK, power_of_two(16)), num_warps=(NUM_WARPS, power_of_two(1)),
                    num_stages=(NUM_STAGES, AT_LEAST_1),  # Triton takes warps in powers of two
                    cache_hints=(CACHE_HINTS, ((lambda v: v in (0, 1)), "0 or 1")))


def settings(chunk: Optional[int] = None, num_warps: Optional[int] = None,
             num_stages: Optional[int] = None, cache_hints: Optional[int] = None):
    """Within (a context manager): the kernels traced take these launch settings instead
    of the defaults (chunk: a power of two >= 16, logits loaded at a time; Triton's warps
    and stages; cache_hints 1 or 0, the gradient kernel's L2 eviction priorities or the
    cache's default). Read when a kernel is traced."""
    return SETTINGS.use(chunk=chunk, num_warps=num_warps, num_stages=num_stages,
                        cache_hints=cache_hints)


def _params(interpret: bool):
    return triton_params(SETTINGS["num_warps"], SETTINGS["num_stages"], interpret)


def _pieces(v: int, chunk: int) -> tuple[int, list[tuple[int, int]]]:
    """(full chunks, [(start, size)] of the remainder in descending powers of two)."""
    n = v // chunk
    return n, power_of_two_pieces(v - n * chunk, start=n * chunk)


def _walk(v: int, chunk: int, visit, carry, backward: bool = False):
    """carry = visit(start, size, carry) over the row's chunks, then its remainder pieces;
    `backward`: the same visits in the opposite order, from the row's end to its start."""
    n, pieces = _pieces(v, chunk)

    def body(j, c):
        return visit(pl.multiple_of((n - 1 - j if backward else j) * chunk, chunk), chunk, c)
    if backward:
        for start, size in reversed(pieces):
            carry = visit(start, size, carry)
    if n:
        carry = lax.fori_loop(0, n, body, carry)
    if not backward:
        for start, size in pieces:
            carry = visit(start, size, carry)
    return carry


def _statistics(z_ref, t, v: int, chunk: int, sums: bool, inline: bool, eviction=None):
    """(lse, target_z, sum_z (0 unless sums), first_max) of the row z_ref [V], t its
    target (a scalar). inline: the exponentials as PTX (attention/ptx.py); eviction: the
    loads' L2 eviction priority (None: the cache's default)."""
    f32 = jnp.float32

    def visit(start, size, carry):
        m, s, sz, first = carry
        z = plgpu.load(z_ref.at[pl.ds(start, size)], eviction_policy=eviction).astype(f32)
        chunk_max = jnp.max(z)
        m_new = jnp.maximum(m, chunk_max)
        # A row or chunk of -inf (masked logits) must not make inf - inf: exponentials
        # are taken against a finite stand-in for the max, and add exactly 0.
        pivot = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        s = s * jnp.exp(m - pivot) + jnp.sum(
            ptx.exp2_fma(z, LOG2_E, -pivot * LOG2_E, inline=inline))  # Σ exp(z - pivot)
        if sums:
            sz = sz + jnp.sum(z)
        # The first index of the row's max, looked for only in a chunk whose max beats
        # every earlier one (after the first few chunks, seldom): a later chunk replaces
        # it only when larger. The row's first load always looks and keeps what it found
        # where its max is larger than -inf (a branch there would yield the initial
        # constant, which Triton's lowering of a branch cannot).
        def look(z):
            return start + jnp.min(jnp.where(z == chunk_max, lax.iota(jnp.int32, size), size))
        if isinstance(start, int) and start == 0:
            first = jnp.where(chunk_max > m, look(z), first)
        else:
            first = lax.cond(chunk_max > m, lambda z, first: look(z), lambda z, first: first,
                             z, first)
        return m_new, s, sz, first

    zero = jnp.zeros((), f32)
    m, s, sz, first = _walk(v, chunk, visit, (jnp.full((), -jnp.inf, f32), zero, zero,
                                              jnp.zeros((), jnp.int32)))
    # The target's logit: one load (0 for a target outside [0, V), as a row of padding has).
    valid = (t >= 0) & (t < v)
    tz = jnp.where(valid, jnp.sum(z_ref[pl.ds(jnp.clip(t, 0, v - 1), 1)].astype(f32)), 0.0)
    return m + jnp.log(s), tz, sz, first  # sz: 0 unless sums


def _store_row(refs, values):
    for ref, x in zip(refs, values):
        ref[...] = jnp.reshape(x, (1,)).astype(ref.dtype)


def _statistics_kernel(z_ref, t_ref, lse_ref, tz_ref, sz_ref, first_ref, *, v, chunk, sums,
                       inline):
    _store_row((lse_ref, tz_ref, sz_ref, first_ref),
               _statistics(z_ref, t_ref[0], v, chunk, sums, inline))


def _gradient_kernel(z_ref, t_ref, scale_ref, lse_ref, tz_ref, sz_ref, first_ref, dz_ref, *,
                     v, chunk, smoothing, inline, hints):
    t, scale = t_ref[0], scale_ref[0]
    sums = smoothing != 0
    # L2 priorities (the module's text): keep the statistics' reads, drop the second's.
    keep, drop = ("evict_last", "evict_first") if hints else (None, None)
    stats = _statistics(z_ref, t, v, chunk, sums, inline, eviction=keep)
    _store_row((lse_ref, tz_ref, sz_ref, first_ref), stats)
    shift = -stats[0] * LOG2_E
    # dz = (softmax(z) - q)·scale with q = (1-ε)·onehot(t) + ε/V: every logit's
    # softmax·scale less (ε/V)·scale, and the target's (1-ε)·scale more besides.
    spread, hit = smoothing / v * scale, (1.0 - smoothing) * scale

    def visit(start, size, carry):  # over the logits (aliased)
        z = plgpu.load(z_ref.at[pl.ds(start, size)], eviction_policy=drop).astype(jnp.float32)
        dz = ptx.exp2_fma(z, LOG2_E, shift, inline=inline) * scale
        if sums:
            dz = dz - spread
        # Only the chunk that holds the target compares indices.
        dz = lax.cond((t >= start) & (t < start + size),
                      lambda dz: jnp.where(lax.iota(jnp.int32, size) == t - start, dz - hit, dz),
                      lambda dz: dz, dz)
        plgpu.store(dz_ref.at[pl.ds(start, size)], dz.astype(dz_ref.dtype),
                    eviction_policy=drop)
        return carry

    # The row again from its end: what the statistics read last is likeliest still in the
    # L2 cache. Read in the same order, each chunk would be the one longest out of use,
    # the first to go when the rows in flight outgrow the cache (GPT-2's 528 rows of 100
    # KB on an H100 are 50.7 MiB, its whole L2: README, "What an SM holds").
    _walk(v, chunk, visit, 0, backward=True)


def _row_specs(v: int):
    row = pl.BlockSpec((None, v), lambda i: (i, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    return row, one


def _stat_shapes(m: int):
    f32 = jax.ShapeDtypeStruct((m,), jnp.float32)
    return [f32, f32, f32, jax.ShapeDtypeStruct((m,), jnp.int32)]


def _stats_out(stats, sums: bool):
    """The kernel's row outputs as (lse, target_z, sum_z, first_max), sum_z None unless
    summed (the kernel writes 0 there)."""
    lse, tz, sz, first = stats
    return lse, tz, sz if sums else None, first


def _check(logits, targets, scale=None):
    if logits.ndim != 2:
        raise ValueError(f"logits has shape {logits.shape}; valid: [M, V] (2 axes)")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets has shape {targets.shape}; valid: [M] = {logits.shape[:1]}")
    if scale is not None and scale.shape != logits.shape[:1]:
        raise ValueError(f"scale has shape {scale.shape}; valid: [M] = {logits.shape[:1]}")


def row_statistics(logits, targets, *, sums: bool = True, chunk: Optional[int] = None,
                   interpret=None):
    """(lse, target_z, sum_z [M] float32, first_max [M] int32) of logits [M, V] (any
    float dtype, read once) against targets [M] ints; sum_z (what label smoothing needs)
    is None unless `sums`. interpret: None = on a CPU or TPU (Triton's kernels compile
    for NVIDIA GPUs only)."""
    _check(logits, targets)
    m, v = logits.shape
    interpret = interpret_off_gpu(interpret)
    row, one = _row_specs(v)
    stats = pl.pallas_call(
        functools.partial(_statistics_kernel, v=v,
                          chunk=SETTINGS["chunk"] if chunk is None else chunk, sums=sums,
                          inline=ptx.lowers_to_triton(interpret)),
        grid=(m,), in_specs=[row, one], out_specs=[one] * 4, out_shape=_stat_shapes(m),
        compiler_params=_params(interpret), interpret=interpret,
        name="cross_entropy_statistics",
    )(logits, targets.astype(jnp.int32))
    return _stats_out(stats, sums)


def row_statistics_and_gradient(logits, targets, scale, smoothing: float = 0.0, *,
                                chunk: Optional[int] = None, interpret=None):
    """(row_statistics(logits, targets), dz [M, V] in logits' dtype): dz = (softmax(z) -
    q)·scale per row, written over the logits' buffer (XLA copies them first only where
    they are still used after). scale [M] float32: the row's weight in the loss (0 for
    padding). sum_z is computed only with label smoothing (else None)."""
    _check(logits, targets, scale)
    m, v = logits.shape
    interpret = interpret_off_gpu(interpret)
    row, one = _row_specs(v)
    sums = float(smoothing) != 0
    *stats, dz = pl.pallas_call(
        functools.partial(_gradient_kernel, v=v,
                          chunk=SETTINGS["chunk"] if chunk is None else chunk,
                          smoothing=float(smoothing), inline=ptx.lowers_to_triton(interpret),
                          hints=bool(SETTINGS["cache_hints"])),
        grid=(m,), in_specs=[row, one, one], out_specs=[one] * 4 + [row],
        out_shape=_stat_shapes(m) + [jax.ShapeDtypeStruct(logits.shape, logits.dtype)],
        input_output_aliases={0: 4},
        compiler_params=_params(interpret), interpret=interpret,
        name="cross_entropy_gradient",
    )(logits, targets.astype(jnp.int32), scale.astype(jnp.float32))
    return _stats_out(stats, sums), dz
