"""Transformer blocks and the layer stack.

One block = self-attention [+ cross-attention] + feed-forward, each a residual sublayer.
Where the norm goes is a switch (`norm_position`):
  "post"  x = Norm(x + Dropout(Sublayer(x)))   Vaswani et al. 2017 ("Add & Norm"), BERT.
  "pre"   x = x + Dropout(Sublayer(Norm(x)))   GPT-2, ViT: the residual stream is never
          normalised, so gradients reach early layers unscaled and deep stacks train
          without warm-up (Xiong et al. 2020). Pre-norm stacks need a final norm, which
          the models add after the stack.

    cfg = BlockConfig(num_heads=4, causal=True)
    y, aux = TransformerStack(cfg, num_layers=2)(x)      # x [B, T, D]

The stack can `nn.scan` over layers (one compiled layer, parameters stacked on a
leading LAYERS axis: compile time independent of depth) and rematerialise each layer
(`nn.remat` with a named policy: recompute activations in the backward pass instead of
storing them). Every block returns (y, aux); the stack stacks each aux leaf over layers
([L, ...]) whether or not it scans, so callers read aux the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.attention import IMPLEMENTATIONS, RING_INNER
from attention_jax.errors import check_positive_ints, check_rates_and_epsilon
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.mlp import (ACTIVATIONS, GATED_MLPS, MLP, MLPS, GatedMLP,
                                      gate_activation)
from attention_jax.layers.moe import MoE
from attention_jax.layers.norms import NORM_KERNELS, NORMS, make_norm

NORM_POSITIONS = ("pre", "post")
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: store every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer
    "dots": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the rest
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


def check_remat_policy(policy) -> None:
    """ValueError naming `policy` and REMAT_POLICIES unless it is one: the stack checks it
    as it is traced, and the models' configs when built (before any data is read)."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={policy!r} is unknown; valid: {tuple(REMAT_POLICIES)}")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Hyperparameters of one transformer block (hashable: a Flax module field).

    num_heads N, num_kv_heads K (default N), head_dim H (default D/N).
    mlp: "mlp" (two-layer, hidden mlp_dim, default 4D), "swiglu", "geglu" or "glu" (gated;
      hidden mlp_dim, default ≈ 8D/3 rounded to swiglu_multiple; "glu"'s gate is
      `activation`, the others' silu and gelu) or "moe" (num_experts, top_k,
      capacity_factor; hidden mlp_dim).
    norm: "layernorm" | "rmsnorm"; norm_position: "pre" | "post"; norm_kernel: how a
      pre-norm block adds a sublayer's output and normalises the sum (norms.NORM_KERNELS:
      "auto" takes the one-kernel add and norm of layers/norm_kernel.py on NVIDIA GPUs).
    causal: causal self-attention (decoders). cross_attention: add a cross-attention
      sublayer over a context (encoder-decoder decoders).
    dropout_rate: residual dropout on each sublayer's output (Vaswani §5.4) and in the MLP.
    attention_dropout_rate: on per-head attention outputs (layers/attention.py).
    implementation: attention backend; ring_inner: its chunk-pair kernel when the ring runs;
    rope_base: rotary embeddings in self-attention.
    attention_scale: multiplier of the attention logits (default 1/sqrt(H)).
    """

    num_heads: int
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    mlp: str = "mlp"
    mlp_dim: Optional[int] = None
    activation: str = "gelu"
    swiglu_multiple: int = 128
    norm: str = "layernorm"
    norm_position: str = "pre"
    norm_epsilon: float = 1e-6
    norm_kernel: str = "auto"
    causal: bool = False
    cross_attention: bool = False
    use_bias: bool = True
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    implementation: str = "auto"
    ring_inner: str = "auto"
    rope_base: Optional[float] = None
    attention_scale: Optional[float] = None
    window: Union[int, tuple[int, int], None] = None
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    dtype: Any = "float32"
    param_dtype: Any = "float32"

    def defers_output_bias(self, deterministic: bool) -> bool:
        """Whether a block leaves its attention's and MLP's output biases to the next norm
        (pre-norm, with biases, no residual dropout in this call); the MoE's is its own."""
        dropping = self.dropout_rate > 0 and not deterministic
        return self.norm_position == "pre" and self.use_bias and not dropping

    def __post_init__(self):
        choices = {"mlp": MLPS, "norm": NORMS, "norm_position": NORM_POSITIONS,
                   "norm_kernel": NORM_KERNELS,
                   "activation": tuple(ACTIVATIONS), "implementation": IMPLEMENTATIONS,
                   "ring_inner": RING_INNER}
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                raise ValueError(f"{field}={getattr(self, field)!r} is unknown; valid: {valid}")
        if self.mlp in GATED_MLPS:
            gate_activation(self.mlp, self.activation)
        if self.norm_kernel == "pallas" and self.norm_position == "post":
            raise ValueError("norm_kernel='pallas' takes a pre-norm block's residual add "
                             "into the next norm's kernel; a post-norm block has no such "
                             "add to give it: valid with norm_position='post': 'auto' or 'xla'")
        # Types first: a string or a float from the command line was compared with an
        # integer below ("'<=' not supported") or reached a shape (a JAX traceback).
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("num_heads", "num_kv_heads", "mlp_dim", "num_experts",
                                   "top_k"),
                            none_means={"num_kv_heads": "num_heads: multi-head attention",
                                        "mlp_dim": f"the {self.mlp!r} default width"})
        if (isinstance(self.capacity_factor, bool)
                or not isinstance(self.capacity_factor, (int, float))
                or not self.capacity_factor > 0):
            raise ValueError(f"capacity_factor={self.capacity_factor!r}; valid: a number > 0 "
                             f"(1.0: room for every token under an even load)")
        if self.mlp == "moe" and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k}; valid: 1..{self.num_experts} "
                             f"(num_experts={self.num_experts})")
        n, k = self.num_heads, self.num_kv_heads
        if k is not None and n % k:
            raise ValueError(f"num_kv_heads={k} must divide num_heads={n}; valid: "
                             f"{[d for d in range(1, n + 1) if n % d == 0]}")


