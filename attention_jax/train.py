"""The trainer: `train_and_evaluate(config, workdir)`, read top to bottom.

Phases: setup (validated config → mesh → task → optimizer → state shardings →
checkpointer) → resume (checkpoint, warm start or scratch) → data (a loader whose
position lives in the checkpoint, batches sent to the devices ahead) → the loop, a
list of events between sync points. What a step computes is in steps.py; the run
directory's files in workdir.py; what differs between model families is the
family's registered `Task` (tasks/): the trainer knows nothing about GPT or ViT.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from attention_jax import checkpoint as ckpt_lib
from attention_jax import config as config_lib
from attention_jax import convert, heap, quiet, sharding, steps
from attention_jax import tasks as tasks_lib
from attention_jax import workdir as workdir_lib
from attention_jax.data import loaders
from attention_jax.errors import ConfigError, UserError
from attention_jax.optimizer import make_optimizer
from attention_jax.tasks import TASKS, Task


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss or gradient became NaN/inf with `train.nonfinite='stop'`."""


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)


# ==================================================================================== setup
@dataclasses.dataclass
class Setup:
    """Everything before the first step, shared by training, eval and sampling."""
    mesh: jax.sharding.Mesh
    rules: Any  # logical axis -> mesh axes (flax logical_axis_rules)
    task: Task
    tx: Any  # the optax transformation
    schedule: Any  # step -> learning rate
    abstract: Any  # the train state's shapes, dtypes and shardings
    shardings: Any  # the train state's NamedShardings, by field ("params", ...)
    init_state: Any  # () -> a fresh train state, created already sharded
    ckpt: ckpt_lib.Checkpointer


def validated_devices(config, tasks=TASKS) -> list:
    """The devices `config` runs on (mesh.num_devices of them, 0: all), with the config
    validated against them and against `tasks` (None: the task is given, not named)."""
    if config.mesh.num_devices > jax.device_count():  # was cut to those there, unsaid
        raise ConfigError(f"config.mesh.num_devices={config.mesh.num_devices}: this run has "
                          f"{jax.device_count()} device(s); valid: 0 (all) or "
                          f"1..{jax.device_count()}")
    devices = jax.devices()[:config.mesh.num_devices or None]
    config_lib.validate(config, len(devices), tasks=tasks,
                        granules=len(set(sharding.granules(devices)[0])))
    return devices


def setup(config, workdir: str, task: Task | None = None, read_only: bool = False) -> Setup:
    """Validated config, mesh, task, optimizer, state shardings and the checkpointer.

    read_only: for tools that only read a run (eval, sample, analysis): a writable
    checkpoint manager would clean up the temporary folder of a save in progress if
    the run is still training in the same workdir. Their task reads its data on first
    use (tasks.data_on_demand): sampling needs no corpus, and evaluation checks its eval
    split itself (steps.check_eval_split)."""
    sharding.maybe_initialize_distributed(config.mesh)  # Before anything touches devices.
    devices = validated_devices(config, tasks=None if task else TASKS)
    mesh = sharding.make_mesh({a: config.mesh.get(a, 1) for a in sharding.MESH_AXES}, devices,
                              dcn=sharding.dcn_shape(config.mesh))
    sharding.check_batch_split(mesh)  # each process's batch rows on its own devices
    rules = sharding.rules_from_config(config.mesh.rules)
    if task is None:
        with tasks_lib.data_on_demand() if read_only else contextlib.nullcontext():
            task = TASKS[config.task](config, workdir)
    config_lib.check_model_fits_mesh(getattr(task.model, "config", task.model), mesh.shape,
                                     task.seq_len, task.tokens_per_example)
    if config.eval.every >= 0 and not read_only:
        steps.check_eval_split(task, config)
    if not read_only:
        steps.check_train_split(task, config)
    tx, schedule = make_optimizer(config.optim, config.optim.decay_steps or config.train.steps)
    # Shapes and shardings are worked out outside the mesh context: flax's partitioned
    # initialisers would otherwise try to constrain abstract values eagerly.
    with nn.logical_axis_rules(rules):
        abstract, shardings, init_state = steps.create_state(task, tx, mesh, rules,
                                                             config.train.seed)
    ckpt = ckpt_lib.Checkpointer(
        _checkpoints(workdir),
        save_every=config.train.checkpoint_every, keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoint, read_only=read_only)
    return Setup(mesh, rules, task, tx, schedule, abstract, shardings, init_state, ckpt)


