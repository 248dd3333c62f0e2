"""What differs between model families: a `Task` per `config.task` (model, data, loss, and
the optional entries the tools use: sample, decode, embed, attention maps, FLOPs).

The trainer knows nothing about GPT or ViT; it asks `TASKS[config.task]`
for a `Task` and runs it. Each adapter here reads `config.model` (checked against the
model's own config dataclass) and `config.data` (checked against the adapter's keys),
builds the offline dataset splits and the tokenizer, and returns the loss function.
main's modes and the tools (analysis, viz, fits) ask the Task too, never `isinstance` on a
model class: a family without an entry gets `need`'s one-line error naming the tasks that
have it. A notebook or a test can register its own: `tasks.TASKS["mine"] = make_my_task`,
or `tasks.register("mine", make_my_task, provides=(...))` to be named in those errors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
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
from attention_jax.models import flops
from attention_jax.models.losses import cross_entropy


# ===================================================================================== task
@dataclasses.dataclass
class Task:
    """What the trainer and the tools need from a model family (built by the adapters in
    TASKS).

    Required:
      model: the linen module; init(rng) -> the params tree (with flax logical-axis boxes);
      loss(params, batch, rng, train) -> (scalar loss, {name: scalar metric});
      train_source, eval_source: random-access (`len`, `[i]`); the transforms map
        (record, np rng) -> example.
    Optional (None: the family cannot; `need` names the registered tasks that can):
      sample(params, rng) -> list[str]: continuations of config.eval.sample_prompts (gpt).
      decode(params, src [B, S] int32, max_len: int) -> tokens [B, max_len] int32: greedy
        translation, EOS kept and pad after it (rnn_seq2seq: RNNSeq2Seq.generate; encdec:
        encdec.greedy_decode).
      embed(params, texts: list[str]) -> np.ndarray [B, D] float32: sentence embeddings,
        mean-pooled, unit length (bert_mlm, through convert.SentenceEncoder).
      attention_input(params, text: str | None = None, *, target: str | None = None,
        index: int = 0) -> AttentionInput: one example to draw the attention of, with its
        labels: a text (gpt, bert_mlm); the eval image `index` (vit); a source sentence
        and its `target`, by default the greedy translation (rnn_seq2seq, encdec). An input
        longer than the model's context raises InputTooLongError before any compute.
      classify(params, batch) -> (predicted [B] int32, labels [B] int32): the predicted
        classes of a batch of eval examples and their labels (vit, cnn).
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
    unit: str = "examples"  # throughput unit in the progress bar: tokens | examples.
    count: Callable[[dict], int] | None = None  # units in a host batch (default: rows).
    save_assets: Callable[[str], None] | None = None  # e.g. the tokenizer into the workdir.
    seq_len: int | None = None  # tokens per example when fixed (checked against mesh.sequence).
    sample: Callable[[Any, jax.Array], list[str]] | None = None
    decode: Callable[[Any, Any, int], Any] | None = None
    embed: Callable[[Any, Sequence[str]], np.ndarray] | None = None
    attention_input: Callable[..., AttentionInput] | None = None
    classify: Callable[[Any, dict], tuple[np.ndarray, np.ndarray]] | None = None
    flops_per_unit: Callable[[Any], float] | None = None
    tokens_per_example: int | None = None


# The optional entries a tool may `need`; `register` checks an adapter sets exactly the
# ones it declares, so the error for a task without one can name the tasks with it
# without building them (building loads data).
OPTIONAL = ("sample", "decode", "embed", "attention_input", "classify", "flops_per_unit",
            "tokens_per_example")


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
    itself is added to the objective by the model, as aux["moe_loss"].)
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


MOE_KEYS = ("load_balance_loss", "router_entropy", "dropped_fraction", "expert_load")


# ================================================================================ adapters
# config.task -> function(config, workdir) -> Task. The model families register below; a
# notebook or a test can add its own (`TASKS["mine"] = make_my_task`).
TASKS: dict[str, Callable[[Any, str], Task]] = {}


def register(name: str, make: Callable[[Any, str], Task], provides: Sequence[str] = ()) -> None:
    """TASKS[name] = make, declaring the optional Task entries it sets (OPTIONAL), so that
    `need` can name the tasks with an entry without building any. A build that sets other
    entries than it declares is a bug here and raises."""
    unknown = sorted(set(provides) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"provides={unknown} are not optional Task entries; valid: {OPTIONAL}")
    declared = frozenset(provides)

    @functools.wraps(make)
    def build(config, workdir: str) -> Task:
        task = make(config, workdir)
        found = {f for f in OPTIONAL if getattr(task, f) is not None}
        if found != declared:
            raise AssertionError(f"task {name!r} sets {sorted(found)} but declares "
                                 f"{sorted(declared)}: fix its register(..., provides=)")
        return task

    build.provides = declared
    TASKS[name] = build


