r"""Command line: run an experiment config in a workdir.

  python -m attention_jax.main --config=gpt --workdir=/tmp/gpt \
      [--config.optim.lr=1e-3 --config.train.steps=200]
      [--mode=train|eval|sample|embed|classify|translate]
  attention-jax --config=vit:variant=vit-tiny/4 --workdir=/tmp/vit
  attention-jax --config=path/to/my_config.py --workdir=/tmp/mine

`--config=NAME` is a config shipped in attention_jax/configs/, `--config=FILE.py` one of
yours (its get_config(arg) built on attention_jax.config.base_config()); `:ARG` passes the
experiment's own arguments (`variant=...,steps=...`). Any field can be overridden with
`--config.group.key=value`; an unknown key or argument, a value of the wrong type or
range is an error before anything runs. Running the same command again resumes from
the workdir's latest checkpoint (so does one without --config, training the workdir's
config.json, e.g. `--workdir=RUN --config.train.steps=2000` to extend it); if
training-relevant keys differ from the workdir's config.json the run stops and lists them (--resume_changed resumes anyway; a changed
train.steps, to extend a run, and the keys in workdir.RESUME_SAFE_KEYS need no flag).
Modes:
  train   (default) train and evaluate, resuming what is in the workdir.
  eval    evaluate the latest checkpoint on the eval split (--config.data.eval_split=test:
          another split of the run's dataset); print the metrics and append them to the
          workdir's evals.jsonl (never to the training's metrics.jsonl; a record of another
          split names it under "data").
  sample  language models: print continuations of config.eval.sample_prompts;
          translation (encdec, rnn_seq2seq): their translations (greedy, or a beam
          search of --config.eval.beam_size=N).
  embed   BERT sentence embeddings of the lines on stdin, from
          --config.train.init_from=hf:<dir> or the workdir's checkpoint (embed_texts).
  classify  text classifiers (bert_classify): each line of stdin's class and its
          probability, one JSON line each on stdout (a pair: its two texts tab-separated);
          image classifiers (vit, cnn): each line an image file's path.
  translate  translation (encdec, rnn_seq2seq): each line of stdin a source sentence, its
          translation one JSON line each on stdout; greedy, or a beam search of
          --config.eval.beam_size=N.
Reading modes (eval, sample, embed, classify, translate) use the run's own config.json: --config may
be left out, and an override may change only what reading uses (eval.*, mesh.*, batch
sizes, train.compute_dtype, ...); one of a model, data or optimizer key stops in one line.
Exit codes: 0 done, 1 a usage, config, data or non-finite-loss error (one `error: ...`
message, no traceback), 130/143 stopped by SIGINT/SIGTERM after saving a checkpoint
(run again to resume; a SIGINT before or after training's loop, or a second one, ends
the process at once, in one line), 75 another process of a multi-process run was lost (one `error:`
line naming it; run all processes again to resume).
"""

from __future__ import annotations

import os
import signal
import sys


