"""Evaluation over exactly the examples it reports: the last, partial eval batch is padded
to the full eval.batch_size and masked, never dropped, on one device and on eight.

Every metric is checked against the same quantity computed independently, on the host,
over every example (or the first `eval.steps` batches' worth): the ViT's accuracy and
loss over all 359 digits test images, a GPT's token-weighted loss over the whole
validation split.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

import tiny
from attention_jax import config as config_lib
from attention_jax import main, steps, train
from attention_jax.data import loaders
from attention_jax.errors import ConfigError
from attention_jax.models import losses
from attention_jax.models.losses import token_cross_entropy
from attention_jax.tasks import TASKS
from helpers import shrink

DIGITS_TEST = 359  # images in the digits test split


def _vit_config(data_dir, **overrides):
    """The shipped vit_digits config at a tiny size: 2 steps, evaluated at the end over
    the whole test split (eval.steps=0)."""
    c = shrink(config_lib.load("vit_digits"), data_dir)
    c.mesh.num_devices = 0  # every device: these tests evaluate on one and on eight
    c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.mlp_dim = 16, 1, 2, 32
    c.train.steps, c.train.checkpoint_every = 2, 2
    c.eval.every, c.eval.steps = 0, 0
    config_lib.apply_overrides(c, overrides)
    return c


def _digits(task):
    """All eval images [359, 8, 8, 1] and labels [359], in split order."""
    examples = [task.eval_transform(task.eval_source[i], None) for i in range(len(task.eval_source))]
    return (np.stack([e["image"] for e in examples]),
            np.array([e["label"] for e in examples], np.int32))


def _per_image(task, params, images, labels):
    """(correct [N] bool, negative log-likelihood [N] float64) of each image, computed
    on the host with the model's own apply: no loader, no padding, no batching."""
    logits = np.asarray(task.model.apply({"params": params}, images)[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return logits.argmax(-1) == labels, -logp[np.arange(len(labels)), labels]


@pytest.mark.parametrize("devices,batch_size", [(1, 48), (8, 40)])
def test_vit_eval_counts_every_test_image(data_dir, tmp_path, devices, batch_size):
    """359 = 7×48 + 23 = 8×40 + 39: the last batch is partial on either mesh."""
    assert DIGITS_TEST % batch_size
    mesh = {"mesh.num_devices": 1} if devices == 1 else {"mesh.data": 8}
    config = _vit_config(data_dir, **{"eval.batch_size": batch_size, **mesh})
    workdir = str(tmp_path / "run")
    summary = train.train_and_evaluate(config, workdir)
    assert len(jax.tree.leaves(summary["state"]["params"])[0].sharding.device_set) == devices
    metrics = summary["eval"]
    assert metrics["examples"] == DIGITS_TEST

    params = jax.device_get(summary["state"]["params"])
    task = TASKS["vit"](config, workdir)
    images, labels = _digits(task)
    assert len(labels) == DIGITS_TEST
    correct, nll = _per_image(task, params, images, labels)
    # accuracy × 359 is the number of correct images, to float rounding.
    assert metrics["accuracy"] * DIGITS_TEST == pytest.approx(correct.sum(), abs=1e-3)
    assert metrics["loss"] == pytest.approx(nll.mean(), rel=1e-5)

    if devices == 8:  # --mode=eval goes through the same evaluation
        again = main.evaluate_checkpoint(config, workdir)
        assert again["examples"] == DIGITS_TEST
        assert again["accuracy"] == pytest.approx(metrics["accuracy"], rel=1e-6)
        assert again["loss"] == pytest.approx(metrics["loss"], rel=1e-6)


def _setup_eval(config, workdir):
    """(evaluate(config) -> metrics, task, host params): freshly initialised params of
    the run `config` describes, evaluated with the trainer's own jitted eval step."""
    prepared = train.setup(config, workdir, read_only=True)
    params = prepared.init_state()["params"]

    def evaluate(cfg):
        with jax.set_mesh(prepared.mesh), nn.logical_axis_rules(prepared.rules):
            eval_step = steps.jit_eval_step(prepared.task, cfg, prepared.mesh,
                                            prepared.shardings["params"])
            return steps.evaluate(eval_step, params, prepared.task, cfg, prepared.mesh)

    return evaluate, prepared.task, jax.device_get(params)


def test_eval_steps_evaluates_exactly_that_many_batches(data_dir, tmp_path):
    config = _vit_config(data_dir, **{"eval.batch_size": 40, "mesh.data": 8})
    evaluate, task, params = _setup_eval(config, str(tmp_path))
    images, labels = _digits(task)
    correct, nll = _per_image(task, params, images, labels)
    # 8 whole batches = 320 images; the 9th is the partial one (39 images); more steps
    # than the split has batches: the whole split, once.
    for eval_steps, examples in [(1, 40), (3, 120), (8, 320), (9, 359), (100, 359)]:
        metrics = evaluate(_vit_config(data_dir, **{"eval.batch_size": 40, "mesh.data": 8,
                                                    "eval.steps": eval_steps}))
        assert metrics["examples"] == examples, eval_steps
        assert metrics["accuracy"] * examples == pytest.approx(correct[:examples].sum(), abs=1e-3)
        assert metrics["loss"] == pytest.approx(nll[:examples].mean(), rel=1e-5)
    # A split smaller than one eval batch is evaluated too: one batch, 153 rows of padding.
    metrics = evaluate(_vit_config(data_dir, **{"eval.batch_size": 512, "mesh.data": 8}))
    assert metrics["examples"] == DIGITS_TEST
    assert metrics["accuracy"] * DIGITS_TEST == pytest.approx(correct.sum(), abs=1e-3)
    assert metrics["loss"] == pytest.approx(nll.mean(), rel=1e-5)


def test_gpt_eval_loss_is_the_token_weighted_mean_over_the_split(data_dir, tmp_path):
    c = shrink(config_lib.load("gpt"), data_dir)
    c.train.steps = 2
    # Two data-parallel devices: the shrunk split's few rows (8) in batches of 6, the
    # second one 2 rows and 4 of padding.
    c.mesh.num_devices, c.eval.batch_size = 2, 6
    c.eval.every, c.eval.steps = 0, 0
    workdir = str(tmp_path / "run")
    task = TASKS["gpt"](c, workdir)
    rows = len(task.eval_source)
    assert rows % c.eval.batch_size and rows > c.eval.batch_size
    summary = train.train_and_evaluate(c, workdir)
    metrics = summary["eval"]

    # Every validation row once, as the eval loader transforms it (one row per batch:
    # the same (seed, index) stream, no padding), through the model on the host.
    batch = {k: np.concatenate([b[k] for b in loaders.Loader(
        task.eval_source, global_batch_size=1, seed=c.train.seed, shuffle=False, num_epochs=1,
        transform=task.eval_transform, process_index=0, process_count=1)])
        for k in ("inputs", "targets", "weights", "positions", "segment_ids")}
    assert len(batch["inputs"]) == rows
    params = jax.device_get(summary["state"]["params"])
    logits, _ = task.model.apply({"params": params}, batch["inputs"],
                                 positions=batch["positions"], segment_ids=batch["segment_ids"])
    nll = np.asarray(token_cross_entropy(logits, batch["targets"]), np.float64)
    w = batch["weights"].astype(np.float64)
    correct = np.asarray(logits).argmax(-1) == batch["targets"]
    assert metrics["examples"] == rows
    assert metrics["tokens"] == w.sum()
    assert metrics["loss"] == pytest.approx((nll * w).sum() / w.sum(), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx((correct * w).sum() / w.sum(), rel=1e-5)
    # The old estimate, a mean of per-batch means, is a different number here: the
    # comparison above can tell them apart.
    size = c.eval.batch_size
    per_batch = [(nll * w)[i:i + size].sum() / w[i:i + size].sum() for i in range(0, rows, size)]
    assert abs(np.mean(per_batch) - metrics["loss"]) > 1e-5 * metrics["loss"]


def test_a_loss_that_ignores_example_weights_is_refused_only_with_a_partial_batch(tmp_path):
    """tests/system/tiny.py's loss does not weight by example: its full batches evaluate
    as before (a mean of equal batches); a padded one would count padding, so it is an
    error naming the ways out."""
    config = tiny.tiny_config(**{"eval.steps": 0, "eval.batch_size": 48})  # 256 = 5×48 + 16
    evaluate, _, _ = _setup_eval(config, str(tmp_path))
    with pytest.raises(ConfigError, match=r"ignores batch\['example_weight'\].*"
                                          r"config.eval.steps <= 5"):
        evaluate(config)
    metrics = evaluate(tiny.tiny_config(**{"eval.steps": 5, "eval.batch_size": 48}))
    assert metrics["examples"] == 240 and np.isfinite(metrics["loss"])
    assert "tokens" not in metrics  # no weight reported: no token count to claim


@pytest.mark.parametrize("name,overrides", [
    ("gpt", {"train.loss_chunk_size": 8}),  # the chunked head's loss
    # rnn_seq2seq: the translation families' one loss (encdec shares it).
    ("bert_mlm", {"data.vocab_size": 300, "data.seq_len": 64}), ("rnn_seq2seq", {}),
    ("inductive_bias:model=cnn", {})])
def test_every_family_loss_weighs_a_padding_row_zero(data_dir, tmp_path, name, overrides):
    """A batch of real rows and a copy weighted 0 (as evaluate pads) gives the loss and
    metrics of the real rows alone, and reports their total weight."""
    config = shrink(config_lib.load(name), data_dir)
    config_lib.apply_overrides(config, overrides)
    task = TASKS[config.task](config, str(tmp_path))
    n = min(3, len(task.eval_source))  # the shrunk BERT split has only a few rows
    rows = next(iter(loaders.Loader(task.eval_source, global_batch_size=n, shuffle=False,
                                    num_epochs=1, transform=task.eval_transform,
                                    process_index=0, process_count=1)))
    padded = {k: np.concatenate([v, v[:1]]) for k, v in rows.items()}
    padded[loaders.EXAMPLE_WEIGHT] = np.array([1] * n + [0], np.float32)
    params = nn.meta.unbox(jax.jit(task.init)(jax.random.PRNGKey(0)))  # one compile
    loss = jax.jit(lambda p, b: task.loss(p, b, jax.random.PRNGKey(1), False))
    want_loss, want = loss(params, rows)
    got_loss, got = loss(params, padded)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert losses.WEIGHT not in want  # training batches: the metrics as before
    total = float(got.pop(losses.WEIGHT))
    assert set(got) == set(want)
    for k in want:
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-5, abs=1e-7), k
    weights = {"gpt": "weights", "bert_mlm": "weights", "encdec": "target_weights",
               "rnn_seq2seq": "target_weights"}.get(config.task)
    assert total == (rows[weights].sum() if weights else n)


def _tiny_moe(data_dir, workdir, overrides=(), **fields):
    """The tiny MoE GPT's task (GPTConfig `fields` set on its config), its first eval
    batch of 2 and its initial params."""
    config = shrink(config_lib.load("gpt:variant=gpt-tiny-moe", ["model.num_heads=2",
                                                                 *overrides]), data_dir)
    for name, value in fields.items():  # GPTConfig fields the shipped config leaves out
        config.model[name] = value
    task = TASKS[config.task](config, str(workdir))
    batch = next(iter(loaders.Loader(task.eval_source, global_batch_size=2, shuffle=False,
                                     num_epochs=1, transform=task.eval_transform,
                                     process_index=0, process_count=1)))
    return task, batch, nn.meta.unbox(jax.jit(task.init)(jax.random.PRNGKey(0)))


def test_an_moe_gpt_s_eval_loss_is_the_tokens_nll_without_the_balance_loss(data_dir, tmp_path):
    """The routers' balance loss is added to what an MoE GPT trains on, not to what its
    evaluation reports: eval's loss (and perplexity, its exp) was the NLL plus
    moe_loss_weight × the balance loss, so a larger weight read as a worse model."""
    got = {}
    for weight in (0.0, 1.0):
        task, batch, params = _tiny_moe(data_dir, tmp_path / str(weight), moe_loss_weight=weight)
        loss = jax.jit(task.loss, static_argnums=3)
        got[weight] = [float(loss(params, batch, jax.random.PRNGKey(1), train)[0])
                       for train in (False, True)]
    assert got[1.0][0] == pytest.approx(got[0.0][0], rel=1e-6)  # eval: the NLL alone
    assert got[1.0][1] > got[0.0][1] + 0.5  # training: + the balance loss (>= 1 per layer)


def test_an_moe_gpt_s_stream_padding_moves_neither_its_loss_nor_its_router_metrics(
        data_dir, tmp_path):
    """data.packing="stream" rows carry no segment ids, so their padding (a split's
    last row, an eval batch's padding copies) reached the MoE unmarked: it took expert
    slots and counted in the router metrics and the balance loss trained on. The task
    now masks it (text.moe_token_mask): whatever the padding holds, the training loss
    and every metric stay the same."""
    task, batch, params = _tiny_moe(data_dir, tmp_path, ["data.packing=stream"])
    assert "segment_ids" not in batch
    # Row 1 padded after its 10th token, as next_token_targets weights a stream's tail.
    batch["weights"][1, 9:] = 0.0
    runs = []
    for fill in (0, 5):
        padded = {**batch, "inputs": batch["inputs"].copy()}
        padded["inputs"][1, 10:] = fill
        loss, metrics = task.loss(params, padded, jax.random.PRNGKey(1), True)
        runs.append((float(loss), {k: float(v) for k, v in metrics.items()}))
    (loss_a, metrics_a), (loss_b, metrics_b) = runs
    assert any(k.startswith("moe/") for k in metrics_a)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for k in metrics_a:
        assert metrics_a[k] == pytest.approx(metrics_b[k], rel=1e-5, abs=1e-7), k


def test_an_moe_gpt_trains_on_router_z_loss_weight_times_the_z_loss(data_dir, tmp_path):
    """config.model.router_z_loss_weight (ST-MoE's 1e-3; default 0) adds exactly that
    multiple of the routers' z-loss, summed over layers, to the training loss, and
    nothing to eval's."""
    got, z = {}, None
    for weight in (0.0, 0.5):
        task, batch, params = _tiny_moe(data_dir, tmp_path / str(weight),
                                        router_z_loss_weight=weight)
        loss = jax.jit(task.loss, static_argnums=3)
        got[weight] = [float(loss(params, batch, jax.random.PRNGKey(1), train)[0])
                       for train in (False, True)]
        if weight == 0.0:
            aux = task.model.apply({"params": params}, batch["inputs"],
                                   positions=batch["positions"],
                                   segment_ids=batch["segment_ids"])[1]
            z = float(np.sum(aux["layers"]["moe"]["router_z_loss"]))
    assert z > 0
    assert got[0.5][0] == pytest.approx(got[0.0][0], rel=1e-6)  # eval: the NLL alone
    assert got[0.5][1] - got[0.0][1] == pytest.approx(0.5 * z, rel=1e-4)