def tasks_with(entry: str) -> list[str]:
    """The registered tasks that declare the optional Task `entry` (see register)."""
    return sorted(n for n, make in TASKS.items() if entry in getattr(make, "provides", ()))


def need(task: Task, entry: str, name: str, doing: str):
    """task.<entry>, or a ConfigError naming task `name` (config.task) and the registered
    tasks that have it: "task 'vit' cannot translate; valid: ['encdec', 'rnn_seq2seq']"."""
    check_choice("entry", entry, OPTIONAL)
    value = getattr(task, entry)
    if value is None:
        raise ConfigError(f"task {name!r} cannot {doing} (its Task has no {entry}); "
                          f"valid: {tasks_with(entry)}")
    return value


def model_config(cls, config, **forced):
    """The model's frozen config from `config.model`: an optional `variant` name (the
    model file's table) plus overrides of its fields. Unknown keys name the valid ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    given = config.model.to_dict()
    variant = given.pop("variant", None)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ConfigError(f"config.model.{unknown[0]} is not a field of {cls.__name__}; "
                          f"valid: {sorted(fields | {'variant'})}")
    kwargs = {**given, **forced}
    try:
        cfg = cls.from_variant(variant, **kwargs) if variant else cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.model: {e}") from None
    # Dropout probabilities of any model family (dropout_rate, attention_dropout_rate),
    # checked on the resolved config so a variant's own values are covered too.
    for f in dataclasses.fields(cfg):
        if f.name.endswith("dropout_rate") and isinstance(getattr(cfg, f.name), (int, float)):
            check_range(f"model.{f.name}", getattr(cfg, f.name), "[0, 1)")
    return cfg


# Valid ranges of the `config.data` keys the adapters share (a key a task lacks is skipped).
DATA_RANGES = {"mask_rate": "(0, 1)", "seq_len": "[1, inf)", "source_len": "[1, inf)",
               "target_len": "[1, inf)", "vocab_size": "[1, inf)", "max_files": "[0, inf)",
               "max_documents": "[0, inf)", "padding": "[0, inf)"}


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
    from attention_jax.data.tokenization import KINDS
    for key, valid in (("tokenizer", KINDS), ("packing", PACKINGS)):
        if key in merged:
            check_choice(f"config.data.{key}", merged[key], valid)
    return ml_collections.ConfigDict(merged)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _tokenizer(d, workdir: str, texts: Callable[[], list[str]]):
    """The run's tokenizer: the one saved in the workdir (so a resumed run, eval and
    sampling decode with exactly the training vocabulary), else a new one."""
    from attention_jax import data
    saved = workdir_lib.path(workdir, workdir_lib.TOKENIZER)
    if os.path.exists(os.path.join(saved, "tokenizer_meta.json")):
        tok = data.load_tokenizer(saved)
        if tok.kind != d.tokenizer:
            raise ConfigError(f"config.data.tokenizer={d.tokenizer!r} but {saved} holds a "
                              f"{tok.kind!r} tokenizer; use a new workdir to change it")
        return tok
    if d.tokenizer in ("byte", "wordpiece"):
        return data.get_tokenizer(d.tokenizer)
    return data.get_tokenizer(d.tokenizer, texts=texts(), vocab_size=d.vocab_size)


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


def _splits(d, **options):
    """The train and eval splits; a dataset that is unknown or not prepared here is a
    ConfigError naming config.data.name (the message says how to prepare it)."""
    from attention_jax import data
    from attention_jax.data import sources

    offline = d.name.split("/")[0] in sources.OFFLINE

    def get(key):
        try:
            src = data.get_dataset(d.name, d[key], d.data_dir or None,
                                   **(options if offline else {}))
        except data.DatasetNotFoundError as e:
            known = [*sources.OFFLINE, *sources.CATALOGUE_EXAMPLES]
            hint = "" if d.name in known else did_you_mean(d.name, known)
            raise ConfigError(f"config.data.name={d.name!r}{hint}: {e}") from None
        if options and not offline:  # e.g. max_files, which only the offline corpora have
            key, value = next(iter(options.items()))
            raise ConfigError(f"config.data.{key}={value!r} applies only to the offline "
                              f"datasets {sorted(sources.OFFLINE)}; set it to 0 for "
                              f"{d.name!r}")
        return src
    return get("train_split"), get("eval_split")


def _corpus_options(d) -> dict:
    return {"max_files": d.max_files} if d.max_files else {}


def data_parallel_size() -> int:
    """Devices the batch is split over in the current mesh (jax.set_mesh), 1 without one."""
    from attention_jax import sharding
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in sharding.BATCH_AXES)


def _text_attention_input(tok, context: int | None, name: str):
    """Task.attention_input of a text model (gpt, bert_mlm): the text's ids [1, T]."""
    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params, index  # a text's ids are all the model reads
        if text is None:
            raise ValueError(f"text=None: task {name!r} draws its attention on a text; give one")
        if target is not None:
            raise ValueError(f"target={target!r}: task {name!r} reads one text; a target is "
                             f"for the translation tasks {tasks_with('decode')}")
        ids = tok.encode(text)
        check_context(len(ids), context, "text")
        if not ids:
            raise ValueError(f"text={text!r} encodes to no tokens; give some text")
        labels = token_labels(tok, ids)
        return AttentionInput(inputs=(np.array([ids], np.int32),),
                              labels={"self": (labels, labels)}, info={"tokens": labels})
    return attention_input


