"""The trainer: `train_and_evaluate(config, workdir)`, one function read top to bottom.

Phases, each a section below: config (defaults and validation) → mesh → data →
model/optimizer (train state created already sharded) → step functions → checkpoint
(resume order) → eval → loop. What differs between model families (which model, which
data, which loss) is a `Task` built by `attention_jax.tasks`-style adapters at the end
of this file; the trainer itself knows nothing about GPT or ViT.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from attention_jax import checkpoint as ckpt_lib
from attention_jax import sharding
from attention_jax.data import loaders


# =================================================================================== config
def base_config() -> ml_collections.ConfigDict:
    """Defaults of every group but `model` and `data`, which each experiment defines.

    Experiments start from this and override; the keys here are also the schema that
    `validate_config` checks (an unknown key is an error, not silently ignored).
    """
    c = ml_collections.ConfigDict()
    c.task = ""  # which adapter builds model + data + loss: one of TASKS.
    c.model = ml_collections.ConfigDict()  # fields of the model's own config dataclass.
    c.data = ml_collections.ConfigDict()  # dataset name, lengths, tokenizer: per task.

    c.optim = o = ml_collections.ConfigDict()
    o.lr = 3e-4  # peak learning rate, reached after warmup.
    o.warmup_steps = 100  # linear warmup from 0 (Goyal et al. 2017; stabilises Adam early).
    o.schedule = "cosine"  # decay after warmup: cosine | linear | constant.
    o.end_lr_ratio = 0.1  # final lr as a fraction of the peak (cosine/linear).
    o.b1 = 0.9  # Adam first-moment decay.
    o.b2 = 0.95  # Adam second-moment decay (0.95 is the LLM convention; 0.999 for small data).
    o.eps = 1e-8  # Adam epsilon.
    o.weight_decay = 0.1  # decoupled (AdamW, Loshchilov & Hutter 2019); not on norms/biases/embeddings.
    o.clip_norm = 1.0  # global-norm gradient clipping; 0 disables.
    o.label_smoothing = 0.0  # Szegedy et al. 2016; applies to classification/LM targets.
    o.grad_accum = 1  # micro-batches per optimizer step (train.batch_size is split into them).
    o.decay_steps = 0  # length of the warmup + decay schedule; 0: train.steps.

    c.train = t = ml_collections.ConfigDict()
    t.steps = 1000  # optimizer steps.
    t.batch_size = 32  # global batch (all processes, all micro-batches) per step.
    t.seed = 0  # parameters, dropout and data order all derive from it.
    t.compute_dtype = "float32"  # float32 | bfloat16: activations/matmuls; params stay float32.
    t.log_every = 10  # steps between metric records (JSONL + TensorBoard).
    t.progress = True  # show a progress bar on process 0.
    t.nonfinite = "stop"  # non-finite loss: stop (keep last good checkpoint) | skip the step.
    t.inject_nan_at = -1  # fault injection: the loss of step N (1-based, as logged) is NaN; -1 never.
    t.checkpoint_every = 500  # steps between checkpoints (plus one at the end and on SIGTERM).
    t.keep_checkpoints = 3  # newest checkpoints kept on disk.
    t.async_checkpoint = True  # write checkpoints in the background.
    t.init_from = ""  # warm start: a workdir or checkpoint dir whose params (only) to load.
    t.data_workers = 0  # grain worker processes (0: read in the trainer process).

    c.mesh = m = ml_collections.ConfigDict()
    m.data = -1  # data-parallel axis; -1 takes the devices the other axes leave.
    m.fsdp = 1  # fully sharded data parallel: batch and parameters split.
    m.tensor = 1  # tensor (model) parallel: heads and MLP hidden split.
    m.num_devices = 0  # use only the first N devices (0: all), e.g. 1 for a one-device baseline.
    m.rules = sharding.DEFAULT_RULES  # logical axis -> mesh axes (see sharding.py).
    m.distributed = False  # call jax.distributed.initialize (multi-host).
    m.coordinator_address = ""  # host:port of process 0; empty lets JAX detect it.
    m.num_processes = -1  # -1: detect.
    m.process_id = -1  # -1: detect.
    m.cpu_collectives = ""  # e.g. gloo: collectives between CPU processes.

    c.eval = e = ml_collections.ConfigDict()
    e.every = 500  # steps between evaluations (and at the end); 0: only at the end; -1: never.
    e.steps = 10  # eval batches per evaluation; 0 = the whole split.
    e.batch_size = 32  # global eval batch.
    e.sample_prompts = ("def ", "import ")  # language models: prompts for --mode=sample.
    e.sample_tokens = 64  # tokens generated per prompt.
    e.sample_temperature = 0.8  # 0 is greedy.
    e.sample_top_k = 40  # keep the k most likely tokens (0: all).
    return c


class ConfigError(ValueError):
    """A config key with an invalid value; the message names the key and valid values."""


_CHOICES = {
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.compute_dtype": ("float32", "bfloat16"),
    "train.nonfinite": ("stop", "skip"),
}


def _flat(cfg: ml_collections.ConfigDict, prefix="") -> dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, ml_collections.ConfigDict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def validate_config(config, num_devices: int | None = None, check_task: bool = True) -> None:
    """Checks keys, types and combinations before anything is compiled.

    With `num_devices`, also the mesh and what must divide it (batch, heads).
    """
    base = _flat(base_config())
    got = _flat(config)
    for key, value in got.items():
        if key.startswith(("model.", "data.")):
            continue  # Checked by the task against the model/data dataclasses.
        if key not in base:
            group = key.rsplit(".", 1)[0]
            valid = sorted(k.rsplit(".", 1)[1] for k in base if k.rsplit(".", 1)[0] == group)
            raise ConfigError(f"config.{key} is not a known key; valid keys in "
                              f"config.{group}: {valid or sorted(base)}")
        want = base[key]
        if isinstance(want, float) and isinstance(value, int) and not isinstance(value, bool):
            continue
        if type(value) is not type(want) and not (isinstance(want, tuple) and isinstance(value, list)):
            raise ConfigError(f"config.{key}={value!r} has type {type(value).__name__}; "
                              f"expected {type(want).__name__} (default {want!r})")
    if check_task and config.task not in TASKS:
        raise ConfigError(f"config.task={config.task!r} is unknown; valid: {sorted(TASKS)}")
    for key, choices in _CHOICES.items():
        if got[key] not in choices:
            raise ConfigError(f"config.{key}={got[key]!r} is invalid; valid: {list(choices)}")
    for key in ("train.steps", "train.batch_size", "optim.grad_accum", "train.log_every",
                "train.checkpoint_every", "train.keep_checkpoints", "eval.batch_size"):
        if got[key] <= 0:
            raise ConfigError(f"config.{key}={got[key]} must be a positive integer")
    if got["eval.every"] < -1:
        raise ConfigError(f"config.eval.every={got['eval.every']} must be >= -1")
    for key in ("optim.warmup_steps", "eval.steps", "train.data_workers",
                "mesh.num_devices"):
        if got[key] < 0:
            raise ConfigError(f"config.{key}={got[key]} must be >= 0")
    sharding.rules_from_config(config.mesh.rules)
    if num_devices is None:
        return
    try:
        mesh = sharding.resolve_mesh_shape(
            {a: config.mesh[a] for a in sharding.MESH_AXES}, num_devices)
    except ValueError as e:
        raise ConfigError(f"config.mesh: {e}") from None
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


def check_model_fits_mesh(model, mesh) -> None:
    """Heads are split over the tensor axis (rule heads -> tensor): every device must
    hold whole heads. Checked on the model's resolved config (variant + overrides)."""
    cfg = getattr(model, "config", model)
    tensor = mesh.shape["tensor"]
    for field in dataclasses.fields(cfg) if dataclasses.is_dataclass(cfg) else ():
        value = getattr(cfg, field.name)
        if "heads" in field.name and isinstance(value, int) and value % tensor:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise ConfigError(
                f"config.model.{field.name}={value} is not divisible by mesh.tensor={tensor}; "
                f"valid: mesh.tensor in {divisors}, or num heads a multiple of {tensor}")


