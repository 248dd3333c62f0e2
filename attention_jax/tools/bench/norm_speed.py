"""A residual add and the LayerNorm after it alone, by norm kernel: `python -m
attention_jax.tools.bench norm`.

    python -m attention_jax.tools.bench norm       # GPT-2 small's, 16 x 1024 rows of 768
    python -m attention_jax.tools.bench norm --pallas-settings rows=1,program_rows=16,warps=1

For each norm kernel (layers/norms.py NORM_KERNELS: `xla`, XLA's fusions; `pallas`, the
kernels of layers/norm_kernel.py) it times layers.norms.add_normalize of x, y [rows, D]
with y's projection bias, LayerNorm's scale and bias, in one process: the forward pass
alone, and the forward with its backward given gradients reaching both r = x + y + b
and its norm (as in a pre-norm block, where r goes on along the residual path). Each
figure is the median of `--repeats` timings of `--steps` calls queued back to back and
ended by one wait, after a warm-up call. The table says what one pass through a [rows, D] array takes at the
device's measured copy rate, so a time reads as passes: the forward reads x and y and
writes r and n (4 passes at least), the backward reads the two gradients and r and
writes one (4 more).

`--pallas-settings rows=1,program_rows=16,warps=1 ...` adds a row per launch setting of
the Pallas kernels (`norm_kernel.settings`: rows a program holds at a time, rows a
backward program walks, Triton's warps a program). Compiled for an H100 the defaults'
backward spends about 100 barriers a step (`bench gpu-hlo --kernel-code`); one row and
one warp a step has none. Which is faster only a GPU says; the rows' values and their
gradients' sums of squares say whether each computes the same. A setting whose rows do
not divide `--rows` is an error (add_normalize would take XLA's ops). On a CPU the Pallas
kernels run interpreted (slow: use small `--rows`); the default there is `xla` alone, in
float32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from attention_jax.tools.bench import kernel_bench

# --pallas-settings: each key and norm_kernel.settings' argument it sets
SETTING_KEYS = {"rows": "rows", "program_rows": "program_rows", "warps": "num_warps"}


def parse_settings(text: str) -> dict:
    """`rows=1,warps=1` -> norm_kernel.settings' arguments; a wrong key or value is one
    line naming the valid ones."""
    return kernel_bench.parse_settings(text, SETTING_KEYS)


def _within(given: str):
    """norm_kernel.settings of a row's SETTINGS text ("" for the defaults)."""
    from attention_jax.layers import norm_kernel
    return norm_kernel.settings(**parse_settings(given)) if given else contextlib.nullcontext()


