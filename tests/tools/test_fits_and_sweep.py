"""The lecture-claim analyses (#17): power-law and slope fits on synthetic data with a
known exponent, the compute envelope, the FLOP count (models/flops.py) and the scaling
report on stub runs of a registered task, seed grouping and crossings, the attention-cost
report on a benchmark JSON, and tools/sweep's grid handling."""

import json
import os
import warnings

import numpy as np
import pytest

from attention_jax.tools import fits, sweep


# ---------------------------------------------------------------------------------- fits
def test_power_law_fit_recovers_alpha_and_E_with_honest_errors():
    n = np.geomspace(3e4, 1.5e7, 8)
    rng = np.random.default_rng(0)
    loss = 1.3 + 40.0 * n ** -0.3 + rng.normal(0, 0.003, n.size)
    fit = fits.fit_power_law(n, loss)
    assert fit["alpha"] == pytest.approx(0.3, abs=0.05)
    assert fit["E"] == pytest.approx(1.3, abs=0.05)
    assert fit["A"] == pytest.approx(40.0, rel=0.5)
    # The truth lies within 3 standard errors, and the errors are not absurdly small.
    assert abs(fit["alpha"] - 0.3) < 3 * fit["alpha_stderr"] + 1e-3
    assert 1e-4 < fit["alpha_stderr"] < 0.1
    np.testing.assert_allclose(np.sum(np.square(fit["residuals"])) / n.size, fit["rmse"] ** 2)
    assert fit["rmse"] < 0.006


def test_power_law_fit_is_exact_on_noiseless_data_and_pure_law_matches_kaplan_form():
    n = np.geomspace(1e4, 1e8, 6)
    fit = fits.fit_power_law(n, 0.8 + 5.0 * n ** -0.25)
    assert fit["alpha"] == pytest.approx(0.25, rel=1e-4)
    assert fit["E"] == pytest.approx(0.8, rel=1e-4)
    np.testing.assert_allclose(fit["residuals"], 0, atol=1e-6)
    # No irreducible term: Kaplan's L = (N_c/N)^α_N is a straight line in log-log.
    pure = fits.fit_power_law(n, (8.8e13 / n) ** 0.076)
    assert pure["pure_alpha"] == pytest.approx(0.076, rel=1e-6)
    assert pure["pure_Nc"] == pytest.approx(8.8e13, rel=1e-4)
    assert pure["pure_alpha_stderr"] < 1e-6


def test_slope_fit_recovers_quadratic_and_linear_growth():
    n = np.array([256, 512, 1024, 2048, 4096])
    rng = np.random.default_rng(1)
    quad = fits.fit_slope(n, 3e-9 * n ** 2 * np.exp(rng.normal(0, 0.02, n.size)))
    lin = fits.fit_slope(n, 4096.0 * n)
    assert quad["slope"] == pytest.approx(2.0, abs=0.05) and 0 < quad["stderr"] < 0.05
    assert lin["slope"] == pytest.approx(1.0, abs=1e-9) and lin["prefactor"] == pytest.approx(4096)
    assert fits.fit_slope([1, 2], [3, 12])["slope"] == pytest.approx(2.0)


def test_a_two_point_slope_has_no_standard_error(tmp_path):
    """A line through 2 points has no residual degrees of freedom: its standard error was
    reported as 0 (an exact slope); it is None, null in the JSON and said in the table."""
    two = fits.fit_slope([1, 2], [3, 13])
    assert two["stderr"] is None and two["points"] == 2
    three = fits.fit_slope([1, 2, 4], [3, 13, 40])  # off a line: a positive error
    assert three["stderr"] > 0
    rows = [{"impl": "reference", "n": n, "causal": False, "fwd_s": 1e-9 * n ** 2}
            for n in (512, 1024)]
    rows += [{"impl": "blockwise", "n": n, "causal": False, "fwd_s": 1e-6 * n}
             for n in (512, 1024, 2048)]
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"rows": rows}))
    fits.attention_cost_report(str(path), str(tmp_path / "cost"))
    # Strict JSON (no NaN token): null where undetermined, 0.0 for an exact 3-point line.
    saved = json.loads((tmp_path / "cost.json").read_text(), parse_constant=pytest.fail)
    assert saved["slopes"]["reference"]["fwd_s"]["stderr"] is None
    assert saved["slopes"]["blockwise"]["fwd_s"]["stderr"] == pytest.approx(0.0, abs=1e-12)
    table = (tmp_path / "cost.md").read_text()
    assert "| reference | 2.00 ± undetermined (2 points) (N 512–1024) |" in table
    assert "| blockwise | 1.00 ± 0.00 (N 512–2048) |" in table


def test_fits_reject_bad_input():
    with pytest.raises(ValueError, match="positive"):
        fits.fit_slope([1, 2, 3], [1, 0, 2])
    with pytest.raises(ValueError, match="same length >= 2"):
        fits.fit_slope([1], [1])
    with pytest.raises(ValueError, match="length >= 4"):
        fits.fit_power_law([1, 2, 3], [3, 2, 1])


def test_compute_envelope_is_the_lowest_loss_reached_by_each_compute():
    curves = {"small": ([1.0, 10.0, 100.0], [3.0, 2.0, 1.8]),
              "large": ([10.0, 100.0, 1000.0], [2.5, 1.5, 1.0])}
    c, loss = fits.compute_envelope(curves, points=4)  # grid 1, 10, 100, 1000
    np.testing.assert_allclose(c, [1, 10, 100, 1000])
    np.testing.assert_allclose(loss, [3.0, 2.0, 1.5, 1.0])


