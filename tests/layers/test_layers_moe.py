"""Mixture-of-Experts routing: top-A dispatch, gate weights, capacity, auxiliary loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.layers.moe import MoE, expert_capacity, route


def _logits(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape) * 2


# A module's init and apply, jitted: op by op, each of its ops is compiled alone (a
# layer's check took 304 small compiles).
_init = jax.jit(lambda module, *a, **k: module.init(*a, **k), static_argnums=0)
_apply = jax.jit(lambda module, *a, **k: module.apply(*a, **k), static_argnums=0,
                 static_argnames="no_drop")


def test_every_kept_token_goes_to_exactly_top_k_experts_with_weights_summing_to_one():
    logits = _logits((3, 10, 5))
    dispatch, combine, aux = route(logits, top_k=2, capacity=20)  # room for everyone
    dispatch = np.asarray(dispatch)
    np.testing.assert_array_equal(dispatch.sum(axis=(2, 3)), 2)  # A assignments per token
    np.testing.assert_array_equal(dispatch.any(-1).sum(-1), 2)  # to 2 different experts
    top2 = np.argsort(-np.asarray(logits), -1)[..., :2]
    chosen = np.sort(np.nonzero(dispatch.any(-1))[2].reshape(3, 10, 2), -1)
    np.testing.assert_array_equal(chosen, np.sort(top2, -1))  # the router's top-2
    np.testing.assert_allclose(np.asarray(combine).sum(axis=(2, 3)), 1.0, rtol=1e-6)
    assert np.all(dispatch.sum(1) <= 1)  # a slot holds at most one token
    assert float(aux["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(aux["expert_load"]).sum(), 1.0, rtol=1e-6)


def test_over_capacity_assignments_are_dropped_in_priority_order():
    # Every token prefers expert 0, second choice expert 1; capacity 2.
    logits = jnp.tile(jnp.array([3.0, 2.0, 0.0, -1.0]), (1, 5, 1))  # [1, 5, 4]
    dispatch, combine, aux = route(logits, top_k=2, capacity=2, priority="choice")
    d = np.asarray(dispatch)[0]  # [T, E, C]
    # first choices come first: tokens 0, 1 get expert 0; tokens 0, 1 also get expert 1
    np.testing.assert_array_equal(d[:, 0].any(-1), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(d[:, 1].any(-1), [1, 1, 0, 0, 0])
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 6 / 10)
    assert np.all(np.asarray(combine)[0, 2:] == 0)  # dropped tokens contribute nothing

    # "choice" lets a later first choice evict an earlier second choice; "token" does not.
    mixed = jnp.array([[[2.0, 3.0, 0, 0], [3.0, 2.0, 0, 0], [3.0, 0.0, 2.0, 0]]])  # [1, 3, 4]
    by_choice = np.asarray(route(mixed, 2, capacity=2, priority="choice")[0])[0]
    by_token = np.asarray(route(mixed, 2, capacity=2, priority="token")[0])[0]
    assert not by_choice[0, 0].any() and by_choice[2, 0].any()  # token 0's 2nd choice evicted
    assert by_token[0, 0].any() and not by_token[2, 0].any()  # earliest token keeps its slot
    with pytest.raises(ValueError, match=r"valid: \('choice', 'token'\)"):
        route(mixed, 2, 2, priority="random")


def test_dropped_tokens_pass_through_the_residual_unchanged():
    moe = MoE(num_experts=2, top_k=1, capacity_factor=0.5)  # C = ceil(.5·8·1/2) = 2 per expert
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 6))
    params = jax.jit(moe.init)(jax.random.PRNGKey(1), x)
    y, aux = jax.jit(moe.apply)(params, x)
    assert expert_capacity(8, 2, 1, 0.5) == 2
    zero = np.all(np.asarray(y)[0] == 0, axis=-1)
    assert zero.sum() == 8 - 4  # only 2 slots per expert: 4 tokens served, 4 dropped
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 0.5)
    np.testing.assert_allclose((x + y)[0, zero], x[0, zero])  # x + MoE(x) = x for them


def test_load_balancing_loss_is_minimal_for_a_uniform_router():
    e = 4
    uniform = route(jnp.zeros((2, 16, e)), top_k=1, capacity=32)[2]
    np.testing.assert_allclose(float(uniform["load_balance_loss"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(uniform["router_entropy"]), np.log(e), rtol=1e-4)
    collapsed = route(jnp.tile(jnp.array([9.0, 0, 0, 0]), (2, 16, 1)), 1, 32)[2]
    assert float(collapsed["load_balance_loss"]) > 3.9  # -> E when all tokens pick one expert
    for seed in range(3):
        skewed = route(_logits((2, 16, e), seed) + jnp.array([2.0, 0, 0, 0]), 1, 32)[2]
        assert float(skewed["load_balance_loss"]) > 1.0


def test_moe_layer_is_differentiable_and_experts_carry_the_expert_axis():
    moe = MoE(num_experts=4, top_k=2, hidden=16)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 8))
    variables = jax.jit(moe.init)(jax.random.PRNGKey(1), x)
    assert variables["params"]["wi"].value.shape == (4, 8, 16)
    assert variables["params"]["wi"].names[0] == "expert"

    def loss(p):
        y, aux = moe.apply({"params": p}, x)
        return jnp.sum(y ** 2) + aux["load_balance_loss"]

    grads = jax.jit(jax.grad(loss))(variables["params"])
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["router"].value).sum()) > 0  # the router learns
    with pytest.raises(ValueError, match="top_k"):
        jax.eval_shape(MoE(num_experts=2, top_k=3).init, jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("priority", ["choice", "token"])
def test_padding_takes_no_slot_and_counts_in_no_statistic(priority):
    """Without a mask, an encoder's padding tokens took experts' slots ("choice": their
    first choices before real tokens' second) and counted in the balance loss: changing
    only the padding changed the real tokens' outputs. Routed with token_mask, the real
    tokens get what they get with the padding cut off."""
    b, t, n, e = 2, 12, 7, 4
    logits = jax.random.normal(jax.random.key(0), (b, t, e))
    mask = jnp.arange(t)[None, :] < n
    masked = route(logits, 2, 3, priority=priority, token_mask=jnp.broadcast_to(mask, (b, t)))
    alone = route(logits[:, :n], 2, 3, priority=priority)
    np.testing.assert_array_equal(masked[0][:, :n], alone[0])
    np.testing.assert_allclose(masked[1][:, :n], alone[1], rtol=1e-6)
    assert not masked[0][:, n:].any()  # padding is dispatched nowhere
    for key in alone[2]:
        np.testing.assert_allclose(masked[2][key], alone[2][key], rtol=1e-5, err_msg=key)
    with pytest.raises(ValueError, match=r"token_mask: shape \(2, 7\); valid: \[B, T\]"):
        route(logits, 2, 3, token_mask=mask[:, :n].repeat(2, 0))


def test_an_encoder_s_real_tokens_do_not_see_its_padding_through_the_experts():
    """TransformerStack passes kv_mask to its MoE: the helper's case (post-norm encoder,
    4 experts, top 2, capacity_factor 1), where changing only the padding moved a real
    token's output by 0.23."""
    from attention_jax.layers.blocks import BlockConfig, TransformerStack
    cfg = BlockConfig(num_heads=4, mlp="moe", norm_position="post", num_experts=4, top_k=2,
                      capacity_factor=1.0)
    stack = TransformerStack(cfg, 1, block="encoder")
    x = jax.random.normal(jax.random.key(1), (2, 16, 16))
    kv_mask = jnp.arange(16)[None, :] < jnp.array([[16], [6]])
    params = _init(stack, jax.random.key(2), x, kv_mask=kv_mask)
    other = x.at[1, 6:].set(jax.random.normal(jax.random.key(3), (10, 16)) * 5)
    y, _ = _apply(stack, params, x, kv_mask=kv_mask)
    y_other, _ = _apply(stack, params, other, kv_mask=kv_mask)
    np.testing.assert_allclose(y[:, :6], y_other[:, :6], atol=1e-6)
    np.testing.assert_allclose(y[0], y_other[0], atol=1e-6)


