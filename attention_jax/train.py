"""The trainer: `train_and_evaluate(config, workdir)`, one function read top to bottom.

Phases, each a section below: config (defaults and validation) → mesh → data →
model/optimizer (train state created already sharded) → step functions → checkpoint
(resume order) → eval → loop. What differs between model families (which model, which
data, which loss) is a `Task` built by the adapters in `attention_jax/tasks.py`
(`TASKS[config.task]`); the trainer itself knows nothing about GPT or ViT.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from attention_jax import checkpoint as ckpt_lib
from attention_jax import convert
from attention_jax import sharding
from attention_jax.data import loaders
from attention_jax.errors import UserError
# The model families live in tasks.py; these names are re-exported because callers
# (main.py, runs.py, tools, tests) use them as train.ConfigError, train.Task, train.TASKS.
from attention_jax.tasks import TASKS, ConfigError, Task, check_range  # noqa: F401


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
    o.eps = 1e-8
    o.weight_decay = 0.1  # decoupled (AdamW, Loshchilov & Hutter 2019); matrices only (decay_mask).
    o.clip_norm = 1.0  # global-norm gradient clipping; 0 disables.
    o.label_smoothing = 0.0  # Szegedy et al. 2016; applies to classification/LM targets.
    o.grad_accum = 1  # micro-batches per optimizer step (train.batch_size is split into them).
    o.decay_steps = 0  # length of the warmup + decay schedule; 0: train.steps.

    c.train = t = ml_collections.ConfigDict()
    t.steps = 1000  # optimizer steps (each of grad_accum micro-batches).
    t.batch_size = 32  # global batch (all processes, all micro-batches) per step.
    t.seed = 0  # parameters, dropout and data order all derive from it.
    t.compute_dtype = "float32"  # float32 | bfloat16: activations/matmuls; params stay float32.
    t.loss_chunk_size = 0  # GPT: positions per chunk of the fused LM head + loss; 0: whole logits.
    t.log_every = 10  # steps between metric records (JSONL + TensorBoard).
    t.progress = True  # show a progress bar on process 0.
    t.nonfinite = "stop"  # non-finite loss: stop (keep last good checkpoint) | skip the step.
    t.inject_nan_at = -1  # fault injection: the loss of step N (1-based, as logged) is NaN; -1 never.
    t.checkpoint_every = 500  # steps between checkpoints (plus one at the end and on SIGTERM).
    t.keep_checkpoints = 3
    t.async_checkpoint = True
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

    c.eval = e = ml_collections.ConfigDict()
    e.every = 500  # steps between evaluations (and at the end); 0: only at the end; -1: never.
    e.steps = 10  # 0: the whole split.
    e.batch_size = 32  # global eval batch.
    e.sample_prompts = ("def ", "import ")  # language models: prompts for --mode=sample.
    e.sample_tokens = 64  # tokens generated per prompt.
    e.sample_temperature = 0.8  # 0 is greedy.
    e.sample_top_k = 40  # keep the k most likely tokens (0: all).
    return c


_CHOICES = {
    "optim.schedule": ("cosine", "linear", "constant"),
    "train.compute_dtype": ("float32", "bfloat16"),
    "train.nonfinite": ("stop", "skip"),
    "train.checkpoint_on_damage": ("fall_back", "stop"),
}


# Valid values of the numeric keys, as intervals ("(" open, "[" closed; tasks.check_range).
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
    "train.batch_size": "[1, inf)",
    "train.loss_chunk_size": "[0, inf)",
    "train.log_every": "[1, inf)",
    "train.inject_nan_at": "[-1, inf)",
    "train.checkpoint_every": "[1, inf)",
    "train.keep_checkpoints": "[1, inf)",
    "train.data_workers": "[0, inf)",
    "train.prefetch": "[0, inf)",
    "mesh.num_devices": "[0, inf)",
    "eval.every": "[-1, inf)",
    "eval.steps": "[0, inf)",
    "eval.batch_size": "[1, inf)",
    "eval.sample_tokens": "[1, inf)",
    "eval.sample_temperature": "[0, inf)",
    "eval.sample_top_k": "[0, inf)",
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
    for key, interval in RANGES.items():
        check_range(key, got[key], interval)
    schedule = got["optim.decay_steps"] or got["train.steps"]
    if got["optim.warmup_steps"] > schedule:
        what = (f"optim.decay_steps={schedule}" if got["optim.decay_steps"]
                else f"the run (train.steps={schedule})")
        raise ConfigError(
            f"config.optim.warmup_steps={got['optim.warmup_steps']} is longer than {what}: "
            f"the learning rate would never reach optim.lr; valid: warmup_steps <= {schedule} "
            f"(or set optim.decay_steps >= {got['optim.warmup_steps']} to run the start of a "
            f"longer schedule)")
    sharding.rules_from_config(config.mesh.rules)
    if num_devices is None:
        return
    try:
        mesh = sharding.resolve_mesh_shape(
            {a: config.mesh.get(a, 1) for a in sharding.MESH_AXES}, num_devices)
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


def check_model_fits_mesh(model, mesh, seq_len: int | None = None) -> None:
    """Heads are split over the tensor axis (rule heads -> tensor): every device must
    hold whole heads. Checked on the model's resolved config (variant + overrides).
    The length is split over the sequence axis into two chunks per device (ring
    attention's zig-zag), so seq_len (when the task has a fixed one) must divide."""
    cfg = getattr(model, "config", model)
    sequence = mesh.shape.get("sequence", 1)
    if seq_len is not None and sequence > 1 and seq_len % (2 * sequence):
        raise ConfigError(
            f"config.data.seq_len={seq_len} is not divisible by 2 × mesh.sequence = "
            f"{2 * sequence} (ring attention gives each device two chunks of the sequence); "
            f"valid: seq_len a multiple of {2 * sequence}, or mesh.sequence in "
            f"{[d for d in range(1, seq_len + 1) if seq_len % (2 * d) == 0]}")
    tensor = mesh.shape["tensor"]
    for name in ("num_heads", "num_kv_heads"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value % tensor:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise ConfigError(
                f"config.model.{name}={value} is not divisible by mesh.tensor={tensor}; "
                f"valid: mesh.tensor in {divisors}, or num heads a multiple of {tensor}")


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


# Parameters that weight decay leaves alone, by the role their name gives them: lookup
# tables ("embedding": token, segment and learned position tables; ViT's
# "position_embeddings"; a table pulled toward zero only shrinks rare tokens), ViT's
# [CLS] token ("cls"), norm scales ("scale") and biases ("bias", "<matrix>_bias").
NO_DECAY = ("embedding", "position_embeddings", "cls", "scale", "bias")


def decay_mask(params):
    """True where weight decay applies: the matrices (projection kernels of any rank,
    ViT's patch-embedding convolution, MoE routers), by the role of the leaf's name."""
    def decays(path, x):
        name = ckpt_lib.key_name(path[-1]) if path else ""
        return x.ndim >= 2 and name not in NO_DECAY and not name.endswith("_bias")
    return jax.tree_util.tree_map_with_path(decays, params)


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
        if config.train.nonfinite == "skip":
            # A non-finite step changes nothing but the step counter: training goes on
            # with the old values. Only here: selecting between the old and new state
            # makes XLA copy every AdamW moment each step (the new moments are written
            # in place while the parameters' update still reads the old ones; seen in the
            # compiled step, tests/system/test_training.py counts the copies). In "stop"
            # mode the host finds the step at the next sync point, before anything is
            # saved, and stops: the state after it is never saved or used.
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

    def __init__(self, workdir: str, resume_step: int | None = None):
        """resume_step: training (re)starts after this step, so records of later steps
        (written before a crash, or before a fall back to an older checkpoint) are
        superseded: dropped from metrics.jsonl and purged from TensorBoard."""
        self.enabled = jax.process_index() == 0
        if self.enabled:
            from tensorboardX import SummaryWriter
            path = os.path.join(workdir, "metrics.jsonl")
            if resume_step is not None:
                drop_records_after(path, resume_step)
            self._jsonl = open(path, "a")
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)

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


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl file, in order ([] without the file). A line cut
    short by a kill is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn or blank line
    return records


def drop_records_after(path: str, step: int) -> None:
    """Rewrites the JSONL file `path` without the records of steps after `step` (and
    without torn lines): written to a temporary file and renamed over the old one, so a
    crash leaves one or the other, never half of each."""
    if not os.path.exists(path):
        return
    records = read_records(path)
    keep = [r for r in records if r.get("step", 0) <= step]
    with open(path) as f:
        unchanged = len(keep) == sum(1 for line in f if line.strip())
    if unchanged:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss or gradient became NaN/inf with `train.nonfinite='stop'`."""


# ==================================================================================== data
def prefetch_to_device(loader: loaders.Loader, mesh, size: int, count=None):
    """Yields (batch on the devices, units in it, the loader's state after it), with
    `size` more batches already sent to the devices: their host-to-device copies run
    while the step before them computes (jax transfers asynchronously). The loader's
    state travels with each batch, so a checkpoint records the position of the batches
    the steps took, not of those sent ahead. count(host batch): the units (tokens,
    examples) it holds on this process; default its rows.

    Reading needs no thread of ours: grain's iterator already reads examples ahead with
    a pool of threads (a grain thread-prefetch stage on top of it measured slower:
    6.6-9.0 ms a 16 x 1024 batch against 0.1-5.3 ms without it, loaded 2-core CPU)."""
    def put(host):
        n = count(host) if count else len(jax.tree.leaves(host)[0])
        return (sharding.shard_batch(host, mesh), n * jax.process_count(),
                loader.get_state().to_dict())

    ahead = collections.deque()
    hosts = iter(loader)
    try:
        for host in hosts:
            ahead.append(put(host))
            if len(ahead) > size:
                yield ahead.popleft()
        yield from ahead
    finally:
        hosts.close()


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
        raise ConfigError(f"the eval split has fewer than eval.batch_size="
                         f"{config.eval.batch_size} examples; lower config.eval.batch_size")
    means = {k: v / n for k, v in sums.items()}
    if task.unit == "tokens":
        means["perplexity"] = math.exp(min(means["loss"], 50.0))
    return means


# ==================================================================================== loop
def setup(config, workdir: str, task: Task | None = None, read_only: bool = False):
    """Everything before the first step: validated config, mesh, task, optimizer, state
    shardings and the checkpointer. Shared by training, eval and sampling.

    read_only: for tools that only read a run (eval, sample, analysis): a writable
    checkpoint manager would clean up the temporary folder of a save in progress if
    the run is still training in the same workdir."""
    sharding.maybe_initialize_distributed(config.mesh)  # Before anything touches devices.
    devices = jax.devices()[:config.mesh.num_devices or None]
    validate_config(config, len(devices), check_task=task is None)
    mesh = sharding.make_mesh({a: config.mesh.get(a, 1) for a in sharding.MESH_AXES}, devices)
    rules = sharding.rules_from_config(config.mesh.rules)
    task = task or TASKS[config.task](config, workdir)
    check_model_fits_mesh(task.model, mesh, task.seq_len)
    if config.eval.every >= 0:
        check_eval_split(task, config.eval.batch_size)
    tx, schedule = make_optimizer(config.optim, config.optim.decay_steps or config.train.steps)
    # Shapes and shardings are worked out outside the mesh context: flax's partitioned
    # initialisers would otherwise try to constrain abstract values eagerly.
    with nn.logical_axis_rules(rules):
        abstract, shardings, init_state = create_state(task, tx, mesh, rules, config.train.seed)
    ckpt = ckpt_lib.Checkpointer(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        save_every=config.train.checkpoint_every, keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoint, read_only=read_only)
    return dataclasses.make_dataclass("Setup", ["mesh", "rules", "task", "tx", "schedule",
                                                "abstract", "shardings", "init_state", "ckpt"])(
        mesh, rules, task, tx, schedule, abstract, shardings, init_state, ckpt)


def check_eval_split(task: Task, batch_size: int) -> None:
    """Before any step: an eval split smaller than one eval batch would end the run
    at its first evaluation, after the training it did."""
    n = len(task.eval_source)
    if n < batch_size:
        raise ConfigError(f"config.eval.batch_size={batch_size} is larger than the eval split "
                          f"({n} examples); valid: 1 to {n} (a multiple of the data-parallel "
                          f"size), or more eval data (e.g. config.data.max_files)")


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


def restore_or_init(s, config):
    """(state, data_state). Resume order: this workdir's latest checkpoint → the params
    of `train.init_from` (fresh optimizer and data position) → scratch."""
    # The newest checkpoint that restores and matches its digests (damaged newer ones are
    # reported, and moved aside unless train.checkpoint_on_damage='stop').
    restored = s.ckpt.restore_intact(s.abstract, on_damage=config.train.checkpoint_on_damage,
                                     say=lambda m: _say(f"WARNING: {m}"))
    if restored is not None:
        state, data_state, step = restored
        _say(f"resumed from {s.ckpt.directory} at step {step}")
        return state, data_state
    state = s.init_state()
    if config.train.init_from:
        state["params"] = warm_start_params(config.train.init_from, s.abstract["params"])
    return state, None


def warm_start_params(init_from: str, abstract_params):
    """The params of `train.init_from` on the shardings of `abstract_params`: another
    run's workdir or checkpoint directory, or `hf:<dir>`, a Hugging Face model dir
    (convert/)."""
    if init_from.startswith("hf:"):
        params, step = convert.restore_params_from_hf(init_from[len("hf:"):], abstract_params)
        src = init_from
    else:
        src = init_from
        if os.path.isdir(os.path.join(src, "checkpoints")):
            src = os.path.join(src, "checkpoints")
        params, step = ckpt_lib.restore_params(src, abstract_params)
    _say(f"warm start: params from {src} step {step}")
    return params


def jit_steps(s, config):
    """(train_step, eval_step) of setup `s`, jitted on its mesh: train_step(state, batch)
    -> (state, metrics) donates the old state; eval_step(params, batch) -> metrics."""
    batch_sh, repl = sharding.batch_sharding(s.mesh), sharding.replicated(s.mesh)
    train_step = jax.jit(make_train_step(s.task, s.tx, s.schedule, config, s.mesh),
                         in_shardings=(s.shardings, batch_sh), out_shardings=(s.shardings, repl),
                         donate_argnums=0)  # The old state's buffers hold the new one.
    eval_step = jax.jit(make_eval_step(s.task, config),
                        in_shardings=(s.shardings["params"], batch_sh), out_shardings=repl)
    return train_step, eval_step


def train_and_evaluate(config, workdir: str, task: Task | None = None, *,
                       resume_changed: bool = False) -> dict[str, Any]:
    """Trains `config` in `workdir`, resuming whatever is there. Returns a summary:
    {'step', 'train': last logged metrics, 'eval': last eval metrics (both read back
    from metrics.jsonl when this call logged none), 'losses': the loss of each step run
    by this call, 'stopped_by': signal name or None, 'state': the final train state
    (sharded jax.Arrays)}.

    Resuming with training-relevant keys changed from the workdir's config.json is a
    ConfigError listing them, unless `resume_changed` (see check_config_change)."""
    os.makedirs(workdir, exist_ok=True)
    s = setup(config, workdir, task)
    task, mesh = s.task, s.mesh
    check_config_change(config, workdir, s.ckpt.latest_step(), resume_changed)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        if task.save_assets:
            task.save_assets(workdir)
    _say(f"workdir {os.path.abspath(workdir)}: " + ", ".join(_outputs(config, task)))

    with jax.set_mesh(mesh), nn.logical_axis_rules(s.rules):
        state, data_state = restore_or_init(s, config)
        train_step, eval_step = jit_steps(s, config)
        loader = make_train_loader(task, config, data_state)
        summary = _loop(config, workdir, s, state, loader, train_step, eval_step)
    for split, record in last_records(workdir).items():
        summary[split] = summary[split] or record  # e.g. a resumed run with nothing to do
    _say(f"workdir {os.path.abspath(workdir)}: checkpoints/ up to step {summary['step']}, "
         f"metrics.jsonl, tensorboard/, config.json")
    return summary


def _outputs(config, task: Task) -> list[str]:
    """What a training run writes into its workdir, for the line printed at the start."""
    out = ["config.json",
           f"checkpoints/ (every {config.train.checkpoint_every} steps and at the end)",
           f"metrics.jsonl and tensorboard/ (every {config.train.log_every} steps)"]
    if task.save_assets:
        out.append("tokenizer/")
    return out


def last_records(workdir: str) -> dict[str, dict]:
    """The last 'train' and 'eval' records of workdir/metrics.jsonl (with their step)."""
    found = {"train": {}, "eval": {}}
    for record in read_records(os.path.join(workdir, "metrics.jsonl")):
        if record.get("split") in found:
            found[record.pop("split")] = record
    return found


# Keys a resumed run may change without resume_changed=True: how long to train, how often
# to log, evaluate and checkpoint, where the data lives, on which devices (checkpoints
# restore onto any mesh), and the attention backend; none changes what a step computes.
# Keys ending in "." cover their whole group.
RESUME_SAFE_KEYS = ("train.steps", "train.log_every", "train.progress", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.async_checkpoint", "train.data_workers",
                    "train.prefetch",
                    "train.nonfinite", "train.inject_nan_at", "train.init_from",
                    "train.checkpoint_on_damage", "train.loss_chunk_size",
                    "data.data_dir", "model.implementation", "model.remat_policy",
                    "mesh.", "eval.")


# Keys the experiment configs gained after runs were saved without them, with the value
# those runs trained with: resuming such a run with the key at that value is no change.
ADDED_KEYS = {"data.packing": "documents"}


def _flat_json(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat_json(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(config, workdir: str) -> dict[str, tuple[Any, Any]]:
    """{key: (value in workdir/config.json, value in `config`)} for every key that
    differs ({} without a config.json). A key one side lacks counts as its default."""
    from attention_jax import tasks
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        stored = json.load(f)
    stored["model"] = tasks.rename_old_model_fields(stored.get("task", ""), stored.get("model", {}))
    old = _flat_json(stored)
    new = _flat_json(json.loads(config.to_json_best_effort()))
    base = {**_flat_json(json.loads(base_config().to_json_best_effort())), **ADDED_KEYS}
    missing = "(absent)"
    changes = {}
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, base.get(key, missing)), new.get(key, base.get(key, missing))
        if before != after:
            changes[key] = (before, after)
    return changes


def check_config_change(config, workdir: str, step: int | None, resume_changed: bool) -> None:
    """Before resuming the checkpoint at `step`: compares `config` with the run's
    config.json. Changes only of RESUME_SAFE_KEYS (e.g. train.steps, to extend a run) are
    printed as a note; others raise a ConfigError listing `key: old -> new` and the ways
    through, unless `resume_changed` (then the old file is kept as
    config_until_step_<step>.json)."""
    if step is None:
        return  # Nothing to resume: the workdir's config.json is simply replaced.
    changes = config_changes(config, workdir)
    if not changes:
        return
    safe = lambda key: any(key == k or (k.endswith(".") and key.startswith(k))
                           for k in RESUME_SAFE_KEYS)
    show = lambda keys: ", ".join(f"{k}: {json.dumps(changes[k][0])} -> "
                                  f"{json.dumps(changes[k][1])}" for k in keys)
    relevant = [k for k in changes if not safe(k)]
    if relevant and not resume_changed:
        raise ConfigError(
            f"{workdir} holds a run at step {step} trained with another config: "
            f"{show(relevant)}. To resume it with the new values anyway pass "
            f"--resume_changed (train_and_evaluate(..., resume_changed=True)); to train "
            f"from scratch use a new --workdir.")
    note = f"resuming step {step} with config changes: {show(list(changes))}"
    if "train.steps" in changes and not config.optim.decay_steps:
        note += (f" (the learning-rate schedule now spans {changes['train.steps'][1]} steps; "
                 f"--config.optim.decay_steps={changes['train.steps'][0]} keeps the old one)")
    if relevant and jax.process_index() == 0:
        old = os.path.join(workdir, f"config_until_step_{step}.json")
        os.replace(os.path.join(workdir, "config.json"), old)
        note += f"; the previous config is kept as {old}"
    _say(note)


def _loop(config, workdir, s, state, loader, train_step, eval_step) -> dict[str, Any]:
    """The steps. The host never waits for a step to finish except at a *sync point*:
    a step that logs, evaluates or checkpoints (or the last, or one after a stop
    signal). Between them it only queues work, so the device runs step after step while
    the host reads and transfers the next batches (`prefetch_to_device`). At a sync
    point the metrics of every step since the last one are fetched at once and checked;
    a non-finite step is found there, before anything is saved: "stop" stops with the
    last good checkpoint intact (the state after that step is dropped), "skip" goes on
    (its step applied no update: make_train_step)."""
    task, mesh, ckpt = s.task, s.mesh, s.ckpt
    total, log_every, eval_every = config.train.steps, config.train.log_every, config.eval.every
    step = int(jax.device_get(state["step"]))
    writer = MetricWriter(workdir, resume_step=step)
    show = config.train.progress and jax.process_index() == 0
    # A bar on a terminal; in a log file (the bar's stream is not a terminal) one plain
    # line per logged window instead of a line of carriage returns.
    plain = show and not sys.stderr.isatty()
    # The terminal bar only: a notebook's stderr is not a terminal, so it gets the plain
    # lines (tqdm.auto would warn there that ipywidgets is missing).
    from tqdm import tqdm
    bar = tqdm(total=total, initial=step, disable=not show or plain, dynamic_ncols=True,
               unit="step")
    summary = {"step": step, "train": {}, "eval": {}, "losses": [], "stopped_by": None}
    pending = []  # (step, metrics still on the device) since the last sync point
    # A throughput window: units trained, its start, and where the host's time went in
    # it: waiting for the next batch (reading and sending it) and in the step call
    # (tracing once, then only queueing work unless the device makes it wait). Logged as
    # shares of the window's time: the rest is the wait for the device at the sync point.
    new_window = lambda: (0, time.perf_counter(), {"data": 0.0, "dispatch": 0.0})
    window, (units, t0, host) = [], new_window()
    start_step, start_time = step, t0
    batches = prefetch_to_device(loader, mesh, config.train.prefetch, task.count)
    try:
        with ckpt_lib.StopRequest() as stop:
            while step < total:
                t_data = time.perf_counter()
                batch, batch_units, data_state = next(batches)
                t_step = time.perf_counter()
                units += batch_units
                state, metrics = train_step(state, batch)
                host["data"] += t_step - t_data
                host["dispatch"] += time.perf_counter() - t_step
                step += 1
                pending.append((step, metrics))
                bar.update(1)
                stopping = stop.requested()
                log_now = step % log_every == 0 or step == total
                eval_now = eval_every >= 0 and (step == total or
                                                (eval_every and step % eval_every == 0))
                save_now = stopping or step == total or ckpt.due(step)
                if not (log_now or eval_now or save_now):
                    if step == start_step + 1:
                        # The first step compiled: throughput is measured from its end.
                        jax.block_until_ready(metrics)
                        units, t0, host = new_window()
                    continue
                # ---- sync point: the one wait for the device since the last one.
                for at, m in jax.device_get(pending):
                    if not m["finite"]:
                        _nonfinite(config, at, m, ckpt)  # raises in "stop" mode
                        continue  # "skip": the update was not applied.
                    summary["losses"].append(float(m["loss"]))
                    window.append(m)
                pending = []
                if log_now and window:
                    means = {k: float(np.mean([m[k] for m in window])) for k in window[0]
                             if k != "finite"}
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    means[f"{task.unit}_per_sec"] = units / elapsed
                    means["host_data_frac"] = host["data"] / elapsed
                    means["host_dispatch_frac"] = host["dispatch"] / elapsed
                    if len(window) != log_every:
                        # Fewer steps than a full window: it began at a resume, ends the
                        # run early, or lost skipped non-finite steps.
                        means["steps_in_window"] = float(len(window))
                    writer.write(step, "train", means)
                    bar.set_postfix(loss=f"{means['loss']:.4f}", lr=f"{means['lr']:.2e}",
                                    **{f"{task.unit}/s": f"{means[f'{task.unit}_per_sec']:,.0f}"})
                    if plain:
                        _say(_progress_line(step, total, means, task.unit,
                                            time.perf_counter() - start_time, step - start_step))
                    summary["train"], window = means, []
                    units, t0, host = new_window()
                if eval_now:
                    summary["eval"] = evaluate(eval_step, state["params"], task, config, mesh)
                    writer.write(step, "eval", summary["eval"])
                    bar.write(f"step {step} eval: " + ", ".join(
                        f"{k}={v:.4g}" for k, v in summary["eval"].items()))
                    units, t0, host = new_window()  # evaluation is not training time
                if save_now:
                    ckpt.save(step, state, data_state, force=stopping or step == total)
                if stopping:
                    import signal as signal_lib
                    summary["stopped_by"] = signal_lib.Signals(stop.signal).name
                    bar.write(f"{summary['stopped_by']}: saved checkpoint at step {step}; "
                              f"run the same command again to resume")
                    break
    finally:
        batches.close()  # stops the loader's reading thread
        ckpt.wait()  # A pending async save commits before we return or raise.
        ckpt.close()
        bar.close()
        writer.close()
    summary["step"], summary["state"] = step, state
    return summary


def _progress_line(step, total, means, unit, elapsed, steps_done) -> str:
    """One line of progress for a log file: step, loss, lr, throughput, time left."""
    left = elapsed / max(steps_done, 1) * (total - step)
    return (f"step {step}/{total}  loss {means['loss']:.4f}  lr {means['lr']:.2e}  "
            f"{means[f'{unit}_per_sec']:,.0f} {unit}/s  {int(left) // 60}m{int(left) % 60:02d}s left")


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
