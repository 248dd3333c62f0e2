"""Sequence-to-sequence families: the RNN with Bahdanau attention (`rnn_seq2seq`) and
the Transformer encoder-decoder (`encdec`)."""

from __future__ import annotations

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import workdir as workdir_lib
from attention_jax.config import PAIR_FILE_KEYS
from attention_jax.data.tokenization import TokenizerEncodeError
from attention_jax.errors import ConfigError
from attention_jax.models import encdec, flops, rnn
from attention_jax.models.beam import MOST_CANDIDATES
from attention_jax.models.losses import WEIGHT, cross_entropy, example_weighted
from attention_jax.data import records_cache
from attention_jax.tasks.base import (AttentionInput, OnDemand, Task, as_text, cache_root,
                                      check_context,
                                      check_model_config, complete_records, data_is_on_demand,
                                      data_options, data_parallel_size, gather_rows,
                                      held_out_files_alone, note_shipped_prompts,
                                      LOOSE_VOCAB, model_config, padded_vocab, record_splits,
                                      register, run_tokenizer, token_labels, until_eos)


def _check_languages(data_opts, records) -> None:
    """config.data.source and .target name text fields of the dataset's records."""
    first = records[0] if len(records) else {}
    valid = sorted(k for k, v in first.items() if isinstance(v, (str, bytes)))
    for key in ("source", "target"):
        if data_opts[key] not in valid:
            raise ConfigError(f"config.data.{key}={data_opts[key]!r} is not a language of "
                              f"{data_opts.name!r}; valid: {valid}")
    if data_opts.source == data_opts.target:  # (as for files: it trained a copy task, unsaid)
        raise ConfigError(f"config.data.source and config.data.target are both "
                          f"{data_opts.source!r}; valid: two different languages of "
                          f"{data_opts.name!r}: {valid}")


def _pairs(data_opts, held_out_only: bool = False):
    """(train, eval) sources of sentence pairs: a dataset's splits, or with
    data.name="files" the records of the user's .jsonl/.parquet/.csv/.tsv files, each holding both
    languages under the keys data.source and data.target (held_out_only: (None, eval),
    of data.eval_files alone)."""
    if data_opts.name == "files":
        if not data_opts.source or not data_opts.target:
            raise ConfigError(f"config.data.source={data_opts.source!r}, config.data.target="
                              f"{data_opts.target!r}; valid: the two keys of a record that hold "
                              f"the source and the target sentence")
        if data_opts.source == data_opts.target:
            raise ConfigError(f"config.data.source and config.data.target are both "
                              f"{data_opts.source!r}; valid: the two keys of a record that "
                              f"hold the source and the target sentence")
    return record_splits(
        data_opts, (data_opts.source, data_opts.target),
        holds="the two languages under data.source and data.target",
        hint="config.data.source and config.data.target to the keys of the two languages",
        held_out_only=held_out_only)


def _whole_pairs(data_opts, records, split: str):
    """`records` less the pairs with an empty side: a blank line in a user's files, or a
    bad record (not JSON, a side missing), which the files source reads as empty. Trained
    on, it taught 'empty source -> end of sentence' and counted in the eval; left out
    here, counted in a warning. A function of the records alone, so a resumed run and a
    reader's evaluation leave out the same ones. The user's files' pairs carry a digest of
    what they hold, read in this same pass: a resume on edited pairs stops
    (loaders.source_id), where their count alone would not tell (a tfds split has its own)."""
    from attention_jax.data.sources import Subset
    keys, files = (data_opts.source, data_opts.target), data_opts.name == "files"
    # A side of spaces only is kept, as it always was here: a run saved before keeps
    # resuming on its rows (the classifier, new, leaves such texts out).
    found = complete_records(records, keys, spaces_are_empty=False, digest=files,
                             cache=cache_root(data_opts))
    if not found.kept:
        raise ConfigError(f"config.data.{split}={data_opts[split]!r} of {data_opts.name!r}: "
                          f"every one of its {found.count} pairs has an empty side "
                          f"({keys[0]!r} or {keys[1]!r})")
    if found.kept < found.count:
        print(f"warning: {found.count - found.kept} of the {found.count} pairs of "
              f"{data_opts.name!r} ({data_opts[split]}) have an empty {keys[0]!r} or "
              f"{keys[1]!r} (or were bad records): left out (a run saved before such pairs "
              f"were left out resumes with --resume_changed)", file=sys.stderr)
    elif not files:
        return records  # a whole tfds split: its own identity (loaders.tfds_id)
    # Its identity: the digest of the files' pairs, else the split's and the pairs kept.
    return Subset(records, found.indices(), fingerprint=(
        f"{found.kept} sentence pairs, contents {found.digest}" if files else ""))