def test_non_embedding_params_leave_out_the_tables():
    params = {"token_embedding": {"embedding": np.zeros((256, 8))},
              "position_embedding": {"embedding": np.zeros((64, 8))},
              "decoder": {"layer_0": {"mlp": {"wi": {"kernel": np.zeros((8, 32))}}}},
              "final_norm": {"scale": np.zeros(8)}}
    assert fits.non_embedding_params(params) == 8 * 32 + 8
    # An untied head is a vocabulary matrix as well (it counted 256 * 8 more)
    params["lm_head"] = {"kernel": np.zeros((8, 256))}
    assert fits.non_embedding_params(params) == 8 * 32 + 8


# ------------------------------------------------------------------- FLOPs, scaling report
def test_flops_per_token_is_palms_formula_with_gpt2s_parameter_count():
    """models/flops.py: N counted from a GPT's parameter shapes is GPT-2's closed form
    V·D + L·(12·D² + 13·D) + 2·D (the position table left out), and GPT-2 small at T = 1024
    costs 6·N + 12·L·T·D = 0.86 GFLOP per token (configs/gpt2_gpu.py)."""
    import jax

    from attention_jax.models import flops, gpt
    cfg = gpt.GPTConfig(vocab_size=50304)  # GPT-2 small: L 12, D 768, T 1024
    shapes = jax.eval_shape(gpt.GPT(cfg).init, jax.random.PRNGKey(0),
                            jax.numpy.zeros((1, 8), "int32"))["params"]
    v, d, layers = 50304, 768, 12
    n = flops.matmul_params(shapes)
    assert n == v * d + layers * (12 * d * d + 13 * d) + 2 * d
    per_token = flops.flops_per_token(n, layers, 1024, d)
    assert per_token == 6 * n + 12 * layers * 1024 * d
    assert per_token == pytest.approx(0.855e9, rel=1e-3)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_an_moe_gpt_s_flops_count_the_top_k_experts_a_token_passes_through(
        data_dir, tmp_path, scan_layers):
    """The active-parameter convention: of an MoE layer's E experts a token is routed
    through top_k, so N counts top_k of each expert weight's E slices (the router in
    full); every expert for every token was counted before (2x at E 4, top 2). By hand
    for gpt-tiny-moe (V 256, D 64, L 2, F 128, E 4, top 2, biases, tied head), with the
    layers as one scan (a leading L axis) too; and the gpt task's FLOPs use it."""
    import jax

    from attention_jax import config as config_lib
    from attention_jax.models import flops, gpt
    from attention_jax.tasks import TASKS
    from helpers import shrink
    cfg = gpt.get_config("gpt-tiny-moe", scan_layers=scan_layers)
    shapes = jax.eval_shape(gpt.GPT(cfg).init, jax.random.PRNGKey(0),
                            jax.numpy.zeros((1, 8), "int32"))["params"]
    v, d, layers, f, e, k = 256, 64, 2, 128, 4, 2
    expert = d * f + f + f * d + d  # wi, wi_bias, wo, wo_bias of one expert
    block = (4 * d * d + 4 * d) + 2 * 2 * d + d * e  # attention, two LayerNorms, router
    final_norm = 2 * d
    assert flops.matmul_params(shapes) == v * d + layers * (block + e * expert) + final_norm
    active = v * d + layers * (block + k * expert) + final_norm
    assert flops.matmul_params(shapes, experts_per_token=(k, e)) == active
    assert flops.matmul_params(shapes, experts_per_token=(e, e)) == flops.matmul_params(shapes)
    with pytest.raises(ValueError, match=r"experts_per_token=\(5, 4\); valid: \(top_k, "):
        flops.matmul_params(shapes, experts_per_token=(5, 4))
    if scan_layers:
        return
    config = shrink(config_lib.load("gpt:variant=gpt-tiny-moe", "model.num_heads=2"), data_dir)
    task = TASKS[config.task](config, str(tmp_path))
    c = task.model.config
    shapes = jax.eval_shape(task.init, jax.random.PRNGKey(0))
    n = flops.matmul_params(shapes, experts_per_token=(c.top_k, c.num_experts))
    assert n < flops.matmul_params(shapes)
    assert task.flops_per_unit(shapes) == flops.flops_per_token(n, c.num_layers,
                                                                config.data.seq_len, c.d_model)


def _scaling_task(config, workdir):
    """A registered stand-in for a model-size sweep: params [L, D, D] and a FLOP count."""
    import jax.numpy as jnp

    from attention_jax import tasks
    from attention_jax.models import flops
    layers, width = config.model.num_layers, config.model.d_model
    return tasks.Task(model=None, init=lambda rng: {"w": jnp.zeros((layers, width, width))},
                      loss=None, train_source=None, eval_source=None, unit="tokens", seq_len=16,
                      flops_per_unit=lambda p: flops.flops_per_token(
                          flops.matmul_params(p), layers, 16, width))


