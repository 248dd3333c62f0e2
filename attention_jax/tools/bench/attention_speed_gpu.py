"""The attention benchmark on a GPU or TPU: `python -m attention_jax.tools.bench attention` there.

FlashAttention-2's setup (Dao 2023, §4.1): bfloat16, model width N·H = 2048, B·T = 16k
tokens, head dims 64 and 128, T from 1k to 16k, causal and not, plus causal rows of
packed documents given as segment ids, which cuDNN cannot express: *packed*, four
documents of T/4 tokens per row (most tiles skipped), and *docs*, two documents of 3T/4
and T/4 (long documents, as a corpus of real files packs them: most tiles lie inside one
document and have nothing to skip; the trainer's rows look like this). For each JAX
path (blockwise lax.scan, the Pallas kernels, jax.nn's cuDNN and XLA, and "auto", with
what auto chose and why) it prints forward and forward+backward TFLOP/s and the compiled
temp memory; with a CUDA PyTorch, SDPA's FlashAttention-2 and cuDNN backends are timed
in a process of their own (`torch_attention.py`). FLOPs: 4·B·N·T·S·H per forward, half
of it when causal (packed and docs rows are counted as causal), ×3.5 for forward+backward.

`--qkv packed` times attention as a GPT layer calls it: one [B, T, 3, N, H] projection
output and its [3, N, H] bias through `packed_self_attention`, the gradient taken for
both (the Pallas kernels read the array in place; the others get q, k, v sliced out and
biased first, copies included in their time). `--masks`, `--head-dims` and
`--implementations` keep a part of the grid. `--pallas-tiles` adds a column per setting
of the Pallas kernels' tiles and launch parameters (`pallas.BlockSizes`), e.g.
`fwd=128x64,bwd=64x128,warps=8,stages=3,bwd_warps=8,bwd_stages=3`: what is not given
stays as `kernel_block_sizes` has it for the row's head size.

On a TPU the same shapes and tables time splash, blockwise, xla and auto (`plan`
picks the implementations per platform); there is no PyTorch peer there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.attention import (dot_product_attention, explain, explain_packed,
                                     packed_self_attention, pallas)
from attention_jax.attention.call import make_call
from attention_jax.tools.bench.timing import installed

WIDTH, TOKENS = 2048, 16384  # N·H and B·T (--width 768: GPT-2 small's attention, N = 12 at H = 64)
IMPLS = {"gpu": ("blockwise", "pallas", "cudnn", "xla", "auto"),
         "tpu": ("splash", "blockwise", "xla", "auto")}
# The two fused kernels whose time ratio gets a column of its own, per platform.
RATIO = {"gpu": ("pallas", "cudnn"), "tpu": ("splash", "xla")}
MASKS = ("full", "causal", "packed", "docs")


def shapes(quick: bool):
    """(H, T, mask) rows: the FlashAttention-2 grid, smaller with --quick."""
    lengths = (1024, 4096) if quick else (1024, 4096, 16384)
    return [(h, t, mask) for h in (64, 128) for t in lengths for mask in MASKS]


def plan(platform: str, quick: bool):
    """(implementations, shapes) timed on `platform` ("gpu" or "tpu"): the same shapes."""
    return IMPLS[platform], shapes(quick)


def chosen(platform: str, args):
    """plan's implementations and shapes, less those the arguments leave out (--sizes,
    --masks, --head-dims, --implementations); an implementation this platform has not is
    one line naming the valid ones."""
    impls, grid = plan(platform, args.quick)
    wanted = getattr(args, "implementations", None)
    if wanted:
        unknown = [i for i in wanted if i not in impls]
        if unknown:
            raise SystemExit(f"error: --implementations {','.join(unknown)}; valid on "
                             f"{platform}: {','.join(impls)}")
        impls = tuple(i for i in impls if i in wanted)
    keep = lambda value, given: not given or value in given  # noqa: E731
    grid = [(h, t, m) for h, t, m in grid if keep(t, args.sizes)
            and keep(m, getattr(args, "masks", None)) and keep(h, getattr(args, "head_dims", None))]
    if not grid:
        full = plan(platform, args.quick)[1]
        raise SystemExit("error: --sizes, --masks and --head-dims leave no row of the grid; "
                         f"valid: T in {sorted({t for _, t, _ in full})}, H in "
                         f"{sorted({h for h, _, _ in full})}, masks {', '.join(MASKS)}")
    return impls, grid


def flops(h: int, t: int, mask: str, width: int = WIDTH) -> float:
    b, n = TOKENS // t, width // h
    return 4 * b * n * t * t * h * (1.0 if mask == "full" else 0.5)


def _inputs(h, t, mask, width=WIDTH):
    b, n = TOKENS // t, width // h
    keys = jax.random.split(jax.random.key(t + h), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
    kwargs = {"causal": mask != "full"}
    if mask == "packed":  # four documents of T/4 tokens per row
        kwargs["segment_ids"] = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None].repeat(b, 0)
    if mask == "docs":  # two documents per row, of 3T/4 and T/4 tokens
        ids = (jnp.arange(t) >= 3 * t // 4).astype(jnp.int32)
        kwargs["segment_ids"] = ids[None].repeat(b, 0)
    return q, k, v, kwargs


def gpu_time(fn, *args, repeats: int = 7, min_seconds: float = 0.05) -> float:
    """Median seconds per call; calls are queued back to back (as in a training step),
    enough of them per timing that launch latency does not count."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


