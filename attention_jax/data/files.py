"""Your own text, read from files: a random-access source of documents.

  splits = file_splits('~/corpus/**/*.txt,data/*.jsonl.zst')   # {'train': src, 'validation': src}
  src = get_dataset('files', 'train', files='data/*.parquet', text_key='content')
  len(src), src[0]                  # {'id': b'shard-00.parquet:0', 'text': b'...'} (UTF-8)

From the command line: `--config.data.name=files --config.data.files=GLOBS`.

Formats (by the file name's ending):
  .txt .md .py                one document per file (undecodable bytes become U+FFFD);
                              .txt also as .txt.gz, .txt.zst
  .jsonl .jsonl.gz .jsonl.zst one JSON object per line, the document in `text_key`;
                              blank lines are skipped
  .parquet                    one document per row, in the column `text_key`
  .csv .tsv (also .gz, .zst)  one document per row, in the column `text_key` named by the
                              header row (CSV: quoted fields may span lines, a quote that
                              never closes is a bad record; TSV: a row a line, a field
                              unquoted only as csv or pandas quote it, so a field they
                              quoted over a line break is rows of the pieces, those of
                              another width bad records saying so); blank lines are
                              skipped; a whole number written as a float (5.0) in an
                              integer field reads as the integer, as in JSONL
`files` is a comma-separated list of globs (`**` recurses, `~` expands; a directory
stands for every file of these formats under it).

Splits: 'train' and 'validation'. With `eval_files`, train is every document of `files`
and validation every document of `eval_files` (a file in both is an error). Without,
a document goes to validation when a stable hash of its identity (file, plus line or
row number) falls below `eval_fraction`: the same document always lands in the same
split, whatever else the corpus holds or the order the globs were given in. A file's
identity is its path relative to the fixed part of the glob that found it
(`~/corpus/**/*.txt` -> `sub/a.txt`), so moving the corpus keeps its splits.

Laziness: start-up lists the files and indexes them (byte offsets of the lines of a
plain .jsonl, .csv or .tsv, the line offsets of a compressed one after decompressing it
once, the row-group sizes of a .parquet: no parquet data is read). `src[i]` then reads
one line (plain .jsonl, .csv, .tsv), one row group (.parquet, the last one kept), or the
whole decompressed file (.gz/.zst; decompressed files and row groups are kept up to
CACHE_BYTES: a global shuffle over more than that decompresses a file almost every
record, slow, and said; the prepared token cache of issue #26 is the fast path for big
compressed corpora).

Pairs (a translation's source and target sentences): `fields=('en', 'fr')` reads those
two keys of each .jsonl record or columns of each .parquet, .csv or .tsv row, and a record is
{'id': ..., 'en': UTF-8 bytes, 'fr': UTF-8 bytes} (text files hold no fields). Labelled
texts likewise: `fields=('text', 'label'), integer_fields=('label',)`, where the label may
also be an integer or a boolean (read as its text: '3', 'true').

Bad input is one line naming the file (FilesError): a glob that matches nothing, an
unsupported file type, a jsonl or parquet whose records lack `text_key` (with the keys
they have), an unreadable, truncated or corrupt file. A bad record inside a good file
(a line that is not JSON, a value that is not a string) is skipped (it reads as an
empty document) with a counted warning on stderr; past `max_bad_records` it is an error.
A compressed text file (.txt.gz, .txt.zst) is one document, so one that cannot be
decompressed is such a bad record, as a text file of NUL bytes is.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import dataclasses
import functools
import glob as glob_lib
import gzip
import hashlib
import json
import math
import os
import re
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from attention_jax.errors import UserError

TEXT_SUFFIXES = ('.txt', '.md', '.py', '.txt.gz', '.txt.zst')
JSONL_SUFFIXES = ('.jsonl', '.jsonl.gz', '.jsonl.zst')
# Tables whose header row names the columns: CSV (RFC 4180: a quoted field may hold the
# delimiter, doubled quotes and line breaks) and TSV (the IANA form: a record a line,
# fields split at tabs; a field unquoted only where csv or pandas quoted it, _tsv_field).
TABLE_SUFFIXES = ('.csv', '.tsv', '.csv.gz', '.csv.zst', '.tsv.gz', '.tsv.zst')
SUFFIXES = (*TEXT_SUFFIXES, *JSONL_SUFFIXES, '.parquet', *TABLE_SUFFIXES)
SPLITS = ('train', 'validation')
_CHUNK = 1 << 24  # bytes read at a time while indexing


class FilesError(UserError, ValueError):
    """A corpus file that cannot be used as asked; the message names the file."""


class NoFilesError(FilesError, FileNotFoundError):
    """A glob of `files` or `eval_files` that matches no file."""


def _format(path: str) -> str | None:
    name = path.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


# ============================================================================ listing files
def _glob_base(pattern: str) -> str:
    """The fixed leading directories of a glob: ids are paths relative to it."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if glob_lib.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or ('' if not pattern.startswith(os.sep) else os.sep)


def refuse_url(value: str, arg: str, what: str, error: type = None) -> None:
    """One line for an object-store URL (gs://, s3://...) where local or mounted paths are
    read: it was globbed as a local path and said to match nothing (files that are
    there), or to be a folder that does not exist, 'moved?'."""
    if '://' in str(value):
        flag = f'--{arg}' if arg.startswith('config.') else arg
        raise (error or FilesError)(f'{flag}={value!r}: {what} in object storage are not read here; '
                         f'valid: local paths, or the bucket mounted as a folder (gcsfuse, '
                         f'mountpoint-s3)')


