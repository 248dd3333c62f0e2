"""Tokenize your files once: `python -m attention_jax.tools.prepare --config=... [overrides]`.

    python -m attention_jax.tools.prepare --config=gpt --config.data.name=files \\
        --config.data.files='~/corpus/**/*.jsonl.zst' --config.data.tokenizer=~/gpt2/

reads the config exactly as `python -m attention_jax.main` does (a shipped NAME or a
FILE.py, then --config.KEY=VALUE overrides) and writes the train and eval splits' tokens
into the token cache (data/token_cache.py) under config.data.cache_dir (default
DATA_DIR/token_cache), with every core and a progress bar. Training with the same config
then opens the cache at once; without this step the first run prepares it (the same
code), so a small corpus stays one command. A killed prepare resumes with the shards it
finished. Flags:

  --workdir=DIR          use the tokenizer a run saved in DIR (a trained BPE, say)
  --workers=N            processes tokenizing (default: every core)
  --process_index=p --process_count=P
                         on several hosts sharing the cache directory: each prepares
                         shards p, p+P, ... and then waits for the others' commits

A command-line entry point beside main.py's layer: it reads the run config and asks the
text task (tasks/text.py) what to tokenize and with which tokenizer, so it stands above
both (among the tools); the cache itself is data/token_cache.py.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from attention_jax import config as config_lib
    from attention_jax.errors import UserError
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # as attention_jax.main takes them: --config.KEY=VALUE, --config.KEY VALUE, ...
        argv, overrides = config_lib.split_overrides(argv)
    except UserError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog='python -m attention_jax.tools.prepare',
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', required=True, help='a shipped config NAME or a FILE.py')
    parser.add_argument('--workdir', default=None)
    parser.add_argument('--workers', type=int, default=None)
    parser.add_argument('--process_index', type=int, default=0)
    parser.add_argument('--process_count', type=int, default=1)
    args = parser.parse_args(argv)
    if not 0 <= args.process_index < args.process_count:
        parser.error(f'--process_index={args.process_index} must be in [0, --process_count='
                     f'{args.process_count})')
    if args.workers is not None and args.workers < 1:
        parser.error(f'--workers={args.workers} must be >= 1')
    try:
        config = config_lib.load(args.config, overrides)
        from attention_jax.tasks import text
        dirs = text.prepare_from_config(config, args.workdir, workers=args.workers,
                                        process_index=args.process_index,
                                        process_count=args.process_count)
    except UserError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    import json
    import os
    tokens = {}
    for label, directory in dirs.items():
        with open(os.path.join(directory, 'manifest.json')) as f:
            m = json.load(f)
        tokens[label] = sum(m["tokens"])
        print(f'{label}: {sum(m["documents"]):,} documents, {tokens[label]:,} tokens '
              f'({m["dtype"]}) in {len(m["tokens"])} shards, from '
              f'{m["source_bytes"] / 1e6:.1f} MB of text: {directory}')
    if args.process_index == 0 and tokens.get('eval', 0) > tokens.get('train', 0):
        why = ('the eval files hold more than the train files' if config.data.get('eval_files')
               else 'documents are split by count (data.eval_fraction), and a few long ones '
                    'landed in eval; give eval files of your own (--config.data.eval_files='
                    'GLOBS) or split the long files')
        print(f'note: the eval split holds more tokens than the train split ({tokens["eval"]:,} '
              f'against {tokens["train"]:,}): {why}', file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(main())