def lm_task(config, workdir: str) -> Task:
    """GPT next-token prediction on packed documents (default: the stdlib corpus)."""
    from attention_jax import data
    from attention_jax.models import gpt
    # packing: "documents" keeps each packed document to itself (segment ids, positions
    # restarting per document); "stream" reads a row as a window of one token stream, as
    # GPT-2 and nanoGPT train (plain causal attention: cuDNN's kernel on a GPU).
    d = data_options(config, name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                     tokenizer="byte", vocab_size=1024, seq_len=128, train_split="train",
                     eval_split="validation", packing="documents")
    train_docs, eval_docs = _splits(d, **_corpus_options(d))
    tok = _tokenizer(d, workdir, lambda: [_text(train_docs[i]["text"])
                                          for i in range(min(len(train_docs), 300))])
    cfg = model_config(gpt.GPTConfig, config, vocab_size=lm_vocab_size(config, tok.vocab_size),
                       dtype=config.train.compute_dtype)
    if cfg.position == "learned" and d.seq_len > cfg.max_len:
        raise ConfigError(f"config.data.seq_len={d.seq_len} exceeds config.model.max_len="
                          f"{cfg.max_len}; valid: seq_len <= {cfg.max_len}")
    model = gpt.GPT(cfg)
    pack = lambda docs: data.packed_lm_source(docs, tok, d.seq_len,
                                              max_documents=d.max_documents or None)

    # train.loss_chunk_size > 0: the head and the loss a chunk of positions at a time (the
    # [B, T, V] logits never exist at once); .get: a run's config.json from before the key.
    chunk_size = config.train.get("loss_chunk_size", 0)

    def loss(params, batch, rng, train):
        (nll, m), aux = gpt.head_loss(
            model, params, batch["inputs"], batch["targets"], batch["weights"],
            chunk_size=chunk_size, label_smoothing=config.optim.label_smoothing if train else 0.0,
            positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
            deterministic=not train, rngs={"dropout": rng})
        return nll + aux.get("moe_loss", 0.0), {"accuracy": m["accuracy"], **moe_metrics(aux)}

    def sample(params, rng):
        prompts = [tok.encode(p) or [tok.bos_id] for p in config.eval.sample_prompts]
        width = max(map(len, prompts))
        new = config.eval.sample_tokens
        if cfg.position == "learned":
            new = min(new, cfg.max_len - width)
        # As many rows as the batch axes split evenly (extra one-token rows, dropped
        # after): otherwise XLA must replicate the activations at every layer.
        rows = -(-len(prompts) // data_parallel_size()) * data_parallel_size()
        prompts = prompts + [[tok.bos_id]] * (rows - len(prompts))
        padded = np.array([p + [tok.pad_id] * (width - len(p)) for p in prompts], np.int32)
        out, lengths = gpt.generate(
            model, params, padded, np.array([len(p) for p in prompts], np.int32),
            max_new_tokens=new, rng=rng, temperature=config.eval.sample_temperature,
            top_k=config.eval.sample_top_k or None, stop_token=tok.eos_id, pad_token=tok.pad_id)
        out, lengths = np.asarray(out), np.asarray(lengths)
        return [tok.decode(out[i, :lengths[i]]) for i in range(len(config.eval.sample_prompts))]

    # An untied head's input table is only looked up; a tied one is the output matmul.
    lookups = flops.LOOKUP_TABLES + (() if cfg.tie_embeddings else ("token_embedding",))
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=data.CausalLM(d.packing), eval_transform=data.CausalLM(d.packing),
                unit="tokens",
                count=lambda b: int(np.sum(b["weights"])), sample=sample,
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)), seq_len=d.seq_len,
                # The position table bounds the input only when it is learned.
                attention_input=_text_attention_input(
                    tok, cfg.max_len if cfg.position == "learned" else None, config.task),
                flops_per_unit=lambda params: flops.flops_per_token(
                    flops.matmul_params(params, lookups), cfg.num_layers, d.seq_len, cfg.d_model),
                tokens_per_example=d.seq_len)


