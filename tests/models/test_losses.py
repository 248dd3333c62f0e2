"""models/losses.py: the one cross-entropy (masks, label smoothing, accuracy) and the one
shift_right, checked against the formulas written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models.losses import cross_entropy, shift_right, token_cross_entropy

TGT = np.array([[3, 4, 0, 0], [5, 6, 7, 0]])  # 0 is padding: 5 real tokens


def _logits():
    return jax.random.normal(jax.random.key(1), (2, 4, 8))


def test_cross_entropy_averages_over_weighted_positions_only():
    logits = _logits()
    loss, metrics = cross_entropy(logits, TGT, TGT != 0)
    logp = np.asarray(jax.nn.log_softmax(logits))
    real = [(b, t) for b in range(2) for t in range(4) if TGT[b, t]]
    manual = -sum(logp[b, t, TGT[b, t]] for b, t in real) / len(real)
    np.testing.assert_allclose(float(loss), manual, rtol=1e-6)
    hits = sum(int(np.argmax(logp[b, t]) == TGT[b, t]) for b, t in real)
    np.testing.assert_allclose(float(metrics["accuracy"]), hits / len(real), rtol=1e-6)
    unweighted, _ = cross_entropy(logits, TGT)
    np.testing.assert_allclose(float(unweighted), -np.mean(
        np.take_along_axis(logp, TGT[..., None], -1)), rtol=1e-6)
    # Uniform weights are the unweighted mean, whatever their size: weights of 0.1 (Σw
    # 0.8) gave 0.8 of it, divided by max(Σw, 1); none counting gives 0, not NaN.
    tenth, _ = cross_entropy(logits, TGT, jnp.full(TGT.shape, 0.1))
    np.testing.assert_allclose(float(tenth), float(unweighted), rtol=1e-6)
    none, _ = cross_entropy(logits, TGT, jnp.zeros(TGT.shape))
    assert float(none) == 0.0


def test_label_smoothing_mixes_in_the_uniform_distribution():
    logits, eps, v = _logits(), 0.1, 8
    logp = np.asarray(jax.nn.log_softmax(logits))
    soft = (1 - eps) * np.eye(v)[TGT] + eps / v
    np.testing.assert_allclose(np.asarray(token_cross_entropy(logits, TGT, eps)),
                               -(soft * logp).sum(-1), rtol=1e-5)
    with pytest.raises(ValueError, match="label_smoothing=1.5; valid: 0 <= label_smoothing < 1"):
        token_cross_entropy(logits, TGT, 1.5)


def test_cross_entropy_is_float32_for_bfloat16_logits():
    loss, _ = cross_entropy(_logits().astype(jnp.bfloat16), TGT, TGT != 0)
    assert loss.dtype == jnp.float32


def test_shift_right_on_numpy_and_inside_jit():
    want = [[1, 3, 4, 0], [1, 5, 6, 7]]
    host = shift_right(TGT, bos_id=1)
    assert isinstance(host, np.ndarray) and host.dtype == TGT.dtype
    np.testing.assert_array_equal(host, want)
    np.testing.assert_array_equal(jax.jit(shift_right, static_argnums=1)(jnp.asarray(TGT), 1), want)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_matches_the_float64_formula(smoothing, dtype):
    """The custom VJP's dlogits = (softmax - q)·w/Σw, in the logits' dtype, against the
    same derivative written out in float64 numpy (and a -inf logit stays at zero)."""
    logits = np.asarray(_logits(), np.float64) * 3.0
    logits[0, 0, 1] = -np.inf  # a masked vocabulary entry
    x = jnp.asarray(logits, dtype)
    weights = (TGT != 0).astype(np.float64)
    grad = jax.grad(lambda z: cross_entropy(z, TGT, TGT != 0, smoothing)[0])(x)
    assert grad.dtype == jnp.dtype(dtype)
    z = np.asarray(x.astype(jnp.float32), np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = (1 - smoothing) * np.eye(8)[TGT] + smoothing / 8
    want = (p - q) * (weights / weights.sum())[..., None]
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(grad, np.float64), want, atol=tol, rtol=tol)
    assert np.isfinite(np.asarray(grad, np.float64)).all()
    if not smoothing:  # the masked entry leaves the loss finite and exact
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        want_loss = -(np.take_along_axis(logp, TGT[..., None], -1)[..., 0] * weights).sum()
        np.testing.assert_allclose(float(cross_entropy(x, TGT, TGT != 0)[0]),
                                   want_loss / weights.sum(), rtol=tol)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_vocabulary_split_over_devices_gives_the_one_device_values(smoothing):
    """Logits [B, T, V] split over batch, length and vocabulary (2 × 2 × 2 devices):
    the one-pass reduction over V and its gradient equal the unsplit ones."""
    import flax.linen as nn
    from attention_jax import sharding
    logits = jax.random.normal(jax.random.key(2), (4, 16, 32)) * 2.0
    targets = jax.random.randint(jax.random.key(3), (4, 16), 0, 32)
    weights = jax.random.uniform(jax.random.key(4), (4, 16)) > 0.3
    fn = jax.jit(jax.value_and_grad(
        lambda z, y, w: cross_entropy(z, y, w, smoothing)[0]))
    want_loss, want_grad = fn(logits, targets, weights)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "sequence": 2, "tensor": 2},
                              jax.devices()[:8])
    spec = lambda *names: jax.sharding.NamedSharding(mesh, nn.logical_to_mesh_axes(names))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        z = jax.device_put(logits, spec("batch", "length", "vocab"))
        assert z.addressable_shards[0].data.shape == (2, 8, 16)
        loss, grad = fn(z, jax.device_put(targets, spec("batch", "length")),
                        jax.device_put(weights, spec("batch", "length")))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-7)


def test_accuracy_is_argmax_even_with_ties():
    """Equal logits (a zero-initialised head): argmax is index 0, so only targets 0 count
    as correct; a tie between the target and an earlier index is a miss, with a later one
    a hit."""
    _, m = cross_entropy(jnp.zeros((2, 4, 8)), TGT)
    assert float(m["accuracy"]) == np.mean(TGT == 0)
    logits = jnp.zeros((1, 2, 8)).at[0, :, 2].set(1.0).at[0, :, 5].set(1.0)
    targets = np.array([[2, 5]])  # the max is at 2 and 5: argmax is 2
    _, m = cross_entropy(logits, targets)
    assert float(m["accuracy"]) == 0.5


def test_targets_outside_the_classes_are_named_unless_weighted_out():
    """A target of PyTorch's ignore_index (-100), or past the vocabulary, added its row's
    logsumexp to the mean with nothing said (1.71 against the valid positions' 0.91)."""
    from attention_jax.models.losses import head_cross_entropy
    logits = _logits()  # 8 classes
    for bad, value in ((np.where(TGT == 0, -100, TGT), -100), (TGT + 5, 8)):
        with pytest.raises(ValueError, match=rf"targets: {value} is not a class of the 8 "
                                             rf"logits at a position that counts; valid: 0..7 "
                                             rf"\(to leave a position out, e.g. PyTorch's "
                                             rf"ignore_index -100, give it weight 0\)"):
            cross_entropy(logits, jnp.asarray(bad))
    ignored = np.where(TGT == 0, -100, TGT)  # weight 0 where -100: the valid positions' loss
    loss, _ = cross_entropy(logits, jnp.asarray(ignored), TGT != 0)
    np.testing.assert_allclose(float(loss), float(cross_entropy(logits, TGT, TGT != 0)[0]),
                               rtol=1e-6)
    hidden, kernel = jnp.ones((2, 4, 3)), jnp.ones((3, 8))
    with pytest.raises(ValueError, match=r"targets: 9 is not a class of the 8 logits"):
        head_cross_entropy(hidden, kernel, jnp.asarray(TGT + 6))
    from attention_jax.models.losses import chunked_head_cross_entropy
    with pytest.raises(ValueError, match=r"targets: -100 is not a class of the 8 logits"):
        chunked_head_cross_entropy(hidden, kernel, jnp.asarray(np.where(TGT == 0, -100, TGT)),
                                   chunk_size=2)
    jax.jit(cross_entropy)(logits, jnp.asarray(TGT + 5))  # traced: the caller's to check


def test_targets_and_weights_of_another_shape_are_named():
    """Weights of another shape were a NumPy broadcast error (or, where they broadcast, a
    mean over the wrong count); targets of another shape broadcast against the logits."""
    logits = _logits()  # [2, 4, 8]
    with pytest.raises(ValueError, match=r"^weights has shape \(2, 3\); valid: \(2, 4\), the "
                                         r"targets' \(one weight a target\)$"):
        cross_entropy(logits, TGT, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"^weights has shape \(2, 1\); valid: \(2, 4\)"):
        cross_entropy(logits, TGT, jnp.ones((2, 1)))
    with pytest.raises(ValueError, match=r"^targets has shape \(2, 1\); valid: \(2, 4\) "
                                         r"\(logits' leading axes"):
        cross_entropy(logits, TGT[:, :1])


def test_float_targets_are_named_not_cut_to_ints():
    """Float targets were cut to ints with nothing said (2.7 read as class 2), where the
    chunked loss refused them; class ids in a float array are now refused alike."""
    from attention_jax.models.losses import head_cross_entropy
    logits = _logits()  # [2, 4, 8]
    floats = jnp.asarray(TGT, jnp.float32) + 0.7
    message = r"^targets has dtype float32; valid: an integer dtype"
    with pytest.raises(ValueError, match=message):
        cross_entropy(logits, floats)
    with pytest.raises(ValueError, match=message):
        jax.jit(cross_entropy)(logits, floats)  # the dtype is known when tracing
    with pytest.raises(ValueError, match=message):
        token_cross_entropy(logits, floats)
    with pytest.raises(ValueError, match=message):
        head_cross_entropy(jnp.ones((2, 4, 3)), jnp.ones((3, 8)), floats)
    np.testing.assert_allclose(  # bool labels are the classes 0 and 1
        cross_entropy(logits, TGT > 2)[0], cross_entropy(logits, (TGT > 2).astype(int))[0])


def test_the_chunked_loss_takes_bool_targets_as_the_others_do():
    """Bools are the classes 0 and 1 in every loss: the chunked head refused them."""
    from attention_jax.models.losses import chunked_head_cross_entropy
    hidden = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 3))
    kernel = jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    labels = TGT > 2
    loss, metrics = chunked_head_cross_entropy(hidden, kernel, labels, chunk_size=3)
    want, want_metrics = cross_entropy(hidden @ kernel, labels.astype(int))
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], want_metrics["accuracy"])
    with pytest.raises(ValueError, match=r"^targets has dtype float32; valid: an integer"):
        chunked_head_cross_entropy(hidden, kernel, labels.astype(np.float32), chunk_size=3)


def test_negative_or_nan_weights_are_named():
    """A negative weight pushed the mean's loss the wrong way and a NaN one made it NaN,
    both unsaid; weights known when the loss is called (eagerly) are checked."""
    logits, weights = _logits(), np.ones(TGT.shape, np.float32)
    for bad in (-1.0, np.nan):
        weights[1, 2] = bad
        with pytest.raises(ValueError, match=r"^weights: (-1.0|nan) is a weight; valid: "
                                             r"finite and >= 0"):
            cross_entropy(logits, TGT, weights)
    weights[1, 2] = 0.0
    cross_entropy(logits, TGT, weights)  # zeros leave positions out
