"""The residual add and norm as Pallas kernels (layers/norm_kernel.py; interpret mode on
this host): values and gradients against the float64 reference, the block that uses them
against XLA's ops, which kernel `auto` picks, bad input named, under a mesh per device,
and compiled for an H100 what XLA's fusions did there is gone."""

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from attention_jax.attention import compiling_for
from attention_jax.layers import norm_kernel
from attention_jax.layers.blocks import BlockConfig, TransformerBlock
from attention_jax.layers.norms import add_normalize, choose_norm_kernel
from attention_jax.tools.bench import gpu_hlo
from helpers import all_eqns, json_from_cuda_plugin_child, pallas_calls


def _reference(x, y, y_bias, scale, bias, centered, eps=1e-6):
    r = x + (0 if y is None else y) + (0 if y_bias is None else y_bias)
    mu = r.mean(-1, keepdims=True) if centered else 0.0
    var = ((r - mu) ** 2).mean(-1, keepdims=True)
    return r, (r - mu) / jnp.sqrt(var + eps) * scale + (0 if bias is None else bias)


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    return (rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal(d),
            1 + 0.1 * rng.standard_normal(d), rng.standard_normal(d),
            rng.standard_normal(shape), rng.standard_normal(shape))


@pytest.mark.parametrize("centered", [True, False], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("with_y", [True, False], ids=["add", "no-add"])
def test_values_and_gradients_match_float64(x64, centered, with_y):
    """D = 96 goes in pieces of 64 and 32; 2 × 40 rows: programs of one row, the
    backward's of 16 (its partial sums then cover 5 programs). The gradient reaching r along the
    residual path (gr) and that reaching the norm (gn) both count."""
    x, y, yb, s, b, gr, gn = _inputs((2, 40, 96))
    args = (x, y if with_y else None, yb if with_y else None, s, b if centered else None)
    present = tuple(i for i, a in enumerate(args) if a is not None)

    def loss(fn, *a):
        r, n = fn(*a)
        return jnp.vdot(r, gr) + jnp.vdot(n, gn)

    kernel = lambda *a: norm_kernel.add_norm(*a, centered=centered, interpret=True)  # noqa: E731
    want = _reference(*map(lambda a: None if a is None else jnp.asarray(a), args), centered)
    as32 = [None if a is None else jnp.asarray(a, jnp.float32) for a in args]
    got = kernel(*as32)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=present))(*as32)
    wants = jax.jit(jax.grad(lambda *a: loss(lambda *b: _reference(*b, centered), *a),
                             argnums=present))(*map(lambda a: None if a is None else jnp.asarray(a), args))
    for g, w in zip(grads, wants):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))


@pytest.mark.parametrize("given", [dict(rows=8, program_rows=8, num_warps=4),
                                   dict(rows=2, program_rows=2, num_warps=2)],
                         ids=["eight-rows-four-warps", "programs-of-one-step"])
