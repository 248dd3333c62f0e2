"""The trainer's own throughput: `python -m attention_jax.main` on a benchmark shape, its
tokens/s read back from the run's metrics.jsonl.

`bench train --device gpu` adds one such row per shape and attention implementation,
beside the bare step of the same shape (train_speed_gpu.py): the gap between them is what
the trainer costs around the step (reading and sending batches, logging, checkpointing).
The run is configs/gpt2_gpu.py with the row's shape set over it: real data (the
byte-level stdlib corpus, packed; the vocabulary padded to the row's), AdamW, bf16, one
checkpoint at the end, no evaluation. Its first logged window holds the warm-up of the
input pipeline, so the figure is the median of the windows after it.

`measure_step` splits that gap in two: the trainer's own jitted step (steps.jit_steps:
its loss on packed documents, so attention with segment ids, gradient clipping, the
metrics, the non-finite guard) timed alone on one real batch, as the bare step is
timed. Bare step → trainer step is what the trainer's step computes beyond the bare
one; trainer step → trainer is the host's share (reading, sending, logging).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import attention_jax
from attention_jax import config as config_lib
from attention_jax import steps as steps_lib
from attention_jax import train
from attention_jax import workdir as workdir_lib

CONFIG = "gpt2_gpu"  # attention_jax/configs/gpt2_gpu.py


def overrides(row: dict, *, steps: int, log_every: int, implementation: str,
              dtype: str) -> dict:
    """The config keys (over configs/gpt2_gpu.py) that give `row`'s shape and run."""
    return {
        "model.num_layers": row["layers"], "model.num_heads": row["heads"],
        "model.d_model": row["width"], "model.max_len": row["seq_len"],
        "model.vocab_size": row["vocab"], "model.implementation": implementation,
        "data.seq_len": row["seq_len"], "train.batch_size": row["batch"],
        "train.compute_dtype": dtype, "train.steps": steps, "train.log_every": log_every,
        "train.checkpoint_every": steps, "optim.warmup_steps": min(10, steps),
        "eval.every": -1,
    }


def command(row: dict, workdir: str, *, steps: int, log_every: int, implementation: str,
            dtype: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The main.py command line that trains `row`'s shape for `steps` steps."""
    keys = overrides(row, steps=steps, log_every=log_every, implementation=implementation,
                     dtype=dtype)
    return [sys.executable, "-m", "attention_jax.main", f"--config={CONFIG}",
            f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in keys.items()),
            *extra]


def child_env(**extra: str) -> dict:
    """This process's environment with `extra` set, for a child that runs this copy of
    the package, wherever the parent found it."""
    package_root = str(Path(attention_jax.__file__).resolve().parents[1])
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}


def check_windows(steps: int, log_every: int) -> None:
    """`measure`'s run must log two windows at least: the first is left out."""
    if steps < 2 * log_every:
        raise ValueError(f"steps={steps} must be at least 2 × log_every={log_every}: the first "
                         f"window is left out")


def measure(row: dict, implementation: str, *, dtype: str = "bfloat16", steps: int = 60,
            log_every: int = 10, timeout: float = 600, extra: tuple[str, ...] = ()) -> dict:
    """{"step_s", "tokens_per_s_logged", "windows", "windows_tokens_per_s",
    "host_data_frac", "host_dispatch_frac"}: the median logged tokens/s of the windows
    after the first, as seconds per step, every window's figure, and the median shares of
    a window the host spent getting batches and calling the step; or {"error": ...}
    when the run failed or logged too few windows."""
    check_windows(steps, log_every)
    return run_commands(row, lambda workdir: [command(
        row, workdir, steps=steps, log_every=log_every, implementation=implementation,
        dtype=dtype, extra=extra)], env=child_env(), timeout=timeout)


def run_commands(row: dict, commands: Callable[[str], list[list[str]]], *, env: dict,
                 timeout: float) -> dict:
    """`measure`'s reading of one run of the trainer whose processes are the command
    lines `commands(workdir)` (one per process, started together, sharing a temporary
    workdir) run in `env`; `timeout` is each process's."""
    with tempfile.TemporaryDirectory() as workdir:
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for cmd in commands(workdir)]
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                    q.communicate()
                return {"error": f"timed out after {timeout:.0f} s"}
        records = [r for r in workdir_lib.read_records(
            workdir_lib.path(workdir, workdir_lib.METRICS)) if r.get("split") == "train"]
    rates = [r["tokens_per_sec"] for r in records]
    if any(p.returncode for p in procs) or len(rates) < 2:
        failed = next((p for p in procs if p.returncode), procs[0])
        tail = outputs[procs.index(failed)].strip().splitlines()
        return {"error": tail[-1][:200] if tail else f"exit code {failed.returncode}"}
    tokens_per_s = statistics.median(rates[1:])
    # The host's shares of each window (train.Throughput): getting batches, calling the
    # step, saving checkpoints; Python's garbage collections.
    host = {k: statistics.median(r[k] for r in records[1:])
            for k in ("host_data_frac", "host_dispatch_frac", "host_checkpoint_frac",
                      "host_gc_frac")
            if k in records[-1]}
    return {"step_s": row["batch"] * row["seq_len"] / tokens_per_s,
            "tokens_per_s_logged": tokens_per_s, "windows": len(rates) - 1,
            "windows_tokens_per_s": rates, **host,
            "saves": save_costs(records, row["batch"] * row["seq_len"], tokens_per_s)}


