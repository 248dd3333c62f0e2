"""Vision Transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words").

    cfg = ViTConfig.from_variant("vit-tiny/2")            # 8x8 grey digits, 10 classes
    model = ViT(cfg)
    params = model.init(key, images)["params"]             # images [B, H, W, C] float
    logits, aux = model.apply({"params": params}, images)  # [B, num_classes]

An image is cut into P×P patches, each flattened and projected linearly to D (eq. 1) —
a convolution with kernel P and stride P is the same map; writing it as a reshape and an
einsum keeps the "patches are words" reading. A learned [CLS] token is prepended (or,
with pool="gap", the patch tokens are averaged, Section 3.1 / Appendix D.3), learned 1-D
position embeddings are added, and a pre-norm encoder (LayerNorm inside each residual
branch, eq. 2-3) with a final LayerNorm feeds a linear classifier.

At a new resolution (Section 3.2, fine-tuning at higher resolution) the number of
patches changes, so the learned position table is resized as a 2-D grid by bilinear
interpolation; the [CLS] row is kept. At the trained resolution the table is used as is.

For Hugging Face `google/vit-*` checkpoints: pre-norm, exact GELU, LayerNorm epsilon
1e-12 (`norm_epsilon`; big_vision and the paper's code use 1e-6), a CLS token,
1 + P position rows, no pooler before the classifier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.errors import (check_bools, check_fields, check_flags,
                                 check_float_dtypes, check_float_images, check_positive_ints,
                                 check_rates_and_epsilon)
from attention_jax.attention import IMPLEMENTATIONS
from attention_jax.layers.attention import check_heads
from attention_jax.layers.blocks import BlockConfig, REMAT_POLICIES, TransformerStack
from attention_jax.layers.norms import NORM_KERNELS, make_norm

__all__ = ["ViTConfig", "ViT", "VARIANTS", "POOLS", "interpolate_position_embeddings"]

POOLS = ("cls", "gap")


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224  # side of the (square) training image; sets the position table
    patch_size: int = 16  # side of the square patches that become tokens
    num_channels: int = 3  # the images' channels (the tasks set it from the data)
    d_model: int = 768  # hidden size D
    num_layers: int = 12  # transformer blocks
    num_heads: int = 12  # attention heads (head dim D / num_heads)
    mlp_dim: int = 3072  # the MLP's hidden width
    num_classes: int = 1000  # the classifier's outputs (the tasks set it from the data)
    pool: str = "cls"  # "cls": classify the [CLS] token; "gap": average the patch tokens
    norm_epsilon: float = 1e-6  # added to the variance in every LayerNorm
    dropout_rate: float = 0.0  # on the embeddings and each sublayer's output (residual dropout)
    attention_dropout_rate: float = 0.0  # on the per-head attention outputs
    position_embeddings: bool = True  # False: an order-blind encoder (for the lectures' tests)
    # attention backend: auto | reference | ring | cudnn | pallas | splash | blockwise | xla
    implementation: str = "auto"
    scan_layers: bool = False  # the blocks as one lax.scan: compiles in the time of one block
    # activation checkpointing per block: none | full | dots | dots_no_batch
    remat_policy: str = "none"
    norm_kernel: str = "auto"  # residual add + norm: layers/norms.py NORM_KERNELS
    dtype: Any = "float32"

    def __post_init__(self):
        check_float_dtypes(self)
        check_bools(self)
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("image_size", "patch_size", "num_channels", "d_model",
                                   "num_heads", "num_layers", "mlp_dim", "num_classes"))
        check_heads(self.d_model, self.num_heads, head_dim_settable=False)  # lists the valid counts
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}; "
                f"valid image sizes are multiples such as "
                f"{[self.patch_size * k for k in range(1, 5)]}, or pick a patch size in "
                f"{[p for p in range(1, self.image_size + 1) if self.image_size % p == 0]}")
        # (norm_kernel is the block's field, whose own check came only as the model was
        # traced: a traceback after the data was built)
        choices = {"pool": POOLS, "implementation": IMPLEMENTATIONS,
                   "remat_policy": tuple(REMAT_POLICIES), "norm_kernel": NORM_KERNELS}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is unknown; valid: {valid}")

    @property
    def grid_size(self) -> int:
        """Patches per side at the training resolution."""
        return self.image_size // self.patch_size

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "ViTConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown ViT variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})

    def block(self) -> BlockConfig:
        return BlockConfig(
            num_heads=self.num_heads, mlp="mlp", mlp_dim=self.mlp_dim, activation="gelu",
            norm="layernorm", norm_position="pre", norm_epsilon=self.norm_epsilon,
            dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
            implementation=self.implementation, norm_kernel=self.norm_kernel, dtype=self.dtype)


# Model sizes: Dosovitskiy et al. 2020, Table 1 (Base 86M, Large 307M, Huge 632M);
# Tiny and Small from Touvron et al. 2020 (DeiT), Table 1 (5M, 22M). "vit-b/16" is
# ViT-Base on 16×16 patches; the paper pairs Base/Large with 16 and 32, Huge with 14.
_SIZES = {
    "ti": dict(d_model=192, num_layers=12, num_heads=3, mlp_dim=768),
    "s": dict(d_model=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "b": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "l": dict(d_model=1024, num_layers=24, num_heads=16, mlp_dim=4096),
    "h": dict(d_model=1280, num_layers=32, num_heads=16, mlp_dim=5120),
}
_PATCHES = {"ti": (16,), "s": (16, 32), "b": (8, 16, 32), "l": (16, 32), "h": (14,)}
VARIANTS = {f"vit-{size}/{p}": dict(_SIZES[size], patch_size=p)
            for size, patches in _PATCHES.items() for p in patches}
# For sklearn's 8×8 grey digits: 16 patches of 2×2 (or 4 of 4×4), 10 classes.
_TINY = dict(image_size=8, num_channels=1, d_model=32, num_layers=2, num_heads=2, mlp_dim=64,
             num_classes=10)
VARIANTS["vit-tiny/2"] = dict(_TINY, patch_size=2)
VARIANTS["vit-tiny/4"] = dict(_TINY, patch_size=4)


# ----------------------------------------------------------------------------- helpers


def patchify(images, patch_size: int):
    """[B, H, W, C] -> [B, H/P, W/P, P*P*C]: each patch flattened (row, column, channel)."""
    b, h, w, c = images.shape
    p = patch_size
    x = images.reshape(b, h // p, p, w // p, p, c)  # [B, gh, P, gw, P, C]
    x = x.transpose(0, 1, 3, 2, 4, 5)  # [B, gh, gw, P, P, C]
    return x.reshape(b, h // p, w // p, p * p * c)


def interpolate_position_embeddings(table, grid, new_grid, num_prefix: int = 1):
    """Resize a learned position table to a new patch grid (Dosovitskiy et al. Section 3.2).

    table [num_prefix + gh*gw, D] (prefix rows: [CLS]); grid (gh, gw) -> new_grid (nh, nw).
    The patch rows are a 2-D image of D channels, resized bilinearly; prefix rows are kept.
    At the same grid the table is returned unchanged, bit for bit.
    """
    grid, new_grid = tuple(grid), tuple(new_grid)
    if grid == new_grid:
        return table
    prefix, patches = table[:num_prefix], table[num_prefix:]
    d = table.shape[-1]
    patches = patches.reshape(*grid, d)  # [gh, gw, D]
    patches = jax.image.resize(patches.astype(jnp.float32), (*new_grid, d), method="bilinear")
    return jnp.concatenate([prefix, patches.reshape(-1, d).astype(table.dtype)], axis=0)


# ----------------------------------------------------------------------------- model


class ViT(nn.Module):
    """Vision Transformer classifier: images [B, H, W, C] -> (logits [B, num_classes], aux).

    aux: "hidden_states" [B, 1 + P or P, D] final (normed) token states, "pooled" [B, D] the
    classifier input, and "attention_weights" {"self": [L, B, N, T, T]} when return_weights=True.
    H and W may differ from config.image_size (position embeddings are interpolated) but
    must be multiples of the patch size.
    """

    config: ViTConfig

    @nn.compact
    def __call__(self, images, *, deterministic: bool = True, return_weights: bool = False):
        check_flags(deterministic=deterministic, return_weights=return_weights)
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if images.ndim != 4 or images.shape[-1] != cfg.num_channels:
            raise ValueError(f"images must be [B, H, W, C={cfg.num_channels}]; got {images.shape}")
        check_float_images(images)
        b, h, w, _ = images.shape
        p = cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"image size {h}x{w} is not a multiple of patch_size={p}; "
                             f"valid sizes are multiples of {p}, e.g. {cfg.image_size}")

        # Patch embedding (eq. 1): x_p E + b, E [P*P*C, D]. Stored as [P, P, C, D] so the
        # kernel reads like (and converts to) a stride-P convolution's.
        kernel = self.param("patch_embedding", nn.with_logical_partitioning(
            nn.initializers.lecun_normal(in_axis=(0, 1, 2), out_axis=3), (None, None, None, axes.EMBED)),
            (p, p, cfg.num_channels, cfg.d_model), jnp.float32)
        bias = self.param("patch_bias", nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
                          (cfg.d_model,), jnp.float32)
        patches = patchify(images.astype(dtype), p)  # [B, gh, gw, P*P*C]
        x = jnp.einsum("BYXI,ID->BYXD", patches, kernel.reshape(-1, cfg.d_model).astype(dtype))
        x = (x + bias.astype(dtype)).reshape(b, -1, cfg.d_model)  # [B, P, D], row-major grid

        num_prefix = 1 if cfg.pool == "cls" else 0
        if cfg.pool == "cls":
            cls = self.param("cls", nn.with_logical_partitioning(nn.initializers.zeros, (None, axes.EMBED)),
                             (1, cfg.d_model), jnp.float32)
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, cfg.d_model)), x], axis=1)
        if cfg.position_embeddings:
            g = cfg.grid_size
            table = self.param("position_embeddings", nn.with_logical_partitioning(
                nn.initializers.normal(0.02), (axes.POSITION, axes.EMBED)),
                (num_prefix + g * g, cfg.d_model), jnp.float32)  # [1 + P, D]
            table = interpolate_position_embeddings(table, (g, g), (h // p, w // p), num_prefix)
            x = x + table.astype(dtype)[None]
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        # Pre-norm: the stack leaves its last residual add to the final norm, (x, y, y_bias)
        # (layers/blocks.py, one kernel on a GPU).
        pre_norm = cfg.block().norm_position == "pre"
        x, stack_aux = TransformerStack(cfg.block(), cfg.num_layers, block="encoder",
                                        scan_layers=cfg.scan_layers, remat_policy=cfg.remat_policy,
                                        pending_residual=pre_norm, name="encoder")(
            x, deterministic=deterministic, return_weights=return_weights)
        norm = make_norm("layernorm", epsilon=cfg.norm_epsilon, dtype=dtype,
                         kernel=cfg.norm_kernel, name="encoder_norm")
        x = norm(*x, residual=True)[1] if pre_norm else norm(x)
        pooled = x[:, 0] if cfg.pool == "cls" else jnp.mean(x, axis=1)  # [B, D]
        aux = {"hidden_states": x, "pooled": pooled}
        if return_weights:
            aux["attention_weights"] = {"self": stack_aux["self_attention_weights"]}  # [L, B, N, T, T]
        # Zero-initialised head (Appendix B.1.1 fine-tuning): starts at uniform predictions.
        logits = nn.Dense(cfg.num_classes, dtype=dtype, name="head",
                          kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED, None)),
                          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))(pooled)
        return logits, aux
