r"""The train benchmark on a GPU: `python -m attention_jax.tools.bench train` there.

    python -m attention_jax.tools.bench train                      # all shapes below
    python -m attention_jax.tools.bench train --quick              # gpt2-124m, batch 16 only
    python -m attention_jax.tools.bench train --shapes gpt2-medium --implementation auto,cudnn
    python -m attention_jax.tools.bench train --shapes gpt2-xl --fit  # + the largest batch
    python -m attention_jax.tools.bench train --quick --xla-flags='--xla_gpu_enable_latency_hiding_scheduler=true'

`train_speed.run` sends here when JAX's backend is a GPU (asked in a child process; see
below).
Shapes (T = 1024, vocabulary 50304 = 50257 padded to a multiple of 64, as nanoGPT does):

  gpt2-124m    12 layers, 12 heads, width 768, batch 16 and 32
  gpt2-medium  24 layers, 16 heads, width 1024, batch 8 and 16
  gpt2-xl      48 layers, 25 heads, width 1600, batch 8 and 16, each block recomputed in
               the backward pass on both sides (remat "full"; torch.utils.checkpoint)

--fit adds, per shape and attention, the largest batch whose step fits in the device's
memory, from XLA's compiled memory analysis (nothing runs; the step's memory is affine
in the batch: batches 1 and 2 predict it, the prediction is compiled to check).
--xla-flags F (repeatable) times our rows once more with F added to XLA_FLAGS, labelled
xla0, xla1, ...: a flag is kept in the project only if it measures faster.
--packing documents,stream runs the trainer rows once per data.packing: "documents"
(the default) gives attention the packed documents' segment ids (the Pallas kernels on
a GPU), "stream" the bare step's plain causal rows (cuDNN), which splits what the
document masks cost in the trainer from the rest.

What is timed: one training step, forward + backward + AdamW update (lr 3e-4, betas
(0.9, 0.95), weight decay 0.1 on matrices), float32 parameters and optimizer state,
bfloat16 compute, random tokens (the same batch every step: throughput only).
Ours: bare_step.py's step, `jax.jit` of value_and_grad of models/gpt.py's next-token
cross-entropy (models/losses.py) plus `optax.adamw`, the state donated,
GPTConfig(dtype="bfloat16"), attention from `--implementation` (default "auto"; a
comma-separated list times several); `--loss-chunk N` applies the LM head and the loss N
positions at a time (losses.chunked_head_cross_entropy: the [B, T, V] float32 logits,
3.3 GB at gpt2-124m batch 16, never exist at once; 0, the default, builds them whole; a
comma-separated list times several); `--loss-kernel xla,pallas` how the whole logits'
loss is computed (losses.head_cross_entropy: XLA's reductions, or the Pallas kernels of
loss_kernel.py, which read the logits twice and write them once for the forward and
backward passes, against XLA's three reads; "auto", the default, is pallas on a GPU at these vocabularies).
The peer (torch_gpt.py): a GPT-2 written here in nanoGPT's manner, `torch.compile`,
bfloat16 autocast, SDPA causal attention, fused AdamW. Both sides: a few warm-up steps
(compilation), then `--repeats` timings of `--steps` steps queued back to back and ended by
one wait, the median per step.

Where each side runs: every measurement is a child process, one after the other; this
(parent) process never initialises the GPU. JAX preallocates 75% of the GPU's memory when
it starts, so a PyTorch peer sharing a process, or running next to a live JAX process,
would measure in what is left. Order: device query, the PyTorch peer (skipped with a note
when torch has no CUDA), the matmul rate, our rows, then the trainer's rows (trainer.py:
the trainer's own jitted step timed alone on a real batch, "trainer step", then main.py
on the same shape with real data, its own logged tokens/s; `--trainer-steps 0` leaves
them out; with saves inside the run, e.g. `--trainer-steps 300
--trainer-args='--config.train.checkpoint_every=100'`, each save's cost is printed and
kept in the row: what it held the training thread and what its window lost); one process per row, so an out-of-memory row is recorded in the table
and the next starts on an empty GPU.

Model FLOPs per token (PaLM, Chowdhery et al. 2022, App. B; models/flops.py's
flops_per_token, as for the CPU rows and the trainer):
    6·N + 12·L·T·D,   N = V·D + L·(12·D² + 13·D) + 2·D
N: parameters without the position table (the tied embedding counted once). MFU =
FLOPs per token × tokens/s ÷ a peak, two of them: H100_BF16_PEAK, the H100 SXM's dense
bfloat16 rate from NVIDIA's datasheet (989 TFLOP/s; the PCIe card's is 756, so read the
device name in the output), and an 8192³ bfloat16 matmul through XLA timed in the same
run (timing.matmul_rate, median of repeats): what the GPU actually sustains on the
best-case matmul.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from attention_jax.data.objectives import PACKINGS
from attention_jax.errors import UserError
from attention_jax.models import flops
from attention_jax.tools.bench import trainer
from attention_jax.tools.bench.kernel_bench import parse_loss_kernels, parse_norm_kernels

H100_BF16_PEAK = 989e12  # FLOP/s: H100 SXM5, dense bfloat16 (NVIDIA H100 datasheet)
MATMUL_SIZE = 8192
GPU_REPEATS = 5  # timings of --steps steps each; the median is reported
IMPLEMENTATIONS = ("auto", "cudnn", "pallas", "blockwise", "xla", "reference")


@dataclasses.dataclass(frozen=True)
class GPUShape:
    """A GPT-2-shaped model and the batches it is timed at."""
    name: str
    layers: int  # L
    heads: int  # N
    width: int  # D
    batches: tuple[int, ...]
    seq_len: int = 1024  # T
    vocab: int = 50304  # V
    remat: str = "none"  # activation checkpointing per block, on both sides (layers/blocks.py)

    def row(self, batch: int) -> dict:
        """What a child process needs to build one side of this shape at `batch`."""
        return {"shape": self.name, "layers": self.layers, "heads": self.heads,
                "width": self.width, "seq_len": self.seq_len, "vocab": self.vocab,
                "batch": batch, "remat": self.remat}


SHAPES = {
    "gpt2-124m": GPUShape("gpt2-124m", layers=12, heads=12, width=768, batches=(16, 32)),
    "gpt2-medium": GPUShape("gpt2-medium", layers=24, heads=16, width=1024, batches=(8, 16)),
    # 1.56B: its activations at batch 8 do not fit in 80 GB without recomputation.
    "gpt2-xl": GPUShape("gpt2-xl", layers=48, heads=25, width=1600, batches=(8, 16),
                        remat="full"),
}
QUICK = [("gpt2-124m", 16)]
# For the tests: compiles in seconds on a CPU.
# (The vocabulary holds the trainer row's 259 byte tokens.)
SHAPES_TINY = {"gpt-tiny-gpu": GPUShape("gpt-tiny-gpu", layers=1, heads=2, width=32,
                                        batches=(2,), seq_len=16, vocab=320)}


def matmul_params(row: dict) -> int:
    """N of the FLOP formula from the row's sizes, without building the model (this
    process never starts JAX's backend): V·D + L·(12D² + 13D) + 2D, which is
    flops.matmul_params of our GPT's parameters (a test checks it). Per block: LayerNorms
    2·2D, QKV 3D² + 3D, attention output D² + D, MLP 4D² + 4D and 4D² + D; then the
    final LayerNorm 2D and the (tied) token embedding V·D."""
    d, layers, v = row["width"], row["layers"], row["vocab"]
    return v * d + layers * (12 * d * d + 13 * d) + 2 * d


def finish_row(r: dict, matmul_rate: float | None, peak: float = H100_BF16_PEAK) -> dict:
    """Adds tokens/s, model FLOP/s and both MFUs to a measured row (not to a failed one)."""
    if "step_s" not in r:
        return r
    tokens_per_s = r["batch"] * r["seq_len"] / r["step_s"]
    per_token = flops.flops_per_token(matmul_params(r), r["layers"], r["seq_len"], r["width"])
    model_flops = per_token * tokens_per_s
    r.update(tokens_per_s=tokens_per_s, model_flops_per_s=model_flops, mfu_peak=model_flops / peak,
             mfu_matmul=model_flops / matmul_rate if matmul_rate else None)
    return r


def table(rows: list[dict], matmul_rate: float | None, device: str,
          matmul: str = f"bf16 matmul {MATMUL_SIZE}³") -> str:
    """Markdown: one line per (shape, batch, side); ours ÷ peer is step-time speed-up; the
    trainer's rows give their speed as a share of our bare step's (same attention), and
    main.py's row also as a share of the trainer's jitted step alone (same packing)."""
    peers = {(r["shape"], r["batch"]): r for r in rows if r["side"] == "torch" and "step_s" in r}
    measured = lambda side: {(r["shape"], r["batch"], r["impl"], r.get("packing")): r
                             for r in rows if r["side"] == side and "step_s" in r}
    steps, trainer_steps = measured("jax"), measured("trainer step")
    lines = [f"| shape | batch | side / attention | ms/step | tokens/s | MFU vs "
             f"{H100_BF16_PEAK / 1e12:.0f} peak | MFU vs matmul | ours ÷ peer (speed) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = _attention_label(r["impl"], r.get("packing"), r.get("attention_used"))
        side = f"{r['side']} / {label}"
        if "step_s" not in r:
            err = r.get("error", "no result").replace("|", "/")
            lines.append(f"| {r['shape']} | {r['batch']} | {side} | failed: {err} "
                         "| – | – | – | – |")
            continue
        peer = peers.get((r["shape"], r["batch"]))
        ratio = f"{peer['step_s'] / r['step_s']:.2f}×" if r["side"] == "jax" and peer else ""
        key = (r["shape"], r["batch"], r["impl"], r.get("packing"))
        bare = steps.get((r["shape"], r["batch"], r["impl"], None))
        if r["side"] in ("trainer", "trainer step") and bare:
            ratio = f"{bare['step_s'] / r['step_s']:.2f} of our step"
        if r["side"] == "trainer" and key in trainer_steps:
            ratio += (", " if ratio else "") + (
                f"{trainer_steps[key]['step_s'] / r['step_s']:.2f} of the trainer step")
        mfu_mm = f"{100 * r['mfu_matmul']:.1f}%" if r.get("mfu_matmul") else "–"
        lines.append(f"| {r['shape']} | {r['batch']} | {side} | {1e3 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {100 * r['mfu_peak']:.1f}% | {mfu_mm} "
                     f"| {ratio} |")
    rate = f"{matmul_rate / 1e12:.0f} TFLOP/s" if matmul_rate else "not measured"
    lines += ["", f"Device: {device}. {matmul} through XLA: {rate}; peak "
                  f"{H100_BF16_PEAK / 1e12:.0f} TFLOP/s is the H100 SXM's dense bf16 figure."]
    return "\n".join(lines)


def select_rows(quick: bool, shapes: list[str] | None, table_=None) -> list[tuple[str, int]]:
    """(shape name, batch) pairs: --quick, else every shape's batches, filtered by --shapes
    (a name, or name:batch)."""
    table_ = table_ or SHAPES
    pairs = list(QUICK) if quick else [(n, b) for n, s in table_.items() for b in s.batches]
    if shapes:
        valid = sorted(table_) + [f"{n}:{b}" for n, s in table_.items() for b in s.batches]
        unknown = [s for s in shapes if s not in valid]
        if unknown:
            raise SystemExit(f"error: --shapes {unknown} unknown; valid: {valid}")
        pairs = [(n, b) for n, b in pairs if n in shapes or f"{n}:{b}" in shapes]
    return pairs


# ===================================================== labels the parent and its children share
def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _attention_label(impl: str, packing: str | None, used: str | None = None) -> str:
    """A row's attention in the table, with what auto chose where a bare row says; a
    trainer row also names its data.packing."""
    if used and impl.split(",")[0].split(" ")[0] == "auto":
        impl = impl.replace("auto", f"auto ({used})", 1)
    return f"{impl}, {packing} packing" if packing else impl


def _impl_label(implementation: str, loss_chunk_size: int, loss_kernel: str = "auto",
                norm_kernel: str = "auto") -> str:
    """The table's attention column, with the loss chunk, the loss's kernel and the norms'
    when not the default."""
    label = f"{implementation} loss-chunk {loss_chunk_size}" if loss_chunk_size else implementation
    if loss_kernel != "auto" and not loss_chunk_size:
        label += f", loss {loss_kernel}"
    return label if norm_kernel == "auto" else f"{label}, norm {norm_kernel}"


# --fit only compiles (three or more times per shape) and reads the memory analysis, so
# it skips autotuning the matmuls, a large share of a GPU compile: the step's buffers are
# the same whichever kernel runs a matmul (its scratch workspace aside). With autotuning,
# the GPT-2 medium fit outlasted a 10-minute call on the H100.
FIT_XLA_FLAGS = "--xla_gpu_autotune_level=0"


# ======================================================================== the parent process
def gpu_available(timeout: float = 300) -> dict | None:
    """The device info if JAX's default backend is a GPU, else None; asked in a child
    process so that this one never initialises the GPU. Skipped (None) at once when no
    JAX CUDA/ROCm plugin is installed or JAX_PLATFORMS names no GPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return None
    import pkgutil
    names = {m.name for m in pkgutil.iter_modules()}
    plugin = any(n.startswith(("jax_cuda", "jax_rocm")) for n in names)
    if _findable("jax_plugins"):
        import jax_plugins
        plugin |= any("cuda" in m.name or "rocm" in m.name
                      for m in pkgutil.iter_modules(jax_plugins.__path__))
    if not plugin:
        return None
    info = _child_info(timeout)
    return info if info.get("backend") == "gpu" else None


