"""Checks every checkpoint of a workdir against the digests saved with it:

    python -m attention_jax.verify WORKDIR        (a run's workdir or its checkpoints folder,
                                                   a local path or gs://bucket/run)

restores each committed step onto one device, in its saved shapes, and prints a table
(step, save time, size, mesh, status: 'ok' or what is damaged), newest first, followed by
the folders that are not committed steps (half-written saves, steps moved aside). Nothing
is moved or written. Exit status 0 when every step is intact, 1 when one is damaged or
there are none, 2 when there is no checkpoints folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from typing import Any

import jax
from absl import logging
from etils import epath

from attention_jax import workdir as workdir_lib
from attention_jax.checkpoint import (CheckpointDamagedError, CheckpointLocationError, Checkpointer,
                                     one_line_error)


def _size(path: epath.Path) -> int:
    if "://" in str(path):  # an object store: fsspec sums one recursive listing
        import fsspec
        fs, inside = fsspec.core.url_to_fs(str(path))
        return int(fs.du(inside))
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(os.fspath(path)) for f in files)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax and tensorstore log their own tracebacks for a failed read; the verifier
    reports the cause in its table instead."""
    import logging as std_logging
    loggers = [std_logging.getLogger(n) for n in ("absl", "orbax", "asyncio", "jax")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(std_logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def verify_step(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    """Restores `step` onto this process's first device, in its saved shapes, and checks
    it against its digests: {'step', 'saved_at', 'size', 'mesh', 'status'} where status
    is 'ok', 'ok (no digests: not verified)' or what is damaged."""
    path = ckpt.step_path(step)
    row = {"step": step, "saved_at": "?", "size": _size(path), "mesh": "?", "status": "ok"}
    try:
        digest = ckpt.recorded_digest(step)
    except Exception:  # noqa: BLE001 - reported by restore below
        digest = None
    if digest:
        row["saved_at"] = str(digest.get("saved_at", "?")).replace("T", " ").replace("+00:00", "")
        mesh = digest.get("mesh") or {}
        row["mesh"] = " ".join(f"{k}={v}" for k, v in mesh.items()) or "1 device"
        if digest.get("process_count", 1) > 1:
            row["mesh"] += f" ({digest['process_count']} processes)"
    else:
        try:  # orbax's own commit time, for checkpoints saved before digests
            meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
            row["saved_at"] = datetime.datetime.fromtimestamp(
                meta["commit_timestamp_nsecs"] / 1e9, datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S")
        except Exception:  # noqa: BLE001
            pass
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    try:
        tree = ckpt.state_tree(step)
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                tree)
        with _quiet_orbax():
            ckpt.restore(abstract, step)
        if digest is None:
            row["status"] = "ok (no digests: not verified)"
    except CheckpointDamagedError as e:
        row["status"] = "DAMAGED: " + e.reason
        if e.reason.startswith("data-loader state could not be read"):
            # Its arrays may still be whole: a reader (eval, sampling) reads them, as
            # runs.open_run does; training falls back from the step (its data position
            # is gone). Said, so that the table agrees with what --mode=eval did.
            try:
                with _quiet_orbax():
                    ckpt.restore(abstract, step, need_data=False)
                row["status"] += ("; its arrays verify: eval and sampling read this step, "
                                  "training resumes from an older one")
            except Exception:  # noqa: BLE001 - damaged arrays too: the reason above stands
                pass
    except Exception as e:  # noqa: BLE001 - a table row, not a traceback
        row["status"] = "DAMAGED: " + one_line_error(e)
    return row



def verify_directory(workdir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of `verify_step` for every committed step of a workdir (or of its
    checkpoints folder), newest first, and the names of folders that are not committed
    steps (half-written, moved aside)."""
    if workdir_lib.is_remote(workdir):  # a bucket that is missing or cannot be reached
        workdir_lib.check_readable(workdir)  # is one line (it was gcsfs's traceback)
    directory = epath.Path(workdir)  # a local path or a gs:// URL
    if not directory.exists():
        raise FileNotFoundError(f"{workdir} does not exist")
    if not directory.is_dir():
        raise FileNotFoundError(f"{workdir} is a file; valid: a run's workdir or its "
                                f"checkpoints folder")
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    # (a folder with a config.json: a run that has saved no checkpoint yet)
    if not directory.is_dir() or (directory / "config.json").exists():
        raise FileNotFoundError(f"{workdir} has no checkpoints folder")
    entries = [p for p in directory.iterdir() if not p.name.startswith(".")]
    folders = [p for p in entries if p.is_dir()]
    if entries and not any(p.name.split(".")[0].isdigit() for p in folders):
        # Not a checkpoints folder (no step folder, committed or moved aside): a folder of
        # runs, most likely, whose every run read as "not a checkpoint step", or of files
        # (a text corpus), which read as "no committed checkpoints". A checkpoints folder
        # holds only folders (steps, orbax's metadata/), so only an empty one gets that.
        runs = sorted(p.name for p in folders if (p / "checkpoints").is_dir())
        raise FileNotFoundError(
            f"{workdir} is neither a run's workdir nor its checkpoints folder"
            + (f"; the runs in it: {', '.join(runs[:8])}{' ...' if len(runs) > 8 else ''} "
               f"(verify each: python -m attention_jax.verify {workdir}/{runs[0]})"
               if runs else ""))
    ckpt = Checkpointer(directory, read_only=True)
    try:
        committed = ckpt.committed_steps()
        rows = [verify_step(ckpt, step) for step in reversed(committed)]
    finally:
        ckpt.close()
    others = sorted(p.name for p in directory.iterdir()
                    if p.is_dir() and not (p.name.isdigit() and int(p.name) in committed))
    return rows, others


def format_table(rows: list[dict[str, Any]], others: list[str]) -> str:
    header = ("step", "saved at (UTC)", "size", "mesh", "status")
    cells = [[str(r["step"]), r["saved_at"], _human(r["size"]), r["mesh"], r["status"]]
             for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    if not rows:
        lines.append("(no committed checkpoints)")
    for name in others:
        why = ("moved aside after it failed to restore or verify" if ".corrupt" in name else
               "no commit marker (a save that did not finish), ignored" if name.isdigit()
               or ".uncommitted" in name else
               "temporary folder of a save in progress or killed" if "tmp" in name else
               "not a checkpoint step")
        lines.append(f"{name}: {why}")
    return "\n".join(lines)



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attention_jax.verify",
        description="Restore every committed checkpoint of a workdir, check it against the "
                    "digests saved with it and print a table.")
    parser.add_argument("workdir", help="a run's workdir or its checkpoints folder")
    args = parser.parse_args(argv)
    # absl's warnings (orbax's among them) off while it reads, and back after: called
    # from Python (a notebook, a test) it left them off for the rest of the process.
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        rows, others = verify_directory(args.workdir)
    except (FileNotFoundError, CheckpointLocationError, workdir_lib.RunPathError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        logging.set_verbosity(verbosity)
    print(format_table(rows, others))
    return 0 if rows and all(r["status"].startswith("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
