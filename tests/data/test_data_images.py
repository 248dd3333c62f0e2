"""Your own images (data/images.py): the folder source (modes, splits, bad input), the
preprocessing ops against hand-computed results, mixup/cutmix targets, and the image
task's checks of what the data sets in the model (tasks/images.py)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from attention_jax import config as config_lib
from attention_jax.data import images as images_lib
from attention_jax.data import objectives
from attention_jax.data.images import ImagesError, Preprocess, folder_splits
from attention_jax.errors import ConfigError
from attention_jax.models.losses import cross_entropy
from attention_jax.tasks import TASKS
from attention_jax.tasks.images import soft_cross_entropy


def _folder(root, per_class=3, classes=("bee", "ant", "cat"), size=(12, 10)):
    """PNG images of constant grey value 50*(creation index)+k (k < 50) in each class folder."""
    for c, name in enumerate(classes):
        os.makedirs(root / name, exist_ok=True)
        for k in range(per_class):
            Image.fromarray(np.full(size, 50 * c + k, np.uint8)).save(root / name / f"{k}.png")
    return root


# ===================================================================== source and modes
def test_every_mode_decodes_to_rgb_or_grey(tmp_path):
    (tmp_path / "a").mkdir()
    rgb = np.zeros((5, 7, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 100, 50
    Image.fromarray(np.full((5, 7), 77, np.uint8)).save(tmp_path / "a" / "grey.png")
    Image.fromarray(np.dstack([rgb, np.full((5, 7), 9, np.uint8)])).save(tmp_path / "a" / "rgba.png")
    Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE).save(tmp_path / "a" / "palette.png")
    Image.fromarray(np.full((5, 7), 65535, np.uint16)).save(tmp_path / "a" / "sixteen.png")
    Image.fromarray(rgb).save(tmp_path / "a" / "photo.JPG", quality=100)
    (tmp_path / "a" / "notes.txt").write_text("not an image, not listed")
    want = {"grey.png": (77, 77, 77), "rgba.png": (200, 100, 50), "palette.png": (200, 100, 50),
            "sixteen.png": (255, 255, 255), "photo.JPG": (200, 100, 50)}
    for name, rgb_value in want.items():
        x = images_lib.decode(str(tmp_path / "a" / name))
        assert x.shape == (5, 7, 3) and x.dtype == np.uint8, name
        np.testing.assert_allclose(x.reshape(-1, 3).mean(0), rgb_value, atol=2, err_msg=name)
        grey = images_lib.decode(str(tmp_path / "a" / name), channels=1)
        assert grey.shape == (5, 7, 1)
    classes, files = images_lib.list_classes(str(tmp_path))
    assert classes == ["a"] and len(files[0]) == 5  # the .txt is not an image
    # A CIELAB TIFF: PIL converts LAB to RGB only, so grey goes through RGB (it was
    # skipped as an undecodable image with channels=1, read with channels=3).
    Image.fromarray(rgb).convert("LAB").save(tmp_path / "lab.tif")
    colour = images_lib.decode(str(tmp_path / "lab.tif"))
    np.testing.assert_allclose(colour.reshape(-1, 3).mean(0), (200, 100, 50), atol=3)
    grey = images_lib.decode(str(tmp_path / "lab.tif"), channels=1)
    want_grey = np.asarray(Image.fromarray(colour).convert("L"))[..., None]
    np.testing.assert_array_equal(grey, want_grey)


def test_float_images_in_0_1_and_12_bit_data_in_16_bits(tmp_path, capsys):
    """A float TIFF in [0, 1] decoded black (scaled as 0..255); 12-bit data stored in 16
    bits decodes dark, as the 16-bit range says, now with a note once."""
    from attention_jax.data import files
    files._SAID.difference_update({"low-range-16-bit", "float-images"})  # once a process
    Image.fromarray(np.full((4, 4), 0.5, np.float32)).save(tmp_path / "half.tif")
    np.testing.assert_allclose(images_lib.decode(str(tmp_path / "half.tif")), 128, atol=1)
    Image.fromarray(np.full((4, 4), 200.0, np.float32)).save(tmp_path / "bytes.tif")
    np.testing.assert_allclose(images_lib.decode(str(tmp_path / "bytes.tif")), 200, atol=1)
    for name in ("a12.png", "b12.png"):
        Image.fromarray(np.full((4, 4), 4095, np.uint16)).save(tmp_path / name)
        np.testing.assert_allclose(images_lib.decode(str(tmp_path / name)), 16, atol=1)
    Image.fromarray(np.zeros((4, 4), np.uint16)).save(tmp_path / "black.png")  # no note
    np.testing.assert_array_equal(images_lib.decode(str(tmp_path / "black.png")), 0)
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 2 and notes[0].startswith(f"note: {tmp_path / 'half.tif'} is a float "
                                                   f"image: one with values in [0, 1] is read")
    assert notes[1].startswith(f"note: {tmp_path / 'a12.png'} is a 16-bit image whose values "
                               f"stay below 4096")


def test_classes_labels_and_a_split_that_depends_only_on_the_path(tmp_path):
    root = _folder(tmp_path / "f", per_class=20)
    splits, classes = folder_splits(str(root), eval_fraction=0.25)
    assert classes == ["ant", "bee", "cat"]  # sorted folder names; label i is classes[i]
    train, val = splits["train"], splits["validation"]
    assert len(train) + len(val) == 60 and 5 <= len(val) <= 25
    for src in (train, val):
        for i in range(len(src)):
            r = src[i]
            # The pixel value tells the folder it came from: 50*(the creation order) + k.
            assert ["bee", "ant", "cat"][int(r["image"][0, 0, 0]) // 50] == classes[r["label"]]
    held = set(val.paths)
    # A new image elsewhere moves no existing image across the split.
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "ant" / "new.png")
    again = folder_splits(str(root), eval_fraction=0.25)[0]["validation"]
    assert held <= set(again.paths) and set(again.paths) - held <= {os.path.join("ant", "new.png")}


def test_a_held_out_split_without_some_class_is_said(tmp_path, capsys):
    """A small folder's eval_fraction may hold out no image of a class: its accuracy then
    leaves the class out, said; a split with every class says nothing."""
    root = _folder(tmp_path / "f", per_class=4)
    splits, classes = folder_splits(str(root), eval_fraction=0.2)
    held = set(splits["validation"].labels.tolist())
    missing = [c for i, c in enumerate(classes) if i not in held]
    assert missing  # 12 images at 0.2: this folder's hashes hold out too few for all three
    assert capsys.readouterr().err == (
        f"note: eval_fraction=0.2 of 12 images held out {len(splits['validation'])}, of "
        f"{3 - len(missing)} of the 3 classes (none of {', '.join(map(repr, missing))}): the "
        f"eval metrics leave those out; give a larger eval_fraction, or held-out images of "
        f"every class in eval_root\n")
    splits, _ = folder_splits(str(root), eval_fraction=0.7)
    assert set(splits["validation"].labels.tolist()) == {0, 1, 2}
    assert capsys.readouterr().err == ""


def test_every_format_pil_reads_is_an_image_and_other_files_are_said(tmp_path, capsys):
    """WebP (and BMP, GIF, TIFF) images were left out in silence with the notes beside
    them; now they are images, and what is left out is counted in a note."""
    root = _folder(tmp_path / "f", per_class=2, classes=("ant", "bee"))
    Image.fromarray(np.full((12, 10, 3), 7, np.uint8)).save(root / "ant" / "w.webp")
    Image.fromarray(np.full((12, 10), 9, np.uint8)).save(root / "bee" / "b.BMP")
    (root / "bee" / "notes.txt").write_text("taken in May")
    Image.fromarray(np.full((12, 10), 9, np.uint8)).save(root / "stray.png")  # no class
    classes, files = images_lib.list_classes(str(root))
    assert files == [["ant/0.png", "ant/1.png", "ant/w.webp"],
                     ["bee/0.png", "bee/1.png", "bee/b.BMP"]] and classes == ["ant", "bee"]
    assert capsys.readouterr().err == (
        f"note: root={str(root)!r}: 1 file without an image suffix (.jpg, .jpeg, .png, "
        f".webp, .bmp, .gif, .tif, .tiff) left out: bee/notes.txt\n"
        f"note: root={str(root)!r}: 1 file beside the class folders, in none, left out: "
        f"stray.png\n")
    assert images_lib.decode(str(root / "ant" / "w.webp"))[0, 0].tolist() == [7, 7, 7]


def test_linked_folders_and_images_are_read_once_in_their_own_class(tmp_path, capsys):
    """A link back up (`up -> ..`) walked the root again: 2 images became 80, class b's
    in class a. Each real image is now read once, under its own folder's class, and the
    links are said; a class folder that lives elsewhere (a link) is still followed."""
    root = tmp_path / "root"
    _folder(root, per_class=1, classes=("a", "b"))
    elsewhere = tmp_path / "elsewhere"
    _folder(elsewhere, per_class=2, classes=("c",))
    (root / "c").symlink_to(elsewhere / "c")
    (root / "a" / "up").symlink_to("..")
    (root / "a" / "b_too").symlink_to("../b")
    b_image = next(p.name for p in (root / "b").iterdir())
    (root / "a" / f"zz_{b_image}").symlink_to(f"../b/{b_image}")
    classes, files = images_lib.list_classes(str(root))
    assert classes == ["a", "b", "c"]
    assert [len(f) for f in files] == [1, 1, 2]
    assert files[1] == [f"b/{b_image}"]
    note = capsys.readouterr().err
    assert "3 paths to a folder or image already read (a link) left out: a/b_too/, a/up/, " \
        f"a/zz_{b_image}" in note


def test_source_and_transform_pickle_into_worker_processes(tmp_path):
    import pickle
    splits, _ = folder_splits(str(_folder(tmp_path / "f")), eval_fraction=0.3)
    prep = Preprocess(8, train=True, crop="random_resized", flip=True)
    src, prep2 = pickle.loads(pickle.dumps((splits["train"], prep)))  # grain's workers
    rng = lambda: np.random.default_rng(5)
    np.testing.assert_array_equal(prep2(src[1], rng())["image"], prep(splits["train"][1], rng())["image"])


def test_eval_root_holds_the_training_classes_or_some_of_them(tmp_path, capsys):
    """A held-out folder of some of the classes (a test set of two of three; an empty
    class folder removed, as its error says) evaluates with the training classes'
    indices, said; one with a class the training has not is refused (it was refused for
    a missing class too)."""
    root, other = _folder(tmp_path / "train"), _folder(tmp_path / "val", per_class=2)
    splits, classes = folder_splits(str(root), str(other))
    assert (len(splits["train"]), len(splits["validation"])) == (9, 6)
    some = _folder(tmp_path / "some", classes=("bee", "cat"), per_class=2)
    splits, _ = folder_splits(str(root), str(some))
    held = splits["validation"]
    assert sorted(int(held[i]["label"]) for i in range(len(held))) == [
        classes.index("bee")] * 2 + [classes.index("cat")] * 2
    assert (f"note: eval_root={str(some)!r} holds 2 of the 3 classes (none of 'ant'): the "
            f"eval metrics leave those out") in capsys.readouterr().err
    odd = _folder(tmp_path / "odd", classes=("ant", "bee", "dog"))
    with pytest.raises(ImagesError, match=r"eval_root=.* has class folders the training has "
                                          r"not: \['dog'\]; valid: folders named as root's "
                                          r"classes \['ant', 'bee', 'cat'\]"):
        folder_splits(str(root), str(odd))
    with pytest.raises(ImagesError, match="is root itself"):
        folder_splits(str(root), str(root))


def test_bad_folders_one_line_each(tmp_path):
    with pytest.raises(ImagesError, match=r"root='.*nowhere' does not exist \(moved\? give its "
                                          r"new place, root=DIR\); valid: a folder"):
        folder_splits(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImagesError, match=r"has no class subfolders"):
        folder_splits(str(tmp_path / "empty"))
    root = _folder(tmp_path / "f")
    (root / "dog").mkdir()
    (root / "dog" / "readme.txt").write_text("no images here")
    with pytest.raises(ImagesError, match=r"class folder 'dog' has no images \(.jpg, .jpeg, .png, .webp"):
        folder_splits(str(root))
    # ImageNet's layout from the top: train/ and val/ were taken as two classes (the model
    # learnt the split), train/ alone as one (loss 0, accuracy 1).
    top = tmp_path / "imagenet"
    _folder(top / "train"), _folder(top / "val", per_class=1)
    with pytest.raises(ImagesError, match=rf"config.data.root='{top}' holds split folders "
                                          rf"\(train/, val/\) with class folders inside, not "
                                          rf"class folders: point config.data.root at "
                                          rf"'{top / 'train'}' and config.data.eval_root at "
                                          rf"'{top / 'val'}'"):
        folder_splits(str(top), arg="config.data.")
    # eval/ sorts before train/: the training split is still the one named for root.
    mine = tmp_path / "mine"
    _folder(mine / "train"), _folder(mine / "eval", per_class=1)
    with pytest.raises(ImagesError, match=rf"point config.data.root at '{mine / 'train'}' and "
                                          rf"config.data.eval_root at '{mine / 'eval'}'"):
        folder_splits(str(mine), arg="config.data.")
    with pytest.raises(ImagesError, match=rf"point config.data.eval_root at '{mine / 'eval'}' "
                                          rf"\(root"):  # the held-out split, for eval_root
        folder_splits(str(_folder(tmp_path / "good")), eval_root=str(mine), arg="config.data.")
    vehicles = _folder(tmp_path / "vehicles", classes=("bus", "car", "train"))
    _folder(vehicles / "train", classes=("side",))  # a class named train, nested images
    assert folder_splits(str(vehicles))[1] == ["bus", "car", "train"]
    one = _folder(tmp_path / "one", classes=("cat",))
    with pytest.raises(ImagesError, match=r"has one class folder \('cat'\): a classifier needs "
                                          r"at least 2"):
        folder_splits(str(one))


def test_corrupt_and_truncated_images_are_skipped_counted_then_refused(tmp_path, capsys):
    root = _folder(tmp_path / "f", per_class=2, classes=("a",))
    good = (root / "a" / "0.png").read_bytes()
    (root / "a" / "1.png").write_bytes(good[: len(good) // 2])  # truncated
    (root / "a" / "2.png").write_bytes(b"not a png at all")  # corrupt
    src = images_lib.ImageFiles(str(root), ["a/1.png", "a/2.png", "a/0.png"], [0, 0, 0], ["a"],
                                max_bad_records=2)
    first = src[0]  # both bad ones skipped: the next good image (a/0.png) stands in
    np.testing.assert_array_equal(first["image"], src[2]["image"])
    err = capsys.readouterr().err
    assert err.count("warning: ") == 2 and "(bad image 2, at most 2)" in err
    src[1]
    assert capsys.readouterr().err == ""  # a bad file is reported once
    strict = images_lib.ImageFiles(str(root), ["a/1.png", "a/2.png", "a/0.png"], [0, 0, 0], ["a"],
                                   max_bad_records=1, arg="config.data.")
    with pytest.raises(ImagesError, match=r"2 bad images, more than config.data.max_bad_records=1"):
        strict[0]


def test_an_eval_counts_only_the_images_it_read(tmp_path, capsys):
    """From a new user's audit: in the held-out split an undecodable file's stand-in (the
    next image) was scored and counted, so `examples` said 19 for 18 images read. It
    carries loaders.STAND_IN there, and an evaluation's loader weighs it 0; the training
    split's items are as before."""
    from attention_jax import data
    from attention_jax.data.loaders import EXAMPLE_WEIGHT, STAND_IN
    root = _folder(tmp_path / "f", per_class=3, classes=("a", "b"))
    (root / "b" / "1.png").write_bytes(b"not a png at all")
    held = images_lib.held_out_folder(str(root), ["a", "b"])
    loader = data.Loader(held, global_batch_size=4, seed=0, shuffle=False, num_epochs=1,
                         process_index=0, process_count=1, pad_remainder=True)
    batches = list(loader)
    weights = np.concatenate([b[EXAMPLE_WEIGHT] for b in batches])
    assert weights.sum() == 5 and len(weights) == 8  # 6 files, one bad; 2 rows padding
    assert all(STAND_IN not in b for b in batches)
    assert "skipped, the next image stands in (weighted 0: the eval leaves it out)" in (
        capsys.readouterr().err)
    # Through the eval's preprocessing too, as a run reads it: the transform returned
    # image and label only, so the stand-in was weighed 1 and counted twice.
    loader = data.Loader(held, global_batch_size=4, seed=0, shuffle=False, num_epochs=1,
                         process_index=0, process_count=1, pad_remainder=True,
                         transform=Preprocess(8, train=False))
    batches = list(loader)
    assert np.concatenate([b[EXAMPLE_WEIGHT] for b in batches]).sum() == 5
    assert all(set(b) == {"image", "label", EXAMPLE_WEIGHT} for b in batches)
    train = images_lib.ImageFiles(str(root), ["b/1.png", "a/0.png"], [1, 0], ["a", "b"])
    assert set(train[0]) == {"image", "label"}