def _stop_now(signum, frame):
    """Ctrl-C outside training's loop (whose own handler stops at a step and saves, and
    hands a second Ctrl-C here): while Python imports JAX, the config loads, data is
    prepared, a step compiles, or an evaluation runs. An interrupt inside XLA's compiler
    can crash the interpreter on its way out (a segmentation fault after the traceback,
    seen on the CPU host), so the process ends here, in one line, written with os.write:
    print and flush can raise inside a signal handler (a write in progress, a closed
    pipe)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - nothing may keep the process from ending
        pass
    os.write(2, b"stopped by SIGINT: the workdir keeps its last committed checkpoint (a save "
                b"still being written is dropped); run again to resume\n")
    os._exit(130)


if __name__ == "__main__":  # before the imports below: JAX's takes seconds
    signal.signal(signal.SIGINT, _stop_now)

import json  # noqa: E402
import textwrap  # noqa: E402
from typing import Sequence  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from attention_jax import config as config_lib  # noqa: E402
from attention_jax import config_help  # noqa: E402
from attention_jax.errors import ConfigError, UserError  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "A shipped config NAME or a FILE.py, then :ARG (its "
                    "arguments): gpt, vit:variant=vit-tiny/4, path/to/mine.py.")
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the resolved config.")
MODES = ["train", "eval", "sample", "embed", "classify", "translate"]
flags.DEFINE_enum("mode", "train", MODES, "What to do.")
flags.DEFINE_bool("resume_changed", False,
                  "Resume the workdir's checkpoint even though training-relevant config keys "
                  "differ from its config.json (the old one is kept as "
                  "config_until_step_N.json).")
flags.mark_flags_as_required(["workdir"])  # --config: needed to train (mode_config)
# --help's lines of what a config key means are wrapped at this width.
HELP_WIDTH = 92
USAGE = ("python -m attention_jax.main --config=NAME|FILE.py[:ARG] --workdir=DIR "
         f"[--config.group.key=value ...] [--mode={'|'.join(MODES)}] [--resume_changed]")


class InputError(UserError, ValueError):
    """Bad input on stdin (--mode=embed, --mode=classify, --mode=translate)."""


def _stdin_texts(mode: str, files_note: str, what: str = "text") -> list[str]:
    """The non-empty lines of stdin (UTF-8; a Windows line end is no part of a text), a
    note on stderr where blank ones were skipped (row i is then not line i)."""
    stream = getattr(sys.stdin, "buffer", None)  # bytes: decoded here, the line named
    lines = []
    for number, line in enumerate(stream if stream is not None else sys.stdin, 1):
        try:
            line = line.decode("utf-8") if isinstance(line, bytes) else line
        except UnicodeDecodeError as e:
            raise InputError(f"--mode={mode}: line {number} of stdin is not UTF-8 ({e.reason} "
                             f"at byte {e.start}); valid: UTF-8 text (convert it, e.g. iconv "
                             f"-t utf-8)") from None
        lines.append(line.rstrip("\r\n"))
    texts = [line for line in lines if line.strip()]
    if len(texts) < len(lines):
        blank = len(lines) - len(texts)
        print(f"note: {blank} blank line{'s' * (blank > 1)} of stdin skipped: {len(texts)} "
              f"{what}s, in order, {files_note}", file=sys.stderr)
    if not texts:
        raise InputError(f"--mode={mode}: no {what}s (give one {what} per line on stdin)")
    return texts


def evaluate_checkpoint(config, workdir: str) -> dict:
    """Metrics of the workdir's latest checkpoint (mode=eval), with the trainer's own
    jitted eval step. The record goes to workdir/evals.jsonl (nowhere if the workdir is
    read-only), never into the training history, metrics.jsonl."""
    from attention_jax import runs, steps
    from attention_jax import workdir as workdir_lib
    run = runs.open_run(workdir, config=config)
    steps.check_eval_split(run.task, config)  # (a reader's task reads its data only now)
    with run.mesh_context():
        eval_step = steps.jit_eval_step(run.task, config, run.mesh, run.shardings["params"])
        metrics = steps.evaluate(eval_step, run.params, run.task, config, run.mesh)
    record = {"step": run.step, **metrics}
    # Evaluated on other data than the run's (a test folder, files moved): the record
    # says which, so evals.jsonl does not mix them up unsaid.
    data = {k: new for k, (_, new) in workdir_lib.config_changes(config, workdir).items()
            if k.startswith("data.")}
    if data:
        record["data"] = data
    file = workdir_lib.append_eval_record(workdir, record)
    if file is None:
        print(f"--mode=eval: {workdir} is read-only; the record is printed only",
              file=sys.stderr)
    return record


def sample_checkpoint(config, workdir: str) -> list[str]:
    """Continuations of config.eval.sample_prompts from the latest checkpoint (a
    translation task: their translations)."""
    import jax

    from attention_jax import runs, tasks
    run = runs.open_run(workdir, config=config)
    sample = tasks.need(run.task, "sample", config.task, "sample (--mode=sample)")
    with run.mesh_context():
        return sample(run.params, jax.random.PRNGKey(config.train.seed))


def embed_texts(config, workdir: str, texts: Sequence[str] | None = None) -> dict:
    """`--mode=embed`: embeds `texts` (default: the non-empty lines of stdin) with the
    workdir's trained BERT (its latest checkpoint), or where the workdir holds no run
    with the BERT of `config.train.init_from=hf:<dir>` as it is. Writes
    workdir/embeddings.npy ([B, D] float32) and embeddings_texts.json (a later call:
    embeddings_2.npy and embeddings_2_texts.json, and so on); returns
    {"texts", "dim", "file", "similarity"} (the cosine matrix, for a quick look)."""
    import jax
    import numpy as np

    from attention_jax import convert, runs, tasks
    # (before stdin is read: an empty one said only "no texts")
    tasks.declared_for("embed", config.get("task"), ("embed",), "embed text",
                       " (e.g. --config=bert_mlm)")
    if texts is None:
        texts = _stdin_texts("embed", "one row each (the _texts.json written beside the "
                                      "embeddings lists them)")
    if not texts:
        raise InputError("--mode=embed: no texts (give one text per line on stdin)")
    from attention_jax import checkpoint
    from attention_jax import workdir as workdir_lib  # local or gs:// / s3:// alike
    src = str(config.train.init_from or "")
    # A run trained here embeds with its own weights: its config.json keeps init_from,
    # where its training started (the hf: dir's untrained weights were embedded, unsaid).
    trained = checkpoint.latest_step_in(workdir_lib.epath_of(workdir, workdir_lib.CHECKPOINTS))
    if src.startswith("hf:") and trained is not None:
        print(f"note: {workdir} holds a trained run (step {trained}): embedding with its "
              f"checkpoint, not config.train.init_from={src!r} (where its training started; "
              f"a new --workdir embeds with that dir itself)", file=sys.stderr)
    if src.startswith("hf:") and trained is None:
        # The config's task must embed too: --config=vit with a BERT dir embedded with
        # the BERT in silence, the config ignored.
        task = config.get("task")  # (a notebook's config may name none)
        if task and task not in tasks.tasks_with("embed"):
            raise ConfigError(f"--mode=embed: task {task!r} cannot embed text; valid: "
                              f"{tasks.tasks_with('embed')} (e.g. --config=bert_mlm)")
        try:
            encoder = convert.load_sentence_encoder(src[len("hf:"):])
        except (FileNotFoundError, ValueError) as e:  # a wrong folder: one line, as in train
            raise ConfigError(f"config.train.init_from={src!r}: {e}") from None
        emb = encoder.embed(list(texts))
    else:  # A model trained here that embeds text: the workdir's latest checkpoint.
        run = runs.open_run(workdir, config=config)
        embed = tasks.need(run.task, "embed", config.task,
                           "embed text (--mode=embed; or --config.train.init_from=hf:<bert dir>)")
        emb = embed(jax.tree.map(np.asarray, jax.device_get(run.params)), list(texts))
    # Each call its own pair of files: embeddings.npy, then embeddings_2.npy, ... (an
    # earlier call's embeddings are never overwritten). Process 0 writes them.
    stem, n = "embeddings", 1
    while workdir_lib.epath_of(workdir, f"{stem}.npy").exists():
        n += 1
        stem = f"embeddings_{n}"
    file = workdir_lib.path(workdir, f"{stem}.npy")
    if jax.process_index() == 0:
        workdir_lib.epath_of(workdir).mkdir(parents=True, exist_ok=True)
        with workdir_lib.epath_of(file).open("wb") as f:
            np.save(f, emb)
        workdir_lib.epath_of(workdir, f"{stem}_texts.json").write_text(
            json.dumps(list(texts), indent=1))
    unit = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
    return {"texts": list(texts), "dim": int(emb.shape[1]), "file": file,
            "similarity": np.round((unit @ unit.T).astype(np.float64), 4).tolist()}


def classify_texts(config, workdir: str, texts: Sequence[str] | None = None) -> list[dict]:
    """`--mode=classify`: the class of each of `texts` (default: the non-empty lines of
    stdin) by the workdir's trained classifier: [{"text", "label", "probability"}] in
    order, the label a name of the run's classes and its softmax probability. An image
    classifier's (vit, cnn) texts are image files' paths: [{"image", "label",
    "probability"}], each image read as the run's eval images are."""
    import jax
    import numpy as np

    from attention_jax import runs, tasks
    declared = tasks.declared_for("classify", config.task, ("label_texts", "label_images"),
                                  "classify texts or images")
    what = "image path" if declared and "label_images" in declared else "text"
    if texts is None:
        texts = _stdin_texts("classify", f"one output line each (each names its {what})",
                             what=what)
    if not texts:
        raise InputError(f"--mode=classify: no {what}s (give one {what} per line on stdin)")
    run = runs.open_run(workdir, config=config)
    images = run.task.label_images is not None
    label = run.task.label_images if images else run.task.label_texts
    if label is None:
        able = sorted(tasks.tasks_with("label_texts") + tasks.tasks_with("label_images"))
        raise ConfigError(f"--mode=classify: task {config.task!r} cannot classify texts or "
                          f"images (its Task has neither label_texts nor label_images); "
                          f"valid: {able}")
    params = jax.tree.map(np.asarray, jax.device_get(run.params))
    if images:  # a path's own spaces around it are no part of it (a pasted list)
        texts = [t.strip() for t in texts]
    probabilities, unreadable = label(params, list(texts))
    if unreadable:  # the others are classified; these lines say why not, in order
        what = "files are no readable image" if images else "lines are no pair of texts"
        print(f"warning: --mode=classify: {len(unreadable)} of the {len(texts)} {what}: their "
              f"lines carry \"error\" and no label", file=sys.stderr)
    names = run.task.class_names or [str(k) for k in range(probabilities.shape[-1])]
    key = "image" if images else "text"
    return [{key: text, "error": unreadable[i]} if i in unreadable else
            {key: text, "label": names[int(np.argmax(p))],
             "probability": round(float(np.max(p)), 4)}
            for i, (text, p) in enumerate(zip(texts, probabilities))]