def test_scaling_report_counts_compute_with_the_tasks_flops(tmp_path):
    import ml_collections

    from attention_jax import config as config_lib
    from attention_jax import tasks
    tasks.TASKS["scaling_stub"] = _scaling_task
    try:
        dirs = []
        for layers in (1, 2, 4, 8):
            c = config_lib.base_config()
            c.task = "scaling_stub"
            c.model = ml_collections.ConfigDict({"num_layers": layers, "d_model": 16})
            c.train.batch_size, c.train.steps = 4, 20
            n = layers * 16 * 16
            w = tmp_path / f"l{layers}"
            os.makedirs(w)
            (w / "config.json").write_text(c.to_json_best_effort())
            with open(w / "metrics.jsonl", "w") as f:
                for step in (10, 20):
                    loss = 1.0 + 40.0 * n ** -0.5 + 1.0 / step
                    f.write(json.dumps({"step": step, "split": "train", "loss": loss}) + "\n")
                f.write(json.dumps({"step": 20, "split": "eval", "loss": loss}) + "\n")
            dirs.append(str(w))
        result = fits.scaling_report(dirs, str(tmp_path / "report" / "scaling"))
        # Another token budget (a larger batch) fitted as a size point, unsaid: refused.
        other = tmp_path / "l16"
        os.makedirs(other)
        c.model.num_layers, c.train.batch_size = 16, 8
        (other / "config.json").write_text(c.to_json_best_effort())
        (other / "metrics.jsonl").write_text((tmp_path / "l1" / "metrics.jsonl").read_text())
        with pytest.raises(ValueError, match=r"^scaling: the runs differ in train.batch_size"
                                             rf" \(8: {other}; 4: .*l1, .*l2, .*l4 and 1 "
                                             r"more\)"):  # the odd run named, first
            fits.scaling_report([*dirs, str(other)], str(tmp_path / "report" / "mixed"))
        # Two runs: named in the command's terms (was "n and loss need the same length").
        with pytest.raises(ValueError, match=r"to 4 or more runs of different model sizes; got "
                                             r"2 run\(s\) of 2 size\(s\)"):
            fits.scaling_report(dirs[:2], str(tmp_path / "report" / "two"))
    finally:
        del tasks.TASKS["scaling_stub"]
    first = result["runs"][0]
    per_token = 6 * 256 + 12 * 1 * 16 * 16  # 6·N + 12·L·T·D
    assert first["flops_per_unit"] == per_token and first["units"] == 20 * 4 * 16
    assert first["flops"] == [per_token * 4 * 16 * step for step in (10, 20)]
    assert result["fit"]["alpha"] == pytest.approx(0.5, abs=0.05)
    assert "| 1 | 16 | 256 | 1,280 | 4.61e+03 |" in open(tmp_path / "report" / "scaling.md").read()


def test_scaling_report_names_the_tasks_that_count_flops(tmp_path):
    from attention_jax import config as config_lib
    from attention_jax import tasks
    tasks.TASKS["no_flops"] = lambda config, workdir: tasks.Task(
        model=None, init=lambda rng: {"w": np.zeros(3)}, loss=None, train_source=None,
        eval_source=None)
    try:
        c = config_lib.base_config()
        c.task = "no_flops"
        os.makedirs(tmp_path / "run")
        (tmp_path / "run" / "config.json").write_text(c.to_json_best_effort())
        with pytest.raises(ValueError, match=r"task 'no_flops' cannot count its FLOPs .*valid: "
                                             r"\['bert_classify', 'bert_mlm', 'cnn', 'encdec', "
                                             r"'gpt', 'vit'\]"):
            fits.scaling_report([str(tmp_path / "run")], str(tmp_path / "out"))
    finally:
        del tasks.TASKS["no_flops"]


# ----------------------------------------------------------------------- seeds, crossings
def test_crossings_are_interpolated_in_log_x():
    assert fits.crossings([0.1, 1.0], [1.0, 3.0], [2.0, 2.0]) == pytest.approx([10 ** -0.5])
    assert fits.crossings([1, 2, 4], [1, 1, 1], [2, 3, 4]) == []
    assert fits.crossings([1, 2], [1, 5], [1, 3]) == [1.0]


def _fake_run(path, point, metric_value, metric="accuracy"):
    os.makedirs(path)
    from attention_jax import config as config_lib
    c = config_lib.base_config()
    c.train.steps, c.train.seed = 10, int(point.get("train.seed", 0))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(c.to_json_best_effort())
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "split": "eval", metric: metric_value}) + "\n")
    with open(os.path.join(path, "sweep.json"), "w") as f:
        json.dump({"point": point}, f)
    return str(path)


def test_seeds_report_groups_means_spreads_and_crossing(tmp_path):
    # cnn beats vit at 10% and loses at 100%: the curves cross in between.
    values = {("cnn", 0.1): [0.80, 0.82, 0.84], ("cnn", 1.0): [0.95, 0.95, 0.95],
              ("vit", 0.1): [0.60, 0.62, 0.64], ("vit", 1.0): [0.97, 0.98, 0.99]}
    dirs = [_fake_run(tmp_path / f"{m}{f}s{s}", {"model": m, "data.train_fraction": str(f),
                                                "train.seed": str(s)}, v)
            for (m, f), vs in values.items() for s, v in enumerate(vs)]
    out = str(tmp_path / "report" / "ib")
    result = fits.seeds_report(dirs, out, by="model", x="train_fraction", metric="accuracy")
    g = {(r["model"], r["train_fraction"]): r for r in result["groups"]}
    assert g[("cnn", 0.1)]["mean"] == pytest.approx(0.82)
    assert g[("cnn", 0.1)]["std"] == pytest.approx(0.02)  # ddof=1 over three seeds
    assert g[("vit", 1.0)]["n"] == 3 and g[("cnn", 1.0)]["std"] == pytest.approx(0, abs=1e-12)
    (cross,) = result["crossings"]["cnn vs vit"]
    # d(x) = cnn − vit: +0.20 at 0.1, −0.03 at 1.0 -> log-linear zero at t = 0.20/0.23.
    assert cross == pytest.approx(10 ** (-1 + 0.20 / 0.23))
    table = open(out + ".md").read()
    assert "| cnn | 0.1 | 3 | 82.0% | 2.0 |" in table and "cross at train_fraction ≈ 0.741" in table
    assert os.path.getsize(out + ".png") > 0


