r"""The run config: its schema and defaults, its validation, and how a config is loaded.

    config = config_lib.load("gpt:variant=gpt-tiny-rope", ["train.steps=50"])
    config = config_lib.load("my_experiment.py", {"optim.lr": 1e-3})

A config names an experiment: a shipped one by name (`attention_jax/configs/NAME.py`,
installed with the package) or a file of the user's (`path/to/file.py`), then `:ARG`, the
experiment's own arguments (`variant=gpt-tiny-rope,steps=100`, parsed by `parse_arg`,
which refuses a key the experiment does not take), then overrides of any field
(`train.steps=50`, typed by the field's current value). main, the sweep and the
benchmarks all load configs here. Every experiment starts from `base_config()`, whose
keys are the schema `validate` checks; `model` and `data` belong to the task, which checks
them against the model's config dataclass and its own data keys.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import textwrap
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import ml_collections

from attention_jax import sharding
from attention_jax.errors import ConfigError, check_choice, check_range, did_you_mean


# =================================================================================== schema
def base_config() -> ml_collections.ConfigDict:
    """Defaults of every group but `model` and `data`, which each experiment defines.

    Experiments start from this and override; the keys here are also the schema that
    `validate` checks (an unknown key is an error, not silently ignored).
    """
    c = ml_collections.ConfigDict()
    c.task = ""  # which family builds model + data + loss: a name registered in tasks/.
    c.model = ml_collections.ConfigDict()  # fields of the model's own config dataclass.
    c.data = ml_collections.ConfigDict()  # dataset name, lengths, tokenizer: per task.

    c.optim = o = ml_collections.ConfigDict()
    o.lr = 3e-4  # peak learning rate, reached after warmup.
    o.warmup_steps = 100  # linear warmup from 0 (Goyal et al. 2017; stabilises Adam early).
    o.schedule = "cosine"  # decay after warmup: cosine | linear | constant.
    o.end_lr_ratio = 0.1  # final lr as a fraction of the peak (cosine/linear).
    o.b1 = 0.9  # Adam first-moment decay.
    o.b2 = 0.95  # Adam second-moment decay (0.95 is the LLM convention; 0.999 for small data).
    o.eps = 1e-8  # Adam's term added to the second moment's root (numerical safety).
    # Decoupled (AdamW, Loshchilov & Hutter 2019), on weight matrices only (not biases,
    # norms or embeddings: optimizer.decay_mask).
    o.weight_decay = 0.1
    o.clip_norm = 1.0  # global-norm gradient clipping; 0 disables.
    o.label_smoothing = 0.0  # Szegedy et al. 2016; applies to classification/LM targets.
    # Micro-batches per optimizer step (train.batch_size is split into them); the step is
    # the whole batch's: its mean over all real tokens, however padding falls among them.
    # The exception: a mixture of experts' router losses are not linear in the batch, so
    # each micro-batch's routers are balanced over its own tokens (their losses then
    # averaged as the rest), not over the whole batch's: per group, as Switch's.
    o.grad_accum = 1
    o.decay_steps = 0  # length of the warmup + decay schedule; 0: train.steps.

    c.train = t = ml_collections.ConfigDict()
    t.steps = 1000  # optimizer steps (each of grad_accum micro-batches).
    t.batch_size = 32  # global batch (all processes, all micro-batches) per step.
    t.seed = 0  # parameters, dropout and data order all derive from it.
    t.compute_dtype = "float32"  # float32 | bfloat16: activations/matmuls; params stay float32.
    t.loss_chunk_size = 0  # GPT: positions per chunk of the fused LM head + loss; 0: whole logits.
    # GPT, whole logits: the loss by XLA's reductions (xla) or Pallas kernels that read the
    # logits fewer times (pallas; models/loss_kernel.py); auto: pallas on NVIDIA GPUs for
    # vocabularies of 4096 or more not split over the mesh (losses.choose_loss_kernel).
    t.loss_kernel = "auto"
    t.log_every = 10  # steps between metric records (JSONL + TensorBoard).
    t.progress = True  # show a progress bar on process 0.
    # Non-finite loss: stop (keep the last good checkpoint) | skip the step (no update;
    # the optimizer's counts stay too, so its lr schedule runs one step behind per skip).
    t.nonfinite = "stop"
    t.inject_nan_at = -1  # fault injection: the loss of step N (1-based, as logged) is NaN; -1 never.
    t.checkpoint_every = 500  # steps between checkpoints (plus one at the end and on SIGTERM).
    t.keep_checkpoints = 3  # the newest checkpoints kept in the workdir; older are deleted.
    t.async_checkpoint = True  # write checkpoints in the background while training goes on.
    # A checkpoint that fails to restore or to match its digests: fall_back to the newest
    # intact one (the damaged ones are moved aside, never deleted) | stop with the reason.
    t.checkpoint_on_damage = "fall_back"
    t.init_from = ""  # warm start: a workdir or checkpoint dir whose params (only) to load.
    t.data_workers = 0  # grain worker processes (0: read in the trainer process).
    # Batches sent to the devices ahead of the step that takes them (0: each when its step
    # starts). The host waits for the device only when it logs, evaluates or checkpoints.
    t.prefetch = 2

    c.mesh = m = ml_collections.ConfigDict()
    m.data = -1  # data-parallel axis; -1 takes the devices the other axes leave.
    m.fsdp = 1  # fully sharded data parallel: batch and parameters split.
    m.sequence = 1  # sequence (context) parallel: activations' length split, ring attention.
    m.tensor = 1  # tensor (model) parallel: heads and MLP hidden split.
    m.num_devices = 0  # use only the first N devices (0: all), e.g. 1 for a one-device baseline.
    m.rules = sharding.DEFAULT_RULES  # logical axis -> mesh axes (see sharding.py).
    m.distributed = False  # call jax.distributed.initialize (multi-host).
    m.coordinator_address = ""  # host:port of process 0; empty lets JAX detect it.
    m.num_processes = -1  # -1: detect.
    m.process_id = -1  # -1: detect.
    m.cpu_collectives = ""  # e.g. gloo: collectives between CPU processes.
    # Hybrid mesh, for several slices (TPU multislice) or hosts: the data axis is split
    # dcn_data ways across them, over the slow network, and `data` ways within each (the
    # axes above then count one slice's or one process's devices). dcn_data × dcn_fsdp
    # must equal the number of slices, or else of processes.
    m.dcn_data = 1
    m.dcn_fsdp = 1  # as dcn_data, for the fsdp axis: parameters split across slices or hosts.
    # Seconds without a heartbeat after which another process counts as lost: this one
    # then exits in one line (sharding.LostHostWatchdog; JAX's own heartbeat timeout is
    # set past it).
    m.lost_host_timeout = 120.0

    c.eval = e = ml_collections.ConfigDict()
    e.every = 500  # steps between evaluations (and at the end); 0: only at the end; -1: never.
    e.steps = 10  # batches of eval.batch_size an evaluation reads; 0: the whole split.
    e.batch_size = 32  # global eval batch.
    e.sample_prompts = ("def ", "import ")  # language models: prompts for --mode=sample.
    e.sample_tokens = 64  # tokens generated per prompt.
    e.sample_temperature = 0.8  # 0 is greedy.
    e.sample_top_k = 40  # keep the k most likely tokens (0: all).
    e.sample_top_p = 1.0  # keep the fewest most likely tokens holding this mass (1: all).
    # translations (--mode=translate, and sample's): 1 is greedy; N > 1 a beam search of N
    # (encdec's and rnn_seq2seq's; Vaswani et al. used 4).
    e.beam_size = 1
    return c


CHOICES = {
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.compute_dtype": ("float32", "bfloat16"),
    "train.loss_kernel": ("auto", "xla", "pallas"),
    "train.nonfinite": ("stop", "skip"),
    "train.checkpoint_on_damage": ("fall_back", "stop"),
    # JAX's choices of jax_cpu_collectives_implementation ("": its default)
    "mesh.cpu_collectives": ("", "gloo", "mpi", "megascale"),
}

# GPTConfig's fields of the architecture configs/gpt.py leaves to its variant (None)
# unless given on the command line; a run saved before they were keys left them so
# (workdir.ADDED_KEYS).
GPT_ARCHITECTURE_KEYS = ("num_kv_heads", "position", "rope_base", "mlp", "activation", "norm",
                         "norm_epsilon", "norm_position", "attention_scale", "tie_embeddings",
                         "use_bias", "moe_loss_weight", "router_z_loss_weight")

# Valid values of the numeric keys, as intervals ("(" open, "[" closed; errors.check_range).
RANGES = {
    "optim.lr": "(0, inf)",
    "optim.warmup_steps": "[0, inf)",
    "optim.end_lr_ratio": "[0, 1]",
    "optim.b1": "[0, 1)",
    "optim.b2": "[0, 1)",
    "optim.eps": "(0, inf)",
    "optim.weight_decay": "[0, inf)",
    "optim.clip_norm": "[0, inf)",
    "optim.label_smoothing": "[0, 1)",
    "optim.grad_accum": "[1, inf)",
    "optim.decay_steps": "[0, inf)",
    "train.steps": "[1, inf)",
    # The PRNG key takes 32 bits of it (2**32 + 5 was seed 5), the data order's Philox
    # no negative one.
    "train.seed": "[0, 4294967296)",
    "train.batch_size": "[1, inf)",
    "train.loss_chunk_size": "[0, inf)",
    "train.log_every": "[1, inf)",
    "train.inject_nan_at": "[-1, inf)",
    "train.checkpoint_every": "[1, inf)",
    "train.keep_checkpoints": "[1, inf)",
    "train.data_workers": "[0, inf)",
    "train.prefetch": "[0, inf)",
    "mesh.num_devices": "[0, inf)",
    "mesh.dcn_data": "[1, inf)",
    "mesh.dcn_fsdp": "[1, inf)",
    "mesh.lost_host_timeout": "(0, inf)",
    "eval.every": "[-1, inf)",
    "eval.steps": "[0, inf)",
    "eval.batch_size": "[1, inf)",
    "eval.sample_tokens": "[1, inf)",
    "eval.sample_temperature": "[0, inf)",
    "eval.sample_top_k": "[0, inf)",
    "eval.sample_top_p": "(0, 1]",
    "eval.beam_size": "[1, inf)",
}

# The shipped configs' prompts, written for their offline datasets (Python source, English
# numbers): a run on other data that keeps them is told (tasks.base.note_shipped_prompts).
SHIPPED_PROMPTS = {"python_stdlib": ("def ", "import ", "class "),
                   "number_translation": ("twenty one", "three hundred and forty-two")}

# The keys only the tasks that sample read (Task.sample: gpt's continuations of the
# prompts, translation's greedy translations of them); --help leaves them out of the
# other tasks' keys, and a run of another task that sets one is told it does nothing.
SAMPLE_KEYS = ("eval.sample_prompts", "eval.sample_tokens", "eval.sample_temperature",
               "eval.sample_top_k", "eval.sample_top_p")
# The keys of the GPT's fused head and loss (tasks/text.py), which no other task reads.
LM_LOSS_KEYS = ("train.loss_chunk_size", "train.loss_kernel")
# The key of the translation tasks' decoding (greedy or beam), which no other task reads.
TRANSLATE_KEYS = ("eval.beam_size",)
# Keys only some tasks read (tasks.register(..., reads=)): the same treatment.
TASK_KEYS = SAMPLE_KEYS + LM_LOSS_KEYS + TRANSLATE_KEYS


# Names researchers bring from nanoGPT's train.py and model.py and from Hugging Face's
# TrainingArguments and model configs, and the key that means the same here (said where
# a config has it). Left out where the meanings differ too far: HF's `eval_steps` (an
# interval; eval.steps here counts batches) and `per_device_train_batch_size`
# (train.batch_size is the global batch).
OTHER_NAMES = {
    "learning_rate": "optim.lr", "max_steps": "train.steps", "max_iters": "train.steps",
    "warmup_iters": "optim.warmup_steps", "lr_decay_iters": "optim.decay_steps",
    "beta1": "optim.b1", "beta2": "optim.b2", "adam_beta1": "optim.b1",
    "adam_beta2": "optim.b2", "adam_epsilon": "optim.eps", "grad_clip": "optim.clip_norm",
    "max_grad_norm": "optim.clip_norm", "gradient_accumulation_steps": "optim.grad_accum",
    "logging_steps": "train.log_every",
    "log_interval": "train.log_every", "save_steps": "train.checkpoint_every",
    "save_total_limit": "train.keep_checkpoints", "eval_interval": "eval.every",
    "eval_iters": "eval.steps", "block_size": "data.seq_len", "n_layer": "model.num_layers",
    "num_hidden_layers": "model.num_layers", "n_head": "model.num_heads",
    "num_attention_heads": "model.num_heads", "n_embd": "model.d_model",
    "hidden_size": "model.d_model", "intermediate_size": "model.mlp_dim",
    "max_position_embeddings": "model.max_len", "dropout": "model.dropout_rate",
    "hidden_dropout_prob": "model.dropout_rate",
}
# What differs between such a name and ours, said beside the key.
OTHER_NAME_NOTES = {
    "optim.grad_accum": "it splits config.train.batch_size into micro-batches, where "
                        "nanoGPT's and Hugging Face's multiply the batch",
    "data.seq_len": "config.model.max_len sizes the position table",
}


def _hint(config, key: str, missing: str, valid) -> str:
    """What to add to "config.KEY is not a key" errors, `missing` the part of KEY not
    found: where a key of that name is when it is KEY's last part (a key under another
    group: `--config.model.loss_kernel` for config.train.loss_kernel; a name from nanoGPT
    or Hugging Face, OTHER_NAMES: `--config.optim.learning_rate` for config.optim.lr),
    else the valid name closest to the missing part."""
    if missing == key.rsplit(".", 1)[-1]:
        keys = flat(config)
        others = sorted(k for k in keys if k.rsplit(".", 1)[-1] == missing and k != key)
        if others:
            return " (it is " + " or ".join(f"config.{k}" for k in others) + ")"
        ours = OTHER_NAMES.get(missing)
        if ours in keys:
            note = OTHER_NAME_NOTES.get(ours)
            return f" (here it is config.{ours}" + (f"; {note})" if note else ")")
    return did_you_mean(missing, valid)


def with_base_keys(stored: dict) -> dict:
    """A run's config.json (as a dict) with every key of base_config() it lacks added at
    its default: a run saved before the key existed (eval.sample_top_p, say) then reads,
    validates and takes `--config.eval.sample_top_p=...` like a new one. Every experiment
    starts from base_config(), so a new run holds these keys anyway."""
    def fill(into: dict, defaults: dict) -> None:
        for key, value in defaults.items():
            if key not in into:
                into[key] = copy.deepcopy(value)
            elif isinstance(value, dict) and isinstance(into[key], dict):
                fill(into[key], value)
    out = copy.deepcopy(stored)
    fill(out, base_config().to_dict())
    return out


def flat(tree, prefix: str = "") -> dict[str, Any]:
    """{"group.key": value} of a ConfigDict or a nested dict (e.g. a config.json)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, (dict, ml_collections.ConfigDict)):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The data keys of text from the user's own files, shared by every text experiment (GPT,
