"""Text families: GPT next-token prediction (`gpt`) and BERT masked-language modelling
(`bert_mlm`)."""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import workdir as workdir_lib
from attention_jax.config import LM_LOSS_KEYS, SAMPLE_KEYS, TEXT_FILE_KEYS
from attention_jax.data.tokenization import ROLE_NAMES, TokenizerEncodeError, is_tokenizer_path
from attention_jax.errors import ConfigError
from attention_jax.models import bert, flops, gpt
from attention_jax.models.losses import WEIGHT, cross_entropy, example_weighted
from attention_jax.tasks.base import (AttentionInput, Task, as_text, cache_root, check_context,
                                      check_file_options, check_model_config,
                                      check_source_keys, corpus_options,
                                      data_options,
                                      OnDemand, data_is_on_demand, data_parallel_size,
                                      gather_rows, held_out_files_alone, lm_vocab_size,
                                      LOOSE_VOCAB, note_shipped_prompts, model_config, moe_metrics,
                                      padded_vocab, register, run_tokenizer, splits,
                                      tasks_with, token_labels)


def _text_attention_input(tok, context: int | None, name: str):
    """Task.attention_input of a text model (gpt, bert_mlm): the text's ids [1, T]."""
    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params, index  # a text's ids are all the model reads
        if text is None:
            raise ValueError(f"text=None: task {name!r} draws its attention on a text; give one "
                             f"(text=, or viz's --text)")
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


# The data keys of each text task, with their defaults.
GPT_DATA = dict(name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                tokenizer="byte", vocab_size=1024, seq_len=128, train_split="train",
                eval_split="validation", packing="documents", **TEXT_FILE_KEYS)
MLM_DATA = dict(name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                tokenizer="bpe", vocab_size=2048, seq_len=128, mask_rate=0.15,
                train_split="train", eval_split="validation", **TEXT_FILE_KEYS)


def _check_mlm_tokenizer(data_opts) -> None:
    if not is_tokenizer_path(data_opts.tokenizer) and data_opts.tokenizer not in ("bpe", "wordpiece"):
        raise ConfigError(f"config.data.tokenizer={data_opts.tokenizer!r}: MLM needs a [MASK] token; "
                          f"valid: ['bpe', 'wordpiece'] or a tokenizer.json with one")


def _check_lm_tokenizer(data_opts) -> None:
    if data_opts.tokenizer == "wordpiece":
        raise ConfigError("config.data.tokenizer='wordpiece' is BERT's vocabulary for masked "
                          "language modelling: it has no beginning- or end-of-text token, which "
                          "a GPT's documents and samples need; valid: ['char', 'byte', 'bpe'] or "
                          "a tokenizer.json (BERT's own file gives [CLS] and [SEP] those roles)")


def _check_mask(data_opts, tok) -> None:
    if getattr(tok, "mask_id", None) is None:
        raise ConfigError(f"config.data.tokenizer={data_opts.tokenizer!r}: {tok.path} has no mask "
                          f"token, which MLM needs; valid: a tokenizer with one "
                          f"({', '.join(ROLE_NAMES['mask'])}), or 'bpe' / 'wordpiece'")


# A trained tokenizer (bpe, char) learns from the training documents in order, up to
# this much text: a fixed number of documents would be a few kilobytes of short JSONL
# records or gigabytes of whole books.
TOKENIZER_TRAIN_BYTES = 8 << 20


def _tokenizer(data_opts, workdir: str, documents):
    """The run's tokenizer (run_tokenizer); a trained one learns from the first
    TOKENIZER_TRAIN_BYTES of training text, streamed to the tokenizers library's trainer.
    Padding tells itself by segment ids here, so a pad that is the end-of-text token is
    accepted."""
    def texts():
        train, seen = documents.docs("train"), 0
        for i in range(len(train)):
            if seen >= TOKENIZER_TRAIN_BYTES:
                return
            raw = train[i]["text"]
            seen += len(raw)
            yield as_text(raw)
    return run_tokenizer(data_opts, workdir, texts, pad_may_be_eos=True)


