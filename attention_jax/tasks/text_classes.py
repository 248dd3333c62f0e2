"""Text classification: a BERT encoder with its classification head (`bert_classify`),
fine-tuned on labelled texts (Devlin et al. 2019, §4): [CLS] text [SEP], or a pair
[CLS] A [SEP] B [SEP], and the pooled [CLS] state into one logit per class.

The labelled texts: a tfds dataset whose label is a ClassLabel (default: the offline
`number_languages`; `imdb_reviews`, `glue/sst2`, `ag_news_subset` prepared in data_dir),
or with data.name="files" the user's .jsonl/.parquet/.csv/.tsv records, the text under
data.text_key (a pair's second text under data.pair_key) and the label under
data.label_key: any text, integer or boolean. A file's classes are the distinct labels of
the training split in sorted order (numerically where all are integers), kept with the
run (classes.json) and its export (id2label)."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import workdir as workdir_lib
from attention_jax.config import PAIR_FILE_KEYS
from attention_jax.data.objectives import least_classified_len
from attention_jax.errors import ConfigError
from attention_jax.models import bert, flops
from attention_jax.models.losses import classifier_cross_entropy
from attention_jax.tasks.base import (AttentionInput, OnDemand, Task, as_text, cache_root,
                                      check_classes,
                                      check_context, check_model_config, complete_records,
                                      data_is_on_demand, data_options, held_out_files_alone,
                                      LOOSE_VOCAB, model_config,
                                      padded_vocab, record_splits, register, run_tokenizer,
                                      save_classes, saved_classes, token_labels)

# The data keys and their defaults. text_key/pair_key/label_key name a record's fields.
CLASSIFY_DATA = dict(name="number_languages", data_dir="", tokenizer="wordpiece",
                     vocab_size=1024, seq_len=32, text_key="text", pair_key="",
                     label_key="label", train_split="train", eval_split="validation",
                     train_fraction=1.0, **PAIR_FILE_KEYS)

# A file's labels listed in a message, at most.
SHOWN = 8

class PairFormatError(ValueError):
    """A line given to a pair classifier that is no pair: not two texts around one tab."""


# Texts classified per call of label_texts' program (the last call padded to it).
PREDICT_ROWS = 64

# Training texts whose length the start-up note on cut texts counts (the first ones).
CUT_SAMPLE = 1000


def _record_keys(o) -> list[str]:
    return [o.text_key, *([o.pair_key] if o.pair_key else []), o.label_key]


def _labelled_sources(o, held_out_only: bool = False):
    """(train, eval) sources: a dataset's splits, or with data.name="files" the records of
    the user's .jsonl/.parquet files (held_out_only: (None, eval), of data.eval_files
    alone)."""
    keys = _record_keys(o)
    if not all(keys[:-1]) or not o.label_key or len(set(keys)) < len(keys):
        raise ConfigError(f"config.data.text_key={o.text_key!r}, pair_key={o.pair_key!r}, "
                          f"label_key={o.label_key!r}; valid: distinct keys of a record (the "
                          f"text, a pair's second text or '' for none, the label)")
    return record_splits(o, keys, holds="a text under data.text_key and its label under "
                                        "data.label_key",
                         hint="config.data.text_key and config.data.label_key (and pair_key) "
                              "to the keys of the text and its label",
                         integer_fields=(o.label_key,), held_out_only=held_out_only)


def _dataset_classes(o, records) -> tuple[str, ...]:
    """A tfds dataset's class names: its label feature's (a ClassLabel), checked with the
    text fields against its first record."""
    first = records[0] if len(records) else {}
    texts = sorted(k for k, v in first.items() if isinstance(v, (str, bytes)))
    for key in ("text_key", "pair_key"):
        if o[key] and o[key] not in texts:
            raise ConfigError(f"config.data.{key}={o[key]!r} is not a text field of "
                              f"{o.name!r}; valid: {texts}")
    features = getattr(getattr(records, "dataset_info", None), "features", None) or {}
    labels = sorted(k for k in first if k in features and getattr(features[k], "names", None))
    if o.label_key not in labels:
        raise ConfigError(f"config.data.label_key={o.label_key!r} is not a class label of "
                          f"{o.name!r} (a tfds ClassLabel); valid: "
                          f"{labels or 'none: it has no ClassLabel field'}, or your own "
                          f"records' labels with config.data.name=files")
    return tuple(features[o.label_key].names)


def _check_labelled(o, records, split: str, classes) -> None:
    """A tfds split whose first record's label is no class (-1: GLUE's test splits hold
    no labels) is refused before it is trained or evaluated on: as labels its -1s were
    counted wrong with nothing said."""
    label = int(records[0][o.label_key]) if len(records) else 0
    if not 0 <= label < len(classes):
        raise ConfigError(f"config.data.{split}={o[split]!r} of {o.name!r}: its records' "
                          f"{o.label_key!r} is {label}, no class of {len(classes)} (an "
                          f"unlabelled split); valid: a labelled split")


def _labelled(o, records, split: str):
    """(`records` less those with an empty text or label, the distinct labels of the ones
    kept). A blank line or a bad record (not JSON, a key missing) reads as empty: left
    out and counted in a warning, as the translation pairs are. The records kept carry a
    digest of what they hold, read in this same pass: a resume on files whose texts or
    labels changed stops (loaders.source_id) where their count alone would not tell. The
    pass is kept in the records cache: the next start on the same files reads none."""
    from attention_jax.data.sources import Subset
    keys = _record_keys(o)
    found = complete_records(records, keys, labels_of=o.label_key, cache=cache_root(o))
    if not found.kept:
        raise ConfigError(f"config.data.{split}={o[split]!r} of {o.files or o.name!r}: every "
                          f"one of its {found.count} records has an empty text or label "
                          f"({', '.join(map(repr, keys))})")
    if found.kept < found.count:
        print(f"warning: {found.count - found.kept} of the {found.count} records of "
              f"{o[split]} have an empty {' or '.join(map(repr, keys))} (or were bad records): "
              f"left out", file=sys.stderr)
    fingerprint = f"{found.kept} labelled records, contents {found.digest}"
    return Subset(records, found.indices(), fingerprint=fingerprint), set(found.labels)


def _sorted_labels(labels) -> tuple[str, ...]:
    """Labels in class order: numerically where every one is an integer ('2' before
    '10'), else as text."""
    def as_int(label):
        try:
            return int(label)
        except ValueError:
            return None
    numbers = [as_int(label) for label in labels]
    if None not in numbers and len(set(numbers)) == len(numbers):
        return tuple(label for _, label in sorted(zip(numbers, labels)))
    return tuple(sorted(labels))


def _say_missing_classes(o, classes, train) -> None:
    """A note where data.train_fraction's draw holds only some of the classes."""
    from attention_jax.data.pipelines import label_text
    drawn = {label_text(train[i][o.label_key]) for i in range(len(train))}
    if len(drawn) < len(classes):
        missing = sorted(set(classes) - drawn)
        print(f"note: config.data.train_fraction={o.train_fraction}: its {len(train)} training "
              f"records hold {len(drawn)} of the {len(classes)} classes (none of "
              f"{missing[:SHOWN]}); the model still has a logit for each", file=sys.stderr)