# ============================================================================= preprocess
def test_eval_resizes_the_shorter_side_and_cuts_the_centre():
    image = np.zeros((4, 8, 1), np.uint8)
    image[:, 2:6, 0] = np.arange(16, dtype=np.uint8).reshape(4, 4) * 10 + 50
    out = Preprocess(4, channels=1, mean=(0.0,), std=(1.0,))({"image": image, "label": 3},
                                                              np.random.default_rng(0))
    # No resize (shorter side already 4): exactly the centre 4×4, divided by 255.
    np.testing.assert_allclose(out["image"], image[:, 2:6] / 255.0, atol=1e-6)
    assert out["label"] == 3 and out["label"].dtype == np.int32
    # An odd margin (9 - 4 = 5 columns) is split rounding down, as transformers' centre
    # crop does: columns 2..5 again, whole pixels, not a half-pixel interpolation.
    odd = np.concatenate([image, np.full((4, 1, 1), 255, np.uint8)], axis=1)
    np.testing.assert_array_equal(images_lib.resize_centre(odd, 4), image[:, 2:6])
    # Tall: the shorter side (width 3) to 2, the height in proportion, int(2 * 7 / 3) = 4
    # rows, of which the middle 2.
    tall = images_lib.resize_centre(np.full((7, 3, 3), 7, np.uint8), 2)
    assert tall.shape == (2, 2, 3) and (tall == 7).all()
    # Downscaling a ramp 8 -> 4 wide: PIL's bilinear widens its triangle filter to 2 input
    # pixels when shrinking 2x (antialiased), which keeps a linear ramp linear away from the
    # borders: output column j samples x = 2j + 0.5 (pixel centres), 10x = 25, 45.
    ramp = np.tile(np.arange(8, dtype=np.uint8) * 10, (8, 1))[..., None]
    small = images_lib.resize_box(ramp, (0, 0, 8, 8), 4)[..., 0]
    np.testing.assert_allclose(small[:, 1:3], [[25, 45]] * 4, atol=1)
    flat = images_lib.resize_box(np.full((37, 50, 3), 99, np.uint8), (3.5, 1.2, 40.1, 30.0), 9)
    assert flat.shape == (9, 9, 3) and (flat == 99).all()