def list_files(spec: str | Sequence[str], arg: str = 'files',
               max_files: int = 0) -> list[tuple[str, str]]:
    """(identity, absolute path) of every file the globs of `spec` match, sorted by path.

    NoFilesError names a glob that matches nothing; FilesError a matched file of a type
    this source does not read."""
    globs = [g.strip() for g in (spec.split(',') if isinstance(spec, str) else spec)]
    globs = [g for g in globs if g]
    if not globs:
        raise NoFilesError(f'{arg}={spec!r}: no glob given; valid: comma-separated globs of '
                           f'{", ".join(SUFFIXES)} files, e.g. {arg}=~/corpus/**/*.txt')
    found: dict[str, tuple] = {}  # real path -> (len(identity), identity, path)
    aliases = set()
    # A folder's real path once (each file's realpath is an lstat per part of its path).
    real_dir = functools.lru_cache(maxsize=None)(os.path.realpath)
    for pattern in globs:
        refuse_url(pattern, arg, 'files')
        full = os.path.expanduser(pattern)
        if os.path.isdir(full):  # a directory: every file of a known format under it
            # escaped: a folder named "corpus [2024]" is a path, not a character class
            under = [p for p in glob_lib.glob(os.path.join(glob_lib.escape(full), '**', '*'),
                                              recursive=True) if os.path.isfile(p)]
            base, paths = full, [p for p in under if _format(p)]
            others = sorted(os.path.relpath(p, full) for p in under if not _format(p))
            shown = ', '.join(others[:3]) + (', ...' if len(others) > 3 else '')
            if others and paths:  # said, not dropped in silence
                say_once(f'others:{full}', f'note: {arg}={pattern!r}: {len(others)} file'
                         f'{"s" if len(others) > 1 else ""} of other types left out: {shown} '
                         f'(read: {", ".join(SUFFIXES)})')
            elif others:
                raise FilesError(f'{arg}={spec!r}: the directory {pattern!r} holds no file '
                                 f'this source reads ({len(others)} of other types: {shown}); '
                                 f'valid: {", ".join(SUFFIXES)}')
        elif os.path.isfile(full):  # a file by its name, brackets and all
            base, paths = os.path.dirname(full), [full]
        else:
            base, paths = _glob_base(full), glob_lib.glob(full, recursive=True)
        paths = [p for p in paths if os.path.isfile(p)]
        if not paths:
            where = '' if os.path.isabs(full) else f' (relative globs start in {os.getcwd()})'
            # A trained run's files may have moved since: the flag that says where to.
            moved = (f'; moved? give where they are now, --{arg}=GLOBS'
                     if arg.startswith('config.') else '')
            raise NoFilesError(f'{arg}={spec!r}: the glob {pattern!r} matches no file{where}'
                               f'{moved}')
        for p in paths:
            if _format(p) is None:
                raise FilesError(f'{arg}: {p} (matched by {pattern!r}) is not a file type this '
                                 f'source reads; valid: {", ".join(SUFFIXES)}')
            rel = (os.path.relpath(p, base) if base else os.path.normpath(p)).replace(os.sep, '/')
            # One file once, however many globs or links reach it (a link back up, `up ->
            # ..`, listed a folder's files dozens of times, in both splits), under the
            # shortest of its names: the split hashes it, so not the first glob's.
            named = (len(rel), rel, os.path.abspath(p))
            real = (os.path.realpath(p) if os.path.islink(p) else
                    os.path.join(real_dir(os.path.dirname(p)), os.path.basename(p)))
            if real in found:
                aliases.add(real)
            found[real] = min(found.get(real, named), named)
    if aliases:
        say_once(f'aliases:{spec}', f'note: {arg}={spec!r}: {len(aliases)} file'
                 f'{"s" if len(aliases) > 1 else ""} reached by more than one glob or link '
                 f'(e.g. {found[min(aliases)][1]}); each read once')
    files = [(ident, path) for _, ident, path in sorted(found.values(), key=lambda e: e[2])]
    return files[:max_files] if max_files else files


# ================================================================================= indexing
@dataclasses.dataclass
class _File:
    """One indexed file: `count` documents; where each starts (jsonl) or the row groups."""
    path: str
    ident: str
    format: str
    count: int = 1
    starts: np.ndarray | None = None  # jsonl: byte offset of each document's line
    ends: np.ndarray | None = None
    lines: np.ndarray | None = None  # jsonl: its 1-based line number (identity, messages)
    groups: np.ndarray | None = None  # parquet: first row of each row group, then the count
    columns: tuple[str, ...] = ()  # csv/tsv: the header row's names
    # (size, mtime_ns, inode, ctime_ns) when it was indexed: what is derived from its
    # records is kept by it (records_cache); an edit that restores the size and mtime
    # (cp -p, rsync -t, os.utime) still changes the ctime.
    stat: tuple[int, ...] = ()


def _gzip_chunks(path: str) -> Iterator[bytes]:
    with gzip.open(path, 'rb') as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _zstd_chunks(path: str) -> Iterator[bytes]:
    import zstandard
    # decompressobj, not stream_reader: a reader returns a truncated frame's data silently;
    # `eof` tells a frame that ended from one that was cut off.
    dctx = zstandard.ZstdDecompressor()
    obj, fed = dctx.decompressobj(), False
    with open(path, 'rb') as f:
        while chunk := f.read(_CHUNK):
            while chunk:  # concatenated frames (pzstd, appended files): one object each
                fed = True
                out = obj.decompress(chunk)
                if out:
                    yield out
                if obj.eof:
                    chunk, obj, fed = obj.unused_data, dctx.decompressobj(), False
                else:
                    chunk = b''
    if fed and not obj.eof:
        raise EOFError('the file ends inside a zstd frame')


def _plain_chunks(path: str) -> Iterator[bytes]:
    with open(path, 'rb') as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _chunks(fmt: str) -> Callable[[str], Iterator[bytes]]:
    """What reads a file of format `fmt` as a stream of its (decompressed) bytes."""
    return (_gzip_chunks if fmt.endswith('.gz') else _zstd_chunks if fmt.endswith('.zst')
            else _plain_chunks)


def _compressed(fmt: str) -> bool:
    return fmt.endswith(('.gz', '.zst'))


def _compression_name(fmt: str) -> str:
    return 'gzip file' if fmt.endswith('.gz') else 'zstd file' if fmt.endswith('.zst') else 'file'


def _stream_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A byte stream's lines, each with its line break (the last one maybe without)."""
    carry = b''
    for chunk in chunks:
        lines = (carry + chunk).split(b'\n')
        carry = lines.pop()
        for line in lines:
            yield line + b'\n'
    if carry:
        yield carry


