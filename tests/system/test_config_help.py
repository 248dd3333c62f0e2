"""--help explains every key: the explanations are the comments beside the code that sets
each key (config_help), so a key left uncommented fails here rather than reaching a user
as a bare `key = value`; and a config's own comment is the one of the statement that set
the value shown, for the arguments given."""

import pytest

from attention_jax import config as config_lib
from attention_jax import config_help, tasks


def explained(spec: str, overrides=()) -> tuple[dict, dict]:
    return config_help.load_explained(
        spec, overrides, lambda c: getattr(tasks.TASKS.get(c.task), "model", None))


@pytest.mark.parametrize("name", sorted(config_lib.shipped()))
def test_every_key_a_shipped_config_lists_is_explained(name):
    config, explanations = explained(name)
    listed = [k for k in config_lib.flat(config) if k not in tasks.unread_keys(config.task)]
    assert [k for k in listed if not explanations.get(k)] == []


def test_the_statement_that_wrote_a_key_is_found_however_it_wrote_it(tmp_path):
    """Every write into the config is recorded with its line: a helper's, update() (one
    comment a keyword's line), setattr, a tuple target, `*=`, a group built and then
    attached, a group replaced whole (its statement's comment); a one-line `if` whose
    body did not run, a base config built a second time only to read it, a get_ref of a
    key and a value chosen by a conditional expression give no comment of theirs."""
    mine = tmp_path / "writes.py"
    mine.write_text(
        "from attention_jax.configs import gpt\n\n"
        "def _tune(cfg):\n"
        "    cfg.optim.lr = 1e-4  # a helper's rate\n\n"
        "def get_config(arg=None):\n"
        "    c = gpt.get_config()\n"
        "    _tune(c)\n"
        "    c.train.update(seed=3)  # through update\n"
        "    setattr(c.eval, 'steps', 2)  # through setattr\n"
        "    c.train.log_every, c.train.prefetch = 5, 1  # a tuple target\n"
        "    c.train.batch_size *= 2  # doubled\n"
        "    if arg == 'big': c.train.steps = 10**6  # only when big\n"
        "    other = gpt.get_config('variant=gpt2')  # built only to read it\n"
        "    c.model.num_layers = other.model.num_layers or 12\n"
        "    c.mesh = type(c.mesh)(dict(c.mesh))  # the group replaced whole\n"
        "    c.eval.every = 1 if arg else 2  # one arm's comment\n"
        "    c.optim.update(\n"
        "        b1=0.8,  # first moment\n"
        "        b2=0.9,  # second moment\n"
        "    )\n"
        "    c.eval.batch_size = int('16', base=10)  # a keyword, one comment\n"
        "    extra = type(c)()\n"
        "    extra.width = 7  # built first\n"
        "    c.extra = extra\n"
        "    c.extra.twice = c.train.get_ref('seed') * 2  # twice the seed\n"
        "    return c\n")
    config, found = explained(str(mine))
    assert (config.optim.lr, config.train.seed, config.eval.steps) == (1e-4, 3, 2)
    assert found["optim.lr"].endswith("This config: a helper's rate.")
    assert found["train.seed"].endswith("This config: through update.")
    assert found["eval.steps"].endswith("This config: through setattr.")
    assert found["train.log_every"].endswith("This config: a tuple target.")
    assert found["train.prefetch"].endswith("This config: a tuple target.")
    assert found["train.batch_size"].endswith("This config: doubled.")
    assert "only when big" not in found["train.steps"]  # gpt.py's comment instead
    assert found["train.steps"].endswith("2 shared CPU cores (docstring).")
    assert "This config" not in found["model.num_layers"]  # written uncommented
    assert found["mesh.data"].endswith("This config: the group replaced whole.")
    assert "one arm" not in found["eval.every"]
    assert found["optim.b1"].endswith("This config: first moment.")
    assert found["optim.b2"].endswith("This config: second moment.")
    assert found["eval.batch_size"].endswith("This config: a keyword, one comment.")
    assert found["extra.width"] == "built first."
    assert found["train.seed"].endswith("This config: through update.")  # not get_ref's