def test_a_run_evaluated_only_by_mode_eval_is_read_from_evals_jsonl(tmp_path):
    """eval.every=-1 and a --mode=eval after: the reports saw no eval record."""
    from attention_jax import workdir as workdir_lib
    run = _fake_run(tmp_path / "a", {"mlp": "relu", "train.seed": "0"}, 0.5)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "split": "train", "loss": 2.0}) + "\n")
    with open(os.path.join(run, "evals.jsonl"), "w") as f:
        for record in ({"step": 10, "accuracy": 0.5, "time": "t0"},
                       {"step": 10, "accuracy": 0.6, "time": "t1"},  # the step's latest
                       {"step": 10, "accuracy": 0.9, "data": {"data.eval_root": "/x"}}):
            f.write(json.dumps(record) + "\n")
    assert [r["accuracy"] for r in workdir_lib.eval_records(run)] == [0.6]  # other data: not it
    result = fits.seeds_report([run], str(tmp_path / "out"), by="mlp", metric="accuracy")
    assert result["groups"][0]["mean"] == pytest.approx(0.6)


def test_seeds_report_names_a_run_without_the_metric(tmp_path):
    run = _fake_run(tmp_path / "a", {"mlp": "relu", "train.seed": "0"}, 1.0, metric="loss")
    with pytest.raises(ValueError, match=r"no eval record with 'accuracy'; valid: a finished "
                                         r"run's eval metrics: \['loss'\]"):
        fits.seeds_report([run], str(tmp_path / "out"), by="mlp", metric="accuracy")
    (tmp_path / "bench.json").write_text("not json")
    with pytest.raises(ValueError, match=r"bench\.json: not the attention benchmark's JSON"):
        fits.attention_cost_report(str(tmp_path / "bench.json"), str(tmp_path / "cost"))
    # Missing, a folder, a run's config.json, a JSON list: the same one line (they were
    # FileNotFoundError, IsADirectoryError, KeyError and TypeError tracebacks).
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "config.json").write_text('{"task": "gpt"}')
    for bad in ("nope.json", ".", "list.json", "config.json"):
        with pytest.raises(ValueError, match=r"not the attention benchmark's JSON \(.*\); "
                                             r"valid: what `bench attention --out FILE` writes"):
            fits.attention_cost_report(str(tmp_path / bad), str(tmp_path / "cost"))


# ---------------------------------------------------------------------- attention's cost
def test_attention_cost_report_fits_quadratic_time_and_memory_slopes(tmp_path):
    rows = []
    for n in (512, 1024, 2048, 4096):
        rows.append({"impl": "reference", "n": n, "causal": False, "fwd_s": 1e-9 * n ** 2,
                     "fwd_bwd_s": 3e-9 * n ** 2, "fwd_temp_bytes": 32 * n ** 2,
                     "fwd_bwd_temp_bytes": 80 * n ** 2})
        rows.append({"impl": "blockwise", "n": n, "causal": False, "fwd_s": 5e-10 * n ** 2,
                     "fwd_bwd_s": 1.5e-9 * n ** 2, "fwd_temp_bytes": 2048 * n,
                     "fwd_bwd_temp_bytes": 8192 * n})
        rows.append({"impl": "torch_sdpa", "n": n, "causal": False, "fwd_s": 7e-10 * n ** 2,
                     "fwd_bwd_s": 2e-9 * n ** 2})
        rows.append({"impl": "reference", "n": n, "causal": True, "fwd_s": 1.0})  # other mask
    rows.append({"impl": "reference", "n": 8192, "causal": False, "skipped": "time",
                 "fwd_temp_bytes": 32 * 8192 ** 2, "fwd_bwd_temp_bytes": 80 * 8192 ** 2})
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"rows": rows}))
    result = fits.attention_cost_report(str(path), str(tmp_path / "cost"))
    s = result["slopes"]
    for impl in ("reference", "blockwise", "torch_sdpa"):
        assert s[impl]["fwd_s"]["slope"] == pytest.approx(2.0)
        assert s[impl]["fwd_bwd_s"]["slope"] == pytest.approx(2.0)
    assert s["reference"]["fwd_temp_bytes"]["slope"] == pytest.approx(2.0)
    assert s["reference"]["fwd_temp_bytes"]["n"][-1] == 8192  # memory of a skipped timing
    assert s["blockwise"]["fwd_bwd_temp_bytes"]["slope"] == pytest.approx(1.0)
    assert "fwd_temp_bytes" not in s["torch_sdpa"]
    assert "| blockwise | 2.00 ± 0.00 (N 512–4096) |" in open(tmp_path / "cost.md").read()
    with pytest.raises(ValueError, match=r"^--mask='packed': .*attention\.json has no rows of "
                                         r"that mask; valid: \['causal', 'full'\]$"):
        fits.attention_cost_report(str(path), str(tmp_path / "c2"), mask="packed")
    with pytest.raises(ValueError, match=r"no rows with mask='full' and N >= 10000"):
        fits.attention_cost_report(str(path), str(tmp_path / "c2"), min_n=10000)


