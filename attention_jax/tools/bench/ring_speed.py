r"""Ring attention against the sequence-parallel size: `python -m attention_jax.tools.bench ring`.

Three tables, on a mesh whose `sequence` axis has P devices (P = 1: one device, the
blockwise kernel; P > 1: ring attention, attention/ring.py):

  attention  causal attention forward + backward at a fixed length T: per-device temp
             memory (XLA's compiled memory analysis) and the wall time of one call;
             for P > 1 one row per `--inner` (the ring's chunk-pair kernel, ring_inner:
             "auto" is pallas on an NVIDIA GPU, splash on a TPU, blockwise on CPU), the
             kernel it ran in the "pairs" column.
  gpt        one training step (forward, backward, AdamW) of a fixed small GPT at a fixed
             T: per-device memory (arguments + outputs + temp, less what is aliased)
             and step time.
  context    the longest context (--min-length doubled, then 1.5×) whose GPT training step fits a
             fixed per-device memory budget: on one device; on P devices with the length
             split but attention left to GSPMD (implementation="blockwise": keys and
             values gathered whole on every device); on P devices with the ring.

Memory comes from compiling only (nothing runs), so it is exact and quiet; times are
medians of a few calls. Without enough devices (a CPU host), the command re-runs itself
with `--xla_force_host_platform_device_count`: the "devices" then share the host's
cores, so step times show the ring's overhead, not a speed-up, and on a GPU machine
with one device the ring cannot be timed at all. Memory is per device either way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from attention_jax.tools.bench.attention_speed import positive_int

DEFAULT_SIZES = (1, 2, 4, 8)


def add_parser(sub) -> None:
    """Registers `ring` on the bench command's subcommand parser."""
    p = sub.add_parser("ring", help="ring attention: per-device memory and time vs sequence size")
    p.add_argument("--sizes", type=positive_int, nargs="+", default=list(DEFAULT_SIZES),
                   help="sequence-parallel sizes P (devices on the sequence axis)")
    p.add_argument("--length", type=positive_int, default=8192,
                   help="T for the attention table (a multiple of 2P for every P)")
    p.add_argument("--gpt-length", type=positive_int, default=4096,
                   help="T for the GPT step table (a multiple of 2P for every P)")
    p.add_argument("--budget-mib", type=float, default=64.0,
                   help="per-device memory budget for the longest-context table (MiB)")
    p.add_argument("--min-length", type=positive_int, default=512,
                   help="the context search's first length (then doubling; a multiple of 2P)")
    p.add_argument("--max-length", type=positive_int, default=1 << 17,
                   help="stop the context search here")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls per measurement (median)")
    p.add_argument("--inner", nargs="+", default=["auto"],
                   choices=["auto", "pallas", "splash", "blockwise"],
                   help="the ring's chunk-pair kernels to time in the attention table "
                        "(ring_inner; e.g. 'blockwise auto' on a GPU or TPU host)")
    p.add_argument("--out", default="bench_results/ring.json", help="JSON output path")


def check_args(args) -> None:
    """What the ring needs of the lengths, said before any child starts or step compiles:
    the zig-zag split gives each of P devices two chunks, so a length divides by 2P."""
    for flag, length in (("--length", args.length), ("--gpt-length", args.gpt_length),
                         ("--min-length", args.min_length)):
        bad = [p for p in args.sizes if length % (2 * p)]
        if bad:
            raise SystemExit(f"error: bench ring: {flag}={length} does not split over "
                             f"--sizes {bad}; "
                             f"valid: a multiple of {2 * math.lcm(*args.sizes)} (2P for "
                             f"every P of --sizes)")
    if args.min_length > args.max_length:
        raise SystemExit(f"error: bench ring: --min-length={args.min_length} is past "
                         f"--max-length={args.max_length}; valid: at most --max-length")
    if not args.budget_mib > 0:
        raise SystemExit(f"bench ring: --budget-mib={args.budget_mib:g}; valid: a number > 0")