def save_costs(records: list[dict], tokens_per_step: int, tokens_per_s: float) -> list[dict]:
    """[{"step", "held_s", "extra_s", "gc_s"}] for each logged window that holds a
    checkpoint save (one made at the step that closed the window before:
    host_checkpoint_frac > 0): how long `save` held the training thread, how much longer
    the window took than the same steps at the run's median rate (the save's whole cost
    to training, what it held and what it slowed beside it), and how long Python's
    garbage collections held the interpreter in it. Issue 35's target: at most one
    step's time for every save after the first."""
    costs, previous = [], None
    for r in records:
        steps = r["step"] - previous if previous is not None else None
        previous = r["step"]
        if not steps or not r.get("host_checkpoint_frac"):
            continue
        window_s = steps * tokens_per_step / r["tokens_per_sec"]
        costs.append({"step": r["step"], "held_s": r["host_checkpoint_frac"] * window_s,
                      "extra_s": window_s - steps * tokens_per_step / tokens_per_s,
                      "gc_s": r.get("host_gc_frac", 0.0) * window_s})
    return costs


def experiment_config(row: dict, implementation: str, dtype: str, steps: int,
                      extra: tuple[str, ...] = ()):
    """The config main.py would run for `command(...)`: configs/gpt2_gpu.py with the
    row's keys and the `--config.*` arguments of `extra` set, as strings typed by their
    fields (config.load, as main.py loads it; `--config.KEY` alone sets a boolean); other
    arguments of `extra` are left out."""
    keys = overrides(row, steps=steps, log_every=1, implementation=implementation, dtype=dtype)
    given = [a.removeprefix("--config.") for a in extra if a.startswith("--config.")]
    return config_lib.load(CONFIG, [*(f"{k}={v}" for k, v in keys.items()),
                                    *(a if "=" in a else f"{a}=true" for a in given)])


def compiled_step(row: dict, implementation: str, *, dtype: str = "bfloat16", steps: int = 100,
                  extra: tuple[str, ...] = ()):
    """(compiled train_step(state, batch) -> (state, metrics), state, batch): the
    trainer's own step (steps.jit_steps) for `row`'s shape, compiled for the mesh of
    the experiment config, its fresh state, and one real batch on the devices (the
    packed corpus, as main.py reads it). steps: the run length the schedule is set for.
    The data is built or read under the config's data_dir (a temporary workdir holds
    the rest)."""
    import flax.linen as nn
    import jax
    config = experiment_config(row, implementation, dtype, steps, extra)
    with tempfile.TemporaryDirectory() as workdir:
        prepared = train.setup(config, workdir)
        with jax.set_mesh(prepared.mesh), nn.logical_axis_rules(prepared.rules):
            state, _ = train.restore_or_init(prepared, config)
            prepared.ckpt.close()  # nothing is saved here
            train_step, _ = steps_lib.jit_steps(prepared, config)
            loader = train.make_train_loader(prepared.task, config)
            batches = train.prefetch_to_device(loader, prepared.mesh, 0, prepared.task.count)
            batch = next(batches)[0]
            batches.close()
            return train_step.lower(state, batch).compile(), state, batch


def measure_step(row: dict, implementation: str, *, dtype: str = "bfloat16", warmup: int = 3,
                 repeats: int = 5, steps: int = 10, extra: tuple[str, ...] = ()) -> dict:
    """The trainer's jitted step alone (no loop, no logging): median seconds per step
    over `repeats` timings of `steps` steps queued back to back on one real batch, after
    `warmup` steps; as train_speed_gpu_child.measure_ours times the bare step. extra: main.py
    arguments, as for `measure` (its --config.* ones apply). Runs in this process: the
    benchmark calls it in a child (train_speed_gpu_child.py's `trainer-step`), which records an
    exception as the row's error."""
    import jax

    from attention_jax.tools.bench import timing
    compiled, state, batch = compiled_step(row, implementation, dtype=dtype,
                                           steps=max(warmup + repeats * steps, 1), extra=extra)
    step = lambda s: compiled(s, batch)
    for _ in range(max(1, warmup)):
        state, metrics = step(state)
    jax.block_until_ready(metrics)
    times, state, metrics = timing.queued_step_times(step, state, repeats, steps)
    return {"step_s": statistics.median(times), "times": times, "loss": float(metrics["loss"])}
