"""The run directory: what a training run writes into its workdir, and how it is read back.

    workdir/config.json      the resolved config (write_config / read_config)
    workdir/metrics.jsonl    one record per (step, split) (MetricWriter / read_metrics)
    workdir/evals.jsonl      evaluations of the trained run (--mode=eval), one per call
    workdir/lock.json        who writes the workdir now (WriterLock)
    workdir/tensorboard/     the same metrics as TensorBoard event files
    workdir/checkpoints/     orbax steps (checkpoint.py)
    workdir/tokenizer/       the run's tokenizer, for eval, sampling and resume

The trainer, `runs`, the tools and the sweep all go through here, so the file names,
the handling of a line torn by a kill, and the mapping of old config names live in one
place. Also here: the guard that stops a resume with a changed config.

A workdir is a local path or an object-store URL (gs://bucket/run, s3://bucket/run): files
are read and written through `etils.epath` (fsspec's gcsfs/s3fs for URLs, as orbax does),
and only a local path is made absolute. Object stores have no append, rename or lock: the
JSONL files are rewritten whole (MetricWriter says why that is cheap enough), and the
writer lock is a warning there (WriterLock).
"""

from __future__ import annotations

import errno
import glob
import atexit
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import uuid
from typing import Any, Callable

import jax
import ml_collections
from etils import epath

from attention_jax import config as config_lib
from attention_jax import quiet
from attention_jax.errors import ConfigError, UserError

CONFIG = "config.json"
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"  # --mode=eval of a trained run: its records, apart from the training's
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
TOKENIZER = "tokenizer"


class RunNotFoundError(UserError, FileNotFoundError):
    """The workdir holds no run, or no checkpoint yet (train first)."""


# URL schemes epath reaches through fsspec (gcsfs, s3fs): paths that are never made absolute.
REMOTE_SCHEMES = ("gs://", "s3://")
# Those a run may use as its workdir: where orbax can write checkpoints (checkpoint.py).
CHECKPOINT_URLS = ("gs://",)


def is_remote(workdir) -> bool:
    """Whether `workdir` is an object-store URL (gs://, s3://) rather than a local path."""
    return str(workdir).startswith(REMOTE_SCHEMES)


def resolve(workdir) -> str:
    """`workdir` as the trainer names it: a local path made absolute (orbax needs that),
    an object-store URL as it is (os.path.abspath would turn gs://b/r into ./gs:/b/r)."""
    workdir = str(workdir)
    return workdir if is_remote(workdir) else os.path.abspath(expand(workdir))


# A URL's scheme (two letters or more: "C:/" is a Windows drive) followed by ":/".
_URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")


def expand(workdir) -> str:
    """`workdir` with a leading ~ expanded (a shell leaves --workdir=~/run as it is); a URL
    as it is. Every entry point takes its workdir through this: a literal ~ once sent the
    checkpoints to $HOME/run and everything else to ./~/run. A URL of another scheme, or
    one slash short (gs:/bucket), is refused: it was made a local folder ./gs:/bucket."""
    workdir = str(workdir)
    if is_remote(workdir):
        return workdir
    url = _URL_LIKE.match(workdir)
    if url:
        raise RunPathError(f"--workdir={workdir} reads as a URL of a scheme this does not "
                           f"know ({url.group(1)}:), or one slash short; valid: "
                           f"{', '.join(f'{s}bucket/path' for s in REMOTE_SCHEMES)}, or a "
                           f"local path")
    return os.path.expanduser(workdir)


def path(workdir, name: str) -> str:
    """workdir/name, for one of the names above (a URL stays a URL)."""
    return os.path.join(expand(workdir), name)


def fresh_listings() -> None:
    """checkpoint.fresh_listings, imported only for a remote path: a local workdir (most
    runs, every tool that reads one) does not load orbax for it."""
    from attention_jax import checkpoint
    checkpoint.fresh_listings()


def epath_of(workdir, name: str | None = None) -> epath.Path:
    """workdir (or workdir/name) as an epath.Path: local or gs:// / s3:// alike."""
    if is_remote(workdir):
        fresh_listings()
    return epath.Path(path(workdir, name) if name else expand(workdir))


def exists(workdir, name: str | None = None) -> bool:
    return epath_of(workdir, name).exists()


def _write_text(file, text: str) -> None:
    """The whole object/file replaced at once: a reader (another process, a notebook) and
    a crash see the old text or the new, never a truncated file. An object store's put
    is atomic; a local file is written beside and renamed over the old one."""
    if is_remote(file):
        epath_of(file).write_text(text)
        return
    # A name of this writer's own (open's usual permissions, unlike mkstemp's 0600).
    tmp = f"{os.fspath(file)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_assets(save: Callable[[str], None], workdir) -> None:
    """Runs a task's `save(workdir)` (e.g. the tokenizer into workdir/tokenizer). The
    savers write local files (os.makedirs, open), so a remote workdir gets them written
    into a local temporary folder first and copied up file by file."""
    if not is_remote(workdir):
        save(str(workdir))
        return
    from attention_jax.data.tokenization import META_FILE
    with tempfile.TemporaryDirectory(prefix="attention_jax_assets_") as tmp:
        save(tmp)
        local = [os.path.join(root, f) for root, _, files in os.walk(tmp) for f in files]
        # A tokenizer's META_FILE last: it says the folder holds a tokenizer (the saver
        # writes it after the vocabulary). Uploaded in the listing's order (the
        # filesystem's hash order), it could go up first, and a run stopped before the
        # vocabulary followed (a kill, the store gone) failed at every later start with
        # a traceback ("No such file or directory") until the folder was deleted.
        for file in sorted(local, key=lambda f: (os.path.basename(f) == META_FILE, f)):
            target = epath_of(workdir, os.path.relpath(file, tmp))
            target.write_bytes(open(file, "rb").read())


