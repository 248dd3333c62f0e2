"""Fits for the lectures' quantitative claims, over finished runs and benchmark files.

* fit_slope: the least-squares log-log slope (y ∝ x^slope) with its standard error.
* Scaling laws: L(N) = E + A·N^-α fitted with its uncertainty (fit_power_law) over a
  model-size sweep, and the loss-against-compute envelope (scaling_report).
* Seed sweeps: the mean and spread over seeds of runs grouped by a sweep key, against a
  second key with where the curves cross (seeds_report; runs from tools/sweep.py).
* Attention's cost: log-log slopes of time and memory against N from the attention
  benchmark's JSON (attention_cost_report).

Command line: `python -m attention_jax.tools.analysis scaling|seeds|attention_cost ...`
(analysis.py's CLI).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import ml_collections
import numpy as np

from attention_jax.runs import count_params, resolved_model_fields
from attention_jax import workdir as workdir_lib
from attention_jax.workdir import read_metrics, wall_seconds


# ================================================================================== fits
def fit_slope(x, y) -> dict:
    """Least-squares line through (log x, log y): y ∝ x^slope. Returns slope, its
    standard error (from the fit's covariance) and the prefactor. With two points the
    standard error is None, undetermined: the line passes through both, leaving no
    residual to estimate it from (it was 0, which read as an exact slope). JSON writes
    it as null; `plus_minus` prints it."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"x and y need the same length >= 2; got {len(x)} and {len(y)}")
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("x and y must be positive for a log-log slope")
    lx, ly = np.log(x), np.log(y)
    if len(x) == 2:
        slope = (ly[1] - ly[0]) / (lx[1] - lx[0])
        return {"slope": float(slope), "stderr": None,
                "prefactor": float(np.exp(ly[0] - slope * lx[0])), "points": 2}
    (slope, intercept), cov = np.polyfit(lx, ly, 1, cov="unscaled")
    resid = ly - (slope * lx + intercept)
    scale = float(resid @ resid) / (len(x) - 2)  # 3 points or more here
    return {"slope": float(slope), "stderr": float(np.sqrt(cov[0, 0] * scale)),
            "prefactor": float(np.exp(intercept)), "points": len(x)}


def plus_minus(stderr, digits: int) -> str:
    """"± 0.012" for a standard error, or what a two-point fit's None means."""
    if stderr is None:
        return "± undetermined (2 points)"
    return f"± {stderr:.{digits}f}"


def fit_power_law(n, loss) -> dict:
    """L(N) = E + A·N^(−α) by nonlinear least squares (scipy.optimize.curve_fit), with
    standard errors from its covariance, the residuals, and beside it the pure power law
    L = (N_c/N)^α_N with no irreducible term (Kaplan et al. 2020, eq. 1.1), a straight
    line in log-log whose slope is −α_N.

    The three-parameter fit is done as L = E + exp(a − α·ln N) (A = e^a), which keeps the
    problem well scaled across decades of N; E is bounded to [0, min L] and α to [0, 4].
    With few points E and A trade off (their errors are large and correlated): the
    covariance says so, which is the point of reporting it.
    """
    from scipy.optimize import curve_fit
    n, loss = np.asarray(n, np.float64), np.asarray(loss, np.float64)
    if len(n) != len(loss) or len(n) < 4:
        raise ValueError(f"n and loss need the same length >= 4 for a 3-parameter fit; "
                         f"got {len(n)} and {len(loss)}")
    if np.any(n <= 0):
        raise ValueError("n (parameter counts) must be positive")
    ln = np.log(n)
    model = lambda x, e, a, alpha: e + np.exp(a - alpha * x)

    pure = fit_slope(n, loss)
    best = None
    for e0 in (0.0, 0.5 * loss.min(), 0.9 * loss.min()):  # a few starts; keep the best
        alpha0 = max(1e-3, -fit_slope(n, np.maximum(loss - e0, 1e-9))["slope"])
        a0 = float(np.log(max(loss.max() - e0, 1e-6)) + alpha0 * ln.min())
        try:
            p, cov = curve_fit(model, ln, loss, p0=(e0, a0, alpha0),
                               bounds=([0.0, -np.inf, 0.0], [loss.min(), np.inf, 4.0]),
                               maxfev=20000)
        except RuntimeError:
            continue
        sse = float(np.sum((model(ln, *p) - loss) ** 2))
        if best is None or sse < best[2]:
            best = (p, cov, sse)
    if best is None:
        raise ValueError("the power-law fit did not converge")
    (e, a, alpha), cov, sse = best
    err = np.sqrt(np.clip(np.diag(cov), 0, None)) if np.all(np.isfinite(cov)) else \
        np.full(3, np.inf)
    fitted = model(ln, e, a, alpha)
    return {"E": float(e), "E_stderr": float(err[0]), "A": float(np.exp(a)),
            "log_A_stderr": float(err[1]), "alpha": float(alpha), "alpha_stderr": float(err[2]),
            "residuals": (loss - fitted).tolist(), "rmse": float(np.sqrt(sse / len(n))),
            "pure_alpha": -pure["slope"], "pure_alpha_stderr": pure["stderr"],
            "pure_Nc": float(pure["prefactor"] ** (1 / -pure["slope"])) if pure["slope"] < 0
            else float("inf"),
            "pure_residuals": (np.log(loss)
                               - np.log(pure["prefactor"] * n ** pure["slope"])).tolist()}


# ========================================================================== scaling laws
def non_embedding_params(params) -> int:
    """Parameters outside the vocabulary and position tables (Kaplan's N; norms
    included): the token and position embeddings, and an untied output head (`lm_head`,
    GPTConfig.tie_embeddings=False), which is a vocabulary matrix too; Kaplan et al.
    2020's N leaves out "all vocabulary and positional embeddings"."""
    import flax
    flat = flax.traverse_util.flatten_dict(params)
    return int(sum(np.size(v) for k, v in flat.items()
                   if not any("embedding" in part or part == "lm_head" for part in k)))


def _smooth(values, width: int = 5):
    """Trailing moving average: a logged training loss is one noisy batch each."""
    values = np.asarray(values, np.float64)
    return np.array([values[max(0, i - width + 1):i + 1].mean() for i in range(len(values))])


def compute_envelope(curves: dict[str, tuple], points: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """The compute-efficient frontier: at each C of a log grid, the lowest loss any run
    had reached by C. curves: name -> (C [k], loss [k]) sorted by C."""
    lo = min(c[0][0] for c in curves.values())
    hi = max(c[0][-1] for c in curves.values())
    grid = np.geomspace(lo, hi, points)
    best = np.full(points, np.inf)
    for flops, loss in curves.values():
        flops, loss = np.asarray(flops), np.asarray(loss)
        for j, g in enumerate(grid):
            seen = loss[flops <= g * (1 + 1e-9)]
            if len(seen):
                best[j] = min(best[j], seen.min())
    keep = np.isfinite(best)
    return grid[keep], best[keep]


def units_per_step(task, config) -> int:
    """Units of `task.unit` in a training step: the batch's examples, or its tokens
    (batch × the task's fixed seq_len)."""
    if task.unit == "tokens":
        if not task.seq_len:
            raise ValueError(f"task {config.task!r} counts tokens but has no fixed seq_len: "
                             f"its compute per step is not known from the config")
        return config.train.batch_size * task.seq_len
    return config.train.batch_size


def scaling_report(workdirs: Sequence[str], out: str) -> dict:
    """L(N) at the end of each run, fitted (fit_power_law) on Kaplan's non-embedding N,
    and the training loss against compute C for each run with the envelope: C = the
    task's model FLOPs per unit (Task.flops_per_unit: 6·N + 12·L·T·D per token, the PaLM
    convention of models/flops.py, N with the output head) × units trained. Writes out.json,
    out.md and out.png (loss vs N with the fit and its residuals; loss vs C)."""
    import flax.linen as nn
    import jax
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from attention_jax import tasks
    from attention_jax.runs import check_comparable, load_config
    runs = []
    for w in workdirs:
        config = load_config(w)
        task = tasks.TASKS[config.task](config, w)
        per_unit = tasks.need(task, "flops_per_unit", config.task, "count its FLOPs")
        # Shapes only: counting needs no parameters computed and no checkpoint.
        shapes = nn.meta.unbox(jax.eval_shape(task.init, jax.random.PRNGKey(0)))
        n = non_embedding_params(shapes)
        evals = workdir_lib.eval_records(w)
        trains = [r for r in read_metrics(w) if r["split"] == "train" and "loss" in r]
        if not evals or not trains:
            missing = "eval" if trains else "train"
            raise ValueError(f"{w}: no {missing} records (metrics.jsonl" + (
                ", evals.jsonl); is the run finished, or evaluated (--mode=eval)?"
                if missing == "eval" else "); is it a run that trained?"))
        units = units_per_step(task, config)
        steps = np.array([r["step"] for r in trains])
        model = resolved_model_fields(config, task)  # a variant's sizes too
        runs.append({"workdir": w, "layers": model.get("num_layers"),
                     "d_model": model.get("d_model"), "non_embedding_params": n,
                     "params": count_params(shapes), "steps": int(evals[-1]["step"]),
                     "unit": task.unit, "units": int(evals[-1]["step"] * units),
                     "flops_per_unit": float(per_unit(shapes)),
                     "eval_loss": float(evals[-1]["loss"]), "lr": config.optim.lr,
                     "flops": (per_unit(shapes) * units * steps).tolist(),
                     "train_loss": _smooth([r["loss"] for r in trains]).tolist(),
                     "wall_s": wall_seconds(w)})
    # One token budget and data, each run once and finished: a fit over runs of another
    # budget or task, or one counted twice, is no L(N).
    check_comparable(workdirs, "scaling", same=("task", "data.name", "train.steps",
                                                "train.batch_size", "data.seq_len"))
    runs.sort(key=lambda r: r["non_embedding_params"])
    if len(runs) < 4:  # said in the command's terms, not the fit's arguments'
        sizes = len({r["non_embedding_params"] for r in runs})
        raise ValueError(f"scaling fits L(N) = E + A·N^-α (3 parameters) to 4 or more runs of "
                         f"different model sizes; got {len(runs)} run(s) of {sizes} size(s) "
                         f"(a model-size sweep: configs/scaling.py)")
    n = np.array([r["non_embedding_params"] for r in runs], np.float64)
    loss = np.array([r["eval_loss"] for r in runs])
    fit = fit_power_law(n, loss)
    curves = {r["workdir"]: (r["flops"], r["train_loss"]) for r in runs}
    env_c, env_loss = compute_envelope(curves)
    # The frontier's power law in C, over its second half (the first is warm-up).
    half = len(env_c) // 2
    env_fit = fit_slope(env_c[half:], env_loss[half:])
    result = {"runs": runs, "fit": fit, "envelope": {"flops": env_c.tolist(),
                                                     "loss": env_loss.tolist(),
                                                     "alpha_C": -env_fit["slope"],
                                                     "alpha_C_stderr": env_fit["stderr"]}}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(scaling_table(result))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.loglog(n, loss, "o", color="C0", label="runs (validation loss)")
    grid = np.geomspace(n.min() / 1.5, n.max() * 1.5, 100)
    ax.loglog(grid, fit["E"] + fit["A"] * grid ** -fit["alpha"], color="C1",
              label=f"E + A·N^-α: α = {fit['alpha']:.3f} ± {fit['alpha_stderr']:.3f}, "
                    f"E = {fit['E']:.2f}")
    ax.loglog(grid, (fit["pure_Nc"] / grid) ** fit["pure_alpha"], "--", color="C2",
              label=f"(N_c/N)^α_N: α_N = {fit['pure_alpha']:.3f} "
                    f"{plus_minus(fit['pure_alpha_stderr'], 3)}")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel(f"validation loss (nats per {runs[0]['unit'][:-1]})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax = axes[1]
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.plot(n, fit["residuals"], "o-", color="C1", label="E + A·N^-α (nats)")
    ax.plot(n, fit["pure_residuals"], "s--", color="C2", label="pure power law (log loss)")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("residual (measured − fit)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[2]
    for i, r in enumerate(runs):
        ax.loglog(r["flops"], r["train_loss"], color=plt.cm.viridis(i / max(1, len(runs) - 1)),
                  label=f"L={r['layers']}, N={r['non_embedding_params'] / 1e6:.2g}M")
    ax.loglog(env_c, env_loss, "k--", linewidth=2,
              label=f"envelope (upper half: α_C = {-env_fit['slope']:.3f})")
    ax.set_xlabel("training compute C (model FLOPs: 6·N + 12·L·T·D per token)")
    ax.set_ylabel("training loss (5-record moving average)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    plt.close(fig)
    return result


def scaling_table(result: dict) -> str:
    fit = result["fit"]
    unit = result["runs"][0]["unit"]
    lines = [f"| layers | width | non-embedding N | {unit} | FLOPs per {unit[:-1]} | peak lr | "
             "validation loss | residual (E + A·N^-α) | wall time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, res in zip(result["runs"], fit["residuals"]):
        lines.append(f"| {r['layers']} | {r['d_model']} | {r['non_embedding_params']:,} | "
                     f"{r['units']:,} | {r['flops_per_unit']:.3g} | {r['lr']:.2e} | "
                     f"{r['eval_loss']:.4f} | {res:+.4f} | {r['wall_s']:.0f} s |")
    lines.append("")
    lines.append(f"Fit L(N) = E + A·N^-α: α = {fit['alpha']:.3f} ± {fit['alpha_stderr']:.3f}, "
                 f"E = {fit['E']:.3f} ± {fit['E_stderr']:.3f}, A = {fit['A']:.3g} "
                 f"(ln A ± {fit['log_A_stderr']:.2f}); RMS residual {fit['rmse']:.4f} nats.")
    lines.append(f"Pure power law L = (N_c/N)^α_N: α_N = {fit['pure_alpha']:.4f} "
                 f"{plus_minus(fit['pure_alpha_stderr'], 4)}, N_c = {fit['pure_Nc']:.3g}.")
    env = result["envelope"]
    lines.append(f"Compute envelope (upper half of C): L ∝ C^-α_C with α_C = "
                 f"{env['alpha_C']:.3f} {plus_minus(env['alpha_C_stderr'], 3)}.")
    return "\n".join(lines) + "\n"


# ============================================================================ seed sweeps
def _point_value(workdir: str, key: str, flag: str = ""):
    """A run's value of `key`: its sweep point (tools/sweep.py's sweep.json; `key` may be
    the last part of a dotted grid key) or else the dotted field of its config.json.
    flag: the option that named the key, for the error."""
    path = workdir_lib.epath_of(workdir, "sweep.json")  # a local path or gs:// / s3://
    if path.exists():
        point = json.loads(path.read_text())["point"]
        for k, v in point.items():
            if k == key or k.rsplit(".", 1)[-1] == key:
                return v
    from attention_jax.runs import load_config
    named = f"{flag}={key!r}: " if flag else ""  # the errors' start
    node = load_config(workdir)
    for part in key.split("."):
        if part not in node:
            raise ValueError(f"{named}{workdir}: no sweep point or config field {key!r}")
        node = node[part]
    if isinstance(node, (dict, ml_collections.ConfigDict)):  # a group, not a value
        fields = ", ".join(f"{key}.{k}" for k in sorted(node)[:5])
        raise ValueError(f"{named}{workdir}: config field {key!r} is a group of settings, "
                         f"not a value; valid: a key of the runs' sweep (sweep.json) or a field "
                         f"with a value, e.g. {fields}")
    return node


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def _order(v) -> tuple:
    """A sort key that puts numbers in numeric order ('2' before '16'), then text."""
    n = _number(v)
    return (0, n, "") if isinstance(n, float) else (1, 0.0, str(v))


def crossings(xs, a, b) -> list[float]:
    """Where the curves a(x) and b(x) cross, linear in log x between measured points
    (an x where they are equal counts once)."""
    xs, d = np.asarray(xs, np.float64), np.asarray(a, np.float64) - np.asarray(b, np.float64)
    out = []
    for i in range(len(xs) - 1):
        if d[i] == 0:
            out.append(float(xs[i]))
        elif d[i] * d[i + 1] < 0:
            t = d[i] / (d[i] - d[i + 1])
            out.append(float(np.exp(np.log(xs[i]) + t * (np.log(xs[i + 1]) - np.log(xs[i])))))
    if len(d) and d[-1] == 0:
        out.append(float(xs[-1]))
    return out


def seeds_report(workdirs: Sequence[str], out: str, by: str, x: str = "",
                 metric: str = "loss", baseline: str = "") -> dict:
    """Final eval `metric` of runs that differ in `by` (and `x`) and in their seed: mean,
    standard deviation (ddof=1), range and each seed's value of each group; with
    `baseline` (a value of `by`), each group's difference to it seed by seed (mean ± std
    of the paired differences: the seed's share of the spread cancels); with `x`, the
    mean ± std against x for each `by` value and where the first two curves cross.
    Writes out.json, out.md and out.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attention_jax.runs import check_comparable
    check_comparable(workdirs, "seeds")  # each run once, finished
    groups: dict[tuple, list] = {}
    for w in workdirs:
        records = workdir_lib.eval_records(w)
        evals = [r for r in records if metric in r]
        if not evals:
            named = sorted({k for r in records for k in r} - {"split", "step"})
            raise ValueError(f"{w}: no eval record with {metric!r}; valid: a finished run's "
                             f"eval metrics{': ' + str(named) if named else ''}")
        xv = _number(_point_value(w, x, "--x")) if x else None
        if x and not isinstance(xv, float):  # the curves, crossings and log axis need numbers
            raise ValueError(f"--x={x!r}: {w} has {x}={xv!r}, not a number; valid: a key "
                             f"with numeric values (e.g. train_fraction), or --by for a "
                             f"key of names")
        key = (str(_point_value(w, by, "--by")), xv)
        groups.setdefault(key, []).append({"workdir": w, "value": float(evals[-1][metric]),
                                           "seed": int(_point_value(w, "train.seed")),
                                           "wall_s": wall_seconds(w)})
    rows = []
    for (name, xv), runs in groups.items():
        # Within a group only the seed may differ in what counts (the groups themselves
        # differ in `by` and `x`: a CNN against a ViT, a step count against another).
        check_comparable([r["workdir"] for r in runs], f"seeds ({by}={name})",
                         same=("task", "train.steps"), finished=False)
        _check_seeds_only(runs, f"seeds ({by}={name})")
        seeds = [r["seed"] for r in runs]
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        if twice:  # two copies of one run would count as two seeds
            same = [r["workdir"] for r in runs if r["seed"] == twice[0]]
            raise ValueError(f"seeds: {', '.join(same)} share {by}={name!r} and "
                             f"train.seed={twice[0]}; valid: one run per seed in a group")
        runs.sort(key=lambda r: r["seed"])
        v = np.array([r["value"] for r in runs])
        rows.append({by: name, **({x: xv} if x else {}), "n": len(v), "mean": float(v.mean()),
                     "std": float(v.std(ddof=1)) if len(v) > 1 else None,
                     "min": float(v.min()), "max": float(v.max()),
                     "wall_s": float(np.mean([r["wall_s"] for r in runs])), "runs": runs})
    rows.sort(key=lambda r: (_order(r[by]), _order(r.get(x, 0))))  # 2 before 16
    if baseline:
        _paired_differences(rows, by, x, baseline)
    result = {"by": by, "x": x, "metric": metric, "baseline": baseline, "groups": rows}
    names = list(dict.fromkeys(r[by] for r in rows))
    if x and len(names) >= 2:
        curve = lambda name: sorted((r[x], r["mean"]) for r in rows if r[by] == name)
        (xa, ya), (xb, yb) = (list(zip(*curve(names[0]))), list(zip(*curve(names[1]))))
        if xa == xb:
            result["crossings"] = {f"{names[0]} vs {names[1]}": crossings(xa, ya, yb)}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(seeds_table(result))
    scale = 100.0 if metric == "accuracy" else 1.0
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, name in enumerate(names):
        mine = [r for r in rows if r[by] == name]
        if x:
            xs = [r[x] for r in mine]
            ax.errorbar(xs, [scale * r["mean"] for r in mine],
                        [scale * (r["std"] or 0.0) for r in mine],  # None: one seed
                        marker="o", capsize=3, color=f"C{i}", label=f"{name} (mean ± std)")
            for r in mine:
                ax.plot([r[x]] * r["n"], [scale * s["value"] for s in r["runs"]], ".",
                        color=f"C{i}", alpha=0.4)
        else:
            r = mine[0]
            ax.errorbar([i], [scale * r["mean"]], [scale * (r["std"] or 0.0)], marker="o",
                        capsize=4, color=f"C{i}")
            ax.plot([i] * r["n"], [scale * s["value"] for s in r["runs"]], ".", color=f"C{i}",
                    alpha=0.5)
    if x:
        ax.set_xscale("log")
        ax.set_xlabel(x)
        ax.legend()
    else:
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel(by)
    ax.set_ylabel(f"eval {metric}" + (" (%)" if metric == "accuracy" else "") +
                  ", mean ± std over seeds")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)
    return result


def _check_seeds_only(runs: list[dict], report: str) -> None:
    """A ValueError where two runs of one group differ in a training key besides the seed
    (another optim.lr, data, model size): they would be averaged as two seeds of one
    setting. Keys a resume may change (workdir_lib.RESUME_SAFE_KEYS) do not count."""
    from attention_jax.runs import load_config
    first = runs[0]["workdir"]
    config = load_config(first)
    for r in runs[1:]:
        config.train.seed = r["seed"]
        changed = workdir_lib.training_changes(config, r["workdir"])
        if changed:  # (config.json's value -> the first run's)
            raise ValueError(f"{report}: {r['workdir']} and {first} differ in more than the "
                             f"seed ({changed}); valid: runs that differ only in train.seed "
                             f"within a group (--by and --x name what else differs)")


def _paired_differences(rows: list[dict], by: str, x: str, baseline: str) -> None:
    """Adds "paired" (mean, std of value − the baseline group's value, seed by seed, at
    the same x) to each row; the baseline's seeds must be every group's."""
    base = {r.get(x): r for r in rows if r[by] == baseline}
    if not base:
        raise ValueError(f"--baseline={baseline!r} is no value of {by}; valid: "
                         f"{sorted({r[by] for r in rows})}")
    for r in rows:
        ref = base.get(r.get(x))
        mine = {s["seed"]: s["value"] for s in r["runs"]}
        theirs = {s["seed"]: s["value"] for s in ref["runs"]} if ref else {}
        if set(mine) != set(theirs):
            raise ValueError(f"--baseline={baseline!r}: {by}={r[by]!r} has seeds "
                             f"{sorted(mine)}, the baseline {sorted(theirs)}; valid: the same "
                             f"seeds in every group, to pair them")
        d = np.array([mine[seed] - theirs[seed] for seed in sorted(mine)])
        r["paired"] = None if r[by] == baseline else {
            "mean": float(d.mean()), "std": float(d.std(ddof=1)) if len(d) > 1 else None}


def _paired_cell(paired: dict | None) -> str:
    """'−0.2568 ± 0.1591' (a group's paired difference to the baseline), '–' for the
    baseline itself, and '–' for the spread of one seed."""
    if paired is None:
        return "–"
    spread = "–" if paired["std"] is None else f"{paired['std']:.4f}"
    return f"{paired['mean']:+.4f} ± {spread}"


def seeds_table(result: dict) -> str:
    by, x, metric = result["by"], result["x"], result["metric"]
    pct = metric == "accuracy"
    fmt = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.4f}")
    sd = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.4f}")
    base = result.get("baseline")
    seeds = sorted({s["seed"] for r in result["groups"] for s in r["runs"]})
    lines = [f"| {by} | " + (f"{x} | " if x else "") + f"seeds | mean {metric} | std | "
             f"min – max | per seed ({' / '.join(map(str, seeds))}) | "
             + (f"paired difference to {base}, mean ± std | " if base else "")
             + "wall time per run |",
             "|---|" + ("---|" if x else "") + "---|---|---|---|---|" + ("---|" if base else "")
             + "---|"]
    for r in result["groups"]:
        values = {s["seed"]: s["value"] for s in r["runs"]}
        per_seed = " / ".join(fmt(values[s]) if s in values else "–" for s in seeds)
        paired = f"{_paired_cell(r.get('paired'))} | " if base else ""
        lines.append(f"| {r[by]} | " + (f"{r[x]:g} | " if x else "") +
                     f"{r['n']} | {fmt(r['mean'])} | "
                     f"{'–' if r['std'] is None else sd(r['std'])} | "
                     f"{fmt(r['min'])} – {fmt(r['max'])} | {per_seed} | {paired}"
                     f"{r['wall_s']:.0f} s |")
    for pair, xs in result.get("crossings", {}).items():
        lines.append("")
        where = ", ".join(f"{v:.3g}" for v in xs)
        lines.append(f"{pair}: the mean curves cross at {x} ≈ {where}" if xs else
                     f"{pair}: the mean curves do not cross over the measured {x}.")
    return "\n".join(lines) + "\n"


# ==================================================================== attention's cost
def attention_cost_report(bench_json: str, out: str, mask: str = "full", min_n: int = 0) -> dict:
    """Time and compiled temp memory against sequence length from the attention
    benchmark's JSON (`python -m attention_jax.tools.bench attention`, CPU or GPU rows),
    with the log-log slope of each implementation (fit_slope over its measured lengths
    >= min_n): 2 where the N×N scores are computed (time) or stored (memory), 1 where
    only O(N) rows are kept. Writes out.json, out.md and out.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    valid = "valid: what `bench attention --out FILE` writes"
    try:
        with open(bench_json) as f:
            bench = json.load(f)
    except (OSError, ValueError) as e:  # missing, a folder, unreadable, not JSON
        raise ValueError(f"{bench_json}: not the attention benchmark's JSON "
                         f"({getattr(e, 'strerror', None) or e}); {valid}") from None
    rows = bench.get("rows") if isinstance(bench, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "impl" in r for r in rows):
        raise ValueError(f"{bench_json}: not the attention benchmark's JSON (no list of "
                         f"\"rows\" of timed implementations); {valid}")
    def mask_of(r):  # (older files: a "causal" flag, not a "mask")
        return r.get("mask", "causal" if r.get("causal") else "full")
    masks = sorted({mask_of(r) for r in rows})
    if mask not in masks:
        raise ValueError(f"--mask={mask!r}: {bench_json} has no rows of that mask; valid: "
                         f"{masks}")
    series: dict[tuple, list] = {}
    for r in rows:
        n = r.get("n", r.get("T"))
        if mask_of(r) != mask or n is None or n < min_n:
            continue
        for key in ("fwd_s", "fwd_bwd_s", "fwd_temp_bytes", "fwd_bwd_temp_bytes"):
            if r.get(key):  # skipped timings are absent; 0 bytes has no logarithm
                series.setdefault((r["impl"], key), []).append((n, r[key]))
    if not series:
        raise ValueError(f"{bench_json}: no rows with mask={mask!r} and N >= {min_n}")
    slopes = {}
    for (impl, key), pts in sorted(series.items()):
        pts.sort()
        if len(pts) >= 2:
            fit = fit_slope(*zip(*pts))
            slopes.setdefault(impl, {})[key] = {"slope": fit["slope"], "stderr": fit["stderr"],
                                                "n": [p[0] for p in pts],
                                                "values": [p[1] for p in pts]}
    result = {"source": bench_json, "mask": mask, "min_n": min_n, "slopes": slopes}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    keys = ("fwd_s", "fwd_bwd_s", "fwd_temp_bytes", "fwd_bwd_temp_bytes")
    cell = lambda s: "–" if s is None else (f"{s['slope']:.2f} {plus_minus(s['stderr'], 2)} "
                                            f"(N {s['n'][0]}–{s['n'][-1]})")
    lines = ["| implementation | time fwd | time fwd+bwd | temp memory fwd | "
             "temp memory fwd+bwd |", "|---|---|---|---|---|"]
    for impl, fits in slopes.items():
        lines.append(f"| {impl} | " + " | ".join(cell(fits.get(k)) for k in keys) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n\nLog-log slopes (± standard error of the fit; "
                "undetermined over 2 lengths, which the line passes through): "
                "2 = quadratic in N, 1 = linear.\n")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    impls = list(slopes)
    quantities = (("s", "seconds", 1.0), ("temp_bytes", "compiled temp memory (MiB)", 2 ** -20))
    for ax, (prefix, unit, scale) in zip(axes, quantities):
        for i, impl in enumerate(impls):
            for key, style in ((f"fwd_{prefix}", "-"), (f"fwd_bwd_{prefix}", "--")):
                s = slopes[impl].get(key)
                if s:
                    ax.loglog(s["n"], np.array(s["values"]) * scale, style, marker="o",
                              color=f"C{i}", label=f"{impl} {key.split('_' + prefix)[0]}: "
                                                    f"slope {s['slope']:.2f}")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:   # the bench JSON measured none of this quantity: say so on the empty panel
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center")
    axes[0].set_title("time (solid: forward, dashed: forward+backward)")
    axes[1].set_title("memory (solid: forward, dashed: forward+backward)")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    plt.close(fig)
    return result


if __name__ == "__main__":
    # The fits have no command line of their own: point whoever ran this at the one they use.
    import sys
    sys.exit("attention_jax.tools.fits is a library; its command line is "
             "`python -m attention_jax.tools.analysis scaling|seeds|attention_cost --help`")
