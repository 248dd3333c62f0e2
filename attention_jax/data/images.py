"""Your own images: a folder of class subfolders as a random-access source, and the
standard preprocessing for it and for any prepared tfds image set.

  splits, classes = folder_splits('~/pets', eval_fraction=0.1)   # ImageNet layout
  splits['train'][0]          # {'image': uint8 [H, W, 3] of the file's own size, 'label': 2}
  prep = Preprocess(image_size=224, train=True, crop='random_resized', flip=True)
  prep(splits['train'][0], np.random.default_rng(0))['image'].shape   # (224, 224, 3)

From the command line: `--config.data.name=image_folder --config.data.root=DIR`.

Layout: root/<class>/**/<image>; class names are the sorted subfolder names, label i
the i-th. Files ending .jpg .jpeg .png .webp .bmp .gif .tif .tiff (any case) are images;
others are left out, and a note says how many.
Any size and mode: grey, grey+alpha, RGBA, palette and 16-bit grey are converted to RGB
(or to grey with channels=1); alpha is dropped (not composited).

Splits 'train' and 'validation'. With `eval_root` (the same class folders, or some of
them: said), train is root and validation eval_root. Without, an image goes to
validation when a stable hash of its path relative to root falls below `eval_fraction`:
the same image always lands on the same side, whatever else the folder holds, and moving
the folder keeps the splits.

Laziness: start-up lists the file names and nothing else; `src[i]` opens and decodes one
file. A file that cannot be decoded (corrupt, truncated, not an image) is skipped with a
counted warning on stderr and the next image of the split stands in for it (a function of
the index only, so resumption stays exact; in the held-out split it carries
loaders.STAND_IN, so an evaluation weighs it 0: its `examples` count the images read);
past `max_bad_records` distinct bad files it is an error. The count is kept in each
reading process (grain workers each count theirs). Every other bad input (a root that
does not exist, no class folders, a class with no images, eval_root with a class the
training has not) is an ImagesError, one line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from attention_jax.data.files import held_out, say_once, stable_hash64
from attention_jax.data.loaders import STAND_IN
from attention_jax.errors import UserError

SUFFIXES = ('.jpg', '.jpeg', '.png', '.webp', '.bmp', '.gif', '.tif', '.tiff')  # PIL reads them
SPLITS = ('train', 'validation')
CROPS = ('none', 'random', 'random_resized')


def _bad_image_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image
    # PIL's errors for a file that is no readable image: OSError (truncated, unknown
    # format), ValueError and SyntaxError (bad headers), and an image too large to
    # decompress safely (DecompressionBombError, a plain Exception).
    return (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


BAD_IMAGE_ERRORS = _bad_image_errors()


class ImagesError(UserError, ValueError):
    """A bad image folder, a bad preprocessing option, or too many undecodable files."""


# ================================================================================= listing
# Folder names of splits, not classes (case-insensitive).
SPLIT_NAMES = ('train', 'training', 'val', 'valid', 'validation', 'test', 'eval', 'dev')


def list_classes(root: str, arg: str = 'root') -> tuple[list[str], list[list[str]]]:
    """(sorted class names, per class the sorted image paths relative to root)."""
    from attention_jax.data.files import refuse_url
    refuse_url(os.fspath(root), arg, 'images', ImagesError)
    root = os.path.expanduser(os.fspath(root))
    if not os.path.isdir(root):
        # The setting as the user gives it: a command-line flag, else the argument.
        flag = f'--{arg}' if arg.startswith('config.') else arg
        what = ('is a file, not a folder' if os.path.exists(root) else
                f'does not exist (moved? give its new place, {flag}=DIR)')
        raise ImagesError(f'{arg}={root!r} {what}; valid: a folder with one subfolder of '
                          f'images per class (root/<class>/<image>.jpg)')
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith('.'))
    if not classes:
        raise ImagesError(f'{arg}={root!r} has no class subfolders; valid: one subfolder of '
                          f'images per class (root/<class>/<image>.jpg)')
    # ImageNet's own folder has train/ and val/ at the top: taken as two classes, the
    # model would learn which split an image is in, with nothing said. (Only when every
    # folder is a split's, holding folders: a class may be called "train".)
    splits = [c for c in classes if c.lower() in SPLIT_NAMES and any(
        e.is_dir() and not e.name.startswith('.') for e in os.scandir(os.path.join(root, c)))]
    if splits and len(splits) == len(classes):
        # The training split for root (by its name's place in SPLIT_NAMES: train/ before
        # eval/, not the first alphabetically), the next for eval_root.
        splits.sort(key=lambda c: SPLIT_NAMES.index(c.lower()))
        first = os.path.join(root, splits[0])
        other = next((os.path.join(root, c) for c in splits[1:]), '')
        if arg.endswith('eval_root') or not arg.endswith('root'):
            # An eval_root's (or another argument's) split: the held-out one, no pair.
            first = (other or first) if arg.endswith('eval_root') else first
            other = ''
        raise ImagesError(
            f'{arg}={root!r} holds split folders ({", ".join(s + "/" for s in splits)}) with '
            f'class folders inside, not class folders: point {arg} at {first!r}'
            + (f' and {arg.replace("root", "eval_root")} at {other!r}' if other else '')
            + ' (root/<class>/<image>.jpg)')
    # Linked folders and images are followed (a class may live elsewhere), each real
    # image read once: a link back up (`up -> ..`) walked root again and put the other
    # classes' images in this class, dozens of times over. An image reached both directly
    # and through a link keeps its direct place (and class); the links are said.
    tops = {os.path.realpath(p) for p in [root] + [os.path.join(root, c) for c in classes]}
    others, links, entries = [], [], {}  # entries: real path -> (linked?, class, rel path)
    for k, name in enumerate(classes):
        walked = set()
        # Folders to read: (path under root, real path, reached through a link?). A real
        # path is the folder's joined with a name, resolved only for a link (resolving
        # every image was an lstat per part of its path: the listing took 9x as long).
        todo = [(name, os.path.realpath(os.path.join(root, name)), False)]
        while todo:
            rel_top, real_top, linked = todo.pop()
            try:
                listing = sorted(os.scandir(os.path.join(root, rel_top)), key=lambda e: e.name)
            except OSError:  # unreadable: skipped, as os.walk does
                continue
            for e in listing:
                if e.name.startswith('.'):
                    continue
                rel, link = os.path.join(rel_top, e.name), e.is_symlink()
                real = os.path.realpath(e.path) if link else os.path.join(real_top, e.name)
                if e.is_dir():
                    if real in tops or real in walked:  # a loop, or another class's folder
                        links.append(rel + os.sep)
                    else:
                        walked.add(real)
                        todo.append((rel, real, linked or link))
                elif not e.name.lower().endswith(SUFFIXES):
                    others.append(rel)
                else:
                    entry = (linked or link, k, rel)
                    if real in entries:
                        links.append(max(entry, entries[real])[2])
                        entry = min(entry, entries[real])
                    entries[real] = entry
    files = [[] for _ in classes]
    for _, k, rel in entries.values():
        files[k].append(rel)
    for name, found in zip(classes, files):
        if not found:
            raise ImagesError(f'{arg}={root!r}: class folder {name!r} has no images '
                              f'({", ".join(SUFFIXES)}); remove it or add images')
        found.sort()
    loose = sorted(e.name for e in os.scandir(root) if not e.name.startswith('.')
                   and not e.is_dir())
    for noun, what, names in (
            ('file', f'without an image suffix ({", ".join(SUFFIXES)})', others),
            ('file', 'beside the class folders, in none,', loose),
            ('path', 'to a folder or image already read (a link)', links)):
        if names:  # said, not dropped in silence
            shown = ', '.join(sorted(names)[:3]) + (', ...' if len(names) > 3 else '')
            print(f'note: {arg}={root!r}: {len(names)} {noun}{"s" if len(names) > 1 else ""} '
                  f'{what} left out: {shown}', file=sys.stderr)
    return classes, files


# ================================================================================ decoding
def decode(path: str, channels: int = 3) -> np.ndarray:
    """The image file at `path` as uint8 [H, W, channels] (channels 1 or 3). Raises
    OSError/ValueError (PIL's) for a file that is not a readable image."""
    from PIL import Image
    with Image.open(path) as img:
        img.load()  # decode now: a truncated file fails here, not later
        if img.mode in ('I', 'I;16', 'I;16B', 'I;16L', 'F'):
            # 16-bit or float grey: scale to 8 bits by the mode's range; float images in
            # [0, 1] by that range (scaled as 0..255 they read black).
            x = np.asarray(img, np.float32)
            if img.mode == 'F':  # no range in the file: each image by its own values, said
                say_once('float-images', f'note: {path} is a float image: one with values in '
                         f'[0, 1] is read as that range, others as 0..255 (each image by its '
                         f'own values); said once for all such images')
            if img.mode == 'F' and x.size and 0.0 <= x.min() and x.max() <= 1.0:
                top = 1.0
            else:
                top = 65535.0 if img.mode.startswith('I;16') or x.max() > 255 else 255.0
            if top == 65535.0 and x.size and 0 < x.max() < 4096:
                say_once(
                    'low-range-16-bit', f'note: {path} is a 16-bit image whose values stay '
                    f'below 4096 (12-bit data?): scaled from the 16-bit range to 8 bits it '
                    f'reads dark (at most {x.max() / 65535 * 255:.0f} of 255); said once for '
                    f'all such images')
            img = Image.fromarray(np.clip(x / top * 255.0 + 0.5, 0, 255).astype(np.uint8))
        if img.mode == 'P':  # palette (maybe with transparency): through RGBA
            img = img.convert('RGBA')
        if channels == 1 and img.mode in ('LAB', 'HSV'):
            # PIL converts these to RGB only: straight to grey was a ValueError, and the
            # image was skipped as undecodable (it reads as RGB with channels=3).
            img = img.convert('RGB')
        img = img.convert('L' if channels == 1 else 'RGB')
        x = np.asarray(img, np.uint8)
    return x[..., None] if x.ndim == 2 else x


class _BadImages:
    """Distinct undecodable files seen by this process; over `limit` is an error."""

    def __init__(self, limit: int, arg: str, held_out: bool = False):
        self.limit, self.arg, self.seen, self.held_out = limit, arg, set(), held_out

    def skip(self, path: str, why: str) -> None:
        if path in self.seen:
            return
        self.seen.add(path)
        if len(self.seen) > self.limit:
            raise ImagesError(f'{path}: {why}; that is {len(self.seen)} bad images, more than '
                              f'{self.arg}max_bad_records={self.limit}: fix or remove them, or '
                              f'raise it')
        print(f'warning: {path}: cannot be decoded ({why}); skipped, the next image stands in'
              + (' (weighted 0: the eval leaves it out)' if self.held_out else '')
              + f' (bad image {len(self.seen)}, at most {self.limit})', file=sys.stderr,
              flush=True)


class ImageFiles:
    """The images of one split: `len`, `[i]` -> {'image': uint8 [H, W, C], 'label': int32}
    (held_out: and STAND_IN, whether the next image stood in for an undecodable one)."""

    def __init__(self, root: str, paths: Sequence[str], labels: Sequence[int], classes: Sequence[str],
                 *, channels: int = 3, max_bad_records: int = 100, arg: str = '',
                 held_out: bool = False):
        self.root, self.classes, self.channels = root, list(classes), channels
        self.paths = np.asarray(paths, dtype=object)
        self.labels = np.asarray(labels, np.int32)
        self.held_out = held_out
        self._bad = _BadImages(max_bad_records, arg, held_out)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i) -> dict[str, np.ndarray]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f'image {i} of a split of {len(self)}')
        for k in range(len(self)):  # the first good image from i on, cyclically
            j = (i + k) % len(self)
            path = os.path.join(self.root, self.paths[j])
            try:
                image = decode(path, self.channels)
            except BAD_IMAGE_ERRORS as e:
                self._bad.skip(path, f'{type(e).__name__}: {e}')
                continue
            example = {'image': image, 'label': self.labels[j]}
            return {**example, STAND_IN: np.bool_(k > 0)} if self.held_out else example
        raise ImagesError(f'{self.root}: none of the {len(self)} images of this split can be decoded')


