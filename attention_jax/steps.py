"""The step functions: the train state created already sharded, the jitted training and
evaluation steps, and the evaluation over the eval split. What a step computes for a
model family comes from its `Task` (tasks/): `task.init` and `task.loss`.
"""

from __future__ import annotations

import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from attention_jax import sharding
from attention_jax.data import loaders
from attention_jax.errors import ConfigError
from attention_jax.models import losses
from attention_jax.tasks import Task


# ==================================================================================== state
def fetch(tree):
    """jax.device_get(tree), waiting for it on the device first: a computation that failed
    there (out of memory) raises here. device_get alone waited forever on an output of a
    computation with several outputs of which another could not be allocated (jaxlib
    0.10, CPU: the run hung, idle, where it should have said it ran out of memory)."""
    return jax.device_get(jax.block_until_ready(tree))


def create_state(task: Task, tx, mesh, rules, seed: int):
    """Abstract state (with shardings) and a function that creates it already sharded.

    The state is a dict {step, params, opt_state, rng}: plain containers keep checkpoints
    readable by any tool. Shardings come from the logical names on the parameters; the
    optimizer state mirrors them (optax's tree_map_params), counters are replicated.
    """
    # The mesh's abstract form is ambient while shapes are traced: implementation="ring"
    # asked for by name finds its sequence axis there (it refused, naming a mesh the run had).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        boxed = jax.eval_shape(task.init, jax.random.PRNGKey(seed))
    logical = nn.get_partition_spec(boxed)
    param_sh = sharding.logical_to_shardings(logical, mesh, rules)
    abstract_params = nn.meta.unbox(boxed)
    sharding.check_divisible(abstract_params, param_sh, logical=logical)
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

    # init's shapes from the pieces traced above (a second trace of the model's init cost
    # as much as the first)
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract_params,
                "opt_state": abstract_opt,
                "rng": jax.eval_shape(lambda k: jax.random.fold_in(k, 1),
                                      jax.random.PRNGKey(seed))}
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    # jit with out_shardings: every device computes only its own shards; the full
    # state never exists on one device.
    init_fn = jax.jit(init, out_shardings=shardings)
    return abstract, shardings, lambda: init_fn(jax.random.PRNGKey(seed))


# =========================================================================== step functions
def make_train_step(task: Task, tx, schedule, config, mesh):
    accum = config.optim.grad_accum
    nan_at = config.train.inject_nan_at
    batch_sh = sharding.batch_sharding(mesh)

    def loss_fn(params, batch, rng, step):
        # The float32 parameters, as a bare step takes them: each module casts its weights
        # to train.compute_dtype where it uses them, so a lookup table's gradient
        # accumulates in float32 (layers/posemb.py Embed; tests/system/test_step_structure.py).
        loss, metrics = task.loss(params, batch, rng, True)
        if nan_at >= 0:  # Fault injection for testing the non-finite path.
            loss = loss * jnp.where(step + 1 == nan_at, jnp.nan, 1.0)
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state, batch):
        if isinstance(batch, sharding.PackedBatch):  # as train.prefetch_to_device sends it
            batch = batch.unpack()
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

            # Each micro-batch's loss is a mean over its own tokens (examples); their
            # counts differ where rows hold padding, so the big batch's mean is
            # Σ_j mean_j·W_j / Σ_j W_j, not the mean of the means. A loss reports W_j
            # (losses.WEIGHT) when its batch carries example weights, as an eval batch
            # does: micro-batches without them are given weights of 1, which change
            # nothing else (a batch's own are kept).
            micro = jax.tree.map(split, batch)
            if isinstance(batch, dict) and loaders.EXAMPLE_WEIGHT not in batch:
                rows = jax.tree.leaves(batch)[0].shape[0]
                micro[loaders.EXAMPLE_WEIGHT] = split(jnp.ones((rows,), jnp.float32))
            first = jax.tree.map(lambda x: x[0], micro)
            (shapes_loss, shapes), shapes_grads = jax.eval_shape(grad_fn, params, first, rng,
                                                                 step)
            weighted = losses.WEIGHT in shapes

            # Sums in float32 at least: a boolean metric's sum was a logical or, an
            # integer's weights cut to whole numbers.
            wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))  # noqa: E731

            def body(carry, xs):
                mb, j = xs
                (l, m), g = grad_fn(params, mb, jax.random.fold_in(rng, j), step)
                w = m.pop(losses.WEIGHT) if weighted else jnp.ones((), jnp.float32)
                w = w.astype(jnp.float32)
                scaled = jax.tree.map(lambda x: wide(x) * w.astype(wide(x).dtype), (l, m, g))
                return jax.tree.map(jnp.add, carry, (*scaled, w)), None

            loss, metrics, grads = jax.tree.map(
                lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)),
                (shapes_loss, shapes, shapes_grads))
            metrics = {k: v for k, v in metrics.items() if k != losses.WEIGHT}
            (loss, metrics, grads, total), _ = jax.lax.scan(
                body, (loss, metrics, grads, jnp.zeros((), jnp.float32)),
                (micro, jnp.arange(accum)))
            total = jnp.where(total > 0, total, 1.0)  # no real token at all: 0, not NaN
            loss, metrics, grads = jax.tree.map(lambda x: x / total.astype(x.dtype),
                                                (loss, metrics, grads))
            # (the optimizer's state keeps the parameters' dtype)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
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
        metrics = {**metrics, "loss": loss, "grad_norm": grad_norm,
                   "lr": schedule(schedule_count(state["opt_state"], step)), "finite": finite}
        return new_state, metrics

    return train_step