def test_launch_settings_compute_the_same(given, x64):
    """norm_kernel.settings (bench norm sweeps them on a GPU): other rows a step, rows a
    backward program and warps give the same values and gradients (D = 96 in pieces of
    64 and 32; 2 × 8 rows, so the backward's partial sums cover 4 or 8 programs)."""
    x, y, yb, s, b, gr, gn = _inputs((2, 8, 96), seed=2)
    as32 = [jnp.asarray(a, jnp.float32) for a in (x, y, yb, s, b)]

    def loss(fn, *a):
        r, n = fn(*a)
        return jnp.vdot(r, gr) + jnp.vdot(n, gn)

    kernel = lambda *a: norm_kernel.add_norm(*a, interpret=True)  # noqa: E731
    grad = jax.value_and_grad(lambda *a: loss(kernel, *a), argnums=tuple(range(5)))
    with norm_kernel.settings(**given):
        got = grad(*as32)
        traced = jax.make_jaxpr(grad)(*as32)
    # the programs the settings make: forward 16 rows / rows, backward 16 / program_rows
    grids = [e.params["grid_mapping"].grid for e in pallas_calls(traced.jaxpr)]
    assert grids == [(16 // given["rows"],), (16 // given["program_rows"],)], grids
    want = jax.value_and_grad(lambda *a: loss(lambda *c: _reference(*c, True), *a),
                              argnums=tuple(range(5)))(*map(jnp.asarray, (x, y, yb, s, b)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))
    assert norm_kernel.SETTINGS.current() == {"rows": norm_kernel.ROWS, "program_rows":
                                              norm_kernel.PROGRAM_ROWS,
                                              "num_warps": norm_kernel.NUM_WARPS}
    assert not any(norm_kernel.SETTINGS.given(n) for n in ("rows", "program_rows", "num_warps"))


def test_bad_launch_settings_name_the_valid_values():
    with pytest.raises(ValueError, match=r"rows=3; valid: a power of two >= 1"):
        with norm_kernel.settings(rows=3):
            pass
    with pytest.raises(ValueError, match=r"program_rows=4 with rows=8: .*valid: "
                                         r"program_rows >= rows"):
        with norm_kernel.settings(rows=8, program_rows=4):
            pass
    with pytest.raises(ValueError, match=r"program_rows=16 with rows=128"):
        with norm_kernel.settings(rows=128):  # the default program_rows is 16
            pass
    assert norm_kernel.SETTINGS["rows"] == norm_kernel.ROWS  # nothing changed by either


def _inline_asm(jaxpr):
    """The asm strings of a kernel's inline blocks, its loops' bodies included."""
    return [e.params["asm"] for e in all_eqns(jaxpr)
            if e.primitive.name == "elementwise_inline_asm_p"]


def _grids(fn, *args):
    """{kernel name: grid} of the pallas_calls fn traces to."""
    traced = jax.make_jaxpr(fn)(*args)
    return {e.params["name"]: e.params["grid_mapping"].grid for e in pallas_calls(traced.jaxpr)}


def test_on_a_gpu_the_backward_grid_fills_the_sms():
    """By default one row in one warp a step (GPT-2 small's 16,384 rows of 768: 16,384
    forward programs, 1024 backward programs of 16 rows). Traced for a GPU, a backward
    program walks fewer rows where the grid would have fewer than BACKWARD_PROGRAMS
    programs (2048 rows: 256 of 8), never fewer than a step's rows; interpreted, and where
    program_rows is given (a sweep's row), the setting stands. Not below MIN_PROGRAM_ROWS
    (each program's partial sums would outweigh its rows)."""
    from attention_jax.attention import compiling_for

    assert norm_kernel.launch(16384, 768) == {"rows": 1, "program_rows": 16, "num_warps": 1}
    rows = norm_kernel._program_rows
    assert rows(2048, 1, gpu=True) == 8 and rows(2048, 1, gpu=False) == 16
    assert rows(8192, 1, gpu=True) == 16
    assert rows(800, 8, gpu=True) == 8  # 800 = 16·50: 50 programs, halved down to 8 rows
    assert rows(1024, 1, gpu=True) == 8  # 128 programs: halved to MIN_PROGRAM_ROWS, no further
    with norm_kernel.settings(program_rows=16):
        assert rows(2048, 1, gpu=True) == 16
    x = jax.ShapeDtypeStruct((2, 1024, 1024), jnp.bfloat16)  # medium's activations at batch 2
    s = jax.ShapeDtypeStruct((1024,), jnp.float32)
    grad = jax.grad(lambda x, y, s: jnp.sum(norm_kernel.add_norm(x, y, None, s, s)[1]
                                            .astype(jnp.float32)), argnums=(0, 1))
    with compiling_for("gpu"):
        assert _grids(grad, x, x, s) == {"add_norm_forward": (2048,), "add_norm_backward": (256,)}


def test_wide_rows_take_more_warps(x64):
    """By default a thread holds at most THREAD_ELEMENTS of a row tile at a time (GPT-2
    XL's 8 rows of 1600 in 4 warps, 100 a thread, spilled in the backward compiled for an
    H100): one row in one warp up to 2048 features, wider rows more warps (4096: two), up
    to MOST_WARPS; warps given stand as given, and rows given take the warps they need
    (8 rows of 1600: eight). 12 rows of 1600 are 12 forward programs and 3 backward ones
    of 4 rows; a step's rows must divide the rows, which with rows=8 12 does not. The
    values and gradients at 1600 (pieces of 1024, 512 and 64; the kernels work in
    float32) match float64."""
    widths = (96, 768, 1024, 1600, 2048, 4096, 10 ** 5)
    assert [norm_kernel.launch(64, d)["num_warps"] for d in widths] == [1, 1, 1, 1, 1, 2, 32]
    assert {norm_kernel.launch(64, d)["rows"] for d in widths} == {1}
    with norm_kernel.settings(num_warps=1):
        assert norm_kernel.launch(64, 4096)["num_warps"] == 1
    with norm_kernel.settings(rows=8):
        assert norm_kernel.launch(1 << 16, 1600) == {"rows": 8, "program_rows": 16, "num_warps": 8}
        assert "not a multiple of 8" in norm_kernel.unsupported((12, 768))
    assert norm_kernel.unsupported((12, 1600)) is None
    x, y, yb, s, b, gr, gn = _inputs((12, 1600), seed=3)

    def loss(fn, *a):
        r, n = fn(*a)
        return jnp.vdot(r, gr) + jnp.vdot(n, gn)

    kernel = lambda *a: norm_kernel.add_norm(*a, interpret=True)  # noqa: E731
    grad = jax.value_and_grad(lambda *a: loss(kernel, *a), argnums=tuple(range(5)))
    args = tuple(map(jnp.asarray, (x, y, yb, s, b)))
    assert _grids(grad, *args) == {"add_norm_forward": (12,), "add_norm_backward": (3,)}
    want = jax.value_and_grad(lambda *a: loss(lambda *c: _reference(*c, True), *a),
                              argnums=tuple(range(5)))(*args)
    for g, w in zip(jax.tree.leaves(grad(*args)), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max()))


def test_traced_for_a_gpu_the_multiply_adds_are_one_fma_each():
    """Lowering for Triton (traced as for an H100, no GPU needed to trace): the forward's
    x̂·γ + β and the backward's g - x̂·c1 and dx·rstd + dr are one `fma.rn.f32` each, for
    each piece of D (768 = 512 + 256); interpreted, none."""
    from attention_jax.attention import compiling_for

    x = jnp.zeros((8, 768), jnp.bfloat16)
    s, b = jnp.ones(768), jnp.zeros(768)
    grad = jax.grad(lambda x, y: jnp.sum(norm_kernel.add_norm(x, y, None, s, b)[1]
                                         .astype(jnp.float32)), argnums=(0, 1))
    with compiling_for("gpu"):
        traced = jax.make_jaxpr(grad)(x, x)
    found = {e.params["name"]: _inline_asm(e.params["jaxpr"]) for e in pallas_calls(traced.jaxpr)}
    assert found == {"add_norm_forward": ["fma.rn.f32 $0, $1, $2, $3;"] * 2,
                     "add_norm_backward": ["fma.rn.f32 $0, $1, $2, $3;"] * 4}, found
    interpreted = jax.make_jaxpr(lambda x, y: norm_kernel.add_norm(x, y, None, s, b,
                                                                   interpret=True))(x, x)
    assert not [a for e in pallas_calls(interpreted.jaxpr) for a in _inline_asm(e.params["jaxpr"])]


def test_bfloat16_rounds_the_sum_once(x64):
    """bfloat16 x and y: r is rounded to bfloat16 once (the sum taken in float32), and
    the norm's statistics are those of r as stored, so n is the float64 norm of that r."""
    x, y, yb, s, b, _, _ = _inputs((4, 8, 128), seed=1)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    r, n = norm_kernel.add_norm(bf(x), bf(y), bf(yb), jnp.asarray(s, jnp.float32),
                                jnp.asarray(b, jnp.float32), interpret=True)
    assert r.dtype == n.dtype == jnp.bfloat16
    exact = (bf(x).astype(jnp.float64) + bf(y).astype(jnp.float64) + bf(yb).astype(jnp.float64))
    np.testing.assert_array_equal(r, exact.astype(jnp.float32).astype(jnp.bfloat16))
    _, want = _reference(r.astype(jnp.float64), None, None, s, b, True)
    np.testing.assert_allclose(n.astype(jnp.float64), want, rtol=1e-2, atol=2e-2)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _moved_params(model, scale, x):
    """`model`'s initial params (key 1), each moved by `scale` × a normal draw (key 2).
    Jitted: op by op, each initialiser and draw was compiled alone."""
    params = model.init(jax.random.key(1), x)
    return jax.tree.map(lambda p: p + scale * jax.random.normal(jax.random.key(2), p.shape),
                        params)


def _params_of_both(models, scale, x):
    """models["xla"]'s moved params (_moved_params), with the same tree as models["pallas"]'s
    (compared through eval_shape: no values needed)."""
    params = _moved_params(models["xla"], scale, x)
    assert (jax.tree.structure(jax.eval_shape(models["pallas"].init, jax.random.key(1), x))
            == jax.tree.structure(params))
    return params


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_a_pre_norm_block_computes_as_with_xla_s_ops(norm):
    """The block with the kernels (the attention's output bias left to the next norm)
    against the block with XLA's ops: the same parameters, values and gradients."""
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))
    blocks = {k: TransformerBlock(BlockConfig(num_heads=4, causal=True, norm=norm, norm_kernel=k))
              for k in ("xla", "pallas")}
    # Non-zero biases and scales, so that leaving the output bias apart is tested.
    params = _params_of_both(blocks, 0.1, x)

    def loss(p, x, kind):
        return jnp.sum(jnp.sin(blocks[kind].apply(p, x)[0]))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    got, want = grad(params, x, "pallas"), grad(params, x, "xla")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)
    jaxpr = str(jax.make_jaxpr(lambda p: blocks["pallas"].apply(p, x))(params))
    assert jaxpr.count("pallas_call[") == 2  # both sublayers' norms (attention: blockwise here)


