"""Datasets by name: the offline builders of this package and the tfds catalogue.

`get_dataset(name, split, data_dir)` returns a random-access source (`len`, `[i]`,
records are dicts of numpy values) that the grain loaders read. Offline builders are
prepared on first use; catalogue datasets are only ever read: if one is not prepared
in `data_dir`, we fail at once with a message that says how to prepare it, instead of
letting tfds try to download (which hangs or fails deep inside on a machine without
network).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np
import tensorflow_datasets as tfds

from attention_jax import quiet
from attention_jax.data import builders, images
from attention_jax.errors import ConfigError, UserError


class DatasetNotFoundError(UserError, FileNotFoundError):
    """A dataset that is neither an offline builder nor prepared in the data dir."""


class DataDirError(UserError, OSError):
    """The data_dir where an offline dataset is built cannot hold it (missing, a file, or
    not writable)."""


def _under(path, folder) -> bool:
    """Whether `path` is `folder` or inside it (False unless both are paths)."""
    if not all(isinstance(p, (str, bytes, os.PathLike)) for p in (path, folder)):
        return False
    path, folder = os.path.abspath(os.fsdecode(path)), os.path.abspath(os.fsdecode(folder))
    return os.path.commonpath([path, folder]) == folder


class SplitError(UserError, ValueError):
    """A split the dataset does not have, or one that holds no records."""


def _text_corpus(options) -> tuple[type, tfds.core.BuilderConfig]:
    if not options.get('globs'):
        # It once fell back to the standard library: a run on the wrong corpus, silently.
        raise ConfigError("text_corpus needs globs=[...] of your files; from the command line "
                          "use --config.data.name=files --config.data.files=GLOBS "
                          "(python_stdlib is the standard library's source)")
    return builders.TextCorpus, builders.text_corpus_config(**options)


def _number_translation(options) -> tuple[type, tfds.core.BuilderConfig | str | None]:
    config = options.pop('config', None)
    if options:
        # Custom sizes/seed: the config name records them so prepared files never clash.
        tag = '_'.join(f'{k}{v}' for k, v in sorted(options.items()))
        config = builders.NumberTranslationConfig(name=f'custom_{tag}', **options)
    return builders.NumberTranslation, config


def _number_languages(options) -> tuple[type, tfds.core.BuilderConfig | str | None]:
    config = options.pop('config', None)
    if options:  # custom sizes/seed over the default config's, named by them
        tag = '_'.join(f'{k}{v}' for k, v in sorted(options.items()))
        default = builders.NumberLanguages.BUILDER_CONFIGS[0]
        sizes = {k: getattr(default, k) for k in ('num_train', 'num_validation', 'num_test',
                                                  'max_digits', 'seed')}
        config = builders.NumberTranslationConfig(name=f'custom_{tag}', **{**sizes, **options})
    return builders.NumberLanguages, config


# Offline datasets: name -> function(options) -> (builder class, config or None).
# To add one: write a GeneratorBasedBuilder in builders.py and register it here.
# 'name/config' picks one of the builder's named configs (e.g. number_translation/small).
OFFLINE: dict[str, Callable[[dict], tuple[type, tfds.core.BuilderConfig | str | None]]] = {
    'python_stdlib': lambda o: (builders.TextCorpus, builders.stdlib_corpus_config(**o)),
    'text_corpus': _text_corpus,
    'digits': lambda o: (builders.SklearnDigits, None),
    'number_translation': _number_translation,
    'number_languages': _number_languages,
    'stdlib_docstrings': lambda o: (builders.StdlibDocstrings, None),
}


def _files(split: str, data_dir: str | None, **options):
    from attention_jax.data import files  # no tfds builder: read where the files are
    del data_dir  # the token cache (data/token_cache.py) lives under data.cache_dir
    return files.get_split(split, **options)


# Sources read straight from the user's files, not built by tfds:
# name -> function(split, data_dir, **options) -> random-access source (data/files.py).
DIRECT: dict[str, Callable] = {'files': _files, 'image_folder': images.direct_source}


# Catalogue datasets the experiments name; any other tfds name works the same way.
CATALOGUE_EXAMPLES = ('tiny_shakespeare', 'lm1b', 'mnist', 'cifar10', 'imagenette',
                      'wmt14_translate/de-en', 'wmt_t2t_translate/de-en', 'glue/cola')


def default_data_dir() -> str:
    """$TFDS_DATA_DIR if set, else ~/tensorflow_datasets (tfds' own default)."""
    return os.environ.get('TFDS_DATA_DIR', os.path.expanduser('~/tensorflow_datasets'))


def get_builder(name: str, data_dir: str | None = None, *, prepare: bool = True,
                **options) -> tfds.core.DatasetBuilder:
    """The prepared builder for `name`.

    Offline builders are built (once) in `data_dir`; `options` configure them
    (e.g. `max_files=8` for 'python_stdlib', `globs=[...]` for 'text_corpus'; without
    globs, text_corpus is an error: it never trains on the standard library silently).
    Catalogue datasets must already be prepared in array_record format.
    """
    if name in DIRECT:
        raise ValueError(f'{name!r} is read where its files are, with no tfds builder; '
                         f'use get_dataset({name!r}, split, ...)')
    data_dir = os.fspath(data_dir or default_data_dir())
    base, _, config_name = name.partition('/')
    if base in OFFLINE:
        if config_name:
            options = {**options, 'config': config_name}
        cls, config = OFFLINE[base](dict(options))
        if isinstance(config, tfds.core.BuilderConfig) and config.name in cls.builder_configs:
            config = config.name  # tfds refuses an object named like a registered config.
        kwargs = {} if config is None else {'config': config}
        if not sys.stderr.isatty():
            tfds.disable_progress_bar()  # Its bars are lines of escape codes in a log file.
        with quiet.drop_log_messages(*builders.HARMLESS_TFDS_WARNINGS):
            try:
                builder = cls(data_dir=data_dir, file_format=builders.FILE_FORMAT, **kwargs)
                if prepare and not builder.is_prepared():
                    builder.download_and_prepare()
            except OSError as e:
                where = getattr(e, 'filename', None)
                # In data_dir, or a folder above it that makedirs could not create.
                if not (_under(where, data_dir) or _under(data_dir, where)):
                    raise  # (a corpus file of its own, say: its error names it)
                raise DataDirError(
                    f'data_dir={data_dir!r}: the offline dataset {name!r} cannot be built '
                    f'there ({e.strerror or e}: {e.filename}); set config.data.data_dir to a '
                    f'writable directory') from None
        return builder
    if options:
        raise ValueError(f'options {sorted(options)} only apply to the offline datasets '
                         f'{sorted(OFFLINE)}; {name!r} is read from the tfds catalogue')
    return _catalogue_builder(name, data_dir)


def _catalogue_builder(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
    how = (f'Prepare it on a machine with network (tfds needs tensorflow to build most '
           f'catalogue datasets):\n'
           f'    tfds build {name} --data_dir={data_dir} --file_format=array_record\n'
           f'then copy {os.path.join(data_dir, name.split("/")[0])} to this machine.')
    # (tfds warns of a variant folder without dataset_info.json; the error below says it.)
    with quiet.drop_log_messages(*builders.HARMLESS_TFDS_WARNINGS):
        try:
            # Constructing a builder reads only local metadata; it never downloads.
            builder = tfds.builder(name, data_dir=data_dir, file_format=builders.FILE_FORMAT)
        except tfds.core.registered.DatasetNotFoundError as e:
            raise DatasetNotFoundError(
                f'Unknown dataset {name!r}: not an offline dataset '
                f'({", ".join(sorted([*OFFLINE, *DIRECT]))}) and not in the tfds catalogue '
                f'({e.__class__.__name__}).') from None
        prepared = builder.is_prepared()
    if not prepared:
        raise DatasetNotFoundError(
            f'Dataset {name!r} is not prepared in data_dir {data_dir!r} (looked for '
            f'{os.path.join(os.fspath(builder.data_path), "dataset_info.json")}). '
            f'Data is never downloaded at run time.\n{how}')
    if builder.info.file_format is None or builder.info.file_format.value != builders.FILE_FORMAT:
        fmt = builder.info.file_format.value if builder.info.file_format else 'unknown'
        raise DatasetNotFoundError(
            f'Dataset {name!r} in {data_dir!r} is stored as {fmt}, which has no random '
            f'access; grain needs array_record. Convert it with\n'
            f'    tfds convert_format --root_data_dir={data_dir} --out_file_format=array_record\n'
            f'or rebuild it:\n{how}')
    return builder


def get_dataset(name: str, split: str, data_dir: str | None = None, **options):
    """A random-access source of one split: `len(src)`, `src[i]` -> dict of numpy values.

    Text features come back as UTF-8 `bytes`. Example:
      src = get_dataset('digits', 'train', '/tmp/data')
      src[0]['image'].shape  # (8, 8, 1)
    'files' reads your own files where they are (data/files.py; options files=GLOBS,
    eval_files=, text_key=, eval_fraction=, max_bad_records=, max_files=).
    """
    if name in DIRECT:
        return DIRECT[name](split, data_dir, **options)
    builder = get_builder(name, data_dir, **options)
    splits = list(builder.info.splits.keys())
    if split.split('[')[0] not in splits:
        raise SplitError(f'dataset {name!r} has no split {split!r}; valid: {splits}')
    try:
        size = builder.info.splits[split].num_examples
    except (KeyError, ValueError) as e:  # a slice tfds cannot parse, e.g. 'train[:200%]'
        raise SplitError(f'split {split!r} of dataset {name!r}: {e}') from None
    if not size:
        # array_record would fail later with "Paths sequence can not be of 0 length".
        raise SplitError(f'split {split!r} of dataset {name!r} holds no records; valid: a '
                         f'split or slice with at least one, e.g. {split.split("[")[0]!r}')
    return builder.as_data_source(split)


class Subset:
    """The records of `source` at `indices`, in that order (None: all of them): a
    random-access source too. fingerprint: the identity of what they hold, where the
    caller read them all and knows it (loaders.source_id: a resume on other records
    stops); '' derives it from `source`'s."""

    def __init__(self, source, indices, fingerprint: str = ''):
        self.source = source
        self.indices = None if indices is None else np.asarray(indices, np.int64)
        self.fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.source) if self.indices is None else len(self.indices)

    def __getitem__(self, i):
        return self.source[i if self.indices is None else int(self.indices[i])]


def subset_fraction(source, fraction: float, seed: int = 0):
    """A random `fraction` of `source` (at least one record), drawn with `seed`; fraction
    1 returns `source` itself. The draw is a prefix of one fixed permutation, so smaller
    fractions are subsets of larger ones (10% ⊂ 25% ⊂ 50%): a data-size sweep adds data
    to what the smaller runs saw instead of drawing a different set each time."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]; valid: e.g. 0.1, 0.25, 1.0")
    if fraction == 1:
        return source
    order = np.random.default_rng(seed).permutation(len(source))
    return Subset(source, np.sort(order[:max(1, round(fraction * len(source)))]))
