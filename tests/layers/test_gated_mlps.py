"""SwiGLU, GeGLU and ReGLU (Shazeer 2020) against a float64 numpy reference, and their
parameter count against the plain MLP's at F = 8D/3 (the gated-MLP experiment's premise)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.blocks import BlockConfig, TransformerStack
from attention_jax.layers.mlp import GATED_MLPS, MLP, GatedMLP, gate_activation


def _gelu64(x):  # exact (erf) GELU
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


REFERENCE = {"silu": lambda x: x / (1 + np.exp(-x)), "gelu": _gelu64,
             "relu": lambda x: np.maximum(x, 0)}


@pytest.mark.parametrize("gate", sorted(REFERENCE))
def test_gated_mlp_matches_float64_reference(gate):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 12))
    layer = GatedMLP(hidden=32, gate_activation=gate)
    params = nn.unbox(layer.init(jax.random.PRNGKey(1), x)["params"])
    y = layer.apply({"params": params}, x)
    w = {k: np.asarray(jax.device_get(v["kernel"]), np.float64) for k, v in params.items()}
    x64 = np.asarray(x, np.float64)
    act = REFERENCE[gate]
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
    stacks["reglu"] = TransformerStack(BlockConfig(num_heads=2, mlp="glu", activation="relu",
                                                   mlp_dim=24, use_bias=False), 1)
    params = stacks["swiglu"].init(jax.random.PRNGKey(1), x)
    mlp = params["params"]["layer_0"]["mlp"]
    assert set(mlp) == {"wg", "wi", "wo"} and mlp["wg"]["kernel"].value.shape == (16, 24)
    # Same weights, different gate: the kind reaches the layer.
    y = {kind: stack.apply(params, x)[0] for kind, stack in stacks.items()}
    assert not np.allclose(y["swiglu"], y["geglu"], atol=1e-4)
    # "glu"'s gate is the block's activation: gelu (the default) is GeGLU, relu ReGLU.
    np.testing.assert_array_equal(y["glu"], y["geglu"])
    assert not np.allclose(y["reglu"], y["geglu"], atol=1e-4)


def test_a_named_gated_mlp_refuses_an_activation_it_would_ignore():
    """mlp='swiglu' with activation='relu' trained a SwiGLU, the relu silently unused."""
    assert gate_activation("swiglu", "gelu") == gate_activation("swiglu", "silu") == "silu"
    assert gate_activation("glu", "relu") == "relu"
    with pytest.raises(ValueError, match=r"activation='relu' is not used by mlp='swiglu', "
                                         r"whose gate is 'silu'; valid: 'silu' or the default "
                                         r"'gelu' \(left as it is\), or mlp='glu'"):
        BlockConfig(num_heads=2, mlp="swiglu", activation="relu")
    with pytest.raises(ValueError, match=r"activation='silu' is not used by mlp='geglu'"):
        BlockConfig(num_heads=2, mlp="geglu", activation="silu")


def test_a_gpt_with_a_named_gated_mlp_keeps_its_default_activation_as_unset():
    """GPTConfig's activation default is gelu_tanh (GPT-2's), which a swiglu GPT leaves as
    it is: its block gets the silu gate, while a set relu is refused and glu takes it."""
    from attention_jax.models.gpt import GPTConfig
    small = dict(vocab_size=32, max_len=8, num_layers=1, d_model=16, num_heads=2)
    assert GPTConfig(**small, mlp="swiglu").block().activation == "silu"
    assert GPTConfig(**small, mlp="glu", activation="relu").block().activation == "relu"
    with pytest.raises(ValueError, match=r"activation='relu' is not used by mlp='swiglu', whose "
                                         r"gate is 'silu'; valid: 'silu' or the default "
                                         r"'gelu_tanh'"):
        GPTConfig(**small, mlp="swiglu", activation="relu")
    with pytest.raises(ValueError, match=r"activation='tanh' is unknown; valid:"):
        GPTConfig(**small, mlp="geglu", activation="tanh")
