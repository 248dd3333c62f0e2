"""Config values checked before anything compiles, and what a resumed run may change."""

import json
import os
import re

import flax.linen as nn
import jax
import pytest

import tiny
from attention_jax import steps, tasks, train
from attention_jax import config as config_lib
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError


@pytest.mark.parametrize("key,value,message", [
    ("optim.lr", -1e-3, "config.optim.lr=-0.001 is out of range; valid: optim.lr > 0"),
    ("optim.lr", 0.0, "config.optim.lr=0.0 is out of range; valid: optim.lr > 0"),
    ("optim.b2", 1.0, "config.optim.b2=1.0 is out of range; valid: 0 <= optim.b2 < 1"),
    ("optim.label_smoothing", 1.5, "config.optim.label_smoothing=1.5 is out of range; valid: "
                                   "0 <= optim.label_smoothing < 1"),
    ("optim.end_lr_ratio", float("nan"), "config.optim.end_lr_ratio=nan is out of range; "
                                         "valid: 0 <= optim.end_lr_ratio <= 1"),
    ("optim.weight_decay", -0.1, "config.optim.weight_decay=-0.1 is out of range; valid: "
                                 "optim.weight_decay >= 0"),
    ("train.steps", 0, "config.train.steps=0 is out of range; valid: train.steps >= 1"),
    ("train.batch_size", -8, "config.train.batch_size=-8 is out of range; valid: "
                             "train.batch_size >= 1"),
    ("eval.every", -2, "config.eval.every=-2 is out of range; valid: eval.every >= -1"),
    # A negative seed was a traceback from the data order's Philox; 2**32 + 5 the PRNG key
    # of seed 5 (its low 32 bits), unsaid.
    ("train.seed", -7, "config.train.seed=-7 is out of range; valid: 0 <= train.seed < "
                       "4294967296"),
    ("train.seed", 2 ** 32 + 5, "config.train.seed=4294967301 is out of range; valid: "
                                "0 <= train.seed < 4294967296"),
    ("eval.sample_temperature", -1.0, "config.eval.sample_temperature=-1.0 is out of range; "
                                      "valid: eval.sample_temperature >= 0"),
    ("eval.sample_top_p", 0.0, "config.eval.sample_top_p=0.0 is out of range; valid: "
                               "0 < eval.sample_top_p <= 1"),
    # Steps count from 1: a fault asked for at 0 never came, unsaid.
    ("train.inject_nan_at", 0, "config.train.inject_nan_at=0 is no step: steps count from 1, "
                               "as metrics.jsonl logs them; valid: -1 (never) or a step 1, 2, ..."),
])
def test_out_of_range_values_name_the_key_value_and_range(key, value, message):
    with pytest.raises(ConfigError) as e:
        config_lib.validate(tiny.tiny_config(**{key: value}))
    assert str(e.value) == message


def test_boundaries_are_valid():
    config_lib.validate(tiny.tiny_config(**{"optim.b1": 0.0, "optim.clip_norm": 0.0,
                                              "eval.every": -1, "optim.end_lr_ratio": 1.0,
                                              "optim.warmup_steps": 20,
                                              "train.seed": 2 ** 32 - 1}))


def test_warmup_longer_than_a_short_run_is_a_warning_not_an_error():
    # A smoke run (--config.train.steps=5) of any experiment must just work: one line.
    c = tiny.tiny_config(**{"optim.decay_steps": 0, "optim.warmup_steps": 11})
    config_lib.validate(c)
    assert config_lib.warnings(c) == [
        "config.optim.warmup_steps=11 is longer than the run (train.steps=10): the learning "
        "rate stops at 82% of optim.lr"]  # the 10th step's, 9/11: as the run logs it
    c = tiny.tiny_config(**{"optim.decay_steps": 20, "optim.warmup_steps": 21})
    assert "longer than optim.decay_steps=20" in config_lib.warnings(c)[0]
    # Past the warmup, the run does reach optim.lr (it said 49% at decay_steps=50).
    c = tiny.tiny_config(**{"train.steps": 1000, "optim.decay_steps": 50,
                            "optim.warmup_steps": 100})
    assert config_lib.warnings(c)[0].endswith("the learning rate reaches optim.lr at step "
                                              "101, then drops to the schedule's end at once")
    # The start of a longer schedule (10 steps of a 20-step one) says nothing.
    assert config_lib.warnings(tiny.tiny_config(**{"optim.decay_steps": 20,
                                                   "optim.warmup_steps": 15})) == []
    # An impossible value still stops.
    with pytest.raises(ConfigError, match=r"config\.optim\.warmup_steps=-1 is out of range"):
        config_lib.validate(tiny.tiny_config(**{"optim.warmup_steps": -1}))
    # A constant schedule reads neither the decay's end nor its length (both were ignored,
    # unsaid).
    c = tiny.tiny_config(**{"optim.schedule": "constant", "optim.end_lr_ratio": 0.01})
    assert config_lib.warnings(c) == [
        "config.optim.end_lr_ratio=0.01, optim.decay_steps=20 set, but optim.schedule="
        "'constant' holds optim.lr after the warmup: ignored (valid with them: "
        "optim.schedule 'cosine' or 'linear')"]
    c = tiny.tiny_config(**{"optim.schedule": "constant", "optim.decay_steps": 0})
    assert config_lib.warnings(c) == []


def test_an_moe_capacity_below_one_warns_that_tokens_are_dropped():
    c = config_lib.load("gpt:variant=gpt-tiny-moe", "model.capacity_factor=0.5")
    assert [w for w in config_lib.warnings(c) if "capacity_factor" in w] == [
        "config.model.capacity_factor=0.5 is below 1: each expert takes at most 50% of an "
        "even share of the tokens, so at least 50% of the token-to-expert assignments skip "
        "the MLP even with perfect balance (Switch's default is 1.25; the run logs "
        "dropped_fraction)"]
    for fine in ("model.capacity_factor=1.0", "model.capacity_factor=1.25"):
        c = config_lib.load("gpt:variant=gpt-tiny-moe", fine)
        assert not [w for w in config_lib.warnings(c) if "capacity_factor" in w]
    assert not config_lib.warnings(config_lib.load("gpt"))  # None: the variant's own


def test_moe_loss_weights_are_keys_refused_below_zero_and_absent_from_old_runs(tmp_path):
    """model.router_z_loss_weight (new) and model.moe_loss_weight: None is the model's
    default (0 and 0.01); a negative weight is a ConfigError naming the key; a run saved
    before the z-loss's key reads back with it unset, and resumes as no change."""
    from attention_jax.models import gpt
    load = lambda *over: config_lib.load("gpt:variant=gpt-tiny-moe", list(over))  # noqa: E731
    cfg = tasks.model_config(gpt.GPTConfig, load(), vocab_size=256)
    assert (cfg.router_z_loss_weight, cfg.moe_loss_weight) == (0.0, 0.01)
    assert tasks.model_config(gpt.GPTConfig, load("model.router_z_loss_weight=1e-3"),
                              vocab_size=256).router_z_loss_weight == 1e-3
    for key in ("router_z_loss_weight", "moe_loss_weight"):
        with pytest.raises(ConfigError, match=rf"^config\.model: {key}=-0\.5 is out of "
                                              rf"range; valid: a finite {key} >= 0"):
            tasks.model_config(gpt.GPTConfig, load(f"model.{key}=-0.5"), vocab_size=256)
    config = load()
    workdir_lib.write_config(str(tmp_path), config)
    stored = json.loads((tmp_path / "config.json").read_text())
    del stored["model"]["router_z_loss_weight"]  # as a run saved before the key
    (tmp_path / "config.json").write_text(json.dumps(stored))
    old = workdir_lib.read_config(str(tmp_path))
    assert tasks.model_config(gpt.GPTConfig, old, vocab_size=256).router_z_loss_weight == 0.0
    assert workdir_lib.training_changes(config, str(tmp_path)) == ""
    assert "model.router_z_loss_weight: null -> 0.001" in workdir_lib.training_changes(
        load("model.router_z_loss_weight=1e-3"), str(tmp_path))


