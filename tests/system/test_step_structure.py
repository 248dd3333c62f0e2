"""What a training step is made of, checked on the CPU, where a GPU's idle time and extra
work come from (issue #35): the trainer's loop launches one executable and makes one
host-to-device copy a step, and every family's step runs its matmuls in the compute
dtype while the gradients of its lookup tables accumulate in float32."""

import collections
import tempfile

import flax.linen as nn
import jax
import jax.extend.core as jex_core
import numpy as np
import pytest

import tiny
from attention_jax import sharding, steps, train
from attention_jax.tools.bench.traces import read_trace
from helpers import load, shrink


# ================================================================== the loop, per step
def _outermost_calls(events) -> collections.Counter:
    """{jitted function: calls} from a trace's PjitFunction events (a call records
    nested events of the same name; only the outermost counts)."""
    calls, by_thread = collections.Counter(), collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name", "").startswith("PjitFunction("):
            by_thread[(e["pid"], e["tid"])].append(e)
    for spans in by_thread.values():
        end = -1.0
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:  # not inside the call before it
                calls[e["name"][len("PjitFunction("):-1]] += 1
                end = e["ts"] + e["dur"]
    return calls


def _traced_run(steps_: int, workdir: str, trace_dir: str, capfd):
    """(jitted calls, host-to-device transfers) of a whole training run of `steps_`
    steps that logs and checkpoints only at its end."""
    cfg = tiny.tiny_config(**{"train.steps": steps_, "train.log_every": steps_,
                              "train.checkpoint_every": steps_, "train.prefetch": 2})
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own calls: a million events, no use here
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log_explicit"), \
            jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        train.train_and_evaluate(cfg, workdir)
    transfers = capfd.readouterr().err.count("host-to-device transfer")
    return _outermost_calls(read_trace(trace_dir)), transfers


def test_a_training_step_is_one_executable_and_one_transfer(tmp_path, capfd):
    """Two runs, 4 and 12 steps, alike but for the steps: the 8 steps more launch the
    jitted train_step 8 times more and nothing else, and send 8 more arrays to the
    devices, one a step (the batch packed into one: sharding.PackedBatch). Whatever else a run
    launches or sends (init, the first compile, the final checkpoint) is the same in
    both and cancels."""
    short = _traced_run(4, str(tmp_path / "w4"), str(tmp_path / "t4"), capfd)
    long = _traced_run(12, str(tmp_path / "w12"), str(tmp_path / "t12"), capfd)
    assert short[0]["train_step"] == 4, short[0]  # the trace sees every step
    more = long[0] - short[0]
    assert dict(more) == {"train_step": 8}, (short[0], long[0])
    # The transfer guard logs each device's shard: one array a step is a copy per device.
    assert long[1] - short[1] == 8 * jax.local_device_count(), (short[1], long[1])


def _compiled_reductions(**overrides) -> int:
    """Reduce instructions in the tiny LM's compiled train step (one device)."""
    cfg = tiny.tiny_config(**{"mesh.num_devices": 1, **overrides})
    prepared = train.setup(cfg, tempfile.mkdtemp())
    train_step, _ = steps.jit_steps(prepared, cfg)
    with jax.set_mesh(prepared.mesh):
        batch = {k: jax.ShapeDtypeStruct((16, tiny.SEQ), np.int32) for k in ("inputs", "targets")}
        text = train_step.lower(prepared.abstract, batch).compile().as_text()
    return text.count(" reduce(")


def test_clipping_reuses_the_norm_the_metrics_report():
    """The step reports the gradient's global norm (metrics["grad_norm"]) and clips by
    it (optax.clip_by_global_norm): one pass of reductions over the gradients serves
    both (XLA merges the two identical sums), so clipping adds no reduction to the
    compiled step. A second pass would be one reduction kernel more per parameter on a
    GPU, each with its launch."""
    assert _compiled_reductions(**{"optim.clip_norm": 1.0}) == \
        _compiled_reductions(**{"optim.clip_norm": 0.0})


def test_packed_batch_round_trips_every_dtype():
    """pack_batch / unpack give back each array, bit for bit, inside jit: ints, floats
    (NaN and -0.0 included), bools, rows of any shape; int64 becomes int32 as a transfer
    would make it."""
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(-2**31, 2**31, (4, 5), dtype=np.int64).astype(np.int32),
             "weights": np.array([[np.nan, -0.0, 1.5], [np.inf, 2.0, -3.0]] * 2, np.float32),
             "mask": rng.random((4, 2, 3)) > 0.5, "label": np.arange(4, dtype=np.int64),
             "nested": {"bf": rng.random((4, 3)).astype(jax.numpy.bfloat16),
                        "u8": rng.integers(0, 256, (4,), dtype=np.uint8)}}
    packed = sharding.pack_batch(batch)
    assert packed.data.dtype == np.uint8 and packed.data.shape == (4, 20 + 12 + 6 + 4 + 6 + 1)
    out = jax.jit(lambda p: p.unpack())(packed)
    want = {**batch, "label": batch["label"].astype(np.int32)}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(out)):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(ValueError, match="leading .batch. sizes differ"):
        sharding.pack_batch({"a": np.zeros((4, 2)), "b": np.zeros((3, 2))})


