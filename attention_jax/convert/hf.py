"""Hugging Face checkpoints <-> this project's GPT, BERT and ViT.

    ckpt = load_hf("path/to/dir")          # config.json + model.safetensors (or pytorch_model.bin)
    out, aux = ckpt.model.apply({"params": ckpt.params}, inputs)
    export_hf(ckpt.model, ckpt.params, "out_dir")       # GPT-2 and BERT, readable by transformers
    params = init_params_from_hf("path/to/dir", model)  # warm start a model of our own config

Supported: GPT-2 (GPT2LMHeadModel, GPT2Model), BERT (BertModel, BertForMaskedLM,
BertForPreTraining, BertForSequenceClassification) and ViT (ViTModel,
ViTForImageClassification). Reading safetensors needs only numpy; pytorch_model.bin
needs torch, imported only then.

How a family maps onto our parameters is a list of `Rule`s: one of our parameters, the
checkpoint tensors it is made of, their shapes, and a `kind` of layout change (PyTorch
`nn.Linear` stores [out, in], GPT-2's `Conv1D` [in, out], our kernels [in, out] with
heads split out: [D, 3, N, H] for the fused q/k/v). The same rules run backwards for
export, and name every missing, unexpected or mis-shaped tensor before anything is
converted, so nothing is dropped silently. The only tensors skipped without an error
are PyTorch buffers that are not parameters (`position_ids`, GPT-2's causal-mask
`attn.bias`) and tied copies, which are checked to equal the tensor they copy.

Options in config.json that change the function (GELU variant, LayerNorm epsilon,
untied embeddings, relative positions, cross-attention, ...) become config fields or a
ValueError naming the option. Dropout rates are copied for fine-tuning; our attention
dropout acts on per-head outputs (layers/attention.py), so training noise differs from
PyTorch's, while evaluation (no dropout) is the same function.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import re
import warnings
import zlib
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.models import bert, gpt, vit

__all__ = ["HFCheckpoint", "ConversionError", "load_hf", "read_hf_dir", "config_from_hf",
           "export_hf", "init_params_from_hf", "restore_params_from_hf", "hf_model_overrides"]


class ConversionError(ValueError):
    """Checkpoint tensors that do not fit the model: every offending name is listed."""


# ============================================================================ reading files


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


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a model dir: single file or sharded (an index.json naming the shards)."""
    for name, reader in (("model.safetensors", _read_safetensors),
                         ("pytorch_model.bin", _read_torch)):
        if os.path.exists(os.path.join(path, name)):
            return reader(os.path.join(path, name))
        index = os.path.join(path, name + ".index.json")
        if os.path.exists(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            out = {}
            for shard in shards:
                out.update(reader(os.path.join(path, shard)))
            return out
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin (nor a sharded "
                            f"*.index.json); files there: {sorted(os.listdir(path))}")


def read_hf_dir(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json as a dict, {tensor name: float32 array}) of a Hugging Face model dir.

    Legacy TF-era names (LayerNorm.gamma / .beta) are renamed to weight / bias, as
    transformers itself does on load."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory; expected a Hugging Face model "
                                f"dir with config.json and model.safetensors or pytorch_model.bin")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"{path}: no config.json (the model's architecture); files "
                                f"there: {sorted(os.listdir(path))}")
    with open(cfg_file) as f:
        hf_cfg = json.load(f)
    tensors = {}
    for name, x in _read_tensors(path).items():
        name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
        tensors[name] = np.asarray(x, np.float32) if np.issubdtype(x.dtype, np.floating) or \
            x.dtype.name == "bfloat16" else np.asarray(x)
    return hf_cfg, tensors


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


def _copy(ours, hf, shape, **kw) -> Rule:
    return Rule(ours, (hf,), (tuple(shape),), "copy", **kw)


def _linear(ours, hf, d_in, d_out, **kw) -> list[Rule]:
    """An nn.Linear(d_in, d_out) -> our Dense `ours` (kernel [in, out] + bias)."""
    return [Rule(f"{ours}/kernel", (f"{hf}.weight",), ((d_out, d_in),), "linear", **kw),
            _copy(f"{ours}/bias", f"{hf}.bias", (d_out,), **kw)]


def _layernorm(ours, hf, d, **kw) -> list[Rule]:
    return [_copy(f"{ours}/scale", f"{hf}.weight", (d,), **kw),
            _copy(f"{ours}/bias", f"{hf}.bias", (d,), **kw)]


