"""The trainer's own throughput: `python -m attention_jax.main` on a benchmark shape, its
tokens/s read back from the run's metrics.jsonl.

`bench train --device gpu` adds one such row per shape and attention implementation,
beside the bare step of the same shape (train_gpu.py): the gap between them is what the
trainer costs around the step (reading and sending batches, logging, checkpointing).
The run is experiments/gpt2_gpu.py with the row's shape set over it: real data (the
byte-level stdlib corpus, packed; the vocabulary padded to the row's), AdamW, bf16, one
checkpoint at the end, no evaluation. Its first logged window holds the warm-up of the
input pipeline, so the figure is the median of the windows after it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from attention_jax import train

EXPERIMENT = Path(__file__).resolve().parents[3] / "experiments" / "gpt2_gpu.py"


def command(row: dict, workdir: str, *, steps: int, log_every: int, implementation: str,
            dtype: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The main.py command line that trains `row`'s shape for `steps` steps."""
    overrides = {
        "model.num_layers": row["layers"], "model.num_heads": row["heads"],
        "model.d_model": row["width"], "model.max_len": row["seq_len"],
        "model.vocab_size": row["vocab"], "model.implementation": implementation,
        "data.seq_len": row["seq_len"], "train.batch_size": row["batch"],
        "train.compute_dtype": dtype, "train.steps": steps, "train.log_every": log_every,
        "train.checkpoint_every": steps, "optim.warmup_steps": min(10, steps),
        "eval.every": -1,
    }
    return [sys.executable, "-m", "attention_jax.main", f"--config={EXPERIMENT}",
            f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items()),
            *extra]


def measure(row: dict, implementation: str, *, dtype: str = "bfloat16", steps: int = 60,
            log_every: int = 10, timeout: float = 600, extra: tuple[str, ...] = ()) -> dict:
    """{"step_s", "tokens_per_s_logged", "windows"}: the median logged tokens/s of the
    windows after the first, as seconds per step; or {"error": ...} when the run failed or
    logged too few windows."""
    if steps < 2 * log_every:
        raise ValueError(f"steps={steps} must be at least 2 × log_every={log_every}: the first "
                         f"window is left out")
    with tempfile.TemporaryDirectory() as workdir:
        cmd = command(row, workdir, steps=steps, log_every=log_every,
                      implementation=implementation, dtype=dtype, extra=extra)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(EXPERIMENT.parents[1]), os.environ.get("PYTHONPATH")) if p)}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        rates = [r["tokens_per_sec"] for r in train.read_records(f"{workdir}/metrics.jsonl")
                 if r.get("split") == "train"]
        if done.returncode or len(rates) < 2:
            tail = (done.stderr or done.stdout).strip().splitlines()
            return {"error": tail[-1][:200] if tail else f"exit code {done.returncode}"}
    tokens_per_s = statistics.median(rates[1:])
    return {"step_s": row["batch"] * row["seq_len"] / tokens_per_s,
            "tokens_per_s_logged": tokens_per_s, "windows": len(rates) - 1}
