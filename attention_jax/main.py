r"""Command line: run an experiment config in a workdir.

  python -m attention_jax.main --config=experiments/gpt.py --workdir=/tmp/gpt \
      [--config.optim.lr=1e-3 --config.train.steps=200] [--mode=train|eval|sample|embed]
  attention-jax --config=experiments/vit.py:variant=vit-tiny/4 --workdir=/tmp/vit

`--config=FILE:ARG` passes ARG to the file's `get_config(arg)`. Any field can be
overridden with `--config.group.key=value`; an unknown key, a value of the wrong type
or range is an error before anything runs. Running the same command again resumes from
the workdir's latest checkpoint; if training-relevant keys differ from the workdir's
config.json the run stops and lists them (--resume_changed resumes anyway; a changed
train.steps, to extend a run, and the keys in train.RESUME_SAFE_KEYS need no flag).
Modes:
  train   (default) train and evaluate, resuming what is in the workdir.
  eval    evaluate the latest checkpoint on the eval split, print and log the metrics.
  sample  language models: print continuations of config.eval.sample_prompts.
  embed   BERT sentence embeddings of the lines on stdin, from
          --config.train.init_from=hf:<dir> or the workdir's checkpoint (embed_texts).
Exit codes: 0 done, 1 a usage, config, data or non-finite-loss error (one `error: ...`
message, no traceback), 130/143 stopped by SIGINT/SIGTERM after saving a checkpoint
(run again to resume).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

from attention_jax.errors import UserError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file (experiments/*.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the resolved config.")
MODES = ["train", "eval", "sample", "embed"]
flags.DEFINE_enum("mode", "train", MODES, "What to do.")
flags.DEFINE_bool("resume_changed", False,
                  "Resume the workdir's checkpoint even though training-relevant config keys "
                  "differ from its config.json (the old one is kept as "
                  "config_until_step_N.json).")
flags.mark_flags_as_required(["config", "workdir"])
USAGE = ("python -m attention_jax.main --config=experiments/NAME.py[:ARG] --workdir=DIR "
         f"[--config.group.key=value ...] [--mode={'|'.join(MODES)}] [--resume_changed]")


class InputError(UserError, ValueError):
    """Bad input on stdin (--mode=embed)."""


def evaluate_checkpoint(config, workdir: str) -> dict:
    """Metrics of the workdir's latest checkpoint (mode=eval)."""
    import jax

    from attention_jax import runs, sharding, train
    run = runs.open_run(workdir, config=config)
    with run.mesh_context():
        eval_step = jax.jit(train.make_eval_step(run.task, config),
                            in_shardings=(run.shardings["params"], sharding.batch_sharding(run.mesh)),
                            out_shardings=sharding.replicated(run.mesh))
        metrics = train.evaluate(eval_step, run.params, run.task, config, run.mesh)
    writer = train.MetricWriter(workdir)
    writer.write(run.step, "eval", metrics)
    writer.close()
    return {"step": run.step, **metrics}


def sample_checkpoint(config, workdir: str) -> list[str]:
    """Continuations of config.eval.sample_prompts from the latest checkpoint."""
    import jax

    from attention_jax import runs, train
    run = runs.open_run(workdir, config=config)
    if run.task.sample is None:
        raise train.ConfigError(f"--mode=sample: task {config.task!r} cannot sample; "
                                f"valid: {[t for t in ('gpt',) if t in train.TASKS]}")
    with run.mesh_context():
        return run.task.sample(run.params, jax.random.PRNGKey(config.train.seed))


def embed_texts(config, workdir: str, texts: Sequence[str] | None = None) -> dict:
    """`--mode=embed`: embeds `texts` (default: the non-empty lines of stdin) with the
    BERT of `config.train.init_from=hf:<dir>`, else the workdir's trained BERT. Writes
    workdir/embeddings.npy ([B, D] float32) and embeddings_texts.json; returns
    {"texts", "dim", "file", "similarity"} (the cosine matrix, for a quick look)."""
    import jax
    import numpy as np

    from attention_jax import convert, runs, train
    from attention_jax.models import bert
    if texts is None:
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise InputError("--mode=embed: no texts (give one text per line on stdin)")
    src = str(config.train.init_from or "")
    if src.startswith("hf:"):
        enc = convert.load_sentence_encoder(src[len("hf:"):])
    else:  # A BERT trained here (task "mlm"): the workdir's latest checkpoint and tokenizer.
        run = runs.open_run(workdir, config=config)
        if not isinstance(run.task.model, bert.Bert):
            raise train.ConfigError(f"--mode=embed needs a BERT; task {config.task!r} builds a "
                                    f"{type(run.task.model).__name__} (or pass "
                                    f"--config.train.init_from=hf:<bert dir>)")
        params = jax.tree.map(np.asarray, jax.device_get(run.params))
        enc = convert.SentenceEncoder(run.task.model, params, run.tokenizer,
                                      max_length=run.task.model.config.max_len)
    emb = enc.embed(list(texts))
    os.makedirs(workdir, exist_ok=True)
    file = os.path.join(workdir, "embeddings.npy")
    np.save(file, emb)
    with open(os.path.join(workdir, "embeddings_texts.json"), "w") as f:
        json.dump(list(texts), f, indent=1)
    unit = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
    return {"texts": list(texts), "dim": int(emb.shape[1]), "file": file,
            "similarity": np.round((unit @ unit.T).astype(np.float64), 4).tolist()}


