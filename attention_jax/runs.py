"""Open a run in a workdir: its resolved config, its task, and the latest checkpoint's
state restored read-only onto this process's devices.

    run = runs.open_run("/tmp/gpt")                          # config.json, one device
    run = runs.open_run("/tmp/gpt", {"eval.batch_size": 8})  # with read-safe overrides
    run = runs.open_run(workdir, config=config)              # main's modes: the CLI config
    with run.mesh_context():
        logits, aux = run.task.model.apply({"params": run.params}, tokens)

Used by main's eval / sample / embed modes and by tools/ (analysis, fits, viz), which
also summarise a finished run here (run_summary, count_params; its files are read
through workdir.py). The checkpoint
is opened read-only (train.setup(read_only=True)): a writable manager would clean up the
temporary folder of a save in progress if the run is still training in the workdir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import ml_collections

from attention_jax import config as config_lib
from attention_jax import data, sharding, tasks, train
from attention_jax import workdir as workdir_lib
from attention_jax.checkpoint import CheckpointMismatchError
from attention_jax.workdir import RunNotFoundError


def load_config(workdir: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The run's config from its config.json, set to one device (a reader needs no mesh;
    checkpoints restore onto any mesh). `overrides`: {'data.seq_len': 256}."""
    config = workdir_lib.read_config(workdir)
    config.mesh.num_devices = 1
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    config.mesh.sequence = 1
    # (a multi-process or multislice run's split over the slow network: one process here)
    config.mesh.dcn_data, config.mesh.dcn_fsdp = 1, 1
    config.mesh.distributed = False
    config.train.progress = False
    config_lib.apply_overrides(config, overrides or {})
    return config


def fit_run_mesh(config, who: str, doing: str = "read") -> bool:
    """A run read on fewer devices than it trained on (8 devices, read on a laptop): the
    mesh of its config.json cannot be built here, and a reader needs no particular one
    (checkpoints restore onto any mesh). So it reads on this host's devices, batch split
    over them, and says so (True; False when the run's mesh fits, or the config is a
    multi-process one). main's reading modes call it unless a --config.mesh.* is given;
    load_config (the tools) sets one device instead.

    A run trained by several processes (mesh.distributed) is read by this one alone: it
    joined the training's coordinator, long gone, waited 5 minutes and aborted. Said.
    doing="train": the same for a run continued without --config or a --config.mesh.*
    (main.mode_config calls it only for a run of several processes: their launch settings,
    process 0's, are no part of the run)."""
    words = {"read": ("read", "reads", "reading"),
             "train": ("continued", "continues", "training")}[doing]
    m = config.mesh
    joined = m.distributed
    if joined:
        m.distributed, m.coordinator_address, m.cpu_collectives = False, "", ""
        m.num_processes, m.process_id = -1, -1
    alone = (f" (it trained as several processes, mesh.distributed=True: {words[0]} here by "
             f"this one; --config.mesh.distributed=True with each process's settings "
             f"{words[1]} with all of them)") if joined else ""
    shape = {a: m.get(a, 1) for a in sharding.MESH_AXES}
    here = jax.device_count()
    if _mesh_fits(m, shape, here):
        if joined:
            print(f"{who}: the run is {words[0]} on its mesh {shape}{alone}", file=sys.stderr)
        return joined
    # (its processes' or slices' split: the part of its mesh a single process cannot have)
    over = " × ".join(f"mesh.dcn_{a}={n}" for a, n in sharding.dcn_shape(m).items() if n != 1)
    m.data, m.fsdp, m.sequence, m.tensor, m.num_devices = -1, 1, 1, 1, 0
    m.dcn_data, m.dcn_fsdp = 1, 1
    where = "the one device here" if here == 1 else f"the {here} devices here, batch split"
    print(f"{who}: the run's mesh {shape}{f' over {over} processes' if over else ''} does not "
          f"fit this host's {here} device{'s' * (here > 1)}"
          f"{' (one process)' if over else ''}: {words[2]} on {where} (--config.mesh.* to "
          f"choose){alone}", file=sys.stderr)
    return True


def _mesh_fits(m, shape: dict[str, int], here: int) -> bool:
    """Whether a mesh config can be built on `here` devices of one process."""
    if m.num_devices > here or any(s != 1 for s in sharding.dcn_shape(m).values()):
        return False
    try:
        sharding.resolve_mesh_shape(shape, m.num_devices or here)
    except ValueError:
        return False
    return True