# ====================================================== every family, in bfloat16
FAMILIES = ["gpt", "bert_mlm", "vit", "encdec", "rnn_seq2seq", "inductive_bias"]  # + cnn
TABLES = {"gpt", "bert_mlm", "encdec", "rnn_seq2seq"}  # families that look rows up
MATMULS = ("dot_general", "conv_general_dilated")
# Primitives whose result is still the parameter itself (its values, re-laid out).
SAME_VALUES = ("reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy",
               "copy_p", "sharding_constraint", "slice", "dynamic_slice", "gather")


def _walk(jaxpr, raw: set, found: dict) -> None:
    """Sorts the matmuls of `jaxpr` (and of the jaxprs inside it) into found["raw"]
    (an operand is a float32 parameter not cast: `raw` holds the variables that are)
    and found["cast"], and lists its scatter-adds in found["scatter"]."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v for v in eqn.invars if isinstance(v, jex_core.Var)]
        if name in MATMULS:
            found["raw" if any(v in raw for v in ins) else "cast"].append(
                [str(v.aval.dtype) for v in ins])
        elif name == "scatter-add":
            found["scatter"].append(eqn.outvars[0].aval)
        elif name in SAME_VALUES and ins and ins[0] in raw:
            raw.add(eqn.outvars[0])
        for sub in jex_core.jaxprs_in_params(eqn.params):
            # Calls (pjit, custom_vjp, remat, scan) bind their operands in order; a
            # while loop does not: its parameters are not followed into it.
            inner = (set() if len(sub.invars) != len(eqn.invars) else
                     {i for i, o in zip(sub.invars, eqn.invars) if o in ins and o in raw})
            _walk(sub, inner, found)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_steps_in_its_compute_dtype(name, data_dir, tmp_path):
    """The trainer's step of each shipped family at train.compute_dtype=bfloat16: the
    loss gets the float32 parameters (as a bare step does) and the model casts every
    weight before its matmul (none multiplies a float32 parameter), and the gradient of
    every lookup table (a scatter-add into an array of a parameter's shape) accumulates
    in float32. Casting the parameters up front instead made that scatter-add bfloat16:
    it loses a frequent row's low bits and, on a GPU, has no native atomic: 2.5 ms a step
    into GPT-2's table on an H100, absent from the bare step (#35)."""
    config = shrink(load(name).get_config(), data_dir)
    config.train.compute_dtype = "bfloat16"
    prepared = train.setup(config, str(tmp_path))
    with jax.set_mesh(prepared.mesh), nn.logical_axis_rules(prepared.rules):
        train_step, _ = steps.jit_steps(prepared, config)
        host = next(iter(train.make_train_loader(prepared.task, config)))
        packed = sharding.pack_batch(host)
        batch = sharding.PackedBatch(jax.ShapeDtypeStruct(packed.data.shape, np.uint8),
                                     packed.layout)
        closed = jax.make_jaxpr(train_step)(prepared.abstract, batch)
    leaves = jax.tree_util.tree_leaves_with_path((prepared.abstract, batch))
    raw = {v for (path, x), v in zip(leaves, closed.jaxpr.invars)
           if jax.tree_util.keystr(path[:2]) == "[0]['params']" and x.dtype == np.float32}
    assert raw
    found = collections.defaultdict(list)
    _walk(closed.jaxpr, raw, found)
    assert not found["raw"], f"matmuls of uncast float32 parameters: {found['raw'][:5]}"
    assert any(set(dtypes) == {"bfloat16"} for dtypes in found["cast"]), found["cast"][:5]
    shapes = {x.shape for x in jax.tree.leaves(prepared.abstract["params"])}
    tables = [a for a in found["scatter"] if a.shape in shapes]
    assert all(a.dtype == np.float32 for a in tables), tables
    assert bool(tables) == (name in TABLES), (name, tables)
