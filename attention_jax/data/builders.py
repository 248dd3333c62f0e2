"""Offline tfds builders: a text corpus, scikit-learn's digits, number translation.

Each builder is a real `tfds.core.GeneratorBasedBuilder` that writes array_record
files into a data dir and is read back through `builder.as_data_source(split)`.
None of them needs the network or TensorFlow: the features are `Text` (stored as
UTF-8 bytes), `Tensor` and `ClassLabel`, which tfds encodes with numpy alone.

Determinism is part of the contract (tests build each twice and compare records):
file lists are sorted, every random choice has a fixed seed, and the split rules
depend only on a record's identity (its path, its integer), never on order of arrival.
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath  # tfds' own path library.

from attention_jax.data.files import stable_hash64

# Builders read their own arguments from a config; the tfds file format that allows
# random access (and therefore grain's global shuffle) is array_record.
FILE_FORMAT = 'array_record'


class OfflineBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders here.

    tfds locates a builder's source file (for download checksums) through a check that
    imports `importlib_resources`, a package tfds does not install on Python >= 3.9.
    Our builders download nothing, so we give the path directly.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    # tfds announces "Downloading and preparing dataset Unknown size ..." and "...
    # downloaded and prepared" in bold; these builders download nothing, so one plain
    # line says what happens instead.
    def _log_download_bytes(self) -> None:
        name = f'{self.name}/{self.builder_config.name}' if self.builder_config else self.name
        print(f'building the offline dataset {name} in {self.data_dir} (once; nothing is '
              f'downloaded)', flush=True)

    def _log_download_done(self) -> None:
        pass


# tfds warnings that the offline builders provoke by design: a config object built at
# run time (python_stdlib's file count, text_corpus's globs) rather than a registered
# one, and a not-yet-built variant folder probed before the first build.
HARMLESS_TFDS_WARNINGS = ('Using custom data configuration: %s', 'Variant folder %s has no %s')


def _stable_bucket(key: str, buckets: int = 100) -> int:
    """A bucket in [0, buckets) that depends only on `key` (not on Python's hash seed)."""
    return stable_hash64(key) % buckets


# --------------------------------------------------------------------------------------
# Text corpus: local text files. Its registered config is the Python standard library
# ('python_stdlib'); 'text_corpus' needs globs (sources._text_corpus refuses none).
# --------------------------------------------------------------------------------------

# Directories of the standard library that are not ordinary library source: tests
# (huge and repetitive), vendored wheels, GUI demos, and third-party site-packages.
_STDLIB_EXCLUDE = ('test', 'tests', 'idlelib', 'lib2to3', 'turtledemo', 'tkinter',
                   'ensurepip', 'site-packages', 'dist-packages', '__pycache__')


@dataclasses.dataclass(eq=False)
class TextCorpusConfig(tfds.core.BuilderConfig):
    """Which files make the corpus.

    Attributes:
      root: directory the globs are relative to; document ids are paths relative to it,
        so the split of a file does not depend on where the corpus lives.
      globs: glob patterns under `root` (`**` recurses).
      exclude_dirs: a file under a directory with one of these names is skipped.
      max_files: keep only the first `max_files` files in sorted order (tests, smoke runs).
      validation_percent: share of documents (by a hash of their id) in 'validation'.
    """
    root: str = ''
    globs: tuple[str, ...] = ('**/*.txt',)
    exclude_dirs: tuple[str, ...] = ()
    max_files: int | None = None
    validation_percent: int = 5


def stdlib_corpus_config(max_files: int | None = None) -> TextCorpusConfig:
    """The Python standard library's own source: several MB of real text on any machine."""
    name = 'python_stdlib' if max_files is None else f'python_stdlib_first{max_files}'
    return TextCorpusConfig(
        name=name, root=sysconfig.get_paths()['stdlib'], globs=('**/*.py',),
        exclude_dirs=_STDLIB_EXCLUDE, max_files=max_files,
        description='Python standard library source files, one document per file.')


def text_corpus_config(globs: Sequence[str], root: str = '', max_files: int | None = None,
                       validation_percent: int = 5, name: str | None = None) -> TextCorpusConfig:
    """A corpus from the user's files. The config name (and so the data dir) is a hash
    of the arguments unless given, so two different corpora never share prepared files."""
    if isinstance(globs, str):
        globs = (globs,)
    if not globs:
        raise ValueError('text_corpus needs at least one glob, got globs=()')
    root = os.path.abspath(root) if root else ''
    if name is None:
        digest = hashlib.md5(repr((tuple(globs), root, max_files, validation_percent))
                             .encode()).hexdigest()[:10]
        name = f'files_{digest}'
    return TextCorpusConfig(name=name, root=root, globs=tuple(globs), max_files=max_files,
                            validation_percent=validation_percent,
                            description=f'Local text files {list(globs)} under {root!r}.')


def list_corpus_files(config: TextCorpusConfig) -> list[tuple[str, str]]:
    """(document id, absolute path) pairs in a deterministic (sorted) order."""
    found = {}
    for pattern in config.globs:
        full = os.path.join(config.root, pattern) if config.root else pattern
        for path in glob_lib.glob(full, recursive=True):
            if not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, config.root) if config.root else os.path.abspath(path)
            if set(rel.split(os.sep)[:-1]) & set(config.exclude_dirs):
                continue
            found[rel.replace(os.sep, '/')] = os.path.abspath(path)
    files = sorted(found.items())
    if config.max_files is not None:
        files = files[:config.max_files]
    if not files:
        raise FileNotFoundError(
            f'text corpus {config.name!r}: no files match globs={list(config.globs)} '
            f'under root={config.root!r}')
    return files


