"""Every experiment config loads and trains one step; config errors say what is wrong."""

import glob
import os
import re
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import tiny
from attention_jax import checkpoint, train
from conftest import REPO, subprocess_env
from helpers import load, shrink
from attention_jax import config as config_lib
from attention_jax import tasks
from attention_jax.errors import ConfigError

EXPERIMENTS = sorted(config_lib.shipped())


def test_the_five_experiments_exist():
    assert {"gpt", "bert_mlm", "vit", "encdec", "rnn_seq2seq"} <= set(EXPERIMENTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_loads_and_trains_one_step(name, data_dir, tmp_path):
    module = load(name)
    doc = module.__doc__
    assert f"python -m attention_jax.main --config={name}" in doc
    config = module.get_config()
    assert set(config.keys()) == {"task", "model", "data", "optim", "train", "mesh", "eval"}
    config_lib.validate(config)
    summary = train.train_and_evaluate(shrink(config, data_dir), str(tmp_path))
    assert summary["step"] == 1 and np.isfinite(summary["losses"][0])
    assert os.path.exists(tmp_path / "config.json") and os.path.exists(tmp_path / "metrics.jsonl")
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True).latest_step() == 1
    # The machine it was measured on, named, and a figure.
    assert re.search(r"Measured \([^)]+\): .*\d", doc), "docstring must give runtime and metric"


# ----------------------------------------------------------------------------- errors
def _raises(config, match, **kwargs):
    with pytest.raises(ConfigError, match=match):
        config_lib.validate(config, **kwargs)


def test_config_errors_name_the_key_and_valid_values():
    c = tiny.tiny_config()
    c.optim.lrr = 1e-3
    _raises(c, r"config\.optim\.lrr is not a known key; valid keys in config\.optim: .*'lr'")
    # A config file's own top-level key or group listed every flat key as "valid keys in
    # config.my_note" (and no data.* or model.* one); it names the top-level keys.
    c = tiny.tiny_config()
    c.my_note = 3
    _raises(c, r"^config\.my_note is not a known key: config has no 'my_note'; valid top-level "
               r"keys of config: \['data', 'eval', 'mesh', 'model', 'optim', 'task', 'train'\]$")
    c = tiny.tiny_config()
    c.trian = {"steps": 3}
    _raises(c, r"^config\.trian\.steps is not a known key: config has no 'trian'; .* \(did you "
               r"mean 'train'\?\)$")

    c = tiny.tiny_config().to_dict()
    c["train"]["steps"] = "ten"
    _raises(ml_collections.ConfigDict(c), r"config\.train\.steps='ten' has type str; expected int")

    c = tiny.tiny_config(**{"optim.schedule": "cosin"})
    _raises(c, r"config\.optim\.schedule='cosin' is unknown; valid: \['cosine', 'linear', 'constant'\] \(did you mean 'cosine'\?\)")

    c = tiny.tiny_config(**{"mesh.data": 8, "train.batch_size": 12})
    _raises(c, r"config\.train\.batch_size=12 must be divisible by .* = 1 × 8 .*valid: multiples "
               r"of 8", num_devices=8)

    c = tiny.tiny_config(**{"mesh.data": 3})
    _raises(c, r"config\.mesh: .*3 devices but 8 are available", num_devices=8)

    c = tiny.tiny_config(**{"mesh.rules": (("embed", "fsdpp"),)})
    _raises(c, r"^config\.mesh\.rules\[0\]: logical axis 'embed' maps to \['fsdpp'\]; valid mesh "
               r"axes: \['data', 'fsdp', 'sequence', 'tensor'\] or None \(did you mean 'fsdp'\?\)$")
    c = tiny.tiny_config(**{"mesh.rules": (("btch", "data"),)})
    _raises(c, r"^config\.mesh\.rules\[0\]: 'btch' is no logical axis of the models; valid: "
               r"\['batch', .*\] \(did you mean 'batch'\?\)$")
    c = tiny.tiny_config(**{"mesh.rules": (("batch",),)})
    _raises(c, r"^config\.mesh\.rules\[0\]=\('batch',\) is not a pair")