# ===================================================================================== task
@dataclasses.dataclass
class Task:
    """What the trainer needs from a model family (built by the adapters in TASKS).

    init(rng) -> the params tree (with flax logical-axis boxes);
    loss(params, batch, rng, train) -> (scalar loss, {name: scalar metric});
    sources are random-access (`len`, `[i]`), transforms map (record, np rng) -> example.
    """
    model: nn.Module
    init: Callable[[jax.Array], Any]
    loss: Callable[..., tuple[jax.Array, dict]]
    train_source: Any
    eval_source: Any
    train_transform: Callable | None = None
    eval_transform: Callable | None = None
    unit: str = "examples"  # throughput unit in the progress bar: tokens | examples.
    count: Callable[[dict], int] | None = None  # units in a host batch (default: rows).
    sample: Callable | None = None  # (params, config, rng) -> list of strings.
    save_assets: Callable[[str], None] | None = None  # e.g. the tokenizer into the workdir.


def cross_entropy(logits, targets, weights=None, label_smoothing: float = 0.0):
    """Mean cross-entropy over weighted positions, and accuracy, in float32.

    logits [..., V], targets [...] ints, weights [...] (0 for padding).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    labels = jax.nn.one_hot(targets, vocab)
    if label_smoothing:
        labels = labels * (1 - label_smoothing) + label_smoothing / vocab
    losses = optax.softmax_cross_entropy(logits, labels)
    weights = jnp.ones_like(losses) if weights is None else weights.astype(jnp.float32)
    total = jnp.maximum(weights.sum(), 1.0)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return (losses * weights).sum() / total, {"accuracy": (correct * weights).sum() / total}


def moe_metrics(aux) -> dict[str, jax.Array]:
    """Router statistics found anywhere in a model's aux dict, averaged over layers.

    Mixture-of-experts layers report `load_balance_loss` (Switch Transformer, Fedus et
    al. 2021), `router_entropy`, `dropped_fraction` and `expert_load` [E] (one metric
    per expert), so every task logs MoE models the same way. (The weighted balance loss
    itself is added to the objective by the model, as aux["moe_loss"].)
    """
    found: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(aux)[0]:
        name = ckpt_lib._key_name(path[-1]) if path else ""
        if name in MOE_KEYS:
            found.setdefault(name, []).append(jnp.asarray(leaf, jnp.float32))
    metrics = {}
    for name, values in found.items():
        value = jnp.mean(jnp.stack([v.reshape(-1, v.shape[-1]).mean(0) if name == "expert_load"
                                    else v.mean() for v in values]), axis=0)
        if value.ndim:
            metrics.update({f"moe/{name}_{i}": value[i] for i in range(value.shape[0])})
        else:
            metrics[f"moe/{name}"] = value
    return metrics


MOE_KEYS = ("load_balance_loss", "router_entropy", "dropped_fraction", "expert_load")


# ============================================================================ optimizer
def learning_rate_schedule(o, total_steps: int) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1))
    decay_steps = max(total_steps - o.warmup_steps, 1)
    end = o.lr * o.end_lr_ratio
    if o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(o.lr, decay_steps, alpha=o.end_lr_ratio)
    elif o.schedule == "linear":
        decay = optax.linear_schedule(o.lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(o.lr)
    return optax.join_schedules([warmup, decay], [o.warmup_steps])


def decay_mask(params):
    """True where weight decay applies: matrices, but not embeddings (a lookup table
    pulled toward zero only shrinks rare tokens), nor biases and norm scales (1-D)."""
    def keep(path, x):
        names = "/".join(ckpt_lib._key_name(k) for k in path).lower()
        return x.ndim >= 2 and "embed" not in names and "pos_emb" not in names
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(o, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(o, total_steps)
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule


# ==================================================================================== state
def create_state(task: Task, tx, mesh, rules, seed: int):
    """Abstract state (with shardings) and a function that creates it already sharded.

    The state is a dict {step, params, opt_state, rng}: plain containers keep checkpoints
    readable by any tool. Shardings come from the logical names on the parameters; the
    optimizer state mirrors them (optax's tree_map_params), counters are replicated.
    """
    boxed = jax.eval_shape(task.init, jax.random.PRNGKey(seed))
    param_sh = sharding.logical_to_shardings(nn.get_partition_spec(boxed), mesh, rules)
    abstract_params = nn.meta.unbox(boxed)
    sharding.check_divisible(abstract_params, param_sh)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    repl = sharding.replicated(mesh)
    opt_sh = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_sh, transform_non_params=lambda _: repl,
        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    shardings = {"step": repl, "params": param_sh, "opt_state": opt_sh, "rng": repl}

    def init(seed_key):
        params = nn.meta.unbox(task.init(seed_key))
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(params), "rng": jax.random.fold_in(seed_key, 1)}

    abstract = jax.eval_shape(init, jax.random.PRNGKey(seed))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    # jit with out_shardings: every device computes only its own shards; the full
    # state never exists on one device.
    init_fn = jax.jit(init, out_shardings=shardings)
    return abstract, shardings, lambda: init_fn(jax.random.PRNGKey(seed))


# =========================================================================== step functions
def _cast_params(params, dtype):
    """Mixed precision: float32 master params, low-precision copy for the forward pass."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


def make_train_step(task: Task, tx, schedule, config, mesh):
    dtype = jnp.dtype(config.train.compute_dtype)
    accum = config.optim.grad_accum
    nan_at = config.train.inject_nan_at
    batch_sh = sharding.batch_sharding(mesh)

    def loss_fn(params, batch, rng, step):
        loss, metrics = task.loss(_cast_params(params, dtype), batch, rng, True)
        if nan_at >= 0:  # Fault injection for testing the non-finite path.
            loss = loss * jnp.where(step + 1 == nan_at, jnp.nan, 1.0)
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state, batch):
        step, params = state["step"], state["params"]
        rng = jax.random.fold_in(state["rng"], step)  # A function of step: resume-exact.
        if accum == 1:
            (loss, metrics), grads = grad_fn(params, batch, rng, step)
        else:
            # Micro-batch j takes rows j, j+A, j+2A, ...: every device keeps an equal
            # share of each micro-batch (a plain reshape would put micro-batch 0 on
            # the first devices only).
            def split(x):
                x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
                return jax.lax.with_sharding_constraint(
                    x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                        None, *batch_sh.spec)))

            def body(carry, xs):
                mb, j = xs
                (l, m), g = grad_fn(params, mb, jax.random.fold_in(rng, j), step)
                return jax.tree.map(jnp.add, carry, (l, m, g)), None

            micro = jax.tree.map(split, batch)
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                 jax.eval_shape(grad_fn, params,
                                                jax.tree.map(lambda x: x[0], micro), rng, step))
            (loss, metrics), grads = zeros
            (loss, metrics, grads), _ = jax.lax.scan(
                body, (loss, metrics, grads), (micro, jnp.arange(accum)))
            loss, metrics, grads = jax.tree.map(lambda x: x / accum, (loss, metrics, grads))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A non-finite step changes nothing but the step counter: in "stop" mode the
        # host stops after it, in "skip" mode training goes on with the old values.
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new,
                           {"params": params, "opt_state": state["opt_state"]})
        new_state = {**new, "step": step + 1, "rng": state["rng"]}
        metrics = {**metrics, "loss": loss, "grad_norm": grad_norm, "lr": schedule(step),
                   "finite": finite}
        return new_state, metrics

    return train_step


