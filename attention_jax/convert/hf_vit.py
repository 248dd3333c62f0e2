"""ViT (ViTModel, ViTForImageClassification) <-> our ViT: config mapping and tensor
rules, both ways. Export writes ViTForImageClassification (our ViT always has a
classifier); ViTModel takes params without the "head" (transformers then builds its
pooler afresh unless loaded with `ViTModel.from_pretrained(dir, add_pooling_layer=False)`)."""

from __future__ import annotations

import jax.numpy as jnp

from attention_jax.convert.hf_rules import (Family, Rule, activation_from_hf, attention, copy,
                                            layernorm, linear, num_labels, require)
from attention_jax.models import vit


def _square(hf_cfg, key, default) -> int:
    value = hf_cfg.get(key, default)
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"config.json {key}={value!r} is not square; valid: one side")
        value = value[0]
    return int(value)


class ViTFamily(Family):
    model_type = "vit"
    prefix = "vit."
    architectures = ("ViTModel", "ViTForImageClassification")
    base_architecture = "ViTModel"
    head_paths = ("head/",)
    config_cls = vit.ViTConfig

    def guess_architecture(self, tensors):
        return "ViTForImageClassification" if "classifier.weight" in tensors else "ViTModel"

    def config(self, hf_cfg, arch):
        if activation_from_hf(hf_cfg, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"config.json hidden_act={hf_cfg['hidden_act']!r} is not supported "
                             f"(our ViT uses the exact GELU); valid: 'gelu'")
        require(hf_cfg, "qkv_bias", True, "q/k/v projections have biases")
        num_classes = num_labels(hf_cfg)
        if num_classes <= 0:
            raise ValueError(f"config.json num_labels={num_classes} (no classifier) is not "
                             f"supported; valid: num_labels >= 1")
        return vit.ViTConfig(
            image_size=_square(hf_cfg, "image_size", 224),
            patch_size=_square(hf_cfg, "patch_size", 16),
            # (a key config.json lacks takes ViTConfig's default, as transformers reads it)
            num_channels=hf_cfg.get("num_channels", 3), d_model=hf_cfg.get("hidden_size", 768),
            num_layers=hf_cfg.get("num_hidden_layers", 12),
            num_heads=hf_cfg.get("num_attention_heads", 12),
            mlp_dim=hf_cfg.get("intermediate_size", 3072), num_classes=num_classes, pool="cls",
            norm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
            dropout_rate=hf_cfg.get("hidden_dropout_prob", 0.0),
            attention_dropout_rate=hf_cfg.get("attention_probs_dropout_prob", 0.0))

    def rules(self, c: vit.ViTConfig, arch):
        d, f, p = c.d_model, c.mlp_dim, c.patch_size
        e = "embeddings."
        rules = [Rule("patch_embedding", (e + "patch_embeddings.projection.weight",),
                      ((d, c.num_channels, p, p),), "conv"),
                 copy("patch_bias", e + "patch_embeddings.projection.bias", (d,)),
                 copy("cls", e + "cls_token", (1, 1, d)),
                 copy("position_embeddings", e + "position_embeddings", (1, 1 + c.grid_size ** 2, d))]
        for i in range(c.num_layers):
            o, q = f"encoder/layer_{i}/", f"encoder.layer.{i}."
            a = q + "attention."
            # Pre-norm: layernorm_before feeds attention, layernorm_after the MLP.
            rules += [*layernorm(o + "self_attention_norm", q + "layernorm_before", d),
                      *attention(o + "self_attention", a + "attention.query", a + "attention.key",
                                 a + "attention.value", a + "output.dense", d),
                      *layernorm(o + "mlp_norm", q + "layernorm_after", d),
                      *linear(o + "mlp/wi", q + "intermediate.dense", d, f),
                      *linear(o + "mlp/wo", q + "output.dense", f, d)]
        rules += layernorm("encoder_norm", "layernorm", d)
        if arch == "ViTForImageClassification":
            rules += linear("head", "classifier", d, c.num_classes, base=False)
        return rules

    def unused(self, arch):
        # ViTModel's pooler (dense + tanh on [CLS]) is not part of our ViT, whose
        # classifier reads the [CLS] state directly as ViTForImageClassification does.
        return ("pooler.dense.weight", "pooler.dense.bias") if arch == "ViTModel" else ()

    def model(self, c, arch):
        return vit.ViT(c)

    def arch_fields(self, c: vit.ViTConfig):
        return dict(patch_size=c.patch_size, num_channels=c.num_channels, d_model=c.d_model,
                    num_layers=c.num_layers, num_heads=c.num_heads, mlp_dim=c.mlp_dim,
                    norm_epsilon=c.norm_epsilon, pool=c.pool,
                    position_embeddings=c.position_embeddings)

    def hf_config(self, c: vit.ViTConfig, arch):
        # transformers' ViT: [CLS] pooling, learned absolute positions, exact GELU.
        unsupported = {"pool": ("cls", c.pool), "position_embeddings": (True, c.position_embeddings)}
        for field, (want, got) in unsupported.items():
            if want != got:
                raise ValueError(f"ViTConfig.{field}={got!r} has no transformers ViT "
                                 f"equivalent; valid: {want!r}")
        out = {"model_type": "vit", "architectures": [arch], "hidden_size": c.d_model,
               "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
               "intermediate_size": c.mlp_dim, "hidden_act": "gelu",
               "hidden_dropout_prob": c.dropout_rate,
               "attention_probs_dropout_prob": c.attention_dropout_rate,
               "layer_norm_eps": c.norm_epsilon, "image_size": c.image_size,
               "patch_size": c.patch_size, "num_channels": c.num_channels, "qkv_bias": True}
        if arch == "ViTForImageClassification":
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_classes)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(c.num_classes)}
        return out

    def dummy_input(self, c):
        return (jnp.zeros((1, c.image_size, c.image_size, c.num_channels)),), {}