def split_corpus_files(config: TextCorpusConfig) -> dict[str, list[tuple[str, str]]]:
    """Split by document so no file contributes to both splits."""
    files = list_corpus_files(config)
    buckets = [_stable_bucket(doc_id) for doc_id, _ in files]
    is_val = [b < config.validation_percent for b in buckets]
    if not any(is_val) and len(files) > 1 and config.validation_percent > 0:
        # Tiny corpora (tests, --max_files) could otherwise get an empty validation split;
        # promote the file with the smallest bucket, which is still a function of ids only.
        is_val[int(np.argmin(buckets))] = True
    return {'train': [f for f, v in zip(files, is_val) if not v],
            'validation': [f for f, v in zip(files, is_val) if v]}


class TextCorpus(OfflineBuilder):
    """One record per file: {'id': relative path, 'text': file contents}."""

    VERSION = tfds.core.Version('1.0.0')
    BUILDER_CONFIGS = [stdlib_corpus_config()]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description=self.builder_config.description,
            features=tfds.features.FeaturesDict({
                'id': tfds.features.Text(), 'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download: the files are local.
        return {split: self._generate_examples(files)
                for split, files in split_corpus_files(self.builder_config).items()}

    def _generate_examples(self, files):
        for doc_id, path in files:
            with open(path, 'rb') as f:
                # Undecodable bytes become U+FFFD rather than failing the whole build.
                text = f.read().decode('utf-8', errors='replace')
            yield doc_id, {'id': doc_id, 'text': text}


# --------------------------------------------------------------------------------------
# Digits: scikit-learn's bundled 8x8 handwritten digits (UCI optdigits test set).
# --------------------------------------------------------------------------------------

class SklearnDigits(OfflineBuilder):
    """1,797 grey 8x8 images, labels 0-9; a stratified 80/20 train/test split."""

    VERSION = tfds.core.Version('1.0.0')
    TEST_FRACTION = 0.2
    SEED = 0

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description="scikit-learn's load_digits, pixels rescaled to 0-255.",
            features=tfds.features.FeaturesDict({
                'image': tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                'label': tfds.features.ClassLabel(num_classes=10),
                'index': tfds.features.Tensor(shape=(), dtype=np.int64)}),
            supervised_keys=('image', 'label'))

    @classmethod
    def split_indices(cls, labels: np.ndarray) -> dict[str, np.ndarray]:
        """Stratified split written out here (not sklearn's) so it cannot drift with
        scikit-learn versions: per class, a seeded permutation; the first 20% is test."""
        rng = np.random.default_rng(cls.SEED)
        test = []
        for c in range(10):
            members = np.flatnonzero(labels == c)
            n_test = int(round(len(members) * cls.TEST_FRACTION))
            test.extend(rng.permutation(members)[:n_test].tolist())
        is_test = np.zeros(len(labels), bool)
        is_test[test] = True
        return {'train': np.flatnonzero(~is_test), 'test': np.flatnonzero(is_test)}

    def _split_generators(self, dl_manager):
        del dl_manager
        from sklearn.datasets import load_digits  # Bundled with scikit-learn: no download.
        digits = load_digits()
        # Pixel values are 0..16; stretch to the usual uint8 range so that image code
        # (normalisation, plots) treats digits like any other image set.
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
        labels = digits.target.astype(np.int64)
        return {split: self._generate_examples(images, labels, idx)
                for split, idx in self.split_indices(labels).items()}

    def _generate_examples(self, images, labels, indices):
        for i in indices:
            yield int(i), {'image': images[i], 'label': int(labels[i]), 'index': int(i)}


# --------------------------------------------------------------------------------------
# Number translation: English number words -> French and German number words.
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class NumberTranslationConfig(tfds.core.BuilderConfig):
    """Sizes and the range of integers. Integers are drawn by magnitude first (number of
    digits uniform in 1..max_digits), so 'seven' and 'nine hundred and eighty-seven
    billion, ...' are both common and input lengths span ~1 to 20+ words."""
    num_train: int = 20_000
    num_validation: int = 1_000
    num_test: int = 1_000
    max_digits: int = 12
    seed: int = 0


LANGUAGES = ('en', 'fr', 'de')


def draw_split_integers(config: NumberTranslationConfig) -> dict[str, list[int]]:
    """Distinct integers, dealt to train/validation/test in order: disjoint by construction."""
    rng = np.random.default_rng(config.seed)
    total = config.num_train + config.num_validation + config.num_test
    capacity = 10 ** config.max_digits
    if total > capacity // 2:
        raise ValueError(f'{config.name}: {total} distinct integers requested but '
                         f'max_digits={config.max_digits} allows only {capacity}')
    seen: dict[int, None] = {}  # An ordered set: dealing order must be reproducible.
    while len(seen) < total:
        digits = int(rng.integers(1, config.max_digits + 1))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        seen.setdefault(int(rng.integers(low, 10 ** digits)), None)
    numbers = list(seen)
    a, b = config.num_train, config.num_train + config.num_validation
    return {'train': numbers[:a], 'validation': numbers[a:b], 'test': numbers[b:]}


def number_words(n: int) -> dict[str, str]:
    from num2words import num2words  # Imported here: only the builder needs it.
    return {lang: num2words(n, lang=lang) for lang in LANGUAGES}


class NumberTranslation(OfflineBuilder):
    """{'number': int, 'en': words, 'fr': words, 'de': words} per integer."""

    VERSION = tfds.core.Version('1.0.0')
    BUILDER_CONFIGS = [
        NumberTranslationConfig(name='default', description='20k/1k/1k integers < 1e12.'),
        NumberTranslationConfig(name='small', num_train=2_000, num_validation=200,
                                num_test=200, max_digits=7,
                                description='2k/200/200 integers < 1e7, for smoke runs.'),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description='English number words to French and German (num2words).',
            features=tfds.features.FeaturesDict({
                'number': tfds.features.Tensor(shape=(), dtype=np.int64),
                **{lang: tfds.features.Text() for lang in LANGUAGES}}))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(numbers)
                for split, numbers in draw_split_integers(self.builder_config).items()}

    def _generate_examples(self, numbers: list[int]) -> Iterator:
        for n in numbers:
            yield n, {'number': n, **number_words(n)}