def test_a_key_under_another_group_is_pointed_to():
    """A key given under the wrong group (the loss kernel is a training setting, not the
    model's) says where it is, not the nearest spelling in the wrong group."""
    c = tiny.tiny_config()
    with pytest.raises(ConfigError, match=re.escape(
            "--config.model.loss_kernel: config.model has no key 'loss_kernel'; valid: [")
            + r".*\(it is config\.train\.loss_kernel\)$"):
        config_lib.apply_overrides(c, ["model.loss_kernel=pallas"])
    c.optim.steps = 10
    _raises(c, r"config\.optim\.steps is not a known key; .* \(it is config\.eval\.steps or "
               r"config\.train\.steps\)$")
    with pytest.raises(ConfigError, match=r"has no key 'stepz'; .* \(did you mean 'steps'\?\)$"):
        config_lib.apply_overrides(tiny.tiny_config(), ["train.stepz=10"])
    # names from nanoGPT and Hugging Face, in any group: where the key of that meaning is
    for given, ours in (("train.learning_rate", "optim.lr"), ("optim.learning_rate", "optim.lr"),
                        ("train.max_iters", "train.steps"), ("model.n_head", "model.num_heads"),
                        ("optim.max_grad_norm", "optim.clip_norm")):
        with pytest.raises(ConfigError, match=re.escape(f"(here it is config.{ours})") + "$"):
            config_lib.apply_overrides(tiny.tiny_config(), [f"{given}=1"])
    with pytest.raises(ConfigError, match=re.escape(  # a name whose meaning differs, said so
            "(here it is config.optim.grad_accum; it splits config.train.batch_size into "
            "micro-batches, where nanoGPT's and Hugging Face's multiply the batch)")):
        config_lib.apply_overrides(tiny.tiny_config(), ["train.gradient_accumulation_steps=4"])
    # a group given a value: one line naming its keys, not ml_collections' cast error
    with pytest.raises(ConfigError, match=re.escape(
            "--config.train='5': config.train is a group of keys, not a value; valid: "
            "--config.train.KEY=value, KEY one of ['async_checkpoint', ")):
        config_lib.apply_overrides(tiny.tiny_config(), ["train=5"])
    c = tiny.tiny_config()  # a group given a group merges into it (runs.open_run's overrides)
    config_lib.apply_overrides(c, {"train": tiny.tiny_config(**{"train.steps": 7}).train})
    assert c.train.steps == 7
    # a name whose meaning this config has no key for gets the nearest spelling, as before
    c = tiny.tiny_config()
    del c.model["num_heads"]
    with pytest.raises(ConfigError, match=r"has no key 'n_head'; valid: .*") as raised:
        config_lib.apply_overrides(c, ["model.n_head=1"])
    assert "here it is" not in str(raised.value)


def test_rules_that_split_the_batch_over_no_data_axis_are_said(tmp_path, capsys):
    """Rules without a 'batch' entry on a data-parallel mesh trained with the batch
    copied onto every device (a seventh of the speed, the same losses), unsaid."""
    from attention_jax import sharding
    rules = tuple((n, t) for n, t in sharding.DEFAULT_RULES if n != "batch")
    c = tiny.tiny_config(**{"mesh.data": 2, "mesh.num_devices": 2, "train.steps": 1,
                            "mesh.rules": rules})
    train.train_and_evaluate(c, str(tmp_path / "a"))
    assert ("warning: config.mesh.rules split 'batch' over none of ['data'] (mesh.data=2): "
            "each of those devices computes the whole batch") in capsys.readouterr().err
    assert sharding.rules_warnings(sharding.DEFAULT_RULES, {"data": 2, "fsdp": 4}) == []
    assert sharding.rules_warnings(rules, {"data": 1, "fsdp": 1, "tensor": 8}) == []
    # Own rules naming no axis for tensor or sequence: those devices duplicated the work
    only_batch = (("batch", ("data", "fsdp")),)
    assert sharding.rules_warnings(only_batch, {"data": 2, "tensor": 2, "sequence": 4}) == [
        "config.mesh.rules map no logical axis to mesh.tensor=2: those devices each compute "
        "the same thing; the default rules split heads, the MLP and the vocabulary over "
        "'tensor'"]
    # (ring attention splits over sequence whatever the rules say)
    assert sharding.rules_warnings(only_batch, {"data": 2, "sequence": 4}) == []