@pytest.mark.parametrize("scan, remat", [(False, "none"), (True, "full")],
                         ids=["layers", "scan-remat"])
def test_gpt_hands_each_residual_add_to_the_next_norm(scan, remat):
    """GPT with the kernels: each block's MLP output (its bias apart) goes to the next
    block's first norm and the last to the final norm, through nn.scan and nn.remat too.
    The same parameters as with XLA's ops, and the same loss and gradients."""
    from attention_jax.models import gpt
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
    models = {k: gpt.GPT(gpt.GPTConfig(vocab_size=64, max_len=16, num_layers=3, d_model=32,
                                       num_heads=4, scan_layers=scan, remat_policy=remat,
                                       norm_kernel=k)) for k in ("xla", "pallas")}
    params = _params_of_both(models, 0.05, tokens)

    def loss(p, kind):
        logits = models[kind].apply(p, tokens)[0]
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    got, want = grad(params, "pallas"), grad(params, "xla")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    jaxpr = str(jax.make_jaxpr(lambda p: models["pallas"].apply(p, tokens))(params))
    # Two norms a block and the final one; under nn.scan the one block is traced once.
    assert jaxpr.count("pallas_call[") == (3 if scan else 7)


def test_vit_hands_its_last_residual_add_to_the_encoder_norm():
    """ViT (pre-norm, always) likewise: its 8 × 8 digits' 17 tokens at batch 8 make 136
    rows, a multiple of 8: the kernels against XLA's ops, the same parameters."""
    from attention_jax.models import vit
    images = jax.random.normal(jax.random.key(0), (8, 8, 8, 1))
    models = {k: vit.ViT(vit.ViTConfig(image_size=8, patch_size=2, num_channels=1, d_model=32,
                                       num_layers=2, num_heads=4, mlp_dim=64, num_classes=10,
                                       norm_kernel=k)) for k in ("xla", "pallas")}
    params = _params_of_both(models, 0.05, images)
    loss = lambda p, kind: jnp.sum(jnp.sin(models[kind].apply(p, images)[0]))  # noqa: E731
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    got, want = grad(params, "pallas"), grad(params, "xla")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
    jaxpr = str(jax.make_jaxpr(lambda p: models["pallas"].apply(p, images))(params))
    assert jaxpr.count("pallas_call[") == 5  # two norms a block and the final one


