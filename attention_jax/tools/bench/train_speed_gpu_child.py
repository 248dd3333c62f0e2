"""The child processes of `bench train` on a GPU: the JAX side of each row, one process
per measurement so every row starts from a fresh device (train_speed_gpu.py, the parent,
starts them and never touches the GPU itself).

    python -m attention_jax.tools.bench.train_speed_gpu_child info|matmul|jax|fit|trainer-step ...
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

from attention_jax.tools.bench import bare_step, trainer
from attention_jax.tools.bench.train_speed_gpu import MATMUL_SIZE, _impl_label


@contextlib.contextmanager
def kernel_settings(settings: dict | None):
    """Within: the Pallas kernels traced take `settings`' launch settings ({"tiles":
    pallas.tiles' fields, "loss": loss_kernel.settings', "norm": norm_kernel.settings'},
    each optional; train_speed_gpu.launch_settings makes it); the rest their defaults."""
    from attention_jax.attention import pallas
    from attention_jax.layers import norm_kernel
    from attention_jax.models import loss_kernel
    settings = settings or {}
    with (pallas.tiles(**settings.get("tiles", {})),
          loss_kernel.settings(**settings.get("loss", {})),
          norm_kernel.settings(**settings.get("norm", {}))):
        yield


def _step_parts(row: dict, implementation: str, dtype: str, loss_chunk_size: int = 0):
    """(model, optimizer, train_step(state, inputs, targets) -> (state, loss)) of `row`:
    bare_step's jitted, donating step of the next-token loss; state = (params, opt_state).
    The row's "loss_kernel" (default "auto") picks the whole-logits loss (losses.LOSS_KERNELS),
    its "norm_kernel" the blocks' residual add and norm (norms.NORM_KERNELS)."""
    from attention_jax.models import gpt  # in the child only: it starts JAX
    cfg = gpt.GPTConfig(vocab_size=row["vocab"], max_len=row["seq_len"], num_layers=row["layers"],
                        d_model=row["width"], num_heads=row["heads"], dropout_rate=0.0,
                        implementation=implementation, dtype=dtype, param_dtype="float32",
                        remat_policy=row.get("remat", "none"),
                        norm_kernel=row.get("norm_kernel", "auto"))
    model = gpt.GPT(cfg)
    tx = bare_step.adamw(decay_matrices_only=True)  # as the peer's (torch_gpt.py)

    def loss_fn(params, inputs, targets):
        return gpt.head_loss(model, params, inputs, targets, chunk_size=loss_chunk_size,
                             loss_kernel=row.get("loss_kernel", "auto"))[0][0]

    return model, tx, bare_step.make_train_step(loss_fn, tx)


def compiled_ours(row: dict, implementation: str, dtype: str = "bfloat16", seed: int = 0,
                  loss_chunk_size: int = 0):
    """(compiled step(state, inputs, targets) -> (state, loss), state, (inputs, targets)):
    our donating training step of `row`, compiled, on a fixed batch of random tokens.
    loss_chunk_size > 0: the chunked head + loss."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    model, tx, train_step = _step_parts(row, implementation, dtype, loss_chunk_size)
    key_init, key_data = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(key_data, (row["batch"], row["seq_len"] + 1), 0, row["vocab"],
                                jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = nn.meta.unbox(jax.jit(model.init)(key_init, inputs[:1])["params"])
    state = (params, tx.init(params))
    compiled = train_step.lower(state, inputs, targets).compile()
    return compiled, state, (inputs, targets)


def prepare_ours(row: dict, implementation: str, dtype: str = "bfloat16", seed: int = 0,
                 loss_chunk_size: int = 0):
    """(step(state) -> (state, loss), state, info): compiled_ours's step on its batch."""
    import jax
    compiled, state, batch = compiled_ours(row, implementation, dtype, seed, loss_chunk_size)
    info = {"params": sum(int(x.size) for x in jax.tree.leaves(state[0]))}
    return (lambda s: compiled(s, *batch)), state, info


