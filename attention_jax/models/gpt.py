"""GPT: a decoder-only transformer language model (Radford et al. 2018, 2019).

    cfg = GPTConfig.from_variant("gpt-tiny")            # or get_config("gpt2", dropout_rate=0.1)
    model = GPT(cfg)
    params = model.init(key, tokens)["params"]           # tokens [B, T] int
    logits, aux = model.apply({"params": params}, tokens)   # [B, T, V]
    loss, metrics = lm_loss(logits, tokens)
    hidden, aux = model.apply({"params": params}, tokens, return_hidden=True)  # [B, T, D]
    kernel, bias = lm_head_weights(params, cfg)      # the head as [D, V] (chunked losses)
    out, lengths = generate(model, params, prompts, prompt_lengths, max_new_tokens=20,
                            rng=key, temperature=0.8, top_p=0.9, stop_token=0)

Token embedding + position (a learned table, fixed sinusoids, or RoPE inside
attention), a stack of causal blocks (pre-norm as in GPT-2 by default; post-norm as in
GPT-1 and the original Transformer for the ablation), a final norm when pre-norm
(pre-norm leaves the residual stream unnormalised), and an LM head that by default reuses the token embedding (tied, Press &
Wolf 2017: saves V·D parameters, 38M of GPT-2 small's 124M).

Decoding keeps a KV cache per layer (layers/attention.py). `generate` takes a batch of
RIGHT-padded prompts with their lengths, prefills all of them in one call, then feeds
each row's new token at its own position (len_b, len_b + 1, ...), all under one jit with
a lax.scan over steps: fixed shapes, no Python loop at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import axes
from attention_jax.errors import (check_bools, check_fields, check_flags, check_float_dtypes,
                                 check_positive_ints, check_rates_and_epsilon, is_int)
from attention_jax.layers.blocks import BlockConfig, TransformerStack, check_remat_policy
from attention_jax.layers.linear import dot_general_2d
from attention_jax.layers.mlp import GATED_MLPS, gate_activation
from attention_jax.layers.norms import make_norm
from attention_jax.layers.posemb import (Embed, LearnedPositionEmbedding, check_ids,
                                         sinusoidal)
from attention_jax.models.losses import (choose_loss_kernel, chunked_head_cross_entropy,
                                         cross_entropy, head_cross_entropy)

__all__ = ["GPTConfig", "GPT", "VARIANTS", "get_config", "lm_loss", "lm_head_weights", "head_loss",
           "init_cache", "generate", "sample_logits"]

GPT_POSITIONS = ("learned", "sinusoidal", "rope")
DEFAULT_ACTIVATION = "gelu_tanh"  # GPT-2's MLP


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A GPT model's hyperparameters (defaults: GPT-2 small)."""

    # rows of the embedding and the LM head; in training, unset: the tokenizer's size
    # padded to a multiple of 64 (tasks.base.lm_vocab_size), else at least that size
    vocab_size: int = 50257
    max_len: int = 1024  # the longest context (position="learned": its table's rows)
    num_layers: int = 12  # transformer blocks
    d_model: int = 768  # D: the width of every token's vector
    num_heads: int = 12  # N query heads (head dim D/N)
    num_kv_heads: Optional[int] = None  # K < N: grouped-query attention
    mlp: str = "mlp"  # "mlp" | "glu" | "swiglu" | "geglu" | "moe"
    mlp_dim: Optional[int] = None  # F (default 4D)
    # the MLP's and the experts' (mlp="mlp", "moe") and mlp="glu"'s gate: relu | gelu |
    # gelu_tanh (GPT-2's) | silu; swiglu's gate is silu, geglu's gelu (this left as it is)
    activation: str = DEFAULT_ACTIVATION
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_epsilon: float = 1e-5  # added to the variance in every norm
    norm_position: str = "pre"  # "pre" (GPT-2) | "post" (GPT-1, Vaswani et al.)
    norm_kernel: str = "auto"  # residual add + norm: layers/norms.py NORM_KERNELS
    attention_scale: Optional[float] = None  # logits multiplier; None = 1/sqrt(head dim)
    position: str = "learned"  # "learned" | "sinusoidal" | "rope"
    rope_base: float = 10000.0  # position="rope": the base of its wavelengths
    tie_embeddings: bool = True  # the output head is the token embedding's transpose
    use_bias: bool = True  # biases in the projections and the MLP
    dropout_rate: float = 0.0  # on the embeddings and each sublayer's output (residual dropout)
    # attention backend: auto | reference | ring | cudnn | pallas | splash | blockwise | xla
    implementation: str = "auto"
    ring_inner: str = "auto"  # chunk-pair kernel of ring attention (mesh.sequence > 1)
    scan_layers: bool = False  # the blocks as one lax.scan: compiles in the time of one block
    # activation checkpointing per block: none | full | dots | dots_no_batch
    remat_policy: str = "none"
    num_experts: int = 8  # for mlp="moe"
    top_k: int = 2  # mlp="moe": experts each token is sent to
    capacity_factor: float = 1.25  # mlp="moe": an expert's slots, a multiple of its even share
    moe_loss_weight: float = 0.01  # weight of the load-balancing loss (Switch uses 1e-2)
    # weight of the router z-loss, mean logsumexp(router logits)² (ST-MoE, Zoph et al.
    # 2022, use 1e-3; it keeps the router's logits small); 0: not in the loss
    router_z_loss_weight: float = 0.0
    dtype: Any = "float32"
    param_dtype: Any = "float32"

    def __post_init__(self):
        if self.position not in GPT_POSITIONS:
            raise ValueError(f"position={self.position!r} is unknown; valid: {GPT_POSITIONS}")
        # Before the division below (num_heads=0 was a ZeroDivisionError; d_model=0 and
        # num_layers=0 built a model with nothing in it).
        check_float_dtypes(self)
        check_rates_and_epsilon(self)
        # The MoE losses' weights: a negative one would reward the imbalance (or the large
        # router logits) the loss is there to penalise.
        for name in ("moe_loss_weight", "router_z_loss_weight"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not 0 <= value < math.inf):
                raise ValueError(f"{name}={value!r} is out of range; valid: a finite "
                                 f"{name} >= 0 (0: not in the loss)")
        check_positive_ints(self, ("vocab_size", "max_len", "num_layers", "d_model",
                                   "num_heads"))
        check_bools(self)  # ('abc' was taken as its truth value, True, unsaid)
        # Numbers the block reads only when the model is traced: a string or NaN scale was
        # a traceback there, a rope_base <= 0 (0 ** -x, a negative base's fractional
        # powers) NaN losses once training had begun.
        for name, low in (("attention_scale", -math.inf), ("rope_base", 0)):
            value = getattr(self, name)
            if value is None and name == "attention_scale":
                continue
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not low < value < math.inf):
                valid = ("a finite number, or None for 1/sqrt(head dim)"
                         if name == "attention_scale" else "a finite number > 0")
                raise ValueError(f"{name}={value!r} is out of range; valid: {valid}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} does not divide d_model={self.d_model}; valid "
                f"num_heads: {[n for n in range(1, self.d_model + 1) if self.d_model % n == 0]}")
        head_dim = self.d_model // self.num_heads
        if self.position == "rope" and head_dim % 2:  # RoPE rotates pairs of coordinates
            even = [n for n in range(1, self.d_model + 1)
                    if self.d_model % n == 0 and (self.d_model // n) % 2 == 0]
            raise ValueError(
                f"position='rope' rotates pairs of a head's coordinates: head dim d_model / "
                f"num_heads = {self.d_model} / {self.num_heads} = {head_dim} is odd; valid "
                f"num_heads: {even or 'none (d_model is odd)'}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"position='sinusoidal' is sin/cos pairs: d_model={self.d_model} is "
                             f"odd; valid: an even d_model")
        self.block()  # validates the block fields (norm, mlp, kv heads, ...)
        # The stack's own field, not the block's: an unknown one was refused only as the
        # model was traced (a traceback after the corpus was built).
        check_remat_policy(self.remat_policy)

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "GPTConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown GPT variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})

    def block(self) -> BlockConfig:
        return BlockConfig(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, mlp=self.mlp,
            mlp_dim=self.mlp_dim, norm=self.norm,
            # A named gated MLP's own gate (this config's default activation is not the
            # block's: gelu_tanh left as it is means "unset" here, not a gate).
            activation=(gate_activation(self.mlp, self.activation, default=DEFAULT_ACTIVATION)
                        if self.mlp in GATED_MLPS else self.activation),
            norm_epsilon=self.norm_epsilon, norm_position=self.norm_position,
            norm_kernel=self.norm_kernel, causal=True,
            use_bias=self.use_bias, dropout_rate=self.dropout_rate,
            implementation=self.implementation, ring_inner=self.ring_inner,
            rope_base=self.rope_base if self.position == "rope" else None,
            attention_scale=self.attention_scale,
            num_experts=self.num_experts, top_k=self.top_k,
            capacity_factor=self.capacity_factor, dtype=self.dtype, param_dtype=self.param_dtype)


# GPT-2 sizes: Radford et al. 2019, Table 2 (layers, d_model; 1024 context, 50257 BPE
# vocabulary, head dim 64). The paper's column says 117M/345M/762M/1542M; the released
# checkpoints count 124M/355M/774M/1558M (the paper's numbers left out the position
# table and miscounted small), which is what these configurations give.
VARIANTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(num_layers=12, d_model=768, num_heads=12),  # 124M
    "gpt2-medium": dict(num_layers=24, d_model=1024, num_heads=16),  # 355M
    "gpt2-large": dict(num_layers=36, d_model=1280, num_heads=20),  # 774M
    "gpt2-xl": dict(num_layers=48, d_model=1600, num_heads=25),  # 1558M
    # tiny models for tests and CPU experiments
    "gpt-tiny": dict(vocab_size=256, max_len=128, num_layers=2, d_model=64, num_heads=4),
    "gpt-tiny-rope": dict(vocab_size=256, max_len=128, num_layers=2, d_model=64,
                          num_heads=4, num_kv_heads=2, position="rope", mlp="swiglu",
                          norm="rmsnorm", use_bias=False, tie_embeddings=False),
    "gpt-tiny-moe": dict(vocab_size=256, max_len=128, num_layers=2, d_model=64,
                         num_heads=4, mlp="moe", num_experts=4, top_k=2, mlp_dim=128),
}


def get_config(variant: str, **overrides) -> GPTConfig:
    """GPTConfig of a named variant with fields overridden; ValueError names the valid ones."""
    return GPTConfig.from_variant(variant, **overrides)


class GPT(nn.Module):
    """tokens [B, T] -> (logits [B, T, V], aux); with return_hidden=True (hidden [B, T, D],
    aux): the final hidden states, after the final norm, in the compute dtype, for a loss
    that applies the head itself (models/losses.py chunked_head_cross_entropy with
    lm_head_weights).

    aux: {"layers": per-layer aux stacked [L, ...] (MoE statistics), "attention_weights":
    {"self": [L, B, N, T, S]} when asked, "moe_loss": moe_loss_weight × the load-balancing
    loss + router_z_loss_weight × the router z-loss, each summed over layers (MoE only),
    for the training objective}.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, *, positions=None, segment_ids=None, token_mask=None,
                 deterministic: bool = True, decode: bool = False, return_weights: bool = False,
                 return_hidden: bool = False):
        """positions [B, T]: default arange(T); required with decode=True (the absolute
        positions of the new tokens, see layers/attention.py). segment_ids [B, T]: packed
        documents (no attention across documents), numbered from 1; 0 marks padding (with
        mlp="moe" routed to no expert, data/packing.py's rows). token_mask [B, T] bool
        (mlp="moe"; None: every token real): False marks padding where there are no
        segment ids (a "stream" row's tail, an eval batch's padding copies), routed to no
        expert and left out of the router statistics and the balance loss. It masks no
        attention: a causal model's real tokens see no padding that follows them."""
        check_flags(deterministic=deterministic, decode=decode, return_weights=return_weights,
                    return_hidden=return_hidden)
        cfg = self.config
        check_ids("tokens", tokens)
        b, t = tokens.shape
        if positions is not None:
            check_ids("positions", positions, (b, t))
        if token_mask is not None and (jnp.shape(token_mask) != (b, t)
                                       or jnp.result_type(token_mask) != jnp.bool_):
            # (an int mask went to the MoE as a weight: segment ids scaled its outputs)
            raise ValueError(f"token_mask must be a bool array of shape [B, T]={[b, t]} (True "
                             f"for a real token); got {jnp.result_type(token_mask)} "
                             f"{tuple(jnp.shape(token_mask))}")
        dtype = jnp.dtype(cfg.dtype)
        if positions is None:
            if decode:
                raise ValueError("decode=True needs positions [B, T] (each row's next positions)")
            if t > cfg.max_len and cfg.position == "learned":
                raise ValueError(f"sequence length {t} exceeds max_len={cfg.max_len}")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # Fixed sinusoids have entries of size ~1; GPT-2's 0.02-std token table would be
        # drowned by them, so that variant follows Vaswani et al. §3.4 instead: table std
        # D^-1/2, multiplied by sqrt(D) on the way in (unit-variance tokens).
        sinusoidal_input = cfg.position == "sinusoidal"
        init_std = cfg.d_model ** -0.5 if sinusoidal_input else 0.02
        embed = Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(init_std),
                                                        (axes.VOCAB, axes.EMBED)),
            name="token_embedding")
        x = embed(tokens)  # [B, T, D], gathered in float32 (posemb.Embed says why)
        if sinusoidal_input:
            x = x * jnp.sqrt(jnp.float32(cfg.d_model)).astype(x.dtype)
        if cfg.position == "learned":
            x = x + LearnedPositionEmbedding(cfg.max_len, cfg.d_model, dtype=dtype,
                                             param_dtype=jnp.dtype(cfg.param_dtype),
                                             name="position_embedding")(positions)
        elif cfg.position == "sinusoidal":  # fixed, defined at every position
            x = x + sinusoidal(positions, cfg.d_model, dtype=dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED))
        pre_norm = cfg.norm_position == "pre"
        x, layer_aux = TransformerStack(
            cfg.block(), cfg.num_layers, scan_layers=cfg.scan_layers,
            remat_policy=cfg.remat_policy, pending_residual=pre_norm, name="decoder")(
                x, positions=positions, segment_ids=segment_ids, token_mask=token_mask,
                deterministic=deterministic, decode=decode, return_weights=return_weights)
        if pre_norm:  # post-norm blocks already end in a norm
            # The stack leaves its last residual add to this norm: (x, y, y_bias).
            x = make_norm(cfg.norm, epsilon=cfg.norm_epsilon, use_bias=cfg.use_bias,
                          dtype=dtype, param_dtype=jnp.dtype(cfg.param_dtype),
                          kernel=cfg.norm_kernel, name="final_norm")(
                              *x, residual=True)[1]
        aux = {"layers": layer_aux}
        if return_weights:
            aux["attention_weights"] = {"self": layer_aux.pop("self_attention_weights")}  # [L, B, N, T, S]
        if cfg.mlp == "moe":
            aux["moe_loss"] = cfg.moe_loss_weight * jnp.sum(layer_aux["moe"]["load_balance_loss"])
            if cfg.router_z_loss_weight:  # (left out at 0: the sum stays bit for bit as it was)
                aux["moe_loss"] = aux["moe_loss"] + cfg.router_z_loss_weight * jnp.sum(
                    layer_aux["moe"]["router_z_loss"])
        if return_hidden and not self.is_initializing():  # init still creates the head
            return x, aux
        if cfg.tie_embeddings:
            logits = embed.attend(x)  # [B, T, V]: x · Eᵀ
        else:
            logits = nn.Dense(
                cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.dtype(cfg.param_dtype),
                dot_general=dot_general_2d,
                kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                         (axes.EMBED, axes.VOCAB)),
                name="lm_head")(x)
        logits = nn.with_logical_constraint(logits, (axes.BATCH, axes.LENGTH, axes.VOCAB))
        if return_hidden:
            return x, aux
        # float32 at least: bfloat16 logits are widened, float64 ones (a numerics check) kept
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), aux