def make_eval_step(task: Task, config):
    dtype = jnp.dtype(config.train.compute_dtype)

    def eval_step(params, batch):
        loss, metrics = task.loss(_cast_params(params, dtype), batch, jax.random.PRNGKey(0), False)
        return {**metrics, "loss": loss}

    return eval_step


# ================================================================================= metrics
class MetricWriter:
    """Metrics as JSONL (`metrics.jsonl`, one object per record) and TensorBoard event
    files (`tensorboard/`), written by process 0 only."""

    def __init__(self, workdir: str):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            from tensorboardX import SummaryWriter
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in metrics.items():
            self._tb.add_scalar(f"{split}/{k}", float(v), step)
        self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient became NaN/inf with `train.nonfinite='stop'`."""


# ==================================================================================== data
def make_train_loader(task: Task, config, state=None) -> loaders.Loader:
    """Shuffled, repeated stream of training batches; this process's share of each.

    Its position (`next_index`, examples consumed) depends only on the seed and the
    number of steps taken, never on the number of devices or processes, so a run
    resumes on any mesh with the same batches.
    """
    return loaders.Loader(task.train_source, global_batch_size=config.train.batch_size,
                          seed=config.train.seed, transform=task.train_transform,
                          worker_count=config.train.data_workers, state=state)


def evaluate(eval_step, params, task: Task, config, mesh) -> dict[str, float]:
    """Mean of the eval metrics over `eval.steps` batches (0: the whole split)."""
    loader = loaders.Loader(task.eval_source, global_batch_size=config.eval.batch_size,
                            seed=config.train.seed, shuffle=False, num_epochs=1,
                            transform=task.eval_transform)
    sums, n = {}, 0
    for batch in loader:
        metrics = jax.device_get(eval_step(params, sharding.shard_batch(batch, mesh)))
        sums = {k: sums.get(k, 0.0) + float(v) for k, v in metrics.items()}
        n += 1
        if config.eval.steps and n >= config.eval.steps:
            break
    if n == 0:
        raise ValueError(f"the eval split has fewer than eval.batch_size="
                         f"{config.eval.batch_size} examples; lower config.eval.batch_size")
    means = {k: v / n for k, v in sums.items()}
    if task.unit == "tokens":
        means["perplexity"] = math.exp(min(means["loss"], 50.0))
    return means


# ==================================================================================== loop
def setup(config, workdir: str, task: Task | None = None):
    """Everything before the first step: validated config, mesh, task, optimizer, state
    shardings and the checkpointer. Shared by training, eval and sampling."""
    sharding.maybe_initialize_distributed(config.mesh)  # Before anything touches devices.
    devices = jax.devices()[:config.mesh.num_devices or None]
    validate_config(config, len(devices), check_task=task is None)
    mesh = sharding.make_mesh({a: config.mesh[a] for a in sharding.MESH_AXES}, devices)
    rules = sharding.rules_from_config(config.mesh.rules)
    task = task or TASKS[config.task](config, workdir)
    check_model_fits_mesh(task.model, mesh)
    tx, schedule = make_optimizer(config.optim, config.optim.decay_steps or config.train.steps)
    # Shapes and shardings are worked out outside the mesh context: flax's partitioned
    # initialisers would otherwise try to constrain abstract values eagerly.
    with nn.logical_axis_rules(rules):
        abstract, shardings, init_state = create_state(task, tx, mesh, rules, config.train.seed)
    ckpt = ckpt_lib.Checkpointer(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        save_every=config.train.checkpoint_every, keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoint)
    return dataclasses.make_dataclass("Setup", ["mesh", "rules", "task", "tx", "schedule",
                                                "abstract", "shardings", "init_state", "ckpt"])(
        mesh, rules, task, tx, schedule, abstract, shardings, init_state, ckpt)


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def restore_or_init(s, config):
    """(state, data_state). Resume order: this workdir's latest checkpoint → the params
    of `train.init_from` (fresh optimizer and data position) → scratch."""
    if s.ckpt.latest_step() is not None:
        state, data_state = s.ckpt.restore(s.abstract)
        _say(f"resumed from {s.ckpt.directory} at step {int(state['step'])}")
        return state, data_state
    state = s.init_state()
    if config.train.init_from:
        src = config.train.init_from
        if os.path.isdir(os.path.join(src, "checkpoints")):
            src = os.path.join(src, "checkpoints")
        state["params"], step = ckpt_lib.restore_params(src, s.abstract["params"])
        _say(f"warm start: params from {src} step {step}")
    return state, None


def train_and_evaluate(config, workdir: str, task: Task | None = None) -> dict[str, Any]:
    """Trains `config` in `workdir`, resuming whatever is there. Returns a summary:
    {'step', 'train': last logged metrics, 'eval': last eval metrics, 'losses': the loss
    of each step run by this call, 'stopped_by': signal name or None, 'state': the final
    train state (sharded jax.Arrays)}."""
    os.makedirs(workdir, exist_ok=True)
    s = setup(config, workdir, task)
    task, mesh = s.task, s.mesh
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        if task.save_assets:
            task.save_assets(workdir)

    batch_sh = sharding.batch_sharding(mesh)
    repl = sharding.replicated(mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(s.rules):
        state, data_state = restore_or_init(s, config)
        train_step = jax.jit(make_train_step(task, s.tx, s.schedule, config, mesh),
                             in_shardings=(s.shardings, batch_sh), out_shardings=(s.shardings, repl),
                             donate_argnums=0)  # The old state's buffers hold the new one.
        eval_step = jax.jit(make_eval_step(task, config),
                            in_shardings=(s.shardings["params"], batch_sh), out_shardings=repl)
        loader = make_train_loader(task, config, data_state)
        summary = _loop(config, workdir, s, state, loader, train_step, eval_step)
    return summary


def _loop(config, workdir, s, state, loader, train_step, eval_step) -> dict[str, Any]:
    task, mesh, ckpt = s.task, s.mesh, s.ckpt
    total = config.train.steps
    step = int(jax.device_get(state["step"]))
    writer = MetricWriter(workdir)
    show = config.train.progress and jax.process_index() == 0
    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=step, disable=not show, dynamic_ncols=True, unit="step")
    summary = {"step": step, "train": {}, "eval": {}, "losses": [], "stopped_by": None}
    window, units, t0 = [], 0, time.perf_counter()
    batches = iter(loader)
    try:
        with ckpt_lib.StopRequest() as stop:
            while step < total:
                host_batch = next(batches)
                units += (task.count(host_batch) if task.count else
                          len(jax.tree.leaves(host_batch)[0])) * jax.process_count()
                state, metrics = train_step(state, sharding.shard_batch(host_batch, mesh))
                step += 1
                metrics = jax.device_get(metrics)  # Syncs: the host needs loss/finite now.
                if not metrics["finite"]:
                    _nonfinite(config, step, metrics, ckpt)
                    continue  # "skip": the update was not applied.
                summary["losses"].append(float(metrics["loss"]))
                window.append(metrics)
                rate = units / max(time.perf_counter() - t0, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                **{f"{task.unit}/s": f"{rate:,.0f}"})
                if step % config.train.log_every == 0 or step == total:
                    means = {k: float(np.mean([m[k] for m in window])) for k in window[0]
                             if k != "finite"}
                    means[f"{task.unit}_per_sec"] = rate
                    writer.write(step, "train", means)
                    summary["train"], window, units, t0 = means, [], 0, time.perf_counter()
                every = config.eval.every
                if every >= 0 and (step == total or (every and step % every == 0)):
                    summary["eval"] = evaluate(eval_step, state["params"], task, config, mesh)
                    writer.write(step, "eval", summary["eval"])
                    bar.write(f"step {step} eval: " + ", ".join(
                        f"{k}={v:.4g}" for k, v in summary["eval"].items()))
                stopping = stop.requested()
                data_state = loader.get_state().to_dict()
                if stopping or step == total:
                    ckpt.save(step, state, data_state, force=True)
                else:
                    ckpt.save(step, state, data_state)  # Only every checkpoint_every steps.
                if stopping:
                    import signal as signal_lib
                    summary["stopped_by"] = signal_lib.Signals(stop.signal).name
                    bar.write(f"{summary['stopped_by']}: saved checkpoint at step {step}; "
                              f"run the same command again to resume")
                    break
    finally:
        ckpt.wait()  # A pending async save commits before we return or raise.
        ckpt.close()
        bar.close()
        writer.close()
    summary["step"], summary["state"] = step, state
    return summary


def _nonfinite(config, step, metrics, ckpt) -> None:
    what = f"loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}"
    if config.train.nonfinite == "skip":
        logging.warning("step %d: non-finite (%s); update skipped", step, what)
        return
    ckpt.wait()
    last = ckpt.latest_step()
    where = (f"the last good checkpoint is step {last} in {ckpt.directory}" if last is not None
             else "no checkpoint was written yet")
    raise NonFiniteLossError(
        f"non-finite training loss at step {step} ({what}); stopping without saving: "
        f"{where}. Lower config.optim.lr, check the data, or set "
        f"--config.train.nonfinite=skip to skip such steps.")


# =================================================================================== tasks
# config.task -> function(config, workdir) -> Task. The model families register below; a
# notebook or a test can add its own (`TASKS["mine"] = make_my_task`).
TASKS: dict[str, Callable[[Any, str], Task]] = {}


def model_config(cls, config, **forced):
    """The model's frozen config from `config.model`: an optional `variant` name (the
    model file's table) plus overrides of its fields. Unknown keys name the valid ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    given = config.model.to_dict()
    variant = given.pop("variant", None)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ConfigError(f"config.model.{unknown[0]} is not a field of {cls.__name__}; "
                          f"valid: {sorted(fields | {'variant'})}")
    kwargs = {**given, **{k: v for k, v in forced.items() if k in fields}}
    try:
        return cls.from_variant(variant, **kwargs) if variant else cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.model: {e}") from None


