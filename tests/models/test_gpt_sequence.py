"""GPT with its sequence split over the mesh (ring attention): the same logits and
gradients as on one device, with each kind of position information (positions are
computed in natural order, so they must survive the resharding and the ring's zig-zag)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import sharding
from attention_jax.models.gpt import GPT, GPTConfig, lm_loss


def _mesh(sequence, data=1):
    return sharding.make_mesh({"data": data, "fsdp": 1, "sequence": sequence, "tensor": 1},
                              jax.devices()[:data * sequence])


def _run(model, params, tokens, segment_ids, mesh):
    def loss(params):
        logits, _ = model.apply({"params": params}, tokens, segment_ids=segment_ids)
        return lm_loss(logits, tokens)[0], logits

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        (value, logits), grads = fn(params)
        jaxpr = str(jax.make_jaxpr(fn)(params))
    return value, logits, grads, jaxpr


@pytest.mark.parametrize("variant, position", [("gpt-tiny", "learned"),
                                               ("gpt-tiny", "sinusoidal"),
                                               ("gpt-tiny-rope", "rope")])
def test_gpt_on_sequence_4_equals_one_device(variant, position):
    cfg = GPTConfig.from_variant(variant, position=position, num_layers=1)
    model = GPT(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 32)), jnp.int32)
    segment_ids = jnp.asarray(np.sort(rng.integers(1, 4, (2, 32)), axis=1), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
    v1, logits1, g1, jaxpr1 = _run(model, params, tokens, segment_ids, _mesh(1))
    v4, logits4, g4, jaxpr4 = _run(model, params, tokens, segment_ids, _mesh(4, data=2))
    assert "ppermute" in jaxpr4 and "ppermute" not in jaxpr1  # the ring ran, and only there
    np.testing.assert_allclose(logits4, logits1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v4, v1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
