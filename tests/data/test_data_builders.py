"""Offline tfds builders: deterministic, disjoint splits, readable without TensorFlow;
catalogue datasets fail fast with a useful message when they are not prepared."""

import os
import sys
import time

import numpy as np
import pytest

from attention_jax import data
from attention_jax.data import builders, sources


def _records(source):
    return [source[i] for i in range(len(source))]


def _assert_same_records(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            np.testing.assert_array_equal(ra[key], rb[key])


def test_stdlib_corpus_builds_identically_and_splits_by_document(tmp_path):
    splits = {}
    for run in ('a', 'b'):
        splits[run] = {s: _records(data.get_dataset('python_stdlib', s, tmp_path / run,
                                                    max_files=6))
                       for s in ('train', 'validation')}
    for s in ('train', 'validation'):
        _assert_same_records(splits['a'][s], splits['b'][s])
    ids = {s: [r['id'].decode() for r in recs] for s, recs in splits['a'].items()}
    assert ids['train'] and ids['validation']
    assert not set(ids['train']) & set(ids['validation'])
    # Together the splits are exactly the first six files in sorted order, read verbatim.
    listed = builders.list_corpus_files(builders.stdlib_corpus_config(max_files=6))
    assert sorted(ids['train'] + ids['validation']) == [doc_id for doc_id, _ in listed]
    record = splits['a']['train'][0]
    path = dict(listed)[record['id'].decode()]
    with open(path, encoding='utf-8', errors='replace') as f:
        assert record['text'].decode() == f.read()


def test_text_corpus_from_user_globs(tmp_path):
    root = tmp_path / 'corpus'
    (root / 'sub').mkdir(parents=True)
    texts = {f'sub/doc{i}.txt': f'document {i}\nlíne two {i}\n' for i in range(5)}
    for name, text in texts.items():
        (root / name).write_text(text, encoding='utf-8')
    (root / 'ignored.md').write_text('not matched')
    got = {}
    for split in ('train', 'validation'):
        for r in _records(data.get_dataset('text_corpus', split, tmp_path / 'data',
                                           globs=['**/*.txt'], root=str(root))):
            assert r['id'].decode() not in got  # No document in two splits.
            got[r['id'].decode()] = r['text'].decode()
    assert got == texts


def test_digits_stratified_split_is_fixed_and_disjoint(tmp_path):
    a = {s: _records(data.get_dataset('digits', s, tmp_path / 'a')) for s in ('train', 'test')}
    b = {s: _records(data.get_dataset('digits', s, tmp_path / 'b')) for s in ('train', 'test')}
    for s in a:
        _assert_same_records(a[s], b[s])
    train = {int(r['index']) for r in a['train']}
    test = {int(r['index']) for r in a['test']}
    assert not train & test and len(train | test) == 1797
    from sklearn.datasets import load_digits
    digits = load_digits()
    for r in a['test'][:20]:
        expected = np.round(digits.images[r['index']] * 255 / 16).astype(np.uint8)
        np.testing.assert_array_equal(r['image'][..., 0], expected)
        assert r['label'] == digits.target[r['index']]
    # Stratified: each class keeps its 20% share in test, to rounding.
    for c in range(10):
        n_class = int((digits.target == c).sum())
        n_test = sum(int(r['label']) == c for r in a['test'])
        assert n_test == round(0.2 * n_class)


def test_number_translation_deterministic_disjoint_and_correct(tmp_path):
    opts = dict(num_train=300, num_validation=60, num_test=60, max_digits=12, seed=1)
    runs = []
    for run in ('a', 'b'):
        runs.append({s: _records(data.get_dataset('number_translation', s, tmp_path / run,
                                                  **opts))
                     for s in ('train', 'validation', 'test')})
    for s in runs[0]:
        _assert_same_records(runs[0][s], runs[1][s])
    numbers = {s: {int(r['number']) for r in recs} for s, recs in runs[0].items()}
    assert [len(numbers[s]) for s in ('train', 'validation', 'test')] == [300, 60, 60]
    assert not (numbers['train'] & numbers['validation'] or numbers['train'] & numbers['test']
                or numbers['validation'] & numbers['test'])
    from num2words import num2words
    lengths = []
    for r in runs[0]['train'][:50]:
        n = int(r['number'])
        assert r['fr'].decode() == num2words(n, lang='fr')
        assert r['de'].decode() == num2words(n, lang='de')
        lengths.append(len(r['en'].decode().split()))
    assert min(lengths) <= 3 and max(lengths) >= 12  # Spans magnitudes.
    assert builders.number_words(42)['de'] == 'zweiundvierzig'


def test_missing_catalogue_dataset_fails_fast_with_instructions(tmp_path):
    start = time.time()
    with pytest.raises(data.DatasetNotFoundError) as info:
        data.get_dataset('mnist', 'train', tmp_path)
    assert time.time() - start < 20
    message = str(info.value)
    assert "'mnist'" in message and str(tmp_path) in message
    assert 'tfds build mnist' in message and 'array_record' in message
    assert not os.path.exists(tmp_path / 'downloads' / 'mnist')  # Nothing was fetched.
    with pytest.raises(data.DatasetNotFoundError, match='Unknown dataset'):
        data.get_dataset('no_such_dataset_xyz', 'train', tmp_path)


def test_bad_split_and_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="no split 'validation'.*'test'"):
        data.get_dataset('digits', 'validation', tmp_path)
    with pytest.raises(ValueError, match='only apply to the offline'):
        data.get_dataset('mnist', 'train', tmp_path, max_files=3)


