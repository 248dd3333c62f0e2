"""grain loaders whose position is a pure function of (seed, global example index).

The order of examples is defined once, for the whole job, as a *global stream*:

    stream[g] = transform(source[perm_e(g mod N)], rng(seed, g)),   e = g // N

with `perm_e` a seeded permutation per epoch (grain's index shuffle: O(1) memory, so
it scales to catalogue datasets; seeded by order_seed(seed) + e, see there) and
`rng(seed, g)` the random stream of augmentation
and masking. Global step s is the slice stream[s*G : (s+1)*G] (G the global batch), and
process p of P takes the p-th contiguous block of B = G/P examples from it.

Because nothing depends on P except which block a host reads, the loader's state is a
single integer, the number of stream examples consumed (`next_index`). Saving it in a
checkpoint and restoring it continues exactly, on the same or on a different number of
hosts, and with any number of grain worker processes (workers prefetch ahead, but the
state counts batches the caller has actually received).

A source that reads many records at once (`read_rows(indices)` -> a dict of stacked
arrays, e.g. `token_cache.TokenRows`) is read a whole batch per call (`batched`): grain
then moves integers only, the global stream indices of each batch, and the records are
gathered in one call and transformed together (`transform.apply_batch(batch, rngs)`
when the transform has it, else example by example). The order, the per-example random
streams and the state are those of the per-example path, exactly (tests compare them):
record perm_e(g mod N) is computed as grain's shuffle computes it (its index_shuffle,
seeded by order_seed(seed) + epoch), and example g's rng is grain's random_map rng for index g
(Philox keyed by the seed, counter [0, 0, 0, g]).

A finite stream whose length is not a multiple of G ends in a partial global batch. For
training it is dropped (every process must take the same number of steps). Evaluation
must see every example exactly once, so `pad_remainder=True` pads it instead: the final
batch is filled up to G with copies of real examples, and every example carries
`example_weight` (EXAMPLE_WEIGHT: 1.0, or 0.0 on a padding copy) for the loss to mask
with. Padding to the full G keeps the batch splittable over the data-parallel devices
and keeps one compiled eval step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
from grain.experimental import index_shuffle
from absl import flags
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attention_jax.errors import UserError

Batch = Any  # A pytree (usually a dict) of numpy arrays with a leading batch axis.
Transform = Callable[[Any, np.random.Generator], Any]

# The per-example field of a `pad_remainder` loader's batches: 1.0 on the stream's own
# examples, 0.0 on the copies that pad the final global batch (float32 [B]).
EXAMPLE_WEIGHT = 'example_weight'
# A field a source's example may carry: True where it was read in place of one that could
# not be (an image file that does not decode: data/images.py). Under pad_remainder it is
# weighted 0 like a padding copy, so an evaluation counts and scores only what it read;
# the field itself is dropped.
STAND_IN = 'stand_in'


# How a seed orders the epochs (LoaderState.order): 1, each seed's epochs from their own
# point of a Weyl sequence (order_seed); 0, the seed itself, as before 2026-11-28, kept
# for the states saved then so that their runs resume in the order they began.
ORDER = 1


def order_seed(seed: int, order: int = ORDER) -> int:
    """The base of the per-epoch shuffle seeds, order_seed + e. grain reseeds its shuffle
    with seed + epoch, so seed s + 1 saw seed s's epochs one epoch late (a multi-epoch
    sweep over seeds 0, 1, 2 shared its data order). Bases a golden-ratio step of 2**32
    apart keep the seeds of a sweep millions of epochs from each other's."""
    if order == 0:
        return seed
    return (seed * 0x9E3779B1 + 0x7F4A7C15) % 2**32


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Everything needed to continue a loader exactly. JSON-able via `to_dict`.

    `seed` and `num_records` are stored to refuse a restore into a different data
    order (another seed, another dataset), which would silently repeat or skip data;
    `source`, the records' identity where the source has one (a token cache's
    `fingerprint`, a tfds split's `tfds_id`), also refuses the same number of other
    records (an edited corpus, a tfds dataset rebuilt with other examples). `order`:
    how the seed orders the epochs (ORDER; 0 in a state saved before there was one).
    """
    next_index: int
    seed: int
    num_records: int
    source: str = ''  # '' where unknown (a source without one, a state saved before)
    order: int = ORDER

    def to_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_any(cls, state: LoaderState | Mapping[str, Any] | bytes | str) -> LoaderState:
        if isinstance(state, LoaderState):
            return state
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        return cls(**{k: int(state[k]) for k in ('next_index', 'seed', 'num_records')},
                   source=str(state.get('source', '')), order=int(state.get('order', 0)))

    def moved_to(self, num_records: int, seed: int, source: str = '') -> LoaderState:
        """This position in another data order (more or fewer records, another seed, other
        records): the same point in epochs, in the new order."""
        return LoaderState(round(self.next_index * num_records / self.num_records), seed,
                           num_records, source, self.order)


# Records of a tfds split whose decoded contents go into its identity: all of a split up
# to this size, else this many spread over it (a few milliseconds of reads and decoding
# at a loader's first save, even for images).
TFDS_ID_RECORDS = 256
TFDS_ID_SAMPLE = 64


def source_id(source) -> str:
    """A source's records' identity where it has one, else '': a `fingerprint` (a token
    cache's, TokenRows; a Subset's whose records were all read, e.g. a user's labelled
    texts), a tfds split's `tfds_id`, a Subset's of the records it picks. Independent of
    where the data lives (data.data_dir may move)."""
    fingerprint = getattr(source, 'fingerprint', '')
    if fingerprint:
        return str(fingerprint)
    inner, indices = getattr(source, 'source', None), getattr(source, 'indices', None)
    if inner is not None and indices is None and hasattr(source, 'indices'):
        return source_id(inner)  # a sources.Subset of all the records
    if inner is not None and indices is not None:  # sources.Subset (train_fraction)
        of = source_id(inner)
        picked = hashlib.sha256(np.asarray(indices, np.int64).tobytes()).hexdigest()[:8]
        return f'{of}, records {picked}' if of else ''
    if getattr(source, 'dataset_info', None) is not None and hasattr(source, 'split'):
        return tfds_id(source)
    return ''


def tfds_id(source) -> str:
    """The identity of a tfds split's records (tfds' ArrayRecordDataSource): its dataset,
    version and split, and a digest of the decoded contents of up to TFDS_ID_RECORDS
    records (TFDS_ID_SAMPLE of a larger split, spread over it). A dataset rebuilt in place
    with other examples of the same count, or another copy under another data.data_dir,
    differs; the same dataset copied elsewhere, or prepared again from the same examples,
    does not. Nothing serialized counts: two builds of the same examples differ in their
    bytes (tfds writes a record's features in no fixed order; an image's PNG or JPEG bytes
    depend on the encoder's version), which would refuse a resume on another machine. An
    edit outside the sampled records of a large split goes unseen."""
    info, split = source.dataset_info, str(source.split)
    n = len(source)
    picked = (range(n) if n <= TFDS_ID_RECORDS else
              sorted(set(np.linspace(0, n - 1, TFDS_ID_SAMPLE).round().astype(int).tolist())))
    digest = hashlib.sha256()
    for i in picked:
        digest_record(digest, source[i])
    return f'tfds {info.full_name} {split}: {n} records, contents {digest.hexdigest()[:12]}'


def digest_record(digest, value) -> None:
    """Feeds a decoded record (dicts of numpy values, bytes, str) into `digest` in a fixed
    order: the same records give the same digest however they were serialized."""
    if isinstance(value, Mapping):
        for key in sorted(value):
            digest.update(str(key).encode() + b'\0')
            digest_record(digest, value[key])
    elif isinstance(value, (bytes, str)):
        data = value.encode() if isinstance(value, str) else value
        digest.update(len(data).to_bytes(8, 'little') + data)
    elif isinstance(value, (list, tuple)):
        digest.update(len(value).to_bytes(8, 'little'))
        for v in value:
            digest_record(digest, v)
    else:
        array = np.asarray(value)
        if array.dtype == object:  # e.g. an array of bytes (a Sequence of Text)
            items = array.ravel().tolist()
            if array.ndim == 0:  # a plain object (None, ...): its text, not itself again
                digest.update(repr(items).encode())
                return
            digest_record(digest, items)
            return
        digest.update(f'{array.dtype.str}{array.shape}'.encode() + array.tobytes())


def exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """Ends this worker process once `parent` is gone: a parent killed outright (SIGKILL,
    the OOM killer) closes nothing, and its workers lived on (grain's loader workers
    holding hundreds of MB each; a prepare's workers waiting for tasks forever)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def watch_parent(parent: int, name: str) -> None:
    """Starts exit_with_parent on a daemon thread of this worker."""
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True, name=name).start()


@dataclasses.dataclass(frozen=True)
class _EndWithParent:
    """grain's worker_init_fn (pickled into each spawned worker): the worker watches the
    process that started it, and leaves Ctrl-C to it. A terminal's Ctrl-C reaches the
    whole process group: each worker died of it with a KeyboardInterrupt traceback (and
    the batches it held in shared memory were reported leaked) while the trainer was
    still finishing its step and saving its checkpoint. The trainer stops its workers
    when it closes the loader, or they end with it (watch_parent). (A Ctrl-C in the
    seconds a worker takes to start, before this runs, still reaches it.)"""
    parent: int

    def __call__(self, worker_index: int, worker_count: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch_parent(self.parent, "loader-parent-watch")


class DataChangedError(UserError, ValueError):
    """A loader state saved for another data order: another seed or number of records."""


class Loader:
    """Batches of one process's share of a seeded, shuffled, repeated random-access source.

    Args:
      source: random-access source (`len`, `[i]`), e.g. from `get_dataset`.
      global_batch_size: G, the batch summed over processes; each process yields G/P.
      seed: shuffle and transform seed.
      shuffle: global shuffle, different every epoch.
      num_epochs: None repeats forever; otherwise the final partial global batch is
        dropped (or padded: `pad_remainder`) so that all processes stop after the same
        number of steps.
      pad_remainder: with a finite `num_epochs`, pad the final partial global batch to G
        with copies of real examples instead of dropping it, and give every example
        (a dict) the field EXAMPLE_WEIGHT, 1.0 or 0.0 on a padding copy: for evaluation
        over exactly the split.
      transform: `fn(record, rng) -> record` applied per example before batching;
        `rng` is a numpy Generator seeded by (seed, global index): deterministic and
        different in every epoch.
      process_index, process_count: this host's place; default jax's.
      worker_count: grain worker processes (0 reads in the calling process).
      read_threads: threads that read batches ahead, in this process or in each worker
        (0: read when asked). One overlaps reading with the training step; grain's
        default of 16 made reading 4x slower on a 2-core host (measured with the token
        cache: 214 vs 51 µs a row), as row reads are Python that holds the GIL, so the
        threads take turns. Decoding that releases the GIL (images) scales with worker
        processes instead (train.data_workers).
      state: a `LoaderState` (or its dict/bytes) to continue from.
      batched: read a batch per call (module docstring); None: when the source has
        `read_rows`. The batches are the same either way.
    """

    def __init__(self, source, *, global_batch_size: int, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None, transform: Transform | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 worker_count: int = 0, state=None, pad_remainder: bool = False,
                 read_threads: int = 1, batched: bool | None = None):
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f'process_index={self.process_index} must be in '
                             f'[0, process_count={self.process_count})')
        if global_batch_size <= 0 or global_batch_size % self.process_count:
            raise ValueError(f'global_batch_size={global_batch_size} must be a positive multiple '
                             f'of process_count={self.process_count}')
        if len(source) == 0:
            raise ValueError('Loader got an empty source')
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f'num_epochs={num_epochs} must be positive or None')
        if pad_remainder and num_epochs is None:
            raise ValueError('pad_remainder=True needs a finite num_epochs (an infinite stream '
                             'has no final batch to pad); valid: num_epochs >= 1')
        if not 0 <= seed < 2**32:
            raise ValueError(f'seed={seed} must be in [0, 2**32)')
        self.source = source
        self.global_batch_size = global_batch_size
        self.batch_size = global_batch_size // self.process_count  # B, per process.
        self.seed = seed
        self.order = ORDER  # a restored state's own (set_state)
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.transform = transform
        self.worker_count = worker_count
        if read_threads < 0:
            raise ValueError(f'read_threads={read_threads} must be >= 0 (0: no read-ahead)')
        self.read_threads = read_threads
        self.pad_remainder = pad_remainder
        has_read_rows = callable(getattr(source, 'read_rows', None))
        if batched and not has_read_rows:
            raise ValueError(f'batched=True needs a source with read_rows(indices); '
                             f'{type(source).__name__} has none')
        self.batched = has_read_rows if batched is None else batched
        self._next_index = 0
        self._source_id: str | None = None
        if state is not None:
            self.set_state(state)

    # --- State -------------------------------------------------------------------------
    @property
    def source_id(self) -> str:
        """source_id(self.source), found once: get_state runs at every batch, and a tfds
        split's identity reads records."""
        if self._source_id is None:
            self._source_id = source_id(self.source)
        return self._source_id

    def get_state(self) -> LoaderState:
        return LoaderState(self._next_index, self.seed, len(self.source), self.source_id,
                           self.order)

    def set_state(self, state) -> None:
        state = LoaderState.from_any(state)
        if (state.seed, state.num_records) != (self.seed, len(self.source)):
            raise DataChangedError(
                f'loader state was saved for seed={state.seed}, num_records={state.num_records}; '
                f'this loader has seed={self.seed}, num_records={len(self.source)}')
        # A state saved without an identity (a source that had none, an older version)
        # resumes unchecked, as before.
        now = self.source_id if state.source else ''
        if state.source and now and state.source != now:
            raise DataChangedError(f'loader state was saved for records {state.source}; this '
                                   f'loader reads {now} (as many, other ones)')
        self._next_index = state.next_index
        self.order = state.order  # a run resumes in the order it began

    @property
    def steps_per_epoch(self) -> int:
        return self._whole_batches(len(self.source))

    def _whole_batches(self, examples: int) -> int:
        """Global batches made of `examples` stream examples: the partial one counts when
        it is padded."""
        if self.pad_remainder:
            return -(-examples // self.global_batch_size)
        return examples // self.global_batch_size

    @property
    def epoch(self) -> float:
        """Fractional epoch of the next batch, for logging."""
        return self._next_index / len(self.source)

    def __len__(self) -> int:
        """Batches left (finite `num_epochs` only)."""
        if self.num_epochs is None:
            raise TypeError('an infinite Loader (num_epochs=None) has no length')
        left = len(self.source) * self.num_epochs - self._next_index
        return self._whole_batches(max(0, left))

    # --- Pipeline ----------------------------------------------------------------------
    def _stream(self) -> grain.MapDataset:
        """The global stream (see module docstring) as a grain MapDataset."""
        ds = grain.MapDataset.source(self.source)
        if self.shuffle:
            # Reseeded per epoch by the repeat below (order_seed + epoch).
            ds = ds.shuffle(seed=order_seed(self.seed, self.order))
        if self.transform is not None:
            ds = ds.random_map(_KeepStandIn(self.transform), seed=self.seed)
        return ds.repeat(self.num_epochs)

    def _process_batches(self) -> grain.MapDataset:
        """This process's batches from `next_index` on."""
        if self.batched:
            return self._batched_process_batches()
        stream = self._stream()
        G, B = self.global_batch_size, self.batch_size
        start = min(self._next_index, len(stream))
        remaining = len(stream) - start
        if self.pad_remainder:
            # Padded to whole global batches: every example once, plus copies weighted 0.
            stream = grain.MapDataset.range(-(-remaining // G) * G).map(
                _WithExampleWeight(stream[start:]))
        else:
            # Whole global batches only: all processes must agree on the number of steps.
            stream = stream[start:start + (remaining // G) * G]
        # Batch k of this stream is examples [k*B, (k+1)*B); global step s is batches
        # s*P .. s*P+P-1, and this process takes batch s*P + p.
        return stream.batch(B, drop_remainder=True)[self.process_index::self.process_count]

    def _batched_process_batches(self) -> grain.MapDataset:
        """The batches of `_process_batches`, a whole batch read per call: batch j of
        this process holds stream examples start + (j*P + p)*B + [0, B) (wrapped to the
        stream's first examples, weighted 0, past its end when padded)."""
        G = self.global_batch_size
        length = len(self._stream())  # N * num_epochs, or unbounded
        start = min(self._next_index, length)
        remaining = length - start
        steps = -(-remaining // G) if self.pad_remainder else remaining // G
        return grain.MapDataset.range(steps).map(_BatchReader(
            self.source, self.shuffle, self.transform, self.seed,
            order_seed(self.seed, self.order), start, remaining,
            self.batch_size, self.process_index, self.process_count, self.pad_remainder))

    def __iter__(self) -> Iterator[Batch]:
        # A few batches read ahead (one per thread, at least 4): enough to hide reading
        # behind a step. (grain's default buffer is 500 batches: gigabytes of images.)
        ds = self._process_batches().to_iter_dataset(read_options=grain.ReadOptions(
            num_threads=self.read_threads,
            prefetch_buffer_size=max(4, self.read_threads) if self.read_threads else 0))
        if self.worker_count > 0:
            # grain's workers read absl flags; outside an absl app (notebooks, pytest)
            # nobody parsed them, so accept the defaults rather than crash.
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.worker_count),
                                worker_init_fn=_EndWithParent(os.getpid()))
        for batch in ds:
            # Advance before yielding: a checkpoint taken after receiving this batch must
            # resume with the next one. (A padded final batch ends at the stream's end.)
            self._next_index += self.global_batch_size
            if self.pad_remainder:
                self._next_index = min(self._next_index, len(self.source) * self.num_epochs)
            yield batch


def _check_weightable(example) -> None:
    """pad_remainder=True adds EXAMPLE_WEIGHT to each example (or batch): it must be a dict
    without one."""
    if not isinstance(example, Mapping):
        raise TypeError(f'pad_remainder=True needs dict examples (it adds the field '
                        f'{EXAMPLE_WEIGHT!r}); got {type(example).__name__}')
    if EXAMPLE_WEIGHT in example:
        raise ValueError(f'the examples already have a field {EXAMPLE_WEIGHT!r}; '
                         f'pad_remainder=True adds it')


class _KeepStandIn:
    """transform(record, rng), with the record's STAND_IN mark carried over to what it
    returns (a transform that builds a new dict, as images.Preprocess does, dropped it:
    the stand-in was then weighed 1, counted twice)."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, record, rng):
        out = self.transform(record, rng)
        if isinstance(record, Mapping) and STAND_IN in record and isinstance(out, Mapping):
            out = {**out, STAND_IN: record[STAND_IN]}
        return out


class _WithExampleWeight:
    """Index i of a stream padded to any length: {**stream[i], EXAMPLE_WEIGHT: 1.0} while
    i is in the stream, then copies of its examples (from its start) with weight 0.0.
    Copies rather than zeros: a padding row is a valid input (no all-masked attention
    row, no out-of-range id) whose finite values the weight then removes."""

    def __init__(self, stream):
        self.stream = stream

    def __call__(self, i: int):
        n = len(self.stream)
        example = self.stream[i % n]
        _check_weightable(example)
        stood_in = bool(example.get(STAND_IN, False))
        example = {k: v for k, v in example.items() if k != STAND_IN}
        return {**example, EXAMPLE_WEIGHT: np.float32(i < n and not stood_in)}


class ExampleRngs(Sequence):
    """The random streams of a batch's examples, made when asked for (a transform that
    uses none, such as CausalLM, pays nothing): example i's is grain's random_map rng
    for its stream index g, Philox keyed by the seed with counter [0, 0, 0, g]."""

    def __init__(self, seed: int, stream: np.ndarray):
        self.seed, self.stream = seed, stream

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        counter = np.array([0, 0, 0, int(self.stream[i])], np.uint64)
        return np.random.Generator(np.random.Philox(self.seed, counter=counter))


@dataclasses.dataclass(frozen=True)
class _BatchReader:
    """Local batch j -> the batch, read with one `source.read_rows` (picklable, for
    grain's worker processes)."""
    source: Any
    shuffle: bool
    transform: Transform | None
    seed: int
    shuffle_seed: int  # order_seed(seed, order): epoch e's shuffle is seeded + e
    start: int
    remaining: int
    batch_size: int
    process_index: int
    process_count: int
    pad_remainder: bool

    def __call__(self, j: int) -> Batch:
        B = self.batch_size
        offsets = (j * self.process_count + self.process_index) * B + np.arange(B)
        stream = self.start + offsets % self.remaining
        batch = self.source.read_rows(self.records(stream))
        if self.transform is not None:
            rngs = ExampleRngs(self.seed, stream)
            apply_batch = getattr(self.transform, 'apply_batch', None)
            if apply_batch is not None:
                batch = apply_batch(batch, rngs)
            else:
                examples = [self.transform({k: v[i] for k, v in batch.items()}, rng)
                            for i, rng in enumerate(rngs)]
                batch = jax.tree.map(lambda *xs: np.stack(xs), *examples)
        if self.pad_remainder:
            _check_weightable(batch)
            batch = {**batch, EXAMPLE_WEIGHT: (offsets < self.remaining).astype(np.float32)}
        return batch

    def records(self, stream: np.ndarray) -> list[int]:
        """Record perm_e(g mod N) of each stream index g: grain's shuffle (MapDataset.
        shuffle) computed as it does, index_shuffle with shuffle_seed + epoch, 4 rounds (2.5x
        cheaper than a lookup through the dataset; tests compare the two paths)."""
        n = len(self.source)
        if not self.shuffle:
            return (stream % n).tolist()
        out = []
        for g in stream.tolist():
            epoch, i = divmod(g, n)
            out.append(index_shuffle(i, max_index=n - 1,
                                     seed=(self.shuffle_seed + epoch) % 2**32,
                                     rounds=4))
        return out


def to_global_batch(batch: Batch, mesh: Mesh,
                    data_axes: str | tuple[str, ...] = ('data',)) -> Batch:
    """Host-local numpy batch [B, ...] -> global jax.Arrays [G, ...] sharded over `data_axes`.

    Each process passes its own B = G/P rows; `jax.make_array_from_process_local_data`
    assembles them (in process order, matching the Loader's blocks) without any host
    gathering the whole batch. `data_axes` may name several mesh axes, e.g.
    ('data', 'fsdp'), over which the batch dimension is split jointly.
    """
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f'data_axes {missing} are not mesh axes {mesh.axis_names}')
    sharding = NamedSharding(mesh, PartitionSpec(axes))
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    local_shards = shards * jax.local_device_count() // jax.device_count()

    def put(x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % max(local_shards, 1):
            raise ValueError(f'batch leaf of shape {x.shape}: the leading (batch) dimension must '
                             f'divide evenly over the {max(local_shards, 1)} local shards of '
                             f'mesh axes {axes}')
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(put, batch)