# =================================================================================== resume
def restore_or_init(prepared, config):
    """(state, data_state). Resume order: this workdir's latest checkpoint → the params
    of `train.init_from` (fresh optimizer and data position) → scratch."""
    # The newest checkpoint that restores and matches its digests (damaged newer ones are
    # reported, and moved aside unless train.checkpoint_on_damage='stop').
    restored = prepared.ckpt.restore_intact(prepared.abstract,
                                            on_damage=config.train.checkpoint_on_damage)
    if restored is not None:
        state, data_state, step = restored
        _say(f"resumed from {prepared.ckpt.directory} at step {step}")
        return state, data_state
    state = prepared.init_state()
    untrained = prepared.task.untrained
    if config.train.init_from:  # its params stand; what it lacks of `untrained` is zero
        state["params"] = warm_start_params(config.train.init_from, prepared.abstract["params"],
                                            getattr(prepared.task.model, "config", None),
                                            vocab_size=prepared.task.vocab_size,
                                            untrained=untrained)
    elif untrained:  # what the loss never trains starts at zero (Task.untrained)
        state["params"] = {name: jax.tree.map(lambda a: a * 0, p) if name in untrained else p
                           for name, p in state["params"].items()}
    return state, None


def warm_start_params(init_from: str, abstract_params, model_config=None,
                      vocab_size: int | None = None, untrained: tuple[str, ...] = ()):
    """The params of `train.init_from` on the shardings of `abstract_params`: another
    run's workdir or checkpoint directory, or `hf:<dir>`, a Hugging Face model dir
    (convert/), checked against `model_config` where its weights cannot show a field and
    against the run's tokenizer's `vocab_size`; of `untrained` (Task.untrained), what a
    Hugging Face dir lacks starts at zero."""
    hf, where = _init_from_source(init_from)
    src = init_from
    try:
        if hf:
            params, step = convert.restore_params_from_hf(
                where, abstract_params, model_config=model_config,
                vocab_size=vocab_size, untrained=untrained)
        else:
            if workdir_lib.epath_of(src, "checkpoints").is_dir():
                src = workdir_lib.path(src, "checkpoints")
            params, step = ckpt_lib.restore_params(src, abstract_params)
    except ckpt_lib.CheckpointDamagedError as e:
        # (a warm start takes the step it names or the newest: not silently an older one)
        raise ConfigError(f"config.train.init_from={init_from!r}: {e}; not warm-started "
                          f"(python -m attention_jax.verify {src} lists its steps)") from None
    except (FileNotFoundError, ValueError) as e:
        # Nothing there, weights that do not fit the model, and for a model dir an
        # architecture or setting the conversion does not take or a damaged file (its
        # ValueErrors): the config's mistake. A checkpoint's other ValueErrors are not.
        if isinstance(e, UserError) or not (
                hf or isinstance(e, (FileNotFoundError, convert.ConversionError))):
            raise
        raise ConfigError(f"config.train.init_from={init_from!r}: {e}") from None
    _say(f"warm start: params from {src} step {step}")
    return params


# ===================================================================================== data
def prefetch_to_device(loader: loaders.Loader, mesh, size: int, count=None):
    """Yields (batch on the devices, as one sharding.PackedBatch; units in it; the
    loader's state after it), with
    `size` more batches already sent to the devices: their host-to-device copies run
    while the step before them computes (jax transfers asynchronously). The loader's
    state travels with each batch, so a checkpoint records the position of the batches
    the steps took, not of those sent ahead. count(host batch): the units (tokens,
    examples) it holds on this process; default its rows.

    Reading needs no thread of ours: grain's iterator already reads examples ahead with
    a pool of threads (a grain thread-prefetch stage on top of it measured slower:
    README, Measurements behind the code)."""
    def put(host):
        n = count(host) if count else len(jax.tree.leaves(host)[0])
        # One array per batch (sharding.PackedBatch): one host-to-device copy a step.
        return (sharding.shard_batch(sharding.pack_batch(host), mesh), n * jax.process_count(),
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
                          worker_count=config.train.data_workers, state=state,
                          read_threads=task.read_threads)