def test_post_norm_blocks_take_no_pending_add():
    x = jnp.ones((2, 8, 16))
    cfg = BlockConfig(num_heads=2, norm_position="post")
    with pytest.raises(ValueError, match="is for pre-norm blocks"):
        TransformerBlock(cfg).init(jax.random.key(0), (x, x, None))
    from attention_jax.layers.blocks import TransformerStack
    with pytest.raises(ValueError, match="pending_residual=True is for pre-norm blocks"):
        TransformerStack(cfg, 2, pending_residual=True).init(jax.random.key(0), x)


def test_auto_takes_the_kernels_for_a_gpu_only():
    shape = (4, 16, 64)
    assert choose_norm_kernel("auto", shape, jnp.bfloat16) == "xla"  # this host is a CPU
    with compiling_for("gpu"):
        assert choose_norm_kernel("auto", shape, jnp.bfloat16) == "pallas"
        assert choose_norm_kernel("auto", shape, jnp.float64) == "xla"
        # 15 rows: backward programs of one row, whose partial sums outweigh the rows
        assert choose_norm_kernel("auto", (3, 5, 64), jnp.bfloat16) == "xla"
        assert choose_norm_kernel("pallas", (3, 5, 64), jnp.bfloat16) == "pallas"  # as asked
    assert choose_norm_kernel("xla", shape, jnp.bfloat16) == "xla"