def main(argv) -> int:
    del argv  # parse_flags has refused stray arguments.
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax and tfds are chatty at INFO.
    from attention_jax import workdir as workdir_lib
    try:
        workdir = workdir_lib.expand(FLAGS.workdir)
        config = mode_config(FLAGS.mode, FLAGS.config, _overrides, workdir)
        return _run_mode(config, workdir)
    except UserError as e:  # a mistake in the request: one line; a bug keeps its traceback
        where = f"--mode={FLAGS.mode}: " if isinstance(e, workdir_lib.RunNotFoundError) else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - only the device running out of memory is caught
        import jax
        if not (isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)):
            raise
        # A config too large for the device (gpt2_gpu on a laptop): XLA's 50-line
        # traceback said only "Out of memory allocating N bytes".
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        ways = ("a smaller train.batch_size (optim.grad_accum keeps the batch), "
                "model.remat_policy (recompute activations), train.loss_chunk_size, a smaller "
                "model, or more devices (mesh.fsdp)" if FLAGS.mode == "train" else
                "a smaller eval.batch_size, or more devices (--config.mesh.*)")
        print(f"error: the run does not fit this device's memory ({first[:200]}); valid: "
              f"{ways}", file=sys.stderr)
        return 1


def mode_config(mode: str, spec: str | None, overrides: Sequence[str], workdir: str):
    """The config `mode` runs with. Training: `spec` with `overrides` (no `spec` in a
    workdir that holds a run: its config.json with `overrides`, to continue it). Reading a trained
    run (eval, sample, embed): the run's own config.json, so an evaluation is of the model
    and data the run trained on whatever --config says; `overrides` may change only what
    reading uses (eval.*, mesh.*, dtype, ...: workdir.READ_SAFE_KEYS), and those that differ
    from the run's are named on stderr. (embed of a Hugging Face model, with no run in the
    workdir, takes `spec`.)"""
    from attention_jax import workdir as workdir_lib
    mesh_given = any(str(o).startswith("mesh.") for o in overrides)
    if mode != "train":
        workdir_lib.check_readable(workdir)
    if mode != "train" and workdir_lib.exists(workdir, workdir_lib.CONFIG):
        config = workdir_lib.read_config(workdir)
        config_lib.apply_overrides(config, overrides)
        from attention_jax import runs
        fitted = not mesh_given and runs.fit_run_mesh(config, f"--mode={mode}")
        changed = workdir_lib.check_reader_config(config, workdir, f"--mode={mode}")
        if fitted:  # said once, by fit_run_mesh
            changed = {k: v for k, v in changed.items() if not k.startswith("mesh.")}
        registers = _register_the_runs_task(config, spec, reading=True)
        if spec is not None:
            print(f"--mode={mode}: the run's own config "
                  f"({workdir_lib.path(workdir, workdir_lib.CONFIG)}) is read; --config={spec} "
                  + ("ran for its tasks.register only" if registers else "is not"),
                  file=sys.stderr)
        if changed:
            print(f"--mode={mode}: the run's config.json with " + ", ".join(
                f"{k}={json.dumps(new)} (trained with {json.dumps(old)})"
                for k, (old, new) in changed.items()), file=sys.stderr)
        return config
    if spec is None and mode == "train" and _holds_a_run(workdir):
        # Continuing a run (more steps, say) needs no --config and none of its overrides
        # again: the run's own config.json is the config, these overrides on top.
        config = workdir_lib.read_config(workdir)
        config_lib.apply_overrides(config, overrides)
        m = config.mesh
        launched = m.coordinator_address or m.process_id >= 0 or m.num_processes > 0
        if m.distributed and launched and not mesh_given:
            # Process 0's launch settings (its id, the coordinator) are no part of the run:
            # inherited, this one process joined the gone coordinator and waited 5 minutes.
            # (A cluster JAX detects, a TPU VM's or SLURM's, recorded none: its workers
            # continue together, as they trained.)
            from attention_jax import runs
            runs.fit_run_mesh(config, "training", doing="train")
        _register_the_runs_task(config, None, reading=False)
        print(f"training the run's own config ({workdir_lib.path(workdir, workdir_lib.CONFIG)})"
              + (f" with {', '.join(map(str, overrides))}" if overrides else ""), file=sys.stderr)
        return config
    if spec is None:
        if mode == "train":
            raise ConfigError("--config is required to train: a shipped config NAME or a "
                              "FILE.py (--help lists them)")
        # (only embed reads a model without a run: a Hugging Face checkpoint)
        hint = ("train there first, name a run's workdir, or give --config with "
                "--config.train.init_from=hf:DIR" if mode == "embed" else
                "train there first, or name a run's workdir")
        raise workdir_lib.RunNotFoundError(
            f"{workdir_lib.path(workdir, workdir_lib.CONFIG)} does not exist: {workdir!r} holds "
            f"no trained run ({hint})")
    return config_lib.load(spec, overrides)


