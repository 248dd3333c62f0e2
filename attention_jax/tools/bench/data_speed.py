r"""Text data speed: `python -m attention_jax.tools.bench data [--sizes 100,1000]`.

On generated corpora of --sizes MB of JSONL text (the Python standard library's sources,
repeated, one document per .py file) and a byte-level BPE tokenizer.json of 8192 tokens
trained here with `tokenizers`, every row in its own fresh process:

  prepare          `token_cache.prepare` from the files (indexing them included), every
                   core: MB of text/s and tokens/s; and, on the same documents already
                   in memory, the tokenizers library's own `encode_batch` (all cores, the
                   Rust thread pool) as the yardstick: prepare / encode_batch.
  loader           tokens/s of one process's `Loader` over the prepared cache (rows of
                   --seq_len, global shuffle, the CausalLM transform), stream and documents
                   packing, --batches from the iterator's creation on (the batched path,
                   and documents through the per-example one: batched=False for the same
                   batches); against nanoGPT's
                   reader (random windows of one `train.bin` memmap, x and y as int64),
                   the same tokens per batch.
  first batch      a run's data start over the prepared cache, as the GPT task does it:
                   config, file listing, cache lookup, rows, loader, first batch; seconds
                   (from the process start, imports included, and the data part alone),
                   the process's own peak RSS up to that batch (VmHWM), and its RSS at
                   the batch split into private memory (RssAnon) and mapped file pages
                   (RssFile: the shards' pages mapped by the reads of the first batch and
                   of grain's threads, which prefetch batches meanwhile; they grow with
                   the spread of the rows over the corpus, and are page cache the kernel
                   takes back under pressure), for each corpus size.

Corpora, tokenizer, caches and train.bin stay in --dir (default a folder under the
system's temp dir) for the next run; --fresh prepares the caches again; --only picks
the measures (a corpus missing from --dir is still made and prepared first). Medians over
--repeats (prepare and encode_batch alternate on the smallest corpus; a larger one is
prepared once, and timed, when its cache is not kept).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

_T0 = time.perf_counter()  # a child's start: what time-to-first-batch counts from

FILE_MB = 100  # JSONL files of at most this many MB


# ============================================================================ corpus setup
def _stdlib_documents() -> list[str]:
    root = sysconfig.get_paths()['stdlib']
    docs = []
    for dirpath, _, names in sorted(os.walk(root)):
        if 'site-packages' in dirpath:
            continue
        for name in sorted(names):
            if name.endswith('.py'):
                try:
                    with open(os.path.join(dirpath, name), encoding='utf-8') as f:
                        docs.append(f.read())
                except (OSError, UnicodeDecodeError):
                    pass
    return [d for d in docs if d.strip()]


def make_corpus(directory: str, megabytes: int) -> str:
    """`megabytes` MB of JSONL in `directory` (reused when there); returns its glob."""
    done = os.path.join(directory, 'done')
    if not os.path.exists(done):
        os.makedirs(directory, exist_ok=True)
        docs, target, written, k, i = _stdlib_documents(), megabytes * 10**6, 0, 0, 0
        while written < target:
            with open(os.path.join(directory, f'part-{k:03d}.jsonl'), 'w') as f:
                part = 0
                while part < FILE_MB * 10**6 and written < target:
                    line = json.dumps({'text': docs[i % len(docs)],
                                       'copy': i // len(docs)}) + '\n'
                    f.write(line)
                    part += len(line)
                    written += len(line)
                    i += 1
            k += 1
        open(done, 'w').close()
    return os.path.join(directory, '*.jsonl')


def make_tokenizer(path: str) -> str:
    if not os.path.exists(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        docs = _stdlib_documents()[:1500]
        tok.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=8192, special_tokens=['<|endoftext|>'], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(path)
    return path


# ============================================================================= children
def _splits(glob: str):
    from attention_jax.data import files
    return files.file_splits(glob, eval_fraction=0.01)


def _run_data(a: dict):
    """(data options, tokenizer, documents) of a GPT run on the corpus, as the task
    builds them."""
    from attention_jax import config as config_lib
    from attention_jax.data import get_tokenizer
    from attention_jax.tasks import base, text
    config = config_lib.load('gpt', [f'data.files={a["glob"]}', 'data.name=files',
                                     'data.eval_fraction=0.01', f'data.cache_dir={a["cache"]}',
                                     f'data.seq_len={a.get("seq_len", 1024)}'])
    data_opts = base.data_options(config, **text.GPT_DATA)
    return data_opts, get_tokenizer('file', path=a['tokenizer']), text._Documents(data_opts)


def child_prepare(a: dict) -> dict:
    from attention_jax.tasks import text
    data_opts, tok, documents = _run_data(a)
    start = time.perf_counter()
    dirs = text.prepare_files(data_opts, tok, documents, process_index=0, process_count=1,
                              workers=a['workers'] or None, progress=False)
    seconds = time.perf_counter() - start
    manifests = [json.load(open(os.path.join(d, 'manifest.json'))) for d in dirs.values()]
    return {'seconds': seconds, 'bytes': sum(m['source_bytes'] for m in manifests),
            'tokens': sum(sum(m['tokens']) for m in manifests), 'directory': dirs['train'],
            'shards': sum(len(m['tokens']) for m in manifests)}


def child_encode_batch(a: dict) -> dict:
    from attention_jax.data import get_tokenizer
    hf = get_tokenizer('file', path=a['tokenizer']).hf
    docs = _splits(a['glob'])['train']
    texts = [docs[i]['text'].decode() for i in range(len(docs))]
    nbytes = sum(len(t.encode()) for t in texts)
    # In batches of about a prepare shard's text, as prepare hands them over.
    batches, batch, size = [], [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= 4 << 20:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += sum(len(e.ids) for e in hf.encode_batch_fast(batch, add_special_tokens=False))
    return {'seconds': time.perf_counter() - start, 'bytes': nbytes, 'tokens': tokens}


def child_loader(a: dict) -> dict:
    from attention_jax import data
    from attention_jax.data import token_cache
    rows = token_cache.TokenRows(a['directory'], a['seq_len'], packing=a['packing'])
    loader = data.Loader(rows, global_batch_size=a['batch'], seed=0,
                         transform=data.CausalLM(a['packing']), process_index=0,
                         process_count=1, batched=a.get('batched', True))
    # From the iterator's creation: grain's threads prefetch hundreds of batches ahead,
    # so a count of batches after a warm-up would time the buffer, not the reading.
    start = time.perf_counter()
    it = iter(loader)
    for _ in range(a['batches']):
        next(it)
    seconds = time.perf_counter() - start
    return {'seconds': seconds, 'tokens': a['batches'] * a['batch'] * a['seq_len']}


def child_memmap(a: dict) -> dict:
    import numpy as np
    rng = np.random.default_rng(0)
    L, B = a['seq_len'], a['batch']

    def get_batch():  # nanoGPT's train.py get_batch, without the copy to a device
        m = np.memmap(a['bin'], dtype=np.uint16, mode='r')
        ix = rng.integers(len(m) - L - 1, size=B)
        x = np.stack([m[i:i + L].astype(np.int64) for i in ix])
        y = np.stack([m[i + 1:i + 1 + L].astype(np.int64) for i in ix])
        return x, y
    start = time.perf_counter()
    for _ in range(a['batches']):
        get_batch()
    return {'seconds': time.perf_counter() - start, 'tokens': a['batches'] * B * L}


def memory_mib() -> dict:
    """This process's memory in MiB from /proc/self/status: `peak_rss_mib`, the peak RSS of
    its own address space (VmHWM), and its RSS now as private memory (`anon_mib`, RssAnon)
    and mapped file pages (`file_mib`, RssFile); Linux keeps no peak of either part.
    Not ru_maxrss: Linux carries a process's peak over fork and exec into the child's, so
    a child of a bench that had held 600 MiB reported 600 MiB, whatever it used itself."""
    with open('/proc/self/status') as f:
        status = dict(line.split(':', 1) for line in f if ':' in line)
    kib = lambda key: int(status.get(key, '0 kB').split()[0])  # noqa: E731
    return {'peak_rss_mib': kib('VmHWM') / 1024, 'anon_mib': kib('RssAnon') / 1024,
            'file_mib': kib('RssFile') / 1024}


def child_first_batch(a: dict) -> dict:
    before = time.perf_counter()
    import jax  # noqa: F401 (what a run has imported before its data)

    from attention_jax import data
    from attention_jax.data import token_cache
    from attention_jax.tasks import text
    imported = time.perf_counter()
    data_opts, tok, documents = _run_data(a)
    dirs = text.prepare_files(data_opts, tok, documents, process_index=0, process_count=1,
                              progress=False)
    rows = token_cache.TokenRows(dirs['train'], a['seq_len'], pad_id=tok.pad_id)
    batch = next(iter(data.Loader(rows, global_batch_size=a['batch'], seed=0,
                                  transform=data.CausalLM('documents'), process_index=0,
                                  process_count=1)))
    assert batch['inputs'].shape == (a['batch'], a['seq_len'])
    end = time.perf_counter()
    return {'total_s': end - _T0, 'data_s': end - imported, 'import_s': imported - before,
            **memory_mib(), 'tokens': rows.num_tokens}


PARTS = ('prepare', 'loader', 'first_batch')
PER_EXAMPLE = 'documents, per example'

CHILDREN = {'prepare': child_prepare, 'encode_batch': child_encode_batch,
            'loader': child_loader, 'memmap': child_memmap, 'first_batch': child_first_batch}


def _child(kind: str, **args) -> dict:
    done = subprocess.run([sys.executable, '-m', 'attention_jax.tools.bench.data_speed', kind,
                           json.dumps(args)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f'bench data {kind} failed:\n{done.stderr[-3000:]}')
    return json.loads(done.stdout.strip().splitlines()[-1])


# ================================================================================ report
def _write_bin(directory: str, path: str) -> None:
    """The prepared tokens as one flat uint16 file, nanoGPT's train.bin."""
    if os.path.exists(path):
        return
    import numpy as np
    with open(path + '.tmp', 'wb') as out:
        k = 0
        while os.path.exists(shard := os.path.join(directory, f'{k:05d}.tokens.npy')):
            np.load(shard, mmap_mode='r').astype(np.uint16).tofile(out)
            k += 1
    os.replace(path + '.tmp', path)


