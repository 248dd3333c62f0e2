"""models/loss_kernel.py and losses.head_cross_entropy: the loss as Pallas kernels (run
here in interpret mode, as on the GPU they run compiled by Triton). The row statistics
and the gradient written over the logits against float64, rows that split into chunks
and pieces of every size, ties, rows of -inf; the head's loss, accuracy and gradients
against XLA's loss and a float64 reference; GPT's loss through it; auto's choice; the
errors; under a mesh, each device's rows."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention_jax import config as config_lib
from attention_jax.attention import compiling_for
from attention_jax.errors import ConfigError
from attention_jax.models import gpt, loss_kernel
from attention_jax.models.losses import choose_loss_kernel, cross_entropy, head_cross_entropy
from attention_jax.sharding import DEFAULT_RULES

from test_chunked_loss import _inputs, _reference


def _row_reference(z, t):
    z = np.asarray(z, np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    return lse, z[np.arange(len(t)), t], z.sum(axis=1), z.argmax(axis=1)


@pytest.mark.parametrize("v", [1, 3, 16, 37, 64])
def test_pieces_cover_a_row_in_powers_of_two(v):
    n, pieces = loss_kernel._pieces(v, 16)
    starts = [16 * j for j in range(n)] + [s for s, _ in pieces]
    sizes = [16] * n + [size for _, size in pieces]
    assert starts == list(np.cumsum([0] + sizes[:-1]))  # contiguous, in order
    assert sum(sizes) == v and all(s & (s - 1) == 0 for s in sizes)  # powers of two
    assert loss_kernel._pieces(50304, 4096) == (12, [(49152, 1024), (50176, 128)])


@pytest.mark.parametrize("v", [16, 37, 100])
def test_a_backward_walk_visits_the_same_pieces_end_first(v):
    def starts(backward):
        def visit(start, size, carry):
            seen, i = carry
            return seen.at[i].set(start * 1000 + size), i + 1
        seen, i = loss_kernel._walk(v, 16, visit, (jnp.full(8, -1), 0), backward=backward)
        return [int(x) for x in seen[:int(i)]]
    forward = starts(False)
    assert starts(True) == forward[::-1] and len(set(forward)) == len(forward)


def test_the_gradient_reads_the_row_from_its_end():
    """The gradient's pass starts where the statistics' pass ended (the remainder pieces,
    then the chunks from the last): those logits are the likeliest still in the L2
    cache. Its pieces' stores (static starts, outside the loop) come before its loop."""
    from helpers import pallas_calls

    v, chunk = 100, 16  # 6 chunks and a piece of 4
    z, t, scale = jnp.zeros((2, v), jnp.float32), jnp.zeros(2, jnp.int32), jnp.ones(2)
    traced = jax.make_jaxpr(lambda z: loss_kernel.row_statistics_and_gradient(
        z, t, scale, chunk=chunk))(z)
    (call,) = pallas_calls(traced.jaxpr)
    eqns = call.params["jaxpr"].eqns
    loops = [i for i, e in enumerate(eqns) if e.primitive.name in ("scan", "while")]
    row_stores = [i for i, e in enumerate(eqns)
                  if e.primitive.name in ("swap", "masked_swap") and e.invars[0].aval.shape == (v,)]
    assert len(loops) == 2 and row_stores, (loops, row_stores)
    assert all(i < loops[1] for i in row_stores)  # the piece at the row's end, first
    z = jnp.asarray(np.random.default_rng(0).standard_normal((3, v)), jnp.float32)
    t = jnp.array([0, 50, 99])
    (lse, *_), dz = loss_kernel.row_statistics_and_gradient(z, t, jnp.ones(3), chunk=chunk)
    expected = jax.nn.softmax(z, axis=1) - jax.nn.one_hot(t, v)
    np.testing.assert_allclose(dz, expected, atol=1e-6)


