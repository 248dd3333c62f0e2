"""Evaluation beyond the training loss, for the experiments that reproduce the lectures.

* Translation by source length (Bahdanau et al. 2015, Fig. 2): greedy translations of a
  split from a run's checkpoint, exact-match accuracy and BLEU (sacrebleu) per source-
  length bucket, for any number of runs; one JSON, one markdown table, one PNG.
* Run summaries: the final eval metrics, parameter count and wall time of a set of runs
  (a sweep), as a table and a plot.

* Loss by position past the training length (position encodings), and training curves.
* Attention entropy and largest weight of a GPT's rows, at initialisation and trained
  (the softmax-scaling ablation).
* Scaling laws: L(N) = E + A·N^-α fitted with its uncertainty (fit_power_law) over a
  model-size sweep, and the loss-against-compute envelope (scaling_report).
* Seed sweeps: the mean and spread over seeds of runs grouped by a sweep key, against a
  second key with where the curves cross (seeds_report; runs from tools/sweep.py).
* Attention's cost: log-log slopes of time and memory against N from the attention
  benchmark's JSON (fit_slope, attention_cost_report).

Command line (each reads finished run directories, trains nothing):
  python -m attention_jax.tools.analysis translation --out=docs/results/bottleneck \
      rnn-bottleneck=/tmp/bottleneck/rnn-bottleneck rnn-attention=/tmp/... transformer=/tmp/...
  python -m attention_jax.tools.analysis runs --out=docs/results/vit_patches --x=tokens \
      p1=/tmp/vit/p1 p2=/tmp/vit/p2 ...
  python -m attention_jax.tools.analysis attention --out=docs/results/scale_attention \
      scaled-h32=/tmp/abl/scale-scaled-h32 unscaled-h32=/tmp/abl/scale-unscaled-h32 ...
  python -m attention_jax.tools.analysis scaling --out=docs/results/scaling /tmp/scaling/l*
  python -m attention_jax.tools.analysis seeds --out=docs/results/gated_mlp --by=mlp /tmp/gated/*
  python -m attention_jax.tools.analysis attention_cost --out=docs/results/attention_cost \
      bench_results/attention.json

A run directory is what `attention_jax.main` wrote: config.json, metrics.jsonl,
checkpoints/ and (text tasks) tokenizer/. The config is read back from config.json, so
the analysis needs no experiment file and sees the run's overrides.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Sequence

import numpy as np

# Source-length buckets in BPE tokens (the number-translation sources are 1-30 tokens):
# (0, 8], (8, 16], (16, 24], (24, 32].
DEFAULT_EDGES = (0, 8, 16, 24, 32)


# ================================================================================ metrics
def bucket_labels(edges: Sequence[int]) -> list[str]:
    return [f"{lo + 1}-{hi}" for lo, hi in zip(edges[:-1], edges[1:])]


def bucket_index(length: int, edges: Sequence[int]) -> int:
    """Bucket i holds lengths in (edges[i], edges[i+1]]; -1 outside all buckets."""
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        if lo < length <= hi:
            return i
    return -1


def bucketed_translation_metrics(lengths: Sequence[int], hypotheses: Sequence[str],
                                 references: Sequence[str],
                                 edges: Sequence[int] = DEFAULT_EDGES) -> list[dict]:
    """Exact match (%) and corpus BLEU per source-length bucket, plus an 'all' row.

    BLEU is sacrebleu's corpus BLEU over the bucket's sentences (default 13a
    tokenisation), so a bucket's score is comparable with published corpus scores; an
    empty bucket gets n=0 and None for both metrics.
    """
    import sacrebleu
    if not len(lengths) == len(hypotheses) == len(references):
        raise ValueError(f"lengths, hypotheses and references differ in length: "
                         f"{len(lengths)}, {len(hypotheses)}, {len(references)}")
    groups: list[list[int]] = [[] for _ in range(len(edges) - 1)]
    for i, n in enumerate(lengths):
        b = bucket_index(n, edges)
        if b >= 0:
            groups[b].append(i)

    def row(name, idx):
        if not idx:
            return {"bucket": name, "n": 0, "exact_match": None, "bleu": None}
        hyp = [hypotheses[i].strip() for i in idx]
        ref = [references[i].strip() for i in idx]
        exact = 100.0 * np.mean([h == r for h, r in zip(hyp, ref)])
        bleu = sacrebleu.corpus_bleu(hyp, [ref]).score
        return {"bucket": name, "n": len(idx), "exact_match": float(exact), "bleu": float(bleu)}

    rows = [row(name, idx) for name, idx in zip(bucket_labels(edges), groups)]
    rows.append(row("all", [i for g in groups for i in g]))
    return rows


# ============================================================================= restoring
def restore_run(workdir: str, overrides: dict | None = None):
    """(config, task, params on the host) from the run's latest checkpoint (runs.open_run)."""
    import jax

    from attention_jax.runs import open_run
    run = open_run(workdir, overrides)
    return run.config, run.task, jax.device_get(run.params)