def test_heads_not_divisible_by_tensor_axis_fails_before_compiling(tmp_path):
    c = tiny.tiny_config(**{"mesh.data": 2, "mesh.tensor": 4})
    with pytest.raises(ConfigError, match=r"config\.model\.num_heads=2 is not divisible by "
                                                r"mesh\.tensor=4; valid: mesh\.tensor in \[1, 2\]"):
        train.train_and_evaluate(c, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints" / "0")


def test_model_keys_are_checked_against_the_model_config(data_dir, tmp_path):
    c = shrink(load("gpt").get_config(), data_dir)
    c.model.num_layerz = 3
    c.data.data_dir = str(tmp_path / "tfds")  # nothing built there yet
    with pytest.raises(ConfigError, match=r"config\.model\.num_layerz is not a field of "
                                                r"GPTConfig; valid: .*'num_layers'.*\(did you "
                                                r"mean 'num_layers'\?\)"):
        train.train_and_evaluate(c, str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "tfds")  # said before the corpus was built
    # A key set to None is not set (a template's keys of other families): no error.
    from attention_jax.models import gpt
    from attention_jax.tasks.base import check_model_keys
    c = load("gpt").get_config()
    c.model.patch_size = None
    check_model_keys(gpt.GPTConfig, c)
    for name, key, cls in (("vit", "patch_sise", "ViTConfig"), ("bert_mlm", "num_head", "BertConfig"),
                           ("encdec", "d_modle", "EncDecConfig"),
                           ("rnn_seq2seq", "hiden", "RNNConfig")):
        c = load(name).get_config()
        c.model[key] = 1
        with pytest.raises(ConfigError, match=rf"config\.model\.{key} is not a field of {cls}"):
            train.train_and_evaluate(c, str(tmp_path / name))
    c = shrink(load("gpt").get_config(), data_dir)
    c.data.seq_len = 512
    with pytest.raises(ConfigError, match=r"config\.data\.seq_len=512 exceeds "
                                                r"config\.model\.max_len=128"):
        train.train_and_evaluate(c, str(tmp_path / "b"))


def test_checkpoint_of_another_model_is_refused_naming_keys(tmp_path):
    workdir = str(tmp_path)
    train.train_and_evaluate(tiny.tiny_config(), workdir)
    wider = tiny.tiny_config()
    wider.model.width = 32
    with pytest.raises(ConfigError, match=r"model\.width: 16 -> 32"):
        train.train_and_evaluate(wider, workdir)  # the changed config is named first
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"shape differs: +params/embed model \(32, 32\) vs checkpoint \(32, 16\)"):
        train.train_and_evaluate(wider, workdir, resume_changed=True)


def test_cli_reports_config_errors_in_one_line(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "attention_jax.main",
                               "--config=gpt", f"--workdir={tmp_path}", *args],
                              env=subprocess_env(8), cwd=REPO, capture_output=True, text=True,
                              timeout=120)

    out = cli("--config.data.bogus=1")
    assert out.returncode == 1
    assert "error: --config.data.bogus: config.data has no key 'bogus'; valid: [" in out.stderr
    out = cli("--config.train.batch_size=12", "--config.mesh.data=8")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "error: config.train.batch_size=12 must be divisible" in out.stderr

