"""What one pass over every record of a split found, kept so that the next start need not
read them all again.

The classifier and translation tasks read every record of a split when they start: to
leave out those with an empty text (a blank line, a bad record), to digest what the rest
hold (a resume on edited files stops: loaders.source_id), to list the classes, and to
find the longest text in tokens. At a million records that is about 10 s of Python per
process and split (2-core host), at tens of millions minutes, at every start, resume and
evaluation. The first pass keeps its result under ROOT/records/KEY.npz, KEY a hash of

  the records: a user's files' paths, sizes and mtimes (a stat, as the token cache is
  keyed) and which of their records the split holds; else the split's identity
  (loaders.source_id: a tfds split's, a subset's fingerprint or picks)
  the pass: what it reads and how (the keys, the tokenizer)

so an edited file, another split or another tokenizer is another entry, never a stale
one. An entry is written whole (a temp file, then a rename); one that cannot be read is
computed again and a note says so. ROOT may be a bucket (gs://...): entries are small.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import uuid
import zipfile
from collections.abc import Callable

import numpy as np

VERSION = 1
FOLDER = 'records'

# The JSON part of an entry, beside its arrays in the .npz.
_META = 'meta.json'


def identity(records) -> dict | None:
    """What `records` are, found without reading them; None where nothing tells (a
    list in memory: nothing is kept for it)."""
    from attention_jax.data import files, loaders
    if isinstance(records, files.FileDocuments):
        corpus = records.corpus
        members = hashlib.sha256(str(len(records)).encode())
        if records.indices is not None:
            members.update(np.ascontiguousarray(records.indices, np.int64).tobytes())
        return {'files': [[f.path, *_stat(f.path)] for f in corpus.files],
                'records': members.hexdigest()[:16], 'fields': list(corpus.fields),
                'integers': list(corpus.integers), 'max_bad_records': corpus.bad.limit}
    found = loaders.source_id(records)
    return {'source': found, 'count': len(records)} if found else None


def _stat(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


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
    a dict of JSON values and numpy arrays. root None: computed, nothing kept."""
    path = entry_path(root, records, what) if root else None
    if path is None:
        return compute()
    from etils import epath
    entry = epath.Path(path)
    if entry.exists():
        try:
            return _read(entry)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            print(f'note: {path}: a damaged entry of the records cache ({e}); the records '
                  f'are read again', file=sys.stderr)
    result = compute()
    try:
        _write(entry, result)
    except OSError as e:  # the run goes on; only the next start's time is lost
        print(f'warning: {path}: the records cache could not be written ({e}); the next '
              f'start reads every record again (config.data.cache_dir names another place)',
              file=sys.stderr)
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
