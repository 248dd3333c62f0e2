r"""A grid of runs of one experiment config, trained one after another in one process.

    python -m attention_jax.tools.sweep --config=gated_mlp --workdir=/tmp/gated \
        --grid=train.seed=0,1,2 --grid=mlp=relu,gelu,swiglu,geglu

Each --grid is KEY=V1,V2,...: a KEY with a dot is a config field (`train.seed`,
`data.train_fraction`), set like `--config.train.seed=1` of attention_jax.main; a KEY
without one is an argument of the experiment file (`configs/gated_mlp.py:mlp=relu`).
`--config.KEY=VALUE` sets a field for every point, as attention_jax.main takes it.
Every combination trains, the first --grid varying slowest (put the seed first: a
sweep stopped early then has every variant for its first seeds), in
WORKDIR/<key><value>-<key><value>... (e.g. /tmp/gated/seed0-mlprelu), exactly as
`attention_jax.main` would train it, plus a sweep.json there naming the point, which
`analysis seeds --by=KEY` groups on. A point whose run already finished is skipped, so
an interrupted sweep resumes where it stopped: SIGINT or SIGTERM stops the point in
training as attention_jax.main stops (a checkpoint saved), then the sweep, with main's exit
code. Every point's config and task (its model config, its data), and any run already in
a point's folder, are checked before the first point trains: a bad value in the last
point fails at once.

Why one process: a small run's own training is seconds on a CPU, while starting Python,
JAX and the data pipeline costs tens of seconds per process; here it is paid once. And
compiling the train step costs tens of seconds more per run, the same program for
points that differ only in the seed or the data (the seed is an argument of the jitted
init, not a constant): XLA's persistent compilation cache in WORKDIR/.jax_cache compiles
each distinct model once.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence

import ml_collections

from attention_jax import config as config_lib
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError, UserError


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """['mlp=relu,gelu', 'train.seed=0,1']
    -> {'mlp': ['relu', 'gelu'], 'train.seed': ['0', '1']}."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--grid={item!r} must be KEY=V1,V2,..., e.g. train.seed=0,1,2")
        if key in grid:
            raise ValueError(f"--grid key {key!r} is given twice; list all its values in "
                             f"one --grid")
        grid[key] = values.split(",")
    return grid


