"""The errors that report a mistake in what was asked, and the checks that raise them.

UserError is the base of every exception that reports a mistake in the request (a config
value, a missing run or dataset, a damaged checkpoint, a diverged run), not a bug. The
command line (main.py) prints such an error as one line, `error: ...`, and exits 1;
anything else keeps its traceback. Each subclass also derives from the built-in error a
caller would expect (ValueError, FileNotFoundError, ...), so `except ValueError` still
catches a ConfigError.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the request; its message says what is wrong and what is valid."""


class ConfigError(UserError, ValueError):
    """A config key with an invalid value; the message names the key and valid values."""


def known_values(x):
    """x's values as a NumPy array where they are known now (an eager call, as in a
    notebook), else None. Under jit a value check cannot raise (and a gather or a
    dynamic_update_slice there clamps or fills with NaN, saying nothing), so values are
    checked where they can be seen; traced ones, or ones on other processes, stay the
    caller's to check."""
    import jax
    import numpy as np
    if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None
    return np.asarray(x)


def did_you_mean(word, choices: Iterable) -> str:
    """' (did you mean 'x'?)' for the choice closest to `word`, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_fields(cls, names: Iterable[str]) -> None:
    """ConfigError naming the first of `names` that is no field of dataclass `cls`, with the
    closest field and all of them (the dataclass's own TypeError names neither)."""
    import dataclasses
    valid = [f.name for f in dataclasses.fields(cls)]
    for name in names:
        if name not in valid:
            raise ConfigError(f"{name!r} is not a field of {cls.__name__}"
                              f"{did_you_mean(name, valid)}; valid: {valid}")


def check_choice(name: str, value, valid: Iterable) -> None:
    """ConfigError "NAME=VALUE is unknown; valid: [...]" unless `value` is one of `valid`.
    `name` is what the user wrote, e.g. "config.data.tokenizer"."""
    valid = list(valid)
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is unknown; valid: {valid}"
                          f"{did_you_mean(value, valid)}")


def check_range(key: str, value, interval: str) -> None:
    """ConfigError unless `value` lies in `interval`, written as in maths: "(0, inf)",
    "[0, 1)", "[1, inf)"; the message names config.<key>, the value and the range."""
    low, high = (float(x.strip()) for x in interval[1:-1].split(","))
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    if above and below:  # False for NaN as well.
        return
    fmt = lambda x: f"{int(x)}" if x.is_integer() else f"{x:g}"  # 4294967296, not 4.29e+09
    if math.isinf(high):
        valid = f"{key} {'>' if interval[0] == '(' else '>='} {fmt(low)}"
    else:
        valid = (f"{fmt(low)} {'<' if interval[0] == '(' else '<='} {key} "
                 f"{'<' if interval[-1] == ')' else '<='} {fmt(high)}")
    raise ConfigError(f"config.{key}={value!r} is out of range; valid: {valid}")


def is_int(x) -> bool:
    """An integer (Python's, NumPy's, or a 0-d integer array), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_float_dtypes(config, names: Iterable[str] = ("dtype", "param_dtype")) -> None:
    """ValueError naming the first of `names` on `config` (a model's config dataclass, where
    it has that field) that is no floating dtype: 'floatx' was taken until init failed
    ("data type 'floatx' not understood")."""
    import jax.numpy as jnp
    for name in names:
        if not hasattr(config, name):
            continue
        value = getattr(config, name)
        try:
            ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name}={value!r} is no floating dtype; valid: one of "
                             f"{list(FLOAT_DTYPES)} (or its jnp dtype)")


def check_float_images(images) -> None:
    """ValueError for images of an integer dtype (a ViT's or CNN's input): raw uint8 pixels
    in 0..255 trained and classified without a word, at 255 times the scale the models
    and their converted weights expect."""
    import jax.numpy as jnp
    if not jnp.issubdtype(jnp.result_type(images), jnp.floating):
        raise ValueError(f"images have dtype {jnp.result_type(images)}; valid: a floating "
                         f"dtype, the pixels normalised as the data pipeline does "
                         f"(data.images.Preprocess: (x / 255 - mean) / std)")


RATES = ("dropout_rate", "attention_dropout_rate")  # probabilities of dropping: [0, 1)


def check_bools(config) -> None:
    """ValueError naming the first field of `config` (a model's config dataclass) declared
    bool whose value is none: a string was taken by its truth value, so
    position_embeddings="False" kept the position embeddings, unsaid."""
    import dataclasses

    import numpy as np
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type in ("bool", bool) and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{field.name}={value!r} is no bool; valid: True or False")


def check_flags(**flags) -> None:
    """ValueError naming the first of a call's switches (deterministic=..., return_weights=...)
    that is no bool: deterministic="False" is truthy, so a training call ran without
    dropout, unsaid. NumPy's and JAX's 0-d bools are bools too."""
    import numpy as np
    for name, value in flags.items():
        if isinstance(value, (bool, np.bool_)):
            continue
        if getattr(value, "shape", None) == () and getattr(value, "dtype", None) == np.bool_:
            continue
        raise ValueError(f"{name}={value!r} is no bool; valid: True or False")


def check_rates_and_epsilon(config) -> None:
    """ValueError naming the first dropout rate on `config` (a model's config dataclass,
    where it has the field) outside [0, 1), or a norm_epsilon not > 0. A notebook's model
    took 1.5 (training's logits all zeros) or -0.5 (activations scaled by 1/1.5) unsaid;
    the trainer's config checks say the same for config.model.*."""
    def number(name, value):  # NumPy's float32 is a number too (no Python float)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r} is no number; valid: a float")
        return float(value)

    for name in RATES:
        if not 0 <= number(name, getattr(config, name, 0.0)) < 1:
            raise ValueError(f"{name}={getattr(config, name)!r} is out of range; valid: 0 <= "
                             f"{name} < 1")
    if not number("norm_epsilon", getattr(config, "norm_epsilon", 1.0)) > 0:
        raise ValueError(f"norm_epsilon={config.norm_epsilon!r} is out of range; valid: "
                         f"norm_epsilon > 0 (added to the variance under the square root)")


def check_positive_ints(config, names: Iterable[str], none_means: dict | None = None) -> None:
    """ValueError "NAME must be a positive integer; got VALUE (valid: ...)" for the first of
    `names` whose value on `config` (a model's config dataclass) is not an integer >= 1.
    none_means: {name: what None stands for} where None is valid too. Said before a size
    divides by zero or builds a model with nothing in it."""
    none_means = none_means or {}
    for name in names:
        value = getattr(config, name)
        if value is None and name in none_means:
            continue
        if not is_int(value) or value < 1:
            valid = "an integer >= 1" + (f" or None ({none_means[name]})"
                                         if name in none_means else "")
            raise ValueError(f"{name} must be a positive integer; got {value!r} (valid: "
                             f"{valid})")
