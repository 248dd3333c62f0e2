"""Device mesh, logical-axis rules, and sharded creation of the train state.

Parameters and activations are annotated with the logical names of `axes.py`; the run
config's `mesh.rules` maps those names onto the four mesh axes:

  data    pure data parallelism: the batch is split, parameters are replicated.
  fsdp    the batch is split *and* parameters/optimizer state are split along their
          `embed` axis and gathered just in time (ZeRO-3 / fully sharded data parallel).
  sequence  context parallelism: the length of activations is split; attention runs as
          ring attention (attention/ring.py), passing keys and values between the
          devices of this axis, so no device holds the whole sequence.
  tensor  Megatron-style model parallelism: heads and MLP hidden units are split.

The same program runs on 1 CPU, 8 fake CPU devices, a GPU, or many hosts: jit with
NamedShardings (what pjit became) lets XLA insert the collectives. Across TPU slices or
hosts joined by the slow data-centre network the mesh is hybrid (`make_mesh`'s `dcn`,
config `mesh.dcn_data` / `mesh.dcn_fsdp`): only the batch axes span the slow network.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attention_jax import axes
from attention_jax.errors import ConfigError, did_you_mean

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
# Axes that may also span slices (TPU multislice) or hosts over the slow data-centre
# network: `mesh.dcn_data=2` puts 2 slices' worth of data parallelism on it, and the
# mesh's data axis is dcn_data × data. Only the batch-splitting axes: their traffic is
# one gradient reduction per step, while fsdp's gathers and tensor's per-layer
# collectives inside a slice would stall on the slow network.
DCN_AXES = ("data", "fsdp")
# Mesh axes the batch dimension is split over (fsdp also splits the batch: each fsdp
# shard computes on its own examples with gathered parameters).
BATCH_AXES = ("data", "fsdp")

# A sensible default, used by every experiment; order matters: flax assigns each logical
# axis the first rule whose mesh axis is not yet used by another dimension of the same
# array, so activations [batch, length, embed] get batch over (data, fsdp), length over
# sequence and an unsharded embed, while parameters [vocab, embed] get embed over fsdp.
DEFAULT_RULES = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", None),
    ("length", "sequence"),
    ("head_dim", None),
    ("layers", None),
    ("position", None),
    ("norm", None),
)


# ------------------------------------------------------------------------ distributed
def maybe_initialize_distributed(cfg) -> None:
    """`jax.distributed.initialize` when `mesh.distributed` is set (multi-host runs).

    Must run before anything touches the devices. Empty coordinator/num_processes/
    process_id mean "let JAX detect them" (SLURM, TPU pods and Open MPI set them; see
    launch/). JAX's own heartbeat timeout is set past `mesh.lost_host_timeout`, so that a
    lost host is reported by LostHostWatchdog in one line before the coordination service
    aborts the survivors.
    """
    if not cfg.distributed:
        return
    if jax.distributed.is_initialized():
        return
    check_distributed(cfg)
    if cfg.cpu_collectives:
        # CPU devices of different processes talk through gloo (tests, CPU clusters).
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs = {}
    if cfg.coordinator_address:
        kwargs["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes > 0:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id >= 0:
        kwargs["process_id"] = cfg.process_id
    if kwargs.get("coordinator_address"):  # JAX waits for every process, unsaid: say it
        who = (f"process {cfg.process_id} of {cfg.num_processes}" if cfg.num_processes > 0
               and cfg.process_id >= 0 else "this process")
        print(f"jax.distributed: {who} joining the coordinator at {cfg.coordinator_address}; "
              f"it waits until every process has joined (a process never started shows as a "
              f"DEADLINE_EXCEEDED abort after about 5 minutes)", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(
            **kwargs, heartbeat_timeout_seconds=service_heartbeat_timeout(cfg.lost_host_timeout))
    except (ValueError, IndexError) as e:  # JAX's own, for what it cannot detect
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config.mesh.distributed=True: jax.distributed.initialize failed "
                          f"({first}); valid: mesh.coordinator_address=host:port, "
                          f"mesh.num_processes and mesh.process_id, or a cluster JAX detects "
                          f"them on (SLURM, Open MPI, TPU pods; launch/)") from None
    logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count())


def check_distributed(cfg) -> None:
    """The multi-process keys that can be checked before any process joins (one line
    each): a coordinator address with its port, a process id below the process count."""
    address = cfg.coordinator_address
    if address:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ConfigError(f"config.mesh.coordinator_address={address!r}; valid: host:port, "
                              f"e.g. 10.0.0.1:1234 (process 0's host)")
    if cfg.num_processes == 0 or cfg.num_processes < -1:
        raise ConfigError(f"config.mesh.num_processes={cfg.num_processes}; valid: >= 1, or -1 "
                          f"to detect")
    if cfg.num_processes > 0 and not -1 <= cfg.process_id < cfg.num_processes:
        raise ConfigError(f"config.mesh.process_id={cfg.process_id}; valid: 0..."
                          f"{cfg.num_processes - 1} (mesh.num_processes={cfg.num_processes}), "
                          f"or -1 to detect")


def service_heartbeat_timeout(lost_host_timeout: float) -> int:
    """JAX's coordination-service heartbeat timeout: long enough after ours that our
    watchdog speaks first (it aborts every survivor with a C++ check failure)."""
    return int(math.ceil(lost_host_timeout * 1.5 + 10))


_barriers = itertools.count()  # every process calls sync_processes in the same order


def sync_processes(name: str, timeout: float = 3600) -> None:
    """Returns once every process has called it (the coordination service's barrier: no
    devices, no compile, the GIL released while waiting). Nothing with one process.
    A peer that dies before arriving is reported by LostHostWatchdog, not by this
    `timeout` (seconds), which only bounds a run without a watchdog."""
    if jax.process_count() == 1 or _client() is None:
        return
    _client().wait_at_barrier(f"attention_jax/{name}/{next(_barriers)}", int(timeout * 1000))


def exchange(name: str, value: str) -> list[str]:
    """Every process's `value`, in process order (the coordination service's key-value
    store and a barrier: no devices). [value] with one process."""
    if jax.process_count() == 1 or _client() is None:
        return [value]
    key = f"attention_jax/exchange/{name}/{next(_barriers)}"
    _client().key_value_set(f"{key}/{jax.process_index()}", value)
    sync_processes(f"exchange_{name}")
    found = {k.rsplit("/", 1)[-1]: v for k, v in _client().key_value_dir_get(key)}
    return [found[str(i)] for i in range(jax.process_count())]


def check_same_config(flat_config: dict[str, Any], own_keys=("mesh.process_id",)) -> None:
    """A ConfigError in every process when their configs differ (but for `own_keys`): each
    applied its own values to its copy of the model, and the copies drifted apart with
    nothing said (a learning rate), or a collective failed natively (a step count)."""
    mine = {k: v for k, v in flat_config.items() if k not in own_keys}
    configs = [json.loads(c) for c in exchange("config", json.dumps(mine, sort_keys=True,
                                                                    default=str))]
    for index, other in enumerate(configs):
        differ = sorted(k for k in set(other) | set(configs[0])
                        if other.get(k) != configs[0].get(k))
        if differ:
            shown = ", ".join(f"{k}: {configs[0].get(k)!r} (process 0), {other.get(k)!r} "
                              f"(process {index})" for k in differ[:4])
            more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
            raise ConfigError(f"the processes of this run were given different configs: {shown}"
                              f"{more}; valid: the same command on every process (only "
                              f"mesh.process_id differs)")


def check_same_place(workdir: str, write, read) -> None:
    """A ConfigError in every process unless all see `workdir` as one place: process 0
    writes a token there (`write(token)`), the others read it (`read()`). A local folder
    on each host saved nothing and hung at the first checkpoint, for ever."""
    if jax.process_count() == 1 or _client() is None:
        return
    token = exchange("workdir_token", uuid.uuid4().hex if jax.process_index() == 0 else "")[0]
    if jax.process_index() == 0:
        write(token)
    sync_processes("workdir_token_written")
    try:
        seen = read() == token
    except OSError:
        seen = False
    blind = [i for i, ok in enumerate(exchange("workdir_seen", str(int(seen)))) if ok != "1"]
    if blind:
        raise ConfigError(f"--workdir={workdir} is not one place for every process: process"
                          f"{'es' if len(blind) > 1 else ''} {', '.join(map(str, blind))} "
                          f"cannot see what process 0 wrote there (a local folder on each "
                          f"host?); valid: a shared filesystem or object storage (gs://) that "
                          f"every host reaches")


# ------------------------------------------------------------------------ lost hosts
# A run over several hosts is one program per host; each step's collectives need all of
# them. A host that dies (a preempted VM, an OOM-killed process) leaves the others waiting
# inside a collective for ever, until JAX's coordination service notices the missing
# heartbeats and aborts them with a C++ check failure. `LostHostWatchdog` says it first,
# in one line, and exits with `EXIT_LOST_HOST`: every process publishes a heartbeat in the
# coordination service's key-value store and reads the others' (a background thread: the
# main thread may be stuck in that collective); a peer whose heartbeat has not changed
# for `mesh.lost_host_timeout` seconds is lost. Checkpoints are safe: orbax commits a step
# only after every process wrote its part, so the newest committed step is whole and a
# rerun of all processes resumes from it.
#
# What it cannot say: when process 0 itself dies, the coordination service it hosts dies
# with it and JAX's client aborts the others at once with its own message ("... the
# leader task was preempted/died ..."); that exit is immediate, not ours.
EXIT_LOST_HOST = 75  # EX_TEMPFAIL: not this process's fault; run again to resume.
_PREFIX = "attention_jax_heartbeat/"
_DONE = "done"  # a process that finished: its silence from then on is not a loss


def _client():
    """JAX's distributed runtime client (no public accessor; multihost_utils reads the
    same global state)."""
    from jax._src import distributed
    return distributed.global_state.client


class LostHostWatchdog:
    """While it is entered, exits this process within about `timeout` seconds of another
    process going silent, with one line on stderr naming it. Does nothing with one
    process. Leaving it normally marks this process done, so the others stop
    counting its silence; leaving by an exception does not (a crashed host is lost).
    Leaving by a JAX runtime error (a failed collective) first waits up to `timeout` for
    the verdict, so a peer's death is reported as such rather than as the traceback of
    the collective it broke."""

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self.interval = max(0.2, min(2.0, self.timeout / 10))
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if jax.process_count() > 1 and _client() is not None:
            self._me, self._count = jax.process_index(), jax.process_count()
            self._beat(0)
            self._thread = threading.Thread(target=self._watch, name="lost-host-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc):
        if self._thread is None:
            return False
        if exc_type is not None and issubclass(exc_type, jax.errors.JaxRuntimeError):
            # A collective may fail rather than hang when a peer dies (gloo: "connection
            # reset by peer"): give the watchdog its verdict before the traceback.
            wait = self.timeout + 3 * self.interval
            print(f"process {self._me}: a collective failed; waiting up to {wait:.0f} s "
                  f"(mesh.lost_host_timeout) to see whether a peer was lost",
                  file=sys.stderr, flush=True)
            time.sleep(wait)  # the watchdog thread exits the process if it finds one
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._beat(_DONE)
        return False

    def _beat(self, value) -> None:
        _client().key_value_set(f"{_PREFIX}{self._me}", str(value), allow_overwrite=True)

    def _watch(self) -> None:
        start = time.monotonic()
        # peer -> (its last heartbeat value, when we saw it change); a peer that has not
        # written yet counts from our start.
        seen = {p: (None, start) for p in range(self._count) if p != self._me}
        beat = 0
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                self._beat(beat)
                values = {k.rsplit("/", 1)[-1]: v for k, v in _client().key_value_dir_get(_PREFIX)}
            except Exception as e:  # the coordination service is gone: process 0 died
                self._lost(f"the coordinator, process 0 of {self._count}, is unreachable "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
            now = time.monotonic()
            for peer in list(seen):
                value = values.get(str(peer))
                if value == _DONE:
                    del seen[peer]
                elif value != seen[peer][0]:
                    seen[peer] = (value, now)
            lost = sorted(p for p, (_, since) in seen.items() if now - since > self.timeout)
            if lost:
                age = now - seen[lost[0]][1]
                who = (f"process {lost[0]}" if len(lost) == 1
                       else f"processes {', '.join(map(str, lost))}")
                self._lost(f"{who} of {self._count} sent no heartbeat for {age:.0f} s "
                           f"(mesh.lost_host_timeout={self.timeout:g})")

    def _lost(self, why: str) -> None:
        print(f"error: process {self._me}: {why}; stopping (exit code {EXIT_LOST_HOST}). "
              f"The newest committed checkpoint is whole: start all processes again to "
              f"resume from it.", file=sys.stderr, flush=True)
        # os._exit: the main thread may be inside a collective that will never finish, and
        # no cleanup may wait on the lost peer (an async save's commit, JAX's shutdown).
        os._exit(EXIT_LOST_HOST)


# ------------------------------------------------------------------------------- mesh
def resolve_mesh_shape(shape: dict[str, int], num_devices: int) -> dict[str, int]:
    """{'data': -1, 'fsdp': 2, 'tensor': 1} on 8 devices -> {'data': 4, 'fsdp': 2, ...}
    (axes not given have size 1).

    -1 means "all remaining devices"; at most one axis may use it.
    """
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes {unknown} are unknown; valid: {list(MESH_AXES)}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    rest = [a for a, s in sizes.items() if s == -1]
    bad = [f"mesh.{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"{', '.join(bad)}: mesh sizes must be positive or -1 (the rest)")
    if len(rest) > 1:
        raise ValueError(f"mesh axes {rest} are all -1; at most one axis may take the rest")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if num_devices % fixed:
            # Named by the axes set, which the user chose, with the sizes that fit.
            set_ = {a: s for a, s in sizes.items() if s not in (1, -1)}
            divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
            raise ValueError(
                f"mesh.{rest[0]}=-1 cannot take the rest: "
                + ", ".join(f"mesh.{a}={s}" for a, s in set_.items())
                + f" take{'s' * (len(set_) == 1)} {fixed} devices, which do not divide the "
                f"{num_devices}; valid: sizes whose product divides {num_devices} (each one "
                f"of {divisors})")
        sizes[rest[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh {sizes} has {fixed} devices but {num_devices} are available; set one "
            f"axis to -1 or make the sizes multiply to {num_devices}"
            + (f", or use {fixed} of them (mesh.num_devices={fixed})" if fixed < num_devices
               else ""))
    return sizes


def dcn_shape(cfg) -> dict[str, int]:
    """{'data': cfg.dcn_data, 'fsdp': cfg.dcn_fsdp} of a mesh config (1 when absent)."""
    return {a: int(cfg.get(f"dcn_{a}", 1)) for a in DCN_AXES}


def granules(devices: Sequence[Any]) -> tuple[list[int], bool]:
    """The groups joined by the slow network, as (one id per device, whether they are
    processes): TPU slices where devices carry several `slice_index` values, else
    processes (a GPU node, a CPU process)."""
    slices = [getattr(d, "slice_index", None) for d in devices]
    if None not in slices and len(set(slices)) > 1:
        return slices, False
    return [d.process_index for d in devices], True


def check_dcn(dcn: dict[str, int], count: int, what: str) -> None:
    """ValueError unless the dcn sizes multiply to `count`, the slices or processes (`what`)
    the hybrid mesh spans: one granule per coordinate of the slow-network axes."""
    wanted = math.prod(dcn.values())
    if wanted != count:
        given = " × ".join(f"mesh.dcn_{a}={s}" for a, s in dcn.items())
        raise ValueError(f"{given} = {wanted} must equal the number of {what}, {count}; "
                         f"valid: dcn sizes multiplying to {count}")


def make_mesh(shape: dict[str, int], devices: Sequence[Any] | None = None,
              dcn: dict[str, int] | None = None) -> Mesh:
    """The (data, fsdp, sequence, tensor) mesh over all devices (of all processes).

    dcn: sizes of the axes across slices/hosts (`dcn_shape`); with any above 1 the mesh
    is hybrid: `shape` is resolved against one granule's devices (a slice or a process)
    and each axis of the result is dcn size × in-granule size, with the dcn part
    outermost, so a granule's devices hold neighbouring coordinates and fsdp, sequence
    and tensor collectives never leave it."""
    devices = list(jax.devices() if devices is None else devices)
    dcn = {a: int(s) for a, s in (dcn or {}).items()}
    if all(s == 1 for s in dcn.values()):
        sizes = resolve_mesh_shape(shape, len(devices))
        # jax.make_mesh orders devices so that the fastest-changing axis (tensor) stays on
        # the best-connected devices (same host / same ICI ring).
        # Auto axes: XLA propagates shardings from the annotated inputs/params (the
        # explicit sharding-in-types mode would make every op state its sharding).
        return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                             devices=devices)
    ids, by_process = granules(devices)
    count = len(set(ids))
    check_dcn(dcn, count, "processes" if by_process else "slices")
    sizes = resolve_mesh_shape(shape, len(devices) // count)
    from jax.experimental import mesh_utils
    array = mesh_utils.create_hybrid_device_mesh(
        [sizes[a] for a in MESH_AXES], [dcn.get(a, 1) for a in MESH_AXES], devices,
        process_is_granule=by_process)
    return Mesh(array, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def batch_split_problem(processes: np.ndarray, process_count: int) -> str | None:
    """What is wrong with a mesh whose devices belong to `processes` (an int array of the
    mesh's shape, axes MESH_AXES: each device's process index) for batches that each of
    `process_count` processes loads its own share of (loaders.Loader: process p reads the
    p-th block of G/P rows; shard_batch hands it to jax.make_array_from_process_local_data),
    or None. Each batch shard (a coordinate of the data and fsdp axes) must lie on the
    devices of one process: one spread over several, because the sequence or tensor axis
    spans processes, is one "replica" to JAX that the processes fill with different rows
    (and the global batch shrinks to G/P), which trains on nothing consistent, unsaid.
    Every process must hold a shard too (mesh.num_devices cutting a process out), and as
    many as every other (mesh.num_devices cutting one short)."""
    processes = np.asarray(processes)
    dp = processes.shape[0] * processes.shape[1]
    by_shard = processes.reshape(dp, -1)  # [data × fsdp, sequence × tensor]
    for i, row in enumerate(by_shard):
        owners = sorted(set(row.tolist()))
        if len(owners) > 1:
            sizes = dict(zip(MESH_AXES, processes.shape))
            return (f"batch shard {i} of the {dp} (mesh.data={sizes['data']} × mesh.fsdp="
                    f"{sizes['fsdp']}) lies on devices of processes {owners}, which each load "
                    f"their own rows of every batch: mesh.sequence={sizes['sequence']} × "
                    f"mesh.tensor={sizes['tensor']} spans processes, so the batch would be "
                    f"{process_count} different copies of one shard")
    missing = sorted(set(range(process_count)) - set(by_shard[:, 0].tolist()))
    if missing:
        return (f"the mesh holds no device of process(es) {missing}, which load their share "
                f"of every batch too")
    # Each process loads G/P rows: it must hold dp/P of the shards (mesh.num_devices=6 of
    # 2 processes × 4 devices gave 4 and 2, and the first batch stopped in jax's 'Unable
    # to compute global_shape due to non-uniform sharding' traceback).
    held = {p: int(np.sum(by_shard[:, 0] == p)) for p in range(process_count)}
    if len(set(held.values())) > 1:
        return (f"the processes hold {', '.join(f'{n} (process {p})' for p, n in held.items())}"
                f" of the {dp} batch shards, where each loads an equal share of every batch")
    return None


def check_batch_split(mesh: Mesh) -> None:
    """ConfigError when the batches of a multi-process run cannot be assembled on `mesh`
    (`batch_split_problem`); nothing with one process."""
    if jax.process_count() == 1:
        return
    processes = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    problem = batch_split_problem(processes, jax.process_count())
    if problem:
        local = jax.local_device_count()
        raise ConfigError(
            f"config.mesh: {problem}; valid: mesh.data × mesh.fsdp (× mesh.dcn_data × "
            f"mesh.dcn_fsdp) a multiple of the {jax.process_count()} processes, with "
            f"mesh.sequence × mesh.tensor dividing one process's {local} devices, and "
            f"mesh.num_devices=0 (all)")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data and fsdp; the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ------------------------------------------------------------------------------ rules
def rules_from_config(rules) -> tuple[tuple[str, Any], ...]:
    """Config rules (lists from JSON/CLI, or tuples) -> flax's tuple-of-pairs form.

    Checks every name so that a typo fails here: a mesh axis rather than inside XLA, a
    logical one rather than never (flax leaves a name without a rule unsharded, so
    'btch' copied the batch onto every device, unsaid, at a seventh of the speed).
    """
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str) or len(rule) != 2:
            raise ConfigError(f"config.mesh.rules[{i}]={rule!r} is not a pair; valid: "
                              f"(logical_name, mesh_axes) pairs, e.g. ('batch', ('data', "
                              f"'fsdp')) or ('embed', None)")
        name, target = rule
        if name not in axes.LOGICAL_AXES:
            raise ConfigError(f"config.mesh.rules[{i}]: {name!r} is no logical axis of the "
                              f"models; valid: {list(axes.LOGICAL_AXES)}"
                              f"{did_you_mean(name, axes.LOGICAL_AXES)}")
        if isinstance(target, (list, tuple)):
            target = tuple(target)
            named = target
        else:
            named = () if target is None else (target,)
        bad = [a for a in named if a not in MESH_AXES]
        if bad:
            raise ConfigError(f"config.mesh.rules[{i}]: logical axis {name!r} maps to {bad}; "
                              f"valid mesh axes: {list(MESH_AXES)} or None"
                              f"{did_you_mean(bad[0], MESH_AXES)}")
        out.append((str(name), target))
    return tuple(out)


def rules_warnings(rules, mesh_shape) -> list[str]:
    """What `rules` leave undone on a mesh of `mesh_shape`: a batch split over no
    data-parallel axis of size > 1 makes each of those devices compute the whole batch."""
    out = []
    targets = lambda name: {a for n, target in rules if n == name or name is None  # noqa: E731
                            for a in (target if isinstance(target, tuple) else (target,))}
    parallel = {a: mesh_shape.get(a, 1) for a in BATCH_AXES if mesh_shape.get(a, 1) > 1}
    if parallel and not targets(axes.BATCH) & set(parallel):
        shown = " × ".join(f"mesh.{a}={n}" for a, n in parallel.items())
        out.append(f"config.mesh.rules split 'batch' over none of {list(parallel)} ({shown}): "
                   f"each of those devices computes the whole batch, no faster than one; the "
                   f"default rules have ('batch', {BATCH_AXES})")
    # A tensor axis of size > 1 that no rule names (own rules replacing the defaults): its
    # devices each compute the same thing. (Not the sequence axis: ring attention splits
    # over it whatever the rules say.)
    if mesh_shape.get("tensor", 1) > 1 and "tensor" not in targets(None):
        out.append(f"config.mesh.rules map no logical axis to mesh.tensor="
                   f"{mesh_shape['tensor']}: those devices each compute the same thing; the "
                   f"default rules split heads, the MLP and the vocabulary over 'tensor'")
    return out


def logical_to_shardings(logical_specs, mesh: Mesh, rules):
    """A tree of logical PartitionSpecs -> NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def check_divisible(abstract_tree, shardings, what: str = "parameter", logical=None) -> None:
    """Fail before compilation when a sharded dimension does not divide its mesh axes:
    one ConfigError line naming the first such array, its logical axis (`logical`: the
    tree's logical PartitionSpecs, when given) and what would do.

    XLA would otherwise pad or fail deep inside compilation with an opaque message.
    """
    problems, names = [], set()
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract_tree)
    flat_sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    specs = (jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, PartitionSpec))
             if logical is not None else [None] * len(flat))
    for (path, leaf), sh, spec in zip(flat, flat_sh, specs):
        for k, (dim, split) in enumerate(zip(leaf.shape, sh.spec)):
            if split is None:
                continue
            split = (split,) if isinstance(split, str) else tuple(split)
            size = math.prod(sh.mesh.shape[a] for a in split)
            if dim % size:
                name = spec[k] if spec is not None and k < len(spec) else None
                names.add(name)
                problems.append(f"{jax.tree_util.keystr(path)} shape {leaf.shape}: dimension "
                                f"{dim}" + (f" (logical axis {name!r})" if name else "")
                                + f" is split over mesh axes {split} of size {size}")
    if problems:
        remap = sorted(n for n in names if n)
        raise ConfigError(
            f"config.mesh: {len(problems)} {what}(s) cannot be split as the mesh "
            f"{dict(mesh_shape(flat_sh))} asks: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; valid: model sizes the mesh axes divide, other mesh.* sizes, or mesh.rules "
            + (f"mapping {', '.join(map(repr, remap))} to None" if remap
               else "mapping that logical axis to None"))