def test_model_dropout_and_data_probabilities():
    from attention_jax.models import bert, gpt
    c = tiny.tiny_config()
    c.model = {"attention_dropout_rate": 1.0}
    with pytest.raises(ConfigError, match=r"^config\.model\.attention_dropout_rate=1\.0 is "
                                                r"out of range; valid: 0 <= model\."
                                                r"attention_dropout_rate < 1$"):
        tasks.model_config(bert.BertConfig, c)
    c.model = {"variant": "gpt-tiny", "dropout_rate": -0.1}
    with pytest.raises(ConfigError, match=r"config\.model\.dropout_rate=-0\.1"):
        tasks.model_config(gpt.GPTConfig, c)
    c.data = {"mask_rate": 1.2}
    with pytest.raises(ConfigError, match=r"^config\.data\.mask_rate=1\.2 is out of range; "
                                                r"valid: 0 < data\.mask_rate < 1$"):
        tasks.data_options(c, mask_rate=0.15, seq_len=128)
    c.data = {"seq_len": 0}
    with pytest.raises(ConfigError, match=r"data\.seq_len >= 1"):
        tasks.data_options(c, mask_rate=0.15, seq_len=128)
    c.data = {"tokenizer": "bytes"}
    with pytest.raises(ConfigError, match=r"config\.data\.tokenizer='bytes' is unknown; "
                                                r"valid: .*\(did you mean 'byte'\?\)"):
        tasks.data_options(c, tokenizer="byte")


# A shipped config's model key given a value its model config refused only as the model
# was traced (a traceback, after the data was built, the workdir holding lock.json).
@pytest.mark.parametrize("spec,override,message", [
    ("gpt", "model.remat_policy=foo", r"remat_policy='foo' is unknown; valid: \('none', "
                                      r"'full', 'dots', 'dots_no_batch'\)"),
    ("encdec", "model.remat_policy=foo", r"remat_policy='foo' is unknown; valid: \('none'"),
    ("vit_digits", "model.norm_kernel=foo", r"norm_kernel='foo' is unknown; valid: \('auto', "
                                            r"'xla', 'pallas'\)"),
    ("gpt", "model.attention_scale=foo", r"attention_scale='foo' is out of range; valid: a "
                                         r"finite number, or None for 1/sqrt\(head dim\)"),
    ("gpt", "model.attention_scale=nan", r"attention_scale='nan' is out of range"),
    # (a NaN loss only once training had begun)
    ("gpt", "model.rope_base=0", r"rope_base=0 is out of range; valid: a finite number > 0"),
    ("gpt", "model.rope_base=abc", r"rope_base='abc' is out of range"),
    # (taken as its truth value: True, unsaid)
    ("gpt", "model.tie_embeddings=abc", r"tie_embeddings='abc' is no bool; valid: True or False"),
    ("gpt", "model.use_bias=0", r"use_bias=0 is no bool; valid: True or False"),
])
def test_a_model_key_s_bad_value_is_a_config_error_before_the_model_is_built(
        spec, override, message):
    config = config_lib.load(spec, [override])
    with pytest.raises(ConfigError, match=rf"^config\.model: {message}"):
        tasks.model_config(tasks.TASKS[config.task].model, config)


# A model key refused only once the corpus was read and a tokenizer trained on it (minutes
# on a large corpus): said first, with the vocabulary a stand-in. The files named are not
# there, so the data, had it come first, would have been the error.
@pytest.mark.parametrize("spec,override,message", [
    ("gpt", "model.remat_policy=foo", r"remat_policy='foo' is unknown"),
    ("bert_mlm", "model.num_heads=5", r"num_heads"),
    ("bert_classify", "model.remat_policy=foo", r"remat_policy"),
    ("encdec", "model.num_heads=7", r"num_heads"),
    ("rnn_seq2seq", "model.cell=rnn", r"cell='rnn'"),
])
def test_a_model_key_s_bad_value_is_said_before_the_data_is_read(spec, override, message,
                                                                 tmp_path):
    config = config_lib.load(spec, [override, "data.name=files",
                                    f"data.files={tmp_path / 'none' / '*.jsonl'}"])
    with pytest.raises(ConfigError, match=rf"^config\.model: .*{message}"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


# ------------------------------------------------------------------------ resuming a run
def test_resume_refuses_changed_training_keys_and_lists_them(tmp_path, capsys):
    workdir = str(tmp_path)
    train.train_and_evaluate(tiny.tiny_config(), workdir)
    out = capsys.readouterr().out
    assert f"workdir {os.path.abspath(workdir)}: config.json, checkpoints/ (every 10 steps" in out
    assert f"workdir {os.path.abspath(workdir)}: checkpoints/ up to step 10" in out

    changed = tiny.tiny_config(**{"optim.lr": 2e-2, "train.batch_size": 32})
    with pytest.raises(ConfigError) as e:
        train.train_and_evaluate(changed, workdir)
    assert str(e.value) == (
        f"{workdir} holds a run at step 10 trained with another config: optim.lr: 0.01 -> "
        f"0.02, train.batch_size: 16 -> 32. To resume it with the new values anyway pass "
        f"--resume_changed (train_and_evaluate(..., resume_changed=True)); to train from "
        f"scratch use a new --workdir.")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["optim"]["lr"] == 0.01  # not overwritten

    # Extending the run and logging/evaluating differently needs no flag, only a note.
    longer = tiny.tiny_config(**{"train.steps": 15, "train.log_every": 3, "eval.every": 15})
    summary = train.train_and_evaluate(longer, workdir)
    out = capsys.readouterr().out
    assert ("resuming step 10 with config changes: eval.every: -1 -> 15, train.log_every: 5 -> "
            "3, train.steps: 10 -> 15\n") in out  # decay_steps is set: the schedule is kept
    assert summary["step"] == 15
    # Windows: steps 11-12 (resumed mid-window), 13-15; both logged with their count.
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if '"train"' in line]
    assert [(r["step"], r.get("steps_in_window")) for r in records] == [
        (5, None), (10, None), (12, 2.0), (15, None)]

    # Fewer steps than the run has: it trained nothing yet rewrote config.json (and
    # warned of a warmup longer than the run). Now one line, config.json left alone.
    with pytest.raises(ConfigError, match=rf"^config.train.steps=10 is below the run's step 15 "
                                          rf"\({workdir}/checkpoints/15\); valid: train.steps "
                                          rf">= 15 to resume it"):
        train.train_and_evaluate(changed, workdir, resume_changed=True)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["train"]["steps"] == 15
    changed.train.steps = 15
    summary = train.train_and_evaluate(changed, workdir, resume_changed=True)
    assert summary["step"] == 15  # nothing left to do ...
    assert summary["train"]["step"] == 15 and summary["eval"]["step"] == 15  # ... from the file
    assert os.path.exists(tmp_path / "config_until_step_15.json")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["optim"]["lr"] == 0.02