# BERT), read with data.name="files" (data/files.py). Each entry's comment is its --help.
TEXT_FILE_KEYS = {
    # Comma-separated globs of your files: .jsonl, .csv, .tsv (each also .gz or .zst) and
    # .parquet, a record's text under text_key (translation and classification: records
    # holding data.source/target or text_key/label_key); for text alone also .txt .md .py
    # and .txt.gz/.zst, a document each.
    "files": "",
    # Globs of the held-out files; "": eval_fraction of the records is held out instead.
    "eval_files": "",
    "text_key": "text",  # the key (jsonl) or column (parquet, csv, tsv) holding a record's text.
    # Without eval_files: the share of the records held out, chosen by a hash of file and
    # line or row (stable as files are added).
    "eval_fraction": 0.05,
    "max_bad_records": 100,  # unreadable records skipped with a warning, up to this many.
    # Where what is read from your files is prepared once (tokens, the records' pass);
    # "": DATA_DIR/token_cache (data.data_dir, else $TFDS_DATA_DIR or ~/tensorflow_datasets).
    "cache_dir": "",
}


# The data keys of sentence pairs from the user's own files, for the translation tasks
# (encdec, rnn_seq2seq): data.name="files"; files: comma-separated globs of .jsonl, .csv,
# .tsv (each also .gz or .zst) and .parquet whose records (rows) hold both languages under
# the keys (columns)
# data.source and data.target; the held-out split as for text (eval_files, else
# eval_fraction of the pairs by a hash of file and line or row: data/files.py).
# cache_dir: where what a pass over every record found (the pairs kept, their digest,
# the longest in tokens; a classifier's labels) is kept for the next start
# (data/records_cache.py); "" as for text.
PAIR_FILE_KEYS = {k: TEXT_FILE_KEYS[k] for k in ("files", "eval_files", "eval_fraction",
                                                "max_bad_records", "cache_dir")}
