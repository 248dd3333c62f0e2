"""runs.open_run on a workdir trained for one step, and main's modes that read a run
(eval, sample) through it."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from attention_jax import main, runs, tasks, train
from helpers import load, shrink
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError, UserError


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("gpt"))
    config = shrink(load("gpt").get_config(), data_dir)
    config.eval.sample_prompts = ("def ",)
    config.eval.sample_tokens = 4
    config.eval.batch_size = 8
    summary = train.train_and_evaluate(config, workdir)
    return config, workdir, summary


def test_open_run_restores_the_trained_params(gpt_run):
    config, workdir, summary = gpt_run
    run = runs.open_run(workdir, {"train.batch_size": 1})
    assert run.step == 1 and run.config.train.batch_size == 1
    assert run.config.mesh.num_devices == 1 and run.tokenizer is not None
    trained = summary["state"]["params"]
    for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_main_eval_and_sample_modes(gpt_run, capsys):
    config, workdir, _ = gpt_run
    metrics = main.evaluate_checkpoint(config, workdir)
    assert metrics["step"] == 1 and np.isfinite(metrics["loss"])
    # Its own file, not a second record in the training history.
    with open(os.path.join(workdir, "evals.jsonl")) as f:
        assert json.loads(f.readlines()[-1])["loss"] == metrics["loss"]
    assert all(r["split"] == "train" for r in workdir_lib.read_metrics(workdir))
    texts = main.sample_checkpoint(config, workdir)
    assert len(texts) == 1 and isinstance(texts[0], str)
    # More tokens than the position table holds: as many as it does, and said (it was a
    # shorter text without a word).
    long = config.copy_and_resolve_references()
    long.eval.sample_tokens = 10_000
    main.sample_checkpoint(long, workdir)
    assert (f"note: eval.sample_tokens=10000: {config.model.max_len - 4} tokens generated, "
            f"where the position table ends (model.max_len={config.model.max_len}, the "
            f"longest prompt 4 tokens)") in capsys.readouterr().err


def test_open_run_names_what_is_missing(tmp_path, gpt_run):
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        runs.open_run(str(tmp_path))
    config, workdir, _ = gpt_run
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    shutil.copy(os.path.join(workdir, "config.json"), untrained)
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*: train first"):
        runs.open_run(str(untrained))
    with pytest.raises(ValueError, match="overrides="):
        runs.open_run(workdir, {"data.seq_len": 8}, config=config)
    # An override that reshapes the parameters: one line naming it, the first array it
    # reshapes and the valid overrides (was the checkpoint's multi-line mismatch list).
    width = config.model.d_model
    with pytest.raises(ConfigError, match=rf"^the overrides model.d_model: {width} -> "
                                          rf"{2 * width} change the model the run trained, "
                                          rf"so its checkpoint does not restore \(shape "
                                          rf"differs: params/.* valid overrides: eval\.\*"):
        runs.open_run(workdir, {"model.d_model": 2 * width})
    # A nested dict merges into its group as the dotted key does (was: it replaced the
    # whole model config, whose defaults then did not restore).
    run = runs.open_run(workdir, {"eval": {"batch_size": 2}})
    assert run.config.eval.batch_size == 2 and run.config.model.d_model == width


def test_a_config_json_with_the_old_field_names_still_opens(tmp_path, gpt_run):
    """A workdir written before the rename (GPT's embed_dim, now d_model) keeps opening."""
    config, workdir, _ = gpt_run
    old = tmp_path / "old"
    shutil.copytree(workdir, old)
    with open(old / "config.json") as f:
        raw = json.load(f)
    raw["model"]["embed_dim"] = raw["model"].pop("d_model")
    with open(old / "config.json", "w") as f:
        json.dump(raw, f)
    run = runs.open_run(str(old))
    assert run.task.model.config.d_model == config.model.d_model and run.step == 1


def test_open_run_reads_a_run_of_several_processes_here(tmp_path, gpt_run):
    """A run trained as two processes over a hybrid mesh (mesh.dcn_data=2) opens in a
    notebook's one process, as load_config promises ("set to one device"): it stopped at
    "config.mesh.dcn_data=2 × mesh.dcn_fsdp=1 = 2 must equal the number of ... processes,
    1", a key the reader never gave (main's reading modes reset it, load_config did not)."""
    config, workdir, _ = gpt_run
    multi = tmp_path / "multi"
    shutil.copytree(workdir, multi)
    with open(multi / "config.json") as f:
        raw = json.load(f)
    raw["mesh"].update(distributed=True, num_processes=2, process_id=0, dcn_data=2)
    with open(multi / "config.json", "w") as f:
        json.dump(raw, f)
    assert runs.open_run(str(multi)).step == 1


def test_old_model_field_names_map_per_family():
    assert workdir_lib.rename_old_model_fields(
        "bert_mlm", {"max_positions": 64, "layer_norm_epsilon": 1e-12, "num_layers": 2}) == {
        "max_len": 64, "norm_epsilon": 1e-12, "num_layers": 2}
    assert workdir_lib.rename_old_model_fields("rnn_seq2seq", {"dropout": 0.1, "embed_dim": 8}) == {
        "dropout_rate": 0.1, "embed_dim": 8}  # the RNN's embed_dim is its own field (m)
    with pytest.raises(ConfigError, match="both 'embed_dim' and its new name 'd_model'"):
        workdir_lib.rename_old_model_fields("gpt", {"embed_dim": 8, "d_model": 8})


def test_sampling_needs_the_run_not_its_corpus(tmp_path, data_dir):
    """A run trained on one's own files samples after they moved and their token cache
    was deleted (it listed and prepared the whole corpus again, or failed on the glob);
    evaluating still needs them, and says which glob found nothing."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text("the cat sat on the mat and the dog ran. " * 30)
    config = shrink(load("gpt").get_config(), data_dir)
    config.data.name, config.data.files = "files", f"{corpus}/*.txt"
    config.data.cache_dir = str(tmp_path / "cache")
    config.eval.sample_prompts, config.eval.sample_tokens = ("the ",), 4
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir)
    corpus.rename(tmp_path / "moved")
    shutil.rmtree(tmp_path / "cache")
    (text,) = main.sample_checkpoint(runs.load_config(workdir), workdir)
    assert text.startswith("the ")
    assert not (tmp_path / "cache").exists()  # nothing prepared
    with pytest.raises(UserError, match=rf"the glob '{corpus}/\*\.txt' matches no file"):
        main.evaluate_checkpoint(runs.load_config(workdir), workdir)


def test_a_reading_mode_fits_a_mesh_this_host_lacks(tmp_path, capsys):
    """A run trained on a 16-device mesh, read here (8 devices): eval and sample stopped at
    "mesh ... has 16 devices but 8 are available" though a reader needs no particular
    mesh. Now they read on this host's devices and say so; a mesh given is kept."""
    config = load("gpt").get_config()
    config.mesh.data, config.mesh.tensor = 8, 2
    workdir_lib.write_config(str(tmp_path), config)
    read = main.mode_config("eval", None, [], str(tmp_path))
    assert (read.mesh.data, read.mesh.tensor, read.mesh.fsdp) == (-1, 1, 1)
    err = capsys.readouterr().err
    assert ("--mode=eval: the run's mesh {'data': 8, 'fsdp': 1, 'sequence': 1, 'tensor': 2} "
            "does not fit this host's 8 devices: reading on the 8 devices here, batch split "
            "(--config.mesh.* to choose)") in err
    assert "mesh.data=-1 (trained with 8)" not in err  # said once
    given = main.mode_config("eval", None, ["mesh.data=4", "mesh.tensor=2"], str(tmp_path))
    assert (given.mesh.data, given.mesh.tensor) == (4, 2)
    config.mesh.data, config.mesh.tensor = 4, 2  # fits: as trained, nothing said
    workdir_lib.write_config(str(tmp_path), config)
    assert main.mode_config("sample", None, [], str(tmp_path)).mesh.data == 4
    assert "does not fit" not in capsys.readouterr().err
    # A run of two processes, read by one: it joined the gone coordinator, waited 5
    # minutes and aborted. Now it reads alone, and says so.
    config.mesh.update(distributed=True, coordinator_address="127.0.0.1:1", num_processes=2,
                       process_id=0, cpu_collectives="gloo", dcn_data=2, data=4, tensor=1)
    workdir_lib.write_config(str(tmp_path), config)
    read = main.mode_config("eval", None, [], str(tmp_path))
    assert not read.mesh.distributed and read.mesh.num_processes == -1
    err = capsys.readouterr().err
    assert ("(it trained as several processes, mesh.distributed=True: read here by this "
            "one; --config.mesh.distributed=True with each process's settings reads with all "
            "of them)") in err
    # The mesh said is the one it had: over two processes (it fits 8 devices otherwise).
    assert ("--mode=eval: the run's mesh {'data': 4, 'fsdp': 1, 'sequence': 1, 'tensor': 1} "
            "over mesh.dcn_data=2 processes does not fit this host's 8 devices (one process): "
            "reading on the 8 devices here, batch split") in err
    # Continued without --config (more steps), by one process: process 0's launch settings
    # were inherited, and it joined the gone coordinator for 5 minutes. Now it trains
    # alone, and says so; a mesh.* given is taken as the user's launch.
    more = main.mode_config("train", None, ["train.steps=44"], str(tmp_path))
    assert not more.mesh.distributed and (more.mesh.process_id, more.mesh.dcn_data) == (-1, 1)
    assert ("training: the run's mesh {'data': 4, 'fsdp': 1, 'sequence': 1, 'tensor': 1} over "
            "mesh.dcn_data=2 processes does not fit this host's 8 devices (one process): "
            "training on the 8 devices here, batch split (--config.mesh.* to choose) (it "
            "trained as several processes, mesh.distributed=True: continued here by this one; "
            "--config.mesh.distributed=True with each process's settings continues with all "
            "of them)") in capsys.readouterr().err
    given = main.mode_config("train", None, ["train.steps=44", "mesh.process_id=1"],
                             str(tmp_path))
    assert given.mesh.distributed and given.mesh.process_id == 1
    # A cluster JAX detects (a TPU VM's workers, SLURM) recorded no launch settings: every
    # worker continues it together, as they trained.
    config.mesh.update(coordinator_address="", num_processes=-1, process_id=-1)
    workdir_lib.write_config(str(tmp_path), config)
    together = main.mode_config("train", None, ["train.steps=44"], str(tmp_path))
    assert together.mesh.distributed and together.mesh.dcn_data == 2
    assert "continued here by this one" not in capsys.readouterr().err


def test_a_run_killed_in_its_final_eval_counts_as_evaluated_after_mode_eval(tmp_path):
    """A run killed during its final evaluation is refused by the reports with "--mode=eval
    it at the end"; that evaluation (evals.jsonl) was read only where training had none, so
    the run stayed "last evaluated at step 1" and the reports kept step 1's loss. An
    evaluation past the last training step (of a checkpoint a resume superseded) is not
    the run's."""
    config = load("gpt").get_config()
    config.train.steps = 2
    workdir = str(tmp_path)
    workdir_lib.write_config(workdir, config)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for r in ({"step": 1, "split": "train", "loss": 5.0}, {"step": 1, "split": "eval", "loss": 4.0},
                  {"step": 2, "split": "train", "loss": 4.5}):  # killed in step 2's eval
            f.write(json.dumps(r) + "\n")
    with pytest.raises(ValueError, match="last evaluated at step 1 of its train.steps=2"):
        runs.check_comparable([workdir], "seeds")
    with open(tmp_path / "evals.jsonl", "w") as f:
        for r in ({"step": 2, "loss": 3.0, "data": "other"}, {"step": 2, "loss": 3.5},
                  {"step": 3, "loss": 1.0}):
            f.write(json.dumps(r) + "\n")
    assert [(r["step"], r["loss"]) for r in workdir_lib.eval_records(workdir)] == [(1, 4.0), (2, 3.5)]
    assert runs.last_eval_step(workdir) == 2
    runs.check_comparable([workdir], "seeds")  # the advice taken: it counts as finished


@pytest.mark.parametrize("mlp, gate", [("swiglu", "silu"), ("geglu", "gelu")])
def test_an_old_gated_mlp_run_s_config_still_loads_and_resumes(tmp_path, mlp, gate):
    """configs/gated_mlp wrote model.activation='gelu' beside mlp='swiglu' (the field was
    unused by a named gated MLP, which trained its own silu gate). Since such an
    activation is refused, that run's config.json stopped loading (--mode=eval, sample,
    the reports: 'activation='gelu' is not used by mlp='swiglu'') and its README command
    resumed it as a change of model.activation ("gelu" -> "silu"). Such a config reads
    as the gate it trained; GPT's default activation left as it is stays as written."""
    from attention_jax import config as config_lib
    today = config_lib.load(f"gated_mlp:mlp={mlp}", [])
    old = today.copy_and_resolve_references()
    old.model.activation = "relu" if mlp == "geglu" else "gelu"  # what a run wrote
    workdir_lib.write_config(str(tmp_path), old)
    config = runs.load_config(str(tmp_path))
    assert config.model.activation == gate
    with tasks.data_on_demand():
        task = tasks.TASKS[config.task](config, str(tmp_path))
    assert task.model.config.block().activation == gate
    assert not workdir_lib.training_changes(today, str(tmp_path))  # resumes as it is
    # The GPT default (gelu_tanh, "left as it is") and glu's own activation are kept.
    for kind, act in (("swiglu", "gelu_tanh"), ("glu", "relu")):
        today.model.mlp, today.model.activation = kind, act
        workdir_lib.write_config(str(tmp_path), today)
        assert runs.load_config(str(tmp_path)).model.activation == act