def test_attention_cost_report_with_time_only_draws_no_empty_legend(tmp_path):
    # torch's rows carry no compiled memory: the memory panel is empty, and matplotlib warned
    # "No artists with labels found to put in legend" for it; now it says "not measured".
    rows = [{"impl": "torch_sdpa", "n": n, "causal": False, "fwd_s": 1e-9 * n ** 2}
            for n in (512, 1024, 2048)]
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"rows": rows}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fits.attention_cost_report(str(path), str(tmp_path / "cost"))
    assert result["slopes"]["torch_sdpa"]["fwd_s"]["slope"] == pytest.approx(2.0)
    assert (tmp_path / "cost.png").stat().st_size > 0


# --------------------------------------------------------------------------------- sweep
def test_sweep_grid_points_names_and_typed_overrides():
    grid = sweep.parse_grid(["mlp=relu,gelu", "train.seed=0,1"])
    pts = sweep.points(grid)
    assert pts == [{"mlp": "relu", "train.seed": "0"}, {"mlp": "relu", "train.seed": "1"},
                   {"mlp": "gelu", "train.seed": "0"}, {"mlp": "gelu", "train.seed": "1"}]
    assert sweep.point_name(pts[1]) == "mlprelu-seed1"  # the grid order: first key first
    c = sweep.point_config("inductive_bias",
                           {"model": "vit", "data.train_fraction": "0.25", "train.seed": "2"})
    assert c.task == "vit" and c.data.train_fraction == 0.25 and c.train.seed == 2
    assert isinstance(c.train.seed, int)


def test_sweep_rejects_bad_grids_naming_what_is_valid():
    with pytest.raises(ValueError, match="must be KEY=V1,V2"):
        sweep.parse_grid(["seed"])
    with pytest.raises(ValueError, match="given twice"):
        sweep.parse_grid(["a=1", "a=2"])
    # A grid key's mistake names the --grid (it said --config.train.sed, given nowhere).
    with pytest.raises(ValueError, match=r"^--grid=train\.sed=\.\.\.: config.train has no key "
                                         r"'sed'; valid: \[.*'seed'"):
        sweep.point_config("gated_mlp", {"train.sed": "1"})
    with pytest.raises(ValueError, match="train.seed='x' must be an int"):
        sweep.point_config("gated_mlp", {"train.seed": "x"})
    with pytest.raises(ValueError, match=r"^--config\.train\.sed: config.train has no key"):
        sweep.point_config("gated_mlp", {"train.seed": "1"}, ["train.sed=3"])
    with pytest.raises(ValueError, match=r"--config=gated_mlp:mlp=tanh: :mlp='tanh' is unknown; "
                                         r"valid: \['relu'"):
        sweep.point_config("gated_mlp", {"mlp": "tanh"})
    with pytest.raises(ValueError, match=r"'mlpp' is not an argument of this config"):
        sweep.point_config("gated_mlp", {"mlpp": "relu"})


def test_a_sweep_skips_only_its_own_finished_runs(tmp_path):
    """A finished point was skipped whatever config it was trained with (a changed
    --config argument left the old results standing in for the new ones): another
    config's run stops the sweep before anything trains; its own is skipped."""
    import json

    from attention_jax import workdir as workdir_lib
    from attention_jax.errors import ConfigError
    grid = sweep.parse_grid(["train.seed=0"])
    run = tmp_path / "seed0"
    run.mkdir()
    workdir_lib.write_config(str(run), sweep.point_config("vit_digits:steps=30",
                                                          {"train.seed": "0"}))
    (run / "metrics.jsonl").write_text(json.dumps({"split": "eval", "step": 30}) + "\n")
    with pytest.raises(ConfigError, match=r"^sweep point seed0: .*seed0 holds a finished run "
                                          r"of another config \(model.patch_size: 4 -> 8\); "
                                          r"give this sweep another --workdir, or move that "
                                          r"run away$"):
        sweep.run_sweep("vit_digits:steps=30,patch=8", str(tmp_path), grid)
    (record,) = sweep.run_sweep("vit_digits:steps=30", str(tmp_path), grid)
    assert record["skipped"]
    # Finished without its sweep.json (a signal in its last window stopped the call before
    # it was written): written now, so analysis seeds --by finds the point.
    assert json.loads((run / "sweep.json").read_text())["point"] == {"train.seed": "0"}
    # Unfinished, it stopped the sweep with main's --resume_changed advice (which the sweep
    # does not take) after the points before it had trained: now before any trains.
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / "20").mkdir(parents=True)  # a checkpoint a resume would take
    grid = sweep.parse_grid(["train.seed=1,0"])
    with pytest.raises(ConfigError, match=r"^sweep point seed0: .*seed0 holds an unfinished "
                                          r"run of another config \(model.patch_size: 4 -> 8\)"):
        sweep.run_sweep("vit_digits:steps=30,patch=8", str(tmp_path), grid)
    assert not (tmp_path / "seed1").exists()