class TransformerBlock(nn.Module):
    """One layer: self-attention, optional cross-attention, feed-forward; (y, aux) out."""

    config: BlockConfig

    def _flags(self) -> tuple[bool, bool]:
        return self.config.causal, self.config.cross_attention

    @nn.compact
    def __call__(self, x, context=None, *, positions=None, segment_ids=None, kv_mask=None,
                 context_mask=None, token_mask=None, deterministic: bool = True,
                 decode: bool = False, return_weights: bool = False):
        """x [B, T, D]; context [B, S, Dc] (cross-attention blocks); positions [B, T];
        segment_ids [B, T] / kv_mask [B, T] mask the self-attention keys; context_mask
        [B, S] bool masks the context's padding; token_mask [B, T] bool (mlp="moe" only):
        False marks padding the attention masks do not (a GPT's stream rows carry no
        segment ids), routed to no expert; decode: use the KV cache (see
        layers/attention.py). Returns (y [B, T, D], aux).

        Pre-norm blocks also take and return the residual stream with its last add left
        to do: x = (x, y, y_bias) stands for x + y + y_bias (y_bias [D] or None), which
        the first norm adds as it normalises (norms.add_normalize: one kernel on a GPU);
        the block then returns (x, its MLP's y, that y's bias) for the next block's first
        norm or the model's final one (TransformerStack's pending_residual)."""
        cfg = self.config
        causal, cross = self._flags()
        if cross and context is None:
            raise ValueError("a cross-attention block needs context [B, S, Dc]")
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        carried = isinstance(x, tuple)
        if carried and cfg.norm_position != "pre":
            raise ValueError("x = (x, y, y_bias), the residual stream with its add left to "
                             "do, is for pre-norm blocks; valid here: x [B, T, D]")
        x, *pending = x if carried else (x, None, None)
        d = x.shape[-1]
        common = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                      head_dim=cfg.head_dim, use_bias=cfg.use_bias,
                      dropout_rate=cfg.attention_dropout_rate, implementation=cfg.implementation,
                      ring_inner=cfg.ring_inner,
                      scale=cfg.attention_scale,
                      dtype=dtype, param_dtype=param_dtype)
        calls = dict(deterministic=deterministic, return_weights=return_weights)

        def norm(name):
            return make_norm(cfg.norm, epsilon=cfg.norm_epsilon, use_bias=cfg.use_bias,
                             dtype=dtype, param_dtype=param_dtype, kernel=cfg.norm_kernel,
                             name=name)

        # Pre-norm: a sublayer's output y is added to the residual stream by the next
        # sublayer's norm (one kernel on a GPU: norms.add_normalize), with the bias of the
        # projection that made y when the sublayer left it apart; the last one is added
        # at the end, or by the next block. Post-norm: x = norm(x + f(x)). A sublayer
        # returns (y, aux, y's bias or None).
        def residual(x, name, sublayer):
            nonlocal pending
            if cfg.norm_position == "post":
                y, sub_aux, _ = sublayer(x)
                y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
                x = norm(f"{name}_norm")(x + y)
            else:
                x, inp = norm(f"{name}_norm")(x, *pending, residual=True)
                y, sub_aux, y_bias = sublayer(inp)
                pending = [nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic), y_bias]
            return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED)), sub_aux

        def bias_apart(out):  # an attention layer's (y, aux) -> (y, aux, bias)
            y, sub_aux = out
            return y, sub_aux, sub_aux.pop("output_bias", None)

        # Output biases are left apart where nothing comes between them and the next norm
        # (no residual dropout): that norm's kernel adds them as it reads the output.
        defer = dict(defer_output_bias=cfg.defers_output_bias(deterministic))

        aux = {}
        self_attn = MultiHeadAttention(causal=causal, window=cfg.window, rope_base=cfg.rope_base,
                                       name="self_attention", **common, **defer)
        x, a = residual(x, "self_attention", lambda h: bias_apart(self_attn(
            h, positions=positions, segment_ids=segment_ids, kv_mask=kv_mask, decode=decode,
            **calls)))
        if return_weights:
            aux["self_attention_weights"] = a["attention_weights"]
        if cross:
            cross_attn = MultiHeadAttention(name="cross_attention", **common, **defer)
            x, a = residual(x, "cross_attention", lambda h: bias_apart(cross_attn(
                h, context, kv_mask=context_mask, decode=decode, **calls)))
            if return_weights:
                aux["cross_attention_weights"] = a["attention_weights"]

        if cfg.mlp == "moe":
            ffn = MoE(num_experts=cfg.num_experts, top_k=cfg.top_k,
                      capacity_factor=cfg.capacity_factor, hidden=cfg.mlp_dim,
                      priority="token" if causal else "choice",  # keeps decoders causal
                      activation=cfg.activation, use_bias=cfg.use_bias,
                      dropout_rate=cfg.dropout_rate, dtype=dtype, param_dtype=param_dtype,
                      name="mlp")
            # The block's keys are its tokens: kv_mask marks its padding, or else segment
            # id 0 (packed rows' padding, data/packing.py; a GPT passes only segment_ids),
            # which takes no expert's slot from a real token (and counts in no router
            # statistic, nor in the balance loss).
            real = kv_mask if kv_mask is not None or segment_ids is None else segment_ids != 0
            if token_mask is not None:  # padding the attention masks leave unmarked
                real = token_mask if real is None else jnp.logical_and(real, token_mask)
            x, aux["moe"] = residual(x, "mlp", lambda h: (
                *ffn(h, deterministic=deterministic, token_mask=real, no_drop=decode), None))
        else:
            if cfg.mlp in GATED_MLPS:
                ffn = GatedMLP(hidden=cfg.mlp_dim, multiple_of=cfg.swiglu_multiple,
                             gate_activation=gate_activation(cfg.mlp, cfg.activation),
                             use_bias=cfg.use_bias, dropout_rate=cfg.dropout_rate, dtype=dtype,
                             param_dtype=param_dtype, name="mlp", **defer)
            else:
                ffn = MLP(hidden=cfg.mlp_dim or 4 * d, activation=cfg.activation,
                          use_bias=cfg.use_bias, dropout_rate=cfg.dropout_rate, dtype=dtype,
                          param_dtype=param_dtype, name="mlp", **defer)

            def mlp(h):
                out = ffn(h, deterministic=deterministic)
                y, y_bias = out if defer["defer_output_bias"] else (out, None)
                return y, None, y_bias
            x, _ = residual(x, "mlp", mlp)
        if carried:
            return (x, *pending), aux
        y, y_bias = pending
        if y is not None:
            x = x + (y if y_bias is None else y + y_bias.astype(y.dtype))
        return nn.with_logical_constraint(x, (axes.BATCH, axes.LENGTH, axes.EMBED)), aux


