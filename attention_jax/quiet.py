"""Third-party log lines that are known to be harmless where we trigger them, dropped
while our code triggers them: never a blanket silence, always one message template of
one library, and only around the call that provokes it.

    with quiet.drop_log_messages("Given directory is read only=%s"):
        manager = ocp.CheckpointManager(...)   # read-only on purpose: nothing to warn of

Messages are matched on their format string (`record.msg`), not the formatted text,
so a filter cannot swallow a different message that happens to contain the words.

And our own warnings about a choice made at trace time (a kernel that cannot take a
shape, a mesh that splits nothing) are said once per process and key, not at every
trace: `warn_once(logger, key, message, *args)`; those of a run as it goes (a damaged
checkpoint, a skipped step) as `warn(message)`, a `warning:` line.
"""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def drop_log_messages(*templates: str, logger: str = "absl"):
    """Drops records whose format string is one of `templates` from `logger` (absl's,
    which orbax and tensorflow-datasets log through) for the duration of the block."""
    templates = frozenset(templates)
    with _filtered(logger, lambda record: record.msg not in templates):
        yield


@contextlib.contextmanager
def _filtered(logger: str, f):
    """Within: `logger` keeps only the records f(record) is true of (logging takes a
    callable as a filter)."""
    target = logging.getLogger(logger)
    target.addFilter(f)
    try:
        yield
    finally:
        target.removeFilter(f)


# gcsfs logs a traceback when a request runs out of retries or fails for good, its
# message formatted before logging (no template to match): what the call that raises
# it then says in one line (workdir.py).
GCSFS_GAVE_UP = (" out of retries on exception: ", " non-retriable exception: ")


# gcsfs's rename of an object asks the store's moveTo first and, refused (the GCS
# emulator's 501), logs a traceback each object before it copies and deletes, which works.
GCSFS_MOVE_FALLBACK = ("Failed to move file using moveTo API",)


@contextlib.contextmanager
def drop_gcsfs(parts=GCSFS_GAVE_UP):
    """Drops gcsfs's records (and their tracebacks) holding one of `parts` for the
    duration of the block: by default its "out of retries" and "non-retriable" ones,
    whose caller says the error itself."""
    with _filtered("gcsfs", lambda record: not any(part in str(record.msg) for part in parts)):
        yield


@contextlib.contextmanager
def storage_errors_in_one_line(limit: int = 300):
    """Within: orbax's ERROR records (on absl's logger) and gcsfs's keep their message's
    first line and lose their tracebacks. A save that fails as the object store goes away
    logged a dozen tracebacks of gcsfs's, aiohttp's and orbax's threads (600 lines)
    before the run's own one line (checkpoint.CheckpointSaveError) said what failed;
    each is now one line."""
    def shorten(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and (record.name == "gcsfs"
                                                or "orbax" in record.pathname):
            first = (record.getMessage().splitlines() or [""])[0]
            record.msg = first if len(first) <= limit else first[:limit] + " ..."
            record.args, record.exc_info, record.exc_text, record.stack_info = (), None, None, None
        return True
    with _filtered("absl", shorten), _filtered("gcsfs", shorten):
        yield


_warned: set = set()


def warn(message: str) -> None:
    """A `warning:` line on stderr from process 0, with every other warning and note
    (stdout has the run's progress and results): the checkpoints' and the trainer's.
    absl's log lines carried a timestamp and a file's line number instead."""
    import sys

    import jax
    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def warn_once(logger: str, key, message: str, *args) -> None:
    """logging.getLogger(logger).warning(message, *args), the first time `key` comes to
    that logger."""
    if (logger, key) not in _warned:
        _warned.add((logger, key))
        logging.getLogger(logger).warning(message, *args)