def _resumed_loader(task: Task, config, data_state, resume_changed: bool) -> loaders.Loader:
    """The training loader at the checkpoint's position. Data that changed since (files
    added, removed or edited, another seq_len, another seed) cannot continue the saved
    order: an error, unless `resume_changed`, which starts the new order at the same
    point in epochs."""
    try:
        return make_train_loader(task, config, data_state)
    except loaders.DataChangedError:
        saved = loaders.LoaderState.from_any(data_state)
        now = len(task.train_source)
        source = loaders.source_id(task.train_source)
        other_tokens = (now, config.train.seed) == (saved.num_records, saved.seed)
        # A tfds split's identity says what it is (dataset, split, bytes, contents), and a
        # user's labelled texts' or sentence pairs' how many (tasks/text_classes.py,
        # translation.py): both are shown, so what changed is named. A token cache's is a
        # bare digest.
        ids = (source, saved.source)
        tfds = any(s.startswith("tfds ") for s in ids)
        records = tfds or any(", contents " in s for s in ids)
        makes = (f"as many, but other ones ({saved.source} then, {source} now)" if other_tokens
                 and records else "as many, but other ones (its tokens differ)" if other_tokens
                 else f"{now} (seed {config.train.seed})")
        causes = ("a tfds dataset rebuilt with other examples or read from another "
                  "data.data_dir holding other ones" if tfds else
                  "records added, removed or edited in the files, or a relative glob read "
                  "from another directory" if records else
                  "files added, removed or edited, a relative glob read from another "
                  "directory, or another seq_len or packing")
        if not resume_changed:
            raise loaders.DataChangedError(
                f"the training data changed since the checkpoint: its loader read {saved.num_records} "
                f"rows in the order of seed {saved.seed}, the data now makes {makes}; "
                f"{causes}. To go on with the data "
                f"as it is now pass --resume_changed (train_and_evaluate(..., "
                f"resume_changed=True)): its order starts anew at the same point in epochs; "
                f"to train from scratch use a new --workdir") from None
        moved = saved.moved_to(now, config.train.seed, source)
        other = "other records" if records else "other tokens"
        _say(f"note: the training data changed since the checkpoint ({saved.num_records} rows, "
             f"seed {saved.seed} -> "
             f"{f'as many, {other}' if other_tokens else f'{now}, seed {config.train.seed}'}): "
             f"its new order starts at epoch {moved.next_index / now:.3f}, where the "
             f"checkpoint was in the old one")
        return make_train_loader(task, config, moved)


def _check_saved_data(prepared: Setup, config, latest: int | None, resume_changed: bool):
    """(data_state, loader) of the newest checkpoint, its data state read alone (no
    arrays): the loader made here stops a resume on changed data first thing. None where
    there is no checkpoint, where --resume_changed takes changed data anyway (its note
    comes once, for the step restored), or where the data state is damaged
    (restore_intact then reports it and falls back)."""
    if latest is None or resume_changed:
        return None
    data_state = prepared.ckpt.intact_data_state(latest)
    if data_state is None:
        return None
    return data_state, _resumed_loader(prepared.task, config, data_state, resume_changed)


# ==================================================================================== train
def train_and_evaluate(config, workdir: str, task: Task | None = None, *,
                       resume_changed: bool = False) -> dict[str, Any]:
    """Trains `config` in `workdir`, resuming whatever is there. Returns a summary:
    {'step', 'train': last logged metrics, 'eval': last eval metrics (both read back
    from metrics.jsonl when this call logged none), 'losses': the loss of each step run
    by this call, 'stopped_by': signal name or None, 'state': the final train state
    (sharded jax.Arrays), 'task': the run's Task}.

    Resuming with training-relevant keys changed from the workdir's config.json is a
    ConfigError listing them, unless `resume_changed` (see workdir.check_config_change)."""
    sharding.maybe_initialize_distributed(config.mesh)  # process_index() is known from here
    workdir = workdir_lib.expand(workdir)
    with sharding.LostHostWatchdog(config.mesh.lost_host_timeout):
        return _train_writer(config, workdir, task, resume_changed)


