"""`bench train`'s GPU mode on the CPU at tiny sizes (no timing asserted): the FLOP
formula by hand, the table on fabricated rows, the PyTorch peer's model and step, our
child process's step, and the parent's whole flow with children on the CPU."""

import argparse
import json
import math
import re

import pytest

from attention_jax.models import flops
from attention_jax.tools.bench import train_speed, train_speed_gpu, train_speed_gpu_child


def test_flops_and_mfu_by_hand():
    row = train_speed_gpu.SHAPES["gpt2-124m"].row(16)
    # N = V·D + L·(12D² + 13D) + 2D = 38,633,472 + 12·7,087,872 + 1,536
    assert train_speed_gpu.matmul_params(row) == 123_689_472
    # 6N + 12·L·T·D = 742,136,832 + 113,246,208
    assert flops.flops_per_token(123_689_472, 12, 1024, 768) == 855_383_040
    r = train_speed_gpu.finish_row({**row, "side": "jax", "impl": "cudnn", "step_s": 0.0389},
                                   matmul_rate=800e12)
    tokens_per_s = 16 * 1024 / 0.0389
    assert r["tokens_per_s"] == pytest.approx(tokens_per_s)
    assert r["mfu_peak"] == pytest.approx(855_383_040 * tokens_per_s / 989e12)
    assert round(100 * r["mfu_peak"]) == 36  # the 38.9 ms -> 36%
    assert r["mfu_matmul"] == pytest.approx(855_383_040 * tokens_per_s / 800e12)
    medium = train_speed_gpu.SHAPES["gpt2-medium"].row(8)
    assert (train_speed_gpu.matmul_params(medium)
            == 50304 * 1024 + 24 * (12 * 1024**2 + 13 * 1024) + 2048)


def test_our_param_count_matches_the_formula():
    """N from the formula = our GPT's parameters minus the position table."""
    import flax.linen as nn
    import jax
    import numpy as np
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    from attention_jax.models import gpt
    cfg = gpt.GPTConfig(vocab_size=row["vocab"], max_len=row["seq_len"], num_layers=row["layers"],
                        d_model=row["width"], num_heads=row["heads"])
    params = jax.eval_shape(lambda: nn.meta.unbox(gpt.GPT(cfg).init(
        jax.random.PRNGKey(0), np.zeros((1, row["seq_len"]), np.int32))["params"]))
    assert flops.matmul_params(params) == train_speed_gpu.matmul_params(row)


def test_table_on_fabricated_rows():
    base = train_speed_gpu.SHAPES["gpt2-124m"].row(16)
    rows = [{**base, "side": "torch", "impl": "sdpa + compile", "step_s": 0.040},
            {**base, "side": "jax", "impl": "cudnn", "step_s": 0.032},
            {**base, "side": "jax", "impl": "pallas",
             "error": "XlaRuntimeError: RESOURCE_EXHAUSTED | oom"},
            {**train_speed_gpu.SHAPES["gpt2-medium"].row(8), "side": "jax", "impl": "auto",
             "step_s": 0.1, "attention_used": "pallas"}]
    for r in rows:
        train_speed_gpu.finish_row(r, 800e12)
    text = train_speed_gpu.table(rows, 800e12, "NVIDIA H100 80GB HBM3")
    lines = text.splitlines()
    assert lines[0].startswith("| shape | batch |") and "MFU vs 989 peak" in lines[0]
    assert "| gpt2-124m | 16 | jax / cudnn | 32.0 |" in text and "1.25×" in text
    assert "failed: XlaRuntimeError: RESOURCE_EXHAUSTED / oom" in text  # no stray '|'
    assert all(line.count("|") == 9 for line in lines[:6])
    assert "NVIDIA H100 80GB HBM3" in text and "800 TFLOP/s" in text
    assert "| gpt2-medium | 8 | jax / auto (pallas) | 100.0 |" in text  # no peer: no ratio
    trainer_rows = [{**base, "side": "trainer step", "impl": "auto", "packing": packing,
                     "step_s": 0.034} for packing in ("stream", "documents")]
    text = train_speed_gpu.table([train_speed_gpu.finish_row(r, None) for r in trainer_rows],
                                 None, "x")
    assert "| trainer step / auto, stream packing |" in text
    assert "| trainer step / auto, documents packing |" in text  # each packing named
    no_rate = train_speed_gpu.table([train_speed_gpu.finish_row(
        {**base, "side": "jax", "impl": "auto", "step_s": 0.04}, None)], None, "x")
    assert "not measured" in no_rate