def test_the_l2_cache_is_told_which_reads_come_again():
    """In the gradient kernel the statistics' pass loads the row with the L2 cache's
    evict_last priority (the gradient's pass reads it again) and the gradient's pass
    loads and stores it with evict_first (the last use of both): so the rows in flight
    keep what is read again, not what was read or written last. Every load and store of
    the row says so, in the loop and in the remainder pieces (V = 100 in chunks of 16:
    6 chunks and a piece of 4), but the target logit's one load; the statistics kernel
    alone (nothing read again) and `settings(cache_hints=0)` leave the cache's default."""
    from helpers import all_eqns, pallas_calls

    v, chunk = 100, 16
    z, t, scale = jnp.zeros((2, v), jnp.float32), jnp.zeros(2, jnp.int32), jnp.ones(2)

    def accesses(fn):  # in the kernel's order (a loop's body where the loop is)
        (call,) = pallas_calls(jax.make_jaxpr(fn)(z).jaxpr)
        return [(e.primitive.name, e.params.get("eviction_policy"))
                for e in all_eqns(call.params["jaxpr"])
                if e.primitive.name in ("get", "swap", "masked_load", "masked_swap")
                and e.invars[0].aval.shape == (v,)]

    assert accesses(lambda z: loss_kernel.row_statistics_and_gradient(
        z, t, scale, chunk=chunk)) == [
        ("masked_load", "evict_last"), ("masked_load", "evict_last"),  # the statistics' loop, piece
        ("get", None),  # the target's logit
        ("masked_load", "evict_first"), ("masked_swap", "evict_first"),  # the gradient's piece,
        ("masked_load", "evict_first"), ("masked_swap", "evict_first")]  # then its loop
    assert accesses(lambda z: loss_kernel.row_statistics(z, t, chunk=chunk)) == [
        ("masked_load", None), ("masked_load", None), ("get", None)]
    with loss_kernel.settings(cache_hints=0):  # the A/B's other side: the cache's default
        assert {policy for _, policy in accesses(
            lambda z: loss_kernel.row_statistics_and_gradient(z, t, scale, chunk=chunk))} == {None}


def test_row_statistics_against_float64():
    """V = 37 in chunks of 16: two chunks through the loop, then pieces of 4 and 1. Ties
    go to the first index (also across chunks), and -inf logits (a masked vocabulary)
    add nothing, even a whole chunk of them ahead of the row's finite ones."""
    rng = np.random.default_rng(0)
    m, v = 6, 37
    z = (3 * rng.normal(size=(m, v))).astype(np.float32)
    t = rng.integers(0, v, m).astype(np.int32)
    z[0, 3] = z[0, 30] = z[0].max() + 1  # a tie across chunks: index 3
    z[1, 36] = z[1].max() + 2  # the max in the last piece of one
    t[1] = 36
    z[2, :16] = -np.inf  # the first chunk masked whole
    z[3, 5:9] = -np.inf
    lse, tz, sz, first = loss_kernel.row_statistics(jnp.asarray(z), jnp.asarray(t), chunk=16)
    ref_lse, ref_tz, _, ref_first = _row_reference(z, t)
    ok = np.isfinite(z).all(axis=1)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    np.testing.assert_allclose(np.where(np.isfinite(ref_tz), tz, 0), np.where(np.isfinite(ref_tz), ref_tz, 0),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sz)[ok], _row_reference(z[ok], t[ok])[2], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(first, ref_first)
    assert first[0] == 3 and first[1] == 36


def test_row_statistics_of_bfloat16_logits_in_float32():
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(size=(4, 64)) * 4, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, 64, 4), jnp.int32)
    lse, tz, sz, first = loss_kernel.row_statistics(z, t, chunk=16)
    assert lse.dtype == jnp.float32 and first.dtype == jnp.int32
    ref = _row_reference(np.asarray(z.astype(jnp.float32)), np.asarray(t))  # the same bf16 values
    np.testing.assert_allclose(lse, ref[0], rtol=1e-6)
    np.testing.assert_allclose(tz, ref[1], rtol=1e-6)
    np.testing.assert_array_equal(first, ref[3])