def test_a_sweep_of_runs_that_never_evaluate_skips_its_finished_ones(tmp_path):
    """finished() asked for an eval record at the last step, which eval.every=-1 never
    writes: each later call "resumed" the finished run, trained nothing, and overwrote its
    sweep.json with a wall time of seconds and an empty eval."""
    import json

    from attention_jax import workdir as workdir_lib
    grid = sweep.parse_grid(["train.seed=0"])
    run = tmp_path / "seed0"
    run.mkdir()
    workdir_lib.write_config(str(run), sweep.point_config("vit_digits:steps=30",
                                                          {"train.seed": "0"},
                                                          ["eval.every=-1"]))
    (run / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 30}) + "\n")
    (run / "sweep.json").write_text(json.dumps({"wall_s": 81.5}))
    (record,) = sweep.run_sweep("vit_digits:steps=30", str(tmp_path), grid, ["eval.every=-1"])
    assert record["skipped"]
    assert json.loads((run / "sweep.json").read_text()) == {"wall_s": 81.5}
    assert not workdir_lib.finished(str(run), 30)  # one that evaluates needs its final eval
    assert workdir_lib.finished(str(run), 30, evaluates=False)
    assert not workdir_lib.finished(str(run), 40, evaluates=False)


def test_what_a_grid_would_give_twice_or_fold_into_one_folder_is_refused(tmp_path):
    """A grid key --config's :ARG also set ran with the --config value recorded as the
    point's; a value with '/' (vit's variant vit-tiny/4) nested the run a folder deeper."""
    from attention_jax.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--grid=mlp=... varies what "
                                          r"--config=gated_mlp:steps=5,mlp=relu sets"):
        sweep.run_sweep("gated_mlp:steps=5,mlp=relu", "/nonexistent",
                        sweep.parse_grid(["mlp=relu,gelu"]))
    with pytest.raises(ConfigError, match=r"--grid=train.steps=... varies what "
                                          r"--config.train.steps sets"):
        sweep.check_grid("gated_mlp", sweep.parse_grid(["train.steps=5,6"]), ["train.steps=4"])
    assert sweep.point_name({"variant": "vit-tiny/4"}) == "variantvit-tiny_4"
    with pytest.raises(ConfigError, match=r"would share the folder 'variantvit-tiny_4'"):
        sweep.check_grid("vit", sweep.parse_grid(["variant=vit-tiny/4,vit-tiny_4"]), [])
    with pytest.raises(ConfigError, match=r"^--grid gives the point \{'optim\.lr': '1e-3'\} "
                                          r"twice; give each value once$"):
        sweep.check_grid("gpt", sweep.parse_grid(["optim.lr=1e-3,1e-3"]), [])
    # A sweep begun when '/' went into the name as it is: its runs are found, not retrained.
    from attention_jax import workdir as workdir_lib
    earlier = tmp_path / "variantvit-tiny" / "4"
    earlier.mkdir(parents=True)
    workdir_lib.write_config(str(earlier), sweep.point_config("vit", {"variant": "vit-tiny/4"}))
    with pytest.raises(ConfigError, match=r"its run is in .*variantvit-tiny/4, the name an "
                                          r"earlier version gave it; move it to "
                                          r".*variantvit-tiny_4 to resume it"):
        sweep.run_sweep("vit", str(tmp_path), sweep.parse_grid(["variant=vit-tiny/4"]))
    c = sweep.point_config("gated_mlp", {"train.seed": "1"}, ["train.steps=7", "train.seed=0"])
    assert (c.train.steps, c.train.seed) == (7, 1)  # the point's own field wins
    with pytest.raises(ConfigError, match=r"'mlp' is given twice in :mlp=relu,mlp=gelu; give "
                                          r"each argument once"):
        sweep.point_config("gated_mlp:mlp=relu", {"mlp": "gelu"})


def test_a_signal_stops_the_sweep_with_main_s_exit_code(tmp_path):
    """SIGTERM saved the point in training, then the sweep trained the next point and
    exited 0: now it stops there, 143, and says how to resume."""
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "attention_jax.tools.sweep",
                          "--config=vit_digits:steps=100000", f"--workdir={tmp_path}",
                          "--grid=train.seed=0,1", "--config.train.log_every=1"],
                         env=env, cwd=repo, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:  # the first logged step: the loop's handler is in place
        lines.append(line)
        if line.startswith("step "):
            p.send_signal(signal.SIGTERM)
            break
    rest, _ = p.communicate(timeout=300)
    out = "".join(lines) + rest
    assert p.returncode == 143, out[-3000:]
    assert "[sweep] stopped by SIGTERM in " in out and "run the same command again" in out
    assert not (tmp_path / "seed1").exists()
    assert os.listdir(tmp_path / "seed0" / "checkpoints")


def test_a_sweep_checks_every_points_task_before_the_first_trains(tmp_path):
    """A grid value only a task checks (num_heads must divide the width: the family's
    model config) stopped the sweep when its point came, after the points before it had
    trained: now before any point trains, naming the point."""
    import os

    from attention_jax.errors import ConfigError
    grid = sweep.parse_grid(["train.seed=0,1", "model.num_heads=2,3"])
    with pytest.raises(ConfigError, match=r"^sweep point seed0-num_heads3: config.model: "
                                          r"num_heads=3 does not divide the model width"):
        sweep.run_sweep("vit_digits:steps=1", str(tmp_path), grid)
    assert not os.listdir(tmp_path)  # nothing trained, no folder made