@dataclasses.dataclass
class Run:
    """A restored run. params: sharded jax.Arrays on `mesh`; tokenizer: the one saved in
    the workdir (None for image runs)."""
    config: Any
    task: tasks.Task
    params: Any
    step: int
    tokenizer: Any
    mesh: Any
    rules: Any
    shardings: Any  # the train state's NamedShardings, by field ("params", ...)

    def mesh_context(self):
        """The mesh and logical axis rules the model's params were restored under."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack


def open_run(workdir: str, overrides: dict | None = None, *, config=None) -> Run:
    """The workdir's latest checkpoint. config: the run's config as given (main's modes);
    None reads the workdir's config.json with `overrides` (see load_config)."""
    workdir = workdir_lib.expand(workdir)
    if config is None:
        config = load_config(workdir, overrides)
    elif overrides:
        raise ValueError(f"overrides={overrides!r} apply to the workdir's config.json; "
                         f"with config= given, set the fields on it instead")
    else:
        # A reader's config may differ from the run's only where reading allows it:
        # otherwise it would evaluate another model or split than the run trained. (No
        # config.json, e.g. a checkpoint written by a script: nothing to compare.)
        workdir_lib.check_reader_config(config, workdir)
    prepared = train.setup(config, workdir, read_only=True)
    try:
        if prepared.ckpt.latest_step() is None:
            raise RunNotFoundError(f"no checkpoint in {prepared.ckpt.directory}: train first "
                                   f"(--mode=train with this --workdir)")
        with jax.set_mesh(prepared.mesh), nn.logical_axis_rules(prepared.rules):
            # The newest step that restores and verifies (a damaged one is reported and
            # skipped, not moved: a reader changes nothing in the workdir).
            try:
                state, _, _ = prepared.ckpt.restore_intact(  # arrays only: no loader
                    prepared.abstract, need_data=False)
            except CheckpointMismatchError as e:
                if not overrides:
                    raise
                # The tools' overrides may go past the read-safe keys (the positions
                # analysis reads at another data.seq_len); one that reshapes the
                # parameters is named in one line, with the first array it reshapes.
                raise workdir_lib.reader_overrides_error(
                    config, workdir, " ".join(str(e).splitlines()[1].split())) from None
    finally:
        prepared.ckpt.close()
    tok_dir = workdir_lib.local_dir(workdir, workdir_lib.TOKENIZER)  # gs://, s3://: a copy
    tokenizer = data.load_tokenizer(tok_dir) if tok_dir else None
    return Run(config, prepared.task, state["params"], int(jax.device_get(state["step"])), tokenizer,
               prepared.mesh, prepared.rules, prepared.shardings)


# ============================================================== a finished run's records
def count_params(params) -> int:
    """Elements in a tree of arrays (or shapes)."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))



def run_summary(workdir: str, task=None) -> dict:
    """Final eval metrics, steps, parameter count and wall time of a finished run.

    Wall time is the span from the run's first start to its last metric record (the
    final eval; workdir.wall_seconds): compilation, training and evaluation included, as
    a user waits for it. A resumed run's span includes the pause. "model" is the resolved
    model config (a variant's fields included), not config.model's given keys. task: the
    run's, where the caller has built it (data on demand).
    """
    records = workdir_lib.read_metrics(workdir)
    evals = workdir_lib.eval_records(workdir)  # --mode=eval's too, where training had none
    trains = [r for r in records if r["split"] == "train"]
    config = load_config(workdir)
    if task is None:  # its config and entries: not its corpus, which may have moved
        with tasks.data_on_demand():
            task = tasks.TASKS[config.task](config, workdir)
    shapes = jax.eval_shape(task.init, jax.random.PRNGKey(0))  # Counts without computing.
    return {"workdir": workdir, "task": config.task, "step": trains[-1]["step"] if trains else 0,
            "steps": config.train.steps,
            "params": count_params(nn.meta.unbox(shapes)), "wall_s": workdir_lib.wall_seconds(workdir),
            "eval": {k: v for k, v in (evals[-1] if evals else {}).items()
                     if k not in ("step", "split")},
            "model": resolved_model_fields(config, task)}


def last_eval_step(workdir: str) -> int:
    """The step of a run's last evaluation (training's, or --mode=eval's): the result a
    report reads. A run killed during its final evaluation has trained every step, but
    its result is still an earlier step's."""
    return max((int(r.get("step", 0)) for r in workdir_lib.eval_records(workdir)), default=0)


def check_comparable(workdirs, report: str, same=(), finished: bool = True) -> None:
    """A ValueError for a set of runs a report would mix unsaid: one given twice (two
    globs that overlap), one that stopped before its train.steps (with `finished`: a
    killed run's last eval would stand as its result), runs that differ in a config key
    of `same` (e.g. the token budget of a scaling fit)."""
    seen, configs = {}, {}
    for w in workdirs:
        key = w.rstrip("/") if workdir_lib.is_remote(w) else os.path.realpath(w)
        if key in seen:
            raise ValueError(f"{report}: {w} is given twice (also as {seen[key]}); each run "
                             f"counts once")
        seen[key] = w
        config = load_config(w)
        evaluated = last_eval_step(w) if finished else None
        if finished and evaluated < config.train.steps:
            raise ValueError(f"{report}: {w} was last evaluated at step {evaluated} of "
                             f"its train.steps={config.train.steps}; valid: finished runs (run "
                             f"it again to finish it, or --mode=eval it at the end, or leave it "
                             f"out)")
        configs[w] = config_lib.flat(config)
    for key in same:
        values = {w: flat.get(key) for w, flat in configs.items()}
        groups: dict[str, list] = {}
        for w, v in values.items():
            groups.setdefault(repr(v), []).append(w)
        if len(groups) > 1:
            # Each value with its runs, the fewest first: the odd run out is named, where
            # the first few runs shown may all share the common value.
            shown = "; ".join(
                f"{v}: {', '.join(ws[:3])}" + (f" and {len(ws) - 3} more" if len(ws) > 3 else "")
                for v, ws in sorted(groups.items(), key=lambda g: len(g[1])))
            raise ValueError(f"{report}: the runs differ in {key} ({shown}); valid: runs of "
                             f"one {key}")


def resolved_model_fields(config, task) -> dict:
    """config.model's keys with the model's resolved values over them (a variant's sizes
    where config.model leaves them None), the plain ones (numbers, strings, bools)."""
    fields = config.model.to_dict()
    model_config = getattr(task.model, "config", None)
    if dataclasses.is_dataclass(model_config):
        fields.update({k: v for k, v in dataclasses.asdict(model_config).items()
                       if v is None or isinstance(v, (bool, int, float, str))})
    return fields