def test_lm_vocabulary_can_be_padded_to_gpt2s_but_not_below_the_tokenizer(data_dir, tmp_path):
    """model.vocab_size gives the byte-level LM GPT-2's head (configs/gpt2_gpu.py);
    unset, the tokenizer's 259 tokens are padded to 320; below 259 is a ConfigError."""
    config = shrink(load("gpt2_gpu").get_config(), data_dir)
    assert tasks.TASKS["gpt"](config, str(tmp_path)).model.config.vocab_size == 50304
    config.model.vocab_size = 0
    assert tasks.TASKS["gpt"](config, str(tmp_path)).model.config.vocab_size == 320
    config.model.vocab_size = 100
    with pytest.raises(ConfigError, match=r"config\.model\.vocab_size=100 is smaller than "
                                                r"the tokenizer's 259 tokens; valid: at least 259"):
        tasks.TASKS["gpt"](config, str(tmp_path))


def test_lm_stream_packing_attends_across_documents(data_dir, tmp_path):
    """data.packing: 'documents' (default) keeps a packed document to itself, so changing
    the first document of a row leaves the loss on the second unchanged; 'stream'
    (GPT-2, nanoGPT) reads the row as one causal stream, so the same change reaches the
    second document. A packing that does not exist is named with the valid ones."""
    import jax
    import flax.linen as nn

    def second_document_losses(packing):
        config = shrink(load("gpt").get_config(), data_dir)
        config.data.packing = packing
        task = tasks.TASKS["gpt"](config, str(tmp_path / packing))
        params = nn.meta.unbox(jax.jit(task.init)(jax.random.key(0)))
        row = next(r for r in (task.train_source[i] for i in range(len(task.train_source)))
                   if r["segment_ids"].max() >= 2 and (r["segment_ids"] == 1).sum() > 1)
        seg = row["segment_ids"]
        second = dict(row, tokens=row["tokens"].copy())
        second["tokens"][seg == 1] = (second["tokens"][seg == 1] + 7) % 256  # first document
        losses = []
        for r in (row, second):
            ex = task.train_transform(r, None)
            batch = {k: v[None] for k, v in ex.items()}
            batch["weights"] = batch["weights"] * (seg == 2)[None]  # loss on document 2 only
            losses.append(float(task.loss(params, batch, jax.random.key(0), False)[0]))
        return losses, ex

    (a, b), ex = second_document_losses("documents")
    assert "segment_ids" in ex and a == pytest.approx(b, abs=1e-6)
    (a, b), ex = second_document_losses("stream")
    assert "segment_ids" not in ex and abs(a - b) > 1e-4
    config = shrink(load("gpt").get_config(), data_dir)
    config.data.packing = "rows"
    with pytest.raises(ConfigError, match=r"config\.data\.packing='rows' is unknown; valid: "
                                                r"\['documents', 'stream'\]"):
        tasks.TASKS["gpt"](config, str(tmp_path / "bad"))


@pytest.mark.parametrize("spec,model,want", [
    # (encdec's and rnn_seq2seq's explicit sizes overrode every variant: :variant=
    # transformer-base trained the 64-wide model and tiny-lstm a GRU, unsaid.)
    ("encdec", "EncDecConfig", dict(d_model=64, num_heads=4, num_encoder_layers=2)),
    ("encdec:variant=transformer-base", "EncDecConfig",
     dict(d_model=512, num_heads=8, mlp_dim=2048, num_encoder_layers=6, dropout_rate=0.1)),
    ("encdec:variant=transformer-big", "EncDecConfig",
     dict(d_model=1024, num_heads=16, mlp_dim=4096, dropout_rate=0.3)),
    ("rnn_seq2seq", "RNNConfig", dict(embed_dim=64, hidden_dim=128, cell="gru")),
    ("rnn_seq2seq:variant=tiny-lstm", "RNNConfig", dict(embed_dim=64, cell="lstm")),
    ("rnn_seq2seq:variant=tiny-bottleneck", "RNNConfig", dict(hidden_dim=128, attention=False)),
    ("rnn_seq2seq:variant=rnnsearch", "RNNConfig", dict(embed_dim=620, hidden_dim=1000)),
])
def test_a_translation_configs_variant_is_the_model_it_names(spec, model, want):
    from attention_jax.models import encdec, rnn
    from attention_jax.tasks import base
    cls = {"EncDecConfig": encdec.EncDecConfig, "RNNConfig": rnn.RNNConfig}[model]
    got = base.model_config(cls, config_lib.load(spec))
    assert {k: getattr(got, k) for k in want} == want