def test_the_general_meaning_comes_first_then_the_configs_own():
    _, gpt = explained("gpt")
    assert gpt["optim.lr"] == ("peak learning rate, reached after warmup. This config: "
                               "Chosen for this config's own 0.4M-parameter model, which "
                               "tolerates a large step (a larger :variant= may want a "
                               "smaller one).")
    # a model field's comment in its dataclass (tasks.register(..., model=GPTConfig))
    assert gpt["model.num_layers"] == "transformer blocks."
    # a comment that only repeats the general one is not shown twice
    _, rnn = explained("rnn_seq2seq")
    assert rnn["model.cell"] == 'the recurrent cell: "gru" | "lstm".'
    # the same key name in two data tables: each config gets its own table's text
    _, vit = explained("vit")
    assert "images held out" in vit["data.eval_fraction"]
    assert "records held out" in gpt["data.eval_fraction"]
    # a config built on another (inductive_bias on vit_digits) takes that one's comments
    # for the keys it leaves as they were
    _, inductive = explained("inductive_bias")
    assert inductive["data.flip"] == ("mirror half the training images left to right. This "
                                      "config: mirroring changes what a digit is.")
    # words, not letters: BERT's "A: attention heads" is not within "head dim 32"
    assert not config_help._says_within("A.", "head dim 32.")
    assert config_help._says_within("D", "D: the width.")


def test_the_comment_shown_is_the_one_of_the_statement_that_set_the_value():
    """get_config runs traced: a comment in the branch its arguments took is shown, one
    in another branch, on a replaced value or on one arm of a conditional value is not."""
    _, norm = explained("ablation_lm:study=norm,variant=pre")
    assert "Deep and narrow" in norm["model.num_layers"]
    _, position = explained("ablation_lm")  # study=position: the norm study's comment not
    assert position["model.num_layers"] == "transformer blocks."
    _, bottleneck = explained("bottleneck:model=rnn-bottleneck")
    assert "'tiny-bottleneck' does not" in bottleneck["model.variant"]
    _, transformer = explained("bottleneck:model=transformer")
    assert "rnn" not in transformer["model.variant"] and "RNN" not in transformer["optim.lr"]
    # inductive_bias (model=cnn) replaces vit_digits' whole model group, and sets the steps
    _, cnn = explained("inductive_bias")
    assert cnn["model.variant"] == config_help.VARIANT
    assert cnn["train.steps"] == "optimizer steps (each of grad_accum micro-batches)."
    # `4 if own else None  # N (head dim 32)`: the comment is the default arm's
    _, gpt2 = explained("gpt:variant=gpt2")
    assert "head dim 32" not in gpt2["model.num_heads"]
    # a key set on the command line: its value is the user's; the config's own value
    # and its comment are beside it, as that value's
    config, mine = explained("gpt", ["optim.lr=0.01", "data.seq_len=512", "train.steps=9"])
    assert config.optim.lr == 0.01
    assert mine["optim.lr"].startswith("peak learning rate, reached after warmup. Set on "
                                       "the command line; the config gives 0.003: Chosen ")
    assert mine["data.seq_len"] == ("Set on the command line; the config gives 128: tokens "
                                    "per packed row.")
    assert mine["train.steps"] == ("optimizer steps (each of grad_accum micro-batches). Set "
                                   "on the command line; the config gives 600: the own "
                                   "model's took 6.9 min on 2 shared CPU cores (docstring).")


def test_a_users_config_file_and_its_own_model_class(tmp_path, capsys):
    """A config file of one's own: built on the config its get_config() calls (not on
    every config it imports); a task it registers with model= has its fields' comments
    (read from the file, which runs once however often --help asks for it)."""
    mine = tmp_path / "mine.py"
    mine.write_text(
        "import dataclasses\n"
        "from attention_jax import tasks\n"
        "from attention_jax.configs import gpt, vit_digits\n\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class ToyConfig:\n"
        "    width: int = 8  # the toy's width\n\n"
        "tasks.register('toy_help', lambda config, workdir: None, reads=(), model=ToyConfig)\n"
        "print('loaded')\n\n"
        "def get_config(arg=None):\n"
        "    c = gpt.get_config()\n"
        "    c.train.steps = 50  # short\n"
        "    return c\n")
    try:
        module = config_lib.config_module(str(mine))
        config, found = explained(str(mine))
        assert config_lib.config_module(str(mine)) is module
        assert capsys.readouterr().out == "loaded\n"  # run once, not once a call
        assert "image" not in found["task"]  # gpt's, not vit_digits'
        assert found["train.steps"].endswith("This config: short.")
        assert found["optim.lr"].endswith("(a larger :variant= may want a smaller one).")
        assert config_help.fields(tasks.TASKS["toy_help"].model, "model") == {
            "model.width": "the toy's width"}
    finally:
        tasks.TASKS.pop("toy_help", None)
