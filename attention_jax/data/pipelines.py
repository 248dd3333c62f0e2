"""Per-task transforms that turn dataset records into model batches.

They are small frozen dataclasses rather than closures so that grain can pickle them
into worker processes. Each is `fn(record, rng) -> dict of numpy arrays`, the
`transform` a `Loader` takes; one may add `apply_batch(rows, rngs)`, the same on a
whole batch at once, which the Loader's batched path calls instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from attention_jax.data import objectives
from attention_jax.data.packing import PackedSource
from attention_jax.data.tokenization import Tokenizer


def _text(value) -> str:
    return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def label_text(value) -> str:
    """A record's class label as the class name it stands for: its text without the
    spaces around it (' neg ' is 'neg')."""
    return _text(value).strip()


@dataclasses.dataclass(frozen=True)
class EncodeText:
    """record -> token ids of record[key] (picklable, for PackedSource)."""
    tokenizer: Tokenizer
    key: str = 'text'

    def __call__(self, record) -> list[int]:
        return self.tokenizer.encode(_text(record[self.key]))


def packed_lm_source(source, tokenizer: Tokenizer, seq_len: int, *, key: str = 'text',
                     split_documents: bool = True,
                     max_documents: int | None = None) -> PackedSource:
    """Documents of `source[i][key]` tokenized, EOS-terminated (when the tokenizer has
    one), packed into rows of `seq_len`."""
    return PackedSource(source, EncodeText(tokenizer, key), seq_len,
                        eos_id=getattr(tokenizer, 'eos_id', None),
                        split_documents=split_documents, pad_id=tokenizer.pad_id,
                        max_documents=max_documents)


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """Packed row -> inputs/targets/weights (next-token prediction), with segment_ids
    and positions when packing is 'documents' (objectives.next_token_targets)."""
    packing: str = 'documents'

    def __call__(self, row, rng) -> dict[str, np.ndarray]:
        del rng
        return objectives.next_token_targets(row, self.packing)

    def apply_batch(self, rows, rngs) -> dict[str, np.ndarray]:
        """The same on rows [B, L] at once (the Loader's batched path)."""
        del rngs
        return objectives.next_token_targets(rows, self.packing)


@dataclasses.dataclass(frozen=True)
class MaskedLM:
    """Packed row -> BERT MLM example; segment ids and positions pass through."""
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    mask_rate: float = 0.15

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, mask_rate: float = 0.15) -> MaskedLM:
        return cls(tokenizer.mask_id, tokenizer.vocab_size, tuple(sorted(tokenizer.special_ids)),
                   mask_rate)

    def __call__(self, row, rng) -> dict[str, np.ndarray]:
        out = objectives.mlm_mask(row['tokens'], rng, mask_id=self.mask_id,
                                  vocab_size=self.vocab_size, special_ids=self.special_ids,
                                  mask_rate=self.mask_rate)
        return {**out, 'segment_ids': row['segment_ids'], 'positions': row['positions']}


@dataclasses.dataclass(frozen=True)
class Translation:
    """Number-translation (or any text pair) record -> fixed-length seq2seq example."""
    source_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    source_key: str = 'en'
    target_key: str = 'fr'
    source_len: int = 32
    target_len: int = 32

    def __call__(self, record, rng) -> dict[str, np.ndarray]:
        del rng
        tgt = self.target_tokenizer
        return objectives.seq2seq_example(
            self.source_tokenizer.encode(_text(record[self.source_key])),
            tgt.encode(_text(record[self.target_key])),
            source_len=self.source_len, target_len=self.target_len,
            bos_id=tgt.bos_id, eos_id=tgt.eos_id, pad_id=tgt.pad_id)


@dataclasses.dataclass(frozen=True)
class TextClassification:
    """Labelled text record -> BERT's sentence-level input and the label's index
    (objectives.classification_example): record[text_key], and record[pair_key] as the
    second text of a pair where pair_key is set. `classes`: the class names in index
    order. A record's label is one of them (its text, spaces around it aside), or with
    `by_index` the index itself (a tfds ClassLabel's); another is a ValueError (a tfds
    test split's -1, which means unlabelled)."""
    tokenizer: Tokenizer
    seq_len: int
    start_id: int
    end_id: int
    classes: tuple[str, ...]
    text_key: str = 'text'
    pair_key: str = ''
    label_key: str = 'label'
    by_index: bool = False

    def __call__(self, record, rng) -> dict[str, np.ndarray]:
        del rng
        encode = lambda key: self.tokenizer.encode(_text(record[key]))  # noqa: E731
        example = objectives.classification_example(
            encode(self.text_key), encode(self.pair_key) if self.pair_key else None,
            seq_len=self.seq_len, start_id=self.start_id, end_id=self.end_id,
            pad_id=self.tokenizer.pad_id)
        label = record[self.label_key]
        index = (int(label) if self.by_index and 0 <= int(label) < len(self.classes) else
                 None if self.by_index else self._index.get(label_text(label)))
        if index is None:
            # A run whose classes came from a table's float-written labels ('1.0', read as
            # '1' since 2026-11-27) cannot go on: said so, not only that '1' is no class.
            floats = not self.by_index and f'{label_text(label)}.0' in self._index
            raise ValueError(f'{self.label_key}={_text(label)!r} is not one of the '
                             f'{len(self.classes)} classes {list(self.classes)[:8]}'
                             + (' (as an index)' if self.by_index else '')
                             + (f' (its classes were read as {label_text(label)}.0 from a '
                                f'CSV or TSV, which now reads whole numbers as integers: '
                                f'train a new run)' if floats else ''))
        return {**example, 'label': np.int32(index)}

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}


@dataclasses.dataclass(frozen=True)
class ImageClassification:
    """Image record -> normalised float image (optionally augmented) and label."""
    mean: float | Sequence[float] = 0.5
    std: float | Sequence[float] = 0.5
    augment: bool = False
    padding: int = 0
    flip: bool = False
    image_key: str = 'image'
    label_key: str = 'label'

    def __call__(self, record, rng) -> dict[str, np.ndarray]:
        image = record[self.image_key]
        if self.augment:
            image = objectives.random_crop_flip(image, rng, padding=self.padding, flip=self.flip)
        return {'image': objectives.normalize_image(image, self.mean, self.std),
                'label': np.int32(record[self.label_key])}
