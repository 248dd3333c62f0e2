"""packed_state.py and the Checkpointer's packed format: a state whose arrays are whole on
every device (one device, or replicated) is written as one flat array per top-level entry
and dtype, with its layout; it restores equal onto any mesh, a warm start reads only the
parameters, damage to the layout is reported as damage, and a sharded state keeps the
format of one array per array."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from attention_jax import checkpoint, packed_state


def _state(sharding=None):
    state = {"step": jnp.int32(7),
             "params": {"w": jnp.arange(24.0).reshape(4, 6), "b": jnp.linspace(-1, 1, 6),
                        "emb": jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 7},
             "opt_state": ({"count": jnp.int32(3)},
                           {"mu": {"w": jnp.full((4, 6), 0.5), "b": jnp.ones(6)}}),
             "rng": jax.random.PRNGKey(3)}
    return state if sharding is None else jax.device_put(state, sharding)


def _abstract(state, sharding=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding or x.sharding), state)


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_the_layout_packs_each_top_level_entry_and_dtype_in_tree_order():
    state = _state()
    layout = packed_state.layout_of(state)
    assert layout.groups == {"opt_state/float32": 30, "opt_state/int32": 1,
                             "params/float32": 62, "rng/uint32": 2, "step/int32": 1}
    on_device = packed_state.pack_on_device(state)
    on_host = packed_state.pack_on_host(state)
    _equal(on_device, on_host)
    # params in tree order (b, emb, w: dict keys sorted), each raveled
    np.testing.assert_array_equal(on_host["params"]["float32"], np.concatenate(
        [np.asarray(state["params"][k]).ravel() for k in ("b", "emb", "w")]))
    assert packed_state.Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    _equal(packed_state.unpack(on_host, layout, _abstract(state)), state)


def test_the_layout_is_worked_out_once_per_structure_shapes_and_dtypes():
    """A save asks for the layout on the training thread: the same state's (or its next
    step's) is the one already made; other shapes, dtypes or names get their own."""
    state = _state()
    layout = packed_state.layout_of(state)
    assert packed_state.layout_of(_abstract(state)) is layout  # arrays or their shapes
    assert packed_state.layout_of(jax.tree.map(lambda x: x + 1, state)) is layout
    wider = {**state, "params": {**state["params"], "b": jnp.zeros(7)}}
    assert packed_state.layout_of(wider).groups["params/float32"] == 63
    halved = {**state, "params": {**state["params"], "b": jnp.zeros(6, jnp.bfloat16)}}
    assert packed_state.layout_of(halved).groups["params/bfloat16"] == 6
    renamed = {**state, "params": {"v" if k == "b" else k: x for k, x in state["params"].items()}}
    paths = [e.path for e in packed_state.layout_of(renamed).entries]
    assert "params/v" in paths and "params/b" not in paths


def test_a_bad_layout_says_what_is_wrong():
    good = packed_state.layout_of(_state()).to_json()
    with pytest.raises(ValueError, match="not a packed-state layout"):
        packed_state.Layout.from_json({"arrays": []})
    with pytest.raises(ValueError, match=r"layout version 9; this attention_jax reads version 1"):
        packed_state.Layout.from_json({**good, "version": 9})
    outside = {**good, "arrays": [[*good["arrays"][0][:2], 10 ** 6, [2]]]}
    with pytest.raises(ValueError, match=r"opt_state/0/count lies outside its flat array"):
        packed_state.Layout.from_json(outside)


def test_the_device_copy_is_new_buffers_the_next_step_can_donate():
    """A group of one array is copied, not forwarded: donating the state leaves it."""
    state = {"step": jnp.int32(5), "w": jnp.arange(4.0)}
    packed = packed_state.pack_on_device(state)
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    _equal(packed, {"step": {"int32": [5]}, "w": {"float32": [0, 1, 2, 3]}})


def test_which_states_are_packed():
    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices.reshape(8), ("data",))
    assert packed_state.packable(_state())  # one device
    assert packed_state.packable(_state(NamedSharding(mesh, P())))  # replicated on 8
    sharded = _state(NamedSharding(mesh, P()))
    sharded["params"]["emb"] = jax.device_put(sharded["params"]["emb"],
                                              NamedSharding(mesh, P("data")))
    assert not packed_state.packable(sharded)  # needs gathering: one array per array
    assert not packed_state.packable({"w": jnp.ones(2), "n": 3})  # a host value


