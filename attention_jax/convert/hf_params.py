"""Our side of a conversion: params trees as {'encoder/layer_0/mlp/wi/kernel': array},
scanned layers, the shapes a model expects, and fitting converted params onto another
config of the same family (warm start)."""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.convert.hf_files import ConversionError, describe
from attention_jax.convert.hf_rules import Family
from attention_jax.models import vit

# ================================================================================= trees


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def flatten(tree) -> dict[str, Any]:
    """{'encoder/layer_0/mlp/wi/kernel': leaf} of a params tree."""
    return {_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def strip_boxes(tree):
    """Params without flax's partitioning boxes. Not nn.meta.unbox: inside a mesh context
    (the trainer's) that applies sharding constraints, which abstract values refuse."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    strip = lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x.unbox()
    return jax.tree.map(lambda x: strip(x) if is_box(x) else x, tree, is_leaf=is_box)


def param_shapes(model: nn.Module, cfg, family: Family) -> dict[str, tuple[int, ...]]:
    """{path: shape} of the model's params, without computing them."""
    args, kwargs = family.dummy_input(cfg)
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args, **kwargs))
    return {k: tuple(v.shape) for k, v in flatten(strip_boxes(abstract["params"])).items()}


# ======================================================================== scanned layers


def unscanned(cfg):
    """Rules name layers one by one; a scanned model is converted unscanned, then stacked."""
    return dataclasses.replace(cfg, scan_layers=False)


_LAYER = re.compile(r"^(.*)/layer_(\d+)/(.*)$")


def stack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """layer_0 ... layer_{L-1} -> one 'layers' entry with a leading L axis (nn.scan)."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, x in flat.items():
        m = _LAYER.match(name)
        if m:
            groups.setdefault(f"{m[1]}/layers/{m[3]}", {})[int(m[2])] = x
        else:
            out[name] = x
    for name, layers in groups.items():
        out[name] = np.stack([np.asarray(layers[i]) for i in range(len(layers))])
    return out


def unstack_layers(flat: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, x in flat.items():
        head, sep, tail = name.partition("/layers/")
        if sep:
            for i, layer in enumerate(np.asarray(x)):
                out[f"{head}/layer_{i}/{tail}"] = layer
        else:
            out[name] = np.asarray(x)
    return out


# ============================================================================ warm start


def fresh_numpy(path: str, shape, seed: int = 0) -> np.ndarray:
    """A new head's parameter without a model to initialise it: N(0, 0.02²) kernels and
    embeddings (BERT's initializer_range; GPT-2 and ViT use the same std), zero biases,
    unit norm scales."""
    leaf = path.rsplit("/", 1)[-1]
    if leaf == "scale":
        return np.ones(shape, np.float32)
    if "bias" in leaf:
        return np.zeros(shape, np.float32)
    # crc32, not hash(): the same numbers in every process of a multi-host run.
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)


def fit(family: Family, converted: dict[str, np.ndarray], target: dict[str, tuple],
        fresh: Callable[[str, tuple], np.ndarray], grid: Optional[tuple] = None,
        where: str = "") -> tuple[dict[str, np.ndarray], list[str], list[str]]:
    """Fits converted params onto a target {path: shape} (another config of the same
    family). Allowed differences, each reported: a larger vocabulary (our tasks pad it to
    a multiple of 64: extra rows are zero), a ViT position table of another grid
    (resized bilinearly, Dosovitskiy et al. Section 3.2), and task heads the target
    needs but the checkpoint lacks or shapes differently (freshly initialised, the
    fine-tuning recipe). Anything else raises ConversionError naming the parameters.
    Returns (params, [fresh head params], [checkpoint params not used])."""
    if any("/layers/" in k for k in target):
        converted = stack_layers(converted)
    is_head = lambda name: name.startswith(family.head_paths)
    out, new, missing, mismatched = {}, [], [], []
    for name, shape in target.items():
        x = converted.get(name)
        if x is not None and tuple(x.shape) == tuple(shape):
            out[name] = x
        elif x is not None and _vocab_axis(name) is not None and \
                _pads(x.shape, shape, _vocab_axis(name)):
            pad = [(0, s - t) for s, t in zip(shape, x.shape)]
            out[name] = np.pad(x, pad)  # rows for ids the tokenizer never produces
        elif x is not None and name == "position_embeddings" and family.model_type == "vit" \
                and x.shape[1] == shape[1] and grid is not None:
            old = int(round((x.shape[0] - 1) ** 0.5))
            out[name] = np.asarray(vit.interpolate_position_embeddings(
                jnp.asarray(x), (old, old), grid))
        elif is_head(name):
            out[name] = fresh(name, tuple(shape))
            new.append(name if x is None else f"{name} (checkpoint {tuple(x.shape)}, model {tuple(shape)})")
        elif x is None:
            missing.append(f"{name} {tuple(shape)}")
        else:
            mismatched.append(f"{name}: checkpoint {tuple(x.shape)}, model {tuple(shape)}")
    extra = [n for n in converted if n not in target]
    unexpected = [f"{n} {tuple(converted[n].shape)}" for n in extra if not is_head(n)]
    if missing or unexpected or mismatched:
        raise ConversionError(describe(f"checkpoint {where} does not fit the model (set "
                                       f"config.model to the checkpoint's architecture)",
                                       missing, unexpected, mismatched))
    return out, new, [n for n in extra if is_head(n)]


# Embedding-like params whose first axis is the vocabulary: may be padded on warm start.
_VOCAB_PARAMS = ("token_embedding/embedding", "word_embeddings/embedding", "mlm_bias")


def _vocab_axis(name):
    if name in _VOCAB_PARAMS:
        return 0
    return 1 if name == "lm_head/kernel" else None


def _pads(have, want, axis) -> bool:
    return (len(have) == len(want) and have[axis] <= want[axis]
            and all(h == w for i, (h, w) in enumerate(zip(have, want)) if i != axis))
