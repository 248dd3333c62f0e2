r"""Images/s of the training loader from JPEGs: `python -m attention_jax.tools.bench images`.

Writes --images JPEGs of --size (default 500 of 500×375, the typical ImageNet photo) in
10 class folders, then reads them as training does: `data.images.folder_splits` ->
`Preprocess` (decode, Inception random-resized crop to --image-size, flip, mean/std) ->
`loaders.Loader` batches of --batch, with 0, 1, 2 grain worker processes (--workers).
Each row: images/s of this one process after --warmup batches, over --batches batches
(the stream repeats the folder, so the page cache holds the files: decoding and the
crop are measured, not the disk).

The demand side, for how many workers a GPU needs: ViT-B/16 at 224² trains on
3 × 2 × (matmul params + attention) FLOPs per token (the PaLM convention of
models/flops.py) × 197 tokens ≈ 105 GFLOP per image, so at --mfu of an H100's 989 TFLOP/s
dense bf16 (NVIDIA's H100 SXM datasheet) a GPU consumes --mfu × 989e12 / 105e9 images/s
(≈ 3,770 at 40%). That figure is computed, not measured here: no GPU on this machine.
The pixels are smooth gradients plus noise, so the files are about the size of photos'
(tens of kB), not of pure noise.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import time

# ViT-B/16 at 224²: 196 patches + [CLS]; D 768, 12 layers, MLP 3072 (Dosovitskiy et al. 2020).
_TOKENS, _D, _LAYERS, _MLP = 197, 768, 12, 3072


def vit_b16_train_flops_per_image() -> float:
    """Training FLOPs of one 224² image through ViT-B/16, the PaLM count of models/flops.py
    over its matmul weights (attention's four D×D, the MLP's two D×F per layer)."""
    from attention_jax.models import flops
    matmul_params = _LAYERS * (4 * _D * _D + 2 * _D * _MLP)
    return flops.flops_per_token(matmul_params, _LAYERS, _TOKENS, _D) * _TOKENS


def write_jpegs(root: str, count: int, width: int, height: int, classes: int = 10,
                seed: int = 0) -> int:
    """`count` JPEGs in `classes` folders under root; returns their total bytes."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    total = 0
    for i in range(count):
        folder = os.path.join(root, f"class{i % classes:02d}")
        os.makedirs(folder, exist_ok=True)
        a, b, c = rng.uniform(0, 6.28, 3)
        base = np.stack([np.sin(xx / (40 + 30 * a) + b), np.cos(yy / (35 + 25 * b) + c),
                         np.sin((xx + yy) / (50 + 20 * c) + a)], -1)
        pixels = np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255)
        path = os.path.join(folder, f"{i:05d}.jpg")
        Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
        total += os.path.getsize(path)
    return total


def _rate(source, transform, batch: int, workers: int, warmup: int, batches: int) -> float:
    from attention_jax.data.loaders import Loader
    loader = Loader(source, global_batch_size=batch, seed=0, transform=transform,
                    process_index=0, process_count=1, worker_count=workers,
                    read_threads=16 if workers == 0 else 1)  # as the image tasks read
    it = iter(loader)
    for _ in range(warmup):  # worker start-up and the first reads
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t
    it.close()
    return batches * batch / seconds


def run(args) -> dict:
    import platform

    from attention_jax.data import images as images_lib
    root = args.dir or tempfile.mkdtemp(prefix="bench_images_")
    if not args.dir:  # at exit, after the loaders' read-ahead threads (still reading) end
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    nbytes = write_jpegs(root, args.images, *args.size)
    splits, classes = images_lib.folder_splits(root, eval_fraction=0.01)
    imagenet = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    transform = images_lib.Preprocess(args.image_size, train=True, crop="random_resized",
                                      flip=True, **imagenet)
    rows = [{"workers": w, "images_per_s": _rate(splits["train"], transform, args.batch, w,
                                                 args.warmup, args.batches)}
            for w in args.workers]
    from attention_jax.tools.bench.data_speed import _machine
    from attention_jax.tools.bench.train_speed_gpu import H100_BF16_PEAK
    need = args.mfu * H100_BF16_PEAK / vit_b16_train_flops_per_image()
    out = {"machine": f"{_machine()} ({platform.machine()})",
           "images": args.images, "size": list(args.size), "mean_jpeg_kb": nbytes / args.images / 1e3,
           "image_size": args.image_size, "batch": args.batch, "rows": rows,
           "vit_b16_gflop_per_image": vit_b16_train_flops_per_image() / 1e9,
           "h100_images_per_s_at_mfu": need, "mfu": args.mfu}
    print(f"{args.images} JPEGs of {args.size[0]}×{args.size[1]} (mean "
          f"{out['mean_jpeg_kb']:.0f} kB) -> {args.image_size}² random-resized crop, flip, "
          f"mean/std; batch {args.batch}; one process on {out['machine']}")
    print("| grain workers | images/s | H100s fed (ViT-B/16) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['images_per_s']:,.0f} | {r['images_per_s'] / need:.2f} |")
    print(f"ViT-B/16 training at 224²: {out['vit_b16_gflop_per_image']:.0f} GFLOP per image; an "
          f"H100 at {args.mfu:.0%} MFU of 989 TFLOP/s takes {need:,.0f} images/s (computed, "
          f"not measured). One core here decodes {_per_worker(rows):,.0f} images/s, "
          f"so one H100 needs about {math.ceil(need / max(1.0, _per_worker(rows)))} decoding "
          f"workers (cores) of this kind.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _per_worker(rows) -> float:
    """Images/s one core decodes: the best rate over the cores it could use (a worker
    row: one per worker; the 0-worker row reads with 16 threads in the calling process,
    which PIL's decoding, free of the GIL, spreads over every core)."""
    cores = os.cpu_count() or 1
    return max(r["images_per_s"] / (min(r["workers"], cores) or cores) for r in rows)


def add_parser(sub) -> None:
    """Registers `images` on the bench command's subcommand parser."""
    p = sub.add_parser("images", help="images/s of the training loader from JPEGs, by workers")
    p.add_argument("--images", type=int, default=500, help="JPEGs to write")
    p.add_argument("--size", type=int, nargs=2, default=(500, 375), metavar=("W", "H"),
                   help="their width and height")
    p.add_argument("--image-size", type=int, default=224, help="the crop's side")
    p.add_argument("--batch", type=int, default=32, help="loader batch (one process)")
    p.add_argument("--workers", type=int, nargs="+", default=(0, 1, 2),
                   help="grain worker processes, one row each")
    p.add_argument("--warmup", type=int, default=3, help="batches read before timing")
    p.add_argument("--batches", type=int, default=30, help="batches timed")
    p.add_argument("--mfu", type=float, default=0.4,
                   help="model FLOPs utilisation assumed for the H100 row")
    p.add_argument("--dir", default="", help="where to write the JPEGs (default: a temporary folder)")
    p.add_argument("--json", "--out", dest="json", default="",
                   help="also write the numbers to this file")