class EncoderBlock(TransformerBlock):
    """Bidirectional self-attention + feed-forward (BERT, ViT, the Transformer encoder):
    ignores config.causal / config.cross_attention."""

    def _flags(self):
        return False, False


class DecoderBlock(TransformerBlock):
    """Causal self-attention + cross-attention over the encoder + feed-forward (Vaswani
    2017's decoder layer); needs `context`. Ignores config.causal / cross_attention."""

    def _flags(self):
        return True, True


BLOCKS = {"transformer": TransformerBlock, "encoder": EncoderBlock, "decoder": DecoderBlock}


def _positional(block_cls):
    """A block whose extra inputs are positional and whose flags are fields: the form
    nn.scan (broadcast inputs) and nn.remat (no static keyword arguments) need."""

    class Layer(block_cls):
        deterministic: bool = True
        decode: bool = False
        return_weights: bool = False

        def __call__(self, x, context, positions, segment_ids, kv_mask, context_mask,
                     token_mask):
            return super().__call__(
                x, context, positions=positions, segment_ids=segment_ids, kv_mask=kv_mask,
                context_mask=context_mask, token_mask=token_mask,
                deterministic=self.deterministic,
                decode=self.decode, return_weights=self.return_weights)

    Layer.__name__ = block_cls.__name__
    return Layer