def data_options(config, **defaults) -> ml_collections.ConfigDict:
    """`config.data` checked against the task's keys (with their defaults and types)."""
    given = config.data.to_dict()
    for key, value in given.items():
        if key not in defaults:
            raise ConfigError(f"config.data.{key} is not a key of task {config.task!r}; "
                              f"valid: {sorted(defaults)}")
        want = type(defaults[key])
        if not isinstance(value, want) and not (want is float and isinstance(value, int)):
            raise ConfigError(f"config.data.{key}={value!r} must be {want.__name__}")
    return ml_collections.ConfigDict({**defaults, **given})


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _tokenizer(d, workdir: str, texts: Callable[[], list[str]]):
    """The run's tokenizer: the one saved in the workdir (so a resumed run, eval and
    sampling decode with exactly the training vocabulary), else a new one."""
    from attention_jax import data
    saved = os.path.join(workdir, "tokenizer")
    if os.path.exists(os.path.join(saved, "tokenizer_meta.json")):
        tok = data.load_tokenizer(saved)
        if tok.kind != d.tokenizer:
            raise ConfigError(f"config.data.tokenizer={d.tokenizer!r} but {saved} holds a "
                              f"{tok.kind!r} tokenizer; use a new workdir to change it")
        return tok
    if d.tokenizer in ("byte", "wordpiece"):
        return data.get_tokenizer(d.tokenizer)
    return data.get_tokenizer(d.tokenizer, texts=texts(), vocab_size=d.vocab_size)