def _train_writer(config, workdir: str, task: Task | None, resume_changed: bool) -> dict:
    created = workdir_lib.prepare_for_writing(workdir)
    # One writer per workdir, taken before the checkpoint manager opens the directory (a
    # writable one cleans up the temporary folder of a save another run has in progress).
    lock = workdir_lib.WriterLock(workdir).acquire() if jax.process_index() == 0 else None
    others = workdir_lib.other_entries(workdir)
    if others:  # a mistyped --workdir (a home or data folder) is seen before it fills up
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        _say(f"note: --workdir={workdir} is not a run (no {workdir_lib.CONFIG}) and holds "
             f"{shown}; the run writes config.json, metrics.jsonl, checkpoints/ and "
             f"tensorboard/ beside them (a new folder keeps a run apart)")
    try:
        _check_processes(config, workdir)
        return _train_locked(config, workdir, task, resume_changed)
    except UserError:
        if lock and created and os.listdir(workdir) == [workdir_lib.LOCK]:  # local only
            # A mistake found before anything ran leaves no empty workdir behind.
            os.remove(workdir_lib.path(workdir, workdir_lib.LOCK))
            os.rmdir(workdir)
        raise
    finally:
        if lock:
            lock.release()


def _check_processes(config, workdir: str) -> None:
    """Several processes: the same config in each, and one workdir all of them see (each
    a ConfigError in every process, before anything is built)."""
    if jax.process_count() == 1:
        return
    sharding.check_same_config(config_lib.flat(json.loads(config.to_json_best_effort())))
    marker = workdir_lib.epath_of(workdir, ".processes_check")  # hidden: no one's run
    try:
        sharding.check_same_place(workdir, marker.write_text, marker.read_text)
    finally:
        if jax.process_index() == 0:
            marker.unlink(missing_ok=True)


def _train_locked(config, workdir: str, task: Task | None, resume_changed: bool) -> dict:
    # What refuses a resume from the config alone is found before the task builds its data
    # (a corpus tokenized, records read): it once came after minutes of that.
    latest = ckpt_lib.latest_step_in(_checkpoints(workdir))
    if latest is not None:
        # (keys, types and choices first: a typo is the mistake, not a change of config)
        config_lib.validate(config, tasks=None if task else TASKS)
        if latest > config.train.steps:
            # Resumed, it trained nothing, yet rewrote config.json with the smaller count
            # (and warned of a warmup longer than the run): training cannot go back.
            raise ConfigError(f"config.train.steps={config.train.steps} is below the run's "
                              f"step {latest} ({workdir_lib.path(workdir, 'checkpoints')}/"
                              f"{latest}); valid: train.steps >= {latest} to resume it "
                              f"(--mode=eval to evaluate it), or a new --workdir")
        if not resume_changed:
            workdir_lib.refuse_config_change(config, workdir, latest)
    elif config.train.init_from:  # (a resumed run reads its own checkpoint instead)
        _check_init_from_exists(config.train.init_from)
    prepared = setup(config, workdir, task)
    try:
        return _train_prepared(config, workdir, prepared, resume_changed, latest)
    finally:
        # The loop closes it as it ends; this closes it where a run stopped before the
        # loop (a changed config found at resume, a checkpoint that does not restore).
        # Left open, orbax's threads outlived the interpreter's shutdown (checkpoint._Manager).
        prepared.ckpt.close()


def _init_from_source(init_from: str) -> tuple[bool, str]:
    """(whether train.init_from names a Hugging Face model dir, `hf:<dir>`; the path)."""
    hf = init_from.startswith("hf:")
    return hf, init_from[len("hf:"):] if hf else init_from


def _check_init_from_exists(init_from: str) -> None:
    """A warm start from a path that is not there is refused before the task builds its
    data and before the workdir is written: it was found after both, leaving a run that
    never trained."""
    _, where = _init_from_source(init_from)
    if not workdir_lib.exists(where):
        raise ConfigError(f"config.train.init_from={init_from!r}: {where!r} does not exist; "
                          f"valid: a run's workdir or checkpoints folder, or hf:<a Hugging "
                          f"Face model directory>")


def _checkpoints(workdir: str) -> str:
    return workdir_lib.path(workdir_lib.resolve(workdir), workdir_lib.CHECKPOINTS)


