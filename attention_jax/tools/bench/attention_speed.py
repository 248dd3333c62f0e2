"""The attention benchmark: `python -m attention_jax.tools.bench attention [--quick]`.

Times scaled dot-product attention, B=1, 8 heads, head dim 64, float32, over
sequence lengths N, causal and not: forward and forward+backward (median of repeated
runs after a warm-up) and XLA's compiled temp memory, for our reference and blockwise
paths, jax.nn.dot_product_attention (XLA), and PyTorch's CPU
`scaled_dot_product_attention` (a fused flash-style kernel) when torch is installed,
all on the same thread count (on a GPU or TPU: `attention_speed_gpu.py`, bf16, the fused
kernels side by side). It also measures this machine's float32 matmul rate, so
the blockwise forward's FLOP rate can be read as a fraction of what the hardware does.
"""

from __future__ import annotations

import argparse

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from attention_jax.attention import dot_product_attention
from attention_jax.tools.bench import attention_speed_gpu
from attention_jax.tools.bench.timing import (available_memory_bytes, cpu_vector_isa,
                                              installed, matmul_rate, median_time,
                                              say_ignored_on_cpu)

HEADS, HEAD_DIM = 8, 64
JAX_IMPLS = ("reference", "xla", "blockwise")


def attention_flops(n: int, causal: bool) -> float:
    """4·B·N·T·S·H for the two matmuls of the forward pass; causal needs half the tiles."""
    return 4 * HEADS * n * n * HEAD_DIM * (0.5 if causal else 1.0)


# ----------------------------------------------------------------------------- JAX paths


def _jax_fns(impl: str, causal: bool):
    def forward(q, k, v):
        return dot_product_attention(q, k, v, causal=causal, implementation=impl)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v))

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def predicted_seconds(rows, impl, n, causal):
    """fwd+bwd time at n extrapolated from this implementation's largest smaller n (∝ n²)."""
    done = [r for r in rows if r["impl"] == impl and r["causal"] == causal and "fwd_bwd_s" in r]
    if not done:
        return 0.0
    last = max(done, key=lambda r: r["n"])
    return last["fwd_bwd_s"] * (n / last["n"]) ** 2


def bench_jax(impl, n, causal, repeats, memory_budget):
    """Times and temp memory of one JAX implementation; skips what would not fit."""
    shape = jax.ShapeDtypeStruct((1, n, HEADS, HEAD_DIM), jnp.float32)
    row = {"impl": impl, "n": n, "causal": causal}
    forward, gradient = _jax_fns(impl, causal)
    compiled = {}
    for name, fn in (("fwd", forward), ("fwd_bwd", gradient)):
        exe = fn.lower(shape, shape, shape).compile()
        temp = exe.memory_analysis().temp_size_in_bytes
        row[f"{name}_temp_bytes"] = temp
        compiled[name] = exe
    if max(row["fwd_temp_bytes"], row["fwd_bwd_temp_bytes"]) > memory_budget:
        row["skipped"] = (f"needs {row['fwd_bwd_temp_bytes'] / 2**30:.1f} GiB of temp memory; "
                          f"budget {memory_budget / 2**30:.1f} GiB")
        return row
    return row