def test_seeds_refuses_runs_it_would_mix_unsaid(tmp_path):
    """One run given twice counted as two seeds (std 0.0000); a killed run's last eval
    stood in as its result; runs of another length or a copy of one seed were averaged."""
    from attention_jax import config as config_lib
    a = _fake_run(tmp_path / "a", {"mlp": "relu", "train.seed": "0"}, 1.0, metric="loss")
    b = _fake_run(tmp_path / "b", {"mlp": "relu", "train.seed": "1"}, 1.2, metric="loss")
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=rf"^seeds: {a} is given twice \(also as {a}\)"):
        fits.seeds_report([a, b, a], out, by="mlp")
    copy = _fake_run(tmp_path / "copy", {"mlp": "relu", "train.seed": "1"}, 1.2, metric="loss")
    with pytest.raises(ValueError, match=r"share mlp='relu' and train.seed=1; valid: one run per "
                                         r"seed in a group"):
        fits.seeds_report([a, b, copy], out, by="mlp")
    longer = _fake_run(tmp_path / "longer", {"mlp": "relu", "train.seed": "2"}, 0.9, metric="loss")
    c = config_lib.base_config()
    c.train.steps, c.train.seed = 10000, 2
    (tmp_path / "longer" / "config.json").write_text(c.to_json_best_effort())
    with pytest.raises(ValueError, match=r"longer was last evaluated at step 10 of its "
                                         r"train.steps=10000; valid: finished runs"):
        fits.seeds_report([a, b, longer], out, by="mlp")
    # Killed in its final evaluation: trained every step, but its result is step 10's.
    (tmp_path / "longer" / "metrics.jsonl").write_text(
        json.dumps({"step": 10, "split": "eval", "loss": 0.9}) + "\n"
        + json.dumps({"step": 10000, "split": "train", "loss": 0.9}) + "\n")
    with pytest.raises(ValueError, match=r"longer was last evaluated at step 10 of its"):
        fits.seeds_report([a, b, longer], out, by="mlp")
    (tmp_path / "longer" / "metrics.jsonl").write_text(
        json.dumps({"step": 10000, "split": "eval", "loss": 0.9}) + "\n")
    with pytest.raises(ValueError, match=r"^seeds \(mlp=relu\): the runs differ in train.steps"):
        fits.seeds_report([a, b, longer], out, by="mlp")
    # Groups may differ in what they compare: a CNN's task against a ViT's
    # (inductive_bias: --by=model), each group of one task.
    c = config_lib.base_config()
    c.train.steps, c.train.seed, c.task = 10, 0, "cnn"
    cnn = _fake_run(tmp_path / "cnn", {"mlp": "cnn", "train.seed": "0"}, 0.8, metric="loss")
    (tmp_path / "cnn" / "config.json").write_text(c.to_json_best_effort())
    assert len(fits.seeds_report([a, b, cnn], out, by="mlp")["groups"]) == 2
    # --by naming a group of settings (a run of the config's own, no sweep.json): a
    # whole config dumped into the table's first column, exit 0.
    with pytest.raises(ValueError, match=r"^--by='optim': .*a: config field 'optim' is a "
                                         r"group of settings, not a value; valid: .*, e.g. "
                                         r"optim\.[a-z_]+"):
        fits.seeds_report([a, b], out, by="optim")
    result = fits.seeds_report([a], out, by="mlp")  # one seed: no spread to show
    assert result["groups"][0]["std"] is None and "| relu | 1 | 1.0000 | – |" in open(out + ".md").read()


def test_seeds_table_has_each_seed_and_the_paired_difference_to_a_baseline(tmp_path):
    """The README's gated-MLP table had a per-seed column and a paired difference to
    ReLU that the tool did not write; now it does (--baseline)."""
    values = {"relu": [1.8723, 1.6042, 1.7046], "swiglu": [1.4926, 1.5271, 1.3908]}
    dirs = [_fake_run(tmp_path / f"{m}{s}", {"mlp": m, "train.seed": str(s)}, v, metric="loss")
            for m, vs in values.items() for s, v in enumerate(vs)]
    out = str(tmp_path / "g")
    result = fits.seeds_report(dirs, out, by="mlp", baseline="relu")
    d = np.subtract(values["swiglu"], values["relu"])
    swiglu = next(r for r in result["groups"] if r["mlp"] == "swiglu")
    assert swiglu["paired"]["mean"] == pytest.approx(d.mean())
    assert swiglu["paired"]["std"] == pytest.approx(d.std(ddof=1))
    table = open(out + ".md").read()
    assert "| per seed (0 / 1 / 2) | paired difference to relu, mean ± std |" in table
    assert "| 1.4926 / 1.5271 / 1.3908 | -0.2569 ± 0.1591 |" in table
    assert "| 1.8723 / 1.6042 / 1.7046 | – |" in table
    with pytest.raises(ValueError, match=r"--baseline='tanh' is no value of mlp; valid: "
                                         r"\['relu', 'swiglu'\]"):
        fits.seeds_report(dirs, out, by="mlp", baseline="tanh")
    with pytest.raises(ValueError, match=r"has seeds \[0, 1\], the baseline \[0, 1, 2\]"):
        fits.seeds_report(dirs[:-1], out, by="mlp", baseline="relu")


