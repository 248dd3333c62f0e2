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
def get_config(arg=None):
    c = config_lib.base_config()
    c.optim = o = ml_collections.ConfigDict()
    o.lr = 1e-3  # peak rate
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
    c.optim.lr = 2e-3  # a later assignment: the first comment stays
    return c
'''
    assert config_help.assignments(source) == {
        "optim.lr": "peak rate", "train.steps": "optimizer steps",
        "train.seed": "on the statement's last line"}
    # A comment block above the statement counts; a blank line or code between does not.
    source = source.replace("    d = c.data\n", "").replace("d.name = \"x\"", "c.data.name = 1")
    found = config_help.assignments(source)
    assert found["data.name"] == "the data's name, over two lines"
    assert "model.width" not in found and "model.depth" not in found


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
