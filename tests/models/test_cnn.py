"""The residual CNN baseline (models/cnn.py): shapes, residual structure, training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adam_losses, assert_loss_goes_down

from attention_jax.models.cnn import CNN, VARIANTS, CNNConfig

IMAGES = jax.random.normal(jax.random.key(0), (3, 8, 8, 1))


def _model(**overrides):
    return CNN(CNNConfig.from_variant("resnet-tiny", **overrides))


def test_output_shapes_and_parameters():
    model = _model()
    params = model.init(jax.random.key(0), IMAGES)["params"]
    logits, aux = model.apply({"params": params}, IMAGES)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32
    assert aux["feature_maps"].shape == (3, 8, 8, 48) and aux["pooled"].shape == (3, 48)
    np.testing.assert_allclose(aux["pooled"], aux["feature_maps"].mean((1, 2)), rtol=1e-6)
    # 3 blocks × 2 convolutions of 3·3·48·48 weights, plus GroupNorm scales and biases.
    blocks = sum(np.size(x) for k, v in params.items() if k.startswith("block")
                 for x in jax.tree.leaves(v))
    assert blocks == 3 * (2 * 9 * 48 * 48 + 2 * 2 * 48)
    # Fully convolutional up to the pooling: any image size gives the same logits' shape.
    assert model.apply({"params": params}, jnp.zeros((2, 16, 12, 1)))[0].shape == (2, 10)


def test_convolutions_are_translation_equivariant_away_from_the_border():
    """A shifted image gives shifted feature maps (where neither the content nor the
    'SAME' padding's effect differs): the bias ViT has to learn from data."""
    model = _model(num_blocks=1, groups=1)
    img = jnp.zeros((1, 24, 24, 1)).at[0, 10:13, 10:13, 0].set(jax.random.normal(jax.random.key(1), (3, 3)))
    params = model.init(jax.random.key(0), img)["params"]
    # The stem alone (no norm): exactly equivariant in the interior.
    stem = lambda x: jax.lax.conv_general_dilated(
        x, params["stem"]["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    shifted = jnp.roll(img, 2, axis=2)
    np.testing.assert_allclose(stem(shifted)[:, :, 6:21], stem(img)[:, :, 4:19], atol=1e-6)
    # The whole network (GroupNorm over all positions is shift-invariant): the feature
    # maps shift too, where neither image's content meets the zero padding.
    maps = lambda x: model.apply({"params": params}, x)[1]["feature_maps"]
    np.testing.assert_allclose(maps(shifted)[:, :, 6:21], maps(img)[:, :, 4:19], atol=1e-5)


def test_jitted_training_steps_decrease_the_loss():
    model = _model(dropout_rate=0.1)
    params = model.init(jax.random.key(0), IMAGES)["params"]
    images = jax.random.normal(jax.random.key(5), (8, 8, 8, 1))
    labels = jnp.arange(8) % 10

    def loss_fn(p, key):
        logits, _ = model.apply({"params": p}, images, deterministic=False, rngs={"dropout": key})
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    losses = adam_losses(loss_fn, params, steps=10, lr=1e-2)
    assert_loss_goes_down(losses, by=0.5)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match=r"unknown CNN variant 'resnet-huge'; valid: \['resnet-tiny'\]"):
        CNNConfig.from_variant("resnet-huge")
    with pytest.raises(ValueError, match=r"groups=5 does not divide width=48; valid groups: \[1, 2, 3"):
        CNNConfig(groups=5)
    with pytest.raises(ValueError, match="kernel_size=4 must be odd"):
        CNNConfig(kernel_size=4)
    with pytest.raises(ValueError, match=r"num_blocks must be a positive integer; got 0"):
        CNNConfig(num_blocks=0)
    with pytest.raises(ValueError, match=r"C=1"):
        jax.eval_shape(_model().init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"^images have dtype int32; valid: a floating dtype"):
        jax.eval_shape(_model().init, jax.random.key(0), jnp.zeros((1, 8, 8, 1), jnp.int32))
    assert set(VARIANTS) == {"resnet-tiny"}