class TransformerStack(nn.Module):
    """num_layers blocks of one config: [B, T, D] -> ([B, T, D], aux stacked [L, ...]).

    block: "transformer" (flags from config), "encoder" or "decoder" (see above).
    scan_layers: nn.scan over layers; params then live under "layers" with a leading
      L axis (logical name LAYERS), else under "layer_0", "layer_1", ...
    remat_policy: one of REMAT_POLICIES.
    pending_residual: pre-norm only: each block hands the next its residual stream with
      the last add left to do, (x, y, y_bias), which the next block's first norm adds in
      its kernel; the stack returns it in that form, for the caller's final norm to add
      (a norm's __call__(x, y, y_bias, residual=True)).
    """

    config: BlockConfig
    num_layers: int
    block: str = "transformer"
    scan_layers: bool = False
    remat_policy: str = "none"
    pending_residual: bool = False

    @nn.compact
    def __call__(self, x, context=None, *, positions=None, segment_ids=None, kv_mask=None,
                 context_mask=None, token_mask=None, deterministic: bool = True,
                 decode: bool = False, return_weights: bool = False):
        if self.block not in BLOCKS:
            raise ValueError(f"block={self.block!r} is unknown; valid: {tuple(BLOCKS)}")
        check_remat_policy(self.remat_policy)
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1; got {self.num_layers}")
        if self.pending_residual:
            if self.config.norm_position != "pre":
                raise ValueError("pending_residual=True is for pre-norm blocks; "
                                 f"norm_position={self.config.norm_position!r}")
            # The carry through the layers, (x, y, y_bias): one structure for every layer
            # (nn.scan's), so the first block gets zeros to add.
            bias = (jnp.zeros(x.shape[-1:], self.config.param_dtype)  # (as a bias apart is)
                    if self.config.defers_output_bias(deterministic) and self.config.mlp != "moe"
                    else None)
            x = (x, jnp.zeros_like(x), bias) if self.scan_layers else (x, None, None)
        layer = _positional(BLOCKS[self.block])
        if self.remat_policy != "none":
            # prevent_cse stops XLA from merging the recomputation with the forward pass;
            # inside scan the loop already prevents that, and the flag would cost speed.
            layer = nn.remat(layer, policy=REMAT_POLICIES[self.remat_policy],
                             prevent_cse=not self.scan_layers)
        flags = dict(deterministic=deterministic, decode=decode, return_weights=return_weights)
        inputs = (context, positions, segment_ids, kv_mask, context_mask, token_mask)
        if self.scan_layers:
            scanned = nn.scan(
                layer, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * len(inputs),
                length=self.num_layers, metadata_params={nn.PARTITION_NAME: axes.LAYERS})
            return scanned(self.config, name="layers", **flags)(x, *inputs)
        auxes = []
        for i in range(self.num_layers):
            x, aux = layer(self.config, name=f"layer_{i}", **flags)(x, *inputs)
            auxes.append(aux)
        return x, jax.tree.map(lambda *leaves: jnp.stack(leaves), *auxes)