def _train_prepared(config, workdir: str, prepared: Setup, resume_changed: bool,
                    latest: int | None) -> dict:
    if latest is not None:
        # A checkpoint of another model (a --resume_changed of model.* keys) cannot
        # resume: refused before config.json is moved aside and rewritten, which once
        # left the workdir describing a model its checkpoints do not hold.
        try:
            prepared.ckpt.check_structure(prepared.abstract, latest)
        except ckpt_lib.CheckpointDamagedError:
            pass  # restore_intact reports it and falls back to an older step
    for warning in (config_lib.warnings(config)
                    + sharding.rules_warnings(prepared.rules, dict(prepared.mesh.shape))):
        quiet.warn(warning)
    # Data that changed since the checkpoint is refused (or, resume_changed, noted) before
    # its arrays are read and before config.json is rewritten: it was found only after
    # "resumed from ... at step N", which read as if the run had gone on.
    checked = _check_saved_data(prepared, config, latest, resume_changed)
    note = workdir_lib.check_config_change(config, workdir, latest, resume_changed)
    # Every process has read config.json (and the task its assets) before process 0
    # rewrites them. config.json is now replaced atomically, but the assets (a tokenizer's
    # files) are written in place: a process still reading once saw a truncated file,
    # died, and the others waited for it until the lost-host watchdog stopped them (#30).
    sharding.sync_processes("config_read")
    if jax.process_index() == 0:
        # (moved aside here, not in check_config_change: a process still to read it found none)
        kept = workdir_lib.keep_replaced_config(config, workdir, latest)
        if kept:
            note += f"; the previous config is kept as {kept}"
        workdir_lib.write_config(workdir, config)
        if prepared.task.save_assets:
            workdir_lib.save_assets(prepared.task.save_assets, workdir)
    _say(f"workdir {workdir_lib.resolve(workdir)}: " + ", ".join(_outputs(config, prepared.task)))

    with jax.set_mesh(prepared.mesh), nn.logical_axis_rules(prepared.rules), \
            quiet.storage_errors_in_one_line():
        state, data_state = restore_or_init(prepared, config)
        if note:  # the step actually resumed: a damaged newer one may have been passed over
            _say(f"resuming step {int(steps.fetch(state['step']))} {note}")
        train_step, eval_step = steps.jit_steps(prepared, config)
        # The loader checked above, unless the restore fell back to an older step (the
        # newest was damaged), whose data state is checked now.
        loader = (checked[1] if checked and checked[0] == data_state else
                  _resumed_loader(prepared.task, config, data_state, resume_changed))
        summary = _loop(config, workdir, prepared, state, loader, train_step, eval_step)
    for split, record in workdir_lib.last_records(workdir).items():
        summary[split] = summary[split] or record  # e.g. a resumed run with nothing to do
    summary["task"] = prepared.task
    _say(f"workdir {workdir_lib.resolve(workdir)}: checkpoints/ up to step {summary['step']}, "
         f"metrics.jsonl, tensorboard/, config.json")
    return summary


def _outputs(config, task: Task) -> list[str]:
    """What a training run writes into its workdir, for the line printed at the start."""
    out = [workdir_lib.CONFIG,
           f"checkpoints/ (every {config.train.checkpoint_every} steps and at the end)",
           f"metrics.jsonl and tensorboard/ (every {config.train.log_every} steps)"]
    if task.save_assets:  # an image classifier's are its class names (tasks/images.py)
        if task.classify:
            out.append("classes.json")
        if not task.classify or task.vocab_size:  # a text classifier's, its tokenizer too
            out.append("tokenizer/")
    return out


def due(step: int, every: int, total: int) -> bool:
    """Whether a periodic event (log, eval, checkpoint) happens at `step`: every
    `every` steps and at the last; every=0: only at the last; every<0: never."""
    return every >= 0 and (step == total or (every > 0 and step % every == 0))


