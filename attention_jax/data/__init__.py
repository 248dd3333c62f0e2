"""Data: tfds datasets that work offline, grain loaders with resumable state,
tokenizers and training objectives.

Datasets (`get_dataset(name, split, data_dir, **options)`)
-----------------------------------------------------------
Offline, built on first use into `data_dir` (array_record files, no network, no
TensorFlow):

  name                        splits                    record
  python_stdlib               train, validation         {'id', 'text'}: one stdlib .py file
                              (options: max_files=N for the first N files)
  files                       train, validation         {'id', 'text'}: your own files, read
                              where they are, not built (data/files.py): .txt/.md/.py (one
                              document each; .txt.gz|.zst too), .jsonl, .csv, .tsv (each
                              also .gz|.zst), .parquet (the document in text_key);
                              options files='GLOBS,...', eval_files=, text_key=,
                              eval_fraction= (held out by a hash of file + line/row),
                              max_bad_records=, max_files=
  text_corpus                 train, validation         {'id', 'text'} from your files, built
                              (options: globs=[...] (required), root=..., max_files=...,
                               validation_percent=...)
  digits                      train (1,438), test (359) {'image' uint8 [8, 8, 1], 'label', 'index'}
  number_translation          train (20k), validation,  {'number', 'en', 'fr', 'de'}
                              test (1k each)            ('number_translation/small': 2k/200/200)
  number_languages            train (18k), validation,  {'number', 'text', 'label'}: number
                              test (1.8k each)          words labelled by language (6 classes)
  stdlib_docstrings           train (1.3k), validation, {'source', 'text', 'label'}: the
                              test (~270 each)          standard library's docstrings labelled
                                                        by package (9 classes; counts vary a
                                                        little by Python version)

Your own text
-------------
  plain text, Markdown, Python   --config.data.name=files --config.data.files='~/notes/**/*.md'
                                 (a document per file; a directory means every file in it)
  JSON lines (.jsonl, .gz, .zst) --config.data.files='data/*.jsonl.zst' --config.data.text_key=text
  Parquet (a Hugging Face        --config.data.files='~/hf/dataset/data/train-*.parquet'
    dataset's shards)              (the column text_key)
  a held-out split               --config.data.eval_files=GLOBS, else eval_fraction (0.05) of
                                 the documents by a stable hash of file and line/row
  a tokenizer                    --config.data.tokenizer=PATH (a tokenizer.json or the
                                 directory save_pretrained wrote: GPT-2's, Llama's, BERT's)
The files' tokens are prepared once into a cache (token_cache.py; data.cache_dir, default
DATA_DIR/token_cache) keyed by the files' paths, sizes and mtimes and the tokenizer:
beforehand with every core,
  python -m attention_jax.tools.prepare --config=gpt --config.data.name=files --config.data.files=...
or by the first run itself. Runs then memory-map it: rows of seq_len are windows of the
token stream (packing 'documents' adds segment ids and positions, 'stream' is the window),
nothing proportional to the corpus is read at start-up, and the loader state stays three
integers. The Loader reads such rows a whole batch per call (Loader(batched=...); the same
batches as example by example): 130M tokens/s per process with 'stream' packing and 82M
with 'documents' (rows of 1024, batches of 32), 1.85x and 1.15x nanoGPT's memmap reader
(71M), against 15M example by example (2-core Xeon, shared; README, bench data).
A catalogue dataset (tfds) or the built-in corpora below need none of this.

Text comes back as UTF-8 bytes. Corpus documents are split by a hash of their path, so
a file is always in the same split; digits are split 80/20 per class with a fixed seed;
number-translation integers are distinct across splits.

Catalogue datasets (tiny_shakespeare, lm1b, mnist, cifar10, imagenette,
wmt14_translate/de-en, wmt_t2t_translate/de-en, glue/cola, any tfds name) are read from
`data_dir` if prepared there in array_record format. They are never downloaded at run
time: a missing one raises `DatasetNotFoundError` at once, naming the dataset, the data
dir and the `tfds build ... --file_format=array_record` command that prepares it.

Adding a dataset: write a `tfds.core.GeneratorBasedBuilder` subclass of
`builders.OfflineBuilder` in `builders.py` (features `Text`/`Tensor`/`ClassLabel`
only, so it builds without TensorFlow; deterministic order and splits), then add one
line to `sources.OFFLINE` mapping its name to the class and config. A catalogue
dataset needs no code, only its name in the experiment config.

Loading
-------
  src = get_dataset('digits', 'train', data_dir)
  loader = Loader(src, global_batch_size=128, seed=0,
                  transform=ImageClassification(augment=True, padding=1))
  for batch in loader:                       # host-local numpy, B = G / process_count
    batch = to_global_batch(batch, mesh)     # global jax.Arrays sharded on 'data'
  state = loader.get_state().to_dict()       # into the checkpoint; JSON-able
  Loader(src, ..., state=state)              # continues with exactly the next batch

Language modelling packs documents into rows with segment ids and positions:
  tok = get_tokenizer('byte')
  rows = packed_lm_source(get_dataset('python_stdlib', 'train', data_dir), tok, 256)
  Loader(rows, global_batch_size=32, transform=CausalLM())
  (CausalLM('stream'): the rows as one causal token stream, no segment ids, as GPT-2)

Tokenizers: `get_tokenizer('char' | 'byte' | 'wordpiece' | 'bpe', ...)`,
`get_tokenizer('file', path=...)` (any tokenizer.json, its own ids and special tokens),
`tokenizer.save(workdir_subdir)`, `load_tokenizer(workdir_subdir)`.
Objectives: `mlm_mask`, `nsp_pairs`, `next_token_targets`, `shift_right`,
`seq2seq_example`, `normalize_image`, `random_crop_flip`.
"""

