"""Reading back a `jax.profiler.trace`: its events, and each thread's busy time.

Shared by `bench profile` (device time per op) and `bench profile --save` (each
thread's time, plain windows against a checkpoint save's).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re


def read_trace(log_dir: str) -> list[dict]:
    """The trace events of the newest `perfetto_trace.json.gz` under log_dir."""
    found = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(found[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _stable(thread: str) -> str:
    """A GPU stream's name without the kinds of work the trace saw on it ("Stream
    #14(Memset,Compute)" -> "Stream #14"), which differ between traces of one stream."""
    return re.sub(r"^(Stream #\d+)\(.*\)$", r"\1", thread)


def thread_busy(events: list[dict]) -> dict[tuple[str, str], dict]:
    """{(process name, thread name): {"busy_us", "top"}} of a trace: the time each
    thread had an event open (nested and overlapping events counted once; threads of
    one name, a pool, summed) and the three event names of most self time (their time
    less that of the events nested in them: what the thread was doing, not the frames
    around it)."""
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("dur") is not None:
            spans[(e["pid"], e["tid"])].append((float(e["ts"]), float(e["dur"]), e["name"]))
    busy = {}
    for key, evs in spans.items():
        evs.sort(key=lambda e: (e[0], -e[1]))  # an enclosing event before those inside it
        total, end = 0.0, float("-inf")
        self_us = collections.Counter()
        stack = []  # open events: [end, name, its own time so far]
        for ts, dur, name in evs:
            if ts + dur > end:  # the union of the intervals
                total += ts + dur - max(ts, end)
                end = ts + dur
            while stack and stack[-1][0] <= ts:
                closed = stack.pop()
                self_us[closed[1]] += closed[2]
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - ts)  # nested: not its parent's own
            stack.append([ts + dur, name, dur])
        for closed in stack:
            self_us[closed[1]] += closed[2]
        label = (procs.get(key[0], str(key[0])), _stable(names.get(key, str(key[1]))))
        entry = busy.setdefault(label, {"busy_us": 0.0, "self": collections.Counter()})
        entry["busy_us"] += total
        entry["self"].update(self_us)
    for entry in busy.values():
        entry["top"] = [name for name, _ in entry.pop("self").most_common(3)]
    return busy
