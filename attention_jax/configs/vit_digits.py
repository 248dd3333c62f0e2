r"""ViT on scikit-learn's 8×8 digits: the accuracy target, [CLS] vs average pooling, and
the patch-size trade-off (Dosovitskiy et al. 2020 §3.1 and Fig. 4: smaller patches mean
more tokens, more compute, and usually better accuracy).

A wider, deeper ViT than configs/vit.py (width 64, 4 layers, 4 heads), trained
longer. Arguments: `pool=cls|gap` and `patch=1|2|4|8` (8×8 images: 64, 16, 4 or 1
patch tokens, plus [CLS] when pool=cls; default 4).

Command (2-core CPU): the default run (4×4 patches, [CLS]), then the sweeps and their
tables and plot (analysis.py evaluates every one of the 359 test images):
  python -m attention_jax.main --config=vit_digits --workdir=/tmp/vitd/cls-p4
  for p in 1 2 8; do python -m attention_jax.main \
      --config=vit_digits:patch=$p --workdir=/tmp/vitd/cls-p$p; done
  python -m attention_jax.main --config=vit_digits:pool=gap,patch=2 \
      --workdir=/tmp/vitd/gap-p2
  python -m attention_jax.tools.analysis runs --out=docs/results/vit_patches --x=tokens \
      p1=/tmp/vitd/cls-p1 p2=/tmp/vitd/cls-p2 p4=/tmp/vitd/cls-p4 p8=/tmp/vitd/cls-p8
  python -m attention_jax.tools.analysis runs --out=docs/results/vit_pool \
      cls=/tmp/vitd/cls-p2 gap=/tmp/vitd/gap-p2

Measured (2-core AMD EPYC, 2026-11-27): the default (patch 4, 5 tokens) reaches 98.3%
test accuracy (all 359 images) in 17 s wall, 2000 steps. Patch 8 / 2 / 1 (2 / 17 / 65
tokens): 97.2% in 18 s / 96.4% in 28 s / 79.1% in 84 s; at patch 2, average pooling
95.5% vs [CLS] 96.4%. On 8×8 images one-pixel tokens (a 1-d patch embedding) train
worst and slowest: the lectures' "more tokens, more accuracy" needs patches that carry
some structure. Tables: README ("ViT on 8×8 digits"), docs/results/vit_patches.md.
"""

import ml_collections

from attention_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, patch=4, pool="cls", steps=2000)
    c = config_lib.base_config()
    c.task = "vit"  # image classification (tasks.image_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).

    c.model.variant = "vit-tiny/2"  # models/vit.py VARIANTS: 8×8 grey images, 10 classes.
    c.model.patch_size = args.patch  # 1 | 2 | 4 | 8 pixels per patch side.
    c.model.pool = args.pool  # cls: the [CLS] token; gap: mean of patch tokens.
    c.model.d_model = 64  # D.
    c.model.num_layers = 4
    c.model.num_heads = 4  # head dim 16.
    c.model.mlp_dim = 128  # F = 2D: tiny data, a narrower MLP trains as well.
    c.model.dropout_rate = 0.0
    c.model.remat_policy = "none"
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".

    c.data.name = "digits"  # 1,438 training and 359 test images.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    # Training crops and flips (data.train_crop, data.flip) on or off. Off: a random
    # 1-pixel shift is large on 8×8 digits (configs/vit.py).
    c.data.augment = False
    c.data.padding = 1  # crop padding in pixels (train_crop="random").
    c.data.flip = False  # mirroring changes what a digit is.
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "test"  # the split evaluated (image_folder: the held-out images).
    # Your own images and the preprocessing (config.IMAGE_KEYS): e.g. --config.data.name=
    # image_folder --config.data.root=DIR --config.data.image_size=32 (README, "Your own images").
    config_lib.add_image_keys(c.data)

    c.optim.lr = 2e-3
    c.optim.warmup_steps = 100
    c.optim.b2 = 0.999  # small data: the classic Adam value.
    c.optim.weight_decay = 0.05
    c.optim.label_smoothing = 0.1  # regularises the 1.4k-image training set.

    c.train.steps = args.steps  # :steps= (2000: ~45 epochs at batch 32).
    c.train.batch_size = 32
    c.train.log_every = 50
    c.train.checkpoint_every = 1000

    c.mesh.data = -1

    c.eval.every = 500  # test accuracy.
    c.eval.steps = 0  # the whole test split.
    c.eval.batch_size = 40  # 8 full batches and one of 39 (padded, the padding weighted 0).
    return c