def test_gradient_kernel_writes_softmax_minus_target_over_the_logits():
    rng = np.random.default_rng(2)
    m, v, smoothing = 5, 37, 0.1
    z = (2 * rng.normal(size=(m, v))).astype(np.float32)
    t = rng.integers(0, v, m).astype(np.int32)
    scale = rng.uniform(size=m).astype(np.float32)
    scale[2] = 0.0  # a padding row: no gradient
    stats, dz = jax.jit(lambda z, t, s: loss_kernel.row_statistics_and_gradient(
        z, t, s, smoothing, chunk=16))(jnp.asarray(z), jnp.asarray(t), jnp.asarray(scale))
    lse, *_ = _row_reference(z, t)
    p = np.exp(z.astype(np.float64) - lse[:, None])
    q = (1 - smoothing) * np.eye(v)[t] + smoothing / v
    np.testing.assert_allclose(dz, (p - q) * scale[:, None], atol=2e-7)
    assert not np.asarray(dz[2]).any()
    np.testing.assert_allclose(stats[0], lse, rtol=1e-6)  # the statistics come along


def test_without_smoothing_and_with_targets_outside_the_vocabulary():
    """Without label smoothing neither kernel sums the logits (sum_z is None); the
    gradient is softmax·scale with 1·scale off the target's logit, a target in the loop's
    chunks or in the pieces after them alike. A target outside [0, V) (as a row of
    padding may carry) has logit 0 and takes nothing off any logit."""
    rng = np.random.default_rng(3)
    m, v = 6, 37  # chunks of 16: [0, 16), [16, 32), then pieces [32, 36), [36, 37)
    z = (2 * rng.normal(size=(m, v))).astype(np.float32)
    t = np.asarray([0, 15, 16, 36, -1, v], np.int32)
    scale = rng.uniform(0.5, 1.0, size=m).astype(np.float32)
    lse, tz, sz, first = loss_kernel.row_statistics(jnp.asarray(z), jnp.asarray(t), sums=False,
                                                    chunk=16)
    assert sz is None
    ref_lse, _, _, ref_first = _row_reference(z, np.clip(t, 0, v - 1))
    inside = (t >= 0) & (t < v)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    np.testing.assert_allclose(tz, np.where(inside, z[np.arange(m), np.clip(t, 0, v - 1)], 0), rtol=1e-6)
    np.testing.assert_array_equal(first, ref_first)
    stats, dz = loss_kernel.row_statistics_and_gradient(jnp.asarray(z), jnp.asarray(t),
                                                        jnp.asarray(scale), chunk=16)
    assert stats[2] is None
    p = np.exp(z.astype(np.float64) - ref_lse[:, None])
    onehot = np.zeros((m, v))
    onehot[np.arange(m)[inside], t[inside]] = 1.0
    # exp2(z·log₂e - lse·log₂e): the shift's rounding costs about |lse|·2⁻²³ of each value
    np.testing.assert_allclose(dz, (p - onehot) * scale[:, None], rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("chunk", [16, 64], ids=["chunks", "pieces-only"])
def test_a_row_with_a_nan_has_a_nan_loss_and_first_max_0(chunk):
    """NaN compares false with everything: its row's statistics are NaN and its first max
    stays at 0 whether the row walks chunks or (V under a chunk) only pieces."""
    z = np.random.default_rng(4).normal(size=(2, 37)).astype(np.float32)
    z[0, 3] = np.nan
    lse, _, _, first = loss_kernel.row_statistics(jnp.asarray(z), jnp.zeros(2, jnp.int32),
                                                  chunk=chunk)
    assert np.isnan(lse[0]) and not np.isnan(lse[1])
    assert first[0] == 0 and first[1] == z[1].argmax()


def _loop_bodies(jaxpr):
    """The bodies of a kernel's loops (its fori_loops over chunks: scans, their trip count
    being static), outermost first."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            body = eqn.params["jaxpr" if eqn.primitive.name == "scan" else "body_jaxpr"].jaxpr
            yield body
            yield from _loop_bodies(body)


def test_each_chunk_takes_two_block_reductions_and_no_index_compare():
    """What a chunk of logits costs the kernels besides its exponentials (on a GPU each
    block reduction is a round of shuffles and a barrier, each comparison one more
    instruction a logit): the statistics' loop takes the chunk's max and Σexp (and Σz
    with label smoothing) and nothing else over the whole chunk; the first index of a
    new max is looked for under a `cond` (a chunk whose max beats every earlier one), the
    target's logit is one load after the loop, and the gradient's loop compares indices
    only under a `cond` too (the chunk that holds the target)."""
    from helpers import pallas_calls

    z, t = jnp.zeros((2, 96), jnp.float32), jnp.zeros(2, jnp.int32)
    scale = jnp.ones(2, jnp.float32)
    for smoothing, reductions in ((0.0, ["reduce_max", "reduce_sum"]),
                                  (0.1, ["reduce_max", "reduce_sum", "reduce_sum"])):
        traced = jax.make_jaxpr(lambda z: loss_kernel.row_statistics_and_gradient(
            z, t, scale, smoothing, chunk=16))(z)
        (call,) = pallas_calls(traced.jaxpr)
        statistics, gradient = _loop_bodies(call.params["jaxpr"])
        for body in (statistics, gradient):
            names = [e.primitive.name for e in body.eqns]
            assert "iota" not in names and "cond" in names, names
            assert not [e for e in body.eqns if e.primitive.name == "eq"
                        and e.invars[0].aval.dtype == jnp.int32], names
        assert sorted(n for n in (e.primitive.name for e in statistics.eqns)
                      if n.startswith("reduce_")) == sorted(reductions)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_head_cross_entropy_kernels_equal_xla_and_float64(smoothing):
    """Loss, accuracy and the gradients of hidden, kernel and bias: the kernels' path
    (the gradient computed in the forward pass, scaled in the backward) against XLA's
    loss and the float64 reference, with padding weights."""
    h, k, bias, tg, w = _inputs(t=6, v=37)

    def run(implementation):
        def f(h, k, b):
            return head_cross_entropy(h, k, tg, w, bias=b, label_smoothing=smoothing,
                                      implementation=implementation)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(h, k, bias)

    (loss, metrics), grads = run("pallas")
    (xla_loss, xla_metrics), xla_grads = run("xla")
    ref_loss, ref_accuracy, ref_grads = _reference(h, k, bias, tg, w, smoothing)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    assert float(loss) == pytest.approx(float(xla_loss), rel=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(ref_accuracy, abs=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(float(xla_metrics["accuracy"]), abs=1e-6)
    for g, xg, rg in zip(grads, xla_grads, ref_grads):
        np.testing.assert_allclose(g, rg, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(g, xg, rtol=1e-4, atol=1e-6)
    # Without differentiation only the statistics kernel runs: the same loss.
    value, _ = jax.jit(lambda: head_cross_entropy(h, k, tg, w, bias=bias, label_smoothing=smoothing,
                                                  implementation="pallas"))()
    assert float(value) == pytest.approx(float(loss), rel=1e-6)


def test_gpt_head_loss_through_the_kernels_equals_xla():
    """A tiny GPT (tied embeddings): head_loss with loss_kernel="pallas" applies the head
    to the final hidden states itself; its loss, accuracy and every gradient are XLA's."""
    cfg = gpt.GPTConfig(vocab_size=40, max_len=8, num_layers=1, d_model=16, num_heads=2,
                        dropout_rate=0.0)
    model = gpt.GPT(cfg)
    rng = np.random.default_rng(3)
    inputs = jnp.asarray(rng.integers(0, 40, (2, 8)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 8)), jnp.int32)
    params = jax.tree.map(lambda x: x, jax.jit(model.init)(jax.random.key(0), inputs)["params"])
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))

    def f(p, kernel):
        (loss, m), _ = gpt.head_loss(model, p, inputs, targets, loss_kernel=kernel)
        return loss, m

    def run(kernel):
        return jax.jit(jax.value_and_grad(lambda p: f(p, kernel), has_aux=True))(params)

    assert "pallas_call" in str(jax.make_jaxpr(lambda p: f(p, "pallas"))(params))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda p: f(p, "xla"))(params))

    (loss, m), grads = run("pallas")
    (xla_loss, xla_m), xla_grads = run("xla")
    assert float(loss) == pytest.approx(float(xla_loss), rel=1e-6)
    assert float(m["accuracy"]) == float(xla_m["accuracy"])
    for g, xg in zip(jax.tree.leaves(grads), jax.tree.leaves(xla_grads)):
        np.testing.assert_allclose(g, xg, rtol=1e-4, atol=1e-7)


