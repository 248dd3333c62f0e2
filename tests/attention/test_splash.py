"""JAX's splash attention behind implementation="splash": interpret mode on CPU against the
float64 reference (outputs and dq/dk/dv) over every mask it takes, its refusals, and
what `auto` picks on a TPU. Splash tiles are multiples of 128, so the shapes here are
T, S in {128, 256, 384} with 128-tiles (2 × 2 tiles or more per kernel); each case
combines several properties to keep interpret mode's time down."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.attention import dot_product_attention, explain


@dataclasses.dataclass
class Case:
    name: str
    b: int = 1
    t: int = 256
    s: int = 256
    n: int = 2
    k: int = 2
    h: int = 64
    hv: int = 64
    kwargs: dict = dataclasses.field(default_factory=dict)


def _packed(b, t, seed):
    """Sorted segment ids: packed documents of random lengths."""
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (b, t)), axis=1),
                       jnp.int32)


CASES = [
    # packed documents, causal, right padding as lengths, GQA (2 query heads per K/V head)
    Case("causal-packed-lengths-gqa", n=4, k=2,
         kwargs=dict(causal=True, segment_ids=_packed(1, 256, 0), kv_lengths=jnp.array([200]))),
    # a two-sided window, key padding as kv_mask (row 1 has no real key: zeros), MQA,
    # Hv != H, a scale of our own
    Case("window-kvmask-mqa-empty-row", b=2, n=2, k=1, hv=32,
         kwargs=dict(window=(40, 17), scale=0.3,
                     kv_mask=jnp.asarray(np.arange(256)[None, :] < np.array([[100], [0]])))),
    # T != S: 128 queries after 256 cached keys, causal (a static offset), a left window
    Case("cross-offset-window", t=128, s=384, n=2, k=1,
         kwargs=dict(causal=True, window=(150, 0), q_offset=256)),
]


def _grads(impl, q, k, v, case):
    """y and (dq, dk, dv) of a fixed random projection of y (every element its own weight)."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal((case.t, case.n, case.hv)), q.dtype)

    def loss(q, k, v):
        y = dot_product_attention(q, k, v, implementation=impl, **case.kwargs)
        return jnp.sum(y.astype(w.dtype) * w), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return y, g


def _inputs(case, dtype):
    rng = np.random.default_rng(0)
    shapes = ((case.b, case.t, case.n, case.h), (case.b, case.s, case.k, case.h),
              (case.b, case.s, case.k, case.hv))
    return [jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes]


def _relative_errors(case, dtype):
    q, k, v = _inputs(case, dtype)
    y, g = _grads("splash", q, k, v, case)
    assert y.dtype == dtype
    with jax.enable_x64(True):
        y_ref, g_ref = _grads("reference", *(x.astype(jnp.float64) for x in (q, k, v)), case)
        return {name: float(jnp.linalg.norm(a.astype(jnp.float64) - b) / jnp.linalg.norm(b))
                for name, a, b in zip(("y", "dq", "dk", "dv"), (y, *g), (y_ref, *g_ref))}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_splash_float32_equals_float64_reference(case):
    errors = _relative_errors(case, jnp.float32)
    assert max(errors.values()) < 1e-5, errors


def test_splash_runs_with_x64_on(x64):
    """With jax_enable_x64 (a notebook checking numerics; float32 inputs), JAX's splash
    kernels raised a TypeError in their index maps wherever T != S, heads were grouped or
    q_offset was set: forward and backward now trace with 64-bit types off."""
    errors = _relative_errors(CASES[2], jnp.float32)
    assert max(errors.values()) < 1e-5, errors


def test_splash_bfloat16_close_to_float64_reference():
    case = Case("bf16-causal-packed-tiles-256x128",
                kwargs=dict(causal=True, segment_ids=_packed(1, 256, 2), block_q=256, block_k=128))
    errors = _relative_errors(case, jnp.bfloat16)
    assert max(errors.values()) < 2e-2, errors


def test_splash_rows_with_no_visible_key_are_zero_with_zero_gradients():
    """Row 1 of the window case has no real key; a static mask that hides every key (a
    window behind the queries' offset past the end of the keys) never reaches the kernel."""
    case = CASES[1]
    q, k, v = _inputs(case, jnp.float32)
    y, (dq, dk, dv) = _grads("splash", q, k, v, case)
    assert float(jnp.abs(y[0]).max()) > 0
    for a in (y, dq, dk, dv):
        assert bool(jnp.all(jnp.isfinite(a))) and float(jnp.abs(a[1]).max()) == 0.0
    nothing = Case("nothing", t=128, s=256, kwargs=dict(causal=True, window=(10, 0), q_offset=300))
    y, g = _grads("splash", *_inputs(nothing, jnp.float32), nothing)
    assert all(float(jnp.abs(a).max()) == 0.0 for a in (y, *g))


# ----------------------------------------------------------------------------- refusals


