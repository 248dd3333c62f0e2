"""Your own text (issue #26): files of every format as a random-access source, stable
held-out splits, any tokenizer.json, bad input in one line each, and one command-line
run that trains on files with a tokenizer file and samples with it. Every file is made
here, in tmp_path."""

import bz2
import gzip
import json
import os
import shutil
import subprocess
import sys

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from attention_jax import data
from attention_jax.configs import bert_mlm as bert_config
from attention_jax.data import files
from attention_jax.errors import ConfigError, UserError
from attention_jax.tasks import base
from helpers import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = 'the cat sat on a mat while seven dogs ran over hills and rivers far away'.split()


def _sentence(i: int) -> str:
    rng = np.random.default_rng(i)
    return ' '.join(rng.choice(WORDS, 8)) + f' {i}.'


def _jsonl(docs, key='text') -> str:
    return ''.join(json.dumps({key: d, 'meta': i}) + '\n' for i, d in enumerate(docs))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """Every format: 4 .txt (one nested) and a .md, then 20 documents each in .jsonl
    (with blank lines), .jsonl.gz, .jsonl.zst and .parquet (3 row groups)."""
    root = tmp_path_factory.mktemp('corpus')
    (root / 'notes' / 'deep').mkdir(parents=True)
    texts = {}
    for i, name in enumerate(['notes/a.txt', 'notes/b.txt', 'notes/deep/c.txt', 'd.txt',
                              'readme.md']):
        texts[name] = f'file {name}: ' + _sentence(1000 + i)
        # d.txt as a Windows editor saves it: a byte order mark first, no text (it was)
        bom = b'\xef\xbb\xbf' if name == 'd.txt' else b''
        (root / name).write_bytes(bom + texts[name].encode())
    lines = {fmt: [_sentence(100 * k + i) for i in range(20)]
             for k, fmt in enumerate(['jsonl', 'gz', 'zst', 'parquet'])}
    plain = _jsonl(lines['jsonl']).split('\n')
    # (a blank line of 12 spaces was a bad record: only lines of 8 bytes or fewer were
    # looked at for white space)
    (root / 'p.jsonl').write_text('\n'.join(plain[:5] + ['', ' ' * 12] + plain[5:]))
    with gzip.open(root / 'g.jsonl.gz', 'wt') as f:
        f.write(_jsonl(lines['gz']))
    import zstandard  # here, not at the top: a machine without it (the GPU one) still collects
    (root / 'z.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(
        _jsonl(lines['zst']).encode()))
    pq.write_table(pa.table({'text': lines['parquet'], 'n': list(range(20))}),
                   root / 'r.parquet', row_group_size=7)
    expected = dict(texts)
    for k, d in enumerate(lines['jsonl']):  # line numbers: two blank lines after the 5th
        expected[f'p.jsonl:{k + 1 + 2 * (k >= 5)}'] = d
    expected.update({f'g.jsonl.gz:{k + 1}': d for k, d in enumerate(lines['gz'])})
    expected.update({f'z.jsonl.zst:{k + 1}': d for k, d in enumerate(lines['zst'])})
    expected.update({f'r.parquet:{k}': d for k, d in enumerate(lines['parquet'])})
    return root, expected


ALL = '**/*.txt,*.md,*.jsonl,*.jsonl.gz,*.jsonl.zst,*.parquet'


def _globs(root, spec=ALL):
    return ','.join(str(root / g) for g in spec.split(','))


def _read(src) -> dict[str, str]:
    out = {}
    for i in range(len(src)):
        record = src[i]
        assert set(record) == {'id', 'text'} and isinstance(record['text'], bytes)
        out[record['id'].decode()] = record['text'].decode()
    return out


