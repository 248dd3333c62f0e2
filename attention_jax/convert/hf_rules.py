"""How a Hugging Face family maps onto our parameters: `Rule`s, the `Family` interface
that hf_gpt2 / hf_bert / hf_vit implement, and `convert_tensors`, which applies a
family's rules and names every tensor that does not fit.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import warnings
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from attention_jax.convert.hf_files import ConversionError, describe

# ================================================================================== rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """One of our parameters ('encoder/layer_0/mlp/wi/kernel') and the HF tensors it is
    made of, with the HF shapes. `kind` is the layout change:
      copy          same numbers, reshaped (GPT-2 Conv1D [in, out] -> [D, 3, N, H], ...)
      linear        nn.Linear [out, in] -> transposed to [in, out], then reshaped
      stack_linear  q, k, v nn.Linear weights -> one fused [D, 3, N, H] kernel
      stack         q, k, v biases -> [3, N, H]
      conv          ViT patch conv [D, C, P, P] -> our [P, P, C, D]
    `base`: the tensor belongs to the base model, whose names a head model prefixes
    ('bert.', 'transformer.', 'vit.'). `optional`: an architecture may leave it out.
    """

    ours: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str = "copy"
    base: bool = True
    optional: bool = False

    def to_ours(self, arrays: list[np.ndarray], shape) -> np.ndarray:
        if self.kind == "copy":
            x = arrays[0]
        elif self.kind == "linear":
            x = arrays[0].T
        elif self.kind == "stack_linear":
            x = np.stack([a.T for a in arrays], axis=1)  # [D, 3, N*H]
        elif self.kind == "stack":
            x = np.stack(arrays, axis=0)  # [3, N*H]
        elif self.kind == "conv":
            x = arrays[0].transpose(2, 3, 1, 0)  # [D, C, P, P] -> [P, P, C, D]
        else:
            raise ValueError(f"rule kind {self.kind!r} is unknown")
        return np.ascontiguousarray(x.reshape(shape))

    def to_hf(self, x: np.ndarray) -> list[np.ndarray]:
        x = np.asarray(x, np.float32)
        if self.kind == "copy":
            out = [x.reshape(self.hf_shapes[0])]
        elif self.kind == "linear":
            out = [x.reshape(self.hf_shapes[0][::-1]).T]
        elif self.kind == "stack_linear":
            x = x.reshape(x.shape[0], len(self.hf), -1)
            out = [x[:, j].T.reshape(s) for j, s in enumerate(self.hf_shapes)]
        elif self.kind == "stack":
            x = x.reshape(len(self.hf), -1)
            out = [x[j].reshape(s) for j, s in enumerate(self.hf_shapes)]
        elif self.kind == "conv":
            out = [x.transpose(3, 2, 0, 1)]
        else:
            raise ValueError(f"rule kind {self.kind!r} is unknown")
        return [np.ascontiguousarray(a) for a in out]


def copy(ours, hf, shape, **kw) -> Rule:
    return Rule(ours, (hf,), (tuple(shape),), "copy", **kw)


def linear(ours, hf, d_in, d_out, **kw) -> list[Rule]:
    """An nn.Linear(d_in, d_out) -> our Dense `ours` (kernel [in, out] + bias)."""
    return [Rule(f"{ours}/kernel", (f"{hf}.weight",), ((d_out, d_in),), "linear", **kw),
            copy(f"{ours}/bias", f"{hf}.bias", (d_out,), **kw)]


def layernorm(ours, hf, d, **kw) -> list[Rule]:
    return [copy(f"{ours}/scale", f"{hf}.weight", (d,), **kw),
            copy(f"{ours}/bias", f"{hf}.bias", (d,), **kw)]


def attention(ours, q, k, v, out, d) -> list[Rule]:
    """Separate q/k/v nn.Linear (BERT, ViT) -> our fused qkv [D, 3, N, H] and out [N, H, D]."""
    names = [f"{x}.weight" for x in (q, k, v)]
    biases = [f"{x}.bias" for x in (q, k, v)]
    return [Rule(f"{ours}/qkv", tuple(names), ((d, d),) * 3, "stack_linear"),
            Rule(f"{ours}/qkv_bias", tuple(biases), ((d,),) * 3, "stack"),
            Rule(f"{ours}/out", (f"{out}.weight",), ((d, d),), "linear"),
            copy(f"{ours}/out_bias", f"{out}.bias", (d,))]


# ======================================================================= config options

# config.json activation names -> ours. "gelu_new"/"gelu_pytorch_tanh" are the tanh
# approximation GPT-2 was trained with; "gelu" is the exact erf form (BERT, ViT).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def activation_from_hf(hf_cfg, key, default) -> str:
    name = hf_cfg.get(key, default)
    if name not in _ACTIVATIONS:
        raise ValueError(f"config.json {key}={name!r} is not supported; valid: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def activation_to_hf(value, field, hf_model) -> str:
    """config.json's name for our activation `value` (of config `field`), for `hf_model`."""
    if value not in _ACTIVATION_NAMES:
        raise ValueError(f"{field}={value!r} has no {hf_model} name; "
                         f"valid: {sorted(_ACTIVATION_NAMES)}")
    return _ACTIVATION_NAMES[value]


def require(hf_cfg, key, expected, why) -> None:
    """Raises unless config.json's `key` has the one value our model implements."""
    value = hf_cfg.get(key, expected)
    if value != expected:
        raise ValueError(f"config.json {key}={value!r} is not supported ({why}); "
                         f"valid: {expected!r}")


def num_labels(hf_cfg) -> int:
    if "num_labels" in hf_cfg:
        return int(hf_cfg["num_labels"])
    return len(hf_cfg.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})  # transformers' default