@pytest.mark.parametrize("async_save", [True, False])
def test_a_packed_checkpoint_restores_onto_any_mesh_and_verifies(tmp_path, async_save):
    devices = np.array(jax.devices()[:8])
    replicated = NamedSharding(jax.sharding.Mesh(devices, ("data",)), P())
    state = _state(replicated)
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=1, async_save=async_save)
    assert ck.save(1, state, {"next_index": 4})
    ck.wait()
    layout = ck.layout(1)
    assert layout is not None
    # orbax holds 5 flat arrays, not the state's 8
    tree = ck.manager.item_metadata(1)["state"].tree
    assert sorted(checkpoint.flat_shapes(tree)) == sorted(
        layout.groups)
    assert checkpoint.flat_shapes(ck.state_tree(1)) == checkpoint.flat_shapes(state)
    # onto 4 devices, its parameters sharded two ways, and onto one device
    mesh4 = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("fsdp", "tensor"))
    onto = _abstract(state, NamedSharding(mesh4, P()))
    onto["params"]["w"] = jax.ShapeDtypeStruct((4, 6), jnp.float32,
                                               sharding=NamedSharding(mesh4, P("fsdp", "tensor")))
    restored, data = ck.restore(onto)
    assert data == {"next_index": 4}
    _equal(restored, state)
    assert restored["params"]["w"].sharding == onto["params"]["w"].sharding
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    _equal(ck.restore(_abstract(state, one))[0], state)
    ck.close()
    # a warm start reads the parameters only: onto another layout of devices
    params, step = checkpoint.restore_params(str(tmp_path), _abstract(state["params"], one))
    assert step == 1
    _equal(params, state["params"])


def test_a_sharded_state_and_packed_off_write_an_array_per_array(tmp_path):
    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices, ("data",))
    sharded = _state(NamedSharding(mesh, P()))
    sharded["params"]["emb"] = jax.device_put(sharded["params"]["emb"],
                                              NamedSharding(mesh, P("data")))
    for name, state, packed in (("sharded", sharded, True), ("off", _state(), False)):
        ck = checkpoint.Checkpointer(str(tmp_path / name), save_every=1, packed=packed)
        ck.save(2, state, {})
        ck.wait()
        assert ck.layout(2) is None and not (tmp_path / name / "2" / "layout").exists()
        assert len(checkpoint.flat_shapes(ck.manager.item_metadata(2)["state"].tree)) == 8
        ck.close()
        # either format restores through a default (packing) Checkpointer
        reader = checkpoint.Checkpointer(str(tmp_path / name), read_only=True)
        _equal(reader.restore(_abstract(state))[0], state)
        reader.close()


@pytest.mark.parametrize("damage,reason", [
    ("delete", "packed-state layout deleted"),
    ("garbage", "packed-state layout unreadable"),
    ("shift", "lies outside its flat array"),
])
def test_damage_to_the_layout_is_damage(tmp_path, damage, reason):
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=1)
    ck.save(1, _state(), {})
    ck.save(2, _state(), {})
    ck.wait()
    layout_dir = tmp_path / "2" / "layout"
    if damage == "delete":
        for f in layout_dir.iterdir():
            f.unlink()
        layout_dir.rmdir()
    else:
        meta = layout_dir / "metadata"  # orbax's JSON item
        data = json.loads(meta.read_text())
        if damage == "garbage":
            meta.write_text('{"format": "attention_jax packed')
        else:
            data["arrays"][0][2] = data["groups"][data["arrays"][0][1]]
            meta.write_text(json.dumps(data))
    with pytest.raises(checkpoint.CheckpointDamagedError, match=reason):
        ck.restore(_abstract(_state()), 2)
    # the loop's fallback: the intact step 1, and step 2 moved aside
    said = []
    state, _, step = ck.restore_intact(_abstract(_state()), say=said.append)
    assert step == 1 and reason in said[0]
    assert os.path.isdir(tmp_path / "2.corrupt")
    ck.close()


def test_saves_in_a_row_each_keep_their_own_values(tmp_path):
    """On CPU the flat arrays are host buffers reused from save to save: the next save
    fills them only once orbax has written the previous one from them."""
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=1, keep=5)
    states = {}
    for step in (1, 2, 3):
        states[step] = jax.tree.map(lambda x, s=step: x * s if x.dtype == jnp.float32 else x,
                                    _state())
        ck.save(step, states[step], {"step": step})
    ck.wait()
    for step, state in states.items():
        restored, data = ck.restore(_abstract(state), step)  # verifies the digests too
        _equal(restored, state)
        assert data == {"step": step}
    ck.close()


@pytest.mark.parametrize("packed", [True, False])
def test_another_optimizer_of_as_many_arrays_is_a_mismatch_not_damage(tmp_path, packed):
    """Saved an array per array (a sharded state) too: only the leaf count was compared
    there, so a restore with another optimizer of as many arrays (clip_norm on or off)
    called every step damaged, and a --resume_changed rewrote config.json first."""
    ck = checkpoint.Checkpointer(str(tmp_path), save_every=1, packed=packed)
    state = _state()
    ck.save(1, state, {})
    ck.wait()
    other = dict(state, opt_state=({"count": state["opt_state"][0]["count"]},
                                   {"nu": state["opt_state"][1]["mu"]}))
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"missing from checkpoint: opt_state/1/nu/b"):
        ck.restore(_abstract(other))
    ck.close()