# Keys read only by the user's own data (data.name 'files' or 'image_folder'), which have
# a default: set to another value for a dataset, they did nothing (tasks.base.
# check_source_keys), and a resume that changes them changes nothing (workdir).
SOURCE_KEY_DEFAULTS = {k: TEXT_FILE_KEYS[k] for k in ("eval_fraction", "max_bad_records")}
USER_DATA_SOURCES = ("files", "image_folder")


def add_pair_file_keys(data: ml_collections.ConfigDict) -> None:
    """Gives a translation experiment's `config.data` the PAIR_FILE_KEYS with their
    defaults, so the command line can set them (--config.data.files=pairs.jsonl)."""
    data.update(PAIR_FILE_KEYS)


def add_text_file_keys(data: ml_collections.ConfigDict) -> None:
    """Gives an experiment's `config.data` the TEXT_FILE_KEYS with their defaults, so the
    command line can set them (--config.data.files=...)."""
    for key, value in TEXT_FILE_KEYS.items():
        data[key] = value


# The data keys of the image tasks (vit, cnn) beyond the dataset's name and splits
# (data/images.py). Each entry's comment is its --help.
IMAGE_KEYS = {
    "root": "",  # data.name="image_folder": the folder of root/<class>/<image> files.
    "eval_root": "",  # the held-out images, as root; "": eval_fraction of root's.
    # Without eval_root: the share of the images held out, chosen by a hash of the path.
    "eval_fraction": 0.05,
    "max_bad_records": 100,  # undecodable images skipped with a warning, up to this many.
    "augment": True,  # the training crops and flips below; False: read as the eval's.
    # Side the images are resized to; 0: the dataset's own (a folder: the model's).
    "image_size": 0,
    "channels": 0,  # 1 (grayscale) or 3 (RGB); 0: the dataset's own (a folder: RGB).
    # Training crop: 'none' | 'random' (pad by data.padding, crop back) |
    # 'random_resized' (Inception's crop, keeping at least crop_scale of the area).
    "train_crop": "random",
    "padding": 1,  # train_crop='random': the pixels padded on each side before the crop.
    "crop_scale": 0.08,  # random_resized: the smallest share of the image's area kept.
    "flip": False,  # mirror half the training images left to right.
    "mean": "0.5",  # subtracted from pixels in [0, 1]: one number or one per channel.
    "std": "0.5",  # pixels are divided by it after: one number or one per channel.
    "mixup": 0.0,  # mixup's Beta(alpha, alpha) mixing of image pairs; 0: off.
    "cutmix": 0.0,  # CutMix's Beta(alpha, alpha) pasted patches; 0: off.
}