def _attention(ours, q, k, v, out, d) -> list[Rule]:
    """Separate q/k/v nn.Linear (BERT, ViT) -> our fused qkv [D, 3, N, H] and out [N, H, D]."""
    names = [f"{x}.weight" for x in (q, k, v)]
    biases = [f"{x}.bias" for x in (q, k, v)]
    return [Rule(f"{ours}/qkv", tuple(names), ((d, d),) * 3, "stack_linear"),
            Rule(f"{ours}/qkv_bias", tuple(biases), ((d,),) * 3, "stack"),
            Rule(f"{ours}/out", (f"{out}.weight",), ((d, d),), "linear"),
            _copy(f"{ours}/out_bias", f"{out}.bias", (d,))]


# PyTorch buffers saved with some checkpoints: not parameters, derived from the config.
_BUFFERS = re.compile(r"(^|\.)(position_ids|token_type_ids)$|(^|\.)attn\.(masked_)?bias$")

# config.json activation names -> ours. "gelu_new"/"gelu_pytorch_tanh" are the tanh
# approximation GPT-2 was trained with; "gelu" is the exact erf form (BERT, ViT).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu", "silu": "silu", "swish": "silu"}
_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def _activation(hf_cfg, key, default) -> str:
    name = hf_cfg.get(key, default)
    if name not in _ACTIVATIONS:
        raise ValueError(f"config.json {key}={name!r} is not supported; valid: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _require(hf_cfg, key, expected, why) -> None:
    """Raises unless config.json's `key` has the one value our model implements."""
    value = hf_cfg.get(key, expected)
    if value != expected:
        raise ValueError(f"config.json {key}={value!r} is not supported ({why}); "
                         f"valid: {expected!r}")


def _num_labels(hf_cfg) -> int:
    if "num_labels" in hf_cfg:
        return int(hf_cfg["num_labels"])
    return len(hf_cfg.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})  # transformers' default


# =============================================================================== families


class _Family(abc.ABC):
    """What differs between GPT-2, BERT and ViT: config mapping, rules, model, heads."""

    model_type = ""
    prefix = ""  # how head models prefix the base model's tensors
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
                         f"valid: GPT-2 and BERT")

    @abc.abstractmethod
    def dummy_input(self, cfg):
        """Implemented per family."""


