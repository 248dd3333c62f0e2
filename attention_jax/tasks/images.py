"""Image classification families: the ViT (`vit`) and the residual CNN (`cnn`)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.errors import ConfigError
from attention_jax.models import flops
from attention_jax.models.losses import WEIGHT, cross_entropy
from attention_jax.tasks.base import (AttentionInput, Task, data_options, model_config,
                                      register, splits)


def image_task(config, workdir: str) -> Task:
    """Image classification (default: scikit-learn's 8×8 digits): config.task 'vit' uses
    models/vit.py, 'cnn' the residual CNN of models/cnn.py. data.train_fraction < 1
    trains on that share of the training split (data.subset_fraction)."""
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    from attention_jax.models import cnn, vit
    data_opts = data_options(config, name="digits", data_dir="", augment=True, padding=1, flip=False,
                     train_split="train", eval_split="test", train_fraction=1.0)
    train_src, eval_src = splits(data_opts)
    try:
        train_src = data.subset_fraction(train_src, data_opts.train_fraction)
    except ValueError as e:
        raise ConfigError(f"config.data.train_fraction: {e}") from None
    family = {"vit": (vit.ViTConfig, vit.ViT, _vit_entries),
              "cnn": (cnn.CNNConfig, cnn.CNN, _cnn_entries)}
    config_cls, model_cls, entries = family[config.task]
    cfg = model_config(config_cls, config, dtype=config.train.compute_dtype)
    model = model_cls(cfg)

    def loss(params, batch, rng, train):
        logits, _ = model.apply({"params": params}, batch["image"], deterministic=not train,
                                rngs={"dropout": rng})
        # Eval batches weigh each image (0: a row padding the last batch; steps.evaluate);
        # training batches have no weights: every image counts.
        example_weight = batch.get(EXAMPLE_WEIGHT)
        nll, metrics = cross_entropy(logits, batch["label"], example_weight,
                                     config.optim.label_smoothing if train else 0.0)
        if example_weight is not None:
            metrics[WEIGHT] = jnp.sum(example_weight)  # the images the means are over
        return nll, metrics

    predict = jax.jit(lambda params, images: jnp.argmax(
        model.apply({"params": params}, images)[0], axis=-1).astype(jnp.int32))

    def classify(params, batch):
        return np.asarray(predict(params, batch["image"])), np.asarray(batch["label"], np.int32)

    shape = (1, cfg.image_size, cfg.image_size, cfg.num_channels)
    eval_transform = data.ImageClassification()
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros(shape))["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=data.ImageClassification(augment=data_opts.augment, padding=data_opts.padding,
                                                         flip=data_opts.flip),
                eval_transform=eval_transform, classify=classify,
                **entries(cfg, eval_src, eval_transform))


def _vit_entries(cfg, eval_src, eval_transform) -> dict:
    # Patches (+ [CLS]): the tokens an image is to the Transformer.
    tokens = cfg.grid_size ** 2 + (1 if cfg.pool == "cls" else 0)
    return dict(tokens_per_example=tokens,
                attention_input=_image_attention_input(cfg, eval_src, eval_transform),
                flops_per_unit=lambda params: tokens * flops.flops_per_token(
                    flops.matmul_params(params), cfg.num_layers, tokens, cfg.d_model))


def _cnn_entries(cfg, eval_src, eval_transform) -> dict:
    # The CNN's stride-1 convolutions run at every pixel of the image.
    return dict(flops_per_unit=lambda params: flops.conv_flops_per_example(
        params, cfg.image_size ** 2))


def _image_attention_input(cfg, source, transform):
    """Task.attention_input of the ViT: eval image `index`, labelled by patch row,column."""
    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params
        if text is not None or target is not None:
            raise ValueError("text= and target= are for text tasks; the ViT draws an eval "
                             "image: give index=")
        if not 0 <= index < len(source):
            raise ValueError(f"index={index}; valid: 0..{len(source) - 1} (the eval split)")
        example = transform(source[index], np.random.default_rng(0))
        side = cfg.grid_size
        labels = [f"{r},{c}" for r in range(side) for c in range(side)]  # row-major patches
        if cfg.pool == "cls":
            labels = ["[CLS]"] + labels
        return AttentionInput(inputs=(np.asarray(example["image"], np.float32)[None],),
                              labels={"self": (labels, labels)}, info={"tokens": labels},
                              title=f"eval image {index} (label {int(example['label'])})")
    return attention_input


register("vit", image_task, provides=("classify", "attention_input", "flops_per_unit",
                                      "tokens_per_example"))
register("cnn", image_task, provides=("classify", "flops_per_unit"))