_LOCAL_COPIES: dict[str, str] = {}


def local_dir(workdir, name: str) -> str | None:
    """A local folder holding workdir/name (e.g. the tokenizer) for code that reads it
    with `open` (data.load_tokenizer): the folder itself for a local workdir, else a
    copy downloaded once per process into a temporary folder, removed when the process
    exits (each run against a bucket once left one behind); None when it is absent."""
    folder = epath_of(workdir, name)
    if not is_remote(workdir):
        return str(folder) if folder.is_dir() else None
    key = str(folder)
    if key not in _LOCAL_COPIES:
        if not folder.is_dir():
            return None
        import fsspec  # epath refuses recursive globs on GCS; fsspec's find is one listing
        fs, inside = fsspec.core.url_to_fs(key)
        tmp = tempfile.mkdtemp(prefix="attention_jax_copy_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        for f in fs.find(inside):
            local = os.path.join(tmp, os.path.relpath(f, inside))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get_file(f, local)
        _LOCAL_COPIES[key] = tmp
    return _LOCAL_COPIES[key]


# =================================================================================== config
# Model-config fields renamed since a run may have written its config.json (old -> new),
# by task: one spelling of the fields the families share (d_model, max_len,
# norm_epsilon, dropout_rate, vocab_size).
RENAMED_MODEL_FIELDS = {
    "gpt": {"embed_dim": "d_model"},
    "encdec": {"embed_dim": "d_model"},
    "bert_mlm": {"max_positions": "max_len", "layer_norm_epsilon": "norm_epsilon"},
    "vit": {"layer_norm_epsilon": "norm_epsilon"},
    "rnn_seq2seq": {"src_vocab_size": "vocab_size", "dropout": "dropout_rate"},
}

# Keys the experiment configs gained after runs were saved without them, with the value
# those runs trained with: resuming such a run with the key at that value is no change.
ADDED_KEYS = {"data.packing": "documents", "model.ring_inner": "auto", "model.norm_kernel": "auto",
              "model.mlp_dim": None, "model.num_experts": None, "model.top_k": None,
              "model.capacity_factor": None,
              **{f"model.{k}": None for k in config_lib.GPT_ARCHITECTURE_KEYS},
              **{f"data.{k}": v for k, v in config_lib.TEXT_FILE_KEYS.items()},
              **{f"data.{k}": v for k, v in config_lib.IMAGE_KEYS.items()}}


def rename_old_model_fields(task: str, model: dict) -> dict:
    """`model` (a config.json's "model" group) with the old field names of `task`'s
    model replaced by today's; a field written under both names is an error."""
    renamed = RENAMED_MODEL_FIELDS.get(task, {})
    both = sorted(old for old, new in renamed.items() if old in model and new in model)
    if both:
        raise ConfigError(f"config.model has both {both[0]!r} and its new name "
                          f"{renamed[both[0]]!r}; keep only {renamed[both[0]]!r}")
    return {renamed.get(k, k): v for k, v in model.items()}


def fix_old_gated_activation(model: dict) -> dict:
    """`model` with a named gated MLP's activation set to its gate where the run's config
    gave another (configs/gated_mlp wrote activation='gelu' for mlp='swiglu'). Before
    model.activation fed mlp='glu' only, swiglu and geglu ignored it and trained their own
    gate; it is now refused, so such a run's config.json no longer loaded (its eval,
    sample, reports) and its resume read as a change of model.activation. GPT's default
    (gelu_tanh: "left as it is") is kept, which today's config writes and accepts."""
    from attention_jax.layers.mlp import GATED_MLPS
    from attention_jax.models.gpt import DEFAULT_ACTIVATION
    gate = GATED_MLPS.get(model.get("mlp"))
    # (None, configs/gpt.py's "unset", is the variant's: left as it is too)
    if gate is not None and model.get("activation") not in (gate, DEFAULT_ACTIVATION, None):
        return {**model, "activation": gate}
    return model


# Config keys that may name local files or folders. config.json holds them absolute, so
# that what reads the run later (--mode=eval or sample, a resume) from another directory
# finds the data it trained on, or is told that the data differs, never reading other
# files in silence; comparisons of configs resolve both sides the same way.
PATH_KEYS = ("data.files", "data.eval_files", "data.tokenizer", "data.cache_dir",
             "data.data_dir", "data.root", "data.eval_root", "train.init_from")


def _absolute_path(path_: str) -> str:
    path_ = path_.strip()
    return path_ if not path_ or "://" in path_ else resolve(path_)  # a URL is absolute


def absolute_paths(flat_config: dict[str, Any]) -> dict[str, Any]:
    """A flat config ({"group.key": value}) with PATH_KEYS' local paths made absolute in
    the current directory: comma-separated globs one by one, a tokenizer only when it is a
    path (not a kind like "bpe"), init_from's "hf:" kept."""
    from attention_jax.data.tokenization import is_tokenizer_path
    out = dict(flat_config)
    for key in PATH_KEYS:
        value = out.get(key)
        if not isinstance(value, str) or not value:
            continue
        if key in ("data.files", "data.eval_files"):
            out[key] = ",".join(_absolute_path(g) for g in value.split(",") if g.strip())
        elif key == "data.tokenizer":
            out[key] = _absolute_path(value) if is_tokenizer_path(value) else value
        elif key == "train.init_from" and value.startswith("hf:"):
            out[key] = "hf:" + _absolute_path(value[len("hf:"):])
        else:
            out[key] = _absolute_path(value)
    return out


def write_config(workdir: str, config) -> None:
    """config.json: `config` with its local paths absolute (PATH_KEYS)."""
    tree = json.loads(config.to_json_best_effort())
    given = config_lib.flat(tree)
    for key, value in absolute_paths(given).items():
        if key in PATH_KEYS and value != given[key]:
            group, name = key.split(".")  # PATH_KEYS are group.key
            tree[group][name] = value
    _write_text(path(workdir, CONFIG), json.dumps(tree, indent=2))


def read_config_json(workdir: str) -> dict | None:
    """The run's config.json as a dict with today's model field names (None without it)."""
    file = epath_of(workdir, CONFIG)
    if not file.exists():
        return None
    try:
        stored = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        stored, why = None, f"not JSON: {e}"
    else:
        why = f"a JSON {type(stored).__name__}, not an object"
    if not isinstance(stored, dict):  # (was a traceback from json or from .get)
        raise RunPathError(f"{file}: not a run's config ({why}); move it away, or give "
                           f"another --workdir")
    stored["model"] = rename_old_model_fields(stored.get("task", ""), stored.get("model", {}))
    if stored.get("task") == "gpt":  # (the one model whose block's MLP kind is a config key)
        stored["model"] = fix_old_gated_activation(stored["model"])
    return stored


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The run's config; RunNotFoundError if `workdir` holds no run."""
    stored = read_config_json(workdir)
    if stored is None:
        raise RunNotFoundError(f"{path(workdir, CONFIG)} does not exist: {workdir!r} is not a "
                               f"run directory written by attention_jax.main (--workdir=DIR "
                               f"writes it)")
    # Keys added since the run was saved (eval.sample_top_p, say) at their defaults: its
    # config then validates and takes an override of them (validate read them as absent).
    return ml_collections.ConfigDict(config_lib.with_base_keys(stored))


# ================================================================================== metrics
def _import_tensorboardx():
    """tensorboardX, imported without torch. tensorboardX imports torch wherever it is
    installed, only to accept torch tensors, which a run never hands it: 1.2 of the
    import's 1.5 s on the 2-core CPU host, at every run's start. With torch already
    imported (a notebook that uses it) it is imported as usual."""
    import importlib
    if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which it expects
        try:
            return importlib.import_module("tensorboardX")
        finally:
            del sys.modules["torch"]
    return importlib.import_module("tensorboardX")


def _tensorboard_writer_class():
    """tensorboardX's SummaryWriter (_import_tensorboardx)."""
    return _import_tensorboardx().SummaryWriter


def _last_event_time(event_file) -> float | None:
    """The wall time of the last metric record (a summary event) in a TensorBoard events
    file (an epath), read from its records (TFRecord framing: a length, its CRC, the Event
    proto, its CRC); None where it holds none. A start's own file_version event is not
    one: a later start that wrote nothing would otherwise move the run's end."""
    import struct
    _import_tensorboardx()
    from tensorboardX.proto import event_pb2
    data, at, last = event_file.read_bytes(), 0, None
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        record = data[at + 12:at + 12 + length]
        at += 12 + length + 4
        if len(record) < length:
            break  # a record cut short (a run killed as it wrote one)
        event = event_pb2.Event()
        try:
            event.ParseFromString(record)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError): a damaged record
            break
        if event.HasField("summary"):  # a record's: every start writes a file_version event
            last = max(last or 0.0, event.wall_time)
    return last