def count_params(params) -> int:
    import jax
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))


# ============================================================================ translation
def _greedy_fn(model, max_len: int):
    """A jitted src [B, S] -> tokens [B, max_len] for either translation model family."""
    import jax

    from attention_jax.models import encdec, rnn
    if isinstance(model, rnn.RNNSeq2Seq):
        return jax.jit(lambda params, src: model.apply(
            {"params": params}, src, max_len=max_len, method=model.generate)[0])
    if isinstance(model, encdec.EncoderDecoder):
        return lambda params, src: encdec.greedy_decode(model, params, src, max_len=max_len)
    raise TypeError(f"cannot translate with a {type(model).__name__}; valid: RNNSeq2Seq, "
                    f"EncoderDecoder (config.task rnn_seq2seq or encdec)")


def _until_eos(ids, eos_id: int) -> list[int]:
    ids = [int(t) for t in ids]
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def translate_split(workdir: str, split: str = "test", max_examples: int = 0,
                    batch_size: int = 100) -> list[dict]:
    """Greedy translations of `split` by the run's checkpoint: one dict per example with
    source, reference, hypothesis and source_tokens (the BPE length the model read)."""
    from attention_jax import data
    config, task, params = restore_run(workdir)
    d = config.data
    tok = data.load_tokenizer(os.path.join(workdir, "tokenizer"))
    records = data.get_dataset(d.name, split, d.data_dir or None)
    n = min(len(records), max_examples) if max_examples else len(records)
    text = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
    greedy = _greedy_fn(task.model, d.target_len)
    out = []
    for start in range(0, n, batch_size):
        rows = [records[i] for i in range(start, min(start + batch_size, n))]
        src = np.stack([task.eval_transform(r, None)["inputs"] for r in rows])
        # Pad the last batch to the full size: one compiled shape for the whole split.
        src_full = np.concatenate([src, np.repeat(src[:1], batch_size - len(src), 0)])
        tokens = np.asarray(greedy(params, src_full))[:len(src)]
        for r, s, t in zip(rows, src, tokens):
            out.append({"source": text(r[d.source]), "reference": text(r[d.target]),
                        "hypothesis": tok.decode(_until_eos(t, tok.eos_id)),
                        "source_tokens": int(np.sum(s != tok.pad_id))})
    return out


def translation_report(runs: dict[str, str], out: str, split: str = "test",
                       edges: Sequence[int] = DEFAULT_EDGES, max_examples: int = 0) -> dict:
    """Bucketed exact match and BLEU of each named run; writes out.json, out.md, out.png
    and out_examples.json (a few long-source translations of each run, to read)."""
    results, examples = {}, {}
    for name, workdir in runs.items():
        rows = translate_split(workdir, split, max_examples)
        results[name] = bucketed_translation_metrics(
            [r["source_tokens"] for r in rows], [r["hypothesis"] for r in rows],
            [r["reference"] for r in rows], edges)
        longest = sorted(rows, key=lambda r: -r["source_tokens"])[:3]
        examples[name] = longest
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"split": split, "edges": list(edges), "results": results}, f, indent=1)
    with open(out + "_examples.json", "w") as f:
        json.dump(examples, f, indent=1, ensure_ascii=False)
    with open(out + ".md", "w") as f:
        f.write(translation_table(results))
    plot_translation(results, out + ".png")
    return results


def translation_table(results: dict[str, list[dict]]) -> str:
    """Markdown: one row per bucket, exact match and BLEU of each run side by side."""
    names = list(results)
    head = "| source tokens | n | " + " | ".join(
        f"{n} exact % | {n} BLEU" for n in names) + " |\n"
    sep = "|---|---|" + "---|---|" * len(names) + "\n"
    fmt = lambda v: "–" if v is None else f"{v:.1f}"
    lines = []
    for i, row in enumerate(results[names[0]]):
        cells = [f"{fmt(results[n][i]['exact_match'])} | {fmt(results[n][i]['bleu'])}"
                 for n in names]
        lines.append(f"| {row['bucket']} | {row['n']} | " + " | ".join(cells) + " |\n")
    return head + sep + "".join(lines)