def test_bad_input_is_named(caplog):
    x = jnp.ones((2, 8, 16))
    s = jnp.ones(16)
    with pytest.raises(ValueError, match=r"norm kernel 'triton' is unknown; valid: \('auto', 'xla', 'pallas'\)"):
        choose_norm_kernel("triton", x.shape, x.dtype)
    # Asked for where the kernels cannot take x (a sampler's prompts, with a sweep's 8
    # rows a step): XLA's ops, said once.
    with caplog.at_level(logging.WARNING), norm_kernel.settings(rows=8):
        r, n = add_normalize(jnp.ones((3, 5, 16)), scale=s, kernel="pallas")
        with pytest.raises(ValueError, match=r"add_norm cannot take x \(3, 5, 16\) here: 15 rows"):
            norm_kernel.add_norm(jnp.ones((3, 5, 16)), scale=s)
    assert ("norm_kernel='pallas' cannot take x (3, 5, 16) here (15 rows per device, not a "
            "multiple of 8): XLA's ops compute this call") in caplog.text
    assert r.shape == n.shape == (3, 5, 16)
    with pytest.raises(ValueError, match=r"scale has shape \(8,\); valid: \[D\] = \(16,\)"):
        norm_kernel.add_norm(x, scale=jnp.ones(8))
    with pytest.raises(ValueError, match=r"y is bfloat16\[2, 8, 16\]; valid: x's shape and dtype"):
        norm_kernel.add_norm(x, x.astype(jnp.bfloat16), scale=s)
    with pytest.raises(ValueError, match="y_bias without y"):
        norm_kernel.add_norm(x, None, s, scale=s)
    with pytest.raises(ValueError, match="y_bias without y"):  # XLA's path says so too
        add_normalize(x, None, s, scale=s, kernel="xla")
    with pytest.raises(ValueError, match="norm_kernel='cuda' is unknown"):
        BlockConfig(num_heads=2, norm_kernel="cuda")
    # Asked for where it has nothing to do: an error, not XLA's ops in silence.
    with pytest.raises(ValueError, match=r"norm_kernel='pallas' takes a pre-norm block's "
                                         r".*valid with norm_position='post': 'auto' or 'xla'"):
        BlockConfig(num_heads=2, norm_kernel="pallas", norm_position="post")