def test_a_sweep_says_each_note_once_under_the_points_it_is_of(tmp_path, capsys):
    """A point's task is built twice, checked before the first point trains and again by
    its training: its notes came twice a point. Now the check says them as they come,
    under a line naming the points it checks (those differing only in the seed share
    one), and training does not again; what only training says (the warmup warning) is
    said by each point's."""
    records = sweep.run_sweep(
        "vit_digits:steps=2", str(tmp_path), sweep.parse_grid(["train.seed=0,1"]),
        ["data.flip=true", "eval.every=-1", "optim.warmup_steps=5", "mesh.num_devices=1"])
    assert [r["point"] for r in records] == [{"train.seed": "0"}, {"train.seed": "1"}]
    said = capsys.readouterr()
    err = said.err
    assert err.count("note: config.data.augment=False") == 1, err
    assert ("[sweep] checking seed0 (for seed1 too: they differ in the seed)\n"
            "note: config.data.augment=False: ") in err, err
    both = said.out + said.err
    assert both.count("warning: config.optim.warmup_steps=5 is longer than the run") == 2, both


def test_a_sweep_checks_every_points_config_against_the_devices_before_the_first_trains(tmp_path):
    """run_sweep validated each point without the devices or the registered tasks: a grid
    batch size the 8 devices do not divide stopped the sweep when its point came, after
    the points before it had trained, and --config.task=gtp was check_tasks' KeyError
    traceback."""
    import os

    from attention_jax.errors import ConfigError
    grid = sweep.parse_grid(["train.batch_size=16,12"])
    with pytest.raises(ConfigError, match=r"^sweep point batch_size12: config.train.batch_size"
                                          r"=12 must be divisible by optim.grad_accum × "
                                          r"data-parallel size = 1 × 8"):
        sweep.run_sweep("vit_digits:steps=1", str(tmp_path), grid)
    assert not os.listdir(tmp_path)  # nothing trained, no folder made
    with pytest.raises(ConfigError, match=r"^sweep point seed0: config.task='gtp' is unknown; "
                                          r"valid: \[.*'gpt'"):
        sweep.run_sweep("vit_digits:steps=1", str(tmp_path), sweep.parse_grid(["train.seed=0"]),
                        ["task=gtp"])
    with pytest.raises(ConfigError, match=r"^sweep point seed0: config.mesh.num_devices=9: "
                                          r"this run has 8 device"):
        sweep.run_sweep("vit_digits:steps=1", str(tmp_path), sweep.parse_grid(["train.seed=0"]),
                        ["mesh.num_devices=9"])


def test_seeds_orders_numeric_groups_by_number_and_refuses_a_non_numeric_x(tmp_path):
    """--by=num_heads put 16 before 2 and 4 (the values are text: sorted as strings), in
    the table, the plot and the pair of curves whose crossing is computed; an --x of names
    ended in 'could not convert string to float' from the crossing's arithmetic."""
    dirs = [_fake_run(tmp_path / f"h{h}s{s}", {"model.num_heads": str(h), "train.seed": str(s)},
                      1.0 + h / 100 + s / 1000, metric="loss")
            for h in (2, 4, 16) for s in (0, 1)]
    out = str(tmp_path / "heads")
    result = fits.seeds_report(dirs, out, by="num_heads")
    assert [r["num_heads"] for r in result["groups"]] == ["2", "4", "16"]
    rows = [line.split(" | ")[0] for line in open(out + ".md").read().splitlines()[2:]]
    assert rows == ["| 2", "| 4", "| 16"]
    named = [_fake_run(tmp_path / f"{m}{k}", {"mlp": m, "kind": k, "train.seed": "0"}, 1.0,
                       metric="loss") for m in ("relu", "gelu") for k in ("a", "b")]
    with pytest.raises(ValueError, match=r"^--x='kind': .* has kind='a', not a number; valid: "
                                         r"a key with numeric values"):
        fits.seeds_report(named, str(tmp_path / "named"), by="mlp", x="kind")


def test_seeds_refuses_a_group_whose_runs_differ_in_more_than_the_seed(tmp_path):
    """Two runs of mlp=relu at another learning rate (two sweeps' folders given together)
    were averaged as two seeds of one setting: mean 1.5, std 0.71, said nowhere."""
    from attention_jax import config as config_lib
    a = _fake_run(tmp_path / "a", {"mlp": "relu", "train.seed": "0"}, 1.0, metric="loss")
    b = _fake_run(tmp_path / "b", {"mlp": "relu", "train.seed": "1"}, 2.0, metric="loss")
    c = config_lib.base_config()
    c.train.steps, c.train.seed, c.optim.lr = 10, 1, 0.5
    (tmp_path / "b" / "config.json").write_text(c.to_json_best_effort())
    with pytest.raises(ValueError, match=r"^seeds \(mlp=relu\): .*b and .*a differ in more than "
                                         r"the seed \(optim.lr: 0.5 -> .*\); valid: runs that "
                                         r"differ only in train.seed"):
        fits.seeds_report([a, b], str(tmp_path / "out"), by="mlp")
    # What a resume may change (where the data lives, how often it logged) is no difference.
    c.optim.lr, c.train.log_every = config_lib.base_config().optim.lr, 7
    (tmp_path / "b" / "config.json").write_text(c.to_json_best_effort())
    assert fits.seeds_report([a, b], str(tmp_path / "out"), by="mlp")["groups"][0]["n"] == 2