def _register_the_runs_task(config, spec: str | None, reading: bool) -> bool:
    """Whether `spec`, a config file, was run for the registration of the run's task
    (a task of one's own, tasks.register in that file: the run's config.json names it,
    and only the file registers it). A task registered nowhere is a ConfigError saying
    which file to give (reading: for its registration only; continuing the training: as
    the config, as when the run started)."""
    from attention_jax import tasks
    if config.get("task") in tasks.TASKS:
        return False
    file = (spec or "").partition(":")[0]
    if file.endswith(".py"):
        config_lib.config_module(file)
        if config.task in tasks.TASKS:
            return True
    raise ConfigError(
        f"config.task={config.task!r} (the run's config.json) is no registered task"
        + (f": {file} does not register it" if file.endswith(".py") else "")
        + f"; valid: {sorted(tasks.TASKS)}, or give the config file that registers it "
        f"(tasks.register): --config=FILE.py"
        + (" (it runs for that; the run's own config.json stays the config)" if reading
           else ", the config the run started with"))


def translate_texts(config, workdir: str, texts: Sequence[str] | None = None) -> list[dict]:
    """`--mode=translate`: each of `texts` (default: the non-empty lines of stdin), a
    source sentence, translated by the workdir's trained model: [{"source", "translation"}]
    in order; greedy, or the best of a beam search of config.eval.beam_size. A sentence
    that cannot be translated (no tokens, longer than data.source_len) gets {"source",
    "error"}, said on stderr, the others translated."""
    from attention_jax import runs, tasks
    tasks.declared_for("translate", config.task, ("translate",), "translate")
    if texts is None:
        texts = _stdin_texts("translate", "one output line each (each names its source)",
                             what="source sentence")
    if not texts:
        raise InputError("--mode=translate: no source sentences (give one per line on stdin)")
    run = runs.open_run(workdir, config=config)
    translate = tasks.need(run.task, "translate", config.task, "translate (--mode=translate)")
    untranslated: dict[int, str] = {}  # a line too long, or of no tokens: said on its line
    with run.mesh_context():
        out = translate(run.params, list(texts), untranslated)
    if untranslated:  # the others are translated; these lines say why not, in order
        print(f"warning: --mode=translate: {len(untranslated)} of the {len(texts)} source "
              f"sentences cannot be translated: their lines carry \"error\" and no "
              f"translation", file=sys.stderr)
    return [{"source": text, "error": untranslated[i]} if i in untranslated else
            {"source": text, "translation": t} for i, (text, t) in enumerate(zip(texts, out))]


