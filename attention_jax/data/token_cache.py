"""Tokenize once, train many times: a sharded token cache and the lazy rows read from it.

A split of documents (`files.FileDocuments`, or any random-access source of
{'text': bytes}) is tokenized into a cache directory named by a key of everything that
decides its tokens:

  the split's files (absolute path, size, mtime: a stat, never a read of their content),
  which of their documents the split holds, text_key, max_documents, the tokenizer
  (a hash of its vocabulary files and special ids), the end-of-text id, the shard size

so a changed file or another tokenizer is another directory, never a stale read. Inside:

  inputs.json               what the key hashes (for people, and to tell a tampered dir)
  NNNNN.tokens.npy          the shard's token stream: documents joined, each followed by
                            eos; uint16 when the vocabulary fits, else uint32
  NNNNN.ends.npy            int64, where each document of the shard ends in that stream
  NNNNN.json                the shard's commit: written (temp file, rename) after both
                            arrays, so a killed prepare resumes with the shards it finished
  manifest.json             written last: every shard's counts and file sizes

Preparing uses every core (a process pool, one shard per task; a single shard is encoded
in-process, where the tokenizers library's Rust `encode_batch` uses the cores). Several
hosts share the work on a shared directory: process p takes shards p, p+P, ... first,
then waits for the others' commits; if none arrives for `stall_s` seconds (a dead host,
or a disk that is not shared) it prepares what is missing itself. Commits are atomic
renames of identical bytes, so two writers of one shard are harmless.

`TokenRows` reads a prepared split as rows of `seq_len` tokens: row r is the window
[r*L, (r+1)*L) of the whole token stream (shards memory-mapped when first touched, the
last row padded). packing='documents' adds segment_ids and positions from the document
ends inside the window: the rows of `packing.pack_documents(split_documents=True)` over
the same documents, exactly. Nothing proportional to the corpus is read at start-up or
held in memory; a row costs two binary searches and a slice. The cache directory must be
a local (or mounted) filesystem: np.memmap needs one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
import pickle
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np

from attention_jax.data.files import FilesError
from attention_jax.data.loaders import watch_parent
from attention_jax.data.packing import PAD_SEGMENT
from attention_jax.data.tokenization import encode_many

# The key stats the files and never reads them, so a change in how their documents are
# read must change VERSION. 2 (2026-11-27): a CSV's quote left open is a bad record (it
# used to take the rest of the file as one text). 3 (2026-11-27): a text file more than a
# quarter of whose own bytes are not UTF-8 is a bad record (the share was of the decoded
# text, where each U+FFFD is 3 bytes, so it never passed a third). 4 (2026-11-28): a text
# file's UTF-8 byte order mark is no text, and a line of white space longer than 8 bytes
# is a blank line (it was a bad record).
VERSION = 4
MANIFEST = 'manifest.json'
MOST_BAD_WHERE = 5  # the bad records' places a manifest keeps, to say at each start
INPUTS = 'inputs.json'
DEFAULT_SHARD_BYTES = 4 << 20  # of source text: small enough to keep every core busy to the end


class CacheError(FilesError):
    """A token cache that cannot be used: truncated, unreadable, or not the one asked for."""


# ====================================================================================== key
def _file_stats(docs) -> list:
    """(path, size, mtime_ns) of every file behind `docs` (a FileDocuments), else []
    (files.corpus_listing's stats, and why no more)."""
    corpus = getattr(docs, 'corpus', None)
    out = []
    for f in getattr(corpus, 'files', ()):
        st = os.stat(f.path)
        out.append([f.path, st.st_size, st.st_mtime_ns])
    return out


def _membership(docs) -> str:
    """A hash of which documents of its corpus the split holds (the eval_fraction draw)."""
    indices = getattr(docs, 'indices', None)
    h = hashlib.sha256(str(len(docs)).encode())
    if indices is not None:
        h.update(np.ascontiguousarray(indices, np.int64).tobytes())
    return h.hexdigest()[:16]


def cache_inputs(docs, tokenizer, *, text_key: str = 'text', max_documents: int = 0,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, source=None) -> dict:
    """Everything the tokens of a prepared split depend on (the key hashes this).

    source: a JSON-able description of the documents that changes whenever they may
      (the task gives files.corpus_listing plus the split and how it is drawn, so a
      prepared cache is found without indexing any file); None: derived from `docs`, a
      FileDocuments (its files' stats and which of their documents it holds)."""
    from attention_jax.data.tokenization import fingerprint
    if source is None:
        docs = docs() if callable(docs) else docs
        files = _file_stats(docs)
        if not files:
            raise ValueError('cache_inputs: documents that are not files need source=... '
                             'describing them (what would change their contents)')
        source = {'files': files, 'documents': _membership(docs)}
    return {'version': VERSION, 'source': source, 'text_key': text_key,
            'max_documents': int(max_documents or 0), 'tokenizer': fingerprint(tokenizer),
            'eos_id': getattr(tokenizer, 'eos_id', None), 'shard_bytes': int(shard_bytes)}


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


# ================================================================================ writing
def _local(path) -> str:
    """`path` (a str or an etils.epath.Path) as a local path: memory maps need one."""
    if '://' in str(path):
        raise CacheError(f'cache_dir={str(path)!r}: the token cache must be on a local or '
                         f'mounted filesystem (its shards are memory-mapped); valid: a local '
                         f'directory, e.g. a bucket mounted with gcsfuse')
    return os.path.expanduser(os.fspath(path))


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    # A temp name of its own per writer (host, process, call): two writers of one file,
    # threads of a process included, each rename complete bytes.
    tmp = f'{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}'
    write(tmp)
    os.replace(tmp, path)


def _write_json(path: str, obj) -> None:
    def write(tmp):
        with open(tmp, 'w') as f:
            json.dump(obj, f, sort_keys=True, indent=1)
    _atomic_write(path, write)


def _write_npy(path: str, array: np.ndarray) -> None:
    def write(tmp):
        with open(tmp, 'wb') as f:
            np.save(f, array)
    _atomic_write(path, write)


def _shard_name(directory: str, k: int, what: str) -> str:
    return os.path.join(directory, f'{k:05d}.{what}')


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _ShardWriter:
    """Tokenizes documents [first, last) of `docs` into shard k of `directory`."""

    def __init__(self, docs, tokenizer, directory: str, key: str):
        self.docs, self.tokenizer, self.directory = docs, tokenizer, directory
        self.key = key
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.eos = getattr(tokenizer, 'eos_id', None)

    def __call__(self, k: int, first: int, last: int) -> dict:
        bad = getattr(getattr(self.docs, 'corpus', None), 'bad', None)
        texts, names, source_bytes = [], [], 0
        # the bad records of this range, those read before included
        with bad.watching() if bad is not None else contextlib.nullcontext([]) as bad_here:
            for i in range(first, last):
                doc = self.docs[i]
                raw = doc['text']
                source_bytes += len(raw)
                texts.append(raw.decode('utf-8', errors='replace') if isinstance(raw, bytes)
                             else str(raw))
                name = doc.get('id', i)
                names.append(name.decode('utf-8', errors='replace') if isinstance(name, bytes)
                             else str(name))
        ids = encode_many(self.tokenizer, texts, names)
        del texts, names
        lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        extra = 0 if self.eos is None else 1
        ends = np.cumsum(lengths + extra)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, self.dtype)
        start = 0
        for x, end in zip(ids, ends):
            n = len(x)
            tokens[start:start + n] = x
            if extra:
                tokens[start + n] = self.eos
            start = int(end)
        _write_npy(_shard_name(self.directory, k, 'tokens.npy'), tokens)
        _write_npy(_shard_name(self.directory, k, 'ends.npy'), ends.astype(np.int64))
        # What the shard holds, for a resumed run to tell the same tokens from others
        # (TokenRows.fingerprint): a cache is rebuilt when a file's size or time changes.
        digest = hashlib.blake2b(tokens.tobytes(), digest_size=16)
        digest.update(ends.astype(np.int64).tobytes())
        skipped = sorted(set(bad_here), key=_place_order)
        meta = {'key': self.key, 'shard': k, 'first_document': first, 'documents': last - first,
                'tokens': len(tokens), 'digest': digest.hexdigest(), 'source_bytes': source_bytes,
                'bad_records': len(skipped), 'bad_where': skipped[:MOST_BAD_WHERE],
                'sizes': [os.path.getsize(_shard_name(self.directory, k, w))
                          for w in ('tokens.npy', 'ends.npy')]}
        _write_json(_shard_name(self.directory, k, 'json'), meta)
        return meta


