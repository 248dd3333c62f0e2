"""A translation run (encdec) on a tfds dataset of the user's own, built with tfds in a
data_dir of theirs: evaluated on another of its splits, and resumed after the dataset
was rebuilt in place."""

import json
import os
import shutil

import pytest

from attention_jax import config as config_lib
from attention_jax import main, train
from attention_jax import workdir as workdir_lib
from attention_jax.data import loaders, sources
from attention_jax.errors import ConfigError

NAME = "user_pairs"  # not in the tfds registry: read from its prepared files, as a user's is
WORDS = "one two three four five six seven eight nine ten".split()
FRENCH = "un deux trois quatre cinq six sept huit neuf dix".split()


def build(data_dir: str, words=WORDS, test_size: int = 6) -> None:
    """Prepares NAME in `data_dir` (replacing an earlier build): 80 train, 10 validation
    and `test_size` test pairs of two-word numbers, `words` as the English."""
    import tensorflow_datasets as tfds
    pairs = [(f"{words[i % 10]} {words[i // 10 % 10]}", f"{FRENCH[i % 10]} {FRENCH[i // 10 % 10]}")
             for i in range(90 + test_size)]
    splits = {"train": pairs[:80], "validation": pairs[80:90], "test": pairs[90:]}
    with tfds.core.registered.skip_registration():
        class UserPairs(tfds.core.GeneratorBasedBuilder):
            VERSION = tfds.core.Version("1.0.0")

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                    {"en": tfds.features.Text(), "fr": tfds.features.Text()}))

            def _split_generators(self, dl_manager):
                return {s: self._generate_examples(p) for s, p in splits.items()}

            def _generate_examples(self, pairs):
                for i, (en, fr) in enumerate(pairs):
                    yield i, {"en": en, "fr": fr}
    UserPairs.name = NAME
    shutil.rmtree(os.path.join(data_dir, NAME), ignore_errors=True)
    UserPairs(data_dir=data_dir, file_format="array_record").download_and_prepare()


def config(data_dir: str, steps: int = 4):
    return config_lib.load("encdec", [
        f"data.name={NAME}", f"data.data_dir={data_dir}", "data.vocab_size=300",
        "data.source_len=8", "data.target_len=8", "model.d_model=16", "model.num_heads=2",
        "model.mlp_dim=16", "model.num_encoder_layers=1", "model.num_decoder_layers=1",
        f"train.steps={steps}", "train.batch_size=8", "train.log_every=2",
        "train.checkpoint_every=2", "train.progress=False", "eval.every=-1",
        "eval.batch_size=8", "optim.warmup_steps=1", "eval.sample_prompts=()"])


def test_a_trained_run_evaluates_on_another_split_of_its_dataset(tmp_path, capsys):
    """--mode=eval --config.data.eval_split=test was refused ("these cannot change after
    training"); it evaluates the trained model on that split, and the record in
    evals.jsonl names it. Its dataset and training split still cannot change."""
    data_dir, workdir = str(tmp_path / "tfds"), str(tmp_path / "run")
    build(data_dir)
    train.train_and_evaluate(config(data_dir), workdir)
    own = main.evaluate_checkpoint(main.mode_config("eval", None, [], workdir), workdir)
    assert own["examples"] == 10 and "data" not in own  # the validation split

    capsys.readouterr()
    test = main.evaluate_checkpoint(
        main.mode_config("eval", None, ["data.eval_split=test"], workdir), workdir)
    assert ('--mode=eval: the run\'s config.json with data.eval_split="test" (trained with '
            '"validation")') in capsys.readouterr().err
    assert test["examples"] == 6 and test["data"] == {"data.eval_split": "test"}
    records = workdir_lib.read_records(workdir_lib.path(workdir, workdir_lib.EVALS))
    assert [(r["examples"], r.get("data")) for r in records] == [
        (10, None), (6, {"data.eval_split": "test"})]
    # The run's own evaluations (what the tools plot) are the validation split's only.
    assert [r["examples"] for r in workdir_lib.eval_records(workdir)] == [10]

    for key, value in (("data.train_split", "test"), ("data.name", "other_pairs")):
        with pytest.raises(ConfigError, match=rf"^--mode=eval uses the run's own "
                                                         rf"config .* {key}: .* these cannot "
                                                         rf"change after training"):
            main.mode_config("eval", None, [f"{key}={value}"], workdir)


def test_resuming_on_a_tfds_dataset_rebuilt_with_other_examples_stops(tmp_path, capsys):
    """A tfds dataset rebuilt in place with other examples of the same count resumed in
    silence (the loader's state held only the count and the seed). The same examples
    rebuilt, or copied to another data_dir, resume; other ones stop with both identities,
    and --resume_changed goes on with them."""
    data_dir, workdir = str(tmp_path / "tfds"), str(tmp_path / "run")
    build(data_dir)
    train.train_and_evaluate(config(data_dir, steps=2), workdir)
    build(data_dir)  # the same examples again (their files' bytes differ: tfds' order)
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    assert train.train_and_evaluate(config(copy, steps=4), workdir)["step"] == 4

    build(copy, words=WORDS[::-1])  # as many pairs, other English
    with pytest.raises(loaders.DataChangedError) as e:
        train.train_and_evaluate(config(copy, steps=6), workdir)
    then = loaders.source_id(sources.get_dataset(NAME, "train", data_dir))
    now = loaders.source_id(sources.get_dataset(NAME, "train", copy))
    assert then.startswith(f"tfds {NAME}/1.0.0 train: 80 records, contents ") and then != now
    assert str(e.value).startswith(
        f"the training data changed since the checkpoint: its loader read 80 rows in the order "
        f"of seed 0, the data now makes as many, but other ones ({then} then, {now} now); a "
        f"tfds dataset rebuilt with other examples or read from another data.data_dir")
    capsys.readouterr()
    summary = train.train_and_evaluate(config(copy, steps=6), workdir, resume_changed=True)
    assert summary["step"] == 6
    assert ("note: the training data changed since the checkpoint (80 rows, seed 0 -> as "
            "many, other records)") in capsys.readouterr().out


def test_a_loader_state_saved_without_an_identity_resumes_a_tfds_split(tmp_path):
    """A state saved before tfds splits had an identity ('') is not compared: it resumes
    on whatever the split holds now, as it did; one with an identity is."""
    data_dir = str(tmp_path / "tfds")
    build(data_dir)
    source = sources.get_dataset(NAME, "train", data_dir)
    saved = loaders.Loader(source, global_batch_size=8, state={
        "next_index": 16, "seed": 0, "num_records": 80}).get_state()
    assert saved.next_index == 16 and saved.source == loaders.source_id(source) != ""
    build(data_dir, words=WORDS[::-1])
    rebuilt = sources.get_dataset(NAME, "train", data_dir)
    old = {"next_index": 16, "seed": 0, "num_records": 80}
    assert loaders.Loader(rebuilt, global_batch_size=8, state=old).get_state().next_index == 16
    assert loaders.Loader(rebuilt, global_batch_size=8,
                          state=json.dumps({**old, "source": ""})).get_state().next_index == 16
    with pytest.raises(loaders.DataChangedError, match="as many, other ones"):
        loaders.Loader(rebuilt, global_batch_size=8, state=saved)