# Records encoded per call of the tokenizer's batch encoding in the length check.
LENGTH_BATCH = 4096


def _longest(data_opts, tok, records) -> dict[str, int]:
    """{'source': n, 'target': m}: the most tokens a source and a target of `records`
    encode to, batch by batch; kept in the records cache, so a restart on the same pairs
    and tokenizer encodes none of them again."""
    from attention_jax.data.tokenization import encode_many, fingerprint
    sides = {"source": data_opts.source, "target": data_opts.target}

    def read() -> dict:
        longest = dict.fromkeys(sides, 0)
        for first in range(0, len(records), LENGTH_BATCH):
            batch = [records[i] for i in range(first, min(first + LENGTH_BATCH, len(records)))]
            names = [f"{i} of the pairs" for i in range(first, first + len(batch))]
            for side, key in sides.items():
                ids = encode_many(tok, [as_text(record[key]) for record in batch], names)
                longest[side] = max(longest[side], *map(len, ids))
        return longest
    what = {"pass": "longest tokens", "keys": list(sides.values()), "tokenizer": fingerprint(tok)}
    return records_cache.remembered(cache_root(data_opts), records, what, read)


def _check_lengths(data_opts, tok, *splits_) -> None:
    """Every source fits config.data.source_len and every target, with its end token,
    target_len: found here, before training, rather than at the batch that holds the
    first one too long."""
    found = [_longest(data_opts, tok, records) for records in splits_]
    for key, length in (("source", data_opts.source_len), ("target", data_opts.target_len)):
        most = max(longest[key] for longest in found) + (key == "target")  # its end token
        if most > length:
            raise ConfigError(f"config.data.{key}_len={length}: the longest {key} "
                              f"({data_opts[key]!r}) of {data_opts.name!r} has {most} "
                              f"tokens{' with its end token' if key == 'target' else ''}; "
                              f"valid: {key}_len >= {most}")


