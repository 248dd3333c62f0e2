r"""Where a training step's time goes: `python -m attention_jax.tools.bench profile`.

    python -m attention_jax.tools.bench profile                       # gpt2-124m, batch 16
    python -m attention_jax.tools.bench profile --shape gpt2-124m --batch 32 --loss-chunk 256
    python -m attention_jax.tools.bench profile --out bench_results/profile   # + trace, HLO
    python -m attention_jax.tools.bench profile --trainer   # the trainer's step, a real batch
    python -m attention_jax.tools.bench profile --save      # what a checkpoint save costs it

Builds the GPU benchmark's bare step (train_speed_gpu.py: GPT-2 shapes, AdamW, bfloat16
compute), runs it until compiled, then records `--steps` steps with `jax.profiler.trace`
and reads the trace back: every op the device ran, grouped by name, with its time per step and
its share of the step, and the same grouped into kinds (matmuls, attention, XLA's fused
elementwise kernels, copies, ...). An op that XLA generated is found in the compiled
module: the table gives its shape and the JAX operation it came from (the layer's path,
e.g. `transpose(jvp(GPT))/decoder/layer_11/mlp/wi/reduce_sum`: the backward pass of the
last MLP's input projection); library kernels (cuBLAS, cuDNN) have no such entry. The printed table is what a person reads first; the
directory `--out` keeps the Perfetto trace (open it at ui.perfetto.dev), the compiled
HLO (a kernel's `hlo_op` names an instruction there) and the table as JSON.
`--trainer` profiles the trainer's own jitted step instead (bench/trainer.py: main.py's
step at this shape, on one real batch of the packed corpus): the two tables side by side
say what the trainer's step adds to the bare one. `--save` times checkpoint saves
between the trainer's steps instead and traces a save's windows (bench/save_window.py).

Where the ops come from: on a GPU the trace has one process per device ("/device:GPU:0")
whose threads are its CUDA streams; each kernel is one event there. On a CPU, XLA runs
its thunks on host threads; those events are read instead (the CPU trace names fused
regions coarsely, so the table is useful on a GPU and a test on a CPU).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shlex
import sys
from pathlib import Path

from attention_jax.tools.bench.traces import read_trace

# Kinds, tried in order against the lower-cased kernel name (and its HLO op's name).
KINDS = (
    ("loss", ("cross_entropy",)),  # the Pallas loss kernels (models/loss_kernel.py)
    ("norm", ("add_norm",)),  # the residual add and norm's Pallas kernels (layers/norm_kernel.py)
    ("attention", ("fmha", "flash", "cudnn", "sdpa", "attention", "mha")),
    ("matmul", ("gemm", "cublas", "xmma", "cutlass", "nvjet", "matmul", "dot", "wgmma")),
    ("copy", ("memcpy", "memset", "copy", "transpose")),
    ("reduction", ("reduce", "reduction", "softmax", "scatter", "gather")),
    ("elementwise", ("fusion", "loop", "input", "triton", "convert", "add", "multiply")),
)
# Host-side bookkeeping in a CPU trace: not ops.
HOST_NOISE = ("ThreadpoolListener", "SlinkyThreadPool", "ThunkExecutor", "end: ")


def kind_of(name: str, hlo_op: str = "") -> str:
    text = f"{name} {hlo_op}".lower()
    for kind, words in KINDS:
        if any(w in text for w in words):
            return kind
    return "other"


def device_ops(events: list[dict]) -> tuple[list[dict], str]:
    """(the op events, where they were found): complete events ("X") on a device's
    threads when the trace has a device process, else on the host's non-Python threads."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
    device_pids = {p for p, n in procs.items() if n.startswith("/device:")}
    if device_pids:
        # A device process holds its streams and, on some versions, derived lines ("XLA
        # Ops", "XLA Modules", "Steps") that repeat the kernels: count streams only.
        ops = [e for e in spans if e["pid"] in device_pids
               and "stream" in threads.get((e["pid"], e["tid"]), "").lower()]
        if not ops:  # no thread named as a stream: every device event
            ops = [e for e in spans if e["pid"] in device_pids]
        return ops, ", ".join(sorted(procs[p] for p in device_pids))
    ops = [e for e in spans if threads.get((e["pid"], e["tid"]), "") != "python"
           and not e["name"].startswith(HOST_NOISE)]
    return ops, "host threads (no device process in the trace)"