# ================================================================================== splits
def folder_splits(root: str, eval_root: str = '', *, eval_fraction: float = 0.05,
                  channels: int = 3, max_bad_records: int = 100, arg: str = '',
                  say_held_out: bool = True) -> tuple[dict[str, ImageFiles], list[str]]:
    """({'train': ..., 'validation': ...}, class names) of an image folder (module
    docstring). `arg` prefixes the argument names in messages ('config.data.').
    `say_held_out`: note a held-out split that misses some class (off where nothing is
    evaluated, or on every host but the first of a run)."""
    if not 0 < eval_fraction < 1:
        raise ImagesError(f'{arg}eval_fraction={eval_fraction!r} is out of range; valid: '
                          f'0 < eval_fraction < 1')
    if max_bad_records < 0:
        raise ImagesError(f'{arg}max_bad_records={max_bad_records!r} is out of range; valid: >= 0')
    if channels not in (1, 3):
        raise ImagesError(f'{arg}channels={channels!r} is unknown; valid: 1 (grey) or 3 (RGB)')
    root = os.path.expanduser(os.fspath(root))
    classes, files = list_classes(root, f'{arg}root')
    if len(classes) == 1:  # it would train to loss 0 and accuracy 1, learning nothing
        raise ImagesError(f'{arg}root={root!r} has one class folder ({classes[0]!r}): a '
                          f'classifier needs at least 2; valid: one subfolder of images per class')
    paths = [p for group in files for p in group]
    labels = [c for c, group in enumerate(files) for _ in group]
    make = lambda top, p, l, held=False: ImageFiles(  # noqa: E731
        top, p, l, classes, channels=channels, max_bad_records=max_bad_records, arg=arg,
        held_out=held)
    if eval_root:
        eval_root = os.path.expanduser(os.fspath(eval_root))
        if os.path.realpath(eval_root) == os.path.realpath(root):
            raise ImagesError(f'{arg}eval_root={eval_root!r} is {arg}root itself: an image must '
                              f'not be both trained and evaluated on')
        return ({'train': make(root, paths, labels),
                 'validation': held_out_folder(eval_root, classes, channels=channels,
                                               max_bad_records=max_bad_records, arg=arg)},
                classes)
    if len(paths) < 2:
        raise ImagesError(f'{arg}root={root!r} holds one image; a held-out split needs two or '
                          f'more, or give {arg}eval_root')
    # By a hash of the relative path, as the files source splits documents.
    held = held_out([stable_hash64(p.replace(os.sep, '/')) for p in paths], eval_fraction,
                    'images', f'{arg}eval_fraction', f'{arg}eval_root')
    pick = lambda mask: ([paths[i] for i in np.flatnonzero(mask)],
                         [labels[i] for i in np.flatnonzero(mask)])
    if say_held_out:
        _say_classes_not_held_out(pick(held)[1], classes, eval_fraction, len(paths), arg)
    return ({'train': make(root, *pick(~held)), 'validation': make(root, *pick(held), True)},
            classes)