def _loop(config, workdir, prepared: Setup, state, loader, train_step, eval_step) -> dict[str, Any]:
    """The steps. The host never waits for a step to finish except at a *sync point*:
    a step that logs, evaluates or checkpoints (or the last, or one after a stop
    signal). Between them it only queues work, so the device runs step after step while
    the host reads and transfers the next batches (`prefetch_to_device`). At a sync
    point the metrics of every step since the last one are fetched at once and checked;
    a non-finite step is found there, before anything is saved: "stop" stops with the
    last good checkpoint intact (the state after that step is dropped), "skip" goes on
    (its step applied no update: steps.make_train_step)."""
    total = config.train.steps
    # The whole state, waited for: an init or restore that failed on the device (out of
    # memory) raises here rather than leaving device_get waiting forever (steps.fetch).
    step = int(jax.device_get(jax.block_until_ready(state)["step"]))
    summary = {"step": step, "train": {}, "eval": {}, "losses": [], "stopped_by": None}
    pauses = heap.Pauses()
    progress, meter = Progress(config, workdir, prepared.task.unit, step), Throughput(pauses)
    pending, window = [], []  # steps since the last sync point (on the device); since the last log
    batches = prefetch_to_device(loader, prepared.mesh, config.train.prefetch, prepared.task.count)
    first, evaluated = step + 1, False
    # The stop handler stays until a pending save has committed: a Ctrl-C meanwhile is
    # a stop request (or, the second, main's immediate exit), not an interrupted commit.
    error = None  # what ends the loop by raising, if anything
    with StopRequest() as stop:
        try:
            with heap.FrozenHeap() as frozen, pauses:
                # Its save programs compile beside the first step's, on a thread that freezes
                # what they made once they are done (it may finish after the first step).
                prepared.ckpt.prepare(state, on_compiled=frozen.settle)
                while step < total:
                    t_data = time.perf_counter()
                    batch, units, data_state = next(batches)
                    t_step = time.perf_counter()
                    state, metrics = train_step(state, batch)
                    t_called = time.perf_counter()
                    meter.add(units, data_s=t_step - t_data, dispatch_s=t_called - t_step)
                    step += 1
                    pending.append((step, metrics))
                    progress.advance()
                    if step == first:  # its compilation made objects that live as long as the loop
                        frozen.settle()
                    stopping = stop.requested(step)
                    log_now = stopping or due(step, config.train.log_every, total)
                    eval_now = due(step, config.eval.every, total)
                    save_now = stopping or due(step, config.train.checkpoint_every, total)
                    sync = log_now or eval_now or save_now
                    if step == first:
                        # Its call compiled the step (a resumed run's first step too): time
                        # is measured from the call's return at a sync point, else from the
                        # step's end; the estimate of time left from then on.
                        progress.compiled(step, compile_s=t_called - t_step)
                        if sync:  # its compilation left out of the window
                            meter.restart(at=t_called)
                            meter.add(units, data_s=0.0, dispatch_s=0.0)
                        else:
                            jax.block_until_ready(metrics)
                            meter.restart()
                            progress.compiled(step)
                    if not sync:
                        continue
                    # ---- sync point: the one wait for the device since the last one.
                    window += _finite_steps(pending, config, prepared.ckpt, summary["losses"])
                    pending = []
                    if log_now and window:
                        summary["train"] = {**_means(window, config.train.log_every),
                                            **meter.report(prepared.task.unit)}
                        progress.train(step, summary["train"])
                        window = []
                        meter.restart()
                    if eval_now:
                        summary["eval"] = steps.evaluate(eval_step, state["params"],
                                                         prepared.task, config, prepared.mesh)
                        progress.eval(step, summary["eval"])
                        if not evaluated:  # as the first step's: the eval step's compilation
                            frozen.settle()
                            evaluated = True
                        meter.restart()  # evaluation is not training time
                    if save_now:
                        t_save = time.perf_counter()
                        prepared.ckpt.save(step, state, data_state, force=stopping or step == total)
                        meter.checkpoint_s += time.perf_counter() - t_save
                    if stopping:
                        summary["stopped_by"] = signal.Signals(stop.signal).name
                        progress.note(f"{summary['stopped_by']}: saved checkpoint at step {step}; "
                                      f"run the same command again to resume")
                        break
        except BaseException as e:
            error = e
            raise
        finally:
            batches.close()  # stops the loader's reading thread
            try:
                prepared.ckpt.wait()  # A pending async save commits before we return or raise.
                prepared.ckpt.close()
            except BaseException as e:
                error = error or e
                raise
            finally:
                # With the store gone the last event files stay local (a second round of
                # retries would only replace the error with its own); with another error
                # on its way out, theirs is said, not raised over it.
                progress.close(upload=not isinstance(error, (workdir_lib.RunPathError,
                                                             ckpt_lib.CheckpointSaveError)),
                               failing=error is not None)
        if summary["stopped_by"] is None and stop.signal is not None:
            # It came after the loop's last check (the last step's eval or save, the final
            # commit): the run is whole, and whoever sent it still asked to stop (a sweep
            # trained its next point).
            summary["stopped_by"] = signal.Signals(stop.signal).name
    summary["step"], summary["state"] = step, state
    return summary