def time_jax(impl, n, causal, repeats):
    """Median forward and forward+backward times of one JAX implementation."""
    shape = (1, n, HEADS, HEAD_DIM)
    keys = jax.random.split(jax.random.key(n), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    times = {}
    for name, fn in zip(("fwd", "fwd_bwd"), _jax_fns(impl, causal)):
        times[f"{name}_s"] = median_time(lambda: jax.block_until_ready(fn(q, k, v)), repeats)
    return times


# ----------------------------------------------------------------------------- PyTorch peer


def bench_torch(n, causal, repeats):
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row = {"impl": "torch_sdpa", "n": n, "causal": causal}
    with torch.no_grad():
        row["fwd_s"] = median_time(lambda: sdpa(q, k, v, is_causal=causal), repeats)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd_bwd():
        for x in (qg, kg, vg):
            x.grad = None
        sdpa(qg, kg, vg, is_causal=causal).sum().backward()

    row["fwd_bwd_s"] = median_time(fwd_bwd, repeats)
    return row


# ----------------------------------------------------------------------------- report


def _fmt_time(row, key):
    if "skipped" in row:
        return "skip"
    return f"{row[key]:.4f}" if key in row else "-"


def _fmt_mem(row, key):
    return f"{row[key] / 2**20:.1f}" if key in row else "-"


def attention_table(rows, rate, isa="unknown ISA"):
    """Markdown table: one line per (N, causal, implementation), then the ratios."""
    lines = ["| N | causal | impl | fwd s | fwd+bwd s | fwd temp MiB | fwd+bwd temp MiB | fwd GFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gflops = ("-" if "fwd_s" not in r
                  else f"{attention_flops(r['n'], r['causal']) / r['fwd_s'] / 1e9:.0f}")
        lines.append(f"| {r['n']} | {r['causal']} | {r['impl']} | {_fmt_time(r, 'fwd_s')} | "
                     f"{_fmt_time(r, 'fwd_bwd_s')} | {_fmt_mem(r, 'fwd_temp_bytes')} | "
                     f"{_fmt_mem(r, 'fwd_bwd_temp_bytes')} | {gflops} |")
    lines += ["", f"float32 matmul rate (XLA, 2048²): {rate / 1e9:.0f} GFLOP/s on a "
                  f"{os.cpu_count()}-thread {isa} host", ""]
    lines += ratio_lines(rows, rate)
    return "\n".join(lines)


def ratio_lines(rows, rate):
    """The targets: speed against each peer, causal vs full, FLOP rate, memory."""
    by = {(r["impl"], r["n"], r["causal"]): r for r in rows}
    out = ["| N | causal | blockwise speed-up vs torch fwd / fwd+bwd | vs reference fwd / fwd+bwd "
           "| vs xla fwd | causal/full time fwd / fwd+bwd | % of matmul rate | temp memory ref/blockwise fwd / fwd+bwd |",
           "|---|---|---|---|---|---|---|---|"]
    for (impl, n, causal), b in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if impl != "blockwise" or "fwd_s" not in b:
            continue

        def speedup(peer, key):
            p = by.get((peer, n, causal))
            if not p or key not in p:
                return "-"
            return f"{p[key] / b[key]:.2f}×"

        full = by.get(("blockwise", n, False))
        causal_ratio = (f"{b['fwd_s'] / full['fwd_s']:.2f} / {b['fwd_bwd_s'] / full['fwd_bwd_s']:.2f}"
                        if causal and full and "fwd_s" in full else "-")
        ref = by.get(("reference", n, causal))
        mem = (f"{ref['fwd_temp_bytes'] / b['fwd_temp_bytes']:.0f}× / "
               f"{ref['fwd_bwd_temp_bytes'] / b['fwd_bwd_temp_bytes']:.0f}×") if ref else "-"
        pct = 100 * attention_flops(n, causal) / b["fwd_s"] / rate
        out.append(f"| {n} | {causal} | {speedup('torch_sdpa', 'fwd_s')} / "
                   f"{speedup('torch_sdpa', 'fwd_bwd_s')} | {speedup('reference', 'fwd_s')} / "
                   f"{speedup('reference', 'fwd_bwd_s')} | {speedup('xla', 'fwd_s')} | "
                   f"{causal_ratio} | {pct:.0f}% | {mem} |")
    return out


def _progress(row):
    if "skipped" in row:
        return "skipped, " + row["skipped"]
    return f"fwd {row['fwd_s']:.4f}s, fwd+bwd {row['fwd_bwd_s']:.4f}s"


def run(args):
    """`bench attention`: the table on stdout, the rows as JSON in --out."""
    if jax.default_backend() in attention_speed_gpu.IMPLS:  # GPU/TPU: bf16, TFLOP/s, fused kernels
        return attention_speed_gpu.run(args)
    say_ignored_on_cpu(args)
    sizes = args.sizes or ([256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384])
    repeats = args.repeats or (3 if args.quick else 5)
    budget = args.memory_fraction * available_memory_bytes()
    rate = matmul_rate()
    peers = installed("torch") and not args.no_torch
    isa = cpu_vector_isa()
    print(f"backend {jax.default_backend()}, {os.cpu_count()} CPU threads ({isa}), "
          f"matmul {rate / 1e9:.0f} GFLOP/s, torch peer: "
          f"{'yes' if peers else 'no (--no-torch)' if args.no_torch else 'not installed'}",
          file=sys.stderr)
    rows = []
    for n in sizes:
        for causal in (False, True):
            for impl in JAX_IMPLS:
                row = bench_jax(impl, n, causal, repeats, budget)
                guess = predicted_seconds(rows, impl, n, causal)
                if "skipped" not in row and impl != "blockwise" and guess > args.time_budget:
                    # Memory (compiled above) is still reported; only the timing is skipped.
                    row["skipped"] = (f"fwd+bwd would take ~{guess:.1f} s per call "
                                      f"(--time-budget {args.time_budget:.0f} s)")
                elif "skipped" not in row:
                    row.update(time_jax(impl, n, causal, repeats))
                rows.append(row)
                print(f"  N={n} causal={causal} {impl}: {_progress(row)}", file=sys.stderr)
            if peers:
                guess = predicted_seconds(rows, "torch_sdpa", n, causal)
                if guess > args.time_budget:
                    rows.append({"impl": "torch_sdpa", "n": n, "causal": causal, "skipped":
                                 f"fwd+bwd would take ~{guess:.1f} s per call "
                                 f"(--time-budget {args.time_budget:.0f} s)"})
                else:
                    rows.append(bench_torch(n, causal, repeats))
                print(f"  N={n} causal={causal} torch_sdpa: {_progress(rows[-1])}", file=sys.stderr)
    table = attention_table(rows, rate, isa)
    print(table)
    notes = [f"N={r['n']} causal={r['causal']} {r['impl']}: skipped, {r['skipped']}"
             for r in rows if "skipped" in r]
    if notes:
        print("\n" + "\n".join(notes))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"matmul_flops_per_s": rate, "cpu_isa": isa,
                               "heads": HEADS, "head_dim": HEAD_DIM,
                               "threads": os.cpu_count(), "rows": rows}, indent=1))
    print(f"\nwrote {out}")


