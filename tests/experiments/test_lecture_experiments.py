"""The lecture experiments' configs: every variant loads, validates and trains one step."""

import numpy as np
import pytest

from attention_jax import checkpoint, tasks, train
from attention_jax.errors import ConfigError
from attention_jax.models import bert
from helpers import load, shrink
from attention_jax import config as config_lib

# The default of each file (no argument) already trains one step in
# tests/system/test_experiments_and_config.py; these are the other variants.
CASES = [("bottleneck", "model=rnn-bottleneck"), ("bottleneck", "model=transformer"),
         ("char_gpt", "size=baby"), ("vit_digits", "pool=gap,patch=2"),
         ("ablation_lm", "study=position,variant=rope"),
         ("ablation_lm", "study=position,variant=sinusoidal"),
         ("ablation_lm", "study=moe,variant=dense"), ("ablation_lm", "study=moe,variant=moe"),
         # scaled-h32 is the learned-position config (test_ablation_pairs_differ_in_one_field).
         ("ablation_lm", "study=scale,variant=unscaled-h32"),
         ("ablation_lm", "study=scale,variant=scaled-h128"),
         ("ablation_lm", "study=scale,variant=unscaled-h128"),
         ("ablation_lm", "study=norm,variant=pre"), ("ablation_lm", "study=norm,variant=post")]


@pytest.mark.slow
@pytest.mark.parametrize("name,arg", CASES, ids=[f"{n}:{a}" for n, a in CASES])
def test_config_loads_and_trains_one_step(name, arg, data_dir, tmp_path):
    module = load(name)
    assert f"python -m attention_jax.main --config={name}" in module.__doc__
    config = module.get_config(arg)
    config_lib.validate(config)
    summary = train.train_and_evaluate(shrink(config, data_dir), str(tmp_path))
    assert summary["step"] == 1 and np.isfinite(summary["losses"][0])
    assert checkpoint.Checkpointer(tmp_path / "checkpoints", read_only=True).latest_step() == 1


