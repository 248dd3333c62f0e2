r"""Cost of checkpoint digests: `python -m attention_jax.tools.bench checkpoint`.

The train state of a GPT-2-shaped model (default 9 layers of GPT-2 small: 103M
parameters; the state adds AdamW's two moments, 3 x 103M float32 values) is saved and
restored with `checkpoint.Checkpointer`, and each time the digest's share is measured:

  digest at save      digests.state_digests(state), what Checkpointer.save adds (on
                      its background thread, or on an accelerator launched by the caller)
  save                Checkpointer.save + wait until committed, digests included (and
                      the host CPU time it took, all threads: what it takes from a
                      training loop beside it; `--compression off` without orbax's
                      zstd; `--packed off` one array in the files per array); and
                      the part of it that blocks the caller: the whole `save` call, so
                      everything on the calling thread (launching the device copy of the
                      state and the digest sums, queueing the rest); training resumes
                      after it. The first save's, which compiles the copy, on its own
  snapshot copy       the device copy of the state that `save` launches, until done: the
                      device time the next train step queues behind (on CPU: the cores)
  plain save          the same orbax save without the digest item
  verify at restore   state_digests of the restored state (what restore adds)
  restore             Checkpointer.restore (reads and verifies)

The moments are filled with random values, not the zeros of a fresh optimizer, which
orbax's compression would shrink to nothing and make the save look cheaper than in a
real run. Median over --repeats; every repeat saves a new step.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time


def _state(layers: int, seed: int = 0, **overrides):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from attention_jax.models import gpt
    model = gpt.GPT(gpt.GPTConfig.from_variant("gpt2", num_layers=layers, **overrides))
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed),
                                               jnp.zeros((1, 8), jnp.int32))["params"])
    opt_state = optax.adamw(1e-3).init(params)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 10_000))
    opt_state = jax.tree.map(
        lambda x: (jax.random.normal(next(keys), x.shape, x.dtype) * 1e-3
                   if x.ndim and jnp.issubdtype(x.dtype, jnp.floating) else x), opt_state)
    return {"step": jnp.int32(1), "params": params, "opt_state": opt_state,
            "rng": jax.random.PRNGKey(seed)}


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from attention_jax import background_save, checkpoint, digests
    if args.width < 12 or args.width % 12 or args.vocab < 1:
        raise SystemExit(f"error: --width {args.width} --vocab {args.vocab}; valid: a width "
                         f"that is a multiple of GPT-2's 12 heads, a vocabulary >= 1")
    state = jax.block_until_ready(_state(args.layers, d_model=args.width,
                                         vocab_size=args.vocab))
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_values = sum(np.size(x) for x in jax.tree.leaves(state))
    root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    data_state = {"next_index": 123, "seed": 0, "num_records": 1000}
    out = {"params": int(n_params), "state_values": int(n_values),
           "state_bytes": int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)))}
    try:
        state_digests = lambda: digests.state_digests(state)  # noqa: E731
        state_digests()  # warm-up
        out["digest_at_save_s"] = _median_time(state_digests, args.repeats)

        ck = checkpoint.Checkpointer(os.path.join(root, "with"), save_every=1, keep=2,
                                     compression=args.compression == "on",
                                     packed=args.packed == "on")
        step, blocking = iter(range(1, 10_000)), []
        t = time.perf_counter()
        ck.save(next(step), state, data_state)  # the first: compiles the device copy
        out["save_blocking_first_s"] = time.perf_counter() - t
        ck.wait()

        cpu = []

        def save():
            t, c = time.perf_counter(), time.process_time()
            ck.save(next(step), state, data_state)
            blocking.append(time.perf_counter() - t)
            ck.wait()
            cpu.append(time.process_time() - c)
        out["save_s"] = _median_time(save, args.repeats)
        out["save_blocking_s"] = statistics.median(blocking)
        out["save_cpu_s"] = statistics.median(cpu)
        snapshot = lambda: jax.block_until_ready(background_save.snapshot(state))  # noqa: E731
        out["snapshot_s"] = _median_time(snapshot, args.repeats)

        plain = ocp.CheckpointManager(
            os.path.join(root, "plain"),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler()})
        plain_step = iter(range(1, 10_000))

        def plain_save():
            plain.save(next(plain_step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
            plain.wait_until_finished()
        out["plain_save_s"] = _median_time(plain_save, args.repeats)
        plain.close()

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=x.sharding), state)
        latest = ck.latest_step()
        restored = {}

        def restore():
            restored["state"] = jax.block_until_ready(ck.restore(abstract, latest)[0])
        out["restore_s"] = _median_time(restore, args.repeats)
        out["verify_at_restore_s"] = _median_time(
            lambda: digests.state_digests(restored["state"]), args.repeats)
        ck.close()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    out["digest_share_of_save"] = out["digest_at_save_s"] / out["save_s"]
    out["verify_share_of_restore"] = out["verify_at_restore_s"] / out["restore_s"]
    out["compression"], out["packed"] = args.compression, args.packed
    out["arrays"] = len(jax.tree.leaves(state))
    print(f"state: {n_params / 1e6:.1f}M parameters, {n_values / 1e6:.1f}M values "
          f"({out['state_bytes'] / 2**30:.2f} GiB) on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} cores, {out['arrays']} arrays, packed {args.packed}, compression "
          f"{args.compression}, median of {args.repeats}")
    for key in ("digest_at_save_s", "save_blocking_first_s", "save_blocking_s", "snapshot_s",
                "save_s", "save_cpu_s", "plain_save_s", "verify_at_restore_s", "restore_s"):
        print(f"  {key:22s} {out[key]:8.3f}")
    print(f"  digest / save          {out['digest_share_of_save']:8.1%}")
    print(f"  verify / restore       {out['verify_share_of_restore']:8.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def add_parser(sub) -> None:
    """Registers `checkpoint` on the bench command's subcommand parser."""
    p = sub.add_parser("checkpoint", help="cost of the checkpoint digests at save and restore")
    p.add_argument("--layers", type=int, default=9,
                   help="GPT-2 small's shape with this many layers (9: 103M parameters)")
    p.add_argument("--width", type=int, default=768, help="d_model (GPT-2 small's: 768)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's: 50257)")
    p.add_argument("--repeats", type=int, default=3, help="timed saves/restores (median)")
    p.add_argument("--compression", default="on", choices=("on", "off"),
                   help="orbax's zstd compression of the arrays in our saves")
    p.add_argument("--packed", default="on", choices=("on", "off"),
                   help="the Checkpointer's packed format in our saves (off: one array in the "
                        "files per array of the state)")
    p.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    p.add_argument("--json", "--out", dest="json", default="",
                   help="also write the numbers to this file")