def test_pallas_asked_for_float64_keeps_its_digits(x64, caplog):
    """The kernels compute in float32: float64 activations keep XLA's ops, said once."""
    x, y, yb, s, b, _, _ = _inputs((2, 8, 16), seed=5)
    with caplog.at_level(logging.WARNING):
        r, n = add_normalize(jnp.asarray(x), jnp.asarray(y), jnp.asarray(yb), jnp.asarray(s),
                             jnp.asarray(b), kernel="pallas")
    assert r.dtype == jnp.float64 and np.array_equal(r, x + (y + yb))
    assert "norm_kernel='pallas' computes in float32; float64 activations keep XLA's ops" in \
        caplog.text


def _on_a_mesh_as_whole(shape, seed, mesh, rows_spec, check=lambda loss, args: None):
    """add_norm's value and gradients with x and y split over `mesh` as `rows_spec` equal
    those on one device (shapes included); `check(loss, args)` runs under the mesh."""
    from attention_jax import sharding
    x, y, yb, s, b, gr, gn = (jnp.asarray(a, jnp.float32) for a in _inputs(shape, seed=seed))

    def loss(x, y, yb, s, b):
        r, n = norm_kernel.add_norm(x, y, yb, s, b, interpret=True)
        return jnp.vdot(r, gr) + jnp.vdot(jnp.sin(n), gn)

    grads = lambda: jax.value_and_grad(loss, argnums=tuple(range(5)))  # noqa: E731
    whole = grads()(x, y, yb, s, b)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        check(loss, (x, y, yb, s, b))
        rows = NamedSharding(mesh, rows_spec)
        split = jax.jit(grads())(*jax.device_put((x, y), rows), yb, s, b)
    for g, w in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_under_a_mesh_each_device_takes_its_rows():
    """Batch over data x fsdp, length whole: a shard_map over the rows, the parameters'
    gradients summed over every device's partial sums."""
    from attention_jax import sharding

    def runs_per_device(loss, args):
        assert "in_specs=(P(('data', 'fsdp'), None, None), P(('data', 'fsdp'), None, None), P()" \
            in str(jax.make_jaxpr(loss)(*args))

    _on_a_mesh_as_whole((8, 16, 32), 3, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}),
                        P(("data", "fsdp")), runs_per_device)


def test_split_over_batch_and_length_when_length_equals_features():
    """Batch over data, length over sequence, at T == D == a backward program's rows (64):
    the partial sums [G, D] then have the rows' [B, T] shape, and must still be split as
    the rows' product (they once took the rows' spec, and the scale's gradient came back
    twice as long)."""
    from attention_jax import sharding

    def kernels_take_it(loss, args):
        assert norm_kernel.unsupported(args[0].shape) is None

    _on_a_mesh_as_whole((4, 64, 64), 4,
                        sharding.make_mesh({"data": 2, "sequence": 2}, jax.devices()[:4]),
                        P("data", "sequence"), kernels_take_it)


def test_auto_under_a_mesh_needs_the_features_whole(caplog):
    """The trainer's rules map embed to fsdp for parameters, but an activation's batch
    takes fsdp first, so its features stay whole and the kernels run per device; rules
    that split the features leave auto to XLA, and 'pallas' too, saying why."""
    from attention_jax import sharding
    shape = (8, 16, 64)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh), compiling_for("gpu"):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            assert choose_norm_kernel("auto", shape, jnp.bfloat16) == "pallas"
        with nn.logical_axis_rules((("batch", "data"), ("embed", "tensor"))):
            assert choose_norm_kernel("auto", shape, jnp.bfloat16) == "xla"
        # No rules: nothing splits the rows, every device would compute all of them;
        # asked for anyway, the kernels run, and say so.
        assert choose_norm_kernel("auto", shape, jnp.bfloat16) == "xla"
        with caplog.at_level(logging.WARNING):
            assert choose_norm_kernel("pallas", shape, jnp.bfloat16) == "pallas"
        assert "nothing splits its rows over the devices" in caplog.text
        with nn.logical_axis_rules((("batch", "data"), ("embed", "tensor"))):
            with caplog.at_level(logging.WARNING):
                assert choose_norm_kernel("pallas", shape, jnp.bfloat16) == "xla"
            assert "(the mesh splits the features D over ('tensor',))" in caplog.text