def mlm_task(config, workdir: str) -> Task:
    """BERT masked-language modelling (Devlin et al. 2019) on packed documents."""
    from attention_jax import data
    from attention_jax.models import bert
    d = data_options(config, name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                     tokenizer="bpe", vocab_size=2048, seq_len=128, mask_rate=0.15,
                     train_split="train", eval_split="validation")
    if d.tokenizer not in ("bpe", "wordpiece"):
        raise ConfigError(f"config.data.tokenizer={d.tokenizer!r}: MLM needs a [MASK] token; "
                          f"valid: ['bpe', 'wordpiece']")
    train_docs, eval_docs = _splits(d, **_corpus_options(d))
    tok = _tokenizer(d, workdir, lambda: [_text(train_docs[i]["text"])
                                          for i in range(min(len(train_docs), 300))])
    cfg = model_config(bert.BertConfig, config, vocab_size=padded_vocab(tok.vocab_size),
                       dtype=config.train.compute_dtype)
    model = bert.Bert(cfg)
    pack = lambda docs: data.packed_lm_source(docs, tok, d.seq_len,
                                              max_documents=d.max_documents or None)
    transform = data.MaskedLM.for_tokenizer(tok, d.mask_rate)
    # The MLM head runs on the M predicted positions only (as BERT's own code does): a
    # [B, T, V] logit array would dominate memory for a 30k vocabulary.
    m_slots = math.ceil(d.mask_rate * d.seq_len) + 1

    def loss(params, batch, rng, train):
        _, slots = jax.lax.top_k(batch["weights"], m_slots)  # [B, M] predicted positions
        take = lambda x: jnp.take_along_axis(x, slots, axis=1)
        out, aux = model.apply({"params": params}, batch["inputs"],
                               attention_mask=batch["segment_ids"] != 0,
                               positions=batch["positions"], segment_ids=batch["segment_ids"],
                               masked_positions=slots, deterministic=not train, rngs={"dropout": rng})
        return cross_entropy(out["mlm_logits"], take(batch["targets"]), take(batch["weights"]),
                             config.optim.label_smoothing if train else 0.0)

    encoder = {}  # the last SentenceEncoder, by params: one compilation per restored run

    def embed(params, texts):
        # Imported here: convert is tasks' neighbour layer and train imports both.
        from attention_jax import convert
        if encoder.get("params") is not params:
            host = jax.tree.map(np.asarray, jax.device_get(params))
            encoder.update(params=params, encoder=convert.SentenceEncoder(
                model, host, tok, max_length=cfg.max_len))
        return encoder["encoder"].embed(list(texts))

    # The FLOP count is the full model's (every position through the vocabulary), as the
    # benchmarks count BERT; this loss projects only the ~15% predicted positions.
    return Task(model=model, init=lambda rng: model.init(rng, jnp.ones((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["segment_ids"] != 0)),
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)), seq_len=d.seq_len,
                embed=embed, attention_input=_text_attention_input(tok, cfg.max_len, config.task),
                flops_per_unit=lambda params: flops.flops_per_token(
                    flops.matmul_params(params), cfg.num_layers, d.seq_len, cfg.d_model),
                tokens_per_example=d.seq_len)