def run(args) -> dict:
    root = args.dir or os.path.join(tempfile.gettempdir(), 'attention_jax_bench_data')
    os.makedirs(root, exist_ok=True)
    sizes = _sizes(args.sizes)
    only = set(args.only.split(','))
    if only - set(PARTS):
        raise SystemExit(f'error: --only {args.only}: valid parts are {",".join(PARTS)}')
    start_load = os.getloadavg()[0]  # a shared machine: the table says how busy it was
    tokenizer = make_tokenizer(os.path.join(root, 'tokenizer.json'))
    out = {'machine': _machine(), 'cores': os.cpu_count(), 'sizes_mb': sizes, 'prepare': {},
           'first_batch': {}, 'seq_len': args.seq_len, 'batch': args.batch}
    for mb in sizes:  # the corpora and their caches (prepared when not kept)
        glob = make_corpus(os.path.join(root, f'corpus-{mb}MB'), mb)
        cache = os.path.join(root, f'cache-{mb}MB')
        if args.fresh:
            shutil.rmtree(cache, ignore_errors=True)
        fresh = not os.path.exists(cache)
        p = _child('prepare', glob=glob, tokenizer=tokenizer, cache=cache, workers=args.workers)
        if fresh and mb != sizes[0] and 'prepare' in only:  # timed only when it tokenized
            out['prepare'][mb] = p
            print(f'prepare {mb} MB: {p["bytes"] / 1e6 / p["seconds"]:.2f} MB/s', flush=True)
        out.setdefault('directory', {})[mb] = p['directory']
    # prepare and encode_batch on the smallest corpus, alternated (the machine's load
    # drifts), each prepare into a new cache; medians.
    small = sizes[0]
    glob_small = os.path.join(root, f'corpus-{small}MB', '*.jsonl')
    prepares, encodes = [], []
    for _ in range(args.repeats if 'prepare' in only else 0):
        scratch = tempfile.mkdtemp(dir=root, prefix='prepare-')
        try:
            prepares.append(_child('prepare', glob=glob_small, tokenizer=tokenizer,
                                   cache=scratch, workers=args.workers))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        encodes.append(_child('encode_batch', glob=glob_small, tokenizer=tokenizer))
    rate = lambda r: r['bytes'] / r['seconds']  # noqa: E731
    if prepares:
        out['prepare'][small] = sorted(prepares, key=rate)[len(prepares) // 2]
        out['encode_batch'] = sorted(encodes, key=rate)[len(encodes) // 2]
        print(f'prepare {small} MB: {rate(out["prepare"][small]) / 1e6:.2f} MB/s; '
              f'encode_batch {rate(out["encode_batch"]) / 1e6:.2f} MB/s', flush=True)
    # Loader rows over the smallest corpus; nanoGPT's reader over the same tokens.
    directory = out['directory'][small]
    bin_path = os.path.join(root, f'train-{small}MB.bin')
    _write_bin(directory, bin_path)
    common = dict(seq_len=args.seq_len, batch=args.batch, batches=args.batches)
    out['loader'] = {}
    for name, kind, extra in (('stream', 'loader', {'packing': 'stream'}),
                              ('documents', 'loader', {'packing': 'documents'}),
                              (PER_EXAMPLE, 'loader', {'packing': 'documents',
                                                       'batched': False}),
                              ('memmap', 'memmap', {'bin': bin_path})):
        if 'loader' not in only:
            break
        rates = [(r := _child(kind, directory=directory, **common, **extra))['tokens']
                 / r['seconds'] for _ in range(args.repeats)]
        out['loader'][name] = statistics.median(rates)
        print(f'loader {name}: {out["loader"][name] / 1e6:.2f}M tokens/s', flush=True)
    for mb in sizes if 'first_batch' in only else ():
        runs = [_child('first_batch', glob=os.path.join(root, f'corpus-{mb}MB', '*.jsonl'),
                       cache=os.path.join(root, f'cache-{mb}MB'), tokenizer=tokenizer,
                       seq_len=args.seq_len, batch=args.batch) for _ in range(args.repeats)]
        out['first_batch'][mb] = {k: statistics.median(r[k] for r in runs)
                                  for k in ('total_s', 'data_s', 'import_s', 'peak_rss_mib',
                                            'anon_mib', 'file_mib')}
        out['first_batch'][mb]['tokens'] = runs[0]['tokens']
        fb = out['first_batch'][mb]
        print(f'first batch {mb} MB: {fb["total_s"]:.2f} s ({fb["data_s"]:.3f} s data), '
              f'peak RSS {fb["peak_rss_mib"]:.0f} MiB', flush=True)
    out['load'] = [start_load, os.getloadavg()[0]]
    print()
    print(table(out))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(out, f, indent=1)
    return out


def _machine() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            model = next(line.split(':', 1)[1].strip() for line in f if 'model name' in line)
    except (OSError, StopIteration):
        model = 'unknown CPU'
    return f'{os.cpu_count()}-core "{model}"'


def table(out: dict) -> str:
    lines = [f'Machine: {out["machine"]}; loader rows of {out["seq_len"]} tokens, batches of '
             f'{out["batch"]}; load average {out["load"][0]:.1f} at the start, '
             f'{out["load"][1]:.1f} at the end', '', '| measure | value | target |',
             '|---|---|---|']
    e = out.get('encode_batch', {'bytes': 0, 'seconds': 1})
    e_rate = e['bytes'] / e['seconds']
    for mb, p in sorted(out['prepare'].items(), key=lambda item: int(item[0])):
        rate = p['bytes'] / p['seconds']
        lines.append(f'| prepare {mb} MB (all cores) | {rate / 1e6:.2f} MB/s, '
                     f'{p["tokens"] / p["seconds"] / 1e6:.2f}M tokens/s; '
                     f'{rate / e_rate:.2f}x encode_batch | >= 0.8x |')
    if 'encode_batch' in out:
        lines.append(f'| tokenizers encode_batch (all cores, text in memory) | '
                     f'{e_rate / 1e6:.2f} MB/s, {e["tokens"] / e["seconds"] / 1e6:.2f}M '
                     f'tokens/s | |')
    if out['loader']:
        m = out['loader']['memmap']
        for name in ('stream', 'documents', PER_EXAMPLE):
            r = out['loader'][name]
            what = ('documents packing, per-example path (batched=False)' if name == PER_EXAMPLE
                    else f'{name} packing')
            lines.append(f'| loader, {what} (1 process) | {r / 1e6:.2f}M tokens/s; '
                         f'{r / m:.2f}x memmap | >= 1M/s, >= 0.5x |')
        lines.append(f'| nanoGPT memmap reader | {m / 1e6:.2f}M tokens/s | |')
    sizes = list(out['first_batch'])
    for mb in sizes:
        fb = out['first_batch'][mb]
        lines.append(f'| first batch, {mb} MB corpus ({fb["tokens"] / 1e6:.0f}M tokens) | '
                     f'{fb["total_s"]:.2f} s ({fb["data_s"]:.3f} s after imports); peak RSS '
                     f'{fb["peak_rss_mib"]:.0f} MiB; RSS at the batch {fb["anon_mib"]:.0f} '
                     f'private + {fb["file_mib"]:.0f} mapped files | |')
    if len(sizes) > 1:
        a, b = out['first_batch'][sizes[0]], out['first_batch'][sizes[-1]]
        lines.append(f'| {sizes[-1]} MB vs {sizes[0]} MB | {b["total_s"] / a["total_s"]:.2f}x '
                     f'time; {b["anon_mib"] - a["anon_mib"]:+.0f} MiB private, '
                     f'{b["peak_rss_mib"] - a["peak_rss_mib"]:+.0f} MiB peak RSS | <= 1.2x, '
                     f'<= +100 MiB |')
    return '\n'.join(lines)


def _sizes(text: str) -> list[int]:
    """--sizes "10,100": corpus sizes in MB, each >= 1, increasing (the table compares each
    with the one before)."""
    valid = 'valid: increasing sizes in MB, each >= 1, comma-separated (e.g. 10,100)'
    try:
        sizes = [int(s) for s in text.split(',')]
    except ValueError:
        raise SystemExit(f'error: --sizes={text!r}; {valid}') from None
    if min(sizes) < 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise SystemExit(f'error: --sizes={text!r}; {valid}')
    return sizes


def add_parser(sub) -> None:
    """Registers `data` on the bench command's subcommand parser."""
    p = sub.add_parser('data', help='text data: prepare, loader and first-batch speed')
    p.add_argument('--sizes', default='10,100',
                   help='corpus sizes in MB, comma-separated, smallest first (README: 100,1000)')
    p.add_argument('--seq_len', type=int, default=1024)
    p.add_argument('--batch', type=int, default=32, help='rows per loader batch')
    p.add_argument('--batches', type=int, default=2000,
                   help='timed loader batches (far more than grain prefetches)')
    p.add_argument('--repeats', type=int, default=3, help='runs of each loader/first-batch row')
    p.add_argument('--workers', type=int, default=0, help='prepare processes (0: every core)')
    p.add_argument('--dir', default='', help='where corpora and caches are kept')
    p.add_argument('--fresh', action='store_true', help='prepare the caches again')
    p.add_argument('--only', default=','.join(PARTS),
                   help=f'measures to run, comma-separated among {",".join(PARTS)}')
    p.add_argument('--json', '--out', dest='json', default='',
                   help='also write the numbers to this file')


if __name__ == '__main__':  # one measurement, run by _child in its own process
    print(json.dumps(CHILDREN[sys.argv[1]](json.loads(sys.argv[2]))))