def test_mean_std_per_channel_and_channel_conversion():
    image = np.full((2, 2, 1), 255, np.uint8)  # grey to RGB: repeated
    prep = Preprocess(2, channels=3, mean=images_lib.parse_floats("0.5,0.25,0", "mean", 3),
                      std=images_lib.parse_floats(0.5, "std", 3))
    out = prep({"image": image, "label": 0}, np.random.default_rng(0))["image"]
    np.testing.assert_allclose(out[0, 0], [(1 - 0.5) / 0.5, (1 - 0.25) / 0.5, 2.0])
    with pytest.raises(ImagesError, match=r"mean='0.1,0.2' must be one number or 3 comma-separated"):
        images_lib.parse_floats("0.1,0.2", "mean", 3)
    # std 0 trained to a non-finite loss at step 1 (a divide-by-zero warning first); a
    # negative one flipped every image's sign, unsaid.
    for std in ("0", "-1", "0.2,0,0.2"):
        with pytest.raises(ImagesError, match=rf"std='{std}': each must be > 0"):
            images_lib.parse_floats(std, "std", 3, positive=True)
    with pytest.raises(ImagesError, match=r"must be one number"):
        images_lib.parse_floats("nan", "mean", 3)


def test_grey_and_alpha_arrays_drop_the_alpha_and_other_channel_counts_are_named():
    """A [H, W, 2] array (grey and alpha, as a tfds set or an .npy may hold) reached the
    normalisation as two channels and failed there with numpy's broadcasting error."""
    grey_alpha = np.stack([np.full((2, 2), 255, np.uint8), np.zeros((2, 2), np.uint8)], -1)
    for channels in (1, 3):
        prep = Preprocess(2, channels=channels)
        out = prep({"image": grey_alpha, "label": 0}, np.random.default_rng(0))["image"]
        assert out.shape == (2, 2, channels)
        np.testing.assert_allclose(out, 1.0)  # (1 - 0.5) / 0.5: the grey, not the alpha
    with pytest.raises(ImagesError, match=r"shape \(2, 2, 5\): 5 channels; valid: 1 \(grey\), "
                                          r"2 \(grey and alpha\), 3 \(RGB\) or 4 \(RGBA\)"):
        Preprocess(2)({"image": np.zeros((2, 2, 5), np.uint8), "label": 0},
                      np.random.default_rng(0))


