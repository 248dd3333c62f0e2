"""A residual add and the LayerNorm (or RMSNorm) after it as one Pallas kernel each way
(Triton on NVIDIA GPUs; interpret mode elsewhere, slow, for tests).

    r, n = add_norm(x, y, y_bias, scale, bias)     # r = x + y + y_bias, n = norm(r)

Why: in a pre-norm block the residual stream goes r = x + attention(...) and then
straight into the MLP's norm, and XLA spends three kernels on it (the add with the row
statistics, their rsqrt, the normalisation: r written and read back) and four or five on
its backward (row sums, the scale's and bias's partial sums, the residual gradient's add).
Compiled for an H100 (`bench gpu-hlo`), GPT-2 small's 24 norms moved about 7 GB a step
that way: 126 MB for each forward at batch 16, 178 for each backward. Here:
  forward   reads x, y (and the bias of the projection that made y: it is added here,
            not in a kernel of its own), writes r, n and two floats a row;
  backward  reads dn, r, the gradient that reached r along the residual path (dr) and the
            row statistics, writes dr + d(norm)/dr once (x's and y's gradient alike) and
            per program partial column sums for the scale's, the bias's and y_bias's
            gradients, summed by XLA after (a few MB).
The row statistics are taken from r as stored (rounded to x's dtype), so the backward
recomputes x̂ from what it reads; the variance is centred, Σ(r - μ)²/D, computed from the
row held in registers. Rows go through a program R at a time, D in pieces of powers of
two (Triton's loads have power-of-two sizes): 768 = 512 + 256.

JAX ships a Triton LayerNorm (jax.experimental.pallas.ops.gpu.layer_norm); it normalises
an x already summed, and its backward reads x and the gradient twice (dx, then the scale's
and bias's sums). The add, the projection's bias and the residual gradient taken in the
same pass are what this module is for.

`add_norm` is for XLA-compiled callers: on several devices it runs under a shard_map over
the rows (the logical rules' batch and length axes); the features D must be whole on
each device. layers/norms.py `add_normalize` chooses between it and XLA's ops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from attention_jax import axes
from attention_jax.attention import ptx
from attention_jax.attention.call import compiling_for_gpu
from attention_jax.kernel_tiles import (Settings, interpret_off_gpu, power_of_two,
                                        power_of_two_pieces, triton_params)
from attention_jax.layers.logical import array_mesh_axes, row_mesh_axes, rows_logical

ROWS = 1           # rows a program holds in registers at a time
PROGRAM_ROWS = 16  # rows a backward program walks (at most: BACKWARD_PROGRAMS)
NUM_WARPS = 1      # Triton's warps a program (more for rows wider than THREAD_ELEMENTS)
# One row in one warp at a time: measured on an H200 at GPT-2 small's [16384, 768] (bench
# norm), forward 0.051 ms and forward + backward 0.123 against 0.062 and 0.138 for 8 rows
# in 4 warps with 64 rows a backward program (the defaults until 2026-11-27). Compiled for
# an H100 (`bench gpu-hlo --kernel-code`) its backward has no barrier and 206 registers
# (8 programs an SM), where 8 rows in 4 warps spread a tile's rows and columns over the
# warps, so both its row and column sums crossed warps (about 100 barriers a step).
# The most elements of a [rows, D] tile a thread holds at a time: by default a program
# takes more warps (up to MOST_WARPS) where a thread would hold more, a row of 4096 two,
# of 8192 four (a setting given stands as given). Compiled for an H100, 8 rows of 1024 in
# 4 warps (64 a thread) take 255 registers a thread in the backward and spill nothing;
# 8 of 1600 (100 a thread) spilled 2456 bytes a thread.
THREAD_ELEMENTS = 64
MOST_WARPS = 32  # Triton's most: 1024 threads a program
# On a GPU a backward program walks fewer rows where PROGRAM_ROWS would make fewer
# programs than this: nine tenths of two on each of an H100's 132 SMs. With 8 rows in 4
# warps, GPT-2 medium at batch 8 (8192 rows) made 128 programs of 64, one an SM where two
# fit; 256 of 32 measured the same on an H200 (0.117 ms forward + backward). With one row
# a warp and 16 rows a program it takes effect below 3792 rows (2048 rows: 256 programs
# of 8).
BACKWARD_PROGRAMS = int(0.9 * 2 * 132)
# The fewest rows a backward program walks by default (the halving above stops there),
# and the fewest `auto` takes the kernels with (layers/norms.py): each program writes
# float32 partial sums of a row each for the scale's, the bias's and y_bias's gradients,
# which at fewer rows a program outweigh the bfloat16 rows themselves (one row a
# program: 6x their bytes). As the defaults of 8 rows a step allowed until 2026-11-27.
MIN_PROGRAM_ROWS = 8
# What the kernels are traced with, unless `settings` says otherwise (bench norm sweeps
# them on a GPU).
SETTINGS = Settings(
    together=lambda now: None if now["program_rows"] >= now["rows"] else (
        f"program_rows={now['program_rows']} with rows={now['rows']}: a backward program "
        f"walks whole steps; valid: program_rows >= rows"),
    rows=(ROWS, power_of_two(1)), program_rows=(PROGRAM_ROWS, power_of_two(1)),
    num_warps=(NUM_WARPS, power_of_two(1)))


def settings(rows: int | None = None, program_rows: int | None = None,
             num_warps: int | None = None):
    """Within (a context manager): the kernels traced take these launch settings instead of
    the defaults (rows a program holds at a time; rows a backward program walks, at least
    as many; Triton's warps a program; powers of two). Read when a kernel is traced. A
    setting given stands as given; the defaults adapt to the rows (`_warps`,
    `_program_rows`)."""
    return SETTINGS.use(rows=rows, program_rows=program_rows, num_warps=num_warps)


@dataclasses.dataclass(frozen=True)
class _Static:
    d: int
    centered: bool
    epsilon: float
    out_dtype: str
    has_y: bool
    has_y_bias: bool
    has_bias: bool
    rows: int          # R: rows per step of a program
    program_rows: int  # backward: rows per program
    num_warps: int
    interpret: bool

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """[(start, size)] of D in descending powers of two."""
        return power_of_two_pieces(self.d)


def _pow2_divisor(m: int, most: int) -> int:
    """The largest power of two <= most that divides m."""
    size = most
    while m % size:
        size //= 2
    return size


def _warps(d: int, rows: int) -> int:
    """Triton's warps a program of `rows` rows of d features takes: the num_warps setting;
    by default (NUM_WARPS) doubled, up to MOST_WARPS, while a thread would hold more than
    THREAD_ELEMENTS."""
    warps = SETTINGS["num_warps"]
    while (not SETTINGS.given("num_warps") and warps < MOST_WARPS
           and rows * d > THREAD_ELEMENTS * 32 * warps):
        warps *= 2
    return warps


def _program_rows(m: int, rows: int, gpu: bool) -> int:
    """The rows a backward program walks of m rows (a multiple of rows): the largest
    power of two up to the program_rows setting that divides m; by default (PROGRAM_ROWS)
    on a GPU halved, down to rows and MIN_PROGRAM_ROWS, while the grid would have fewer
    than BACKWARD_PROGRAMS programs."""
    size = _pow2_divisor(m, SETTINGS["program_rows"])
    fill = gpu and not SETTINGS.given("program_rows")
    while fill and size > max(rows, MIN_PROGRAM_ROWS) and m // size < BACKWARD_PROGRAMS:
        size //= 2
    return size


def launch(m: int, d: int, gpu: bool = True) -> dict:
    """What the kernels take for m rows of d features on each device, under the current
    settings: {"rows": a program's rows at a time, "program_rows": a backward program's,
    "num_warps"} (on a GPU, or interpreted: gpu=False). For a bench to say what ran."""
    rows = SETTINGS["rows"]
    return {"rows": rows, "program_rows": _program_rows(m, rows, gpu),
            "num_warps": _warps(d, rows)}


# ------------------------------------------------------------------------------ kernels
def _row_stats(st: _Static, pieces):
    """(mean, rstd) [R] of a block's rows held as pieces [R, w] float32."""
    f32 = jnp.float32
    if st.centered:
        mean = sum(jnp.sum(p, axis=1) for p in pieces) / st.d
        var = sum(jnp.sum(jnp.square(p - mean[:, None]), axis=1) for p in pieces) / st.d
    else:
        mean = jnp.zeros((pieces[0].shape[0],), f32)
        var = sum(jnp.sum(jnp.square(p), axis=1) for p in pieces) / st.d
    return mean, lax.rsqrt(var + st.epsilon)


def _forward_kernel(*refs, st: _Static):
    refs = list(refs)
    x_ref = refs.pop(0)
    y_ref = refs.pop(0) if st.has_y else None
    yb_ref = refs.pop(0) if st.has_y_bias else None
    scale_ref = refs.pop(0)
    bias_ref = refs.pop(0) if st.has_bias else None
    r_ref = refs.pop(0) if st.has_y else None
    n_ref, mean_ref, rstd_ref = refs
    f32 = jnp.float32

    rs = []
    for start, size in st.pieces:
        cols = pl.ds(start, size)
        r = x_ref[:, cols].astype(f32)
        if y_ref is not None:
            r = r + y_ref[:, cols].astype(f32)
            if yb_ref is not None:
                r = r + yb_ref[cols].astype(f32)[None, :]
            r = r.astype(r_ref.dtype)
            r_ref[:, cols] = r
        rs.append(r.astype(f32))
    mean, rstd = _row_stats(st, rs)
    inline = ptx.lowers_to_triton(st.interpret)
    for (start, size), r in zip(st.pieces, rs):
        cols = pl.ds(start, size)
        xhat = (r - mean[:, None]) * rstd[:, None]
        gamma = scale_ref[cols].astype(f32)[None, :]
        n = (xhat * gamma if bias_ref is None else
             ptx.fma(xhat, gamma, bias_ref[cols].astype(f32)[None, :], inline=inline))
        n_ref[:, cols] = n.astype(n_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _backward_kernel(dn_ref, r_ref, mean_ref, rstd_ref, dr_ref, scale_ref, dx_ref, sums_ref,
                     *, st: _Static):
    f32 = jnp.float32
    widths = [size for _, size in st.pieces]
    inline = ptx.lowers_to_triton(st.interpret)
    # γ once for every step of the loop, as the rows' tiles lay it out ([1, w] each piece)
    gammas = [scale_ref[pl.ds(start, size)].astype(f32)[None, :] for start, size in st.pieces]

    def step(j, sums):
        rows = pl.ds(pl.multiple_of(j * st.rows, st.rows), st.rows)
        mean, rstd = mean_ref[rows], rstd_ref[rows]
        dns, xhats, c1, c2 = [], [], 0.0, 0.0
        for p, (start, size) in enumerate(st.pieces):
            cols = pl.ds(start, size)
            dn = dn_ref[rows, cols].astype(f32)
            xhat = (r_ref[rows, cols].astype(f32) - mean[:, None]) * rstd[:, None]
            g = dn * gammas[p]
            c1 = c1 + jnp.sum(g * xhat, axis=1)
            c2 = c2 + jnp.sum(g, axis=1)
            dns.append(dn)
            xhats.append(xhat)
        c1, c2 = c1 / st.d, c2 / st.d
        ds, db, dyb = sums
        ds, db, dyb = list(ds), list(db), list(dyb)
        for p, (start, size) in enumerate(st.pieces):
            cols = pl.ds(start, size)
            g = dns[p] * gammas[p]
            dx = ptx.fma(xhats[p], -c1[:, None], g, inline=inline)  # g - x̂·c1
            if st.centered:
                dx = dx - c2[:, None]
            dx = ptx.fma(dx, rstd[:, None], dr_ref[rows, cols].astype(f32), inline=inline)
            dx_ref[rows, cols] = dx.astype(dx_ref.dtype)
            ds[p] = ds[p] + jnp.sum(dns[p] * xhats[p], axis=0)
            db[p] = db[p] + jnp.sum(dns[p], axis=0)
            dyb[p] = dyb[p] + jnp.sum(dx, axis=0)
        return tuple(ds), tuple(db), tuple(dyb)

    zeros = tuple(jnp.zeros((w,), f32) for w in widths)
    ds, db, dyb = lax.fori_loop(0, st.program_rows // st.rows, step, (zeros, zeros, zeros))
    for p, (start, size) in enumerate(st.pieces):
        cols = pl.ds(start, size)
        for row, total in enumerate((ds[p], db[p], dyb[p])):
            sums_ref[row, cols] = total


def _forward(st: _Static, x, y, y_bias, scale, bias):
    """(r, n, mean, rstd) of x [M, D] and y [M, D] (and y_bias [D]); without y (n, mean,
    rstd)."""
    m = x.shape[0]
    block = pl.BlockSpec((st.rows, st.d), lambda i: (i, 0))
    vector = pl.BlockSpec((st.d,), lambda i: (0,))
    stat = pl.BlockSpec((st.rows,), lambda i: (i,))
    inputs = [a for a in (x, y, y_bias, scale, bias) if a is not None]
    in_specs = [block] + [block] * st.has_y + [vector] * st.has_y_bias + [vector] + [vector] * st.has_bias
    f32 = jax.ShapeDtypeStruct((m,), jnp.float32)
    out_shape = ([jax.ShapeDtypeStruct(x.shape, x.dtype)] * st.has_y
                 + [jax.ShapeDtypeStruct(x.shape, jnp.dtype(st.out_dtype)), f32, f32])
    out_specs = [block] * st.has_y + [block, stat, stat]
    out = pl.pallas_call(
        functools.partial(_forward_kernel, st=st), grid=(m // st.rows,),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=triton_params(st.num_warps, 1, st.interpret),
        interpret=st.interpret, name="add_norm_forward",
    )(*inputs)
    return tuple(out)


def _backward(st: _Static, dn, r, mean, rstd, dr, scale):
    """(dr + d norm/dr [M, D] in r's dtype, partial sums [G, 3, D] float32 of dn·x̂, dn and
    the former): G = M / program_rows programs, each its rows' column sums. One array of
    the three: XLA sums it in one launch, where three [G, D] took three (`bench gpu-hlo`:
    71 of GPT-2 small's step, against 25)."""
    m = r.shape[0]
    g = m // st.program_rows
    block = pl.BlockSpec((st.program_rows, st.d), lambda i: (i, 0))
    stat = pl.BlockSpec((st.program_rows,), lambda i: (i,))
    vector = pl.BlockSpec((st.d,), lambda i: (0,))
    partial = pl.BlockSpec((None, 3, st.d), lambda i: (i, 0, 0))
    parts = jax.ShapeDtypeStruct((g, 3, st.d), jnp.float32)
    return pl.pallas_call(
        functools.partial(_backward_kernel, st=st), grid=(g,),
        in_specs=[block, block, stat, stat, block, vector],
        out_specs=[block, partial],
        out_shape=[jax.ShapeDtypeStruct(r.shape, r.dtype), parts],
        compiler_params=triton_params(st.num_warps, 1, st.interpret),
        interpret=st.interpret, name="add_norm_backward",
    )(dn, r, mean, rstd, dr.astype(r.dtype), scale)


# ----------------------------------------------------------------- the differentiable op
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _add_norm(st, x, y, y_bias, scale, bias):
    return _add_norm_fwd(st, x, y, y_bias, scale, bias)[0]


def _add_norm_fwd(st, x, y, y_bias, scale, bias):
    out = _on_rows(functools.partial(_forward, st), (x, y), (y_bias, scale, bias))
    r, n, mean, rstd = out if st.has_y else (x, *out)
    return (r, n), (r, mean, rstd, scale, bias, y, y_bias)


def _add_norm_bwd(st, residuals, cotangents):
    r, mean, rstd, scale, bias, y, y_bias = residuals
    dr, dn = cotangents
    dx, parts = _on_rows(functools.partial(_backward, st), (dn, r, mean, rstd, dr), (scale,),
                         partial_sums=1)
    dscale, dbias, dyb = parts.sum(0)  # one launch; in a step the optimizer's reads of
    # its three rows fuse with each other, where three [G, D] sums kept apart did not
    total = lambda p, like: None if like is None else p.astype(like.dtype)  # noqa: E731
    return (dx, None if y is None else dx.astype(y.dtype), total(dyb, y_bias),
            total(dscale, scale), total(dbias, bias))


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


def _on_rows(fn, rows, vectors, partial_sums: int = 0):
    """fn(*rows, *vectors) of loose rows: `rows` ([..., D] or the statistics [...]; None
    allowed) flattened to [M, ...], `vectors` ([D] or None) whole; its outputs, [M, ...]
    but for the last `partial_sums` ([G, ...]), have the rows' leading axes given back.
    Under a mesh each device runs it on its own rows: a shard_map splitting the leading
    axes as the logical rules split batch (axis 0) and length (axis 1); the partial sums'
    G axis is then the devices' G's one after another. (Told apart by position, not
    shape: a [G, ...] may have [B, T, ...]'s shape.)"""
    lead = rows[0].shape[:-1]
    is_sum = lambda i, out: i >= len(out) - partial_sums  # noqa: E731

    def local(rows, vectors):
        m = math.prod(rows[0].shape[:-1])
        flat = [None if a is None else a.reshape(m, *a.shape[len(lead):]) for a in rows]
        out = fn(*flat, *vectors)
        return tuple(a if is_sum(i, out) else a.reshape(*rows[0].shape[:-1], *a.shape[1:])
                     for i, a in enumerate(out))

    split = _split(lead)
    if split is None:
        return local(rows, vectors)
    mesh = jax.sharding.get_abstract_mesh()
    row_spec = lambda a: None if a is None else P(*split[:a.ndim])  # noqa: E731
    out = jax.eval_shape(local, rows, vectors)
    out_specs = tuple(P(tuple(n for names in split if names for n in names))
                      if is_sum(i, out) else P(*split[:a.ndim]) for i, a in enumerate(out))
    return jax.shard_map(local, mesh=mesh, in_specs=(tuple(map(row_spec, rows)), tuple(
        None if v is None else P() for v in vectors)), out_specs=out_specs,
        check_vma=False)(rows, vectors)


def _split(lead) -> tuple | None:
    """The mesh axes that split each leading axis (batch, length, then none) of an
    activation [*lead, D], and None for D; None when nothing splits (no mesh, one device,
    no rules)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    split = row_mesh_axes(len(lead))
    return None if not any(split) else tuple(s or None for s in split) + (None,)


def features_split(ndim: int) -> tuple[str, ...]:
    """The mesh axes the rules split an activation's features D over (() when whole)."""
    return array_mesh_axes((*rows_logical(ndim - 1), axes.EMBED))[-1]


def gathers_rows(x_shape) -> bool:
    """Whether several devices would each get the whole of an x [..., D] of this shape:
    a mesh of several devices whose rules split none of its rows, or several devices and
    no mesh (XLA gathers a Pallas call's operands onto every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.device_count() > 1 and not compiling_for_gpu()
    return mesh.size > 1 and _split(tuple(x_shape[:-1])) is None


def rows_per_device(lead) -> int:
    """The rows ([..., D]'s leading axes' product) each device holds under the mesh."""
    split = _split(lead) or ()
    mesh = jax.sharding.get_abstract_mesh()
    m = math.prod(lead)
    for names in split:
        if names:
            m //= math.prod(mesh.shape[a] for a in names)
    return m


def unsupported(x_shape) -> str | None:
    """Why add_norm cannot take an x [..., D] of this shape here (None: it can)."""
    lead = x_shape[:-1]
    split = _split(lead) or ()
    mesh = jax.sharding.get_abstract_mesh()
    for size, names in zip(lead, split):
        if names and size % math.prod(mesh.shape[a] for a in names):
            return f"a leading axis of {size} does not divide over mesh axes {names}"
    m, rows = rows_per_device(lead), SETTINGS["rows"]
    if m % rows:
        return f"{m} rows per device, not a multiple of {rows}"
    if features_split(len(x_shape)):
        return f"the mesh splits the features D over {features_split(len(x_shape))}"
    return None


def add_norm(x, y=None, y_bias=None, scale=None, bias=None, *, centered: bool = True,
             epsilon: float = 1e-6, dtype=None, interpret=None):
    """(r, n): r = x + y + y_bias (x itself without y), n = LayerNorm (centered) or RMSNorm
    of r over its last axis with scale [D] (and bias [D]), in `dtype` (default x's).

    x, y [..., D] of one dtype (r's); y_bias [D] or None; the rows (the leading axes'
    product) a multiple of the rows a program holds (the rows setting, by default 1) on
    each device. Differentiable in every array argument; the
    backward takes the gradients reaching r (along the residual path) and n in one kernel.
    interpret: None = on a CPU or TPU (the kernels compile for NVIDIA GPUs only)."""
    if scale is None or scale.shape != x.shape[-1:]:
        raise ValueError(f"scale has shape {None if scale is None else scale.shape}; "
                         f"valid: [D] = {x.shape[-1:]}")
    for name, v in (("bias", bias), ("y_bias", y_bias)):
        if v is not None and v.shape != x.shape[-1:]:
            raise ValueError(f"{name} has shape {v.shape}; valid: [D] = {x.shape[-1:]} or None")
    if y is not None and (y.shape != x.shape or y.dtype != x.dtype):
        raise ValueError(f"y is {y.dtype}{list(y.shape)}; valid: x's shape and dtype, "
                         f"{x.dtype}{list(x.shape)}")
    if y is None and y_bias is not None:
        raise ValueError("y_bias without y: valid only with y (the bias of y's projection)")
    if x.ndim < 2:
        raise ValueError(f"x has shape {x.shape}; valid: [..., D] with leading axes")
    why = unsupported(x.shape)
    if why:
        raise ValueError(f"add_norm cannot take x {x.shape} here: {why}")
    m = rows_per_device(x.shape[:-1])
    interpret = interpret_off_gpu(interpret)
    # program_rows >= rows (Settings' rule) and m a multiple of rows (unsupported's):
    # the divisor is a whole number of steps
    use = launch(m, x.shape[-1], gpu=not interpret)
    rows, program_rows = use["rows"], use["program_rows"]
    st = _Static(d=x.shape[-1], centered=bool(centered), epsilon=float(epsilon),
                 out_dtype=jnp.dtype(dtype or x.dtype).name, has_y=y is not None,
                 has_y_bias=y_bias is not None, has_bias=bias is not None, rows=rows,
                 program_rows=program_rows, num_warps=use["num_warps"],
                 interpret=interpret)
    return _add_norm(st, x, y, y_bias, scale, bias)