def add_image_keys(data: ml_collections.ConfigDict) -> None:
    """Gives an image experiment's `config.data` the IMAGE_KEYS it lacks, with their
    defaults, so the command line can set them (--config.data.root=DIR
    --config.data.image_size=32); keys the experiment set keep its values."""
    for key, value in IMAGE_KEYS.items():
        if key not in data:
            data[key] = value


# =============================================================================== validation
def validate(config, num_devices: int | None = None, tasks: Iterable[str] | None = None,
             granules: int = 1) -> None:
    """Checks keys, types, choices and ranges before anything is compiled.

    tasks: the registered task names config.task must be one of (None: not checked).
    num_devices: also the mesh and what must divide it (batch sizes).
    granules: the slices or processes the mesh's dcn_* axes span (sharding.granules).
    """
    base = flat(base_config())
    got = flat(config)
    for key, value in got.items():
        if key.startswith(("model.", "data.")):
            continue  # Checked by the task against the model/data dataclasses.
        if key not in base:
            group = key.rsplit(".", 1)[0]
            valid = sorted(k.rsplit(".", 1)[1] for k in base if k.rsplit(".", 1)[0] == group)
            if not valid:  # a top-level key or group of its own (my_note, trian.steps)
                top = sorted(base_config().keys())
                first = key.split(".", 1)[0]
                raise ConfigError(f"config.{key} is not a known key: config has no {first!r}; "
                                  f"valid top-level keys of config: {top}"
                                  f"{did_you_mean(first, top)}")
            raise ConfigError(f"config.{key} is not a known key; valid keys in "
                              f"config.{group}: {valid or sorted(base)}"
                              f"{_hint(base_config(), key, key.rsplit('.', 1)[-1], valid)}")
        want = base[key]
        if isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool):
            continue
        if type(value) is not type(want) and not (isinstance(want, tuple) and isinstance(value, list)):
            raise ConfigError(f"config.{key}={value!r} has type {type(value).__name__}; "
                              f"expected {type(want).__name__} (default {want!r})")
    # The prompts are texts: (1, 2) passed the tuple check above and failed in the
    # tokenizer's encode with an AttributeError traceback.
    prompts = got["eval.sample_prompts"]
    wrong = [p for p in prompts if not isinstance(p, str)]
    if wrong:
        raise ConfigError(f"config.eval.sample_prompts={prompts!r} holds {wrong[0]!r} "
                          f"({type(wrong[0]).__name__}); valid: a tuple of strings, e.g. "
                          f"'(\"def \", \"import \")', or () for none")
    if tasks is not None:
        check_choice("config.task", config.task, sorted(tasks))
    for key, choices in CHOICES.items():
        check_choice(f"config.{key}", got[key], choices)
    for key, interval in RANGES.items():
        check_range(key, got[key], interval)
    if got["train.inject_nan_at"] == 0:
        # Steps count from 1 (as logged): 0 matched no step, and the fault a test asked
        # for never came, unsaid.
        raise ConfigError("config.train.inject_nan_at=0 is no step: steps count from 1, as "
                          "metrics.jsonl logs them; valid: -1 (never) or a step 1, 2, ...")
    sharding.rules_from_config(config.mesh.rules)
    if num_devices is None:
        return
    dcn = sharding.dcn_shape(config.mesh)
    parts = math.prod(dcn.values())  # slices or processes the dcn axes span
    if parts > 1:
        given = " × ".join(f"mesh.dcn_{a}={s}" for a, s in dcn.items())
        try:
            sharding.check_dcn(dcn, granules, "slices (TPU multislice) or else processes")
        except ValueError as e:
            raise ConfigError(f"config.{e}") from None
        if config.mesh.num_devices:
            raise ConfigError(f"config.mesh.num_devices={config.mesh.num_devices} cannot be "
                              f"combined with {given}: a hybrid mesh takes every device; "
                              f"valid: 0")
    try:
        mesh = sharding.resolve_mesh_shape(
            {a: config.mesh.get(a, 1) for a in sharding.MESH_AXES}, num_devices // parts)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}" + (
            f" (the devices of one of the {parts} slices or processes)" if parts > 1 else "")
        ) from None
    for axis, size in dcn.items():
        mesh[axis] *= size
    dp = mesh["data"] * mesh["fsdp"]
    batch, accum = config.train.batch_size, config.optim.grad_accum
    if batch % (accum * dp):
        valid = accum * dp
        raise ConfigError(
            f"config.train.batch_size={batch} must be divisible by optim.grad_accum × "
            f"data-parallel size = {accum} × {dp} (mesh.data={mesh['data']} × "
            f"mesh.fsdp={mesh['fsdp']}); valid: multiples of {valid}, e.g. "
            f"{max(valid, batch // valid * valid)}")
    if config.eval.batch_size % dp:
        raise ConfigError(f"config.eval.batch_size={config.eval.batch_size} must be divisible "
                          f"by the data-parallel size {dp}; valid: multiples of {dp}")


