"""SwiGLU and GeGLU (Shazeer 2020) against a float64 numpy reference, and their
parameter count against the plain MLP's at F = 8D/3 (the gated-MLP experiment's premise)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.blocks import BlockConfig, TransformerStack
from attention_jax.layers.mlp import GATED_MLPS, MLP, GatedMLP


def _gelu64(x):  # exact (erf) GELU
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


REFERENCE = {"silu": lambda x: x / (1 + np.exp(-x)), "gelu": _gelu64}


@pytest.mark.parametrize("kind", sorted(GATED_MLPS))
def test_gated_mlp_matches_float64_reference(kind):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 12))
    layer = GatedMLP(hidden=32, gate_activation=GATED_MLPS[kind])
    params = nn.unbox(layer.init(jax.random.PRNGKey(1), x)["params"])
    y = layer.apply({"params": params}, x)
    w = {k: np.asarray(jax.device_get(v["kernel"]), np.float64) for k, v in params.items()}
    x64 = np.asarray(x, np.float64)
    act = REFERENCE[GATED_MLPS[kind]]
    want = (act(x64 @ w["wg"]) * (x64 @ w["wi"])) @ w["wo"]
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5)


def test_swiglu_and_geglu_differ_only_in_the_gate():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 8))
    params = GatedMLP(hidden=16).init(jax.random.PRNGKey(1), x)
    y_swi = GatedMLP(hidden=16).apply(params, x)
    y_ge = GatedMLP(hidden=16, gate_activation="gelu").apply(params, x)
    assert not np.allclose(y_swi, y_ge, atol=1e-3)


def test_gated_mlps_at_8d_over_3_have_the_plain_mlps_parameters():
    d = 48  # configs/gated_mlp.py's width: 8·48/3 = 128 exactly
    x = jnp.zeros((1, 2, d))
    count = lambda layer: sum(np.size(v) for v in jax.tree.leaves(
        jax.eval_shape(layer.init, jax.random.PRNGKey(0), x)))
    assert count(MLP(hidden=4 * d, use_bias=False)) == count(GatedMLP(hidden=8 * d // 3)) == 18432


def test_block_builds_the_gated_mlp_of_its_kind():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 16))
    stacks = {kind: TransformerStack(BlockConfig(num_heads=2, mlp=kind, mlp_dim=24,
                                                 use_bias=False), 1) for kind in GATED_MLPS}
    params = stacks["swiglu"].init(jax.random.PRNGKey(1), x)
    mlp = params["params"]["layer_0"]["mlp"]
    assert set(mlp) == {"wg", "wi", "wo"} and mlp["wg"]["kernel"].value.shape == (16, 24)
    # Same weights, different gate: the kind reaches the layer.
    y = {kind: stack.apply(params, x)[0] for kind, stack in stacks.items()}
    assert not np.allclose(y["swiglu"], y["geglu"], atol=1e-4)