class MetricWriter:
    """Metrics as JSONL (`metrics.jsonl`, one object per record) and TensorBoard event
    files (`tensorboard/`), written by process 0 only.

    In an object store (no append) metrics.jsonl is rewritten whole at each record, from
    the lines this writer holds: a reader always sees a complete file, as with a local
    append, and the cost is one upload of the file per logged record (writes happen only
    at log and eval steps; 1000 records of ~200 bytes is a 200 KB object). Numbered part
    files would upload less but make every reader list and merge them. TensorBoard's
    event file is written into a local temporary folder and copied up at each record
    in the same way. (tensorboardX's own gs:// writer uploads again when it is garbage
    collected, after close, and retries for two minutes if the bucket is gone by then.)"""

    def __init__(self, workdir: str, resume_step: int | None = None):
        """resume_step: training (re)starts after this step, so records of later steps
        (written before a crash, or before a fall back to an older checkpoint) are
        superseded: dropped from metrics.jsonl and purged from TensorBoard."""
        self.enabled = jax.process_index() == 0
        if self.enabled:
            SummaryWriter = _tensorboard_writer_class()
            file = path(workdir, METRICS)
            if resume_step is not None:
                drop_records_after(file, resume_step)
            self._remote, self._workdir, self._unreachable = is_remote(workdir), workdir, False
            tb_dir = path(workdir, TENSORBOARD)
            if resume_step == 0:  # (an object store's too: wall_seconds reads them all)
                _set_aside_earlier_events(tb_dir)
            if self._remote:
                self._file = file
                self._lines = [json.dumps(r) + "\n" for r in read_records(file)]
                self._tb_remote, self._tb_local = tb_dir, tempfile.mkdtemp(prefix="attention_jax_tb_")
                self._tb_sizes: dict[str, int] = {}
                tb_dir = self._tb_local
            else:
                self._jsonl = open(file, "a")
            self._tb = SummaryWriter(tb_dir,
                                     purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, **{k: float(v) for k, v in metrics.items()}}
        if self._remote:
            self._lines.append(json.dumps(record) + "\n")
            self._upload(METRICS, lambda: _write_text(self._file, "".join(self._lines)))
        else:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        for k, v in metrics.items():
            self._tb.add_scalar(f"{split}/{k}", float(v), step)
        self._tb.flush()
        if self._remote:
            self._copy_tensorboard()

    def _copy_tensorboard(self) -> None:
        """The local event files that grew since the last copy, uploaded whole."""
        for name in os.listdir(self._tb_local):
            local = os.path.join(self._tb_local, name)
            size = os.path.getsize(local)
            if self._tb_sizes.get(name) != size:
                self._upload(f"{TENSORBOARD}/{name}", lambda: epath_of(
                    self._tb_remote, name).write_bytes(open(local, "rb").read()))
                self._tb_sizes[name] = size

    def _upload(self, what: str, write: Callable[[], Any]) -> None:
        """write() into the object store. A store that cannot be reached (gone, refusing)
        after gcsfs's retries is one line naming the workdir and what is kept, in place
        of gcsfs's traceback when it gives up."""
        try:
            with quiet.drop_gcsfs():
                write()
        except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types
            self._unreachable = True  # close() does not wait through the retries again
            raise RunPathError(
                f"writing {what} to --workdir={self._workdir} failed: {_first_line(e)}; the "
                f"run stops here, what it saved is kept, and the same command resumes from "
                f"its last checkpoint once the store can be reached") from e
        self._unreachable = False

    def close(self, upload: bool = True, failing: bool = False) -> None:
        """In an object store the event files' last records are uploaded here (unless
        `upload` is False, or an upload has failed: the store is gone, and another round
        of gcsfs's retries would only repeat the error). failing: the run is ending by
        another error, which an upload's failure is said beside, not raised over."""
        if self.enabled:
            self._tb.close()
            if self._remote:
                try:
                    if upload and not self._unreachable:
                        self._copy_tensorboard()
                except RunPathError as e:
                    if not failing:
                        raise
                    logging.getLogger(__name__).warning("%s", e)
                finally:
                    shutil.rmtree(self._tb_local, ignore_errors=True)
            else:
                self._jsonl.close()


