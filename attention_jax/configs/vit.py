r"""ViT (Dosovitskiy et al. 2020) on scikit-learn's 8×8 handwritten digits (offline).

Command (2-core CPU, default sizes):
  python -m attention_jax.main --config=vit --workdir=/tmp/vit
Variants: `--config=vit:variant=vit-tiny/4` (4×4 patches: 4 tokens
instead of 16). 1,438 training / 359 test images, 10 classes.
Your own images at any resolution (the README's "Your own images"):
  python -m attention_jax.main --config=vit --workdir=/tmp/pets \
      --config.data.name=image_folder --config.data.root=DIR --config.data.image_size=32
Fine-tune a Hugging Face ViT (a transformers save_pretrained dir) at that resolution, its
position table resized to the new patch grid: `--config=vit:hf=HF_DIR` (same overrides).

Measured (2-core CPU): 600 steps in 30 s wall, test accuracy 87.5% (loss 0.42).
"""

import ml_collections

from attention_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, variant="", hf="")  # variant "": vit-tiny/2, or hf's
    if args.hf and args.variant:  # the checkpoint's architecture would win, unsaid
        raise config_lib.ConfigError(f":hf={args.hf!r} and :variant={args.variant!r}: hf= trains "
                                     f"the checkpoint's own architecture; give one of the two")
    c = config_lib.base_config()
    c.task = "vit"  # image classification (tasks.image_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).

    # models/vit.py VARIANTS (:variant=; the default vit-tiny/2 has 2×2 patches).
    c.model.variant = args.variant or "vit-tiny/2"
    c.model.pool = "cls"  # classify the [CLS] token ("gap": average the patch tokens).
    c.model.dropout_rate = 0.0  # measured on vit-tiny/2: dropout only slowed it down.
    c.model.remat_policy = "none"  # activation checkpointing per block.
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".
    if args.hf:  # fine-tune a Hugging Face ViT: its architecture, its weights (train.init_from)
        import os

        from attention_jax import convert
        args.hf = os.path.expanduser(args.hf)
        try:
            implied = convert.hf_model_overrides(args.hf)
            arch = convert.config_from_hf(args.hf)[1]
            if not arch.startswith("ViT"):  # (its fields were then "not a field of ViTConfig")
                raise ValueError(f"it holds a {arch}; valid: a ViT checkpoint (ViTModel, "
                                 f"ViTForImageClassification)")
        except (OSError, ValueError) as e:
            raise config_lib.ConfigError(f"hf={args.hf!r}: {e}") from None
        c.model = ml_collections.ConfigDict({**implied,
                                             "implementation": "auto", "remat_policy": "none",
                                             "dropout_rate": 0.0})
        c.train.init_from = f"hf:{args.hf}"

    c.data.name = "digits"  # sklearn's digits as a tfds builder.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    # Training crops and flips (data.train_crop, data.flip) on or off. Off: a 1-pixel
    # random crop is a big shift on 8×8 digits, and it hurt (35% against 78%).
    c.data.augment = False
    c.data.padding = 1  # crop padding in pixels.
    c.data.flip = False  # mirroring changes what a digit is.
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "test"  # the split evaluated (image_folder: the held-out images).
    # Your own images and the preprocessing (config.IMAGE_KEYS): e.g. --config.data.name=
    # image_folder --config.data.root=DIR --config.data.image_size=32 (README, "Your own images").
    config_lib.add_image_keys(c.data)

    c.optim.lr = 2e-3
    c.optim.warmup_steps = 50
    c.optim.b2 = 0.999  # small data: the classic Adam value.
    c.optim.weight_decay = 0.05
    c.optim.label_smoothing = 0.0  # Szegedy et al. 2016; off: the model underfits anyway.

    c.train.steps = 600  # ~13 epochs of 1,438 images.
    c.train.batch_size = 32
    c.train.log_every = 20
    c.train.checkpoint_every = 300

    c.mesh.data = -1  # all devices data-parallel.

    c.eval.every = 200  # test accuracy.
    c.eval.steps = 0  # the whole test split.
    c.eval.batch_size = 32
    return c