def warnings(config) -> list[str]:
    """What is allowed but probably not meant, one line each (printed, never raised): a
    smoke run (`--config.train.steps=5`) of any experiment must just work."""
    out = []
    schedule = config.optim.decay_steps or config.train.steps
    if config.optim.warmup_steps > schedule:
        what = (f"optim.decay_steps={schedule}" if config.optim.decay_steps
                else f"the run (train.steps={schedule})")
        # The last step trains at the schedule's count train.steps - 1 (the first at 0):
        # the rate it reaches, as the run logs it (steps/warmup said 10% too much at 6).
        # The warmup runs its whole length whatever decay_steps says, then the decay's
        # one step drops to the end.
        last, warmup = config.train.steps - 1, config.optim.warmup_steps
        tail = (f"the learning rate stops at {last / warmup:.0%} of optim.lr" if last < warmup
                else f"the learning rate reaches optim.lr at step {warmup + 1}, then drops to "
                     f"the schedule's end at once")
        out.append(f"config.optim.warmup_steps={warmup} is longer than {what}: {tail}")
    # A constant schedule holds optim.lr after the warmup: it has no end, nor a length.
    default = base_config()
    unread = [f"optim.{k}={config.optim[k]}" for k in ("end_lr_ratio", "decay_steps")
              if config.optim[k] != default.optim[k]]
    if config.optim.schedule == "constant" and unread:
        out.append(f"config.{', '.join(unread)} set, but optim.schedule='constant' holds "
                   f"optim.lr after the warmup: ignored (valid with them: optim.schedule "
                   f"'cosine' or 'linear')")
    m, unset = config.mesh, default.mesh
    given = [f"mesh.{k}" for k in ("coordinator_address", "num_processes", "process_id",
                                   "cpu_collectives") if m.get(k, unset[k]) != unset[k]]
    if given and not m.distributed:
        out.append(f"config.{', '.join(given)} set, but mesh.distributed=False: ignored, this "
                   f"runs as one process (--config.mesh.distributed=True to join the others)")
    factor = config.get("model", {}).get("capacity_factor")
    if isinstance(factor, (int, float)) and 0 < factor < 1:
        out.append(f"config.model.capacity_factor={factor} is below 1: each expert takes at "
                   f"most {factor:.0%} of an even share of the tokens, so at least "
                   f"{1 - factor:.0%} of the token-to-expert assignments skip the MLP even with "
                   f"perfect balance (Switch's default is 1.25; the run logs "
                   f"dropped_fraction)")
    inner = config.get("model", {}).get("ring_inner")
    if inner not in (None, "auto") and m.get("sequence", 1) == 1:
        out.append(f"config.model.ring_inner={inner!r} is the kernel of ring attention, which "
                   f"runs with mesh.sequence > 1; with mesh.sequence=1 it does nothing")
    return out


