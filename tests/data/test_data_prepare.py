"""The token cache (issue #26): files of three formats tokenized once with a tokenizer.json
trained here, read back as exactly the rows pack_documents makes; a prepare that was cut
off resumes; a changed file or tokenizer is another cache; damaged caches are one line;
the loader over the cache resumes exactly and splits over processes; BERT reads it too."""

import gzip
import json
import re
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from etils import epath

from attention_jax import data
from attention_jax.configs import bert_mlm as bert_config
from attention_jax.data import files, loaders, packing, token_cache
from attention_jax.data.loaders import EXAMPLE_WEIGHT
from attention_jax.errors import UserError
from attention_jax.tasks import base

WORDS = 'the cat sat on a mat while seven dogs ran over hills and rivers far away'.split()


def _doc(i: int) -> str:
    rng = np.random.default_rng(i)
    return ' '.join(rng.choice(WORDS, int(rng.integers(0, 40)))) + f' {i}.'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """3 .txt files, 60 documents in a .jsonl.gz, 60 in a .parquet (4 row groups), and a
    GPT-2-style BPE tokenizer.json trained on them."""
    root = tmp_path_factory.mktemp('prep')
    for i in range(3):
        (root / f't{i}.txt').write_text(_doc(i) * 5)
    with gzip.open(root / 'g.jsonl.gz', 'wt') as f:
        f.writelines(json.dumps({'text': _doc(100 + i)}) + '\n' for i in range(60))
    pq.write_table(pa.table({'text': [_doc(200 + i) for i in range(60)]}),
                   root / 'r.parquet', row_group_size=16)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_doc(i) for i in range(300)], trainers.BpeTrainer(
        vocab_size=320, special_tokens=['<|endoftext|>'], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / 'tokenizer.json'))
    return root, data.get_tokenizer('file', path=str(root / 'tokenizer.json'))


def _globs(root):
    return f'{root}/*.txt,{root}/*.jsonl.gz,{root}/*.parquet'


def _packed(docs, tok, seq_len):
    """The in-memory reference: every document tokenized, eos-terminated, packed."""
    return packing.pack_documents([tok.encode(docs[i]['text'].decode()) + [tok.eos_id]
                                   for i in range(len(docs))], seq_len)


def _rows(rows) -> dict[str, np.ndarray]:
    return {k: np.stack([rows[r][k] for r in range(len(rows))]) for k in rows[0]}


def test_prepared_rows_are_the_packed_rows_and_a_cut_prepare_resumes(corpus, tmp_path, capsys):
    root, tok = corpus
    docs = files.file_splits(_globs(root), eval_fraction=0.2)['train']
    # Shards of ~600 source bytes: many, so rows cross shard boundaries.
    directory = token_cache.prepare(docs, tok, str(tmp_path), shard_bytes=600, workers=2,
                                    progress=False)
    manifest = json.load(open(os.path.join(directory, 'manifest.json')))
    assert len(manifest['tokens']) > 5 and manifest['dtype'] == 'uint16'
    for seq_len in (16, 61):
        want = _packed(docs, tok, seq_len)
        got = _rows(token_cache.TokenRows(directory, seq_len, pad_id=tok.pad_id))
        assert set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        stream = token_cache.TokenRows(directory, seq_len, pad_id=tok.pad_id, packing='stream')
        got = _rows(stream)
        np.testing.assert_array_equal(got['tokens'], want['tokens'])
        np.testing.assert_array_equal(got['segment_ids'], want['segment_ids'] != 0)
        for p in ('stream', 'documents'):  # what the model is fed is the same too
            a = data.CausalLM(p)(stream[3] if p == 'stream' else
                                 token_cache.TokenRows(directory, seq_len)[3], None)
            b = data.CausalLM(p)({k: v[3] for k, v in want.items()}, None)
            assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # Cut off: the manifest not written, shard 2 not committed, a temp file left over.
    # Resuming redoes shard 2 only; the rows are the same.
    before = {n: os.path.getmtime(os.path.join(directory, n)) for n in os.listdir(directory)}
    os.remove(os.path.join(directory, 'manifest.json'))
    os.remove(os.path.join(directory, '00002.json'))
    open(os.path.join(directory, '00002.tokens.npy.tmp-host-1'), 'w').write('partial')
    with pytest.raises(token_cache.CacheError, match='run it again to resume'):
        token_cache.TokenRows(directory, 16)
    capsys.readouterr()
    again = token_cache.prepare(docs, tok, str(tmp_path), shard_bytes=600, workers=1,
                                progress=True)
    assert again == directory
    shards = len(manifest['tokens'])  # it said "1 shards to tokenize", as if that were all
    assert re.search(rf": 1 shards to tokenize of {shards} \(resuming: {shards - 1} prepared "
                     rf"before\)", capsys.readouterr().err)
    redone = {n for n, t in before.items() if os.path.getmtime(os.path.join(directory, n)) != t}
    assert redone == {'00002.tokens.npy', '00002.ends.npy', '00002.json', 'manifest.json'}
    assert json.load(open(os.path.join(directory, 'manifest.json'))) == manifest
    np.testing.assert_array_equal(_rows(token_cache.TokenRows(directory, 16))['tokens'],
                                  _packed(docs, tok, 16)['tokens'])