def test_auto_takes_the_kernels_on_gpus_where_they_pay():
    assert choose_loss_kernel("xla") == "xla" and choose_loss_kernel("pallas") == "pallas"
    assert choose_loss_kernel("auto") == "xla"  # this CPU host
    with compiling_for("gpu"):
        assert choose_loss_kernel("auto") == "pallas"
        assert choose_loss_kernel("auto", vocab=50304) == "pallas"
        assert choose_loss_kernel("auto", vocab=65) == "xla"  # characters: cheap logits
        assert choose_loss_kernel("auto", jnp.float64) == "xla"  # Triton has no float64
        # Rows split over the devices: each runs the kernels on its own; a vocabulary
        # split over them: XLA's loss.
        with jax.set_mesh(jax.make_mesh((8,), ("data",))), nn.logical_axis_rules(DEFAULT_RULES):
            assert choose_loss_kernel("auto") == "pallas"
        with jax.set_mesh(jax.make_mesh((4, 2), ("data", "tensor"))), \
                nn.logical_axis_rules(DEFAULT_RULES):
            assert choose_loss_kernel("auto") == "xla"


@pytest.mark.parametrize("mesh_shape, names", [((8,), ("data",)),
                                               ((2, 2, 2), ("data", "fsdp", "sequence"))])