def test_a_transform_s_mean_and_std_fit_its_channels():
    """ImageNet's three means on a grey transform broadcast its images to three channels,
    unsaid; a zero std divided by zero. Both refused when the transform is made."""
    for kw, message in (({"channels": 1, "mean": (0.485, 0.456, 0.406)},
                         r"mean=\(0.485, 0.456, 0.406\) for channels=1; valid: one number or 1"),
                        ({"channels": 3, "std": (0.2, 0.3)},
                         r"std=\(0.2, 0.3\) for channels=3; valid: one number or 3 .*each > 0"),
                        ({"channels": 3, "std": (0.0,)}, r"std=\(0.0,\) for channels=3")):
        with pytest.raises(ImagesError, match=message):
            Preprocess(4, **kw)
    grey = Preprocess(4, channels=1, mean=(0.5,), std=0.25)  # one number, as a tuple or not
    out = grey({"image": np.zeros((6, 6, 1), np.uint8), "label": 0}, np.random.default_rng(0))
    assert out["image"].shape == (4, 4, 1)
    np.testing.assert_allclose(out["image"], -2.0)


def test_flip_mirrors_half_the_draws_and_random_crop_keeps_the_size():
    image = np.arange(16, dtype=np.uint8).reshape(4, 4, 1)
    prep = Preprocess(4, channels=1, train=True, crop="none", flip=True, mean=(0.0,), std=(1.0 / 255,))
    outs = [np.round(prep({"image": image, "label": 0}, np.random.default_rng(s))["image"][..., 0])
            for s in range(40)]
    flipped = sum(np.array_equal(o, image[:, ::-1, 0]) for o in outs)
    assert flipped + sum(np.array_equal(o, image[..., 0]) for o in outs) == 40
    assert 8 <= flipped <= 32
    crop = Preprocess(4, channels=1, train=True, crop="random", padding=1)
    assert crop({"image": image, "label": 0}, np.random.default_rng(0))["image"].shape == (4, 4, 1)


