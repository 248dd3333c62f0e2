"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017).

    cfg = EncDecConfig.from_variant("transformer-tiny")
    model = EncoderDecoder(cfg)
    tgt_in = losses.shift_right(tgt, cfg.bos_id)                           # tgt [B, T]
    params = model.init(key, src, tgt_in)["params"]                        # src [B, S]
    logits, aux = model.apply({"params": params}, src, tgt_in)             # [B, T, V]
    weights = jnp.arange(tgt.shape[1]) <= tgt_len[:, None]  # tgt_len [B]: tokens before EOS
    loss, metrics = losses.cross_entropy(logits, tgt, weights, label_smoothing=0.1)
    out = greedy_decode(model, params, src, max_len=20)                    # [B, 20]
    out, scores = beam_search(model, params, src, beam_size=4, max_len=20) # [B, W, 20]

Encoder: bidirectional self-attention over the source (padding masked). Decoder: causal
self-attention over the target prefix, cross-attention to the encoder output, both with
post-norm "Add & Norm" by default (the paper's Figure 1); `norm_position="pre"` gives
the pre-norm variant, with a final norm after each stack. Positions are the sinusoids
of §3.5 (no parameters); embeddings are multiplied by sqrt(D) (§3.4) so that they are
not drowned by the unit-scale sinusoids. One matrix is shared by the source embedding,
the target embedding and the pre-softmax projection (§3.4; the joint BPE vocabulary
makes that possible).

Decoding caches the decoder's self-attention keys/values (layers/attention.py); the
cross-attention keys/values are recomputed from the encoder output at every step, a
[B, S, D]·[D, 2D] matmul per layer, which keeps the cache a single kind of entry.
Token ids: pad 0, bos 1, eos 2 by default; sources are right-padded with pad. Targets end
with EOS, then pad; the loss weighs them by position, each target's tokens and its EOS
(data.seq2seq_example's `target_weights`, what the translation task trains on), not by
id: `tgt != pad_id` weighs every EOS 0 where a tokenizer's pad is its EOS, and the model
never learns to stop.
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
from attention_jax.layers.blocks import BlockConfig, TransformerStack, check_remat_policy
from attention_jax.layers.norms import make_norm
from attention_jax.layers.posemb import Embed, check_ids, sinusoidal
from attention_jax.models import beam

__all__ = ["EncDecConfig", "EncoderDecoder", "VARIANTS", "get_config", "init_cache", "greedy_decode", "beam_search"]


@dataclasses.dataclass(frozen=True)
class EncDecConfig:
    """Hyperparameters of the encoder-decoder Transformer (defaults: Transformer base)."""

    vocab_size: int = 37000  # shared source/target vocabulary; in training: the tokenizer's
    d_model: int = 512  # d_model of the paper: every layer's width
    num_heads: int = 8  # h: attention heads (head dim d_model / h)
    mlp_dim: Optional[int] = 2048  # d_ff (None: 4 * d_model)
    num_encoder_layers: int = 6  # N of the encoder stack
    num_decoder_layers: int = 6  # N of the decoder stack
    activation: str = "relu"  # the FFN's: relu (the paper's, §3.3) | gelu | gelu_tanh | silu
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_position: str = "post"  # "post" (the paper: norm after the residual add) | "pre"
    norm_epsilon: float = 1e-6  # added to the variance in every norm
    dropout_rate: float = 0.1  # P_drop (§5.4)
    attention_dropout_rate: float = 0.0  # on the per-head attention outputs
    share_embeddings: bool = True  # one table for source, target and the output head (§3.4)
    # attention backend: auto | reference | ring | cudnn | pallas | splash | blockwise | xla
    implementation: str = "auto"
    scan_layers: bool = False  # each stack as one lax.scan: compiles in the time of one layer
    # activation checkpointing per block: none | full | dots | dots_no_batch
    remat_policy: str = "none"
    pad_id: int = 0  # token ids of padding, start and end (the tokenizer's)
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = "float32"  # computation dtype
    param_dtype: Any = "float32"

    def __post_init__(self):
        # Checked here, where the message can name the field: a zero d_model or num_heads
        # otherwise divides by zero (here, or in setup's D^-1/2), zero layers fails deep in
        # the stack's setup, and mlp_dim=0 silently became the 4D default.
        check_float_dtypes(self)
        check_bools(self)
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("vocab_size", "d_model", "num_heads", "num_encoder_layers",
                                   "num_decoder_layers", "mlp_dim"),
                            none_means={"mlp_dim": "4 * d_model"})  # the block's default
        if self.d_model % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} does not divide d_model={self.d_model}; valid "
                f"num_heads: {[n for n in range(1, self.d_model + 1) if self.d_model % n == 0]}")
        if self.d_model % 2:  # the positions are sinusoidal
            raise ValueError(f"the sinusoidal positions are sin/cos pairs: d_model="
                             f"{self.d_model} is odd; valid: an even d_model")
        for name in ("pad_id", "bos_id", "eos_id"):  # (one out of range: NaN beams, unsaid)
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value!r} is no token id of the vocabulary; valid: "
                                 f"0..{self.vocab_size - 1}")
        self.block()  # validates norm, norm_position, activation, implementation
        # The stack's own field, not the block's: an unknown one was refused only as the
        # model was traced (a traceback after the data was built).
        check_remat_policy(self.remat_policy)

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "EncDecConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown encoder-decoder variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})

    def block(self) -> BlockConfig:
        return BlockConfig(
            num_heads=self.num_heads, mlp="mlp", mlp_dim=self.mlp_dim, activation=self.activation,
            norm=self.norm, norm_position=self.norm_position, norm_epsilon=self.norm_epsilon,
            dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
            implementation=self.implementation, dtype=self.dtype, param_dtype=self.param_dtype)