# The exit code of a run stopped by a signal (after its checkpoint is saved): 128 + the
# signal's number, as a shell reports a process the signal ended.
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class StopRequest(contextlib.AbstractContextManager):
    """Turns SIGTERM/SIGINT into a stop the training loop polls between steps.

    Saving inside a signal handler would race with the step in flight; instead the
    loop finishes the current step, saves a final checkpoint and exits. A second
    signal while stopping restores the default behaviour (a user pressing Ctrl-C twice
    wants out now).

    With several processes they must stop at the same step, with no collective per
    step to agree on it: SIGTERM (a preempted VM, a scheduler stopping the job) is JAX's
    preemption notice. jax.distributed installs its own SIGTERM handler, which tells the
    coordination service; every process learns of it in the background, and
    `requested(step)` asks JAX's preemption sync manager whether `step` is the one all
    processes agreed to stop at (a local check; the one exchange of step numbers happens
    once, after a notice). SIGINT here is handed to that handler as a SIGTERM. It needs
    every process to call `requested` at every step from the same first step.
    """

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}
        self._preemption = jax.process_count() > 1
        self._signals = (signal.SIGINT,) if self._preemption else (signal.SIGTERM, signal.SIGINT)

    def _handler(self, signum, frame):
        if self.signal is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signal = signum
        # The host runs ahead of the device by the steps it has queued (up to a log,
        # eval or save): those finish, then the checkpoint, then the run stops.
        # os.write, not print: a print inside a signal handler raises where the handler
        # interrupted a write to stderr (a progress line) or the pipe is closed.
        if jax.process_index() == 0:
            try:
                os.write(2, f"warning: received {signal.Signals(signum).name}: finishing the "
                            f"steps already queued, then saving a final checkpoint and "
                            f"stopping\n".encode())
            except OSError:
                pass
        if self._preemption:
            signal.raise_signal(signal.SIGTERM)  # JAX's handler: every process stops

    def __enter__(self):
        # Signal handlers can only be installed from the main thread (tests call the
        # trainer from worker threads sometimes): then there is simply no handler.
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        return False

    def requested(self, step: int) -> bool:
        if not self._preemption:
            return self.signal is not None
        from jax.experimental import multihost_utils
        if multihost_utils.reached_preemption_sync_point(step):
            self.signal = self.signal or signal.SIGTERM
            return True
        return False


def _finite_steps(pending, config, ckpt, losses: list) -> list[dict]:
    """The fetched metrics of the `pending` (step, metrics) whose loss is finite; their
    losses appended to `losses`. A non-finite step stops the run ("stop") or is left
    out ("skip": its update was not applied)."""
    finite = []
    for at, m in steps.fetch(pending):
        if not m["finite"]:
            _nonfinite(config, at, m, ckpt)  # raises in "stop" mode
            continue
        losses.append(float(m["loss"]))
        finite.append(m)
    return finite


def _means(window: list[dict], log_every: int) -> dict[str, float]:
    """A logged window's record: each metric's mean over its steps, but the learning rate
    at its last step (the schedule's value at the logged step, as TensorBoard's x-axis
    says; a warmup's mean lags it, and read as the rate it looked like a wrong one)."""
    means = {k: float(np.mean([m[k] for m in window])) for k in window[0] if k != "finite"}
    if "lr" in means:
        means["lr"] = float(window[-1]["lr"])
    if len(window) != log_every:
        # Fewer steps than a full window: it began at a resume, ends the run early, or
        # lost skipped non-finite steps.
        means["steps_in_window"] = float(len(window))
    return means


class Throughput:
    """A window of training steps: the units (tokens, examples) trained, its start, and
    where the host's time went in it: waiting for the next batch (reading and sending
    it), inside the step call (tracing once, then only queueing work unless the
    device makes it wait) and in checkpoint saves (a save made at a log step falls in
    the next window). Reported as shares of the window's time: the rest is the wait
    for the device at the sync point. Apart: host_gc_frac, the share in which Python's
    garbage collector held the interpreter, in any thread (it stops them all; it
    overlaps the others)."""

    def __init__(self, pauses: heap.Pauses):
        self.pauses = pauses  # entered by the loop: adds up the collections
        self.restart()

    def restart(self, at: float | None = None) -> None:
        """A new window from now (or from the time.perf_counter() `at`)."""
        self.units, self.data_s, self.dispatch_s, self.checkpoint_s = 0, 0.0, 0.0, 0.0
        self.start = time.perf_counter() if at is None else at
        self.gc_start = self.pauses.total_s

    def add(self, units: int, data_s: float, dispatch_s: float) -> None:
        self.units += units
        self.data_s += data_s
        self.dispatch_s += dispatch_s

    def report(self, unit: str) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {f"{unit}_per_sec": self.units / elapsed, "host_data_frac": self.data_s / elapsed,
                "host_dispatch_frac": self.dispatch_s / elapsed,
                "host_checkpoint_frac": self.checkpoint_s / elapsed,
                "host_gc_frac": (self.pauses.total_s - self.gc_start) / elapsed}


