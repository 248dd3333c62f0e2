"""Objectives: MLM rates and specials, NSP pairs, teacher forcing, image transforms."""

import numpy as np
import pytest

from attention_jax import data

PAD, CLS, SEP, MASK, VOCAB = 0, 1, 2, 3, 1000
SPECIALS = (PAD, CLS, SEP, MASK)


def _batch(rng, rows=2000, length=128):
    tokens = rng.integers(4, VOCAB, size=(rows, length))
    tokens[:, 0] = CLS
    lengths = rng.integers(20, length, size=rows)
    for r, n in enumerate(lengths):
        tokens[r, n - 1] = SEP
        tokens[r, n:] = PAD
    return tokens


def test_mlm_rates_within_tolerance_and_specials_never_masked():
    rng = np.random.default_rng(0)
    tokens = _batch(rng)
    out = data.mlm_mask(tokens, rng, mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS)
    special = np.isin(tokens, SPECIALS)
    chosen = out['weights'] > 0
    assert not (chosen & special).any()
    np.testing.assert_array_equal(out['inputs'][special], tokens[special])
    np.testing.assert_array_equal(out['targets'], tokens)
    # 15% of each row's ordinary tokens (exactly, to rounding).
    eligible = (~special).sum(1)
    assert np.all(np.abs(chosen.sum(1) - 0.15 * eligible) <= 0.5)
    n = chosen.sum()
    masked = (out['inputs'] == MASK) & chosen
    kept = (out['inputs'] == tokens) & chosen
    replaced = chosen & ~masked & ~kept
    # ~37k predictions: 5 standard deviations of a proportion are below 0.011.
    assert abs(masked.sum() / n - 0.8) < 0.011
    assert abs(kept.sum() / n - 0.1) < 0.011  # (+ random picks of the same id: 0.1%.)
    assert abs(replaced.sum() / n - 0.1) < 0.011
    assert not np.isin(out['inputs'][replaced], SPECIALS).any()
    assert ((out['inputs'] != tokens) <= chosen).all()  # Nothing else changes.


def test_masked_lm_transform_is_deterministic_per_rng():
    row = data.pack_documents([list(range(10, 60))], 64)
    row = {k: v[0] for k, v in row.items()}
    t = data.MaskedLM(mask_id=MASK, vocab_size=VOCAB, special_ids=SPECIALS)
    a = t(row, np.random.default_rng(3))
    b = t(row, np.random.default_rng(3))
    np.testing.assert_array_equal(a['inputs'], b['inputs'])
    assert a['weights'].sum() == round(0.15 * 50)
    np.testing.assert_array_equal(a['segment_ids'], row['segment_ids'])


def test_nsp_pairs_are_half_real_next_and_well_formed():
    rng = np.random.default_rng(0)
    docs = [[[100 * d + 10 * s + i for i in range(1, 4)] for s in range(6)] for d in range(40)]
    examples = data.nsp_pairs(docs, rng, seq_len=12, cls_id=CLS, sep_id=SEP)
    assert len(examples) == 40 * 5
    labels = np.array([e['is_next'] for e in examples])
    assert abs(labels.mean() - 0.5) < 0.1  # 200 draws: 2.8 standard deviations.
    for e in examples:
        tokens, types = e['tokens'], e['type_ids']
        assert tokens.shape == types.shape == (12,)
        assert tokens[0] == CLS and tokens[4] == SEP and tokens[8] == SEP
        a, b = tokens[1:4], tokens[5:8]
        assert (types[:5] == 0).all() and (types[5:9] == 1).all() and (tokens[9:] == PAD).all()
        same_doc, next_seg = a[0] // 100 == b[0] // 100, b[0] % 100 // 10 == a[0] % 100 // 10 + 1
        assert (same_doc and next_seg) if e['is_next'] else not same_doc
        # The NSP head's class, IsNext first (Google's and Hugging Face's order, which an
        # exported head keeps): training it on is_next swapped the classes.
        assert e['next_sentence_label'] == (0 if same_doc and next_seg else 1)


def test_teacher_forcing_shift_and_seq2seq_example():
    np.testing.assert_array_equal(data.shift_right(np.array([[5, 6, 7]]), bos_id=1), [[1, 5, 6]])
    ex = data.seq2seq_example([9, 8], [5, 6, 7], source_len=4, target_len=6, bos_id=1,
                              eos_id=2)
    np.testing.assert_array_equal(ex['inputs'], [9, 8, 0, 0])
    np.testing.assert_array_equal(ex['targets'], [5, 6, 7, 2, 0, 0])
    np.testing.assert_array_equal(ex['decoder_inputs'], [1, 5, 6, 7, 2, 0])
    np.testing.assert_array_equal(ex['target_weights'], [1, 1, 1, 1, 0, 0])
    with pytest.raises(ValueError, match='target has 7 tokens'):
        data.seq2seq_example([1], [5] * 6, source_len=4, target_len=6, bos_id=1, eos_id=2)


def test_translation_transform_on_number_translation(tmp_path):
    src = data.get_dataset('number_translation', 'validation', tmp_path, num_train=20,
                           num_validation=10, num_test=10)
    tok = data.get_tokenizer('byte')
    t = data.Translation(tok, tok, source_key='en', target_key='de', source_len=160,
                         target_len=160)
    ex = t(src[0], np.random.default_rng(0))
    assert tok.decode(ex['inputs']) == src[0]['en'].decode()
    assert tok.decode(ex['targets']) == src[0]['de'].decode()
    assert ex['decoder_inputs'][0] == tok.bos_id


