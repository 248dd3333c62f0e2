"""The LM head's loss alone, by loss kernel: `python -m attention_jax.tools.bench loss`.

    python -m attention_jax.tools.bench loss                       # GPT-2 small's head, 16 x 1024 rows
    python -m attention_jax.tools.bench loss --rows 4096 --loss-kernel xla,pallas --out /tmp/loss.json

For each loss kernel (losses.LOSS_KERNELS: `xla`, XLA's reductions; `pallas`, the kernels
of models/loss_kernel.py) it times losses.head_cross_entropy of hidden [rows, D] through
the head's kernel [D, V], in one process (what differs is the loss; the head's matmuls
are the same): the forward pass alone (the loss, as evaluation computes it) and
value_and_grad (what the training step runs of the head: its matmuls, the loss and its
gradient). Each figure is the median of `--repeats` timings of `--steps` calls queued
back to back and ended by one wait, after a warm-up call. With the logits' size, the
table says what one pass through them takes at the device's measured copy rate (a
bfloat16 copy of the logits' size, timed the same way), so a loss's time reads as passes.

`--pallas-settings chunk=8192,warps=16 ...` adds a row per launch setting of the loss
kernels (`loss_kernel.settings`: logits a program loads at a time, Triton's warps and
stages, and `hints=0` or `1`, the gradient kernel's L2 eviction priorities off or on):
the warps decide how many rows are in flight on an SM, and so, with the priorities,
whether a row is still in the L2 cache when the gradient reads it a second time.

Where a step's gap between the kernels is within its noise (a few tenths of a
millisecond in 34), this isolates it. On a CPU the Pallas kernels run interpreted (slow:
use small `--rows`); the default there is `xla` alone, in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from attention_jax.tools.bench import kernel_bench

# --pallas-settings: each key and loss_kernel.settings' argument it sets
SETTING_KEYS = {"chunk": "chunk", "warps": "num_warps", "stages": "num_stages",
                "hints": "cache_hints"}


def parse_settings(text: str) -> dict:
    """`chunk=8192,warps=16` -> loss_kernel.settings' arguments; a wrong key or value is
    one line naming the valid ones."""
    return kernel_bench.parse_settings(text, SETTING_KEYS)


def measure(rows: int, width: int, vocab: int, dtype: str, kernels: list[str], repeats: int,
            steps: int, seed: int = 0) -> dict:
    """{"device", "rows", "width", "vocab", "dtype", "logits_bytes", "pass_s", "kernels":
    {kernel: {"forward_s", "forward_backward_s", "loss"}}}."""
    import jax
    import jax.numpy as jnp

    from attention_jax.models import loss_kernel
    from attention_jax.models.losses import head_cross_entropy
    from attention_jax.tools.bench.timing import queued_time
    kh, kk, kt = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(kh, (rows, width), jnp.dtype(dtype))
    kernel = (jax.random.normal(kk, (width, vocab), jnp.float32) / width ** 0.5).astype(dtype)
    targets = jax.random.randint(kt, (rows,), 0, vocab, jnp.int32)
    logits_bytes = rows * vocab * jnp.dtype(dtype).itemsize
    # One pass through the logits: a copy of their size reads and writes them (two passes).
    block = jnp.zeros((rows, vocab), dtype)
    copy = jax.jit(lambda x: x + jnp.asarray(1, dtype))
    pass_s = queued_time(copy, (block,), repeats, steps) / 2
    del block
    out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
           "rows": rows, "width": width, "vocab": vocab, "dtype": dtype,
           "logits_bytes": logits_bytes, "pass_s": pass_s, "kernels": {}}
    for name in kernels:  # "pallas SETTINGS": the kernels traced with those settings
        impl, _, given = name.partition(" ")

        def loss(h, k, impl=impl):
            return head_cross_entropy(h, k, targets, implementation=impl)[0]
        forward = jax.jit(loss)
        both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with loss_kernel.settings(**parse_settings(given)) if given else contextlib.nullcontext():
            out["kernels"][name] = {
                "forward_s": queued_time(forward, (hidden, kernel), repeats, steps),
                "forward_backward_s": queued_time(both, (hidden, kernel), repeats, steps),
                "loss": float(forward(hidden, kernel))}
    return out


def table(result: dict) -> str:
    ms = lambda s: f"{1e3 * s:.3f}"  # noqa: E731
    passes = lambda s: f"{s / result['pass_s']:.1f}"  # noqa: E731
    lines = [f"{result['device']} ({result['backend']}): the head's loss, hidden "
             f"[{result['rows']}, {result['width']}] · [{result['width']}, {result['vocab']}], "
             f"{result['dtype']}; logits {result['logits_bytes'] / 1e9:.2f} GB, one pass "
             f"through them {ms(result['pass_s'])} ms (a copy, halved)", "",
             "| loss kernel | forward ms | in passes | forward + backward ms | in passes | loss |",
             "|---|---|---|---|---|---|"]
    for name, k in result["kernels"].items():
        lines.append(f"| {name} | {ms(k['forward_s'])} | {passes(k['forward_s'])} | "
                     f"{ms(k['forward_backward_s'])} | {passes(k['forward_backward_s'])} | "
                     f"{k['loss']:.4f} |")
    names = list(result["kernels"])
    if "xla" in names and "pallas" in names:
        x, p = result["kernels"]["xla"], result["kernels"]["pallas"]
        lines += ["", f"pallas / xla: forward {p['forward_s'] / x['forward_s']:.2f}, forward + "
                      f"backward {p['forward_backward_s'] / x['forward_backward_s']:.2f} "
                      "(below 1: the kernels are faster)"]
    lines.append("(the passes include the head's matmuls: their time in passes is the same "
                 "for every kernel)")
    return "\n".join(lines)


def settings_argument(text: str) -> str:
    """argparse's type for a --pallas-settings setting (checked as the kernels check it)."""
    from attention_jax.models import loss_kernel
    return kernel_bench.settings_argument(text, SETTING_KEYS, loss_kernel.settings)


def add_parser(sub) -> None:
    p = sub.add_parser("loss", help="the LM head's loss alone: XLA's reductions against the "
                                    "Pallas loss kernels",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16 * 1024, help="positions (batch x length)")
    p.add_argument("--width", type=int, default=768, help="D, the hidden width")
    p.add_argument("--vocab", type=int, default=50304, help="V")
    kernel_bench.add_options(p, "loss", "chunk=8192,warps=16,stages=3", settings_argument, steps=10)


def run(args) -> dict:
    from attention_jax.tools.bench.kernel_bench import parse_loss_kernels
    kernels, dtype = kernel_bench.rows_and_dtype(args, "loss", ("rows", "width", "vocab"),
                                                 parse_loss_kernels)
    print(f"timing the loss, kernels {kernels} ...", file=sys.stderr, flush=True)
    result = measure(args.rows, args.width, args.vocab, dtype, kernels, args.repeats, args.steps)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result
