"""models/losses.py chunked_head_cross_entropy: the LM head and the cross-entropy a chunk
of positions at a time. Loss, accuracy and gradients against a float64 reference
(autodiff of the written-out formula), bfloat16 against float32, the compiled memory
against the whole-logits path, the GPT task with train.loss_chunk_size (and with
train.loss_kernel="pallas") against the whole-logits loss, a mesh that splits the vocabulary (and the length) against one
device, and the errors."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load, shrink

from attention_jax import sharding, tasks
from attention_jax.layers.linear import matmul
from attention_jax.models.gpt import GPT, GPTConfig, lm_head_weights
from attention_jax.models.losses import chunked_head_cross_entropy, cross_entropy
from attention_jax import config as config_lib
from attention_jax import workdir as workdir_lib
from attention_jax.errors import ConfigError


def _inputs(b=2, t=12, d=8, v=24, seed=0, zero_weights=True):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    kernel = (rng.normal(size=(d, v)) / np.sqrt(d)).astype(np.float32)
    bias = rng.normal(size=(v,)).astype(np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    weights = (rng.random((b, t)) > 0.3).astype(np.float32) if zero_weights else np.ones((b, t), np.float32)
    return hidden, kernel, bias, targets, weights


def _reference(hidden, kernel, bias, targets, weights, smoothing):
    """Loss, accuracy and d(loss)/d(hidden, kernel, bias) in float64: jax autodiff of
    -Σ_i w_i Σ_v q_iv log softmax(h_i·K + b)_v / Σ w, q = (1-ε)·onehot + ε/V."""
    with jax.enable_x64(True):
        v = kernel.shape[1]
        q = (1 - smoothing) * np.eye(v)[targets] + smoothing / v
        w = np.asarray(weights, np.float64)

        def loss(h, k, b):
            logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, k) + b, axis=-1)
            return -jnp.sum(w[..., None] * q * logp) / max(w.sum(), 1.0)

        args = [jnp.asarray(x, jnp.float64) for x in (hidden, kernel, bias)]
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
        logits = np.asarray(hidden, np.float64) @ kernel + bias
        accuracy = np.sum(w * (logits.argmax(-1) == targets)) / max(w.sum(), 1.0)
        return float(value), float(accuracy), [np.asarray(g) for g in grads]


def _chunked(hidden, kernel, bias, targets, weights, chunk_size, smoothing=0.0):
    def f(h, k, b):
        return chunked_head_cross_entropy(h, k, targets, weights, bias=b, chunk_size=chunk_size,
                                          label_smoothing=smoothing)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        hidden, kernel, bias)
    return loss, metrics, grads


@pytest.mark.parametrize("t, chunk_size, smoothing, zero_weights", [
    (12, 4, 0.0, True),    # T divisible by the chunk, padding positions weighted 0
    (13, 4, 0.0, True),    # not divisible: a padded last round
    (13, 5, 0.1, False),   # label smoothing
    (12, 1, 0.1, True),    # one position per chunk
    (12, 64, 0.0, True),   # chunk_size >= T: one chunk
])
def test_loss_accuracy_and_grads_match_the_float64_reference(t, chunk_size, smoothing, zero_weights):
    hidden, kernel, bias, targets, weights = _inputs(t=t, zero_weights=zero_weights)
    loss, metrics, grads = _chunked(hidden, kernel, bias, targets, weights, chunk_size, smoothing)
    ref_loss, ref_accuracy, ref_grads = _reference(hidden, kernel, bias, targets, weights, smoothing)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["accuracy"]), ref_accuracy, rtol=1e-6)
    for name, got, want in zip(("hidden", "kernel", "bias"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7, err_msg=name)
    # The evaluation path (no differentiation: the plain scan, not the fused forward).
    value, m = jax.jit(lambda h: chunked_head_cross_entropy(
        h, kernel, targets, weights, bias=bias, chunk_size=chunk_size,
        label_smoothing=smoothing))(hidden)
    np.testing.assert_allclose(float(value), ref_loss, rtol=1e-6)
    np.testing.assert_allclose(float(m["accuracy"]), ref_accuracy, rtol=1e-6)


def test_equals_cross_entropy_without_bias_or_weights_and_with_all_weights_zero():
    hidden, kernel, _, targets, weights = _inputs(t=10)
    loss, m = chunked_head_cross_entropy(hidden, kernel, targets, chunk_size=3)
    want, want_m = cross_entropy(hidden @ kernel, targets)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(float(m["accuracy"]), float(want_m["accuracy"]), rtol=1e-6)
    # No weighted position: 0 (cross_entropy divides by max(Σw, 1)), and zero gradients.
    f = lambda h: chunked_head_cross_entropy(h, kernel, targets, 0 * weights, chunk_size=3)[0]
    value, grad = jax.value_and_grad(f)(hidden)
    assert float(value) == 0.0 and not np.any(np.asarray(grad))


def test_gradients_scale_with_the_cotangent():
    """The backward pass scales the stored pieces: d(3·loss) = 3·d(loss)."""
    hidden, kernel, bias, targets, weights = _inputs(t=9)
    f = lambda h, k: chunked_head_cross_entropy(h, k, targets, weights, chunk_size=4)[0]
    g1 = jax.grad(f, argnums=(0, 1))(hidden, kernel)
    g3 = jax.grad(lambda h, k: 3.0 * f(h, k), argnums=(0, 1))(hidden, kernel)
    for a, b in zip(g1, g3, strict=True):
        np.testing.assert_allclose(np.asarray(b), 3 * np.asarray(a), rtol=1e-6, atol=1e-8)


def test_bfloat16_inputs_match_the_float32_path():
    hidden, kernel, bias, targets, weights = _inputs(t=16, d=32, v=64)
    loss32, m32, g32 = _chunked(hidden, kernel, bias, targets, weights, 8)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (hidden, kernel, bias)]
    loss16, m16, g16 = _chunked(*bf, targets, weights, 8)
    assert loss16.dtype == jnp.float32  # the statistics stay float32
    assert [g.dtype for g in g16] == [jnp.bfloat16] * 3
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=2e-2)
    for a, b in zip(g16, g32, strict=True):
        scale = np.abs(np.asarray(b)).max()
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=3e-2 * scale)


def _temp_bytes(fn, *shapes):
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_is_far_below_the_whole_logits():
    """B=2, T=512, V=8192: the whole float32 logits are 32 MiB; with 128 positions per
    chunk, value_and_grad needs a fraction of that (one chunk's logits and gradient, 8 MiB
    each) and less than half of what the whole-logits path needs."""
    b, t, d, v = 2, 512, 64, 8192
    shapes = (jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
              jax.ShapeDtypeStruct((b, t), jnp.int32))
    whole = _temp_bytes(jax.value_and_grad(
        lambda h, k, y: cross_entropy(matmul(h, k), y)[0], argnums=(0, 1)), *shapes)
    chunked = _temp_bytes(jax.value_and_grad(
        lambda h, k, y: chunked_head_cross_entropy(h, k, y, chunk_size=128)[0], argnums=(0, 1)),
        *shapes)
    logits_bytes = b * t * v * 4
    assert whole >= logits_bytes  # the whole path does build the logits
    assert chunked < 0.6 * logits_bytes and chunked < 0.5 * whole, (chunked, whole, logits_bytes)


def _mesh(data, sequence, tensor):
    return sharding.make_mesh({"data": data, "fsdp": 1, "sequence": sequence, "tensor": tensor},
                              jax.devices()[:data * sequence * tensor])


@pytest.mark.parametrize("data, sequence, tensor, chunk_size", [
    (4, 1, 2, 4), (2, 2, 2, 4),
    (2, 2, 2, 3),  # chunks of 3 positions on a length split in two (XLA pads the split)
])
def test_a_mesh_splitting_the_vocabulary_gives_the_one_device_values(data, sequence, tensor,
                                                                     chunk_size):
    hidden, kernel, bias, targets, weights = _inputs(b=4, t=16, d=8, v=32)
    want_loss, want_m, want_g = _chunked(hidden, kernel, bias, targets, weights, chunk_size, 0.1)
    mesh = _mesh(data, sequence, tensor)
    spec = lambda *names: jax.sharding.NamedSharding(mesh, nn.logical_to_mesh_axes(names))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        placed = (jax.device_put(hidden, spec("batch", "length", "embed")),
                  jax.device_put(kernel, spec("embed", "vocab")),
                  jax.device_put(bias, spec("vocab")))
        assert placed[1].addressable_shards[0].data.shape == (8, 32 // tensor)  # V split
        y = jax.device_put(targets, spec("batch", "length"))
        w = jax.device_put(weights, spec("batch", "length"))
        loss, m, grads = _chunked(*placed, y, w, chunk_size, 0.1)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(float(m["accuracy"]), float(want_m["accuracy"]), rtol=1e-6)
    for a, b in zip(grads, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_the_kernel_gradient_is_reduced_over_the_batch_once_not_per_chunk():
    """Batch split in 4, vocabulary in 2: no all-reduce of the [D, V/2] weight-gradient
    shard inside the chunk loop (each batch shard keeps its own partial sum), one after."""
    hidden, kernel, bias, targets, weights = _inputs(b=8, t=16, d=16, v=64)
    mesh = _mesh(4, 1, 2)
    spec = lambda *names: jax.sharding.NamedSharding(mesh, nn.logical_to_mesh_axes(names))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        h = jax.device_put(hidden, spec("batch", "length", "embed"))
        k = jax.device_put(kernel, spec("embed", "vocab"))
        y = jax.device_put(targets, spec("batch", "length"))
        grad = jax.jit(jax.grad(lambda h, k: chunked_head_cross_entropy(h, k, y, chunk_size=4)[0],
                                argnums=(0, 1)))
        hlo = grad.lower(h, k).compile().as_text()
    reductions = [line for line in hlo.splitlines()
                  if "all-reduce(" in line and "16,32]" in line.split("all-reduce(")[0]]  # [.., D, V/2]
    assert reductions and not [r for r in reductions if "while/body" in r], reductions


@pytest.mark.parametrize("variant", ["gpt-tiny", "gpt-tiny-rope"])  # tied; untied head
def test_gpt_hidden_times_the_head_weights_are_its_logits(variant):
    cfg = GPTConfig.from_variant(variant, num_layers=1)
    model = GPT(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    # init with return_hidden still creates the head's parameters
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens, return_hidden=True)["params"])
    assert ("lm_head" in params) == (not cfg.tie_embeddings)
    logits, aux = model.apply({"params": params}, tokens)
    hidden, hidden_aux = model.apply({"params": params}, tokens, return_hidden=True)
    assert hidden.shape == (2, 8, cfg.d_model) and set(hidden_aux) == set(aux)
    kernel, bias = lm_head_weights(params, cfg)
    assert kernel.shape == (cfg.d_model, cfg.vocab_size) and bias is None
    np.testing.assert_allclose(np.asarray(hidden @ kernel), np.asarray(logits), rtol=1e-5, atol=1e-5)
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")
    assert lm_head_weights(params, bf16)[0].dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("model", [{}, {"tie_embeddings": False, "mlp": "moe", "num_experts": 4,
                                        "top_k": 2}])
def test_gpt_task_chunked_loss_equals_the_whole_logits_loss(model, data_dir, tmp_path):
    """tasks.lm_task with train.loss_chunk_size = 8 (seq_len 32: four chunks), and with
    train.loss_kernel = "pallas" (the loss kernels, interpreted), against the whole logits:
    the same loss (with the MoE balance loss added), metrics and parameter gradients, for
    a tied head, and an untied one in an MoE model; with label smoothing; and the
    evaluation path."""
    def task_and_loss(chunk, kernel="auto"):
        c = shrink(load("gpt").get_config(), data_dir)
        c.model.update(model)
        c.optim.label_smoothing = 0.1
        c.train.loss_chunk_size = chunk
        c.train.loss_kernel = kernel
        task = tasks.TASKS[c.task](c, str(tmp_path))
        return task, jax.jit(jax.value_and_grad(lambda p, b: task.loss(p, b, jax.random.key(0), True),
                                                has_aux=True))

    task, whole = task_and_loss(0)
    params = nn.meta.unbox(jax.jit(task.init)(jax.random.key(1)))
    assert ("lm_head" in params) == (model.get("tie_embeddings") is False)
    rng = np.random.default_rng(0)
    examples = [task.train_transform(task.train_source[i], rng) for i in range(3)]
    batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    assert batch["weights"].shape[1] == 32
    (want, want_m), want_g = whole(params, batch)
    for changed in (task_and_loss(8), task_and_loss(0, "pallas")):  # chunked; the loss kernels
        _check_same_loss(changed, params, batch, (want, want_m), want_g, model)
    eval_loss = lambda t: float(jax.jit(t.loss, static_argnums=3)(params, batch, jax.random.key(0),
                                                                  False)[0])
    np.testing.assert_allclose(eval_loss(task_and_loss(8)[0]), eval_loss(task), rtol=1e-5)
    np.testing.assert_allclose(eval_loss(task_and_loss(0, "pallas")[0]), eval_loss(task), rtol=1e-5)


def _check_same_loss(task_and_step, params, batch, want_loss, want_g, model):
    (want, want_m) = want_loss
    (got, got_m), got_g = task_and_step[1](params, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    assert set(got_m) == set(want_m)
    for k in want_m:
        np.testing.assert_allclose(np.asarray(got_m[k]), np.asarray(want_m[k]), rtol=1e-5, atol=1e-7)
    if "mlp" in model:
        assert {"moe/load_balance_loss", "moe/router_z_loss"} <= set(got_m)
        assert float(got_m["moe/router_z_loss"]) > 0
    flat_want = jax.tree_util.tree_flatten_with_path(want_g)[0]
    for (path, a), b in zip(flat_want, jax.tree.leaves(got_g), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("change, match", [
    (dict(chunk_size=0), r"chunk_size=0; valid: an int >= 1"),
    (dict(chunk_size=2.5), r"chunk_size=2.5; valid: an int >= 1"),
    (dict(label_smoothing=1.0), r"label_smoothing=1.0; valid: 0 <= label_smoothing < 1"),
    (dict(label_smoothing=-0.1), r"label_smoothing=-0.1; valid"),
    (dict(hidden=np.zeros((2, 12), np.float32)), r"hidden has shape \(2, 12\); valid: \[B, T, D\]"),
    (dict(kernel=np.zeros((7, 24), np.float32)), r"kernel has shape \(7, 24\); valid: \[D, V\] with D = 8"),
    (dict(targets=np.zeros((2, 11), np.int32)), r"targets has shape \(2, 11\); valid: \[B, T\] = \(2, 12\)"),
    (dict(targets=np.zeros((2, 12), np.float32)), r"targets has dtype float32; valid: an integer"),
    (dict(weights=np.ones((12,), np.float32)), r"weights has shape \(12,\); valid: \[B, T\]"),
    (dict(bias=np.zeros((23,), np.float32)), r"bias has shape \(23,\); valid: \[V\] = \(24,\)"),
])
def test_bad_input_is_a_value_error_naming_the_argument(change, match):
    hidden, kernel, bias, targets, weights = _inputs(t=12)
    args = dict(hidden=hidden, kernel=kernel, targets=targets, weights=weights, bias=bias,
                chunk_size=4, label_smoothing=0.0)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        chunked_head_cross_entropy(**args)


def test_chunks_and_the_loss_kernels_are_one_or_the_other(data_dir, tmp_path):
    c = shrink(load("gpt").get_config(), data_dir)
    c.train.loss_chunk_size, c.train.loss_kernel = 8, "pallas"
    with pytest.raises(ConfigError, match=r"config.train.loss_kernel='pallas' computes the loss "
                                          r"over the whole logits.*loss_chunk_size=8.*valid"):
        tasks.TASKS[c.task](c, str(tmp_path))
    assert "train.loss_kernel" in workdir_lib.RESUME_SAFE_KEYS


def test_config_key_is_checked_and_resume_safe():
    from attention_jax import train
    c = load("gpt").get_config()
    assert c.train.loss_chunk_size == 0
    c.train.loss_chunk_size = -1
    with pytest.raises(ConfigError, match=r"config.train.loss_chunk_size=-1 .* >= 0"):
        config_lib.validate(c)
    assert "train.loss_chunk_size" in workdir_lib.RESUME_SAFE_KEYS


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_chunked_equals_whole_in_bfloat16_on_a_gpu():
    """On the GPU's bf16 dots (float32 accumulation): the chunked loss and gradients
    against the whole-logits path at a GPT-2-like head (V = 50304), and the float64
    reference at a small one."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 256, 128, 50304
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)

    def whole(h, k):
        return cross_entropy(matmul(h, k, preferred_element_type=jnp.float32), targets)[0]

    def chunked(h, k):
        return chunked_head_cross_entropy(h, k, targets, chunk_size=64)[0]

    (lw, gw), (lc, gc) = (jax.jit(jax.value_and_grad(f, (0, 1)))(hidden, kernel)
                          for f in (whole, chunked))
    assert float(lc) == pytest.approx(float(lw), rel=1e-3)
    for a, c in zip(gw, gc):
        a, c = a.astype(jnp.float32), c.astype(jnp.float32)
        assert float(jnp.linalg.norm(a - c) / jnp.linalg.norm(a)) < 2e-2
    h, k, bias, tg, w = _inputs()
    loss, _ = chunked_head_cross_entropy(jnp.asarray(h, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                                         tg, w, bias=jnp.asarray(bias), chunk_size=5)
    assert float(loss) == pytest.approx(float(_reference(h, k, bias, tg, w, 0.0)[0]), rel=2e-2)