def lm_head_weights(params, config: GPTConfig):
    """(kernel [D, V], bias [V] or None) of the LM head in the compute dtype: the token
    embedding transposed when tied, else lm_head's kernel (no bias: GPT-2's head has
    none). logits = hidden · kernel, as GPT.__call__ computes them."""
    dtype = jnp.dtype(config.dtype)
    if config.tie_embeddings:
        return params["token_embedding"]["embedding"].astype(dtype).T, None
    return params["lm_head"]["kernel"].astype(dtype), None


# ----------------------------------------------------------------------------- losses


def lm_loss(logits, tokens, weights=None):
    """Next-token loss: logits at position i predict tokens[i + 1]. logits [B, T, V],
    tokens [B, T], weights [B, T] (1 on real tokens). Returns (loss, {"accuracy"})."""
    check_ids("tokens", tokens)
    if getattr(logits, "ndim", None) != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits must be [B, T, V] over tokens' [B, T]={list(tokens.shape)}; "
                         f"got {getattr(logits, 'shape', type(logits).__name__)} (the order "
                         f"is lm_loss(logits, tokens))")
    if weights is not None and jnp.shape(weights) != tokens.shape:  # (an IndexError below)
        raise ValueError(f"weights: shape {tuple(jnp.shape(weights))}; valid: tokens' [B, T]="
                         f"{list(tokens.shape)}, one weight a token (a per-example weight "
                         f"[B]: weights[:, None] * jnp.ones_like(tokens))")
    w = None if weights is None else weights[:, 1:]
    return cross_entropy(logits[:, :-1], tokens[:, 1:], w)