def _some(names) -> str:
    """The first three names, quoted, and '...' for more: a note's list of classes."""
    return ', '.join(map(repr, names[:3])) + (', ...' if len(names) > 3 else '')


def _say_classes_not_held_out(held_labels, classes, eval_fraction, total: int, arg: str) -> None:
    """A note where eval_fraction of a small folder held out no image of some class: the
    eval accuracy then says nothing of those classes, unsaid (the record's `examples`
    count shows how few were evaluated, not which classes)."""
    held = set(held_labels)
    missing = [c for i, c in enumerate(classes) if i not in held]
    if missing:
        shown = _some(missing)
        print(f'note: {arg}eval_fraction={eval_fraction} of {total} images held out '
              f'{len(held_labels)}, of {len(classes) - len(missing)} of the {len(classes)} '
              f'classes (none of {shown}): the eval metrics leave those out; give a larger '
              f'{arg}eval_fraction, or held-out images of every class in {arg}eval_root',
              file=sys.stderr)


def held_out_folder(eval_root: str, classes: Sequence[str], *, channels: int = 3,
                    max_bad_records: int = 100, arg: str = '') -> ImageFiles:
    """Every image of `eval_root`, a held-out folder whose class folders are `classes`
    (the training folder's, or a trained run's classes.json) or some of them (a test set
    of a few classes; said): one split, its labels the training classes' indices, listed
    without the training folder."""
    eval_root = os.path.expanduser(os.fspath(eval_root))
    eval_classes, eval_files = list_classes(eval_root, f'{arg}eval_root')
    unknown = sorted(set(eval_classes) - set(classes))
    if unknown:
        raise ImagesError(f'{arg}eval_root={eval_root!r} has class folders the training has '
                          f'not: {unknown[:5]}; valid: folders named as {arg}root\'s classes '
                          f'{list(classes)[:8]}' + (' ...' if len(classes) > 8 else ''))
    missing = [c for c in classes if c not in eval_classes]
    if missing:
        shown = _some(missing)
        print(f'note: {arg}eval_root={eval_root!r} holds {len(eval_classes)} of the '
              f'{len(classes)} classes (none of {shown}): the eval metrics leave those out',
              file=sys.stderr)
    index = {name: i for i, name in enumerate(classes)}
    return ImageFiles(eval_root, [p for g in eval_files for p in g],
                      [index[name] for name, g in zip(eval_classes, eval_files) for _ in g],
                      classes, channels=channels, max_bad_records=max_bad_records, arg=arg,
                      held_out=True)


