"""Evaluation beyond the training loss, for the experiments that reproduce the lectures.

* Translation by source length (Bahdanau et al. 2015, Fig. 2): greedy translations of a
  split from a run's checkpoint, exact-match accuracy and BLEU (sacrebleu) per source-
  length bucket, for any number of runs; one JSON, one markdown table, one PNG.
* Run summaries: the final eval metrics, parameter count and wall time of a set of runs
  (a sweep), as a table and a plot.

* Loss by position past the training length (position encodings), and training curves.
* Attention entropy and largest weight of a GPT's rows, at initialisation and trained
  (the softmax-scaling ablation).
* Through fits.py: scaling laws (L(N) = E + A·N^-α with its uncertainty, the
  loss-against-compute envelope), seed sweeps (mean and spread, where curves cross) and
  attention's cost (log-log slopes from the attention benchmark's JSON).

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
import sys
from collections.abc import Sequence

import numpy as np

from attention_jax import tasks
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError, UserError
from attention_jax.runs import last_eval_step, run_summary
from attention_jax.tools import fits
from attention_jax.workdir import read_metrics

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
    """Exact match (%) and corpus BLEU per source-length bucket, plus an 'all' row (every
    example, in a bucket or not).

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
    # Every example, those outside all buckets too (a source longer than the last edge was
    # left out of "all" as well, unsaid: its n and scores were of the buckets' only).
    rows.append(row("all", list(range(len(lengths)))))
    return rows


# ============================================================================= restoring
def parse_edges(text: str) -> tuple[int, ...]:
    """--edges "0,8,16": bucket edges, checked before any run is read or file written."""
    valid = "valid: two or more increasing ints >= 0, comma-separated, e.g. 0,8,16,24,32"
    try:
        edges = tuple(int(e) for e in text.split(","))
    except ValueError:
        raise ValueError(f"--edges={text!r}; {valid}") from None
    if len(edges) < 2 or edges[0] < 0 or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--edges={text!r}; {valid}")
    return edges


def restore_run(workdir: str, overrides: dict | None = None):
    """(config, task, params on the host) from the run's latest checkpoint (runs.open_run)."""
    import jax

    from attention_jax.runs import open_run
    run = open_run(workdir, overrides)
    return run.config, run.task, jax.device_get(run.params)


# ============================================================================ translation
def translate_split(workdir: str, split: str = "test", max_examples: int = 0,
                    batch_size: int = 100) -> list[dict]:
    """Greedy translations of `split` by the run's checkpoint: one dict per example with
    source, reference, hypothesis and source_tokens (the BPE length the model read)."""
    from attention_jax import data
    config, task, params = restore_run(workdir)
    decode = tasks.need(task, "decode", config.task, "translate")
    d = config.data
    tok = data.load_tokenizer(workdir_lib.local_dir(workdir, workdir_lib.TOKENIZER)
                              or workdir_lib.path(workdir, workdir_lib.TOKENIZER))
    if d.name == "files":  # the user's own pairs: read as the run reads them (its files, keys)
        own = {"train": task.train_source, "validation": task.eval_source}
        if split not in own:
            raise ConfigError(f"--split={split!r}: a run on its own files (data.name='files') "
                              f"has the splits {list(own)}; its held-out pairs: "
                              f"--split=validation")
        records = own[split]
    else:
        records = data.get_dataset(d.name, split, d.data_dir or None)
    n = min(len(records), max_examples) if max_examples else len(records)
    text = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
    out = []
    for start in range(0, n, batch_size):
        rows = [records[i] for i in range(start, min(start + batch_size, n))]
        src = np.stack([task.eval_transform(r, None)["inputs"] for r in rows])
        # Pad the last batch to the full size: one compiled shape for the whole split.
        src_full = np.concatenate([src, np.repeat(src[:1], batch_size - len(src), 0)])
        tokens = np.asarray(decode(params, src_full, d.target_len))[:len(src)]
        for r, s, t in zip(rows, src, tokens):
            out.append({"source": text(r[d.source]), "reference": text(r[d.target]),
                        "hypothesis": tok.decode(tasks.until_eos(t, tok.eos_id)),
                        "source_tokens": int(np.sum(s != tok.pad_id))})
    return out