def padded_vocab(n: int, multiple: int = 64) -> int:
    """Vocabulary rounded up so the vocab axis splits over any tensor size up to 64 and
    the matmuls get hardware-friendly shapes (nanoGPT pads 50257 to 50304 likewise);
    the extra rows are never targets, so they only learn to be unlikely."""
    return -(-n // multiple) * multiple


def _splits(d, **options):
    from attention_jax import data
    get = lambda split: data.get_dataset(d.name, split, d.data_dir or None, **options)
    return get(d.train_split), get(d.eval_split)


def _corpus_options(d) -> dict:
    return {"max_files": d.max_files} if d.max_files else {}


def lm_task(config, workdir: str) -> Task:
    """GPT next-token prediction on packed documents (default: the stdlib corpus)."""
    from attention_jax import data
    from attention_jax.models import gpt
    d = data_options(config, name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                     tokenizer="byte", vocab_size=1024, seq_len=128, train_split="train",
                     eval_split="validation")
    train_docs, eval_docs = _splits(d, **_corpus_options(d))
    tok = _tokenizer(d, workdir, lambda: [_text(train_docs[i]["text"])
                                          for i in range(min(len(train_docs), 300))])
    cfg = model_config(gpt.GPTConfig, config, vocab_size=padded_vocab(tok.vocab_size),
                       dtype=config.train.compute_dtype)
    if cfg.position == "learned" and d.seq_len > cfg.max_len:
        raise ConfigError(f"config.data.seq_len={d.seq_len} exceeds config.model.max_len="
                          f"{cfg.max_len}; valid: seq_len <= {cfg.max_len}")
    model = gpt.GPT(cfg)
    pack = lambda docs: data.packed_lm_source(docs, tok, d.seq_len,
                                              max_documents=d.max_documents or None)

    def loss(params, batch, rng, train):
        logits, aux = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                                  segment_ids=batch["segment_ids"], deterministic=not train,
                                  rngs={"dropout": rng})
        nll, m = gpt.cross_entropy(logits, batch["targets"], batch["weights"],
                                   config.optim.label_smoothing if train else 0.0)
        return nll + aux.get("moe_loss", 0.0), {"accuracy": m["accuracy"], **moe_metrics(aux)}

    def sample(params, rng):
        prompts = [tok.encode(p) or [tok.bos_id] for p in config.eval.sample_prompts]
        width = max(map(len, prompts))
        new = config.eval.sample_tokens
        if cfg.position == "learned":
            new = min(new, cfg.max_len - width)
        padded = np.array([p + [tok.pad_id] * (width - len(p)) for p in prompts], np.int32)
        out, lengths = gpt.generate(
            model, params, padded, np.array([len(p) for p in prompts], np.int32),
            max_new_tokens=new, rng=rng, temperature=config.eval.sample_temperature,
            top_k=config.eval.sample_top_k or None, stop_token=tok.eos_id, pad_token=tok.pad_id)
        out, lengths = np.asarray(out), np.asarray(lengths)
        return [tok.decode(out[i, :lengths[i]]) for i in range(len(prompts))]

    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=data.CausalLM(), eval_transform=data.CausalLM(), unit="tokens",
                count=lambda b: int(np.sum(b["weights"])), sample=sample,
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")))


