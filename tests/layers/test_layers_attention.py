"""Attention layer, positions, norms, MLPs and blocks: properties from the lectures."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import attention as attention_lib
from attention_jax.layers import (BlockConfig, MultiHeadAttention, TransformerStack, apply_rope,
                                  make_norm, sinusoidal)
from attention_jax.layers.mlp import MLP, GatedMLP, gated_hidden


def _x(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def test_sinusoidal_matches_the_formula():
    pos, dim = np.array([0, 1, 7, 50]), 16
    got = np.asarray(sinusoidal(jnp.asarray(pos), dim))
    i = np.arange(dim // 2)
    angle = pos[:, None] / 10000.0 ** (2 * i[None] / dim)
    want = np.zeros((4, dim))
    want[:, 0::2], want[:, 1::2] = np.sin(angle), np.cos(angle)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_rope_scores_depend_only_on_relative_offset():
    q, k = _x((1, 1, 1, 16), 1), _x((1, 1, 1, 16), 2)

    def score(i, j):
        qi = apply_rope(q, jnp.array([[i]]))
        kj = apply_rope(k, jnp.array([[j]]))
        return float(jnp.sum(qi * kj))

    for offset in (0, 3, -5):
        scores = [score(p + offset, p) for p in (0, 4, 17, 100)]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-4, atol=1e-4)
    assert abs(score(3, 0) - score(0, 3)) > 1e-3  # positions matter (not the identity map)
    # a rotation: norms are preserved
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, jnp.array([[9]]))),
                               jnp.linalg.norm(q), rtol=1e-5)
    # In float64 the angles are float64 too: the property holds far out (their float32
    # angles were 1.7e-3 off at a million), and the sinusoidal table is float64 as asked.
    with jax.enable_x64(True):
        q64, k64 = q.astype(jnp.float64), k.astype(jnp.float64)
        far = [float(jnp.sum(apply_rope(q64, jnp.array([[p + 3]]))
                             * apply_rope(k64, jnp.array([[p]])))) for p in (0, 10**4, 10**6)]
        np.testing.assert_allclose(far, far[0], rtol=1e-9)
        table = sinusoidal(jnp.array([10**6]), 8, dtype=jnp.float64)
        assert table.dtype == jnp.float64
        np.testing.assert_allclose(table[0, 0], np.sin(10**6), rtol=1e-9)
    for x, positions in ((_x((2, 1, 8)), jnp.zeros((1, 2), jnp.int32)),  # x without heads
                         (q, jnp.array([0])),  # positions without the batch axis
                         (_x((1, 3, 1, 16)), jnp.zeros((1, 2), jnp.int32))):  # another T
        with pytest.raises(ValueError, match=r"^apply_rope: x shape .*; valid: x \[B, T, N, "
                                             r"H\] with positions \[B, T\] or \[1, T\]"):
            apply_rope(x, positions)


@pytest.mark.parametrize("cross", [False, True])
def test_reference_and_blockwise_agree_in_value_and_gradient(cross, monkeypatch):
    # Tiles of 4: several per row, so the blockwise scan really runs over blocks.
    monkeypatch.setattr(attention_lib, "default_block_sizes", lambda *args, **kwargs: (4, 4))
    x, ctx = _x((2, 12, 32), 0), _x((2, 10, 24), 1)
    kv_mask = jnp.arange(10)[None] < jnp.array([[10], [6]])
    kwargs = dict(num_heads=4, num_kv_heads=2)
    inputs = dict(context=ctx, kv_mask=kv_mask) if cross else dict(positions=None)
    # (rope and causality are self-attention's: a cross-attention refuses them)
    kwargs.update(causal=not cross, rope_base=None if cross else 1e4)
    ref = MultiHeadAttention(implementation="reference", **kwargs)
    blk = MultiHeadAttention(implementation="blockwise", **kwargs)
    params = jax.jit(lambda: ref.init(jax.random.PRNGKey(2), x, **inputs)["params"])()

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply({"params": p}, x, **inputs)[0]))

    (lr, gr), (lb, gb) = (jax.jit(jax.value_and_grad(loss(m), argnums=(0, 1)))(params, x)
                          for m in (ref, blk))
    np.testing.assert_allclose(lr, lb, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _matmuls(module, params, x):
    """The layer's matmuls (the attention kernels' own tile products are inside their calls)."""
    jaxpr = jax.make_jaxpr(lambda p: module.apply({"params": p}, x)[0])(params).jaxpr
    return sum(eqn.primitive.name == "dot_general" for eqn in jaxpr.eqns)


def test_pallas_reads_one_projection_of_q_k_v_in_place():
    """With the Pallas kernels, self-attention projects q, k and v in one matmul and hands
    its [B, T, 3, N, H] product to the kernels (the bias folded in): values and
    gradients as blockwise's three projections, with the same parameters. RoPE rotates q
    and k before the kernels see them, so it keeps three projections."""
    x = _x((2, 40, 32), 0)
    ids = jnp.asarray(np.repeat([[0] * 17 + [1] * 23], 2, 0), jnp.int32)
    layers = {impl: MultiHeadAttention(num_heads=2, causal=True, implementation=impl)
              for impl in ("pallas", "blockwise")}
    params = layers["blockwise"].init(jax.random.PRNGKey(1), x)["params"]
    params = jax.tree.map(lambda p: p + 0.1 * _x(p.shape, 3), params)  # non-zero biases
    assert set(params) == {"qkv", "qkv_bias", "out", "out_bias"}

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply({"params": p}, x, segment_ids=ids)[0]))

    (lp, gp), (lb, gb) = (jax.value_and_grad(loss(layers[i]), argnums=(0, 1))(params, x)
                          for i in ("pallas", "blockwise"))
    np.testing.assert_allclose(lp, lb, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert _matmuls(layers["pallas"], params, x) == 2  # q, k, v as one; the output
    assert _matmuls(layers["blockwise"], params, x) == 4
    rope = MultiHeadAttention(num_heads=2, causal=True, implementation="pallas", rope_base=1e4)
    assert _matmuls(rope, params, x) == 4


def test_attention_weights_are_returned_causal_and_normalised():
    x = _x((2, 6, 16))
    mha = MultiHeadAttention(num_heads=2, causal=True)
    params = jax.jit(mha.init)(jax.random.PRNGKey(0), x)
    _, aux = jax.jit(lambda p, x: mha.apply(p, x, return_weights=True))(params, x)
    w = np.asarray(aux["attention_weights"])  # [B, N, T, S]
    assert w.shape == (2, 2, 6, 6)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(w, k=1) == 0)


def test_parameters_follow_shape_letters_with_logical_axes():
    x, ctx = _x((1, 4, 32)), _x((1, 3, 24))
    fused = jax.eval_shape(MultiHeadAttention(num_heads=4).init, jax.random.PRNGKey(0), x)["params"]
    assert fused["qkv"].value.shape == (32, 3, 4, 8)
    assert fused["qkv"].names == ("embed", None, "heads", "head_dim")
    assert fused["out"].value.shape == (4, 8, 32)
    gqa = jax.eval_shape(MultiHeadAttention(num_heads=4, num_kv_heads=1).init,
                         jax.random.PRNGKey(0), x, ctx)
    assert gqa["params"]["query"].value.shape == (32, 4, 8)
    assert gqa["params"]["kv"].value.shape == (24, 2, 1, 8)
    assert gqa["params"]["kv"].names[2] == "kv_heads"


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=5), r"num_heads=5 does not divide.*\[1, 2, 4, 8, 16, 32\]"),
    (dict(num_heads=4, num_kv_heads=3), r"num_kv_heads=3 must divide.*\[1, 2, 4\]"),
    (dict(num_heads=4, implementation="flash"), r"valid: \('auto'"),
])
def test_bad_attention_configs_raise_with_valid_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(MultiHeadAttention(**kwargs).init, jax.random.PRNGKey(0), _x((1, 4, 32)))


def test_a_sequence_without_its_batch_axis_is_named():
    """x [T, D] was "not enough values to unpack"."""
    with pytest.raises(ValueError, match=r"x: shape \(4, 32\); valid: \[B, T, D\] \(one "
                                         r"sequence: x\[None\]\)"):
        jax.eval_shape(MultiHeadAttention(num_heads=4).init, jax.random.PRNGKey(0), _x((4, 32)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(norm_position="middle"), r"valid: \('pre', 'post'\)"),
    (dict(norm="batchnorm"), r"valid: \('layernorm', 'rmsnorm'\)"),
    (dict(mlp="kan"), r"valid: \('mlp', 'glu', 'swiglu', 'geglu', 'moe'\)"),
    (dict(num_kv_heads=3), r"valid: \[1, 2, 4\]"),
    # The MLP reads `mlp_dim or 4 * D`: 0 was silently the default width.
    (dict(mlp_dim=0), r"mlp_dim must be a positive integer; got 0 \(valid: an integer >= 1 "
                      r"or None \(the 'mlp' default width\)\)"),
    # From the command line a string or a float reached a comparison or a shape.
    (dict(mlp_dim=2.5), r"mlp_dim must be a positive integer; got 2\.5"),
    (dict(mlp_dim="abc"), r"mlp_dim must be a positive integer; got 'abc'"),
    (dict(num_heads="4"), r"num_heads must be a positive integer; got '4'"),
    (dict(mlp="moe", top_k="x"), r"top_k must be a positive integer; got 'x'"),
    (dict(mlp="moe", num_experts=2.0), r"num_experts must be a positive integer; got 2\.0"),
    (dict(mlp="moe", capacity_factor="abc"), r"capacity_factor='abc'; valid: a number > 0"),
])
def test_bad_block_configs_raise_with_valid_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockConfig(**{"num_heads": 4, **kwargs})
    with pytest.raises(ValueError, match="remat_policy"):
        jax.eval_shape(TransformerStack(BlockConfig(num_heads=4), 1, remat_policy="some").init,
                       jax.random.PRNGKey(0), _x((1, 4, 32)))


def test_norms_and_mlps():
    x = _x((2, 3, 8)) * 5 + 2
    ln = make_norm("layernorm")
    y = ln.apply(ln.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-5)
    rms = make_norm("rmsnorm")
    y = rms.apply(rms.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y ** 2, -1)), 1, rtol=1e-3)
    with pytest.raises(ValueError, match="valid"):
        make_norm("groupnorm")
    assert gated_hidden(4096, 256) == 11008  # LLaMA-7B's F
    assert gated_hidden(64, 64) == 192
    p = jax.eval_shape(MLP().init, jax.random.PRNGKey(0), x)["params"]
    assert p["wi"]["kernel"].value.shape == (8, 32)  # F = 4D
    p = jax.eval_shape(GatedMLP(multiple_of=16).init, jax.random.PRNGKey(0), x)["params"]
    assert p["wg"]["kernel"].value.shape == (8, 32)  # 8·8/3 = 21.3 -> 32
    with pytest.raises(ValueError, match="valid"):
        jax.eval_shape(MLP(activation="swish2").init, jax.random.PRNGKey(0), x)


def test_norm_position_switch():
    """Post-norm ends each block with a norm (Add & Norm); pre-norm leaves the residual raw."""
    x = _x((2, 5, 16)) * 3 + 1
    for position, normalised in (("post", True), ("pre", False)):
        stack = TransformerStack(BlockConfig(num_heads=2, norm_position=position), 1)
        y, _ = jax.jit(stack.apply)(jax.jit(stack.init)(jax.random.PRNGKey(0), x), x)
        is_norm = np.allclose(y.mean(-1), 0, atol=1e-4) and np.allclose(y.std(-1), 1, atol=1e-2)
        assert is_norm == normalised, position


@pytest.mark.parametrize("position", ["pre", "post"])
def test_encoder_without_positions_is_permutation_equivariant(position):
    x = _x((2, 7, 16))
    perm = np.array([3, 0, 6, 1, 5, 2, 4])
    stack = TransformerStack(BlockConfig(num_heads=4, norm_position=position), 2, block="encoder")
    params = jax.jit(stack.init)(jax.random.PRNGKey(0), x)
    y, _ = jax.jit(stack.apply)(params, x)
    y_perm, _ = jax.jit(stack.apply)(params, x[:, perm])
    np.testing.assert_allclose(y_perm, y[:, perm], atol=1e-5)
    causal = TransformerStack(BlockConfig(num_heads=4, causal=True), 2)  # and a decoder is not
    yc, _ = jax.jit(causal.apply)(params, x)
    yc_perm, _ = jax.jit(causal.apply)(params, x[:, perm])
    assert not np.allclose(yc_perm, yc[:, perm], atol=1e-3)


def test_scan_and_remat_match_the_unrolled_stack():
    x = _x((2, 6, 16))
    cfg = BlockConfig(num_heads=2, causal=True)
    loop = TransformerStack(cfg, 3)
    scan = TransformerStack(cfg, 3, scan_layers=True, remat_policy="full")
    loop_params = jax.jit(loop.init)(jax.random.PRNGKey(0), x)["params"]
    unboxed = jax.tree.map(lambda b: b.value, loop_params,
                           is_leaf=lambda b: hasattr(b, "names"))
    stacked = {"layers": jax.tree.map(lambda *ls: jnp.stack(ls), *unboxed.values())}
    scan_shapes = jax.eval_shape(lambda: scan.init(jax.random.PRNGKey(0), x))["params"]
    assert scan_shapes["layers"]["self_attention"]["qkv"].names[0] == "layers"

    def loss(module, p):
        y, _ = module.apply({"params": p}, x, return_weights=False)
        return jnp.sum(y ** 2)

    l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(loop, p)))(unboxed)
    l2, g2 = jax.jit(jax.value_and_grad(lambda p: loss(scan, p)))(stacked)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    g1 = {"layers": jax.tree.map(lambda *ls: jnp.stack(ls), *g1.values())}
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_decoding_past_the_cache_is_named_where_positions_are_known():
    """Eager decoding past the cache's slots wrote nothing where it should (the write
    clamps) and returned outputs 0.5-1.0 off the full pass, with nothing said."""
    mha = MultiHeadAttention(num_heads=4, causal=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 32))
    params = mha.init(jax.random.PRNGKey(1), x)["params"]
    full, _ = mha.apply({"params": params}, x)
    cache = mha.init(jax.random.PRNGKey(1), x[:, :4], decode=True,
                     positions=jnp.zeros((1, 4), jnp.int32))["cache"]
    for t in range(4):
        (y, _), state = mha.apply({"params": params, "cache": cache}, x[:, t:t + 1],
                             positions=jnp.array([[t]]), decode=True, mutable=["cache"])
        cache = state["cache"]
        np.testing.assert_allclose(y[:, 0], full[:, t], atol=1e-5)
    with pytest.raises(ValueError, match=r"decode: position 4 is past the cache's 4 slots \(the "
                                         r"length of the input it was created with\); valid: "
                                         r"positions 0..3, or a cache created with a longer "
                                         r"input"):
        mha.apply({"params": params, "cache": cache}, x[:, 4:5], positions=jnp.array([[4]]),
                  decode=True, mutable=["cache"])


def test_decoding_with_float64_on_and_without_a_cache():
    """Under jax_enable_x64 the cache write's literal indices were int64 beside int32
    positions: every KV-cache decode (generate, greedy, beam) raised in lax.concatenate.
    Applied without a cache it said "past the cache's 1 slots"."""
    mha = MultiHeadAttention(num_heads=2, causal=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 8))
    with jax.enable_x64(True):
        variables = mha.init(jax.random.PRNGKey(1), x, positions=jnp.arange(4)[None],
                             decode=True)
        full, _ = mha.apply({"params": variables["params"]}, x)
        (y, _), _ = mha.apply(variables, x[:, :1], positions=jnp.array([[0]]), decode=True,
                              mutable=["cache"])
        np.testing.assert_allclose(y[:, 0], full[:, 0], atol=1e-6)
    with pytest.raises(ValueError, match=r"decode=True without a cache: create it with "
                                         r"init\(\.\.\., decode=True\)"):
        mha.apply({"params": variables["params"]}, x[:, :1], positions=jnp.array([[0]]),
                  decode=True, mutable=["cache"])


def test_what_only_self_attention_reads_is_refused_with_a_context():
    """causal=True, segment_ids and rope_base were dropped without a word when a context
    was given: causal cross-attention gave the non-causal result."""
    x, context = _x((1, 4, 32)), _x((1, 6, 32))
    for module, kwargs, named in ((MultiHeadAttention(num_heads=4, causal=True), {}, "causal=True"),
                                  (MultiHeadAttention(num_heads=4),
                                   dict(segment_ids=jnp.ones((1, 4), jnp.int32)), "segment_ids"),
                                  (MultiHeadAttention(num_heads=4, rope_base=1e4), {}, "rope_base")):
        with pytest.raises(ValueError, match=rf"^{named}: for self-attention \(context=None\); "
                                             rf"a cross-attention \(context given\) attends"):
            jax.eval_shape(module.init, jax.random.PRNGKey(0), x, context, **kwargs)
    jax.eval_shape(MultiHeadAttention(num_heads=4).init, jax.random.PRNGKey(0), x, context,
                   kv_mask=jnp.ones((1, 6), bool))


@pytest.mark.parametrize("rate", [10, 1.5, -0.5])
def test_a_layer_s_dropout_rate_out_of_range_is_named(rate):
    """The layers took any rate (the model configs checked theirs): dropout_rate=10, a
    percentage, zeroed every training output, -0.5 scaled them by 1/1.5, unsaid."""
    from attention_jax.layers import MoE
    x = jnp.ones((1, 3, 8))
    for layer in (MultiHeadAttention(2, dropout_rate=rate), MLP(dropout_rate=rate),
                  GatedMLP(dropout_rate=rate), MoE(num_experts=2, top_k=1, dropout_rate=rate)):
        with pytest.raises(ValueError, match=rf"^dropout_rate={rate} is out of range; valid: "
                                             rf"0 <= dropout_rate < 1"):
            jax.eval_shape(layer.init, jax.random.key(0), x)


@pytest.mark.parametrize("hidden", [0, -4, 2.5])
def test_a_feed_forward_layer_s_hidden_width_is_checked(hidden):
    """hidden=0 was read as the default width (4D, or 8D/3 for the gated MLP), unsaid."""
    from attention_jax.layers import MoE
    x = jnp.ones((1, 3, 8))
    for layer in (MLP(hidden=hidden), GatedMLP(hidden=hidden),
                  MoE(num_experts=2, top_k=1, hidden=hidden)):
        with pytest.raises(ValueError, match=rf"^hidden must be a positive integer; got "
                                             rf"{hidden}"):
            jax.eval_shape(layer.init, jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"^multiple_of must be a positive integer; got 0"):
        jax.eval_shape(GatedMLP(multiple_of=0).init, jax.random.key(0), x)
    for layer in (MLP(), GatedMLP(multiple_of=16), MoE(num_experts=2, top_k=1)):  # None: default
        jax.eval_shape(layer.init, jax.random.key(0), x)