import importlib

# Names are imported on first use (PEP 562), so that `attention_jax.data.objectives` (the
# models' shift_right) costs no tensorflow-datasets or grain import: a notebook or a GPU
# machine that only builds models never needs them.
_WHERE = {
    'loaders': ('Loader', 'LoaderState', 'to_global_batch'),
    'objectives': ('PACKINGS', 'classification_example', 'mlm_mask', 'next_token_targets', 'normalize_image', 'nsp_pairs',
                   'random_crop_flip', 'seq2seq_example', 'shift_right'),
    'packing': ('PackedSource', 'pack_documents', 'unpack_row'),
    'pipelines': ('CausalLM', 'ImageClassification', 'MaskedLM', 'TextClassification',
                  'Translation', 'packed_lm_source'),
    'sources': ('CATALOGUE_EXAMPLES', 'OFFLINE', 'DatasetNotFoundError', 'default_data_dir',
                'Subset', 'get_builder', 'get_dataset', 'subset_fraction'),
    'tokenization': ('BPETokenizer', 'ByteTokenizer', 'CharTokenizer', 'FileTokenizer',
                     'Tokenizer', 'TokenizerEncodeError', 'TokenizerFileError',
                     'WordPieceTokenizer', 'get_tokenizer', 'load_tokenizer'),
    'files': ('FileDocuments', 'FilesError', 'file_splits'),
    'token_cache': ('CacheError', 'TokenRows'),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'attention_jax.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f'attention_jax.data.{_MODULE_OF[name]}'), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(list(globals()) + list(_MODULE_OF))


__all__ = [
    'BPETokenizer', 'ByteTokenizer', 'CATALOGUE_EXAMPLES', 'CausalLM', 'CharTokenizer',
    'CacheError', 'DatasetNotFoundError', 'FileDocuments', 'FileTokenizer', 'FilesError',
    'ImageClassification', 'Loader', 'LoaderState', 'MaskedLM', 'OFFLINE', 'PACKINGS',
    'PackedSource', 'TextClassification', 'Tokenizer', 'TokenizerEncodeError',
    'TokenizerFileError', 'Translation', 'WordPieceTokenizer', 'classification_example',
    'default_data_dir', 'file_splits', 'get_builder', 'get_dataset', 'get_tokenizer',
    'load_tokenizer',
    'mlm_mask', 'next_token_targets', 'normalize_image', 'nsp_pairs',
    'pack_documents', 'packed_lm_source', 'random_crop_flip', 'seq2seq_example',
    'shift_right', 'to_global_batch', 'TokenRows', 'unpack_row',
]