def plot_translation(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # No display on the machines these run on.
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        rows = [r for r in rows if r["bucket"] != "all"]
        labels = [f"{r['bucket']}\n(n={r['n']})" for r in rows]
        x = np.arange(len(rows))
        for ax, key in zip(axes, ("exact_match", "bleu")):
            y = [np.nan if r[key] is None else r[key] for r in rows]
            ax.plot(x, y, marker="o", label=name)
            ax.set_xticks(x, labels)
    for ax, title in zip(axes, ("exact-match accuracy (%)", "BLEU")):
        ax.set_title(title)
        ax.set_xlabel("source length (BPE tokens)")
        # Zoomed to the data (not 0-100): the differences that matter are a few points.
        low = min(v for line in ax.get_lines() for v in line.get_ydata() if np.isfinite(v))
        ax.set_ylim(max(0.0, low - 5), 101)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ========================================================================= classification
def classification_accuracy(workdir: str, split: str = "") -> tuple[float, int]:
    """(accuracy, n) of the run's checkpoint on every image of `split` (default: the
    run's eval split). The trainer's eval drops the last partial batch (359 digits test
    images are 11 batches of 32 and 7 left over); this counts all of them."""
    import jax

    from attention_jax import data
    config, task, params = restore_run(workdir)
    records = data.get_dataset(config.data.name, split or config.data.eval_split,
                               config.data.data_dir or None)
    examples = [task.eval_transform(records[i], None) for i in range(len(records))]
    images = np.stack([e["image"] for e in examples])
    labels = np.array([e["label"] for e in examples])
    logits, _ = jax.jit(lambda p, x: task.model.apply({"params": p}, x))(params, images)
    return float(np.mean(np.asarray(logits).argmax(-1) == labels)), len(labels)


def eval_batches(task, batches: int, batch_size: int):
    """The first `batches` validation batches of a task, unshuffled and transformed as the
    trainer's eval sees them (the same rows for every run of the same data)."""
    from attention_jax.data import loaders
    loader = loaders.Loader(task.eval_source, global_batch_size=batch_size, seed=0,
                            shuffle=False, num_epochs=1, transform=task.eval_transform)
    for i, b in enumerate(loader):
        if i >= batches:
            return
        yield b


# ============================================================================== positions
def position_losses(workdir: str, seq_len: int, batches: int = 8, batch_size: int = 16):
    """Validation next-token loss at each position 0..seq_len-1 (a language-model run
    evaluated on rows of `seq_len`, possibly longer than it was trained on): where a
    position encoding stops generalising, the loss climbs past the training length.
    Returns (mean loss per position [seq_len], tokens counted per position)."""
    import jax

    from attention_jax.models.losses import token_cross_entropy

    config, task, params = restore_run(workdir, {"data.seq_len": seq_len})
    model = task.model

    @jax.jit
    def nll(params, b):  # [B, T] per-token negative log-likelihood.
        logits, _ = model.apply({"params": params}, b["inputs"], positions=b["positions"],
                                segment_ids=b["segment_ids"])
        return token_cross_entropy(logits, b["targets"])

    sums, counts = np.zeros(seq_len), np.zeros(seq_len)
    for b in eval_batches(task, batches, batch_size):
        losses = np.asarray(nll(params, {k: b[k] for k in
                                         ("inputs", "targets", "positions", "segment_ids")}))
        w = np.asarray(b["weights"], bool)
        np.add.at(sums, b["positions"][w], losses[w])
        np.add.at(counts, b["positions"][w], 1)
    if not counts.any():
        raise ValueError(f"{workdir}: the validation split has fewer than batch_size="
                         f"{batch_size} rows of {seq_len} tokens; valid: batch_size <= "
                         f"{len(task.eval_source)}")
    return sums / np.maximum(counts, 1), counts


def positions_report(runs: dict[str, str], out: str, eval_len: int, train_len: int,
                     batches: int = 8, batch_size: int = 16) -> dict:
    """Loss by position of each run at `eval_len` (out.png, out.json) and a table of the
    mean loss inside and beyond the training length (out.md)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, workdir in runs.items():
        loss, counts = position_losses(workdir, eval_len, batches, batch_size)
        inside = float(np.average(loss[:train_len], weights=counts[:train_len]))
        beyond = float(np.average(loss[train_len:], weights=np.maximum(counts[train_len:], 1e-9)))
        results[name] = {"loss_by_position": loss.tolist(), "tokens": counts.tolist(),
                         "within_train_len": inside, "beyond_train_len": beyond}
        # A moving average of 8 positions: single positions are noisy at this batch count.
        smooth = np.convolve(loss, np.ones(8) / 8, mode="valid")
        ax.plot(np.arange(len(smooth)) + 4, smooth, label=name)
    ax.axvline(train_len, color="grey", linestyle=":", label=f"training length {train_len}")
    ax.set_xlabel("position in the row")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)
    with open(out + ".json", "w") as f:
        json.dump({"eval_len": eval_len, "train_len": train_len, "results": results}, f)
    table = (f"| run | loss, positions < {train_len} | loss, positions {train_len}-{eval_len - 1} |\n"
             "|---|---|---|\n" + "".join(
                 f"| {n} | {r['within_train_len']:.3f} | {r['beyond_train_len']:.3f} |\n"
                 for n, r in results.items()))
    with open(out + ".md", "w") as f:
        f.write(table)
    return results


# ============================================================================== attention
@functools.lru_cache(maxsize=None)
def _self_attention_weights_fn(model):
    """One compiled GPT forward per model configuration that returns the self-attention
    weights [L, B, N, T, S] of a packed batch (models are hashable by their config)."""
    import jax

    @jax.jit
    def weights(params, batch):
        _, aux = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                             segment_ids=batch["segment_ids"], return_weights=True)
        return aux["attention_weights"]["self"]
    return weights


def attention_stats(model, params, batch) -> dict[str, float]:
    """Mean entropy (nats) and mean largest weight of the causal attention rows of a GPT
    on a packed batch (inputs, positions, segment_ids [B, T]), over layers, heads and the
    rows of real tokens; `uniform_entropy` is the entropy the same rows would have with
    equal weights on every key they may see (log of the number of such keys).

    A saturated softmax (the lectures' argument for 1/sqrt(H): logits of std sqrt(H)
    make it near one-hot) shows as a largest weight near 1 and entropy near 0.
    """
    batch = {k: batch[k] for k in ("inputs", "positions", "segment_ids")}
    w = np.asarray(_self_attention_weights_fn(model)(params, batch), np.float64)
    seg = np.asarray(batch["segment_ids"])
    t = seg.shape[1]
    visible = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool))  # [B, T, S]
    real = seg != 0  # [B, T] query rows of real tokens (0 is padding)
    entropy = -np.sum(w * np.log(np.where(w > 0, w, 1.0)), -1)  # [L, B, N, T]; 0 log 0 = 0
    rows = np.broadcast_to(real[None, :, None], entropy.shape)
    return {"entropy": float(entropy[rows].mean()),
            "max_weight": float(w.max(-1)[rows].mean()),
            "uniform_entropy": float(np.log(visible.sum(-1))[real].mean())}


def attention_report(runs: dict[str, str], out: str, batches: int = 4,
                     batch_size: int = 16) -> dict:
    """attention_stats of each language-model run at initialisation (its seed) and at
    its latest checkpoint, on the first validation rows; writes out.json and out.md."""
    import flax.linen as nn
    import jax
    results = {}
    for name, workdir in runs.items():
        config, task, trained = restore_run(workdir)
        init = nn.meta.unbox(task.init(jax.random.PRNGKey(config.train.seed)))
        stats = {"init": [], "trained": []}
        for b in eval_batches(task, batches, batch_size):
            for when, params in (("init", init), ("trained", trained)):
                stats[when].append(attention_stats(task.model, params, b))
        if not stats["init"]:
            raise ValueError(f"{workdir}: the validation split has fewer than batch_size="
                             f"{batch_size} rows; valid: batch_size <= {len(task.eval_source)}")
        results[name] = {when: {k: float(np.mean([s[k] for s in v])) for k in v[0]}
                         for when, v in stats.items()}
        results[name]["head_dim"] = config.model.d_model // config.model.num_heads
        results[name]["attention_scale"] = config.model.get("attention_scale")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    uniform = next(iter(results.values()))["init"]["uniform_entropy"]
    table = ("| run | entropy at init | largest weight at init | entropy trained | "
             "largest weight trained |\n|---|---|---|---|---|\n" + "".join(
                 f"| {n} | {r['init']['entropy']:.2f} | {r['init']['max_weight']:.2f} | "
                 f"{r['trained']['entropy']:.2f} | {r['trained']['max_weight']:.2f} |\n"
                 for n, r in results.items())
             + f"\nEntropy in nats, mean over layers, heads and query rows; equal weights "
               f"on every visible key would give {uniform:.2f}.\n")
    with open(out + ".md", "w") as f:
        f.write(table)
    return results


# ================================================================================= curves
def plot_curves(runs: dict[str, str], path: str, metric: str = "loss") -> None:
    """Train (thin) and eval (markers) `metric` against step for each run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, workdir) in enumerate(runs.items()):
        records = read_metrics(workdir)
        for split, style in (("train", dict(linewidth=1, alpha=0.6)),
                             ("eval", dict(marker="o", linestyle="--"))):
            pts = [(r["step"], r[metric]) for r in records if r["split"] == split and metric in r]
            if pts:
                ax.plot(*zip(*pts), color=f"C{i}", label=f"{name} {split}", **style)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# =================================================================================== runs