def main(argv) -> int:
    del argv  # parse_flags has refused stray arguments.
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax and tfds are chatty at INFO.
    from attention_jax import runs, train
    config, workdir = FLAGS.config, FLAGS.workdir
    try:
        return _run_mode(config, workdir, train)
    except UserError as e:  # a mistake in the request: one line; a bug keeps its traceback
        where = f"--mode={FLAGS.mode}: " if isinstance(e, runs.RunNotFoundError) else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return 1


def _run_mode(config, workdir, train) -> int:
    if FLAGS.mode == "eval":
        print(json.dumps(evaluate_checkpoint(config, workdir), indent=1))
        return 0
    if FLAGS.mode == "embed":
        print(json.dumps(embed_texts(config, workdir), indent=1))
        return 0
    if FLAGS.mode == "sample":
        for prompt, text in zip(config.eval.sample_prompts, sample_checkpoint(config, workdir)):
            print(f"--- prompt {prompt!r}\n{text}\n")
        return 0
    summary = train.train_and_evaluate(config, workdir, resume_changed=FLAGS.resume_changed)
    print(json.dumps({k: summary[k] for k in ("step", "train", "eval", "stopped_by")}, indent=1))
    if summary["stopped_by"]:
        return {"SIGINT": 130, "SIGTERM": 143}.get(summary["stopped_by"], 1)
    if config.task == "gpt" and train.TASKS.get(config.task) is not None:
        for prompt, text in zip(config.eval.sample_prompts, sample_checkpoint(config, workdir)):
            print(f"--- sample from {prompt!r}:\n{text}\n")
    return 0


def _config_spec(argv) -> str | None:
    """The value of --config (`--config=F` or `--config F`), or None."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _load_experiment(spec: str):
    """The ConfigDict of `experiments/NAME.py[:ARG]` (ARG goes to its get_config)."""
    import importlib.util
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_experiment", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def experiments() -> dict[str, str]:
    """experiments/*.py of the working directory (else the repository's): path -> the
    first line of its docstring, read without running the file."""
    import ast
    import glob
    here = glob.glob(os.path.join("experiments", "*.py"))
    repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
    out = {}
    for path in sorted(here or glob.glob(os.path.join(repo, "*.py"))):
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        out[path] = doc.strip().split("\n")[0]
    return out


def help_text(argv) -> str:
    """--help: the module doc, the experiments, the flags, and with --config=FILE the
    keys of that config with their values."""
    lines = [__doc__.strip(), "", f"Usage: {USAGE}", "", "Experiments (--config=PATH):"]
    found = experiments()
    width = max(map(len, found), default=0)
    lines += [f"  {path:<{width}}  {doc}" for path, doc in found.items()]
    lines += ["", "Flags:"]
    lines += [f"  --{name}: {FLAGS[name].help}" for name in ("config", "workdir", "mode",
                                                             "resume_changed")]
    spec = _config_spec(argv)
    if spec and os.path.isfile(spec.partition(":")[0]):
        from attention_jax import train
        config = _load_experiment(spec)
        lines += ["", f"Keys of --config={spec} (override any with --config.KEY=value):"]
        lines += [f"  {key} = {value!r}" for key, value in train._flat(config).items()]
    else:
        lines += ["", "A config's keys and values: add --help to a command with "
                      "--config=experiments/NAME.py"]
    return "\n".join(lines)


def _bad_override(argv) -> str:
    """Which `--config.a.b=v` failed and the keys that are valid there."""
    spec = _config_spec(argv)
    if spec is None:
        return ""
    config = _load_experiment(spec)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0].split(".")
        node, where = config, "config"
        for key in path:
            if not hasattr(node, "keys") or key not in node:
                valid = sorted(node.keys()) if hasattr(node, "keys") else []
                return f"{arg}: {where} has no key {key!r}; valid: {valid}"
            node, where = node[key], f"{where}.{key}"
    return ""


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def parse_flags(argv):
    """absl flag parsing with every mistake reported as one line: a missing experiment
    file, a stray argument, an unknown flag, an override naming a key the config lacks
    or of the wrong type. --help prints help_text and exits 0."""
    if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
        print(help_text(argv))
        sys.exit(0)
    spec = _config_spec(argv)
    if spec is not None and not os.path.isfile(spec.partition(":")[0]):
        import difflib
        names = list(experiments())
        close = difflib.get_close_matches(spec.partition(":")[0], names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        _fail(f"--config={spec}: no such file{hint}. Experiments: "
              f"{', '.join(names) or 'none found in ./experiments'}")
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e}\nUsage: {USAGE}")
    except (AttributeError, KeyError) as e:  # An override naming a key the config lacks.
        _fail(_bad_override(argv) or str(e))
    except (TypeError, ValueError) as e:  # An override of the wrong type.
        _fail(str(e))
    if len(rest) > 1:
        _fail(f"unexpected argument{'s' if len(rest) > 2 else ''} {' '.join(rest[1:])}: "
              f"flags are --name=value and config overrides --config.group.key=value "
              f"(--help lists them)")
    return rest


def run() -> None:
    """Console-script entry point (`attention-jax` in pyproject)."""
    # Experiment files import attention_jax relative to the working directory.
    sys.path.insert(0, os.getcwd())
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