def test_select_rows():
    assert train_speed_gpu.select_rows(True, None) == [("gpt2-124m", 16)]
    assert train_speed_gpu.select_rows(False, None) == [
        ("gpt2-124m", 16), ("gpt2-124m", 32), ("gpt2-medium", 8), ("gpt2-medium", 16),
        ("gpt2-xl", 8), ("gpt2-xl", 16)]
    assert train_speed_gpu.select_rows(False, ["gpt2-medium"]) == [("gpt2-medium", 8),
                                                                  ("gpt2-medium", 16)]
    assert train_speed_gpu.select_rows(False, ["gpt2-124m:32"]) == [("gpt2-124m", 32)]
    with pytest.raises(SystemExit, match="gpt2-small"):
        train_speed_gpu.select_rows(False, ["gpt2-small"])


def test_torch_peer_step_on_cpu_learns():
    torch = pytest.importorskip("torch")
    from attention_jax.tools.bench import torch_gpt
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    step, model, info = torch_gpt.make_step(row, device="cpu", compile=False, lr=3e-3)
    assert info["params"] == train_speed_gpu.matmul_params(row) + row["seq_len"] * row["width"]
    assert model.lm_head.weight is model.token_embedding.weight  # tied
    losses = [float(step()) for _ in range(8)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(row["vocab"]), rel=0.1)  # uniform at init
    assert losses[-1] < losses[0]  # the same batch every step: it memorises
    # Recomputing each block in the backward pass (gpt2-xl's remat) changes nothing computed.
    remat_step, _, _ = torch_gpt.make_step({**row, "remat": "full"}, device="cpu",
                                           compile=False, lr=3e-3)
    again, _, _ = torch_gpt.make_step(row, device="cpu", compile=False, lr=3e-3)
    for _ in range(3):
        assert float(remat_step()) == pytest.approx(float(again()), rel=1e-5)
    with torch.no_grad():  # causal: a later token does not change earlier logits
        x = torch.randint(0, row["vocab"], (1, row["seq_len"]))
        y = x.clone()
        y[0, -1] = (y[0, -1] + 1) % row["vocab"]
        assert torch.allclose(model(x)[0, :-1], model(y)[0, :-1], atol=1e-5)


def test_torch_peer_cli_on_cpu(tmp_path):
    pytest.importorskip("torch")
    from attention_jax.tools.bench import torch_gpt
    out = tmp_path / "peer.json"
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    torch_gpt.main(["--rows", json.dumps([row]), "--out", str(out), "--device", "cpu",
                    "--no-compile", "--warmup", "1", "--repeats", "2", "--steps", "2"])
    (r,) = json.loads(out.read_text())
    assert r["side"] == "torch" and len(r["times"]) == 2 and r["step_s"] > 0
    assert math.isfinite(r["loss"]) and "error" not in r


def test_our_child_step_on_cpu():
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    r = train_speed_gpu_child.measure_ours(row, "blockwise", warmup=1, repeats=2, steps=2,
                                     dtype="float32")
    assert "error" not in r, r.get("error")
    assert len(r["times"]) == 2 and r["step_s"] > 0 and math.isfinite(r["loss"])
    assert r["params"] == train_speed_gpu.matmul_params(row) + row["seq_len"] * row["width"]
    bad = train_speed_gpu_child.measure_ours(row, "no-such-attention", warmup=1, repeats=1, steps=1,
                                       dtype="float32")
    assert "error" in bad and "step_s" not in bad  # recorded, not raised
    # The row's norm_kernel reaches the model (--norm-kernel): the kernels, interpreted
    # here, train the same first step as XLA's ops.
    kernels = train_speed_gpu_child.measure_ours({**row, "norm_kernel": "pallas"}, "blockwise",
                                                 warmup=1, repeats=1, steps=1, dtype="float32")
    assert kernels["impl"] == "blockwise, norm pallas" and "error" not in kernels
    assert r["attention_used"] == "blockwise"
    # On a GPU, auto's choice for GPT-2 small's rows: the kernels reading the packed q, k, v
    from attention_jax.attention import compiling_for
    with compiling_for("gpu"):
        assert train_speed_gpu_child.attention_used(
            train_speed_gpu.SHAPES["gpt2-124m"].row(16), "auto", "bfloat16") == "pallas"
        assert train_speed_gpu_child.attention_used(
            train_speed_gpu.SHAPES["gpt2-124m"].row(16), "cudnn", "bfloat16") == "cudnn"
    assert kernels["first_loss"] == pytest.approx(r["first_loss"], rel=1e-5)