def _span(path: str, fmt: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file's (decompressed) stream, read up to `end` only."""
    if not _compressed(fmt):
        with open(path, 'rb') as fh:
            return os.pread(fh.fileno(), end - start, start)
    read = bytearray()
    for chunk in _chunks(fmt)(path):
        read += chunk
        if len(read) >= end:
            break
    return bytes(read[start:end])


def _corrupt_errors() -> tuple[type[BaseException], ...]:
    """What decompressing a truncated or corrupt .gz or .zst raises (gzip's own OSError
    is BadGzipFile)."""
    import zstandard
    return (EOFError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError)


def _decompression_errors() -> tuple[type[BaseException], ...]:
    return (*_corrupt_errors(), OSError)


FIRST_RECORDS = 20  # a file's records whose keys tell whether text_key is its key
_WHITE_SPACE = np.frombuffer(b' \t\r\x0b\x0c', np.uint8)  # what bytes.strip() takes (and \n)


def _index_lines(chunks: Iterator[bytes]):
    """(starts, ends, line numbers, the first FIRST_RECORDS lines) of the non-blank lines
    of a stream."""
    starts, ends, lines, first = [], [], [], []
    base, line, carry = 0, 1, b''  # offset of buf[0]; the line number it starts

    def keep(buf, s, e, first_line):
        blank = np.zeros(len(s), bool)
        # Only a line this short, or one that starts with white space, can be blank (a
        # JSON object is rarely this short): a line of 12 spaces was a bad record.
        heads = np.frombuffer(buf, np.uint8)[np.minimum(s, len(buf) - 1)] if len(buf) else s
        maybe = (e - s <= 8) | np.isin(heads, _WHITE_SPACE)
        for k in np.flatnonzero(maybe):
            blank[k] = not buf[s[k]:e[k]].strip()
        for k in np.flatnonzero(~blank)[:FIRST_RECORDS - len(first)]:
            first.append(buf[s[k]:e[k]])
        starts.append(s[~blank] + base)
        ends.append(e[~blank] + base)
        lines.append((np.arange(len(s)) + first_line)[~blank])

    for chunk in chunks:
        buf = carry + chunk if carry else chunk
        nl = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
        if len(nl):
            keep(buf, np.concatenate([[0], nl[:-1] + 1]), nl, line)
            cut = int(nl[-1]) + 1
            carry, base, line = buf[cut:], base + cut, line + len(nl)
        else:
            carry = buf
    if carry.strip():  # a last line without a newline
        keep(carry, np.array([0]), np.array([len(carry)]), line)
    cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)
    return cat(starts, np.int64), cat(ends, np.int64), cat(lines, np.int64), first


_NOT_JSON = object()


def _first_value(line: bytes):
    """A first record's JSON value, or _NOT_JSON (a bad record later)."""
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return _NOT_JSON


def _check_first_records(path: str, first: list[bytes], fields, integers, hint: str) -> None:
    """The first records tell a file whose records are not objects, hold the text under
    another key, or hold a value of another type under it: none of them is, has it, or
    has it as text. Each would skip every record, one bad record and a warning line each,
    before the max_bad_records error; said now in one line. One such record among others
    (a header line, a stray record) is a bad record, skipped and counted when read."""
    values = [v for v in map(_first_value, first) if v is not _NOT_JSON]
    objects = [v for v in values if isinstance(v, dict)]
    if values and not objects:
        kinds = sorted({type(v).__name__ for v in values})
        raise FilesError(f'{path}: its first records are JSON {" and ".join(kinds)} values, not '
                         f'objects; valid: one JSON object a line, with {", ".join(map(repr, fields))} '
                         f'keys')
    for key in fields:
        if objects and not any(key in obj for obj in objects):
            raise _missing_key(path, key, sorted(set().union(*objects)), hint)
        held = [obj[key] for obj in objects if obj.get(key) is not None]  # (null: missing)
        kinds = {type(v).__name__ for v in held}
        if held and not any(isinstance(_integer_text(v) if key in integers else v, str)
                            for v in held):
            what = 'text or integers' if key in integers else 'text'
            raise FilesError(f'{path}: {key!r} holds {" and ".join(sorted(kinds))} in its first '
                             f'records, not text; valid: {what} ({hint})')


def _missing_key(path: str, key: str, keys: list[str], hint: str) -> FilesError:
    return FilesError(f'{path} has no {key!r} in its records (their keys: {keys}); {hint}')