def translation_report(runs: dict[str, str], out: str, split: str = "test",
                       edges: Sequence[int] = DEFAULT_EDGES, max_examples: int = 0) -> dict:
    """Bucketed exact match and BLEU of each named run; writes out.json, out.md, out.png
    and out_examples.json (a few long-source translations of each run, to read)."""
    if max_examples < 0:
        raise ValueError(f"--max_examples={max_examples}; valid: 0 (the whole split) or a "
                         f"count of examples")
    results, examples = {}, {}
    unfinished = unfinished_runs(runs)
    for name, workdir in runs.items():
        rows = translate_split(workdir, split, max_examples)
        results[name] = bucketed_translation_metrics(
            [r["source_tokens"] for r in rows], [r["hypothesis"] for r in rows],
            [r["reference"] for r in rows], edges)
        if not any(r["n"] for r in results[name][:-1]):  # before anything is written
            lengths = [r["source_tokens"] for r in rows]
            raise ValueError(
                f"--edges={','.join(map(str, edges))}: none of run {name!r}'s {len(rows)} "
                f"{split} examples has a source length in ({edges[0]}, {edges[-1]}], so "
                f"there is nothing to score; valid: edges that cover the sources' lengths"
                + (f" ({min(lengths)} to {max(lengths)} tokens)" if lengths else ""))
        longest = sorted(rows, key=lambda r: -r["source_tokens"])[:3]
        examples[name] = longest
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"split": split, "edges": list(edges), "results": results}, f, indent=1)
    with open(out + "_examples.json", "w") as f:
        json.dump(examples, f, indent=1, ensure_ascii=False)
    with open(out + ".md", "w") as f:
        f.write(translation_table(results) + unfinished)
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
def _predictions(workdir: str, split: str, batch_size: int):
    """(task, predicted [n], labels [n], the checkpoint's step) of the run's latest
    checkpoint on every example of `split` (default: the run's eval split), as its task
    reads that split (an image folder's held-out files, a user's labelled records less
    the empty ones), through its task's `classify`."""
    import jax

    from attention_jax.data.loaders import STAND_IN
    from attention_jax.runs import open_run
    run = open_run(workdir, {"data.eval_split": split} if split else None)
    config, task, params = run.config, run.task, jax.device_get(run.params)
    classify = tasks.need(task, "classify", config.task, "classify")
    records = task.eval_source
    predicted, labels = [], []
    for start in range(0, len(records), batch_size):
        read = (records[i] for i in range(start, min(start + batch_size, len(records))))
        # An image standing in for an undecodable one is scored once, as itself (the
        # trainer's eval weighs its copy 0).
        examples = [task.eval_transform(r, None) for r in read
                    if not (isinstance(r, dict) and r.get(STAND_IN, False))]
        if not examples:
            continue
        batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
        p, y = classify(params, batch)
        predicted.append(p)
        labels.append(y)
    return task, np.concatenate(predicted), np.concatenate(labels), run.step


def classification_accuracy(workdir: str, split: str = "", batch_size: int = 512,
                            with_step: bool = False) -> tuple:
    """(accuracy, n) of the run's latest checkpoint on every example of `split` (default:
    the run's eval split), through its task's `classify`; with_step: (accuracy, n, the
    checkpoint's step). It counts every example, as the trainer's eval does (its last
    partial batch padded and weighted), of any split the run's data has."""
    _, predicted, labels, step = _predictions(workdir, split, batch_size)
    found = float(np.mean(predicted == labels)), len(labels)
    return (*found, step) if with_step else found


def class_accuracies(workdir: str, split: str = "", batch_size: int = 512
                     ) -> dict[str, tuple[float, int]]:
    """{class name: (accuracy, n)} of the run's checkpoint over every example of `split`
    (default: its eval split), by the names the run was trained with (an image folder's
    subfolders; label numbers where the data has no names). Classes absent from the
    split are left out."""
    task, predicted, labels, _ = _predictions(workdir, split, batch_size)
    names = task.class_names or tuple(str(c) for c in range(int(labels.max()) + 1))
    return {names[c]: (float(np.mean(predicted[labels == c] == c)), int(np.sum(labels == c)))
            for c in np.unique(labels)}


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
def check_counts(**counts: int) -> None:
    """A ValueError naming the first of the options (--name=value) that is not >= 1."""
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"--{name}={value}; valid: an int >= 1")


