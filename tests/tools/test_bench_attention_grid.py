"""`bench attention`'s GPU grid cut down by its options, and `--qkv packed` (attention as
a GPT layer calls it), chosen and compiled on the CPU; nothing is timed here."""

import argparse

import jax.numpy as jnp
import pytest

from attention_jax.tools.bench import __main__ as bench_main
from attention_jax.tools.bench import attention_speed_gpu as gpu


def _args(**given):
    return argparse.Namespace(**{"quick": True, "sizes": None, "masks": None, "head_dims": None,
                                 "implementations": None, **given})


def test_options_keep_a_part_of_the_grid():
    impls, grid = gpu.chosen("gpu", _args(sizes=[1024], masks=("causal", "docs"), head_dims=[64],
                                          implementations=("cudnn", "pallas")))
    assert impls == ("pallas", "cudnn")  # the table's order, not the command line's
    assert grid == [(64, 1024, "causal"), (64, 1024, "docs")]
    assert gpu.chosen("gpu", _args()) == gpu.plan("gpu", True)
    with pytest.raises(SystemExit, match=r"--implementations cudnn; valid on tpu: "
                                         r"splash,blockwise,xla,auto"):
        gpu.chosen("tpu", _args(implementations=("cudnn",)))


@pytest.mark.parametrize("argv, says", [
    (["attention", "--masks", "causal,diagonal"],
     "'causal,diagonal'; valid: comma-separated names of full, causal, packed, docs"),
    (["attention", "--implementations", "flash"], "'flash'; valid: comma-separated names of"),
    (["attention", "--qkv", "fused"], "invalid choice: 'fused'"),
])
def test_bad_grid_options_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_packed_rows_take_one_projection_output_and_its_bias():
    (qkv, bias), kwargs = gpu._packed_inputs(64, 1024, "docs", 768)
    assert qkv.shape == (16, 1024, 3, 12, 64) and bias.shape == (3, 12, 64)
    assert qkv.dtype == bias.dtype == jnp.bfloat16 and kwargs["causal"]
    # Lowered and compiled, forward and gradient for both, then refused by a memory
    # budget of one byte (so nothing runs): the row names its inputs and the reason.
    row = gpu.bench_jax("xla", 64, 1024, "causal", memory_budget=1, width=128, qkv="packed")
    assert row["qkv"] == "packed" and row["fwd_temp_bytes"] > 1
    assert row["skipped"].startswith("needs ")