def test_kernels_on_each_device_s_rows_under_a_mesh(mesh_shape, names):
    """8 devices, as the trainer's mesh (sharding.make_mesh: Auto axes): the batch split
    over data (and fsdp), the length over sequence; each device runs the kernels on its
    rows (a shard_map), and loss, accuracy and gradients are one device's."""
    h, k, bias, tg, w = _inputs(b=8, t=4, v=37)
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))

    def run(implementation, sharded):
        def f(h, k, b):
            return head_cross_entropy(h, k, tg, w, bias=b, implementation=implementation)
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
        if not sharded:
            return step(h, k, bias)
        with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
            rows = NamedSharding(mesh, P(tuple(a for a in names if a != "sequence"),
                                         "sequence" if "sequence" in names else None))
            hs = jax.device_put(h, rows)
            assert "shard_map" in str(jax.make_jaxpr(f)(hs, k, bias))
            return step(hs, k, bias)

    (loss, m), grads = run("pallas", True)
    (want, want_m), want_grads = run("xla", False)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert float(m["accuracy"]) == pytest.approx(float(want_m["accuracy"]), abs=1e-7)
    for g, wg in zip(grads, want_grads):
        np.testing.assert_allclose(g, wg, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh_shape, names, says", [
    ((8,), ("data",), r"batch 4 does not divide over mesh axes \('data',\): each device "
                      r"computes the loss of every row"),
    ((4, 2), ("data", "tensor"), r"the mesh splits the vocabulary over \('tensor',\); each "
                                 r"device gathers its rows' logits whole")])
def test_kernels_asked_for_where_rows_cannot_split_say_so(mesh_shape, names, says, caplog):
    """loss_kernel='pallas' on a batch the data axis does not divide, or on a mesh that
    splits the vocabulary (where auto takes xla): still the one-device loss, and one line
    saying what it costs."""
    h, k, _, tg, w = _inputs(b=4, t=4, v=37)
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    f = lambda h, k: head_cross_entropy(h, k, tg, w, implementation="pallas")[0]  # noqa: E731
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        loss = jax.jit(f)(h, k)
    want = head_cross_entropy(h, k, tg, w, implementation="xla")[0]  # one device
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert any(re.search(says, r.getMessage()) for r in caplog.records), caplog.text


