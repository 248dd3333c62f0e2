"""Hugging Face model dirs on disk: config.json + model.safetensors or pytorch_model.bin.

Reading safetensors needs only numpy; pytorch_model.bin needs torch, imported only then.
Also the error every conversion raises when tensors and parameters do not fit.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Callable

import numpy as np


class ConversionError(ValueError):
    """Checkpoint tensors that do not fit the model: every offending name is listed."""


def describe(title, missing=(), unexpected=(), mismatched=(), limit=20, untied=()) -> str:
    """ConversionError's message: every offending name, by what is wrong with it."""
    lines = [title + ":"]
    for label, items in (("missing", missing), ("unexpected", unexpected),
                         ("shape mismatch", mismatched), ("not tied", untied)):
        for item in list(items)[:limit]:
            lines.append(f"  {label}: {item}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more {label}")
    return "\n".join(lines)


# ================================================================================ reading


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    try:
        return load_file(file)
    except TypeError:
        # numpy has no bfloat16, so the safetensors numpy reader refuses bf16 files; the
        # format is a JSON header + raw buffers, which ml_dtypes (a jax dependency) reads.
        return _read_safetensors_raw(file)


def _read_safetensors_raw(file: str) -> dict[str, np.ndarray]:
    import ml_dtypes
    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}; "
                             f"readable: {sorted(dtypes)}")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def _read_torch(file: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ImportError(f"{file} is a PyTorch pickle; reading it needs torch (pip install "
                          f"'attention_jax[torch]'), or save the model as model.safetensors "
                          f"(transformers: save_pretrained(dir, safe_serialization=True))") from None
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def _read_file(reader, file: str) -> dict[str, np.ndarray]:
    """reader(file), a damaged or missing file said with its name (safetensors' own error
    named none: "invalid header length")."""
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file}: a weights file its index names is not there")
    try:
        return reader(file)
    except (ImportError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 (SafetensorError, torch's UnpicklingError, ...)
        raise ValueError(f"{file}: unreadable weights ({type(e).__name__}: {e}); valid: the "
                         f"file as save_pretrained wrote it (a download cut short, or "
                         f"damaged?)") from None


def _read_json(file: str, what: str):
    try:
        with open(file) as f:
            found = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file}: not JSON ({e}); valid: {what}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{file}: a JSON {type(found).__name__}, not an object; valid: {what}")
    return found


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a model dir: single file or sharded (an index.json naming the shards)."""
    for name, reader in (("model.safetensors", _read_safetensors),
                         ("pytorch_model.bin", _read_torch)):
        if os.path.exists(os.path.join(path, name)):
            return _read_file(reader, os.path.join(path, name))
        index = os.path.join(path, name + ".index.json")
        if os.path.exists(index):
            weight_map = _read_json(index, "a weights index with a weight_map").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map (tensor name -> shard file); valid: "
                                 f"the index save_pretrained wrote")
            out = {}
            for shard in sorted(set(weight_map.values())):
                out.update(_read_file(reader, os.path.join(path, shard)))
            return out
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin (nor a sharded "
                            f"*.index.json); files there: {folder_listing(path)}")


def folder_listing(path: str, most: int = 8) -> str:
    """The first names in a folder, for a message: a wrong folder (/tmp) listed hundreds."""
    names = sorted(os.listdir(path))
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most
                                      else "") if names else "(none)"


def read_hf_dir(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, {tensor name: float32 array}) of a Hugging Face model dir.

    Legacy TF-era names (LayerNorm.gamma / .beta) are renamed to weight / bias, as
    transformers itself does on load."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory; expected a Hugging Face model "
                                f"dir with config.json and model.safetensors or pytorch_model.bin")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json (the model's architecture); files "
                                f"there: {folder_listing(path)}")
    hf_cfg = _read_json(cfg_file, "a Hugging Face model's config.json")
    tensors = {}
    for name, x in _read_tensors(path).items():
        name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
        tensors[name] = np.asarray(x, np.float32) if np.issubdtype(x.dtype, np.floating) or \
            x.dtype.name == "bfloat16" else np.asarray(x)
    return hf_cfg, tensors


def read_hf_config(path_or_config) -> dict:
    """config.json of a model dir, or the dict itself."""
    if isinstance(path_or_config, dict):
        return path_or_config
    with open(os.path.join(os.path.expanduser(os.fspath(path_or_config)), "config.json")) as f:
        return json.load(f)


# ================================================================================ writing


def check_not_a_run(out_dir: str, is_dir, is_file, read_text) -> None:
    """A ConversionError if `out_dir` holds a training run (checkpoints/, or a config.json
    that is not an earlier export's), whose config.json an export would replace; the
    callables read a local folder or an object store's."""
    config_file = f"{out_dir.rstrip('/')}/config.json"
    taken = is_dir(f"{out_dir.rstrip('/')}/checkpoints")  # a run's folder
    if is_file(config_file) and not taken:
        try:
            taken = "model_type" not in json.loads(read_text(config_file))  # not an export's
        except (ValueError, OSError):
            taken = True  # not a Hugging Face config either: someone's file, kept
    if taken:
        raise ConversionError(f"export_hf: {out_dir!r} holds a training run (or another "
                              f"config.json), which the export's config.json would replace; "
                              f"valid: a folder of its own, e.g. {out_dir.rstrip('/') + '/hf'!r}")


def export_remote(out_dir: str, export: Callable[[str], object], with_tokenizer: bool) -> str:
    """An export into object storage (gs://, s3://): `export` writes a local staging
    folder, which workdir.save_assets copies up (the writers are local: a gs:// path
    became a folder named ./gs: before); without a tokenizer, an earlier export's
    tokenizer files go."""
    from attention_jax import workdir as workdir_lib
    # epath_of: gcsfs's listings uncached first (workdir.fresh_listings), as for a run's
    # paths; an export touching the bucket first left a reader in the process stale
    target = workdir_lib.epath_of(out_dir)
    check_not_a_run(out_dir, lambda p: workdir_lib.epath_of(p).is_dir(),
                    lambda p: workdir_lib.epath_of(p).is_file(),
                    lambda p: workdir_lib.epath_of(p).read_text())
    staged = {}

    def export_staged(local: str) -> None:
        export(local)
        staged.update({name: os.path.exists(os.path.join(local, name)) for name in OWN_FILES})
    workdir_lib.save_assets(export_staged, out_dir)
    # An earlier export's generation config or image processor goes once this one is
    # written (a refused export leaves the folder as it was): an export writes its own
    # only where it has one (convert/hf.py).
    for name in OWN_FILES:
        if not staged[name] and (target / name).exists():
            (target / name).unlink()
    if not with_tokenizer:
        _remove_stale([n for n in TOKENIZER_FILES if (target / n).exists()], out_dir,
                      lambda name: (target / name).unlink())
    return out_dir


def _remove_stale(stale: list[str], out_dir: str, remove: Callable[[str], None]) -> None:
    for name in stale:
        remove(name)
    if stale:
        print(f"note: export_hf: {', '.join(stale)} of an earlier export removed from "
              f"{out_dir} (they were not this model's; tokenizer= writes new ones)",
              file=sys.stderr)


def write_hf_dir(out_dir, hf_cfg: dict, tensors: dict[str, np.ndarray]) -> str:
    """config.json + model.safetensors that transformers' from_pretrained reads. A folder
    that is a training run (its own config.json, checkpoints/) is refused: its config.json
    would be replaced, and the run would no longer open. An earlier export is replaced."""
    out_dir = os.path.expanduser(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # was FileExistsError's traceback
        raise ConversionError(f"export_hf: {out_dir!r} is a file; valid: a folder to write "
                              f"config.json and model.safetensors into")
    check_not_a_run(out_dir, os.path.isdir, os.path.isfile,
                    lambda p: open(p).read())
    os.makedirs(out_dir, exist_ok=True)
    from safetensors.numpy import save_file
    # transformers checks the "format" metadata to know the layout is PyTorch's.
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    # safetensors writes its file readable by its owner only (0600); an export is for
    # sharing, so it gets the permissions of config.json, written as any file here is.
    os.chmod(weights, stat.S_IMODE(os.stat(os.path.join(out_dir, "config.json")).st_mode))
    return os.fspath(out_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
# Files an export writes only where it has them: an earlier export's are removed.
OWN_FILES = ("generation_config.json", IMAGE_PROCESSOR_FILE)


def write_hf_tokenizer(out_dir, tokenizer, form, model_max_length: int | None = None,
                       input_names: tuple[str, ...] | None = None) -> None:
    """tokenizer.json + tokenizer_config.json beside an export, so that transformers'
    AutoTokenizer.from_pretrained(out_dir) encodes and decodes as `tokenizer` (one of
    attention_jax.data's; `form` its hf_form()) does: the same ids for a text, its
    special tokens by role. input_names: what the tokenizer gives the model (a BERT's
    token_type_ids, which tell a pair's two texts apart). Without a tokenizer, an earlier
    export's files are removed: they would pass for this model's."""
    if tokenizer is None:
        _remove_stale([n for n in TOKENIZER_FILES if os.path.exists(os.path.join(out_dir, n))],
                      out_dir, lambda name: os.remove(os.path.join(out_dir, name)))
        return
    form.no_truncation()
    form.no_padding()
    form.save(os.path.join(out_dir, "tokenizer.json"))
    roles = {f"{role}_token": form.id_to_token(i) for role, i in tokenizer.hf_roles().items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles,
              # WordPiece's decoding joins pieces with spaces; the others decode exactly.
              "clean_up_tokenization_spaces": tokenizer.kind == "wordpiece",
              # Ours encode "<eos>" in a text as its characters (bytes), not as the token.
              "split_special_tokens": tokenizer.kind in ("char", "byte")}
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    if input_names:
        config["model_input_names"] = list(input_names)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_hf_image_processor(out_dir, preprocess) -> None:
    """preprocessor_config.json beside a ViT export, so that transformers'
    AutoImageProcessor (and pipeline("image-classification")) reads an image as the run
    read its eval images (`preprocess`: the run's data.images.Preprocess,
    run.task.eval_transform): its shorter side resized to image_size and the centre cut
    (CLIPImageProcessor's steps, bilinear: data.images.resize_centre's), then x/255 and
    (x - mean) / std per channel: any image comes out the same to float rounding (with
    transformers' PIL processor; its torchvision one, where torchvision is installed and
    chosen, interpolates its own way). A one-channel model's
    processor converts nothing: give it grey images, through the processor and the model
    (transformers' pipeline converts every image to RGB first). Two more differences
    are transformers' own: its pipeline turns a photo by its EXIF orientation tag (the
    run reads the pixels as stored) and clips a 16-bit image to 8 bits (the run scales
    it), and its processor called directly puts an RGBA image on white (the run drops the
    alpha). Without `preprocess`, an earlier export's file is removed."""
    file = os.path.join(out_dir, IMAGE_PROCESSOR_FILE)
    if preprocess is None:
        if os.path.exists(file):
            os.remove(file)
        return
    size, channels = int(preprocess.image_size), int(preprocess.channels)
    per_channel = lambda v: [float(x) for x in (tuple(v) * channels if len(v) == 1 else v)]  # noqa: E731
    config = {"image_processor_type": "CLIPImageProcessor",
              "do_resize": True, "size": {"shortest_edge": size}, "resample": 2,  # bilinear
              "do_center_crop": True, "crop_size": {"height": size, "width": size},
              "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": per_channel(preprocess.mean),
              "image_std": per_channel(preprocess.std), "do_convert_rgb": channels == 3}
    with open(file, "w") as f:
        json.dump(config, f, indent=2)