def test_random_resized_box_bounds():
    rng = np.random.default_rng(0)
    for h, w in ((375, 500), (64, 64), (10, 300)):
        for _ in range(200):
            left, top, right, bottom = images_lib.random_resized_box(h, w, rng, (0.2, 1.0))
            assert 0 <= left < right <= w + 1e-9 and 0 <= top < bottom <= h + 1e-9
            cw, ch = right - left, bottom - top
            assert 3 / 4 - 1e-9 <= cw / ch <= 4 / 3 + 1e-9
            if (h, w) != (10, 300):  # a long strip falls back to the clamped centre crop
                assert 0.2 - 1e-9 <= cw * ch / (h * w) <= 1 + 1e-9
    out = Preprocess(6, train=True, crop="random_resized")(
        {"image": np.zeros((37, 50, 3), np.uint8), "label": 1}, np.random.default_rng(1))
    assert out["image"].shape == (6, 6, 3) and out["image"].dtype == np.float32


def test_mixup_and_cutmix_targets_sum_to_one_and_match_the_pixels():
    images = jnp.stack([jnp.full((4, 4, 1), 1.0), jnp.full((4, 4, 1), 0.0)])  # [2, 4, 4, 1]
    labels = jnp.array([0, 2])
    mix = jax.jit(objectives.mix_batch, static_argnames=("num_classes", "mixup", "cutmix"))
    boxes = 0
    for seed in range(6):  # both on: each batch mixed one way or the other (one compile)
        mixed, targets = mix(images, labels, jax.random.PRNGKey(seed), num_classes=3,
                             mixup=0.4, cutmix=1.0)
        np.testing.assert_allclose(targets.sum(-1), 1.0, atol=1e-6)
        # Image 0 is ones mixed with image 1 (zeros): its mean is its own share λ, whether
        # blended (mixup) or pasted (cutmix: then every pixel is 0 or 1).
        np.testing.assert_allclose(mixed[0].mean(), targets[0, 0], atol=1e-6)
        np.testing.assert_allclose(targets[0, 2], 1 - targets[0, 0], atol=1e-6)
        boxes += bool(jnp.all((mixed == 0) | (mixed == 1)))
    assert 0 < boxes < 6  # both ways were drawn
    with pytest.raises(ValueError, match="at least one > 0"):
        objectives.mix_batch(images, labels, jax.random.PRNGKey(0), num_classes=3)