def mesh_shape(shardings) -> dict[str, int]:
    for sh in shardings:
        return dict(sh.mesh.shape)
    return {}


def shard_batch(batch, mesh: Mesh):
    """Process-local numpy batch -> global jax.Arrays split over (data, fsdp).

    Each process passes its own rows (the loader gives process p the p-th block of the
    global batch); no process ever holds the whole batch. A PackedBatch (pack_batch)
    goes as its one array.
    """
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        batch)


@jax.tree_util.register_pytree_node_class
class PackedBatch:
    """A batch's arrays as one uint8 array [B, bytes]: row b holds row b of every array,
    byte for byte, one after the other. `pack_batch` builds it on the host; `shard_batch`
    sends its one array to the devices; `unpack()`, inside the jitted step, gives the
    batch back (slices and bitcasts, which XLA fuses into their first use).

    Why: a step's batch is several arrays (inputs, targets, weights, and for packed
    documents positions and segment ids), and each is its own host-to-device copy per
    device, each with its fixed cost on the host and on the copy engine. Packed, a step
    sends one (tests/system/test_step_structure.py counts them). The layout (the tree of
    arrays, their dtypes and row shapes) is static: part of the jitted step's signature,
    as the arrays' shapes would be."""

    def __init__(self, data, layout):
        self.data = data  # [B, bytes] uint8: numpy on the host, a jax.Array on the devices
        self.layout = layout  # (treedef, ((dtype name, row shape), ...)) of the arrays

    def tree_flatten(self):
        return (self.data,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def unpack(self):
        """The batch, as the tree of arrays `pack_batch` was given (traceable)."""
        treedef, fields = self.layout
        rows, start, arrays = self.data.shape[0], 0, []
        for dtype, shape in fields:
            dtype = np.dtype(dtype)
            size = math.prod(shape) * dtype.itemsize
            raw = self.data[:, start:start + size]
            start += size
            if dtype == np.bool_:
                x = raw != 0
            elif dtype.itemsize == 1:
                x = jax.lax.bitcast_convert_type(raw, dtype)
            else:  # [B, n·itemsize] -> [B, n, itemsize] -> [B, n]
                x = jax.lax.bitcast_convert_type(raw.reshape(rows, -1, dtype.itemsize), dtype)
            arrays.append(x.reshape(rows, *shape))
        return jax.tree_util.tree_unflatten(treedef, arrays)


def pack_batch(batch) -> PackedBatch:
    """A process-local batch (a tree of numpy arrays with a common leading batch axis) as
    one PackedBatch. dtypes are made what JAX would make them (int64 -> int32 unless
    x64 is enabled), as a transfer of each array would."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    arrays = [np.ascontiguousarray(x, dtype=jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
              for x in leaves]
    rows = {len(x) for x in arrays}
    if len(rows) != 1:
        raise ValueError(f"pack_batch: the arrays' leading (batch) sizes differ: "
                         f"{[x.shape for x in arrays]}; valid: one batch size for all")
    (b,) = rows
    data = np.concatenate([x.reshape(b, -1).view(np.uint8) for x in arrays], axis=1)
    return PackedBatch(data, (treedef, tuple((x.dtype.name, x.shape[1:]) for x in arrays)))