def image_task(config, workdir: str) -> Task:
    """Image classification (default: scikit-learn's 8×8 digits): config.task 'vit' uses
    models/vit.py, 'cnn' the residual CNN of models/cnn.py. data.train_fraction < 1
    trains on that share of the training split (data.subset_fraction)."""
    from attention_jax import data
    from attention_jax.models import cnn, vit
    d = data_options(config, name="digits", data_dir="", augment=True, padding=1, flip=False,
                     train_split="train", eval_split="test", train_fraction=1.0)
    train_src, eval_src = _splits(d)
    try:
        train_src = data.subset_fraction(train_src, d.train_fraction)
    except ValueError as e:
        raise ConfigError(f"config.data.train_fraction: {e}") from None
    family = {"vit": (vit.ViTConfig, vit.ViT, _vit_entries),
              "cnn": (cnn.CNNConfig, cnn.CNN, _cnn_entries)}
    config_cls, model_cls, entries = family[config.task]
    cfg = model_config(config_cls, config, dtype=config.train.compute_dtype)
    model = model_cls(cfg)

    def loss(params, batch, rng, train):
        logits, _ = model.apply({"params": params}, batch["image"], deterministic=not train,
                                rngs={"dropout": rng})
        return cross_entropy(logits, batch["label"], None,
                             config.optim.label_smoothing if train else 0.0)

    predict = jax.jit(lambda params, images: jnp.argmax(
        model.apply({"params": params}, images)[0], axis=-1).astype(jnp.int32))

    def classify(params, batch):
        return np.asarray(predict(params, batch["image"])), np.asarray(batch["label"], np.int32)

    shape = (1, cfg.image_size, cfg.image_size, cfg.num_channels)
    eval_transform = data.ImageClassification()
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros(shape))["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=data.ImageClassification(augment=d.augment, padding=d.padding,
                                                         flip=d.flip),
                eval_transform=eval_transform, classify=classify,
                **entries(cfg, eval_src, eval_transform))


def _vit_entries(cfg, eval_src, eval_transform) -> dict:
    # Patches (+ [CLS]): the tokens an image is to the Transformer.
    tokens = cfg.grid_size ** 2 + (1 if cfg.pool == "cls" else 0)
    return dict(tokens_per_example=tokens,
                attention_input=_image_attention_input(cfg, eval_src, eval_transform),
                flops_per_unit=lambda params: tokens * flops.flops_per_token(
                    flops.matmul_params(params), cfg.num_layers, tokens, cfg.d_model))


def _cnn_entries(cfg, eval_src, eval_transform) -> dict:
    # The CNN's stride-1 convolutions run at every pixel of the image.
    return dict(flops_per_unit=lambda params: flops.conv_flops_per_example(
        params, cfg.image_size ** 2))


def _image_attention_input(cfg, source, transform):
    """Task.attention_input of the ViT: eval image `index`, labelled by patch row,column."""
    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params
        if text is not None or target is not None:
            raise ValueError("text= and target= are for text tasks; the ViT draws an eval "
                             "image: give index=")
        if not 0 <= index < len(source):
            raise ValueError(f"index={index}; valid: 0..{len(source) - 1} (the eval split)")
        example = transform(source[index], np.random.default_rng(0))
        side = cfg.grid_size
        labels = [f"{r},{c}" for r in range(side) for c in range(side)]  # row-major patches
        if cfg.pool == "cls":
            labels = ["[CLS]"] + labels
        return AttentionInput(inputs=(np.asarray(example["image"], np.float32)[None],),
                              labels={"self": (labels, labels)}, info={"tokens": labels},
                              title=f"eval image {index} (label {int(example['label'])})")
    return attention_input


