"""ViT: sizes from the papers, patchify, position interpolation, order-blindness, training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models.vit import (ViT, ViTConfig, VARIANTS, interpolate_position_embeddings,
                                      patchify)
from helpers import adam_losses, assert_loss_goes_down

IMAGES = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))


def _count(name, **overrides):
    cfg = ViTConfig.from_variant(name, **overrides)
    image = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels))
    shapes = jax.eval_shape(ViT(cfg).init, jax.random.key(0), image)
    return sum(x.size for x in jax.tree.leaves(nn.unbox(shapes["params"])))


def _model(variant="vit-tiny/2", **overrides):
    """Tiny ViT on the reference attention path (cheapest op by op; blockwise compared below)."""
    return ViT(ViTConfig.from_variant(variant, **{"implementation": "reference", **overrides}))


@functools.lru_cache(maxsize=None)
def _params(variant="vit-tiny/2", pool="cls"):
    """Initial parameters with a random (not zero-initialised) head, so that gradients
    reach the encoder and outputs depend on it."""
    params = nn.unbox(jax.jit(_model(variant, pool=pool).init)(jax.random.key(0), IMAGES)["params"])
    kernel = jax.random.normal(jax.random.key(3), params["head"]["kernel"].shape)
    return params | {"head": {"kernel": kernel, "bias": params["head"]["bias"]}}


@pytest.mark.parametrize("name,published", [
    ("vit-b/16", 86e6), ("vit-l/16", 307e6), ("vit-h/14", 632e6),  # Dosovitskiy et al. Table 1
    ("vit-s/16", 22e6),  # DeiT Table 1 (its Ti, "5M", is 5.7M with the 1000-way head)
])
def test_parameter_counts_match_the_papers(name, published):
    assert abs(_count(name) / published - 1) < 0.01


def test_vit_b16_matches_hugging_face_exactly():
    # google/vit-base-patch16-224 (ViTForImageClassification, 1000 labels): 86,567,656.
    assert _count("vit-b/16") == 86_567_656
    assert _count("vit-b/16", scan_layers=True, remat_policy="full") == 86_567_656


def test_patch_embedding_is_a_stride_p_convolution():
    model, params = _model("vit-tiny/4"), _params("vit-tiny/4")
    x = patchify(IMAGES, 4)  # [B, 2, 2, 16]
    np.testing.assert_array_equal(x[1, 1, 0].reshape(4, 4), IMAGES[1, 4:8, 0:4, 0])
    kernel = params["patch_embedding"]  # [P, P, C, D]
    conv = jax.lax.conv_general_dilated(IMAGES, kernel, (4, 4), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    ours = jnp.einsum("BYXI,ID->BYXD", x, kernel.reshape(-1, kernel.shape[-1]))
    np.testing.assert_allclose(ours, conv, atol=1e-5)
    logits, aux = model.apply({"params": params}, IMAGES)
    assert logits.shape == (2, 10) and aux["hidden_states"].shape == (2, 5, 32)


def test_position_interpolation_is_exact_at_the_trained_grid_and_bilinear_elsewhere():
    rows, cols = jnp.meshgrid(jnp.arange(4.0), jnp.arange(4.0), indexing="ij")
    grid = jnp.stack([rows, cols, jnp.sin(rows * cols)], -1).reshape(16, 3)  # [P, D=3]
    table = jnp.concatenate([jnp.full((1, 3), 7.0), grid])  # [1 + P, D], CLS row = 7
    np.testing.assert_array_equal(interpolate_position_embeddings(table, (4, 4), (4, 4)), table)
    big = interpolate_position_embeddings(table, (4, 4), (8, 6))
    assert big.shape == (1 + 48, 3)
    np.testing.assert_array_equal(big[0], 7.0)  # the CLS row is kept
    # Bilinear reproduces a linear ramp between sample centres: an 8-row grid puts new row
    # r at old coordinate (r + 0.5) / 2 - 0.5.
    new_rows = big[1:].reshape(8, 6, 3)[..., 0]
    np.testing.assert_allclose(new_rows[1:-1, 0], (np.arange(1, 7) + 0.5) / 2 - 0.5, atol=1e-6)
    # The model at its own size uses the table untouched; at 12x16 it interpolates.
    model, params = _model(), _params()
    _, aux = model.apply({"params": params}, jnp.zeros((1, 12, 16, 1)))
    assert aux["hidden_states"].shape == (1, 1 + 6 * 8, 32)


def test_model_at_trained_size_adds_the_table_unchanged():
    model, params = _model(position_embeddings=False), _params()
    with_pos = _model()
    # The encoder's inputs with and without positions differ by exactly the stored table.
    inputs = []

    def record(next_fun, args, kwargs, context):
        if context.module.name == "encoder" and context.method_name == "__call__":
            inputs.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply({"params": params}, IMAGES)
        with_pos.apply({"params": params}, IMAGES)
    table = np.broadcast_to(params["position_embeddings"], inputs[0].shape)
    np.testing.assert_allclose(inputs[1] - inputs[0], table, atol=1e-6)  # (x + t) - x


@pytest.mark.parametrize("positions", [False, True])
def test_encoder_without_positions_is_permutation_equivariant(positions):
    params = _params(pool="gap")
    model = _model(pool="gap", position_embeddings=positions)
    perm = np.array([5, 0, 13, 2, 9, 15, 1, 7, 3, 12, 4, 10, 8, 14, 6, 11])  # of 16 patches
    # Shuffle the 2x2 patches of the image: patch k of the new image is patch perm[k].
    patches = IMAGES.reshape(2, 4, 2, 4, 2, 1).transpose(0, 1, 3, 2, 4, 5).reshape(2, 16, 2, 2, 1)
    shuffled = patches[:, perm].reshape(2, 4, 4, 2, 2, 1).transpose(0, 1, 3, 2, 4, 5).reshape(2, 8, 8, 1)
    logits, aux = model.apply({"params": params}, IMAGES)
    logits_p, aux_p = model.apply({"params": params}, shuffled)
    equivariant = np.allclose(aux_p["hidden_states"], aux["hidden_states"][:, perm], atol=1e-5)
    assert equivariant == (not positions)
    if not positions:  # average pooling then makes the classifier order-blind
        np.testing.assert_allclose(logits_p, logits, atol=1e-5)


def test_reference_and_blockwise_attention_agree_in_outputs_and_gradients():
    params, labels = _params(), jnp.array([3, 7])

    def loss(params, implementation):
        logits, aux = _model(implementation=implementation).apply({"params": params}, IMAGES)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1)), aux["hidden_states"]

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l_ref, y_ref), g_ref = grad_fn(params, "reference")
    (l_blk, y_blk), g_blk = grad_fn(params, "blockwise")
    np.testing.assert_allclose(l_ref, l_blk, rtol=1e-5)
    np.testing.assert_allclose(y_ref, y_blk, atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(g_ref["encoder"]["layer_0"]["self_attention"]["qkv"]).max()) > 1e-4
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_blk)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4)


def test_jitted_training_steps_decrease_the_loss():
    model = _model(dropout_rate=0.1)
    params = nn.unbox(_model().init(jax.random.key(0), IMAGES)["params"])  # zero head, as trained
    images = jax.random.normal(jax.random.key(5), (8, 8, 8, 1))
    labels = jnp.arange(8) % 10

    def loss_fn(p, key):
        logits, _ = model.apply({"params": p}, images, deterministic=False, rngs={"dropout": key})
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    losses = adam_losses(loss_fn, params, steps=8, lr=1e-2)
    np.testing.assert_allclose(losses[0], np.log(10), rtol=1e-5)  # zero head: uniform at start
    assert_loss_goes_down(losses, by=0.3)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match=r"vit-b/16.*vit-tiny/2"):
        ViTConfig.from_variant("vit-b/15")
    with pytest.raises(ValueError, match=r"image_size=30 is not a multiple of patch_size=16"):
        ViTConfig.from_variant("vit-b/16", image_size=30)
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide.*\[1, 2, 4, 8, 16, 32\]"):
        ViTConfig.from_variant("vit-tiny/2", num_heads=5)
    with pytest.raises(ValueError, match="pool"):
        ViTConfig.from_variant("vit-tiny/2", pool="max")
    model = _model()
    with pytest.raises(ValueError, match="not a multiple of patch_size=2"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 9, 8, 1)))
    with pytest.raises(ValueError, match="C=1"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    # Raw pixels 0..255 were taken as they came, at 255 times the trained scale
    with pytest.raises(ValueError, match=r"^images have dtype uint8; valid: a floating dtype"):
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 1), jnp.uint8))
    assert {"vit-ti/16", "vit-s/16", "vit-b/16", "vit-b/32", "vit-l/16", "vit-h/14"} <= set(VARIANTS)


@pytest.mark.slow
def test_matches_hugging_face_vit_for_image_classification():
    """Same weights, same logits: pre-norm, exact GELU, eps 1e-12, CLS token and 1 + P
    position rows are the architecture of the google/vit-* checkpoints."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = ViTConfig.from_variant("vit-tiny/2", norm_epsilon=1e-12)
    hf_cfg = transformers.ViTConfig(
        hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, hidden_act="gelu", layer_norm_eps=cfg.norm_epsilon,
        image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.num_channels,
        num_labels=cfg.num_classes,
        initializer_range=0.3)  # wide weights: activations O(1), where GELU variants differ
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(hf_cfg).eval()
    sd = hf.state_dict()
    g = lambda name: sd[name].detach().numpy()
    norm = lambda name: {"scale": g(f"{name}.weight"), "bias": g(f"{name}.bias")}
    n, d = cfg.num_heads, cfg.d_model

    def pick(*names):  # transformers 5 renamed the layer internals; accept either layout
        return g(next(name for name in names if name in sd))

    def layer(i):
        new, old = f"vit.layers.{i}", f"vit.encoder.layer.{i}"
        w = lambda new_name, old_name, part: pick(f"{new}.{new_name}.{part}", f"{old}.{old_name}.{part}")
        names = [(f"attention.{c}_proj", f"attention.attention.{o}")
                 for c, o in (("q", "query"), ("k", "key"), ("v", "value"))]
        out, fc1, fc2 = (("attention.o_proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                         ("mlp.fc2", "output.dense"))
        return {
            "self_attention": {"qkv": np.stack([w(*c, "weight").T.reshape(d, n, -1) for c in names], 1),
                               "qkv_bias": np.stack([w(*c, "bias").reshape(n, -1) for c in names]),
                               "out": w(*out, "weight").T.reshape(n, -1, d), "out_bias": w(*out, "bias")},
            "mlp": {"wi": {"kernel": w(*fc1, "weight").T, "bias": w(*fc1, "bias")},
                    "wo": {"kernel": w(*fc2, "weight").T, "bias": w(*fc2, "bias")}},
            "self_attention_norm": {"scale": w("layernorm_before", "layernorm_before", "weight"),
                                    "bias": w("layernorm_before", "layernorm_before", "bias")},
            "mlp_norm": {"scale": w("layernorm_after", "layernorm_after", "weight"),
                         "bias": w("layernorm_after", "layernorm_after", "bias")}}

    params = {
        # torch conv weight [D, C, P, P] -> [P, P, C, D]
        "patch_embedding": g("vit.embeddings.patch_embeddings.projection.weight").transpose(2, 3, 1, 0),
        "patch_bias": g("vit.embeddings.patch_embeddings.projection.bias"),
        "cls": g("vit.embeddings.cls_token")[0],
        "position_embeddings": g("vit.embeddings.position_embeddings")[0],
        "encoder": {f"layer_{i}": layer(i) for i in range(cfg.num_layers)},
        "encoder_norm": norm("vit.layernorm"),
        "head": {"kernel": g("classifier.weight").T, "bias": g("classifier.bias")},
    }
    logits, _ = ViT(cfg).apply({"params": params}, IMAGES)
    with torch.no_grad():
        ref = hf(pixel_values=torch.tensor(np.asarray(IMAGES).transpose(0, 3, 1, 2))).logits.numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)
