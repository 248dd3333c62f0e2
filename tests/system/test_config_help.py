"""--help explains every key: the explanations are the comments beside the code that sets
each key (config_help), so a key left uncommented fails here rather than reaching a user
as a bare `key = value`."""

import pytest

from attention_jax import config as config_lib
from attention_jax import config_help, tasks


def explained(name: str) -> tuple[dict, dict]:
    config = config_lib.load(name)
    model = getattr(tasks.TASKS[config.task], "model", None)
    return config, config_help.explain(config, config_lib.config_module(name), model)


@pytest.mark.parametrize("name", sorted(config_lib.shipped()))
def test_every_key_a_shipped_config_lists_is_explained(name):
    config, explanations = explained(name)
    listed = [k for k in config_lib.flat(config) if k not in tasks.unread_keys(config.task)]
    assert [k for k in listed if not explanations.get(k)] == []


def test_assignments_follow_the_names_that_stand_for_the_config():
    source = '''
def helper(c):
    c.train.log_every = 3  # a helper's c is not get_config's

def get_config(arg=None):
    c = ml_collections.ConfigDict()  # the name returned stands for the config
    c.optim = o = ml_collections.ConfigDict()
    o.b1 = 0.9  # first moment
    # the data's name,
    # over two lines
    d = c.data
    d.name = "x"
    c.train["steps"] = 5  # optimizer steps
    c.train.seed = (
        0)  # on the statement's last line
    c.model.width = 8

    c.model.depth = 2
    d = make_something_else()
    d.name = "y"  # d no longer stands for c.data
    if arg:
        c.eval.every = 1  # only with an argument: not said
        c.mesh.data = 1  # in both branches alike
        c.optim.lr = 1  # one value here,
    else:
        c.mesh.data = 2  # in both branches alike
        c.optim.lr = 2  # another there
    c.optim.b1 = 0.8  # assigned twice with other comments: neither holds for sure
    return c
'''
    assert config_help.assignments(source) == {
        "train.steps": "optimizer steps", "train.seed": "on the statement's last line",
        "mesh.data": "in both branches alike"}
    # A comment block above the statement counts; a blank line or code between does not.
    source = source.replace("    d = c.data\n", "").replace("d.name = \"x\"", "c.data.name = 1")
    found = config_help.assignments(source)
    assert found["data.name"] == "the data's name, over two lines"
    assert "model.width" not in found and "model.depth" not in found


def test_a_comment_is_shown_only_where_it_holds_for_the_value_shown():
    """A comment inside one branch of a config's arguments, or in a config this one is
    built on for a key this one sets, would describe another value: not shown."""
    _, ablation = explained("ablation_lm")  # study=position: the norm study's comment not
    assert ablation["model.num_layers"] == "transformer blocks."
    assert "H = 32" not in ablation["model.num_heads"]
    _, inductive = explained("inductive_bias")  # model=cnn, on vit_digits' config
    assert inductive["model.variant"] == config_help.VARIANT
    assert inductive["train.steps"] == "optimizer steps (each of grad_accum micro-batches)."
    _, transformer = explained("bottleneck:model=transformer")
    assert "rnn" not in transformer["model.variant"] and "RNN" not in transformer["optim.lr"]
    # words, not letters: BERT's "A: attention heads" is not within "head dim 32"
    assert not config_help._says_within("A.", "head dim 32.")
    assert config_help._says_within("D", "D: the width.")


def test_a_users_config_file_and_its_own_model_class(tmp_path, capsys):
    """A config file of one's own: built on the config its get_config() calls (not on
    every config it imports); a task it registers with model= has its fields' comments
    (read from the file, which is loaded once however often --help asks for it)."""
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
        config = config_lib.load(str(mine))
        assert config_lib.config_module(str(mine)) is module
        assert capsys.readouterr().out == "loaded\n"  # run once, not once a call
        found = config_help.explain(config, module, None)
        assert "image" not in found["task"]  # gpt's, not vit_digits'
        assert found["train.steps"].endswith("This config: short.")
        assert config_help.fields(tasks.TASKS["toy_help"].model, "model") == {
            "model.width": "the toy's width"}
    finally:
        tasks.TASKS.pop("toy_help", None)


def test_the_general_meaning_comes_first_then_the_configs_own():
    _, gpt = explained("gpt")
    assert gpt["optim.lr"] == ("peak learning rate, reached after warmup. This config: peak "
                               "lr: a 0.4M-parameter model tolerates a large step.")
    # a model field's comment in its dataclass (tasks.register(..., model=GPTConfig))
    assert gpt["model.num_layers"] == "transformer blocks."
    # a comment that only repeats the general one is not shown twice
    assert gpt["model.max_len"] == "rows of the learned position table (context length)."
    # the same key name in two data tables: each config gets its own table's text
    _, vit = explained("vit")
    assert "images held out" in vit["data.eval_fraction"]
    assert "records held out" in gpt["data.eval_fraction"]
    # a config built on another (inductive_bias on vit_digits) takes that one's comments
    _, inductive = explained("inductive_bias")
    assert inductive["data.flip"] == "mirroring changes what a digit is."
