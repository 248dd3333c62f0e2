"""Tokenizers: round trips, save/load from a workdir, WordPiece equal to the
`tokenizers` library's ids."""

import numpy as np
import pytest

from attention_jax import data

TEXT = 'Hello, world! Zwölf Boxkämpfer jagen Viktor — 42 × π ≈ 131.9\n\tdef f(x): return x'

SENTENCES = [
    'Hello, world! It\'s a test.',
    'Héllo Wörld — naïve café résumé',
    'The quick brown fox jumps over the lazy dog\'s back; $100 + 20% = ?',
    'def f(x): return x**2  # a comment',
    '北京欢迎你 and 東京',
    'unbelievably antidisestablishmentarianism supercalifragilisticexpialidocious',
    'a [MASK] in the middle [SEP] and more',
    'tabs\tand\nnewlines\r\n ok',
    'symbols ∑ ≤ ≥ ™ © and an emoji 😀',
    'x' * 150,
    '',
]


def _corpus():
    return [f'line {i}: the {w} jumps over {i * 7} lazy dogs; héllo wörld.'
            for i, w in enumerate(['quick fox', 'slow cat', 'brown bear', 'tiny ant'] * 25)]


def test_char_tokenizer_round_trip_and_unknown(tmp_path):
    tok = data.get_tokenizer('char', texts=[TEXT])
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT) and tok.decode(ids) == TEXT
    assert tok.pad_id == 0 and 0 not in ids
    assert tok.encode('Q') == [tok.unk_id]  # 'Q' is not in TEXT.
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'char')))
    assert loaded.encode(TEXT) == ids and loaded.vocab_size == tok.vocab_size


def test_byte_tokenizer_round_trip_any_text(tmp_path):
    tok = data.get_tokenizer('byte')
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode('utf-8'))
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == TEXT
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, 0, 0]) == TEXT  # Specials skipped.
    assert data.load_tokenizer(tok.save(str(tmp_path / 'b'))).encode(TEXT) == ids


def test_bpe_trains_round_trips_and_reloads(tmp_path):
    corpus = _corpus()
    tok = data.get_tokenizer('bpe', texts=corpus, vocab_size=400)
    assert tok.pad_id == 0 and 256 < tok.vocab_size <= 400
    for text in corpus[:5] + [TEXT]:
        assert tok.decode(tok.encode(text)) == text
    # Merges were learnt: frequent words take fewer tokens than bytes.
    assert len(tok.encode(corpus[0])) < len(corpus[0].encode()) / 2
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'bpe')))
    assert isinstance(loaded, data.BPETokenizer)
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    assert loaded.special_ids == tok.special_ids


def test_wordpiece_matches_the_tokenizers_library():
    from tokenizers import Tokenizer as HFTokenizer
    tok = data.get_tokenizer('wordpiece')
    reference = HFTokenizer.from_file(tok.path)
    reference.no_padding()
    reference.no_truncation()
    for sentence in SENTENCES:
        assert tok.encode(sentence) == reference.encode(
            sentence, add_special_tokens=False).ids, sentence
        assert tok.encode(sentence, add_special_tokens=True) == reference.encode(
            sentence).ids, sentence
    assert tok.vocab_size == 30522 and tok.pad_id == 0
    assert {tok.cls_id, tok.sep_id, tok.mask_id, tok.pad_id} <= tok.special_ids


def test_wordpiece_decodes_and_reloads(tmp_path):
    tok = data.get_tokenizer('wordpiece')
    text = 'the quick brown fox jumps over the lazy dog, unbelievably.'
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'wp')))
    assert loaded.encode(SENTENCES[2]) == tok.encode(SENTENCES[2])


def test_bad_kind_and_missing_dir_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        data.get_tokenizer('sentencepiece')
    with pytest.raises(FileNotFoundError, match='no saved tokenizer'):
        data.load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match='texts='):
        data.get_tokenizer('bpe')
