"""Flax linen layers built on `attention_jax.attention`: attention, positions, norms,
MLPs, mixture-of-experts, and transformer blocks/stacks. Each is a pure function of
(params, inputs) through init/apply; see each module's docstring.
"""

from attention_jax.layers import attention, blocks, mlp, moe, norms, posemb
from attention_jax.layers.attention import MultiHeadAttention
from attention_jax.layers.blocks import (BlockConfig, DecoderBlock, EncoderBlock,
                                         TransformerBlock, TransformerStack)
from attention_jax.layers.mlp import MLP, GatedMLP
from attention_jax.layers.moe import MoE
from attention_jax.layers.norms import make_norm
from attention_jax.layers.posemb import (LearnedPositionEmbedding, apply_rope, sinusoidal,
                                         sinusoidal_table)

__all__ = ["attention", "blocks", "mlp", "moe", "norms", "posemb", "MultiHeadAttention",
           "BlockConfig", "TransformerBlock", "EncoderBlock", "DecoderBlock",
           "TransformerStack", "MLP", "GatedMLP", "MoE", "make_norm", "LearnedPositionEmbedding",
           "apply_rope", "sinusoidal", "sinusoidal_table"]
