"""Your own images from the command line: a folder of PNGs and JPEGs of mixed sizes and
modes in 3 classes trains the ViT and the CNN, and a converted Hugging Face ViT
fine-tunes at a new resolution (its position table resized): the ViT at two resolutions.

The runs go through main.py's own flag parsing and main() in this process (a subprocess
per run would spend most of the test's time importing jax), with tiny models and 2 steps.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from attention_jax import convert, main, workdir as workdir_lib
from attention_jax.models import vit
from attention_jax.tasks import TASKS

CLASSES = ("ant", "bee", "cat")
SIZES = ((20, 30), (33, 17), (24, 24), (40, 28))
MODES = ("RGB", "L", "RGBA", "P", "LA")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pets")
    rng = np.random.default_rng(0)
    for c, name in enumerate(CLASSES):
        os.makedirs(root / name)
        for k in range(8):
            h, w = SIZES[k % len(SIZES)]
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            pixels[..., c] = 255  # a class colour to learn from
            image = Image.fromarray(pixels)
            if k % 3 == 0:
                image.save(root / name / f"{k}.jpg", quality=90)
            else:
                image.convert(MODES[k % len(MODES)]).save(root / name / f"{k}.png")
    return str(root)


def cli(capsys, *args) -> tuple[int, str, str]:
    """python -m attention_jax.main ARGS, in this process: (exit code, stdout, stderr)."""
    main.parse_flags(["main", "--mode=train", *args])
    code = main.main([])
    out = capsys.readouterr()
    return code, out.out, out.err


TINY = ["--config.train.steps=2", "--config.train.batch_size=8", "--config.eval.batch_size=8",
        "--config.eval.every=0", "--config.train.log_every=1", "--config.train.checkpoint_every=2",
        "--config.optim.warmup_steps=1", "--config.data.eval_fraction=0.25",
        "--config.mesh.num_devices=1"]  # one device: an 8-way compile costs seconds more here


def _train(capsys, folder, workdir, spec, *extra):
    code, out, err = cli(capsys, f"--config={spec}", f"--workdir={workdir}",
                         "--config.data.name=image_folder", f"--config.data.root={folder}",
                         *TINY, *extra)
    assert code == 0, err[-3000:]
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [r for r in records if r.get("split") == "eval"]
    assert evals and np.isfinite(evals[-1]["loss"]), records
    with open(os.path.join(workdir, "classes.json")) as f:
        assert json.load(f) == list(CLASSES)
    config = workdir_lib.read_config(workdir)
    return TASKS[config.task](config, workdir), out + err, evals[-1]


# Two resolutions of each family: the ViT from scratch at 16 and fine-tuned from Hugging
# Face at 24; the CNN at 20 and 12. Each run here compiles for seconds.
def test_vit_trains_on_a_folder(folder, tmp_path, capsys, monkeypatch, size=16):
    import shutil
    own = shutil.copytree(folder, tmp_path / "pets")  # moved away after training
    task, _, last = _train(capsys, str(own), str(tmp_path / "vit"), "vit:variant=vit-tiny/4",
                           f"--config.data.image_size={size}", "--config.data.augment=true",
                           "--config.data.train_crop=random_resized", "--config.data.flip=true",
                           "--config.data.mean=0.485,0.456,0.406", "--config.data.mixup=0.2")
    cfg = task.model.config
    assert (cfg.image_size, cfg.num_channels, cfg.num_classes) == (size, 3, 3)
    assert task.tokens_per_example == (size // 4) ** 2 + 1
    assert last["examples"] == len(task.eval_source)  # every held-out image, once
    # The trained run classifies image files from the command line (paths on stdin), each
    # read as its eval images were; the training folder may have moved away.
    held = task.eval_source
    paths = [os.path.join(held.root, p) for p in held.paths[:3]]
    from attention_jax import runs
    params = runs.open_run(str(tmp_path / "vit")).params
    want = [jax.nn.softmax(task.model.apply({"params": params}, task.eval_transform(
        held[i], np.random.default_rng(0))["image"][None])[0][0]) for i in range(3)]
    elsewhere = shutil.move(str(own), tmp_path / "moved")
    paths = [p.replace(str(own), str(elsewhere)) for p in paths]
    import io
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(
        ("\n".join(paths) + "\n").encode())))
    main.parse_flags(["main", "--mode=classify", f"--workdir={tmp_path / 'vit'}"])
    assert main.main([]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in rows] == paths
    for row, p in zip(rows, want):
        assert row["label"] == CLASSES[int(np.argmax(p))]
        assert row["probability"] == pytest.approx(float(np.max(p)), abs=1e-4)
    # A path that is no image, or an image too large to decompress safely (PIL's own
    # check, its limit lowered here), gets a line saying why, and the others their
    # labels; a warning counts them. An empty stdin is one line naming image paths.
    (tmp_path / "notes.txt").write_text("not an image")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(
        f"{paths[0]}  \n{tmp_path / 'notes.txt'}\n{paths[1]}\n".encode())))
    main.parse_flags(["main", "--mode=classify", f"--workdir={tmp_path / 'vit'}"])
    assert main.main([]) == 0
    out = capsys.readouterr()
    got = [json.loads(line) for line in out.out.splitlines()]
    assert [g.get("label") for g in got] == [rows[0]["label"], None, rows[1]["label"]]
    assert got[0]["image"] == paths[0]  # the spaces after a path are no part of it
    assert got[1] == {"image": str(tmp_path / "notes.txt"),
                      "error": got[1]["error"]} and "not a readable image" in got[1]["error"]
    assert "warning: --mode=classify: 1 of the 3 files are no readable image" in out.err
    from PIL import Image as PILImage
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 100)  # 24x24 > 2 x 100: a "bomb"
    [bomb] = main.classify_texts(workdir_lib.read_config(str(tmp_path / "vit")),
                                 str(tmp_path / "vit"), [os.path.join(elsewhere, "ant", "2.png")])
    assert bomb["error"].startswith("not a readable image (Image size (576 pixels) exceeds")
    monkeypatch.undo()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    with pytest.raises(main.InputError, match=r"no image paths \(give one image path per line"):
        main.classify_texts(workdir_lib.read_config(str(tmp_path / "vit")), str(tmp_path / "vit"))
    # A task added the plain way (TASKS[name] = make) declares nothing: its Task tells.
    from attention_jax.tasks import image_task
    monkeypatch.setitem(TASKS, "vit", lambda config, workdir: image_task(config, workdir))
    assert [r["label"] for r in main.classify_texts(
        workdir_lib.read_config(str(tmp_path / "vit")), str(tmp_path / "vit"), paths)] == \
        [r["label"] for r in rows]
    monkeypatch.undo()
    # Evaluated after its folder moved: on a held-out folder of one's own, the training
    # folder is not needed; without one, the message says how to give the new place.
    code, out, err = cli(capsys, "--mode=eval", f"--workdir={tmp_path / 'vit'}",
                         f"--config.data.eval_root={elsewhere}")
    assert code == 0, err
    assert json.loads(out)["examples"] == 8 * len(CLASSES)
    code, out, err = cli(capsys, "--mode=eval", f"--workdir={tmp_path / 'vit'}")
    assert code == 1 and "does not exist (moved? give its new place, --config.data.root=DIR)" \
        in err
    # A run of a task that classifies nothing: one line, before stdin is read.
    from attention_jax.errors import ConfigError
    gpt = workdir_lib.read_config(str(tmp_path / "vit"))
    gpt.task = "gpt"
    with pytest.raises(ConfigError, match=r"^--mode=classify: task 'gpt' cannot classify "
                                          r"texts or images; valid: \['bert_classify', 'cnn', "
                                          r"'vit'\]$"):
        main.classify_texts(gpt, str(tmp_path / "vit"))
    # Its classes.json deleted as well as its folder moved: the error names both, since
    # the folder is listed only for want of the file.
    (tmp_path / "vit" / "classes.json").unlink()
    with pytest.raises(ConfigError, match=r"does not exist .*; a reading mode takes the run's "
                                          r"classes from .*classes\.json, which is gone"):
        main.classify_texts(workdir_lib.read_config(str(tmp_path / "vit")),
                            str(tmp_path / "vit"), paths)


def test_cnn_trains_on_a_folder(folder, tmp_path, capsys, size=20):
    task, said, _ = _train(capsys, folder, str(tmp_path / "cnn"), "inductive_bias:model=cnn",
                           f"--config.data.image_size={size}", "--config.data.cutmix=1.0")
    # The config's data.augment=False (made for 8×8 digits) reads a folder's training
    # images as eval images are: said, with the way to turn the crops on.
    assert ("note: config.data.augment=False: the training images are read as the eval "
            "images are (the centre, resized), so train_crop='random' (the default) does "
            "nothing; "
            "--config.data.augment=true applies them") in said
    assert (task.model.config.image_size, task.model.config.num_classes) == (size, 3)
    assert task.train_transform(task.train_source[0], np.random.default_rng(0))["image"].shape \
        == (size, size, 3)
    # The tools report the run's classes by their folder names, over its held-out images.
    from attention_jax.tools import analysis
    by_class = analysis.class_accuracies(str(tmp_path / "cnn"))
    assert set(by_class) <= set(CLASSES) and task.class_names == tuple(CLASSES)
    assert sum(n for _, n in by_class.values()) == len(task.eval_source)
    accuracy, n = analysis.classification_accuracy(str(tmp_path / "cnn"))
    assert n == len(task.eval_source) and accuracy == pytest.approx(
        sum(a * n for a, n in by_class.values()) / n)
    # Evaluated on a test folder of one's own, and after the images moved: were "these
    # cannot change after training" (data.eval_root, data.root).
    import shutil
    test_set = shutil.copytree(folder, tmp_path / "test_set")
    code, out, err = cli(capsys, "--mode=eval", f"--workdir={tmp_path / 'cnn'}",
                         f"--config.data.eval_root={test_set}")
    assert code == 0, err
    record = json.loads(out)
    assert record["examples"] == 8 * len(CLASSES)  # every image of the test folder
    assert record["data"] == {"data.eval_root": str(test_set)}  # said in evals.jsonl too
    moved = shutil.copytree(folder, tmp_path / "moved")  # the run's own root, elsewhere
    code, out, err = cli(capsys, "--mode=eval", f"--workdir={tmp_path / 'cnn'}",
                         f"--config.data.root={moved}")
    assert code == 0, err
    assert json.loads(out)["examples"] == len(task.eval_source)  # the same held-out images
    # A second resolution from the same folder: only the flag changes.
    small, _, _ = _train(capsys, folder, str(tmp_path / "cnn12"), "inductive_bias:model=cnn",
                         "--config.data.image_size=12")
    assert small.model.config.image_size == 12


def test_hugging_face_vit_fine_tunes_at_a_new_resolution(folder, tmp_path, capsys):
    # A Hugging Face model dir (config.json + model.safetensors, transformers' layout) of a
    # ViT trained at 16×16 with 5 classes, written without torch by export_hf (whose
    # output transformers loads: tests/convert/test_hf.py).
    cfg = vit.ViTConfig(image_size=16, patch_size=4, num_channels=3, d_model=32, num_layers=1,
                        num_heads=4, mlp_dim=48, num_classes=5, norm_epsilon=1e-12)
    shapes = jax.eval_shape(lambda: vit.ViT(cfg).init(jax.random.PRNGKey(0),
                                                       jnp.zeros((1, 16, 16, 3))))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32),
                          nn.meta.unbox(shapes))
    convert.export_hf(vit.ViT(cfg), params, tmp_path / "hf")
    task, out, _ = _train(capsys, folder, str(tmp_path / "ft"), f"vit:hf={tmp_path / 'hf'}",
                          "--config.data.image_size=24")
    assert (task.model.config.image_size, task.model.config.grid_size) == (24, 6)
    # The checkpoint's 4×4 grid went into a 6×6 model; its 5-class head became a 3-class one.
    assert f"warm start from {tmp_path / 'hf'} (ViTForImageClassification)" in out
    assert "head/kernel (checkpoint (32, 5), model (32, 3))" in out


def test_a_size_the_patch_does_not_divide_is_one_line(folder, tmp_path, capsys):
    # (half the images held out: every class among them, so no note on that beside it)
    code, _, err = cli(capsys, "--config=vit", f"--workdir={tmp_path}",
                       "--config.data.name=image_folder", f"--config.data.root={folder}",
                       "--config.data.image_size=15", "--config.data.eval_fraction=0.5")
    assert code == 1 and err.count("\n") == 1 and err.startswith(
        "error: config.data.image_size=15 is not a multiple of the ViT's patch_size=2; valid: ")


def test_a_class_missing_from_the_held_out_split_is_said_where_it_is_evaluated(
        folder, tmp_path, capsys):
    """The note that a small held-out split misses some class comes where the run
    evaluates, not with eval.every=-1 (nothing is evaluated, so nothing is left out)."""
    from attention_jax import config as config_lib
    said = {}
    for every in (0, -1):
        config = config_lib.load("vit", ["data.name=image_folder", f"data.root={folder}",
                                         "data.eval_fraction=0.05", f"eval.every={every}"])
        TASKS[config.task](config, str(tmp_path / f"every{every}"))
        said[every] = capsys.readouterr().err
    assert "held out" in said[0] and "the eval metrics leave those out" in said[0], said
    assert "held out" not in said[-1], said[-1]
