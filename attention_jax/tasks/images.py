"""Image classification families: the ViT (`vit`) and the residual CNN (`cnn`)."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import workdir as workdir_lib
from attention_jax.config import IMAGE_KEYS
from attention_jax.errors import ConfigError, check_choice, check_range, did_you_mean
from attention_jax.models import cnn, flops, vit
from attention_jax.models.losses import classifier_cross_entropy
from attention_jax.tasks.base import (CLASSES_FILE, AttentionInput, OnDemand, Task,
                                      check_classes, check_model_keys, check_source_keys,
                                      data_is_on_demand, data_options, has_trained,
                                      model_config, register, save_classes, saved_classes,
                                      splits)

# Images classified per call of label_images' program (the last call padded to it).
PREDICT_ROWS = 64


def image_task(config, workdir: str) -> Task:
    """Image classification (default: scikit-learn's 8×8 digits): config.task 'vit' uses
    models/vit.py, 'cnn' the residual CNN of models/cnn.py. The data: a prepared tfds
    image set by name, or data.name='image_folder' with data.root (data/images.py); the
    keys of config.IMAGE_KEYS set the preprocessing (data.image_size, channels, crops,
    mean/std, mixup/cutmix), and the image size, channels and number of classes reach the
    model. data.train_fraction < 1 trains on that share of the training split."""
    from attention_jax import data
    from attention_jax.data import images as images_lib
    from attention_jax.data import objectives
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    family = {"vit": (vit.ViTConfig, vit.ViT, vit.VARIANTS, _vit_entries),
              "cnn": (cnn.CNNConfig, cnn.CNN, cnn.VARIANTS, _cnn_entries)}
    config_cls, model_cls, variants, entries = family[config.task]
    check_model_keys(config_cls, config)  # before the images are read
    data_opts = data_options(config, name="digits", data_dir="", train_split="train",
                             eval_split="test", train_fraction=1.0, **IMAGE_KEYS)
    _check_image_options(data_opts)

    def fraction(train_src):  # data.train_fraction < 1: that share of the training split
        try:
            return data.subset_fraction(train_src, data_opts.train_fraction)
        except ValueError as e:
            raise ConfigError(f"config.data.train_fraction: {e}") from None
    saved = saved_classes(workdir)
    if data_is_on_demand() and saved and data_opts.name == "image_folder":
        # A reader (classifying image files, attention maps) needs the run's classes, not
        # its folder, which may have moved; an evaluation lists the folder then, and its
        # classes must still be the run's.
        @functools.cache
        def folder():
            found = _image_sources(data_opts, say_held_out=jax.process_index() == 0)
            check_classes(workdir, found[2])
            return found
        train_src = OnDemand(lambda: fraction(folder()[0]))
        eval_src, classes = OnDemand(lambda: folder()[1]), list(saved)
        if data_opts.eval_root:  # a held-out folder of its own: the training one not listed
            eval_src = OnDemand(lambda: _held_out_folder(data_opts, saved))
    else:
        # A held-out split is said only where it is evaluated, once for the run.
        try:
            train_src, eval_src, classes = _image_sources(
                data_opts, say_held_out=config.eval.every != -1 and jax.process_index() == 0)
        except ConfigError as e:
            if not (data_is_on_demand() and data_opts.name == "image_folder"
                    and workdir and has_trained(workdir)):
                raise
            # A reader of a trained run lists the folder only for want of its classes.json.
            raise ConfigError(f"{e}; a reading mode takes the run's classes from "
                              f"{workdir_lib.path(workdir, CLASSES_FILE)}, which is gone, and "
                              f"so lists the training folder; valid: that file put back, or "
                              f"config.data.root naming where the training folder is now "
                              f"(its class folders are the run's classes)") from None
        train_src = fraction(train_src)
    forced = _model_fields(config, data_opts, config_cls, variants, train_src, classes)
    cfg = model_config(config_cls, config, dtype=config.train.compute_dtype, **forced)
    model = model_cls(cfg)
    check_classes(workdir, classes)
    mixing = data_opts.mixup > 0 or data_opts.cutmix > 0

    def loss(params, batch, rng, train):
        images = batch["image"]
        if train and mixing:  # batch-level mixup/cutmix: soft targets (data/objectives.py)
            rng, mix_rng = jax.random.split(rng)
            images, targets = objectives.mix_batch(
                images, batch["label"], mix_rng, num_classes=cfg.num_classes,
                mixup=data_opts.mixup, cutmix=data_opts.cutmix)
        logits, _ = model.apply({"params": params}, images, deterministic=not train,
                                rngs={"dropout": rng})
        if train and mixing:
            return soft_cross_entropy(logits, targets, config.optim.label_smoothing)
        # Eval batches weigh each image (0: a row padding the last batch; steps.evaluate);
        # training batches have no weights: every image counts.
        return classifier_cross_entropy(logits, batch["label"], batch.get(EXAMPLE_WEIGHT),
                                        config.optim.label_smoothing if train else 0.0)

    predict = jax.jit(lambda params, images: jnp.argmax(
        model.apply({"params": params}, images)[0], axis=-1).astype(jnp.int32))

    def classify(params, batch):
        return np.asarray(predict(params, batch["image"])), np.asarray(batch["label"], np.int32)

    probabilities = jax.jit(lambda params, images: jax.nn.softmax(
        model.apply({"params": params}, images)[0].astype(jnp.float32), axis=-1))

    def label_images(params, paths):
        out = np.full((len(paths), cfg.num_classes), np.nan, np.float32)
        unreadable = {}
        blank = np.zeros((cfg.image_size, cfg.image_size, cfg.num_channels), np.float32)
        for at in range(0, len(paths), PREDICT_ROWS):  # a batch decoded at a time
            chunk = []
            for i, path in enumerate(paths[at:at + PREDICT_ROWS], at):
                try:
                    chunk.append(_read_image(path, cfg.num_channels, eval_transform))
                except ValueError as e:  # its row stays NaN; the others are classified
                    unreadable[i] = str(e).removeprefix(f"{path}: ")
                    chunk.append(blank)
            n = len(chunk)
            chunk += [blank] * (PREDICT_ROWS - n)  # one shape: one compilation
            out[at:at + n] = np.asarray(probabilities(params, np.stack(chunk)))[:n]
        out[list(unreadable)] = np.nan
        return out, unreadable

    def preprocess(train: bool):
        try:
            return _preprocess(train)
        except images_lib.ImagesError as e:  # a mean/std that does not fit the channels
            raise ConfigError(str(e)) from None

    def _preprocess(train: bool):
        return images_lib.Preprocess(
            image_size=cfg.image_size, channels=cfg.num_channels, train=train,
            crop=data_opts.train_crop, padding=data_opts.padding,
            crop_scale=data_opts.crop_scale, flip=data_opts.flip,
            mean=images_lib.parse_floats(data_opts.mean, "config.data.mean", cfg.num_channels),
            std=images_lib.parse_floats(data_opts.std, "config.data.std", cfg.num_channels,
                                        positive=True))

    shape = (1, cfg.image_size, cfg.image_size, cfg.num_channels)
    eval_transform = preprocess(train=False)
    _say_if_not_augmented(data_opts)  # once the settings are known to be good
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros(shape))["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=preprocess(train=data_opts.augment),
                eval_transform=eval_transform, classify=classify, label_images=label_images,
                save_assets=(lambda w: save_classes(w, classes)) if classes else None,
                class_names=tuple(classes) if classes else None,
                # PIL decodes without the GIL: in the trainer's process, threads decode in
                # parallel (bench images, 2-core host: 483 images/s with 16, 328 with 1);
                # with worker processes, one thread each did best (576 vs 482 with 16).
                read_threads=16 if config.train.data_workers == 0 else 1,
                **entries(cfg, eval_src, eval_transform, classes))


def _read_image(path: str, channels: int, eval_transform) -> np.ndarray:
    """An image file as the model reads an eval image: decoded (any mode to `channels`),
    the centre square resized, normalised. A file that is no readable image is a
    ValueError naming it."""
    from attention_jax.data import images as images_lib
    try:
        image = images_lib.decode(os.path.expanduser(path), channels=channels)
    except images_lib.BAD_IMAGE_ERRORS as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a readable image ({reason})") from None
    return eval_transform({"image": image, "label": 0}, np.random.default_rng(0))["image"]


def soft_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    """Mean cross-entropy against soft targets [B, C] (mixup/cutmix), smoothed toward the
    uniform distribution by ε as the hard-label loss is: q = (1-ε) targets + ε/C. Accuracy
    counts the argmax of the targets (the larger share of each mixed image)."""
    logits = logits.astype(jnp.float32)
    c = logits.shape[-1]
    q = (1.0 - label_smoothing) * targets + label_smoothing / c
    nll = -jnp.sum(q * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    correct = jnp.argmax(logits, -1) == jnp.argmax(targets, -1)
    return jnp.mean(nll), {"accuracy": jnp.mean(correct.astype(jnp.float32))}


def _check_image_options(o) -> None:
    from attention_jax.data import images as images_lib
    check_choice("config.data.train_crop", o.train_crop, images_lib.CROPS)
    check_choice("config.data.channels", o.channels, (0, 1, 3))
    for key, interval in (("image_size", "[0, inf)"), ("crop_scale", "(0, 1]"),
                          ("mixup", "[0, inf)"), ("cutmix", "[0, inf)"),
                          ("eval_fraction", "(0, 1)"), ("max_bad_records", "[0, inf)")):
        check_range(f"data.{key}", o[key], interval)
    check_source_keys(o, "image_folder", ("root", "eval_root"))
    if o.name == "image_folder" and not o.root:
        raise ConfigError("config.data.name='image_folder' needs --config.data.root=DIR (one "
                          "subfolder of images per class)")


def _image_sources(o, *, say_held_out: bool):
    """(train source, eval source, class names or None) of config.data; `say_held_out`:
    note a folder's held-out split that misses some class."""
    from attention_jax.data import images as images_lib
    if o.name == "image_folder":
        for key, valid in (("train_split", ("train",)), ("eval_split", ("validation", "test"))):
            check_choice(f"config.data.{key}", o[key], valid)  # 'test' names the held-out split too
        try:
            by_split, classes = images_lib.folder_splits(
                o.root, o.eval_root, eval_fraction=o.eval_fraction, channels=o.channels or 3,
                max_bad_records=o.max_bad_records, arg="config.data.",
                say_held_out=say_held_out)
        except images_lib.ImagesError as e:
            raise ConfigError(str(e)) from None
        return by_split["train"], by_split["validation"], classes
    train_src, eval_src = splits(o)
    try:  # a tfds ClassLabel's names, kept with the run like a folder's
        names = list(train_src.dataset_info.features["label"].names) or None
    except (AttributeError, KeyError, TypeError):
        names = None
    return train_src, eval_src, names


def _say_if_not_augmented(o) -> None:
    """A note where training crops or flips are asked for but data.augment is off (the
    digits configs turn it off): training read the eval crop, unsaid."""
    default = lambda k: " (the default)" if o[k] == IMAGE_KEYS.get(k) else ""  # noqa: E731
    asked = [f"{k}={o[k]!r}{default(k)}" for k, on in (
        ("train_crop", o.train_crop == "random_resized" or
         (o.name == "image_folder" and o.train_crop != "none")),
        ("flip", o.flip)) if on]
    if asked and not o.augment and not data_is_on_demand() and jax.process_index() == 0:
        print(f"note: config.data.augment=False: the training images are read as the eval "
              f"images are (the centre, resized), so {' and '.join(asked)} "
              f"{'do' if len(asked) > 1 else 'does'} nothing; "
              f"--config.data.augment=true applies them", file=sys.stderr)


def _held_out_folder(o, classes):
    from attention_jax.data import images as images_lib
    try:
        return images_lib.held_out_folder(o.eval_root, classes, channels=o.channels or 3,
                                          max_bad_records=o.max_bad_records, arg="config.data.")
    except images_lib.ImagesError as e:
        raise ConfigError(str(e)) from None


def _model_fields(config, o, config_cls, variants, train_src, classes) -> dict:
    """The model fields the data sets: image_size, num_channels, num_classes. A field
    also given in config.model must agree (else ConfigError naming both)."""
    given = config.model.to_dict()
    # The model's own values (class defaults, its variant, config.model), unvalidated:
    # a value the data replaces may be invalid on its own (8 px at patch 16).
    import dataclasses
    own = {f.name: f.default for f in dataclasses.fields(config_cls)}
    variant = given.get("variant")
    if variant and variant not in variants:  # before the data's checks read its defaults
        raise ConfigError(f"config.model.variant={variant!r} is unknown; valid: "
                          f"{sorted(variants)}{did_you_mean(variant, variants)}")
    own.update(variants.get(variant, {}))
    own.update({k: v for k, v in given.items() if k != "variant"})
    native = None
    if o.name != "image_folder" and (not o.image_size or not o.channels):
        try:  # a tfds set: its declared image shape (None where sizes vary)
            native = tuple(train_src.dataset_info.features["image"].shape)
        except (AttributeError, KeyError, TypeError):
            native = np.asarray(train_src[0]["image"]).shape
        if not o.image_size and not given.get("image_size") and (
                None in native[:2] or native[0] != native[1]):
            raise ConfigError(f"config.data.name={o.name!r} has images of shape {native} (not "
                              f"one square size); give --config.data.image_size=N")
    channels = o.channels or given.get("num_channels") or (
        3 if native is None else (native[-1] if len(native) == 3 else 1))
    size = o.image_size or given.get("image_size") or (own["image_size"] if native is None
                                                        else native[0])
    forced = {"image_size": int(size), "num_channels": int(channels)}
    if classes:
        forced["num_classes"] = len(classes)
    where = {"image_size": "config.data.image_size", "num_channels": "config.data.channels",
             "num_classes": f"the {len(classes or [])} classes of config.data.name={o.name!r}"}
    for field, value in forced.items():
        if field in given and given[field] != value:
            raise ConfigError(f"config.model.{field}={given[field]} but {where[field]} gives "
                              f"{value}; set one of them (the data sets the model's {field})")
    patch = own.get("patch_size")
    if patch and forced["image_size"] % patch:
        s = forced["image_size"]
        # The other way out: a patch size dividing s, which the shipped configs set
        # through the variant (they have no config.model.patch_size key).
        fits = sorted(v for v, f in variants.items() if s % f.get("patch_size", s + 1) == 0)
        other = (f"a config.model.patch_size dividing {s}" if "patch_size" in given else
                 f"a config.model.variant whose patch divides it: {fits}" if fits else
                 "another image size")
        raise ConfigError(f"config.data.image_size={s} is not a multiple of the ViT's "
                          f"patch_size={patch}; valid: {[patch * k for k in range(max(1, s // patch - 1), s // patch + 3)]}"
                          f", or {other}")
    if o.name == "image_folder" and not o.image_size and not given.get("image_size") \
            and not data_is_on_demand() and jax.process_index() == 0:
        # A folder's photos of any size trained at the model's own size (8 px for the
        # digits' vit-tiny variants) without a word: said (once, after the checks), with
        # the way to choose it.
        print(f"note: config.data.image_size=0: the images are resized to {int(size)}x"
              f"{int(size)}, the model's own size (variant {variant or 'default'}); set "
              f"--config.data.image_size=N for another", file=sys.stderr)
    return forced


def _vit_entries(cfg, eval_src, eval_transform, classes=None) -> dict:
    # Patches (+ [CLS]): the tokens an image is to the Transformer.
    tokens = cfg.grid_size ** 2 + (1 if cfg.pool == "cls" else 0)
    return dict(tokens_per_example=tokens,
                attention_input=_image_attention_input(cfg, eval_src, eval_transform, classes),
                flops_per_unit=lambda params: tokens * flops.flops_per_token(
                    flops.matmul_params(params), cfg.num_layers, tokens, cfg.d_model))


def _cnn_entries(cfg, eval_src, eval_transform, classes=None) -> dict:
    # The CNN's stride-1 convolutions run at every pixel of the image.
    return dict(flops_per_unit=lambda params: flops.conv_flops_per_example(
        params, cfg.image_size ** 2))


def _image_attention_input(cfg, source, transform, classes=None):
    """Task.attention_input of the ViT: eval image `index`, labelled by patch row,column."""
    def attention_input(params, text: str | None = None, *, target: str | None = None,
                        index: int = 0) -> AttentionInput:
        del params
        if text is not None or target is not None:
            raise ValueError("a text and a target are for text tasks; the ViT draws an eval "
                             "image: give its index (index=, or viz's --image-index)")
        if not 0 <= index < len(source):
            raise ValueError(f"image index {index} (index=, or viz's --image-index); valid: "
                             f"0..{len(source) - 1}, the eval split's images")
        example = transform(source[index], np.random.default_rng(0))
        side = cfg.grid_size
        labels = [f"{r},{c}" for r in range(side) for c in range(side)]  # row-major patches
        if cfg.pool == "cls":
            labels = ["[CLS]"] + labels
        return AttentionInput(inputs=(np.asarray(example["image"], np.float32)[None],),
                              labels={"self": (labels, labels)}, info={"tokens": labels},
                              title=f"eval image {index} (label {_label_name(example['label'], classes)})")
    return attention_input


def _label_name(label, classes) -> str:
    return f"{int(label)}: {classes[int(label)]}" if classes else str(int(label))


register("vit", image_task, provides=("classify", "label_images", "attention_input",
                                      "flops_per_unit", "tokens_per_example"),
         reads=(), model=vit.ViTConfig)
register("cnn", image_task, provides=("classify", "label_images", "flops_per_unit"),
         reads=(), model=cnn.CNNConfig)