def _arrays(t=128, s=128, dtype=jnp.float32):
    return (jnp.zeros((1, t, 2, 64), dtype), jnp.zeros((1, s, 2, 64), dtype),
            jnp.zeros((1, s, 2, 64), dtype))


@pytest.mark.parametrize("arrays, kwargs, message", [
    (_arrays(), dict(mask=jnp.ones((1, 1, 128, 128), bool)), r"cannot take a dense mask="),
    (_arrays(), dict(q_offset=jnp.zeros((1,), jnp.int32)), r"needs q_offset as a Python int"),
    (_arrays(t=100), dict(), r"needs T and S to be multiples of 128 .*got T=100"),
    (_arrays(s=200), dict(causal=True), r"multiples of 128 .*got S=200"),
    (_arrays(dtype=jnp.float16), dict(), r"takes float32 or bfloat16 q, k, v .*got float16"),
    (_arrays(), dict(block_q=64), r"block_q=64 must be a multiple of 128 that divides T=128"),
    (_arrays(), dict(block_k=256), r"block_k=256 must be a multiple of 128 that divides S=128"),
    (_arrays(), dict(return_weights=True), r"return_weights=True needs implementation='reference'"),
])
def test_splash_refusals_are_one_sentence_value_errors(arrays, kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        dot_product_attention(*arrays, implementation="splash", **kwargs)
    text = str(error.value)
    assert "\n" not in text and ". " not in text, text  # one sentence


def test_splash_refuses_float64(x64):
    with pytest.raises(ValueError, match="takes float32 or bfloat16 q, k, v .*; got float64"):
        explain(*_arrays(dtype=jnp.float64), implementation="splash")


# ----------------------------------------------------------------------------- auto


def _shapes(t=1024, s=1024, n=12, k=12, h=64, dtype=jnp.bfloat16, b=2):
    return (jax.ShapeDtypeStruct((b, t, n, h), dtype), jax.ShapeDtypeStruct((b, s, k, h), dtype),
            jax.ShapeDtypeStruct((b, s, k, h), dtype))


IDS = jax.ShapeDtypeStruct((2, 1024), jnp.int32)


@pytest.mark.parametrize("shapes, kwargs, chosen, passed_over", [
    (_shapes(), dict(causal=True), "splash", None),
    (_shapes(), dict(causal=True, segment_ids=IDS), "splash", None),  # packed documents
    (_shapes(k=4, dtype=jnp.float32), dict(kv_lengths=jax.ShapeDtypeStruct((2,), jnp.int32)),
     "splash", None),
    (_shapes(), dict(causal=True, window=(256, 0)), "splash", None),
    (_shapes(t=128), dict(causal=True, q_offset=896), "splash", None),
    (_shapes(t=1), dict(causal=True, q_offset=1023), "blockwise", "multiples of 128"),
    (_shapes(), dict(causal=True, q_offset=jax.ShapeDtypeStruct((2,), jnp.int32)), "blockwise",
     "q_offset as a Python int"),
    (_shapes(), dict(mask=jax.ShapeDtypeStruct((2, 1, 1024, 1024), jnp.bool_)), "blockwise",
     "dense mask"),
    (_shapes(), dict(return_weights=True), "reference", None),
])
def test_auto_on_a_tpu_takes_splash_where_it_applies(shapes, kwargs, chosen, passed_over):
    impl, reason = explain(*shapes, backend="tpu", **kwargs)
    assert impl == chosen, reason
    if passed_over:
        assert "not splash: " in reason and passed_over in reason, reason


def test_auto_off_tpu_never_takes_splash():
    assert explain(*_shapes(), causal=True, backend="cpu")[0] == "blockwise"
    assert explain(*_shapes(), causal=True, segment_ids=IDS, backend="gpu")[0] == "pallas"
    assert explain(*_shapes(), causal=True, backend="gpu")[0] == "cudnn"


# ----------------------------------------------------------------------------- TPU


@pytest.mark.tpu
def test_splash_compiled_on_a_tpu_equals_reference():
    """The compiled (not interpreted) kernels on a TPU, float32 and bfloat16, against the
    float32 reference at the highest matmul precision, and auto choosing them."""
    case = Case("tpu-causal-packed-gqa", b=2, t=1024, s=1024, n=4, k=2, h=128, hv=128,
                kwargs=dict(causal=True, segment_ids=_packed(2, 1024, 3)))
    q, k, v = _inputs(case, jnp.float32)
    assert explain(q, k, v, **case.kwargs)[0] == "splash"
    with jax.default_matmul_precision("highest"):
        y_ref, g_ref = _grads("reference", q, k, v, case)
    for dtype, tol in ((jnp.float32, 1e-3), (jnp.bfloat16, 3e-2)):
        y, g = _grads("splash", *(x.astype(dtype) for x in (q, k, v)), case)
        for a, b in zip((y, *g), (y_ref, *g_ref)):
            err = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)
            assert float(err) < tol, (dtype, float(err))