# Vaswani et al. 2017, Table 3 (rows "base" and "big"). Exact counts of this code:
# base 63.1M (the paper rounds to 65M), big 214.3M (paper: 213M); see tests/models.
VARIANTS: dict[str, dict[str, Any]] = {
    "transformer-base": dict(),
    "transformer-big": dict(d_model=1024, num_heads=16, mlp_dim=4096, dropout_rate=0.3),
    "transformer-tiny": dict(vocab_size=64, d_model=32, num_heads=4, mlp_dim=64,
                             num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0),
}


def get_config(variant: str, **overrides) -> EncDecConfig:
    """EncDecConfig of a named variant; unknown names raise ValueError listing valid ones."""
    return EncDecConfig.from_variant(variant, **overrides)


class EncoderDecoder(nn.Module):
    """(src [B, S], tgt_in [B, T]) -> (logits [B, T, V], aux {"encoder", "decoder"})."""

    config: EncDecConfig

    def setup(self):
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        # std D^-1/2: after the sqrt(D) scaling the embedded tokens have unit variance,
        # and the tied output projection starts with unit-scale logits.
        init = nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model ** -0.5),
                                            (axes.VOCAB, axes.EMBED))

        def embed(name):
            return Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype,
                         param_dtype=param_dtype, name=name)

        self.src_embed = embed("embedding")
        self.tgt_embed = self.src_embed if cfg.share_embeddings else embed("target_embedding")
        if not cfg.share_embeddings:
            self.output = nn.Dense(
                cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                         (axes.EMBED, axes.VOCAB)),
                name="output")
        stack = functools.partial(TransformerStack, cfg.block(), scan_layers=cfg.scan_layers,
                                  remat_policy=cfg.remat_policy)
        self.encoder = stack(num_layers=cfg.num_encoder_layers, block="encoder")
        self.decoder = stack(num_layers=cfg.num_decoder_layers, block="decoder")
        self.dropout = nn.Dropout(cfg.dropout_rate)
        if cfg.norm_position == "pre":  # pre-norm leaves the residual stream unnormalised
            self.encoder_norm = make_norm(cfg.norm, epsilon=cfg.norm_epsilon, dtype=dtype,
                                          param_dtype=param_dtype)
            self.decoder_norm = make_norm(cfg.norm, epsilon=cfg.norm_epsilon, dtype=dtype,
                                          param_dtype=param_dtype)

    def _embed(self, table, tokens, positions, deterministic):
        x = table(tokens) * jnp.sqrt(jnp.float32(self.config.d_model)).astype(table.dtype)
        x = x + sinusoidal(positions, self.config.d_model, dtype=x.dtype)  # [B, T, D]
        return self.dropout(x, deterministic=deterministic)

    def encode(self, src, src_mask=None, *, deterministic: bool = True,
               return_weights: bool = False):
        """src [B, S] -> (encoded [B, S, D], aux). src_mask [B, S] bool (default src != pad)."""
        check_ids("src", src)
        if src_mask is None:
            src_mask = src != self.config.pad_id
        _check_src_mask(src_mask, src.shape)
        b, s = src.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self._embed(self.src_embed, src, positions, deterministic)
        x, aux = self.encoder(x, kv_mask=src_mask, deterministic=deterministic,
                              return_weights=return_weights)
        if self.config.norm_position == "pre":
            x = self.encoder_norm(x)
        return x, aux

    def decode(self, tgt_in, encoded, src_mask, *, positions=None, deterministic: bool = True,
               decode: bool = False, return_weights: bool = False):
        """tgt_in [B, T] (shifted targets, or new tokens when decode=True), encoded
        [B, S, D], src_mask [B, S] -> (logits [B, T, V], aux). With decode=True, positions
        [B, T] are the tokens' absolute positions (right-padded prefixes, see
        layers/attention.py) and the "cache" collection must be mutable."""
        check_ids("tgt_in", tgt_in)
        if tgt_in.shape[0] != encoded.shape[0]:
            raise ValueError(f"tgt_in and src need the same batch B: tgt_in {tuple(tgt_in.shape)}"
                             f", src's encoding {tuple(encoded.shape)}")
        _check_src_mask(src_mask, encoded.shape[:2])
        b, t = tgt_in.shape
        if positions is None:
            if decode:
                raise ValueError("decode=True needs positions [B, T] (each row's next positions)")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        y = self._embed(self.tgt_embed, tgt_in, positions, deterministic)
        y, aux = self.decoder(y, encoded, positions=positions, context_mask=src_mask,
                              deterministic=deterministic, decode=decode,
                              return_weights=return_weights)
        if self.config.norm_position == "pre":
            y = self.decoder_norm(y)
        logits = self.tgt_embed.attend(y) if self.config.share_embeddings else self.output(y)
        logits = nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.VOCAB))
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), aux

    def __call__(self, src, tgt_in, src_mask=None, *, deterministic: bool = True,
                 return_weights: bool = False):
        check_flags(deterministic=deterministic, return_weights=return_weights)
        check_ids("src", src)
        check_ids("tgt_in", tgt_in)
        if src.shape[0] != tgt_in.shape[0]:
            raise ValueError(f"src and tgt_in need the same batch B: src {tuple(src.shape)}, "
                             f"tgt_in {tuple(tgt_in.shape)}")
        if src_mask is None:
            src_mask = src != self.config.pad_id
        encoded, enc_aux = self.encode(src, src_mask, deterministic=deterministic,
                                       return_weights=return_weights)
        logits, dec_aux = self.decode(tgt_in, encoded, src_mask, deterministic=deterministic,
                                      return_weights=return_weights)
        aux = {"encoder": enc_aux, "decoder": dec_aux}
        if return_weights:  # [L, B, N, T or S, S or T], one entry per kind of attention
            aux["attention_weights"] = {"encoder": enc_aux.pop("self_attention_weights"),
                                        "decoder": dec_aux.pop("self_attention_weights"),
                                        "cross": dec_aux.pop("cross_attention_weights")}
        return logits, aux