def check_model_fits_mesh(model_config, mesh_shape: Mapping[str, int],
                          seq_len: int | None = None, positions: int | None = None) -> None:
    """Heads are split over the tensor axis (rule heads -> tensor): every device must
    hold whole heads. Checked on the model's resolved config (variant + overrides).
    The length is split over the sequence axis into two chunks per device (ring
    attention's zig-zag), so seq_len (when the task has a fixed one) must divide; so
    must `positions`, the fixed positions an example of a task without a seq_len has (a
    ViT's patches and [CLS]), which no key sets directly."""
    sequence = mesh_shape.get("sequence", 1)

    def fits(length: int) -> list[int]:  # the mesh.sequence sizes that split `length`
        return [d for d in range(1, length + 1)
                if length % (2 * d) == 0 and jax.device_count() % d == 0]
    if seq_len is not None and sequence > 1 and seq_len % (2 * sequence):
        raise ConfigError(
            f"config.data.seq_len={seq_len} is not divisible by 2 × mesh.sequence = "
            f"{2 * sequence} (ring attention gives each device two chunks of the sequence); "
            f"valid: seq_len a multiple of {2 * sequence}, or mesh.sequence in {fits(seq_len)}")
    if seq_len is None and positions and sequence > 1 and positions % (2 * sequence):
        # (auto's attention took another backend than the ring, unsaid, and the sequence
        # axis's devices split nothing)
        raise ConfigError(
            f"config.mesh.sequence={sequence}: the model's {positions} positions an example "
            f"are not divisible by 2 × mesh.sequence = {2 * sequence} (ring attention gives "
            f"each device two chunks of them); valid: mesh.sequence in {fits(positions) or [1]}")
    if seq_len is not None and sequence > 1 and getattr(model_config, "ring_inner",
                                                        None) == "splash":
        # Said here, before the workdir is made (it came at the first trace, unprefixed).
        from attention_jax.attention.splash import LANES
        chunk = seq_len // (2 * sequence)
        if chunk % LANES:
            raise ConfigError(
                f"config.model.ring_inner='splash' needs chunks of data.seq_len / (2 × "
                f"mesh.sequence) = {chunk} tokens to be a multiple of {LANES} (its tiles "
                f"span {LANES} lanes); valid: seq_len a multiple of {2 * sequence * LANES}, "
                f"or ring_inner 'auto' or 'blockwise'")
    tensor = mesh_shape.get("tensor", 1)
    for name in ("num_heads", "num_kv_heads"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value % tensor:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise ConfigError(
                f"config.model.{name}={value} is not divisible by mesh.tensor={tensor}; "
                f"valid: mesh.tensor in {divisors}, or num heads a multiple of {tensor}")


# =================================================================================== loading
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped() -> dict[str, str]:
    """The configs shipped in attention_jax/configs: name -> the first paragraph of its
    docstring (its first line can end mid-sentence), at most about 110 characters, read
    without running the file."""
    out = {}
    for file in sorted(os.listdir(CONFIG_DIR)):
        if file.endswith(".py") and not file.startswith("_"):
            with open(os.path.join(CONFIG_DIR, file)) as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            paragraph = " ".join(doc.strip().split("\n\n")[0].split())
            if len(paragraph) > 110:
                paragraph = paragraph[:110].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
            out[file[:-3]] = paragraph
    return out


def describe(spec: str) -> str:
    """The docstring of the config `spec` names (its arguments, commands and results, as
    each shipped config writes them), for --help."""
    return (config_module(spec).__doc__ or "").strip()


def config_module(spec: str):
    """The module that config `spec` (NAME[:ARG] or FILE.py[:ARG]) is loaded from."""
    return _module(spec.partition(":")[0])


# The user's config files loaded in this process: real path -> (its content's digest,
# the module run from it).
_loaded_files: dict[str, tuple[str, Any]] = {}


def _module(name: str):
    """The module of a config: a shipped name, or a path to a .py file. An old
    `experiments/NAME.py` path names the shipped config NAME (the configs lived there)."""
    base = os.path.basename(name)
    if (not os.path.exists(name) and os.path.dirname(name) == "experiments"
            and base.endswith(".py") and base[:-3] in shipped()):
        print(f"note: --config={name} is the shipped config {base[:-3]!r} now "
              f"(--config={base[:-3]}; attention_jax/configs/{base})", file=sys.stderr)
        name = base[:-3]
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise ConfigError(f"--config={name}: no such file; shipped configs: "
                              f"{', '.join(shipped())}")
        real = os.path.realpath(name)
        with open(name, "rb") as f:
            content = hashlib.sha256(f.read()).hexdigest()
        # One name a file (two folders' mine.py are two modules), which its latest
        # version holds in sys.modules.
        module_name = f"_config_{hashlib.sha256(real.encode()).hexdigest()[:12]}"
        loaded = _loaded_files.get(real)
        if loaded and loaded[0] == content:  # run once per edit: its prints, registrations
            sys.modules[module_name] = loaded[1]
            return loaded[1]
        spec = importlib.util.spec_from_file_location(module_name, name)
        module = importlib.util.module_from_spec(spec)
        # In sys.modules, as an import puts a module: inspect (--help's explanations)
        # and pickle find its classes by it.
        sys.modules[spec.name] = module
        sys.path.insert(0, os.path.dirname(os.path.abspath(name)))  # its own helpers
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:  # the file's own mistake: where, not our traceback
            sys.modules.pop(spec.name, None)
            code = f": {e.text.strip()}" if e.text else ""
            raise ConfigError(f"--config={name}: line {e.lineno}: {e.msg}{code}") from None
        except BaseException:
            sys.modules.pop(spec.name, None)
            raise
        finally:
            sys.path.pop(0)
        _loaded_files[real] = (content, module)
        return module
    if name not in shipped():
        raise ConfigError(f"--config={name} is not a shipped config{did_you_mean(name, shipped())}"
                          f"; valid: {list(shipped())}, or a path to a .py file with get_config()")
    return importlib.import_module(f"attention_jax.configs.{name}")


def _takes_an_argument(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume the usual form
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def load(spec: str, overrides: Mapping[str, Any] | Iterable[str] = ()) -> ml_collections.ConfigDict:
    """The config of `spec` ("NAME[:ARG]" or "path/to/file.py[:ARG]") with `overrides`
    applied: {"train.steps": 50} or ["train.steps=50"] (strings are typed by the field)."""
    name, _, arg = spec.partition(":")
    module = _module(name)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config={spec}: {name} defines no get_config(arg)")
    takes_arg = _takes_an_argument(module.get_config)
    if arg and not takes_arg:
        raise ConfigError(f"--config={spec}: {name}'s get_config() takes no argument; valid: "
                          f"--config={name}, or a get_config(arg) that reads {arg!r}")
    if arg and takes_arg and not _reads_its_argument(module.get_config):
        raise ConfigError(f"--config={spec}: {name}'s get_config never reads its argument, "
                          f"so :{arg} would change nothing, unsaid; valid: --config={name}, "
                          f"or a get_config(arg) that reads it (config.parse_arg)")
    try:
        # get_config() without a parameter is ml_collections' plainest form: called so.
        config = module.get_config(arg or None) if takes_arg else module.get_config()
    except ConfigError as e:
        raise ConfigError(f"--config={spec}: {e}") from None
    except Exception as e:
        if not name.endswith(".py"):
            raise  # a shipped config's bug: its traceback
        # The user's file's mistake: one line naming its line (the chain keeps the rest).
        file = os.path.realpath(name)
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.realpath(f.filename) == file]
        where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
        raise ConfigError(f"--config={spec}: get_config raised {type(e).__name__}: {e}"
                          f"{where}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"--config={spec}: get_config returned a {type(config).__name__}; "
                          f"valid: an ml_collections.ConfigDict, e.g. one that starts from "
                          f"attention_jax.config.base_config() or a shipped config")
    apply_overrides(config, overrides)
    return config


def _reads_its_argument(fn) -> bool:
    """Whether fn's argument (its first parameter; a method's after self) is read in its
    body: True where its source is not there to read, or where the body reads its
    names by locals() or vars()."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return True
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    params = (function.args.posonlyargs + function.args.args)[inspect.ismethod(fn):]
    if not params:
        return True
    names = {n.id for n in ast.walk(function)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return bool(names & {params[0].arg, "locals", "vars"})


def split_overrides(argv) -> tuple[list[str], list[str]]:
    """(argv without the overrides, ["group.key=value", ...]) of `--config.group.key=value`
    arguments (or `--config.group.key value`, as absl takes its own flags); `--config.key`
    alone sets a boolean key, `--noconfig.key` clears it. The command lines that take
    overrides (attention_jax.main, tools.prepare) take no positional argument, so the word
    after a bare --config.KEY that is not a flag is its value."""
    rest, overrides = [], []
    args = list(argv)
    while args:
        a = args.pop(0)
        for prefix, bare in (("--config.", "true"), ("--noconfig.", "false")):
            if a.startswith(prefix):
                key, sep, value = a[len(prefix):].partition("=")
                if prefix == "--noconfig." and sep:
                    raise ConfigError(f"{a}: --noconfig.KEY takes no value; use "
                                      f"--config.{key}={value}")
                if not sep and prefix == "--config." and args and _a_value(args[0]):
                    sep, value = "=", args.pop(0)
                overrides.append(f"{key}={value if sep else bare}")
                break
        else:
            rest.append(a)
    return rest, overrides


def _a_value(word: str) -> bool:
    """Whether the word after a bare --config.KEY is its value: not a flag (-1 is a value)."""
    if not word.startswith("-"):
        return True
    try:
        float(word)
        return True
    except ValueError:
        return False


def apply_overrides(config, overrides: Mapping[str, Any] | Iterable[str]) -> None:
    """Sets each "group.key" of `overrides` on `config` ({"group": {"key": v}} too); a key
    the config lacks is a ConfigError naming the valid keys, a string is parsed as the
    field's type."""
    if isinstance(overrides, str):  # one "group.key=value", not its characters
        overrides = [overrides]
    items = (overrides.items() if isinstance(overrides, Mapping)
             else (_split_override(o) for o in overrides))
    for key, value in items:
        *groups, field = key.split(".")
        node, where = config, "config"
        for name in [*groups, field]:
            if not isinstance(node, ml_collections.ConfigDict) or name not in node:
                valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                raise ConfigError(f"--config.{key}: {where} has no key {name!r}; valid: {valid}"
                                  f"{_hint(config, key, name, valid)}")
            if name != field:
                node, where = node[name], f"{where}.{name}"
        old = node[field]
        if isinstance(old, ml_collections.ConfigDict) and isinstance(
                value, (Mapping, ml_collections.ConfigDict)):
            # {"model": {"d_model": 64}} sets model.d_model, as "model.d_model" does: a
            # nested dict merges into its group rather than replacing it.
            apply_overrides(config, {f"{key}.{k}": v for k, v in value.items()})
            continue
        if isinstance(old, ml_collections.ConfigDict):  # (ml_collections' words: "cannot
            # be casted to type <class '...ConfigDict'>")
            raise ConfigError(f"--config.{key}={value!r}: config.{key} is a group of keys, "
                              f"not a value; valid: --config.{key}.KEY=value, KEY one of "
                              f"{sorted(old.keys())}")
        if isinstance(value, str):
            value = parse_value(f"config.{key}", old, value)
        try:
            node[field] = value
        except TypeError as e:
            raise ConfigError(f"--config.{key}={value!r}: {e}") from None
        except AttributeError:  # a FrozenConfigDict's "immutable"
            raise ConfigError(f"--config.{key}={value!r}: the config is frozen (its "
                              f"get_config returned a FrozenConfigDict), so no key can be "
                              f"set; valid: a get_config that returns a ConfigDict") from None


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} must be group.key=value, e.g. train.steps=50")
    return key, value