def test_soft_cross_entropy_of_one_hot_targets_is_the_hard_loss():
    logits = jax.random.normal(jax.random.PRNGKey(0), (5, 4))
    labels = jnp.array([0, 3, 1, 1, 2])
    for eps in (0.0, 0.1):
        soft, m = soft_cross_entropy(logits, jax.nn.one_hot(labels, 4), eps)
        hard, mh = cross_entropy(logits, labels, None, eps)
        np.testing.assert_allclose(soft, hard, rtol=1e-5)
        np.testing.assert_allclose(m["accuracy"], mh["accuracy"])


# ============================================================ the task: data -> the model
def _config(root, spec="vit", **overrides):
    return config_lib.load(spec, {"data.name": "image_folder", "data.root": str(root),
                                  "data.eval_fraction": 0.3, **overrides})


def test_the_folder_sets_image_size_channels_and_classes(tmp_path):
    root = _folder(tmp_path / "f")
    task = TASKS["vit"](_config(root, **{"data.image_size": 12, "data.channels": 1}), "")
    cfg = task.model.config
    assert (cfg.image_size, cfg.num_channels, cfg.num_classes, cfg.grid_size) == (12, 1, 3, 6)
    assert task.tokens_per_example == 37  # 6×6 patches + [CLS]
    example = task.eval_transform(task.eval_source[0], np.random.default_rng(0))
    assert example["image"].shape == (12, 12, 1)
    task.save_assets(str(tmp_path))
    assert json.loads((tmp_path / "classes.json").read_text()) == ["ant", "bee", "cat"]
    cnn = TASKS["cnn"](_config(root, "inductive_bias:model=cnn", **{"data.image_size": 20}), "")
    assert (cnn.model.config.image_size, cnn.model.config.num_channels) == (20, 3)