def _place_order(where: str) -> list:
    """A bad record's place ('file.jsonl:12', 'file.parquet: row 3') as a sort key that
    orders its numbers as numbers (line 2 before line 10)."""
    return [int(part) if part.isdigit() else part for part in re.split(r'(\d+)', where)]


_WORKER: dict = {}


def _init_worker(payload: bytes, parent: int) -> None:
    # One shard per process: the tokenizers library's own threads would only contend.
    os.environ['TOKENIZERS_PARALLELISM'] = 'false'
    _WORKER['write'] = pickle.loads(payload)
    # A parent killed outright closes nothing: its workers, which hold the task queue's
    # write end as well as its read end, wrote the shards queued and then waited forever.
    watch_parent(parent, 'prepare-parent-watch')


def _work(task) -> dict:
    return _WORKER['write'](*task)


class _Progress:
    """A bar on a terminal, a few log lines otherwise (process 0 only)."""

    def __init__(self, total: int, label: str, show: bool, done_before: int = 0):
        self.total, self.label, self.show = total, label, show
        self.done = self.tokens = self.bytes = 0
        self.start, self.next_log = time.perf_counter(), 0.25
        self.bar = None
        if show and total and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit='shard', desc=f'prepare {label}', file=sys.stderr)
        elif show and total:
            before = (f' of {total + done_before} (resuming: {done_before} prepared before)'
                      if done_before else '')
            print(f'prepare {label}: {total} shards to tokenize{before}', file=sys.stderr,
                  flush=True)
        if show and total and done_before and self.bar is not None:
            self.bar.write(f'prepare {label}: resuming, {done_before} of '
                           f'{total + done_before} shards prepared before')

    def update(self, meta: dict) -> None:
        self.done += 1
        self.tokens += meta['tokens']
        self.bytes += meta['source_bytes']
        rate = self.bytes / max(time.perf_counter() - self.start, 1e-9) / 1e6
        if self.bar is not None:
            self.bar.set_postfix_str(f'{self.tokens / 1e6:.1f}M tokens, {rate:.1f} MB/s')
            self.bar.update(1)
        elif self.show and (self.done / self.total >= self.next_log or self.done == self.total):
            self.next_log += 0.25
            print(f'prepare {self.label}: {self.done}/{self.total} shards, '
                  f'{self.tokens / 1e6:.1f}M tokens, {rate:.1f} MB/s', file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _plan(docs, shard_bytes: int, max_documents: int) -> list[tuple[int, int]]:
    """[first, last) documents of each shard: a fixed count per shard, from the average
    document size the file sizes give (no document is read to plan)."""
    n = len(docs) if not max_documents else min(max_documents, len(docs))
    corpus = getattr(docs, 'corpus', None)
    if corpus is not None and len(corpus):
        avg = max(1.0, sum(os.path.getsize(f.path) for f in corpus.files) / len(corpus))
    else:
        avg = 1024.0
    per = max(1, int(shard_bytes // avg))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def prepare(docs, tokenizer, root: str, *, text_key: str = 'text', max_documents: int = 0,
            shard_bytes: int = DEFAULT_SHARD_BYTES, workers: int | None = None,
            process_index: int = 0, process_count: int = 1, progress: bool = True,
            label: str = 'split', source=None, stall_s: float = 300.0) -> str:
    """Tokenizes `docs` into the cache under `root` unless it is there; returns its
    directory (module docstring). Safe to call from every process of a job. `docs` may
    be a function returning them, called only when there is something to tokenize;
    `source`: see cache_inputs."""
    inputs = cache_inputs(docs, tokenizer, text_key=text_key, max_documents=max_documents,
                          shard_bytes=shard_bytes, source=source)
    key = cache_key(inputs)
    directory = os.path.join(_local(root), key)
    if os.path.exists(os.path.join(directory, MANIFEST)):
        manifest = check_manifest(directory, inputs)
        if manifest.get('bad_records') and process_index == 0:
            # Their warnings were said once, by the prepare; each start says they are out.
            where = manifest.get('bad_where') or []
            more = ', ...' if manifest['bad_records'] > len(where) else ''
            print(f"note: {label}: {manifest['bad_records']} bad record(s) of its files were "
                  f"left out when its token cache was prepared ({', '.join(where)}{more}; "
                  f"{directory})", file=sys.stderr)
        return directory
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CacheError(f'{directory}: cannot create the token cache here ({e}); set '
                         f'config.data.cache_dir to a writable directory') from None
    recorded = os.path.join(directory, INPUTS)
    if os.path.exists(recorded):
        _check_inputs(directory, _read_json(recorded), inputs)
    else:
        _write_json(recorded, inputs)
    docs = docs() if callable(docs) else docs
    plan = _plan(docs, shard_bytes, max_documents)
    if not plan:
        raise CacheError(f'{label}: no documents to prepare')
    done = lambda k: os.path.exists(_shard_name(directory, k, 'json'))  # noqa: E731
    writer = _ShardWriter(docs, tokenizer, directory, key)
    show = progress and process_index == 0
    ours = [k for k in range(len(plan)) if k % process_count == process_index]
    mine = [k for k in ours if not done(k)]
    _run(writer, [(k, *plan[k]) for k in mine], workers,
         _Progress(len(mine), label, show, done_before=len(ours) - len(mine)))
    # The other processes' shards: wait for their commits; prepare them here when none
    # arrives for stall_s (a dead host, or a cache dir that is not shared).
    last, seen = time.monotonic(), -1
    while missing := [k for k in range(len(plan)) if not done(k)]:
        if len(missing) != seen:
            last, seen = time.monotonic(), len(missing)
        if time.monotonic() - last > stall_s:
            if show:
                print(f'prepare {label}: no shard committed by another process for '
                      f'{stall_s:.0f} s; preparing the {len(missing)} missing ones here',
                      file=sys.stderr, flush=True)
            _run(writer, [(k, *plan[k]) for k in missing], workers,
                 _Progress(len(missing), label, show))
            break
        time.sleep(0.2)
    shards = [_read_json(_shard_name(directory, k, 'json')) for k in range(len(plan))]
    bad = sum(s['bad_records'] for s in shards)
    limit = getattr(getattr(getattr(docs, 'corpus', None), 'bad', None), 'limit', None)
    if limit is not None and bad > limit:
        raise FilesError(f'{label}: {bad} bad records were skipped, more than '
                         f'max_bad_records={limit}: fix the files or raise it')
    manifest = {'inputs': inputs, 'dtype': token_dtype(tokenizer.vocab_size).name,
                'tokens': [s['tokens'] for s in shards],
                'documents': [s['documents'] for s in shards],
                'sizes': [s['sizes'] for s in shards],
                'source_bytes': sum(s['source_bytes'] for s in shards), 'bad_records': bad,
                'bad_where': [w for s in shards for w in s.get('bad_where', [])][:MOST_BAD_WHERE]}
    if all('digest' in s for s in shards):  # (shards of a prepare from before digests: none)
        manifest['digests'] = [s['digest'] for s in shards]
    _write_json(os.path.join(directory, MANIFEST), manifest)
    _remove_stale_temps(directory, stall_s)
    return directory


def _run(writer: _ShardWriter, tasks: list, workers: int | None, bar: _Progress) -> None:
    workers = min(workers or os.cpu_count() or 1, len(tasks))
    try:
        if workers > 1 and not _can_spawn():
            print(f'prepare: one process instead of {workers} (__main__ is a script run by '
                  f'path, which spawned workers would import again); each shard is still '
                  f'tokenized on every core by encode_batch', file=sys.stderr)
        if workers <= 1 or not _can_spawn():
            for task in tasks:
                bar.update(writer(*task))
            return
        with _pool(workers, writer) as pool:
            for meta in pool.map(_work, tasks):
                bar.update(meta)
    finally:
        bar.close()


def _pool(workers: int, writer) -> concurrent.futures.ProcessPoolExecutor:
    """`workers` processes that run `writer` on the tasks given them, each ending with
    this process (loaders.watch_parent). spawn, not fork: the caller may hold JAX's threads, which
    a fork would copy half-way through whatever they were doing."""
    return concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context('spawn'),
        initializer=_init_worker, initargs=(pickle.dumps(writer), os.getpid()))


def _can_spawn() -> bool:
    """Whether spawned workers can start: they import the parent's __main__, which a
    script run by path may not guard with `if __name__ == '__main__'` (a module run with
    -m, a notebook or an interpreter can). Without: one process, whose encode_batch
    still spreads each shard over the cores."""
    main = sys.modules.get('__main__')
    return getattr(main, '__spec__', None) is not None or not hasattr(main, '__file__')


def _remove_stale_temps(directory: str, older_than_s: float) -> None:
    now = time.time()
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            if '.tmp-' in name and now - os.path.getmtime(path) > older_than_s:
                os.remove(path)
        except OSError:
            pass  # another process removed or renamed it first


# ================================================================================ reading
def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CacheError(f'{path}: unreadable token cache file ({e}); delete '
                         f'{os.path.dirname(path)} to prepare it again') from None


def _check_inputs(directory: str, found: dict, inputs: dict) -> None:
    if not isinstance(found, dict):
        raise CacheError(f'{directory}: its manifest records no inputs (damaged or edited); '
                         f'delete it to prepare it again')
    if found != inputs:
        differ = sorted(k for k in {*found, *inputs} if found.get(k) != inputs.get(k))
        raise CacheError(f'{directory} was prepared from other inputs ({", ".join(differ)} '
                         f'differ) than its name says; delete it to prepare it again')


def check_manifest(directory: str, inputs: dict) -> dict:
    manifest = _read_json(os.path.join(directory, MANIFEST))
    _check_inputs(directory, manifest.get('inputs'), inputs)
    return manifest


class TokenRows:
    """Rows of `seq_len` tokens over a prepared split (module docstring); records are
    dicts of [L] int32: tokens and segment_ids, and positions with packing='documents'
    (packing='stream': segment_ids are 1 on tokens, 0 on the last row's padding)."""

    def __init__(self, directory: str, seq_len: int, *, pad_id: int = 0,
                 packing: str = 'documents'):
        if seq_len <= 0:
            raise ValueError(f'seq_len={seq_len} must be positive')
        if packing not in ('documents', 'stream'):
            raise ValueError(f"packing={packing!r}; valid: ['documents', 'stream']")
        directory = _local(directory)
        manifest_path = os.path.join(directory, MANIFEST)
        if not os.path.exists(manifest_path):
            raise CacheError(f'{directory}: no {MANIFEST}: not a prepared token cache (or '
                             f'its prepare did not finish; run it again to resume)')
        manifest = _read_json(manifest_path)
        self.directory, self.seq_len, self.pad_id, self.packing = (directory, seq_len, pad_id,
                                                                   packing)
        try:
            self.dtype = np.dtype(manifest['dtype'])
            self.shard_tokens = np.asarray(manifest['tokens'], np.int64)
            self.num_documents = int(sum(manifest['documents']))
            sizes = [tuple(map(int, s)) for s in manifest['sizes']]
            self.eos_id = manifest['inputs'].get('eos_id')
            digests = manifest.get('digests')
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CacheError(f'{manifest_path}: a damaged manifest ({type(e).__name__}: {e}); '
                             f'delete {directory} to prepare it again') from None
        # The tokens' identity, which a loader's saved state keeps (loaders.LoaderState):
        # the same corpus moved elsewhere has it, an edited one does not; '' for a cache
        # prepared before shards had digests (not compared).
        self.fingerprint = (hashlib.sha256(''.join(digests).encode()).hexdigest()[:16]
                            if isinstance(digests, list) else '')
        self.starts = np.concatenate([[0], np.cumsum(self.shard_tokens)]).astype(np.int64)
        self.num_tokens = int(self.starts[-1])
        if self.num_tokens == 0:
            raise CacheError(f'{directory}: the prepared documents hold no tokens')
        # A stat per shard file (no read): a truncated or missing shard is found now.
        for k, shard_sizes in enumerate(sizes):
            for what, size in zip(('tokens.npy', 'ends.npy'), shard_sizes):
                path = _shard_name(directory, k, what)
                try:
                    found = os.path.getsize(path)
                except OSError as e:
                    raise CacheError(f'{path}: token cache shard cannot be read ({e}); '
                                     f'delete {directory} to prepare it again') from None
                if found != size:
                    raise CacheError(f'{path}: truncated or damaged token cache shard '
                                     f'({found} bytes, {size} written); delete {directory} '
                                     f'to prepare it again')
        self._columns = np.arange(seq_len)
        self._shards: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self):  # grain workers open their own maps
        return {**self.__dict__, '_shards': {}}

    def __len__(self) -> int:
        return -(-self.num_tokens // self.seq_len)

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._shards.get(k)
        if got is None:
            try:
                # Plain arrays over the maps: a slice of an np.memmap costs a Python
                # subclass' bookkeeping, 2x the copy of a row.
                got = tuple(np.asarray(np.load(_shard_name(self.directory, k, w),
                                               mmap_mode='r'))
                            for w in ('tokens.npy', 'ends.npy'))
            except (OSError, ValueError) as e:
                raise CacheError(f'{_shard_name(self.directory, k, "*.npy")}: unreadable token '
                                 f'cache shard ({e}); delete {self.directory} to prepare it '
                                 f'again') from None
            self._shards[k] = got
        return got

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        r = int(index)
        if not 0 <= r < len(self):
            raise IndexError(f'row {r} of {len(self)}')
        L = self.seq_len
        a, b = r * L, (r + 1) * L
        k = int(np.searchsorted(self.starts, a, side='right')) - 1
        if b > self.starts[k + 1]:  # the row crosses a shard or is the padded last one
            return self._general_row(a, min(b, self.num_tokens), k)
        shard_tokens, shard_ends = self._shard(k)
        lo = a - int(self.starts[k])
        tokens = shard_tokens[lo:lo + L].astype(np.int32)
        if self.packing == 'stream':
            return {'tokens': tokens, 'segment_ids': np.ones(L, np.int32)}
        # Ends strictly inside the row start the row's next pieces.
        i, j = shard_ends.searchsorted([lo, lo + L], side='right')
        cuts = np.asarray(shard_ends[i:j]) - lo
        return {'tokens': tokens, **self._segments(cuts[cuts < L], L)}

    def read_rows(self, indices) -> dict[str, np.ndarray]:
        """Rows `indices` at once, as dicts of [len(indices), L] int32: what stacking
        self[i] for each would give, read with a slice copy per row and the segment ids
        of all rows computed together (the Loader's batched path)."""
        rows = np.asarray(indices, np.int64).reshape(-1)
        if len(rows) and not (0 <= rows.min() and rows.max() < len(self)):
            raise IndexError(f'rows {rows.min()}..{rows.max()} of {len(self)}')
        L, n = self.seq_len, len(rows)
        a = rows * L
        k = np.searchsorted(self.starts, a, side='right') - 1
        simple = a + L <= self.starts[k + 1]  # inside one shard, not the padded last row
        tokens = np.empty((n, L), np.int32)
        documents = self.packing == 'documents'
        out = {'tokens': tokens}
        if not documents:
            out['segment_ids'] = np.ones((n, L), np.int32)
        else:
            # A row's pieces start at column 0 and after every document end inside it.
            # Marked in the batch's flat [n*L] columns, the marks are where the batch's
            # pieces begin, in order; each column repeats its piece's number and start.
            marks = np.zeros(n * L, bool)
            marks[::L] = True
        lo = (a - self.starts[k]).tolist()
        shards, cut_rows, cut_cols = k.tolist(), [], []
        # Row by row: the rows of a batch are spread over the shards (a loop per shard
        # was 3x slower over 26 shards), and a row is a slice copy and one binary search.
        for i in np.flatnonzero(simple).tolist():
            shard_tokens, shard_ends = self._shard(shards[i])
            tokens[i] = shard_tokens[lo[i]:lo[i] + L]
            if documents:
                first, last = shard_ends.searchsorted((lo[i], lo[i] + L), side='right')
                if last > first:
                    cut_cols.append(shard_ends[first:last] - lo[i])
                    cut_rows.append(np.full(last - first, i))
        if cut_cols:
            cuts, row_of = np.concatenate(cut_cols), np.concatenate(cut_rows)
            inside = cuts < L
            marks[row_of[inside] * L + cuts[inside]] = True  # twice (no eos): one piece
        if documents:
            begins = np.flatnonzero(marks).astype(np.int32)
            lengths = np.diff(begins, append=np.int32(n * L))
            first_of_row = np.searchsorted(begins, np.arange(n) * L)
            number = (np.arange(len(begins)) - first_of_row[begins // L] + 1).astype(np.int32)
            out['segment_ids'] = np.repeat(number, lengths).reshape(n, L)
            out['positions'] = (np.arange(n * L, dtype=np.int32)
                                - np.repeat(begins, lengths)).reshape(n, L)
        for i in np.flatnonzero(~simple):  # across shards, or the last row: one by one
            row = self[int(rows[i])]
            for key, value in row.items():
                out[key][i] = value
        return out

    def _segments(self, cuts: np.ndarray, col: int) -> dict[str, np.ndarray]:
        """segment_ids and positions of a row whose pieces start at 0 and at `cuts`
        (sorted, in (0, col)); columns from `col` on are padding."""
        if self.eos_id is None:  # empty documents end where the one before did
            cuts = np.unique(cuts)
        L = self.seq_len
        piece = np.searchsorted(cuts, self._columns, side='right')  # 0-based piece of a column
        positions = (self._columns - np.concatenate([[0], cuts])[piece]).astype(np.int32)
        segment_ids = (piece + 1).astype(np.int32)
        if col < L:
            segment_ids[col:] = PAD_SEGMENT
            positions[col:] = 0
        return {'segment_ids': segment_ids, 'positions': positions}

    def _general_row(self, a: int, b: int, k: int) -> dict[str, np.ndarray]:
        """A row across shards (each starts a new document) or the last, padded one."""
        L = self.seq_len
        tokens = np.full(L, self.pad_id, np.int32)
        cuts, col = [], 0
        while a < b:
            shard_tokens, shard_ends = self._shard(k)
            lo, hi = a - int(self.starts[k]), min(b, int(self.starts[k + 1])) - int(self.starts[k])
            tokens[col:col + hi - lo] = shard_tokens[lo:hi]
            if col:
                cuts.append(col)
            i, j = shard_ends.searchsorted([lo, hi], side='right')
            cuts.extend((np.asarray(shard_ends[i:j]) - lo + col).tolist())
            col += hi - lo
            a += hi - lo
            k += 1
        if self.packing == 'stream':
            segment_ids = np.zeros(L, np.int32)
            segment_ids[:col] = 1
            return {'tokens': tokens, 'segment_ids': segment_ids}
        cuts = np.array(sorted(c for c in set(cuts) if 0 < c < col), np.int64)
        return {'tokens': tokens, **self._segments(cuts, col)}
