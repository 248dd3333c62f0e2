r"""Command line: run an experiment config in a workdir.

  python -m attention_jax.main --config=experiments/gpt.py --workdir=/tmp/gpt \
      [--config.optim.lr=1e-3 --config.train.steps=200] [--mode=train|eval|sample]
  attention-jax --config=experiments/vit.py:variant=vit-tiny/4 --workdir=/tmp/vit

`--config=FILE:ARG` passes ARG to the file's `get_config(arg)`. Any field can be
overridden with `--config.group.key=value`; an unknown key or a value of the wrong type
is an error before anything runs. Running the same command again resumes from the
workdir's latest checkpoint. Modes:
  train   (default) train and evaluate, resuming what is in the workdir.
  eval    evaluate the latest checkpoint on the eval split, print and log the metrics.
  sample  language models: print continuations of config.eval.sample_prompts.
  embed   BERT sentence embeddings of the lines on stdin, from
          --config.train.init_from=hf:<dir> or the workdir's checkpoint (embed_texts).
Exit codes: 0 done, 1 a config or non-finite-loss error (message printed), 130/143
stopped by SIGINT/SIGTERM after saving a checkpoint (run again to resume).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file (experiments/*.py[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the resolved config.")
flags.DEFINE_enum("mode", "train", ["train", "eval", "sample", "embed"], "What to do.")
flags.mark_flags_as_required(["config", "workdir"])


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
        raise ValueError("--mode=embed: no texts (give one text per line on stdin)")
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
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides are --config.x.y=v")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax and tfds are chatty at INFO.
    from attention_jax import train
    config, workdir = FLAGS.config, FLAGS.workdir
    try:
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
        summary = train.train_and_evaluate(config, workdir)
    except (train.ConfigError, train.NonFiniteLossError, train.NoIntactCheckpointError) as e:
        # Expected failures get a one-paragraph message, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("step", "train", "eval", "stopped_by")}, indent=1))
    task = train.TASKS.get(config.task)
    if summary["stopped_by"]:
        return {"SIGINT": 130, "SIGTERM": 143}.get(summary["stopped_by"], 1)
    if FLAGS.mode == "train" and config.task == "gpt" and task is not None:
        for prompt, text in zip(config.eval.sample_prompts, sample_checkpoint(config, workdir)):
            print(f"--- sample from {prompt!r}:\n{text}\n")
    return 0


def _bad_override(argv) -> str:
    """Which `--config.a.b=v` failed and the keys that are valid there."""
    import importlib.util
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return ""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_experiment", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg or None)
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


def parse_flags(argv):
    """absl flag parsing with config errors reported as one line naming the key."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}\nUsage: python -m attention_jax.main --config=experiments/NAME.py "
              f"--workdir=DIR [--config.group.key=value ...] [--mode=train|eval|sample]",
              file=sys.stderr)
    except (AttributeError, KeyError) as e:  # An override naming a key the config lacks.
        print(f"error: {_bad_override(argv) or e}", file=sys.stderr)
    except (TypeError, ValueError) as e:  # An override of the wrong type.
        print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def run() -> None:
    """Console-script entry point (`attention-jax` in pyproject)."""
    # Experiment files import attention_jax relative to the working directory.
    sys.path.insert(0, os.getcwd())
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
