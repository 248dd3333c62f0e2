"""The lecture experiments' configs: every variant loads, validates and trains one step."""

import importlib.util
import os

import numpy as np
import pytest

from attention_jax import checkpoint, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name):
    path = os.path.join(REPO, "experiments", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def shrink(c, data_dir):
    """One step at tiny size on small offline data (the 2k-pair translation set, six
    corpus files), so the test builds its datasets in seconds."""
    c.data.data_dir = data_dir
    if c.data.name == "number_translation":
        c.data.name = "number_translation/small"
    if "max_files" in c.data:
        c.data.max_files = 6
    if c.task == "gpt":
        c.data.seq_len = min(c.data.seq_len, 32)
        c.model.num_layers, c.model.embed_dim = 1, 4 * c.model.num_heads
    c.train.steps = 1
    c.train.batch_size = 8
    c.train.progress = False
    c.eval.every = -1
    return c


# The default of each file (no argument) already trains one step in
# tests/system/test_experiments_and_config.py; these are the other variants.
CASES = [("bottleneck", "model=rnn-bottleneck"), ("bottleneck", "model=transformer"),
         ("char_gpt", "size=baby"), ("vit_digits", "pool=gap,patch=2"),
         ("ablation_lm", "study=position,variant=rope"),
         ("ablation_lm", "study=moe,variant=dense"), ("ablation_lm", "study=moe,variant=moe")]


@pytest.mark.slow
@pytest.mark.parametrize("name,arg", CASES, ids=[f"{n}:{a}" for n, a in CASES])
def test_config_loads_and_trains_one_step(name, arg, data_dir, tmp_path):
    module = load(name)
    assert f"python -m attention_jax.main --config=experiments/{name}.py" in module.__doc__
    config = module.get_config(arg)
    train.validate_config(config)
    summary = train.train_and_evaluate(shrink(config, data_dir), str(tmp_path))
    assert summary["step"] == 1 and np.isfinite(summary["losses"][0])
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True).latest_step() == 1


def test_configs_match_the_recipes_they_cite():
    cpu = load("char_gpt").get_config()
    assert (cpu.model.num_layers, cpu.model.num_heads, cpu.model.embed_dim, cpu.data.seq_len,
            cpu.train.batch_size, cpu.train.steps) == (4, 4, 128, 64, 12, 2000)
    baby = load("char_gpt").get_config("size=baby")
    assert (baby.model.num_layers, baby.model.num_heads, baby.model.embed_dim,
            baby.data.seq_len) == (6, 6, 384, 256)
    configs = {m: load("bottleneck").get_config(f"model={m}") for m in load("bottleneck").MODELS}
    assert configs["rnn-bottleneck"].model.variant == "tiny-bottleneck"
    assert configs["rnn-attention"].model.variant == "tiny"
    # The comparison is fair only if data, steps and batch are the same for all three.
    for c in configs.values():
        assert (c.data.to_dict(), c.train.steps, c.train.batch_size) == (
            configs["transformer"].data.to_dict(), configs["transformer"].train.steps,
            configs["transformer"].train.batch_size)
    assert load("vit_digits").get_config("patch=4,pool=gap").model.patch_size == 4


def test_unknown_arguments_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"model='lstm' is unknown; valid: \('rnn-bottleneck'"):
        load("bottleneck").get_config("model=lstm")
    with pytest.raises(ValueError, match=r"size='huge' is unknown; valid: \['baby', 'cpu'\]"):
        load("char_gpt").get_config("size=huge")
    with pytest.raises(ValueError, match=r"variant='rope' is unknown for study=moe; "
                                         r"valid: \('dense', 'moe'\)"):
        load("ablation_lm").get_config("study=moe,variant=rope")


def test_ablation_pairs_differ_in_one_field():
    get = load("ablation_lm").get_config
    learned, rope = (get(f"study=position,variant={v}").to_dict() for v in ("learned", "rope"))
    assert learned["model"].pop("position") == "learned" and rope["model"].pop("position") == "rope"
    assert learned == rope
    dense, moe = (get(f"study=moe,variant={v}").to_dict() for v in ("dense", "moe"))
    assert (dense["model"].pop("mlp"), moe["model"].pop("mlp")) == ("mlp", "moe")
    assert dense == moe and moe["model"]["top_k"] == 1  # equal active MLP parameters
