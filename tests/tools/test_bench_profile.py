"""bench profile: a jax.profiler trace of a training step read back into per-op and
per-kind device time. On the CPU the ops are XLA's thunks on host threads; the kinds
are checked on kernel names an H100 trace of GPT-2 small gave (2026-11-23)."""

import argparse
import json
import math
import statistics
import sys

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
    assert profile.kind_of("cross_entropy_gradient") == "loss"  # the Pallas loss kernels


def test_bad_arguments_name_the_valid_values(tmp_path):
    with pytest.raises(SystemExit, match=r"--batch 0; valid: an integer >= 1"):
        profile.run(_args(tmp_path, "--batch", "0"))
    with pytest.raises(SystemExit, match=r"--loss-chunk -1; valid: an integer >= 0"):
        profile.run(_args(tmp_path, "--loss-chunk", "-1"))
    with pytest.raises(SystemExit, match=r"--loss-kernel 'fused'; valid: \['auto', 'xla', 'pallas'\]"):
        profile.run(_args(tmp_path, "--loss-kernel", "fused"))
    with pytest.raises(SystemExit, match=r"--switch-interval 0.0; valid: seconds > 0"):
        profile.run(_args(tmp_path, "--save", "--switch-interval", "0"))


def test_the_save_profile_costs_each_save_and_compares_threads(tmp_path, capsys):
    """bench profile --save on the trainer's step: every save spans whole windows until
    it has committed, its cost is what those windows took beyond as many plain steps,
    and the traced plain window and save give each thread's time side by side. The
    options reach orbax (pinned-host copy on: the CPU client has that memory too)."""
    out = tmp_path / "save"
    trainer_args = (f"--config.data.max_files=6 --config.data.data_dir={tmp_path / 'tfds'} "
                    "--config.mesh.num_devices=1")
    result = profile.run(_args(tmp_path, "--save", "--save-window", "2", "--saves", "2",
                               "--pinned-host", "on", "--compression", "off", "--python-trace",
                               "--switch-interval", "0.0005",
                               "--out", str(out),
                               f"--trainer-args={trainer_args}"))
    assert result["pinned_host"] is True and result["compression"] is False
    assert result["gc_freeze"] is True and result["packed"] is True  # as main.py's loop
    assert result["switch_interval_s"] == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.005)  # given back
    assert result["step_s"] > 0 and len(result["saves"]) == 2
    for cost in (result["first"], *result["saves"]):
        assert cost["steps"] >= 2 and cost["steps"] % 2 == 0 and 0 < cost["held_s"] < cost["window_s"]
        assert cost["extra_s"] == pytest.approx(cost["window_s"] - cost["steps"] * result["step_s"])
        # the garbage collections meanwhile, by generation (heap.Pauses)
        assert all(g["count"] >= 1 and g["max_s"] <= g["total_s"] for g in cost["gc"].values())
    assert result["extra_s"] == pytest.approx(statistics.median(c["extra_s"]
                                                                for c in result["saves"]))
    threads = result["threads"]
    assert any(r["thread"] == "python" for r in threads)  # the training thread
    # threads that only the save's trace has: the save's and orbax's
    assert any(r["plain_ms_per_step"] == 0 < r["save_ms_per_step"] for r in threads)
    # the windows' own time per step, against which a thread's busy time shows idle
    python = next(r for r in threads if r["thread"] == "python")
    wall = result["traced_wall_ms_per_step"]
    assert wall["plain"] > 0 and wall["save"] > 0
    assert python["save_ms_per_step"] > 0
    # what a full collection would walk at each save: a heap frozen as main.py's loop
    # leaves a few thousand objects outside it at most
    assert all(0 <= c["unfrozen_objects"] < 20_000 for c in (result["first"], *result["saves"]))
    saved = json.loads((out / "summary.json").read_text())
    assert saved["saves"] == result["saves"] and list((out / "traces").rglob("*.json.gz"))
    printed = capsys.readouterr().out
    assert "| later 2 |" in printed and "| process | thread | plain ms/step |" in printed
    assert "heap frozen on" in printed and "| full ones: count, longest ms |" in printed
    assert "thread switch interval 0.5 ms" in printed and "| (wall clock) |" in printed
    assert "arrays (saved packed)" in printed


def test_thread_busy_counts_nested_and_overlapping_events_once():
    from attention_jax.tools.bench import save_window, traces
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}}]
    span = lambda ts, dur, name, tid=7: {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                                         "name": name}
    events = meta + [span(0, 100, "outer"), span(10, 30, "inner"), span(50, 20, "inner"),
                     span(90, 30, "overlap"), span(200, 5, "alone"), span(0, 4, "other", tid=8)]
    busy = traces.thread_busy(events)
    stream = busy[("/device:GPU:0", "Stream #7")]
    assert stream["busy_us"] == 125  # [0, 120) and [200, 205)
    # self time: inner 30 + 20; outer 100 less the 30 + 20 of inner and the 10 of overlap
    # that fall inside it; overlap 30
    assert stream["top"] == ["inner", "outer", "overlap"]
    assert busy[("/device:GPU:0", "8")]["busy_us"] == 4  # an unnamed thread: its id
    rows = save_window.compare_threads({"plain": busy, "save": busy}, {"plain": 1, "save": 5})
    assert rows[0]["save_ms_per_step"] == pytest.approx(0.125 / 5)


def test_a_gpu_stream_is_one_thread_whatever_work_a_trace_saw_on_it():
    """A trace names a GPU stream by the kinds of work it saw ("Stream #14(Memset,Compute)"
    in one, "Stream #14(Compute)" in another): plain and save traces compare one row."""
    from attention_jax.tools.bench import save_window, traces
    def trace(stream_name):
        return [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": 14, "args": {"name": stream_name}},
                {"ph": "X", "pid": 1, "tid": 14, "ts": 0, "dur": 30, "name": "gemm"}]
    busy = {"plain": traces.thread_busy(trace("Stream #14(Compute)")),
            "save": traces.thread_busy(trace("Stream #14(Memset,Compute)"))}
    rows = save_window.compare_threads(busy, {"plain": 1, "save": 1})
    assert [(r["thread"], r["plain_ms_per_step"], r["save_ms_per_step"]) for r in rows] == \
        [("Stream #14", 0.03, 0.03)]