def read_records(file: str) -> list[dict]:
    """The records of a JSONL file, in order ([] without the file). A line cut short by
    a kill is skipped."""
    file = epath_of(file)
    if not file.exists():
        return []
    records = []
    for line in file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn or blank line
    return records


def drop_records_after(file: str, step: int) -> None:
    """Rewrites the JSONL `file` without the records of steps after `step` (and without
    torn lines): written to a temporary file and renamed over the old one, so a crash
    leaves one or the other, never half of each (`_write_text`)."""
    if not exists(file):
        return
    records = read_records(file)
    keep = [r for r in records if r.get("step", 0) <= step]
    text = epath_of(file).read_text()
    if len(keep) == sum(1 for line in text.splitlines() if line.strip()):
        return
    _write_text(file, "".join(json.dumps(r) + "\n" for r in keep))


def append_eval_record(workdir: str, record: dict) -> str | None:
    """Appends `record` (with the time) to workdir/evals.jsonl; its path, or None when
    the workdir is read-only (a reader writes nothing it was not asked to). Process 0
    writes it: every process of a multi-process --mode=eval appended the same record (N
    copies of each evaluation; in an object store each rewrote the object, racing)."""
    import datetime
    if not writable(workdir):
        return None
    file = path(workdir, EVALS)
    if jax.process_index() != 0:
        return file
    stamped = {**record, "time": datetime.datetime.now().isoformat(timespec="seconds")}
    if is_remote(workdir):  # no append: the object rewritten with one more line
        old = epath_of(file).read_text() if exists(file) else ""
        _write_text(file, old + json.dumps(stamped) + "\n")
    else:
        with open(file, "a") as f:
            f.write(json.dumps(stamped) + "\n")
    return file


def read_metrics(workdir: str) -> list[dict]:
    """The records of metrics.jsonl, one per (step, split). The trainer rewrites the file
    on resume (drop_records_after); a file written before that (or an evaluation by an
    older --mode=eval, which appended here) can hold a step twice: the later record
    supersedes the earlier, in the earlier one's place."""
    file = path(workdir, METRICS)
    if not exists(file):
        raise RunNotFoundError(f"{file}: no metrics (is {workdir} a training run's workdir?)")
    records: dict[tuple, dict] = {}
    for r in read_records(file):
        key = (r.get("step"), r.get("split"))
        if key in records and r.get("split") == "train":
            # A resumed run's record: the ones after it were superseded too.
            records = {k: v for k, v in records.items() if k[0] < r.get("step")}
        records[key] = r
    return list(records.values())


def eval_records(workdir: str) -> list[dict]:
    """The run's evaluations, by step: the eval records of metrics.jsonl, then those of
    evals.jsonl (--mode=eval) on the run's own data (a record of other data, its "data"
    key, is not the run's) at later steps: all of them where training evaluated nothing
    (eval.every=-1); else those up to the run's last training step, e.g. the final
    evaluation of a run killed during its own (they were read only where training had
    none, so such a run stayed "last evaluated at" its earlier step after --mode=eval at
    its end, as check_comparable's error advises)."""
    records = read_metrics(workdir)
    found = [r for r in records if r.get("split") == "eval"]
    if exists(workdir, EVALS):
        after = max((r["step"] for r in found), default=-1)
        # (records past the last training step: an evaluation of a checkpoint that a
        # resume from an older one has since superseded)
        upto = max((r["step"] for r in records if r.get("split") == "train"), default=None)
        by_step = {r["step"]: {**{k: v for k, v in r.items() if k != "time"}, "split": "eval"}
                   for r in read_records(path(workdir, EVALS))
                   if "data" not in r and "step" in r and r["step"] > after
                   and (not found or upto is None or r["step"] <= upto)}
        found = found + [by_step[k] for k in sorted(by_step)]  # the latest of a step's records
    return found