def positive_int(text: str) -> int:
    """argparse's type for a count or a length: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; valid: an integer >= 1")
    return value


def fraction(text: str) -> float:
    """argparse's type for a share: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}; valid: a number in (0, 1]")
    return value


def tiles_argument(text: str) -> str:
    """argparse's type for a --pallas-tiles setting: checked here, parsed per row."""
    try:
        attention_speed_gpu.parse_tiles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _names(valid):
    """argparse's type for a comma-separated subset of `valid`."""
    def parse(text: str) -> tuple:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        unknown = [x for x in names if x not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}; valid: comma-separated names of "
                                             f"{', '.join(valid)}")
        return names
    return parse


def add_parser(sub) -> None:
    """Registers `attention` on the bench command's subcommand parser."""
    att = sub.add_parser("attention", help="attention forward/backward time and memory")
    att.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    att.add_argument("--sizes", type=positive_int, nargs="+", help="sequence lengths N")
    att.add_argument("--repeats", type=positive_int,
                     help="timed runs per measurement (median)")
    att.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    att.add_argument("--memory-fraction", type=fraction, default=0.5,
                     help="skip an implementation whose temp memory exceeds this share of free RAM")
    att.add_argument("--time-budget", type=float, default=6.0,
                     help="skip timing a peer (not blockwise) whose fwd+bwd would exceed this "
                          "many seconds per call (extrapolated from the previous N)")
    att.add_argument("--width", type=int, default=attention_speed_gpu.WIDTH,
                     help="GPU/TPU: model width N·H of the rows (default 2048, FlashAttention-2's; "
                          "768 with --sizes 1024 is GPT-2 small's attention, 12 heads of 64)")
    att.add_argument("--masks", type=_names(attention_speed_gpu.MASKS),
                     help="GPU/TPU: the masks to time, comma-separated (default all: "
                          f"{','.join(attention_speed_gpu.MASKS)})")
    att.add_argument("--head-dims", type=positive_int, nargs="+",
                     help="GPU/TPU: the head sizes H to time (default 64 128)")
    att.add_argument("--implementations",
                     type=_names(sorted({i for v in attention_speed_gpu.IMPLS.values() for i in v})),
                     help="GPU/TPU: the implementations to time, comma-separated (default: all "
                          "of the platform's)")
    att.add_argument("--pallas-tiles", type=tiles_argument, nargs="+",
                     help="GPU: a column per setting of the Pallas kernels' tiles, e.g. "
                          "fwd=128x64,bwd=64x64,warps=8,stages=3,bwd_warps=4,bwd_stages=3 "
                          "(what is not given: the head size's defaults)")
    att.add_argument("--qkv", choices=("separate", "packed"), default="separate",
                     help="GPU/TPU: packed: attention as a GPT layer calls it, one [B, T, 3, N, H] "
                          "projection output and its bias (packed_self_attention; no PyTorch peer)")
    att.add_argument("--out", default="bench_results/attention.json", help="JSON output path")