def _index(ident: str, path: str, fields: tuple[str, ...], hint: str,
           pairs: bool = False, integers: tuple[str, ...] = ()) -> _File:
    """One file indexed for reading the record keys (or parquet columns) `fields` (with
    `pairs`, several per record; those in `integers` may hold integers); `hint` says which
    setting names them, for a file that lacks one."""
    fmt = _format(path)
    st = os.stat(path)
    f = _File(path=path, ident=ident, format=fmt,
              stat=(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))
    if fmt in TEXT_SUFFIXES:
        if pairs:
            raise FilesError(f'{path}: a text file is one document; pairs ({", ".join(fields)}) '
                             f'come from .jsonl, .parquet, .csv or .tsv records holding both')
        if not os.access(path, os.R_OK):
            raise FilesError(f'{path}: cannot be read (permissions)')
        return f
    if fmt == '.parquet':
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            meta = pq.ParquetFile(path)
            names = meta.schema_arrow.names
            rows = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
        except (pa.ArrowException, OSError) as e:
            raise FilesError(f'{path}: not a readable parquet file (truncated or corrupt?): '
                             f'{e}') from None
        for key in fields:
            if key not in names:
                raise _missing_key(path, key, names, hint)
            # A column of another type would skip every row, one bad record each: its
            # schema says so now, in one line.
            kind = meta.schema_arrow.field(key).type
            if pa.types.is_dictionary(kind):  # a categorical column of strings reads as str
                kind = kind.value_type
            textual = ("is_string", "is_large_string", "is_binary", "is_large_binary",
                       "is_string_view", "is_binary_view")  # the views: pyarrow >= 16
            if key in integers and (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
                continue
            if key in integers and pa.types.is_floating(kind):  # whole floats: _integer_text
                # (pandas' integers with a missing value); a column of fractions (ratings
                # of 4.5, a regression target) would skip every row: said now, in one line
                first = (meta.read_row_group(0, columns=[key]).column(0).to_pylist()
                         if meta.num_row_groups else [])
                fraction = next((v for v in first if v is not None and math.isfinite(v)
                                 and v != int(v)), None)
                if fraction is None:
                    continue
                raise FilesError(f'{path}: column {key!r} holds {kind} values that are not '
                                 f'whole ({fraction}); valid: a string or integer column, or '
                                 f'whole numbers ({hint})')
            if not any(getattr(pa.types, name, lambda _: False)(kind) for name in textual):
                what = 'a string or integer column' if key in integers else 'a string column'
                raise FilesError(f'{path}: column {key!r} holds {kind}, not text; valid: '
                                 f'{what} ({hint})')
        f.groups = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        f.count = int(f.groups[-1])
        return f
    if fmt in TABLE_SUFFIXES:
        return _index_table(f, fields, hint)
    try:
        f.starts, f.ends, f.lines, first = _index_lines(_chunks(fmt)(path))
    except PermissionError:
        raise FilesError(f'{path}: cannot be read (permissions)') from None
    except _decompression_errors() as e:
        raise FilesError(f'{path}: truncated or corrupt {_compression_name(fmt)} ({e})') from None
    f.count = len(f.starts)
    _check_first_records(path, first, fields, integers, hint)
    return f


def _csv_module():
    """Python's csv module, its field size limit raised: a long document (an article, a
    book) in one field was a bad record past the default 128 KiB."""
    import csv
    if csv.field_size_limit() < _CSV_FIELD_LIMIT:
        csv.field_size_limit(_CSV_FIELD_LIMIT)
    return csv


_CSV_FIELD_LIMIT = 2**31 - 1


def _index_csv_records(path: str, fmt: str = '.csv'):
    """(starts, ends, line numbers) of a CSV's non-blank records, as Python's csv module
    reads them (a quoted field may hold commas, doubled quotes and line breaks; a quote
    inside an unquoted field is text): the reader takes the file a line at a time and
    stops at each record's last line, so the lines it took say where the record lies. A
    quote left open at the end makes the lines after it one record (a bad one)."""
    csv = _csv_module()
    record = []  # (offset, length without its line break) of the lines of this record

    def lines():
        offset = 0
        for raw in _stream_lines(_chunks(fmt)(path)):
            record.append((offset, len(raw) - raw.endswith(b'\n')))
            offset += len(raw)
            yield raw.decode('utf-8', errors='replace')  # (breaks and quotes are ASCII)
    starts, ends, numbers = [], [], []
    taken = 0  # lines before this record
    rows = csv.reader(lines())
    while True:
        try:
            row = next(rows)
        except StopIteration:
            break
        except csv.Error:  # (a NUL byte, say): a record still, said bad when it is read
            row = ['']
        if row:  # ([] is a blank line)
            (first, _), (last, length) = record[0], record[-1]
            starts.append(first)
            ends.append(last + length)
            numbers.append(taken + 1)
        taken += len(record)
        record.clear()
    cat = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    return cat(starts), cat(ends), cat(numbers)


def _index_table(f: _File, fields, hint: str) -> _File:
    """A CSV's or TSV's records after its header row, which names the columns (offsets
    into the decompressed stream of a compressed one). An empty file (a shard of a split
    dump) holds no records."""
    csv = _csv_module()
    try:
        if _table_kind(f.format) == '.csv':
            starts, ends, lines = _index_csv_records(f.path, f.format)
        else:
            starts, ends, lines, _ = _index_lines(_chunks(f.format)(f.path))
        if not len(starts):
            f.starts, f.ends, f.lines, f.count = starts, ends, lines, 0
            return f
        header = _span(f.path, f.format, int(starts[0]), int(ends[0]))
    except PermissionError:
        raise FilesError(f'{f.path}: cannot be read (permissions)') from None
    except _decompression_errors() as e:
        raise FilesError(f'{f.path}: truncated or corrupt {_compression_name(f.format)} '
                         f'({e})') from None
    text = header.decode('utf-8-sig', errors='replace').rstrip('\r')
    try:
        f.columns = tuple(_table_row(text, f.format))
    except csv.Error as e:
        raise FilesError(f'{f.path}: its header row is no CSV row ({e})') from None
    for key in fields:
        if key not in f.columns:
            raise FilesError(f'{f.path}: its header row names no column {key!r} (its columns: '
                             f'{list(f.columns)}); {hint}, or give the file a header row '
                             f'naming the columns')
        if f.columns.count(key) > 1:
            raise FilesError(f'{f.path}: its header row names the column {key!r} '
                             f'{f.columns.count(key)} times; valid: one column of each name')
    f.starts, f.ends, f.lines = starts[1:], ends[1:], lines[1:]
    f.count = len(f.starts)
    return f


def _table_row(text: str, fmt: str) -> list[str]:
    """One CSV record's fields (quoted ones unquoted, as Python's csv module reads them),
    or a TSV line's: split at tabs, a field unquoted only where a writer quoted it (csv's
    and pandas' tab-separated output: wrapped in quotes, each of its own quotes doubled);
    another quote is text (a sentence that starts with one)."""
    if _table_kind(fmt) == '.tsv':
        return [_tsv_field(field) for field in text.split('\t')]
    return next(_csv_module().reader([text]), [])


# Why a TSV row holds half a quoted field: the writer (csv, pandas) quoted a field with a
# line break, which a TSV, read a row a line, cannot hold.
_TSV_BREAK = ('a quoted field with a line break? a TSV is read a row a line, so the '
              "field's other lines are rows too, read where they have the header's width: "
              'write such fields as CSV')


def _quote_left_open(text: str) -> bool:
    """Whether a CSV record ends inside a quoted field (Python's csv module, lenient, reads
    such a quote to the end of the file as one field): a line after it is then taken into
    the same record."""
    return len(list(_csv_module().reader([text + '\n', 'x\n']))) == 1


def _table_kind(fmt: str) -> str:
    """'.csv' or '.tsv', of a table's format compressed or not."""
    return fmt[:4]


def _tsv_field(field: str) -> str:
    inner = field[1:-1]
    if (len(field) >= 2 and field[0] == field[-1] == '"' and '""' in inner
            and '"' not in inner.replace('""', '')):
        return inner.replace('""', '"')
    return field


# What names the key of a document's text, for a file whose records lack it.
_TEXT_HINT = 'set {arg}text_key to the one that holds the text'


# ================================================================================== reading
# Bytes of decompressed files and parquet row groups a reader keeps, the latest used
# first (at least the last one read, whatever its size). A shuffled pass over records of
# several compressed files reads each file once where they fit: two files of pairs, 8.7 MB
# each decompressed, trained 17x slower as .csv.gz than as .csv when one was kept.
CACHE_BYTES = 256 << 20


def _nbytes(value) -> int:
    """Bytes of what a reader keeps: a decompressed file, or a row group's columns."""
    return len(value) if isinstance(value, bytes) else sum(c.nbytes for c in value)


class _Reader:
    """Reads documents of indexed files, keeping decompressed files and row groups up to
    CACHE_BYTES (the least recently used go first)."""

    def __init__(self):
        self._cache: collections.OrderedDict = collections.OrderedDict()  # key -> (value, bytes)
        self._lock = threading.Lock()  # read threads share a reader
        self._open = (None, None)  # (path, open file) of the last plain .jsonl

    def _cached(self, key, load):
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        value = load()  # (outside the lock: two threads may load one file; both get it)
        with self._lock:
            self._cache[key] = (value, _nbytes(value))
            total = sum(size for _, size in self._cache.values())
            while total > CACHE_BYTES and len(self._cache) > 1:
                total -= self._cache.popitem(last=False)[1][1]
        return value

    def line(self, f: _File, k: int) -> bytes:
        start, end = int(f.starts[k]), int(f.ends[k])
        try:
            if not _compressed(f.format):  # plain .jsonl, .csv, .tsv: read in place
                path, handle = self._open
                if path != f.path:
                    handle = open(f.path, 'rb')  # closed when the next one replaces it
                    self._open = (f.path, handle)
                return os.pread(handle.fileno(), end - start, start)  # no shared position
            data = self._cached((f.path, None), lambda: b''.join(_chunks(f.format)(f.path)))
            return data[start:end]
        except (*_decompression_errors(),) as e:
            raise FilesError(f'{f.path}: cannot be read any more ({e})') from None

    def row(self, f: _File, k: int, fields: tuple[str, ...]) -> list:
        """Row k's values of the columns `fields`."""
        g = int(np.searchsorted(f.groups, k, side='right')) - 1

        def load():
            import pyarrow as pa
            import pyarrow.parquet as pq
            try:
                table = pq.ParquetFile(f.path).read_row_group(g, columns=list(fields))
                return [table.column(key) for key in fields]
            except (pa.ArrowException, OSError) as e:
                raise FilesError(f'{f.path}: row group {g} cannot be read (corrupt?): '
                                 f'{e}') from None
        at = k - int(f.groups[g])
        return [column[at].as_py() for column in self._cached((f.path, g), load)]

    def text_file(self, f: _File) -> tuple[bytes, int, int]:
        """The file's text as UTF-8, how many of its bytes were not UTF-8 (each read as
        U+FFFD), and how many bytes it had; a compressed one's, decompressed (_Corrupt if
        it cannot be)."""
        try:
            raw = b''.join(_chunks(f.format)(f.path))
        except _corrupt_errors() as e:  # (the disk's or network's OSError is no corrupt file)
            raise _Corrupt(f'truncated or corrupt {_compression_name(f.format)} ({e})') from None
        except OSError as e:
            raise FilesError(f'{f.path}: cannot be read any more ({e})') from None
        # A UTF-8 byte order mark (Windows editors write one) is no text: as a CSV's
        # header and a JSON line are read, it goes (it was three tokens of a byte BPE).
        raw = raw[3:] if raw.startswith(codecs.BOM_UTF8) else raw
        try:
            return raw.decode('utf-8').encode('utf-8'), 0, len(raw)
        except UnicodeDecodeError:
            text = raw.decode('utf-8', errors='replace')
            # Each invalid byte became a U+FFFD; those the file itself held (valid UTF-8
            # for U+FFFD) are the ones a decode that drops invalid bytes still has.
            invalid = text.count('\ufffd') - raw.decode('utf-8', errors='ignore').count('\ufffd')
            return text.encode('utf-8'), invalid, len(raw)


class _Corrupt(Exception):
    """A compressed text file that cannot be decompressed: a bad record, skipped."""


# A text file more than this share of whose bytes are not UTF-8 is no text (random or
# compressed bytes without a NUL: about half their bytes): skipped as a bad record. Under
# it (a Latin-1 text's accents, a few in a hundred; a stray byte) the text is kept, each
# such byte read as U+FFFD, and said once.
MOST_INVALID = 0.25


_SAID: set[str] = set()


def say_once(key: str, message: str) -> None:
    """A warning or note (about a file, a kind of file), once per process under `key`: a
    file is read again each epoch, and by every reader of a split."""
    if key not in _SAID:
        _SAID.add(key)
        print(message, file=sys.stderr, flush=True)


class _BadRecords:
    """Counts the distinct skipped records across a corpus's splits (a bad line read again,
    in the next epoch or by another split's pass, is neither counted nor reported twice);
    too many is an error."""

    def __init__(self, limit: int, arg: str):
        self.limit, self.arg, self.seen = limit, arg, set()
        self._watch = threading.local()  # this thread's log while it watches (`watching`)

    def __getstate__(self):  # (a thread's log stays in its process: workers get none)
        return {k: v for k, v in self.__dict__.items() if k != '_watch'}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._watch = threading.local()

    @contextlib.contextmanager
    def watching(self):
        """A list of every record this thread skips inside, one seen before too: a token
        cache's shard counts the bad records of its range, some of which the tokenizer's
        training read first (and two threads may prepare shards at once)."""
        self._watch.log = log = []
        try:
            yield log
        finally:
            self._watch.log = None

    @property
    def count(self) -> int:
        return len(self.seen)

    def recount(self, found: Sequence[str]) -> None:
        """Counts the bad records an earlier pass over these records found and reported
        (records_cache keeps where they are): the limit holds as if they were read."""
        self.seen.update(found)
        if self.count > self.limit:
            shown = sorted(self.seen)
            where = ', '.join(shown[:3]) + (', ...' if len(shown) > 3 else '')
            raise FilesError(f'{self.count} bad records in {self.arg}files (found when they '
                             f'were last read: {where}), more than {self.arg}max_bad_records='
                             f'{self.limit}: fix the files or raise it')

    def skip(self, where: str, why: str) -> None:
        log = getattr(self._watch, 'log', None)
        if log is not None:
            log.append(where)
        if where in self.seen:
            return
        self.seen.add(where)
        if self.count > self.limit:
            raise FilesError(f'{where}: {why}; that is {self.count} bad record'
                             f'{"s" * (self.count > 1)}, more than {self.arg}max_bad_records='
                             f'{self.limit}: fix the files or raise it')
        print(f'warning: {where}: {why}; skipped (bad record {self.count}, at most '
              f'{self.limit})', file=sys.stderr, flush=True)


def _integer_text(value):
    """An integer or boolean as its text (booleans as JSON spells them), a whole float as
    its integer's (1.0 -> '1': pandas writes an integer column with a missing value as
    floats); else `value`."""
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and value == int(value):
        return str(int(value))
    return str(value) if isinstance(value, (int, np.integer)) else value


_WHOLE_NUMBER = re.compile(r'\s*([+-]?\d+)\.0+\s*', re.ASCII)


def _whole_number_text(text: str) -> str:
    """A table cell of a whole number written as a float ('5.0', as pandas writes an
    integer column with a missing value) as its integer's text, as _integer_text reads
    the number 5.0 in JSONL ('007.0' -> '7'); any other text as it is. For the fields
    that may hold integers (a class label) only."""
    whole = _WHOLE_NUMBER.fullmatch(text)
    return str(int(whole.group(1))) if whole else text


class Corpus:
    """The indexed files of one `files` spec, documents numbered in file order. A record
    is the document under 'text' (read from `fields` = (text_key,)), or with `pairs` each
    of `fields` under its own name; an integer or boolean under one of `integers` reads
    as its text ('3', 'true': a class label)."""

    def __init__(self, files: list[_File], fields: tuple[str, ...], bad: _BadRecords,
                 pairs: bool = False, integers: tuple[str, ...] = ()):
        self.files, self.fields, self.bad, self.pairs = files, fields, bad, pairs
        self.integers = integers
        self.first = np.concatenate([[0], np.cumsum([f.count for f in files])]).astype(np.int64)
        self._reader = _Reader()

    def __len__(self) -> int:
        return int(self.first[-1])

    def __getstate__(self):  # workers get the index, not the cached file
        return {**self.__dict__, '_reader': None}

    def __setstate__(self, state):
        self.__dict__.update(state, _reader=_Reader())

    def document(self, n: int) -> dict[str, bytes]:
        i = int(np.searchsorted(self.first, n, side='right')) - 1
        f, k = self.files[i], n - int(self.first[i])
        if f.format in TEXT_SUFFIXES:
            try:
                text, invalid, size = self._reader.text_file(f)
            except _Corrupt as e:
                self.bad.skip(f.path, str(e))
                text, invalid, size = b'', 0, 0
            if b'\x00' in text:  # a binary file under a text suffix: skipped and counted
                self.bad.skip(f.path, 'holds NUL bytes: a binary file, or text not in UTF-8 '
                                      '(UTF-16/32: convert it to UTF-8)')
                text = b''
            elif invalid > MOST_INVALID * max(size, 1):  # of the file's bytes, not the
                # text's (each U+FFFD is 3 bytes there: the share never passed a third)
                self.bad.skip(f.path, f'{invalid} of its bytes are not UTF-8: not text, or text '
                                      f'in another encoding (convert it, e.g. iconv -t utf-8)')
                text = b''
            elif invalid:
                say_once(f.path, f'warning: {f.path}: {invalid} byte(s) not UTF-8, each read as '
                                  f'U+FFFD (text in another encoding? convert it, e.g. iconv -f '
                                  f'latin1 -t utf-8)')
            return {'id': f.ident.encode(), 'text': text}
        if f.format == '.parquet':
            where = f'{f.path}: row {k}'
            values = self._reader.row(f, k, self.fields)
            ident = f'{f.ident}:{k}'
        elif f.format in TABLE_SUFFIXES:
            where = f'{f.path}:{int(f.lines[k])}'
            values = self._table_values(f, self._reader.line(f, k), where, k == f.count - 1)
            values = [_whole_number_text(v) if key in self.integers and v is not _BAD else v
                      for key, v in zip(self.fields, values)]
            ident = f'{f.ident}:{int(f.lines[k])}'
        else:
            where = f'{f.path}:{int(f.lines[k])}'
            values = self._json_values(self._reader.line(f, k), where)
            ident = f'{f.ident}:{int(f.lines[k])}'
        values = [v.decode('utf-8', errors='replace') if isinstance(v, bytes) else
                  _integer_text(v) if key in self.integers else v
                  for key, v in zip(self.fields, values)]
        wrong = next(((key, v) for key, v in zip(self.fields, values) if not isinstance(v, str)),
                     None)
        if wrong is not None:  # the whole record is skipped: a pair needs both sides
            key, value = wrong
            if value is None or (isinstance(value, float) and math.isnan(value)):
                self.bad.skip(where, f'{key!r} has no value ({value})')
            elif isinstance(value, (float, np.floating)) and key in self.integers:
                # (a half-star rating, 2.5: a class named by a number with a fraction)
                self.bad.skip(where, f'{key!r} is the float {value!r}, not text or an '
                                     f'integer; a class named so is written as text ("{value}")')
            elif value is not _BAD:
                self.bad.skip(where, f'{key!r} is {type(value).__name__}, not text'
                              + (' or an integer' if key in self.integers else ''))
            values = [''] * len(self.fields)
        texts = [v.encode('utf-8', errors='replace') for v in values]
        names = self.fields if self.pairs else ('text',)
        return {'id': ident.encode(), **dict(zip(names, texts))}

    def _table_values(self, f: _File, record: bytes, where: str, last: bool) -> list:
        """A CSV or TSV record's values of `fields` (_BAD each if it is a bad record);
        `last`: the file's last record (only it can run to the end inside a quote)."""
        csv = _csv_module()
        try:  # (a record not in UTF-8 is a bad one, as a JSONL line is)
            text = record.decode('utf-8').rstrip('\r')
            if last and _table_kind(f.format) == '.csv' and _quote_left_open(text):
                lines = text.count('\n') + 1
                self.bad.skip(where, 'a quote opened in it never closes, so the rest of the file'
                                     + (f' ({lines} lines)' if lines > 1 else '')
                                     + ' was read as this one record')
                return [_BAD] * len(self.fields)
            row = _table_row(text, f.format)
        except UnicodeDecodeError as e:
            self.bad.skip(where, f'not UTF-8 ({e.reason} at byte {e.start}; a file in another '
                                 f'encoding: convert it, e.g. iconv -f cp1252 -t utf-8)')
            return [_BAD] * len(self.fields)
        except csv.Error as e:
            self.bad.skip(where, f'not a CSV record ({e})')
            return [_BAD] * len(self.fields)
        if len(row) != len(f.columns):
            # A writer's quoted field with a line break spans lines, which a TSV, read a row
            # a line, cannot hold: its pieces are rows, an odd quote each, of another width
            # (said so here) or, by chance, of the header's (read, a stray quote in them).
            broken = _table_kind(f.format) == '.tsv' and text.count('"') % 2
            self.bad.skip(where, f'{len(row)} fields, where the header row names '
                                 f'{len(f.columns)}' + (f' ({_TSV_BREAK})' if broken else ''))
            return [_BAD] * len(self.fields)
        return [row[f.columns.index(key)] for key in self.fields]

    def _json_values(self, line: bytes, where: str) -> list:
        """The record's values of `fields` (_BAD each if the line is a bad record)."""
        bad = [_BAD] * len(self.fields)
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            self.bad.skip(where, f'not a JSON line ({e})')
            return bad
        if not isinstance(obj, dict):
            self.bad.skip(where, f'a JSON {type(obj).__name__}, not an object')
            return bad
        missing = [key for key in self.fields if key not in obj]
        if missing:
            self.bad.skip(where, f'no {missing[0]!r} (keys: {sorted(obj)})')
            return bad
        return [obj[key] for key in self.fields]

    def keys(self) -> np.ndarray:
        """A stable 64-bit hash of every document's identity (file, line or row number)."""
        out = []
        for f in self.files:
            file_key = np.uint64(stable_hash64(f.ident))
            if f.format in TEXT_SUFFIXES:
                numbers = np.zeros(1, np.uint64)
            elif f.format == '.parquet':
                numbers = np.arange(f.count, dtype=np.uint64)
            else:
                numbers = f.lines.astype(np.uint64)
            out.append(_mix(file_key ^ _mix(numbers + np.uint64(1))))
        return np.concatenate(out) if out else np.zeros(0, np.uint64)


_BAD = object()  # a record already counted as bad


def held_out(keys, eval_fraction: float, noun: str, arg: str, alternative: str) -> np.ndarray:
    """Which of the items with these 64-bit hash `keys` are held out: those whose hash,
    as a uniform draw in [0, 1) (its top 53 bits), falls below `eval_fraction`. A small
    set may draw nothing on one side: the item nearest the threshold moves across (still
    a function of the hashes only), and a note says so, naming `arg` and `alternative`."""
    u = (np.asarray(keys, np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    held = u < eval_fraction
    moved = 'validation' if not held.any() else 'train' if held.all() else None
    if not held.any():
        held[np.argmin(u)] = True
    if held.all():
        held[np.argmax(u)] = False
    if moved:
        print(f'note: {arg}={eval_fraction} of {len(u)} {noun} left the {moved} split empty: '
              f'it gets the one nearest the threshold (or give {alternative})', file=sys.stderr)
    return held


def stable_hash64(key: str) -> int:
    """A 64-bit hash of `key` that depends only on it (not on Python's hash seed)."""
    return int.from_bytes(hashlib.md5(key.encode('utf-8')).digest()[:8], 'little')


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014): integer arithmetic, so the same on
    every machine, and vectorised, so a million documents hash in milliseconds."""
    with np.errstate(over='ignore'):
        x = np.asarray(x, np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class FileDocuments:
    """The documents of one split: `len`, `[i]` -> {'id': bytes, 'text': UTF-8 bytes}
    (with `fields`, each field's text under its name)."""

    def __init__(self, corpus: Corpus, indices: np.ndarray | None = None):
        self.corpus = corpus
        self.indices = None if indices is None else np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.corpus) if self.indices is None else len(self.indices)

    def __getitem__(self, i) -> dict[str, bytes]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f'document {i} of a split of {len(self)}')
        return self.corpus.document(i if self.indices is None else int(self.indices[i]))


# =================================================================================== splits
def file_splits(files: str | Sequence[str], eval_files: str | Sequence[str] = '', *,
                text_key: str = 'text', eval_fraction: float = 0.05,
                max_bad_records: int = 100, max_files: int = 0,
                arg: str = '', fields: Sequence[str] = (),
                fields_hint: str = '',
                integer_fields: Sequence[str] = (),
                held_out_only: bool = False) -> dict[str, FileDocuments]:
    """{'train': ..., 'validation': ...} sources of the documents in `files` (module
    docstring). `arg` prefixes the argument names in messages (the task passes
    'config.data.'). `fields`: records of those keys' texts instead (pairs), whose
    settings `fields_hint` names for a file that lacks one; those of `integer_fields`
    may hold integers or booleans too, read as their text (a class label).
    held_out_only: {'validation': ...} alone, of `eval_files` (which it needs): `files`
    is neither listed nor read, so a run's evaluation works where only its held-out
    files are (its training files moved, deleted or far away)."""
    if held_out_only and not eval_files:
        raise FilesError(f'{arg}eval_files is empty: the held-out split alone is the '
                         f'documents of eval_files; valid: globs of files')
    if not 0 < eval_fraction < 1:
        raise FilesError(f'{arg}eval_fraction={eval_fraction!r} is out of range; valid: '
                         f'0 < eval_fraction < 1')
    if max_bad_records < 0:
        raise FilesError(f'{arg}max_bad_records={max_bad_records!r} is out of range; '
                         f'valid: >= 0')
    if not text_key:
        raise FilesError(f"{arg}text_key='' names no key; valid: the key that holds the text")
    if any(not key for key in fields) or len(set(fields)) < len(fields):
        raise FilesError(f'fields={tuple(fields)!r}: valid: distinct, non-empty keys'
                         + (f' ({fields_hint})' if fields_hint else ''))
    # Listing is cheap; indexing is cached on what was listed (paths, sizes, mtimes).
    listed = corpus_listing(files, eval_files, max_files=max_files, arg=arg,
                            train=not held_out_only)
    read = (tuple(fields), f'set {fields_hint}' if fields_hint else 'name the keys that hold '
            'the texts', tuple(integer_fields)) if fields else (
        (text_key,), _TEXT_HINT.format(arg=arg), ())
    if held_out_only and files:  # a reader may name other eval_files than the run's: none
        # may be a training file, where those can still be listed (gone: none can be)
        try:
            trained = {p for _, p in list_files(files, f'{arg}files', max_files)}
        except FilesError as e:
            say_once(f'unchecked held-out:{files}', f'note: {arg}eval_files not checked '
                     f'against {arg}files, which cannot be listed now ({e})')
            trained = set()
        _refuse_both(trained, listed['eval_files'], arg)
    train = None if held_out_only else tuple(map(tuple, listed['files']))
    return _splits(train, tuple(map(tuple, listed['eval_files'])), read,
                   bool(fields), eval_fraction, max_bad_records, arg,
                   files if isinstance(files, str) else ','.join(files))


def corpus_listing(files: str | Sequence[str], eval_files: str | Sequence[str] = '', *,
                   max_files: int = 0, arg: str = '', train: bool = True) -> dict[str, list]:
    """{'files': [[identity, path, size, mtime_ns], ...], 'eval_files': [...]}: what the
    globs match, from a listing and a stat per file (no file is read).
    The splits are a function of it (and eval_fraction), so it keys what is derived from
    them: the indexing here, the token cache (data/token_cache.py). train=False: `files`
    is not listed ('files': [])."""
    listed = {}
    for name, spec, limit in (('files', files, max_files), ('eval_files', eval_files, 0)):
        if name == 'files' and not train:
            listed[name] = []
            continue
        found = list_files(spec, f'{arg}{name}', limit) if spec or name == 'files' else []
        stats = [(ident, path, os.stat(path)) for ident, path in found]
        # Size and modification time only: an inode or change time differs between the
        # hosts of a gcsfuse mount (their token cache keys would) and moves on a chmod or
        # a fresh copy. An edit that keeps both (touch -r) is not seen: delete the cache.
        listed[name] = [[ident, path, st.st_size, st.st_mtime_ns] for ident, path, st in stats]
    return listed


@functools.lru_cache(maxsize=4)
def _splits(train_files, eval_files, read, pairs, eval_fraction, max_bad_records, arg,
            spec) -> dict[str, FileDocuments]:
    bad = _BadRecords(max_bad_records, arg)
    fields, hint, integers = read
    corpus = lambda listed: Corpus([_index(ident, path, fields, hint, pairs, integers)  # noqa: E731
                                    for ident, path, *_ in listed], fields, bad, pairs,
                                   integers)
    def eval_corpus():
        evaluated = corpus(eval_files)
        if len(evaluated) == 0:
            raise FilesError(f'{arg}eval_files: the files hold no documents')
        return evaluated
    if train_files is None:  # file_splits(held_out_only=True)
        return {'validation': FileDocuments(eval_corpus())}
    train = corpus(train_files)
    _say_if_uncached(train.files, pairs, arg)
    if len(train) == 0:
        raise FilesError(f'{arg}files={spec!r}: the files hold no documents')
    if eval_files:
        _refuse_both({f.path for f in train.files}, eval_files, arg)
        evaluated = eval_corpus()
        return {'train': FileDocuments(train), 'validation': FileDocuments(evaluated)}
    if len(train) < 2:
        if all(size == 0 for _, _, size, *_ in train_files):  # (as the tasks word it)
            raise FilesError(f'{arg}files={spec!r}: the train split holds no text (its 1 '
                             f'document is empty); valid: documents with text')
        raise FilesError(f'{arg}files={spec!r} holds one document; a held-out split needs '
                         f'two or more, or give {arg}eval_files')
    held = held_out(train.keys(), eval_fraction, 'documents', f'{arg}eval_fraction',
                    f'{arg}eval_files')
    return {'train': FileDocuments(train, np.flatnonzero(~held)),
            'validation': FileDocuments(train, np.flatnonzero(held))}


def _say_if_uncached(indexed: list[_File], records: bool, arg: str) -> None:
    """A note where records of compressed files (read one by one, in a shuffled order, by
    the pair and label tasks) decompress to more than a reader keeps: a record is read by
    decompressing its whole file, so such a pass is slow."""
    packed = [f for f in indexed if _compressed(f.format) and f.format not in TEXT_SUFFIXES
              and f.count]
    total = sum(int(f.ends[-1]) for f in packed)
    if records and len(packed) > 1 and total > CACHE_BYTES:
        say_once(f'uncached:{[f.path for f in packed]}', f'note: {arg}files: {len(packed)} '
                 f'compressed files of records decompress to {total / 2**20:,.0f} MiB, more '
                 f'than a reader keeps ({CACHE_BYTES >> 20} MiB): a record is read by '
                 f'decompressing its whole file, so a shuffled pass is slow; decompress them '
                 f'(gunzip, zstd -d) to read them in place')


def _refuse_both(trained: set[str], eval_listed, arg: str) -> None:
    # By real path: one file under two names (a link) is one document all the same.
    real = {os.path.realpath(p) for p in trained}
    both = sorted(path for _, path, *_ in eval_listed if os.path.realpath(path) in real)
    if both:
        raise FilesError(f'{both[0]} is in both {arg}files and {arg}eval_files: a '
                         f'document must not be both trained and evaluated on')


def get_split(split: str, **options) -> FileDocuments:
    """One split of `file_splits(**options)`: 'train' or 'validation'."""
    if split not in SPLITS:
        raise FilesError(f"the files source has no split {split!r}; valid: {list(SPLITS)}")
    return file_splits(**options)[split]