# ============================================================================== families


class Family(abc.ABC):
    """What differs between GPT-2, BERT and ViT: config mapping, rules, model, heads."""

    model_type = ""
    prefix = ""  # how head models prefix the base model's tensors
    untied = "untied ones are not supported"  # what a tied copy that differs can do
    architectures: tuple[str, ...] = ()
    base_architecture = ""
    head_paths: tuple[str, ...] = ()  # our parameters a warm start may initialise afresh
    config_cls: type = object

    def architecture(self, hf_cfg, tensors) -> str:
        archs = hf_cfg.get("architectures") or [self.guess_architecture(tensors)]
        arch = archs[0]
        if arch not in self.architectures:
            raise ValueError(f"config.json architectures={archs} is not supported for "
                             f"model_type={self.model_type!r}; valid: {list(self.architectures)}")
        return arch

    def guess_architecture(self, tensors) -> str:
        return self.base_architecture

    @abc.abstractmethod
    def config(self, hf_cfg, arch):  # -> our config dataclass
        """Implemented per family."""

    @abc.abstractmethod
    def rules(self, cfg, arch) -> list[Rule]:
        """Implemented per family."""

    @abc.abstractmethod
    def model(self, cfg, arch) -> nn.Module:
        """Implemented per family."""

    def aliases(self, cfg, arch) -> dict[str, str]:
        """Tied copies: {name: name of the tensor it must equal}."""
        return {}

    def unused(self, arch) -> tuple[str, ...]:
        """Tensors of this architecture our model has no place for (reported, not loaded)."""
        return ()

    @abc.abstractmethod
    def arch_fields(self, cfg) -> dict[str, Any]:
        """Config fields that change the function (compared on warm start)."""

    def hf_config(self, cfg, arch) -> dict:
        raise ValueError(f"export to Hugging Face is not supported for {self.model_type!r}; "
                         f"valid: GPT-2, BERT and ViT")

    def dummy_input(self, cfg):
        """(args, kwargs) for model.init: token ids here; ViT overrides with an image."""
        return (jnp.zeros((1, 1), jnp.int32),), {}


# ============================================================================ conversion

# PyTorch buffers saved with some checkpoints: not parameters, derived from the config.
_BUFFERS = re.compile(r"(^|\.)(position_ids|token_type_ids)$|(^|\.)attn\.(masked_)?bias$")


def convert_tensors(family: Family, cfg, arch, tensors: dict[str, np.ndarray],
                    shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Applies the family's rules: ({our path: array} for every rule whose tensors are
    present, [unused tensor names]). Raises ConversionError listing every missing,
    unexpected or mis-shaped tensor."""
    # Head models prefix the base model's names ('bert.encoder...'); strip it, but keep
    # a map back so errors quote the names as they are in the file.
    original = {}
    for name in tensors:
        short = name[len(family.prefix):] if name.startswith(family.prefix) else name
        original[short] = name
    tensors = {short: tensors[name] for short, name in original.items()}
    quoted = lambda n: original.get(n, n)

    missing, mismatched, untied, out = [], [], [], {}
    used = set()
    for rule in family.rules(cfg, arch):
        present = [n in tensors for n in rule.hf]
        if not all(present):
            if not (rule.optional and not any(present)):
                missing += [f"{n} {s}" for n, s, ok in zip(rule.hf, rule.hf_shapes, present) if not ok]
            continue
        arrays = [tensors[n] for n in rule.hf]
        bad = [f"{quoted(n)}: checkpoint {tuple(a.shape)}, expected {s}"
               for n, a, s in zip(rule.hf, arrays, rule.hf_shapes) if tuple(a.shape) != s]
        if rule.ours not in shapes:
            raise ConversionError(f"internal: rule target {rule.ours} is not a parameter of "
                                  f"{type(family).__name__}'s model")
        if bad:
            mismatched += bad
            used.update(rule.hf)  # said as a mismatch, not again as unexpected
            continue
        out[rule.ours] = rule.to_ours(arrays, shapes[rule.ours])
        used.update(rule.hf)

    for alias, source in family.aliases(cfg, arch).items():
        if alias in tensors and source in tensors:
            if tensors[alias].shape != tensors[source].shape or \
                    not np.array_equal(tensors[alias], tensors[source]):
                untied.append(f"{quoted(alias)} differs from {quoted(source)}, to which the "
                              f"architecture ties it ({family.untied})")
            used.add(alias)
    unused = [quoted(n) for n in family.unused(arch) if n in tensors]
    used.update(n for n in family.unused(arch))
    unexpected = [f"{quoted(n)} {tuple(tensors[n].shape)}" for n in sorted(tensors)
                  if n not in used and not _BUFFERS.search(n)]
    if missing or unexpected or mismatched or untied:
        raise ConversionError(describe(f"checkpoint tensors do not fit {arch}", missing,
                                       unexpected, mismatched, untied=untied))
    if unused:
        # stacklevel=3: load_hf's caller.
        warnings.warn(f"{arch}: tensors with no counterpart in our model, not loaded: {unused}",
                      stacklevel=3)
    return out, unused


def export_tensors(family: Family, rules: list[Rule], arch, flat: dict[str, Any]) -> dict[str, np.ndarray]:
    """The rules run backwards: {HF tensor name: array}, prefixed as `arch` names them."""
    prefix = family.prefix if arch != family.base_architecture else ""
    tensors = {}
    for rule in rules:
        for name, x in zip(rule.hf, rule.to_hf(flat[rule.ours])):
            tensors[(prefix if rule.base else "") + name] = x
    return tensors
