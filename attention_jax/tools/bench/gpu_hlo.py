r"""The bare step as XLA compiles it for an H100, on a machine without a GPU:
`python -m attention_jax.tools.bench gpu-hlo`.

    python -m attention_jax.tools.bench gpu-hlo                          # gpt2-124m, batch 16
    python -m attention_jax.tools.bench gpu-hlo --shape gpt2-medium --batch 16 --out /tmp/hlo
    python -m attention_jax.tools.bench gpu-hlo --kernel-code --pallas-tiles bwd=32x64 \
        --loss-settings chunk=8192,warps=16 --norm-settings rows=1,program_rows=16,warps=4

A GPU is lent to few sessions; the structure of the step it runs need not wait for one.
JAX's CUDA plugin compiles without a device for a device it is told about
(`jax.experimental.topologies` with a target description: an H100 SXM below), and
`attention.compiling_for("gpu")` makes attention choose and lower as on the GPU (the
Pallas kernels for Triton). What comes back is the optimized module XLA:GPU would run,
read here into:

  kernels       each launch of the entry computation by kind: matmuls (cuBLAS calls and
                XLA's Triton GEMM fusions), attention (the Pallas kernels' Triton calls,
                cuDNN's), memory-bound (every other fusion, copy, scatter, reduction, and
                the Pallas kernels of the loss, models/loss_kernel.py: `--loss-kernel`,
                and of the residual add and norm, layers/norm_kernel.py)
  bytes         what each memory-bound kernel reads and writes: its operands and results,
                an operand that the kernel only slices counted as its slices, one handed
                to it twice counted once; the sum at
                the GPU's bandwidth is the time those kernels need at the least (on the
                H100 on 2026-11-24 the profile's memory-bound kernels took 12.5 ms of
                GPT-2 small's step)
  sources       those bytes grouped by where in the model they come from (the JAX
                operation XLA recorded, layer numbers folded: the 12 layers' LayerNorms
                are one row), largest first
  memory        XLA's memory analysis: what the step needs in the GPU's memory
  save compile  the seconds the checkpoint's save programs (background_save.SavePrograms:
                the state's copy, the digest sums) take to compile for the GPU here: what
                a first save waits for when they are not compiled ahead
  kernel code   (--kernel-code) the Pallas kernels' PTX, launches, registers, programs an
                SM and SASS loops (`kernel_code`); with --pallas-tiles, --loss-settings
                and --norm-settings the step is compiled with those launch settings, so
                a setting that spills or leaves the SMs half empty is seen before a GPU
                call sweeps it

So a change to the model's structure (a fused kernel, a different layout) shows its
effect on the memory-bound bytes on a CPU host; its speed still needs the GPU. Matmul
tiles are XLA's defaults here (no autotuning without a device), which changes no fusion.
cuDNN's attention needs cuDNN present to lower, so `--implementation pallas` is the
default. The plugin runs in a child process, so this process's JAX stays on its CPU:
`make install` puts it in .venv/gpu-aot (jax-cuda12-plugin and jax-cuda12-pjrt of the
installed JAX's version; about 180 MB).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# An H100 SXM5 80GB as XLA:GPU's compiler reads a device (its GpuTargetConfig): 132 SMs
# at 1.98 GHz, 3.35 TB/s of HBM3, 50 MiB of L2, compute capability 9.0, and the memory
# the device reports (84,929,347,584 bytes). cuDNN 9 and CUDA 12 are what the compiler
# may assume of the runtime.
H100 = {"name": "NVIDIA H100 80GB HBM3", "sms": 132, "clock_ghz": 1.98,
        "bandwidth": 3.35e12, "l2_bytes": 50 * 2**20, "memory_bytes": 84_929_347_584}
# What an SM of compute capability 9.0 holds at once (CUDA's occupancy rules,
# cuda_occupancy.h): 65,536 registers in 4 sub-partitions of 16,384, given out a warp at
# a time in units of 256, at most 255 a thread and 65,536 a program; 2048 threads; 32
# programs (blocks); 228 KiB of shared memory (at the largest carveout), each program's
# share rounded up to 128 bytes after the 1 KiB the runtime reserves for it.
SM90 = {"registers": 65536, "subpartitions": 4, "register_unit": 256, "thread_registers": 255,
        "threads": 2048, "programs": 32, "shared_bytes": 233472, "shared_reserved": 1024,
        "shared_unit": 128}


def target_config(gpu: dict = H100) -> str:
    """The GpuTargetConfig text proto that describes `gpu` to the CUDA plugin."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {gpu['sms']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu['bandwidth'])}
  l2_cache_size: {gpu['l2_bytes']}
  clock_rate_ghz: {gpu['clock_ghz']}
  device_memory_size: {gpu['memory_bytes']}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{gpu['name']}"