def test_a_gpt_s_packed_padding_takes_no_expert_slot_and_no_statistic():
    """A GPT passes only segment_ids (0: padding, data/packing.py), so its MoE got no
    token_mask: the padding was routed, took slots and counted in expert_load and the
    balance loss added to the objective. Changing only the padding now changes nothing."""
    from attention_jax.models import gpt
    cfg = gpt.GPTConfig.from_variant("gpt-tiny-moe", capacity_factor=1.0)
    model = gpt.GPT(cfg)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    other = tokens.at[:, 8:].set((tokens[:, 8:] * 7 + 3) % cfg.vocab_size)  # the padding
    segments = jnp.array([[1] * 8 + [0] * 8, [1] * 5 + [2] * 3 + [0] * 8])
    positions = jnp.array([list(range(8)) + [0] * 8, list(range(5)) + list(range(3)) + [0] * 8])
    params = _init(model, jax.random.key(1), tokens, segment_ids=segments, positions=positions)
    runs = [_apply(model, params, t, segment_ids=segments, positions=positions)
            for t in (tokens, other)]
    (y, aux), (y_other, aux_other) = runs
    np.testing.assert_allclose(y[:, :8], y_other[:, :8], atol=1e-6)
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(aux_other)):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("use_bias", [True, False])
def test_no_drop_computes_every_assignment_grouped_as_the_slots_do_with_room(use_bias):
    """MoE(no_drop=True), as a decoder runs while decoding: each expert's tokens grouped
    (ragged_dot) rather than in capacity slots. Where the slots have room for every token
    the two agree, outputs and router statistics; where they drop, no_drop keeps what the
    slots dropped; padding gets y = 0 either way. Slots enough for every token (C = T)
    grew as T²: the grouped form's temporaries stay linear in T."""
    b, t, d = 2, 9, 8
    x = jax.random.normal(jax.random.PRNGKey(0), (b, t, d))
    mask = jnp.arange(t)[None, :] < jnp.array([[9], [5]])
    roomy = MoE(num_experts=4, top_k=2, hidden=16, capacity_factor=4.0, use_bias=use_bias,
                priority="token")
    params = _init(roomy, jax.random.PRNGKey(1), x)
    if use_bias:  # nonzero biases, so that they count
        params = jax.tree.map(lambda p: p + 0.1, params)
    want, want_aux = _apply(roomy, params, x, token_mask=mask)
    got, got_aux = _apply(roomy, params, x, token_mask=mask, no_drop=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.asarray(got)[1, 5:].any()
    for key in want_aux:
        np.testing.assert_allclose(got_aux[key], want_aux[key], rtol=1e-5, err_msg=key)
    tight = MoE(num_experts=4, top_k=2, hidden=16, capacity_factor=0.25, use_bias=use_bias,
                priority="token")
    _, aux = _apply(tight, params, x, token_mask=mask)
    assert float(aux["dropped_fraction"]) > 0.3
    kept, aux = _apply(tight, params, x, token_mask=mask, no_drop=True)
    np.testing.assert_allclose(kept, want, rtol=1e-5, atol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.0

    def temporaries(t, no_drop):
        x = jnp.zeros((1, t, d))
        f = jax.jit(lambda p, x: MoE(num_experts=16, top_k=1, hidden=16).apply(
            p, x, no_drop=no_drop)[0])
        p = jax.eval_shape(MoE(num_experts=16, top_k=1, hidden=16).init, jax.random.PRNGKey(1), x)
        return f.lower(p, x).compile().memory_analysis().temp_size_in_bytes
    grouped = temporaries(2048, True) / temporaries(512, True)
    assert grouped < 6, grouped  # (4x the tokens: linear; slots of C = T grew 16x)


def test_a_float64_layer_routes_in_float64():
    """dtype='float64' (a numerics check under x64): the router's logits, gates and aux
    losses stay float64. They were cast to float32, so the layer's output and its
    z-loss were float32's 1e-7 from the float64 formula where every other layer is
    at 1e-15."""
    with jax.enable_x64(True):
        moe = MoE(num_experts=3, top_k=2, hidden=5, capacity_factor=3.0, activation="relu",
                  dtype="float64", param_dtype="float64")
        x = np.random.default_rng(0).standard_normal((2, 4, 6))
        variables = moe.init(jax.random.key(0), x)
        p = {k: np.asarray(v.value) for k, v in variables["params"].items()}
        for no_drop in (False, True):
            y, aux = moe.apply(variables, x, no_drop=no_drop)
            logits = x @ p["router"]
            probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
            top = np.argsort(-probs, -1)[..., :2]  # [B, T, A]
            gates = np.take_along_axis(probs, top, -1)
            gates /= gates.sum(-1, keepdims=True)
            hidden = np.maximum(np.einsum("btd,btadf->btaf", x, p["wi"][top])
                                + p["wi_bias"][top], 0)
            out = np.einsum("btaf,btafd->btad", hidden, p["wo"][top]) + p["wo_bias"][top]
            np.testing.assert_allclose(y, np.einsum("bta,btad->btd", gates, out),
                                       rtol=0, atol=1e-12)
            z_loss = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
            np.testing.assert_allclose(aux["router_z_loss"], z_loss, rtol=1e-12)


@pytest.mark.parametrize("factor, tokens, top_k, experts, slots", [
    (1.1, 100, 1, 2, 55), (1.1, 100, 2, 4, 55), (1.1, 50, 2, 2, 55), (1.2, 10, 1, 4, 3),
    (0.7, 30, 1, 3, 7), (1.25, 8, 2, 4, 5), (1.25, 9, 2, 4, 6), (0.01, 4, 1, 8, 1)])
def test_expert_capacity_is_the_ceiling_of_the_exact_product(factor, tokens, top_k, experts,
                                                              slots):
    # C = ceil(capacity_factor · T · A / E) as written: float rounding of an exact whole
    # product (1.1 · 100 / 2 = 55.00000000000001) gave one slot more than the formula.
    assert expert_capacity(tokens, experts, top_k, factor) == slots


def test_masked_tokens_are_as_if_absent_outputs_and_aux_alike():
    """token_mask anywhere in a row (not only a padded tail): a masked token gets y = 0,
    and with room for every assignment (capacity_factor = E / A) the real tokens' outputs
    and every statistic equal those of the real tokens alone, packed into one row. No
    mask and an all-True one route alike."""
    moe = MoE(num_experts=4, top_k=2, capacity_factor=2.0, hidden=32)
    x = jax.random.normal(jax.random.key(0), (2, 9, 16))
    mask = jax.random.bernoulli(jax.random.key(1), 0.6, (2, 9)).at[:, 0].set(True)
    params = _init(moe, jax.random.key(2), x)
    y, aux = _apply(moe, params, x, token_mask=mask)
    alone_y, alone_aux = _apply(moe, params, x[mask][None])  # [1, n, D]: the real tokens
    np.testing.assert_allclose(y[mask], alone_y[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[~mask], 0.0)
    assert set(aux) == set(alone_aux)
    for key in aux:
        np.testing.assert_allclose(aux[key], alone_aux[key], rtol=1e-5, err_msg=key)
    # The padding changed things before masking: the statistics are not trivially equal.
    unmasked_aux = _apply(moe, params, x)[1]
    assert abs(unmasked_aux["router_z_loss"] - alone_aux["router_z_loss"]) > 1e-3
    # Default: exactly as an all-True mask.
    # (op by op: two jitted programs, fused apart, differ in the last bit)
    for a, b in zip(jax.tree.leaves(moe.apply(params, x)),
                    jax.tree.leaves(moe.apply(params, x, token_mask=jnp.ones((2, 9), bool)))):
        np.testing.assert_array_equal(a, b)


def test_a_gpt_s_stream_padding_is_masked_by_token_mask():
    """A "stream" row has no segment ids, so nothing marked its padded tail for the
    MoE: it took slots and counted in the balance loss trained on. With token_mask the
    real tokens' logits, the router statistics and the weighted MoE loss are those of
    the batch with the padding cut off (room for every assignment: 2 = E / A)."""
    from attention_jax.models import gpt
    cfg = gpt.GPTConfig.from_variant("gpt-tiny-moe", capacity_factor=2.0)
    model = gpt.GPT(cfg)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    mask = jnp.broadcast_to(jnp.arange(16) < 11, (2, 16))
    params = _init(model, jax.random.key(1), tokens)
    logits, aux = _apply(model, params, tokens, token_mask=mask)
    cut_logits, cut_aux = _apply(model, params, tokens[:, :11])
    np.testing.assert_allclose(logits[:, :11], cut_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["moe_loss"], cut_aux["moe_loss"], rtol=1e-5)
    for key in ("load_balance_loss", "router_z_loss", "expert_load", "router_entropy"):
        np.testing.assert_allclose(aux["layers"]["moe"][key], cut_aux["layers"]["moe"][key],
                                   rtol=1e-5, err_msg=key)
    assert abs(_apply(model, params, tokens)[1]["moe_loss"] - cut_aux["moe_loss"]) > 1e-6


def test_the_lm_task_marks_stream_padding_and_eval_padding_copies_for_the_moe():
    """tasks.text.moe_token_mask recovers a stream row's real tokens from its loss
    weights (objectives.next_token_targets) and masks an eval batch's padding copies;
    documents rows leave their padding to the segment ids (None without copies)."""
    from attention_jax.data import objectives
    from attention_jax.data.loaders import EXAMPLE_WEIGHT
    from attention_jax.tasks.text import moe_token_mask
    lengths = np.array([8, 5, 2, 0])  # real tokens per row of 8 (the last a padding copy)
    seg = (np.arange(8)[None] < lengths[:, None]).astype(np.int32)
    rows = {"tokens": np.where(seg > 0, 7, 0).astype(np.int32), "segment_ids": seg,
            "positions": np.zeros_like(seg)}
    stream = objectives.next_token_targets(rows, "stream")
    got = moe_token_mask(stream, jnp.asarray(stream["weights"]))
    np.testing.assert_array_equal(got, seg > 0)
    copy = np.array([1.0, 1.0, 0.0, 1.0], np.float32)  # row 2 padding an eval batch
    got = moe_token_mask({**stream, EXAMPLE_WEIGHT: copy},
                         jnp.asarray(stream["weights"]) * copy[:, None])
    np.testing.assert_array_equal(got, (seg > 0) & (copy[:, None] > 0))
    documents = objectives.next_token_targets(rows, "documents")
    assert moe_token_mask(documents, jnp.asarray(documents["weights"])) is None
    got = moe_token_mask({**documents, EXAMPLE_WEIGHT: copy}, jnp.asarray(documents["weights"]))
    np.testing.assert_array_equal(got, np.broadcast_to(copy[:, None] > 0, (4, 8)))


def test_a_token_mask_that_is_not_bool_is_refused_by_name():
    """An int mask was a weight: segment ids 1, 2, 3 passed as token_mask scaled each
    token's expert output (and its share of the statistics) by its id, unsaid."""
    from attention_jax.models import gpt
    logits = jax.random.normal(jax.random.key(0), (2, 5, 4))
    with pytest.raises(ValueError, match=r"token_mask: dtype int32; valid: a bool array"):
        route(logits, 2, 3, token_mask=jnp.ones((2, 5), jnp.int32))
    cfg = gpt.GPTConfig.from_variant("gpt-tiny-moe", num_layers=1, d_model=16, mlp_dim=16)
    model = gpt.GPT(cfg)
    tokens = jnp.zeros((2, 4), jnp.int32)
    params = model.init(jax.random.key(1), tokens)
    segments = jnp.array([[1, 1, 2, 2], [1, 2, 3, 3]])
    with pytest.raises(ValueError, match=r"token_mask must be a bool array of shape \[B, T\]"):
        model.apply(params, tokens, token_mask=segments)
    model.apply(params, tokens, token_mask=segments != 0)  # what was meant
