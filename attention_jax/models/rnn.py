"""RNN sequence-to-sequence model: the encoder-decoder the lectures start from, and the
attention that was invented to fix it.

Two decoders share one code path, switched by `RNNConfig.attention`:
  - bottleneck (Cho et al. 2014, "RNN Encoder-Decoder"; Sutskever et al. 2014): the whole
    source is squeezed into one fixed vector c, the encoder's final state, and the decoder
    reads the same c at every step. Long sentences must fit through that vector.
  - additive attention (Bahdanau, Cho & Bengio 2015, "RNNsearch"): at every step i the
    decoder scores each encoder state h_j against its previous state s_{i-1},
        e_ij = vᵀ tanh(W_s s_{i-1} + W_h h_j),   α_i = softmax_j(e_ij),   c_i = Σ_j α_ij h_j,
    so the context is recomputed per target word and padding positions get α = 0.

    model = RNNSeq2Seq(RNNConfig.from_variant("tiny"))
    params = model.init(key, src, tgt_in)["params"]
    logits, aux = model.apply({"params": params}, src, tgt_in, return_weights=True)   # [B, T, V]
    aux["attention_weights"]["cross"]   # [1, B, 1, T, S]: one layer, one additive "head"
    tokens, aux = model.apply({"params": params}, src, method=model.generate, max_len=20)
    tokens, scores = beam_search(model, params, src, beam_size=4, max_len=20)  # [B, W, 20]

Sources are right-padded with `pad_id` (or give `src_mask` [B, S], True on real tokens).
Targets: decoder input is `losses.shift_right(targets)` ([BOS, y_1, ..., y_{T-1}]), loss
is `losses.cross_entropy(logits, targets, weights)` with the weights by position, each
target's tokens and its EOS: `jnp.arange(T) <= lengths[:, None]`, lengths [B] the tokens
before EOS (data.seq2seq_example's `target_weights`, what the translation task trains
on). Not `targets != pad_id`: where a tokenizer's pad is its EOS it weighs every EOS 0,
and the model never learns to stop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.errors import (check_bools, check_fields, check_flags, check_float_dtypes,
                                 check_positive_ints, check_rates_and_epsilon, is_int)
from attention_jax.layers.posemb import Embed, check_below, check_ids
from attention_jax.models import beam

__all__ = ["RNNConfig", "RNNSeq2Seq", "VARIANTS", "beam_search"]

CELLS = ("gru", "lstm")


@dataclasses.dataclass(frozen=True)
class RNNConfig:
    vocab_size: int  # the source's, and the target's unless tgt_vocab_size is set
    embed_dim: int  # m in Bahdanau et al. Appendix A
    hidden_dim: int  # n: units per direction of the encoder, and of the decoder
    attention_dim: int  # n': hidden size of the alignment MLP
    readout_dim: int  # l: maxout units of the deep output layer
    attention: bool = True  # False: the single-context-vector bottleneck
    bidirectional: bool = True  # encoder reads the source both ways (annotations = [→h; ←h])
    cell: str = "gru"  # the recurrent cell: "gru" | "lstm"
    dropout_rate: float = 0.0  # on the embeddings and the readout
    tgt_vocab_size: Optional[int] = None  # a target vocabulary of its own (None: vocab_size)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = jnp.float32  # computation dtype; params stay float32

    def __post_init__(self):
        if self.cell not in CELLS:
            raise ValueError(f"cell={self.cell!r} is unknown; valid: {CELLS}")
        check_float_dtypes(self)
        check_bools(self)
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("vocab_size", "target_vocab_size", "embed_dim",
                                   "hidden_dim", "attention_dim", "readout_dim"))
        for name in ("pad_id", "bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.target_vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} must lie in "
                                 f"[0, target vocabulary size {self.target_vocab_size})")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size or self.vocab_size

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "RNNConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown RNN variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})


# Bahdanau et al. 2015, Section 4.2 and Appendix A.2: 30k-word vocabularies, 620-d
# embeddings, 1000 hidden units (per direction in RNNsearch's encoder), a 1000-unit
# alignment model and a 500-unit maxout readout. RNNencdec is the paper's baseline
# (Cho et al. 2014): same sizes, one-directional encoder, no attention.
_PAPER = dict(vocab_size=30000, embed_dim=620, hidden_dim=1000,
              attention_dim=1000, readout_dim=500)
_TINY = dict(vocab_size=32, embed_dim=16, hidden_dim=32,
             attention_dim=32, readout_dim=16)
VARIANTS = {
    "rnnsearch": dict(_PAPER, attention=True, bidirectional=True),
    "rnnencdec": dict(_PAPER, attention=False, bidirectional=False),
    "tiny": dict(_TINY, attention=True),
    "tiny-bottleneck": dict(_TINY, attention=False),
    "tiny-lstm": dict(_TINY, attention=True, cell="lstm"),
}


# ----------------------------------------------------------------------------- helpers


def _dense(features, in_axis, out_axis, name, use_bias=True, dtype=jnp.float32):
    return nn.Dense(
        features, use_bias=use_bias, dtype=dtype, name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (in_axis, out_axis)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (out_axis,)))


def _cell(cfg: RNNConfig, **module_kwargs):
    """A GRU or LSTM cell of cfg.hidden_dim units. The hidden units carry the MLP axis
    (the only wide axis an RNN has); the recurrent kernel's input side stays unsharded
    because one parameter cannot use a mesh axis twice."""
    cls = nn.GRUCell if cfg.cell == "gru" else nn.LSTMCell
    # flax starts the carry in param_dtype: float32 params under dtype float64 made the
    # scan's carry float32 in, float64 out (a TypeError at init); bfloat16 keeps float32.
    return cls(
        features=cfg.hidden_dim, dtype=cfg.dtype,
        param_dtype=jnp.promote_types(jnp.float32, cfg.dtype), **module_kwargs,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (axes.EMBED, axes.MLP)),
        recurrent_kernel_init=nn.with_logical_partitioning(nn.initializers.orthogonal(), (None, axes.MLP)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes.MLP,)))


def _hidden(cfg: RNNConfig, carry):
    """The state s the rest of the model reads: h for a GRU, h of (c, h) for an LSTM."""
    return carry if cfg.cell == "gru" else carry[1]


# ----------------------------------------------------------------------------- decoder step


class DecoderStep(nn.Module):
    """One decoder step: previous token -> (new carry, logits, attention weights).

    Scanned over time both for teacher forcing and for greedy decoding, so the two use
    the same parameters and the same arithmetic.
    """

    config: RNNConfig

    @nn.compact
    def __call__(self, carry, y_prev, memory, deterministic: bool):
        """carry: cell state; y_prev: [B] token ids; memory: dict of encoder arrays
        (annotations [B, S, C], keys [B, S, A] = W_h h_j, mask [B, S], summary [B, C])."""
        cfg = self.config
        emb = Embed(cfg.target_vocab_size, cfg.embed_dim, dtype=cfg.dtype, name="embed",
                    embedding_init=nn.with_logical_partitioning(
                        nn.initializers.normal(1.0), (axes.VOCAB, axes.EMBED)))(y_prev)  # [B, m]
        emb = nn.Dropout(cfg.dropout_rate)(emb, deterministic=deterministic)
        s_prev = _hidden(cfg, carry)  # [B, n]

        if cfg.attention:
            # e_ij = vᵀ tanh(W_s s_{i-1} + W_h h_j); W_h h_j was computed once per source
            # (Bahdanau et al. Appendix A.1.2: it does not depend on i).
            query = _dense(cfg.attention_dim, axes.MLP, axes.HEAD_DIM, "attn_query",
                           use_bias=False, dtype=cfg.dtype)(s_prev)  # [B, A]
            hid = jnp.tanh(memory["keys"] + query[:, None, :])  # [B, S, A]
            scores = _dense(1, axes.HEAD_DIM, None, "attn_v", use_bias=False,
                            dtype=cfg.dtype)(hid)[..., 0]  # [B, S]
            # A finite fill (not -inf) keeps a row with no real source token NaN-free,
            # forward and backward; the final where gives padding exactly zero weight.
            # The softmax in float32 at least: float64 under dtype float64 (the numerics
            # checks), where a float32 one gave the float64 model weights off by ~1e-7.
            exact = jnp.promote_types(cfg.dtype, jnp.float32)
            scores = jnp.where(memory["mask"], scores.astype(exact), jnp.finfo(exact).min)
            alpha = jnp.where(memory["mask"], jax.nn.softmax(scores, axis=-1), 0.0)  # [B, S]
            context = jnp.einsum("BS,BSC->BC", alpha.astype(cfg.dtype), memory["annotations"])
        else:
            # The bottleneck: the same summary vector at every step (Cho et al. 2014, Section 2.2).
            context = memory["summary"]  # [B, C]
            alpha = None  # there is nothing to align

        # The GRU/LSTM input is [E y_{i-1}; c_i]: a linear map of the concatenation equals
        # Bahdanau's separate W E y + C c terms.
        carry, s_new = _cell(self.config, name="cell")(carry, jnp.concatenate([emb, context], -1))

        # Deep output (Bahdanau et al. Appendix A.2.2): t̃ = U s_i + V E y_{i-1} + C c_i,
        # a maxout over pairs of t̃ units, then a linear map to the vocabulary.
        pre = _dense(2 * cfg.readout_dim, axes.EMBED, axes.MLP, "readout", dtype=cfg.dtype)(
            jnp.concatenate([s_new, emb, context], -1))  # [B, 2l]
        t = jnp.max(pre.reshape(pre.shape[:-1] + (cfg.readout_dim, 2)), axis=-1)  # [B, l]
        t = nn.Dropout(cfg.dropout_rate)(t, deterministic=deterministic)
        logits = _dense(cfg.target_vocab_size, axes.MLP, axes.VOCAB, "logits", dtype=cfg.dtype)(t)
        return carry, logits, alpha


def _teacher_body(step: DecoderStep, carry, y_prev, memory, deterministic):
    carry, logits, alpha = step(carry, y_prev, memory, deterministic)
    return carry, (logits, alpha)


def _greedy_body(step: DecoderStep, state, _, memory, deterministic, vocab_size=None):
    carry, y_prev, done = state
    cfg = step.config
    carry, logits, alpha = step(carry, y_prev, memory, deterministic)
    logits = beam.only_vocabulary(logits, vocab_size)
    token = jnp.argmax(logits, axis=-1).astype(y_prev.dtype)  # [B]
    live = ~done  # this step belongs to the output (up to and including EOS)
    token = jnp.where(live, token, cfg.pad_id)  # finished rows emit padding
    return (carry, token, done | (token == cfg.eos_id)), (token, alpha, live)


def _scan(body, length=None):
    # Parameters are shared over time (broadcast); dropout draws a fresh mask per step.
    # On a data-parallel mesh XLA all-reduces the weights' gradient at every step of the
    # backward loops (each step's contracts over the split batch), not once after them:
    # XLA:CPU's optimised HLO of `bottleneck` on 8 devices (2026-11-29). Left as it is for
    # the teaching model; shard_map over the batch would reduce once at its boundary.
    return nn.scan(body, variable_broadcast="params", split_rngs={"params": False, "dropout": True},
                   in_axes=(1, nn.broadcast, nn.broadcast), out_axes=1, length=length)


# ----------------------------------------------------------------------------- model


class RNNSeq2Seq(nn.Module):
    """GRU/LSTM encoder-decoder, with Bahdanau attention or the single-vector bottleneck."""

    config: RNNConfig

    def setup(self):
        cfg = self.config
        self.src_embed = Embed(cfg.vocab_size, cfg.embed_dim, dtype=cfg.dtype,
                               embedding_init=nn.with_logical_partitioning(
                                   nn.initializers.normal(1.0), (axes.VOCAB, axes.EMBED)))
        # parent=None: the cells are adopted by their nn.RNN rather than by this module.
        forward = nn.RNN(_cell(cfg, parent=None), parent=None)
        if cfg.bidirectional:
            backward = nn.RNN(_cell(cfg, parent=None), parent=None)
            self.encoder = nn.Bidirectional(forward, backward, return_carry=True)
        else:
            self.encoder = forward
        self.attn_keys = _dense(cfg.attention_dim, axes.EMBED, axes.HEAD_DIM, "attn_keys",
                                dtype=cfg.dtype)
        self.init_state = _dense(cfg.hidden_dim, axes.EMBED, axes.MLP, "init_state", dtype=cfg.dtype)
        self.decoder = DecoderStep(cfg)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def encode(self, src, src_mask=None, deterministic: bool = True):
        """src: [B, S] ids, right-padded. Returns (memory dict, initial decoder carry)."""
        cfg = self.config
        src_mask = _check_source(src, src_mask, cfg.pad_id)
        lengths = jnp.sum(src_mask, axis=-1).astype(jnp.int32)  # [B]
        x = self.dropout(self.src_embed(src), deterministic=deterministic)  # [B, S, m]
        carry, annotations = self.encoder(x, seq_lengths=lengths, return_carry=True)  # [B, S, C]
        annotations = jnp.where(src_mask[..., None], annotations, 0)  # no junk past the end
        if cfg.bidirectional:
            # [→h_last; ←h_1]: each direction's state after reading the whole sentence.
            summary = jnp.concatenate([_hidden(cfg, carry[0]), _hidden(cfg, carry[1])], -1)
        else:
            summary = _hidden(cfg, carry)  # [B, n]
        # s_0 = tanh(W_s summary): Bahdanau et al. A.2.2 use ←h_1; Cho et al. the last h.
        s0 = jnp.tanh(self.init_state(summary))  # [B, n]
        dec_carry = s0 if cfg.cell == "gru" else (jnp.zeros_like(s0), s0)
        memory = dict(annotations=annotations, mask=src_mask, summary=summary)
        if cfg.attention:  # W_h h_j: computed once per source, read at every decoder step
            memory["keys"] = self.attn_keys(annotations)  # [B, S, A]
        return memory, dec_carry

    def __call__(self, src, tgt_in, src_mask=None, deterministic: bool = True,
                 return_weights: bool = False):
        """Teacher forcing: src [B, S], tgt_in [B, T] (= shift_right(targets)).

        Returns (logits [B, T, V], aux): aux["hidden_states"] [B, S, C] (the encoder's
        annotations), aux["summary"] [B, C] (the bottleneck vector) and, with attention and
        return_weights, aux["attention_weights"]["cross"] [1, B, 1, T, S] (the other
        families' [L, B, N, T, S]; each row sums to 1 over real source tokens, 0 on
        padding). The weights are computed either way: they make the context."""
        check_flags(deterministic=deterministic, return_weights=return_weights)
        check_ids("tgt_in", tgt_in)
        # The decoder embeds tgt_in inside its scan, where the ids are traced and the
        # lookup's own check cannot see them: an id past the target vocabulary gave NaN
        # logits, unsaid. Checked here where they are concrete (an eager apply).
        check_below("tgt_in", tgt_in, self.config.target_vocab_size,
                    "token ids of the target vocabulary")
        memory, carry = self.encode(src, src_mask, deterministic)  # checks src
        if src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"src and tgt_in need the same batch B: src {tuple(src.shape)}, "
                             f"tgt_in {tuple(tgt_in.shape)}")
        _, (logits, alpha) = _scan(_teacher_body)(self.decoder, carry, tgt_in, memory, deterministic)
        return logits, _aux(alpha if return_weights else None,
                            hidden_states=memory["annotations"], summary=memory["summary"])

    def generate(self, src, src_mask=None, max_len: int = 32, return_weights: bool = False,
                 vocab_size: Optional[int] = None):
        """Greedy decoding for max_len steps from BOS. After a row emits EOS it emits
        pad_id. vocab_size: ids from it up are never emitted (a tokenizer's vocabulary,
        where the model's is padded past it). Returns (tokens [B, max_len], aux) with
        aux["lengths"] [B] (tokens up to and including EOS, or max_len) and, with
        attention and return_weights, aux["attention_weights"]["cross"] [1, B, 1,
        max_len, S]."""
        cfg = self.config
        if not is_int(max_len) or max_len <= 0:
            raise ValueError(f"max_len must be a positive int; got {max_len!r}")
        vocab_size = beam.check_vocab_size(vocab_size, cfg.target_vocab_size,
                                              (cfg.pad_id, cfg.bos_id, cfg.eos_id))
        memory, carry = self.encode(src, src_mask, deterministic=True)
        b = src.shape[0]
        start = (carry, jnp.full((b,), cfg.bos_id, jnp.int32), jnp.zeros((b,), bool))
        body = functools.partial(_greedy_body, vocab_size=vocab_size)
        _, (tokens, alpha, live) = _scan(body, length=int(max_len))(
            self.decoder, start, None, memory, True)
        return tokens, _aux(alpha if return_weights else None,
                            lengths=jnp.sum(live, axis=-1).astype(jnp.int32))


def beam_search(model: RNNSeq2Seq, params, src, *, beam_size: int, max_len: int,
                alpha: float = 0.6, src_mask=None, vocab_size: Optional[int] = None):
    """Beam search over the decoder's steps (beam.search): each beam carries its own
    cell state, the source's annotations shared. (tokens [B, W, max_len], scores [B, W])
    sorted best first; scores are log p(y | x) / lp(|y|), |y| counting tokens up to and
    including eos. A beam of one is `generate`'s greedy decoding. vocab_size: as
    generate's (the probabilities then over the ids below it)."""
    if not isinstance(model, RNNSeq2Seq):
        raise ValueError(f"beam_search: model is a {type(model).__name__}; valid: an "
                         f"rnn.RNNSeq2Seq (an EncoderDecoder's: encdec.beam_search)")
    src_mask = _check_source(src, src_mask, model.config.pad_id)
    beam.check_decode_inputs(src, max_len, model.config.vocab_size)
    beam_size = beam.check_beam_size(beam_size)
    cfg = model.config
    vocab_size = beam.check_vocab_size(vocab_size, cfg.target_vocab_size,
                                       (cfg.pad_id, cfg.bos_id, cfg.eos_id))
    return _beam(model, beam_size, int(max_len), beam.check_alpha(alpha), vocab_size, params,
                 src, src_mask)


def _decoder_step(model: RNNSeq2Seq, carry, y_prev, memory):
    return model.decoder(carry, y_prev, memory, True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam(model, w, max_len, alpha, vocab_size, params, src, src_mask):
    cfg = model.config
    memory, carry = model.apply({"params": params}, src, src_mask, method=model.encode)
    # row b·W + k is beam k of source b
    memory, carry = jax.tree.map(lambda x: jnp.repeat(x, w, axis=0), (memory, carry))

    def step(carry, last, i):
        carry, logits, _ = model.apply({"params": params}, carry, last, memory,
                                       method=_decoder_step)
        exact = jnp.promote_types(logits.dtype, jnp.float32)
        logits = beam.only_vocabulary(logits.astype(exact), vocab_size)
        return jax.nn.log_softmax(logits), carry
    return beam.search(step, carry, batch=src.shape[0], beam_size=w, max_len=max_len,
                       vocab=cfg.target_vocab_size, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                       pad_id=cfg.pad_id, alpha=alpha)


def _aux(alpha, **named):
    """alpha [B, T, S] as the families' attention_weights {"cross": [L=1, B, N=1, T, S]}."""
    return named if alpha is None else {"attention_weights": {"cross": alpha[None, :, None]},
                                        **named}


def _check_source(src, src_mask: Optional[jax.Array], pad_id: int):
    if src.ndim != 2 or not jnp.issubdtype(src.dtype, jnp.integer):
        raise ValueError(f"src must be int token ids of shape [B, S]; got {src.dtype} {src.shape}")
    if src_mask is None:
        return src != pad_id
    if src_mask.shape != src.shape or src_mask.dtype != jnp.bool_:
        raise ValueError(f"src_mask must be bool with src's shape {src.shape}; "
                         f"got {src_mask.dtype} {src_mask.shape}")
    return src_mask