def hlo_sources(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (its shape, the JAX operation it came from)} of a compiled
    module's text: what a kernel named after a fusion computes, and where in the model."""
    found = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+(?: \S+)*?) [a-z][\w\-]*\(", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            found[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return found


def _source_of(kernel: str, sources: dict) -> tuple[str, str]:
    """A kernel's HLO instruction: the same name (CPU thunks), or, as XLA:GPU names
    kernels, the fusion's name with its last '.' written '_' (loop_add_fusion_3)."""
    if kernel in sources:
        return sources[kernel]
    m = re.match(r"(.*)_(\d+)$", kernel)
    return sources.get(f"{m.group(1)}.{m.group(2)}", ("", "")) if m else ("", "")


def summarize(events: list[dict], steps: int, step_s: float | None = None,
              hlo_text: str = "") -> dict:
    """Per-op and per-kind device time per step from the trace's op events.
    step_s: the step's wall time measured outside the trace (for the shares). hlo_text:
    the compiled module, to give each op its shape and source (hlo_sources)."""
    ops, source = device_ops(events)
    sources = hlo_sources(hlo_text) if hlo_text else {}
    by_name: dict[str, dict] = {}
    for e in ops:
        args = e.get("args") or {}
        hlo = str(args.get("hlo_op", "") or args.get("long_name", ""))
        row = by_name.setdefault(e["name"], {"name": e["name"], "hlo_op": hlo, "calls": 0,
                                             "us": 0.0, "kind": kind_of(e["name"], hlo)})
        row["calls"] += 1
        row["us"] += float(e["dur"])
    rows = sorted(by_name.values(), key=lambda r: -r["us"])
    for r in rows:
        r["shape"], r["source"] = _source_of(r["name"], sources)
    busy_s = sum(r["us"] for r in rows) * 1e-6 / steps
    for r in rows:
        r["ms_per_step"] = r["us"] * 1e-3 / steps
        r["calls_per_step"] = r["calls"] / steps
    kinds = collections.defaultdict(lambda: {"ms_per_step": 0.0, "ops_per_step": 0.0})
    for r in rows:
        kinds[r["kind"]]["ms_per_step"] += r["ms_per_step"]
        kinds[r["kind"]]["ops_per_step"] += r["calls_per_step"]
    return {"source": source, "steps": steps, "device_busy_s_per_step": busy_s,
            "step_s": step_s, "ops": rows,
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms_per_step"]))}


def table(summary: dict, top: int = 30) -> str:
    """Markdown: the kinds, then the `top` ops by time."""
    step_ms = 1e3 * (summary["step_s"] or summary["device_busy_s_per_step"])
    busy = 1e3 * summary["device_busy_s_per_step"]
    lines = [f"Ops from {summary['source']}; {summary['steps']} steps traced. Step "
             f"{step_ms:.2f} ms wall, device busy {busy:.2f} ms "
             f"({100 * busy / step_ms:.0f}%).", "",
             "| kind | ms/step | % of step | ops/step |", "|---|---|---|---|"]
    for kind, k in summary["kinds"].items():
        lines.append(f"| {kind} | {k['ms_per_step']:.2f} | {100 * k['ms_per_step'] / step_ms:.1f}% "
                     f"| {k['ops_per_step']:.0f} |")
    lines += ["", "| op | kind | calls/step | ms/step | % of step | shape | from |",
              "|---|---|---|---|---|---|---|"]
    short = lambda text, n: text if len(text) <= n else text[:n - 3] + "..."
    for r in summary["ops"][:top]:
        origin = re.sub(r"^jit\([^)]*\)/", "", r.get("source", ""))  # the step's own name
        lines.append(f"| `{short(r['name'], 60)}` | {r['kind']} | {r['calls_per_step']:g} "
                     f"| {r['ms_per_step']:.3f} | {100 * r['ms_per_step'] / step_ms:.1f}% "
                     f"| {short(r.get('shape', ''), 40)} | {short(origin, 70)} |")
    return "\n".join(lines)


def profile_step(compiled, state, args: tuple, steps: int = 3, warmup: int = 3,
                 out_dir: str | None = None) -> dict:
    """Runs `compiled(state, *args) -> (state, out)` `warmup` times, times `steps` steps,
    then traces `steps` more; returns summarize()'s dict (plus "last": the last step's
    output, fetched). out_dir: keeps the trace and the compiled HLO there (else a
    temporary directory)."""
    import shutil
    import tempfile

    import jax
    from attention_jax.tools.bench import timing
    step = lambda s: compiled(s, *args)
    for _ in range(warmup):
        state, out = step(state)
    jax.block_until_ready(out)
    (step_s,), state, out = timing.queued_step_times(step, state, 1, steps)
    log_dir = out_dir or tempfile.mkdtemp(prefix="profile_")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        _, state, out = timing.queued_step_times(step, state, 1, steps)
    hlo_text = compiled.as_text()
    summary = summarize(read_trace(log_dir), steps, step_s, hlo_text)
    summary.update(device=jax.devices()[0].device_kind, last=jax.device_get(out))
    if out_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        with gzip.open(Path(log_dir) / "step.hlo.txt.gz", "wt") as f:
            f.write(hlo_text)
    return summary


def add_parser(sub) -> None:
    from attention_jax.tools.bench import train_speed_gpu
    p = sub.add_parser("profile", help="where a GPT-2 training step's time goes (jax.profiler)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes = {**train_speed_gpu.SHAPES, **train_speed_gpu.SHAPES_TINY}
    p.add_argument("--shape", default="gpt2-124m", choices=sorted(shapes))
    p.add_argument("--batch", type=int, default=None, help="default: the shape's first batch")
    p.add_argument("--implementation", default="auto", choices=train_speed_gpu.IMPLEMENTATIONS)
    p.add_argument("--dtype", default="bfloat16",
                   help="compute dtype (float32 on a CPU, whose dots refuse bf16 x bf16 -> f32)")
    p.add_argument("--loss-chunk", type=int, default=0, help="positions per LM-head chunk (0: whole)")
    p.add_argument("--loss-kernel", default="auto",
                   help="the whole logits' loss: xla or pallas (models/loss_kernel.py); auto: "
                        "pallas on a GPU (train.loss_kernel with --trainer)")
    p.add_argument("--norm-kernel", default="auto",
                   help="a block's residual add and norm: xla or pallas (layers/norm_kernel.py); "
                        "auto: pallas on a GPU (model.norm_kernel with --trainer)")
    p.add_argument("--steps", type=int, default=3, help="steps timed, then steps traced")
    p.add_argument("--top", type=int, default=30, help="ops listed")
    p.add_argument("--out", default=None,
                   help="directory for the trace, the compiled HLO and summary.json")
    p.add_argument("--trainer", action="store_true",
                   help="profile the trainer's own step (main.py's, configs/gpt2_gpu.py at "
                        "this shape: packed documents, clipping, metrics) on a real batch")
    p.add_argument("--save", action="store_true",
                   help="what a checkpoint save costs the trainer's steps around it, and "
                        "where (save_window.py; implies --trainer)")
    p.add_argument("--save-window", type=int, default=10,
                   help="with --save: steps per window (main.py's log_every)")
    p.add_argument("--saves", type=int, default=3, help="with --save: later saves timed")
    p.add_argument("--pinned-host", default="default", choices=("default", "on", "off"),
                   help="with --save: orbax's device-to-host copy through pinned host "
                        "memory (default: orbax's choice, on for a GPU)")
    p.add_argument("--python-trace", action="store_true",
                   help="with --save --out: trace every Python call of every thread too "
                        "(what orbax's threads do; large traces)")
    p.add_argument("--compression", default="on", choices=("on", "off"),
                   help="with --save: orbax's zstd compression of the arrays (tensorstore "
                        "compresses on every core of the host)")
    p.add_argument("--gc-freeze", default="on", choices=("on", "off"),
                   help="with --save: Python's long-lived objects kept out of the garbage "
                        "collector's walks, as main.py's loop does (heap.FrozenHeap); off: "
                        "each full collection walks the whole heap")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="with --save: Python's thread switch interval in seconds during the "
                        "measurement (sys.setswitchinterval; default: as it is, 0.005), the "
                        "longest the training thread waits for the interpreter while a saving "
                        "thread holds it")
    p.add_argument("--packed", default="on", choices=("on", "off"),
                   help="with --save: the Checkpointer's packed format (on: a state on one "
                        "device written as a few flat arrays; off: one array in the files per "
                        "array, 448 for GPT-2 small, each with orbax's Python work on its "
                        "saving threads)")
    p.add_argument("--trainer-args", default="",
                   help="with --trainer: main.py --config.* arguments, one string, e.g. "
                        "--trainer-args='--config.data.max_files=50'")


def run(args) -> dict:
    from attention_jax.tools.bench import train_speed_gpu, train_speed_gpu_child, trainer
    shape = {**train_speed_gpu.SHAPES, **train_speed_gpu.SHAPES_TINY}[args.shape]
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"error: --batch {args.batch}; valid: an integer >= 1")
    if args.loss_chunk < 0:
        raise SystemExit(f"error: --loss-chunk {args.loss_chunk}; valid: an integer >= 0")
    if args.switch_interval is not None and not args.switch_interval > 0:
        raise SystemExit(f"error: --switch-interval {args.switch_interval}; valid: seconds > 0")
    for flag in ("save_window", "saves"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}; "
                             f"valid: an integer >= 1")
    loss_kernel = train_speed_gpu.one_loss_kernel(args.loss_kernel)
    norm_kernel = train_speed_gpu.one_norm_kernel(args.norm_kernel)
    row = {**shape.row(args.batch or shape.batches[0]), "loss_kernel": loss_kernel,
           "norm_kernel": norm_kernel}
    args.trainer = args.trainer or args.save
    import jax
    if jax.default_backend() == "cpu" and args.shape not in train_speed_gpu.SHAPES_TINY:
        # (it ran GPT-2's step on the CPU for minutes with nothing said)
        print(f"note: no GPU here: {args.shape}'s step runs on the CPU, for minutes a step "
              f"at this size; a quick look at the tool: --shape "
              f"{next(iter(train_speed_gpu.SHAPES_TINY))} --dtype float32", file=sys.stderr)
    which = "the trainer's step" if args.trainer else "the bare step"
    print(f"profiling {which}: {args.shape} batch {row['batch']} attention {args.implementation} "
          f"loss-chunk {args.loss_chunk} loss {loss_kernel} ...", file=sys.stderr, flush=True)
    if args.trainer:
        extra = (f"--config.train.loss_chunk_size={args.loss_chunk}",
                 f"--config.train.loss_kernel={loss_kernel}",
                 f"--config.model.norm_kernel={norm_kernel}", *shlex.split(args.trainer_args))
        compiled, state, batch = trainer.compiled_step(row, args.implementation, dtype=args.dtype,
                                                       extra=extra)
        if args.save:
            from attention_jax.tools.bench import save_window
            out = save_window.run(args, compiled, state, batch)
            out.update(row=row, step="checkpoint saves between the trainer's steps",
                       implementation=args.implementation, dtype=args.dtype)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "summary.json").write_text(json.dumps(out, indent=1))
            return out
        summary = profile_step(compiled, state, (batch,), args.steps, out_dir=args.out)
        loss = summary.pop("last")["loss"]
    else:
        compiled, state, batch = train_speed_gpu_child.compiled_ours(
            row, args.implementation, args.dtype, loss_chunk_size=args.loss_chunk)
        summary = profile_step(compiled, state, batch, args.steps, out_dir=args.out)
        loss = summary.pop("last")
    summary.update(row=row, step=which, implementation=args.implementation, dtype=args.dtype,
                   loss_chunk=args.loss_chunk, loss=float(loss))
    if args.out:
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{summary['device']}: {which}, {args.shape} batch {row['batch']}, attention "
          f"{args.implementation}, loss-chunk {args.loss_chunk}, loss kernel {loss_kernel}, "
          f"loss {summary['loss']:.3f}")
    print(table(summary, args.top))
    return summary