def token_cache_root(data_opts) -> str:
    """Where the files' tokens are prepared (base.cache_root), which must be local: the
    shards are memory-mapped."""
    root = cache_root(data_opts)
    if "://" in root:  # named here as the setting it came from (token_cache says the same)
        key = ("config.data.cache_dir" if data_opts.cache_dir else
               "config.data.data_dir, under which the cache goes," if data_opts.data_dir else
               "$TFDS_DATA_DIR, under which the cache goes (config.data.cache_dir unset),")
        raise ConfigError(f"{key} is {root!r}: the token cache must be on a local or "
                          f"mounted filesystem (its shards are memory-mapped); valid: a local "
                          f"directory for config.data.cache_dir (a bucket mounted with gcsfuse)")
    return root


def prepare_files(data_opts, tok, documents, *, process_index: int | None = None,
                  process_count: int | None = None, workers: int | None = None,
                  progress: bool = True,
                  labels: tuple[str, ...] = ("train", "eval")) -> dict[str, str]:
    """Tokenizes the train and eval documents of data.name="files" into the token cache
    (data/token_cache.py) unless they are there: {'train': dir, 'eval': dir} (the splits
    in `labels`). Every process of a job calls it; they share the shards of a shared
    cache directory. A prepared cache is found from the files' listing alone: no file is
    read or indexed."""
    from attention_jax.data import token_cache
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    return {label: token_cache.prepare(
        lambda label=label: documents.docs(label), tok, token_cache_root(data_opts),
        source=documents.source(label), text_key=data_opts.text_key,
        max_documents=data_opts.max_documents, workers=workers, process_index=process_index,
        process_count=process_count, progress=progress, label=documents.split(label))
        for label in labels}


def prepare_from_config(config, workdir: str | None = None, **prepare_kwargs) -> dict[str, str]:
    """What `python -m attention_jax.tools.prepare` does: the token cache of a text task's
    files, with the tokenizer the run would use (the one saved in `workdir` when given)."""
    import tempfile
    defaults = {"gpt": GPT_DATA, "bert_mlm": MLM_DATA}
    if config.get("task") not in defaults:
        raise ConfigError(f"config.task={config.get('task')!r}: prepare tokenizes text for the "
                          f"tasks {sorted(defaults)}")
    data_opts = data_options(config, **defaults[config.task])
    if data_opts.name != "files":
        raise ConfigError(f"config.data.name={data_opts.name!r}: prepare reads your files; set "
                          f"--config.data.name=files --config.data.files=GLOBS")
    if config.task == "bert_mlm":
        _check_mlm_tokenizer(data_opts)
    else:  # refused before the corpus is tokenized, as training refuses it
        _check_lm_tokenizer(data_opts)
    if workdir and not workdir_lib.exists(workdir, workdir_lib.TOKENIZER):
        # (it used to go on with the config's own tokenizer, unsaid)
        raise ConfigError(f"--workdir={workdir}: no tokenizer saved there "
                          f"({workdir_lib.path(workdir, workdir_lib.TOKENIZER)}); valid: the "
                          f"workdir of a run that saved one, or no --workdir (the config's "
                          f"tokenizer)")
    documents = _Documents(data_opts)
    with tempfile.TemporaryDirectory() as scratch:  # no workdir: nothing saved is read
        tok = _tokenizer(data_opts, workdir or scratch, documents)
    if config.task == "bert_mlm":
        _check_mask(data_opts, tok)
    dirs = prepare_files(data_opts, tok, documents, **prepare_kwargs)
    from attention_jax.data import token_cache
    for label in ("train", "eval"):  # as training checks them (prepare said "done")
        rows = token_cache.TokenRows(dirs[label], data_opts.seq_len, pad_id=tok.pad_id)
        _check_has_text(data_opts, documents.split(label), rows)
    return dirs


def _rows(data_opts, tok, documents, packing: str):
    """(train, eval) rows of data.seq_len: the user's files through the token cache,
    prepared on first use and memory-mapped; a dataset packed in memory (PackedSource).
    With data_on_demand, each is built when first used (OnDemand): an eval prepares no
    training split."""
    if data_is_on_demand():
        return tuple(OnDemand(lambda label=label: _built_rows(data_opts, tok, documents,
                                                              packing, (label,))[0])
                     for label in ("train", "eval"))
    return _built_rows(data_opts, tok, documents, packing)