def test_a_language_model_on_a_dataset_without_text_says_so_in_one_line(data_dir, tmp_path):
    """The LM tasks read a dataset's documents from its records' 'text' only: a
    data.text_key set for one did nothing, and a dataset without that feature
    (number_translation's en/fr) was a KeyError traceback from the tokenizer."""
    config = shrink(load("gpt").get_config(), data_dir)
    config.data.name, config.data.max_files = "number_translation/small", 0
    with pytest.raises(ConfigError, match=r"^config\.data\.name='number_translation/small': "
                                          r"its 'train' records hold no 'text' \(their keys: "
                                          r"\['de', 'en', 'fr', 'number'\]\)"):
        tasks.TASKS["gpt"](config, str(tmp_path / "a"))
    config.data.text_key = "en"
    with pytest.raises(ConfigError, match=r"^config\.data\.text_key='en' is read only with "
                                          r"config\.data\.name='files'"):
        tasks.TASKS["gpt"](config, str(tmp_path / "b"))


def test_the_gpt_configs_architecture_is_set_from_the_command_line(tmp_path):
    """configs/gpt had no key for the position, norm, MLP kind or biases: the flagship
    config's architecture was its variant's, and --config.model.position=rope said "no
    key 'position'". The keys are None (the variant's) unless given; a run saved before
    they existed resumes as no change."""
    import json

    from attention_jax import workdir as workdir_lib
    from attention_jax.models import gpt
    from attention_jax.tasks import base
    assert base.model_config(gpt.GPTConfig, config_lib.load("gpt")) == base.model_config(
        gpt.GPTConfig, config_lib.load("gpt", ["model.variant=gpt-tiny"]))
    overrides = ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu",
                 "model.use_bias=False", "model.num_kv_heads=2", "model.norm_epsilon=1e-6"]
    got = base.model_config(gpt.GPTConfig, config_lib.load("gpt", overrides))
    assert (got.position, got.norm, got.mlp, got.use_bias, got.num_kv_heads,
            got.norm_epsilon, got.num_layers, got.d_model) == (
        "rope", "rmsnorm", "swiglu", False, 2, 1e-6, 2, 128)
    config = config_lib.load("gpt")
    workdir_lib.write_config(str(tmp_path), config)
    stored = json.loads((tmp_path / "config.json").read_text())
    for key in config_lib.GPT_ARCHITECTURE_KEYS:  # as a run saved before them
        del stored["model"][key]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    assert workdir_lib.training_changes(config, str(tmp_path)) == ""
    assert 'model.position: null -> "rope"' in workdir_lib.training_changes(
        config_lib.load("gpt", ["model.position=rope"]), str(tmp_path))
    # A swiglu run leaving model.activation unset reads back as it was saved (reading it
    # as the gate's silu made the samples after training refuse their own config).
    swiglu = config_lib.load("gpt", ["model.mlp=swiglu"])
    (tmp_path / "swiglu").mkdir()
    workdir_lib.write_config(str(tmp_path / "swiglu"), swiglu)
    assert workdir_lib.training_changes(swiglu, str(tmp_path / "swiglu")) == ""