def _holds_a_run(workdir: str) -> bool:
    """Whether the workdir's config.json is a run's (not a Hugging Face export's, or
    anyone's file of that name)."""
    from attention_jax import workdir as workdir_lib
    try:
        stored = workdir_lib.read_config_json(workdir)
    except (ValueError, OSError, AttributeError):
        return False
    return isinstance(stored, dict) and "task" in stored


def _say(text: str) -> None:
    """A result line of the run, on process 0's stdout only: every process computes (the
    step's collectives span them), one prints, as every other line of the run, so a
    multi-process eval's JSON comes once, not once a process."""
    import jax
    if jax.process_index() == 0:
        print(text)


def _run_mode(config, workdir) -> int:
    from attention_jax import train

    if FLAGS.mode == "eval":
        _say(json.dumps(evaluate_checkpoint(config, workdir), indent=1))
        return 0
    if FLAGS.mode == "embed":
        _say(json.dumps(embed_texts(config, workdir), indent=1))
        return 0
    if FLAGS.mode == "classify":
        for row in classify_texts(config, workdir):
            _say(json.dumps(row, ensure_ascii=False))
        return 0
    if FLAGS.mode == "translate":
        for row in translate_texts(config, workdir):
            _say(json.dumps(row, ensure_ascii=False))
        return 0
    if FLAGS.mode == "sample":
        if not config.eval.sample_prompts:  # exit 0 with no output read as a broken run
            print("nothing to sample: config.eval.sample_prompts is empty; give prompts, e.g. "
                  "--config.eval.sample_prompts='(\"def \",)'", file=sys.stderr)
            return 0
        _print_samples(config, workdir, "--- prompt {prompt!r}\n{text}\n")
        return 0
    summary = train.train_and_evaluate(config, workdir, resume_changed=FLAGS.resume_changed)
    _say(_summary_line(summary, workdir))
    if summary["stopped_by"]:
        return train.EXIT_CODES.get(summary["stopped_by"], 1)
    if summary["task"].sample is not None:  # a language model: show what it learnt
        _print_samples(config, workdir, "--- sample from {prompt!r}:\n{text}\n")
    return 0