def compiled_bytes(row: dict, implementation: str, dtype: str = "bfloat16",
                   loss_chunk_size: int = 0) -> int:
    """Device memory our step needs at `row`'s batch, from XLA's compiled memory analysis
    (arguments + outputs + temporaries − the donated state they share); nothing runs."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    model, tx, train_step = _step_parts(row, implementation, dtype, loss_chunk_size)
    tokens = jax.ShapeDtypeStruct((row["batch"], row["seq_len"]), jnp.int32)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(
        jax.random.key(0), jnp.zeros((1, row["seq_len"]), jnp.int32))["params"]))
    state = (params, jax.eval_shape(tx.init, params))
    m = train_step.lower(state, tokens, tokens).compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def largest_batch(row: dict, implementation: str, limit_bytes: int, dtype: str = "bfloat16",
                  loss_chunk_size: int = 0, most: int = 4096) -> dict:
    """The largest batch of `row`'s shape whose step fits in `limit_bytes`, by compiled
    memory: a step's memory is affine in the batch (the state, plus activations per
    row), so batches 1 and 2 predict it; the prediction is then compiled and stepped
    down until it fits. {"largest_batch", "bytes", "bytes_per_row", "limit_bytes"}."""
    at = lambda b: compiled_bytes({**row, "batch": b}, implementation, dtype, loss_chunk_size)
    one, two = at(1), at(2)
    if one > limit_bytes:
        return {"largest_batch": 0, "bytes": one, "bytes_per_row": two - one,
                "limit_bytes": limit_bytes}
    per_row = max(two - one, 1)
    batch = max(1, min(most, 1 + (limit_bytes - one) // per_row))
    used = at(batch)
    while used > limit_bytes and batch > 1:  # the prediction was optimistic
        batch = max(1, int(batch * limit_bytes / used))
        used = at(batch)
    return {"largest_batch": batch, "bytes": used, "bytes_per_row": per_row,
            "limit_bytes": limit_bytes}


def measure_ours(row: dict, implementation: str, warmup: int = 3, repeats: int = 5,
                 steps: int = 10, dtype: str = "bfloat16", loss_chunk_size: int = 0,
                 settings: dict | None = None) -> dict:
    """One row of our side: median seconds per step over `repeats` timings of `steps`
    steps queued back to back (one wait at the end), after `warmup` steps; the Pallas
    kernels compiled with `settings` (kernel_settings') where given."""
    import jax

    from attention_jax.tools.bench import timing  # it imports JAX: children only
    result = {**row, "side": "jax",
              "impl": _impl_label(implementation, loss_chunk_size, row.get("loss_kernel", "auto"),
                                  row.get("norm_kernel", "auto")),
              "dtype": dtype, "loss_chunk": loss_chunk_size}
    try:
        start = time.perf_counter()
        with kernel_settings(settings):  # read while the step is traced and compiled
            step, state, info = prepare_ours(row, implementation, dtype,
                                             loss_chunk_size=loss_chunk_size)
            result["launch_used"] = launch_used(row, dtype)
        result.update(info)
        from attention_jax.models.losses import choose_loss_kernel  # what auto chose here
        result["loss_kernel_used"] = ("chunked" if loss_chunk_size else choose_loss_kernel(
            row.get("loss_kernel", "auto"), dtype, row["vocab"]))
        result["attention_used"] = attention_used(row, implementation, dtype)
        loss = None
        for _ in range(max(1, warmup)):
            state, loss = step(state)
        result["first_loss"] = float(loss)  # waits
        result["warmup_s"] = time.perf_counter() - start
        times, state, loss = timing.queued_step_times(step, state, repeats, steps)
        result.update(times=times, step_s=statistics.median(times), loss=float(loss))
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            result["peak_bytes"] = stats["peak_bytes_in_use"]
    except Exception as e:  # out of memory, a backend refusing a shape: a result
        result["error"] = _error_line(e)
    return result


def launch_used(row: dict, dtype: str) -> dict:
    """The Pallas kernels' launch settings at `row` under the settings now in force (what
    a step traced now takes, where it runs them): the attention's tiles, the loss's and
    the norms' (their defaults adapted to the row's rows)."""
    import dataclasses

    import jax

    from attention_jax.attention import pallas
    from attention_jax.layers import norm_kernel
    from attention_jax.models import loss_kernel
    tiles = pallas.kernel_block_sizes(row["width"] // row["heads"], dtype, length=row["seq_len"])
    return {"tiles": dataclasses.asdict(tiles), "loss": loss_kernel.SETTINGS.current(),
            "norm": norm_kernel.launch(row["batch"] * row["seq_len"], row["width"],
                                       gpu=jax.default_backend() == "gpu")}


def attention_used(row: dict, implementation: str, dtype: str) -> str:
    """The backend the model's self-attention runs at `row` (auto's choice, made as the
    layer makes it: for one q, k, v projection's output, plain causal rows)."""
    import jax
    import jax.numpy as jnp

    from attention_jax.attention import explain_packed
    qkv = jax.ShapeDtypeStruct((row["batch"], row["seq_len"], 3, row["heads"],
                                row["width"] // row["heads"]), jnp.dtype(dtype))
    return explain_packed(qkv, implementation=implementation, causal=True)[0]


def _error_line(e: BaseException) -> str:
    """The exception's type and first line, short enough for a table cell (torch_gpt.py
    has its own: importing it would import torch)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"



def fit_child(row: dict, implementation: str, dtype: str, limit_gib: float,
              loss_chunk_size: int = 0) -> dict:
    """largest_batch within `limit_gib` (0: the first device's allocator limit, e.g. 75%
    of an H100's memory under JAX's default preallocation); errors as a result."""
    import jax
    try:
        limit = int(limit_gib * 2**30) or (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if not limit:
            return {"error": "this device reports no memory limit: give --fit-limit-gib"}
        return largest_batch(row, implementation, limit, dtype, loss_chunk_size)
    except Exception as e:  # noqa: BLE001 - a compile failure is a result
        return {"error": _error_line(e)}


def device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": d.device_kind, "count": jax.device_count(),
            "jax": jax.__version__}


def child_main(argv=None):
    """`python -m attention_jax.tools.bench.train_speed_gpu_child info|matmul|jax|fit|trainer-step
    --out F [...]` (matmul: timing.matmul_rate of `--steps` queued matmuls;
    trainer-step: trainer.measure_step, the trainer's own step)."""
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["info", "matmul", "jax", "fit", "trainer-step"])
    p.add_argument("--out", required=True)
    p.add_argument("--row", help="JSON row (jax)")
    p.add_argument("--implementation", default="auto")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=MATMUL_SIZE)
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (jax, matmul)")
    p.add_argument("--loss-chunk", type=int, default=0, help="jax: positions per loss chunk")
    p.add_argument("--settings", default="{}",
                   help="jax: JSON of the Pallas kernels' launch settings (kernel_settings)")
    p.add_argument("--extra", default="[]",
                   help="trainer-step: JSON list of main.py arguments (its --config.* apply)")
    p.add_argument("--limit-gib", type=float, default=0,
                   help="fit: memory to fit in (0: the device's allocator limit)")
    a = p.parse_args(argv)
    if a.what == "info":
        result = device_info()
    elif a.what == "matmul":
        from attention_jax.tools.bench import timing
        result = {"size": a.size, "dtype": a.dtype,
                  "flops_per_s": timing.matmul_rate(a.size, a.repeats, a.dtype, queued=a.steps)}
    elif a.what == "trainer-step":
        try:
            result = trainer.measure_step(json.loads(a.row), a.implementation, dtype=a.dtype,
                                          warmup=a.warmup, repeats=a.repeats, steps=a.steps,
                                          extra=tuple(json.loads(a.extra)))
        except Exception as e:  # noqa: BLE001 - out of memory, a bad config: a result
            result = {"error": _error_line(e)}
    elif a.what == "fit":
        result = fit_child(json.loads(a.row), a.implementation, a.dtype, a.limit_gib, a.loss_chunk)
    else:
        result = measure_ours(json.loads(a.row), a.implementation, a.warmup, a.repeats, a.steps,
                              a.dtype, a.loss_chunk, json.loads(a.settings))
        info = device_info()
        result.update(device=info["device"], devices=info["count"])
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    child_main()