class _GPT2(_Family):
    model_type = "gpt2"
    prefix = "transformer."
    architectures = ("GPT2LMHeadModel", "GPT2Model")
    base_architecture = "GPT2Model"
    head_paths = ("lm_head/",)
    config_cls = gpt.GPTConfig

    def guess_architecture(self, tensors):
        return "GPT2LMHeadModel" if any(k.startswith(self.prefix) or k == "lm_head.weight"
                                        for k in tensors) else "GPT2Model"

    def config(self, hf_cfg, arch):
        _require(hf_cfg, "add_cross_attention", False, "a decoder-only model")
        _require(hf_cfg, "scale_attn_weights", True, "attention is always scaled by 1/sqrt(H)")
        _require(hf_cfg, "scale_attn_by_inverse_layer_idx", False, "no per-layer attention scaling")
        # GPT2Model has no LM head: our logits are then h·wteᵀ, the tied head.
        tie = arch == "GPT2Model" or bool(hf_cfg.get("tie_word_embeddings", True))
        return gpt.GPTConfig(
            vocab_size=hf_cfg["vocab_size"], max_len=hf_cfg["n_positions"],
            num_layers=hf_cfg["n_layer"], embed_dim=hf_cfg["n_embd"], num_heads=hf_cfg["n_head"],
            mlp_dim=hf_cfg.get("n_inner"), activation=_activation(hf_cfg, "activation_function", "gelu_new"),
            norm_epsilon=hf_cfg.get("layer_norm_epsilon", 1e-5), tie_embeddings=tie,
            dropout_rate=hf_cfg.get("resid_pdrop", 0.0))

    def rules(self, c: gpt.GPTConfig, arch):
        d, f, v = c.embed_dim, c.mlp_dim or 4 * c.embed_dim, c.vocab_size
        rules = [_copy("token_embedding/embedding", "wte.weight", (v, d)),
                 _copy("position_embedding/embedding", "wpe.weight", (c.max_len, d))]
        for i in range(c.num_layers):
            o, p = f"decoder/layer_{i}/", f"h.{i}."
            # GPT-2's Conv1D stores [in, out]; c_attn's 3D outputs are q | k | v, each
            # head-major, so a reshape gives our [D, 3, N, H] without moving numbers.
            rules += [*_layernorm(o + "self_attention_norm", p + "ln_1", d),
                      _copy(o + "self_attention/qkv", p + "attn.c_attn.weight", (d, 3 * d)),
                      _copy(o + "self_attention/qkv_bias", p + "attn.c_attn.bias", (3 * d,)),
                      _copy(o + "self_attention/out", p + "attn.c_proj.weight", (d, d)),
                      _copy(o + "self_attention/out_bias", p + "attn.c_proj.bias", (d,)),
                      *_layernorm(o + "mlp_norm", p + "ln_2", d),
                      _copy(o + "mlp/wi/kernel", p + "mlp.c_fc.weight", (d, f)),
                      _copy(o + "mlp/wi/bias", p + "mlp.c_fc.bias", (f,)),
                      _copy(o + "mlp/wo/kernel", p + "mlp.c_proj.weight", (f, d)),
                      _copy(o + "mlp/wo/bias", p + "mlp.c_proj.bias", (d,))]
        rules += _layernorm("final_norm", "ln_f", d)
        if not c.tie_embeddings:
            rules.append(Rule("lm_head/kernel", ("lm_head.weight",), ((v, d),), "linear", base=False))
        return rules

    def aliases(self, c, arch):
        return {"lm_head.weight": "wte.weight"} if c.tie_embeddings else {}

    def model(self, c, arch):
        return gpt.GPT(c)

    def arch_fields(self, c: gpt.GPTConfig):
        return dict(vocab_size=c.vocab_size, max_len=c.max_len, num_layers=c.num_layers,
                    embed_dim=c.embed_dim, num_heads=c.num_heads,
                    num_kv_heads=c.num_kv_heads or c.num_heads, mlp=c.mlp,
                    mlp_dim=c.mlp_dim or 4 * c.embed_dim, activation=c.activation, norm=c.norm,
                    norm_epsilon=c.norm_epsilon, position=c.position,
                    tie_embeddings=c.tie_embeddings, use_bias=c.use_bias)

    def hf_config(self, c: gpt.GPTConfig, arch):
        unsupported = {"position": ("learned", c.position), "norm": ("layernorm", c.norm),
                       "mlp": ("mlp", c.mlp), "use_bias": (True, c.use_bias),
                       "num_kv_heads": (c.num_heads, c.num_kv_heads or c.num_heads)}
        for field, (want, got) in unsupported.items():
            if want != got:
                raise ValueError(f"GPTConfig.{field}={got!r} has no GPT-2 equivalent; valid: {want!r}")
        if c.activation not in _ACTIVATION_NAMES:
            raise ValueError(f"GPTConfig.activation={c.activation!r} has no GPT-2 name; "
                             f"valid: {sorted(_ACTIVATION_NAMES)}")
        return {"model_type": "gpt2", "architectures": [arch], "vocab_size": c.vocab_size,
                "n_positions": c.max_len, "n_embd": c.embed_dim, "n_layer": c.num_layers,
                "n_head": c.num_heads, "n_inner": c.mlp_dim,
                "activation_function": _ACTIVATION_NAMES[c.activation],
                "layer_norm_epsilon": c.norm_epsilon, "tie_word_embeddings": c.tie_embeddings,
                "resid_pdrop": c.dropout_rate, "embd_pdrop": c.dropout_rate, "attn_pdrop": 0.0,
                "bos_token_id": None, "eos_token_id": None}

    def dummy_input(self, c):
        return (jnp.zeros((1, 1), jnp.int32),), {}


