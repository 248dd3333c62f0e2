"""The bench command: `python -m attention_jax.tools.bench attention|train|ring|checkpoint|data|profile|images|multihost|gpu-hlo|loss [options]`."""

from __future__ import annotations

import argparse

import attention_jax.tools.bench as bench
from attention_jax.tools.bench import (attention_speed, checkpoint_speed, data_speed, gpu_hlo,
                                       image_speed, loss_speed, multihost_speed, profile,
                                       ring_speed, train_speed)

BENCHMARKS = {"attention": attention_speed, "train": train_speed, "ring": ring_speed,
              "checkpoint": checkpoint_speed, "data": data_speed, "profile": profile,
              "images": image_speed, "multihost": multihost_speed, "gpu-hlo": gpu_hlo,
              "loss": loss_speed}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attention_jax.tools.bench",
                                     description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="which", required=True)
    for module in BENCHMARKS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return BENCHMARKS[args.which].run(args)


if __name__ == "__main__":
    main()