def translation_task(config, workdir: str) -> Task:
    """Sequence to sequence, teacher-forced (default: English -> French number words).

    config.task 'rnn_seq2seq' uses models/rnn.py; 'encdec' the Transformer of encdec.py.
    One BPE vocabulary is shared by both languages (Vaswani et al. 2017 §5.1 share one).
    """
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    # before the data and tokenizer are built (the vocabulary and its ids stand-ins)
    check_model_config(rnn.RNNConfig if config.task == "rnn_seq2seq" else encdec.EncDecConfig,
                       config, vocab_size=LOOSE_VOCAB, pad_id=0, bos_id=1, eos_id=2,
                       dtype=config.train.compute_dtype)
    data_opts = data_options(config, name="number_translation", data_dir="", source="en", target="fr",
                     tokenizer="bpe", vocab_size=512, source_len=32, target_len=32,
                     train_split="train", eval_split="validation", **PAIR_FILE_KEYS)
    if data_opts.tokenizer == "wordpiece":
        raise ConfigError("config.data.tokenizer='wordpiece' is BERT's vocabulary for masked "
                          "language modelling: it has no beginning- or end-of-sentence token, "
                          "which a decoder starts and stops with; valid: ['char', 'byte', "
                          "'bpe'] or a tokenizer.json")

    reader = data_is_on_demand()

    @functools.cache
    def sources(held_out_only: bool = False):  # no record read but the first
        train, evaluated = _pairs(data_opts, held_out_only)
        _check_languages(data_opts, evaluated if held_out_only else train)
        return {"train_split": train, "eval_split": evaluated}

    @functools.cache
    def whole(split: str):  # one split's pairs with both sides: reads that split alone
        # (a reader's evaluation of data.eval_files lists no training file)
        alone = reader and split == "eval_split" and held_out_files_alone(data_opts)
        return _whole_pairs(data_opts, sources(alone)[split], split)
    if reader:  # a reader (sampling, attention maps) needs no data; an
        # evaluation reads its split only
        train_src, eval_src = (OnDemand(lambda: whole("train_split")),
                               OnDemand(lambda: whole("eval_split")))
    else:
        train_src, eval_src = whole("train_split"), whole("eval_split")
    tok = run_tokenizer(data_opts, workdir, lambda: [as_text(train_src[i][k]) for i in range(len(train_src))
                                          for k in (data_opts.source, data_opts.target)])
    if tok.eos_id is None:  # (was a TypeError in a loader thread, once training began)
        raise ConfigError(f"config.data.tokenizer={data_opts.tokenizer!r} has no end-of-text "
                          f"token, which ends every target and tells the decoder where to "
                          f"stop; valid: a tokenizer with one, or eos_token named in a "
                          f"special_tokens_map.json beside its tokenizer.json")
    if not reader:  # a reader's run trained on these lengths already
        _check_lengths(data_opts, tok, train_src, eval_src)
    note_shipped_prompts(config, data_opts.name)  # (once the data is there: errors first)
    ids = dict(pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
    vocab = padded_vocab(tok.vocab_size)
    if config.task == "rnn_seq2seq":
        cfg = model_config(rnn.RNNConfig, config, vocab_size=vocab,
                           dtype=jnp.dtype(config.train.compute_dtype), **ids)
        model = rnn.RNNSeq2Seq(cfg)
        generate = jax.jit(lambda params, src, max_len: model.apply(
            {"params": params}, src, max_len=max_len, method=model.generate,
            vocab_size=tok.vocab_size)[0], static_argnums=2)
        decode = lambda params, src, max_len: generate(params, src, int(max_len))
        # Recurrent: no PaLM count (its additive attention is no Transformer's 12·L·T·D).
        entries = {}
    else:
        cfg = model_config(encdec.EncDecConfig, config, vocab_size=vocab,
                           dtype=config.train.compute_dtype, **ids)
        model = encdec.EncoderDecoder(cfg)
        decode = lambda params, src, max_len: encdec.greedy_decode(
            model, params, src, max_len=int(max_len), vocab_size=tok.vocab_size)
        entries = dict(flops_per_unit=lambda params: _encdec_flops(cfg, data_opts, params))

    def loss(params, batch, rng, train):
        logits, aux = model.apply({"params": params}, batch["inputs"], batch["decoder_inputs"],
                                  deterministic=not train, rngs={"dropout": rng})
        # Eval batches: padding rows weigh 0 (steps.evaluate); training: unchanged.
        example_weight = batch.get(EXAMPLE_WEIGHT)
        weights = example_weighted(batch["target_weights"], example_weight)
        nll, metrics = cross_entropy(logits, batch["targets"], weights,
                                     config.optim.label_smoothing if train else 0.0)
        if example_weight is not None:
            metrics[WEIGHT] = jnp.sum(weights)  # the target tokens the means are over
        return nll, metrics

    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del index  # a translation is drawn on a source text
        if text is None:
            raise ValueError(f"text=None: task {config.task!r} draws its attention on a source "
                             f"sentence; give one")
        src = tok.encode(text)
        check_context(len(src), data_opts.source_len, "the source text")
        if not src:
            raise ValueError(f"text={text!r} encodes to no tokens; give a source sentence")
        src_arr = np.array([src], np.int32)
        if target is not None:
            tgt = tok.encode(target) + [tok.eos_id]  # Targets end with EOS, as in training.
        else:  # The model's own translation: greedy, cut after its EOS.
            out = np.asarray(decode(params, src_arr, data_opts.target_len))[0]
            ends = np.flatnonzero(out == tok.eos_id)
            tgt = out[:ends[0] + 1 if len(ends) else len(out)].tolist()
        check_context(len(tgt), data_opts.target_len, "the target")
        # Teacher-forced on the target: row i is the attention while predicting token i.
        tgt_in = np.array([[tok.bos_id] + tgt[:-1]], np.int32)
        s, t = token_labels(tok, src), token_labels(tok, tgt)
        return AttentionInput(inputs=(src_arr, tgt_in),
                              labels={"cross": (t, s), "encoder": (s, s), "decoder": (t, t)},
                              info={"source": s, "target": t, "translation": tok.decode(tgt)},
                              title=f"{data_opts.source}→{data_opts.target}", alignment="cross")

    _encode_prompts(config.eval.sample_prompts, tok, data_opts.source_len)  # checked now
    beam = config.eval.beam_size
    # Decodes emit only the tokenizer's ids, never those padding the model's vocabulary.
    vocab = tok.vocab_size
    model_vocab = getattr(model.config, "target_vocab_size", model.config.vocab_size)
    most = min(vocab, MOST_CANDIDATES // model_vocab)  # (top_k's int32 indices into W·V)
    if beam > most:  # (a beam of 1e9 was a traceback)
        raise ConfigError(f"config.eval.beam_size={beam}: more beams than "
                          + (f"the target vocabulary's {vocab} tokens" if most == vocab else
                             f"int32 indices into {model_vocab} tokens a beam allow")
                          + f"; valid: 1..{most} (Vaswani et al. used 4)")
    if beam > 1:  # the best beam of each row
        search = rnn.beam_search if config.task == "rnn_seq2seq" else encdec.beam_search
        decode_best = jax.jit(lambda params, src: search(
            model, params, src, beam_size=beam, max_len=data_opts.target_len,
            vocab_size=tok.vocab_size)[0][:, 0])
    else:
        decode_best = lambda params, src: decode(params, src, data_opts.target_len)  # noqa: E731
    # Rows a call decodes at once: one compiled shape (eval.batch_size, as many as the
    # batch axes split evenly; the last batch padded and its extra rows dropped after).
    per_call = -(-config.eval.batch_size // data_parallel_size()) * data_parallel_size()

    def translate(params, texts, untranslated: dict | None = None) -> list[str]:
        """Each source text's translation: greedy, or the best of a beam search of
        config.eval.beam_size. A text of no tokens or more than data.source_len is a
        ValueError; with `untranslated` (a dict) it is translated as '' and its index
        maps to why there, the others translated."""
        ids, good = [], []
        for i, text in enumerate(texts):
            ids.append(tok.encode(text))
            if not ids[-1] or len(ids[-1]) > data_opts.source_len:
                shown = text if len(text) <= 40 else text[:37] + "..."
                why = (f"source {i + 1} ({shown!r}) is {len(ids[-1])} tokens; valid: "
                       f"1..{data_opts.source_len} tokens (data.source_len)")
                if untranslated is None:
                    raise ValueError(why)
                untranslated[i] = why
            else:
                good.append(i)
        out = [""] * len(texts)
        for first in range(0, len(good), per_call):
            chunk = good[first:first + per_call]
            # padded as in training: the pad id masks it out of attention
            src = np.full((per_call, data_opts.source_len), tok.pad_id, np.int32)
            for row, i in enumerate(chunk):
                src[row, :len(ids[i])] = ids[i]
            tokens = gather_rows(decode_best(params, src))[:len(chunk)]
            for i, row in zip(chunk, tokens):
                out[i] = tok.decode(until_eos(row, tok.eos_id))
        return out

    def sample(params, rng) -> list[str]:
        """Translations of config.eval.sample_prompts (source sentences)."""
        del rng  # greedy or beam: the model's most likely translation
        return translate(params, list(config.eval.sample_prompts))

    transform = data.Translation(tok, tok, data_opts.source, data_opts.target, data_opts.source_len, data_opts.target_len)
    zeros = lambda n: jnp.zeros((1, n), jnp.int32)
    return Task(model=model, init=lambda rng: model.init(rng, zeros(data_opts.source_len) + 3,
                                                         zeros(data_opts.target_len) + 3)["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["target_weights"])),
                save_assets=lambda w: tok.save(workdir_lib.path(w, workdir_lib.TOKENIZER)),
                decode=decode, translate=translate, attention_input=attention_input,
                sample=sample, **entries)


def _encode_prompts(texts, tok, source_len: int) -> list[list[int]]:
    """Sample prompts (source sentences) as ids, checked before training: each encodes to
    1..source_len tokens."""
    prompts = []
    for text in texts:
        try:
            ids = tok.encode(text)
        except TokenizerEncodeError as e:
            raise ConfigError(f"config.eval.sample_prompts: {e}") from None
        prompts.append(ids)
        if not ids or len(ids) > source_len:
            raise ConfigError(f"config.eval.sample_prompts: {text!r} is {len(ids)} tokens; "
                              f"valid: source sentences of 1..{source_len} tokens "
                              f"(data.source_len), or none (--config.eval.sample_prompts='()')")
    return prompts


def _encdec_flops(cfg, data_opts, params) -> float:
    """Model FLOPs per target position of an encoder-decoder step on padded rows of S =
    source_len and T = target_len: the encoder's S tokens and the decoder's T tokens each by
    flops_per_token, and the decoder's cross-attention to S keys."""
    # The embedding is looked up on both sides; shared, it is the output projection too
    # (counted once with the decoder); unshared, the output is a matmul of its own.
    lookups = flops.LOOKUP_TABLES + (() if cfg.share_embeddings else ("embedding",))
    p = nn.meta.unbox(params)
    n_encoder = flops.matmul_params(p["encoder"], lookups)
    n_decoder = flops.matmul_params(p, lookups) - n_encoder
    s, t, width = data_opts.source_len, data_opts.target_len, cfg.d_model
    total = (s * flops.flops_per_token(n_encoder, cfg.num_encoder_layers, s, width)
             + t * flops.flops_per_token(n_decoder, cfg.num_decoder_layers, t, width)
             + t * flops.attention_flops_per_token(cfg.num_decoder_layers, s, width))
    return total / t


# Translations of the prompts, greedy or by beam: no sampling settings, no length
# (data.target_len).
register("rnn_seq2seq", translation_task, provides=("decode", "translate", "attention_input",
                                                    "sample"),
         reads=("eval.sample_prompts", "eval.beam_size"), model=rnn.RNNConfig)
register("encdec", translation_task, provides=("decode", "translate", "attention_input",
                                               "flops_per_unit", "sample"),
         reads=("eval.sample_prompts", "eval.beam_size"), model=encdec.EncDecConfig)
