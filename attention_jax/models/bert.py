"""BERT: a bidirectional Transformer encoder pre-trained by masked-language modelling
(Devlin et al. 2018, "BERT: Pre-training of Deep Bidirectional Transformers").

    cfg = BertConfig.from_variant("bert-tiny")
    model = Bert(cfg)                                    # head="pretraining"
    params = model.init(key, ids)["params"]
    out, aux = model.apply({"params": params}, ids, token_type_ids, attention_mask=mask)
    out["mlm_logits"]  # [B, T, V]      out["nsp_logits"]  # [B, 2]
    logits, aux = Bert(cfg, head="classification").apply(...)   # [B, num_labels]

Input: [CLS] A [SEP] B [SEP] padded to T. The input representation is the sum of word,
segment (A/B: token_type_ids) and learned position embeddings, then LayerNorm (Section
3.2, Figure 2). The encoder is Vaswani et al.'s post-norm stack with GELU. Every query
attends to every real token: padding is hidden from attention through `attention_mask`.

Heads (Section 3.1, Appendix A):
  MLM   h -> dense + GELU + LayerNorm -> h·Eᵀ + b: the output matrix is the word embedding
        E (tied), plus a per-word bias. `masked_positions` [B, M] gathers the M predicted
        positions first, as the original code does, so the V-wide matmul runs on M << T rows.
  NSP   pooled = tanh(W h_[CLS] + b) -> 2 logits (IsNext / NotNext).
  classification (fine-tuning, Section 4) dropout(pooled) -> num_labels logits.

For Hugging Face checkpoints the choices that matter are config fields: exact-erf GELU
(`activation="gelu"`), LayerNorm epsilon 1e-12, post-norm, the pooler, 512 positions and
2 token types. Parameter names follow this project's layers; a converter maps them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.errors import (check_bools, check_fields, check_flags, check_float_dtypes,
                                 check_positive_ints, check_rates_and_epsilon)
from attention_jax.attention import IMPLEMENTATIONS
from attention_jax.layers.attention import check_heads
from attention_jax.layers.blocks import BlockConfig, REMAT_POLICIES, TransformerStack
from attention_jax.layers.mlp import ACTIVATIONS, activation as get_activation
from attention_jax.layers.norms import make_norm
from attention_jax.layers.posemb import Embed, LearnedPositionEmbedding, check_below, check_ids

__all__ = ["BertConfig", "Bert", "HEADS", "VARIANTS"]

HEADS = ("pretraining", "classification", "encoder")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522  # token ids; in training: the tokenizer's size, padded to 64
    d_model: int = 768  # H in the paper: every layer's width
    num_layers: int = 12  # L: transformer blocks
    num_heads: int = 12  # A: attention heads (head dim H / A)
    mlp_dim: int = 3072  # the MLP's hidden width (4H in the paper)
    max_len: int = 512  # rows of the position table (the longest input)
    type_vocab_size: int = 2  # segments A and B
    num_labels: int = 2  # classification head
    activation: str = "gelu"  # the MLP's: gelu (exact erf, as BERT's) | gelu_tanh | relu | silu
    norm_epsilon: float = 1e-12  # added to the variance in every LayerNorm
    dropout_rate: float = 0.1  # on the embeddings, every block and the pooled [CLS]
    attention_dropout_rate: float = 0.1  # on per-head outputs, see layers/attention.py
    initializer_range: float = 0.02  # std of the truncated-normal weight init
    position_embeddings: bool = True  # False: an order-blind encoder (for the lectures' tests)
    # attention backend: auto | reference | ring | cudnn | pallas | splash | blockwise | xla
    implementation: str = "auto"
    scan_layers: bool = False  # the blocks as one lax.scan: compiles in the time of one block
    # activation checkpointing per block: none | full | dots | dots_no_batch
    remat_policy: str = "none"
    dtype: Any = "float32"

    def __post_init__(self):
        check_float_dtypes(self)
        check_bools(self)
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("vocab_size", "d_model", "num_heads", "num_layers",
                                   "mlp_dim", "max_len", "type_vocab_size", "num_labels"))
        check_heads(self.d_model, self.num_heads, head_dim_settable=False)  # lists the valid counts
        choices = {"activation": tuple(ACTIVATIONS), "implementation": IMPLEMENTATIONS,
                   "remat_policy": tuple(REMAT_POLICIES)}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; valid: {valid}")

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "BertConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown BERT variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})

    def block(self) -> BlockConfig:
        return BlockConfig(
            num_heads=self.num_heads, mlp="mlp", mlp_dim=self.mlp_dim, activation=self.activation,
            norm="layernorm", norm_position="post", norm_epsilon=self.norm_epsilon,
            dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
            implementation=self.implementation, dtype=self.dtype)


# Devlin et al. 2018, Section 3 ("Model Architecture"): BERT-base L=12, H=768, A=12
# (110M parameters); BERT-large L=24, H=1024, A=16 (340M); feed-forward 4H. The tiny
# ones are for tests and CPU experiments (the small shapes of Turc et al. 2019's
# "Well-Read Students" grid use the same names).
VARIANTS = {
    "bert-base": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "bert-large": dict(d_model=1024, num_layers=24, num_heads=16, mlp_dim=4096),
    "bert-tiny": dict(vocab_size=128, d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
                      max_len=64),
    "bert-mini": dict(vocab_size=1024, d_model=256, num_layers=4, num_heads=4, mlp_dim=1024,
                      max_len=128),
}


# ----------------------------------------------------------------------------- helpers


def _init(cfg: BertConfig):
    return nn.initializers.truncated_normal(cfg.initializer_range)


def _dense(cfg: BertConfig, features, in_axis, out_axis, name):
    return nn.Dense(features, dtype=jnp.dtype(cfg.dtype), name=name,
                    kernel_init=nn.with_logical_partitioning(_init(cfg), (in_axis, out_axis)),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)))


def _embed(cfg: BertConfig, rows, row_axis, name):
    return Embed(rows, cfg.d_model, dtype=jnp.dtype(cfg.dtype), name=name, rows_axis=row_axis,
                 embedding_init=nn.with_logical_partitioning(_init(cfg), (row_axis, axes.EMBED)))


# ----------------------------------------------------------------------------- model


class Bert(nn.Module):
    """BERT encoder with one of HEADS on top; returns (output, aux).

    output: head "pretraining" -> {"mlm_logits" [B, T or M, V], "nsp_logits" [B, 2]};
            "classification" -> logits [B, num_labels]; "encoder" -> hidden states [B, T, D].
    aux:    "hidden_states" [B, T, D] final hidden states, "pooled" [B, D] (tanh pooler on
            [CLS]), and "attention_weights" {"self": [L, B, N, T, T]} when return_weights=True.
    """

    config: BertConfig
    head: str = "pretraining"

    @nn.compact
    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, *,
                 positions=None, segment_ids=None, masked_positions=None,
                 deterministic: bool = True, return_weights: bool = False):
        """input_ids [B, T] ints; token_type_ids [B, T] (0 = sentence A, 1 = B; default 0);
        attention_mask [B, T] bool/int, true on real tokens (default: all real);
        positions [B, T] position ids (default 0..T-1; packed rows restart per document);
        segment_ids [B, T]: packed documents that must not attend to each other;
        masked_positions [B, M]: positions whose MLM logits to compute (default: all)."""
        check_flags(deterministic=deterministic, return_weights=return_weights)
        cfg = self.config
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r} is unknown; valid: {HEADS}")
        check_ids("input_ids", input_ids, None)
        b, t = input_ids.shape
        if t > cfg.max_len and cfg.position_embeddings and positions is None:
            raise ValueError(f"input length T={t} exceeds max_len={cfg.max_len}")
        dtype = jnp.dtype(cfg.dtype)

        # Input representation (Section 3.2): word + segment + position, LayerNorm, dropout.
        word = _embed(cfg, cfg.vocab_size, axes.VOCAB, "word_embeddings")
        x = word(input_ids)  # [B, T, D]
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        check_ids("token_type_ids", token_type_ids, (b, t))
        check_below("token_type_ids", token_type_ids, cfg.type_vocab_size,
                    f"type_vocab_size={cfg.type_vocab_size}")
        x = x + _embed(cfg, cfg.type_vocab_size, None, "token_type_embeddings")(token_type_ids)
        if cfg.position_embeddings:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            x = x + LearnedPositionEmbedding(cfg.max_len, cfg.d_model, embedding_init=_init(cfg),
                                             dtype=dtype, name="position_embeddings")(positions)
        x = make_norm("layernorm", epsilon=cfg.norm_epsilon, dtype=dtype, name="embeddings_norm")(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        kv_mask = None
        if attention_mask is not None:
            check_ids("attention_mask", attention_mask, (b, t), allow_bool=True)
            kv_mask = attention_mask.astype(bool)
        # Post-norm layers (BERT keeps the original Transformer's Add & Norm); no final norm.
        x, stack_aux = TransformerStack(cfg.block(), cfg.num_layers, block="encoder",
                                        scan_layers=cfg.scan_layers, remat_policy=cfg.remat_policy,
                                        name="encoder")(
            x, segment_ids=segment_ids, kv_mask=kv_mask, deterministic=deterministic,
            return_weights=return_weights)
        aux = {"hidden_states": x}
        if return_weights:
            aux["attention_weights"] = {"self": stack_aux["self_attention_weights"]}  # [L, B, N, T, T]

        # The pooler: a tanh layer on [CLS] (position 0), the sentence-level representation.
        pooled = jnp.tanh(_dense(cfg, cfg.d_model, axes.EMBED, axes.MLP, "pooler")(x[:, 0]))  # [B, D]
        aux["pooled"] = pooled
        if self.head == "encoder":
            return x, aux
        if self.head == "classification":
            h = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
            return _dense(cfg, cfg.num_labels, axes.EMBED, None, "classifier")(h), aux

        # Masked-LM head, tied to the word embedding.
        h = x
        if masked_positions is not None:
            if getattr(masked_positions, "ndim", None) != 2 or masked_positions.shape[0] != b:
                raise ValueError(f"masked_positions: shape {getattr(masked_positions, 'shape', None)}"
                                 f"; valid: [B, M] = [{b}, M], indices into the T={t} tokens")
            check_below("masked_positions", masked_positions, t, f"the input's T={t} tokens")
            h = jnp.take_along_axis(x, masked_positions[..., None].astype(jnp.int32), axis=1)  # [B, M, D]
        h = _dense(cfg, cfg.d_model, axes.EMBED, axes.MLP, "mlm_transform")(h)
        h = get_activation(cfg.activation)(h)
        h = make_norm("layernorm", epsilon=cfg.norm_epsilon, dtype=dtype, name="mlm_norm")(h)
        mlm_bias = self.param("mlm_bias", nn.with_logical_partitioning(nn.initializers.zeros, (axes.VOCAB,)),
                              (cfg.vocab_size,), jnp.float32)
        mlm_logits = word.attend(h) + mlm_bias.astype(dtype)  # [B, T or M, V]
        nsp_logits = _dense(cfg, 2, axes.EMBED, None, "nsp")(pooled)  # [B, 2]
        return {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits}, aux