def _built_rows(data_opts, tok, documents, packing: str,
                labels: tuple[str, ...] = ("train", "eval")):
    from attention_jax import data
    from attention_jax.data import token_cache
    if data_opts.name == "files":
        dirs = prepare_files(data_opts, tok, documents, labels=labels)
        rows = tuple(token_cache.TokenRows(dirs[label], data_opts.seq_len, pad_id=tok.pad_id,
                                           packing=packing) for label in labels)
        for label, split in zip(labels, rows):
            _check_has_text(data_opts, documents.split(label), split)
        return rows
    return tuple(data.packed_lm_source(documents.docs(label), tok, data_opts.seq_len,
                                       max_documents=data_opts.max_documents or None)
                 for label in labels)


class _Documents:
    """The train and eval documents: a dataset's splits, or the user's files
    (data.name="files"), which are listed at once (a glob that matches nothing fails
    now; with data_on_demand, when first read) and indexed only when documents are read:
    a prepared token cache never is."""

    def __init__(self, data_opts):
        from attention_jax.data import files
        self.opts = data_opts
        check_source_keys(data_opts, "files", ("files", "eval_files"))
        self._docs = self._listing = None
        # A reader's (eval, sampling): its splits are read after the task is built,
        # outside tasks.data_on_demand.
        self.reader = data_is_on_demand()
        if data_opts.name != "files":
            # A dataset's documents are its records' 'text' (reading them, the tokenizer
            # and the packing all take that key): a text_key given for one did nothing.
            # (Training only: a reader of a run that set it is not stopped by it.)
            if data_opts.get("text_key", "text") != "text" and not data_is_on_demand():
                raise ConfigError(f"config.data.text_key={data_opts.text_key!r} is read only "
                                  f"with config.data.name='files' (now {data_opts.name!r}, "
                                  f"whose documents are its records' 'text'); valid: 'text', "
                                  f"or --config.data.name=files")
            # A dataset's rows are packed in memory: no token cache, so a cache_dir given
            # for one did nothing, unsaid (the same gate as text_key's).
            if data_opts.get("cache_dir") and not data_is_on_demand():
                raise ConfigError(f"config.data.cache_dir={data_opts.cache_dir!r} is read only "
                                  f"with config.data.name='files' (now {data_opts.name!r}, "
                                  f"whose rows are packed in memory, no token cache); valid: "
                                  f"'', or --config.data.name=files")
            if not data_is_on_demand():
                self._dataset_splits()
            return
        if not data_opts.files:
            raise ConfigError(f"config.data.name='files' needs --config.data.files=GLOBS "
                              f"(comma-separated globs of {', '.join(files.SUFFIXES)} files)")
        check_file_options(data_opts)
        if not data_is_on_demand():
            self.listing  # noqa: B018 - a glob that matches nothing fails now

    @property
    def listing(self) -> dict:
        if self._listing is None:
            from attention_jax.data import files
            self._listing = files.corpus_listing(self.opts.files, self.opts.eval_files,
                                                 max_files=self.opts.max_files,
                                                 arg="config.data.")
        return self._listing

    def _dataset_splits(self) -> None:
        docs = dict(zip(("train", "eval"), splits(self.opts, **corpus_options(self.opts))))
        for label, split in docs.items():
            # A dataset without a 'text' feature (number_translation's en/fr) was a
            # KeyError traceback from the tokenizer's first read.
            record = split[0] if len(split) else None
            if isinstance(record, dict) and "text" not in record:
                raise ConfigError(f"config.data.name={self.opts.name!r}: its "
                                  f"{self.split(label)!r} records hold no 'text' (their keys: "
                                  f"{sorted(record)}), the document a language model reads; "
                                  f"valid: a dataset with a 'text' feature, or your own files "
                                  f"(--config.data.name=files --config.data.files=GLOBS "
                                  f"--config.data.text_key=KEY)")
        self._docs = docs

    def split(self, label: str) -> str:
        return self.opts["train_split" if label == "train" else "eval_split"]

    def held_out_alone(self, label: str) -> bool:
        """Whether `label` is the documents of data.eval_files alone (held_out_files_alone)."""
        return label == "eval" and held_out_files_alone(self.opts)

    def docs(self, label: str):
        """The documents of 'train' or 'eval' (indexing the files on first use)."""
        if self._docs is None and self.opts.name != "files":
            self._dataset_splits()
        if self._docs is None and self.held_out_alone(label) and self.reader:
            return self._file_splits(held_out_only=True)["validation"]
        if self._docs is None:
            by_split = self._file_splits()
            self._docs = {"train": by_split[self.split("train")],
                          "eval": by_split[self.split("eval")]}
        return self._docs[label]

    def _file_splits(self, held_out_only: bool = False) -> dict:
        from attention_jax.data import files
        return files.file_splits(
            self.opts.files, self.opts.eval_files, text_key=self.opts.text_key,
            eval_fraction=self.opts.eval_fraction, max_bad_records=self.opts.max_bad_records,
            max_files=self.opts.max_files, arg="config.data.", held_out_only=held_out_only)

    def source(self, label: str) -> dict:
        """What the files' split `label` is a function of (the token cache's key): the
        listing of data.files and data.eval_files; of eval_files alone for theirs."""
        if self.held_out_alone(label):
            listed = self._listing or self._eval_listing()
            return {"eval_files": listed["eval_files"], "split": "validation",
                    "eval_fraction": None}
        drawn = None if self.listing["eval_files"] else self.opts.eval_fraction
        return {**self.listing, "split": self.split(label), "eval_fraction": drawn}

    def _eval_listing(self) -> dict:
        from attention_jax.data import files
        return files.corpus_listing("", self.opts.eval_files, arg="config.data.", train=False)


