r"""What a checkpoint save costs the training steps around it:
`python -m attention_jax.tools.bench profile --save`.

    python -m attention_jax.tools.bench profile --save                # gpt2-124m, batch 16
    python -m attention_jax.tools.bench profile --save --pinned-host off   # orbax's copy A/B
    python -m attention_jax.tools.bench profile --save --compression off   # orbax's zstd A/B
    python -m attention_jax.tools.bench profile --save --gc-freeze off     # the trainer's heap A/B
    python -m attention_jax.tools.bench profile --save --packed off        # an array per array
    python -m attention_jax.tools.bench profile --save --out bench_results/save  # + traces

Issue 35 asks that a save after the first cost training at most one step. In main.py on
an H100 (2026-11-24) a later save held the training thread about one step, and still its
window took 0.4-0.5 s longer than the others: something slowed the steps while the save's
device-to-host copy and write went on beside them. This benchmark isolates that, on the
trainer's own step (bench/trainer.py: main.py's step at the shape, one real batch), saved
by the trainer's Checkpointer into a temporary folder, the step run in windows of
`--save-window` steps, each ended by one wait for the device (as main.py's log sync):

  plain window   no save in flight (the previous one has committed before it starts)
  a save         `save` at the start of a window, then whole windows until it has
                 committed: held_s, what `save` held the calling thread; extra_s, how much
                 longer those windows took than as many plain steps (the save's whole
                 cost to training, what it held and what it slowed); steps, how many
                 steps it spanned. The first save of the run is reported apart: its device
                 programs compile ahead (Checkpointer.prepare, as main.py calls it) during
                 the warm-up windows, 5 s of them at least

Then one plain window and the first windows of a later save are traced (jax.profiler)
and each thread's busy time per step is read back, plain against save: on a GPU the
device's streams (compute, the copies to and from the host) and the host's threads (the
training thread, the save's, orbax's); on a CPU the host's threads. Beside them, the
traced windows' own wall-clock time per step: a compute stream busy for less than that
idled, waiting for steps the host had not launched yet. Python's garbage collections
during each save are counted too (heap.Pauses): a full one pauses every thread, the one
launching the steps included; and the objects outside the frozen heap at each save's
start, what a full collection walks.

The two options are the suspects one can switch without a profile: orbax's device-to-host
copy through pinned host memory (`--pinned-host`; on by default for a GPU, where each of
the state's arrays, 446 for GPT-2 small with AdamW, moves by a `device_put` of its own;
off, each is copied to pageable memory) and its zstd compression, which
tensorstore runs on a pool as wide as the host's cores, beside the thread that launches
the steps (`--compression`), and the trainer's frozen heap (`--gc-freeze`, heap.py: on,
as main.py's loop; off, each full collection walks the whole heap, 360-470 ms in main.py
on the 2-core CPU host). `--packed off` writes the state one array per array, as the
Checkpointer did before its packed format (448 arrays for GPT-2 small, each with orbax's
Python work on its saving threads, where packed it writes 5). `--switch-interval` sets
Python's thread switch interval (5 ms
by default: how long the training thread may wait for the interpreter that a saving
thread holds, each time it needs it back). Run each setting as its own command: one
process each.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

DATA_STATE = {"bench": "save window"}  # the checkpoint's data item: any JSON
# The first save comes this long after `prepare` at the earliest: main.py's first regular
# save comes after checkpoint_every steps, 100 at least in bench train's save rows (3.5 s
# of GPT-2 small on an H100), while the save's programs compile on their thread.
FIRST_SAVE_AFTER_S = 5.0
# A save's trace covers its first windows only (its launch, the copies to the host, the
# start of the write): every kernel of every step is an event, and a trace of the whole
# save of GPT-2 small would take longer to read back than to record.
TRACED_WINDOWS = 5


def _windows(step, state, size: int, count: int = 1):
    """`count` windows of `size` steps, each ended by a wait for the device."""
    import jax
    for _ in range(count):
        for _ in range(size):
            state, metrics = step(state)
        jax.block_until_ready(metrics)
    return state


def plain_window(step, state, ckpt, size: int):
    """(state, seconds) of one window of `size` steps with no save in flight."""
    ckpt.wait()
    start = time.perf_counter()
    state = _windows(step, state, size)
    return state, time.perf_counter() - start


def saved_windows(step, state, ckpt, at: int, size: int, most: int | None = None,
                  pauses=None):
    """(state, {"held_s", "window_s", "steps", "gc"}): a save of `state` as checkpoint
    step `at` at the start of a window, then windows of `size` steps until it has
    committed (or `most` windows have run); gc: the garbage collections meanwhile by
    generation, if `pauses` (a heap.Pauses) records them."""
    ckpt.wait()
    if pauses is not None:
        pauses.clear()
    # What a full collection would walk now: the objects outside the frozen heap.
    unfrozen = len(gc.get_objects())
    start = time.perf_counter()
    ckpt.save(at, state, DATA_STATE, force=True)
    held = time.perf_counter() - start
    steps = 0
    while True:
        state = _windows(step, state, size)
        steps += size
        if not ckpt.saving() or (most is not None and steps >= most * size):
            break
    return state, {"held_s": held, "window_s": time.perf_counter() - start, "steps": steps,
                   "gc": pauses.summary() if pauses is not None else {},
                   "unfrozen_objects": unfrozen}


def measure(compiled, state, batch, directory, *, size: int = 10, saves: int = 3,
            warmup: int = 2, pinned_host: bool | None = None, compression: bool = True,
            gc_freeze: bool = True, switch_interval: float | None = None,
            packed: bool = True, trace_dir: str | None = None,
            python_trace: bool = False) -> dict:
    """The save costs of `compiled(state, batch) -> (state, metrics)`'s training, saved
    into `directory` (see the module doc). pinned_host, compression: the Checkpointer's
    options of those names (pinned_host None: orbax's default). gc_freeze: the heap frozen
    as main.py's loop freezes it (heap.FrozenHeap). switch_interval: Python's thread
    switch interval meanwhile (sys.setswitchinterval; None: as it is, 5 ms by default),
    the longest a thread waiting for the interpreter waits while another holds it.
    packed: the Checkpointer's option of that name (the state written as a few flat
    arrays, or one array in the files per array). trace_dir: also trace one
    plain window and the first TRACED_WINDOWS windows of a save, and return each thread's
    busy time (`threads`; the traces stay there); python_trace: with every Python call
    of every thread in them (jax.profiler's Python tracer; large traces)."""
    import jax

    from attention_jax import checkpoint, heap, packed_state
    from attention_jax.tools.bench import traces
    step = lambda s: compiled(s, batch)
    ckpt = checkpoint.Checkpointer(directory, save_every=1, keep=2, pinned_host=pinned_host,
                                   compression=compression, packed=packed)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        frozen = stack.enter_context(heap.FrozenHeap()) if gc_freeze else None
        stack.callback(ckpt.close)
        if switch_interval is not None:
            stack.callback(sys.setswitchinterval, sys.getswitchinterval())
            sys.setswitchinterval(switch_interval)
        # as main.py's loop does, before its first steps
        ckpt.prepare(state, on_compiled=frozen.settle if frozen is not None else None)
        state = _windows(step, state, size, warmup)
        if frozen is not None:
            frozen.settle()  # as main.py's loop after its first step
        pauses = stack.enter_context(heap.Pauses())
        while time.perf_counter() - started < FIRST_SAVE_AFTER_S:
            state = _windows(step, state, size)
        plain = []
        state, first = saved_windows(step, state, ckpt, 1, size, pauses=pauses)
        later = []
        for at in range(2, 2 + saves):
            state, seconds = plain_window(step, state, ckpt, size)
            plain.append(seconds / size)
            state, cost = saved_windows(step, state, ckpt, at, size, pauses=pauses)
            later.append(cost)
        state, seconds = plain_window(step, state, ckpt, size)
        plain.append(seconds / size)
        step_s = statistics.median(plain)
        for cost in (first, *later):
            cost["extra_s"] = cost["window_s"] - cost["steps"] * step_s
            cost["extra_steps"] = cost["extra_s"] / step_s
        out = {"step_s": step_s, "window": size, "first": first, "saves": later,
               "held_s": statistics.median(c["held_s"] for c in later),
               "extra_s": statistics.median(c["extra_s"] for c in later),
               "pinned_host": pinned_host, "compression": compression, "gc_freeze": gc_freeze,
               "switch_interval_s": sys.getswitchinterval(),
               "packed": packed and packed_state.packable(state),
               "device": jax.devices()[0].device_kind,
               "state_arrays": sum(isinstance(x, jax.Array) for x in jax.tree.leaves(state)),
               "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)
                                  if isinstance(x, jax.Array))}
        out["extra_steps"] = out["extra_s"] / step_s
        if trace_dir is not None:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = int(python_trace)
            busy, steps, wall = {}, {}, {}
            for name in ("plain", "save"):
                where = f"{trace_dir}/{name}"
                with jax.profiler.trace(where, create_perfetto_trace=True,
                                        profiler_options=options):
                    if name == "plain":
                        state, wall[name] = plain_window(step, state, ckpt, size)
                        steps[name] = size
                    else:
                        state, cost = saved_windows(step, state, ckpt, 2 + saves, size,
                                                    most=TRACED_WINDOWS)
                        steps[name], wall[name] = cost["steps"], cost["window_s"]
                busy[name] = traces.thread_busy(traces.read_trace(where))
            out["threads"] = compare_threads(busy, steps)
            # A device stream busy for less than this idled: the steps were not launched
            # in time (the host), rather than run slower (the device).
            out["traced_wall_ms_per_step"] = {name: 1e3 * wall[name] / steps[name]
                                              for name in wall}
        ckpt.wait()
    return out