GPT2_NORMS = r"""
import json
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from attention_jax.attention import compiling_for
from attention_jax.layers.blocks import BlockConfig, TransformerBlock
from attention_jax.tools.bench import gpu_hlo
topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_hlo.target_config(),
                                        topology="1x1x1")
whole = NamedSharding(topologies.make_mesh(topology, (1,), ("d",)), P())
x = jax.ShapeDtypeStruct((4, 256, 768), jnp.bfloat16, sharding=whole)
found = {}
for kind in ("xla", "auto"):
    block = TransformerBlock(BlockConfig(num_heads=12, causal=True, norm_kernel=kind,
                                         implementation="xla", dtype="bfloat16"))
    params = jax.eval_shape(block.init, jax.random.key(0), x)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), params)
    loss = lambda p, x: jnp.sum(block.apply(p, x)[0].astype(jnp.float32))
    with compiling_for("gpu"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
    rows = [r for r in gpu_hlo.kernel_traffic(text) if r["kind"] == "memory"]
    norm = [r for r in rows if "norm/" in r["source"] or "add_norm" in r["source"]]
    found[kind] = {"norm_launches": len(norm), "norm_bytes": sum(r["bytes"] for r in norm),
                   "bytes": sum(r["bytes"] for r in rows),
                   "copies": sum(r["op"] == "copy" and r["bytes"] >= x.size for r in rows)}
print(json.dumps(found))
"""


@pytest.mark.skipif(gpu_hlo.plugin_path() is None,
                    reason="JAX's CUDA plugin is not installed (make install puts it in "
                           ".venv/gpu-aot)")
def test_compiled_for_an_h100_the_norms_move_fewer_bytes():
    """A GPT-2-wide block compiled for an H100 on this host: with the kernels, its two
    norms are two launches forward and two backward (plus the partial sums' small
    reductions), no more than XLA's fusions (11 each since XLA's variance takes two
    passes, 12 for XLA before), they move fewer bytes, and no residual gradient is copied
    for them."""
    found = json_from_cuda_plugin_child(GPT2_NORMS)
    xla, kernels = found["xla"], found["auto"]
    assert kernels["norm_launches"] <= xla["norm_launches"]
    assert kernels["norm_bytes"] < 0.8 * xla["norm_bytes"]
    assert kernels["bytes"] < xla["bytes"]
    assert kernels["copies"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_triton_kernels_equal_the_reference_on_a_gpu(dtype):
    """Triton-compiled at GPT-2 small's width (768 = 512 + 256) and GPT-2 XL's (1600 =
    1024 + 512 + 64): values and gradients against float32 on the same (rounded) inputs,
    within the dtype's rounding or no further off than XLA's ops. In bfloat16 XLA rounds
    the scale's and bias's gradient sums to bfloat16 (1.2% off float32 on the H100), the
    kernel sums them in float32: XLA is not the yardstick there, float32 is."""
    def loss(kernel, dtype, x, y, yb, s, b):
        r, n = add_normalize(x.astype(dtype), y.astype(dtype), yb.astype(dtype), s, b,
                             kernel=kernel)
        return (jnp.vdot(r.astype(jnp.float32), gr)
                + jnp.vdot(jnp.sin(n.astype(jnp.float32)), gn))

    for d in (768, 1600):
        x, y, yb, s, b, gr, gn = (jnp.asarray(a, jnp.float32) for a in _inputs((4, 512, d)))
        rounded = [a.astype(dtype).astype(jnp.float32) for a in (x, y, yb)] + [s, b]
        f = lambda k, dt, args: jax.jit(jax.value_and_grad(  # noqa: E731
            functools.partial(loss, k, dt), argnums=tuple(range(5))))(*args)
        (lr, gref) = f("xla", jnp.float32, rounded)
        (lk, gk), (lx, gx) = f("pallas", dtype, (x, y, yb, s, b)), f("xla", dtype, (x, y, yb, s, b))
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        assert float(lk) == pytest.approx(float(lr), rel=max(tol, 1.5 * abs(float(lx / lr) - 1)))
        for r, c, a in zip(gref, gk, gx):
            error = lambda g: float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))  # noqa: E731
            assert error(c) < max(tol, 1.5 * error(a)), (error(c), error(a))