def test_gpu_mode_flow_with_children_on_cpu(tmp_path, capsys, monkeypatch):
    """The parent's whole flow (device query, matmul child, our rows in children, a second
    set with extra XLA flags, the trainer's row from main.py's own metrics, --fit, table,
    JSON), the children running on the CPU at a tiny size; the peer skipped."""
    out = tmp_path / "train_gpu.json"
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    trainer_args = (f"--config.data.max_files=6 --config.data.data_dir={tmp_path / 'tfds'} "
                    "--config.mesh.num_devices=1 --config.train.checkpoint_every=2")
    # A flag the CPU knows, whose effect the child reports: its device count.
    flags = "--xla_force_host_platform_device_count=1"
    args = parser.parse_args(["train", "--device", "gpu", "--no-torch", "--warmup", "1",
                              "--repeats", "1", "--steps", "1", "--matmul-size", "256",
                              "--dtype", "float32", "--trainer-steps", "6",
                              f"--trainer-args={trainer_args}", f"--xla-flags={flags}", "--fit", "--fit-limit-gib", "0.05",
                              "--implementation", "blockwise", "--packing", "stream",
                              "--out", str(out)])
    # train_speed.run dispatches on --device gpu; the device query answers from the CPU here.
    monkeypatch.setattr(train_speed_gpu, "SHAPES", train_speed_gpu.SHAPES_TINY)
    monkeypatch.setattr(train_speed_gpu, "_child_info", lambda timeout: {"device": "cpu (test)"})
    rows = train_speed.run(args)
    assert [(r["side"], r["impl"]) for r in rows] == [
        ("jax", "blockwise"), ("jax", "blockwise xla1"), ("trainer step", "blockwise"),
        ("trainer", "blockwise")]
    assert rows[2]["packing"] == rows[3]["packing"] == "stream"
    assert all("error" not in r and r["mfu_peak"] > 0 and r["mfu_matmul"] > 0 for r in rows)
    assert rows[0]["devices"] == 8 and rows[1]["devices"] == 1  # the flags reached the child
    assert math.isfinite(rows[2]["loss"]) and len(rows[2]["times"]) == 1  # the jitted step alone
    trained = rows[3]
    assert trained["windows"] == 5  # 6 steps logged one by one, the first window left out
    assert trained["step_s"] == pytest.approx(2 * 16 / trained["tokens_per_s_logged"])
    # the host's shares of a window (getting batches, calling the step) are logged
    assert 0 < trained["host_data_frac"] < 1 and 0 < trained["host_dispatch_frac"] < 1
    assert trained["host_data_frac"] + trained["host_dispatch_frac"] <= 1.01
    # Saves at steps 2 and 4 (and 6, the last) fall in the windows to steps 3 and 5: what
    # each held the training thread, and what the window took beyond the median rate.
    assert [c["step"] for c in trained["saves"]] == [3, 5]
    assert all(c["held_s"] > 0 and math.isfinite(c["extra_s"]) and c["gc_s"] >= 0
               for c in trained["saves"])
    printed = capsys.readouterr().out
    assert "| gpt-tiny-gpu | 2 | jax / blockwise |" in printed and "cpu (test)" in printed
    assert "| gpt-tiny-gpu | 2 | trainer / blockwise, stream packing |" in printed
    assert "of our step" in printed
    assert "| gpt-tiny-gpu | 2 | trainer step / blockwise, stream packing |" in printed
    assert "of the trainer step |" in printed
    assert f"xla1: XLA_FLAGS += {flags}" in printed
    assert "largest batch of gpt-tiny-gpu (blockwise, remat none): " in printed
    saved = json.loads(out.read_text())
    assert saved["matmul_flops_per_s"] > 0 and len(saved["rows"]) == 4
    (fit,) = saved["fits"]
    assert fit["largest_batch"] >= 1 and fit["bytes"] <= fit["limit_bytes"] == int(0.05 * 2**30)


