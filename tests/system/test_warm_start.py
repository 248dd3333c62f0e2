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


@pytest.mark.parametrize("packed", [True, False])
def test_restore_params_refuses_params_that_do_not_match_their_digests(tmp_path, packed):
    """A warm start verifies what it reads, as a resume does: step 10 holding step 5's
    arrays (a mixed-up copy; valid files, only the digests can tell) was warm-started
    from in silence, as step 10."""
    directory = tmp_path / "ckpt"
    ckpt = checkpoint.Checkpointer(directory, save_every=5, async_save=False, packed=packed)
    for step in (5, 10):
        ckpt.save(step, {"params": {"w": jnp.arange(32.0).reshape(8, 4) + step},
                         "step": jnp.int32(step)}, {"examples_seen": step})
    ckpt.wait()
    ckpt.close()
    import shutil
    shutil.rmtree(directory / "10" / "state")
    shutil.copytree(directory / "5" / "state", directory / "10" / "state")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=one)}
    with pytest.raises(checkpoint.CheckpointDamagedError,
                       match=r"step 10 .* params/w does not match its digest"):
        checkpoint.restore_params(directory, abstract)
    from attention_jax import train
    from attention_jax.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^config\.train\.init_from=.*step 10 .*digest"):
        train.warm_start_params(str(directory), abstract)  # main's one line
    params, step = checkpoint.restore_params(directory, abstract, step=5)  # intact
    assert step == 5
    np.testing.assert_array_equal(params["w"], np.arange(32.0).reshape(8, 4) + 5)