def check_run_tasks(runs: dict[str, str], report: str, valid: Sequence[str]) -> None:
    """A ValueError naming a run whose task the report cannot read (a ViT run given to a
    report of language models), before anything is computed or written."""
    from attention_jax.runs import load_config
    for name, workdir in runs.items():
        task = load_config(workdir).task
        if task not in valid:
            raise ValueError(f"{report} reads runs of task {' or '.join(map(repr, valid))}; run "
                             f"{name!r} ({workdir}) is a {task!r} run")


def unfinished_runs(runs: dict[str, str]) -> str:
    """A note (markdown, "" for none) naming the runs that stopped before their
    train.steps, said on stderr too: a report of checkpoints reads their latest, which is
    then not the run's result (`runs` marks them in its table; seeds and scaling refuse)."""
    from attention_jax.runs import load_config
    lines = []
    for name, workdir in runs.items():
        steps = load_config(workdir).train.steps
        # (the last step it logged, trained or evaluated: a run with eval.every=-1 that
        # trained every step is finished without an eval)
        try:
            records = read_metrics(workdir)
        except workdir_lib.RunNotFoundError:  # no metrics.jsonl: nothing says how far
            continue
        reached = max((int(r.get("step", 0)) for r in records), default=0)
        if reached < steps:
            lines.append(f"note: run {name!r} ({workdir}) is unfinished: it logged step "
                         f"{reached} of its train.steps={steps}; this report reads its "
                         f"latest checkpoint")
    for line in lines:
        print(line, file=sys.stderr)
    return "".join(f"\n{line}\n" for line in lines)


def training_length(runs: dict[str, str], given: int | None) -> int:
    """The runs' training length (data.seq_len): one for all of them, and `given`
    (--train_len) only where it is theirs (the table's line between inside and beyond)."""
    from attention_jax.runs import load_config
    from attention_jax.tasks.text import GPT_DATA  # a config without seq_len: its default
    lengths = {name: load_config(w).data.get("seq_len", GPT_DATA["seq_len"])
               for name, w in runs.items()}
    if given is None:
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the runs trained on different lengths (data.seq_len: {lengths}); "
                             f"valid: runs of one length, or --train_len to draw the line at")
        return next(iter(lengths.values()))
    other = {n: v for n, v in lengths.items() if v != given}
    if other:
        raise ValueError(f"--train_len={given}: the runs trained on data.seq_len {other}; "
                         f"valid: their own length (leave --train_len out to use it)")
    return given


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
        logits, _ = model.apply({"params": params}, b["inputs"], positions=b.get("positions"),
                                segment_ids=b.get("segment_ids"))
        return token_cross_entropy(logits, b["targets"])

    sums, counts = np.zeros(seq_len), np.zeros(seq_len)
    for b in eval_batches(task, batches, batch_size):
        losses = np.asarray(nll(params, _lm_inputs(b, "inputs", "targets")))
        w = np.asarray(b["weights"], bool)
        positions = _row_positions(b)
        np.add.at(sums, positions[w], losses[w])
        np.add.at(counts, positions[w], 1)
    if not counts.any():
        raise ValueError(f"{workdir}: the validation split has fewer than batch_size="
                         f"{batch_size} rows of {seq_len} tokens; valid: batch_size <= "
                         f"{len(task.eval_source)}")
    return sums / np.maximum(counts, 1), counts


def _lm_inputs(batch, *keys) -> dict:
    """`keys` of a language model's batch and its positions and segment ids where it has
    them: a data.packing='stream' row has neither (plain causal attention over the row,
    positions 0..T-1), as the task's loss reads it (they were KeyErrors here)."""
    return {k: batch[k] for k in (*keys, "positions", "segment_ids") if k in batch}


def _row_positions(batch) -> np.ndarray:
    """Each token's position [B, T]: the batch's own (restarting at each packed
    document), or its index in the row where the batch has none (packing='stream')."""
    if "positions" in batch:
        return np.asarray(batch["positions"])
    b, t = np.shape(batch["inputs"])
    return np.broadcast_to(np.arange(t), (b, t))