def test_packing_option_names_the_valid_values(tmp_path):
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["train", "--device", "gpu", "--packing", "documents,rows",
                              "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match=r"--packing 'documents,rows'; valid: \['documents', "
                                         r"'stream'\]"):
        train_speed_gpu.run(args, info={"device": "cpu (test)"})
    args = parser.parse_args(["train", "--device", "gpu", "--norm-kernel", "xla,cudnn",
                              "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match=r"--norm-kernel 'xla,cudnn'; valid: \['auto', 'xla', "
                                         r"'pallas'\], comma-separated"):
        train_speed_gpu.run(args, info={"device": "cpu (test)"})


def test_largest_batch_is_the_last_that_fits():
    """The search's answer b fits and b + 1 does not, by compiled memory; a limit below
    batch 1 gives 0. (Compile only: nothing runs.)"""
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(1)
    at = lambda b: train_speed_gpu_child.compiled_bytes({**row, "batch": b}, "xla", "float32")
    limit = (at(6) + at(7)) // 2
    fit = train_speed_gpu_child.largest_batch(row, "xla", limit, "float32")
    b = fit["largest_batch"]
    assert at(b) == fit["bytes"] <= limit < at(b + 1)
    assert train_speed_gpu_child.largest_batch(row, "xla", at(1) - 1, "float32")["largest_batch"] == 0


def test_cpu_mode_is_chosen_without_a_gpu_plugin(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert train_speed_gpu.gpu_available() is None


def test_loss_chunk_option(tmp_path):
    """--loss-chunk: the values the parent takes, and a child process's step (run in this
    process) with the chunked loss, starting from the same loss as the whole logits."""
    assert train_speed_gpu.parse_loss_chunks("0, 256") == [0, 256]
    for bad in ("-1", "abc", ""):
        with pytest.raises(SystemExit, match="--loss-chunk .* valid: integers >= 0"):
            train_speed_gpu.parse_loss_chunks(bad)
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    results = []
    for chunk in ("0", "4"):
        out = tmp_path / f"chunk{chunk}.json"
        train_speed_gpu_child.child_main(["jax", "--out", str(out), "--row", json.dumps(row),
                                    "--implementation", "xla", "--dtype", "float32",
                                    "--warmup", "1", "--repeats", "1", "--steps", "1",
                                    "--loss-chunk", chunk])
        results.append(json.loads(out.read_text()))
    whole, chunked = results
    assert "error" not in chunked and chunked["impl"] == "xla loss-chunk 4"
    assert chunked["loss_chunk"] == 4 and whole["impl"] == "xla"
    assert chunked["first_loss"] == pytest.approx(whole["first_loss"], rel=1e-5)


def test_loss_kernel_option(tmp_path):
    """--loss-kernel: the values the parent takes, and a child's step whose row asks for
    the Pallas loss (interpreted here), starting from XLA's loss and labelled so."""
    assert train_speed_gpu.parse_loss_kernels("xla, pallas") == ["xla", "pallas"]
    for bad in ("fused", "", "xla,cuda"):
        with pytest.raises(SystemExit, match=r"--loss-kernel .* valid: \['auto', 'xla', 'pallas'\]"):
            train_speed_gpu.parse_loss_kernels(bad)
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    results = {}
    for kernel in ("xla", "pallas"):
        results[kernel] = train_speed_gpu_child.measure_ours(
            {**row, "loss_kernel": kernel}, "xla", warmup=1, repeats=1, steps=1, dtype="float32")
    assert "error" not in results["pallas"], results["pallas"].get("error")
    assert results["pallas"]["impl"] == "xla, loss pallas" and results["xla"]["impl"] == "xla, loss xla"
    assert results["pallas"]["first_loss"] == pytest.approx(results["xla"]["first_loss"], rel=1e-5)
    assert results["pallas"]["loss_kernel_used"] == "pallas"
    auto = train_speed_gpu_child.measure_ours(row, "xla", warmup=1, repeats=1, steps=1,
                                              dtype="float32")
    assert auto["loss_kernel_used"] == "xla"  # auto on this CPU host


def test_a_failing_trainer_step_row_is_recorded_not_raised(tmp_path):
    """The trainer-step child (the trainer's own step alone) writes a bad configuration's
    error as its row, as the other children do."""
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    out = tmp_path / "row.json"
    train_speed_gpu_child.child_main(["trainer-step", "--row", json.dumps(row), "--implementation",
                                "no-such-attention", "--dtype", "float32", "--out", str(out),
                                "--extra", json.dumps(["--config.mesh.num_devices=1"])])
    got = json.loads(out.read_text())
    assert "step_s" not in got and "no-such-attention" in got["error"]


def test_trainer_row_config_is_the_shipped_gpt2_gpu_with_the_row_set():
    """The trainer rows run configs/gpt2_gpu.py by name, with the row's shape and the
    --config.* arguments of --trainer-args set over it (as main.py would); nothing runs."""
    from attention_jax.tools.bench import trainer
    row = train_speed_gpu.SHAPES_TINY["gpt-tiny-gpu"].row(2)
    cmd = trainer.command(row, "/tmp/run", steps=6, log_every=1, implementation="xla",
                          dtype="float32", extra=("--config.data.packing=stream",))
    assert cmd[1:5] == ["-m", "attention_jax.main", "--config=gpt2_gpu", "--workdir=/tmp/run"]
    assert "--config.train.batch_size=2" in cmd and cmd[-1] == "--config.data.packing=stream"
    config = trainer.experiment_config(row, "xla", "float32", 6,
                                       extra=("--config.data.packing=stream", "--mode=train"))
    assert (config.model.num_layers, config.model.d_model, config.model.vocab_size) == (1, 32, 320)
    assert config.model.implementation == "xla" and config.train.compute_dtype == "float32"
    assert config.train.steps == 6 and config.eval.every == -1
    assert config.data.packing == "stream"


def test_launch_settings_are_a_row_of_their_own(tmp_path, capsys, monkeypatch):
    """--norm-settings (as --pallas-tiles and --loss-settings): our step timed again with
    the kernels' launch given, beside the defaults' row, the same first loss (the kernels
    interpreted here); kernel_settings, which the child compiles within, reaches the
    kernels traced inside and ends with it, and each child says what it compiled with;
    of --norm-kernel xla,pallas only the pallas rows get such a row. A setting the step's
    rows cannot take, or for kernels no row runs, is refused before any child runs."""
    from attention_jax.layers import norm_kernel
    with train_speed_gpu_child.kernel_settings({"norm": {"rows": 2, "program_rows": 4}}):
        assert norm_kernel.launch(32, 32, gpu=False) == {"rows": 2, "program_rows": 4,
                                                        "num_warps": 1}
    assert norm_kernel.launch(32, 32, gpu=False)["rows"] == norm_kernel.ROWS
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    common = ["train", "--device", "gpu", "--no-torch", "--warmup", "1", "--repeats", "1",
              "--steps", "1", "--matmul-size", "64", "--dtype", "float32", "--trainer-steps",
              "0", "--implementation", "xla", "--out", str(tmp_path / "t.json")]
    monkeypatch.setattr(train_speed_gpu, "SHAPES", train_speed_gpu.SHAPES_TINY)
    info = {"device": "cpu (test)"}
    for extra, says in (
            (["--norm-kernel", "xla,pallas", "--norm-settings", "rows=64,program_rows=64"],
             "--norm-settings: the norm kernels cannot take the step's rows: 32 rows per "
             "device, not a multiple of 64"),  # (said, though the xla rows need none)
            (["--norm-settings", "rows=2", "--norm-kernel", "xla"],
             "--norm-settings is for the Pallas kernels, which --norm-kernel xla leaves out"),
            (["--loss-settings", "warps=4", "--loss-chunk", "8"],
             "--loss-settings is for the loss kernels, which --loss-chunk 8 leaves out"),
            (["--pallas-tiles", "fwd=32x32"],  # (--implementation xla, above)
             "which --implementation xla leaves out; valid: --implementation pallas or auto")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            train_speed_gpu.run(parser.parse_args(common + extra), info=info)
    assert not (tmp_path / "t.json").exists()
    args = parser.parse_args(common + ["--norm-kernel", "xla,pallas", "--norm-settings",
                                       "rows=2,program_rows=4,warps=1"])
    rows = train_speed_gpu.run(args, info=info)[1:]  # of xla and pallas norms, the pallas rows
    assert [r["impl"] for r in rows] == [
        "xla, norm pallas", "xla, norm pallas with norm-settings rows=2,program_rows=4,warps=1"]
    assert all("error" not in r for r in rows), rows
    assert rows[0]["launch"] == {} and rows[1]["launch"] == {"norm": "rows=2,program_rows=4,warps=1"}
    # what each child compiled with: the defaults, and the settings given
    assert rows[0]["launch_used"]["norm"] == norm_kernel.launch(32, 32, gpu=False)
    assert rows[1]["launch_used"]["norm"] == {"rows": 2, "program_rows": 4, "num_warps": 1}
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-5)
    printed = capsys.readouterr()
    assert "with norm-settings rows=2,program_rows=4,warps=1 |" in printed.out
    assert ("a row with them beside 1 of our 2 rows, those running their kernels "
            "(--norm-settings is for the Pallas kernels, which --norm-kernel xla leaves out"
            in printed.err)
    # auto's choice is named in a launch row's label as in the defaults' row
    assert (train_speed_gpu._attention_label("auto with pallas-tiles fwd=64x64", None, "pallas")
            == "auto (pallas) with pallas-tiles fwd=64x64")


@pytest.mark.parametrize("given, says", [
    (["--trainer-steps", "1"], r"^error: --trainer-steps=1: the trainer's rows time the logged "
                               r"windows after the first; valid: 0 \(no trainer rows\) or >= 2$"),
    (["--trainer-steps", "12", "--trainer-args=--config.train.chekpoint_every=100"],
     r"^error: --trainer-args='--config\.train\.chekpoint_every=100': --config\.train\."
     r"chekpoint_every: config\.train has no key 'chekpoint_every'"),
    (["--xla-flags=--xla_gpu_bogus=1"], r"^error: --xla-flags=.--xla_gpu_bogus=1.: a child "
                                        r"starting JAX with it failed \(Unknown flag in "
                                        r"XLA_FLAGS: --xla_gpu_bogus=1\)$"),
])
def test_gpu_mode_refuses_bad_options_before_any_row_runs(given, says, tmp_path, monkeypatch):
    """One trainer step (trainer.measure's ValueError), a misspelt --trainer-args key and
    an --xla-flags XLA does not know each failed only after the peer's, the matmul's and
    our rows' minutes of a GPU session: now before any of them."""
    parser = argparse.ArgumentParser()
    train_speed.add_parser(parser.add_subparsers(dest="which"))
    args = parser.parse_args(["train", "--device", "gpu", "--no-torch", "--shapes",
                              "gpt-tiny-gpu:2", "--out", str(tmp_path / "t.json"), *given])
    started = []

    def child(argv, timeout, module="", xla_flags=""):
        started.append(argv[0])
        if argv[0] == "info":  # the flags' check: XLA's own refusal, as a child reports it
            return ({"error": f"Unknown flag in XLA_FLAGS: {xla_flags}"}
                    if "bogus" in xla_flags else {"backend": "gpu"})
        return {"step_s": 1.0}
    monkeypatch.setattr(train_speed_gpu, "_child", child)
    with pytest.raises(SystemExit, match=says):
        train_speed_gpu.run(args, info={"backend": "gpu", "device": "test"},
                            shapes_table=train_speed_gpu.SHAPES_TINY)
    assert set(started) <= {"info"}  # no row, no matmul, no peer