class _Bert(_Family):
    model_type = "bert"
    prefix = "bert."
    architectures = ("BertModel", "BertForMaskedLM", "BertForPreTraining",
                     "BertForSequenceClassification")
    base_architecture = "BertModel"
    head_paths = ("pooler/", "nsp/", "classifier/", "mlm_transform/", "mlm_norm/", "mlm_bias")
    config_cls = bert.BertConfig
    HEADS = {"BertModel": "encoder", "BertForMaskedLM": "pretraining",
             "BertForPreTraining": "pretraining", "BertForSequenceClassification": "classification"}

    def guess_architecture(self, tensors):
        if "cls.seq_relationship.weight" in tensors:
            return "BertForPreTraining"
        if "cls.predictions.bias" in tensors:
            return "BertForMaskedLM"
        return "BertForSequenceClassification" if "classifier.weight" in tensors else "BertModel"

    def config(self, hf_cfg, arch):
        _require(hf_cfg, "position_embedding_type", "absolute", "learned absolute positions")
        _require(hf_cfg, "is_decoder", False, "a bidirectional encoder")
        _require(hf_cfg, "add_cross_attention", False, "an encoder without cross-attention")
        if arch in ("BertForMaskedLM", "BertForPreTraining"):
            _require(hf_cfg, "tie_word_embeddings", True, "the MLM output matrix is the word embedding")
        return bert.BertConfig(
            vocab_size=hf_cfg["vocab_size"], d_model=hf_cfg["hidden_size"],
            num_layers=hf_cfg["num_hidden_layers"], num_heads=hf_cfg["num_attention_heads"],
            mlp_dim=hf_cfg["intermediate_size"], max_positions=hf_cfg.get("max_position_embeddings", 512),
            type_vocab_size=hf_cfg.get("type_vocab_size", 2), num_labels=_num_labels(hf_cfg),
            activation=_activation(hf_cfg, "hidden_act", "gelu"),
            layer_norm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
            dropout_rate=hf_cfg.get("hidden_dropout_prob", 0.1),
            attention_dropout_rate=hf_cfg.get("attention_probs_dropout_prob", 0.1),
            initializer_range=hf_cfg.get("initializer_range", 0.02))

    def rules(self, c: bert.BertConfig, arch):
        d, f, v = c.d_model, c.mlp_dim, c.vocab_size
        e = "embeddings."
        rules = [_copy("word_embeddings/embedding", e + "word_embeddings.weight", (v, d)),
                 _copy("position_embeddings/embedding", e + "position_embeddings.weight",
                       (c.max_positions, d)),
                 _copy("token_type_embeddings/embedding", e + "token_type_embeddings.weight",
                       (c.type_vocab_size, d)),
                 *_layernorm("embeddings_norm", e + "LayerNorm", d)]
        for i in range(c.num_layers):
            o, p = f"encoder/layer_{i}/", f"encoder.layer.{i}."
            a = p + "attention."
            # Post-norm: attention.output.LayerNorm follows the residual add of the
            # attention sublayer, output.LayerNorm that of the feed-forward.
            rules += [*_attention(o + "self_attention", a + "self.query", a + "self.key",
                                  a + "self.value", a + "output.dense", d),
                      *_layernorm(o + "self_attention_norm", a + "output.LayerNorm", d),
                      *_linear(o + "mlp/wi", p + "intermediate.dense", d, f),
                      *_linear(o + "mlp/wo", p + "output.dense", f, d),
                      *_layernorm(o + "mlp_norm", p + "output.LayerNorm", d)]
        if arch != "BertForMaskedLM":  # transformers builds BertForMaskedLM without a pooler
            # BertModel(add_pooling_layer=False) saves none either.
            rules += _linear("pooler", "pooler.dense", d, d, optional=arch == "BertModel")
        if arch in ("BertForMaskedLM", "BertForPreTraining"):
            t = "cls.predictions."
            rules += [*_linear("mlm_transform", t + "transform.dense", d, d, base=False),
                      *_layernorm("mlm_norm", t + "transform.LayerNorm", d, base=False),
                      _copy("mlm_bias", t + "bias", (v,), base=False)]
        if arch == "BertForPreTraining":
            rules += _linear("nsp", "cls.seq_relationship", d, 2, base=False)
        if arch == "BertForSequenceClassification":
            rules += _linear("classifier", "classifier", d, c.num_labels, base=False)
        return rules

    def aliases(self, c, arch):
        return {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def model(self, c, arch):
        return bert.Bert(c, head=self.HEADS[arch])

    def arch_fields(self, c: bert.BertConfig):
        return dict(vocab_size=c.vocab_size, d_model=c.d_model, num_layers=c.num_layers,
                    num_heads=c.num_heads, mlp_dim=c.mlp_dim, max_positions=c.max_positions,
                    type_vocab_size=c.type_vocab_size, activation=c.activation,
                    layer_norm_epsilon=c.layer_norm_epsilon,
                    position_embeddings=c.position_embeddings)

    def hf_config(self, c: bert.BertConfig, arch):
        if not c.position_embeddings:
            raise ValueError("BertConfig.position_embeddings=False has no BERT equivalent; valid: True")
        if c.activation not in _ACTIVATION_NAMES:
            raise ValueError(f"BertConfig.activation={c.activation!r} has no BERT name; "
                             f"valid: {sorted(_ACTIVATION_NAMES)}")
        out = {"model_type": "bert", "architectures": [arch], "vocab_size": c.vocab_size,
               "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
               "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
               "hidden_act": _ACTIVATION_NAMES[c.activation],
               "hidden_dropout_prob": c.dropout_rate,
               "attention_probs_dropout_prob": c.attention_dropout_rate,
               "max_position_embeddings": c.max_positions, "type_vocab_size": c.type_vocab_size,
               "initializer_range": c.initializer_range, "layer_norm_eps": c.layer_norm_epsilon,
               "position_embedding_type": "absolute", "pad_token_id": 0,
               "tie_word_embeddings": True}
        if arch == "BertForSequenceClassification":
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(c.num_labels)}
        return out

    def dummy_input(self, c):
        return (jnp.zeros((1, 1), jnp.int32),), {}