def _whole(text: str) -> bool:
    try:
        return float(text).is_integer()
    except (ValueError, OverflowError):
        return False


def parse_value(name: str, old, text: str):
    """`text` as the type of the field's current value `old`."""
    if isinstance(old, bool):
        word = text.strip().lower()
        if word not in ("true", "false", "1", "0"):
            raise ConfigError(f"{name}={text!r} must be true or false")
        return word in ("true", "1")
    for kind in (int, float):
        if isinstance(old, kind):
            try:
                return kind(text)
            except ValueError:
                if kind is int and _whole(text):  # 1e3, 5e5: steps as one writes them
                    return int(float(text))
                raise ConfigError(f"{name}={text!r} must be {'an int' if kind is int else 'a float'}"
                                  f" (now {old!r})") from None
    if old is None and text.strip().lower() in ("true", "false"):
        # A key unset until given (configs/gpt's tie_embeddings, use_bias) takes the
        # words a bool key takes (--noconfig.KEY gives "false"): the string 'false' was
        # kept, and a model read it as true, unsaid.
        return text.strip().lower() == "true"
    if isinstance(old, (tuple, list)) or old is None:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if old is None:
                return text
            example = tuple(old) if old else ("a", "b")  # () shows no element's form
            raise ConfigError(f"{name}={text!r} must be a Python tuple, e.g. "
                              f"\"{example!r}\"") from None
        if isinstance(old, tuple) and isinstance(value, list):
            value = tuple(value)
        return value
    return text


def parse_arg(arg: str | None, choices: Mapping[str, Iterable] | None = None,
              **defaults) -> ml_collections.ConfigDict:
    """An experiment's `:ARG` ("variant=gpt-tiny-rope,steps=100") over `defaults`, each
    value typed as its default; a key not in `defaults`, or a value outside `choices[key]`,
    is a ConfigError naming the valid ones (so a misspelt argument never trains the
    default silently)."""
    args = dict(defaults)
    given = set()
    for item in (arg.split(",") if arg else []):
        key, sep, text = item.partition("=")
        if not sep or key not in defaults:
            valid = sorted(defaults)
            raise ConfigError(f"{key!r} is not an argument of this config{did_you_mean(key, valid)}"
                              f"; valid: {valid} as :key=value,key=value")
        if key in given:  # the last would win, unsaid
            raise ConfigError(f"{key!r} is given twice in :{arg}; give each argument once")
        given.add(key)
        args[key] = parse_value(f":{key}", defaults[key], text)
    for key, valid in (choices or {}).items():
        check_choice(f":{key}", args[key], valid)
    return ml_collections.ConfigDict(args)