def schedule_count(opt_state, step):
    """The count the optimizer's learning-rate schedule reads this step: optax keeps its
    own (ScaleByScheduleState), equal to the step until train.nonfinite=skip skips one
    (a skipped step leaves the optimizer's state as it was, counts included, as optax's
    apply_if_finite does: the schedule then runs a step behind the step counter per
    skip). `step` where the optimizer has no schedule state."""
    counts = [s.count for s in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)]
    return counts[0] if counts else step


def make_eval_step(task: Task, config):
    """eval_step(params, batch) -> {metric: batch mean, "loss", ...}. An eval batch from
    `evaluate` carries per-example weights (loaders.EXAMPLE_WEIGHT, 0 on the copies that
    pad its last batch): the task's loss weights by them and reports the total weight its
    means are over (losses.WEIGHT); the step adds the examples the batch holds (EXAMPLES)."""
    def eval_step(params, batch):
        loss, metrics = task.loss(params, batch, jax.random.PRNGKey(0), False)
        metrics = {**metrics, "loss": loss}
        if loaders.EXAMPLE_WEIGHT in batch:
            metrics[EXAMPLES] = jnp.sum(batch[loaders.EXAMPLE_WEIGHT])
        return metrics

    return eval_step


EXAMPLES = "examples"  # in evaluate's record: the eval examples its metrics are over


def evaluate(eval_step, params, task: Task, config, mesh) -> dict[str, float]:
    """The eval metrics over exactly the eval split (eval.steps=0), or over its first
    eval.steps batches (all of it if it has fewer).

    The last, partial batch is padded to the full eval.batch_size with copies of real
    examples weighted 0 (loaders.Loader(pad_remainder=True)), not dropped: it still
    splits over the data-parallel devices, and the step compiles once. The task's loss
    weights every example by the batch's EXAMPLE_WEIGHT and reports the total weight of
    its means (losses.WEIGHT: images, or tokens), so each metric is Σ(batch mean × batch
    weight) / Σ batch weight: the mean over exactly the examples (tokens) evaluated, as
    if they were one batch. The record also holds `examples` (how many were evaluated)
    and, for token tasks, `tokens` (the weighted tokens the means are over) and
    `perplexity`. A loss that does not report its weight (a family of one's own) is
    averaged per batch, all batches being full; with a partial batch to evaluate it is a
    ConfigError at the first batch."""
    size, batch_size = len(task.eval_source), config.eval.batch_size
    if size == 0:
        raise ConfigError("the eval split (config.data.eval_split) is empty; give an eval "
                          "split with examples, or config.eval.every=-1 for no evaluation")
    loader = loaders.Loader(task.eval_source, global_batch_size=batch_size,
                            seed=config.train.seed, shuffle=False, num_epochs=1,
                            transform=task.eval_transform, pad_remainder=True,
                            read_threads=task.read_threads)
    batches = min(config.eval.steps or len(loader), len(loader))
    partial = batches * batch_size > size  # the last batch evaluated is padded
    sums, weight, examples, weighted = {}, 0.0, 0, False
    for i, batch in enumerate(loader):
        if i == batches:
            break
        metrics = fetch(eval_step(params, sharding.shard_batch(batch, mesh)))
        examples += round(float(metrics.pop(EXAMPLES)))
        weighted = losses.WEIGHT in metrics
        if weighted:
            w = float(metrics.pop(losses.WEIGHT))
        elif partial:
            raise _unweighted_error(config, size)
        else:
            w = 1.0  # full batches of a loss without weights: the mean of batch means
        sums = {k: sums.get(k, 0.0) + float(v) * w for k, v in metrics.items()}
        weight += w
    # No weighted position at all (a split of empty targets): no mean exists; NaN says so.
    means = {k: v / weight if weight else math.nan for k, v in sums.items()}
    means[EXAMPLES] = examples
    if task.unit == "tokens":
        means["perplexity"] = math.exp(min(means["loss"], 50.0))
        if weighted:
            means["tokens"] = round(weight)
    return means


