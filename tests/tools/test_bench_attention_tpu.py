"""`bench attention`'s TPU mode, chosen on the CPU with the platform given explicitly:
the implementations it times and the shapes (the GPU table's). No kernel runs here."""

from attention_jax.tools.bench import attention_speed_gpu as gpu


def test_tpu_plan_times_splash_beside_the_others_in_the_gpu_shapes():
    for quick in (False, True):
        impls, shapes = gpu.plan("tpu", quick)
        assert impls == ("splash", "blockwise", "xla", "auto")
        assert shapes == gpu.plan("gpu", quick)[1] == gpu.shapes(quick)
    assert gpu.plan("gpu", False)[0] == ("blockwise", "pallas", "cudnn", "xla", "auto")
    full = gpu.shapes(False)
    assert {h for h, _, _ in full} == {64, 128}
    assert {t for _, t, _ in full} == {1024, 4096, 16384}
    assert {m for _, _, m in full} == {"full", "causal", "packed", "docs"}


def test_tpu_table_reports_refusals_and_the_splash_ratio():
    rows = [{"impl": "splash", "H": 64, "T": 1024, "mask": "full", "fwd_s": 1.0, "fwd_bwd_s": 2.0},
            {"impl": "xla", "H": 64, "T": 1024, "mask": "full", "fwd_s": 2.0, "fwd_bwd_s": 6.0},
            {"impl": "blockwise", "H": 64, "T": 1024, "mask": "full", "skipped": "refused"}]
    text = gpu.table(rows, "tpu")
    assert "| splash | blockwise | xla | splash ÷ xla |" in text
    assert "| 2.00 / 3.00 |" in text


def test_width_sets_the_heads_and_the_flop_count():
    """--width 768 with T = 1024 is GPT-2 small's attention: 16 rows of 12 heads of 64,
    and a row's TFLOP/s counts those heads (the default width's rows count 32)."""
    q, k, v, kwargs = gpu._inputs(64, 1024, "docs", 768)
    assert q.shape == k.shape == v.shape == (16, 1024, 12, 64)
    assert kwargs["causal"] and kwargs["segment_ids"].shape == (16, 1024)
    assert gpu.flops(64, 1024, "causal", 768) == 4 * 16 * 12 * 1024 * 1024 * 64 * 0.5
    row = {"impl": "pallas", "H": 64, "T": 1024, "mask": "causal", "width": 768,
           "fwd_s": 1e-4, "fwd_bwd_s": 5e-4}
    assert gpu._rate(row, "fwd_s") == f"{gpu.flops(64, 1024, 'causal', 768) / 1e-4 / 1e12:.0f}" == "258"
    assert gpu._rate({**row, "width": 2048}, "fwd_s") == "687"