def test_image_normalisation_and_augmentation():
    image = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3) * 4
    x = data.normalize_image(np.array([0, 255], np.uint8))
    np.testing.assert_allclose(x, [-1, 1])
    per_channel = data.normalize_image(image, mean=(0.1, 0.2, 0.3), std=(1, 2, 3))
    np.testing.assert_allclose(per_channel[..., 2], (image[..., 2] / 255 - 0.3) / 3, rtol=1e-6)
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(data.random_crop_flip(image, rng), image)
    padded = np.pad(image, ((2, 2), (2, 2), (0, 0)))
    windows = {padded[t:t + 4, l:l + 5].tobytes() for t in range(5) for l in range(5)}
    crops = [data.random_crop_flip(image, rng, padding=2) for _ in range(200)]
    assert all(c.shape == image.shape and c.tobytes() in windows for c in crops)
    assert len({c.tobytes() for c in crops}) > 10  # Offsets really vary.
    flips = [data.random_crop_flip(image, rng, flip=True) for _ in range(100)]
    mirrored = sum(np.array_equal(f, image[:, ::-1]) for f in flips)
    assert 25 < mirrored < 75 and all(np.array_equal(f, image) or
                                      np.array_equal(f, image[:, ::-1]) for f in flips)


def test_mlm_predicts_at_least_one_token_of_a_short_row():
    # 3 ordinary tokens at 15% round to 0; BERT's data script predicts max(1, round(...)).
    tokens = np.array([[CLS, 10, 11, 12, SEP, PAD], [CLS, SEP, PAD, PAD, PAD, PAD]])
    out = data.mlm_mask(tokens, np.random.default_rng(0), mask_id=MASK, vocab_size=VOCAB,
                        special_ids=SPECIALS)
    assert out['weights'][0].sum() == 1
    assert out['weights'][1].sum() == 0  # no ordinary token: nothing to predict


def test_nsp_pairs_draw_random_segments_only_from_documents_that_have_some():
    """An empty document drawn as the other one failed ("high <= 0") for some seeds."""
    docs = [[[10, 11], [12]], [], [[20], [21, 22]], []]
    for seed in range(20):
        examples = data.nsp_pairs(docs, np.random.default_rng(seed), seq_len=10, cls_id=CLS,
                                  sep_id=SEP)
        assert len(examples) == 2
    with pytest.raises(ValueError, match=r"at least two documents with segments .* got 1 of 3"):
        data.nsp_pairs([[[1], [2]], [], []], np.random.default_rng(0), seq_len=8, cls_id=CLS,
                       sep_id=SEP)


def test_nsp_pairs_refuse_a_seq_len_below_the_three_special_tokens():
    """seq_len 2 was an IndexError from trimming A and B (popping an empty list)."""
    docs = [[[10, 11], [12, 13]], [[20], [21, 22]]]
    for seq_len in (0, 2):
        with pytest.raises(ValueError, match=rf"^nsp_pairs: seq_len={seq_len} cannot hold "
                                             r"\[CLS\] A \[SEP\] B \[SEP\]; valid: seq_len >= 3"):
            data.nsp_pairs(docs, np.random.default_rng(0), seq_len=seq_len, cls_id=CLS,
                           sep_id=SEP)
    # The least valid: A and B trimmed away, the special tokens kept.
    examples = data.nsp_pairs(docs, np.random.default_rng(0), seq_len=3, cls_id=CLS, sep_id=SEP)
    assert [e['tokens'].tolist() for e in examples] == [[CLS, SEP, SEP]] * 2
    assert [e['type_ids'].tolist() for e in examples] == [[0, 0, 1]] * 2


def test_mlm_rates_are_fractions_or_named():
    """mask_rate=15 (a percentage) chose every ordinary token, mask_token_rate=80 made
    every chosen one [MASK], a negative rate chose none: all unsaid."""
    tokens = _batch(np.random.default_rng(0), rows=4)
    for kwargs, name in ((dict(mask_rate=15), 'mask_rate=15'),
                         (dict(mask_rate=-0.1), r'mask_rate=-0\.1'),
                         (dict(mask_token_rate=80), 'mask_token_rate=80'),
                         (dict(random_token_rate=-1), 'random_token_rate=-1')):
        with pytest.raises(ValueError, match=rf'^{name} is out of range; valid: a fraction'):
            data.mlm_mask(tokens, np.random.default_rng(0), mask_id=MASK, vocab_size=VOCAB,
                          special_ids=SPECIALS, **kwargs)
    with pytest.raises(ValueError, match=r'^mask_token_rate=0\.8 \+ random_token_rate=0\.5 > 1'):
        data.mlm_mask(tokens, np.random.default_rng(0), mask_id=MASK, vocab_size=VOCAB,
                      special_ids=SPECIALS, random_token_rate=0.5)


def test_mlm_mask_id_must_be_a_token_of_the_vocabulary():
    """A mask_id past vocab_size (a tokenizer's [MASK] beside a smaller model vocabulary)
    went into the inputs unsaid, where the embedding's gather reads past its table."""
    tokens = _batch(np.random.default_rng(0), rows=4)
    for bad in (VOCAB, -1, 2.0):
        with pytest.raises(ValueError, match=rf'^mask_id={bad!r} is not a token id of the '
                                             rf'vocabulary; valid: an int in 0\.\.{VOCAB - 1}'):
            data.mlm_mask(tokens, np.random.default_rng(0), mask_id=bad, vocab_size=VOCAB,
                          special_ids=SPECIALS)
    out = data.mlm_mask(tokens, np.random.default_rng(0), mask_id=np.int64(MASK),
                        vocab_size=VOCAB, special_ids=SPECIALS)  # NumPy ints are ids too
    assert (out['inputs'] == MASK).any()