"""


# ------------------------------------------------------------------ reading the module
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
# Instructions that launch nothing: views, tuples, constants.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                "partition-id", "replica-id", "opt-barrier"}


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return total


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}; the entry computation as "ENTRY"."""
    found, name = {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            found[name].append(line)
    return found


def _sliced_reads(body: list[str]) -> dict[int, int]:
    """{parameter index: bytes read} for the parameters of a fused computation that its
    instructions only slice: a kernel reads the slices, not the whole operand."""
    params, users = {}, collections.defaultdict(list)
    for line in body:
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        if op == "parameter":
            params[name] = int(re.match(r"(\d+)\)", rest).group(1))
        for operand in re.findall(r"%([\w.\-]+)", rest.split("), ")[0]):
            users[operand].append((op, shape))
    return {index: sum(shape_bytes(s) for _, s in users[name]) for name, index in params.items()
            if users[name] and all(op in ("slice", "dynamic-slice") for op, _ in users[name])}


def _dims(shape: str) -> list[int]:
    """The dimensions of an HLO shape string's first array ("bf16[16,8]{1,0}" -> [16, 8])."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _dot_flops(result_shape: str, lhs_shape: str, contracting: str) -> int:
    """2 × the result's elements × the lhs's contracted size: one multiply-add per pair."""
    lhs = _dims(lhs_shape)
    k = math.prod(lhs[int(d)] for d in filter(None, contracting.replace('"', "").split(",")))
    return 2 * math.prod(_dims(result_shape)) * k


def matmul_flops(line: str, comps: dict[str, list[str]], shapes: dict[str, str]) -> int:
    """FLOPs of a matmul kernel: the `dot`s of a GEMM fusion's computation, or a cuBLAS
    call's (its first operand the lhs, its dimension numbers in the backend config)."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    if called:
        body = comps.get(called.group(1), [])
        local = {}
        total = 0
        for inner in body:
            m = _INSTRUCTION.match(inner)
            if not m:
                continue
            name, shape, op, rest = m.groups()
            local[name] = shape
            if op == "dot":
                lhs = re.match(r"%([\w.\-]+)", rest).group(1)
                dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inner)
                total += _dot_flops(shape, local.get(lhs, ""), dims.group(1) if dims else "")
        return total
    m = _INSTRUCTION.match(line)
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
    if not m or not dims:
        return 0
    lhs = re.match(r"%([\w.\-]+)", m.group(4))
    return _dot_flops(m.group(2), shapes.get(lhs.group(1), "") if lhs else "", dims.group(1))


def kernel_kind(op: str, line: str) -> str:
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        target = target.group(1).lower() if target else ""
        # The loss's Pallas kernels (loss_kernel.py: a pass through the logits) and the
        # residual add and norm's (layers/norm_kernel.py): what XLA's fusions did there.
        if "cross_entropy" in line or "add_norm" in line:
            return "memory"
        if "fmha" in target or "cudnn" in target or "triton" in target:
            return "attention"  # cuDNN's fused attention, the Pallas kernels (Triton calls)
        if "gemm" in target or "matmul" in target:
            return "matmul"
        return "other"
    # XLA's Triton GEMMs: custom fusions whose backend config says so (the line names its
    # operands too, so a fusion that reads a GEMM's result mentions one as well).
    if op == "fusion" and re.search(r'"kind":"__triton\w*gemm\w*"|"kind":"__cu\w*gemm', line):
        return "matmul"
    if op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
              "send", "recv", "while", "conditional", "call"):
        return "other"
    return "memory"