def smoothed_losses(loss, counts, width: int = 8) -> np.ndarray:
    """The moving average of `width` positions of the loss by position, over the positions
    some token reached only: one no token reached has no loss (position_losses gives it
    0, which pulled the curve towards 0), and a window none reached is NaN (no point)."""
    seen = (np.asarray(counts) > 0).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.convolve(np.asarray(loss) * seen, np.ones(width), mode="valid")
                / np.convolve(seen, np.ones(width), mode="valid"))


def positions_report(runs: dict[str, str], out: str, eval_len: int,
                     train_len: int | None = None, batches: int = 8,
                     batch_size: int = 16) -> dict:
    """Loss by position of each run at `eval_len` (out.png, out.json) and a table of the
    mean loss inside and beyond the training length (out.md; `train_len`: the runs' own
    data.seq_len, checked against it when given)."""
    check_counts(batches=batches, batch_size=batch_size)
    check_run_tasks(runs, "positions", ("gpt",))
    train_len = training_length(runs, train_len)
    if not 0 < train_len < eval_len:
        raise ValueError(f"--eval_len={eval_len} --train_len={train_len}: the report compares "
                         f"positions inside the training length with those past it; valid: "
                         f"0 < train_len < eval_len")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results, unfinished = {}, unfinished_runs(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, workdir in runs.items():
        try:
            loss, counts = position_losses(workdir, eval_len, batches, batch_size)
        except ConfigError as e:  # the rows it reads are --eval_len long: say so
            raise ValueError(f"--eval_len={eval_len} for run {name!r}: {e}") from None
        if not counts[train_len:].any():  # (its average was 0.000: a loss of no token)
            raise ValueError(f"run {name!r}: no token of the {batches} validation batches read "
                             f"is at a position >= train_len={train_len} (positions restart at "
                             f"each packed document: its documents are shorter); valid: "
                             f"validation documents longer than {train_len} tokens, or more "
                             f"--batches")
        inside = float(np.average(loss[:train_len], weights=counts[:train_len]))
        beyond = float(np.average(loss[train_len:], weights=counts[train_len:]))
        results[name] = {"loss_by_position": loss.tolist(), "tokens": counts.tolist(),
                         "within_train_len": inside, "beyond_train_len": beyond}
        # A moving average of 8 positions: single positions are noisy at this batch count.
        smooth = smoothed_losses(loss, counts)
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
        f.write(table + unfinished)
    return results


# ============================================================================== attention
@functools.lru_cache(maxsize=None)
def _self_attention_weights_fn(model):
    """One compiled GPT forward per model configuration that returns the self-attention
    weights [L, B, N, T, S] of a packed batch (models are hashable by their config)."""
    import jax

    @jax.jit
    def weights(params, batch):
        _, aux = model.apply({"params": params}, batch["inputs"],
                             positions=batch.get("positions"),
                             segment_ids=batch.get("segment_ids"), return_weights=True)
        return aux["attention_weights"]["self"]
    return weights


def _segments(batch) -> np.ndarray:
    """The batch's segment ids [B, T] (0: padding). A data.packing='stream' row has none:
    it is one sequence, whose padding (at the split's end) shows in its weights only, a
    token being real where it predicts one (weight 1) or is predicted (its left
    neighbour's weight 1)."""
    if "segment_ids" in batch:
        return np.asarray(batch["segment_ids"])
    if "weights" not in batch:
        return np.ones(np.shape(batch["inputs"]), np.int32)
    real = tasks.text.moe_token_mask(batch, np.asarray(batch["weights"]))  # as the MoE reads it
    return np.asarray(real, np.int32)


def attention_stats(model, params, batch) -> dict[str, float]:
    """Mean entropy (nats) and mean largest weight of the causal attention rows of a GPT
    on a packed batch (inputs, positions, segment_ids [B, T]; a stream-packed one's inputs
    and weights), over layers, heads and the rows of real tokens; `uniform_entropy` is the entropy the same rows would have with
    equal weights on every key they may see (log of the number of such keys).

    A saturated softmax (the lectures' argument for 1/sqrt(H): logits of std sqrt(H)
    make it near one-hot) shows as a largest weight near 1 and entropy near 0.
    """
    seg = _segments(batch)
    batch = _lm_inputs(batch, "inputs")
    w = np.asarray(_self_attention_weights_fn(model)(params, batch), np.float64)
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
    check_counts(batches=batches, batch_size=batch_size)
    check_run_tasks(runs, "attention", ("gpt",))
    results, unfinished = {}, unfinished_runs(runs)
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
        model_cfg = task.model.config  # the resolved one: a variant's fields included
        results[name]["head_dim"] = model_cfg.d_model // model_cfg.num_heads
        results[name]["attention_scale"] = getattr(model_cfg, "attention_scale", None)
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
        f.write(table + unfinished)
    return results


# ================================================================================= curves
def curve_records(runs: dict[str, str], metric: str) -> dict[str, list[dict]]:
    """Each run's metric records, or a ValueError when none has `metric` (an empty plot
    otherwise, written without a word)."""
    named = {name: read_metrics(w) for name, w in runs.items()}
    found = sorted({k for records in named.values() for r in records for k in r}
                   - {"step", "split", "time"})
    if metric not in found:
        raise ValueError(f"--curves={metric!r}: no record of these runs has it; valid: {found}")
    return named


def plot_curves(runs: dict[str, str], path: str, metric: str = "loss") -> None:
    """Train (thin) and eval (markers) `metric` against step for each run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    named = curve_records(runs, metric)
    for i, (name, records) in enumerate(named.items()):
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
def runs_report(runs: dict[str, str], out: str, x: str = "", metric: str = "accuracy") -> dict:
    """A table (out.md, out.json) of the named runs and, with `x` (a model field such as
    `patch_size`, or `tokens`: the positions per example its task reports, a ViT's patches
    + [CLS]), a plot (out.png) of the eval metric and the wall time against it. What a
    run's task offers is added: tokens, model FLOPs per unit (out.json), and for a
    classifier the accuracy over the whole eval split."""
    import jax

    from attention_jax.runs import load_config
    rows, built = {}, {}
    for name, w in runs.items():
        config = load_config(w)
        with tasks.data_on_demand():  # its config and entries: no checkpoint, no corpus
            built[name] = tasks.TASKS[config.task](config, w)
        rows[name] = run_summary(w, built[name])
    for name, r in rows.items():
        task = built[name]
        if task.tokens_per_example:
            r["tokens"] = task.tokens_per_example
        if task.flops_per_unit is not None:  # shapes suffice: nothing is computed
            shapes = jax.eval_shape(task.init, jax.random.PRNGKey(0))
            r["flops_per_unit"] = task.flops_per_unit(shapes)
            r["unit"] = task.unit
        if task.classify is not None:
            # The whole test split, not the trainer's full batches only.
            r["eval"]["accuracy_batches"] = r["eval"].get("accuracy")
            r["eval"]["accuracy"], r["eval"]["n"], step = classification_accuracy(
                r["workdir"], with_step=True)
            # The step of the eval the row shows (else of its last train record): a killed
            # run's checkpoint is older
            if step != (last_eval_step(r["workdir"]) or r["step"]):
                r["eval"]["accuracy_step"] = step
    for name, r in rows.items():  # before anything is written
        if r["eval"] and metric not in r["eval"]:
            raise ValueError(f"--metric={metric!r}: run {name!r}'s eval records have no such "
                             f"metric; valid: {sorted(r['eval'])}")
        if x and r.get(x, r["model"].get(x)) is None:
            raise ValueError(f"--x={x!r}: run {name!r} has no such value; valid: 'tokens' "
                             f"(where the task counts them) or a model field: "
                             f"{sorted(k for k, v in r['model'].items() if v is not None)}")
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
        if metric == "accuracy" and "accuracy_step" in r["eval"]:
            shown += f" (checkpoint of step {r['eval']['accuracy_step']})"
        loss = r["eval"].get("loss")
        lines.append(f"| {name} | " + (f"{r.get('tokens', '–')} | " if has_tokens else "") +
                     f"{r['params']:,} | {_steps(r)} | {shown} | " +
                     (f"{'–' if loss is None else f'{loss:.4f}'} | " if loss_column else "") +
                     f"{r['wall_s']:.0f} s |\n")
    return head + sep + "".join(lines)


def _steps(row: dict) -> str:
    """The steps a run trained, and of how many where it stopped early (a killed run's
    last eval is not its result)."""
    target = row.get("steps")
    return (f"{row['step']} of {target} (unfinished)" if target and row["step"] < target
            else str(row["step"]))


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

    def command(name: str, help: str):  # its --help says what it does, as the list does
        return sub.add_parser(name, help=help, description=help)
    t = command("translation", help="bucketed exact match and BLEU of translation runs")
    t.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    t.add_argument("--split", default="test", help="the split translated (default: test)")
    t.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                   help="source-length bucket edges in tokens, comma-separated")
    t.add_argument("--max_examples", type=int, default=0, help="0: the whole split")
    t.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    r = command("runs", help="final eval metrics, params and wall time of runs")
    r.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    r.add_argument("--x", default="", help="model field (or 'tokens') to plot against")
    r.add_argument("--metric", default="accuracy",
                   help="the eval metric of the table and plot (default: accuracy)")
    r.add_argument("--curves", default="", help="also plot this metric against step")
    r.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    p = command("positions", help="LM loss by position beyond the training length")
    p.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    p.add_argument("--eval_len", type=int, required=True,
                   help="length of the validation rows read (past the training length)")
    p.add_argument("--train_len", type=int, default=None,
                   help="the training length the table splits at (default: the runs' "
                        "data.seq_len; if given, it must be theirs)")
    p.add_argument("--batches", type=int, default=8, help="validation batches read (default 8)")
    p.add_argument("--batch_size", type=int, default=16, help="rows a batch (default 16)")
    p.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    a = command("attention", help="entropy and largest weight of GPT attention rows, "
                                  "at initialisation and trained")
    a.add_argument("--out", required=True, help="path prefix of the .json/.md written")
    a.add_argument("--batches", type=int, default=4, help="validation batches read (default 4)")
    a.add_argument("--batch_size", type=int, default=16, help="rows a batch (default 16)")
    a.add_argument("runs", nargs="+", help="NAME=WORKDIR")
    s = command("scaling", help="L(N) power-law fit and the loss-vs-compute envelope "
                                "of a model-size sweep")
    s.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    s.add_argument("workdirs", nargs="+", help="one run directory per model size")
    d = command("seeds", help="mean and spread over seeds of runs grouped by a sweep key")
    d.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    d.add_argument("--by", required=True, help="sweep key (or dotted config field) to group by")
    d.add_argument("--x", default="", help="a second key to plot against (e.g. train_fraction)")
    d.add_argument("--metric", default="loss", help="the eval metric compared (default: loss)")
    d.add_argument("--baseline", default="",
                   help="a value of --by: each group's difference to it, seed by seed")
    d.add_argument("workdirs", nargs="+", help="the runs' workdirs (e.g. a sweep's /tmp/sweep/*)")
    c = command("attention_cost", help="log-log slopes of attention time and memory "
                                       "against N, from the benchmark's JSON")
    c.add_argument("--out", required=True, help="path prefix of the .json/.md/.png written")
    c.add_argument("--mask", default="full", help="full | causal (| packed on GPU)")
    c.add_argument("--min_n", type=int, default=0, help="fit lengths N >= this only")
    c.add_argument("bench_json", help="bench_results/attention.json")
    args = parser.parse_args(argv)
    try:
        workdir_lib.check_output_path(args.out)
        _run(args)
    except (UserError, ValueError) as e:  # the reports name the argument at fault
        raise SystemExit(f"error: {e}") from None


def _run(args) -> None:
    if args.command in ("scaling", "seeds", "attention_cost"):
        if args.command == "scaling":
            fits.scaling_report(args.workdirs, args.out)
        elif args.command == "seeds":
            fits.seeds_report(args.workdirs, args.out, args.by, args.x, args.metric,
                              args.baseline)
        else:
            fits.attention_cost_report(args.bench_json, args.out, args.mask, args.min_n)
        print(open(args.out + ".md").read())
    elif args.command == "translation":
        edges = parse_edges(args.edges)
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
        if args.curves:  # checked first: a misspelt metric stops before anything is written
            curve_records(runs, args.curves)
        rows = runs_report(runs, args.out, args.x, args.metric)
        if args.curves:
            plot_curves(runs, args.out + "_curves.png", args.curves)
        print(runs_table(rows, args.metric))


if __name__ == "__main__":
    main()