def test_a_resume_refused_leaves_the_workdir_as_it_was(tmp_path, monkeypatch):
    """A changed config is refused before the task builds its data (it came after the
    corpus was tokenized); a --resume_changed of the model's shape stops on the
    checkpoint before config.json is moved aside and rewritten (the workdir then named a
    model its checkpoints do not hold); a second --resume_changed from one step keeps the
    config that trained it."""
    from attention_jax.checkpoint import CheckpointMismatchError
    workdir = str(tmp_path)
    train.train_and_evaluate(tiny.tiny_config(), workdir)
    trained = (tmp_path / "config.json").read_text()

    def no_setup(*args, **kwargs):
        raise AssertionError("the task was built before the config change was refused")
    with monkeypatch.context() as m:
        m.setattr(train, "setup", no_setup)
        with pytest.raises(ConfigError, match=r"trained with another config: optim\.lr"):
            train.train_and_evaluate(tiny.tiny_config(**{"optim.lr": 0.5}), workdir)
        with pytest.raises(ConfigError, match=r"^config\.train\.steps=5 is below"):
            train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 5}), workdir)

    wider = tiny.tiny_config(**{"model.width": 32, "train.steps": 20})
    with pytest.raises(CheckpointMismatchError, match=r"does not match the model"):
        train.train_and_evaluate(wider, workdir, resume_changed=True)
    assert (tmp_path / "config.json").read_text() == trained
    assert not (tmp_path / "config_until_step_10.json").exists()

    # Two resumes with changes from step 10, the first stopped before it saved a step:
    # the record of what trained up to step 10 stays the run's first config, and the
    # second's previous config (which trained nothing) is kept beside it, not over it.
    monkeypatch.setattr(train, "_loop", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        train.train_and_evaluate(tiny.tiny_config(**{"optim.lr": 0.5}), workdir,
                                 resume_changed=True)
    monkeypatch.undo()
    summary = train.train_and_evaluate(tiny.tiny_config(**{"optim.lr": 0.2, "train.steps": 12}),
                                       workdir, resume_changed=True)
    assert summary["step"] == 12
    assert (tmp_path / "config_until_step_10.json").read_text() == trained
    assert json.loads((tmp_path / "config_until_step_10.1.json").read_text())["optim"]["lr"] == 0.5
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 0.2


def _lrs(workdir, steps):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"train"' in line]
    return {r["step"]: r["lr"] for r in records if r["step"] in steps}


def test_the_advice_to_keep_the_schedule_of_an_extended_run_works_as_printed(tmp_path, capsys):
    """Extending a run whose schedule is train.steps long printed "--config.optim.decay_steps=
    <old steps> keeps the old one", and that flag then stopped the run (optim.decay_steps:
    0 -> 10, pass --resume_changed). Given with the extension it is no change (the same
    schedule); after a resume on the new schedule the advice names the flag it needs."""
    import numpy as np
    from attention_jax.optimizer import make_optimizer
    workdir, other = str(tmp_path / "a"), str(tmp_path / "b")
    for w in (workdir, other):  # two finished 10-step runs, schedule = train.steps
        train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 0}), w)
    capsys.readouterr()
    old_schedule = make_optimizer(tiny.tiny_config().optim, 10)[1]

    # Extended with the old length beside the new train.steps: it resumes, no flag, and
    # steps 11-15 follow the 10-step schedule (its end value).
    train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 10, "train.steps": 15}),
                             other)
    out = capsys.readouterr().out
    assert ("resuming step 10 with config changes: optim.decay_steps: 0 -> 10, train.steps: "
            "10 -> 15\n") in out
    np.testing.assert_allclose(_lrs(other, {15})[15], float(old_schedule(15)), rtol=1e-6)

    # Extended without it: the schedule is stretched, and the note's advice, followed as
    # printed, resumes the run and brings the old schedule back.
    train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 0, "train.steps": 15}),
                             workdir)
    out = capsys.readouterr().out
    advice = re.search(r"the learning-rate schedule now spans 15 steps, not 10; to keep the "
                       r"old one, stop this run and run it again with (--\S+ --\S+),", out)
    assert advice, out
    assert advice.group(1) == "--config.optim.decay_steps=10 --resume_changed"
    assert _lrs(workdir, {15})[15] != _lrs(other, {15})[15]  # the 15-step schedule's
    summary = train.train_and_evaluate(
        tiny.tiny_config(**{"optim.decay_steps": 10, "train.steps": 15}), workdir,
        resume_changed=True)
    assert summary["step"] == 15
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["optim"]["decay_steps"] == 10
    # From here on the run is on the old schedule: extending keeps it without a flag.
    train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 10, "train.steps": 20}),
                             workdir)
    np.testing.assert_allclose(_lrs(workdir, {20})[20], float(old_schedule(20)), rtol=1e-6)
    # A decay_steps that does change the schedule still stops.
    with pytest.raises(ConfigError, match=r"optim\.decay_steps: 10 -> 30"):
        train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 30,
                                                     "train.steps": 20}), workdir)
    # A reader may spell the schedule either way too: the same schedule, the same model.
    reader = tiny.tiny_config(**{"optim.decay_steps": 0, "train.steps": 10})
    train.train_and_evaluate(tiny.tiny_config(**{"optim.decay_steps": 0}), str(tmp_path / "c"))
    reader.optim.decay_steps = 10
    assert workdir_lib.check_reader_config(reader, str(tmp_path / "c")) == {
        "optim.decay_steps": (0, 10)}


def test_no_checkpoint_means_nothing_to_compare(tmp_path):
    """A config.json without a checkpoint (a run killed before its first save) is simply
    replaced: there is no run to resume."""
    with open(tmp_path / "config.json", "w") as f:
        f.write(tiny.tiny_config(**{"optim.lr": 0.5}).to_json_best_effort())
    workdir_lib.check_config_change(tiny.tiny_config(), str(tmp_path), None, resume_changed=False)
    assert workdir_lib.config_changes(tiny.tiny_config(), str(tmp_path)) == {"optim.lr": (0.5, 0.01)}


def test_the_config_check_reads_and_only_keep_replaced_config_moves_it_aside(tmp_path):
    """Every process of a run compares with config.json; the check once moved it aside
    too (process 0), before the others had read it (test_multihost shows the race)."""
    workdir = str(tmp_path)
    workdir_lib.write_config(workdir, tiny.tiny_config())
    trained = (tmp_path / "config.json").read_text()
    changed = tiny.tiny_config(**{"optim.lr": 0.5})
    note = workdir_lib.check_config_change(changed, workdir, 10, resume_changed=True)
    assert note == "with config changes: optim.lr: 0.01 -> 0.5"
    assert os.listdir(workdir) == ["config.json"]
    kept = workdir_lib.keep_replaced_config(changed, workdir, 10)
    assert kept == f"{workdir}/config_until_step_10.json"
    assert (tmp_path / "config_until_step_10.json").read_text() == trained
    assert not (tmp_path / "config.json").exists()
    # Only a resume with training-relevant changes keeps one.
    workdir_lib.write_config(workdir, changed)
    extended = tiny.tiny_config(**{"optim.lr": 0.5, "train.steps": 20})
    assert workdir_lib.keep_replaced_config(extended, workdir, 10) is None
    assert workdir_lib.keep_replaced_config(tiny.tiny_config(), workdir, None) is None
    assert (tmp_path / "config.json").exists()


def test_an_eval_the_task_cannot_weight_stops_before_training(tmp_path, capsys):
    # The tiny task's eval split holds 256 sequences and its loss ignores the weights that
    # mask the padding of a partial batch: found by tracing the loss before any step, not
    # at the first evaluation after the training before it.
    config = tiny.tiny_config(**{"eval.every": 0, "eval.batch_size": 512})
    with pytest.raises(ConfigError) as e:
        train.train_and_evaluate(config, str(tmp_path))
    assert str(e.value).startswith("task 'tiny': its loss ignores batch['example_weight'] (0 on "
                                   "the rows that pad the last eval batch: 256 examples padded "
                                   "to config.eval.batch_size=512)")
    assert not os.path.exists(tmp_path / "metrics.jsonl")
    # Full batches only (eval.steps within the split): nothing to weight, nothing refused.
    full = tiny.tiny_config(**{"eval.batch_size": 100, "eval.steps": 2})
    steps.check_eval_split(tiny.make_tiny_task(full), full)
    assert "note:" not in capsys.readouterr().err
    # More batches asked for than the split holds (two full ones): said, not silently fewer.
    more = tiny.tiny_config(**{"eval.batch_size": 128, "eval.steps": 3})
    steps.check_eval_split(tiny.make_tiny_task(more), more)
    assert capsys.readouterr().err == (
        "note: config.eval.steps=3 batches of config.eval.batch_size=128 ask for 384 "
        "examples, and the eval split holds 256: each evaluation reads all 256\n")


