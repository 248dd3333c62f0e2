"""A small residual CNN: the convolutional baseline ViT is measured against.

    cfg = CNNConfig.from_variant("resnet-tiny")             # 8x8 grey digits, 10 classes
    model = CNN(cfg)
    params = model.init(key, images)["params"]              # images [B, H, W, C] float
    logits, aux = model.apply({"params": params}, images)   # [B, num_classes]

The lectures' contrast (Dosovitskiy et al. 2020 §3.1, "Inductive bias"): a convolution
builds in locality and translation equivariance in every layer, while ViT's only
image-specific choices are the patch cut and the position table, so ViT must learn from
data what the CNN is given. The model: a 3×3 convolution stem to `width` channels, then
`num_blocks` pre-activation residual blocks (He et al. 2016, "Identity Mappings in Deep
Residual Networks": x + conv(act(norm(conv(act(norm(x)))))) at full resolution, a final
norm and activation, global average pooling and a linear classifier. GroupNorm (Wu & He
2018) instead of BatchNorm: no running statistics, so the trainer's stateless step and
evaluation serve it like every other model, and small batches are no problem.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from attention_jax.errors import (check_fields, check_flags, check_float_dtypes,
                                 check_float_images, check_positive_ints,
                                 check_rates_and_epsilon)

__all__ = ["CNNConfig", "CNN", "VARIANTS"]


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    image_size: int = 8  # side of the training image (the CNN itself takes any size)
    num_channels: int = 1  # the images' channels (the tasks set it from the data)
    width: int = 48  # channels of the stem and of every block
    num_blocks: int = 3  # residual blocks after the stem
    kernel_size: int = 3  # side of every convolution's window
    groups: int = 8  # GroupNorm groups; must divide width
    num_classes: int = 10  # the classifier's outputs (the tasks set it from the data)
    dropout_rate: float = 0.0  # before the classifier
    dtype: Any = "float32"

    def __post_init__(self):
        check_float_dtypes(self)
        check_rates_and_epsilon(self)
        check_positive_ints(self, ("image_size", "num_channels", "width", "num_blocks",
                                   "kernel_size", "groups", "num_classes"))
        if self.width % self.groups:
            valid = [g for g in range(1, self.width + 1) if self.width % g == 0]
            raise ValueError(f"groups={self.groups} does not divide width={self.width}; valid "
                             f"groups: {valid}")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size} must be odd (a centred 'SAME' "
                             f"kernel); valid: 1, 3, 5, ...")

    @classmethod
    def from_variant(cls, name: str, **overrides) -> "CNNConfig":
        if name not in VARIANTS:
            raise ValueError(f"unknown CNN variant {name!r}; valid: {sorted(VARIANTS)}")
        check_fields(cls, overrides)
        return cls(**{**VARIANTS[name], **overrides})


# "resnet-tiny": 3 blocks of 48 channels on 8×8 digits, about the parameters of the digits
# ViT of configs/vit_digits.py (124k in the blocks against its 131k).
VARIANTS = {
    "resnet-tiny": dict(image_size=8, num_channels=1, width=48, num_blocks=3, num_classes=10),
}


class ResidualBlock(nn.Module):
    """Pre-activation residual block [B, H, W, C] -> [B, H, W, C]."""

    width: int
    kernel_size: int
    groups: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        k = (self.kernel_size, self.kernel_size)
        h = x
        for i in range(2):
            h = nn.GroupNorm(num_groups=self.groups, dtype=self.dtype, name=f"norm{i}")(h)
            h = nn.gelu(h)
            h = nn.Conv(self.width, k, padding="SAME", use_bias=False, dtype=self.dtype,
                        name=f"conv{i}")(h)
        return x + h


class CNN(nn.Module):
    """Residual CNN classifier: images [B, H, W, C] -> (logits [B, num_classes], aux).

    aux: "feature_maps" [B, H, W, width] after the last block (normed and activated) and
    "pooled" [B, width], the classifier input.
    """

    config: CNNConfig

    @nn.compact
    def __call__(self, images, *, deterministic: bool = True):
        check_flags(deterministic=deterministic)
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if images.ndim != 4 or images.shape[-1] != cfg.num_channels:
            raise ValueError(f"images must be [B, H, W, C={cfg.num_channels}]; got {images.shape}")
        check_float_images(images)
        k = (cfg.kernel_size, cfg.kernel_size)
        x = nn.Conv(cfg.width, k, padding="SAME", dtype=dtype, name="stem")(images.astype(dtype))
        for i in range(cfg.num_blocks):
            x = ResidualBlock(cfg.width, cfg.kernel_size, cfg.groups, dtype, name=f"block{i}")(x)
        x = nn.gelu(nn.GroupNorm(num_groups=cfg.groups, dtype=dtype, name="final_norm")(x))
        pooled = x.mean(axis=(1, 2))  # [B, width]: global average pooling
        h = nn.Dropout(cfg.dropout_rate)(pooled, deterministic=deterministic)
        logits = nn.Dense(cfg.num_classes, dtype=dtype, name="head")(h)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        return logits, {"feature_maps": x, "pooled": pooled}
