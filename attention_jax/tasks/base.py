"""The Task every model family gives the trainer and the tools, the registry of
families, and the helpers the families' adapters share (model and data options, splits,
tokenizers, vocabulary sizes)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attention_jax import checkpoint as ckpt_lib
from attention_jax import workdir as workdir_lib
from attention_jax.errors import (ConfigError, UserError, check_choice, check_range,
                                  did_you_mean)


# ===================================================================================== task
@dataclasses.dataclass
class Task:
    """What the trainer and the tools need from a model family (built by the adapters in
    TASKS).

    Required:
      model: the linen module; init(rng) -> the params tree (with flax logical-axis boxes);
      loss(params, batch, rng, train) -> (scalar loss, {name: scalar metric}); params
        arrive as stored (float32): the model computes in train.compute_dtype by casting
        each weight where it uses it (flax's `dtype`; every family's modules do), so a
        lookup table's gradient accumulates in float32 (layers/posemb.py Embed);
      train_source, eval_source: random-access (`len`, `[i]`); the transforms map
        (record, np rng) -> example.
    Evaluation: an eval batch carries batch["example_weight"] [B] (0 on the copies that
      pad the last, partial batch); a loss that weights its means by it and returns their
      total weight as metrics["weight"] is evaluated over exactly the split (every family
      here does, through models/losses.py); one that does not is refused before training
      when a partial batch would be evaluated (steps.check_eval_split). Training with
      optim.grad_accum > 1 gives each micro-batch weights of 1 the same way: the step
      weighs each micro-batch's means by their reported weight (tokens), so the step is
      the whole batch's mean; a loss that reports none has its micro-batches averaged.
    Optional (None: the family cannot; `need` names the registered tasks that can):
      sample(params, rng) -> list[str]: continuations of config.eval.sample_prompts (gpt).
      decode(params, src [B, S] int32, max_len: int) -> tokens [B, max_len] int32: greedy
        translation, EOS kept and pad after it (rnn_seq2seq: RNNSeq2Seq.generate; encdec:
        encdec.greedy_decode).
      translate(params, texts: list[str], untranslated=None) -> list[str]: each source
        text's translation, greedy or a beam search of config.eval.beam_size (rnn_seq2seq,
        encdec); a text it cannot take is a ValueError, or with a dict `untranslated`
        translated as '' and its index mapped there to why.
      embed(params, texts: list[str]) -> np.ndarray [B, D] float32: sentence embeddings,
        mean-pooled, unit length (bert_mlm, through convert.SentenceEncoder).
      attention_input(params, text: str | None = None, *, target: str | None = None,
        index: int = 0) -> AttentionInput: one example to draw the attention of, with its
        labels: a text (gpt, bert_mlm); the eval image `index` (vit); a source sentence
        and its `target`, by default the greedy translation (rnn_seq2seq, encdec). An input
        longer than the model's context raises InputTooLongError before any compute.
      classify(params, batch) -> (predicted [B] int32, labels [B] int32): the predicted
        classes of a batch of eval examples and their labels (vit, cnn, bert_classify).
      label_texts(params, texts: list[str]) -> (np.ndarray [B, C] float32, {i: reason}):
        each class's probability for each text, in class_names' order; a pair's two texts
        are one string with a tab between them, and the lines that are no such pair are
        the reasons' (their rows NaN) (bert_classify).
      label_images(params, paths: list[str]) -> (np.ndarray [B, C] float32, {i: reason}):
        each class's probability for each image file, read as the run's eval images are,
        and the files that are no readable image (their rows NaN) (vit, cnn).
      flops_per_unit(params) -> float: model FLOPs of a training step (forward and
        backward) per `unit`, the PaLM convention of models/flops.py; params may be shapes,
        jax.eval_shape(init, rng) (gpt, bert_mlm, vit, cnn, encdec).
      tokens_per_example: positions the model attends over per example when fixed: the
        data.seq_len of a text, a ViT image's patches (+ 1 for [CLS]) (gpt, bert_mlm, vit).
    """
    model: nn.Module
    init: Callable[[jax.Array], Any]
    loss: Callable[..., tuple[jax.Array, dict]]
    train_source: Any
    eval_source: Any
    train_transform: Callable | None = None
    eval_transform: Callable | None = None
    # What throughput (units/s in the log), flops_per_unit and the eval record count in:
    # "tokens" (positions that carry a target) or "examples" (rows).
    unit: str = "examples"
    # host batch -> how many units it holds: e.g. the target tokens (weights > 0) of a
    # packed text batch, which padding does not inflate; default: its rows.
    count: Callable[[dict], int] | None = None
    save_assets: Callable[[str], None] | None = None  # e.g. the tokenizer into the workdir.
    seq_len: int | None = None  # tokens per example when fixed (checked against mesh.sequence).
    sample: Callable[[Any, jax.Array], list[str]] | None = None
    decode: Callable[[Any, Any, int], Any] | None = None
    translate: Callable[..., list[str]] | None = None
    embed: Callable[[Any, Sequence[str]], np.ndarray] | None = None
    attention_input: Callable[..., AttentionInput] | None = None
    classify: Callable[[Any, dict], tuple[np.ndarray, np.ndarray]] | None = None
    label_texts: Callable[[Any, Sequence[str]], tuple[np.ndarray, dict[int, str]]] | None = None
    label_images: Callable[[Any, Sequence[str]], tuple[np.ndarray, dict[int, str]]] | None = None
    flops_per_unit: Callable[[Any], float] | None = None
    tokens_per_example: int | None = None
    # A classifier's class names in label order (an image folder's subfolders, a tfds
    # ClassLabel's names), for reports by name (tools/analysis.class_accuracies).
    class_names: tuple[str, ...] | None = None
    # Threads reading batches ahead in each reading process (loaders.Loader): 1 where a
    # read is Python holding the GIL (token rows: more threads only take turns), more
    # where decoding releases it (images).
    read_threads: int = 1
    # A text task's tokenizer vocabulary (before padding for the matmuls): what the rows
    # of a warm start's embedding table must stand for (train.init_from=hf:...).
    vocab_size: int | None = None
    # Top-level params the loss never trains (no gradient reaches them): a new run starts
    # them at zero, from scratch or where a warm start's Hugging Face checkpoint lacks
    # them (what it holds stands), and AdamW keeps them there, so what reads the run sees
    # them untrained (BERT's pooler and NSP head under the MLM loss: export_hf then writes
    # a BertForMaskedLM without them).
    untrained: tuple[str, ...] = ()


# The optional entries a tool may `need`; `register` checks an adapter sets exactly the
# ones it declares, so the error for a task without one can name the tasks with it
# without building them (building loads data).
OPTIONAL = ("sample", "decode", "translate", "embed", "attention_input", "classify", "label_texts",
            "label_images", "flops_per_unit", "tokens_per_example")


@dataclasses.dataclass
class AttentionInput:
    """One example to draw a model's attention on (Task.attention_input's answer).

    inputs: the model's positional inputs with a batch of 1, for
      `model.apply({"params": p}, *inputs, return_weights=True)`: ids [1, T]; an image
      [1, H, W, C]; source ids [1, S] and the teacher-forced target [1, T].
    labels: kind of attention, as the model names it in aux["attention_weights"] ("self",
      "encoder", "decoder", "cross") -> (query labels [T], key labels [S]).
    alignment: the kind drawn as the source-target alignment of the lectures (Bahdanau et
      al. 2015, Fig. 3): "cross" for translation, None for self-attention only.
    title: what the input is, for the figures ("eval image 3 (label 7)", "en→fr").
    info: what the tools report beside the figures: "tokens" (the input's labels), or
      "source", "target" and "translation".
    """
    inputs: tuple
    labels: dict[str, tuple[list[str], list[str]]]
    info: dict[str, Any]
    title: str = ""
    alignment: str | None = None


class InputTooLongError(UserError, ValueError):
    """The input has more tokens than the model was built for (or than tools/viz draws)."""


def check_context(n: int, context: int | None, what: str = "input") -> None:
    """InputTooLongError naming the length and the model's context, before any compute."""
    if context is not None and n > context:
        raise InputTooLongError(f"{what} is {n} tokens long; the model's context is {context} "
                                f"tokens. Give a shorter text (at most {context} tokens).")


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One readable label per token id: its own text, or <bos>/<eos>/... for specials."""
    names = {getattr(tokenizer, f"{n}_id", None): f"<{n}>"
             for n in ("pad", "bos", "eos", "mask", "cls", "sep")}  # cls/sep: WordPiece's
    out = []
    for i in map(int, ids):
        if i in names:
            out.append(names[i])
            continue
        # A leading space marks a word start in byte-level BPE; show it as the middle dot.
        text = tokenizer.decode([i]).replace("\n", "⏎").replace(" ", "·")
        if not text.isprintable():  # control bytes and partial UTF-8: escapes, not boxes
            text = text.encode("unicode_escape").decode("ascii")
        out.append(text or f"#{i}")
    return out


def moe_metrics(aux) -> dict[str, jax.Array]:
    """Router statistics found anywhere in a model's aux dict, averaged over layers.

    Mixture-of-experts layers report `load_balance_loss` (Switch Transformer, Fedus et
    al. 2021), `router_entropy`, `dropped_fraction` and `expert_load` [E] (one metric
    per expert), so every task logs MoE models the same way. (The weighted balance loss
    itself, with the weighted router z-loss, is added to the objective by the model, as
    aux["moe_loss"].) They are batch means over the tokens the router saw: a task keeps
    its padding out of them (an eval batch's padding copies included) by masking it, as
    text.moe_token_mask does. `router_z_loss` is logged too, whatever its weight.
    """
    found: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        name = ckpt_lib.key_name(path[-1]) if path else ""
        if name in MOE_KEYS:
            found.setdefault(name, []).append(jnp.asarray(leaf, jnp.float32))
    metrics = {}
    for name, values in found.items():
        value = jnp.mean(jnp.stack([v.reshape(-1, v.shape[-1]).mean(0) if name == "expert_load"
                                    else v.mean() for v in values]), axis=0)
        if value.ndim:
            metrics.update({f"moe/{name}_{i}": value[i] for i in range(value.shape[0])})
        else:
            metrics[f"moe/{name}"] = value
    return metrics


# The router z-loss is logged whatever its weight in the loss (0 by default): a growing one
# is what ST-MoE adds it against.
MOE_KEYS = ("load_balance_loss", "router_z_loss", "router_entropy", "dropped_fraction",
            "expert_load")


# ================================================================================ adapters
# config.task -> function(config, workdir) -> Task. The model families register below; a
# notebook or a test can add its own (`TASKS["mine"] = make_my_task`).
TASKS: dict[str, Callable[[Any, str], Task]] = {}


def register(name: str, make: Callable[[Any, str], Task], provides: Sequence[str] = (),
             reads: Sequence[str] | None = None, model: type | None = None) -> None:
    """TASKS[name] = make, declaring the optional Task entries it sets (OPTIONAL), so that
    `need` can name the tasks with an entry without building any. A build that sets other
    entries than it declares is a bug here and raises. reads: the keys of
    config.TASK_KEYS (keys only some tasks read) the task reads; --help lists only those,
    and a run that sets another is told it does nothing. None (not said): config.
    SAMPLE_KEYS where it samples, none where it does not (only sampling reads them), and
    config.LM_LOSS_KEYS either way (a loss of gpt.head_loss reads them, in the task's own
    code, which this cannot see). model: the dataclass whose fields config.model sets,
    whose field comments --help shows (config_help)."""
    from attention_jax import config as config_lib
    unknown = sorted(set(provides) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"provides={unknown} are not optional Task entries; valid: {OPTIONAL}")
    declared = frozenset(provides)
    if reads is None:
        reads = ((config_lib.SAMPLE_KEYS if "sample" in declared else ())
                 + config_lib.LM_LOSS_KEYS)
    unknown = sorted(set(reads) - set(config_lib.TASK_KEYS))
    if unknown:
        raise ValueError(f"reads={unknown}; valid: keys of {config_lib.TASK_KEYS}")

    @functools.wraps(make)
    def build(config, workdir: str) -> Task:
        task = make(config, workdir)
        found = {f for f in OPTIONAL if getattr(task, f) is not None}
        if found != declared:
            raise AssertionError(f"task {name!r} sets {sorted(found)} but declares "
                                 f"{sorted(declared)}: fix its register(..., provides=)")
        _say_unread_keys(config, name)
        return task

    build.provides = declared
    build.reads = tuple(reads)
    build.model = model
    TASKS[name] = build


def _say_unread_keys(config, name: str) -> None:
    """A note where a task is given values of keys it does not read (a classifier's
    eval.sample_*, which only sampling reads; a ViT's train.loss_chunk_size, which only
    the GPT's loss reads): they did nothing, unsaid."""
    from attention_jax import config as config_lib
    if getattr(config, "eval", None) is None:
        return  # a config without eval settings (a notebook's stub)
    given, default = config_lib.flat(config), config_lib.flat(config_lib.base_config())
    changed = [k for k in unread_keys(name) if k in given and given[k] != default[k]
               and not (isinstance(default[k], tuple) and tuple(given[k]) == default[k])]
    if changed and jax.process_index() == 0:
        print(f"note: task {name!r} does not read {describe_readers(changed)}: set here, "
              f"they do nothing", file=sys.stderr)


def note_shipped_prompts(config, data_name: str) -> None:
    """A note where a run keeps the shipped configs' sample prompts (config.SHIPPED_PROMPTS)
    on other data than theirs: its samples continue Python's 'def ' on a user's novels.
    Training only (a reader samples what it is asked)."""
    from attention_jax import config as config_lib
    prompts = tuple(config.eval.sample_prompts)
    if not prompts or data_is_on_demand() or jax.process_index() != 0:
        return
    for dataset, shipped in config_lib.SHIPPED_PROMPTS.items():
        if set(prompts) <= set(shipped) and not data_name.startswith(dataset):
            print(f"note: config.eval.sample_prompts={prompts!r} are the prompts for the "
                  f"shipped {dataset!r} data, and this run reads data.name={data_name!r}: "
                  f"give your own, e.g. --config.eval.sample_prompts='(\"The \",)', or "
                  f"none, '()'", file=sys.stderr)
            return


def unread_keys(task: str) -> tuple[str, ...]:
    """The keys of config.TASK_KEYS registered task `task` does not read (() for a task
    that declared nothing: TASKS[name] = make)."""
    from attention_jax import config as config_lib
    reads = getattr(TASKS.get(task), "reads", None)
    return () if reads is None else tuple(k for k in config_lib.TASK_KEYS if k not in reads)


def describe_readers(keys: Sequence[str]) -> str:
    """`keys` with the registered tasks that read them, those of the same tasks together:
    "config.a, config.b (read by gpt); config.c (read by no task)"."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for key in keys:
        readers = tuple(sorted(n for n, make in TASKS.items()
                               if key in getattr(make, "reads", ())))
        groups.setdefault(readers, []).append(f"config.{key}")
    return "; ".join(f"{', '.join(group)} (read by {', '.join(readers) or 'no task'})"
                     for readers, group in groups.items())


def tasks_with(entry: str) -> list[str]:
    """The registered tasks that declare the optional Task `entry` (see register)."""
    return sorted(n for n, make in TASKS.items() if entry in getattr(make, "provides", ()))


def declared_for(mode: str, name: str, entries: Sequence[str], doing: str, hint: str = ""):
    """The entries registered task `name` declares (None where it declares nothing:
    TASKS[name] = make; its built Task tells), or, where it declares none of `entries`, a
    ConfigError "--mode=M: task N cannot DOING; valid: [the tasks that do]": a reading
    mode's refusal before stdin is read or the run is loaded."""
    declared = getattr(TASKS.get(name), "provides", None)
    if declared is not None and not set(entries) & set(declared):
        valid = sorted(t for entry in entries for t in tasks_with(entry))
        raise ConfigError(f"--mode={mode}: task {name!r} cannot {doing}; valid: {valid}{hint}")
    return declared


def need(task: Task, entry: str, name: str, doing: str):
    """task.<entry>, or a ConfigError naming task `name` (config.task) and the registered
    tasks that have it: "task 'vit' cannot translate; valid: ['encdec', 'rnn_seq2seq']"."""
    check_choice("entry", entry, OPTIONAL)
    value = getattr(task, entry)
    if value is None:
        raise ConfigError(f"task {name!r} cannot {doing} (its Task has no {entry}); "
                          f"valid: {tasks_with(entry)}")
    return value


def check_model_keys(cls, config) -> None:
    """A ConfigError naming a `config.model` key that is no field of `cls` (a typo set in
    a notebook, `c.model.num_layer = 4`): the tasks call it before reading any data, so
    it is said at once, not after the dataset is built."""
    fields = {f.name for f in dataclasses.fields(cls)} | {"variant"}
    # A key set to None is not set (model_config): a template's other families' keys.
    unknown = sorted(k for k, v in config.model.to_dict().items()
                     if v is not None and k not in fields)
    if unknown:
        raise ConfigError(f"config.model.{unknown[0]} is not a field of {cls.__name__}; "
                          f"valid: {sorted(fields)}{did_you_mean(unknown[0], fields)}")


# Model keys read only by mlp="moe", the router losses' weights among them.
EXPERT_KEYS = ("num_experts", "top_k", "capacity_factor", "moe_loss_weight",
               "router_z_loss_weight")


# What stands in for the vocabulary's size before there is a tokenizer
# (check_model_config): large enough for any special id a check compares with it.
LOOSE_VOCAB = 1 << 20


def check_model_config(cls, config, **data_fields) -> None:
    """check_model_keys, then the model's config built with `data_fields` standing in for
    the fields the data decides (the vocabulary: LOOSE_VOCAB, its special ids): a bad
    value of a key of the model's own (remat_policy='foo', heads that do not divide
    d_model) is said before a corpus is read and a tokenizer trained on it, which on a
    large corpus took minutes before the error came."""
    check_model_keys(cls, config)
    _build_model_config(cls, config, data_fields)


def model_config(cls, config, **forced):
    """The model's frozen config from `config.model`: an optional `variant` name (the
    model file's table) plus overrides of its fields; a key set to None is not set (the
    variant's value, else the field's default). Unknown keys name the valid ones."""
    check_model_keys(cls, config)
    cfg, given = _build_model_config(cls, config, forced)
    # The experts' keys of a dense MLP were ignored, unsaid. A note, not an error: a run
    # that set them (the ablation's dense baseline did) continues as it trained.
    moe_keys = [k for k in EXPERT_KEYS if k in given]
    if (moe_keys and getattr(cfg, "mlp", "moe") != "moe" and not data_is_on_demand()
            and jax.process_index() == 0):
        print(f"note: config.model.{', '.join(moe_keys)} "
              f"{'is' if len(moe_keys) == 1 else 'are'} read only with config.model.mlp='moe' "
              f"(now {cfg.mlp!r}): this dense MLP has no experts", file=sys.stderr)
    return cfg


def _build_model_config(cls, config, forced: dict):
    """(the model's config, the keys config.model sets) for model_config and
    check_model_config; a refused value is a ConfigError."""
    given = {k: v for k, v in config.model.to_dict().items() if v is not None}
    variant = given.pop("variant", None)
    kwargs = {**given, **forced}
    # Dropout probabilities of any model family (dropout_rate, attention_dropout_rate),
    # said as config keys (the model configs refuse them too, a variant's own included).
    for name, value in kwargs.items():
        if name.endswith("dropout_rate") and isinstance(value, (int, float)):
            check_range(f"model.{name}", value, "[0, 1)")
    try:
        cfg = cls.from_variant(variant, **kwargs) if variant else cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.model: {e}") from None
    return cfg, given


# Valid ranges of the `config.data` keys the adapters share (a key a task lacks is skipped).
DATA_RANGES = {"mask_rate": "(0, 1)", "seq_len": "[1, inf)", "source_len": "[1, inf)",
               "target_len": "[1, inf)", "vocab_size": "[1, inf)", "max_files": "[0, inf)",
               "max_documents": "[0, inf)", "padding": "[0, inf)"}


def check_file_options(data_opts) -> None:
    """The options of data.name="files" (text or sentence pairs), checked before a file
    is listed: the held-out fraction, the bad records' limit, and the two splits it has."""
    from attention_jax.data import files
    check_range("data.eval_fraction", data_opts.eval_fraction, "(0, 1)")
    check_range("data.max_bad_records", data_opts.max_bad_records, "[0, inf)")
    for key in ("train_split", "eval_split"):
        if data_opts[key] not in files.SPLITS:
            raise ConfigError(f"config.data.{key}={data_opts[key]!r}: the files source has "
                              f"the splits {list(files.SPLITS)}")


def check_source_keys(data_opts, source: str, keys) -> None:
    """A ConfigError when one of `keys` (e.g. files, root) is set while config.data.name
    is not `source`, the only source that reads them: it would be ignored silently. Set:
    not empty; for keys with a default (config.SOURCE_KEY_DEFAULTS: eval_fraction,
    max_bad_records), other than it (checked in training: a reader of an older run is
    not stopped by what it ignores)."""
    from attention_jax import config as config_lib
    if data_opts.name == source:
        return
    for key in (*keys, *(() if data_is_on_demand() else config_lib.SOURCE_KEY_DEFAULTS)):
        if key not in data_opts:
            continue
        default = config_lib.SOURCE_KEY_DEFAULTS.get(key)
        if data_opts[key] if default is None else data_opts[key] != default:
            raise ConfigError(f"config.data.{key}={data_opts[key]!r} is read only with "
                              f"config.data.name={source!r} (now {data_opts.name!r}); set "
                              f"--config.data.name={source}")


def data_options(config, **defaults) -> ml_collections.ConfigDict:
    """`config.data` checked against the task's keys (with their defaults and types)."""
    given = config.data.to_dict()
    for key, value in given.items():
        if key not in defaults:
            raise ConfigError(f"config.data.{key} is not a key of task {config.task!r}; "
                              f"valid: {sorted(defaults)}")
        want = type(defaults[key])
        if not isinstance(value, want) and not (want is float and isinstance(value, int)):
            raise ConfigError(f"config.data.{key}={value!r} must be {want.__name__}")
    merged = {**defaults, **given}
    for key, interval in DATA_RANGES.items():
        if key in merged:
            check_range(f"data.{key}", merged[key], interval)
    # Keys with a fixed set of values, checked before any data is built.
    from attention_jax.data.objectives import PACKINGS
    from attention_jax.data.tokenization import KINDS, is_tokenizer_path
    for key, valid in (("tokenizer", KINDS), ("packing", PACKINGS)):
        # A tokenizer may also be a path (a tokenizer.json or a directory holding one),
        # read by run_tokenizer, where a saved copy in the workdir takes precedence.
        if key in merged and not (key == "tokenizer" and is_tokenizer_path(merged[key])):
            check_choice(f"config.data.{key}", merged[key], valid)
    return ml_collections.ConfigDict(merged)


def as_text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def held_out_files_alone(data_opts) -> bool:
    """Whether the eval split is the user's data.eval_files, a function of those files
    alone (not a draw from data.files): a reader's evaluation then neither lists nor
    reads the training files, which may have moved or be far away."""
    return (data_opts.name == "files" and bool(data_opts.eval_files)
            and data_opts.eval_split == "validation")


def record_splits(data_opts, fields: Sequence[str], *, holds: str, hint: str,
                  integer_fields: Sequence[str] = (), held_out_only: bool = False):
    """(train, eval) sources of a task whose records hold several keys (sentence pairs,
    labelled texts): a dataset's splits, or with data.name="files" the records of the
    user's .jsonl/.parquet files, each holding `fields`. holds: what a record holds, for
    the message when no files are given; hint: the settings that name the keys, for a
    file that lacks one; integer_fields: keys whose integers read as text (labels).
    held_out_only (where held_out_files_alone): (None, eval), the training files unread."""
    from attention_jax.data import files
    check_source_keys(data_opts, "files", ("files", "eval_files"))
    if data_opts.name != "files":
        return splits(data_opts)
    if not data_opts.files:
        raise ConfigError(f"config.data.name='files' needs --config.data.files=GLOBS "
                          f"(comma-separated globs of .jsonl[.gz|.zst], .parquet, .csv or .tsv "
                          f"files whose records hold {holds})")
    if "id" in fields:  # the record's own key (file and line)
        raise ConfigError(f"config.data: a key is 'id' ({list(fields)}), which names a "
                          f"record's file and line here; valid: other keys (rename that "
                          f"field in the files)")
    check_file_options(data_opts)
    found = files.file_splits(
        data_opts.files, data_opts.eval_files, eval_fraction=data_opts.eval_fraction,
        max_bad_records=data_opts.max_bad_records, arg="config.data.", fields=tuple(fields),
        fields_hint=hint, integer_fields=tuple(integer_fields), held_out_only=held_out_only)
    return (None if held_out_only else found[data_opts.train_split]), found[data_opts.eval_split]


@dataclasses.dataclass(frozen=True, eq=False)  # (an array field: compare the fields)
class WholeRecords:
    """What complete_records found in a split: the records kept (those whose texts all
    hold some text), a digest of what they hold, and the distinct labels of the key it
    was asked to list."""
    count: int  # records read
    dropped: np.ndarray  # int64 indices of those left out
    digest: str  # '' where none was asked for
    labels: tuple[str, ...] = ()

    @property
    def kept(self) -> int:
        return self.count - len(self.dropped)

    def indices(self) -> np.ndarray | None:
        """The indices of the records kept; None: every one (no list of millions)."""
        if not len(self.dropped):
            return None
        return np.delete(np.arange(self.count, dtype=np.int64), self.dropped)


def cache_root(data_opts) -> str:
    """Where what is derived from a split's records is kept (the LM's token cache, the
    records cache): data.cache_dir, else DATA_DIR/token_cache."""
    from attention_jax.data.sources import default_data_dir
    return data_opts.get("cache_dir") or os.path.join(
        data_opts.get("data_dir") or default_data_dir(), "token_cache")


def complete_records(records, keys, *, labels_of: str = "", spaces_are_empty: bool = True,
                     digest: bool = True, cache: str | None = None) -> WholeRecords:
    """Which of `records` hold some text under every one of `keys`, a digest of those
    records' contents (without `digest`, ''), and the distinct labels (pipelines.
    label_text) under `labels_of` among them, in one pass that reads each record once. A
    blank line or a bad record of the user's files reads as empty: the tasks leave such
    records out; with spaces_are_empty, a text of spaces only too. `cache`: the root of
    the records cache (data/records_cache.py), where the pass's result is kept for the
    next start on the same records; None: nothing kept."""
    from attention_jax.data import records_cache
    from attention_jax.data.loaders import digest_record
    from attention_jax.data.pipelines import label_text

    def read() -> dict:
        dropped, labels, hashed = [], set(), hashlib.sha256()
        for i in range(len(records)):
            record = records[i]
            texts = [as_text(record[k]) for k in keys]
            if not all(t.strip() if spaces_are_empty else t for t in texts):
                dropped.append(i)
                continue
            if digest:
                digest_record(hashed, record)
            if labels_of:
                labels.add(label_text(record[labels_of]))
        return {"count": len(records), "dropped": np.asarray(dropped, np.int64),
                "digest": hashed.hexdigest()[:16] if digest else "", "labels": sorted(labels)}
    what = {"pass": "complete records", "keys": list(keys), "labels_of": labels_of,
            "spaces_are_empty": spaces_are_empty, "digest": digest}
    found = records_cache.remembered(cache, records, what, read)
    return WholeRecords(int(found["count"]), np.asarray(found["dropped"], np.int64),
                        found["digest"], tuple(found["labels"]))


def run_tokenizer(data_opts, workdir: str, texts: Callable[[], list[str]], *,
                  pad_may_be_eos: bool = False):
    """The run's tokenizer: the one saved in the workdir (so a resumed run, eval and
    sampling decode with exactly the training vocabulary), else a new one.

    config.data.tokenizer is a kind (KINDS) or a path to a tokenizer.json (or a directory
    holding one), used as it is. Such a file without a pad token pads with its
    end-of-text token; only a task whose loss tells padding by position, not by id
    (`pad_may_be_eos`: the LM's weights come from segment ids), accepts that."""
    from attention_jax import data
    from attention_jax.data import tokenization
    from_file = tokenization.is_tokenizer_path(data_opts.tokenizer)
    kind = "file" if from_file else data_opts.tokenizer
    # A remote workdir's tokenizer (gs://, s3://) is read from a local copy.
    saved = workdir_lib.local_dir(workdir, workdir_lib.TOKENIZER)
    if saved and os.path.exists(os.path.join(saved, "tokenizer_meta.json")):
        tok = data.load_tokenizer(saved)
        if tok.kind != kind:
            raise ConfigError(f"config.data.tokenizer={data_opts.tokenizer!r} but "
                              f"{workdir_lib.path(workdir, workdir_lib.TOKENIZER)} holds a "
                              f"{tok.kind!r} tokenizer; use a new workdir to change it")
        if from_file:
            _say_if_replaced(data_opts.tokenizer, saved, workdir)
        return tok
    if from_file:
        try:
            # Without pad_may_be_eos the tokenizer refuses a file with no pad token itself,
            # before it prints its note that the end-of-text token will pad instead.
            return tokenization.FileTokenizer(data_opts.tokenizer, pad_stand_in=pad_may_be_eos)
        except tokenization.TokenizerFileError as e:
            reason = str(e).removeprefix(f"{data_opts.tokenizer}: ")  # named once is enough
            raise ConfigError(f"config.data.tokenizer={data_opts.tokenizer!r}: {reason}") from None
    if data_opts.tokenizer in ("byte", "wordpiece"):
        return data.get_tokenizer(data_opts.tokenizer)
    least = 256 + len(tokenization.BPETokenizer.SPECIALS)
    if data_opts.tokenizer == "bpe" and data_opts.vocab_size < least:
        # (the library would train one of `least` tokens anyway, unasked)
        raise ConfigError(f"config.data.vocab_size={data_opts.vocab_size}: a byte-level BPE "
                          f"holds its 256 bytes and {least - 256} special tokens at least; "
                          f"valid: vocab_size >= {least}")
    tok = data.get_tokenizer(data_opts.tokenizer, texts=texts(), vocab_size=data_opts.vocab_size)
    if data_opts.tokenizer == "bpe" and tok.vocab_size < data_opts.vocab_size:
        # The corpus ran out of pairs to merge: a smaller vocabulary than asked, said (a
        # model sized for the one asked would be surprising unsaid).
        print(f"note: config.data.vocab_size={data_opts.vocab_size}: the BPE learned "
              f"{tok.vocab_size} tokens, all the training text's merges allow", file=sys.stderr)
    return tok


def _say_if_replaced(source: str, saved: str, workdir: str) -> None:
    """A note when config.data.tokenizer's file is no longer the one the run copied: the
    run keeps its copy (its checkpoints' ids are that vocabulary's), which a user who
    replaced the file would not expect unsaid."""
    import filecmp
    from attention_jax.data import tokenization
    try:
        path = tokenization.tokenizer_file(source)
        same = filecmp.cmp(path, os.path.join(saved, "tokenizer.json"), shallow=False)
    except (OSError, tokenization.TokenizerFileError):  # moved or deleted since: the copy
        return  # is all there is, as documented
    if not same and jax.process_index() == 0:
        print(f"note: config.data.tokenizer={source!r} is not the file this run copied when "
              f"it started; the run keeps its copy ({workdir_lib.path(workdir, workdir_lib.TOKENIZER)}"
              f": its checkpoints' ids are that vocabulary's); to train with the new file, use "
              f"a new workdir", file=sys.stderr)


# ================================================================== a classifier's classes
CLASSES_FILE = "classes.json"  # the run's class names, in label order


def save_classes(workdir: str, classes) -> None:
    workdir_lib.epath_of(workdir, CLASSES_FILE).write_text(json.dumps(list(classes)))


def saved_classes(workdir: str) -> list[str] | None:
    """The class names the run in `workdir` trained on, or None (none saved yet)."""
    saved = workdir_lib.epath_of(workdir, CLASSES_FILE) if workdir else None
    return json.loads(saved.read_text()) if saved is not None and saved.exists() else None


def has_trained(workdir: str) -> bool:
    """Whether the workdir holds a checkpoint's step folder, intact or not: whether a run
    there trained at all, or only started. A listing that fails answers True: what this
    guards (a resume's classes) is then checked."""
    try:
        return bool(ckpt_lib.step_folders(workdir_lib.epath_of(workdir, workdir_lib.CHECKPOINTS)))
    except OSError:
        return True


def check_classes(workdir: str, classes) -> None:
    """A run continued (or evaluated) on other classes than it trained on is an error,
    never a silently different dataset (image folders, a file's labels). Those of a start
    that saved no checkpoint (it stopped at a mistake since mended) are only replaced."""
    before = saved_classes(workdir) if classes else None
    if before is not None and before != list(classes) and has_trained(workdir):
        changed = sorted(set(before) ^ set(classes))[:5] or "their order"
        raise ConfigError(f"{workdir_lib.path(workdir, CLASSES_FILE)} holds the {len(before)} "
                          f"classes this run trained on; the data now has {len(classes)} "
                          f"(differing: {changed}); valid: the same classes, or a new workdir")


def padded_vocab(n: int, multiple: int = 64) -> int:
    """Vocabulary rounded up so the vocab axis splits over any tensor size up to 64 and
    the matmuls get hardware-friendly shapes (nanoGPT pads 50257 to 50304 likewise);
    the extra rows are never targets, so they only learn to be unlikely."""
    return -(-n // multiple) * multiple


def lm_vocab_size(config, tokens: int) -> int:
    """The LM's vocabulary: the tokenizer's `tokens` padded to a multiple of 64, or
    config.model.vocab_size when given (at least `tokens`): e.g. 50304, GPT-2's padded
    size, so a byte-level run has GPT-2's LM head and FLOPs; the extra rows are never
    targets."""
    asked = config.model.get("vocab_size")
    if not asked:
        return padded_vocab(tokens)
    if asked < tokens:
        raise ConfigError(f"config.model.vocab_size={asked} is smaller than the tokenizer's "
                          f"{tokens} tokens; valid: at least {tokens}, or unset (the "
                          f"tokenizer's size padded to a multiple of 64: {padded_vocab(tokens)})")
    return asked


# ============================================================= data read on first use
_ON_DEMAND = contextvars.ContextVar("data_on_demand", default=False)


@contextlib.contextmanager
def data_on_demand():
    """Tasks built inside it read their data on first use, not when built: reading a
    trained run (sampling, embedding, a text's attention maps) needs its tokenizer and
    weights, not its corpus, which may have moved since; evaluating reads it then.
    (train.setup builds a reader's task so: setup(read_only=True).)"""
    token = _ON_DEMAND.set(True)
    try:
        yield
    finally:
        _ON_DEMAND.reset(token)


def data_is_on_demand() -> bool:
    return _ON_DEMAND.get()


class OnDemand:
    """The split `build()` returns, built when first used: its length, an example, or any
    attribute of the split (read_rows, num_tokens, ...). Pickles as the built split (a
    grain worker gets the data, not the builder)."""

    def __init__(self, build: Callable[[], Sequence]):
        self._build, self._split = build, None

    def _get(self):
        if self._split is None:
            self._split = self._build()
        return self._split

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):
        return self._get()[i]

    def __getattr__(self, name):
        if name.startswith("_"):  # ours, before __init__ set them (unpickling)
            raise AttributeError(name)
        return getattr(self._get(), name)

    def __reduce__(self):
        return _built, (self._get(),)


def _built(split):
    return split


def splits(data_opts, **options):
    """The train and eval splits; a dataset that is unknown or not prepared here is a
    ConfigError naming config.data.name (the message says how to prepare it), a split it
    lacks or one with no records a ConfigError naming config.data.train_split/eval_split."""
    from attention_jax import data
    from attention_jax.data import sources

    offline = data_opts.name.split("/")[0] in sources.OFFLINE
    check_dataset_name(data_opts.name, [*sources.OFFLINE, *sources.CATALOGUE_EXAMPLES])

    def get(key):
        try:
            src = data.get_dataset(data_opts.name, data_opts[key], data_opts.data_dir or None,
                                   **(options if offline else {}))
        except data.DatasetNotFoundError as e:
            known = [*sources.OFFLINE, *sources.CATALOGUE_EXAMPLES]
            hint = "" if data_opts.name in known else did_you_mean(data_opts.name, known)
            message = str(e)
            if (data_opts.data_dir and not workdir_lib.is_remote(data_opts.data_dir)
                    and not os.path.isdir(os.path.expanduser(data_opts.data_dir))):
                # A mistyped data_dir may be the real cause, and tfds' message ("not in the
                # tfds catalogue") never says the folder is missing: said on its first line.
                first, sep, rest = message.partition("\n")
                message = (f"{first} (config.data.data_dir={data_opts.data_dir!r} does not "
                           f"exist){sep}{rest}")
            raise ConfigError(f"config.data.name={data_opts.name!r}{hint}: {message}") from None
        except sources.SplitError as e:  # the split named where the user set it
            raise ConfigError(f"config.data.{key}={data_opts[key]!r}: {e}") from None
        if options and not offline:  # e.g. max_files, which only the offline corpora have
            key, value = next(iter(options.items()))
            raise ConfigError(f"config.data.{key}={value!r} applies only to the offline "
                              f"datasets {sorted(sources.OFFLINE)}; set it to 0 for "
                              f"{data_opts.name!r}")
        return src
    return get("train_split"), get("eval_split")


def check_dataset_name(name: str, known) -> None:
    """A path given where a dataset name is expected is one line, not the tfds name
    parser's traceback: `name` names a dataset (a tfds name such as 'lm1b' or
    'python_stdlib/small'), never a file or folder."""
    looks_like_path = (name.startswith(("/", "./", "../", "~")) or os.sep * 2 in name
                       or (os.sep in name and os.path.exists(name))
                       or os.path.splitext(name)[1] in (".txt", ".json", ".jsonl", ".gz",
                                                        ".parquet", ".csv", ".png", ".jpg"))
    if looks_like_path:
        raise ConfigError(
            f"config.data.name={name!r} is a path, but config.data.name names a dataset; "
            f"valid: {list(known)} or any prepared tensorflow-datasets name; for your own "
            f"text files: --config.data.name=files --config.data.files={name}")


def corpus_options(data_opts) -> dict:
    return {"max_files": data_opts.max_files} if data_opts.max_files else {}


def until_eos(ids, eos_id: int) -> list[int]:
    """A generated row's ids before its first end token (all of them without one)."""
    ids = [int(t) for t in ids]
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def gather_rows(x) -> np.ndarray:
    """A generated batch whole on every process (with several, each holds only its rows of
    the global array); every process must call it, as they all call the generation."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def data_parallel_size() -> int:
    """Devices the batch is split over in the current mesh (jax.set_mesh), 1 without one."""
    from attention_jax import sharding
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in sharding.BATCH_AXES)