def test_configs_match_the_recipes_they_cite():
    cpu = load("char_gpt").get_config()
    assert (cpu.model.num_layers, cpu.model.num_heads, cpu.model.d_model, cpu.data.seq_len,
            cpu.train.batch_size, cpu.train.steps) == (4, 4, 128, 64, 12, 2000)
    baby = load("char_gpt").get_config("size=baby")
    assert (baby.model.num_layers, baby.model.num_heads, baby.model.d_model,
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
    with pytest.raises(ConfigError, match=r":model='lstm' is unknown; valid: \['rnn-bottleneck'"):
        load("bottleneck").get_config("model=lstm")
    with pytest.raises(ConfigError, match=r":size='huge' is unknown; valid: \['cpu', 'baby'\]"):
        load("char_gpt").get_config("size=huge")
    with pytest.raises(ConfigError, match=r":variant \(study=moe\)='rope' is unknown; "
                                          r"valid: \['dense', 'moe'\]"):
        load("ablation_lm").get_config("study=moe,variant=rope")
    with pytest.raises(ConfigError, match=r"'stdy' is not an argument of this config \(did you "
                                          r"mean 'study'\?\)"):
        load("ablation_lm").get_config("stdy=moe")


def test_ablation_pairs_differ_in_one_field():
    get = load("ablation_lm").get_config
    learned, rope = (get(f"study=position,variant={v}").to_dict() for v in ("learned", "rope"))
    assert learned["model"].pop("position") == "learned" and rope["model"].pop("position") == "rope"
    assert learned == rope
    dense, moe = (get(f"study=moe,variant={v}").to_dict() for v in ("dense", "moe"))
    assert (dense["model"].pop("mlp"), moe["model"].pop("mlp")) == ("mlp", "moe")
    # and the experts' keys, which a dense MLP has no use for (not set there)
    experts = {k: (dense["model"].pop(k, None), moe["model"].pop(k))
               for k in ("num_experts", "top_k", "capacity_factor")}
    assert experts == {"num_experts": (None, 4), "top_k": (None, 1),
                       "capacity_factor": (None, 1.25)}  # top 1: equal active MLP parameters
    assert dense == moe
    sinusoidal = get("study=position,variant=sinusoidal").to_dict()
    assert sinusoidal["model"].pop("position") == "sinusoidal" and sinusoidal == learned

    scale = {v: get(f"study=scale,variant={v}").to_dict() for v in
             ("scaled-h32", "unscaled-h32", "scaled-h128", "unscaled-h128")}
    # The H = 32 baseline is the same model as the other studies' baselines.
    assert scale["scaled-h32"] == get("study=position,variant=learned").to_dict()
    for h, heads in ((32, 4), (128, 1)):
        scaled, unscaled = scale[f"scaled-h{h}"], scale[f"unscaled-h{h}"]
        assert scaled["model"]["d_model"] // scaled["model"]["num_heads"] == h
        assert scaled["model"]["num_heads"] == heads
        # None is the model's 1/sqrt(H); 1.0 is no scaling.
        assert (scaled["model"].pop("attention_scale"), unscaled["model"].pop("attention_scale")) \
            == (None, 1.0)
        assert scaled == unscaled
    assert scale["scaled-h32"]["model"].pop("num_heads") == 4
    assert scale["scaled-h128"]["model"].pop("num_heads") == 1
    assert scale["scaled-h32"] == scale["scaled-h128"]  # same width: only H differs

    pre, post = (get(f"study=norm,variant={v}").to_dict() for v in ("pre", "post"))
    assert (pre["model"].pop("norm_position"),
            post["model"].pop("norm_position")) == ("pre", "post")
    assert pre == post and pre["model"]["num_layers"] == 24  # "at depth"
    assert pre["optim"]["lr"] == learned["optim"]["lr"]  # the same learning rate


def test_attention_stats_measure_saturation():
    """The scale study's measurement: logits scaled by 0 give equal weights on every
    visible key (so entropy == uniform_entropy exactly); at initialisation, unscaled
    logits at head dim 64 give a peakier softmax than scaled ones."""
    import jax
    import jax.numpy as jnp

    from attention_jax.tools.analysis import attention_stats as stats
    from attention_jax.models import gpt
    # Two documents and padding in row 0; one document in row 1.
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0], [1] * 8], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 0, 0, 0], list(range(8))], np.int32)
    batch = {"inputs": np.arange(16, dtype=np.int32).reshape(2, 8) % 50,
             "positions": positions, "segment_ids": seg}
    visible = np.array([1, 2, 3, 1, 2] + list(range(1, 9)), np.float64)  # keys per real row

    def run(scale):
        model = gpt.GPT(gpt.get_config("gpt-tiny", num_layers=1, num_heads=1,
                                       attention_scale=scale))
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
        return stats(model, params, batch)

    uniform = run(0.0)
    assert uniform["uniform_entropy"] == pytest.approx(np.mean(np.log(visible)))
    assert uniform["entropy"] == pytest.approx(uniform["uniform_entropy"], abs=1e-6)
    assert uniform["max_weight"] == pytest.approx(np.mean(1 / visible), abs=1e-6)
    scaled, unscaled = run(None), run(1.0)
    assert unscaled["entropy"] < scaled["entropy"] < uniform["entropy"]
    assert unscaled["max_weight"] > scaled["max_weight"]


def test_bert_mlm_default_uses_wordpiece_and_its_own_shape():
    c = load("bert_mlm").get_config()
    config_lib.validate(c)
    assert c.data.tokenizer == "wordpiece"
    assert c.model.max_len >= c.data.seq_len
    cfg = tasks.model_config(bert.BertConfig, c, vocab_size=30528)
    assert (cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.mlp_dim) == (
        c.model.num_layers, c.model.num_heads, c.model.d_model, 4 * c.model.d_model)


def test_bert_mlm_variant_argument_takes_the_variant_shape():
    """A variant argument gives that variant's shape (explicit model fields would
    override it)."""
    c = load("bert_mlm").get_config("variant=bert-mini")
    config_lib.validate(c)
    cfg = tasks.model_config(bert.BertConfig, c, vocab_size=30528)
    mini = bert.VARIANTS["bert-mini"]
    assert (cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.mlp_dim) == (
        mini["num_layers"], mini["num_heads"], mini["d_model"], mini["mlp_dim"])
    assert cfg.max_len >= c.data.seq_len