def test_a_run_saved_before_a_key_existed_resumes_with_that_keys_old_value(tmp_path):
    """configs/gpt.py gained data.packing after runs were saved without it: such a
    run trained with "documents", so resuming it with that value is no change, and with
    "stream" is one."""
    from helpers import load
    config = load("gpt").get_config()
    saved = json.loads(config.to_json_best_effort())
    del saved["data"]["packing"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    assert workdir_lib.config_changes(config, str(tmp_path)) == {}
    config.data.packing = "stream"
    assert workdir_lib.config_changes(config, str(tmp_path)) == {"data.packing": ("documents", "stream")}
    # model.norm_kernel came later still: absent, it was "auto"; changing it is resume-safe
    # (it picks kernels, not what a step computes), so such a run resumes with a note.
    del saved["model"]["norm_kernel"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    config.data.packing, config.model.norm_kernel = "documents", "auto"
    assert workdir_lib.config_changes(config, str(tmp_path)) == {}
    config.model.norm_kernel = "xla"
    note = workdir_lib.check_config_change(config, str(tmp_path), 10, resume_changed=False)
    assert "model.norm_kernel" in note


@pytest.mark.parametrize("spec,key,value,source", [
    ("gpt", "data.files", "notes/*.md", "files"),
    ("vit", "data.root", "pets/", "image_folder"),
    # (a dataset's rows are packed in memory: no token cache)
    ("gpt", "data.cache_dir", "/fast/cache", "files"),
])
def test_a_sources_key_under_another_source_is_refused(spec, key, value, source, tmp_path):
    """--config.data.files (or .root) without data.name set to the source that reads it
    would train on the default dataset silently: refused, naming the key and the fix."""
    config = config_lib.load(spec, [f"{key}={value}"])
    with pytest.raises(ConfigError, match=rf"config.{key}='{re.escape(value)}' is read only with "
                                          rf"config.data.name='{source}'.*--config.data.name="
                                          rf"{source}"):
        tasks.TASKS[config.task](config, str(tmp_path))


@pytest.mark.parametrize("spec", ["gpt", "bert_mlm"])
def test_rows_longer_than_the_position_table_are_refused(spec, tmp_path):
    """A learned position table of max_len rows reads no longer row: one error naming both
    keys, before any data is prepared (BERT's used to be a traceback from its model)."""
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 20)
    config = config_lib.load(spec, ["data.name=files", f"data.files={tmp_path}/a.txt",
                                    "data.seq_len=128", "model.max_len=64"])
    with pytest.raises(ConfigError, match=r"^config\.data\.seq_len=128 exceeds "
                                          r"config\.model\.max_len=64; valid: seq_len <= 64$"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("overrides,message", [
    (["data.target=es"], r"config\.data\.target='es' is not a language of "
                         r"'number_translation/small'; valid: \['de', 'en', 'fr'\]"),
    (["data.target_len=18"], r"config\.data\.target_len=18: the longest target \('fr'\) of "
                             r"'number_translation/small' has 20 tokens with its end token; "
                             r"valid: target_len >= 20"),
    # (a copy task, trained unsaid; a user's files already refused it)
    (["data.source=fr"], r"config\.data\.source and config\.data\.target are both 'fr'; valid: "
                         r"two different languages of 'number_translation/small': "
                         r"\['de', 'en', 'fr'\]"),
])
def test_a_translation_s_languages_and_lengths_are_checked_at_setup(overrides, message, tmp_path):
    """A language the records lack was a KeyError; an example longer than its length a
    ValueError at the batch holding it, steps into training, with nothing saved."""
    config = config_lib.load("encdec", overrides)
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        tasks.TASKS[config.task](config, str(tmp_path))


def test_a_translation_run_translates_its_sample_prompts(tmp_path):
    """--mode=sample on a translation run said only "valid: ['gpt']": its samples are now
    greedy translations of eval.sample_prompts, whose lengths are checked at setup."""
    import flax.linen as nn
    import jax
    config = config_lib.load("encdec", ["model.d_model=16", "model.num_heads=2",
                                        "model.mlp_dim=16", "eval.sample_prompts=('five', "
                                        "'twenty one', 'six')"])
    task = tasks.TASKS[config.task](config, str(tmp_path))
    params = nn.meta.unbox(task.init(jax.random.PRNGKey(0)))
    texts = task.sample(params, jax.random.PRNGKey(0))
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    # The first row alone gives the same translation: the padding rows change nothing.
    config.eval.sample_prompts = ("five",)
    alone = tasks.TASKS[config.task](config, str(tmp_path)).sample(params, jax.random.PRNGKey(0))
    assert alone == texts[:1]
    config.eval.sample_prompts = ("twenty one " * 20,)
    with pytest.raises(ConfigError, match=r"^config\.eval\.sample_prompts: 'twenty one twenty "
                                          r"one .* is \d+ tokens; valid: source sentences of "
                                          r"1\.\.32 tokens \(data\.source_len\)"):
        tasks.TASKS[config.task](config, str(tmp_path))


@pytest.mark.parametrize("init_from,message", [
    ("{tmp}/nothing", r"config\.train\.init_from='{tmp}/nothing': no committed checkpoint in "),
    ("hf:{tmp}/nothing", r"config\.train\.init_from='hf:{tmp}/nothing': '{tmp}/nothing' is not "
                         r"a directory"),
])
def test_a_warm_start_from_nothing_names_the_key(init_from, message, tmp_path):
    init_from, message = (s.replace("{tmp}", str(tmp_path)) for s in (init_from, message))
    with pytest.raises(ConfigError, match=rf"^{message}"):
        train.warm_start_params(init_from, {"w": None})


@pytest.mark.parametrize("prefix", ["", "hf:"])
def test_a_run_warm_started_from_a_path_not_there_stops_before_its_workdir_is_written(
        prefix, tmp_path):
    """init_from naming nothing was found after the task built its data and after the
    workdir got its config.json: a run that never trained."""
    config = tiny.tiny_config(**{"train.init_from": f"{prefix}{tmp_path}/nowhere"})
    with pytest.raises(ConfigError, match=rf"^config\.train\.init_from='{prefix}{tmp_path}/"
                                          rf"nowhere': '{tmp_path}/nowhere' does not exist; "
                                          rf"valid: a run's workdir or checkpoints folder"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_warm_start_from_a_model_dir_the_conversion_does_not_take_names_the_key(tmp_path):
    """A T5 dir (or a GPT-2 of an unsupported activation) given as init_from=hf:: a
    30-line traceback ending in the conversion's ValueError; now the config's one line."""
    import json

    import numpy as np
    from safetensors.numpy import save_file
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    save_file({"shared.weight": np.zeros((4, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"^config\.train\.init_from='hf:{tmp_path}': "
                                          rf"config\.json model_type='t5' is not supported; "
                                          rf"valid: \['bert', 'gpt2', 'vit'\]$"):
        train.warm_start_params(f"hf:{tmp_path}", {"w": None})


def test_a_split_without_text_is_refused(tmp_path):
    """Empty files (or records all skipped) gave a split of end-of-text tokens only: the
    run trained on nothing, or evaluated to NaN, and exited 0."""
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 20)
    (tmp_path / "empty.txt").write_text("")
    base = ["data.name=files", "data.seq_len=16", f"data.cache_dir={tmp_path}/cache"]
    config = config_lib.load("gpt", [*base, f"data.files={tmp_path}/t.txt",
                                     f"data.eval_files={tmp_path}/empty.txt"])
    with pytest.raises(ConfigError, match=r"^config\.data\.eval_files: the validation split "
                                          r"holds no text \(its 1 document is empty, or every "
                                          r"record was skipped\); valid: documents with text$"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))
    config = config_lib.load("gpt", [*base, f"data.files={tmp_path}/empty.txt",
                                     f"data.eval_files={tmp_path}/t.txt"])
    with pytest.raises(ConfigError, match=r"^config\.data\.files: the train split holds no text"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


def test_resuming_on_changed_data_stops_unless_asked(tmp_path, capsys):
    """Data that grew since the checkpoint cannot continue the saved order: one error (it
    was a ValueError traceback, --resume_changed or not), and with resume_changed the new
    order starts at the same point in epochs, said in a note."""
    from attention_jax import checkpoint
    from attention_jax.data import loaders
    workdir = str(tmp_path)
    train.train_and_evaluate(tiny.tiny_config(), workdir)  # 10 steps of 16: row 160 of 4096
    config = tiny.tiny_config(**{"train.steps": 20})
    grown = tiny.make_tiny_task(config)
    grown.train_source = tiny.SyntheticSequences(5000)
    capsys.readouterr()
    with pytest.raises(loaders.DataChangedError) as e:
        train.train_and_evaluate(config, workdir, task=grown)
    # Refused before the arrays were read and config.json rewritten: the error once came
    # after "resumed from ... at step 10", as if the run had gone on.
    assert "resumed from" not in capsys.readouterr().out
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 10
    assert str(e.value).startswith("the training data changed since the checkpoint: its loader "
                                   "read 4096 rows in the order of seed 0, the data now makes "
                                   "5000 (seed 0);")
    assert "pass --resume_changed" in str(e.value)
    summary = train.train_and_evaluate(config, workdir, task=grown, resume_changed=True)
    assert summary["step"] == 20
    assert ("note: the training data changed since the checkpoint (4096 rows, seed 0 -> 5000, "
            "seed 0): its new order starts at epoch 0.039") in capsys.readouterr().out
    ck = checkpoint.Checkpointer(f"{workdir}/checkpoints", read_only=True)
    assert ck.data_state(20) == {"next_index": round(160 * 5000 / 4096) + 160, "seed": 0,
                                 "num_records": 5000, "source": "", "order": 1}
    ck.close()


def test_resuming_on_other_records_of_the_same_count_stops_unless_asked(tmp_path, capsys):
    """An edited corpus of as many rows (its token cache rebuilt) resumed in silence:
    the loader's saved count applied to other records. Its identity now refuses it."""
    from attention_jax import checkpoint
    from attention_jax.data import loaders
    workdir = str(tmp_path)
    config = tiny.tiny_config()
    first = tiny.make_tiny_task(config)
    first.train_source = tiny.SyntheticSequences(4096)
    first.train_source.fingerprint = "tokens-a"
    train.train_and_evaluate(config, workdir, task=first)
    config = tiny.tiny_config(**{"train.steps": 20})
    edited = tiny.make_tiny_task(config)
    edited.train_source = tiny.SyntheticSequences(4096, offset=7)
    edited.train_source.fingerprint = "tokens-b"
    with pytest.raises(loaders.DataChangedError, match=r"its loader read 4096 rows in the order "
                                                       r"of seed 0, the data now makes as many, "
                                                       r"but other ones \(its tokens differ\)"):
        train.train_and_evaluate(config, workdir, task=edited)
    summary = train.train_and_evaluate(config, workdir, task=edited, resume_changed=True)
    assert summary["step"] == 20
    assert ("note: the training data changed since the checkpoint (4096 rows, seed 0 -> as "
            "many, other tokens): its new order starts at epoch") in capsys.readouterr().out
    ck = checkpoint.Checkpointer(f"{workdir}/checkpoints", read_only=True)
    assert ck.data_state(20)["source"] == "tokens-b"
    ck.close()


def test_config_json_holds_local_paths_absolute(tmp_path, monkeypatch):
    """Relative paths were stored as given, so --mode=eval from another directory read
    other files (or none): config.json holds them absolute, and a config given from
    another directory compares as the other data it names."""
    (tmp_path / "run").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    config = config_lib.load("gpt", ["data.name=files", "data.files=deep/*.md,~/x/*.txt",
                                     "data.tokenizer=tok/tokenizer.json",
                                     "train.init_from=hf:models/gpt2"])
    run = str(tmp_path / "run")
    workdir_lib.write_config(run, config)
    with open(tmp_path / "run" / "config.json") as f:
        stored = json.load(f)
    home = os.path.expanduser("~")
    assert stored["data"]["files"] == f"{tmp_path}/deep/*.md,{home}/x/*.txt"
    assert stored["data"]["tokenizer"] == f"{tmp_path}/tok/tokenizer.json"
    assert stored["train"]["init_from"] == f"hf:{tmp_path}/models/gpt2"
    assert stored["data"]["cache_dir"] == "" and stored["optim"]["lr"] == config.optim.lr
    assert workdir_lib.config_changes(config, run) == {}  # from the same directory
    kind = config_lib.load("gpt", ["data.tokenizer=bpe"])
    assert workdir_lib.absolute_paths(config_lib.flat(kind))["data.tokenizer"] == "bpe"
    monkeypatch.chdir(tmp_path / "other")
    assert set(workdir_lib.config_changes(config, run)) == {"data.files", "data.tokenizer",
                                                            "train.init_from"}


def test_a_config_file_that_does_not_parse_says_where(tmp_path):
    """A syntax error in one's own --config=mine.py was a traceback through our loader."""
    mine = tmp_path / "mine.py"
    mine.write_text("def get_config(arg):\n    return dict(a=1\n")
    with pytest.raises(ConfigError, match=rf"^--config={re.escape(str(mine))}: line 2: "):
        config_lib.load(str(mine))


def test_a_config_file_s_get_config_may_take_no_argument(tmp_path):
    """def get_config(): (ml_collections' plainest form) was TypeError's traceback."""
    mine = tmp_path / "plain.py"
    mine.write_text("from attention_jax.configs import gpt\n"
                    "def get_config():\n    return gpt.get_config()\n")
    assert config_lib.load(str(mine)).task == "gpt"
    with pytest.raises(ConfigError, match=rf"^--config={re.escape(str(mine))}:small: .*"
                                          rf"get_config\(\) takes no argument; valid: "):
        config_lib.load(f"{mine}:small")


def test_a_config_file_s_mistakes_in_get_config_are_one_line(tmp_path):
    """get_config raising was a traceback through absl and our loader; one returning a
    dict failed later on a missing key; one that never reads its argument took :ARG and
    ignored it."""
    mine = tmp_path / "mine.py"
    mine.write_text("def get_config(arg=None):\n    rate = 1 / 0\n    return rate\n")
    with pytest.raises(ConfigError, match=rf"^--config={re.escape(str(mine))}: get_config "
                                          rf"raised ZeroDivisionError: division by zero at "
                                          rf"line 2: rate = 1 / 0$") as e:
        config_lib.load(str(mine))
    assert isinstance(e.value.__cause__, ZeroDivisionError)  # the rest, for a debugger
    mine.write_text("import ml_collections\nfrom attention_jax.configs import gpt\n"
                    "def get_config(arg=None):\n"
                    "    return ml_collections.FrozenConfigDict(gpt.get_config())\n")
    with pytest.raises(ConfigError, match=r"--config.train.steps=3: the config is frozen"):
        config_lib.load(str(mine), ["train.steps=3"])
    mine.write_text("def get_config(arg=None):\n    return {'task': 'gpt'}\n")
    with pytest.raises(ConfigError, match=r"get_config returned a dict; valid: an "
                                          r"ml_collections.ConfigDict"):
        config_lib.load(str(mine))
    mine.write_text("from attention_jax.configs import gpt\n"
                    "def get_config(arg=None):\n    return gpt.get_config()\n")
    assert config_lib.load(str(mine)).task == "gpt"
    with pytest.raises(ConfigError, match=rf"^--config={re.escape(str(mine))}:layers=4: "
                                          rf".*get_config never reads its argument, so "
                                          rf":layers=4 would change nothing"):
        config_lib.load(f"{mine}:layers=4")
    # Read through locals(), or by a method (after self): read, not refused.
    mine.write_text("from attention_jax.configs import gpt\n"
                    "def get_config(arg=None):\n    return gpt.get_config(locals()['arg'])\n")
    assert config_lib.load(f"{mine}:variant=gpt2").model.variant == "gpt2"
    mine.write_text("from attention_jax.configs import gpt\n"
                    "class Maker:\n    def make(self, arg=None):\n"
                    "        return gpt.get_config(arg)\n"
                    "get_config = Maker().make\n")
    assert config_lib.load(f"{mine}:variant=gpt2").model.variant == "gpt2"


def test_config_files_of_one_name_in_two_folders_are_two_modules(tmp_path):
    """Two folders' mine.py shared one module name (inspect read the other's source); a
    file edited back to an earlier text is that text's module again in sys.modules."""
    import sys
    for folder, lr in (("a", 0.1), ("b", 0.2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "mine.py").write_text(
            "from attention_jax.configs import gpt\n"
            f"def get_config(arg=None):\n    c = gpt.get_config()\n    c.optim.lr = {lr}\n"
            "    return c\n")
    a, b = (config_lib.config_module(str(tmp_path / f / "mine.py")) for f in "ab")
    assert a.__name__ != b.__name__ and sys.modules[a.__name__] is a
    assert (config_lib.load(str(tmp_path / "a" / "mine.py")).optim.lr,
            config_lib.load(str(tmp_path / "b" / "mine.py")).optim.lr) == (0.1, 0.2)
    file = tmp_path / "a" / "mine.py"
    text = file.read_text()
    file.write_text(text.replace("0.1", "0.3"))
    edited = config_lib.config_module(str(file))
    assert edited is not a and sys.modules[a.__name__] is edited
    file.write_text(text)  # back to the first text: the module run from it
    again = config_lib.config_module(str(file))
    assert sys.modules[again.__name__] is again and config_lib.load(str(file)).optim.lr == 0.1


def test_overrides_as_one_string_and_whole_numbers_in_e_notation():
    """load("gpt", "train.steps=5") took the string's characters as overrides ('t' must
    be group.key=value); --config.train.steps=1e3 was "must be an int"."""
    config = config_lib.load("gpt", "train.steps=1e3")
    assert config.train.steps == 1000 and isinstance(config.train.steps, int)
    with pytest.raises(ConfigError, match=r"config.train.steps='1.5e0' must be an int"):
        config_lib.load("gpt", ["train.steps=1.5e0"])
    # A key unset until given (None) takes a bool key's words: 'false' was the string,
    # which the model read as true.
    config = config_lib.load("gpt", ["model.tie_embeddings=false", "model.use_bias=TRUE"])
    assert (config.model.tie_embeddings, config.model.use_bias) == (False, True)


def test_a_bpe_smaller_than_its_bytes_is_refused(tmp_path):
    """data.vocab_size=5 trained a 260-token BPE without a word: the least it can be."""
    from attention_jax.tasks import base
    import ml_collections
    options = ml_collections.ConfigDict({"tokenizer": "bpe", "vocab_size": 5})
    with pytest.raises(ConfigError, match=r"^config\.data\.vocab_size=5: a byte-level BPE holds "
                                          r"its 256 bytes and 4 special tokens at least; valid: "
                                          r"vocab_size >= 260$"):
        base.run_tokenizer(options, str(tmp_path), lambda: ["the cat"])


def test_a_gpt_with_bert_s_wordpiece_vocabulary_is_refused_before_the_corpus(tmp_path):
    """It trained (BERT's 30,522 pieces, no token between documents), then sampling
    failed on the missing bos_id: an AttributeError after the whole run."""
    config = config_lib.load("gpt", ["data.tokenizer=wordpiece", "data.name=files",
                                     f"data.files={tmp_path}/nothing_here/*.txt"])
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer='wordpiece' is BERT's "
                                          r"vocabulary .* valid: \['char', 'byte', 'bpe'\] or a "
                                          r"tokenizer\.json"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))
    from attention_jax.tasks import text  # the prepare tool: before tokenizing the corpus
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer='wordpiece' is BERT's"):
        text.prepare_from_config(config)


def test_a_top_k_past_the_vocabulary_keeps_every_token_and_says_so(tmp_path, capsys):
    """It trained, saved, then failed at sampling with a traceback; then it was refused
    before training, the default 40 with it on a small alphabet. A top-k of the whole
    vocabulary or more keeps every token (nanoGPT's min(k, V)), said before training."""
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 20)
    (tmp_path / "u.txt").write_text("the dog sat on the log. " * 20)
    config = config_lib.load("gpt", ["data.name=files", f"data.files={tmp_path}/*.txt",
                                     f"data.cache_dir={tmp_path}/cache", "data.tokenizer=char",
                                     "model.num_layers=1", "model.d_model=32",
                                     "model.num_heads=2", "eval.sample_prompts=('the ',)",
                                     "eval.sample_tokens=8"])
    task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    assert ("note: config.eval.sample_top_k=40 keeps all of the tokenizer's 15 tokens: "
            "samples come from the whole distribution" in capsys.readouterr().err)
    params = nn.meta.unbox(task.init(jax.random.PRNGKey(0)))
    [text] = task.sample(params, jax.random.PRNGKey(1))
    assert text.startswith("the ") and len(text) > len("the ")
    # Without prompts nothing is sampled: nothing said.
    config.eval.sample_prompts = ()
    tasks.TASKS[config.task](config, str(tmp_path / "run2"))
    assert "sample_top_k" not in capsys.readouterr().err


def test_sampling_takes_top_p_from_the_config(tmp_path):
    """--config.eval.sample_top_p (the README's top-p, which only the Python API had): a
    nucleus this small keeps each step's most likely token alone, so sampling at
    temperature 1 gives the greedy continuation; top_p 1 keeps every token."""
    import flax.linen as nn
    import jax
    for name in "abcd":  # documents, a held-out one among them
        (tmp_path / f"{name}.txt").write_text(f"the cat {name} sat on the mat. " * 20)

    def samples(**keys):
        config = config_lib.load("gpt", ["data.name=files", f"data.files={tmp_path}/*.txt",
                                         f"data.cache_dir={tmp_path}/cache", "data.tokenizer=byte",
                                         "model.num_layers=1", "model.d_model=32",
                                         "eval.sample_tokens=12", "eval.sample_top_k=0",
                                         *(f"eval.{k}={v}" for k, v in keys.items())])
        task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
        params = nn.meta.unbox(task.init(jax.random.PRNGKey(0)))
        return task.sample(params, jax.random.PRNGKey(1))
    greedy = samples(sample_temperature=0.0)
    assert samples(sample_temperature=1.0, sample_top_p=1e-6) == greedy
    assert samples(sample_temperature=1.0, sample_top_p=1.0) != greedy  # an untrained model


def test_a_reader_s_task_prepares_only_the_split_it_reads(tmp_path, capsys):
    """--mode=eval with eval_files tokenized the whole training corpus first."""
    from attention_jax.tasks import base
    (tmp_path / "train.txt").write_text("the cat sat on the mat. " * 40)
    (tmp_path / "eval.txt").write_text("a dog ran over the hill. " * 10)
    config = config_lib.load("gpt", ["data.name=files", f"data.files={tmp_path}/train.txt",
                                     f"data.eval_files={tmp_path}/eval.txt", "data.seq_len=16",
                                     f"data.cache_dir={tmp_path}/cache", "data.tokenizer=byte"])
    with base.data_on_demand():
        task = tasks.TASKS[config.task](config, str(tmp_path / "run"))
    assert len(task.eval_source) > 0
    assert len(os.listdir(tmp_path / "cache")) == 1  # the eval split's cache alone
    assert len(task.train_source) > len(task.eval_source)  # built when first used
    assert len(os.listdir(tmp_path / "cache")) == 2


def test_a_remote_token_cache_names_its_config_key(tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 20)
    config = config_lib.load("gpt", ["data.name=files", f"data.files={tmp_path}/t.txt",
                                     "data.cache_dir=gs://bucket/cache"])
    with pytest.raises(ConfigError, match=r"^config\.data\.cache_dir is 'gs://bucket/cache': "
                                          r"the token cache must be on a local"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))
    monkeypatch.setenv("TFDS_DATA_DIR", "gs://bucket/tfds")  # the cache under it, unsaid
    config = config_lib.load("gpt", ["data.name=files", f"data.files={tmp_path}/t.txt"])
    with pytest.raises(ConfigError, match=r"^\$TFDS_DATA_DIR, under which the cache goes "
                                          r"\(config\.data\.cache_dir unset\), is "
                                          r"'gs://bucket/tfds/token_cache'"):
        tasks.TASKS[config.task](config, str(tmp_path / "run"))


def test_a_tuple_key_s_example_shows_elements():
    """After --config.eval.sample_prompts=(), the example was "()", which shows no
    element's form."""
    config = config_lib.load("gpt", ["eval.sample_prompts=()"])
    with pytest.raises(ConfigError, match=re.escape(
            "config.eval.sample_prompts='the cat' must be a Python tuple, e.g. \"('a', 'b')\"")):
        config_lib.apply_overrides(config, ["eval.sample_prompts=the cat"])


def test_gpt_s_mlp_width_is_a_key_and_none_leaves_the_variant_s(tmp_path, capsys):
    """--config.model.mlp_dim was refused ("no key") though GPTConfig has the field; a key
    left None is not set, so the MoE variant keeps its own width; a run saved before the
    key existed resumes without a change listed."""
    from attention_jax.models import gpt
    width = lambda spec, *over: tasks.model_config(  # noqa: E731
        gpt.GPTConfig, config_lib.load(spec, over), vocab_size=256).mlp_dim
    assert width("gpt") is None  # 4D in the block
    assert width("gpt", "model.mlp_dim=256") == 256
    assert width("gpt:variant=gpt-tiny-moe") == width("gpt", "model.variant=gpt-tiny-moe") == 128
    # :variant= is the variant's shape (GPT-2 small trained as the 2-layer default, unsaid);
    # the default keeps this config's own small model.
    shape = lambda spec: (lambda c: (c.num_layers, c.d_model, c.num_heads))(  # noqa: E731
        tasks.model_config(gpt.GPTConfig, config_lib.load(spec), vocab_size=256))
    assert shape("gpt:variant=gpt2") == (12, 768, 12)
    assert shape("gpt:variant=gpt-tiny-rope") == (2, 64, 4)
    assert shape("gpt") == shape("gpt:variant=gpt-tiny") == (2, 128, 4)
    # The MoE variant's experts are keys too, checked with the config (were a layer's
    # ValueError traceback at the first step, and no key to set them by).
    moe = lambda *over: tasks.model_config(  # noqa: E731
        gpt.GPTConfig, config_lib.load("gpt:variant=gpt-tiny-moe", over), vocab_size=256)
    given = moe("model.num_experts=3", "model.top_k=1")
    assert (moe().num_experts, given.num_experts, given.top_k) == (4, 3, 1)
    for over, message in ((["model.top_k=5"], r"top_k=5; valid: 1\.\.4 \(num_experts=4\)"),
                          (["model.num_experts=0"], r"num_experts must be a positive "
                                                    r"integer; got 0"),
                          (["model.capacity_factor=0"], r"capacity_factor=0; valid: a number "
                                                        r"> 0")):
        with pytest.raises(ConfigError, match=rf"^config.model: {message}"):
            moe(*over)
    # On a dense MLP the experts' keys were ignored, unsaid.
    dense = tasks.model_config(gpt.GPTConfig, config_lib.load("gpt", ["model.num_experts=8"]),
                               vocab_size=256)
    assert dense.mlp == "mlp"
    assert capsys.readouterr().err == ("note: config.model.num_experts is read only with "
                                       "config.model.mlp='moe' (now 'mlp'): this dense MLP "
                                       "has no experts\n")
    tasks.model_config(gpt.GPTConfig, config_lib.load("gpt", ["model.router_z_loss_weight=0.001",
                                                              "model.moe_loss_weight=0.1"]),
                       vocab_size=256)
    assert capsys.readouterr().err == ("note: config.model.moe_loss_weight, router_z_loss_weight "
                                       "are read only with config.model.mlp='moe' (now 'mlp'): "
                                       "this dense MLP has no experts\n")
    config = config_lib.load("gpt")
    old = json.loads(config.to_json_best_effort())
    del old["model"]["mlp_dim"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert "model.mlp_dim" not in workdir_lib.config_changes(config, str(tmp_path))


def test_a_workdir_given_with_a_tilde_is_one_folder(tmp_path, monkeypatch):
    """--workdir=~/run reaches the program as it is (a shell expands ~ only at a word's
    start): the checkpoints went to $HOME/run, everything else to ./~/run."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    train.train_and_evaluate(tiny.tiny_config(), "~/run")
    assert sorted(os.listdir(tmp_path / "home" / "run")) == [
        "checkpoints", "config.json", "lock.json", "metrics.jsonl", "tensorboard"]
    assert not os.path.exists(tmp_path / "~")


def test_a_misspelt_vit_variant_is_named(tmp_path, data_dir):
    """It fell back to the class's own patch size (16), and the error was about 8-pixel
    images not dividing into it."""
    config = config_lib.load("vit:variant=vit-tiny/3", [f"data.data_dir={data_dir}"])
    with pytest.raises(ConfigError, match=r"^config\.model\.variant='vit-tiny/3' is unknown; "
                                          r"valid: \[.*\] \(did you mean 'vit-tiny/"):
        tasks.TASKS[config.task](config, str(tmp_path))


def test_vit_hf_and_variant_together_are_refused(tmp_path):
    """vit:hf=DIR,variant=vit-ti/16 trained the checkpoint's shape, the variant unsaid."""
    with pytest.raises(ConfigError, match=r":hf='.*' and :variant='vit-tiny/4': hf= trains the "
                                          r"checkpoint's own architecture; give one of the two"):
        config_lib.load(f"vit:hf={tmp_path},variant=vit-tiny/4")
    assert config_lib.load("vit").model.variant == "vit-tiny/2"  # the default as before
    import transformers  # a BERT's dir: its fields were "not a field of ViTConfig"
    transformers.BertModel(transformers.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=64)).save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(ConfigError, match=r"hf='.*bert': it holds a BertModel; valid: a ViT "
                                          r"checkpoint"):
        config_lib.load(f"vit:hf={tmp_path / 'bert'}")


def test_multi_process_keys_are_checked_before_joining():
    """A coordinator without its port was an IndexError from inside JAX, a process id past
    the count a ValueError's traceback; the keys without mesh.distributed were ignored
    without a word (the run trained as one process)."""
    from attention_jax import sharding
    config = config_lib.load("gpt", ["mesh.distributed=true", "mesh.coordinator_address=127.0.0.1"])
    with pytest.raises(ConfigError, match=r"^config.mesh.coordinator_address='127.0.0.1'; "
                                          r"valid: host:port"):
        sharding.maybe_initialize_distributed(config.mesh)
    config = config_lib.load("gpt", ["mesh.distributed=true", "mesh.coordinator_address=h:1",
                                     "mesh.num_processes=2", "mesh.process_id=2"])
    with pytest.raises(ConfigError, match=r"^config.mesh.process_id=2; valid: 0\.\.\.1 "):
        sharding.maybe_initialize_distributed(config.mesh)
    config = config_lib.load("gpt", ["mesh.coordinator_address=h:1", "mesh.num_processes=2"])
    assert ("config.mesh.coordinator_address, mesh.num_processes set, but mesh.distributed="
            "False: ignored, this runs as one process") in config_lib.warnings(config)[0]
    assert config_lib.warnings(config_lib.load("gpt", ["train.steps=600"])) == []
    # mesh.cpu_collectives: a value JAX lacks was a traceback once joining; without
    # mesh.distributed it was ignored, unsaid
    config = config_lib.load("gpt", ["mesh.distributed=true", "mesh.cpu_collectives=foo"])
    with pytest.raises(ConfigError, match=r"^config.mesh.cpu_collectives='foo' is unknown; "
                                          r"valid: \['', 'gloo', 'mpi', 'megascale'\]"):
        config_lib.validate(config)
    assert ("config.mesh.cpu_collectives set, but mesh.distributed=False: ignored"
            ) in config_lib.warnings(config_lib.load("gpt", ["mesh.cpu_collectives=gloo"]))[0]
    # the ring's chunk kernel without a ring
    assert config_lib.warnings(config_lib.load("gpt", ["model.ring_inner=pallas"])) == [
        "config.model.ring_inner='pallas' is the kernel of ring attention, which runs with "
        "mesh.sequence > 1; with mesh.sequence=1 it does nothing"]
    assert config_lib.warnings(config_lib.load("gpt", ["model.ring_inner=pallas",
                                                       "mesh.sequence=2"])) == []


def test_more_devices_than_there_are_is_one_config_error(tmp_path):
    """mesh.num_devices=16 on 8 devices trained on 8, unsaid, config.json saying 16."""
    with pytest.raises(ConfigError, match=r"^config.mesh.num_devices=16: this run has 8 "
                                          r"device\(s\); valid: 0 \(all\) or 1..8$"):
        train.setup(tiny.tiny_config(**{"mesh.num_devices": 16}), str(tmp_path))


def test_a_run_of_a_variant_from_before_its_sizes_followed_it_names_the_way_through(tmp_path):
    """gpt:variant=X trained the config's own 2-layer sizes until they followed the
    variant: such a run's config.json holds them, and resuming names the flags that keep
    them (--resume_changed would build the variant's larger model)."""
    old = config_lib.load("gpt:variant=gpt-tiny-rope")
    old.model.num_layers, old.model.d_model, old.model.num_heads = 2, 128, 4
    workdir_lib.write_config(str(tmp_path), old)
    with pytest.raises(ConfigError, match=r"To keep the run's model\.d_model, model\.num_heads, "
                                          r"model\.num_layers: --config\.model\.d_model=128 "
                                          r"--config\.model\.num_heads=4 "
                                          r"--config\.model\.num_layers=2\. To resume"):
        workdir_lib.check_config_change(config_lib.load("gpt:variant=gpt-tiny-rope"),
                                        str(tmp_path), 10, resume_changed=False)


def test_a_config_json_without_a_checkpoint_is_replaced_and_said(tmp_path, capsys):
    """A run killed before its first save, started again with another config: its
    config.json was replaced without a word (nothing to resume, so nothing to refuse)."""
    workdir = str(tmp_path / "w")
    os.makedirs(workdir)
    workdir_lib.write_config(workdir, tiny.tiny_config(**{"optim.lr": 0.02}))
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 2}), workdir)
    assert (f"note: {workdir}/config.json held another config (optim.lr: 0.02 -> 0.01) and no "
            f"checkpoint: this run starts from scratch and replaces it") in capsys.readouterr().err