def head_loss(model: GPT, params, inputs, targets, weights=None, *, chunk_size: int = 0,
              label_smoothing: float = 0.0, loss_kernel: str = "auto", **apply_kwargs):
    """((loss, {"accuracy"}), aux) of predicting `targets` [B, T] from `inputs` [B, T]:
    the model's logits through cross_entropy, or, with chunk_size > 0, its final hidden
    states through the head `chunk_size` positions at a time (chunked_head_cross_entropy:
    the [B, T, V] logits never exist). With whole logits, loss_kernel (losses.LOSS_KERNELS)
    picks how the loss is computed: "pallas" (auto's choice on NVIDIA GPUs) applies
    the head to the final hidden states itself and computes the loss with the kernels of
    loss_kernel.py (losses.head_cross_entropy). apply_kwargs go to model.apply
    (positions, segment_ids, deterministic, rngs)."""
    if chunk_size and loss_kernel == "pallas":
        raise ValueError(f"loss_kernel='pallas' computes the loss over the whole logits; "
                         f"chunk_size={chunk_size} asks for them a chunk at a time; valid: "
                         "loss_kernel 'auto' or 'xla' with a chunk size, or chunk_size=0")
    kernel_loss = not chunk_size and choose_loss_kernel(
        loss_kernel, model.config.dtype, model.config.vocab_size) == "pallas"
    out, aux = model.apply({"params": params}, inputs,
                           return_hidden=bool(chunk_size) or kernel_loss, **apply_kwargs)
    if not chunk_size and not kernel_loss:
        return cross_entropy(out, targets, weights, label_smoothing), aux
    kernel, bias = lm_head_weights(params, model.config)
    if kernel_loss:
        return head_cross_entropy(out, kernel, targets, weights, bias=bias,
                                  label_smoothing=label_smoothing, implementation="pallas"), aux
    return chunked_head_cross_entropy(out, kernel, targets, weights, bias=bias,
                                      chunk_size=chunk_size, label_smoothing=label_smoothing), aux


