"""bench profile: a jax.profiler trace of a training step read back into per-op and
per-kind device time. On the CPU the ops are XLA's thunks on host threads; the kinds
are checked on kernel names an H100 trace of GPT-2 small gave (2026-11-23)."""

import argparse
import json
import math

import pytest

from attention_jax.tools.bench import profile


def _args(tmp_path, *extra):
    parser = argparse.ArgumentParser()
    profile.add_parser(parser.add_subparsers(dest="which"))
    return parser.parse_args(["profile", "--shape", "gpt-tiny-gpu", "--dtype", "float32",
                              "--steps", "2", "--top", "5", *extra])


def test_the_bare_step_profile_sums_its_ops_and_keeps_trace_and_hlo(tmp_path, capsys):
    out = tmp_path / "p"
    summary = profile.run(_args(tmp_path, "--out", str(out)))
    ops = summary["ops"]
    assert ops and summary["steps"] == 2 and summary["step"] == "the bare step"
    assert ops == sorted(ops, key=lambda r: -r["us"])  # largest first
    busy = sum(r["ms_per_step"] for r in ops)
    assert busy == pytest.approx(1e3 * summary["device_busy_s_per_step"])
    assert sum(k["ms_per_step"] for k in summary["kinds"].values()) == pytest.approx(busy)
    assert any(k in summary["kinds"] for k in ("matmul", "elementwise"))
    assert math.isfinite(summary["loss"])
    # each op found in the compiled module: its shape and the JAX operation it came from
    assert sum(bool(r["shape"]) for r in ops) >= len(ops) // 2
    assert any("dot_general" in r["source"] or "GPT" in r["source"] for r in ops)
    import gzip
    sources = profile.hlo_sources(gzip.open(out / "step.hlo.txt.gz", "rt").read())
    numbered = next(n for n in sources if n.rsplit(".", 1)[-1].isdigit())
    gpu_name = numbered[::-1].replace(".", "_", 1)[::-1]  # XLA:GPU's kernel name for it
    assert profile._source_of(gpu_name, sources) == sources[numbered]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["row"]["batch"] == 2 and (out / "step.hlo.txt.gz").stat().st_size > 0
    assert list(out.rglob("perfetto_trace.json.gz"))
    printed = capsys.readouterr().out
    assert "| kind | ms/step | % of step | ops/step |" in printed
    assert printed.count("\n| `") == 5  # --top 5 ops


def test_the_trainer_step_profile_runs_on_a_real_batch(tmp_path):
    trainer_args = (f"--config.data.max_files=6 --config.data.data_dir={tmp_path / 'tfds'} "
                    "--config.mesh.num_devices=1")
    summary = profile.run(_args(tmp_path, "--trainer", f"--trainer-args={trainer_args}"))
    assert summary["step"] == "the trainer's step" and summary["ops"]
    assert math.isfinite(summary["loss"])


def test_kernel_names_from_an_h100_trace_fall_into_their_kinds():
    assert profile.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert profile.kind_of("gemm_fusion_dot_general_297") == "matmul"
    assert profile.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert profile.kind_of("input_add_reduce_fusion_18") == "reduction"
    assert profile.kind_of("loop_convert_multiply_fusion_11") == "elementwise"
    assert profile.kind_of("Memset 0") == "copy"


def test_bad_arguments_name_the_valid_values(tmp_path):
    with pytest.raises(SystemExit, match=r"--batch 0; valid: an integer >= 1"):
        profile.run(_args(tmp_path, "--batch", "0"))
    with pytest.raises(SystemExit, match=r"--loss-chunk -1; valid: an integer >= 0"):
        profile.run(_args(tmp_path, "--loss-chunk", "-1"))
