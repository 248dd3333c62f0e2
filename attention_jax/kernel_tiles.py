"""What the package's row-wise Pallas kernels for Triton share (models/loss_kernel.py,
layers/norm_kernel.py): where they run interpreted, their compiler parameters, their
launch settings (defaults, and others a bench sweeps), and how a row too long or too odd
for one load is cut (Triton's loads have power-of-two sizes).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from attention_jax.attention.call import target_backend


def interpret_off_gpu(interpret) -> bool:
    """`interpret` as given, or (None) True unless lowering for an NVIDIA GPU: Triton's
    kernels compile for those only, elsewhere they run in interpret mode (tests)."""
    return target_backend() != "gpu" if interpret is None else bool(interpret)


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Triton's compiler parameters for a pallas_call (None when interpreted)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # only meaningful when lowering to Triton
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def power_of_two_pieces(length: int, start: int = 0) -> list[tuple[int, int]]:
    """[(start, size)] covering [start, start + length) in descending powers of two (the
    set bits of length, largest first): 768 -> (0, 512), (512, 256)."""
    pieces, size = [], 1 << max(length.bit_length() - 1, 0)
    while length:
        if size <= length:
            pieces.append((start, size))
            start, length = start + size, length - size
        size //= 2
    return pieces


def power_of_two(least: int) -> tuple[Callable[[int], bool], str]:
    """A Settings rule: a power of two >= least."""
    return (lambda v: v >= least and v & (v - 1) == 0), f"a power of two >= {least}"


AT_LEAST_1 = ((lambda v: v >= 1), "an int >= 1")


class Settings:
    """A kernel module's launch settings: its defaults, and within `use(...)` others (`bench
    loss` and `bench norm` sweep them on a GPU). They are read when a kernel is traced: a
    function jitted and traced before keeps the settings it was traced with.
    rules: name=(default, (is valid, what is valid)); together(settings) -> None, or why
    a combination of valid values is not one."""

    def __init__(self, together: Callable[[dict], str | None] = lambda now: None, **rules):
        self._rules, self._together = rules, together
        self._now = {name: default for name, (default, _) in rules.items()}
        self._given: frozenset = frozenset()

    def __getitem__(self, name: str) -> int:
        return self._now[name]

    def given(self, name: str) -> bool:
        """Whether `name` was given within `use` (not its default): a kernel module may
        adapt a default to the shape it gets, never a setting asked for."""
        return name in self._given

    def current(self) -> dict:
        return dict(self._now)

    @contextlib.contextmanager
    def use(self, **given):
        """Within: the settings given (None: as they are), each checked by its rule."""
        for name, value in given.items():
            if name not in self._rules:
                raise TypeError(f"{name}=...: not a setting; valid: {', '.join(self._rules)}")
            ok, valid = self._rules[name][1]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not ok(value)):
                raise ValueError(f"{name}={value!r}; valid: {valid}")
        after = {**self._now, **{k: v for k, v in given.items() if v is not None}}
        why = self._together(after)
        if why:
            raise ValueError(why)
        before = self._now, self._given
        self._now = after
        self._given = self._given | {k for k, v in given.items() if v is not None}
        try:
            yield
        finally:
            self._now, self._given = before