def kernel_traffic(hlo_text: str) -> list[dict]:
    """One row per kernel the compiled module's entry computation launches: {"name",
    "op", "kind", "bytes" (operands + results; slices of a sliced operand), "source"
    (the JAX operation, `jit(...)/` left off)}."""
    comps = _computations(hlo_text)
    shapes, rows = {}, []
    for line in comps.get("ENTRY", []):
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if op in _NOT_KERNELS:
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0].split(")")[0])
        called = re.search(r"calls=%([\w.\-]+)", line)
        sliced = _sliced_reads(comps.get(called.group(1), [])) if called else {}
        # An array handed to a kernel twice is read once (the packed q, k, v that the
        # attention kernels take as three tiled inputs, pallas.pallas_packed_attention).
        first = {o: i for i, o in reversed(list(enumerate(operands)))}
        read = sum(sliced.get(i, shape_bytes(shapes.get(o, ""))) for o, i in first.items())
        source = re.search(r'op_name="([^"]*)"', line)
        kind = kernel_kind(op, line)
        rows.append({"name": name, "op": op, "kind": kind, "bytes": read + shape_bytes(shape),
                     "flops": matmul_flops(line, comps, shapes) if kind == "matmul" else 0,
                     "source": re.sub(r"^jit\([^)]*\)/", "", source.group(1)) if source else ""})
    return rows


def by_source(rows: list[dict], kind: str = "memory") -> list[dict]:
    """`kind`'s rows summed by source, layer numbers folded (layer_0 ... layer_11 ->
    layer_N, its scope's repeat too), largest first: {"source", "kernels", "bytes"}."""
    groups: dict[str, dict] = {}
    for r in rows:
        if r["kind"] != kind:
            continue
        source = re.sub(r"layer_\d+", "layer_N", r["source"]).replace("layer_N/layer_N", "layer_N")
        g = groups.setdefault(source, {"source": source, "kernels": 0, "bytes": 0})
        g["kernels"] += 1
        g["bytes"] += r["bytes"]
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def summarize(rows: list[dict], bandwidth: float) -> dict:
    kinds = {}
    for r in rows:
        k = kinds.setdefault(r["kind"], {"kernels": 0, "bytes": 0, "flops": 0})
        k["kernels"] += 1
        k["bytes"] += r["bytes"]
        k["flops"] += r.get("flops", 0)
    memory = kinds.get("memory", {"bytes": 0})
    return {"kinds": kinds, "memory_bound_ms": 1e3 * memory["bytes"] / bandwidth,
            "sources": by_source(rows)}


# The package's Pallas kernels, by the names their pallas_calls give them (the .entry of
# their PTX): attention/pallas.py, models/loss_kernel.py, layers/norm_kernel.py.
PALLAS_KERNELS = ("flash_", "cross_entropy_", "add_norm_")
# ptx.py's exponential: a fused multiply-add and a flush-to-zero exp2 in one inline block.
_FUSED_EXP2 = re.compile(r"fma\.rn\.ftz\.f32 t, [^;]+; ex2\.approx\.ftz\.f32 ")
_ENTRY = re.compile(r"\.entry (\w+)")