def get_split(split: str, **options) -> ImageFiles:
    """One split of `folder_splits(**options)`: 'train' or 'validation'."""
    if split not in SPLITS:
        raise ImagesError(f'the image_folder source has no split {split!r}; valid: {list(SPLITS)}')
    return folder_splits(**options)[0][split]


# =========================================================================== preprocessing
def parse_floats(value, name: str, channels: int, positive: bool = False) -> tuple[float, ...]:
    """'0.5' or 0.5 -> (0.5,) * channels; '0.485,0.456,0.406' -> per channel. positive:
    each must be > 0 (a std: 0 divides by zero, a negative one flips the image)."""
    try:
        values = tuple(float(v) for v in str(value).split(',') if v.strip())
    except ValueError:
        values = ()
    if len(values) == 1:
        values = values * channels
    if len(values) != channels or not all(np.isfinite(values)):
        raise ImagesError(f'{name}={value!r} must be one number or {channels} comma-separated '
                          f'numbers (one per channel), e.g. 0.5 or 0.485,0.456,0.406')
    if positive and min(values) <= 0:
        raise ImagesError(f'{name}={value!r}: each must be > 0 (the image is divided by it); '
                          f'valid: e.g. 0.5 or 0.229,0.224,0.225')
    return values


def _pil(image: np.ndarray):
    from PIL import Image
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ImagesError(f'images must be uint8 [H, W, C]; got {image.dtype} {image.shape}')
    return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