def read_metrics(workdir: str) -> list[dict]:
    """The records of metrics.jsonl, one per (step, split). The trainer rewrites the file
    on resume (train.drop_records_after); a file written before that, or a repeated
    --mode=eval, can hold a step twice: the later record supersedes the earlier, in the
    earlier one's place."""
    from attention_jax import train
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics (is {workdir} a training run's workdir?)")
    records: dict[tuple, dict] = {}
    for r in train.read_records(path):
        key = (r.get("step"), r.get("split"))
        if key in records and r.get("split") == "train":
            # A resumed run's record: the ones after it were superseded too.
            records = {k: v for k, v in records.items() if k[0] < r.get("step")}
        records[key] = r
    return list(records.values())


def run_summary(workdir: str) -> dict:
    """Final eval metrics, steps, parameter count and wall time of a finished run.

    Wall time is the span from config.json (written before compiling) to the last
    metric record (the final eval): compilation, training and evaluation included, as
    a user waits for it. A resumed run's span includes the pause; start fresh to time.
    """
    import flax.linen as nn
    import jax

    from attention_jax import train
    from attention_jax.runs import load_config
    records = read_metrics(workdir)
    evals = [r for r in records if r["split"] == "eval"]
    trains = [r for r in records if r["split"] == "train"]
    config = load_config(workdir)
    task = train.TASKS[config.task](config, workdir)
    shapes = jax.eval_shape(task.init, jax.random.PRNGKey(0))  # Counts without computing.
    wall = (os.path.getmtime(os.path.join(workdir, "metrics.jsonl"))
            - os.path.getmtime(os.path.join(workdir, "config.json")))
    return {"workdir": workdir, "task": config.task, "step": trains[-1]["step"] if trains else 0,
            "params": count_params(nn.meta.unbox(shapes)), "wall_s": round(wall, 1),
            "eval": {k: v for k, v in (evals[-1] if evals else {}).items()
                     if k not in ("step", "split")},
            "model": config.model.to_dict()}


def runs_report(runs: dict[str, str], out: str, x: str = "", metric: str = "accuracy") -> dict:
    """A table (out.md, out.json) of the named runs and, with `x` (a model field such as
    `patch_size`, or `tokens` for ViT's patch count), a plot (out.png) of the eval
    metric and the wall time against it."""
    rows = {name: run_summary(w) for name, w in runs.items()}
    for r in rows.values():
        m = r["model"]
        if r["task"] == "vit":
            side = m.get("image_size", 8) // m["patch_size"]
            r["tokens"] = side * side + (1 if m.get("pool", "cls") == "cls" else 0)
            # The whole test split, not the trainer's full batches only.
            r["eval"]["accuracy_batches"] = r["eval"].get("accuracy")
            r["eval"]["accuracy"], r["eval"]["n"] = classification_accuracy(r["workdir"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(runs_table(rows, metric))
    if x:
        plot_runs(rows, x, metric, out + ".png")
    return rows


def runs_table(rows: dict[str, dict], metric: str = "accuracy") -> str:
    has_tokens = any("tokens" in r for r in rows.values())
    loss_column = metric != "loss"  # The loss beside another metric; not twice.
    head = ("| run | " + ("tokens | " if has_tokens else "") + f"params | steps | eval {metric} | "
            + ("eval loss | " if loss_column else "") + "wall time |\n")
    sep = "|---|" + ("---|" if has_tokens else "") + "---|---|---|" + \
        ("---|" if loss_column else "") + "---|\n"
    lines = []
    for name, r in rows.items():
        value = r["eval"].get(metric)
        shown = "–" if value is None else (f"{100 * value:.1f}%" if metric == "accuracy"
                                           else f"{value:.4f}")
        loss = r["eval"].get("loss")
        lines.append(f"| {name} | " + (f"{r.get('tokens', '–')} | " if has_tokens else "") +
                     f"{r['params']:,} | {r['step']} | {shown} | " +
                     (f"{'–' if loss is None else f'{loss:.4f}'} | " if loss_column else "") +
                     f"{r['wall_s']:.0f} s |\n")
    return head + sep + "".join(lines)


def plot_runs(rows: dict[str, dict], x: str, metric: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pick = lambda r: r.get(x, r["model"].get(x))
    items = sorted(((pick(r), name, r) for name, r in rows.items()), key=lambda t: t[0])
    xs = [t[0] for t in items]
    fig, ax = plt.subplots(figsize=(6, 4))
    values = [t[2]["eval"].get(metric, np.nan) for t in items]
    values = [100 * v for v in values] if metric == "accuracy" else values
    ax.plot(xs, values, marker="o", color="C0")
    for xv, v, (_, name, _) in zip(xs, values, items):
        ax.annotate(name, (xv, v), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(x)
    ax.set_ylabel(f"eval {metric}" + (" (%)" if metric == "accuracy" else ""), color="C0")
    ax.set_xscale("log", base=2)
    twin = ax.twinx()
    twin.plot(xs, [t[2]["wall_s"] for t in items], marker="s", color="C1", linestyle="--")
    twin.set_ylabel("wall time (s)", color="C1")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================================== fits
def fit_slope(x, y) -> dict:
    """Least-squares line through (log x, log y): y ∝ x^slope. Returns slope, its
    standard error (from the fit's covariance; 0 for two points) and the prefactor."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"x and y need the same length >= 2; got {len(x)} and {len(y)}")
    if np.any(x <= 0) or np.any(y <= 0):
        raise ValueError("x and y must be positive for a log-log slope")
    lx, ly = np.log(x), np.log(y)
    if len(x) == 2:
        slope = (ly[1] - ly[0]) / (lx[1] - lx[0])
        return {"slope": float(slope), "stderr": 0.0,
                "prefactor": float(np.exp(ly[0] - slope * lx[0])), "points": 2}
    (slope, intercept), cov = np.polyfit(lx, ly, 1, cov="unscaled")
    resid = ly - (slope * lx + intercept)
    dof = len(x) - 2
    scale = float(resid @ resid) / dof if dof else 0.0
    return {"slope": float(slope), "stderr": float(np.sqrt(cov[0, 0] * scale)),
            "prefactor": float(np.exp(intercept)), "points": len(x)}


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
    """Parameters outside the token and position tables (Kaplan's N; norms included)."""
    import flax
    flat = flax.traverse_util.flatten_dict(params)
    return int(sum(np.size(v) for k, v in flat.items()
                   if not any("embedding" in part for part in k)))


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


def scaling_report(workdirs: Sequence[str], out: str) -> dict:
    """L(N) at the end of each run, fitted (fit_power_law), and the training loss against
    compute C = 6·N·tokens for each run with the envelope; writes out.json, out.md and
    out.png (loss vs N with the fit and its residuals; loss vs C)."""
    import flax.linen as nn
    import jax
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from attention_jax import data, tasks
    from attention_jax.models import gpt
    from attention_jax.runs import load_config
    runs = []
    for w in workdirs:
        config = load_config(w)
        if config.task != "gpt":
            raise ValueError(f"{w}: task {config.task!r}; the scaling report reads GPT runs "
                             f"(config.task 'gpt')")
        # The model from its config and saved tokenizer: no corpus to load for a count.
        vocab = tasks.padded_vocab(data.load_tokenizer(os.path.join(w, "tokenizer")).vocab_size)
        model = gpt.GPT(tasks.model_config(gpt.GPTConfig, config, vocab_size=vocab))
        shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                              jax.numpy.ones((1, 8), "int32"))["params"])
        n = non_embedding_params(shapes)
        records = read_metrics(w)
        evals = [r for r in records if r["split"] == "eval"]
        trains = [r for r in records if r["split"] == "train" and "loss" in r]
        if not evals or not trains:
            raise ValueError(f"{w}: no eval or train records in metrics.jsonl; is the run "
                             f"finished?")
        tokens_per_step = config.train.batch_size * config.data.seq_len
        steps = np.array([r["step"] for r in trains])
        runs.append({"workdir": w, "layers": config.model.num_layers,
                     "d_model": config.model.d_model, "non_embedding_params": n,
                     "params": count_params(shapes), "steps": int(evals[-1]["step"]),
                     "tokens": int(evals[-1]["step"] * tokens_per_step),
                     "eval_loss": float(evals[-1]["loss"]), "lr": config.optim.lr,
                     "flops": (6.0 * n * tokens_per_step * steps).tolist(),
                     "train_loss": _smooth([r["loss"] for r in trains]).tolist(),
                     "wall_s": run_summary_wall(w)})
    runs.sort(key=lambda r: r["non_embedding_params"])
    n = np.array([r["non_embedding_params"] for r in runs], np.float64)
    loss = np.array([r["eval_loss"] for r in runs])
    fit = fit_power_law(n, loss)
    curves = {f"L{r['layers']}": (r["flops"], r["train_loss"]) for r in runs}
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
              label=f"(N_c/N)^α_N: α_N = {fit['pure_alpha']:.3f} ± "
                    f"{fit['pure_alpha_stderr']:.3f}")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("validation loss (nats/byte)")
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
    ax.set_xlabel("training compute C = 6·N·tokens (FLOPs)")
    ax.set_ylabel("training loss (5-record moving average)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    plt.close(fig)
    return result


def run_summary_wall(workdir: str) -> float:
    """Seconds from config.json to the last metric record (as run_summary measures it)."""
    return round(os.path.getmtime(os.path.join(workdir, "metrics.jsonl"))
                 - os.path.getmtime(os.path.join(workdir, "config.json")), 1)


def scaling_table(result: dict) -> str:
    fit = result["fit"]
    lines = ["| layers | width | non-embedding N | tokens | peak lr | validation loss | "
             "residual (E + A·N^-α) | wall time |", "|---|---|---|---|---|---|---|---|"]
    for r, res in zip(result["runs"], fit["residuals"]):
        lines.append(f"| {r['layers']} | {r['d_model']} | {r['non_embedding_params']:,} | "
                     f"{r['tokens']:,} | {r['lr']:.2e} | {r['eval_loss']:.4f} | {res:+.4f} | "
                     f"{r['wall_s']:.0f} s |")
    lines.append("")
    lines.append(f"Fit L(N) = E + A·N^-α: α = {fit['alpha']:.3f} ± {fit['alpha_stderr']:.3f}, "
                 f"E = {fit['E']:.3f} ± {fit['E_stderr']:.3f}, A = {fit['A']:.3g} "
                 f"(ln A ± {fit['log_A_stderr']:.2f}); RMS residual {fit['rmse']:.4f} nats.")
    lines.append(f"Pure power law L = (N_c/N)^α_N: α_N = {fit['pure_alpha']:.4f} ± "
                 f"{fit['pure_alpha_stderr']:.4f}, N_c = {fit['pure_Nc']:.3g}.")
    env = result["envelope"]
    lines.append(f"Compute envelope (upper half of C): L ∝ C^-α_C with α_C = "
                 f"{env['alpha_C']:.3f} ± {env['alpha_C_stderr']:.3f}.")
    return "\n".join(lines) + "\n"


# ============================================================================ seed sweeps
def _point_value(workdir: str, key: str):
    """A run's value of `key`: its sweep point (tools/sweep.py's sweep.json; `key` may be
    the last part of a dotted grid key) or else the dotted field of its config.json."""
    path = os.path.join(workdir, "sweep.json")
    if os.path.exists(path):
        with open(path) as f:
            point = json.load(f)["point"]
        for k, v in point.items():
            if k == key or k.rsplit(".", 1)[-1] == key:
                return v
    from attention_jax.runs import load_config
    node = load_config(workdir)
    for part in key.split("."):
        if part not in node:
            raise ValueError(f"{workdir}: no sweep point or config field {key!r}")
        node = node[part]
    return node


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


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
                 metric: str = "loss") -> dict:
    """Final eval `metric` of runs that differ in `by` (and `x`) and in their seed: mean,
    standard deviation (ddof=1) and range over seeds of each group; with `x`, the mean
    ± std against x for each `by` value and where the first two curves cross. Writes
    out.json, out.md and out.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: dict[tuple, list] = {}
    for w in workdirs:
        evals = [r for r in read_metrics(w) if r["split"] == "eval" and metric in r]
        if not evals:
            raise ValueError(f"{w}: no eval record with {metric!r}; valid: a finished run's "
                             f"eval metrics")
        key = (str(_point_value(w, by)), _number(_point_value(w, x)) if x else None)
        groups.setdefault(key, []).append({"workdir": w, "value": float(evals[-1][metric]),
                                           "seed": int(_point_value(w, "train.seed")),
                                           "wall_s": run_summary_wall(w)})
    rows = []
    for (name, xv), runs in groups.items():
        v = np.array([r["value"] for r in runs])
        rows.append({by: name, **({x: xv} if x else {}), "n": len(v), "mean": float(v.mean()),
                     "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                     "min": float(v.min()), "max": float(v.max()),
                     "wall_s": float(np.mean([r["wall_s"] for r in runs])), "runs": runs})
    rows.sort(key=lambda r: (r[by], r.get(x, 0)))
    result = {"by": by, "x": x, "metric": metric, "groups": rows}
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
            ax.errorbar(xs, [scale * r["mean"] for r in mine], [scale * r["std"] for r in mine],
                        marker="o", capsize=3, color=f"C{i}", label=f"{name} (mean ± std)")
            for r in mine:
                ax.plot([r[x]] * r["n"], [scale * s["value"] for s in r["runs"]], ".",
                        color=f"C{i}", alpha=0.4)
        else:
            r = mine[0]
            ax.errorbar([i], [scale * r["mean"]], [scale * r["std"]], marker="o", capsize=4,
                        color=f"C{i}")
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


def seeds_table(result: dict) -> str:
    by, x, metric = result["by"], result["x"], result["metric"]
    pct = metric == "accuracy"
    fmt = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.4f}")
    sd = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.4f}")
    lines = [f"| {by} | " + (f"{x} | " if x else "") + f"seeds | mean {metric} | std | "
             f"min – max | wall time per run |",
             "|---|" + ("---|" if x else "") + "---|---|---|---|---|"]
    for r in result["groups"]:
        lines.append(f"| {r[by]} | " + (f"{r[x]:g} | " if x else "") +
                     f"{r['n']} | {fmt(r['mean'])} | {sd(r['std'])} | "
                     f"{fmt(r['min'])} – {fmt(r['max'])} | {r['wall_s']:.0f} s |")
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
    with open(bench_json) as f:
        bench = json.load(f)
    series: dict[tuple, list] = {}
    for r in bench["rows"]:
        n = r.get("n", r.get("T"))
        row_mask = r.get("mask", "causal" if r.get("causal") else "full")
        if row_mask != mask or n is None or n < min_n:
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
    cell = lambda s: "–" if s is None else (f"{s['slope']:.2f} ± {s['stderr']:.2f} "
                                            f"(N {s['n'][0]}–{s['n'][-1]})")
    lines = ["| implementation | time fwd | time fwd+bwd | temp memory fwd | "
             "temp memory fwd+bwd |", "|---|---|---|---|---|"]
    for impl, fits in slopes.items():
        lines.append(f"| {impl} | " + " | ".join(cell(fits.get(k)) for k in keys) + " |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n\nLog-log slopes (± standard error of the fit): "
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
        ax.legend(fontsize=7)
    axes[0].set_title("time (solid: forward, dashed: forward+backward)")
    axes[1].set_title("memory (solid: forward, dashed: forward+backward)")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    plt.close(fig)
    return result


# ==================================================================================== CLI
def _named_runs(items: Sequence[str]) -> dict[str, str]:
    runs = {}
    for item in items:
        name, sep, workdir = item.partition("=")
        if not sep or not name or not workdir:
            raise SystemExit(f"error: run {item!r} must be NAME=WORKDIR, e.g. "
                             f"rnn-attention=/tmp/bottleneck/rnn-attention")
        runs[name] = workdir
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m attention_jax.tools.analysis",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("translation", help="bucketed exact match and BLEU of translation runs")
    t.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    t.add_argument("--split", default="test")
    t.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                   help="source-length bucket edges in tokens, comma-separated")
    t.add_argument("--max_examples", type=int, default=0, help="0: the whole split")
    t.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    r = sub.add_parser("runs", help="final eval metrics, params and wall time of runs")
    r.add_argument("--out", required=True)
    r.add_argument("--x", default="", help="model field (or 'tokens') to plot against")
    r.add_argument("--metric", default="accuracy")
    r.add_argument("--curves", default="", help="also plot this metric against step")
    r.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    p = sub.add_parser("positions", help="LM loss by position beyond the training length")
    p.add_argument("--out", required=True)
    p.add_argument("--eval_len", type=int, required=True)
    p.add_argument("--train_len", type=int, required=True)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    a = sub.add_parser("attention", help="entropy and largest weight of GPT attention rows, "
                                         "at initialisation and trained")
    a.add_argument("--out", required=True)
    a.add_argument("--batches", type=int, default=4)
    a.add_argument("--batch_size", type=int, default=16)
    a.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    s = sub.add_parser("scaling", help="L(N) power-law fit and the loss-vs-compute envelope "
                                       "of a model-size sweep")
    s.add_argument("--out", required=True)
    s.add_argument("workdirs", nargs="+", help="one run directory per model size")
    d = sub.add_parser("seeds", help="mean and spread over seeds of runs grouped by a sweep key")
    d.add_argument("--out", required=True)
    d.add_argument("--by", required=True, help="sweep key (or dotted config field) to group by")
    d.add_argument("--x", default="", help="a second key to plot against (e.g. train_fraction)")
    d.add_argument("--metric", default="loss")
    d.add_argument("workdirs", nargs="+")
    c = sub.add_parser("attention_cost", help="log-log slopes of attention time and memory "
                                              "against N, from the benchmark's JSON")
    c.add_argument("--out", required=True)
    c.add_argument("--mask", default="full", help="full | causal (| packed on GPU)")
    c.add_argument("--min_n", type=int, default=0, help="fit lengths N >= this only")
    c.add_argument("bench_json", help="bench_results/attention.json")
    args = parser.parse_args(argv)
    if args.command in ("scaling", "seeds", "attention_cost"):
        if args.command == "scaling":
            scaling_report(args.workdirs, args.out)
        elif args.command == "seeds":
            seeds_report(args.workdirs, args.out, args.by, args.x, args.metric)
        else:
            attention_cost_report(args.bench_json, args.out, args.mask, args.min_n)
        print(open(args.out + ".md").read())
    elif args.command == "translation":
        edges = tuple(int(e) for e in args.edges.split(","))
        results = translation_report(_named_runs(args.runs), args.out, args.split, edges,
                                     args.max_examples)
        print(translation_table(results))
    elif args.command == "positions":
        positions_report(_named_runs(args.runs), args.out, args.eval_len, args.train_len,
                         args.batches, args.batch_size)
        print(open(args.out + ".md").read())
    elif args.command == "attention":
        attention_report(_named_runs(args.runs), args.out, args.batches, args.batch_size)
        print(open(args.out + ".md").read())
    else:
        runs = _named_runs(args.runs)
        rows = runs_report(runs, args.out, args.x, args.metric)
        if args.curves:
            plot_curves(runs, args.out + "_curves.png", args.curves)
        print(runs_table(rows, args.metric))


if __name__ == "__main__":
    main()