def last_records(workdir: str) -> dict[str, dict]:
    """The last 'train' and 'eval' records of metrics.jsonl (with their step)."""
    found = {"train": {}, "eval": {}}
    for record in read_records(path(workdir, METRICS)):
        if record.get("split") in found:
            found[record.pop("split")] = record
    return found


def finished(workdir: str, steps: int, evaluates: bool = True) -> bool:
    """Whether the run trained all `steps` and wrote its final evaluation (a run that
    `evaluates` not, eval.every=-1: its final training record; it never counted as
    finished, and each later sweep call retrained nothing and overwrote its record)."""
    split = "eval" if evaluates else "train"
    return any(r.get("split") == split and r.get("step") == steps
               for r in read_records(path(workdir, METRICS)))


def _set_aside_earlier_events(tb_dir: str) -> None:
    """A run starting from step 0 in a folder that held an earlier one (its checkpoints
    moved away, or killed before its first save): that run's TensorBoard files go into a
    folder of their own (TensorBoard shows it as another run), so that the events files
    left at the top, whose names carry their start times, are this run's (wall_seconds)."""
    if is_remote(tb_dir):
        folder = epath_of(tb_dir)
        earlier = sorted(str(f) for f in folder.glob("events.out.tfevents.*")) \
            if folder.exists() else []
    else:
        earlier = sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")))
    if earlier:
        stamp = os.path.basename(earlier[0]).split(".")[3]
        aside = os.path.join(tb_dir, f"earlier_run_{stamp}")
        if is_remote(tb_dir):  # no rename: each object copied, then deleted
            for f in earlier:
                epath_of(aside, os.path.basename(f)).write_bytes(epath_of(f).read_bytes())
                epath_of(f).unlink()
        else:
            os.makedirs(aside, exist_ok=True)
            for f in earlier:
                os.replace(f, os.path.join(aside, os.path.basename(f)))
        print(f"note: {tb_dir} held an earlier run's TensorBoard files and this run starts at "
              f"step 0: they are in {aside} now (TensorBoard shows them as another run)",
              flush=True)


def wall_seconds(workdir: str) -> float:
    """From the run's first start to its last metric record (the final eval):
    compilation, training and evaluation included, as a user waits for it. A resumed
    run's span includes the pause.

    The times are those written inside TensorBoard's events files, which a copy keeps
    (cp, scp and gsutil give the files new modification times): the first start's is in
    the name TensorBoard gave the first events file (events.out.tfevents.<unix
    time>.<host>), which a resume keeps, the last record's is its event's wall time.
    Without events files (a run of before, or one copied without them), the files'
    times: metrics.jsonl's last change, and config.json's, which every start rewrites.
    Never negative (a last start that failed before its first record)."""
    if is_remote(workdir):  # the objects' times (whole seconds through epath)
        end, start = (float(epath_of(workdir, n).stat().mtime) for n in (METRICS, CONFIG))
    else:
        end, start = (os.path.getmtime(path(workdir, n)) for n in (METRICS, CONFIG))
    stamps, ends = [], []
    for event_file in epath_of(workdir, TENSORBOARD).glob("events.out.tfevents.*"):
        stamp = event_file.name.split(".")[3]
        if stamp.isdigit():
            stamps.append(float(stamp))
            ends.append(_last_event_time(event_file))
    ends = [t for t in ends if t is not None]
    if stamps and ends:
        start, end = min(stamps), max(ends)
    elif stamps:
        start = min(start, min(stamps))
    return round(max(0.0, end - start), 1)


# ============================================================================ resume guard
# Keys a resumed run may change without resume_changed=True: how long to train, how often
# to log, evaluate and checkpoint, where the data lives, on which devices (checkpoints
# restore onto any mesh), and the attention, loss and norm kernels; none changes what a
# step computes beyond the order of its roundings.
# Keys ending in "." cover their whole group.
RESUME_SAFE_KEYS = ("train.steps", "train.log_every", "train.progress", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.async_checkpoint", "train.data_workers",
                    "train.prefetch",
                    "train.nonfinite", "train.inject_nan_at", "train.init_from",
                    "train.checkpoint_on_damage", "train.loss_chunk_size", "train.loss_kernel",
                    "data.data_dir", "data.cache_dir", "model.implementation", "model.ring_inner",
                    "model.remat_policy",
                    "model.norm_kernel",
                    "mesh.", "eval.")


def config_changes(config, workdir: str) -> dict[str, tuple[Any, Any]]:
    """{key: (value in workdir/config.json, value in `config`)} for every key that
    differs ({} without a config.json). A key one side lacks counts as its default."""
    stored = read_config_json(workdir)
    if stored is None:
        return {}
    old = absolute_paths(config_lib.flat(stored))
    new = absolute_paths(config_lib.flat(json.loads(config.to_json_best_effort())))
    base = {**config_lib.flat(json.loads(config_lib.base_config().to_json_best_effort())),
            **ADDED_KEYS}
    missing = "(absent)"
    changes = {}
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, base.get(key, missing)), new.get(key, base.get(key, missing))
        if before != after:
            changes[key] = (before, after)
    return changes


def training_changes(config, workdir: str) -> str:
    """The training-relevant keys where `config` differs from the run's config.json, as
    `key: old -> new, ...` ("" when none: only RESUME_SAFE_KEYS, or nothing, differ)."""
    changes = config_changes(config, workdir)
    relevant = _training_keys(changes, config)
    return _show(changes, relevant) if relevant else ""


