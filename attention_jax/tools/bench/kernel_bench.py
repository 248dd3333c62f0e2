"""What `bench loss` and `bench norm` share (a kernel module's Pallas kernels timed
against XLA's, a row per launch setting): their common options, the rows and dtype they
time, and their --pallas-settings parsed and checked. Argument handling, not timing
(timing.py), so it imports no JAX itself."""

from __future__ import annotations

import argparse


def parse_settings(text: str, keys: dict[str, str]) -> dict:
    """`chunk=8192,warps=16` -> a kernel module's `settings` arguments, `keys` mapping
    each name given to its argument; a wrong key or value is one line naming the valid
    ones."""
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        if key.strip() not in keys or not value.strip().isdigit():
            raise ValueError(f"{part!r} in {text!r}; valid: comma-separated "
                             + ", ".join(f"{k}=N" for k in keys))
        out[keys[key.strip()]] = int(value)
    if not out:
        raise ValueError(f"{text!r}; valid: e.g. " + ",".join(f"{k}=N" for k in keys))
    return out


def settings_argument(text: str, keys: dict[str, str], settings) -> str:
    """argparse's type for a --pallas-settings setting: `text` once parse_settings(text,
    keys) and the kernel module's `settings(...)` accept it, else argparse's one line."""
    try:
        with settings(**parse_settings(text, keys)):
            pass
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_options(p, what: str, example: str, settings_type, steps: int) -> None:
    """The options both benches have: the dtype, the kernels (--{what}-kernel), a row per
    launch setting of the Pallas kernels, the timing, the JSON."""
    p.add_argument("--dtype", default=None,
                   help="default: bfloat16 on an accelerator, float32 on a CPU")
    p.add_argument(f"--{what}-kernel", default=None,
                   help="comma-separated, of auto,xla,pallas (default: xla,pallas on an "
                        "accelerator, xla on a CPU, where pallas runs interpreted)")
    p.add_argument("--pallas-settings", type=settings_type, nargs="+", default=[],
                   help=f"a row per launch setting of the Pallas {what} kernels, e.g. "
                        f"{example} (what is not given: the defaults)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=steps, help="calls queued per timing")
    p.add_argument("--out", default=None, help="JSON file for the result")


def rows_and_dtype(args, what: str, sizes: tuple[str, ...], parse) -> tuple[list[str], str]:
    """(the rows to time, the dtype): the `sizes` options checked (integers >= 1), the
    kernels of --{what}-kernel (default: xla,pallas on an accelerator, xla on a CPU)
    parsed by `parse`, then "pallas SETTINGS" a launch setting."""
    import jax
    for flag in (*sizes, "repeats", "steps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} {getattr(args, flag)}; valid: an integer >= 1")
    cpu = jax.default_backend() == "cpu"
    kernels = parse(getattr(args, f"{what}_kernel") or ("xla" if cpu else "xla,pallas"))
    kernels += [f"pallas {text}" for text in args.pallas_settings]
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SystemExit(f"error: --dtype {dtype!r}; valid: float32, bfloat16 or float16")
    return kernels, dtype


def _parse_kernels(flag: str, text, valid) -> list[str]:
    """--<flag> "xla,pallas" -> ["xla", "pallas"]; SystemExit naming the valid values."""
    kernels = [k.strip() for k in str(text).split(",") if k.strip()]
    if not kernels or set(kernels) - set(valid):
        raise SystemExit(f"error: --{flag} {text!r}; valid: {list(valid)}, comma-separated")
    return kernels


def parse_loss_kernels(text) -> list[str]:
    """--loss-kernel "xla,pallas" -> ["xla", "pallas"]; SystemExit naming the valid values."""
    from attention_jax.models.losses import LOSS_KERNELS  # imports JAX, not the GPU
    return _parse_kernels("loss-kernel", text, LOSS_KERNELS)


def parse_norm_kernels(text) -> list[str]:
    """--norm-kernel "xla,pallas" -> ["xla", "pallas"] (layers/norms.py NORM_KERNELS)."""
    from attention_jax.layers.norms import NORM_KERNELS  # imports JAX, not the GPU
    return _parse_kernels("norm-kernel", text, NORM_KERNELS)
