"""Several processes: noticing a lost one, and agreeing on when to stop.

A run over several hosts is one program per host; each step's collectives need all of
them. A host that dies (a preempted VM, an OOM-killed process) leaves the others waiting
inside a collective for ever, until JAX's coordination service notices the missing
heartbeats and aborts them with a C++ check failure. `LostHostWatchdog` says it first,
in one line, and exits with `EXIT_LOST_HOST`: every process publishes a heartbeat in the
coordination service's key-value store and reads the others' (a background thread: the
main thread may be stuck in that collective); a peer whose heartbeat has not changed
for `mesh.lost_host_timeout` seconds is lost. Checkpoints are safe: orbax commits a step
only after every process wrote its part, so the newest committed step is whole and a
rerun of all processes resumes from it.

What it cannot say: when process 0 itself dies, the coordination service it hosts dies
with it and JAX's client aborts the others at once with its own message ("... the
leader task was preempted/died ..."); that exit is immediate, not ours.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

EXIT_LOST_HOST = 75  # EX_TEMPFAIL: not this process's fault; run again to resume.
_PREFIX = "attention_jax_heartbeat/"
_DONE = "done"  # a process that finished: its silence from then on is not a loss


def _client():
    """JAX's distributed runtime client (no public accessor; multihost_utils reads the
    same global state)."""
    from jax._src import distributed
    return distributed.global_state.client


class LostHostWatchdog:
    """While it is entered, exits this process within about `timeout` seconds of another
    process going silent, with one line on stderr naming it. Does nothing with one
    process. Leaving it normally marks this process done, so the others stop
    counting its silence; leaving by an exception does not (a crashed host is lost).
    Leaving by a JAX runtime error (a failed collective) first waits up to `timeout` for
    the verdict, so a peer's death is reported as such rather than as the traceback of
    the collective it broke."""

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self.interval = max(0.2, min(2.0, self.timeout / 10))
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if jax.process_count() > 1 and _client() is not None:
            self._me, self._count = jax.process_index(), jax.process_count()
            self._beat(0)
            self._thread = threading.Thread(target=self._watch, name="lost-host-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        if self._thread is None:
            return False
        if exc_type is not None and issubclass(exc_type, jax.errors.JaxRuntimeError):
            # A collective may fail rather than hang when a peer dies (gloo: "connection
            # reset by peer"): give the watchdog its verdict before the traceback.
            deadline = time.monotonic() + self.timeout + 3 * self.interval
            while time.monotonic() < deadline:
                time.sleep(self.interval)
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._beat(_DONE)
        return False

    def _beat(self, value) -> None:
        _client().key_value_set(f"{_PREFIX}{self._me}", str(value), allow_overwrite=True)

    def _watch(self) -> None:
        start = time.monotonic()
        # peer -> (its last heartbeat value, when we saw it change); a peer that has not
        # written yet counts from our start.
        seen = {p: (None, start) for p in range(self._count) if p != self._me}
        beat = 0
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                self._beat(beat)
                values = {k.rsplit("/", 1)[-1]: v for k, v in _client().key_value_dir_get(_PREFIX)}
            except Exception as e:  # the coordination service is gone: process 0 died
                self._lost(f"the coordinator, process 0 of {self._count}, is unreachable "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            now = time.monotonic()
            for peer in list(seen):
                value = values.get(str(peer))
                if value == _DONE:
                    del seen[peer]
                elif value != seen[peer][0]:
                    seen[peer] = (value, now)
            lost = sorted(p for p, (_, since) in seen.items() if now - since > self.timeout)
            if lost:
                age = now - seen[lost[0]][1]
                who = (f"process {lost[0]}" if len(lost) == 1
                       else f"processes {', '.join(map(str, lost))}")
                self._lost(f"{who} of {self._count} sent no heartbeat for {age:.0f} s "
                           f"(mesh.lost_host_timeout={self.timeout:g})")

    def _lost(self, why: str) -> None:
        print(f"error: process {self._me}: {why}; stopping (exit code {EXIT_LOST_HOST}). "
              f"The newest committed checkpoint is whole: start all processes again to "
              f"resume from it.", file=sys.stderr, flush=True)
        # os._exit: the main thread may be inside a collective that will never finish, and
        # no cleanup may wait on the lost peer (an async save's commit, JAX's shutdown).
        os._exit(EXIT_LOST_HOST)