# --pallas-tiles: each key and the BlockSizes fields it sets
TILE_KEYS = {"fwd": ("fwd_q", "fwd_k"), "bwd": ("bwd_q", "bwd_k"), "warps": ("num_warps",),
             "stages": ("num_stages",), "bwd_warps": ("bwd_num_warps",),
             "bwd_stages": ("bwd_num_stages",)}


def parse_tiles(text: str) -> dict:
    """`fwd=128x64,bwd=64x64,warps=8,...` -> {BlockSizes field: value}; a wrong key or
    value is one line naming the valid ones."""
    fields = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        names = TILE_KEYS.get(key.strip())
        numbers = value.split("x")
        if names is None or len(numbers) != len(names) or not all(
                n.isdigit() and int(n) >= 1 for n in numbers):
            raise ValueError(f"{part!r} in {text!r}; valid: " + ",".join(
                f"{k}={'x'.join(['N'] * len(v))}" for k, v in TILE_KEYS.items())
                             + " (whole numbers >= 1; tiles powers of two >= 16)")
        fields.update(zip(names, map(int, numbers)))
    for name in ("fwd_q", "fwd_k", "bwd_q", "bwd_k"):
        if name in fields and (fields[name] < 16 or fields[name] & (fields[name] - 1)):
            raise ValueError(f"{text!r}: tile {fields[name]}; valid: powers of two >= 16")
    if not fields:
        raise ValueError(f"{text!r}; valid: e.g. fwd=128x64,bwd=64x64,warps=8,stages=3")
    with pallas.tiles(**fields):  # the rest of its checks (warps: powers of two)
        return fields


def _tiled_pallas(tiles: str, h: int, t: int, qkv: str):
    """The Pallas kernels with --pallas-tiles' setting for head size h and rows of t (the
    rest the defaults there): a function of the row's inputs and keyword arguments, as
    `packed_self_attention` or `dot_product_attention` would call them."""
    blocks = dataclasses.replace(pallas.kernel_block_sizes(h, jnp.bfloat16, length=t),
                                 **parse_tiles(tiles))

    def attend(*args, **kwargs):
        if qkv == "packed":
            b, t, _, n, hd = args[0].shape
            slot = jax.ShapeDtypeStruct((b, t, n, hd), args[0].dtype)
            call = make_call(slot, slot, slot, **kwargs)
            return pallas.pallas_packed_attention(*args, call.spec, call.scale, blocks)
        call = make_call(*args, **kwargs)
        return pallas.pallas_attention(*args, call.spec, call.scale, blocks)
    return attend