def test_bad_loss_kernel_names_the_valid_values():
    with pytest.raises(ValueError, match=r"loss kernel 'triton' is unknown; valid: "
                                         r"\('auto', 'xla', 'pallas'\)"):
        choose_loss_kernel("triton")
    h, k, _, tg, _ = _inputs(t=2, v=5)
    with pytest.raises(ValueError, match=r"kernel has shape \(5, 8\); valid: \[D, V\] with D = 8"):
        head_cross_entropy(h, k.T, tg, implementation="pallas")
    with pytest.raises(ValueError, match=r"targets has shape \(2, 3\); valid: \(2, 2\)"):
        head_cross_entropy(h, k, tg[:, :1].repeat(3, 1), implementation="pallas")
    with pytest.raises(ValueError, match=r"logits has shape \(4,\); valid: \[M, V\]"):
        loss_kernel.row_statistics(jnp.zeros(4), jnp.zeros(4, jnp.int32))
    model = gpt.GPT(gpt.GPTConfig(vocab_size=40, max_len=8, num_layers=1, d_model=16, num_heads=2))
    with pytest.raises(ValueError, match=r"loss_kernel='pallas' computes the loss over the whole "
                                         r"logits; chunk_size=4 .* valid"):
        gpt.head_loss(model, {}, jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32),
                      chunk_size=4, loss_kernel="pallas")
    c = load("gpt").get_config()
    assert c.train.loss_kernel == "auto"
    c.train.loss_kernel = "fused"
    with pytest.raises(ConfigError, match=r"config.train.loss_kernel='fused'.*auto.*xla.*pallas"):
        config_lib.validate(c)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_kernels_equal_xla_in_bfloat16_on_a_gpu():
    """Triton-compiled: GPT-2's head (V = 50304: twelve chunks and two pieces) in bf16,
    loss and gradients against XLA's loss on the same bf16 logits."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 256, 128, 50304
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)

    def run(implementation):
        f = lambda h, k: head_cross_entropy(h, k, targets, implementation=implementation)[0]
        return jax.jit(jax.value_and_grad(f, (0, 1)))(hidden, kernel)

    (lk, gk), (lx, gx) = run("pallas"), run("xla")
    assert float(lk) == pytest.approx(float(lx), rel=1e-4)
    for a, c in zip(gx, gk):
        a, c = a.astype(jnp.float32), c.astype(jnp.float32)
        assert float(jnp.linalg.norm(a - c) / jnp.linalg.norm(a)) < 1e-2
    z = jnp.asarray(rng.normal(size=(64, v)) * 3, jnp.bfloat16)
    tg = jnp.asarray(rng.integers(0, v, 64), jnp.int32)
    lse, tz, _, first = loss_kernel.row_statistics(z, tg)
    ref = _row_reference(np.asarray(z.astype(jnp.float32)), np.asarray(tg))
    np.testing.assert_allclose(lse, ref[0], rtol=1e-5)
    np.testing.assert_array_equal(first, ref[3])
    loss, _ = cross_entropy(z.astype(jnp.float32), tg)
    assert float(jnp.mean(lse - tz)) == pytest.approx(float(loss), rel=1e-5)


def test_launch_settings_apply_within_and_end_with_it():
    """loss_kernel.settings (bench loss sweeps them on a GPU): the kernels traced within
    load the chunk given (a row of 96 in loads of 16, none of which the default makes),
    give the same statistics, and the defaults are back after; bad values are named."""
    rng = np.random.default_rng(0)
    z, t = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32), jnp.asarray([0, 5, 95])
    def traced():  # a new function each time: JAX caches a trace by the function
        return str(jax.make_jaxpr(lambda: loss_kernel.row_statistics(z, t))())
    with loss_kernel.settings(chunk=16, num_warps=4):
        inside = traced()
        lse = loss_kernel.row_statistics(z, t)[0]
    assert "+16]" in inside and "+16]" not in traced()  # loads z[i:i+16]
    stats = lambda: loss_kernel.row_statistics(z, t)  # noqa: E731
    np.testing.assert_allclose(lse, stats()[0], rtol=1e-6)
    assert loss_kernel.SETTINGS.current() == {"chunk": loss_kernel.CHUNK,
                                              "num_warps": loss_kernel.NUM_WARPS,
                                              "num_stages": loss_kernel.NUM_STAGES,
                                              "cache_hints": loss_kernel.CACHE_HINTS}
    for bad, says in (({"chunk": 100}, "chunk=100; valid: a power of two >= 16"),
                      ({"num_stages": 0}, "num_stages=0; valid: an int >= 1"),
                      ({"num_warps": 12}, "num_warps=12; valid: a power of two >= 1"),
                      ({"cache_hints": 2}, "cache_hints=2; valid: 0 or 1")):
        with pytest.raises(ValueError, match=re.escape(says)):
            with loss_kernel.settings(**bad):
                pass
