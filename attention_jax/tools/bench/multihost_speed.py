r"""What running as several processes costs a step: `python -m attention_jax.tools.bench multihost`.

The trainer (`python -m attention_jax.main`, configs/gpt2_gpu.py at a small shape: the
byte-level stdlib corpus, float32 on CPU) on the same 8 CPU devices of this machine,
the same mesh size and global batch, launched two ways:

  1 process × 8     one process with 8 fake CPU devices: collectives stay in-process.
  2 processes × 4   two local processes joined by jax.distributed (gloo collectives
                    over TCP), the hybrid mesh (mesh.dcn_data=2 × data=4): each
                    process reads its half of the batch and assembles global arrays,
                    checks JAX's preemption sync point each step, and runs the
                    lost-host heartbeat thread.

Seconds per step: the trainer's logged tokens/s (median of the windows after the
first, trainer.measure's reading of metrics.jsonl), then the median over --repeats
launches made in turns. The difference is the multi-process machinery's cost per step
on one machine; across real hosts the network adds its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics

from attention_jax.tools.bench import trainer

ROW = {"layers": 2, "heads": 4, "width": 128, "seq_len": 128, "vocab": 512, "batch": 32}
SETUPS = {"1 process × 8": (1, 8), "2 processes × 4": (2, 4)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, devices: int, steps: int, log_every: int,
           timeout: float = 900) -> dict:
    """trainer.measure's reading ("step_s", "windows", ...) of one launch of the trainer
    as `processes` local processes of `devices` CPU devices each, or {"error": ...}."""
    env = trainer.child_env(JAX_PLATFORMS="cpu",
                            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    port = _free_port()

    def commands(workdir):
        cmds = []
        for i in range(processes):
            extra = ("--config.train.progress=False", "--config.optim.warmup_steps=2")
            if processes > 1:
                extra += ("--config.mesh.distributed=True",
                          f"--config.mesh.coordinator_address=127.0.0.1:{port}",
                          f"--config.mesh.num_processes={processes}",
                          f"--config.mesh.process_id={i}",
                          "--config.mesh.cpu_collectives=gloo",
                          f"--config.mesh.dcn_data={processes}")
            cmds.append(trainer.command(ROW, workdir, steps=steps, log_every=log_every,
                                        implementation="blockwise", dtype="float32",
                                        extra=extra))
        return cmds

    return trainer.run_commands(ROW, commands, env=env, timeout=timeout)


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| launch | ms / step (median) | launches | × 1 process |", "|---|---|---|---|"]
    base = None
    for name, runs in results.items():
        times = [r["step_s"] for r in runs if "step_s" in r]
        if not times:
            why = str(runs[0].get("error", "no timed window")).removeprefix("error: ")
            lines.append(f"| {name} | error: {why} | {len(runs)} | |")
            continue
        ms = 1e3 * statistics.median(times)
        base = base or ms
        lines.append(f"| {name} | {ms:.1f} | {len(times)} | {ms / base:.2f} |")
    return "\n".join(lines)


def run(args) -> dict:
    if args.steps < 2 * args.log_every:  # the first window (compilation) is left out
        raise SystemExit(f"error: --steps={args.steps} with --log_every={args.log_every}: the "
                         f"timing reads the logged windows after the first; valid: --steps >= "
                         f"2 × --log_every = {2 * args.log_every}")
    results = {name: [] for name in SETUPS}
    for _ in range(args.repeats):  # in turns, so a busy spell of the machine hits both
        for name, (processes, devices) in SETUPS.items():
            results[name].append(launch(processes, devices, args.steps, args.log_every))
    shape = ", ".join(f"{k} {v}" for k, v in ROW.items())
    print(f"GPT ({shape}; float32), 8 CPU devices, {os.cpu_count()} cores")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"row": ROW, "results": results}, f, indent=1)
    failed = [name for name, runs in results.items() if not any("step_s" in r for r in runs)]
    if failed:
        raise SystemExit(f"error: every launch of {', '.join(failed)} failed (the table says "
                         f"why)")
    return results


def add_parser(sub) -> None:
    p = sub.add_parser("multihost", help="per-step cost of 2 local processes × 4 devices "
                       "against 1 process × 8 (the trainer, same mesh and batch)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", "--out", dest="json", default="",
                   help="also write the results to this file")