def _say_labels_not_held_out(o, classes, labels, held: int) -> None:
    """A note where the held-out records hold no record of some label: the eval metrics
    then say nothing of it, unsaid (the record's `examples` count shows how few were
    evaluated, not which labels)."""
    present = set(labels)
    missing = [c for c in classes if c not in present]
    if not missing or jax.process_index() != 0:
        return
    where, fix = (("config.data.eval_files", "held-out records of every label")
                  if o.eval_files else
                  (f"config.data.eval_fraction={o.eval_fraction}", "a larger "
                   "config.data.eval_fraction, or held-out records of every label in "
                   "config.data.eval_files=GLOBS"))
    print(f"note: {where}: the {held} held-out records hold {len(classes) - len(missing)} "
          f"of the {len(classes)} labels (none of {missing[:SHOWN]}): the eval metrics "
          f"leave those out; give {fix}", file=sys.stderr)


def _check_eval_labels(o, classes, labels) -> None:
    unknown = sorted(set(labels) - set(classes))
    if not unknown:
        return
    where, fix = (("config.data.eval_files", "held-out records of labels the model trains on")
                  if o.eval_files else
                  ("config.data.eval_fraction", "more records of those labels (the held-out "
                   "draw took all of them), or a held-out split of your own: "
                   "config.data.eval_files=GLOBS"))
    raise ConfigError(f"{where}: the labels {unknown[:SHOWN]} of the held-out records are not "
                      f"among the {len(classes)} labels of the training records "
                      f"{list(classes)[:SHOWN]}; valid: {fix}")


