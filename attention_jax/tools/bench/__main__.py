"""The bench command: `python -m attention_jax.tools.bench attention|train|ring|checkpoint|data|profile|images|multihost|gpu-hlo|loss|norm [options]`."""

from __future__ import annotations

import argparse

import attention_jax.tools.bench as bench
from attention_jax.tools.bench import (attention_speed, checkpoint_speed, data_speed, gpu_hlo,
                                       image_speed, loss_speed, multihost_speed, norm_speed,
                                       profile, ring_speed, train_speed)

BENCHMARKS = {"attention": attention_speed, "train": train_speed, "ring": ring_speed,
              "checkpoint": checkpoint_speed, "data": data_speed, "profile": profile,
              "images": image_speed, "multihost": multihost_speed, "gpu-hlo": gpu_hlo,
              "loss": loss_speed, "norm": norm_speed}


# The least value of each numeric option, whichever benchmark has it: a negative count
# of repeats ended in statistics' "no median for empty data", a batch of 0 in a
# ZeroDivisionError, a warmup of -1 timed the compilation as a step.
MINIMUM = {"warmup": 0, "repeats": 1, "matmul_repeats": 1, "settle": 0, "steps": 1,
           "matmul_size": 1, "child_timeout": 1, "trainer_steps": 0, "fit_limit_gib": 0,
           "layers": 1, "width": 1, "vocab": 1, "seq_len": 1, "batch": 1, "batches": 1,
           "workers": 0, "loss_chunk": 0, "top": 1, "save_window": 1, "saves": 1,
           "images": 1, "size": 1, "image_size": 1, "log_every": 1, "timeout": 1, "rows": 1,
           "time_budget": 0, "budget_mib": 1}
# The options that name a JSON file written at the end: checked before anything is
# measured (a folder given there lost a ten-minute run's numbers to IsADirectoryError).
FILE_OUTPUTS = ("out", "json")
WRITES_A_FOLDER = ("gpu-hlo", "profile")  # their --out is a folder


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """Numbers below their least value and an output path that cannot be written, each
    said in one argparse line naming the option, before anything runs."""
    from attention_jax import workdir as workdir_lib
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        low = MINIMUM.get(action.dest)
        if low is not None and value is not None:
            values = value if isinstance(value, (list, tuple)) else [value]
            bad = [v for v in values if isinstance(v, (int, float)) and v < low]
            if bad:
                parser.error(f"{action.option_strings[0]}={bad[0]}; valid: >= {low}")
        needs = (action.help or "").split(":")[0]  # "with --save": an option of such runs
        if (needs.startswith("with --") and action.option_strings
                and value not in (None, action.default)):
            flag = needs.split()[1]
            if not getattr(args, flag[2:].replace("-", "_"), True):
                parser.error(f"{action.option_strings[0]} is for runs {needs}; add {flag}, or "
                             f"leave it out")
        if action.dest in FILE_OUTPUTS and value:
            # (a folder's mistakes were found after the profile's windows: FileExistsError,
            # or orbax's "is not a directory" after the saves had run)
            check = (workdir_lib.check_output_folder if args.which in WRITES_A_FOLDER
                     else workdir_lib.check_output_path)
            try:
                check(value, action.option_strings[0])
            except workdir_lib.RunPathError as e:
                parser.error(str(e))


def gpu_only_given(parser: argparse.ArgumentParser, args) -> list[str]:
    """The options given whose help says they are for a GPU ("GPU: ...", "GPU/TPU: ..."):
    a benchmark that runs on the CPU says it ignores them (say_ignored_on_cpu)."""
    return [a.option_strings[0] for a in parser._actions
            if a.option_strings and (a.help or "").startswith(("GPU:", "GPU/TPU:"))
            and getattr(args, a.dest, a.default) != a.default]


def main(argv=None):
    from attention_jax.errors import UserError
    parser = argparse.ArgumentParser(prog="python -m attention_jax.tools.bench",
                                     description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    for module in BENCHMARKS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    check_arguments(sub.choices[args.which], args)
    args.gpu_only_given = gpu_only_given(sub.choices[args.which], args)
    try:
        return BENCHMARKS[args.which].run(args)
    except UserError as e:  # a backend that cannot run here, a config value: one line
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