def compare_threads(busy: dict[str, dict], steps: dict[str, int]) -> list[dict]:
    """Rows {"process", "thread", "<name>_ms_per_step"..., "top"} of traces.thread_busy's dicts
    per trace name, each thread's busy time divided by that trace's steps; busiest in the
    save trace first."""
    labels = sorted({label for b in busy.values() for label in b})
    rows = []
    for process, thread in labels:
        row = {"process": process, "thread": thread}
        top = []
        for name, threads in busy.items():
            entry = threads.get((process, thread))
            row[f"{name}_ms_per_step"] = (entry["busy_us"] * 1e-3 / steps[name]) if entry else 0.0
            top += [t for t in (entry["top"] if entry else []) if t not in top]
        row["top"] = top[:3]
        rows.append(row)
    last = list(busy)[-1]
    return sorted(rows, key=lambda r: -r[f"{last}_ms_per_step"])


def report(out: dict, top: int = 12) -> str:
    """Markdown: the costs, then the busiest threads plain against save."""
    ms = lambda s: f"{1e3 * s:.1f}"
    lines = [f"{out['device']}: a state of {out['state_arrays']} arrays"
             f"{' (saved packed)' if out['packed'] else ' (saved an array per array)'}, "
             f"{out['state_bytes'] / 2**30:.2f} GiB; step {ms(out['step_s'])} ms in plain "
             f"windows of {out['window']}; orbax's pinned-host copy "
             f"{ {None: 'default', True: 'on', False: 'off'}[out['pinned_host']]}, "
             f"compression {'on' if out['compression'] else 'off'}, heap frozen "
             f"{'on' if out['gc_freeze'] else 'off'}, thread switch interval "
             f"{1e3 * out['switch_interval_s']:g} ms", "",
             "| save | held the training thread, ms | whole cost to training, ms | "
             "in steps | steps spanned | garbage collections meanwhile, ms | full ones: "
             "count, longest ms | objects outside the frozen heap |",
             "|---|---|---|---|---|---|---|---|"]
    for name, cost in [("first", out["first"]),
                       *((f"later {i + 1}", c) for i, c in enumerate(out["saves"]))]:
        full = cost["gc"].get("gen2", {"count": 0, "max_s": 0.0})
        lines.append(f"| {name} | {ms(cost['held_s'])} | {ms(cost['extra_s'])} | "
                     f"{cost['extra_steps']:.1f} | {cost['steps']} | "
                     f"{ms(sum(g['total_s'] for g in cost['gc'].values()))} | "
                     f"{full['count']}, {ms(full['max_s'])} | {cost['unfrozen_objects']:,} |")
    verdict = "met" if out["extra_s"] <= out["step_s"] else "not met"
    lines += ["", f"Later saves, median: {ms(out['extra_s'])} ms, {out['extra_steps']:.1f} "
                  f"steps (issue 35: at most one step; {verdict})."]
    if "threads" in out:
        wall = out["traced_wall_ms_per_step"]
        lines += ["", "| process | thread | plain ms/step | save ms/step | its largest events |",
                  "|---|---|---|---|---|",
                  f"| (wall clock) | the traced windows | {wall['plain']:.2f} | "
                  f"{wall['save']:.2f} | |"]
        for r in out["threads"][:top]:
            lines.append(f"| {r['process'][:40]} | {r['thread'][:40]} | "
                         f"{r['plain_ms_per_step']:.2f} | {r['save_ms_per_step']:.2f} | "
                         f"{', '.join(t[:40] for t in r['top'])} |")
    return "\n".join(lines)


def run(args, compiled, state, batch) -> dict:
    """`bench profile --save`'s measurement on the trainer's compiled step."""
    pinned = {"default": None, "on": True, "off": False}[args.pinned_host]
    with tempfile.TemporaryDirectory(prefix="bench_save_") as directory:
        trace_dir = str(Path(args.out) / "traces") if args.out else None
        out = measure(compiled, state, batch, directory, size=args.save_window,
                      saves=args.saves, pinned_host=pinned,
                      compression=args.compression == "on", gc_freeze=args.gc_freeze == "on",
                      switch_interval=args.switch_interval, packed=args.packed == "on",
                      trace_dir=trace_dir,
                      python_trace=args.python_trace)
    print(report(out))
    return out