def _cut(o, lengths) -> bool:
    """Whether a text (or a pair) of token `lengths` is cut to data.seq_len with its
    special tokens ([CLS] A [SEP], [CLS] A [SEP] B [SEP])."""
    return sum(lengths) + len(lengths) + 1 > o.seq_len


def _say_cut_texts(o, tok, train) -> None:
    """A note where the first training texts are longer than data.seq_len: the model
    reads their first tokens only (as BERT's fine-tuning does), which reviews cut at 32
    tokens would be, unsaid."""
    n = min(len(train), CUT_SAMPLE)
    keys = _record_keys(o)[:-1]
    cut = sum(_cut(o, [len(tok.encode(as_text(train[i][k]))) for k in keys]) for i in range(n))
    if cut and jax.process_index() == 0:
        print(f"note: config.data.seq_len={o.seq_len}: {cut} of the first {n} training "
              f"{'pairs' if o.pair_key else 'texts'} are longer (with their special tokens) "
              f"and are cut, their ends not read; a larger seq_len (up to model.max_len) "
              f"reads more of them", file=sys.stderr)


def _ends(tok) -> tuple[int, int]:
    """The ids around a text (tokenization.text_ends)."""
    from attention_jax.data.tokenization import text_ends
    ends = text_ends(tok)
    if ends is None:
        raise ConfigError(f"config.data.tokenizer: {getattr(tok, 'path', tok.kind)!r} has "
                          f"neither [CLS]/[SEP] nor beginning/end-of-text tokens, which a "
                          f"classified text starts and ends with; valid: 'wordpiece', 'bpe', "
                          f"'byte', 'char' or a tokenizer.json with them")
    return ends