def test_missing_and_empty_splits_are_one_line_user_errors(tmp_path):
    from attention_jax.errors import UserError
    from attention_jax.tasks import base
    # Both were tracebacks: a plain ValueError, and (empty) array_record's "Paths
    # sequence can not be of 0 length" from deep inside the reader.
    with pytest.raises(UserError, match=r"^dataset 'digits' has no split 'valid'; "
                                        r"valid: \['train', 'test'\]$"):
        data.get_dataset('digits', 'valid', tmp_path)
    with pytest.raises(UserError, match=r"^split 'train\[:0\]' of dataset 'digits' "
                                        r"holds no records; valid: .* e.g. 'train'$"):
        data.get_dataset('digits', 'train[:0]', tmp_path)
    # Through the tasks the message names the config key that holds the split.
    import ml_collections
    opts = ml_collections.ConfigDict(dict(name='digits', train_split='train[:0]',
                                          eval_split='valid', data_dir=str(tmp_path)))
    with pytest.raises(UserError, match=r"^config.data.train_split='train\[:0\]': split "):
        base.splits(opts)
    opts.train_split = 'train'
    with pytest.raises(UserError, match=r"^config.data.eval_split='valid': dataset "):
        base.splits(opts)


def test_a_data_dir_that_does_not_exist_is_named(tmp_path):
    import ml_collections
    from attention_jax.errors import ConfigError
    from attention_jax.tasks import base
    missing = str(tmp_path / 'no' / 'such' / 'dir')
    opts = ml_collections.ConfigDict(dict(name='my_pairs', train_split='train',
                                          eval_split='test', data_dir=missing))
    with pytest.raises(ConfigError) as info:
        base.splits(opts)
    message = str(info.value)
    assert message.startswith("config.data.name='my_pairs': Unknown dataset 'my_pairs'")
    assert message.endswith(f"(config.data.data_dir={missing!r} does not exist)")
    opts.data_dir = str(tmp_path)  # exists: the note would mislead
    with pytest.raises(ConfigError) as info:
        base.splits(opts)
    assert 'does not exist' not in str(info.value)


def test_builders_do_not_need_tensorflow():
    # Importing and building above ran in this process; TensorFlow must not be loaded.
    assert 'tensorflow' not in sys.modules