def test_a_run_saved_before_a_key_existed_reads_and_takes_it(tmp_path):
    """A run whose config.json predates eval.sample_top_p: validating it failed with a
    KeyError (every reader, --mode=sample included), and --config.eval.sample_top_p=...
    was 'no such key'. It reads with the key at its default and takes the override."""
    stored = json.loads(tiny.tiny_config().to_json_best_effort())
    del stored["eval"]["sample_top_p"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    config = workdir_lib.read_config(str(tmp_path))
    assert config.eval.sample_top_p == 1.0
    config_lib.validate(config)
    config_lib.apply_overrides(config, ["eval.sample_top_p=0.5"])
    assert config.eval.sample_top_p == 0.5


def test_a_mesh_axis_the_devices_cannot_take_is_named_with_the_sizes_that_fit():
    """It named the -1 axis ('mesh.data=-1 cannot take the rest') and not the axis set."""
    with pytest.raises(ConfigError, match=r"^config.mesh: mesh.data=-1 cannot take the rest: "
                                          r"mesh.sequence=3 takes 3 devices, which do not "
                                          r"divide the 8; valid: sizes whose product divides "
                                          r"8 \(each one of \[1, 2, 4, 8\]\)$"):
        config_lib.validate(tiny.tiny_config(**{"mesh.data": -1, "mesh.sequence": 3}),
                            num_devices=8)


def test_a_parameter_the_mesh_cannot_split_is_one_config_error_naming_its_axis(tmp_path):
    """A width fsdp does not divide was a traceback with ten lines of arrays, naming no
    logical axis to map elsewhere."""
    config = tiny.tiny_config(**{"mesh.fsdp": 8, "mesh.data": 1, "mesh.num_devices": 8})
    config.model.width = 12
    with pytest.raises(ConfigError, match=r"^config.mesh: \d+ parameter\(s\) cannot be split "
                                          r"as the mesh \{'data': 1, 'fsdp': 8, .*\} asks: \[.*"
                                          r"dimension \d+ \(logical axis '\w+'\) is split over "
                                          r"mesh axes \('fsdp',\) of size 8.*; valid: model "
                                          r"sizes the mesh axes divide, other mesh.\* sizes, "
                                          r"or mesh.rules mapping '\w+'"):
        train.setup(config, str(tmp_path))


def test_splash_chunks_too_short_for_its_tiles_are_a_config_error():
    """It came at the first trace, after the workdir was made, without the config key."""
    from attention_jax.models import gpt
    cfg = gpt.GPTConfig.from_variant("gpt-tiny", ring_inner="splash")
    with pytest.raises(ConfigError, match=r"^config.model.ring_inner='splash' needs chunks of "
                                          r"data.seq_len / \(2 × mesh.sequence\) = 8 tokens to "
                                          r"be a multiple of 128 .*valid: seq_len a multiple of "
                                          r"512, or ring_inner 'auto' or 'blockwise'$"):
        config_lib.check_model_fits_mesh(cfg, {"sequence": 2}, seq_len=32)
    config_lib.check_model_fits_mesh(cfg, {"sequence": 2}, seq_len=512)  # chunks of 128


def test_keys_given_to_a_task_that_does_not_read_them_are_said(capsys):
    """eval.sample_* are read by the tasks that sample (gpt, translation), the LM loss's
    train.loss_* by the GPT alone: set for another (a classifier, a ViT), they did
    nothing, unsaid."""
    from attention_jax.tasks import base
    base.register("tiny_quiet", tiny.make_tiny_task)
    try:
        base.TASKS["tiny_quiet"](tiny.tiny_config(**{"eval.sample_prompts": ("x",),
                                                    "eval.sample_top_k": 5,
                                                    "train.loss_chunk_size": 64}), None)
        # Registered without reads=: it samples nothing, so the sampling keys do nothing;
        # its loss may be gpt.head_loss, which reads train.loss_*: not said of those.
        assert ("note: task 'tiny_quiet' does not read config.eval.sample_prompts (read by "
                "encdec, gpt, rnn_seq2seq); config.eval.sample_top_k (read by "
                "gpt): set here, they do nothing\n") in capsys.readouterr().err
        base.TASKS["tiny_quiet"](tiny.tiny_config(), None)  # the defaults: nothing to say
        assert "does not read" not in capsys.readouterr().err
        # A task whose sampling reads the prompts only (a translation's greedy decoding).
        base.register("tiny_greedy", tiny.make_tiny_task, reads=("eval.sample_prompts",))
        base.TASKS["tiny_greedy"](tiny.tiny_config(**{"eval.sample_prompts": ("x",),
                                                     "eval.sample_temperature": 0.0}), None)
        err = capsys.readouterr().err
        assert ("note: task 'tiny_greedy' does not read config.eval.sample_temperature (read "
                "by gpt)") in err and "sample_prompts" not in err
        assert base.unread_keys("encdec") == config_lib.TASK_KEYS[1:-1]  # not beam_size
        assert base.unread_keys("gpt") == config_lib.TRANSLATE_KEYS
        assert base.unread_keys("vit") == config_lib.TASK_KEYS
        assert base.unread_keys("tiny") == ()  # TASKS[name] = make: declared nothing
        with pytest.raises(ValueError, match=r"reads=\['train\.steps'\]; valid: keys of"):
            base.register("tiny_wrong", tiny.make_tiny_task, reads=("train.steps",))
    finally:
        del base.TASKS["tiny_quiet"]
        base.TASKS.pop("tiny_greedy", None)


def test_the_shipped_prompts_on_other_data_are_said(capsys):
    """A run on the user's files kept the shipped configs' prompts ('def ' for the stdlib
    corpus, 'twenty one' for number_translation), unsaid: its samples continued Python
    on a novel."""
    from attention_jax.tasks import base
    gpt = config_lib.load("gpt")
    base.note_shipped_prompts(gpt, "python_stdlib")
    assert capsys.readouterr().err == ""
    base.note_shipped_prompts(gpt, "files")
    assert ("note: config.eval.sample_prompts=('def ', 'import ', 'class ') are the prompts "
            "for the shipped 'python_stdlib' data, and this run reads data.name='files': give "
            "your own") in capsys.readouterr().err
    encdec = config_lib.load("encdec")
    base.note_shipped_prompts(encdec, "number_translation/small")
    assert capsys.readouterr().err == ""
    base.note_shipped_prompts(encdec, "files")
    assert "'number_translation' data" in capsys.readouterr().err
    config_lib.apply_overrides(gpt, ["eval.sample_prompts=('Once upon',)"])
    base.note_shipped_prompts(gpt, "files")
    assert capsys.readouterr().err == ""


def test_the_user_data_keys_given_for_a_dataset_are_refused_and_never_block_a_resume(tmp_path):
    """data.eval_fraction=1.0 with the stdlib corpus was accepted (out of range for
    files, read by nothing here), and then a resume without it stopped as 'trained with
    another config'."""
    from attention_jax.tasks import base
    config = config_lib.load("gpt", ["data.eval_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"^config\.data\.eval_fraction=0\.5 is read only with "
                                          r"config\.data\.name='files' \(now 'python_stdlib'\)"):
        base.check_source_keys(config.data, "files", ("files", "eval_files"))
    with tasks.data_on_demand():  # a reader of a run saved so: not stopped
        base.check_source_keys(config.data, "files", ("files", "eval_files"))
    image = config_lib.load("vit", ["data.max_bad_records=3"])
    with pytest.raises(ConfigError, match=r"^config\.data\.max_bad_records=3 is read only with "
                                          r"config\.data\.name='image_folder'"):
        base.check_source_keys(image.data, "image_folder", ("root", "eval_root"))
    # A run's config.json holding such a value resumes without it, unasked.
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    workdir_lib.refuse_config_change(config_lib.load("gpt"), str(tmp_path), 10)
    files = config_lib.load("gpt", ["data.name=files", "data.files=a.txt"])
    (tmp_path / "config.json").write_text(files.to_json_best_effort())
    with pytest.raises(ConfigError, match=r"data\.eval_fraction: 0\.05 -> 0\.5"):  # read there
        workdir_lib.refuse_config_change(
            config_lib.load("gpt", ["data.name=files", "data.files=a.txt",
                                    "data.eval_fraction=0.5"]), str(tmp_path), 10)


def test_sample_prompts_that_are_not_strings_are_a_config_error():
    # --config.eval.sample_prompts='(1, 2)' is a tuple, as the key's type asks, and was
    # taken: the task's tokenizer then failed on it with an AttributeError traceback.
    with pytest.raises(ConfigError, match=r"^config\.eval\.sample_prompts=\(1, 2\) holds 1 "
                                          r"\(int\); valid: a tuple of strings"):
        config_lib.validate(tiny.tiny_config(**{"eval.sample_prompts": (1, 2)}))
    config_lib.validate(tiny.tiny_config(**{"eval.sample_prompts": ()}))
    config_lib.validate(tiny.tiny_config(**{"eval.sample_prompts": ["def "]}))  # a config.json's


def test_a_batch_larger_than_the_train_split_is_a_config_error(tmp_path):
    """A few short texts packed into two rows, trained at train.batch_size=8, ran: every
    batch held the same two rows four times over, unsaid."""
    config = tiny.tiny_config(**{"train.batch_size": 16})
    task = tiny.make_tiny_task(config)
    task.train_source = tiny.SyntheticSequences(5)
    with pytest.raises(ConfigError, match=r"^config\.train\.batch_size=16 is more than the "
                                          r"train split's 5 examples: every batch would repeat "
                                          r"them; valid: config\.train\.batch_size <= 5"):
        train.setup(config, str(tmp_path / "run"), task=task)
    assert not (tmp_path / "run").exists()
    task.train_source = tiny.SyntheticSequences(16)  # exactly one batch: trains
    train.setup(config, str(tmp_path / "run"), task=task)