class _ViT(_Family):
    model_type = "vit"
    prefix = "vit."
    architectures = ("ViTModel", "ViTForImageClassification")
    base_architecture = "ViTModel"
    head_paths = ("head/",)
    config_cls = vit.ViTConfig

    def guess_architecture(self, tensors):
        return "ViTForImageClassification" if "classifier.weight" in tensors else "ViTModel"

    @staticmethod
    def _square(hf_cfg, key, default):
        value = hf_cfg.get(key, default)
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ValueError(f"config.json {key}={value!r} is not square; valid: one side")
            value = value[0]
        return int(value)

    def config(self, hf_cfg, arch):
        if _activation(hf_cfg, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"config.json hidden_act={hf_cfg['hidden_act']!r} is not supported "
                             f"(our ViT uses the exact GELU); valid: 'gelu'")
        _require(hf_cfg, "qkv_bias", True, "q/k/v projections have biases")
        num_classes = _num_labels(hf_cfg)
        if num_classes <= 0:
            raise ValueError(f"config.json num_labels={num_classes} (no classifier) is not "
                             f"supported; valid: num_labels >= 1")
        return vit.ViTConfig(
            image_size=self._square(hf_cfg, "image_size", 224),
            patch_size=self._square(hf_cfg, "patch_size", 16),
            num_channels=hf_cfg.get("num_channels", 3), d_model=hf_cfg["hidden_size"],
            num_layers=hf_cfg["num_hidden_layers"], num_heads=hf_cfg["num_attention_heads"],
            mlp_dim=hf_cfg["intermediate_size"], num_classes=num_classes, pool="cls",
            layer_norm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
            dropout_rate=hf_cfg.get("hidden_dropout_prob", 0.0),
            attention_dropout_rate=hf_cfg.get("attention_probs_dropout_prob", 0.0))

    def rules(self, c: vit.ViTConfig, arch):
        d, f, p = c.d_model, c.mlp_dim, c.patch_size
        e = "embeddings."
        rules = [Rule("patch_embedding", (e + "patch_embeddings.projection.weight",),
                      ((d, c.num_channels, p, p),), "conv"),
                 _copy("patch_bias", e + "patch_embeddings.projection.bias", (d,)),
                 _copy("cls", e + "cls_token", (1, 1, d)),
                 _copy("position_embeddings", e + "position_embeddings", (1, 1 + c.grid_size ** 2, d))]
        for i in range(c.num_layers):
            o, q = f"encoder/layer_{i}/", f"encoder.layer.{i}."
            a = q + "attention."
            # Pre-norm: layernorm_before feeds attention, layernorm_after the MLP.
            rules += [*_layernorm(o + "self_attention_norm", q + "layernorm_before", d),
                      *_attention(o + "self_attention", a + "attention.query", a + "attention.key",
                                  a + "attention.value", a + "output.dense", d),
                      *_layernorm(o + "mlp_norm", q + "layernorm_after", d),
                      *_linear(o + "mlp/wi", q + "intermediate.dense", d, f),
                      *_linear(o + "mlp/wo", q + "output.dense", f, d)]
        rules += _layernorm("encoder_norm", "layernorm", d)
        if arch == "ViTForImageClassification":
            rules += _linear("head", "classifier", d, c.num_classes, base=False)
        return rules

    def unused(self, arch):
        # ViTModel's pooler (dense + tanh on [CLS]) is not part of our ViT, whose
        # classifier reads the [CLS] state directly as ViTForImageClassification does.
        return ("pooler.dense.weight", "pooler.dense.bias") if arch == "ViTModel" else ()

    def model(self, c, arch):
        return vit.ViT(c)

    def arch_fields(self, c: vit.ViTConfig):
        return dict(patch_size=c.patch_size, num_channels=c.num_channels, d_model=c.d_model,
                    num_layers=c.num_layers, num_heads=c.num_heads, mlp_dim=c.mlp_dim,
                    layer_norm_epsilon=c.layer_norm_epsilon, pool=c.pool,
                    position_embeddings=c.position_embeddings)

    def dummy_input(self, c):
        return (jnp.zeros((1, c.image_size, c.image_size, c.num_channels)),), {}