def _check_has_text(data_opts, split: str, rows) -> None:
    """A split whose documents hold no token but their end-of-text ones (empty files,
    every record skipped) trained on nothing, or evaluated to NaN, and said neither."""
    ends = rows.num_documents if rows.eos_id is not None else 0
    if rows.num_tokens > ends:
        return
    where = ("config.data.eval_files" if split == data_opts.eval_split and data_opts.eval_files
             else "config.data.files")
    fix = ("documents with text" if where == "config.data.eval_files" or split == data_opts.train_split
           else "documents with text: name them with config.data.eval_files=GLOBS, or change "
                "config.data.eval_fraction to draw others")
    n = rows.num_documents
    raise ConfigError(f"{where}: the {split} split holds no text (its {n} document"
                      f"{' is' if n == 1 else 's are'} empty, or every record was skipped); "
                      f"valid: {fix}")


def _check_seq_len(data_opts, max_len: int) -> None:
    """A model with a learned position table [max_len, D] reads no row longer than it."""
    if data_opts.seq_len > max_len:
        raise ConfigError(f"config.data.seq_len={data_opts.seq_len} exceeds config.model.max_len="
                          f"{max_len}; valid: seq_len <= {max_len}")


def check_sample_prompts(prompts, tok, max_len: int | None = None) -> None:
    """A ConfigError naming config.eval.sample_prompts if the tokenizer cannot encode one
    of them, or one fills a learned position table of `max_len` rows: found before
    training, not when the run samples at its end."""
    for prompt in prompts:
        try:
            ids = tok.encode(prompt)
        except TokenizerEncodeError as e:
            raise ConfigError(f"config.eval.sample_prompts: {e}; valid: prompts it encodes "
                              f"(--config.eval.sample_prompts='(\"...\",)') or none "
                              f"(--config.eval.sample_prompts='()')") from None
        if max_len is not None and len(ids) >= max_len:
            raise ConfigError(f"config.eval.sample_prompts: {prompt[:40]!r} is {len(ids)} "
                              f"tokens, which fill the position table (model.max_len="
                              f"{max_len}); valid: prompts under {max_len} tokens")


def empty_prompt(tok) -> list[int]:
    """The prompt of an empty sample prompt: the end-of-text token, which ends every
    training document and so comes before each next one in a stream; the tokenizer's
    begin token only where it has no end one (a GPT here never trains on a begin token:
    its samples from one read a token the model never saw)."""
    eos = getattr(tok, "eos_id", None)
    return [tok.bos_id if eos is None else eos]