def kernel_code(dump_dir, ptxas: str | None = None, nvdisasm: str | None = None) -> list[dict]:
    """The package's Pallas kernels as XLA dumped their PTX (--xla_dump_to) when compiling
    for the GPU, a row each: its PTX instructions, its exponentials (`ex2`) and how many
    of those are attention/ptx.py's pair (FFMA + MUFU.EX2 in SASS), and its launch (the
    thunk sequence's programs, threads a program and shared memory); given CUDA's ptxas
    (none is needed for the rest), the registers a thread uses and the bytes it spills on
    an sm_90a, and with the launch how many programs share an SM (`programs_per_sm`) and
    in how many waves the grid runs on the H100's 132 SMs; given nvdisasm too, the SASS
    instructions in each of its loops (an iteration: a tile, or a chunk of a row). Both
    come with PyPI's nvidia-cuda-nvcc-cu12 and nvidia-cuda-nvdisasm (bin/ on the PATH)."""
    rows, launched = {}, launches(dump_dir)
    for path in sorted(Path(dump_dir).glob("*.ptx")):
        text = path.read_text()
        entry = _ENTRY.search(text)
        if not entry or not entry.group(1).startswith(PALLAS_KERNELS) or entry.group(1) in rows:
            continue
        fused = len(_FUSED_EXP2.findall(text))
        row = {"kernel": entry.group(1), "file": path.name,  # an inline block: 2 instructions
               "instructions": 2 * fused + len(re.findall(
                   r"^\s+(?:@%p\d+ )?[a-z][\w.]*[ \t][^\n]*;\s*$", text, re.M)),
               "exp2": text.count("ex2.approx"), "fused_exp2": fused,
               **launched.get(entry.group(1), {})}
        if ptxas:
            cubin = path.with_suffix(".cubin")
            done = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(cubin)],
                                  capture_output=True, text=True)
            used = re.search(r"Used (\d+) registers", done.stderr)
            spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr)
            row.update(registers=int(used.group(1)) if used else None,
                       spill_bytes=sum(map(int, spills)) if used else None)
            if used and "threads" in row:
                row["per_sm"], row["per_sm_limit"] = programs_per_sm(
                    row["registers"], row["threads"], row["shared_bytes"])
                row["waves"] = (row["programs"] / (H100["sms"] * row["per_sm"])
                                if row["per_sm"] else None)
            if nvdisasm and used:
                sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True,
                                      text=True).stdout
                row["loops"] = sass_loops(sass)
        rows[row["kernel"]] = row
    return list(rows.values())


# A kernel's launch in XLA's thunk sequence (--xla_dump_to): its grid, threads, and the
# shared memory it asks for (Triton's kernels take theirs at launch, so the PTX has none).
_LAUNCH = re.compile(r"\] (\w+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), "
                     r"(\d+)\]\s+shared_memory: (\d+) bytes")


def launches(dump_dir) -> dict[str, dict]:
    """{kernel name: {"programs", "threads", "shared_bytes"}} of each kernel XLA launches
    (the first launch of each name), read from the thunk sequences in its dump."""
    found = {}
    for path in sorted(Path(dump_dir).glob("*.thunk_sequence.txt")):
        for m in _LAUNCH.finditer(path.read_text()):
            gx, gy, gz, tx, ty, tz = map(int, m.group(2, 3, 4, 5, 6, 7))
            found.setdefault(m.group(1), {"programs": gx * gy * gz, "threads": tx * ty * tz,
                                          "shared_bytes": int(m.group(8))})
    return found