def _unweighted_error(config, size: int) -> ConfigError:
    batch_size = config.eval.batch_size
    return ConfigError(
        f"task {config.task!r}: its loss ignores batch[{loaders.EXAMPLE_WEIGHT!r}] (0 on the "
        f"rows that pad the last eval batch: {size % batch_size} examples padded to "
        f"config.eval.batch_size={batch_size}), so that batch cannot be evaluated exactly; "
        f"valid: a loss that weights by it and returns metrics[{losses.WEIGHT!r}] (see "
        f"tasks/images.py), config.eval.batch_size dividing the eval split's {size} "
        f"examples, or config.eval.steps <= {size // batch_size}")


def check_eval_split(task: Task, config) -> None:
    """Before any step, what `evaluate` would find only at the first evaluation, after
    the training before it: an empty eval split, or a partial last batch (padded) that
    the task's loss cannot weight. The loss is traced abstractly (jax.eval_shape) on one
    example, nothing computed. An eval.steps that asks for more examples than the split
    holds is said (each evaluation reads the whole split, fewer than asked)."""
    size, batch_size = len(task.eval_source), config.eval.batch_size
    if size == 0:
        raise ConfigError("the eval split (config.data.eval_split) is empty; give an eval "
                          "split with examples, or config.eval.every=-1 for no evaluation")
    batches = -(-size // batch_size)
    if min(config.eval.steps or batches, batches) * batch_size > size:  # a padded batch
        _check_weighted(task, config, size)
    if config.eval.steps * batch_size > size and jax.process_index() == 0:
        print(f"note: config.eval.steps={config.eval.steps} batches of "
              f"config.eval.batch_size={batch_size} ask for "
              f"{config.eval.steps * batch_size} examples, and the eval split holds {size}: "
              f"each evaluation reads all {size}", file=sys.stderr)


def check_train_split(task: Task, config) -> None:
    """Before any step: a train split of fewer examples than config.train.batch_size,
    whose every batch would hold the same examples several times over (the loader wraps
    round the split), is refused (a few short texts packed into one or two rows of
    data.seq_len, a batch_size meant for a larger corpus)."""
    size, batch_size = len(task.train_source), config.train.batch_size
    if size >= batch_size:
        return
    rows = (f" (rows of config.data.seq_len={task.seq_len} tokens)"
            if task.unit == "tokens" and task.seq_len else "")
    raise ConfigError(f"config.train.batch_size={batch_size} is more than the train split's "
                      f"{size} example{'s' if size != 1 else ''}{rows}: every batch would "
                      f"repeat them; valid: config.train.batch_size <= {size}, or more "
                      f"training data")


def _check_weighted(task: Task, config, size: int) -> None:
    """ConfigError unless the task's loss reports its weight (losses.WEIGHT), which
    evaluating a padded batch needs."""
    example = task.eval_source[0]
    if task.eval_transform is not None:
        example = task.eval_transform(example, np.random.default_rng(0))
    batch = {k: np.asarray(v)[None] for k, v in example.items()}
    batch[loaders.EXAMPLE_WEIGHT] = np.ones((1,), np.float32)
    params = nn.meta.unbox(jax.eval_shape(task.init, jax.random.PRNGKey(0)))
    if losses.WEIGHT not in jax.eval_shape(make_eval_step(task, config), params, batch):
        raise _unweighted_error(config, size)


def jit_eval_step(task: Task, config, mesh, param_shardings):
    """eval_step(params, batch) -> metrics, jitted on `mesh` (params on `param_shardings`)."""
    return jax.jit(make_eval_step(task, config),
                   in_shardings=(param_shardings, sharding.batch_sharding(mesh)),
                   out_shardings=sharding.replicated(mesh))


def jit_steps(prepared, config):
    """(train_step, eval_step) of a train.Setup `s` (its task, tx, schedule, mesh and
    shardings), jitted on its mesh: train_step(state, batch) -> (state, metrics) donates
    the old state; eval_step(params, batch) -> metrics."""
    batch_sh, repl = sharding.batch_sharding(prepared.mesh), sharding.replicated(prepared.mesh)
    train_step = jax.jit(make_train_step(prepared.task, prepared.tx, prepared.schedule, config, prepared.mesh),
                         in_shardings=(prepared.shardings, batch_sh), out_shardings=(prepared.shardings, repl),
                         donate_argnums=0)  # The old state's buffers hold the new one.
    return train_step, jit_eval_step(prepared.task, config, prepared.mesh, prepared.shardings["params"])