def moe_token_mask(batch, weights):
    """[B, T] bool, False on the padding of an LM batch the model's segment ids do not
    mark, for its MoE (gpt.GPT's token_mask: routed to no expert, left out of the router
    statistics and the balance loss), or None where there is none to mark. `weights`:
    the batch's loss weights times its example weights (losses.example_weighted).

    An eval batch's padding copies (example weight 0) are padding; so is a "stream"
    row's tail (objectives.next_token_targets), which has no segment ids: there the
    weight of the pair (t, t + 1) is real[t] & real[t + 1], so a token is real where the
    pair it starts or the pair it ends is weighted. (The one token that misses both, a
    row holding a single real token, has no target either: only the statistics lose it.)
    Documents rows keep segment id 0 on their padding, which the model masks itself."""
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    weighted = weights > 0
    if "segment_ids" not in batch:
        return weighted | jnp.pad(weighted[:, :-1], ((0, 0), (1, 0)))
    example_weight = batch.get(EXAMPLE_WEIGHT)
    if example_weight is None:
        return None
    return jnp.broadcast_to(jnp.asarray(example_weight)[:, None] > 0, weighted.shape)


def lm_task(config, workdir: str) -> Task:
    """GPT next-token prediction on packed documents (default: the stdlib corpus)."""
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    # before the corpus and tokenizer are built (the vocabulary a stand-in)
    check_model_config(gpt.GPTConfig, config, dtype=config.train.compute_dtype,
                       vocab_size=config.model.get("vocab_size") or LOOSE_VOCAB)
    # packing: "documents" keeps each packed document to itself (segment ids, positions
    # restarting per document); "stream" reads a row as a window of one token stream, as
    # GPT-2 and nanoGPT train (plain causal attention).
    data_opts = data_options(config, **GPT_DATA)
    _check_lm_tokenizer(data_opts)
    documents = _Documents(data_opts)
    # Padding carries weight 0 in the LM loss, so a tokenizer file without a pad token
    # (GPT-2's) pads with its end-of-text token.
    tok = _tokenizer(data_opts, workdir, documents)
    cfg = model_config(gpt.GPTConfig, config, vocab_size=lm_vocab_size(config, tok.vocab_size),
                       dtype=config.train.compute_dtype)
    check_sample_prompts(config.eval.sample_prompts, tok,
                         cfg.max_len if cfg.position == "learned" else None)
    # A top-k of the whole vocabulary or more keeps every token, as nanoGPT's min(k, V):
    # the default 40 is more than a small alphabet's (it refused the default config).
    # Said now, not after training; without prompts nothing is sampled.
    top_k = config.eval.sample_top_k if 0 < config.eval.sample_top_k < tok.vocab_size else None
    if config.eval.sample_prompts and config.eval.sample_top_k > tok.vocab_size:
        print(f"note: config.eval.sample_top_k={config.eval.sample_top_k} keeps all of the "
              f"tokenizer's {tok.vocab_size} tokens: samples come from the whole "
              f"distribution, as with sample_top_k=0", file=sys.stderr)
    if cfg.position == "learned":
        _check_seq_len(data_opts, cfg.max_len)
    model = gpt.GPT(cfg)
    train_rows, eval_rows = _rows(data_opts, tok, documents, data_opts.packing)
    note_shipped_prompts(config, data_opts.name)  # (once the data is there: errors first)

    # train.loss_chunk_size > 0: the head and the loss a chunk of positions at a time (the
    # [B, T, V] logits never exist at once); .get: a run's config.json from before the key.
    chunk_size = config.train.get("loss_chunk_size", 0)
    loss_kernel = config.train.get("loss_kernel", "auto")
    if chunk_size and loss_kernel == "pallas":
        raise ConfigError(f"config.train.loss_kernel='pallas' computes the loss over the whole "
                          f"logits, and config.train.loss_chunk_size={chunk_size} asks for them a "
                          "chunk at a time; valid: loss_kernel='auto' or 'xla' with a chunk "
                          "size, or loss_chunk_size=0")

    def loss(params, batch, rng, train):
        # Eval batches carry example weights (0 on the rows padding the last batch; see
        # steps.evaluate); training batches do not, and train exactly as without them.
        example_weight = batch.get(EXAMPLE_WEIGHT)
        weights = example_weighted(batch["weights"], example_weight)
        (nll, m), aux = gpt.head_loss(
            model, params, batch["inputs"], batch["targets"], weights,
            chunk_size=chunk_size, loss_kernel=loss_kernel,
            label_smoothing=config.optim.label_smoothing if train else 0.0,
            positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
            token_mask=moe_token_mask(batch, weights) if cfg.mlp == "moe" else None,
            deterministic=not train, rngs={"dropout": rng})
        metrics = {"accuracy": m["accuracy"], **moe_metrics(aux)}
        if example_weight is not None:
            metrics[WEIGHT] = jnp.sum(weights)  # the tokens the means are over
        # The routers' balance loss (and z-loss, where weighted) is part of the objective
        # trained on, not of the model's fit: eval's loss (and its perplexity) is the
        # tokens' NLL alone.
        return (nll + aux.get("moe_loss", 0.0) if train else nll), metrics

    def sample(params, rng):
        prompts = [tok.encode(p) or empty_prompt(tok) for p in config.eval.sample_prompts]
        if not prompts:  # --config.eval.sample_prompts='()': nothing to continue
            return []
        width = max(map(len, prompts))
        new = config.eval.sample_tokens
        if cfg.position == "learned" and new > cfg.max_len - width:
            new = cfg.max_len - width  # the position table ends there: said, not silent
            if jax.process_index() == 0:  # (a prompt filling it is refused at setup)
                print(f"note: eval.sample_tokens={config.eval.sample_tokens}: {new} tokens "
                      f"generated, where the position table ends (model.max_len="
                      f"{cfg.max_len}, the longest prompt {width} tokens)", file=sys.stderr)
        # As many rows as the batch axes split evenly (extra one-token rows, dropped
        # after): otherwise XLA must replicate the activations at every layer.
        rows = -(-len(prompts) // data_parallel_size()) * data_parallel_size()
        prompts = prompts + [[tok.bos_id]] * (rows - len(prompts))
        padded = np.array([p + [tok.pad_id] * (width - len(p)) for p in prompts], np.int32)
        top_p = config.eval.get("sample_top_p", 1.0)  # .get: a config.json from before it
        out, lengths = gpt.generate(
            model, params, padded, np.array([len(p) for p in prompts], np.int32),
            max_new_tokens=new, rng=rng, temperature=config.eval.sample_temperature,
            top_k=top_k, top_p=top_p if top_p < 1 else None,
            stop_token=tok.eos_id, pad_token=tok.pad_id,
            vocab_size=tok.vocab_size)  # never the ids padding the model's vocabulary
        out, lengths = gather_rows(out), gather_rows(lengths)
        return [tok.decode(out[i, :lengths[i]]) for i in range(len(config.eval.sample_prompts))]

    # An untied head's input table is only looked up; a tied one is the output matmul.
    lookups = flops.LOOKUP_TABLES + (() if cfg.tie_embeddings else ("token_embedding",))
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros((1, data_opts.seq_len), jnp.int32))["params"],
                vocab_size=tok.vocab_size,
                loss=loss, train_source=train_rows, eval_source=eval_rows,
                train_transform=data.CausalLM(data_opts.packing), eval_transform=data.CausalLM(data_opts.packing),
                unit="tokens",
                count=lambda b: int(np.sum(b["weights"])), sample=sample,
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)), seq_len=data_opts.seq_len,
                # The position table bounds the input only when it is learned.
                attention_input=_text_attention_input(
                    tok, cfg.max_len if cfg.position == "learned" else None, config.task),
                # An MoE's experts count top_k of num_experts: those a token passes through.
                flops_per_unit=lambda params: flops.flops_per_token(
                    flops.matmul_params(params, lookups, experts_per_token=(
                        (cfg.top_k, cfg.num_experts) if cfg.mlp == "moe" else None)),
                    cfg.num_layers, data_opts.seq_len, cfg.d_model),
                tokens_per_example=data_opts.seq_len)