def programs_per_sm(registers: int, threads: int, shared_bytes: int,
                    sm: dict = SM90) -> tuple[int, str]:
    """(how many programs of a kernel an SM runs at once, what limits it: "registers",
    "shared memory", "threads" or "programs", those that bind alike joined by ", "), for
    `registers` a thread, `threads` a program and the shared memory it asks for. A
    memory-bound kernel needs enough of its loads in flight on each SM; a kernel whose
    tiles wait on one another needs a second program to run while one waits. 0: the
    program cannot run (more registers than a program or a thread may have)."""
    up = lambda n, unit: -(-n // unit) * unit  # noqa: E731
    warps = -(-threads // 32)
    per_warp = up(registers * 32, sm["register_unit"])
    parts = sm["subpartitions"]  # a warp's registers come from one sub-partition's
    fits = (registers <= sm["thread_registers"]
            and per_warp * up(warps, parts) <= sm["registers"])
    limits = {"registers": fits * (sm["registers"] // parts // per_warp) * parts // warps,
              "threads": sm["threads"] // (warps * 32), "programs": sm["programs"]}
    if shared_bytes:
        limits["shared memory"] = sm["shared_bytes"] // up(shared_bytes + sm["shared_reserved"],
                                                           sm["shared_unit"])
    most = min(limits.values())
    return most, ", ".join(name for name, n in limits.items() if n == most)


_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+")


def sass_loops(sass: str) -> list[int]:
    """The instructions of each loop in nvdisasm's listing of a kernel, in order: from a
    label to the last branch back to it (branches of 20 instructions or fewer, a
    reduction's shuffle steps, are not counted as loops)."""
    labels, loops = {}, {}
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L\w+):", line)
        if label:
            labels[label.group(1)] = i
        back = re.search(r"BRA `?\(?(\.L\w+)\)?", line)
        if back and labels.get(back.group(1), i) < i:
            start = labels[back.group(1)]
            loops[start] = sum(bool(_SASS_LINE.match(x)) for x in lines[start:i + 1])
    return [n for _, n in sorted(loops.items()) if n > 20]


# ------------------------------------------------------------------------ the child
def compile_step(row: dict, implementation: str, dtype: str, config_text: str,
                 settings: dict | None = None):
    """(the compiled module's text, its memory analysis as a dict, the save programs'
    compile seconds {"copy_s", "sums_s"}): the bare step of `row` (train_speed_gpu_child's)
    compiled for the described GPU, and the checkpoint's save programs for its state.
    settings: the Pallas kernels' launch settings, {"tiles": pallas.tiles' fields, "loss":
    loss_kernel.settings', "norm": norm_kernel.settings'}, each optional. Needs the CUDA
    plugin importable; runs in the child process."""
    import time

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from attention_jax.attention import compiling_for
    from attention_jax.tools.bench import train_speed_gpu_child
    topology = topologies.get_topology_desc(platform="cuda", target_config=config_text,
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("devices",))
    whole = NamedSharding(mesh, PartitionSpec())
    model, tx, step = train_speed_gpu_child._step_parts(row, implementation, dtype)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(
        jax.random.key(0), jnp.zeros((1, row["seq_len"]), jnp.int32))["params"]))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                         (params, jax.eval_shape(tx.init, params)))
    tokens = jax.ShapeDtypeStruct((row["batch"], row["seq_len"]), jnp.int32, sharding=whole)
    with compiling_for("gpu"), train_speed_gpu_child.kernel_settings(settings):
        compiled = step.lower(state, tokens, tokens).compile()
    m = compiled.memory_analysis()
    memory = {k: int(getattr(m, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
        "alias_size_in_bytes", "generated_code_size_in_bytes") if m is not None and hasattr(m, k)}
    from attention_jax import digests, packed_state
    # What Checkpointer.prepare compiles for a state on one GPU: the copy that packs it
    # into its flat arrays, and the digest sums over the state's own arrays.
    arrays = jax.tree.leaves(state)
    start = time.perf_counter()
    packed_state.device_program(state).lower(arrays).compile()
    save = {"copy_s": time.perf_counter() - start, "arrays": len(arrays),
            "flat_arrays": len(packed_state.layout_of(state).groups)}
    start = time.perf_counter()
    digests.device_sums.lower(arrays).compile()
    save["sums_s"] = time.perf_counter() - start
    return compiled.as_text(), memory, save


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    text, memory, save = compile_step(spec["row"], spec["implementation"], spec["dtype"],
                                      target_config(H100), spec.get("settings"))
    Path(spec["hlo"]).write_text(text)
    Path(spec["result"]).write_text(json.dumps({"memory": memory, "save_compile": save}))


# ----------------------------------------------------------------------- the parent
def plugin_path() -> str | None:
    """Where JAX's CUDA plugin is: "" when this environment imports it, the directory
    `make install` put it in (.venv/gpu-aot), or None."""
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins
        if any((Path(p) / "xla_cuda12").is_dir() for p in jax_plugins.__path__):
            return ""
    beside = Path(sys.prefix) / "gpu-aot"
    return str(beside) if (beside / "jax_plugins" / "xla_cuda12").is_dir() else None


def install_hint() -> str:
    import jax
    return (f"pip install --no-deps --target {Path(sys.prefix) / 'gpu-aot'} "
            f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}")


def add_parser(sub) -> None:
    # the launch settings' argparse types: checked as the benches that time them check them
    from attention_jax.tools.bench import attention_speed, loss_speed, norm_speed, train_speed_gpu
    p = sub.add_parser("gpu-hlo", help="the bare step compiled for an H100 on this machine: "
                                       "its kernels and the memory-bound bytes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes = {**train_speed_gpu.SHAPES, **train_speed_gpu.SHAPES_TINY}
    p.add_argument("--shape", default="gpt2-124m", choices=sorted(shapes))
    p.add_argument("--batch", type=int, default=None, help="default: the shape's first batch")
    p.add_argument("--implementation", default="pallas", choices=("pallas", "xla", "blockwise"),
                   help="attention (cuDNN's needs cuDNN present to lower)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--loss-kernel", default="auto",
                   help="the loss: xla (XLA's reductions) or pallas (models/loss_kernel.py); "
                        "auto: as on a GPU (pallas from a vocabulary of 4096)")
    p.add_argument("--norm-kernel", default="auto",
                   help="a block's residual add and norm: xla or pallas (layers/norm_kernel.py); "
                        "auto: as on a GPU (pallas)")
    p.add_argument("--top", type=int, default=25, help="sources listed")
    p.add_argument("--out", default=None, help="directory for the compiled module and summary.json")
    p.add_argument("--xla-flags", action="append", default=[],
                   help="added to XLA_FLAGS for the compile (an XLA:GPU option's effect on "
                        "the kernels, e.g. --xla-flags='--xla_gpu_enable_cublaslt=true'); "
                        "repeatable, all given apply together (one compile)")
    p.add_argument("--kernel-code", action="store_true",
                   help="also read the Pallas kernels' PTX (XLA's dump) and launches: their "
                        "instructions, exponentials, programs and threads; with CUDA's ptxas "
                        "on the PATH their registers and the programs an SM holds, with "
                        "nvdisasm the SASS instructions a loop")
    p.add_argument("--pallas-tiles", default=None, type=attention_speed.tiles_argument,
                   help="the attention kernels' tiles and warps, as bench attention's "
                        "(e.g. fwd=64x64,warps=4,bwd=32x64; what is not given: "
                        "kernel_block_sizes' for the shape)")
    p.add_argument("--loss-settings", default=None, type=loss_speed.settings_argument,
                   help="the loss kernels' launch settings, as bench loss's "
                        "--pallas-settings (e.g. chunk=8192,warps=16)")
    p.add_argument("--norm-settings", default=None, type=norm_speed.settings_argument,
                   help="the norm kernels' launch settings, as bench norm's "
                        "--pallas-settings (e.g. rows=1,program_rows=16,warps=4)")
    p.add_argument("--timeout", type=float, default=900, help="the compiling child's, seconds")


def run(args) -> dict:
    from attention_jax.tools.bench import train_speed_gpu
    shape = {**train_speed_gpu.SHAPES, **train_speed_gpu.SHAPES_TINY}[args.shape]
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"error: --batch {args.batch}; valid: an integer >= 1")
    where = plugin_path()
    if where is None:
        raise SystemExit(f"error: gpu-hlo needs JAX's CUDA plugin (no GPU needed); install it "
                         f"with: {install_hint()}")
    row = {**shape.row(args.batch or shape.batches[0]),
           "loss_kernel": train_speed_gpu.one_loss_kernel(args.loss_kernel),
           "norm_kernel": train_speed_gpu.one_norm_kernel(args.norm_kernel)}
    given = {name: text for name, text in (("tiles", args.pallas_tiles),
                                           ("loss", args.loss_settings),
                                           ("norm", args.norm_settings)) if text}
    settings = train_speed_gpu.launch_settings(given, args.implementation, row,
                                               attention_auto=False)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_hlo_"))
    out.mkdir(parents=True, exist_ok=True)
    spec = {"row": row, "implementation": args.implementation, "dtype": args.dtype,
            "settings": settings, "hlo": str(out / "step.hlo.txt"),
            "result": str(out / "child.json")}
    (out / "spec.json").write_text(json.dumps(spec))
    from attention_jax.tools.bench import trainer  # child_env: this copy of the package
    env = trainer.child_env(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                            CUDA_VISIBLE_DEVICES="-1")
    if where:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], where])
    given_flags = " ".join(args.xla_flags)
    flags = given_flags + (f" --xla_dump_to={out / 'dump'}" if args.kernel_code else "")
    if flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    print(f"compiling the bare step of {args.shape} batch {row['batch']} for an "
          f"{H100['name']} (attention {args.implementation}) ...", file=sys.stderr, flush=True)
    import shutil
    scratch = not args.out  # a temporary folder: removed however the compile ends
    try:
        done = subprocess.run([sys.executable, "-m", "attention_jax.tools.bench.gpu_hlo",
                               str(out / "spec.json")], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        if scratch:
            shutil.rmtree(out, ignore_errors=True)
        raise SystemExit(f"error: compiling for the GPU took longer than --timeout="
                         f"{args.timeout:g} s; valid: a longer --timeout (default 900)") from None
    if done.returncode:
        if scratch:
            shutil.rmtree(out, ignore_errors=True)
        noise = ("cudart_stub", "absl::InitializeLog")  # the plugin, finding no driver
        tail = [l for l in done.stderr.strip().splitlines()
                if l.strip() and not any(n in l for n in noise)][-3:]
        raise SystemExit("error: compiling for the GPU failed: " + " | ".join(tail))
    rows = kernel_traffic(Path(spec["hlo"]).read_text())
    summary = {"row": row, "implementation": args.implementation, "dtype": args.dtype,
               "xla_flags": given_flags, "settings": settings, "settings_given": given,
               "gpu": H100["name"], **summarize(rows, H100["bandwidth"]),
               "weight_flops": weight_flops(row),
               **json.loads(Path(spec["result"]).read_text())}
    from attention_jax.layers import norm_kernel
    rows = (row["batch"] * row["seq_len"], row["width"])
    with norm_kernel.settings(**settings.get("norm", {})):
        if row["norm_kernel"] != "xla" and norm_kernel.unsupported(rows) is None:
            # What the norm kernels launch at the step's rows: the settings given, or
            # the defaults as they adapt to the rows' count and width.
            summary["norm_launch"] = norm_kernel.launch(*rows)
    if args.kernel_code:
        summary["kernel_code"] = kernel_code(out / "dump", shutil.which("ptxas"),
                                             shutil.which("nvdisasm"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(report(summary, args.top))
    if scratch:
        shutil.rmtree(out, ignore_errors=True)
    return summary


def weight_flops(row: dict) -> int:
    """What the model's matmuls with its weights need in a training step: 6 FLOPs per
    weight and token (models/flops.py), the weights being GPT-2's V·D (the tied head) and
    L·12·D² (the four projections; biases and norms are no matmul's). A step whose matmul
    kernels do more recomputes (remat) or multiplies something twice."""
    from attention_jax.models.flops import PER_PARAM
    d = row["width"]
    return PER_PARAM * row["batch"] * row["seq_len"] * (row["vocab"] * d
                                                        + row["layers"] * 12 * d * d)


_SETTINGS_NAMES = {"tiles": "attention tiles", "loss": "loss settings", "norm": "norm settings"}


def report(summary: dict, top: int = 25) -> str:
    gb = lambda b: f"{b / 1e9:.2f}"
    row = summary["row"]
    lines = [f"The bare step of {row['shape']}, batch {row['batch']} x {row['seq_len']}, "
             f"{summary['dtype']}, attention {summary['implementation']}, loss "
             f"{row.get('loss_kernel', 'auto')}, norms {row.get('norm_kernel', 'auto')}, as XLA compiles "
             f"it for an {summary['gpu']} (no GPU used)"
             + (f", XLA_FLAGS += {summary['xla_flags']}" if summary.get("xla_flags") else "")
             + "".join(f", {_SETTINGS_NAMES[what]} {text}"
                       for what, text in (summary.get("settings_given") or {}).items())
             + ".", ""]
    if summary.get("norm_launch"):
        lines += ["The norm kernels launch with {rows} rows a program at a time, {program_rows} "
                  "rows a backward program, {num_warps} warps.".format(**summary["norm_launch"]),
                  ""]
    lines += ["| kernels | launches | GB read + written |", "|---|---|---|"]
    for kind, k in sorted(summary["kinds"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"| {kind} | {k['kernels']} | {gb(k['bytes'])} |")
    lines += ["", f"The memory-bound kernels need {summary['memory_bound_ms']:.2f} ms at the "
                  f"GPU's {H100['bandwidth'] / 1e12:.2f} TB/s at the least."]
    matmul = summary["kinds"].get("matmul", {}).get("flops", 0)
    if summary.get("weight_flops"):
        lines.append(f"The matmul kernels do {matmul / 1e12:.2f} TFLOP, "
                     f"{matmul / summary['weight_flops']:.3f}x what the model's weights need "
                     f"(6 per weight and token; above 1: recomputed or repeated matmuls).")
    lines += ["",
              "| memory-bound, from | launches | GB |", "|---|---|---|"]
    for g in summary["sources"][:top]:
        lines.append(f"| `{g['source'][:90] or '(no source recorded)'}` | {g['kernels']} | "
                     f"{gb(g['bytes'])} |")
    memory = summary.get("memory") or {}
    if not memory:
        lines += ["", "Device memory: XLA gave no memory analysis for this module."]
    else:
        need = (memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
                + memory.get("temp_size_in_bytes", 0) - memory.get("alias_size_in_bytes", 0))
        lines += ["", f"Device memory (XLA's memory analysis): {need / 2**30:.1f} GiB of the "
                      f"{H100['memory_bytes'] / 2**30:.1f} GiB (temporaries "
                      f"{memory.get('temp_size_in_bytes', 0) / 2**30:.1f} GiB)."]
    code = summary.get("kernel_code")
    if code is not None:
        registers = any(r.get("registers") is not None for r in code)
        loops = any("loops" in r for r in code)
        lines += ["", "The Pallas kernels' PTX (the first of each name): instructions, "
                      "exponentials, and those that are one FFMA and one MUFU.EX2 "
                      "(attention/ptx.py); threads a program and shared memory as XLA "
                      "launches it" + ("; ptxas's registers and spills for sm_90a, the "
                                       "programs an SM holds at once and the grid's waves "
                                       "on 132 SMs"
                                              if registers else "; no ptxas on the PATH "
                                              "for registers")
                  + ("; SASS instructions in each loop (nvdisasm)." if loops else "."), "",
                  "| kernel | PTX instructions | exp2 | as FFMA + MUFU.EX2 | threads | "
                  "shared KiB |"
                  + (" registers | spilled bytes | programs an SM (limited by) | waves |"
                     if registers else "")
                  + (" loops |" if loops else ""),
                  "|---|---|---|---|---|---|" + ("---|---|---|---|" if registers else "")
                  + ("---|" if loops else "")]
        for r in code:
            per_sm = (f"{r['per_sm']} ({r['per_sm_limit']}) | "
                      + (f"{r['waves']:.1f}" if r["waves"] is not None else "cannot run")
                      if "per_sm" in r else " | ")
            shared = f"{r['shared_bytes'] / 1024:.1f}" if "shared_bytes" in r else ""
            lines.append(f"| {r['kernel']} | {r['instructions']} | {r['exp2']} | "
                         f"{r['fused_exp2']} | {r.get('threads', '')} | {shared} |"
                         + (f" {r.get('registers')} | {r.get('spill_bytes')} | {per_sm} |"
                            if registers else "")
                         + (f" {', '.join(map(str, r.get('loops', [])))} |" if loops else ""))
    save = summary.get("save_compile")
    if save:
        lines += ["", f"The checkpoint's save programs for its {save['arrays']} arrays compile "
                      f"here in {save['copy_s']:.1f} s (the copy into "
                      f"{save['flat_arrays']} flat arrays) and {save['sums_s']:.1f} s "
                      f"(the digest sums)."]
    return "\n".join(lines)


if __name__ == "__main__":
    _child(sys.argv[1])
