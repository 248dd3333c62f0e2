"""What differs between model families: a `Task` per `config.task` (model, data, loss).

`train.py` is the loop and knows nothing about GPT or ViT; it asks `TASKS[config.task]`
for a `Task` and runs it. Each adapter here reads `config.model` (checked against the
model's own config dataclass) and `config.data` (checked against the adapter's keys),
builds the offline dataset splits and the tokenizer, and returns the loss function.
A notebook or a test can register its own: `tasks.TASKS["mine"] = make_my_task`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attention_jax import checkpoint as ckpt_lib
from attention_jax.errors import UserError
from attention_jax.models.losses import cross_entropy


# Defined here rather than in train.py because the adapters below raise it too and train
# imports this module (never the reverse); train re-exports it as train.ConfigError.
class ConfigError(UserError, ValueError):
    """A config key with an invalid value; the message names the key and valid values."""


def check_range(key: str, value, interval: str) -> None:
    """ConfigError unless `value` lies in `interval`, written as in maths: "(0, inf)",
    "[0, 1)", "[1, inf)"; the message names config.<key>, the value and the range."""
    low, high = (x.strip() for x in interval[1:-1].split(","))
    low, high = float(low), float(high)
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    if above and below:  # False for NaN as well.
        return
    name, fmt = key, lambda x: f"{x:g}"
    if math.isinf(high):
        valid = f"{name} {'>' if interval[0] == '(' else '>='} {fmt(low)}"
    else:
        valid = (f"{fmt(low)} {'<' if interval[0] == '(' else '<='} {name} "
                 f"{'<' if interval[-1] == ')' else '<='} {fmt(high)}")
    raise ConfigError(f"config.{key}={value!r} is out of range; valid: {valid}")


# ===================================================================================== task
@dataclasses.dataclass
class Task:
    """What the trainer needs from a model family (built by the adapters in TASKS).

    init(rng) -> the params tree (with flax logical-axis boxes);
    loss(params, batch, rng, train) -> (scalar loss, {name: scalar metric});
    sources are random-access (`len`, `[i]`), transforms map (record, np rng) -> example.
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
    sample: Callable | None = None  # (params, rng) -> list of strings.
    save_assets: Callable[[str], None] | None = None  # e.g. the tokenizer into the workdir.
    seq_len: int | None = None  # tokens per example when fixed (checked against mesh.sequence).


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


# Model-config fields renamed since a run may have written its config.json (old -> new),
# by task: one spelling of the fields the families share (d_model, max_len,
# norm_epsilon, dropout_rate, vocab_size). runs.load_config maps them when reading.
RENAMED_MODEL_FIELDS = {
    "gpt": {"embed_dim": "d_model"},
    "encdec": {"embed_dim": "d_model"},
    "bert_mlm": {"max_positions": "max_len", "layer_norm_epsilon": "norm_epsilon"},
    "vit": {"layer_norm_epsilon": "norm_epsilon"},
    "rnn_seq2seq": {"src_vocab_size": "vocab_size", "dropout": "dropout_rate"},
}


def rename_old_model_fields(task: str, model: dict) -> dict:
    """`model` (a config.json's "model" group) with the old field names of `task`'s
    model replaced by today's; a field written under both names is an error."""
    renamed = RENAMED_MODEL_FIELDS.get(task, {})
    both = sorted(old for old, new in renamed.items() if old in model and new in model)
    if both:
        raise ConfigError(f"config.model has both {both[0]!r} and its new name "
                          f"{renamed[both[0]]!r}; keep only {renamed[both[0]]!r}")
    return {renamed.get(k, k): v for k, v in model.items()}


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
        if key in merged and merged[key] not in valid:
            raise ConfigError(f"config.data.{key}={merged[key]!r} is unknown; valid: "
                              f"{list(valid)}{_did_you_mean(merged[key], valid)}")
    return ml_collections.ConfigDict(merged)


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _tokenizer(d, workdir: str, texts: Callable[[], list[str]]):
    """The run's tokenizer: the one saved in the workdir (so a resumed run, eval and
    sampling decode with exactly the training vocabulary), else a new one."""
    from attention_jax import data
    saved = os.path.join(workdir, "tokenizer")
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


def _did_you_mean(word: str, choices) -> str:
    import difflib
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
            hint = "" if d.name in known else _did_you_mean(d.name, known)
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

    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=data.CausalLM(d.packing), eval_transform=data.CausalLM(d.packing),
                unit="tokens",
                count=lambda b: int(np.sum(b["weights"])), sample=sample,
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")), seq_len=d.seq_len)


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

    return Task(model=model, init=lambda rng: model.init(rng, jnp.ones((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["segment_ids"] != 0)),
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")), seq_len=d.seq_len)


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
    family = {"vit": (vit.ViTConfig, vit.ViT), "cnn": (cnn.CNNConfig, cnn.CNN)}
    config_cls, model_cls = family[config.task]
    cfg = model_config(config_cls, config, dtype=config.train.compute_dtype)
    model = model_cls(cfg)

    def loss(params, batch, rng, train):
        logits, _ = model.apply({"params": params}, batch["image"], deterministic=not train,
                                rngs={"dropout": rng})
        return cross_entropy(logits, batch["label"], None,
                             config.optim.label_smoothing if train else 0.0)

    shape = (1, cfg.image_size, cfg.image_size, cfg.num_channels)
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros(shape))["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=data.ImageClassification(augment=d.augment, padding=d.padding,
                                                         flip=d.flip),
                eval_transform=data.ImageClassification())


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
        apply = lambda params, b, train, rng: model.apply(
            {"params": params}, b["inputs"], b["decoder_inputs"], deterministic=not train,
            rngs={"dropout": rng})
    else:
        from attention_jax.models import encdec
        cfg = model_config(encdec.EncDecConfig, config, vocab_size=vocab,
                           dtype=config.train.compute_dtype, **ids)
        model = encdec.EncoderDecoder(cfg)
        apply = lambda params, b, train, rng: model.apply(
            {"params": params}, b["inputs"], b["decoder_inputs"], deterministic=not train,
            rngs={"dropout": rng})

    def loss(params, batch, rng, train):
        logits, aux = apply(params, batch, train, rng)
        return cross_entropy(logits, batch["targets"], batch["target_weights"],
                             config.optim.label_smoothing if train else 0.0)

    transform = data.Translation(tok, tok, d.source, d.target, d.source_len, d.target_len)
    zeros = lambda n: jnp.zeros((1, n), jnp.int32)
    return Task(model=model, init=lambda rng: model.init(rng, zeros(d.source_len) + 3,
                                                         zeros(d.target_len) + 3)["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["target_weights"])),
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")))


TASKS.update(gpt=lm_task, bert_mlm=mlm_task, vit=image_task, cnn=image_task,
             rnn_seq2seq=translation_task,
             encdec=translation_task)