# --------------------------------------------------------------------------------------
# Number languages: a number written in words, labelled by its language (text
# classification, the fine-tuning task of BERT's §4 on a corpus that needs no network).
# --------------------------------------------------------------------------------------

# Three Romance languages close enough to share short numbers' words ('seis' is Spanish
# and Portuguese): a short text is hard, a long one easy.
CLASS_LANGUAGES = ('en', 'fr', 'de', 'es', 'it', 'pt')


def language_records(n: int) -> list[tuple[str, str]]:
    """(language, words) of the integer n in each of CLASS_LANGUAGES, less the words that
    two languages share for n ('six' in English and French, 'zero' in three): such a text
    has no one right label."""
    from num2words import num2words
    words = {lang: num2words(n, lang=lang) for lang in CLASS_LANGUAGES}
    counts: dict[str, int] = {}
    for text in words.values():
        counts[text] = counts.get(text, 0) + 1
    return [(lang, text) for lang, text in words.items() if counts[text] == 1]


class NumberLanguages(OfflineBuilder):
    """{'number': int, 'text': words, 'label': its language} per integer and language.
    The integers of train, validation and test are disjoint (draw_split_integers)."""

    VERSION = tfds.core.Version('1.0.0')
    BUILDER_CONFIGS = [
        NumberTranslationConfig(name='default', num_train=3_000, num_validation=300,
                                num_test=300, max_digits=7,
                                description='3k/300/300 integers < 1e7, six languages each.'),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description='Number words (num2words) labelled by their language.',
            features=tfds.features.FeaturesDict({
                'number': tfds.features.Tensor(shape=(), dtype=np.int64),
                'text': tfds.features.Text(),
                'label': tfds.features.ClassLabel(names=CLASS_LANGUAGES)}),
            supervised_keys=('text', 'label'))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(numbers)
                for split, numbers in draw_split_integers(self.builder_config).items()}

    def _generate_examples(self, numbers: list[int]) -> Iterator:
        for n in numbers:
            for lang, text in language_records(n):
                yield f'{n}-{lang}', {'number': n, 'text': text, 'label': lang}