def mlm_slots(mask_rate: float, seq_len: int) -> int:
    """The M positions per row the MLM head projects: at least the most that mlm_mask
    predicts in a row of seq_len (round(mask_rate * eligible), at least 1; the + 1 covers
    a product just over a whole number), and never more than the row's seq_len
    positions: lax.top_k refused k > T (mask_rate=0.95, seq_len=10 gave k=11 and the
    first step stopped)."""
    return min(math.ceil(mask_rate * seq_len) + 1, seq_len)


def mlm_task(config, workdir: str) -> Task:
    """BERT masked-language modelling (Devlin et al. 2019) on packed documents."""
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    # before the corpus and tokenizer are built (the vocabulary a stand-in)
    check_model_config(bert.BertConfig, config, vocab_size=LOOSE_VOCAB,
                       dtype=config.train.compute_dtype)
    data_opts = data_options(config, **MLM_DATA)
    _check_mlm_tokenizer(data_opts)
    documents = _Documents(data_opts)
    # Padding is never masked (a special id) nor attended to (segment ids): a pad that is
    # the end-of-text token is harmless here too.
    tok = _tokenizer(data_opts, workdir, documents)
    _check_mask(data_opts, tok)
    cfg = model_config(bert.BertConfig, config, vocab_size=padded_vocab(tok.vocab_size),
                       dtype=config.train.compute_dtype)
    if cfg.position_embeddings:
        _check_seq_len(data_opts, cfg.max_len)
    model = bert.Bert(cfg)
    train_rows, eval_rows = _rows(data_opts, tok, documents, "documents")
    transform = data.MaskedLM.for_tokenizer(tok, data_opts.mask_rate)
    # The MLM head runs on the M predicted positions only (as BERT's own code does): a
    # [B, T, V] logit array would dominate memory for a 30k vocabulary.
    m_slots = mlm_slots(data_opts.mask_rate, data_opts.seq_len)

    def loss(params, batch, rng, train):
        _, slots = jax.lax.top_k(batch["weights"], m_slots)  # [B, M] predicted positions
        take = lambda x: jnp.take_along_axis(x, slots, axis=1)
        out, aux = model.apply({"params": params}, batch["inputs"],
                               attention_mask=batch["segment_ids"] != 0,
                               positions=batch["positions"], segment_ids=batch["segment_ids"],
                               masked_positions=slots, deterministic=not train, rngs={"dropout": rng})
        # Eval batches: padding rows weigh 0 (steps.evaluate); training: unchanged.
        example_weight = batch.get(EXAMPLE_WEIGHT)
        weights = example_weighted(take(batch["weights"]), example_weight)
        nll, metrics = cross_entropy(out["mlm_logits"], take(batch["targets"]), weights,
                                     config.optim.label_smoothing if train else 0.0)
        if example_weight is not None:
            metrics[WEIGHT] = jnp.sum(weights)  # the predicted tokens the means are over
        return nll, metrics

    encoder = {}  # the last SentenceEncoder, by params: one compilation per restored run

    def embed(params, texts):
        # Imported here: convert is tasks' neighbour layer and train imports both.
        from attention_jax import convert
        if encoder.get("params") is not params:
            host = jax.tree.map(np.asarray, jax.device_get(params))
            # A text reads as the run's training documents read: no [CLS] before it (its
            # MLM training read none; [CLS] text [SEP] was embedded), its end-of-text
            # token after it where the tokenizer has one (the token cache and PackedSource
            # end each document so), cut where its rows were (data.seq_len: the positions
            # past it this run never trained).
            eos = getattr(tok, "eos_id", None)
            encoder.update(params=params, encoder=convert.SentenceEncoder(
                model, host, tok, max_length=min(data_opts.seq_len, cfg.max_len),
                ends=([], [] if eos is None else [eos])))
        return encoder["encoder"].embed(list(texts))

    # The FLOP count is the full model's (every position through the vocabulary), as the
    # benchmarks count BERT; this loss projects only the ~15% predicted positions.
    return Task(model=model, init=lambda rng: model.init(rng, jnp.ones((1, data_opts.seq_len), jnp.int32))["params"],
                vocab_size=tok.vocab_size,
                loss=loss, train_source=train_rows, eval_source=eval_rows,
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["segment_ids"] != 0)),
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)), seq_len=data_opts.seq_len,
                embed=embed, attention_input=_text_attention_input(tok, cfg.max_len, config.task),
                flops_per_unit=lambda params: flops.flops_per_token(
                    flops.matmul_params(params), cfg.num_layers, data_opts.seq_len, cfg.d_model),
                tokens_per_example=data_opts.seq_len,
                # The loss reads neither the pooler nor the NSP head: a run starts them at
                # zero and exports as a BertForMaskedLM, not a BertForPreTraining whose NSP
                # head is a random start.
                untrained=("pooler", "nsp"))


TEXT = ("attention_input", "flops_per_unit", "tokens_per_example")
register("gpt", lm_task, provides=("sample", *TEXT), reads=SAMPLE_KEYS + LM_LOSS_KEYS,
         model=gpt.GPTConfig)
register("bert_mlm", mlm_task, provides=("embed", *TEXT), reads=(), model=bert.BertConfig)