def measure(rows: int, width: int, dtype: str, kernels: list[str], repeats: int, steps: int,
            seed: int = 0) -> dict:
    """{"device", "backend", "rows", "width", "dtype", "array_bytes", "pass_s", "kernels":
    {kernel: {"forward_s", "forward_backward_s", "value", "gradients"}}}."""
    import jax
    import jax.numpy as jnp

    from attention_jax.layers import norm_kernel
    from attention_jax.layers.norms import add_normalize
    from attention_jax.tools.bench.timing import queued_time
    keys = jax.random.split(jax.random.key(seed), 7)
    x, y, dr, dn = (jax.random.normal(k, (rows, width), jnp.float32).astype(dtype)
                    for k in keys[:4])
    y_bias, bias = (0.1 * jax.random.normal(k, (width,), jnp.float32) for k in keys[4:6])
    scale = 1 + 0.1 * jax.random.normal(keys[6], (width,), jnp.float32)
    array_bytes = rows * width * jnp.dtype(dtype).itemsize
    copy = jax.jit(lambda a: a + jnp.asarray(1, dtype))  # reads and writes: two passes
    pass_s = queued_time(copy, (x,), repeats, steps) / 2
    out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "rows": rows, "width": width, "dtype": dtype, "array_bytes": array_bytes,
           "pass_s": pass_s, "kernels": {}}
    for name in kernels:  # before anything is timed: a row the kernels cannot take
        with _within(name.partition(" ")[2]):
            why = norm_kernel.unsupported((rows, width))
        if name.startswith("pallas") and why:  # add_normalize would take XLA's ops instead
            raise SystemExit(f"error: {name!r}: the kernels cannot take [{rows}, {width}]: "
                             f"{why}; valid: --rows a multiple of the rows a program "
                             f"holds (the rows setting, by default 1)")
    for name in kernels:  # "pallas SETTINGS": the kernels traced with those settings
        kernel, _, given = name.partition(" ")

        def forward(x, y, y_bias, scale, bias, kernel=kernel):
            return add_normalize(x, y, y_bias.astype(dtype), scale, bias, kernel=kernel)

        def forward_backward(*args):  # the gradients reaching r (dr) and its norm (dn)
            out, pullback = jax.vjp(forward, *args)
            return out, pullback((dr, dn))
        args = (x, y, y_bias, scale, bias)
        with _within(given):
            (r, n), grads = jax.jit(forward_backward)(*args)
            out["kernels"][name] = {
                "forward_s": queued_time(jax.jit(forward), args, repeats, steps),
                "forward_backward_s": queued_time(jax.jit(forward_backward), args, repeats, steps),
                # what the rows compare: Σ r·dr + n·dn and the gradients' Σ g² (float32)
                "value": float(jnp.vdot(r.astype(jnp.float32), dr.astype(jnp.float32))
                               + jnp.vdot(n.astype(jnp.float32), dn.astype(jnp.float32))),
                "gradients": float(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                       for g in grads))}
            if kernel == "pallas":  # what the kernels took (the defaults adapt to the rows)
                out["kernels"][name]["launch"] = norm_kernel.launch(
                    rows, width, gpu=jax.default_backend() == "gpu")
    return out


def table(result: dict) -> str:
    ms = lambda s: f"{1e3 * s:.3f}"  # noqa: E731
    passes = lambda s: f"{s / result['pass_s']:.1f}"  # noqa: E731
    lines = [f"{result['device']} ({result['backend']}): a residual add and LayerNorm of "
             f"[{result['rows']}, {result['width']}], {result['dtype']}; one pass through "
             f"such an array ({result['array_bytes'] / 1e6:.1f} MB) {ms(result['pass_s'])} ms "
             "(a copy, halved)", "",
             "| norm kernel | forward ms | in passes | forward + backward ms | in passes | value | "
             "Σ gradients² |", "|---|---|---|---|---|---|---|"]
    for name, k in result["kernels"].items():
        if "launch" in k:  # the settings the kernels ran with, given or adapted
            name += " ({rows} rows, backward {program_rows}, {num_warps} warps)".format(**k["launch"])
        lines.append(f"| {name} | {ms(k['forward_s'])} | {passes(k['forward_s'])} | "
                     f"{ms(k['forward_backward_s'])} | {passes(k['forward_backward_s'])} | "
                     f"{k['value']:.4f} | {k['gradients']:.4f} |")
    lines.append("(at the least: 4 passes forward, 8 forward + backward)")
    return "\n".join(lines)


def settings_argument(text: str) -> str:
    """argparse's type for a --pallas-settings setting (checked as the kernels check it)."""
    from attention_jax.layers import norm_kernel
    return kernel_bench.settings_argument(text, SETTING_KEYS, norm_kernel.settings)


def add_parser(sub) -> None:
    p = sub.add_parser("norm", help="a residual add and LayerNorm alone: XLA's fusions "
                                    "against the Pallas norm kernels, and their launch settings",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 1024, help="positions (batch x length)")
    p.add_argument("--width", type=int, default=768, help="D, the features")
    kernel_bench.add_options(p, "norm", "rows=1,program_rows=16,warps=1", settings_argument, steps=20)


def run(args) -> dict:
    from attention_jax.tools.bench.kernel_bench import parse_norm_kernels
    kernels, dtype = kernel_bench.rows_and_dtype(args, "norm", ("rows", "width"),
                                                 parse_norm_kernels)
    print(f"timing the residual add and LayerNorm, kernels {kernels} ...", file=sys.stderr,
          flush=True)
    result = measure(args.rows, args.width, dtype, kernels, args.repeats, args.steps)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result