# ----------------------------------------------------------------------------- decoding


def init_cache(model: nn.Module, batch: int, max_len: int):
    """An all-zero KV cache for `batch` rows and `max_len` positions (no FLOPs spent:
    shapes come from jax.eval_shape)."""
    tokens = jnp.zeros((batch, max_len), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens,
                                               positions=positions, decode=True))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def sample_logits(rng, logits, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None):
    """One token per row from logits [..., V] ([B, V]: one per row, -> [B]; [V]: one
    token). temperature 0 is greedy (argmax).
    top_k keeps the k largest logits; top_p keeps the smallest set of tokens whose
    probability reaches p (nucleus sampling, Holtzman et al. 2020)."""
    if not _is_key(rng):  # (a TypeError from inside jax.random otherwise)
        raise ValueError(f"rng={rng!r}; valid: a JAX PRNG key, e.g. jax.random.key(0) "
                         f"(or jax.random.PRNGKey(0))")
    if jnp.ndim(logits) < 1:
        raise ValueError(f"logits: shape {jnp.shape(logits)}; valid: [..., V], e.g. [B, V]")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        # (a negative one sampled the inverted distribution, unsaid)
        raise ValueError(f"temperature={temperature!r}; valid: 0 (greedy) or a finite number > 0")
    # generate checks these too, but a direct call went on: top_p <= 0 masked every
    # token and drew id 0 for every row, unsaid; top_k 0 or past V failed inside lax.
    vocab = jnp.shape(logits)[-1]
    if top_k is not None and (not is_int(top_k) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k={top_k!r}; valid: None or 1..{vocab} (the logits' last axis)")
    if top_p is not None and not isinstance(top_p, jax.core.Tracer) and (
            not _is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}; valid: None or in (0, 1]")
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Each row's largest logit moved to 0 before the division: a tiny temperature then
    # sends the others to -inf (greedy in the limit), where dividing the raw logits by
    # it overflowed them to ±inf, and the sample went wrong (below about 1e-38).
    logits = logits.astype(jnp.float32)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [B, V] descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model: GPT, params, prompts, prompt_lengths, *, max_new_tokens: int, rng=None,
             temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, stop_token: Optional[int] = None,
             pad_token: int = 0, vocab_size: Optional[int] = None):
    """Continue a batch of right-padded prompts with the KV cache.

    prompts [B, T] ints, row b's prompt in prompts[b, :prompt_lengths[b]] (lengths >= 1).
    temperature 0 (default) is greedy; otherwise sample with optional top_k / top_p.
    A row stops after emitting stop_token (kept in the output); later slots get pad_token.
    vocab_size: ids from it up are never generated (a tokenizer's vocabulary, where the
    model's is padded to a multiple of 64 for its matmuls: those ids decode to nothing).
    Returns (tokens [B, T + max_new_tokens], lengths [B]): each row's prompt followed
    directly by its continuation, padded on the right.
    """
    cfg = model.config
    if isinstance(prompts, (list, tuple)):  # (an AttributeError on .shape)
        prompts = np.asarray(prompts)
    if jnp.ndim(prompts) != 2:
        raise ValueError(f"prompts: shape {jnp.shape(prompts)}; valid: [B, T] token ids (one "
                         f"prompt: prompts[None])")
    b, t = prompts.shape
    if t < 1:
        raise ValueError(f"prompts: shape {jnp.shape(prompts)}; valid: [B, T] token ids with "
                         f"T >= 1 (a prompt has at least one token)")
    if not isinstance(prompts, jax.core.Tracer) and prompts.size:
        ids = np.asarray(jax.device_get(prompts))  # the jitted loop would embed NaN rows
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"prompts: token id {ids.min() if ids.min() < 0 else ids.max()} "
                             f"is outside the vocabulary; valid: 0..{cfg.vocab_size - 1}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}; valid: an integer >= 1")
    total = t + max_new_tokens
    if cfg.position == "learned" and total > cfg.max_len:
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"the position table (max_len={cfg.max_len})")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r}; valid: 0 (greedy) or a finite number > 0")
    if temperature and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng (a key: jax.random.key(0))")
    if rng is not None and not _is_key(rng):
        raise ValueError(f"rng={rng!r}; valid: a JAX PRNG key, e.g. jax.random.key(0) "
                         f"(or jax.random.PRNGKey(0))")
    if top_k is not None and (not is_int(top_k) or not 1 <= top_k <= cfg.vocab_size):
        raise ValueError(f"top_k={top_k}; valid: None or 1..{cfg.vocab_size} (the vocabulary)")
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r}; valid: None or in (0, 1]")
    # (a float was cut to an int without a word: vocab_size=True kept id 0 alone, and
    # stop_token=6.5 stopped at 6)
    if vocab_size is not None and (not is_int(vocab_size)
                                   or not 1 <= vocab_size <= cfg.vocab_size):
        raise ValueError(f"vocab_size={vocab_size!r}; valid: None or 1..{cfg.vocab_size} (the "
                         f"model's vocabulary)")
    emittable = cfg.vocab_size if vocab_size is None else int(vocab_size)
    if stop_token is not None and (not is_int(stop_token) or not 0 <= stop_token < emittable):
        raise ValueError(f"stop_token={stop_token!r}; valid: None or a token id "
                         f"0..{emittable - 1} (one that can be generated)")
    lengths = np.asarray(jax.device_get(prompt_lengths)) if not isinstance(
        prompt_lengths, jax.core.Tracer) else None
    if lengths is not None and (lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > t
                                or not np.issubdtype(lengths.dtype, np.integer)):  # (2.5 read as 2)
        raise ValueError(f"prompt_lengths={lengths.tolist()}; valid: {b} lengths in 1..{t} "
                         f"(prompts is [{b}, {t}])")
    if not is_int(pad_token) or not 0 <= pad_token < cfg.vocab_size:
        raise ValueError(f"pad_token={pad_token!r}; valid: a token id 0..{cfg.vocab_size - 1}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    # The settings are static values, so a second call with the same ones reuses the
    # compiled loop (a fresh functools.partial each call compiled it every time).
    as_int = lambda v: None if v is None else int(v)  # noqa: E731  (a jnp scalar: unhashable)
    settings = (float(temperature), as_int(top_k), None if top_p is None else float(top_p),
                as_int(stop_token), int(pad_token),
                None if vocab_size in (None, cfg.vocab_size) else int(vocab_size))
    return _generate(model, max_new_tokens, settings,
                     params, prompts, jnp.asarray(prompt_lengths, jnp.int32), rng)


def _is_real(x) -> bool:
    """A real number (Python's, NumPy's or a 0-d array), not a bool or a tracer."""
    if isinstance(x, (bool, jax.core.Tracer)) or np.asarray(x).dtype == np.bool_:
        return False
    try:
        float(x)
        return not np.iscomplexobj(x) and not isinstance(x, (str, bytes))
    except (TypeError, ValueError):
        return False


def _is_key(rng) -> bool:
    """One JAX PRNG key: a typed key (jax.random.key) or a raw uint32 vector (PRNGKey's:
    2 words, 4 under the rbg implementations), not a batch of them."""
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.ndim(rng) == 0
    return dtype == jnp.uint32 and jnp.shape(rng) in ((2,), (4,))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _generate(model, max_new_tokens, settings, params, prompts, lengths, rng):
    temperature, top_k, top_p, stop_token, pad_token, vocab_size = settings
    b, t = prompts.shape
    rows = jnp.arange(b)

    def sample(key, logits):
        if vocab_size is not None:  # the padding ids past the tokenizer's vocabulary
            logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
        return sample_logits(key, logits, temperature=temperature, top_k=top_k, top_p=top_p)

    cache = init_cache(model, b, t + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    (logits, _), state = model.apply({"params": params, "cache": cache}, prompts,
                                positions=positions, decode=True, mutable=["cache"])
    last = logits[rows, lengths - 1]  # [B, V]: the prediction after each row's last token
    out = jnp.concatenate([prompts, jnp.full((b, max_new_tokens), pad_token, prompts.dtype)], 1)
    out = jnp.where(jnp.arange(t + max_new_tokens)[None] < lengths[:, None], out, pad_token)

    def step(carry, i):
        cache, last, done, out, rng = carry
        rng, key = jax.random.split(rng)
        token = jnp.where(done, pad_token, sample(key, last))  # [B]
        pos = lengths + i  # [B]: where this token goes
        out = out.at[rows, pos].set(token.astype(out.dtype))
        new_done = done if stop_token is None else done | (token == stop_token)
        (logits, _), state = model.apply({"params": params, "cache": cache}, token[:, None],
                                    positions=pos[:, None], decode=True, mutable=["cache"])
        return (state["cache"], logits[:, 0], new_done, out, rng), ~done

    done = jnp.zeros((b,), bool)
    (_, _, _, out, _), emitted = jax.lax.scan(
        step, (state["cache"], last, done, out, rng), jnp.arange(max_new_tokens))
    return out, lengths + jnp.sum(emitted, axis=0).astype(jnp.int32)