def _schedules(changes: dict, config) -> tuple[Any, Any]:
    """The learning-rate schedule's length (optim.decay_steps, or train.steps where it is
    0: train.make_optimizer) the run trained with and the one `config` gives."""
    # .get: a reader's config.json from before a key (config_changes counts it default).
    steps = changes.get("train.steps") or (config.train.get("steps"),) * 2
    decay = changes.get("optim.decay_steps") or (config.optim.get("decay_steps", 0),) * 2
    return decay[0] or steps[0], decay[1] or steps[1]


def _same_schedule(key: str, changes: dict, config) -> bool:
    """Whether `key` is an optim.decay_steps that spells the schedule the run trained
    with: 0 (train.steps' length) set to that length, as the note of an extended run
    advises (--config.optim.decay_steps=<the old train.steps>), or the reverse. The step
    computes the same learning rates, so the change is as safe as train.steps'."""
    if key != "optim.decay_steps":
        return False
    old, new = _schedules(changes, config)
    return old == new


def _unsafe_keys(changes: dict, config, safe) -> list[str]:
    """The keys of `changes` that may not change unasked: not `safe` (RESUME_SAFE_KEYS for
    a resume, READ_SAFE_KEYS for a reader), nor an optim.decay_steps that keeps the
    schedule."""
    return [k for k in changes
            if not _safe(k, safe) and not _same_schedule(k, changes, config)]


def _training_keys(changes: dict, config) -> list[str]:
    return [k for k in _unsafe_keys(changes, config, RESUME_SAFE_KEYS)
            if not _unread_source_key(k, changes, config)]


def _unread_source_key(key: str, changes: dict, config) -> bool:
    """Whether `key` is one of the user's data's keys (data.eval_fraction, ...) and the run
    read a dataset before and after: it did nothing, so its change changes nothing."""
    if key.removeprefix("data.") not in config_lib.SOURCE_KEY_DEFAULTS:
        return False
    names = changes.get("data.name") or (config.get("data", {}).get("name"),) * 2
    return not any(n in config_lib.USER_DATA_SOURCES for n in names)


def _safe(key: str, keys) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys)


def refuse_config_change(config, workdir: str, step: int, changes: dict | None = None) -> None:
    """A ConfigError listing `key: old -> new` and the ways through where `config`
    changes a training-relevant key of the run's config.json: resuming `step` with it
    needs --resume_changed. Cheap: a run asks before it builds its data."""
    changes = config_changes(config, workdir) if changes is None else changes
    relevant = _training_keys(changes, config)
    if not relevant:
        return
    # A key the config now leaves None (a variant's value) that the run set: giving
    # the run's value resumes it (the gpt config's sizes under :variant=, before they
    # followed the variant).
    unset = [k for k in relevant if changes[k][1] is None and changes[k][0] is not None]
    keep = (f" To keep the run's {', '.join(unset)}: " + " ".join(
        f"--config.{k}={json.dumps(changes[k][0])}" for k in unset) + "."
            if unset else "")
    raise ConfigError(
        f"{workdir} holds a run at step {step} trained with another config: "
        f"{_show(changes, relevant)}.{keep} To resume it with the new values anyway pass "
        f"--resume_changed (train_and_evaluate(..., resume_changed=True)); to train "
        f"from scratch use a new --workdir.")


def check_config_change(config, workdir: str, step: int | None, resume_changed: bool) -> str:
    """Before resuming the checkpoint at `step`: compares `config` with the run's
    config.json. Changes only of RESUME_SAFE_KEYS (e.g. train.steps, to extend a run)
    give a note (returned, "with config changes: ...", for the caller to print once it
    knows the step it resumed; "" when nothing changed); others raise a ConfigError
    listing `key: old -> new` and the ways through, unless `resume_changed` (then the old
    file is to be kept: keep_replaced_config, once every process has read it). Reads
    config.json only: every process calls it."""
    if step is None:  # Nothing to resume: the workdir's config.json is replaced, and said.
        changes = config_changes(config, workdir)
        relevant = _training_keys(changes, config)
        if relevant and jax.process_index() == 0:
            print(f"note: {path(workdir, CONFIG)} held another config ("
                  f"{_show(changes, relevant)}) and no checkpoint: this "
                  f"run starts from scratch and replaces it", file=sys.stderr, flush=True)
        return ""
    changes = config_changes(config, workdir)
    if not changes:
        return ""
    if not resume_changed:
        refuse_config_change(config, workdir, step, changes)
    note = f"with config changes: {_show(changes, list(changes))}"
    old_schedule, new_schedule = _schedules(changes, config)
    if "train.steps" in changes and not config.optim.get("decay_steps", 0) \
            and old_schedule != new_schedule:
        # Advice that works as printed. This resume already trains on the new schedule
        # and rewrites config.json with it, so going back to the old one afterwards is a
        # change of schedule (--resume_changed); given with the extension itself, the
        # old length is no change (_same_schedule) and needs no flag.
        note += (f" (the learning-rate schedule now spans {new_schedule} steps, not "
                 f"{old_schedule}; to keep the old one, stop this run and run it again with "
                 f"--config.optim.decay_steps={old_schedule} --resume_changed, or next time "
                 f"extend with --config.optim.decay_steps={old_schedule} beside "
                 f"--config.train.steps)")
    return note


def keep_replaced_config(config, workdir: str, step: int | None) -> str | None:
    """Before process 0 writes `config` over the run's config.json, resuming `step` with
    training-relevant changes (--resume_changed; check_config_change let them through):
    moves the old file to config_until_step_<step>.json and returns that path; None when
    there is nothing to keep. Called after every process has read config.json: done in
    check_config_change, the move came while another process was still to read it,
    which then found no config.json (or none at the moment it looked)."""
    if step is None or not training_changes(config, workdir):
        return None
    # Never over another one: an earlier --resume_changed from this step (stopped
    # before it saved one) or a run before the checkpoints were moved away kept it.
    old, n = path(workdir, f"config_until_step_{step}.json"), 0
    while epath_of(old).exists():
        n += 1
        old = path(workdir, f"config_until_step_{step}.{n}.json")
    epath_of(workdir, CONFIG).replace(old)
    return old