def _bpe_file(path, texts, specials=('<|endoftext|>',)) -> str:
    """A GPT-2-style byte-level BPE tokenizer.json, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


# ------------------------------------------------------------------ documents and splits
def test_every_format_reads_its_documents_and_the_split_is_stable(corpus, tmp_path):
    root, expected = corpus
    splits = files.file_splits(_globs(root), eval_fraction=0.2)
    train, held = _read(splits['train']), _read(splits['validation'])
    assert not set(train) & set(held)
    assert {**train, **held} == expected  # blank lines skipped, ids relative to the globs
    assert 0.1 < len(held) / len(expected) < 0.35
    # Another order of globs, the corpus moved elsewhere: the same documents held out.
    moved = tmp_path / 'moved'
    shutil.copytree(root, moved)
    again = files.file_splits(_globs(moved, ','.join(reversed(ALL.split(',')))),
                              eval_fraction=0.2)
    assert _read(again['validation']) == held
    # A larger fraction holds out a superset; the registry name reads the same source.
    more = _read(files.file_splits(_globs(root), eval_fraction=0.5)['validation'])
    assert set(held) <= set(more)
    src = data.get_dataset('files', 'validation', files=_globs(root), eval_fraction=0.2)
    assert _read(src) == held
    # eval_files: train is all of files, validation all of eval_files.
    split = files.file_splits(_globs(root, '**/*.txt'), _globs(root, '*.parquet'))
    assert set(_read(split['train'])) == {n for n in expected if n.endswith('.txt')}
    assert len(split['validation']) == 20
    with pytest.raises(files.FilesError, match=r'd\.txt is in both'):
        files.file_splits(_globs(root, '*.txt'), _globs(root, 'd.txt'))


# ------------------------------------------------------------------- bad input, one line
def test_bad_files_are_one_line_naming_the_file(corpus, tmp_path):
    root, _ = corpus
    cases = []
    with pytest.raises(files.NoFilesError) as e:
        files.file_splits(f'{root}/*.txt,{tmp_path}/nothing/*.jsonl')
    cases.append((e, f"the glob '{tmp_path}/nothing/*.jsonl' matches no file"))
    assert str(e.value).endswith("matches no file")  # absolute: no word on relative globs
    with pytest.raises(files.NoFilesError, match=r"matches no file \(relative globs start in "):
        files.file_splits('nothing-here/*.jsonl')
    (tmp_path / 'k.jsonl').write_text(_jsonl(['one', 'two'], key='content'))
    with pytest.raises(files.FilesError) as e:
        files.file_splits(str(tmp_path / 'k.jsonl'))
    cases.append((e, f"{tmp_path / 'k.jsonl'} has no 'text' in its records (their keys: "
                     f"['content', 'meta']); set text_key"))
    with pytest.raises(files.FilesError) as e:
        files.file_splits(str(root / 'r.parquet'), text_key='body')
    cases.append((e, "r.parquet has no 'body' in its records (their keys: ['text', 'n'])"))
    with pytest.raises(files.FilesError) as e:  # was a skipped record per row, then an error
        files.file_splits(str(root / 'r.parquet'), text_key='n')
    cases.append((e, "r.parquet: column 'n' holds int64, not text; valid: a string column"))
    # A JSONL file whose values are of another type, or whose records are no objects, was
    # a warning a record up to max_bad_records, then an error: now one line, as Parquet's.
    (tmp_path / 'n.jsonl').write_text(''.join(json.dumps({'text': i}) + '\n' for i in range(30)))
    with pytest.raises(files.FilesError) as e:
        files.file_splits(str(tmp_path / 'n.jsonl'))
    cases.append((e, "n.jsonl: 'text' holds int in its first records, not text; valid: text "
                     "(set text_key"))
    (tmp_path / 'p.jsonl').write_text(json.dumps(['one', 'eins']) + '\n')
    with pytest.raises(files.FilesError) as e:
        files.file_splits(str(tmp_path / 'p.jsonl'), fields=('en', 'de'))
    cases.append((e, "p.jsonl: its first records are JSON list values, not objects; valid: "
                     "one JSON object a line, with 'en', 'de' keys"))
    (tmp_path / 'h.jsonl').write_text(''.join(json.dumps({'text': 'x', 'stars': 0.5}) + '\n'
                                              for _ in range(3)))
    with pytest.raises(files.FilesError) as e:
        files.file_splits(str(tmp_path / 'h.jsonl'), fields=('text', 'stars'),
                          integer_fields=('stars',))
    cases.append((e, "h.jsonl: 'stars' holds float in its first records, not text; valid: "
                     "text or integers"))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({'text': ['x'] * 3, 'stars': [4.5, 3.0, None]}), tmp_path / 'h.parquet')
    with pytest.raises(files.FilesError) as e:  # (whole floats and nulls pass: below)
        files.file_splits(str(tmp_path / 'h.parquet'), fields=('text', 'stars'),
                          integer_fields=('stars',))
    cases.append((e, "h.parquet: column 'stars' holds double values that are not whole "
                     "(4.5); valid: a string or integer column, or whole numbers"))
    for name, cut in (('g.jsonl.gz', 'gzip'), ('z.jsonl.zst', 'zstd'), ('r.parquet', 'parquet')):
        whole = (root / name).read_bytes()
        (tmp_path / name).write_bytes(whole[:len(whole) // 2])
        with pytest.raises(files.FilesError) as e:
            files.file_splits(str(tmp_path / name))
        cases.append((e, f'{tmp_path / name}: '))
        assert cut in str(e.value) and ('truncated' in str(e.value))
    (tmp_path / 'data.xml').write_text('<a/>\n')
    with pytest.raises(files.FilesError) as e:
        files.file_splits(f'{tmp_path}/*.xml')
    cases.append((e, 'is not a file type this source reads; valid: .txt, .md, .py'))
    (tmp_path / 'data.csv').write_text('a,b\n1,2\n')
    with pytest.raises(files.FilesError) as e:
        files.file_splits(f'{tmp_path}/*.csv')
    cases.append((e, "data.csv: its header row names no column 'text' (its columns: ['a', "
                     "'b']); set text_key to the one that holds the text, or give the file a "
                     "header row naming the columns"))
    (tmp_path / 'lone').mkdir()
    (tmp_path / 'lone' / 'e.txt').write_text('')
    with pytest.raises(files.FilesError) as e:  # was "holds one document; ... two or more"
        files.file_splits(f'{tmp_path}/lone/e.txt')
    cases.append((e, "e.txt': the train split holds no text (its 1 document is empty); "
                     "valid: documents with text"))
    with pytest.raises(files.NoFilesError) as e:  # a run's corpus moved: the flag to give
        files.file_splits(f'{tmp_path}/moved/*.txt', arg='config.data.')
    cases.append((e, "matches no file; moved? give where they are now, "
                     "--config.data.files=GLOBS"))
    for info, part in cases:
        message = str(info.value)
        assert isinstance(info.value, UserError) and '\n' not in message
        assert part in message, message
    # The built text_corpus never falls back to the standard library any more.
    with pytest.raises(ConfigError, match=r'--config.data.name=files --config.data.files=GLOBS'):
        data.get_dataset('text_corpus', 'train', tmp_path / 'tfds')


def test_a_directory_says_what_it_leaves_out_and_brackets_are_a_path(tmp_path, capsys):
    """A directory's files of other types (the largest, a .txt.bz2, among them) were
    dropped unsaid, and a directory of only such files "matched no file"; a folder or
    file named with brackets matched nothing (read as a glob's character class)."""
    folder = tmp_path / 'corpus [2024]'
    (folder / 'sub').mkdir(parents=True)
    (folder / 'a.txt').write_text('the cat sat')
    (folder / 'sub' / 'b [1].md').write_text('on a mat')
    (folder / 'd.json').write_text('[]')
    (folder / 'e.txt.bz2').write_bytes(bz2.compress(b'seven dogs'))
    (folder / 'f.txt.gz').write_bytes(gzip.compress(b'eight dogs'))
    listed = files.list_files(str(folder))
    assert [ident for ident, _ in listed] == ['a.txt', 'f.txt.gz', 'sub/b [1].md']
    assert capsys.readouterr().err.splitlines() == [
        f"note: files={str(folder)!r}: 2 files of other types left out: d.json, e.txt.bz2 "
        f"(read: .txt, .md, .py, .txt.gz, .txt.zst, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, "
        f".csv, .tsv, .csv.gz, .csv.zst, .tsv.gz, .tsv.zst)"]
    files.list_files(str(folder))
    assert capsys.readouterr().err == ''  # once a process
    assert files.list_files(str(folder / 'sub' / 'b [1].md')) == [
        ('b [1].md', str(folder / 'sub' / 'b [1].md'))]
    (tmp_path / 'only').mkdir()
    (tmp_path / 'only' / 'd.json').write_text('[]')
    with pytest.raises(files.FilesError, match=r"the directory '.*only' holds no file this "
                                               r"source reads \(1 of other types: d\.json\); "
                                               r"valid: \.txt"):
        files.list_files(str(tmp_path / 'only'))


def test_a_file_reached_twice_is_read_once_under_one_name_whatever_the_order(tmp_path, capsys):
    """A link back up (`up -> ..`) made 2 files 82 documents, copies of one in both splits;
    two globs over one file named it by the first glob's base, so the held-out draw (a
    hash of the name) depended on the globs' order."""
    loop = tmp_path / 'loop'
    (loop / 's').mkdir(parents=True)
    (loop / 's' / 'a.txt').write_text('hello doc')
    (loop / 'b.txt').write_text('other doc')
    (loop / 's' / 'up').symlink_to('..')
    for spec in (str(loop), str(loop / '**' / '*.txt')):
        assert files.list_files(spec) == [('b.txt', str(loop / 'b.txt')),
                                          ('s/a.txt', str(loop / 's' / 'a.txt'))]
        assert 'note: files=' in capsys.readouterr().err  # "2 files reached by ... each read once"
    corp = tmp_path / 'corp'
    (corp / 'sub').mkdir(parents=True)
    for i in range(30):
        (corp / ('sub' if i % 2 else '') / f'f{i}.txt').write_text(f'document {i}')
    one, two = (f'{corp}/**/*.txt,{corp}/sub/*.txt', f'{corp}/sub/*.txt,{corp}/**/*.txt')
    assert files.list_files(one) == files.list_files(two)
    held = [[d['text'] for d in files.file_splits(spec, eval_fraction=0.2)['validation']]
            for spec in (one, two)]
    assert held[0] == held[1] and held[0]
    # Held out under a link's name, a trained file is still both trained and evaluated on.
    (corp / 'alias').symlink_to('sub')
    with pytest.raises(files.FilesError, match=r"alias/f1\.txt is in both files and eval_files"):
        files.file_splits(f'{corp}/**/*.txt', f'{corp}/alias/f1.txt')


def test_a_header_record_is_a_bad_record_not_a_refused_file(tmp_path, capsys):
    """Only the first record's keys were checked: a header line refused a whole file of
    good records ("has no 'text'"), while a wrong text_key is still one line."""
    path = tmp_path / 'h.jsonl'
    path.write_text(json.dumps({'source': 'x', 'version': 1}) + '\n'
                    + _jsonl([f'doc {i}' for i in range(30)]))
    src = files.file_splits(str(path), eval_fraction=0.5)
    texts = [t for s in src.values() for t in _read(s).values()]
    assert sorted(t for t in texts if t) == sorted(f'doc {i}' for i in range(30))
    assert "no 'text'" in capsys.readouterr().err  # the header: a bad record, counted
    with pytest.raises(files.FilesError, match=r"has no 'body' in its records \(their keys: "
                                               r"\['meta', 'source', 'text', 'version'\]\)"):
        files.file_splits(str(path), text_key='body')


def test_csv_and_tsv_rows_are_records_named_by_their_header(tmp_path, capsys):
    """A CSV (RFC 4180: quoted fields with commas, doubled quotes and line breaks) and a
    TSV (a row a line, no quoting) are read as their header row names the columns; blank
    lines are no rows, and a row of another width or an unclosed quote is a bad record."""
    (tmp_path / 'r.csv').write_bytes(
        b'\xef\xbb\xbfreview,stars\r\n"a good, long\r\nfilm",5\r\nplain text,3\r\n\r\n'
        b'"say ""hi""",4\r\none,too,many\r\nlast,2')  # (a BOM, Windows line ends)
    src = files.file_splits(str(tmp_path / 'r.csv'), eval_fraction=0.5,
                            fields=('review', 'stars'), integer_fields=('stars',))
    rows = {r['id']: (r['review'], r['stars']) for s in src.values()
            for r in (s[i] for i in range(len(s)))}
    assert rows == {b'r.csv:2': (b'a good, long\r\nfilm', b'5'), b'r.csv:4': (b'plain text', b'3'),
                    b'r.csv:6': (b'say "hi"', b'4'), b'r.csv:7': (b'', b''),
                    b'r.csv:8': (b'last', b'2')}
    assert (f"warning: {tmp_path / 'r.csv'}:7: 3 fields, where the header row names 2; "
            f"skipped") in capsys.readouterr().err
    (tmp_path / 'p.tsv').write_text('en\tfr\none\tun\n\ntwo "quoted\tdeux "x"\n')
    src = files.file_splits(str(tmp_path / 'p.tsv'), eval_fraction=0.5, fields=('en', 'fr'))
    rows = sorted((r['en'], r['fr']) for s in src.values() for r in (s[i] for i in range(len(s))))
    assert rows == [(b'one', b'un'), (b'two "quoted', b'deux "x"')]
    (tmp_path / 'q.csv').write_text('"en,fr\none,un\n')  # the header's quote never closes
    with pytest.raises(files.FilesError, match=r"q\.csv: its header row names no column 'en' "
                                              r"\(its columns: \['en,fr\\none,un'\]\)"):
        files.file_splits(str(tmp_path / 'q.csv'), fields=('en', 'fr'))
    (tmp_path / 'd.csv').write_text('en,en,fr\none,un,uno\n')
    with pytest.raises(files.FilesError, match=r"d\.csv: its header row names the column 'en' "
                                              r"2 times; valid: one column of each name"):
        files.file_splits(str(tmp_path / 'd.csv'), fields=('en', 'fr'))


def test_csv_and_tsv_as_the_tools_write_them(tmp_path, capsys):
    """From a review: a quote inside an unquoted field (5" screen) swallowed the rest of
    the file into one bad record; a field past 128 KiB (csv's default limit) was a bad
    record; cp1252 bytes were read as U+FFFD unsaid; a TSV written by csv or pandas kept
    its quotes; an empty CSV shard stopped the corpus. Each row is read here as Python's
    csv module reads it."""
    import csv
    long_text = 'word ' * 40_000  # 200 kB
    rows = [['body', 'n'], ['a 5" screen', '1'], ['"quoted, with a break\n"', '2'],
            [long_text, '3'], ['plain', '4']]
    with open(tmp_path / 'w.csv', 'w', newline='') as fh:
        csv.writer(fh).writerows(rows)
    (tmp_path / 'w.csv').write_bytes((tmp_path / 'w.csv').read_bytes().replace(
        b'"a 5"" screen"', b'a 5" screen'))  # unquoted, as a hand-written file has it
    (tmp_path / 'empty.csv').write_text('')  # an empty shard: no records
    csv.field_size_limit(131072)  # (csv's default, which the reader raises)
    src = files.file_splits(f'{tmp_path}/*.csv', text_key='body', eval_fraction=0.5)
    read = sorted(t for s in src.values() for t in _read(s).values())
    with open(tmp_path / 'w.csv', newline='') as fh:
        assert read == sorted(r[0] for r in list(csv.reader(fh))[1:])
    assert capsys.readouterr().err.count('warning') == 0
    (tmp_path / 'c.tsv').write_bytes(b'en\tfr\n"I said ""hi"""\t"Hello," he said.\n'
                                     b'caf\xe9\tcaf\xe9\n')  # (a writer's quoting; cp1252)
    src = files.file_splits(str(tmp_path / 'c.tsv'), fields=('en', 'fr'), eval_fraction=0.5)
    pairs = sorted((r['en'], r['fr']) for s in src.values() for r in (s[i] for i in range(len(s))))
    assert pairs == [(b'', b''), (b'I said "hi"', b'"Hello," he said.')]
    assert (f"{tmp_path / 'c.tsv'}:3: not UTF-8 (invalid continuation byte at byte 3; a file "
            f"in another encoding: convert it") in capsys.readouterr().err


def test_table_cells_read_as_the_same_records_in_jsonl_would(tmp_path, capsys):
    """From a new user's audit: a label column pandas wrote as floats (5.0: an integer
    column with a missing value) read '5.0' from a CSV and '5' from JSONL, so a corpus of
    both had four classes for two; a quote that never closes read the rest of the CSV as
    one record, unsaid (also after a field strict csv refuses, "x"y); a TSV field with a
    line break (as csv and pandas quote it) is rows of another width, whose warning now
    says why (a piece of the header's width still reads, its stray quote in it: a TSV is
    read a row a line, and a quote may open a field's text, "Hello," he said.)."""
    (tmp_path / 'a.csv').write_text('review,stars\ngood,5.0\nbad,1.0\n"so so",-2.00\nmeh,2.5\n')
    (tmp_path / 'b.jsonl').write_text('{"review": "fine", "stars": 5.0}\n'
                                      '{"review": "poor", "stars": 1}\n')
    src = files.file_splits(f'{tmp_path}/a.csv,{tmp_path}/b.jsonl', eval_fraction=0.5,
                            fields=('review', 'stars'), integer_fields=('stars',))
    labels = {r['review']: r['stars'] for s in src.values() for r in (s[i] for i in range(len(s)))}
    assert labels == {b'good': b'5', b'bad': b'1', b'so so': b'-2', b'meh': b'2.5',
                      b'fine': b'5', b'poor': b'1'}
    (tmp_path / 'q.csv').write_text('id,text\n1,hello\n2,"oops unclosed\n3,world\n4,again\n')
    (tmp_path / 'r.csv').write_text('id,a,text\n1,q,"x"y\n2,"x"y,"open\n3,rest,more\n')
    src = files.file_splits(f'{tmp_path}/q.csv,{tmp_path}/r.csv', eval_fraction=0.5)
    assert sorted(t for s in src.values() for t in _read(s).values()) == ['', '', 'hello', 'xy']
    said = capsys.readouterr().err
    assert (f"{tmp_path / 'q.csv'}:3: a quote opened in it never closes, so the rest of the "
            f"file (3 lines) was read as this one record; skipped") in said
    assert f"{tmp_path / 'r.csv'}:3: a quote opened in it never closes" in said
    (tmp_path / 'm.tsv').write_text('id\ttext\n1\t"para one\nof two"\n2\tplain\n'
                                    '3\t"Buy the 5" TV," he said.\n4\t"I went home.\n')
    src = files.file_splits(str(tmp_path / 'm.tsv'), eval_fraction=0.5)
    assert sorted(t for s in src.values() for t in _read(s).values()) == [
        '', '"Buy the 5" TV," he said.', '"I went home.', '"para one', 'plain']
    assert (f"{tmp_path / 'm.tsv'}:3: 1 fields, where the header row names 2 (a quoted field "
            f"with a line break? a TSV is read a row a line, so the field's other lines are "
            f"rows too, read where they have the header's width: write such fields as CSV)"
            in capsys.readouterr().err)
    (tmp_path / 'n.tsv').write_text('id\ttext\tn\n1\t"para one\nof two"\t3\n')
    src = files.file_splits(str(tmp_path / 'n.tsv'), eval_fraction=0.5)
    [_read(s) for s in src.values()]
    assert (f"{tmp_path / 'n.tsv'}:3: 2 fields, where the header row names 3 (a quoted field "
            f"with a line break? a TSV is read a row a line, so the field's other lines are "
            f"rows too, read where they have the header's width: write such fields as CSV)"
            in capsys.readouterr().err)


def test_compressed_text_files_are_one_document_each(tmp_path, capsys):
    """A .txt.gz or .txt.zst is one document, decompressed (Project Gutenberg's dumps come
    so); one that cannot be decompressed is a bad record, skipped and said, the others
    read."""
    import zstandard
    (tmp_path / 'a.txt.gz').write_bytes(gzip.compress('the café\n'.encode() * 3))
    (tmp_path / 'b.txt.zst').write_bytes(zstandard.ZstdCompressor().compress(b'a mat'))
    (tmp_path / 'c.txt.gz').write_bytes(gzip.compress(b'lost ' * 1000)[:-20])
    src = files.file_splits(f'{tmp_path}/*.txt.*', eval_fraction=0.5)
    read = {k: v for s in src.values() for k, v in _read(s).items()}
    assert read == {'a.txt.gz': 'the café\n' * 3, 'b.txt.zst': 'a mat', 'c.txt.gz': ''}
    assert (f"{tmp_path / 'c.txt.gz'}: truncated or corrupt gzip file"
            in capsys.readouterr().err)


def test_compressed_csv_and_tsv_read_as_the_plain_ones(tmp_path, monkeypatch, capsys):
    """pandas writes `to_csv('x.csv.gz')`: .csv and .tsv compressed with gzip or zstd are
    read as the plain files are (a quoted field's line break, a BOM, Windows line ends, a
    bad row counted), their records found in the decompressed stream, here in chunks of
    7 bytes so that lines and records straddle them; a truncated one is one line naming
    it."""
    import zstandard
    monkeypatch.setattr(files, '_CHUNK', 7)
    table = (b'\xef\xbb\xbfreview,stars\r\n"a good, long\r\nfilm",5\r\nplain text,3\r\n\r\n'
             b'"say ""hi""",4\r\none,too,many\r\nlast,2')
    (tmp_path / 'r.csv').write_bytes(table)
    (tmp_path / 'r.csv.gz').write_bytes(gzip.compress(table))
    (tmp_path / 'r.csv.zst').write_bytes(zstandard.ZstdCompressor().compress(table))
    tsv = b'en\tfr\none\tun\n\n"I said ""hi"""\tdeux\n'
    (tmp_path / 'p.tsv').write_bytes(tsv)
    (tmp_path / 'p.tsv.gz').write_bytes(gzip.compress(tsv))

    def rows(name, fields):
        src = files.file_splits(str(tmp_path / name), eval_fraction=0.5, fields=fields)
        return {r['id'].decode().replace(name, 'F'): tuple(r[k] for k in fields)
                for s in src.values() for r in (s[i] for i in range(len(s)))}
    plain = rows('r.csv', ('review', 'stars'))
    assert plain['F:2'] == (b'a good, long\r\nfilm', b'5') and len(plain) == 5
    assert rows('r.csv.gz', ('review', 'stars')) == rows('r.csv.zst', ('review', 'stars')) == plain
    assert f"{tmp_path / 'r.csv.gz'}:7: 3 fields, where the header row names 2" in capsys.readouterr().err
    assert rows('p.tsv.gz', ('en', 'fr')) == rows('p.tsv', ('en', 'fr')) == {
        'F:2': (b'one', b'un'), 'F:4': (b'I said "hi"', b'deux')}
    # Records of several compressed files read in turn (a shuffle): each file decompressed
    # once where they fit in what a reader keeps; where they do not, a note says so.
    reads = []
    for name in ('_gzip_chunks', '_zstd_chunks'):
        inner = getattr(files, name)
        monkeypatch.setattr(files, name, lambda path, inner=inner: (reads.append(path),
                                                                    inner(path))[1])
    src = files.file_splits(f'{tmp_path}/r.csv.*', eval_fraction=0.5, fields=('review', 'stars'))
    assert len(reads) == 4  # indexing: a pass over each, and the first record (the header)
    reads.clear()
    for _ in range(3):  # the two splits share their files' reader
        for split in src.values():
            for i in range(len(split)):
                split[i]
    assert sorted(reads) == [str(tmp_path / 'r.csv.gz'), str(tmp_path / 'r.csv.zst')]
    assert 'compressed files of records' not in capsys.readouterr().err
    monkeypatch.setattr(files, 'CACHE_BYTES', 100)  # one file kept: each turn reads one
    files.file_splits(f'{tmp_path}/r.csv.*', eval_fraction=0.4,  # (another call: not memoised)
                      fields=('review', 'stars'))
    assert ("2 compressed files of records decompress to 0 MiB, more than a reader keeps (0 "
            "MiB): a record is read by decompressing its whole file") in capsys.readouterr().err
    (tmp_path / 'cut.csv.gz').write_bytes(gzip.compress(table * 50)[:-30])
    with pytest.raises(files.FilesError, match=r"cut\.csv\.gz: truncated or corrupt gzip file"):
        files.file_splits(str(tmp_path / 'cut.csv.gz'), fields=('review', 'stars'))


def test_nulls_are_missing_values_not_a_type(tmp_path, capsys):
    """A first stretch of records with null under the key was refused as "holds NoneType";
    a missing value (null, a pandas NaN label) is a bad record saying so."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / 'n.jsonl').write_text(''.join(
        json.dumps({'text': None if i < 25 else f'doc {i}'}) + '\n' for i in range(30)))
    src = files.file_splits(str(tmp_path / 'n.jsonl'), eval_fraction=0.5)
    texts = [t for s in src.values() for t in _read(s).values()]
    assert sorted(t for t in texts if t) == [f'doc {i}' for i in range(25, 30)]
    assert f"{tmp_path / 'n.jsonl'}:1: 'text' has no value (None); skipped" in capsys.readouterr().err
    pq.write_table(pa.table({'text': [f'doc {i}' for i in range(6)],
                             'stars': [1.0, 2.0, float('nan'), 1.0, 2.0, 1.0]}),
                   tmp_path / 'l.parquet')
    src = files.file_splits(str(tmp_path / 'l.parquet'), eval_fraction=0.5,
                            fields=('text', 'stars'), integer_fields=('stars',))
    rows = [s[i] for s in src.values() for i in range(len(s))]
    assert sorted(r['stars'] for r in rows) == [b'', b'1', b'1', b'1', b'2', b'2']
    assert "l.parquet: row 2: 'stars' has no value (nan); skipped" in capsys.readouterr().err


def test_bad_records_are_skipped_with_a_count_then_stop(tmp_path, capsys):
    good = _jsonl([f'doc {i}' for i in range(6)]).splitlines()
    bad = ['{"text": "cut in the mid', '[1, 2]', '{"text": 7}']
    (tmp_path / 'm.jsonl').write_text('\n'.join(good[:2] + bad + good[2:]) + '\n')
    src = files.file_splits(str(tmp_path / 'm.jsonl'), max_bad_records=3, eval_fraction=0.5)
    texts = [t for s in src.values() for t in _read(s).values()]
    assert sorted(t for t in texts if t) == [f'doc {i}' for i in range(6)]
    assert texts.count('') == 3  # a bad record reads as an empty document
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 3 and all(w.startswith('warning: ') for w in warned)
    where = tmp_path / 'm.jsonl'
    assert any(w.startswith(f'warning: {where}:3: not a JSON line') for w in warned)
    assert any(w.startswith(f"warning: {where}:5: 'text' is int, not text; skipped (bad "
                            f"record 3, at most 3)") for w in warned)
    # Read again (the next epoch): the same bad lines are neither counted nor said again.
    [_read(s) for s in src.values()]
    assert capsys.readouterr().err == ''
    strict = files.file_splits(str(tmp_path / 'm.jsonl'), max_bad_records=1, eval_fraction=0.5)
    with pytest.raises(files.FilesError, match='more than max_bad_records=1'):
        [s[i] for s in strict.values() for i in range(len(s))]
    # Random bytes saved as .txt were decoded with replacement characters and trained on.
    (tmp_path / 'blob').mkdir()
    (tmp_path / 'blob' / 'a.txt').write_text('a real document')
    (tmp_path / 'blob' / 'b.txt').write_bytes(bytes(range(256)) * 4)
    src = files.file_splits(f"{tmp_path / 'blob'}/*.txt", eval_fraction=0.5)
    texts = sorted(t for s in src.values() for t in _read(s).values())
    assert texts == ['', 'a real document']
    assert (f"warning: {tmp_path / 'blob' / 'b.txt'}: holds NUL bytes: a binary file, or "
            f"text not in UTF-8 (UTF-16/32: convert it to UTF-8); skipped") in capsys.readouterr().err
    # Without a NUL: random bytes were read as U+FFFD and trained on, a Latin-1 text's
    # accents too, both unsaid. Mostly not UTF-8: skipped; a few such bytes: kept, said once.
    (tmp_path / 'enc').mkdir()
    (tmp_path / 'enc' / 'latin.txt').write_bytes(
        'a café in Orléans, where nothing much happens. '.encode('latin-1') * 40)
    (tmp_path / 'enc' / 'noise.txt').write_bytes(bytes(range(1, 256)) * 8)
    # Random bytes with no NUL: 41% not UTF-8, but counted against the decoded text (each
    # U+FFFD 3 bytes) the share never passed a third, and the file was kept.
    (tmp_path / 'enc' / 'random.txt').write_bytes(
        np.random.default_rng(0).integers(1, 256, 4000, dtype=np.uint8).tobytes())
    (tmp_path / 'enc' / 'real.txt').write_text('a real document')
    src = files.file_splits(f"{tmp_path / 'enc'}/*.txt", eval_fraction=0.5)
    texts = {k: t for s in src.values() for k, t in _read(s).items()}
    assert sorted(texts.values())[:2] == ['', ''] and 'a real document' in texts.values()
    latin = next(t for t in texts.values() if t.startswith('a caf'))
    assert latin.startswith('a caf\ufffd in Orl\ufffdans') and latin.count('\ufffd') == 80
    err = capsys.readouterr().err
    for name in ('noise.txt', 'random.txt'):
        assert (f"warning: {tmp_path / 'enc' / name}: " in err
                and "of its bytes are not UTF-8: not text, or text in another encoding" in err)
    assert (f"warning: {tmp_path / 'enc' / 'latin.txt'}: 80 byte(s) not UTF-8, each read as "
            f"U+FFFD") in err
    [_read(s) for s in src.values()]  # the next epoch: nothing said again
    assert capsys.readouterr().err == ''


# ---------------------------------------------------------------------- tokenizer files
def test_a_tokenizer_file_keeps_its_ids_and_special_tokens(tmp_path):
    texts = [_sentence(i) for i in range(200)]
    (tmp_path / 'gpt').mkdir()
    path = _bpe_file(tmp_path / 'gpt' / 'tokenizer.json', texts)
    for given in (path, str(tmp_path / 'gpt')):  # the file, or its directory
        tok = data.get_tokenizer('file', path=given)
        end = tok.hf.token_to_id('<|endoftext|>')
        assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.mask_id) == (end, end, end, None)
        assert not tok.has_pad_token and tok.vocab_size == 300
        ids = tok.encode(texts[0])
        assert tok.decode(ids + [end]) == texts[0]
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'saved')))
    assert loaded.kind == 'file' and loaded.roles == tok.roles
    assert loaded.encode(texts[1]) == tok.encode(texts[1])
    # A BERT-style file: [PAD] [CLS] [SEP] [MASK] by name; its truncation is switched off.
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', *WORDS])}
    bert = Tokenizer(models.WordPiece(vocab, unk_token='[UNK]'))
    bert.normalizer = normalizers.BertNormalizer()
    bert.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    bert.decoder = decoders.WordPiece()
    bert.add_special_tokens(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'])
    bert.enable_truncation(4)
    bert.save(str(tmp_path / 'bert.json'))
    tok = data.get_tokenizer('file', path=str(tmp_path / 'bert.json'))
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.eos_id) == (0, 2, 3, 4, 3)
    assert tok.has_pad_token and len(tok.encode(' '.join(WORDS))) == len(WORDS)
    assert tok.decode(tok.encode(f'{WORDS[0]} zzzqqq')) == f'{WORDS[0]} [UNK]'  # kept
    # A tokenizer value that is a path passes the config check; a misspelt kind does not.
    config = ml_collections.ConfigDict({'task': 'gpt', 'data': {'tokenizer': path}})
    assert base.data_options(config, tokenizer='byte').tokenizer == path
    config.data.tokenizer = 'bytes'
    with pytest.raises(ConfigError, match="'bytes' is unknown"):
        base.data_options(config, tokenizer='byte')
    # Bad files, one line each; MLM without a mask token.
    (tmp_path / 'broken.json').write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(data.TokenizerFileError, match=r'broken\.json: not a tokenizer\.json'):
        data.get_tokenizer('file', path=str(tmp_path / 'broken.json'))
    with pytest.raises(data.TokenizerFileError, match='no such file'):
        data.get_tokenizer('file', path=str(tmp_path / 'absent.json'))
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'a.txt').write_text(' '.join(texts[:50]))
    (tmp_path / 'docs' / 'b.txt').write_text(' '.join(texts[50:]))
    config = bert_config.get_config()
    config.data.name, config.data.files = 'files', str(tmp_path / 'docs' / '*.txt')
    config.data.tokenizer = path
    with pytest.raises(ConfigError, match=r'tokenizer\.json has no mask token, which MLM needs'):
        base.TASKS['bert_mlm'](config, str(tmp_path / 'run'))


# ------------------------------------------------------------------- the command line
def test_prepare_then_train_on_files_with_a_tokenizer_file_then_sample(corpus, tmp_path):
    root, expected = corpus
    tokenizer = _bpe_file(tmp_path / 'tokenizer.json', list(expected.values()))
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO,
               XLA_FLAGS=xla_flags(8))
    work = tmp_path / 'run'
    args = ['--config=gpt', f'--workdir={work}', '--config.data.name=files',
            f'--config.data.files={root}/**/*.txt,{root}/*.jsonl.gz,{root}/*.parquet',
            f'--config.data.tokenizer={tokenizer}', '--config.data.eval_fraction=0.2',
            f'--config.data.cache_dir={tmp_path / "cache"}',
            '--config.data.seq_len=32', '--config.model.num_layers=1',
            '--config.model.d_model=16', '--config.model.num_heads=2',
            '--config.train.steps=2', '--config.optim.warmup_steps=1',
            '--config.train.batch_size=8', '--config.train.log_every=2',
            '--config.eval.every=-1', '--config.eval.steps=1', '--config.eval.batch_size=8',
            '--config.eval.sample_tokens=4']
    run = lambda *extra: subprocess.run([sys.executable, '-m', 'attention_jax.main', *args,
                                         *extra], env=env, cwd=REPO, capture_output=True,
                                        text=True, timeout=300)
    # Tokenized once by the prepare command; the run then opens the cache, preparing nothing.
    prepare = subprocess.run([sys.executable, '-m', 'attention_jax.tools.prepare', *args[:1],
                              *args[2:]], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    assert prepare.stdout.startswith('train: ') and 'tokens (uint16)' in prepare.stdout
    out = run()
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'prepare ' not in out.stderr and len(os.listdir(tmp_path / 'cache')) == 2
    saved = data.load_tokenizer(str(work / 'tokenizer'))
    assert saved.kind == 'file' and saved.vocab_size == 300
    assert json.load(open(work / 'config.json'))['data']['tokenizer'] == tokenizer
    out = run('--mode=sample')
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count('--- prompt ') == 3
    # prepare --workdir=DIR takes the tokenizer a run saved there; a DIR without one is an
    # error, not the config's own tokenizer in silence.
    (tmp_path / 'notrun').mkdir()
    prepare = subprocess.run([sys.executable, '-m', 'attention_jax.tools.prepare', *args[:1],
                              f'--workdir={tmp_path / "notrun"}', *args[2:]], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 1 and prepare.stderr.startswith(
        f'error: --workdir={tmp_path / "notrun"}: no tokenizer saved there'), prepare.stderr


def test_prepare_says_when_the_eval_split_outweighs_train(tmp_path, capsys):
    """One long document landing in eval made the eval split 140 times the train split,
    with nothing said."""
    from attention_jax.tools import prepare
    (tmp_path / 'small.txt').write_text('a short training document. ' * 4)
    (tmp_path / 'big.txt').write_text('a long held-out document. ' * 400)
    argv = ['--config=gpt', '--workers=1', '--config.data.name=files',
            f'--config.data.files={tmp_path / "small.txt"}',
            f'--config.data.eval_files={tmp_path / "big.txt"}',
            '--config.data.cache_dir', str(tmp_path / "cache")]  # two words, as main takes
    assert prepare.main(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith('train: 1 documents, 109 tokens')  # 108 bytes and the end
    assert ('note: the eval split holds more tokens than the train split (10,401 against '
            '109): the eval files hold more than the train files') in out.err
    argv[3:5] = [f'--config.data.files={tmp_path / "big.txt"}',
                 f'--config.data.eval_files={tmp_path / "small.txt"}']
    assert prepare.main(argv) == 0
    assert 'note: the eval split' not in capsys.readouterr().err


def test_prepare_refuses_a_corpus_without_text_as_training_does(tmp_path, capsys):
    """Two empty files: prepare said '1 documents, 1 tokens' and exited 0; training the
    same config then refused it."""
    from attention_jax.tools import prepare
    (tmp_path / 'empty').mkdir()
    for name in ('a.txt', 'b.txt'):
        (tmp_path / 'empty' / name).write_text('')
    argv = ['--config=gpt', '--workers=1', '--config.data.name=files',
            f'--config.data.files={tmp_path / "empty"}/*.txt',
            f'--config.data.cache_dir={tmp_path / "cache"}']
    assert prepare.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith('error: config.data.files: the train split holds no text')


@pytest.mark.parametrize("spec", ["gs://bucket/corpus/*.jsonl", "s3://bucket/a.txt"])
def test_files_in_object_storage_are_one_line_saying_so(spec):
    """A bucket's URL in data.files was globbed as a local path: 'matches no file
    (relative globs start in <cwd>); moved?', of files that are there."""
    with pytest.raises(files.FilesError) as e:
        files.list_files(spec, "config.data.files")
    assert "object storage are not read" in str(e.value), e.value
    assert "matches no file" not in str(e.value)


def test_an_image_root_in_object_storage_is_one_line_saying_so():
    from attention_jax.data import images
    with pytest.raises(images.ImagesError) as e:
        images.list_classes("gs://bucket/pets", "config.data.root")
    assert "object storage are not read" in str(e.value), e.value
    assert "does not exist" not in str(e.value)