def _child_info(timeout: float) -> dict:
    return _child(["info"], timeout)


def _child(args: list[str], timeout: float,
           module: str = "attention_jax.tools.bench.train_speed_gpu_child",
           xla_flags: str = "") -> dict | list:
    """Runs `python -m module args --out F` and returns F's JSON, or {"error": ...} when the
    process failed (its stderr's tail goes to our stderr). xla_flags: added to the
    child's XLA_FLAGS."""
    env = None
    if xla_flags:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s", "returncode": None}
        if out.exists():
            try:
                return json.loads(out.read_text())
            except json.JSONDecodeError:
                pass
        tail = done.stderr.strip().splitlines()
        if done.returncode:
            print(f"    child {' '.join(args[:1])} exited {done.returncode}:\n"
                  + "\n".join("      " + x for x in tail[-15:]), file=sys.stderr, flush=True)
        return {"error": (tail[-1][:200] if tail else f"exit code {done.returncode}"),
                "returncode": done.returncode}


def trainer_log_every(trainer_steps: int) -> int:
    """The trainer rows' logging interval: six windows a run, the first left out."""
    return max(1, trainer_steps // 6)


def check_trainer_options(args, row: dict, impls) -> None:
    """--trainer-steps and --trainer-args as the trainer's rows will take them, before any
    row runs: one step gave trainer.measure's ValueError after every other row had run,
    and a misspelt --config key failed both trainer rows after them."""
    steps = args.trainer_steps
    if not steps:
        return
    try:
        trainer.check_windows(steps, trainer_log_every(steps))
    except ValueError:
        raise SystemExit(f"error: --trainer-steps={steps}: the trainer's rows time the logged "
                         f"windows after the first; valid: 0 (no trainer rows) or >= 2") from None
    extra = tuple(shlex.split(args.trainer_args))
    try:
        trainer.experiment_config(row, impls[0], args.dtype, steps, extra)
    except (UserError, ValueError) as e:
        raise SystemExit(f"error: --trainer-args={args.trainer_args!r}: {e}") from None


def run(args, info: dict | None = None, shapes_table: dict | None = None) -> list[dict]:
    """`bench train` on a GPU (see the module docstring). `info`: the device info the
    caller already has; `shapes_table`: SHAPES unless a test passes SHAPES_TINY."""
    table_ = shapes_table or SHAPES
    info = info or _child_info(args.child_timeout)
    device = info.get("device", "unknown device")
    if info.get("backend", "gpu") != "gpu":  # it ran GPT-2's rows on the CPU until killed
        raise SystemExit(f"error: --device gpu: JAX's backend here is {info['backend']!r} "
                         f"({device}); valid: --device cpu or auto on this machine")
    impls = [i.strip() for i in (args.implementation or "auto").split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLEMENTATIONS]
    if bad:
        raise SystemExit(f"error: --implementation {bad} unknown; valid: {list(IMPLEMENTATIONS)}")
    chunks = parse_loss_chunks(getattr(args, "loss_chunk", "0"))
    loss_kernels = parse_loss_kernels(getattr(args, "loss_kernel", "auto"))
    norm_kernels = parse_norm_kernels(getattr(args, "norm_kernel", "auto"))
    packing_arg = getattr(args, "packing", "documents")
    packings = [p.strip() for p in packing_arg.split(",") if p.strip()]
    if not packings or set(packings) - set(PACKINGS):
        raise SystemExit(f"error: --packing {packing_arg!r}; valid: {list(PACKINGS)}, "
                         "comma-separated")
    pairs = select_rows(args.quick, args.shapes, table_)
    check_trainer_options(args, table_[pairs[0][0]].row(pairs[0][1]), impls)
    # Each set of --xla-flags read by XLA now, in a child that only starts JAX: a typo
    # failed its rows only after the peer's and the plain rows' minutes.
    for flags in dict.fromkeys(getattr(args, "xla_flags", None) or []):
        got = _child(["info"], args.child_timeout, xla_flags=flags)
        if "error" in got:
            raise SystemExit(f"error: --xla-flags={flags!r}: a child starting JAX with it "
                             f"failed ({got['error']})")
    # The row with the kernels' launch options given, checked for every row before any runs.
    given = {name: text for name, text in (
        ("tiles", getattr(args, "pallas_tiles", None)),
        ("loss", getattr(args, "loss_settings", None)),
        ("norm", getattr(args, "norm_settings", None))) if text}
    # A row of ours runs with them where its kernels are the Pallas ones they set (e.g. of
    # --norm-kernel xla,pallas the pallas rows); none such is an error.
    launch_for: dict = {}
    if given:
        refusals = []
        for (name, batch), impl, chunk, lk, nk in [
                (p, i, c, lk, nk) for p in pairs for i in impls for c in chunks
                for lk in loss_kernels for nk in norm_kernels]:
            try:
                launch_for[(name, batch, impl, chunk, lk, nk)] = launch_settings(
                    given, impl, {**table_[name].row(batch), "loss_kernel": lk,
                                  "norm_kernel": nk}, chunk)
            except KernelsLeftOut as e:  # (a setting wrong for a row that runs them: raised)
                refusals.append(e)
        if not launch_for:
            raise refusals[0]
        if refusals:  # rows whose kernels they do not set get none: said, not left unsaid
            print(f"launch settings {given}: a row with them beside {len(launch_for)} of our "
                  f"{len(launch_for) + len(refusals)} rows, those running their kernels "
                  f"({str(refusals[0]).removeprefix('error: ')})", file=sys.stderr)
    print(f"GPU: {device}; rows {pairs}; attention {impls}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    timing = ["--warmup", str(args.warmup), "--repeats", str(args.repeats),
              "--steps", str(args.steps)]
    rows: list[dict] = []
    record = {"device": device, "jax": info.get("jax"), "peak_flops_per_s": H100_BF16_PEAK,
              "matmul_flops_per_s": None, "rows": rows}

    def save():
        out.write_text(json.dumps(record, indent=1))

    # 1. The PyTorch peer, first: nothing of ours holds GPU memory yet.
    if args.no_torch:
        print("torch peer: skipped (--no-torch)", file=sys.stderr)
    elif not _findable("torch"):
        print("torch peer: skipped (torch is not installed)", file=sys.stderr)
    else:
        for name, batch in pairs:
            row = table_[name].row(batch)
            print(f"  torch {name} batch {batch} ...", file=sys.stderr, flush=True)
            got = _child(["--rows", json.dumps([row]), *timing], args.child_timeout,
                         module="attention_jax.tools.bench.torch_gpt")
            if isinstance(got, dict) and got.get("returncode") == 3:  # torch has no CUDA
                print("torch peer: skipped (torch has no CUDA device)", file=sys.stderr)
                break
            if isinstance(got, list):
                result = got[0] if got else {"error": "the peer wrote no row"}
            else:
                result = {k: v for k, v in got.items() if k != "returncode"}
            rows.append({**row, "side": "torch", "impl": "sdpa + compile", **result})
            save()
    # 2. The matmul yardstick.
    matmul = f"{'bf16' if args.dtype == 'bfloat16' else args.dtype} matmul {args.matmul_size}³"
    print(f"  {matmul} ...", file=sys.stderr, flush=True)
    mm = _child(["matmul", "--size", str(args.matmul_size), "--dtype", args.dtype],
                args.child_timeout)
    rate = mm.get("flops_per_s")
    record["matmul_flops_per_s"] = rate
    print(f"    {rate / 1e12:.0f} TFLOP/s" if rate else f"    failed: {mm.get('error')}",
          file=sys.stderr, flush=True)
    # 3. Ours: one process per row, attention implementation, loss chunk and XLA flags.
    # The rows without extra flags first, always: each flag set is timed beside them.
    flag_sets = list(dict.fromkeys(["", *(getattr(args, "xla_flags", None) or [])]))
    record["xla_flags"] = {f"xla{k}": f for k, f in enumerate(flag_sets) if f}
    for name, batch in pairs:
        for impl, chunk, lk, nk, k, launch in [
                (i, c, lk, nk, k, g) for i in impls for c in chunks for lk in loss_kernels
                for nk in norm_kernels for k in range(len(flag_sets)) for g in (None, given)
                if g is None or (name, batch, i, c, lk, nk) in launch_for]:
            row = {**table_[name].row(batch), "loss_kernel": lk, "norm_kernel": nk}
            label = (_impl_label(impl, chunk, lk, nk) + (f" xla{k}" if flag_sets[k] else "")
                     + ("" if launch is None else " with " + ", ".join(
                         f"{LAUNCH_FLAGS[n][0][2:]} {t}" for n, t in launch.items())))
            settings = {} if launch is None else launch_for[(name, batch, impl, chunk, lk, nk)]
            print(f"  jax {name} batch {batch} attention {label} ...", file=sys.stderr, flush=True)
            result = _child(["jax", "--row", json.dumps(row), "--implementation", impl,
                             "--dtype", args.dtype, "--loss-chunk", str(chunk), *timing,
                             "--settings", json.dumps(settings)],
                            args.child_timeout, xla_flags=flag_sets[k])
            result.pop("returncode", None)
            rows.append({**row, "side": "jax", **result, "impl": label, "loss_chunk": chunk,
                         "xla_flags": flag_sets[k], "launch": launch or {}})
            r = rows[-1]
            print(f"    {r['error'] if 'error' in r else '%.1f ms/step' % (1e3 * r['step_s'])}",
                  file=sys.stderr, flush=True)
            save()
    # 4. The trainer on the same shapes: its jitted step alone on a real batch, then
    # main.py itself (its own logged tokens/s).
    # Per packing of the documents (data.packing): "documents" gives attention segment
    # ids, "stream" the bare step's plain causal rows.
    if args.trainer_steps:
        for name, batch in pairs:
            for impl, packing in [(i, p) for i in impls for p in packings]:
                row = table_[name].row(batch)
                extra = (*shlex.split(args.trainer_args), f"--config.data.packing={packing}")
                label = _attention_label(impl, packing)
                print(f"  trainer step {name} batch {batch} attention {label} ...",
                      file=sys.stderr, flush=True)
                result = _child(["trainer-step", "--row", json.dumps(row), "--implementation",
                                 impl, "--dtype", args.dtype, *timing, "--extra", json.dumps(extra)],
                                args.child_timeout)
                result.pop("returncode", None)
                rows.append({**row, "side": "trainer step", "impl": impl, "packing": packing,
                             **result})
                print(f"  trainer {name} batch {batch} attention {label} ...", file=sys.stderr,
                      flush=True)
                result = trainer.measure(row, impl, dtype=args.dtype, steps=args.trainer_steps,
                                         log_every=trainer_log_every(args.trainer_steps),
                                         timeout=args.child_timeout, extra=extra)
                rows.append({**row, "side": "trainer", "impl": impl, "packing": packing,
                             **result})
                if "host_dispatch_frac" in result:
                    print(f"    host: {100 * result['host_data_frac']:.0f}% getting batches, "
                          f"{100 * result['host_dispatch_frac']:.0f}% in the step call",
                          file=sys.stderr, flush=True)
                for k, cost in enumerate(result.get("saves", [])):
                    print(f"    {'first save' if k == 0 else 'save'} (window to step "
                          f"{cost['step']}): held {cost['held_s']:.3f} s, window "
                          f"+{cost['extra_s']:.3f} s = {cost['extra_s'] / result['step_s']:.1f} "
                          f"steps; garbage collections {cost['gc_s']:.3f} s", file=sys.stderr,
                          flush=True)
                save()
    # 5. --fit: the largest batch of each shape that fits, from compiled memory.
    if getattr(args, "fit", False):
        record["fits"] = fits = []
        for name in dict.fromkeys(n for n, _ in pairs):
            for impl in impls:
                row = table_[name].row(1)
                print(f"  fit {name} attention {impl} ...", file=sys.stderr, flush=True)
                got = _child(["fit", "--row", json.dumps(row), "--implementation", impl,
                              "--dtype", args.dtype, "--limit-gib", str(args.fit_limit_gib)],
                             args.child_timeout, xla_flags=FIT_XLA_FLAGS)
                got.pop("returncode", None)
                fits.append({"shape": name, "impl": impl, "remat": row.get("remat", "none"),
                             **got})
                save()
    for r in rows:
        finish_row(r, rate)
    save()
    print(table(rows, rate, device, matmul))
    for k, flags in record["xla_flags"].items():
        print(f"{k}: XLA_FLAGS += {flags}")
    for f in record.get("fits", []):
        print(f"largest batch of {f['shape']} ({f['impl']}, remat {f['remat']}): "
              + (f"{f['largest_batch']} ({f['bytes'] / 2**30:.1f} of {f['limit_bytes'] / 2**30:.1f} "
                 f"GiB compiled; {f['bytes_per_row'] / 2**20:,.0f} MiB a row)"
                 if "largest_batch" in f else f"failed: {f.get('error')}"))
    print(f"\nwrote {out}")
    return rows


def parse_loss_chunks(text) -> list[int]:
    """--loss-chunk "0,256" -> [0, 256]; SystemExit naming the valid values otherwise."""
    try:
        chunks = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        chunks = [-1]
    if not chunks or min(chunks) < 0:
        raise SystemExit(f"error: --loss-chunk {text!r}; valid: integers >= 0, comma-separated "
                         "(0: whole logits)")
    return chunks


def one_loss_kernel(text) -> str:
    """--loss-kernel of a command that compiles one step: exactly one of LOSS_KERNELS."""
    from attention_jax.models.losses import LOSS_KERNELS  # imports JAX, not the GPU
    return _one("loss-kernel", text, parse_loss_kernels(text), LOSS_KERNELS)


def one_norm_kernel(text) -> str:
    """--norm-kernel of a command that compiles one step: exactly one of NORM_KERNELS."""
    from attention_jax.layers.norms import NORM_KERNELS  # imports JAX, not the GPU
    return _one("norm-kernel", text, parse_norm_kernels(text), NORM_KERNELS)


# The Pallas kernels' launch options: (their flag, the option the kernels are chosen by).
LAUNCH_FLAGS = {"tiles": ("--pallas-tiles", "--implementation"),
                "loss": ("--loss-settings", "--loss-kernel"),
                "norm": ("--norm-settings", "--norm-kernel")}


class KernelsLeftOut(SystemExit):
    """A launch setting for kernels a row does not run (bench train gives that row none)."""


def launch_settings(given: dict, implementation: str, row: dict, loss_chunk: int = 0,
                    attention_auto: bool = True) -> dict:
    """{"tiles", "loss", "norm": the kernels' settings} of the option texts `given` (keyed
    the same; what is absent: the defaults), for a step whose attention is
    `implementation` and whose row names its "loss_kernel" and "norm_kernel" (and a
    chunked loss, loss_chunk > 0, runs no loss kernel). An option for kernels the step
    would not run is an error (KernelsLeftOut, a SystemExit), as is a norm setting the
    step's rows cannot take (SystemExit: the norms would be XLA's ops). attention_auto:
    whether --implementation auto is a choice (bench train's; gpu-hlo's is not)."""
    from attention_jax.tools.bench import attention_speed_gpu, loss_speed, norm_speed
    parse = {"tiles": attention_speed_gpu.parse_tiles, "loss": loss_speed.parse_settings,
             "norm": norm_speed.parse_settings}
    chosen = {"tiles": implementation, "loss": row["loss_kernel"], "norm": row["norm_kernel"]}
    settings = {}
    for name, text in given.items():
        flag, kernels = LAUNCH_FLAGS[name]
        if chosen[name] not in ("pallas", "auto"):
            raise KernelsLeftOut(f"error: {flag} is for the Pallas kernels, which {kernels} "
                                 f"{chosen[name]} leaves out; valid: {kernels} pallas"
                                 + ("" if name == "tiles" and not attention_auto else " or auto"))
        if name == "loss" and loss_chunk:
            raise KernelsLeftOut(f"error: {flag} is for the loss kernels, which --loss-chunk "
                                 f"{loss_chunk} leaves out (the chunked loss); valid: "
                                 f"--loss-chunk 0")
        settings[name] = parse[name](text)
    if "norm" in settings:
        from attention_jax.layers import norm_kernel
        rows = row["batch"] * row["seq_len"]
        with norm_kernel.settings(**settings["norm"]):
            why = norm_kernel.unsupported((rows, row["width"]))
        if why:
            raise SystemExit(f"error: --norm-settings: the norm kernels cannot take the "
                             f"step's rows: {why}; valid: rows a power of two dividing {rows}")
    return settings


def _one(flag: str, text, kernels: list[str], valid) -> str:
    if len(kernels) != 1:
        raise SystemExit(f"error: --{flag} {text!r}; valid: one of {list(valid)} (this "
                         f"command compiles one step)")
    return kernels[0]


def add_arguments(p) -> None:
    """The GPU mode's own options on `bench train`'s parser."""
    g = p.add_argument_group("GPU mode (when JAX's backend is a GPU)")
    g.add_argument("--quick", action="store_true", help="GPU: only gpt2-124m at batch 16")
    g.add_argument("--shapes", nargs="+",
                   help=f"GPU: shapes to run, a name or name:batch (default all: {list(SHAPES)})")
    g.add_argument("--steps", type=int, default=10,
                   help="GPU: steps queued back to back per timing (--repeats timings)")
    g.add_argument("--loss-chunk", default="0",
                   help="GPU: positions per chunk of the fused LM head + loss, e.g. 256 or "
                        "0,256 (0: whole logits)")
    g.add_argument("--loss-kernel", default="auto",
                   help="GPU: the whole logits' loss, xla or pallas (auto: pallas on a GPU), "
                        "e.g. xla,pallas")
    g.add_argument("--norm-kernel", default="auto",
                   help="GPU: a block's residual add and norm, xla or pallas (auto: pallas on "
                        "a GPU, layers/norm_kernel.py), e.g. xla,pallas")
    g.add_argument("--matmul-size", type=int, default=MATMUL_SIZE, help="GPU: the yardstick matmul")
    g.add_argument("--child-timeout", type=float, default=420,
                   help="GPU: seconds before a child process (one row) is given up")
    g.add_argument("--dtype", default="bfloat16",
                   help="GPU: our compute dtype and the matmul's (float32 for tests on a CPU, "
                        "whose dots refuse bf16 x bf16 -> f32)")
    g.add_argument("--trainer-steps", type=int, default=60,
                   help="GPU: steps of the trainer row (main.py on each shape; 0: no such row)")
    g.add_argument("--trainer-args", default="",
                   help="GPU: more main.py arguments for the trainer row, one string, e.g. "
                        "--trainer-args='--config.data.max_files=50' (or "
                        "'--config.train.checkpoint_every=100': each save's cost)")
    g.add_argument("--packing", default="documents",
                   help="GPU: the trainer rows' data.packing, e.g. documents,stream (documents: "
                        "segment ids, Pallas attention; stream: plain causal rows, cuDNN)")
    g.add_argument("--fit", action="store_true",
                   help="GPU: also find each shape's largest batch that fits (compiled memory)")
    g.add_argument("--fit-limit-gib", type=float, default=0,
                   help="GPU: the memory --fit fills (default: the device allocator's limit)")
    g.add_argument("--xla-flags", action="append", default=None,
                   help="GPU: extra XLA_FLAGS for another set of our rows (repeatable; each set "
                        "is timed beside the rows without, which always run), e.g. "
                        "--xla-flags='--xla_gpu_enable_latency_hiding_scheduler=true'")
    from attention_jax.tools.bench import attention_speed, loss_speed, norm_speed
    g.add_argument("--pallas-tiles", default=None, type=attention_speed.tiles_argument,
                   help="GPU: another row of our step, its attention kernels' tiles and warps "
                        "these (bench attention's --pallas-tiles, e.g. fwd=128x64,warps=8), "
                        "timed beside the defaults' row; with --loss-settings and "
                        "--norm-settings, one row with all given")
    g.add_argument("--loss-settings", default=None, type=loss_speed.settings_argument,
                   help="GPU: the same, the loss kernels' launch (bench loss's "
                        "--pallas-settings, e.g. chunk=8192,warps=16)")
    g.add_argument("--norm-settings", default=None, type=norm_speed.settings_argument,
                   help="GPU: the same, the norm kernels' launch (bench norm's "
                        "--pallas-settings, e.g. rows=8,program_rows=64,warps=4)")
    g.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                   help="which mode: auto asks JAX in a child process")
