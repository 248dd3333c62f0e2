"""`init_from=<another run>`: only the params of a finished run's checkpoint, onto a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention_jax import checkpoint


def _saved_run(tmp_path):
    state = {"params": {"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.ones(4)},
             "opt_state": {"mu": jnp.full((8, 4), 3.0)}, "step": jnp.int32(7)}
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", save_every=1, async_save=False)
    ckpt.save(7, state, {"examples_seen": 70})
    ckpt.wait()
    ckpt.close()
    return tmp_path / "ckpt", state


def test_restore_params_only_onto_a_mesh(tmp_path):
    directory, state = _saved_run(tmp_path)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                          sharding=NamedSharding(mesh, P("data", "fsdp"))),
                "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, P()))}
    params, step = checkpoint.restore_params(directory, abstract)
    assert step == 7
    np.testing.assert_array_equal(params["w"], state["params"]["w"])
    np.testing.assert_array_equal(params["b"], state["params"]["b"])
    assert params["w"].sharding == abstract["w"].sharding


def test_restore_params_names_a_mismatching_key(tmp_path):
    directory, _ = _saved_run(tmp_path)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"w": jax.ShapeDtypeStruct((8, 5), jnp.float32, sharding=one),
                "b": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=one)}
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"params/w|params.*w"):
        checkpoint.restore_params(directory, abstract)