def mlm_task(config, workdir: str) -> Task:
    """BERT masked-language modelling (Devlin et al. 2019) on packed documents."""
    from attention_jax import data
    from attention_jax.models import bert
    d = data_options(config, name="python_stdlib", data_dir="", max_files=0, max_documents=0,
                     tokenizer="bpe", vocab_size=2048, seq_len=128, mask_rate=0.15,
                     train_split="train", eval_split="validation")
    if d.tokenizer not in ("bpe", "wordpiece"):
        raise ConfigError(f"config.data.tokenizer={d.tokenizer!r}: MLM needs a [MASK] token; "
                          f"valid: ['bpe', 'wordpiece']")
    train_docs, eval_docs = _splits(d, **_corpus_options(d))
    tok = _tokenizer(d, workdir, lambda: [_text(train_docs[i]["text"])
                                          for i in range(min(len(train_docs), 300))])
    cfg = model_config(bert.BertConfig, config, vocab_size=padded_vocab(tok.vocab_size),
                       dtype=config.train.compute_dtype)
    model = bert.Bert(cfg)
    pack = lambda docs: data.packed_lm_source(docs, tok, d.seq_len,
                                              max_documents=d.max_documents or None)
    transform = data.MaskedLM.for_tokenizer(tok, d.mask_rate)
    # The MLM head runs on the M predicted positions only (as BERT's own code does): a
    # [B, T, V] logit array would dominate memory for a 30k vocabulary.
    m_slots = math.ceil(d.mask_rate * d.seq_len) + 1

    def loss(params, batch, rng, train):
        _, slots = jax.lax.top_k(batch["weights"], m_slots)  # [B, M] predicted positions
        take = lambda x: jnp.take_along_axis(x, slots, axis=1)
        out, aux = model.apply({"params": params}, batch["inputs"],
                               attention_mask=batch["segment_ids"] != 0,
                               positions=batch["positions"], segment_ids=batch["segment_ids"],
                               masked_positions=slots, deterministic=not train, rngs={"dropout": rng})
        return cross_entropy(out["mlm_logits"], take(batch["targets"]), take(batch["weights"]),
                             config.optim.label_smoothing if train else 0.0)

    return Task(model=model, init=lambda rng: model.init(rng, jnp.ones((1, d.seq_len), jnp.int32))["params"],
                loss=loss, train_source=pack(train_docs), eval_source=pack(eval_docs),
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["segment_ids"] != 0)),
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")))


