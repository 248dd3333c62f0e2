"""Open a run in a workdir: its resolved config, its task, and the latest checkpoint's
state restored read-only onto this process's devices.

    run = runs.open_run("/tmp/gpt")                          # config.json, one device
    run = runs.open_run("/tmp/gpt", {"data.seq_len": 256})   # with overrides
    run = runs.open_run(workdir, config=config)              # main's modes: the CLI config
    with run.mesh_context():
        logits, aux = run.task.model.apply({"params": run.params}, tokens)

Used by main's eval / sample / embed modes and by tools/ (analysis, viz). The checkpoint
is opened read-only (train.setup(read_only=True)): a writable manager would clean up the
temporary folder of a save in progress if the run is still training in the workdir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import ml_collections

from attention_jax import data, tasks, train
from attention_jax.errors import UserError


class RunNotFoundError(UserError, FileNotFoundError):
    """The workdir holds no run, or no checkpoint yet (train first)."""


def load_config(workdir: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The run's config from its config.json, set to one device (a reader needs no mesh;
    checkpoints restore onto any mesh). `overrides`: {'data.seq_len': 256}."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise RunNotFoundError(f"{path} does not exist: {workdir!r} is not a run directory "
                                f"written by attention_jax.main (--workdir=DIR writes it)")
    with open(path) as f:
        raw = json.load(f)
    # A run written before the model fields were renamed keeps opening.
    raw["model"] = tasks.rename_old_model_fields(raw.get("task", ""), raw.get("model", {}))
    config = ml_collections.ConfigDict(raw)
    config.mesh.num_devices = 1
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    config.mesh.sequence = 1
    config.mesh.distributed = False
    config.train.progress = False
    for key, value in (overrides or {}).items():
        group, name = key.split(".")
        config[group][name] = value
    return config


@dataclasses.dataclass
class Run:
    """A restored run. params: sharded jax.Arrays on `mesh`; tokenizer: the one saved in
    the workdir (None for image runs)."""
    config: Any
    task: train.Task
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
    if config is None:
        config = load_config(workdir, overrides)
    elif overrides:
        raise ValueError(f"overrides={overrides!r} apply to the workdir's config.json; "
                         f"with config= given, set the fields on it instead")
    s = train.setup(config, workdir, read_only=True)
    try:
        if s.ckpt.latest_step() is None:
            raise RunNotFoundError(f"no checkpoint in {s.ckpt.directory}: train first "
                                   f"(--mode=train with this --workdir)")
        with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
            # The newest step that restores and verifies (a damaged one is reported and
            # skipped, not moved: a reader changes nothing in the workdir).
            state, _, _ = s.ckpt.restore_intact(s.abstract, say=lambda m: print(f"WARNING: {m}"))
    finally:
        s.ckpt.close()
    tok_dir = os.path.join(workdir, "tokenizer")
    tokenizer = data.load_tokenizer(tok_dir) if os.path.isdir(tok_dir) else None
    return Run(config, s.task, state["params"], int(jax.device_get(state["step"])), tokenizer,
               s.mesh, s.rules, s.shardings)