def test_default_configs_construct(tmp_path):
    # The full corpus and the default translation set are what experiments use; building
    # them is slow for a unit test, but their builders must resolve and list real files.
    stdlib = data.get_builder('python_stdlib', tmp_path, prepare=False)
    assert stdlib.builder_config.name == 'python_stdlib' and not stdlib.is_prepared()
    assert len(builders.list_corpus_files(stdlib.builder_config)) > 100
    numbers = data.get_builder('number_translation', tmp_path, prepare=False)
    assert numbers.builder_config.num_train == 20_000
    assert data.get_builder('number_translation/small', tmp_path,
                            prepare=False).builder_config.num_train == 2_000


def test_stdlib_docstrings_are_labelled_by_package_and_split_by_source(tmp_path):
    """Each record is a documented function's or class's first paragraph, labelled by the
    package its file is in; no text stands under two labels or in two splits; the split
    is a function of the source; a second build gives the same records. Read from a
    library of our own making (root=), then the real one is built."""
    pkg = tmp_path / "lib"
    for package, body in (("email", '"""Parse the message headers into a dict."""'),
                          ("http", '"""Send the response headers to the client."""'),
                          ("xml", '"""Parse the message headers into a dict."""')):
        (pkg / package / "sub").mkdir(parents=True)
        (pkg / package / "sub" / "m.py").write_text(
            f"def f():\n    {body}\n\nclass C:\n    '''One word.'''\n\n"
            f"def g():\n    '''Return the {package} thing, twice.\n\n    More.'''\n"
            f"def h():\n    '''Return the {package} thing, twice.'''\n")
        (pkg / package / "test").mkdir()
        (pkg / package / "test" / "t.py").write_text("def t():\n    '''A test's own words.'''\n")
    records = builders.docstring_records(str(pkg))
    assert sorted(text for _, text, _ in records) == [
        "Return the email thing, twice.", "Return the http thing, twice.",
        "Return the xml thing, twice.", "Send the response headers to the client."]
    assert ("email/sub/m.py:7", "Return the email thing, twice.", "email") in records
    from attention_jax import data
    built = [{s: [(r["source"], r["text"], int(r["label"])) for r in
                  (lambda src: [src[i] for i in range(len(src))])(
                      data.get_dataset("stdlib_docstrings", s, tmp_path / d))]
              for s in ("train", "validation", "test")} for d in ("a", "b")]
    assert built[0] == built[1]
    texts = {s: {t for _, t, _ in recs} for s, recs in built[0].items()}
    assert not (texts["train"] & texts["validation"] or texts["train"] & texts["test"])
    every = [r for recs in built[0].values() for r in recs]
    assert len(every) == len(builders.docstring_records()) > 1000
    for source, text, label in every[:50]:
        assert source.decode().split("/")[0] == builders.DOC_PACKAGES[label]
    assert len(built[0]["train"]) > 3 * len(built[0]["validation"])


def test_an_offline_dataset_names_a_data_dir_it_cannot_be_built_in(tmp_path):
    """A data_dir that is a file (or unwritable, or missing under /proc) raised the
    builder's own NotADirectoryError from tfds' insides, a traceback; a corpus file's
    error is still its own."""
    from attention_jax.errors import UserError
    a_file = tmp_path / 'afile'
    a_file.write_text('not a folder')
    with pytest.raises(sources.DataDirError, match=rf"^data_dir='{a_file}': the offline "
                                                   rf"dataset 'python_stdlib' cannot be built "
                                                   rf"there \(.*\); set config\.data\.data_dir "
                                                   rf"to a writable directory$") as info:
        sources.get_builder('python_stdlib', str(a_file), max_files=2)
    assert isinstance(info.value, UserError)
    # A folder above data_dir that cannot be made fails at that folder: named too.
    with pytest.raises(sources.DataDirError, match=rf"^data_dir='{a_file}/x/y': .*"
                                                   rf"\(.*: {a_file}"):
        sources.get_builder('python_stdlib', str(a_file / 'x' / 'y'), max_files=2)
    assert not sources._under(str(tmp_path / 'corpus.txt'), str(a_file))
    assert sources._under(str(a_file / 'downloads'), str(a_file))
    assert not sources._under(None, str(a_file))