def test_bad_image_options_one_line_each(tmp_path):
    root = _folder(tmp_path / "f")
    bad = [({"data.image_size": 15},
            r"config.data.image_size=15 is not a multiple of the ViT's patch_size=2; valid: "),

           ({"data.root": str(tmp_path / "no")}, r"config.data.root='.*no' does not exist"),
           ({"data.root": ""}, r"needs --config.data.root=DIR"),
           ({"data.train_crop": "inception"}, r"config.data.train_crop='inception' is unknown"),
           ({"data.mean": "1,2"}, r"config.data.mean='1,2' must be one number or 3"),
           ({"data.max_bad_records": -1}, r"config.data.max_bad_records=-1 is out of range")]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            TASKS["vit"](_config(root, **overrides), "")
    # The way out it names is one the config has (it has no model.patch_size key).
    with pytest.raises(ConfigError, match=r"image_size=18 is not a multiple of the ViT's "
                                          r"patch_size=4; valid: \[12, 16, 20, 24\], or a "
                                          r"config.model.variant whose patch divides it: "
                                          r"\[.*'vit-tiny/2'.*\]$"):
        TASKS["vit"](_config(root, "vit:variant=vit-tiny/4", **{"data.image_size": 18}), "")
    # The number of classes comes from the folder; a different one asked is named.
    config = _config(root, "inductive_bias:model=cnn")
    config.model.num_classes = 10
    with pytest.raises(ConfigError, match=r"config.model.num_classes=10 but the 3 classes of "
                                          r"config.data.name='image_folder' gives 3"):
        TASKS["cnn"](config, "")
    # A run continued on other class folders is refused, never trained silently (a run
    # that saved a step; a start that saved none has its classes replaced).
    (tmp_path / "w" / "checkpoints" / "5").mkdir(parents=True)
    (tmp_path / "w" / "classes.json").write_text(json.dumps(["ant", "bee", "dog"]))
    with pytest.raises(ConfigError, match=r"classes.json holds the 3 classes this run trained "
                                          r"on; the data now has 3 \(differing: \['cat', 'dog'\]\)"):
        TASKS["vit"](_config(root), str(tmp_path / "w"))


