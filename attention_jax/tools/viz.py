r"""Attention maps: per-layer, per-head weights as a PNG grid, and translation alignments.

    python -m attention_jax.tools.viz --workdir=/tmp/gpt --text="def main():" [--out=attn.png]
    python -m attention_jax.tools.viz --workdir=/tmp/rnn --text="three hundred and twelve"
    python -m attention_jax.tools.viz --workdir=/tmp/encdec --text="forty-two" [--target="..."]
    python -m attention_jax.tools.viz --workdir=/tmp/vit --image-index=3

From a notebook, on arrays (no workdir needed):

    weights = viz.model_attention(model, params, tokens)   # {"self": [L, N, T, T]}
    fig = viz.plot_attention_grid(weights["self"], labels)  # rows = layers, cols = heads
    fig = viz.plot_alignment(alpha, source_labels, target_labels)  # alpha [T, S]
    viz.save(fig, "attn.png")

or on a run: `maps = viz.attention_maps(workdir, text)` returns the figures by name. What
a run's input is (a text, an eval image, a source sentence and its translation) and how its
positions are labelled is its task's `attention_input` (tasks/); this module only draws.

The weights come from the reference attention path (the only one that materialises the
[B, N, T, S] matrix): models switch to it whenever `return_weights=True`. The RNN's
Bahdanau attention is its own additive scorer and returns α [B, T, S] directly.

For the translation models the picture is the source–target alignment of the lectures
(Bahdanau et al. 2015, Fig. 3): target tokens down, source tokens across, one row per
generated word. Without `--target` the model's own greedy translation is drawn. English
→ German number words show reordering ("twenty-one" → "einundzwanzig": the German unit
comes first) as weight off the diagonal.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, Sequence

import matplotlib

# Files only (no display on a server or in CI), except in a notebook, whose inline
# backend shows the figures these functions return.
if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from attention_jax import tasks  # noqa: E402
from attention_jax import workdir as workdir_lib  # noqa: E402
from attention_jax.errors import UserError  # noqa: E402

__all__ = ["MAX_TOKENS", "MAX_PANELS", "InputTooLongError", "plot_attention_grid",
           "plot_alignment", "save", "model_attention", "token_labels",
           "attention_maps", "main"]

# Beyond 64 tokens a row of labels no longer fits a panel at a readable font size, and
# the [L, N, T, T] grid stops being a picture anyone can read.
MAX_TOKENS = 64
# 12 layers × 12 heads (BERT-base) is the most panels we draw in one figure.
MAX_PANELS = 144
PANEL_INCHES = 2.0
DPI = 100


# The same error whether an input is too long to draw (here) or for the model (the task's
# attention_input, before any compute); the tasks label tokens, so the function lives there.
InputTooLongError = tasks.InputTooLongError
token_labels = tasks.token_labels


def check_length(n: int, limit: int = MAX_TOKENS, what: str = "input",
                 context: int | None = None, shorter: str = "a shorter text") -> None:
    """Raises InputTooLongError naming the length and the limit, before any compute;
    `shorter` says what would have fewer tokens (an image's are its patches)."""
    if context is not None and n > context:
        raise InputTooLongError(f"{what} is {n} tokens long; the model's context is {context} "
                                f"tokens. Give {shorter} (at most {min(limit, context)} tokens).")
    if n > limit:
        raise InputTooLongError(f"{what} is {n} tokens long; at most {limit} tokens can be drawn "
                                f"(more and the per-head panels are unreadable). Give {shorter}, "
                                f"raise the limit (--max-tokens, max_tokens=), or call "
                                f"plot_attention_grid yourself on a slice.")


# ==================================================================================== drawing
def _font_size(n: int) -> float:
    return float(np.clip(160 / max(n, 1), 3.0, 8.0))


def _ticks(ax, labels, axis: str, size: float) -> None:
    if labels is None:
        getattr(ax, f"set_{axis}ticks")([])
        return
    getattr(ax, f"set_{axis}ticks")(range(len(labels)))
    getattr(ax, f"set_{axis}ticklabels")(labels, fontsize=size,
                                         rotation=90 if axis == "x" else 0)


def plot_attention_grid(weights, query_labels: Sequence[str] | None = None,
                        key_labels: Sequence[str] | None = None, *, title: str | None = None,
                        layer_names: Sequence[str] | None = None,
                        max_tokens: int = MAX_TOKENS):
    """Figure with one panel per (layer, head): rows are layers, columns heads.

    weights [L, N, T, S] (a single layer [N, T, S] is taken as L = 1); panel (l, n) shows
    query positions down and key positions across, colour 0..1. Token labels go on the
    left column (queries) and the bottom row (keys); key labels default to the query
    labels (self-attention).
    """
    w = np.asarray(weights, np.float32)
    if w.ndim == 3:
        w = w[None]
    if w.ndim != 4:
        raise ValueError(f"weights must be [L, N, T, S] (or [N, T, S]); got shape {w.shape}")
    layers, heads, t, s = w.shape
    if layers * heads > MAX_PANELS:
        raise InputTooLongError(f"{layers} layers × {heads} heads = {layers * heads} panels; at "
                                f"most {MAX_PANELS} can be drawn. Pass a subset of layers.")
    check_length(max(t, s), max_tokens)
    key_labels = query_labels if key_labels is None and s == t else key_labels
    for name, labels, n in (("query_labels", query_labels, t), ("key_labels", key_labels, s)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} entries; the weights have {n} positions")
    fig, axes = plt.subplots(layers, heads, squeeze=False, dpi=DPI, layout="constrained",
                             figsize=(PANEL_INCHES * heads + 0.8, PANEL_INCHES * layers + 0.8))
    size = _font_size(max(t, s))
    names = layer_names or [f"layer {i}" for i in range(layers)]
    for i in range(layers):
        for j in range(heads):
            ax = axes[i, j]
            image = ax.imshow(w[i, j], cmap="viridis", vmin=0.0, vmax=1.0,
                              interpolation="nearest", aspect="auto")
            _ticks(ax, query_labels if j == 0 else None, "y", size)
            _ticks(ax, key_labels if i == layers - 1 else None, "x", size)
            if i == 0:
                ax.set_title(f"head {j}", fontsize=9)
            if j == 0:
                ax.set_ylabel(names[i], fontsize=9)
    # Which way a row reads, and what a colour is worth: a reader new to the picture
    # cannot tell queries from keys otherwise.
    fig.supylabel("query (the token attending)", fontsize=9)
    fig.supxlabel("key (the token attended to)", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    _title(fig, title)
    return fig


def plot_alignment(weights, source_labels: Sequence[str], target_labels: Sequence[str], *,
                   title: str | None = None, panel_titles: Sequence[str] | None = None,
                   max_tokens: int = MAX_TOKENS):
    """The translation alignment: target tokens down, source tokens across, annotated.

    weights [T, S], or [P, T, S] for P panels side by side (e.g. one per decoder layer).
    """
    w = np.asarray(weights, np.float32)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must be [T, S] or [P, T, S]; got shape {w.shape}")
    panels, t, s = w.shape
    check_length(s, max_tokens, what="source")
    check_length(t, max_tokens, what="target")
    if len(source_labels) != s or len(target_labels) != t:
        raise ValueError(f"{len(source_labels)} source / {len(target_labels)} target labels for "
                         f"weights of {s} source and {t} target positions")
    # Cells about a third of an inch: the labels stay legible next to them.
    width, height = max(4.0, 0.35 * s + 1.5), max(3.0, 0.35 * t + 1.5)
    fig, axes = plt.subplots(1, panels, squeeze=False, dpi=DPI, layout="constrained",
                             figsize=(width * panels, height))
    size = _font_size(max(t, s)) + 1
    for p in range(panels):
        ax = axes[0, p]
        ax.imshow(w[p], cmap="gray_r", vmin=0.0, vmax=1.0, interpolation="nearest")
        _ticks(ax, source_labels, "x", size)
        _ticks(ax, target_labels if p == 0 else None, "y", size)
        ax.xaxis.tick_top()  # The lectures' picture reads the source along the top.
        if panel_titles:
            ax.set_xlabel(panel_titles[p], fontsize=9)
    _title(fig, title)
    return fig


def _title(fig, title: str | None) -> None:
    if title:  # Wrapped to the figure's width: a narrow alignment would clip it.
        chars = max(int(fig.get_size_inches()[0] * 11), 20)
        fig.suptitle(textwrap.fill(title, chars), fontsize=9)


def save(fig, path: str) -> str:
    """Writes the figure as PNG (creating the directory) and closes it; returns the path."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return path


# ============================================================================ weights from models
def model_attention(model, params, inputs, decoder_inputs=None, *,
                    example: int | None = None) -> dict[str, np.ndarray]:
    """Attention weights of one example, by kind of attention, from the reference path.

    GPT / BERT: inputs [1, T] ids -> {"self": [L, N, T, T]}.
    ViT: inputs [1, H, W, C] image -> {"self": [L, N, P(+1), P(+1)]}.
    EncoderDecoder: inputs [1, S], decoder_inputs [1, T] -> {"encoder": [L, N, S, S],
      "decoder": [L, N, T, T], "cross": [L, N, T, S]}.
    RNNSeq2Seq (with attention): -> {"cross": [1, 1, T, S]} (one additive "head").

    A batch of B > 1 examples needs `example`, the one to return (0 <= example < B); the
    model still reads the whole batch. With B = 1 it may be left out.
    """
    import jax
    batch = int(np.shape(inputs)[0])
    if example is None and batch > 1:
        # Only the first was returned, unsaid: a notebook's batch drew its first example.
        raise ValueError(f"model_attention: inputs hold a batch of {batch} examples and the "
                         f"weights are of one; valid: example=0..{batch - 1} (which one), or "
                         f"inputs of one example ([1, ...])")
    example = 0 if example is None else example
    if not 0 <= example < batch:
        raise ValueError(f"model_attention: example={example} is not in the batch of {batch} "
                         f"(inputs {tuple(np.shape(inputs))}); valid: 0 <= example < {batch}")
    # One compiled call is quicker than dispatching a model's hundreds of ops eagerly.
    apply = jax.jit(model.apply, static_argnames=("return_weights",))
    inputs = (inputs,) if decoder_inputs is None else (inputs, decoder_inputs)
    _, aux = apply({"params": params}, *inputs, return_weights=True)
    if "attention_weights" not in aux:
        raise ValueError(f"{type(model).__name__} returned no attention weights: a bottleneck "
                         f"model (attention=False) reads one context vector, so there is no "
                         f"alignment to draw")
    # Every family: {kind: [L, B, N, T, S]} -> {kind: [L, N, T, S]} float32 numpy.
    return {kind: np.asarray(w, np.float32)[:, example]
            for kind, w in aux["attention_weights"].items()}


# ======================================================================================== runs
# A run is drawn from batches of one example.
ONE_EXAMPLE = {"train.batch_size": 1, "eval.batch_size": 1, "optim.grad_accum": 1}


def attention_maps(workdir: str, text: str | None = None, *, target: str | None = None,
                   image_index: int = 0, layers: Sequence[int] | None = None,
                   max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Figures of a run's attention on one input, by name ("self", or for translation
    "alignment", "cross", "encoder", "decoder"), and "info" (tokens, step).

    text: the input (source sentence for translation). target: the translation to align
    (default: the model's greedy output). image_index: ViT, the eval image to draw.
    layers: which layers to draw (default all).
    """
    from attention_jax import runs
    run = runs.open_run(workdir, ONE_EXAMPLE)
    return maps_for_run(run, text, target=target, image_index=image_index, layers=layers,
                        max_tokens=max_tokens)


def maps_for_run(run, text: str | None, *, target: str | None = None,
                 image_index: int = 0, layers: Sequence[int] | None = None,
                 max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """attention_maps on an already opened runs.Run (several inputs, one restore).

    The run's task says what its input is and how to label it (Task.attention_input);
    this draws whatever kinds of attention the model returns."""
    name = run.config.task
    make = tasks.need(run.task, "attention_input", name, "draw attention maps")
    with run.mesh_context():
        example = make(run.params, text, target=target, index=image_index)
        # (an image's tokens are its patches and [CLS]: fewer come from a model of larger
        # patches or smaller images, not from another input)
        shorter = ("a shorter text" if text is not None else
                   "a model of fewer patches (a smaller data.image_size or a larger patch)")
        for kind, (queries, keys) in example.labels.items():  # before the forward pass
            check_length(max(len(queries), len(keys)), max_tokens, f"the {kind}-attention input",
                         shorter=shorter)
        weights = model_attention(run.task.model, run.params, *example.inputs)
    head = f"{name} {example.title}".strip() + f", step {run.step}"
    maps = {}
    for kind, w in weights.items():
        if kind not in example.labels:
            raise ValueError(f"task {name!r} labels {sorted(example.labels)} but the model "
                             f"returned {kind!r} attention too")
        queries, keys = example.labels[kind]
        w, names = _select(w, layers)
        if kind == example.alignment:
            # Source–target alignment: the mean over heads, one panel per decoder layer.
            many = w.shape[1] > 1
            maps["alignment"] = plot_alignment(
                w.mean(axis=1), keys, queries, max_tokens=max_tokens,
                panel_titles=[f"decoder {n}" for n in names],
                title=f"{kind}-attention {'(mean over heads)' if many else 'alignment'}, {head}")
            if not many:  # one head (the RNN's α): a per-head grid would repeat it
                continue
            title = f"{kind}-attention per head"
        else:  # "self", or an encoder-decoder's "encoder" / "decoder" self-attention
            title = "self-attention" if kind == "self" else f"{kind} self-attention"
        maps[kind] = plot_attention_grid(w, queries, keys, layer_names=names,
                                         max_tokens=max_tokens, title=f"{title}, {head}")
    maps["info"] = {**example.info, "step": run.step}
    return maps


def _select(weights, layers):
    """Only the asked layers (all by default), with their names for the row labels."""
    layers = list(range(weights.shape[0])) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < weights.shape[0]]
    if bad:
        raise ValueError(f"layers {bad} do not exist; valid: 0..{weights.shape[0] - 1}")
    return weights[layers], [f"layer {i}" for i in layers]


# ================================================================================ command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attention_jax.tools.viz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--text", help="input text (translation: the source sentence)")
    parser.add_argument("--target", help="translation: the target to align (default: the "
                                         "model's greedy translation)")
    parser.add_argument("--image-index", type=int, default=0, help="ViT: eval image to draw")
    parser.add_argument("--layers", help="comma-separated layer indices (default: all)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help=f"refuse longer inputs (default {MAX_TOKENS})")
    parser.add_argument("--out", help="PNG path (default: WORKDIR/attention.png, or "
                                      "./attention.png for a gs:// or s3:// WORKDIR); other "
                                      "pictures go next to it as OUT_<name>.png")
    args = parser.parse_args(argv)
    args.workdir = workdir_lib.expand(args.workdir)
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError:
        parser.error(f"--layers={args.layers!r}: comma-separated layer indices, e.g. 0,2")
    try:
        if args.out:
            workdir_lib.check_output_path(args.out)
        maps = attention_maps(args.workdir, args.text, target=args.target,
                              image_index=args.image_index, layers=layers,
                              max_tokens=args.max_tokens)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    info = maps.pop("info")
    # A run in an object store: the pictures go to the current folder unless --out says.
    out = args.out or ("attention.png" if workdir_lib.is_remote(args.workdir)
                       else os.path.join(args.workdir, "attention.png"))
    stem, _ = os.path.splitext(out)
    main_name = "alignment" if "alignment" in maps else next(iter(maps))
    for name, fig in maps.items():
        path = save(fig, out if name == main_name else f"{stem}_{name}.png")
        print(f"wrote {path}")
    if "translation" in info:
        print(f"translation: {info['translation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