# --------------------------------------------------------------------------------------
# Docstrings labelled by their package: English sentences on any machine, hard enough
# that what a pre-trained encoder knows shows ('Return the HTTP headers' is http's).
# --------------------------------------------------------------------------------------

# Packages of the standard library in every Python from 3.10 on, with 100 docstrings
# or more each (3.11: 139 to 346).
DOC_PACKAGES = ('asyncio', 'email', 'http', 'importlib', 'logging', 'multiprocessing',
                'unittest', 'urllib', 'xml')

# A docstring's first paragraph, kept where it has this many words: a label from one
# word ('Constructor.') is a guess, and a long one names its package.
DOC_WORDS = (3, 40)


def docstring_records(root: str | None = None) -> list[tuple[str, str, str]]:
    """(source, text, package) for the first paragraph of every documented function and
    class of DOC_PACKAGES under `root` (the running Python's standard library), outside
    their tests; source is 'path:line' relative to root. A text found in two packages is
    left out (it has no one right label); a text repeated in one is kept once."""
    import ast
    root = root or sysconfig.get_paths()['stdlib']
    found: dict[str, list[tuple[str, int, str]]] = {}
    for package in DOC_PACKAGES:
        for path in sorted(glob_lib.glob(os.path.join(root, package, '**', '*.py'),
                                         recursive=True)):
            rel = os.path.relpath(path, root).replace(os.sep, '/')
            if any(part in _STDLIB_EXCLUDE for part in rel.split('/')[:-1]):
                continue
            with open(path, encoding='utf-8') as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node)
                    text = ' '.join((doc or '').strip().split('\n\n')[0].split())
                    if DOC_WORDS[0] <= len(text.split()) <= DOC_WORDS[1]:
                        found.setdefault(text, []).append((rel, node.lineno, package))
    records = []
    for text, places in found.items():
        if len({package for _, _, package in places}) == 1:
            rel, line, package = min(places)  # the first in file and line order
            records.append((f'{rel}:{line}', text, package))
    return sorted(records)


class StdlibDocstrings(OfflineBuilder):
    """{'source': 'path:line', 'text': a docstring's first paragraph, 'label': its
    package} (docstring_records): train 70%, validation 15%, test 15% by a hash of the
    source. Built from the running Python's own library, so its counts differ a little
    between Python versions (3.11: 1,900 texts)."""

    VERSION = tfds.core.Version('1.0.0')

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self, description='Standard-library docstrings labelled by package.',
            features=tfds.features.FeaturesDict({
                'source': tfds.features.Text(),
                'text': tfds.features.Text(),
                'label': tfds.features.ClassLabel(names=DOC_PACKAGES)}),
            supervised_keys=('text', 'label'))

    def _split_generators(self, dl_manager):
        del dl_manager
        by_split: dict[str, list] = {'train': [], 'validation': [], 'test': []}
        for record in docstring_records():
            bucket = _stable_bucket(record[0])
            split = 'train' if bucket < 70 else 'validation' if bucket < 85 else 'test'
            by_split[split].append(record)
        return {split: self._generate_examples(records) for split, records in by_split.items()}

    def _generate_examples(self, records) -> Iterator:
        for source, text, package in records:
            yield source, {'source': source, 'text': text, 'label': package}