def _show(changes: dict, keys) -> str:
    return ", ".join(f"{k}: {json.dumps(changes[k][0])} -> {json.dumps(changes[k][1])}"
                     for k in keys)


# ================================================================================= readers
# Keys a reader of a run (--mode=eval|sample|embed, runs.open_run, the tools) may set
# differently from the run's config.json: what a resume may change, and what only the
# reading itself uses (precision, sampling seed, batch sizes). A model, data or optimizer
# key that differs would evaluate another model or another split than the run's.
READ_SAFE_KEYS = RESUME_SAFE_KEYS + ("train.compute_dtype", "train.seed", "train.batch_size",
                                     "optim.grad_accum",
                                     # Where the data is: a test set of one's own, or the
                                     # images moved. The run's tokenizer and class list are
                                     # its own files, checked against the data (tasks/).
                                     "data.root", "data.eval_root", "data.files",
                                     "data.eval_files", "data.cache_dir",
                                     # Another split of the run's own dataset to evaluate
                                     # (--mode=eval on "test"): the trained model, its
                                     # dataset and training split stay the run's, and the
                                     # eval record names the split (main.evaluate_checkpoint).
                                     "data.eval_split")


_READ_SAFE_WORDS = ("eval.*, mesh.*, train.compute_dtype, train.seed, batch sizes, "
                    "model.implementation, data.eval_split (another split of the run's "
                    "dataset to evaluate), where the data is (data.data_dir, root, eval_root, "
                    "files, eval_files, cache_dir)")


def _unsafe_for_readers(changes: dict, config) -> list[str]:
    return _unsafe_keys(changes, config, READ_SAFE_KEYS)


def check_reader_config(config, workdir: str, who: str = "a reader of a run") -> dict:
    """{key: (run's value, given value)} of the READ_SAFE_KEYS where `config` differs from
    the run's config.json; a ConfigError naming the others (and the run's values)."""
    changes = config_changes(config, workdir)
    unsafe = _unsafe_for_readers(changes, config)
    if unsafe:
        raise ConfigError(
            f"{who} uses the run's own config ({path(workdir, CONFIG)}), and the keys given "
            f"differ from it: {_show(changes, unsafe)}; these cannot change after training "
            f"(valid overrides: {_READ_SAFE_WORDS})")
    return changes


def reader_overrides_error(config, workdir: str, mismatch: str) -> ConfigError:
    """The error for overrides of a run's config (runs.open_run's) under which its
    checkpoint no longer restores: the keys past the read-safe ones, and `mismatch`, the
    first array whose shape they changed."""
    changes = config_changes(config, workdir)
    unsafe = _unsafe_for_readers(changes, config)
    return ConfigError(
        f"the overrides {_show(changes, unsafe) or '(none past the read-safe keys)'} change "
        f"the model the run trained, so its checkpoint does not restore ({mismatch}); "
        f"valid overrides: {_READ_SAFE_WORDS}, and keys that leave the parameters' "
        f"shapes as they are")


# ==================================================================================== lock
LOCK = "lock.json"


class WorkdirLockedError(UserError, RuntimeError):
    """Another live run writes into this workdir."""


class WriterLock:
    """One writer per workdir: the training run holds an OS lock (fcntl.lockf, which
    works on local and NFS paths) on workdir/lock.json, whose text names the holder (host,
    pid, start). The lock dies with its process, however it ends (kill -9 included), so a
    crashed run's lock is stale by construction and the next run simply takes it. Only
    process 0 of a multi-host run holds it; readers (eval, sample, the tools) never take
    it. An object store (gs://, s3://) has no such lock, and one that dies with its
    process would need a conditional create plus a heartbeat: there the run says that a
    second writer would not be detected, as on a local filesystem without locks."""

    def __init__(self, workdir: str):
        self.file = path(workdir, LOCK)
        self._remote = is_remote(workdir)
        self._fd = None

    def acquire(self) -> "WriterLock":
        import datetime
        import fcntl
        import socket
        if self._remote:
            print(f"warning: {workdir_of(self.file)} is in an object store, which has no "
                  f"locks: a second run writing this workdir would not be detected",
                  file=sys.stderr)
            return self
        fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # not held: locks unsupported
                os.close(fd)
                print(f"warning: {self.file} cannot be locked on this filesystem "
                      f"({e.strerror}): a second run writing this workdir would not be "
                      f"detected", file=sys.stderr)
                return self
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirLockedError(
                f"{os.path.dirname(self.file) or '.'} is being written by another run "
                f"({holder}); wait for it to finish or stop it (Ctrl-C saves a checkpoint), "
                f"or use another --workdir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({
            "host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            import fcntl
            fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def workdir_of(file: str) -> str:
    return os.path.dirname(str(file)) or "."


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}"
    except (ValueError, KeyError, OSError):
        return "its lock file names no holder"