def _check_src_mask(src_mask, shape) -> None:
    """src_mask by its own name (it reached attention as kv_mask, and its error named
    that): a bool array of src's shape [B, S]."""
    if (getattr(src_mask, "dtype", None) != jnp.bool_
            or tuple(jnp.shape(src_mask)) != tuple(shape)):
        got = (f"{src_mask.dtype} {tuple(src_mask.shape)}" if hasattr(src_mask, "dtype")
               else type(src_mask).__name__)
        raise ValueError(f"src_mask must be a bool array of src's shape [B, S]="
                         f"{list(shape)} (True on real tokens; default src != pad_id); got "
                         f"{got}")


# ----------------------------------------------------------------------------- decoding


def init_cache(model: EncoderDecoder, batch: int, max_len: int, src_len: int):
    """All-zero decoder KV cache for `batch` rows and `max_len` target positions."""
    d = model.config.d_model
    tokens = jnp.zeros((batch, max_len), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    encoded = jnp.zeros((batch, src_len, d), jnp.dtype(model.config.dtype))
    src_mask = jnp.ones((batch, src_len), bool)
    shapes = jax.eval_shape(lambda: model.init(
        jax.random.PRNGKey(0), tokens, encoded, src_mask, positions=positions, decode=True,
        method=model.decode))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def _specials(cfg) -> tuple[int, int, int]:
    return cfg.pad_id, cfg.bos_id, cfg.eos_id


def _step(model, params, cache, tokens, position, encoded, src_mask, vocab_size=None):
    """One decoding step: tokens [B] at positions [B] -> (log-probs [B, V], cache), the
    ids from vocab_size up (if given) at probability 0."""
    (logits, _), state = model.apply(
        {"params": params, "cache": cache}, tokens[:, None], encoded, src_mask,
        positions=position[:, None], decode=True, mutable=["cache"], method=model.decode)
    logits = beam.only_vocabulary(logits[:, 0], vocab_size)
    return jax.nn.log_softmax(logits), state["cache"]


def greedy_decode(model: EncoderDecoder, params, src, *, max_len: int, src_mask=None,
                  vocab_size: Optional[int] = None):
    """Most likely token at each step, with the cache. src [B, S] -> tokens [B, max_len]:
    the output without bos, eos kept, pad after it. vocab_size: ids from it up are never
    emitted (a tokenizer's vocabulary, where the model's is padded past it)."""
    beam.check_decode_inputs(src, max_len, model.config.vocab_size)
    if src_mask is None:
        src_mask = src != model.config.pad_id
    vocab_size = beam.check_vocab_size(vocab_size, model.config.vocab_size,
                                       _specials(model.config))
    return _greedy(model, int(max_len), vocab_size, params, src, src_mask)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _greedy(model, max_len, vocab_size, params, src, src_mask):
    cfg = model.config
    b = src.shape[0]
    encoded, _ = model.apply({"params": params}, src, src_mask, method=model.encode)

    def step(carry, i):
        cache, token, done = carry
        logp, cache = _step(model, params, cache, token, jnp.full((b,), i), encoded, src_mask,
                            vocab_size)
        token = jnp.where(done, cfg.pad_id, jnp.argmax(logp, -1).astype(jnp.int32))
        return (cache, token, done | (token == cfg.eos_id)), token

    start = (init_cache(model, b, max_len, src.shape[1]), jnp.full((b,), cfg.bos_id, jnp.int32),
             jnp.zeros((b,), bool))
    _, tokens = jax.lax.scan(step, start, jnp.arange(max_len))
    return tokens.T  # [B, max_len]


def beam_search(model: EncoderDecoder, params, src, *, beam_size: int, max_len: int,
                alpha: float = 0.6, src_mask=None, vocab_size: Optional[int] = None):
    """Beam search with the cache (beam.search; Vaswani §6.1 used beam 4, alpha 0.6):
    (tokens [B, W, max_len], scores [B, W]) sorted best first; scores are
    log p(y | x) / lp(|y|), |y| counting tokens up to and including eos. vocab_size: as
    greedy_decode's (the probabilities then over the ids below it)."""
    if not isinstance(model, EncoderDecoder):  # an RNNSeq2Seq failed deep inside JAX
        raise ValueError(f"beam_search: model is a {type(model).__name__}; valid: an "
                         f"encdec.EncoderDecoder (an RNNSeq2Seq's: rnn.beam_search)")
    beam.check_decode_inputs(src, max_len, model.config.vocab_size)
    if src_mask is None:
        src_mask = src != model.config.pad_id
    beam_size = beam.check_beam_size(beam_size)
    vocab_size = beam.check_vocab_size(vocab_size, model.config.vocab_size,
                                       _specials(model.config))
    return _beam(model, beam_size, int(max_len), beam.check_alpha(alpha), vocab_size, params,
                 src, src_mask)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _beam(model, w, max_len, alpha, vocab_size, params, src, src_mask):
    cfg = model.config
    b, s = src.shape
    encoded, _ = model.apply({"params": params}, src, src_mask, method=model.encode)
    encoded = jnp.repeat(encoded, w, axis=0)  # [B·W, S, D]: row b·W + k is beam k of source b
    src_mask = jnp.repeat(src_mask, w, axis=0)

    def step(cache, last, i):
        return _step(model, params, cache, last, jnp.full((b * w,), i), encoded, src_mask,
                     vocab_size)
    return beam.search(step, init_cache(model, b * w, max_len, s), batch=b, beam_size=w,
                       max_len=max_len, vocab=cfg.vocab_size, bos_id=cfg.bos_id,
                       eos_id=cfg.eos_id, pad_id=cfg.pad_id, alpha=alpha,
                       # scanned caches are [L, B·W, S, K, H]
                       take_rows=beam.rows_along(1 if cfg.scan_layers else 0))
