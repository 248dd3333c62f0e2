"""UserError: the base of every exception that reports a mistake in what was asked (a
config value, a missing run or dataset, a damaged checkpoint, a diverged run), not a bug.

The command line (main.py) prints such an error as one line, `error: ...`, and exits 1;
anything else keeps its traceback. Each subclass also derives from the built-in error a
caller would expect (ValueError, FileNotFoundError, ...), so `except ValueError` still
catches a ConfigError.
"""


class UserError(Exception):
    """A mistake in the request; its message says what is wrong and what is valid."""