def points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination, the first key varying slowest."""
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def point_name(point: dict[str, str]) -> str:
    """{'mlp': 'relu', 'train.seed': '0'} -> 'mlprelu-seed0' (the last part of dotted keys).
    A character a folder name cannot hold or should not (a '/' of `vit-tiny/4` would nest
    the run a folder deeper) becomes '_'."""
    return "-".join(re.sub(r"[^\w.+=-]", "_", part) for part in _name_parts(point))


def _name_parts(point: dict[str, str]) -> list[str]:
    """<key><value> of each grid key, the last part of a dotted key, as given."""
    return [f"{key.rsplit('.', 1)[-1]}{value}" for key, value in point.items()]


def point_config(spec: str, point: dict[str, str],
                 overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """The config of one grid point: experiment arguments first, then the sweep's fixed
    overrides (--config.KEY=VALUE), then the point's field overrides (attention_jax.config
    .load, as the command line loads it)."""
    args = ",".join(f"{k}={v}" for k, v in point.items() if "." not in k)
    name, _, given = spec.partition(":")
    args = ",".join(a for a in (given, args) if a)
    fields = [*overrides, *(f"{k}={v}" for k, v in point.items() if "." in k)]
    try:
        return config_lib.load(f"{name}:{args}" if args else name, fields)
    except ConfigError as e:  # a grid key's mistake named as the --grid it came from
        for key in point:
            if "." in key and str(e).startswith(f"--config.{key}: "):
                raise ConfigError(f"--grid={key}=...: {str(e).split(': ', 1)[1]}") from None
        raise


def check_grid(spec: str, grid: dict[str, list[str]], overrides: Sequence[str]) -> None:
    """What would be given twice, the later silently winning: a grid key that --config's
    :ARG or a fixed --config.KEY also sets; and two points whose folders would be one."""
    given = {item.partition("=")[0] for item in spec.partition(":")[2].split(",") if item}
    fixed = {item.partition("=")[0] for item in overrides}
    for key in grid:
        where = (f"--config={spec}" if key in given else
                 f"--config.{key}" if key in fixed else None)
        if where:
            raise ConfigError(f"--grid={key}=... varies what {where} sets; leave {key} out of "
                              f"it (or give the grid one value)")
    names = {}
    for point in points(grid):
        other = names.setdefault(point_name(point), point)
        if other is not point and other == point:  # (was the folder-name message)
            raise ConfigError(f"--grid gives the point {point} twice; give each value once")
        if other is not point:
            raise ConfigError(f"--grid points {other} and {point} would share the folder "
                              f"{point_name(point)!r}; give values that differ in more than "
                              f"the characters a folder name cannot hold")


def check_tasks(todo) -> dict[str, set[str]]:
    """Builds the task of every point still to train, before the first trains: what only
    a task checks (the model config a family builds, e.g. num_heads dividing d_model; the
    data a point names) fails now, not after the points before it have trained. Points
    that differ only in the seed share one check. A built task is dropped and training
    builds its own: the data's caches (tfds, the token cache) are built once, but a
    tokenizer trained for the run (BPE) is trained again, a cost paid to fail early.

    What a check says (notes, warnings, a data preparation's progress) is written as it
    comes, under a line naming the points it checks; returns {run_dir: its messages}, for
    the point's training not to say them a second time (_Unrepeated)."""
    from attention_jax import tasks
    groups: dict[str, list] = {}
    for point, config, run_dir in todo:
        unseeded = config.copy_and_resolve_references()
        unseeded.train.seed = 0
        groups.setdefault(unseeded.to_json_best_effort(sort_keys=True), []).append(
            (point, config, run_dir))
    said = {}
    for group in groups.values():
        point, config, run_dir = group[0]
        names = [point_name(p) for p, _, _ in group]
        print(f"[sweep] checking {names[0]}" + (f" (for {', '.join(names[1:])} too: they "
                                                f"differ in the seed)" if len(names) > 1 else ""),
              file=sys.stderr, flush=True)
        heard = _Heard(sys.stderr)
        try:
            with contextlib.redirect_stderr(heard):
                tasks.TASKS[config.task](config, run_dir)
        except UserError as e:
            raise ConfigError(f"sweep point {point_name(point)}: {e}") from None
        for _, _, dir_ in group:
            said[dir_] = set(heard.messages)
    return said


class _Stream(io.TextIOBase):
    """Stands in for sys.stderr, writing through to it: a terminal stays one for progress
    bars (isatty, fileno, encoding are the stream's)."""

    def __init__(self, stream):
        self.stream = stream

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", None)


class _Heard(_Stream):
    """Writes through, and keeps each message written (a print's text, without the
    newline print writes after it)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.messages = []

    def write(self, text: str) -> int:
        if text.strip():
            self.messages.append(text.rstrip("\n"))
        return self.stream.write(text)


class _Unrepeated(_Stream):
    """Stands in for sys.stderr while a point trains: a message its check printed already
    (with the newline print writes after it) is not written again; everything else goes
    through at once (the progress line included)."""

    def __init__(self, stream, said: set[str]):
        super().__init__(stream)
        self.said, self._thread = said, threading.local()

    def write(self, text: str) -> int:
        # A message and its newline are two writes of one thread (print's): whether the
        # next newline is a suppressed message's is that thread's own.
        skip_newline = getattr(self._thread, "skip_newline", False)
        self._thread.skip_newline = False
        if skip_newline and text == "\n":
            return len(text)
        if text.rstrip("\n") in self.said:
            self._thread.skip_newline = not text.endswith("\n")
            return len(text)
        return self.stream.write(text)


class Stopped(Exception):
    """A point's training stopped by a signal (its checkpoint saved): the sweep stops."""

    def __init__(self, signal_name: str, run_dir: str, step: int):
        super().__init__(f"[sweep] stopped by {signal_name} in {run_dir} at step {step} (saved); "
                         f"run the same command again to resume")
        from attention_jax.train import EXIT_CODES
        self.code = EXIT_CODES.get(signal_name, 1)


def run_sweep(config_path: str, workdir: str, grid: dict[str, list[str]],
              overrides: Sequence[str] = ()) -> list[dict]:
    """Trains every point of the grid (skipping finished ones); returns one record each.
    A point stopped by SIGINT or SIGTERM (saved, as attention_jax.main saves) stops the
    sweep: Stopped."""
    import jax

    from attention_jax import train
    check_grid(config_path, grid, overrides)
    workdir = workdir_lib.expand(workdir)
    runs = []  # (point, config, its run directory, finished before): all errors first
    for point in points(grid):
        config = point_config(config_path, point, overrides)
        # As train.setup validates it: the task's name (a --config.task typo was a
        # KeyError traceback in check_tasks) and what must divide the devices (a grid's
        # batch size that does not stopped the sweep after the points before it trained).
        try:
            train.validated_devices(config)
        except ConfigError as e:
            raise ConfigError(f"sweep point {point_name(point)}: {e}") from None
        run_dir = os.path.join(workdir, point_name(point))
        _check_earlier_folder_name(workdir, point, run_dir)
        done = workdir_lib.finished(run_dir, config.train.steps,
                                    evaluates=config.eval.every >= 0)
        # A point's folder holding a run of another config (finished, or with a checkpoint
        # to resume) would stand in its place, or stop the sweep after the points before
        # it have trained. One without a checkpoint is simply trained anew, as main does.
        changed = ((done or _has_checkpoint(run_dir))
                   and workdir_lib.training_changes(config, run_dir))
        if changed:
            state = "finished" if done else "an unfinished"
            raise ConfigError(f"sweep point {point_name(point)}: {run_dir} holds "
                              f"{'a ' if done else ''}{state} run of another config ({changed}); "
                              f"give this sweep another --workdir, or move that run away")
        runs.append((point, config, run_dir, done))
    said = check_tasks([(point, config, run_dir) for point, config, run_dir, done in runs
                        if not done])
    jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    records = []
    for point, config, run_dir, done in runs:
        record = {"point": point, "workdir": run_dir, "config": config_path}
        if done:
            print(f"[sweep] {run_dir}: finished before, skipped", file=sys.stderr)
            marker = workdir_lib.epath_of(run_dir, "sweep.json")
            if not marker.exists():  # finished by a call a signal stopped before writing it
                marker.write_text(json.dumps(record, indent=1))
            records.append({**record, "skipped": True})
            continue
        start = time.time()
        with contextlib.redirect_stderr(_Unrepeated(sys.stderr, said.get(run_dir, set()))):
            summary = train.train_and_evaluate(config, run_dir)
        stopped = summary["stopped_by"]
        # Finished (a signal in its last window still lets the run end): the point is
        # recorded, as a later call skips it.
        if not stopped or summary["step"] >= config.train.steps:
            record.update(wall_s=round(time.time() - start, 1), eval=summary["eval"])
            workdir_lib.epath_of(run_dir, "sweep.json").write_text(json.dumps(record, indent=1))
            print(f"[sweep] {run_dir}: {record['wall_s']} s, eval {summary['eval']}",
                  file=sys.stderr)
            records.append(record)
        if stopped:  # saved; the rest of the grid waits for the next call
            raise Stopped(stopped, run_dir, summary["step"])
    return records


def _has_checkpoint(run_dir: str) -> bool:
    from attention_jax.checkpoint import step_folders
    return bool(step_folders(workdir_lib.epath_of(run_dir, workdir_lib.CHECKPOINTS)))


def _check_earlier_folder_name(workdir: str, point: dict[str, str], run_dir: str) -> None:
    """A sweep started when a value's '/' or ':' still went into the folder name as it
    is: resumed now, its run would not be found and would train again from scratch."""
    earlier = os.path.join(workdir, "-".join(_name_parts(point)))
    if (earlier != run_dir and workdir_lib.exists(earlier, workdir_lib.CONFIG)
            and not workdir_lib.exists(run_dir, workdir_lib.CONFIG)):
        raise ConfigError(f"sweep point {point_name(point)}: its run is in {earlier}, the "
                          f"name an earlier version gave it; move it to {run_dir} to resume it")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attention_jax.tools.sweep",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="a shipped config NAME or a FILE.py (as attention_jax.main "
                             "takes it), e.g. gated_mlp")
    parser.add_argument("--workdir", required=True, help="parent of the runs' directories")
    parser.add_argument("--grid", action="append", default=[], required=True,
                        help="KEY=V1,V2,... (repeatable). A dotted KEY is a config field "
                             "(train.seed), one without a dot an argument of the config "
                             "(gated_mlp's mlp). Runs go to WORKDIR/<key><value>-..., the "
                             "last part of a dotted key (seed0-mlprelu)")
    parser.epilog = ("--config.KEY=VALUE (repeatable) sets a field for every point, as "
                     "attention_jax.main takes it, without adding to the folders' names.")
    try:
        argv, overrides = config_lib.split_overrides(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    args = parser.parse_args(argv)
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax and tfds are chatty at INFO.
    try:
        grid = parse_grid(args.grid)
        start = time.time()
        records = run_sweep(args.config, args.workdir, grid, overrides)
    except Stopped as e:
        print(e, file=sys.stderr)
        raise SystemExit(e.code) from None
    except (UserError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps({"runs": len(records), "wall_s": round(time.time() - start, 1)}))


if __name__ == "__main__":
    main()
