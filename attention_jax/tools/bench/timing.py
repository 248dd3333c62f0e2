"""What the benchmarks time with: wall times of a blocking call, this machine's matmul
rate (the yardstick for FLOP rates and MFU), free memory, and whether a peer is installed."""

from __future__ import annotations

import importlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def wall_times(fn, repeats: int) -> list[float]:
    """Wall time of each of `repeats` calls of fn() (which must block until done)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs, after one untimed warm-up run."""
    fn()
    return statistics.median(wall_times(fn, repeats))


def queued_time(fn, args, repeats: int, steps: int) -> float:
    """Median seconds per call of fn(*args) over `repeats` timings of `steps` calls queued
    back to back and ended by one wait, after a warm-up."""
    queue = lambda: jax.block_until_ready([fn(*args) for _ in range(steps)])  # noqa: E731
    return median_time(queue, repeats) / steps


def queued_step_times(step, state, repeats: int, steps: int):
    """Seconds per step of `repeats` timings of `steps` training steps queued back to
    back and ended by one wait (the device never waits for the host in between).
    step(state) -> (state, out). Returns (times, the last state, the last out)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, out = step(state)
        jax.block_until_ready((state, out))
        times.append((time.perf_counter() - start) / steps)
    return times, state, out


def matmul_rate(size: int = 2048, repeats: int = 10, dtype: str = "float32",
                queued: int = 1) -> float:
    """This machine's rate on a size³ matmul of `dtype` inputs through XLA, in FLOP/s:
    the median of `repeats` timings, each of `queued` matmuls queued back to back and
    ended by one wait, after an untimed one. The CPU yardstick is float32 one at a
    time; the GPU's, bfloat16 (float32 accumulation) queued, as its steps are timed."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (size, size), jnp.dtype(dtype))
    b = jax.random.normal(kb, (size, size), jnp.dtype(dtype))
    mm = jax.jit(lambda a, b: a @ b)
    queue = lambda: jax.block_until_ready([mm(a, b) for _ in range(queued)])
    return 2 * size ** 3 * queued / median_time(queue, repeats)


def cpu_vector_isa() -> str:
    """The widest x86 vector extension this host has ("AVX-512", "AVX2" or "other"): CPU
    matmul rates and our kernels' ratios against PyTorch differ between the two."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "other"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "other"


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


def installed(*modules: str) -> bool:
    """Whether every one of `modules` can be imported (the PyTorch peers are optional)."""
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError:
        return False
    return True


def say_ignored_on_cpu(args) -> None:
    """A note naming the GPU-only options given (bench's main lists them) to a benchmark
    that runs on the CPU: they change nothing there, and were ignored without a word."""
    given = getattr(args, "gpu_only_given", None)
    if given:
        one = len(given) == 1
        print(f"note: {', '.join(given)} {'is' if one else 'are'} for a GPU run; this one runs "
              f"on the CPU and ignores {'it' if one else 'them'}", file=sys.stderr)
