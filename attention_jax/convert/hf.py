"""Hugging Face checkpoints <-> this project's GPT, BERT and ViT.

    ckpt = load_hf("path/to/dir")          # config.json + model.safetensors (or pytorch_model.bin)
    out, aux = ckpt.model.apply({"params": ckpt.params}, inputs)
    export_hf(ckpt.model, ckpt.params, "out_dir")       # GPT-2, BERT and ViT, readable by transformers
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

This file holds the entry points; the rest of the package, bottom up:
  hf_files.py   reading and writing model dirs (safetensors, pytorch_model.bin, config.json)
  hf_rules.py   Rule, the Family interface, applying rules with every name checked
  hf_gpt2.py, hf_bert.py, hf_vit.py   one Family each: config mapping and rules
  hf_params.py  our params as flat names, scanned layers, fitting for warm start
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention_jax import workdir as workdir_lib
from attention_jax.convert.hf_bert import BertFamily
from attention_jax.convert.hf_files import (ConversionError, describe, export_remote,
                                            read_hf_config, read_hf_dir, write_hf_dir,
                                            write_hf_image_processor, write_hf_tokenizer)
from attention_jax.convert.hf_gpt2 import GPT2Family
from attention_jax.convert.hf_params import (fit, flatten, fresh_numpy, param_shapes,
                                             stack_layers, strip_boxes, unflatten, unscanned,
                                             unstack_layers)
from attention_jax.convert.hf_rules import Family, convert_tensors, export_tensors
from attention_jax.convert.hf_vit import ViTFamily

__all__ = ["HFCheckpoint", "ConversionError", "load_hf", "read_hf_dir", "config_from_hf",
           "export_hf", "init_params_from_hf", "restore_params_from_hf", "hf_model_overrides"]

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GPT2Family(), BertFamily(), ViTFamily())}


def _family(hf_cfg) -> Family:
    model_type = hf_cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                         f"valid: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _family_of(cfg) -> Family:
    for family in FAMILIES.values():
        if isinstance(cfg, family.config_cls):
            return family
    raise ValueError(f"{type(cfg).__name__} has no Hugging Face mapping; valid: "
                     f"{[f.config_cls.__name__ for f in FAMILIES.values()]}")


def config_from_hf(path_or_config) -> tuple[Any, str]:
    """(our model config, HF architecture name) implied by a model dir or config.json dict."""
    hf_cfg = read_hf_config(path_or_config)
    family = _family(hf_cfg)
    arch = family.architecture(hf_cfg, {})
    return family.config(hf_cfg, arch), arch


# ================================================================================ import


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
    shapes = param_shapes(model, cfg, family)
    converted, unused = convert_tensors(family, cfg, arch, tensors, shapes)
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
        flat = stack_layers(flat)
    cfg = dataclasses.replace(cfg, **overrides)
    model = model.clone(config=cfg)
    return HFCheckpoint(model, cfg, unflatten(flat), arch, hf_cfg, synthesized, unused)


# ================================================================================ export

# The architecture a model exports as when `architecture=` is not given.
_EXPORT_ARCH = {("gpt2", None): "GPT2LMHeadModel", ("bert", "pretraining"): "BertForPreTraining",
                ("bert", "classification"): "BertForSequenceClassification",
                ("bert", "encoder"): "BertModel", ("vit", None): "ViTForImageClassification"}
# BertForPreTraining's parts that BertForMaskedLM lacks, which load_hf fills with zeros for
# such a checkpoint: params in which they are all zero (nothing trained there) export as
# BertForMaskedLM by default, the architecture they came from, not with a zero NSP head.
_MLM_ONLY_ZERO = ("pooler/", "nsp/")


def export_hf(model: nn.Module, params, out_dir, *, architecture: Optional[str] = None,
              tokenizer=None, class_names=None, max_length: Optional[int] = None,
              image_preprocess=None) -> str:
    """Writes config.json + model.safetensors that transformers loads as the same model,
    and with `tokenizer` (a run's, `runs.open_run(...).tokenizer`) tokenizer.json +
    tokenizer_config.json that AutoTokenizer loads as the same tokenizer.

    model: a GPT, Bert or ViT module (or its config). Its family and, for BERT, its head
    pick the architecture unless `architecture=` names one: GPT -> GPT2LMHeadModel;
    BERT pretraining -> BertForPreTraining (BertForMaskedLM where its pooler and NSP head
    are all zero, as a loaded BertForMaskedLM's are), classification ->
    BertForSequenceClassification, encoder -> BertModel; ViT ->
    ViTForImageClassification (architecture="ViTModel": params without the "head").
    Options an architecture cannot express (RoPE, RMSNorm, SwiGLU, average pooling, ...)
    raise a ValueError naming them. `class_names` (a classifier's, in label order: a
    run's `run.task.class_names`) become config.json's id2label, which transformers'
    pipelines report (else LABEL_0, LABEL_1, ...). A text classifier's tokenizer goes out
    adding the special tokens its texts were classified with ([CLS] A [SEP] B [SEP],
    token types 0 and 1: tokenization.text_ends), whatever the tokenizer's own file adds.
    max_length: the tokens a text is cut to (a run's data.seq_len), the tokenizer's
    model_max_length, which transformers' truncation=True cuts at (else the model's
    position table). image_preprocess: a ViT run's eval preprocessing
    (run.task.eval_transform), written as preprocessor_config.json, which transformers'
    image pipelines read images with (hf_files.write_hf_image_processor).
    """
    if workdir_lib.is_remote(out_dir):  # staged in a local folder, copied up
        return export_remote(str(out_dir), lambda local: export_hf(
            model, params, local, architecture=architecture, tokenizer=tokenizer,
            class_names=class_names, max_length=max_length,
            image_preprocess=image_preprocess), tokenizer is not None)
    cfg = getattr(model, "config", model)  # a model, or its config
    family = _family_of(cfg)
    head = getattr(model, "head", None) if family.model_type == "bert" else None
    arch = architecture or _EXPORT_ARCH.get((family.model_type, head))
    if arch not in family.architectures:
        raise ValueError(f"export_hf: architecture={architecture!r} cannot export a "
                         f"{type(cfg).__name__} model; valid: {list(family.architectures)}")
    if image_preprocess is not None and family.model_type != "vit":
        raise ValueError(f"export_hf: image_preprocess= given for a {type(cfg).__name__}, "
                         f"which reads no images; valid: image_preprocess=None")
    if image_preprocess is not None and (image_preprocess.image_size, image_preprocess.channels
                                         ) != (cfg.image_size, cfg.num_channels):
        raise ValueError(f"export_hf: image_preprocess makes {image_preprocess.image_size}² "
                         f"images of {image_preprocess.channels} channel(s), the model reads "
                         f"{cfg.image_size}² of {cfg.num_channels}; valid: the run's own "
                         f"(run.task.eval_transform)")
    flat = unstack_layers(flatten(strip_boxes(params)))
    zero = [n for n in flat if n.startswith(_MLM_ONLY_ZERO)]
    if architecture is None and arch == "BertForPreTraining" and zero and not any(
            np.any(np.asarray(flat[n])) for n in zero):
        arch, flat = "BertForMaskedLM", {n: v for n, v in flat.items() if n not in zero}
        print("note: export_hf: the pooler and NSP head are all zero (untrained: a masked-LM "
              "run's, or load_hf's for a BertForMaskedLM): exported as BertForMaskedLM "
              "without them; architecture='BertForPreTraining' keeps them", file=sys.stderr)
    elif architecture is None and arch == "BertForPreTraining" and not any(
            np.any(np.asarray(flat[n])) for n in zero if n.startswith("nsp/")):
        # A masked-LM run warm-started from a BertModel (MiniLM): its pooler came with the
        # checkpoint, its NSP head started at zero and stayed there.
        print("note: export_hf: the NSP head is all zero (untrained) but the pooler is not (a "
              "warm start's): exported as BertForPreTraining, whose next-sentence scores are "
              "then 0; architecture='BertForMaskedLM' leaves both out", file=sys.stderr)
    hf_cfg = family.hf_config(cfg, arch)  # raises for families or options without an HF form
    if class_names is not None:
        hf_cfg = _with_class_names(hf_cfg, arch, [str(c) for c in class_names])
    unit = unscanned(cfg)
    shapes = param_shapes(family.model(unit, arch), unit, family)
    rules = family.rules(unit, arch)
    wanted = {r.ours for r in rules}
    missing = [f"{r.ours} {shapes[r.ours]}" for r in rules if r.ours not in flat]
    mismatched = [f"{r.ours}: params {np.shape(flat[r.ours])}, model {shapes[r.ours]}"
                  for r in rules if r.ours in flat and tuple(np.shape(flat[r.ours])) != shapes[r.ours]]
    # Parameters of a head the architecture lacks would be lost: refuse instead.
    unexpected = [n for n in flat if n not in wanted]
    if unexpected and not (missing or mismatched) and \
            all(n.startswith(family.head_paths) for n in unexpected):
        raise ConversionError(f"export_hf: architecture={arch!r} has no place for the params' "
                         f"head {sorted(unexpected)}; pass params without it, or pick an "
                         f"architecture with that head from {list(family.architectures)}")
    if missing or unexpected or mismatched:
        raise ConversionError(describe(f"params do not fit {arch}", missing, unexpected, mismatched))
    if tokenizer is not None and family.model_type == "vit":
        raise ValueError("export_hf: tokenizer= given for a ViT, which reads images; "
                         "valid: tokenizer=None")
    form = None
    if tokenizer is not None:
        try:  # built before anything is written: a tokenizer without an HF form says so
            form = tokenizer.hf_form()
        except (AttributeError, TypeError):
            raise ValueError(f"export_hf: tokenizer= a {type(tokenizer).__name__}, which has no "
                             f"Hugging Face form; valid: one of attention_jax.data's tokenizers "
                             f"(a run's: runs.open_run(workdir).tokenizer), or None") from None
        # A tokenizer of more tokens than the embedding has rows (another run's) wrote an
        # export whose every id past the table crashed transformers' forward pass.
        rows = hf_cfg.get("vocab_size")
        if rows is not None and tokenizer.vocab_size > rows:
            raise ValueError(f"export_hf: tokenizer= has {tokenizer.vocab_size} tokens, more "
                             f"than the model's {rows} embedding rows (another run's "
                             f"tokenizer?); valid: the model's own run's tokenizer "
                             f"(runs.open_run(workdir).tokenizer), or None")
        # transformers' generate stops at the config's eos and pads with its pad.
        roles = tokenizer.hf_roles()
        hf_cfg = {**hf_cfg, **{f"{r}_token_id": roles[r] for r in ("bos", "eos", "pad")
                               if r in roles}}
    tensors = export_tensors(family, rules, arch, flat)
    if tokenizer is not None and family.model_type == "bert":
        hf_cfg, tensors = _vocabulary_of(tokenizer, hf_cfg, tensors)
    if form is not None and arch == "BertForSequenceClassification":
        _classified_texts(form, tokenizer)
        if max_length is None:
            print(f"note: export_hf: no max_length: the tokenizer's model_max_length is the "
                  f"position table ({getattr(cfg, 'max_len', None)}), where a run cut its texts "
                  f"at its data.seq_len; pass max_length=run.config.data.seq_len so that "
                  f"transformers' truncation=True cuts there too", file=sys.stderr)
    out = write_hf_dir(out_dir, hf_cfg, tensors)
    write_hf_tokenizer(out, tokenizer, form, max_length or getattr(cfg, "max_len", None),
                       input_names=(("input_ids", "token_type_ids", "attention_mask")
                                    if family.model_type == "bert" else None))
    _write_generation_config(out, hf_cfg, tokenizer if family.model_type == "gpt2" else None)
    write_hf_image_processor(out, image_preprocess)
    if family.model_type == "vit" and image_preprocess is None:
        print("note: export_hf: no image_preprocess: no preprocessor_config.json, so "
              "transformers' image pipelines cannot read images for this model; pass "
              "image_preprocess=run.task.eval_transform (how the run read its images)",
              file=sys.stderr)
    return out


def _classified_texts(form, tokenizer) -> None:
    """`form` (a tokenizers.Tokenizer) adding the special tokens a text classifier's texts
    carry (data.classification_example): [CLS] A [SEP], a pair [CLS] A [SEP] B [SEP] with
    B's part of token type 1, or <bos>/<eos> where the tokenizer has no [CLS]/[SEP]."""
    from tokenizers import processors

    from attention_jax.data.tokenization import text_ends
    ends = text_ends(tokenizer)
    if ends is None:
        raise ValueError(f"export_hf: the tokenizer has neither [CLS]/[SEP] nor begin/end "
                         f"tokens, which a classified text starts and ends with")
    start, end = (form.id_to_token(i) for i in ends)
    form.post_processor = processors.TemplateProcessing(
        single=f"{start} $A {end}", pair=f"{start} $A {end} $B:1 {end}:1",
        special_tokens=list(dict.fromkeys([(start, ends[0]), (end, ends[1])])))


def _vocabulary_of(tokenizer, hf_cfg: dict, tensors: dict) -> tuple[dict, dict]:
    """A BERT's config and tensors cut to its tokenizer's vocabulary where the model's is
    padded past it (to a multiple of 64 for its matmuls): the padding rows' ids decode to
    nothing, yet fill-mask ranked them (an early run put a third of the mass there). The
    word embeddings and the MLM head's output lose those rows; nothing else changes."""
    padded, real = int(hf_cfg["vocab_size"]), int(tokenizer.vocab_size)
    if padded <= real:
        return hf_cfg, tensors
    # By name: a width, a position table or an MLP as large as the padded vocabulary has
    # that first dimension too, and is no vocabulary.
    vocabulary = ("embeddings.word_embeddings.weight", "cls.predictions.bias",
                  "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
    cut = {name: x[:real] if any(name == v or name.endswith("." + v) for v in vocabulary)
           else x for name, x in tensors.items()}
    return {**hf_cfg, "vocab_size": real}, cut


def _with_class_names(hf_cfg: dict, arch: str, names: list[str]) -> dict:
    """hf_cfg with id2label/label2id of `names`: the classes of a classifier's head, one a
    label, distinct (label2id maps each back)."""
    if "id2label" not in hf_cfg:
        raise ValueError(f"export_hf: class_names given for {arch}, which has no classifier "
                         f"head; valid: class_names=None")
    if len(names) != len(hf_cfg["id2label"]) or len(set(names)) < len(names):
        raise ValueError(f"export_hf: class_names has {len(names)} names "
                         f"({len(set(names))} distinct); valid: {len(hf_cfg['id2label'])} "
                         f"distinct names, one a label of the head, in label order")
    return {**hf_cfg, "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)}}


def _write_generation_config(out: str, hf_cfg: dict, tokenizer) -> None:
    """generation_config.json for a GPT exported with its tokenizer whose vocabulary the
    model's pads (to a multiple of 64 for its matmuls): transformers' generate then never
    picks the padding ids, which decode to nothing (ours never sample them: generate's
    vocab_size). It carries the special tokens' ids too: generate reads them from this
    file where there is one. Otherwise an earlier export's file is removed."""
    file = os.path.join(out, "generation_config.json")
    if tokenizer is None or hf_cfg["vocab_size"] <= tokenizer.vocab_size:
        if os.path.exists(file):
            os.remove(file)
        return
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")  # as export_hf set them
    config = {**{k: hf_cfg[k] for k in ids if hf_cfg.get(k) is not None},
              "suppress_tokens": list(range(tokenizer.vocab_size, hf_cfg["vocab_size"]))}
    with open(file, "w") as f:
        json.dump(config, f, indent=2)


# ============================================================================ warm start


def hf_model_overrides(path) -> dict[str, Any]:
    """The `config.model` fields a checkpoint implies (for an experiment config), e.g.
    {'d_model': 384, 'num_layers': 6, 'activation': 'gelu', ...}."""
    cfg, _ = config_from_hf(path)
    return _family_of(cfg).arch_fields(cfg)


def _arch_differences(family: Family, cfg, implied) -> list[str]:
    """`field=ours (checkpoint: theirs)` for each architecture field of our model config
    `cfg` that differs from the checkpoint's (`implied`); a larger vocabulary is not one
    (padding: the extra rows are new)."""
    ours, theirs = family.arch_fields(cfg), family.arch_fields(implied)
    return [f"{field}={ours.get(field)!r} (checkpoint: {want!r})"
            for field, want in theirs.items()
            if ours.get(field) != want and not (field == "vocab_size" and ours[field] >= want)]


def _check_architecture(family: Family, implied, cfg, path) -> None:
    bad = _arch_differences(family, cfg, implied)
    if bad:
        raise ValueError(f"model config does not match the checkpoint {path}: "
                         f"{', '.join(bad)}; set these fields to the checkpoint's values")


def _load_converted(path):
    hf_cfg, tensors = read_hf_dir(path)
    family = _family(hf_cfg)
    arch = family.architecture(hf_cfg, tensors)
    implied = family.config(hf_cfg, arch)
    model = family.model(implied, arch)
    converted, _ = convert_tensors(family, implied, arch, tensors, param_shapes(model, implied, family))
    return family, implied, arch, converted


def init_params_from_hf(path, model: nn.Module, *, seed: int = 0, verbose: bool = True) -> dict:
    """Params for `model` (a GPT, Bert or ViT of our own config) from an HF checkpoint:
    fine-tuning's starting point.

    The model's architecture fields (width, depth, heads, activation, epsilon, ...) must
    match the checkpoint's (ValueError naming the ones that differ); its vocabulary may
    be larger, its ViT image size different, and its task head new or of another size
    (initialised as `hf_params.fresh_numpy` says, and printed). Returns a float32 params
    tree (numpy leaves) shaped like model.init's.
    """
    family, implied, arch, converted = _load_converted(path)
    cfg = model.config
    if _family_of(cfg) is not family:
        raise ValueError(f"{path} holds a {family.model_type} checkpoint; the model is a "
                         f"{type(model).__name__}")
    _check_architecture(family, implied, cfg, path)
    target = param_shapes(model, cfg, family)
    grid = (cfg.grid_size, cfg.grid_size) if family.model_type == "vit" else None
    params, new, unused = fit(family, converted, target, lambda n, s: fresh_numpy(n, s, seed),
                              grid, where=os.fspath(path))
    if verbose and (new or unused):
        print(f"init from {path} ({arch}): new heads: {new or 'none'}; "
              f"checkpoint heads left unused: {unused or 'none'}")
    return unflatten(params)


# Tokens a run's tokenizer may add to a checkpoint's vocabulary (a [PAD] or other special
# tokens on GPT-2's 50257: new rows); more is another tokenizer's vocabulary.
ADDED_TOKENS = 64


def restore_params_from_hf(path, abstract_params, *, seed: int = 0, model_config=None,
                           vocab_size: int | None = None, untrained: tuple[str, ...] = ()):
    """`--config.train.init_from=hf:<dir>`: the checkpoint's params placed on the
    shardings of `abstract_params` (a tree of jax.ShapeDtypeStruct), and step 0.

    The architecture check is by shape; the fields shapes cannot show (activation,
    LayerNorm epsilon, a GPT's tied head) are compared with `model_config` (the run's
    model config; a difference is a ConversionError naming them), or printed when it is
    not given. New
    task heads: see `hf_params.fresh_numpy`. vocab_size, the run's tokenizer's: a
    checkpoint's vocabulary more than ADDED_TOKENS smaller is another tokenizer's (its
    embedding rows would stand for other tokens), and one larger than the run's table
    (model_config.vocab_size, padded) cannot fit: a ConversionError either way.
    untrained: top-level params the run's loss never trains (Task.untrained): those the
    checkpoint lacks start at zero, not at fresh_numpy's random start; those it holds
    are its own.
    """
    family, implied, arch, converted = _load_converted(path)
    theirs = getattr(implied, "vocab_size", None)
    table = getattr(model_config, "vocab_size", None)
    if vocab_size is not None and theirs is not None and (
            theirs < vocab_size - ADDED_TOKENS or (table is not None and theirs > table)):
        raise ConversionError(
            f"{os.fspath(path)}: its vocabulary holds {theirs} tokens (config.json vocab_size), "
            f"the run's tokenizer {vocab_size}"
            + (f" in a table of {table} rows" if table is not None else "")
            + ": its embedding rows would stand for other tokens; valid: the checkpoint's own "
              "tokenizer (config.data.tokenizer=DIR, a directory holding its tokenizer.json)")
    target = flatten(abstract_params)
    grid = None
    if family.model_type == "vit" and "patch_embedding" in target and "position_embeddings" in target:
        # Only the target's table size is known: its grid is sqrt(rows - 1) per side.
        side = int(round((target["position_embeddings"].shape[0] - 1) ** 0.5))
        grid = (side, side)
    try:
        def fresh(name, shape):
            if name.split("/", 1)[0] in untrained:
                return np.zeros(shape, np.float32)
            return fresh_numpy(name, shape, seed)
        params, new, unused = fit(family, converted, {k: v.shape for k, v in target.items()},
                                  fresh, grid, where=os.fspath(path))
    except ConversionError:
        # Tensor by tensor the list runs to dozens of lines; the model's fields that differ
        # from the checkpoint's say it in one, where the run's model config is known.
        if not isinstance(model_config, type(implied)):
            raise
        differ = _arch_differences(family, model_config, implied)
        if not differ:
            raise
        raise ConversionError(f"{os.fspath(path)}: config.model does not match the checkpoint's "
                              f"architecture: {', '.join(differ)}; valid: the checkpoint's values "
                              f"(--config.model.KEY=...)") from None
    fields = family.arch_fields(implied)
    # (tie_embeddings: a tied checkpoint's head is its embedding, an untied one's its own
    # lm_head; either fits the other's shapes, dropping or inventing the trained head. A
    # GPT2Model has no head to keep: a run may give it a new one of its own.)
    unseen = {k: fields[k] for k in fields
              if k in ("activation", "norm_epsilon")
              or (k == "tie_embeddings" and arch != "GPT2Model")}
    if isinstance(model_config, type(implied)):  # another family's failed the shapes above
        ours = family.arch_fields(model_config)
        differ = [f"config.model.{k}={ours[k]!r} (its config.json: {v!r})"
                  for k, v in unseen.items() if ours.get(k) != v]
        if differ:
            raise ConversionError(f"{os.fspath(path)}: {', '.join(differ)}, which its weights "
                                  f"cannot show; valid: the checkpoint's values (--config."
                                  f"model.KEY=..., or c.model.KEY = ... in a config file of "
                                  f"one's own where the shipped config has no such key)")
        settings = f"its {unseen}, which the weights cannot show, match config.model"
    else:
        settings = (f"its config.json sets {unseen}, which the weights cannot show: the model "
                    f"must set the same")
    print(f"warm start from {path} ({arch}): {settings}; new heads: {new or 'none'}; "
          f"checkpoint heads left unused: {unused or 'none'}", flush=True)

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