def test_a_folder_without_an_image_size_says_the_size_it_trains_at(tmp_path, capsys):
    """Photos of any size trained at the variant's 8 px, nothing said."""
    root = _folder(tmp_path / "f")
    task = TASKS["vit"](_config(root, "vit:variant=vit-tiny/4"), "")
    size = task.model.config.image_size
    assert (f"note: config.data.image_size=0: the images are resized to {size}x{size}, the "
            f"model's own size (variant vit-tiny/4)") in capsys.readouterr().err
    TASKS["vit"](_config(root, "vit:variant=vit-tiny/4", **{"data.image_size": 16}), "")
    assert "note: config.data.image_size" not in capsys.readouterr().err


def test_an_image_config_of_ones_own_takes_every_preprocessing_key():
    """The README names augment, flip and padding among config.IMAGE_KEYS, but they were
    not there: a config built with add_image_keys refused --config.data.flip=true. Keys a
    config set before calling it keep their values."""
    import ml_collections
    data = ml_collections.ConfigDict({"name": "image_folder", "augment": False})
    config_lib.add_image_keys(data)
    assert (data.augment, data.flip, data.padding) == (False, False, 1)
    assert {"augment", "flip", "padding"} <= set(config_lib.IMAGE_KEYS)
    data.flip = True  # what --config.data.flip=true does