def classify_task(config, workdir: str) -> Task:
    """BERT fine-tuned to classify texts (module docstring)."""
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    # before the data and tokenizer are built (the vocabulary and classes stand-ins)
    check_model_config(bert.BertConfig, config, vocab_size=LOOSE_VOCAB, num_labels=2,
                       dtype=config.train.compute_dtype)
    o = data_options(config, **CLASSIFY_DATA)
    files = o.name == "files"

    reader = data_is_on_demand()

    @functools.cache
    def sources(held_out_only: bool = False):  # no record read but the first
        train, evaluated = _labelled_sources(o, held_out_only)
        return {"train_split": train, "eval_split": evaluated}

    @functools.cache
    def labelled(split: str):  # a file's split less its empty records, and its labels
        # (a reader's evaluation of data.eval_files lists no training file)
        alone = reader and split == "eval_split" and held_out_files_alone(o)
        return _labelled(o, sources(alone)[split], split)

    def records(split: str):
        return labelled(split)[0] if files else sources()[split]

    saved = saved_classes(workdir)
    if reader and saved:  # a reader (sampling, maps) needs no data; eval reads its split
        classes = tuple(saved)
    elif files:
        classes = _sorted_labels(labelled("train_split")[1])
    else:
        classes = _dataset_classes(o, sources()["train_split"])
    if len(classes) < 2:
        raise ConfigError(f"config.data.label_key={o.label_key!r}: the training records have "
                          f"{len(classes)} label ({list(classes)}); valid: two classes or more")
    check_classes(workdir, classes)  # a resume on other labels stops here
    least = least_classified_len(bool(o.pair_key))
    if o.seq_len < least:
        raise ConfigError(f"config.data.seq_len={o.seq_len} leaves no room for a "
                          f"{'pair' if o.pair_key else 'text'} between its special tokens; "
                          f"valid: seq_len >= {least}")

    def eval_records():
        split = records("eval_split")
        if files:
            held_labels = labelled("eval_split")[1]
            _check_eval_labels(o, classes, held_labels)
            _say_labels_not_held_out(o, classes, held_labels, len(split))
        else:
            if reader:  # the names of the copy read now, by classes.json (metadata only)
                check_classes(workdir, _dataset_classes(o, split))
            _check_labelled(o, split, "eval_split", classes)
        return split

    def train_records():  # data.train_fraction < 1: that share of them (a fixed draw)
        if not files:
            _check_labelled(o, records("train_split"), "train_split", classes)
        try:
            train = data.subset_fraction(records("train_split"), o.train_fraction)
        except ValueError as e:
            raise ConfigError(f"config.data.train_fraction: {e}") from None
        if o.train_fraction < 1 and files and not reader:
            _say_missing_classes(o, classes, train)
        return train
    if reader:
        train_src, eval_src = OnDemand(train_records), OnDemand(eval_records)
    else:
        train_src, eval_src = train_records(), eval_records()

    tok = run_tokenizer(o, workdir, lambda: [as_text(train_src[i][k])
                                             for i in range(len(train_src))
                                             for k in _record_keys(o)[:-1]])
    start_id, end_id = _ends(tok)
    cfg = model_config(bert.BertConfig, config, vocab_size=padded_vocab(tok.vocab_size),
                       num_labels=len(classes), dtype=config.train.compute_dtype)
    if cfg.position_embeddings and o.seq_len > cfg.max_len:
        raise ConfigError(f"config.data.seq_len={o.seq_len} is longer than the position table "
                          f"(config.model.max_len={cfg.max_len}); valid: seq_len <= "
                          f"{cfg.max_len}, or a larger max_len")
    model = bert.Bert(cfg, head="classification")
    transform = data.TextClassification(
        tok, o.seq_len, start_id, end_id, classes, text_key=o.text_key, pair_key=o.pair_key,
        label_key=o.label_key, by_index=not files)
    if not reader:
        _say_cut_texts(o, tok, train_src)

    def logits_of(params, batch, train=False, rng=None):
        return model.apply({"params": params}, batch["inputs"], batch["token_types"],
                           attention_mask=batch["mask"], deterministic=not train,
                           rngs=None if rng is None else {"dropout": rng})[0]

    def loss(params, batch, rng, train):
        # Eval batches weigh each text (0: a row padding the last batch; steps.evaluate).
        return classifier_cross_entropy(logits_of(params, batch, train, rng), batch["label"],
                                        batch.get(EXAMPLE_WEIGHT),
                                        config.optim.label_smoothing if train else 0.0)

    predict = jax.jit(lambda params, batch: jnp.argmax(logits_of(params, batch),
                                                       -1).astype(jnp.int32))

    def classify(params, batch):
        return np.asarray(predict(params, batch)), np.asarray(batch["label"], np.int32)

    probabilities = jax.jit(lambda params, batch: jax.nn.softmax(
        logits_of(params, batch).astype(jnp.float32), axis=-1))

    def texts_of(text: str) -> list[str]:
        """A text, or a pair's two texts given with a tab between them."""
        if not o.pair_key:
            return [text]
        texts = text.split("\t")
        if len(texts) != 2 or not all(t.strip() for t in texts):
            raise PairFormatError(f"{text[:60]!r} holds {len(texts) - 1} tab(s)"
                             f"{'' if len(texts) != 2 else ' and an empty side'}; task "
                             f"{config.task!r} classifies pairs (data.pair_key={o.pair_key!r}): "
                             f"give each as its two texts, neither empty, with one tab between")
        return texts

    def label_texts(params, texts):
        unusable, ids = {}, []
        for i, text in enumerate(texts):
            try:
                ids.append([tok.encode(t) for t in texts_of(text)])
            except PairFormatError as e:  # a pair's line without its tab: its row stays NaN
                unusable[i] = str(e)
        rows = [data.classification_example(
            a[0], a[1] if o.pair_key else None, seq_len=o.seq_len, start_id=start_id,
            end_id=end_id, pad_id=tok.pad_id) for a in ids]
        cut = sum(_cut(o, [len(x) for x in a]) for a in ids)
        if cut:  # as in training, and said as there
            print(f"note: {cut} of the {len(texts)} texts are longer than config.data.seq_len="
                  f"{o.seq_len} tokens (with their special tokens): classified on their first "
                  f"tokens, as the run trained", file=sys.stderr)
        out = []
        for at in range(0, len(rows), PREDICT_ROWS):
            chunk = rows[at:at + PREDICT_ROWS]
            chunk += chunk[:1] * (PREDICT_ROWS - len(chunk))  # one shape: one compilation
            batch = {k: np.stack([r[k] for r in chunk]) for k in chunk[0]}
            out.append(np.asarray(probabilities(params, batch))[:len(rows) - at])
        labelled = np.full((len(texts), len(classes)), np.nan, np.float32)
        if out:
            labelled[[i for i in range(len(texts)) if i not in unusable]] = np.concatenate(out)
        return labelled, unusable

    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params, index  # a text's ids are all the model reads
        if text is None or target is not None:
            raise ValueError(f"text={text!r}, target={target!r}: task {config.task!r} draws its "
                             f"attention on one text; give text= (viz's --text) and no target")
        # As the model reads it: [CLS] A [SEP] (B [SEP]), a pair's B of token type 1.
        parts = [tok.encode(t) for t in texts_of(text)]
        ids = [start_id, *parts[0], end_id] + ([*parts[1], end_id] if o.pair_key else [])
        types = [0] * (len(parts[0]) + 2) + [1] * (len(ids) - len(parts[0]) - 2)
        check_context(len(ids), o.seq_len, f"{'pair' if o.pair_key else 'text'} with its "
                                            f"special tokens")
        labels = token_labels(tok, ids)
        return AttentionInput(inputs=(np.array([ids], np.int32), np.array([types], np.int32)),
                              labels={"self": (labels, labels)}, info={"tokens": labels})

    # The word table is only looked up here (no tied MLM output): a text's matmuls are the
    # encoder's, the pooler's and the classifier's.
    lookups = flops.LOOKUP_TABLES + ("word_embeddings",)
    return Task(model=model,
                init=lambda rng: model.init(rng, jnp.ones((1, o.seq_len), jnp.int32))["params"],
                vocab_size=tok.vocab_size, loss=loss, train_source=train_src,
                eval_source=eval_src, train_transform=transform, eval_transform=transform,
                classify=classify, label_texts=label_texts, class_names=tuple(classes),
                save_assets=lambda w: _save_assets(w, tok, classes),
                seq_len=o.seq_len, attention_input=attention_input,
                flops_per_unit=lambda params: o.seq_len * flops.flops_per_token(
                    flops.matmul_params(params, lookups), cfg.num_layers, o.seq_len, cfg.d_model),
                tokens_per_example=o.seq_len)


def _save_assets(workdir: str, tok, classes) -> None:
    tok.save(workdir_lib.path(workdir, workdir_lib.TOKENIZER))
    save_classes(workdir, classes)


register("bert_classify", classify_task,
         provides=("classify", "label_texts", "attention_input", "flops_per_unit",
                   "tokens_per_example"), reads=(), model=bert.BertConfig)