def _to_channels(image: np.ndarray, channels: int) -> np.ndarray:
    if image.ndim == 2:
        image = image[..., None]
    have = image.shape[-1]
    if have == channels:
        return image
    if have == 2:  # grey and alpha: the alpha dropped, as RGBA's is
        image = image[..., :1]
        return image if channels == 1 else np.repeat(image, channels, axis=-1)
    if have == 1:
        return np.repeat(image, channels, axis=-1)
    if have == 4:
        image = image[..., :3]
    elif have != 3:
        raise ImagesError(f'an image of shape {image.shape}: {have} channels; valid: 1 (grey), '
                          f'2 (grey and alpha), 3 (RGB) or 4 (RGBA)')
    if channels == 1:
        return np.asarray(_pil(np.ascontiguousarray(image)).convert('L'))[..., None]
    return image


def resize_box(image: np.ndarray, box: tuple[float, float, float, float], size: int) -> np.ndarray:
    """The region box=(left, top, right, bottom) of image (pixels) resized to size×size,
    bilinear (PIL's, which widens the filter when shrinking, i.e. antialiased)."""
    from PIL import Image
    c = image.shape[-1]
    h, w = image.shape[:2]
    if box == (0, 0, w, h) and (h, w) == (size, size):
        return image
    out = np.asarray(_pil(image).resize((size, size), Image.BILINEAR, box=box))
    return out[..., None] if c == 1 else out


def resize_centre(image: np.ndarray, size: int) -> np.ndarray:
    """The image's shorter side resized to `size` (the longer in proportion, rounded
    down), bilinear as resize_box, then the centred size×size square cut (its offsets
    rounded down). These are the steps and roundings of transformers' processors with a
    shortest_edge size and a centre crop (CLIPImageProcessor), so that a ViT exported
    with the run's preprocessing (convert/hf_files.py) reads any image into the run's
    pixels."""
    from PIL import Image
    h, w = image.shape[:2]
    if (h, w) == (size, size):
        return image
    nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    out = np.asarray(_pil(image).resize((nw, nh), Image.BILINEAR))
    top, left = (nh - size) // 2, (nw - size) // 2
    out = out[top:top + size, left:left + size]
    return out[..., None] if image.shape[-1] == 1 and out.ndim == 2 else out