def _print_samples(config, workdir: str, form: str) -> None:
    """Every process generates (the step's collectives span them); process 0 prints. A
    translation task's samples are translations of its prompts, and say so."""
    import jax

    from attention_jax import tasks
    if config.task in tasks.tasks_with("decode"):
        form = "--- translation of {prompt!r}:\n{text}\n"
    texts = sample_checkpoint(config, workdir)
    if jax.process_index() == 0:
        for prompt, text in zip(config.eval.sample_prompts, texts):
            print(form.format(prompt=prompt, text=text))


def _summary_line(summary: dict, workdir: str) -> str:
    """The end of a run in one line: its step, how it stopped, its last eval (with its
    step where that is not the run's: a run stopped between evaluations, or extended
    with eval.every=-1), and where every record is (the file holds them all; the
    terminal needs no copy)."""
    how = f"stopped by {summary['stopped_by']} at" if summary["stopped_by"] else "done:"
    last = summary["eval"] or summary["train"]
    shown = ", ".join(f"{k} {v:.4g}" for k, v in last.items()
                      if k in ("loss", "accuracy", "perplexity"))
    split = "eval" if summary["eval"] else "train"
    from attention_jax import workdir as workdir_lib
    # The record shown is the split's last in metrics.jsonl (this call's, or read back from
    # the file): its step is there. A SIGTERM at step 777 with evaluations every 500 read
    # "stopped by SIGTERM at step 777; eval loss ...", the loss of step 500's model.
    at = last.get("step")
    if at is None and shown:
        at = workdir_lib.last_records(workdir)[split].get("step")
    if shown and at is not None and at != summary["step"]:
        split = f"{split} (step {at})"
    return (f"{how} step {summary['step']}" + (f"; {split} {shown}" if shown else "")
            + f"; every record in {workdir_lib.path(workdir, workdir_lib.METRICS)}")


