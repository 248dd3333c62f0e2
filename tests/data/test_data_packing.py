"""Sequence packing: every token once, documents separated by segment ids, and a packed
batch through attention equals the documents run one at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import data
from attention_jax.attention import dot_product_attention


def _documents(rng, n=40, max_len=37):
    """Documents whose tokens are globally unique (1, 2, 3, ...) so any loss,
    duplication or reordering is visible."""
    lengths = rng.integers(1, max_len, size=n)
    starts = np.concatenate([[1], 1 + np.cumsum(lengths)[:-1]])
    return [list(range(s, s + n_tok)) for s, n_tok in zip(starts, lengths)]


@pytest.mark.parametrize('split_documents', [True, False])
def test_packing_keeps_every_token_once_and_separates_documents(split_documents):
    docs = _documents(np.random.default_rng(0))
    seq_len = 16
    rows = data.pack_documents(docs, seq_len, split_documents=split_documents)
    tokens, seg, pos = rows['tokens'], rows['segment_ids'], rows['positions']
    assert tokens.shape == seg.shape == pos.shape and tokens.shape[1] == seq_len
    # Every token exactly once, in document order (row-major reading order).
    real = tokens[seg != 0]
    np.testing.assert_array_equal(real, np.concatenate(docs))
    assert (tokens[seg == 0] == 0).all() and (pos[seg == 0] == 0).all()
    doc_of = {t: d for d, doc in enumerate(docs) for t in doc}
    for r in range(len(tokens)):
        piece_docs = []
        for s in range(1, seg[r].max() + 1):
            piece = tokens[r][seg[r] == s]
            assert len({doc_of[t] for t in piece}) == 1  # A segment is one document ...
            piece_docs.append(doc_of[piece[0]])
            np.testing.assert_array_equal(pos[r][seg[r] == s], np.arange(len(piece)))
            # ... and a contiguous run of it.
            assert (np.diff(np.flatnonzero(seg[r] == s)) == 1).all()
        assert len(set(piece_docs)) == len(piece_docs)  # Two segments, two documents.
    if split_documents:
        assert (seg[:-1] != 0).all()  # Rows are full except the last.
    else:
        for doc in docs:  # Short documents are never cut.
            if len(doc) <= seq_len:
                rows_with = {r for r in range(len(tokens)) if np.isin(doc, tokens[r]).any()}
                assert len(rows_with) == 1


def test_next_token_targets_stay_inside_a_document():
    rows = data.pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 6)
    ex = data.next_token_targets({k: v[0] for k, v in rows.items()})
    np.testing.assert_array_equal(ex['inputs'], [5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(ex['targets'][:5], [6, 7, 8, 9, 10])
    # 7 -> 8 and 9 -> 10 cross documents; the last column has no next token here.
    np.testing.assert_array_equal(ex['weights'], [1, 1, 0, 1, 0, 0])


def test_stream_targets_cross_documents_but_not_padding():
    """packing='stream' (GPT-2, nanoGPT): a row is a window of one token stream; every
    next token is a target, across documents, except padding; no segment ids."""
    rows = data.pack_documents([[5, 6, 7], [8, 9], [10]], 8)
    ex = data.next_token_targets({k: v[0] for k, v in rows.items()}, 'stream')
    assert set(ex) == {'inputs', 'targets', 'weights'}
    np.testing.assert_array_equal(ex['inputs'], [5, 6, 7, 8, 9, 10, 0, 0])
    np.testing.assert_array_equal(ex['targets'][:5], [6, 7, 8, 9, 10])
    # 7 -> 8 and 9 -> 10 cross documents and count; 10 -> padding does not.
    np.testing.assert_array_equal(ex['weights'], [1, 1, 1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match=r"packing='rows' is unknown; valid: \('documents', 'stream'\)"):
        data.next_token_targets({k: v[0] for k, v in rows.items()}, 'rows')


def test_packed_source_over_corpus(tmp_path):
    corpus = data.get_dataset('python_stdlib', 'train', tmp_path, max_files=4)
    tok = data.get_tokenizer('byte')
    packed = data.packed_lm_source(corpus, tok, seq_len=128)
    n_tokens = sum(len(corpus[i]['text']) + 1 for i in range(len(corpus)))  # +1: EOS.
    assert packed.num_tokens == n_tokens
    assert len(packed) == -(-n_tokens // 128)
    row = packed[0]
    assert row['tokens'].shape == (128,) and row['tokens'].dtype == np.int32
    first_doc = corpus[0]['text'].decode()
    assert tok.decode(row['tokens'][row['segment_ids'] == 1]) == first_doc[:128]


@pytest.mark.parametrize('implementation', ['reference', 'blockwise'])
def test_packed_attention_equals_unpacked_documents(implementation):
    """One causal self-attention layer with learned position embeddings, run on packed
    rows (segment ids + restarted positions) and on each document alone."""
    rng = np.random.default_rng(1)
    docs = _documents(rng, n=9, max_len=13)
    seq_len, d, heads, head_dim = 16, 8, 2, 4
    rows = data.pack_documents(docs, seq_len, split_documents=False)
    vocab = max(max(doc) for doc in docs) + 1
    init = np.random.default_rng(2)
    tok_emb = jnp.asarray(init.normal(size=(vocab, d)), jnp.float32)
    pos_emb = jnp.asarray(init.normal(size=(seq_len, d)), jnp.float32)
    wq, wk, wv = (init.normal(size=(d, heads, head_dim)).astype(np.float32) for _ in range(3))

    def layer(tokens, positions, segment_ids=None):
        x = tok_emb[tokens] + pos_emb[positions]  # [B, T, D]
        q, k, v = (jnp.einsum('BTD,DNH->BTNH', x, w) for w in (wq, wk, wv))
        kwargs = {} if implementation == 'reference' else {'block_q': 8, 'block_k': 8}
        return dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids,
                                     implementation=implementation, **kwargs)

    layer = jax.jit(layer)
    packed = np.asarray(layer(rows['tokens'], rows['positions'],
                              rows['segment_ids']))  # [R, L, N, H]
    # Unpacked: one document per row, padded at the end (causal attention never looks
    # ahead, so trailing padding cannot change a real token's output).
    alone = np.zeros((len(docs), seq_len), np.int32)
    for i, doc in enumerate(docs):
        alone[i, :len(doc)] = doc
    positions = np.broadcast_to(np.arange(seq_len), alone.shape)
    unpacked = np.asarray(layer(alone, positions))  # [len(docs), L, N, H]
    doc_of_first = {doc[0]: i for i, doc in enumerate(docs)}
    checked = 0
    for r in range(len(rows['tokens'])):
        for s in range(1, rows['segment_ids'][r].max() + 1):
            where = rows['segment_ids'][r] == s
            i = doc_of_first[int(rows['tokens'][r][where][0])]
            np.testing.assert_allclose(packed[r][where], unpacked[i, :where.sum()],
                                       rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == len(docs)
    # Without segment ids the documents would see each other: the test can tell.
    mixed = np.asarray(layer(rows['tokens'], rows['positions']))
    assert not np.allclose(mixed, packed, atol=1e-3)