def translation_task(config, workdir: str) -> Task:
    """Sequence to sequence, teacher-forced (default: English -> French number words).

    config.task 'rnn_seq2seq' uses models/rnn.py; 'encdec' the Transformer of encdec.py.
    One BPE vocabulary is shared by both languages (Vaswani et al. 2017 §5.1 share one).
    """
    from attention_jax import data
    d = data_options(config, name="number_translation", data_dir="", source="en", target="fr",
                     tokenizer="bpe", vocab_size=512, source_len=32, target_len=32,
                     train_split="train", eval_split="validation")
    train_src, eval_src = _splits(d)
    tok = _tokenizer(d, workdir, lambda: [_text(train_src[i][k]) for i in range(len(train_src))
                                          for k in (d.source, d.target)])
    ids = dict(pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
    vocab = padded_vocab(tok.vocab_size)
    if config.task == "rnn_seq2seq":
        from attention_jax.models import rnn
        cfg = model_config(rnn.RNNConfig, config, vocab_size=vocab,
                           dtype=jnp.dtype(config.train.compute_dtype), **ids)
        model = rnn.RNNSeq2Seq(cfg)
        generate = jax.jit(lambda params, src, max_len: model.apply(
            {"params": params}, src, max_len=max_len, method=model.generate)[0],
            static_argnums=2)
        decode = lambda params, src, max_len: generate(params, src, int(max_len))
        # Recurrent: no PaLM count (its additive attention is no Transformer's 12·L·T·D).
        entries = {}
    else:
        from attention_jax.models import encdec
        cfg = model_config(encdec.EncDecConfig, config, vocab_size=vocab,
                           dtype=config.train.compute_dtype, **ids)
        model = encdec.EncoderDecoder(cfg)
        decode = lambda params, src, max_len: encdec.greedy_decode(model, params, src,
                                                                   max_len=int(max_len))
        entries = dict(flops_per_unit=lambda params: _encdec_flops(cfg, d, params))

    def loss(params, batch, rng, train):
        logits, aux = model.apply({"params": params}, batch["inputs"], batch["decoder_inputs"],
                                  deterministic=not train, rngs={"dropout": rng})
        return cross_entropy(logits, batch["targets"], batch["target_weights"],
                             config.optim.label_smoothing if train else 0.0)

    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del index  # a translation is drawn on a source text
        if text is None:
            raise ValueError(f"text=None: task {config.task!r} draws its attention on a source "
                             f"sentence; give one")
        src = tok.encode(text)
        check_context(len(src), d.source_len, "the source text")
        if not src:
            raise ValueError(f"text={text!r} encodes to no tokens; give a source sentence")
        src_arr = np.array([src], np.int32)
        if target is not None:
            tgt = tok.encode(target) + [tok.eos_id]  # Targets end with EOS, as in training.
        else:  # The model's own translation: greedy, cut after its EOS.
            out = np.asarray(decode(params, src_arr, d.target_len))[0]
            ends = np.flatnonzero(out == tok.eos_id)
            tgt = out[:ends[0] + 1 if len(ends) else len(out)].tolist()
        check_context(len(tgt), d.target_len, "the target")
        # Teacher-forced on the target: row i is the attention while predicting token i.
        tgt_in = np.array([[tok.bos_id] + tgt[:-1]], np.int32)
        s, t = token_labels(tok, src), token_labels(tok, tgt)
        return AttentionInput(inputs=(src_arr, tgt_in),
                              labels={"cross": (t, s), "encoder": (s, s), "decoder": (t, t)},
                              info={"source": s, "target": t, "translation": tok.decode(tgt)},
                              title=f"{d.source}→{d.target}", alignment="cross")

    transform = data.Translation(tok, tok, d.source, d.target, d.source_len, d.target_len)
    zeros = lambda n: jnp.zeros((1, n), jnp.int32)
    return Task(model=model, init=lambda rng: model.init(rng, zeros(d.source_len) + 3,
                                                         zeros(d.target_len) + 3)["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["target_weights"])),
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)),
                decode=decode, attention_input=attention_input, **entries)


def _encdec_flops(cfg, d, params) -> float:
    """Model FLOPs per target position of an encoder-decoder step on padded rows of S =
    source_len and T = target_len: the encoder's S tokens and the decoder's T tokens each by
    flops_per_token, and the decoder's cross-attention to S keys."""
    # The embedding is looked up on both sides; shared, it is the output projection too
    # (counted once with the decoder); unshared, the output is a matmul of its own.
    lookups = flops.LOOKUP_TABLES + (() if cfg.share_embeddings else ("embedding",))
    p = nn.meta.unbox(params)
    n_encoder = flops.matmul_params(p["encoder"], lookups)
    n_decoder = flops.matmul_params(p, lookups) - n_encoder
    s, t, width = d.source_len, d.target_len, cfg.d_model
    total = (s * flops.flops_per_token(n_encoder, cfg.num_encoder_layers, s, width)
             + t * flops.flops_per_token(n_decoder, cfg.num_decoder_layers, t, width)
             + t * flops.attention_flops_per_token(cfg.num_decoder_layers, s, width))
    return total / t


TEXT = ("attention_input", "flops_per_unit", "tokens_per_example")
register("gpt", lm_task, provides=("sample", *TEXT))
register("bert_mlm", mlm_task, provides=("embed", *TEXT))
register("vit", image_task, provides=("classify", *TEXT))
register("cnn", image_task, provides=("classify", "flops_per_unit"))
register("rnn_seq2seq", translation_task, provides=("decode", "attention_input"))
register("encdec", translation_task, provides=("decode", "attention_input", "flops_per_unit"))