def test_the_key_follows_files_and_tokenizer_and_damage_is_one_line(corpus, tmp_path):
    root, tok = corpus
    work = tmp_path / 'corpus'
    work.mkdir()
    for name in ('t0.txt', 't1.txt', 'r.parquet'):
        (work / name).write_bytes((root / name).read_bytes())
    spec = f'{work}/*.txt,{work}/*.parquet'
    prep = lambda tok: token_cache.prepare(  # noqa: E731
        files.file_splits(spec, eval_fraction=0.3)['train'], tok, str(tmp_path / 'c'),
        workers=1, progress=False)
    first = prep(tok)
    assert prep(tok) == first  # the same inputs: the same cache, not prepared again
    byte = prep(data.get_tokenizer('byte'))
    (work / 't0.txt').write_text('changed ' * 50)
    changed = prep(tok)
    assert len({first, byte, changed}) == 3
    # A run's saved copy of the tokenizer is the same tokenizer (the same key).
    saved = data.load_tokenizer(tok.save(epath.Path(tmp_path) / 'run' / 'tokenizer'))
    assert prep(saved) == changed
    with pytest.raises(token_cache.CacheError, match='must be on a local or mounted'):
        token_cache.TokenRows('gs://bucket/cache/abc', 16)
    errors = []
    # A cache whose recorded inputs disagree with its name (copied over, edited).
    manifest_path = os.path.join(changed, 'manifest.json')
    manifest = json.load(open(manifest_path))
    json.dump({**manifest, 'inputs': {**manifest['inputs'], 'text_key': 'body'}},
              open(manifest_path, 'w'))
    with pytest.raises(token_cache.CacheError) as e:
        prep(tok)
    errors.append((e, 'was prepared from other inputs (text_key differ)'))
    # A manifest edited into something else: its missing parts named, not a TypeError.
    json.dump({'garbage': 1}, open(manifest_path, 'w'))
    with pytest.raises(token_cache.CacheError) as e:
        prep(tok)
    errors.append((e, f'{changed}: its manifest records no inputs (damaged or edited)'))
    with pytest.raises(token_cache.CacheError) as e:
        token_cache.TokenRows(changed, 16)
    errors.append((e, f"{manifest_path}: a damaged manifest (KeyError: 'dtype')"))
    # A truncated shard, found at open by its size, before any row is read.
    shard = os.path.join(first, '00000.tokens.npy')
    whole = open(shard, 'rb').read()
    open(shard, 'wb').write(whole[:len(whole) // 2])
    with pytest.raises(token_cache.CacheError) as e:
        token_cache.TokenRows(first, 16)
    errors.append((e, f'{shard}: truncated or damaged token cache shard'))
    for info, part in errors:
        assert isinstance(info.value, UserError) and '\n' not in str(info.value)
        assert part in str(info.value), str(info.value)


def test_bad_records_are_counted_through_prepare(tmp_path, capsys):
    lines = [json.dumps({'text': f'doc {i}'}) for i in range(12)]
    lines[2], lines[9] = '{"text": "cut', '{"text": 3}'  # lines 3 and 10: said in that order
    (tmp_path / 'm.jsonl').write_text('\n'.join(lines) + '\n')
    (tmp_path / 'e.jsonl').write_text(lines[0] + '\n')
    tok = data.get_tokenizer('byte')
    for limit, ok in ((2, True), (1, False)):
        docs = files.file_splits(str(tmp_path / 'm.jsonl'), str(tmp_path / 'e.jsonl'),
                                 max_bad_records=limit)['train']
        prep = lambda: token_cache.prepare(docs, tok, str(tmp_path / f'c{limit}'),  # noqa: E731
                                           shard_bytes=40, workers=1, progress=False)
        if ok:
            directory = prep()
            manifest = json.load(open(os.path.join(directory, 'manifest.json')))
            where = [f'{tmp_path / "m.jsonl"}:3', f'{tmp_path / "m.jsonl"}:10']
            assert (manifest['bad_records'], manifest['bad_where']) == (2, where)
            assert capsys.readouterr().err.count('warning: ') == 2
            # A later start reads the cache and no record: it says they are left out (it
            # said nothing, and a new workdir never saw the warnings).
            assert prep() == directory
            # (a shard's places in the order of their numbers, not of their text)
            assert sorted(['m.jsonl:10', 'm.jsonl:3', 'p.parquet: row 11', 'p.parquet: row 2'],
                          key=token_cache._place_order) == [
                'm.jsonl:3', 'm.jsonl:10', 'p.parquet: row 2', 'p.parquet: row 11']
            assert capsys.readouterr().err == (
                f"note: split: 2 bad record(s) of its files were left out when its token "
                f"cache was prepared ({', '.join(where)}; {directory})\n")
        else:
            with pytest.raises(files.FilesError, match='more than'):
                prep()
    # Read once before, as a tokenizer's training reads them (bpe, char): the cache still
    # counts its range's bad records (it counted only those read for the first time: 0).
    docs = files.file_splits(str(tmp_path / 'm.jsonl'), str(tmp_path / 'e.jsonl'),
                             max_bad_records=2)['train']
    [docs[i] for i in range(len(docs))]
    directory = token_cache.prepare(docs, tok, str(tmp_path / 'read-before'), shard_bytes=40,
                                    workers=1, progress=False)
    assert json.load(open(os.path.join(directory, 'manifest.json')))['bad_records'] == 2


def test_a_document_the_tokenizer_cannot_encode_is_named(corpus, tmp_path):
    """A tokenizer without an id for some character (its unknown token missing from its
    vocabulary) stops the prepare with one error naming the document's file and line."""
    from tokenizers import Tokenizer
    lacking = tmp_path / 'tokenizer.json'
    spec = json.loads(Tokenizer.from_file(str(corpus[0] / 'tokenizer.json')).to_str())
    spec['model']['unk_token'] = '<unk>'
    spec['model']['vocab'] = {t: i for t, i in spec['model']['vocab'].items() if t != 'Ã'}
    lacking.write_text(json.dumps(spec))
    tok = data.get_tokenizer('file', path=str(lacking))
    (tmp_path / 'm.jsonl').write_text(json.dumps({'text': 'the cat'}) + '\n'
                                      + json.dumps({'text': 'the Ünicorn'}) + '\n')
    (tmp_path / 'e.jsonl').write_text(json.dumps({'text': 'a mat'}) + '\n')
    docs = files.file_splits(str(tmp_path / 'm.jsonl'), str(tmp_path / 'e.jsonl'))['train']
    with pytest.raises(data.TokenizerEncodeError,
                       match=r"^document m\.jsonl:2: .*tokenizer\.json cannot encode 'the "
                             r"Ünicorn'.*unknown token '<unk>'"):
        token_cache.prepare(docs, tok, str(tmp_path / 'cache'), workers=1, progress=False)


def test_loader_over_the_cache_resumes_exactly_and_splits_over_processes(corpus, tmp_path):
    root, tok = corpus
    docs = files.file_splits(_globs(root), eval_fraction=0.2)['train']
    # Process 1 of 2 goes first and, alone, prepares every shard after a short wait;
    # process 0 then finds the cache. Two at once share it.
    one = token_cache.prepare(docs, tok, str(tmp_path / 'a'), shard_bytes=600, workers=1,
                              progress=False, process_index=1, process_count=2, stall_s=0.2)
    assert token_cache.prepare(docs, tok, str(tmp_path / 'a'), shard_bytes=600, workers=1,
                               progress=False, process_index=0, process_count=2) == one
    got = {}
    threads = [threading.Thread(target=lambda p: got.__setitem__(p, token_cache.prepare(
        docs, tok, str(tmp_path / 'b'), shard_bytes=600, workers=1, progress=False,
        process_index=p, process_count=2)), args=(p,)) for p in (0, 1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert got[0] == got[1] and os.path.exists(os.path.join(got[0], 'manifest.json'))
    rows = token_cache.TokenRows(one, 16, pad_id=tok.pad_id)
    loader = lambda **kw: data.Loader(rows, global_batch_size=4, seed=3,  # noqa: E731
                                      transform=data.CausalLM('documents'), **kw)
    straight = loader(process_index=0, process_count=1)
    it = iter(straight)
    first = [next(it) for _ in range(3)]
    state = straight.get_state().to_dict()
    assert set(state) == {'next_index', 'seed', 'num_records', 'source', 'order'}
    # The tokens' identity: the same in the cache the other two processes prepared
    # elsewhere (a moved corpus resumes), another for other tokens of as many rows.
    assert state['source'] == rows.fingerprint == token_cache.TokenRows(
        got[0], 16, pad_id=tok.pad_id).fingerprint != ''
    other = token_cache.TokenRows(one, 16, pad_id=tok.pad_id)
    other.fingerprint = 'edited-corpus'
    with pytest.raises(loaders.DataChangedError, match='other ones'):
        data.Loader(other, global_batch_size=4, seed=3, state=state)
    old = {k: v for k, v in state.items() if k != 'source'}  # a checkpoint from before
    assert data.Loader(other, global_batch_size=4, seed=3, state=old).get_state().next_index == \
        state['next_index']
    rest = [next(it) for _ in range(2)]
    resumed = iter(loader(process_index=0, process_count=1, state=state))
    for want in rest:
        got_batch = next(resumed)
        assert all((got_batch[k] == want[k]).all() for k in want)
    # Two processes read disjoint halves whose concatenation is the one-process batch.
    halves = [next(iter(loader(process_index=p, process_count=2))) for p in (0, 1)]
    for key in first[0]:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), first[0][key])


def test_bert_reads_files_through_the_cache(corpus, tmp_path):
    root, _ = corpus
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', *WORDS,
                                         *map(str, range(10)), '.', *[f'##{d}' for d in
                                                                      range(10)]])}
    bert = Tokenizer(models.WordPiece(vocab, unk_token='[UNK]'))
    bert.normalizer = normalizers.BertNormalizer()
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    bert.decoder = decoders.WordPiece()
    bert.add_special_tokens(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'])
    bert.save(str(tmp_path / 'bert.json'))
    config = bert_config.get_config()
    config.data.name, config.data.files = 'files', _globs(root)
    config.data.tokenizer, config.data.cache_dir = str(tmp_path / 'bert.json'), str(tmp_path)
    config.data.seq_len = 32
    task = base.TASKS['bert_mlm'](config, str(tmp_path / 'run'))
    assert isinstance(task.train_source, token_cache.TokenRows)
    row = task.train_source[1]
    example = task.train_transform(row, np.random.default_rng(0))
    masked = example['weights'] > 0
    assert masked.any() and (example['segment_ids'] == row['segment_ids']).all()
    assert (example['targets'][masked] == row['tokens'][masked]).all()
    assert not np.isin(row['tokens'], [1]).any()  # no [UNK]: the vocabulary covers the text
    # GPT with a BPE trained on the files (streamed to the trainer) reads them the same way.
    from attention_jax.configs import gpt as gpt_config
    config = gpt_config.get_config()
    config.data.name, config.data.files, config.data.cache_dir = 'files', _globs(root), str(tmp_path)
    config.data.tokenizer, config.data.vocab_size, config.data.seq_len = 'bpe', 300, 32
    task = base.TASKS['gpt'](config, str(tmp_path / 'gpt'))
    assert isinstance(task.eval_source, token_cache.TokenRows)
    ids = np.concatenate([task.train_source[r]['tokens'] for r in range(4)])
    assert ids.max() < 300 and (ids >= 260).mean() > 0.3  # merges learnt (4 specials + 256)


def test_batched_reads_give_the_per_example_batches_and_resume(corpus, tmp_path):
    """The Loader's batched path over the cache (read_rows: a batch per call) yields what
    the per-example grain path does, bit for bit: rows across shards and the padded last
    row, both packings, two epochs, process 1 of 2, the padded unshuffled eval stream, MaskedLM's
    per-example random streams; and a batched loader resumed mid-epoch continues it."""
    root, tok = corpus
    docs = files.file_splits(_globs(root), eval_fraction=0.2)['train']
    directory = token_cache.prepare(docs, tok, str(tmp_path), shard_bytes=600, workers=1,
                                    progress=False)
    for packing_kind in ('documents', 'stream'):
        rows = token_cache.TokenRows(directory, 16, pad_id=tok.pad_id, packing=packing_kind)
        assert len(rows.shard_tokens) > 3 and rows.num_tokens % 16  # crossings, a padded row
        order = np.random.default_rng(0).permutation(np.r_[np.arange(len(rows)), 0, 5])
        got, want = rows.read_rows(order), {k: np.stack([rows[int(r)][k] for r in order])
                                            for k in rows[0]}
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype == np.int32
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        cases = [dict(transform=data.CausalLM(packing_kind), num_epochs=2, process_index=1,
                      process_count=2),
                 dict(transform=data.CausalLM(packing_kind), num_epochs=1, pad_remainder=True,
                      shuffle=False, process_index=0, process_count=1)]  # as eval reads
        if packing_kind == 'documents':  # a transform that draws: the rngs must agree
            cases.append(dict(transform=data.MaskedLM(mask_id=1, vocab_size=320,
                                                      special_ids=(0,), mask_rate=0.3),
                              num_epochs=2, process_index=0, process_count=1))
        for kw in cases:
            make = lambda **more: data.Loader(rows, global_batch_size=6, seed=7,  # noqa: E731
                                              **kw, **more)
            per_example = list(make(batched=False))
            assert make().batched and len(per_example) > 4
            batched = list(make())
            assert len(batched) == len(per_example)
            for a, b in zip(batched, per_example):
                assert a.keys() == b.keys()
                for key in b:
                    assert a[key].dtype == b[key].dtype
                    np.testing.assert_array_equal(a[key], b[key], err_msg=f'{kw} {key}')
            cut = make()
            it = iter(cut)
            [next(it) for _ in range(len(per_example) // 2 + 1)]  # mid-epoch (into the 2nd)
            for a, b in zip(make(state=cut.get_state()),
                            per_example[len(per_example) // 2 + 1:], strict=True):
                # Padding copies (weight 0) are drawn from where the run resumed.
                real = b.get(EXAMPLE_WEIGHT, np.ones(len(b['inputs']))) > 0
                for key in b:
                    np.testing.assert_array_equal(a[key][real], b[key][real],
                                                  err_msg=f'resumed {kw} {key}')


def test_workers_end_with_a_killed_prepare(tmp_path):
    """A prepare killed outright (SIGKILL) left its spawned workers running: they hold the
    task queue's write end too, so they wrote the shards already queued and then waited
    for more forever. Each now ends once its parent is gone."""
    from helpers import children_outliving
    (tmp_path / 'parent.py').write_text(
        "import os, sys, time\n"
        "from attention_jax.data import token_cache\n"
        "if __name__ == '__main__':\n"
        "    pool = token_cache._pool(2, print)\n"
        "    list(pool.map(abs, [-1, -2, -3]))  # the workers are up, now idle\n"
        "    print(*pool._processes, flush=True)\n"
        "    time.sleep(120)\n")
    workers, left = children_outliving(tmp_path / 'parent.py')
    assert len(workers) == 2 and not left