def _packed_inputs(h, t, mask, width=WIDTH):
    """`--qkv packed`: one projection's output [B, T, 3, N, H] and its bias [3, N, H]."""
    q, k, v, kwargs = _inputs(h, t, mask, width)
    bias = 0.1 * jax.random.normal(jax.random.key(h), (3, *q.shape[2:]), jnp.bfloat16)
    return (jnp.stack([q, k, v], axis=2), bias), kwargs


def bench_jax(impl, h, t, mask, memory_budget, width=WIDTH, qkv="separate"):
    """One row: `impl` is an implementation's name, or "pallas " and a --pallas-tiles
    setting."""
    row = {"impl": impl, "H": h, "T": t, "mask": mask, "width": width}
    tiled = _tiled_pallas(impl.split(" ", 1)[1], h, t, qkv) if impl.startswith("pallas ") else None
    if qkv == "packed":
        row["qkv"] = qkv
        args, kwargs = _packed_inputs(h, t, mask, width)
        choice = lambda: explain_packed(args[0], **kwargs)  # noqa: E731

        def forward(qkv, bias):
            if tiled is not None:
                return tiled(qkv, bias, **kwargs)
            return packed_self_attention(qkv, bias, implementation=impl, **kwargs)
    else:
        *args, kwargs = _inputs(h, t, mask, width)
        choice = lambda: explain(*args, **kwargs)  # noqa: E731

        def forward(q, k, v):
            if tiled is not None:
                return tiled(q, k, v, **kwargs)
            return dot_product_attention(q, k, v, implementation=impl, **kwargs)
    if impl == "cudnn" and mask in ("packed", "docs"):
        row["skipped"] = "cuDNN has no segment ids (only a dense N×N mask)"
        return row

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fns = {"fwd": jax.jit(forward),
           "fwd_bwd": jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))}
    try:
        if impl == "auto":
            row["auto"] = " — ".join(choice())
        for name, fn in fns.items():
            exe = fn.lower(*args).compile()
            row[f"{name}_temp_bytes"] = exe.memory_analysis().temp_size_in_bytes
            if row[f"{name}_temp_bytes"] > memory_budget:
                row["skipped"] = (f"needs {row[f'{name}_temp_bytes'] / 2**30:.0f} GiB of temp "
                                  f"memory ({memory_budget / 2**30:.0f} GiB budget)")
                return row
            fns[name] = exe
        for name, exe in fns.items():
            row[f"{name}_s"] = gpu_time(exe, *args)
    except Exception as e:  # a backend refusing a shape is a result, not a crash
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def bench_torch(rows_spec, out_path: Path, width: int = WIDTH):
    """SDPA's flash and cuDNN backends, in a process of its own (JAX holds the GPU's memory
    pool here; the other runtime must not share our process)."""
    cmd = [sys.executable, "-m", "attention_jax.tools.bench.torch_attention", "--out", str(out_path),
           "--rows", json.dumps(rows_spec), "--width", str(width)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    if done.returncode != 0 or not out_path.exists():
        print(f"torch peer failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return []
    return json.loads(out_path.read_text())


def _rate(row, key):
    if "skipped" in row or key not in row:
        return "–"
    rate = flops(row['H'], row['T'], row['mask'], row.get('width', WIDTH)) / row[key]
    return f"{rate * (3.5 if key == 'fwd_bwd_s' else 1) / 1e12:.0f}"


def table(rows, platform="gpu"):
    order = ("splash", "blockwise", "pallas", "cudnn", "xla", "auto", "torch_flash", "torch_cudnn")
    impls = [i for i in order if any(r["impl"] == i for r in rows)]
    tiled = list(dict.fromkeys(r["impl"] for r in rows if r["impl"].startswith("pallas ")))
    at = impls.index("pallas") + 1 if "pallas" in impls else 0
    impls[at:at] = tiled  # each setting's column after the default tiles'
    fast, slow = RATIO[platform]
    by = {(r["impl"], r["H"], r["T"], r["mask"]): r for r in rows}
    keys = sorted({(r["H"], r["T"], r["mask"]) for r in rows},
                  key=lambda x: (x[0], x[1], MASKS.index(x[2])))
    lines = ["| H | T | mask | " + " | ".join(impls) + f" | {fast} ÷ {slow} | auto chose |",
             "|---|---|---|" + "---|" * (len(impls) + 2)]
    for h, t, mask in keys:
        cells = []
        for impl in impls:
            r = by.get((impl, h, t, mask))
            cells.append("–" if r is None else f"{_rate(r, 'fwd_s')} / {_rate(r, 'fwd_bwd_s')}")
        p, c = by.get((fast, h, t, mask)), by.get((slow, h, t, mask))
        ratio = "–"
        if p and c and "fwd_bwd_s" in p and "fwd_bwd_s" in c:
            ratio = f"{c['fwd_s'] / p['fwd_s']:.2f} / {c['fwd_bwd_s'] / p['fwd_bwd_s']:.2f}"
        auto = by.get(("auto", h, t, mask), {}).get("auto", "–").split(" — ")[0]
        lines.append(f"| {h} | {t} | {mask} | " + " | ".join(cells) + f" | {ratio} | {auto} |")
    lines += ["", "TFLOP/s forward / forward+backward, bfloat16.", "",
              "| H | T | mask | temp MiB fwd / fwd+bwd: " + " | ".join(
                  i for i in impls if not i.startswith("torch")) + " |",
              "|---|---|---|" + "---|" * len([i for i in impls if not i.startswith("torch")])]
    for h, t, mask in keys:
        cells = []
        for impl in impls:
            if impl.startswith("torch"):
                continue
            r = by.get((impl, h, t, mask), {})
            cells.append(f"{r['fwd_temp_bytes'] / 2**20:.0f} / {r['fwd_bwd_temp_bytes'] / 2**20:.0f}"
                         if "fwd_bwd_temp_bytes" in r else "–")
        lines.append(f"| {h} | {t} | {mask} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args):
    device = jax.devices()[0]
    total = device.memory_stats().get("bytes_limit", 80 << 30) if device.memory_stats() else 80 << 30
    budget = args.memory_fraction * total
    platform = jax.default_backend()
    impls, specs = chosen(platform, args)
    for tiles in getattr(args, "pallas_tiles", None) or ():
        if platform == "gpu":  # a column of its own after the default tiles'
            impls = (*impls, f"pallas {tiles}")
    if getattr(args, "pallas_tiles", None) and platform != "gpu":
        print(f"note: --pallas-tiles sets the Triton kernels' tiles, which a {platform.upper()} "
              "does not run; ignored", file=sys.stderr)
    width = getattr(args, "width", WIDTH)
    qkv = getattr(args, "qkv", "separate")
    print(f"{platform.upper()}: {device.device_kind}, bf16, N·H={width}, B·T={TOKENS}, q, k, v "
          f"{qkv}", file=sys.stderr)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if platform == "gpu" and installed("torch") and not args.no_torch and qkv == "separate":
        rows += bench_torch([[h, t, m] for h, t, m in specs if m not in ("packed", "docs")],
                            out.with_name(out.stem + "_torch.json"), width)
    for h, t, mask in specs:
        for impl in impls:
            row = bench_jax(impl, h, t, mask, budget, width, qkv)
            rows.append(row)
            print(f"  H={h} T={t} {mask} {impl}: fwd {_rate(row, 'fwd_s')} / fwd+bwd "
                  f"{_rate(row, 'fwd_bwd_s')} TFLOP/s {row.get('skipped', '')}", file=sys.stderr)
            out.write_text(json.dumps({"device": device.device_kind, "rows": rows}, indent=1))
    print(table(rows, platform))
    print(f"N·H = {width}, B·T = {TOKENS}" + (
        "; q, k, v as one [B, T, 3, N, H] projection output with its bias, the gradient for "
        "both (--qkv packed)." if qkv == "packed" else "."))
    for r in rows:
        if r["impl"] == "auto" and "auto" in r:
            print(f"explain H={r['H']} T={r['T']} {r['mask']}: auto -> {r['auto']}")
    for r in rows:  # refusals are results: the reason, not a crash
        if "skipped" in r:
            print(f"skipped H={r['H']} T={r['T']} {r['mask']} {r['impl']}: {r['skipped']}")
    print(f"\nwrote {out}")
