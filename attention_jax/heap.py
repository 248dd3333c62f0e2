"""Python's garbage collector, kept from pausing the training loop.

CPython's cyclic collector holds the interpreter while it runs, and a full (generation 2)
collection walks every object the process holds: JAX, Flax, orbax, the data pipeline,
the compiled step's caches. In main.py (char_gpt with 12 layers, a checkpoint every 50
steps, the 2-core CPU host) one took 360-470 ms, and once the loop had settled they came
about once a minute, on orbax's saving threads in the middle of a save: every Python
thread waits meanwhile, the one that launches the train steps too, so an accelerator
runs out of queued steps. (Issue 35: on an H200, 2026-11-26, full collections of 100-170
ms came in about every other later save, frozen heap or not, while about 290,000 objects
made by the save programs' compilation were outside it: the reason that compilation's
thread settles the heap when it is done, see checkpoint.Checkpointer.prepare.)

`FrozenHeap` moves what exists when training starts into CPython's permanent generation
(`gc.freeze`), again once the first step, the first evaluation and the checkpoint's save
programs have compiled, and back out when training ends
(`gc.unfreeze`): a full collection then walks only what the loop itself created.
(Left out, what the eval step's compilation made kept the full collections of the same
run with an evaluation every 100 steps at up to 42-53 ms; settled, up to 9-16 ms.)
Reference counting still frees frozen objects; only a reference cycle that becomes
garbage while frozen waits until the end of the loop. A process that froze its heap
itself, or turned the collector off, is left as it is.

`Pauses` adds up the collections (gc.callbacks): how many, and how long they held the
interpreter, by generation (`bench profile --save`; the loop's `host_gc_frac`).
"""

from __future__ import annotations

import gc
import threading
import time


class FrozenHeap:
    """While entered, collections skip the objects that existed at entry and at the last
    `settle()` (the process's long-lived ones)."""

    def __init__(self):
        self._ours = False
        self._lock = threading.Lock()  # settle may come from another thread (checkpoint.prepare)

    def __enter__(self):
        self._ours = gc.isenabled() and gc.get_freeze_count() == 0
        self.settle()
        return self

    def settle(self) -> None:
        """Collects what is garbage now (once, so that no cycle is frozen dead) and
        freezes the rest: call it after a phase that created long-lived objects (the
        first step's compilation), from any thread; after the context has exited it
        does nothing."""
        with self._lock:
            if self._ours:
                gc.collect()
                gc.freeze()

    def __exit__(self, *exc):
        with self._lock:
            if self._ours:
                gc.unfreeze()
                self._ours = False
        return False


class Pauses:
    """While entered, adds up the garbage collections of every thread: `total_s`, the
    seconds they held the interpreter; `summary()`, per generation ("gen0" to "gen2",
    gen2 the full collections): {"count", "total_s", "max_s"} (string keys: it goes into
    JSON as it is). Counters only, so a run of days holds no more than a short one."""

    def __init__(self):
        self._started: dict[int, float] = {}
        self.clear()

    def _callback(self, phase, info):
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = time.perf_counter()
        elif me in self._started:
            seconds = time.perf_counter() - self._started.pop(me)
            self.total_s += seconds
            count, total, longest = self._by_generation.get(info["generation"], (0, 0.0, 0.0))
            self._by_generation[info["generation"]] = (count + 1, total + seconds,
                                                       max(longest, seconds))

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False

    def clear(self) -> None:
        self.total_s = 0.0
        self._by_generation: dict[int, tuple[int, float, float]] = {}

    def summary(self) -> dict[str, dict[str, float]]:
        return {f"gen{g}": {"count": c, "total_s": t, "max_s": m}
                for g, (c, t, m) in sorted(self._by_generation.items())}