def run(args) -> dict:
    check_args(args)
    devices = max(args.sizes)
    import jax
    if jax.device_count() < devices:  # XLA reads the device count once: run anew
        if jax.default_backend() != "cpu":
            raise SystemExit(f"bench ring needs {devices} devices for --sizes {args.sizes}; this "
                             f"{jax.default_backend()} host has {jax.device_count()}")
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") +
            f" --xla_force_host_platform_device_count={devices}").strip())
        argv = [sys.executable, "-m", "attention_jax.tools.bench", "ring",
                "--sizes", *map(str, args.sizes), "--length", str(args.length),
                "--gpt-length", str(args.gpt_length), "--budget-mib", str(args.budget_mib),
                "--min-length", str(args.min_length), "--max-length", str(args.max_length),
                "--repeats", str(args.repeats),
                "--inner", *args.inner, "--out", args.out]
        subprocess.run(argv, env=env, check=True)
        return json.loads(Path(args.out).read_text())
    results = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
               "attention": attention_table(args), "gpt": gpt_table(args),
               "context": context_table(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwritten {args.out}")
    return results


# ----------------------------------------------------------------------------- helpers


def _mesh(p: int):
    import jax
    from attention_jax import sharding
    return sharding.make_mesh({"data": 1, "fsdp": 1, "sequence": p, "tensor": 1},
                              jax.devices()[:p])


def _per_device_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


# ----------------------------------------------------------------------------- tables


def attention_table(args) -> list[dict]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from attention_jax.attention import dot_product_attention, explain
    from attention_jax.tools.bench.timing import median_time

    t, heads, head_dim = args.length, 4, 32
    print(f"\ncausal attention fwd+bwd, B=1 T={t} N={heads} H={head_dim} float32 "
          f"(per device)\n   P  impl       pairs      temp MiB   time ms")
    rows = []
    for p in args.sizes:
        mesh = _mesh(p)
        impl = "ring" if p > 1 else "blockwise"
        sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
        x = jax.device_put(jax.random.normal(jax.random.key(0), (1, t, heads, head_dim)), sharded)
        for inner in (args.inner if p > 1 else ["-"]):
            kw = {"ring_inner": inner} if p > 1 else {}

            def loss(q, k, v):
                return dot_product_attention(q, k, v, causal=True, implementation=impl,
                                             **kw).sum()

            with jax.set_mesh(mesh):
                try:
                    pairs = _pair_kernel(explain(x, x, x, causal=True, implementation=impl,
                                                 **kw)[1])
                except ValueError as refused:  # e.g. splash with chunks not a multiple of 128
                    rows.append({"P": p, "implementation": impl, "pairs": inner, "T": t,
                                 "refused": str(refused).split("\n")[0]})
                    print(f"{p:4d}  {impl:9s}  {inner:9s} refused: {rows[-1]['refused']}")
                    continue
                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                compiled = fn.lower(x, x, x).compile()
                seconds = median_time(lambda: jax.block_until_ready(compiled(x, x, x)),
                                      args.repeats)
            temp = compiled.memory_analysis().temp_size_in_bytes
            rows.append({"P": p, "implementation": impl, "pairs": pairs, "T": t,
                         "temp_bytes": temp, "seconds": seconds})
            print(f"{p:4d}  {impl:9s}  {pairs:9s} {_mib(temp)}  {seconds * 1e3:8.1f}",
                  flush=True)
    return rows


def _pair_kernel(reason: str) -> str:
    """The ring's chunk-pair kernel as explain() names it ("-": not a ring call)."""
    match = re.search(r"chunk pairs on (\w+)", reason)
    return match.group(1) if match else "-"


@functools.cache  # the context search meets the gpt table's steps again: compile each once
def _gpt_step(t: int, p: int, implementation: str):
    """(compiled train step, its arguments' builder) of the benchmark GPT at length t."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec
    from attention_jax import sharding
    from attention_jax.models.gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig.from_variant("gpt-tiny-rope", implementation=implementation)
    model, tx, mesh = GPT(cfg), optax.adamw(1e-3), _mesh(p)
    repl = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec(None, "sequence")))

    def init(key):  # the parameters do not depend on the attention implementation
        one_device = GPT(dataclasses.replace(cfg, implementation="blockwise"))
        params = nn.meta.unbox(one_device.init(key, jnp.zeros((1, 8), jnp.int32))["params"])
        return params, tx.init(params)

    def step(params, opt_state, tokens):
        def loss(params):
            return lm_loss(model.apply({"params": params}, tokens)[0], tokens)[0]
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        state = jax.eval_shape(init, jax.random.key(0))
        state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=repl),
                             state)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state, tokens).compile()

    def arguments():
        params, opt_state = jax.jit(init, out_shardings=repl)(jax.random.key(0))
        ids = jax.device_put(jnp.arange(t, dtype=jnp.int32)[None] % cfg.vocab_size,
                             tokens.sharding)
        return params, opt_state, ids

    return compiled, arguments, mesh


def gpt_table(args) -> list[dict]:
    import jax
    from attention_jax.tools.bench.timing import wall_times

    t = args.gpt_length
    print(f"\nGPT train step (gpt-tiny-rope: 2 layers, D=64, 4 heads, 2 K/V heads), B=1, "
          f"T={t} (per device)\n   P  impl       total MiB   step ms")
    rows = []
    for p in args.sizes:
        impl = "ring" if p > 1 else "blockwise"
        compiled, arguments, mesh = _gpt_step(t, p, impl)
        state = list(arguments())

        def call():
            state[0], state[1], loss = compiled(*state)
            jax.block_until_ready(loss)

        with jax.set_mesh(mesh):
            call()  # warm-up
            seconds = sorted(wall_times(call, args.repeats))[args.repeats // 2]
        total = _per_device_bytes(compiled)
        rows.append({"P": p, "implementation": impl, "T": t, "bytes": total, "seconds": seconds})
        print(f"{p:4d}  {impl:9s} {_mib(total)}   {seconds * 1e3:8.1f}", flush=True)
    return rows


def _fits(t: int, p: int, impl: str, budget: float) -> tuple[bool, int]:
    try:
        total = _per_device_bytes(_gpt_step(t, p, impl)[0])
    except Exception as e:  # noqa: BLE001 - an allocation XLA refuses also means "does not fit"
        print(f"      T={t}: {type(e).__name__}: {str(e)[:120]}")
        return False, -1
    return total <= budget, total


def context_table(args) -> list[dict]:
    budget = args.budget_mib * 2**20
    p = max(args.sizes)
    print(f"\nlongest GPT training context within {args.budget_mib:g} MiB per device "
          f"(gpt-tiny-rope, B=1)\n  devices  attention              longest T   MiB at it")
    rows = []
    for devices, impl, label in ((1, "blockwise", "blockwise, one device"),
                                 (p, "blockwise", "blockwise, GSPMD"),
                                 (p, "ring", "ring")):
        best, best_bytes, t = 0, 0, args.min_length
        while t <= args.max_length:  # doubling, then one 1.5× step past the last fit
            ok, total = _fits(t, devices, impl, budget)
            if not ok:
                break
            best, best_bytes, t = t, total, 2 * t
        if best and 3 * best // 2 <= args.max_length and (3 * best // 2) % (2 * devices) == 0:
            ok, total = _fits(3 * best // 2, devices, impl, budget)
            if ok:
                best, best_bytes = 3 * best // 2, total
        rows.append({"devices": devices, "implementation": impl, "longest_T": best,
                     "bytes": best_bytes, "budget_bytes": budget,
                     "capped": best * 2 > args.max_length})
        print(f"  {devices:7d}  {label:21s} {best:9d}{'+' if rows[-1]['capped'] else ' '}  "
              f"{_mib(best_bytes)}", flush=True)
    return rows