class Progress:
    """Where a run reports: metrics.jsonl and TensorBoard (workdir.MetricWriter) and, on
    process 0, a progress bar on a terminal or, in a log file (the bar's stream is not
    a terminal: also a notebook's), one plain line per logged window instead of a line
    of carriage returns."""

    def __init__(self, config, workdir: str, unit: str, step: int):
        from tqdm import tqdm
        self.writer = workdir_lib.MetricWriter(workdir, resume_step=step)
        self.unit, self.total = unit, config.train.steps
        show = config.train.progress and jax.process_index() == 0
        self.plain = show and not sys.stderr.isatty()
        self.bar = tqdm(total=self.total, initial=step, disable=not show or self.plain,
                        dynamic_ncols=True, unit="step")
        self.start_step, self.start_time = step, time.perf_counter()
        self.compile_s = None  # the first step's call, said on the first line after it

    def compiled(self, step: int, compile_s: float | None = None) -> None:
        """The step that compiled ends at `step`: the time left is estimated from here."""
        self.start_step, self.start_time = step, time.perf_counter()
        if compile_s is not None:
            self.compile_s = compile_s

    def advance(self) -> None:
        self.bar.update(1)

    def train(self, step: int, means: dict[str, float]) -> None:
        self.writer.write(step, "train", means)
        rate = means[f"{self.unit}_per_sec"]
        self.bar.set_postfix(loss=f"{means['loss']:.4f}", lr=f"{means['lr']:.2e}",
                             **{f"{self.unit}/s": f"{rate:,.0f}"})
        if self.plain:
            _say(_progress_line(step, self.total, means, self.unit,
                                time.perf_counter() - self.start_time, step - self.start_step,
                                self.compile_s))
            self.compile_s = None

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.write(step, "eval", metrics)
        self.note(f"step {step} eval: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def note(self, message: str) -> None:
        # On process 0 only, as every other line of the run: tqdm.write prints whether or
        # not the bar is disabled, so each process printed every eval line and stop note.
        if jax.process_index() == 0:
            self.bar.write(message)

    def close(self, upload: bool = True, failing: bool = False) -> None:
        self.bar.close()
        self.writer.close(upload=upload, failing=failing)


def _progress_line(step, total, means, unit, elapsed, steps_done,
                   compile_s: float | None = None) -> str:
    """One line of progress for a log file: step, loss, lr, throughput, time left (from
    the steps since the compiling one; on the first line after it, its compile time)."""
    line = (f"step {step}/{total}  loss {means['loss']:.4f}  lr {means['lr']:.2e}  "
            f"{means[f'{unit}_per_sec']:,.0f} {unit}/s")
    if steps_done > 0:
        left = elapsed / steps_done * (total - step)
        line += f"  {int(left) // 60}m{int(left) % 60:02d}s left"
    if compile_s is not None:
        line += f"  (compiled in {compile_s:.1f}s)"
    return line


def _nonfinite(config, step, metrics, ckpt) -> None:
    what = f"loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}"
    if config.train.nonfinite == "skip":
        quiet.warn(f"step {step}: non-finite ({what}); update skipped")
        return
    ckpt.wait()
    last = ckpt.latest_step()
    where = (f"the last good checkpoint is step {last} in {ckpt.directory}" if last is not None
             else "no checkpoint was written yet")
    # The loss finite, its gradient not (an overflow in the backward pass): said as such,
    # not as a "non-finite training loss" beside the finite loss it prints.
    bad = "training loss" if not np.isfinite(float(metrics["loss"])) else "gradient"
    raise NonFiniteLossError(
        f"non-finite {bad} at step {step} ({what}); stopping without saving: "
        f"{where}. Lower config.optim.lr, check the data, or set "
        f"--config.train.nonfinite=skip to skip such steps.")