def _config_spec(argv) -> str | None:
    """The value of --config (`--config=F` or `--config F`), or None."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def help_text(argv) -> str:
    """--help: the module doc, the shipped configs, the flags, and with --config=SPEC the
    keys of that config with their values, each with what it means (config_help)."""
    lines = [__doc__.strip(), "", f"Usage: {USAGE}", "",
             "Shipped configs (--config=NAME; attention_jax/configs/NAME.py):"]
    found = config_lib.shipped()
    width = max(map(len, found), default=0)
    lines += [f"  {name:<{width}}  {doc}" for name, doc in found.items()]
    lines += ["", "Flags:"]
    lines += [f"  --{name}: {FLAGS[name].help}" for name in ("config", "workdir", "mode",
                                                             "resume_changed")]
    spec = _config_spec(argv)
    if spec:
        from attention_jax import tasks
        try:
            overrides = config_lib.split_overrides(argv)[1]
            config, explained = config_help.load_explained(
                spec, overrides,
                lambda c: getattr(tasks.TASKS.get(c.get("task")), "model", None))
        except UserError as e:
            _fail(str(e))
        about = config_lib.describe(spec)
        if about:  # its :ARG arguments are described there, not among the keys
            lines += ["", f"About --config={spec.partition(':')[0]}:", about]
        lines += ["", f"Keys of --config={spec} (override any with --config.KEY=value):"]
        if overrides:  # a comment may count from a value the user has now changed
            lines += textwrap.wrap(
                "(each 'This config:' comment is of the config's own value; one that "
                "derives from a key set on the command line, such as tokens a step from "
                "data.seq_len, may no longer hold)", width=HELP_WIDTH,
                initial_indent="  ", subsequent_indent="   ")
        keys = config_lib.flat(config)
        unread = tasks.unread_keys(config.get("task"))
        if unread:
            keys = {k: v for k, v in keys.items() if k not in unread}
            lines += textwrap.wrap(f"(left out, as task {config.task!r} does not read them: "
                                   f"{tasks.describe_readers(unread)})", width=HELP_WIDTH,
                                   initial_indent="  ", subsequent_indent="   ")
        for key, value in keys.items():
            lines.append(f"  {key} = {value!r}")
            if key in explained:
                lines += textwrap.wrap(explained[key], width=HELP_WIDTH,
                                       initial_indent="      ", subsequent_indent="      ")
    else:
        lines += ["", "A config's keys and values: add --help to a command with --config=NAME"]
    return "\n".join(lines)


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# The --config.KEY=VALUE overrides parse_flags took out of argv, for main (absl hands main
# only the leftover argv).
_overrides: list[str] = []


def parse_flags(argv):
    """absl flag parsing with every mistake reported as one line: a stray argument, an
    unknown flag, a malformed override. --help prints help_text and exits 0. The config
    itself is loaded in main (mode_config), whose errors are one line too."""
    if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
        print(help_text(argv))
        sys.exit(0)
    try:
        argv, overrides = config_lib.split_overrides(argv)
    except ConfigError as e:
        _fail(str(e))
    _overrides[:] = overrides
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        _fail(f"{e}\nUsage: {USAGE}")
    if len(rest) > 1:
        _fail(f"unexpected argument{'s' if len(rest) > 2 else ''} {' '.join(rest[1:])}: "
              f"flags are --name=value and config overrides --config.group.key=value "
              f"(--help lists them)")
    return rest


# Seconds an exit after an error waits for the background threads that are no daemons
# (orbax's save threads) before it leaves without them.
THREAD_GRACE_S = 10.0


def exit_with(code: int) -> None:
    """sys.exit(code); after an error, without the non-daemon threads still running
    THREAD_GRACE_S later. A checkpoint save that failed as the object store went away
    left orbax's threads waiting on each other for its signals' 5-minute timeout, which
    Python's exit joins first: the run said its error and hung on."""
    import threading
    import time
    if code:
        deadline = time.monotonic() + THREAD_GRACE_S
        waiting = [t for t in threading.enumerate()
                   if t is not threading.current_thread() and not t.daemon]
        for t in waiting:
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except TimeoutError:  # orbax's threads raise it from a join that timed out
                pass
        stuck = [t.name for t in waiting if t.is_alive()]
        if stuck:
            print(f"note: exiting without {len(stuck)} background thread(s) still waiting "
                  f"after the error ({', '.join(stuck[:3])}{', ...' if len(stuck) > 3 else ''})",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(code)
    sys.exit(code)


def run() -> None:
    """Console-script entry point (`attention-jax` in pyproject)."""
    signal.signal(signal.SIGINT, _stop_now)  # training's loop installs its own meanwhile
    app.run(lambda argv: exit_with(main(argv)), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