# ============================================================================ path checks
def prepare_for_writing(workdir: str) -> bool:
    """Creates `workdir` for a training run (True if it had to), or raises one line: it is
    a file, or it (or a file in it) cannot be written. An object-store URL needs its
    bucket to exist (nothing is created: folders there are only name prefixes)."""
    if is_remote(workdir):
        _check_remote(workdir, "a directory (new, or a run to resume)")
        _check_run_config(workdir)
        return False
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise RunPathError(f"--workdir={workdir} is a file; valid: a directory (new, or a run "
                           f"to resume)")
    created = not os.path.exists(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise RunPathError(f"--workdir={workdir} cannot be created: {e.strerror}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise RunPathError(f"--workdir={workdir} is not writable; valid: a directory this user "
                           f"may write (training writes config.json, metrics and checkpoints)")
    for name in (CONFIG, METRICS, LOCK):
        file = path(workdir, name)
        if os.path.exists(file) and not os.access(file, os.W_OK):
            raise RunPathError(f"{file} is not writable; training rewrites it")
    _check_folders(workdir, (CHECKPOINTS, TENSORBOARD, TOKENIZER))
    _check_run_config(workdir)
    return created


def _check_run_config(workdir: str) -> None:
    """A config.json in the workdir is a run's, or one line before anything is written
    there (read_config_json's for one that is no JSON object)."""
    stored = read_config_json(workdir)
    if stored is not None and "task" not in stored:  # replaced by the run's, it was lost
        raise RunPathError(f"{path(workdir, CONFIG)} is not a run's config (no 'task': a "
                           f"Hugging Face model's, or another tool's?), and training would "
                           f"replace it; move it away, or give another --workdir")


def _check_folders(workdir: str, names) -> None:
    """The run's folders among `names` that are files: one line, not NotADirectoryError's
    traceback from orbax or from the step listing."""
    for name in names:
        folder = path(workdir, name)
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise RunPathError(f"{folder} is a file; valid: a folder (the run's {name}/), or "
                               f"no entry of that name")


def other_entries(workdir: str) -> list[str]:
    """What a local folder that is not a run yet (no config.json) holds besides what may
    precede a first run there (the tokenizer `prepare` writes, the lock): [] for a new or
    empty folder, a run, or an object-store workdir (not listed: it costs a request)."""
    if is_remote(workdir) or not os.path.isdir(workdir) or os.path.exists(path(workdir, CONFIG)):
        return []
    return sorted(n for n in os.listdir(workdir)  # hidden ones (.DS_Store) are no one's run
                  if n not in (LOCK, TOKENIZER) and not n.startswith("."))


def check_readable(workdir: str) -> None:
    """A readable run directory, or one line saying what is wrong (readers)."""
    if is_remote(workdir):
        _check_remote(workdir, "a run directory")
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise RunPathError(f"--workdir={workdir} is a file; valid: a run directory")
    if os.path.isdir(workdir) and not os.access(workdir, os.R_OK | os.X_OK):
        raise RunPathError(f"--workdir={workdir} is not readable by this user")
    file = path(workdir, CONFIG)
    if os.path.exists(file) and not os.access(file, os.R_OK):
        raise RunPathError(f"{file} is not readable by this user")
    _check_folders(workdir, (CHECKPOINTS, TOKENIZER))


def _check_remote(workdir: str, valid: str) -> None:
    """The bucket of an object-store workdir exists and `workdir` is not an object; one
    line otherwise (a missing bucket, credentials, an unreachable endpoint). An s3://
    workdir stops here: its checkpoints could not be written (checkpoint.check_supported)."""
    if not str(workdir).startswith(CHECKPOINT_URLS):
        raise RunPathError(f"--workdir={workdir}: orbax writes checkpoints only to gs:// "
                           f"buckets and local (or mounted) paths; valid: gs://bucket/path, a "
                           f"local path, or the bucket mounted as a folder (e.g. mountpoint-s3)")
    fresh_listings()
    scheme, rest = str(workdir).split("://", 1)
    bucket = epath.Path(f"{scheme}://{rest.split('/', 1)[0]}")
    try:
        with quiet.drop_gcsfs():  # the one line below says what went wrong
            found = bucket.exists()
            is_object = found and epath.Path(workdir).is_file()
        if not found:
            raise RunPathError(f"--workdir={workdir}: bucket {bucket} does not exist (or this "
                               f"account may not see it); create it first")
        if is_object:
            raise RunPathError(f"--workdir={workdir} is an object, not a folder; valid: {valid}")
    except RunPathError:
        raise
    except Exception as e:  # noqa: BLE001 - fsspec backends raise their own types
        raise RunPathError(f"--workdir={workdir} cannot be reached: {_first_line(e)} (the "
                           f"endpoint and credentials come from the environment: README, "
                           f"'Workdirs in object storage')") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def writable(workdir: str) -> bool:
    if is_remote(workdir):
        return True  # no cheap check: a write that is refused raises
    return os.path.isdir(workdir) and os.access(workdir, os.W_OK | os.X_OK)


def check_output_path(out: str, flag: str = "--out") -> None:
    """A tool's output path (a file, or a prefix of files) whose folder exists or can be
    made, and can be written; else one line naming the flag."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise RunPathError(f"{flag}={out}: {folder} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise RunPathError(f"{flag}={out}: its folder cannot be created ({e.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RunPathError(f"{flag}={out}: {folder} is not writable")
    if os.path.isdir(out):
        raise RunPathError(f"{flag}={out} is a folder; valid: a file path (or a prefix of the "
                           f"files written)")


def check_output_folder(out: str, flag: str = "--out") -> None:
    """A tool's output folder (made now if absent) that can be written; else one line
    naming the flag (check_output_path's counterpart for the tools whose --out is a folder)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunPathError(f"{flag}={out} is a file; valid: a folder (made if absent)")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise RunPathError(f"{flag}={out}: the folder cannot be made ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunPathError(f"{flag}={out} is not writable")


class RunPathError(UserError, OSError):
    """A workdir (or a file in it) that is not what it must be: a file, unwritable..."""
