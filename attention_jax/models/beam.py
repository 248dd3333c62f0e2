"""Beam search over any decoder that scores the next token one step at a time.

    tokens, scores = search(step, state, batch=B, beam_size=4, max_len=20, vocab=V,
                            bos_id=1, eos_id=2, pad_id=0)

`step(state, last, i) -> (log_probs [B·W, V], state)` advances every beam by the token
`last` [B·W] at output position i; `state` is whatever the decoder carries between steps
(a Transformer's KV cache, an RNN's hidden state), each array holding its B·W beams
along `take_rows`' axis (row b·W + k is beam k of source b). encdec.beam_search and
rnn.beam_search are this with their decoders' steps.

Keeps the W best prefixes per source by their length-penalised score. A beam that has
emitted eos is finished: it extends only with pad at no cost, and competes with live
beams by its score (GNMT's length penalty, Wu et al. 2016, §7; Vaswani et al. §6.1 used
W = 4, alpha = 0.6). Returns (tokens [B, W, max_len], scores [B, W]) sorted best first;
scores are log p(y | x) / lp(|y|), |y| counting tokens up to and including eos.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp

from attention_jax.errors import is_int
from attention_jax.layers.posemb import check_below, check_ids


# top_k's indices into a row of W·V candidates are int32: W·V at most this.
MOST_CANDIDATES = 2**31 - 1


def check_decode_inputs(src, max_len, vocab_size: int) -> None:
    """A sequence-to-sequence decode's source ids [B, S] and length, checked before its
    jitted loop (greedy or beam; encdec's, rnn's): there an id past the vocabulary embeds
    a NaN row (all-pad tokens, NaN beam scores, unsaid), and max_len 0 failed as an
    IndexError from a cache."""
    check_ids("src", src)
    check_below("src", src, vocab_size, "token ids of the model's vocabulary")
    if not is_int(max_len) or max_len < 1:
        raise ValueError(f"max_len={max_len!r}; valid: an int >= 1 (tokens to decode)")


def check_beam_size(beam_size) -> int:
    if not is_int(beam_size) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1; got {beam_size!r}")
    return int(beam_size)


def check_alpha(alpha) -> float:
    """The length penalty's exponent as a float: a finite number (NaN ranked every beam
    as NaN, unsaid; a string was float()'s bare message)."""
    if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"alpha={alpha!r}; valid: a finite number (GNMT's length penalty "
                         f"exponent; 0: none, Vaswani et al. 0.6)")
    return float(alpha)


def check_vocab_size(vocab_size, model_vocab: int, special_ids=()):
    """`vocab_size` as a decode's static argument: None where it is the model's (or not
    given), else an int in 1..model_vocab past every special id (the end of a sequence
    must be emittable); ValueError naming it otherwise."""
    if vocab_size is None or vocab_size == model_vocab:
        return None
    least = max(special_ids, default=-1) + 1
    if not is_int(vocab_size) or not max(1, least) <= vocab_size <= model_vocab:
        raise ValueError(f"vocab_size={vocab_size!r}; valid: None or {max(1, least)}.."
                         f"{model_vocab} (the model's vocabulary"
                         + (f", past its special ids {sorted(special_ids)})" if least > 1
                            else ")"))
    return int(vocab_size)


def only_vocabulary(logits, vocab_size):
    """logits [..., V] with the ids from `vocab_size` up at -inf, so that no decode picks
    them (a tokenizer's vocabulary, where the model's is padded to a multiple of 64 for
    its matmuls: those ids decode to nothing; a beam search of more beams than ids can
    only fill its last beams, at score -inf, with them); unchanged where vocab_size is
    None."""
    if vocab_size is None:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


def length_penalty(length, alpha: float):
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, §7); scores are log p / lp."""
    return ((5.0 + length) / 6.0) ** alpha


def rows_along(axis: int) -> Callable:
    """take_rows for a state whose every array holds the beams along `axis`."""
    return lambda state, rows: jax.tree.map(lambda x: jnp.take(x, rows, axis=axis), state)


def search(step: Callable, state, *, batch: int, beam_size: int, max_len: int, vocab: int,
           bos_id: int, eos_id: int, pad_id: int, alpha: float = 0.6,
           take_rows: Callable = rows_along(0)):
    """(tokens [B, W, max_len], scores [B, W]), best first (the module's text). `state`
    holds B·W rows (each source's repeated W times); take_rows(state, rows) picks rows
    [B·W] of it, each beam's parent after a step."""
    beam_size = check_beam_size(beam_size)
    if not is_int(max_len) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1; got {max_len!r}")
    max_len, alpha = int(max_len), check_alpha(alpha)
    b, w, v = batch, beam_size, vocab
    if w * v > MOST_CANDIDATES:
        raise ValueError(f"beam_size={w} with a vocabulary of {v}: {w * v} candidates a step; "
                         f"valid: beam_size <= {MOST_CANDIDATES // v}")
    pad_only = jnp.where(jnp.arange(v) == pad_id, 0.0, -jnp.inf)  # [V]: finished beams

    def body(carry, i):
        state, tokens, logp, finished, lengths = carry
        prev = tokens[:, :, jnp.maximum(i - 1, 0)]  # [B, W]
        last = jnp.where(i == 0, bos_id, prev).reshape(b * w)  # each beam's latest token
        step_logp, state = step(state, last, i)
        step_logp = jnp.where(finished[..., None], pad_only,
                              step_logp.reshape(b, w, v).astype(jnp.float32))
        cand = logp[..., None] + step_logp  # [B, W, V]
        cand_len = jnp.where(finished, lengths, i + 1)[..., None]  # [B, W, 1]
        rank = (cand / length_penalty(cand_len, alpha)).reshape(b, w * v)
        _, best = jax.lax.top_k(rank, w)  # [B, W]
        parent, token = best // v, (best % v).astype(jnp.int32)
        gather = functools.partial(jnp.take_along_axis, indices=parent, axis=1)
        logp = jnp.take_along_axis(cand.reshape(b, w * v), best, axis=1)
        lengths = gather(jnp.broadcast_to(cand_len[..., 0], (b, w)))
        finished = gather(finished) | (token == eos_id)
        tokens = jnp.take_along_axis(tokens, parent[..., None], axis=1).at[:, :, i].set(token)
        rows = (jnp.arange(b)[:, None] * w + parent).reshape(b * w)  # parent rows in B·W
        return (take_rows(state, rows), tokens, logp, finished, lengths), None

    # Only beam 0 is alive at the start, so the first step expands one prefix, not W copies.
    logp = jnp.tile(jnp.where(jnp.arange(w) == 0, 0.0, -jnp.inf)[None], (b, 1)).astype(
        jnp.float32)
    start = (state, jnp.full((b, w, max_len), pad_id, jnp.int32), logp,
             jnp.zeros((b, w), bool), jnp.zeros((b, w), jnp.int32))
    # (int32 steps and float32 scores: under jax_enable_x64 Python's literals widen)
    (_, tokens, logp, _, lengths), _ = jax.lax.scan(body, start,
                                                    jnp.arange(max_len, dtype=jnp.int32))
    scores = logp / length_penalty(lengths, alpha)
    order = jnp.argsort(-scores, axis=1)
    return (jnp.take_along_axis(tokens, order[..., None], axis=1),
            jnp.take_along_axis(scores, order, axis=1))
