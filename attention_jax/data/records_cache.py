"""What one pass over every record of a split found, kept so that the next start need not
read them all again.

The classifier and translation tasks read every record of a split when they start: to
leave out those with an empty text (a blank line, a bad record), to digest what the rest
hold (a resume on edited files stops: loaders.source_id), to list the classes, and to
find the longest text in tokens. At a million records that is about 10 s of Python per
process and split (2-core host), at tens of millions minutes, at every start, resume and
evaluation. The first pass keeps its result under ROOT/records/KEY.npz, KEY a hash of

  the records: a user's files' names, paths and stats when indexed (size, mtime, inode,
  ctime: restoring the size and mtime after an edit leaves the ctime changed) and which
  of their records the split holds; else the split's identity (loaders.source_id: a
  tfds split's, a subset's fingerprint or picks)
  the pass: what it reads and how (the keys, the tokenizer)

so an edited file, another split or another tokenizer is another entry, never a stale
one. An entry is written whole (a temp file, then a rename); one that cannot be read is
computed again and a note says so, one that cannot be written is a warning. ROOT may be
a bucket (gs://...): entries are small. The bad records a pass met are kept with it and
counted again on a read, so data.max_bad_records holds at every start.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import uuid
from collections.abc import Callable

import numpy as np

# 2 (2026-11-27): a table's records read otherwise (a CSV quote left open is a bad
# record, a whole number written as a float a label's integer), so entries of 1 are stale.
# 3 (2026-11-28): a line of white space longer than 8 bytes is blank, not a bad record.
VERSION = 3
FOLDER = 'records'

# The JSON part of an entry, beside its arrays in the .npz.
_META = 'meta.json'
# Where in the user's files the pass met bad records (an entry's JSON part).
_BAD = 'bad records'


def identity(records) -> dict | None:
    """What `records` are, found without reading them; None where nothing tells (a
    list in memory: nothing is kept for it)."""
    from attention_jax.data import files, loaders
    if isinstance(records, files.FileDocuments):
        corpus = records.corpus
        members = hashlib.sha256(str(len(records)).encode())
        if records.indices is not None:
            members.update(np.ascontiguousarray(records.indices, np.int64).tobytes())
        # A file's own name in the records (its ident: the digest reads it) and its stat
        # when it was indexed: size, mtime, inode, ctime (restoring the first two after
        # an edit, as cp -p or rsync -t do, leaves the ctime changed).
        return {'files': [[f.ident, f.path, *f.stat] for f in corpus.files],
                'records': members.hexdigest()[:16], 'fields': list(corpus.fields),
                'integers': list(corpus.integers), 'max_bad_records': corpus.bad.limit}
    found = loaders.source_id(records)
    return {'source': found, 'count': len(records)} if found else None


def entry_path(root: str, records, what: dict) -> str | None:
    """Where the entry of the pass `what` over `records` is kept under `root`; None
    where the records have no identity."""
    found = identity(records)
    if found is None:
        return None
    key = hashlib.sha256(json.dumps({'version': VERSION, 'what': what, 'records': found},
                                    sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(root, FOLDER, f'{key}.npz')


def remembered(root: str | None, records, what: dict,
               compute: Callable[[], dict]) -> dict:
    """compute()'s result for `records`, read from the entry a pass with the same `what`
    over the same records kept under `root`, else computed and kept there. A result is
    a dict of JSON values and numpy arrays. root None: computed, nothing kept. The bad
    records of a user's files that the pass met (reported then) are kept with it and
    counted again on a read, so data.max_bad_records holds at every start."""
    path = entry_path(root, records, what) if root else None
    if path is None:
        return compute()
    from etils import epath

    from attention_jax.data import files
    bad = records.corpus.bad if isinstance(records, files.FileDocuments) else None
    entry = epath.Path(path)
    try:
        found = _read(entry) if entry.exists() else None
    except Exception as e:  # noqa: BLE001 - a damaged file, a store's refusal: read again
        print(f'note: {path}: the records cache could not be read ({type(e).__name__}: '
              f'{str(e)[:200]}); the records are read again', file=sys.stderr)
        found = None
    if found is not None:
        if bad is not None:
            bad.recount(found.pop(_BAD, []))
        return found
    before = set(bad.seen) if bad is not None else set()
    result = compute()
    kept = dict(result)
    if bad is not None:
        kept[_BAD] = sorted(bad.seen - before)
    try:
        _write(entry, kept)
    except Exception as e:  # noqa: BLE001 - the run goes on; only the next start's time is lost
        files.say_once(f'records cache {root}', (
            f'warning: {path}: the records cache could not be written ({type(e).__name__}: '
            f'{str(e)[:200]}); the next start reads every record again '
            f'(config.data.cache_dir names another place); said once for this cache'))
    return result


def _read(entry) -> dict:
    with np.load(io.BytesIO(entry.read_bytes()), allow_pickle=False) as found:
        result = json.loads(str(found[_META]))
        result.update({name: found[name] for name in found.files if name != _META})
    return result


def _write(entry, result: dict) -> None:
    arrays = {k: np.asarray(v) for k, v in result.items() if isinstance(v, np.ndarray)}
    meta = {k: v for k, v in result.items() if k not in arrays}
    buffer = io.BytesIO()
    np.savez(buffer, **{_META: np.array(json.dumps(meta, sort_keys=True))}, **arrays)
    entry.parent.mkdir(parents=True, exist_ok=True)
    # A temp name of its own per writer: every process of a job may write the same entry.
    tmp = entry.parent / f'{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}'
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(entry)