def image_task(config, workdir: str) -> Task:
    """ViT image classification (default: scikit-learn's 8×8 digits)."""
    from attention_jax import data
    from attention_jax.models import vit
    d = data_options(config, name="digits", data_dir="", augment=True, padding=1, flip=False,
                     train_split="train", eval_split="test")
    train_src, eval_src = _splits(d)
    cfg = model_config(vit.ViTConfig, config, dtype=config.train.compute_dtype)
    model = vit.ViT(cfg)

    def loss(params, batch, rng, train):
        logits, _ = model.apply({"params": params}, batch["image"], deterministic=not train,
                                rngs={"dropout": rng})
        return cross_entropy(logits, batch["label"], None,
                             config.optim.label_smoothing if train else 0.0)

    shape = (1, cfg.image_size, cfg.image_size, cfg.num_channels)
    return Task(model=model, init=lambda rng: model.init(rng, jnp.zeros(shape))["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=data.ImageClassification(augment=d.augment, padding=d.padding,
                                                         flip=d.flip),
                eval_transform=data.ImageClassification())


def translation_task(config, workdir: str) -> Task:
    """Sequence to sequence, teacher-forced (default: English -> French number words).

    config.task 'rnn_seq2seq' uses models/rnn.py; 'encdec' the Transformer of encdec.py.
    One BPE vocabulary is shared by both languages (Vaswani et al. 2017 §5.1 share one).
    """
    from attention_jax import data
    d = data_options(config, name="number_translation", data_dir="", source="en", target="fr",
                     tokenizer="bpe", vocab_size=512, source_len=32, target_len=32,
                     train_split="train", eval_split="validation")
    train_src, eval_src = _splits(d)
    tok = _tokenizer(d, workdir, lambda: [_text(train_src[i][k]) for i in range(len(train_src))
                                          for k in (d.source, d.target)])
    ids = dict(pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
    vocab = padded_vocab(tok.vocab_size)
    if config.task == "rnn_seq2seq":
        from attention_jax.models import rnn
        cfg = model_config(rnn.RNNConfig, config, src_vocab_size=vocab,
                           tgt_vocab_size=vocab, dtype=jnp.dtype(config.train.compute_dtype), **ids)
        model = rnn.RNNSeq2Seq(cfg)
        apply = lambda params, b, train, rng: model.apply(
            {"params": params}, b["inputs"], b["decoder_inputs"], deterministic=not train,
            rngs={"dropout": rng})
    else:
        from attention_jax.models import encdec
        cfg = model_config(encdec.EncDecConfig, config, src_vocab_size=vocab,
                           tgt_vocab_size=vocab, vocab_size=vocab,
                           dtype=config.train.compute_dtype, **ids)
        model = encdec.EncoderDecoder(cfg)
        apply = lambda params, b, train, rng: model.apply(
            {"params": params}, b["inputs"], b["decoder_inputs"], deterministic=not train,
            rngs={"dropout": rng})

    def loss(params, batch, rng, train):
        logits, aux = apply(params, batch, train, rng)
        return cross_entropy(logits, batch["targets"], batch["target_weights"],
                             config.optim.label_smoothing if train else 0.0)

    transform = data.Translation(tok, tok, d.source, d.target, d.source_len, d.target_len)
    zeros = lambda n: jnp.zeros((1, n), jnp.int32)
    return Task(model=model, init=lambda rng: model.init(rng, zeros(d.source_len) + 3,
                                                         zeros(d.target_len) + 3)["params"],
                loss=loss, train_source=train_src, eval_source=eval_src,
                train_transform=transform, eval_transform=transform, unit="tokens",
                count=lambda b: int(np.sum(b["target_weights"])),
                save_assets=lambda w: tok.save(os.path.join(w, "tokenizer")))


TASKS.update(gpt=lm_task, bert_mlm=mlm_task, vit=image_task, rnn_seq2seq=translation_task,
             encdec=translation_task)