FAMILIES: dict[str, _Family] = {f.model_type: f for f in (_GPT2(), _Bert(), _ViT())}


def _family(hf_cfg) -> _Family:
    model_type = hf_cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                         f"valid: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _family_of(cfg) -> _Family:
    for family in FAMILIES.values():
        if isinstance(cfg, family.config_cls):
            return family
    raise ValueError(f"{type(cfg).__name__} has no Hugging Face mapping; valid: "
                     f"{[f.config_cls.__name__ for f in FAMILIES.values()]}")


def config_from_hf(path_or_config) -> tuple[Any, str]:
    """(our model config, HF architecture name) implied by a model dir or config.json dict."""
    hf_cfg = path_or_config
    if not isinstance(hf_cfg, dict):
        with open(os.path.join(os.fspath(path_or_config), "config.json")) as f:
            hf_cfg = json.load(f)
    family = _family(hf_cfg)
    arch = family.architecture(hf_cfg, {})
    return family.config(hf_cfg, arch), arch


# ============================================================================ conversion


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


def _strip_boxes(tree):
    """Params without flax's partitioning boxes. Not nn.meta.unbox: inside a mesh context
    (the trainer's) that applies sharding constraints, which abstract values refuse."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
    strip = lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x.unbox()
    return jax.tree.map(lambda x: strip(x) if is_box(x) else x, tree, is_leaf=is_box)


def _shapes(model: nn.Module, cfg, family: _Family) -> dict[str, tuple[int, ...]]:
    args, kwargs = family.dummy_input(cfg)
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args, **kwargs))
    return {k: tuple(v.shape) for k, v in flatten(_strip_boxes(abstract["params"])).items()}


def _unscanned(cfg):
    """Rules name layers one by one; a scanned model is converted unscanned, then stacked."""
    return dataclasses.replace(cfg, scan_layers=False)


def _convert(family: _Family, cfg, arch, tensors: dict[str, np.ndarray],
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

    missing, mismatched, out = [], [], {}
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
            continue
        out[rule.ours] = rule.to_ours(arrays, shapes[rule.ours])
        used.update(rule.hf)

    for alias, source in family.aliases(cfg, arch).items():
        if alias in tensors and source in tensors:
            if tensors[alias].shape != tensors[source].shape or \
                    not np.array_equal(tensors[alias], tensors[source]):
                mismatched.append(f"{quoted(alias)}: differs from {quoted(source)}, which it must "
                                  f"equal (tied weights; untied ones are not supported)")
            used.add(alias)
    unused = [quoted(n) for n in family.unused(arch) if n in tensors]
    used.update(n for n in family.unused(arch))
    unexpected = [f"{quoted(n)} {tuple(tensors[n].shape)}" for n in sorted(tensors)
                  if n not in used and not _BUFFERS.search(n)]
    if missing or unexpected or mismatched:
        raise ConversionError(_describe(f"checkpoint tensors do not fit {arch}", missing,
                                        unexpected, mismatched))
    if unused:
        warnings.warn(f"{arch}: tensors with no counterpart in our model, not loaded: {unused}",
                      stacklevel=3)
    return out, unused


def _describe(title, missing=(), unexpected=(), mismatched=(), limit=20) -> str:
    lines = [title + ":"]
    for label, items in (("missing", missing), ("unexpected", unexpected),
                         ("shape mismatch", mismatched)):
        for item in list(items)[:limit]:
            lines.append(f"  {label}: {item}")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more {label}")
    return "\n".join(lines)


@dataclasses.dataclass
class HFCheckpoint:
    """A converted checkpoint: `model.apply({"params": params}, ...)` is the HF model.

    synthesized: our parameters the HF architecture has no tensors for, set to zero
      (BertForMaskedLM has no pooler or NSP head; ViTModel no classifier). They do not
      touch the outputs the architecture defines (MLM logits; ViT tokens/pooled).
    unused: tensors with no counterpart here (ViTModel's pooler); also warned about.
    """

    model: nn.Module
    config: Any
    params: dict
    architecture: str
    hf_config: dict
    synthesized: list[str]
    unused: list[str]


def load_hf(path, *, implementation: Optional[str] = None, dtype: str = "float32",
            scan_layers: bool = False) -> HFCheckpoint:
    """Loads a Hugging Face model dir as our model + params (float32 numpy leaves, or
    `dtype` for the compute dtype). implementation: the attention backend."""
    hf_cfg, tensors = read_hf_dir(path)
    family = _family(hf_cfg)
    arch = family.architecture(hf_cfg, tensors)
    cfg = family.config(hf_cfg, arch)
    model = family.model(cfg, arch)
    shapes = _shapes(model, cfg, family)
    converted, unused = _convert(family, cfg, arch, tensors, shapes)
    synthesized = []
    flat = {}
    for name, shape in shapes.items():
        if name not in converted:
            if not name.startswith(family.head_paths):
                raise ConversionError(f"internal: {arch} leaves our parameter {name} unset")
            synthesized.append(name)
            flat[name] = np.zeros(shape, np.float32)
        else:
            flat[name] = converted[name]
    overrides = {"dtype": dtype}
    if implementation is not None:
        overrides["implementation"] = implementation
    if scan_layers:
        overrides["scan_layers"] = True
        flat = _stack_layers(flat)
    cfg = dataclasses.replace(cfg, **overrides)
    model = model.clone(config=cfg)
    return HFCheckpoint(model, cfg, unflatten(flat), arch, hf_cfg, synthesized, unused)


# ======================================================================== scanned layers

_LAYER = re.compile(r"^(.*)/layer_(\d+)/(.*)$")


def _stack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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


def _unstack_layers(flat: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, x in flat.items():
        head, sep, tail = name.partition("/layers/")
        if sep:
            for i, layer in enumerate(np.asarray(x)):
                out[f"{head}/layer_{i}/{tail}"] = layer
        else:
            out[name] = np.asarray(x)
    return out


# ================================================================================ export


def _model_parts(model_or_config, head=None):
    cfg = getattr(model_or_config, "config", model_or_config)
    family = _family_of(cfg)
    head = head or getattr(model_or_config, "head", None)
    return cfg, family, head


_EXPORT_ARCH = {("gpt2", None): "GPT2LMHeadModel", ("bert", "pretraining"): "BertForPreTraining",
                ("bert", "classification"): "BertForSequenceClassification",
                ("bert", "encoder"): "BertModel"}


def export_hf(model: nn.Module, params, out_dir, *, architecture: Optional[str] = None) -> str:
    """Writes config.json + model.safetensors that transformers loads as the same model.

    model: a GPT or Bert module (its config and, for BERT, its head pick the
    architecture: pretraining -> BertForPreTraining, classification ->
    BertForSequenceClassification, encoder -> BertModel). GPT-2 and BERT only; options
    they cannot express (RoPE, RMSNorm, SwiGLU, ...) raise a ValueError naming them.
    """
    cfg, family, head = _model_parts(model)
    arch = architecture or _EXPORT_ARCH.get((family.model_type, head if family.model_type == "bert" else None))
    if arch is None or arch not in family.architectures:
        raise ValueError(f"cannot export {type(model).__name__} as {arch!r}; valid: "
                         f"{list(family.architectures)}")
    hf_cfg = family.hf_config(cfg, arch)  # raises for families or options without an HF form
    flat = _unstack_layers(flatten(_strip_boxes(params)))
    unit = _unscanned(cfg)
    shapes = _shapes(family.model(unit, arch), unit, family)
    rules = family.rules(unit, arch)
    wanted = {r.ours for r in rules}
    missing = [f"{r.ours} {shapes[r.ours]}" for r in rules if r.ours not in flat]
    mismatched = [f"{r.ours}: params {np.shape(flat[r.ours])}, model {shapes[r.ours]}"
                  for r in rules if r.ours in flat and tuple(np.shape(flat[r.ours])) != shapes[r.ours]]
    # Parameters of a head the architecture lacks would be lost: refuse instead.
    unexpected = [n for n in flat if n not in wanted]
    if missing or unexpected or mismatched:
        raise ConversionError(_describe(f"params do not fit {arch}", missing, unexpected, mismatched))
    prefix = family.prefix if arch != family.base_architecture else ""
    tensors = {}
    for rule in rules:
        for name, x in zip(rule.hf, rule.to_hf(flat[rule.ours])):
            tensors[(prefix if rule.base else "") + name] = x
    os.makedirs(out_dir, exist_ok=True)
    from safetensors.numpy import save_file
    # transformers checks the "format" metadata to know the layout is PyTorch's.
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    return os.fspath(out_dir)


# ============================================================================ warm start


def hf_model_overrides(path) -> dict[str, Any]:
    """The `config.model` fields a checkpoint implies (for an experiment config), e.g.
    {'d_model': 384, 'num_layers': 6, 'activation': 'gelu', ...}."""
    cfg, _ = config_from_hf(path)
    return _family_of(cfg).arch_fields(cfg)


def _fresh_numpy(path: str, shape, seed: int = 0) -> np.ndarray:
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


def _fit(family: _Family, converted: dict[str, np.ndarray], target: dict[str, tuple],
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
        converted = _stack_layers(converted)
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
        raise ConversionError(_describe(f"checkpoint {where} does not fit the model (set "
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


def _check_architecture(family: _Family, implied, cfg, path) -> None:
    ours, theirs = family.arch_fields(cfg), family.arch_fields(implied)
    bad = []
    for field, want in theirs.items():
        have = ours[field]
        if field == "vocab_size" and have >= want:
            continue  # padded vocabulary: extra rows are zero
        if have != want:
            bad.append(f"{field}={have!r} (checkpoint: {want!r})")
    if bad:
        raise ValueError(f"model config does not match the checkpoint {path}: "
                         f"{', '.join(bad)}; set these fields to the checkpoint's values")


def _load_converted(path):
    hf_cfg, tensors = read_hf_dir(path)
    family = _family(hf_cfg)
    arch = family.architecture(hf_cfg, tensors)
    implied = family.config(hf_cfg, arch)
    model = family.model(implied, arch)
    converted, _ = _convert(family, implied, arch, tensors, _shapes(model, implied, family))
    return family, implied, arch, converted


def init_params_from_hf(path, model: nn.Module, *, seed: int = 0, verbose: bool = True) -> dict:
    """Params for `model` (a GPT, Bert or ViT of our own config) from an HF checkpoint:
    fine-tuning's starting point.

    The model's architecture fields (width, depth, heads, activation, epsilon, ...) must
    match the checkpoint's (ValueError naming the ones that differ); its vocabulary may
    be larger, its ViT image size different, and its task head new or of another size
    (initialised as `_fresh_numpy` says, and printed). Returns a float32 params tree
    (numpy leaves) shaped like model.init's.
    """
    family, implied, arch, converted = _load_converted(path)
    cfg = model.config
    if _family_of(cfg) is not family:
        raise ValueError(f"{path} holds a {family.model_type} checkpoint; the model is a "
                         f"{type(model).__name__}")
    _check_architecture(family, implied, cfg, path)
    target = _shapes(model, cfg, family)
    grid = (cfg.grid_size, cfg.grid_size) if family.model_type == "vit" else None
    params, new, unused = _fit(family, converted, target, lambda n, s: _fresh_numpy(n, s, seed),
                               grid, where=os.fspath(path))
    if verbose and (new or unused):
        print(f"init from {path} ({arch}): new heads {new or 'none'}; "
              f"checkpoint heads not used {unused or 'none'}")
    return unflatten(params)


def restore_params_from_hf(path, abstract_params, *, seed: int = 0):
    """`--config.train.init_from=hf:<dir>`: the checkpoint's params placed on the
    shardings of `abstract_params` (a tree of jax.ShapeDtypeStruct), and step 0.

    Only shapes are known here (no model config), so the architecture check is by shape;
    the fields shapes cannot show (activation, LayerNorm epsilon) are printed next to
    the ones the checkpoint implies. New task heads: see `_fresh_numpy`.
    """
    family, implied, arch, converted = _load_converted(path)
    target = flatten(abstract_params)
    grid = None
    if family.model_type == "vit" and "patch_embedding" in target and "position_embeddings" in target:
        # Only the target's table size is known: its grid is sqrt(rows - 1) per side.
        side = int(round((target["position_embeddings"].shape[0] - 1) ** 0.5))
        grid = (side, side)
    params, new, unused = _fit(family, converted, {k: v.shape for k, v in target.items()},
                               lambda n, s: _fresh_numpy(n, s, seed), grid, where=os.fspath(path))
    fields = family.arch_fields(implied)
    unseen = {k: fields[k] for k in fields if k in ("activation", "layer_norm_epsilon", "norm_epsilon")}
    print(f"warm start from {path} ({arch}): config.model must use {unseen}; "
          f"new heads {new or 'none'}; checkpoint heads not used {unused or 'none'}", flush=True)

    def place(name):
        leaf = target[name]
        x = params[name].astype(leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            return jnp.asarray(x)
        # Each device reads its own block: works with one process or many.
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    placed = {name: place(name) for name in target}
    treedef = jax.tree_util.tree_structure(abstract_params)
    return jax.tree_util.tree_unflatten(treedef, [placed[n] for n in target]), 0