def random_resized_box(h: int, w: int, rng: np.random.Generator, scale=(0.08, 1.0),
                       ratio=(3 / 4, 4 / 3), attempts: int = 10) -> tuple[float, float, float, float]:
    """An Inception-style crop box (Szegedy et al. 2015, §6): area a fraction in `scale`
    of the image's, aspect ratio log-uniform in `ratio`; drawn until it fits, else the
    centre crop of the ratio range's nearest end."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(attempts):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if 0 < cw <= w and 0 < ch <= h:
            left, top = rng.uniform(0, w - cw), rng.uniform(0, h - ch)
            return (left, top, left + cw, top + ch)
    aspect = min(max(w / h, ratio[0]), ratio[1])  # fallback: clamp the image's own ratio
    cw, ch = (w, w / aspect) if w / h <= aspect else (h * aspect, h)
    left, top = (w - cw) / 2, (h - ch) / 2
    return (left, top, left + cw, top + ch)


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """Image record -> {'image': float32 [S, S, C] normalised, 'label': int32}.

    Eval (train=False) and crop='none': the shorter side resized to S and the centre
    square cut (resize_centre; an image already S×S is untouched). Training crops: 'random' pads by
    `padding` and crops back at a random offset after the eval resize (the CIFAR recipe);
    'random_resized' draws an Inception crop of the original (area fraction in
    [crop_scale, 1], ratio in [3/4, 4/3]) and resizes it to S×S. flip: mirror left-right
    with probability 1/2 (training only). Then (x/255 - mean) / std per channel.
    A frozen dataclass of plain values: it pickles into grain's worker processes.
    """
    image_size: int
    channels: int = 3
    train: bool = False
    crop: str = 'none'
    padding: int = 0
    crop_scale: float = 0.08
    flip: bool = False
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    image_key: str = 'image'
    label_key: str = 'label'

    def __post_init__(self):
        if self.crop not in CROPS:
            raise ImagesError(f'train_crop={self.crop!r} is unknown; valid: {list(CROPS)}')
        if not 0 < self.crop_scale <= 1:
            raise ImagesError(f'crop_scale={self.crop_scale!r} is out of range; valid: '
                              f'0 < crop_scale <= 1 (the smallest area fraction of a crop)')
        if self.image_size <= 0 or self.channels not in (1, 3):
            raise ImagesError(f'image_size={self.image_size} channels={self.channels}; valid: '
                              f'image_size >= 1, channels 1 or 3')
        # One value for every channel, or one per channel: ImageNet's three means on a grey
        # transform broadcast its [S, S, 1] images to [S, S, 3], unsaid (and an export
        # wrote three means into a one-channel model's image processor).
        for name in ('mean', 'std'):
            values = np.ravel(np.asarray(getattr(self, name), np.float64))
            if values.size not in (1, self.channels) or not np.isfinite(values).all() or (
                    name == 'std' and (values <= 0).any()):
                raise ImagesError(f'{name}={getattr(self, name)!r} for channels={self.channels}; '
                                  f'valid: one number or {self.channels} (one per channel)'
                                  + (', each > 0' if name == 'std' else ''))

    def __call__(self, record, rng: np.random.Generator) -> dict[str, np.ndarray]:
        from attention_jax.data import objectives
        image = _to_channels(np.asarray(record[self.image_key]), self.channels)
        h, w = image.shape[:2]
        s = self.image_size
        if self.train and self.crop == 'random_resized':
            image = resize_box(image, random_resized_box(h, w, rng, (self.crop_scale, 1.0)), s)
        else:
            image = resize_centre(image, s)
            if self.train and self.crop == 'random':
                image = objectives.random_crop_flip(image, rng, padding=self.padding)
        if self.train and self.flip and rng.random() < 0.5:
            image = image[:, ::-1]
        return {'image': objectives.normalize_image(image, self.mean, self.std),
                'label': np.int32(record[self.label_key])}


def direct_source(split: str, data_dir: str | None = None, **options) -> ImageFiles:
    """sources.DIRECT's entry: get_dataset('image_folder', split, root=DIR, ...)."""
    del data_dir  # read where the images are; nothing is prepared
    return get_split(split, **options)
