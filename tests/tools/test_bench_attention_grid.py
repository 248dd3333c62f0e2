"""`bench attention`'s GPU grid cut down by its options, and `--qkv packed` (attention as
a GPT layer calls it), chosen and compiled on the CPU; nothing is timed here."""

import argparse

import jax.numpy as jnp
import pytest
from helpers import pallas_calls

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
    # a head size or length the grid has not: one line, not an empty table
    with pytest.raises(SystemExit, match=r"leave no row of the grid; valid: T in \[1024, 4096\], "
                                         r"H in \[64, 128\], masks full, causal, packed, docs"):
        gpu.chosen("gpu", _args(head_dims=[96]))


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
    # auto's column names what the packed call takes (on a GPU: the kernels, at H = 64),
    # not what separate q, k, v would (cuDNN)
    from attention_jax.attention import compiling_for
    with compiling_for("gpu"):  # (then refused: a CPU cannot compile the Triton kernels)
        row = gpu.bench_jax("auto", 64, 1024, "causal", memory_budget=1, width=128, qkv="packed")
    assert row["auto"].startswith("pallas — the fused Pallas kernels read the projection's")


def test_pallas_tile_settings_are_parsed_checked_and_tabled():
    assert gpu.parse_tiles("fwd=64x32, warps=4,bwd_stages=2") == {
        "fwd_q": 64, "fwd_k": 32, "num_warps": 4, "bwd_num_stages": 2}
    for text, says in (("fwd=64", "'fwd=64' in 'fwd=64'; valid: fwd=NxN,bwd=NxN,warps=N"),
                       ("tiles=64x64", "valid: fwd=NxN"), ("fwd=48x64", "tile 48; valid: powers"),
                       ("warps=0", "whole numbers >= 1"), ("", "valid: e.g."),
                       ("warps=3", "num_warps=3; valid: a power of two >= 1")):  # Triton's
        with pytest.raises(ValueError, match=says):
            gpu.parse_tiles(text)
    rows = [{"impl": i, "H": 64, "T": 1024, "mask": "causal", "fwd_s": 1e-4, "fwd_bwd_s": 4e-4}
            for i in ("cudnn", "pallas", "pallas fwd=64x64")]
    assert "| H | T | mask | pallas | pallas fwd=64x64 | cudnn | pallas ÷ cudnn |" in gpu.table(rows)


def test_a_tile_setting_runs_those_kernels(x64):
    """A --pallas-tiles column times the kernels with those tiles: the same attention (the
    float64 reference's) through other tiles, packed or not, in interpret mode here."""
    import jax
    import numpy as np

    from attention_jax.attention import dot_product_attention
    rng = np.random.default_rng(0)
    qkv = jnp.asarray(rng.standard_normal((1, 64, 3, 2, 16)))
    bias = jnp.asarray(rng.standard_normal((3, 2, 16)))
    want = dot_product_attention(*(qkv[:, :, c] + bias[c] for c in range(3)), causal=True,
                                 implementation="reference")
    tiles = "fwd=32x16,bwd=16x32"
    packed = gpu._tiled_pallas(tiles, 16, 64, "packed")(qkv, bias, causal=True)
    separate = gpu._tiled_pallas(tiles, 16, 64, "separate")(
        *(qkv[:, :, c] + bias[c] for c in range(3)), causal=True)
    np.testing.assert_allclose(packed, want, atol=1e-10)
    np.testing.assert_allclose(separate, want, atol=1e-10)
    # and with those tiles: the forward's grid has T / 32 query blocks (the CPU's own 16s: 4)
    jaxpr = jax.make_jaxpr(lambda x, b: gpu._tiled_pallas(tiles, 16, 64, "packed")(
        x, b, causal=True))(qkv, bias).jaxpr
    assert [e.params["grid_mapping"].grid for e in pallas_calls(jaxpr)] == [(2, 1, 2)]
    with pytest.raises(SystemExit) as e:
        bench_main.main(["attention", "--pallas-tiles", "fwd=48x64"])
    assert e.value.code == 2
