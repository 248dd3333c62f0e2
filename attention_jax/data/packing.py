"""Sequence packing: variable-length documents in fixed-length rows [R, L].

Each row carries three int32 arrays:
  tokens       the token ids, 0 (pad) after the last piece;
  segment_ids  1..n numbering the document pieces in the row, 0 for padding;
  positions    restart at 0 at the start of every piece.
Attention with `segment_ids` (a query attends only to keys of its own segment) and
position embeddings from `positions` make a packed row compute exactly what its
documents would compute one by one — without the padding waste of one document per
row (Krell et al. 2021, "Efficient sequence packing without cross-contamination").

Packing is a deterministic function of the document order, done once over a source,
so that the packed rows form a random-access source the grain loader can shuffle,
shard and resume like any other. `PackedSource` does it in memory at start-up (the
built-in and catalogue datasets); for your own files, `token_cache.TokenRows` computes
the same rows (split_documents=True) lazily from a prepared token cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

PAD_SEGMENT = 0


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int, *,
                   split_documents: bool = True, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Packs token lists into rows of `seq_len`, in order; returns arrays [R, L].

    split_documents=True (language modelling): every row is filled to the end; a
      document that does not fit in what is left of a row continues in the next row as a
      new piece (its positions restart at 0). No padding except at the very end.
    split_documents=False (MLM, sentence tasks): a document is never cut unless it is
      longer than `seq_len` (then it becomes whole-row chunks plus a remainder); a
      document that does not fit in the current row starts a new row (next-fit).
    Every token appears exactly once, in order.
    """
    if seq_len <= 0:
        raise ValueError(f'seq_len={seq_len} must be positive')
    # (row, column, document index, start in document, length) per piece.
    pieces: list[tuple[int, int, int, int, int]] = []
    docs: list[np.ndarray] = []
    row, col = 0, 0
    for d, doc in enumerate(documents):
        doc = np.asarray(doc, dtype=np.int32).reshape(-1)
        docs.append(doc)
        start = 0
        while start < len(doc):
            left = len(doc) - start
            if col == seq_len or (not split_documents and col > 0 and left > seq_len - col):
                row, col = row + 1, 0
            take = min(left, seq_len - col)
            pieces.append((row, col, d, start, take))
            col += take
            start += take
    num_rows = row + 1 if pieces else 0

    tokens = np.full((num_rows, seq_len), pad_id, np.int32)
    segment_ids = np.zeros((num_rows, seq_len), np.int32)
    positions = np.zeros((num_rows, seq_len), np.int32)
    segment_in_row = {}
    for r, c, d, s, n in pieces:
        seg = segment_in_row[r] = segment_in_row.get(r, 0) + 1
        tokens[r, c:c + n] = docs[d][s:s + n]
        segment_ids[r, c:c + n] = seg
        positions[r, c:c + n] = np.arange(n)
    return {'tokens': tokens, 'segment_ids': segment_ids, 'positions': positions}


def unpack_row(row: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The pieces of one packed row, in order (inverse of packing, for tests and viz)."""
    seg = row['segment_ids']
    return [row['tokens'][seg == s] for s in range(1, int(seg.max(initial=0)) + 1)]


class PackedSource:
    """A random-access source of packed rows built from a source of documents.

    Args:
      source: random-access source of records (e.g. `get_dataset(...)`).
      encode: record -> token ids (e.g. `lambda r: tok.encode(r['text'].decode())`).
      seq_len: L.
      eos_id: appended to every document (so a model learns where documents end).
      split_documents: see `pack_documents`.
      max_documents: pack only the first documents (smoke runs).
    Records are dicts of [L] int32 arrays: tokens, segment_ids, positions.
    """

    def __init__(self, source, encode: Callable[[dict], Sequence[int]], seq_len: int, *,
                 eos_id: int | None = None, split_documents: bool = True, pad_id: int = 0,
                 max_documents: int | None = None):
        n = len(source) if max_documents is None else min(max_documents, len(source))

        def docs():
            for i in range(n):
                ids = list(encode(source[i]))
                yield ids + [eos_id] if eos_id is not None else ids

        self._rows = pack_documents(docs(), seq_len, split_documents=split_documents,
                                    pad_id=pad_id)
        if len(self) == 0:
            raise ValueError('PackedSource: the documents contain no tokens')

    def __len__(self) -> int:
        return len(self._rows['tokens'])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in self._rows.items()}

    @property
    def num_tokens(self) -> int:
        return int((self._rows['segment_ids'] != PAD_SEGMENT).sum())
