"""GPT: parameter counts, causality, KV-cache decoding, generation, training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import gpt
from helpers import adam_losses, assert_loss_goes_down


def _count(cfg):
    shapes = jax.eval_shape(lambda: gpt.GPT(cfg).init(jax.random.PRNGKey(0),
                                                      jnp.zeros((1, 8), jnp.int32)))
    return sum(x.size for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("name, published", [
    ("gpt2", 124e6), ("gpt2-medium", 355e6), ("gpt2-large", 774e6), ("gpt2-xl", 1558e6)])
def test_parameter_counts_match_gpt2(name, published):
    assert abs(_count(gpt.get_config(name)) - published) / published < 0.01


def test_bad_configs_raise_with_valid_choices():
    with pytest.raises(ValueError, match=r"unknown GPT variant 'gpt5'.*'gpt2'"):
        gpt.get_config("gpt5")
    # nanoGPT's name for a field: the closest of ours, and all of them (every family's
    # from_variant checks so)
    with pytest.raises(ValueError, match=r"^'n_layer' is not a field of GPTConfig \(did you "
                                         r"mean 'num_layers'\?\); valid: \['vocab_size', "):
        gpt.GPTConfig.from_variant("gpt-tiny", n_layer=3)
    from attention_jax.models import bert, cnn, encdec, rnn, vit
    for module, family in ((bert, bert.BertConfig), (cnn, cnn.CNNConfig),
                           (encdec, encdec.EncDecConfig), (rnn, rnn.RNNConfig),
                           (vit, vit.ViTConfig)):
        with pytest.raises(ValueError, match=rf"^'depth' is not a field of {family.__name__}"):
            family.from_variant(next(iter(module.VARIANTS)), depth=3)
    with pytest.raises(ValueError, match=r"num_heads=5 does not divide d_model=64.*\[1, 2, 4"):
        gpt.get_config("gpt-tiny", num_heads=5)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=4; valid: \[1, 2, 4\]"):
        gpt.get_config("gpt-tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match=r"valid: \('learned', 'sinusoidal', 'rope'\)"):
        gpt.get_config("gpt-tiny", position="alibi")
    # Pairs of coordinates: found here, not as a traceback from the first trace of the
    # model (after the data was built).
    with pytest.raises(ValueError, match=r"head dim d_model / num_heads = 100 / 4 = 25 is odd; "
                                         r"valid num_heads: \[1, 2, 5, 10, 25, 50\]$"):
        gpt.get_config("gpt-tiny-rope", d_model=100, num_kv_heads=None)
    with pytest.raises(ValueError, match=r"^position='sinusoidal' is sin/cos pairs: "
                                         r"d_model=105 is odd"):
        gpt.get_config("gpt-tiny", position="sinusoidal", d_model=105, num_heads=5)
    with pytest.raises(ValueError, match=r"norm_position='middle' is unknown; valid: \('pre', 'post'\)"):
        gpt.get_config("gpt-tiny", norm_position="middle")


# the MoE variant gets room for every token so decoding can match the full pass (moe.py)
TINY = {"gpt-tiny": {}, "gpt-tiny-rope": {}, "gpt-tiny-moe": dict(capacity_factor=2.0),
        "gpt-tiny-scan": dict(scan_layers=True, remat_policy="dots"),
        "gpt-tiny-post": dict(norm_position="post", position="sinusoidal")}


@functools.lru_cache(maxsize=None)
def _model(name):
    cfg = gpt.get_config(name.replace("-scan", "").replace("-post", ""), **TINY[name])
    model = gpt.GPT(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), jnp.zeros((1, 16), jnp.int32))["params"]
    return model, params


def _tokens(shape, seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 3, 256)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny-moe", "gpt-tiny-post"])
def test_causal_model_does_not_leak_the_future(name):
    model, params = _model(name)
    if name == "gpt-tiny-moe":  # tight capacity: drops happen, and must stay causal too
        model = gpt.GPT(gpt.get_config("gpt-tiny-moe", capacity_factor=0.5))
    apply = jax.jit(lambda t: model.apply({"params": params}, t)[0])
    tokens = _tokens((2, 16))
    changed = tokens.at[:, 9:].set(_tokens((2, 7), 5))
    a, b = apply(tokens), apply(changed)
    np.testing.assert_allclose(a[:, :9], b[:, :9], atol=1e-5)
    assert not np.allclose(a[:, 9:], b[:, 9:], atol=1e-3)


@pytest.mark.parametrize("name", list(TINY))
def test_kv_cache_decoding_equals_full_forward_for_unequal_prompts(name):
    model, params = _model(name)
    b, total, lengths = 3, 14, np.array([2, 7, 5])
    tokens = _tokens((b, total), 1)
    full = jax.jit(lambda t: model.apply({"params": params}, t)[0])(tokens)  # [B, T, V]

    @jax.jit
    def step(cache, t, pos):
        (logits, _), state = model.apply({"params": params, "cache": cache}, t, positions=pos,
                                         decode=True, mutable=["cache"])
        return logits, state["cache"]

    prompt_len = int(lengths.max())
    prompts = jnp.where(jnp.arange(prompt_len)[None] < lengths[:, None], tokens[:, :prompt_len], 0)
    cache = gpt.init_cache(model, b, total)
    logits, cache = step(cache, prompts, jnp.broadcast_to(jnp.arange(prompt_len), (b, prompt_len)))
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=2e-4)
    rows = np.arange(b)
    for i in range(total - prompt_len):
        pos = lengths + i  # each row continues after its own prompt
        logits, cache = step(cache, tokens[rows, pos][:, None], jnp.asarray(pos)[:, None])
        np.testing.assert_allclose(logits[:, 0], full[rows, pos], atol=2e-4)


def test_generate_greedy_follows_the_full_model_and_stops():
    model, params = _model("gpt-tiny-rope")
    lengths = jnp.array([3, 6])
    prompts = jnp.where(jnp.arange(6)[None] < lengths[:, None], _tokens((2, 6), 2), 0)
    out, out_len = gpt.generate(model, params, prompts, lengths, max_new_tokens=5)
    np.testing.assert_array_equal(out_len, lengths + 5)
    full = jax.jit(lambda t: model.apply({"params": params}, t)[0])(out)
    for row in range(2):
        n = int(lengths[row])
        np.testing.assert_array_equal(out[row, :n], prompts[row, :n])
        np.testing.assert_array_equal(out[row, n:n + 5], jnp.argmax(full[row, n - 1:n + 4], -1))
    # Sampling restricted to one candidate (a tiny nucleus) is greedy; row 0 is told to
    # stop at its first generated token, so it keeps that token and pads after it.
    stop = int(out[0, 3])
    again, again_len = gpt.generate(model, params, prompts, lengths, max_new_tokens=5,
                                    temperature=1.5, rng=jax.random.PRNGKey(0), top_k=3,
                                    top_p=1e-6, stop_token=stop, pad_token=0)
    assert int(again_len[0]) == 4 and np.all(np.asarray(again[0, 4:]) == 0)
    np.testing.assert_array_equal(again[0, :4], out[0, :4])
    hits = np.nonzero(np.asarray(out[1, 6:]) == stop)[0]
    n1 = 6 + (int(hits[0]) + 1 if len(hits) else 5)
    assert int(again_len[1]) == n1
    np.testing.assert_array_equal(again[1, :n1], out[1, :n1])


def test_generate_keeps_below_vocab_size_and_compiles_once():
    """A model's vocabulary padded past its tokenizer's (to a multiple of 64): those ids
    were sampled and crashed the char tokenizer's decode. And each call compiled the loop
    anew (a fresh functools.partial as its static argument)."""
    model, params = _model("gpt-tiny")
    prompts = _tokens((2, 4), 2)
    sample = lambda **kw: gpt.generate(model, params, prompts, [4, 4], max_new_tokens=24,  # noqa: E731
                                       temperature=50.0, rng=jax.random.PRNGKey(1), **kw)
    free, _ = sample()
    assert np.asarray(free[:, 4:]).max() >= 200  # near-uniform over 256: high ids come up
    before = gpt._generate._cache_size()
    bounded, _ = sample(vocab_size=200)
    again, _ = sample(vocab_size=200)
    assert np.asarray(bounded[:, 4:]).max() < 200
    np.testing.assert_array_equal(bounded, again)
    assert gpt._generate._cache_size() == before + 1  # the same settings: one compile
    sample(vocab_size=200, top_p=jnp.float32(0.9), top_k=jnp.int32(50))  # JAX scalars too
    with pytest.raises(ValueError, match=r"vocab_size=257; valid: None or 1\.\.256"):
        sample(vocab_size=257)


def test_an_moe_prompt_continues_the_same_alone_or_beside_a_longer_one():
    """The prefill's expert capacity came from the batch's padded width: a short prompt
    beside a long one had more slots than alone, so its continuation depended on the
    other prompts (5 of 6 such pairs here). Decoding now drops no token."""
    cfg = gpt.GPTConfig(vocab_size=40, max_len=32, num_layers=1, d_model=32, num_heads=4,
                        mlp="moe", num_experts=4, top_k=2, mlp_dim=64)
    model = gpt.GPT(cfg)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    rng = np.random.RandomState(0)
    for _ in range(6):
        long, short = rng.randint(0, 40, 12), rng.randint(0, 40, 4)
        both = np.zeros((2, 12), np.int32)
        both[0], both[1, :4] = long, short
        out, lengths = gpt.generate(model, params, both, np.array([12, 4]), max_new_tokens=6)
        alone, alone_lengths = gpt.generate(model, params, short[None].astype(np.int32),
                                            np.array([4]), max_new_tokens=6)
        np.testing.assert_array_equal(out[1, :lengths[1]], alone[0, :alone_lengths[0]])


def test_generate_names_a_bad_argument():
    """Prompt lengths past the prompts' width read padding as the prompt (and returned
    lengths longer than the output); top_p 1.5 or a negative temperature sampled anyway."""
    model, params = _model("gpt-tiny")
    prompts = _tokens((2, 8), 2)
    run = lambda lengths, **kw: gpt.generate(model, params, prompts, lengths,  # noqa: E731
                                             max_new_tokens=2, rng=jax.random.PRNGKey(0), **kw)
    for lengths in (jnp.array([9, 5]), [8, 0], [8]):
        with pytest.raises(ValueError, match=r"prompt_lengths=.*; valid: 2 lengths in 1\.\.8 "
                                             r"\(prompts is \[2, 8\]\)"):
            run(lengths)
    with pytest.raises(ValueError, match=r"top_p=1.5; valid: None or in \(0, 1\]"):
        run([8, 5], temperature=1.0, top_p=1.5)
    for temperature in (-1.0, float("nan"), float("inf"), True, np.bool_(True)):
        with pytest.raises(ValueError, match=r"temperature=.*; valid: 0 \(greedy\) or a "
                                             r"finite number > 0"):
            run([8, 5], temperature=temperature)
    # Non-integers and a seed where a key belongs failed deep inside JAX (or top_k=1.5
    # was cut to 1 without a word).
    with pytest.raises(ValueError, match=r"top_k=1.5; valid: None or 1\.\.256"):
        run([8, 5], temperature=1.0, top_k=1.5)
    with pytest.raises(ValueError, match=r"max_new_tokens=2.5; valid: an integer >= 1"):
        gpt.generate(model, params, prompts, [8, 5], max_new_tokens=2.5)
    with pytest.raises(ValueError, match=r"rng=0; valid: a JAX PRNG key"):
        gpt.generate(model, params, prompts, [8, 5], max_new_tokens=2, temperature=1.0, rng=0)
    with pytest.raises(ValueError, match=r"rng=.*; valid: a JAX PRNG key"):  # 3 words: none
        gpt.generate(model, params, prompts, [8, 5], max_new_tokens=2, temperature=1.0,
                     rng=jnp.zeros(3, jnp.uint32))
    with pytest.raises(ValueError, match=r"prompts: shape \(2, 0\); valid: .* T >= 1"):
        gpt.generate(model, params, prompts[:, :0], [1, 1], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"top_k=0; valid: None or 1\.\.256"):
        run([8, 5], temperature=1.0, top_k=0)
    # Ids past the vocabulary embedded to NaN inside the jitted loop, and a 1-D prompt
    # was "not enough values to unpack".
    with pytest.raises(ValueError, match=r"prompts: token id 300 is outside the vocabulary; "
                                         r"valid: 0\.\.255"):
        gpt.generate(model, params, prompts.at[1, 2].set(300), [8, 5], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts: shape \(8,\); valid: \[B, T\]"):
        gpt.generate(model, params, prompts[0], [8], max_new_tokens=2)
    # A string top_p compared with a number (a TypeError naming nothing); a length of 2.5
    # read as 2; a pad token past the vocabulary taken; a negative temperature handed to
    # sample_logits itself sampled the inverted distribution.
    with pytest.raises(ValueError, match=r"top_p='0.9'; valid: None or in \(0, 1\]"):
        run([8, 5], temperature=1.0, top_p="0.9")
    with pytest.raises(ValueError, match=r"prompt_lengths=\[8.0, 2.5\]; valid: 2 lengths"):
        run(np.array([8, 2.5]))
    with pytest.raises(ValueError, match=r"pad_token=256; valid: a token id 0\.\.255"):
        run([8, 5], pad_token=256)
    # A float was cut to an int without a word: vocab_size=True generated id 0 alone,
    # stop_token=6.5 stopped at 6; a stop past vocab_size can never come.
    with pytest.raises(ValueError, match=r"vocab_size=True; valid: None or 1\.\.256"):
        run([8, 5], vocab_size=True)
    for stop, valid in ((6.5, r"0\.\.255"), (200, r"0\.\.199")):
        with pytest.raises(ValueError, match=rf"stop_token={stop}; valid: None or a token id "
                                             rf"{valid} \(one that can be generated\)"):
            run([8, 5], stop_token=stop, vocab_size=200 if stop == 200 else None)
    with pytest.raises(ValueError, match=r"temperature=-1.0; valid: 0 \(greedy\)"):
        gpt.sample_logits(jax.random.PRNGKey(0), jnp.zeros((1, 4)), temperature=-1.0)
    # A nested list of ids is a batch of prompts, as an array is.
    listed, _ = gpt.generate(model, params, np.asarray(prompts).tolist(), [8, 5],
                             max_new_tokens=2)
    np.testing.assert_array_equal(listed, gpt.generate(model, params, prompts, [8, 5],
                                                       max_new_tokens=2)[0])


def test_ids_outside_a_table_are_an_error_when_applied_eagerly():
    """JAX's gather fills an out-of-range row with NaN (a loss turned NaN, nothing said);
    an eager call, as in a notebook, says which id and the valid range."""
    model, params = _model("gpt-tiny")
    ids = _tokens((2, 8), 2)
    with pytest.raises(ValueError, match=r"^ids: 256 is outside the table's 256 rows; valid: "
                                         r"0\.\.255 \(ids of another tokenizer"):
        model.apply({"params": params}, ids.at[0, 0].set(256))
    with pytest.raises(ValueError, match=r"^ids: -1 is outside"):
        model.apply({"params": params}, ids.at[0, 0].set(-1))
    logits, _ = model.apply({"params": params}, ids)  # in range: no error
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("field", ["vocab_size", "max_len", "num_layers", "d_model", "num_heads"])
def test_sizes_that_are_not_positive_name_the_field(field):
    """num_heads=0 divided by zero; d_model=0 and num_layers=0 built an empty model."""
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer; got 0 "
                                         rf"\(valid: an integer >= 1\)"):
        gpt.GPTConfig.from_variant("gpt-tiny", **{field: 0})


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)

    def draw(keys, **kw):
        return jax.jit(jax.vmap(lambda k: gpt.sample_logits(k, logits, **kw)[0]))(keys)

    assert set(np.asarray(draw(keys, top_k=2)).tolist()) == {0, 1}
    assert set(np.asarray(draw(keys, top_p=0.7)).tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert set(np.asarray(draw(keys, top_p=1.0)).tolist()) == {0, 1, 2, 3}
    # A temperature near 0 is greedy in the limit: dividing the raw logits by 1e-45
    # overflowed them to -inf everywhere, and the draw came out of the mask (its first
    # id, so the most likely token is put last here).
    logits = logits[:, ::-1]
    for temperature in (1e-30, 1e-45):
        assert set(np.asarray(draw(keys, temperature=temperature)).tolist()) == {3}
        assert set(np.asarray(draw(keys, temperature=temperature, top_p=0.9)).tolist()) == {3}
    # Called directly (generate checks its own), top_p 0 masked every token and drew id
    # 0 for every row, unsaid; top_k 0 or past V failed inside lax.
    for kw, valid in ((dict(top_p=0.0), r"top_p=0.0; valid: None or in \(0, 1\]"),
                      (dict(top_p=-0.5), r"top_p=-0.5; valid: None or in \(0, 1\]"),
                      (dict(top_k=0), r"top_k=0; valid: None or 1\.\.4 "),
                      (dict(top_k=5), r"top_k=5; valid: None or 1\.\.4 ")):
        with pytest.raises(ValueError, match=valid):
            gpt.sample_logits(keys[0], logits, **kw)


def _grads(model, params, tokens):
    def loss(p):
        logits, aux = model.apply({"params": p}, tokens)
        return gpt.lm_loss(logits, tokens)[0] + aux.get("moe_loss", 0.0)
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("name", ["gpt-tiny"])
def test_reference_and_blockwise_give_equal_outputs_and_gradients(name):
    model, params = _model(name)
    ref = gpt.GPT(gpt.get_config(name, implementation="reference", **TINY[name]))
    tokens = _tokens((2, 16), 3)
    (l1, g1), (l2, g2) = _grads(model, params, tokens), _grads(ref, params, tokens)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny-moe"])
def test_pre_norm_gpt_trains(name):
    """A few jitted Adam steps on one batch reduce the next-token loss."""
    model, params = _model(name)
    tokens = _tokens((4, 16), 4)

    def loss(p, _):
        logits, aux = model.apply({"params": p}, tokens)
        return gpt.lm_loss(logits, tokens)[0] + aux.get("moe_loss", 0.0)

    assert_loss_goes_down(adam_losses(loss, params, steps=5, lr=3e-3), by=0.1)


def test_attention_scale_multiplies_the_logits():
    """attention_scale=c equals the default 1/sqrt(H) model with its query projection
    (kernel and bias) multiplied by c·sqrt(H): the scale reaches every layer's logits."""
    model, params = _model("gpt-tiny")
    h = model.config.d_model // model.config.num_heads
    c = 1.0  # the "scaling off" arm of the ablation
    scaled = gpt.GPT(gpt.get_config("gpt-tiny", attention_scale=c))

    def boost_queries(p):
        p = jax.tree.map(lambda x: x, nn.unbox(p))  # plain arrays, in dicts we may edit
        for layer in p["decoder"].values():
            attn = layer["self_attention"]
            attn["qkv"] = attn["qkv"].at[:, 0].multiply(c * np.sqrt(h))
            attn["qkv_bias"] = attn["qkv_bias"].at[0].multiply(c * np.sqrt(h))
        return p

    tokens = _tokens((2, 16), 6)
    ours = scaled.apply({"params": params}, tokens)[0]
    np.testing.assert_allclose(ours, model.apply({"params": boost_queries(params)}, tokens)[0],
                               rtol=1e-4, atol=1e-4)
    assert not np.allclose(ours, model.apply({"params": params}, tokens)[0], atol=1e-3)


def test_post_norm_ends_in_a_norm_and_pre_norm_adds_a_final_one():
    pre, pre_params = _model("gpt-tiny")
    post, post_params = _model("gpt-tiny-post")
    assert "final_norm" in pre_params and "final_norm" not in post_params
    # the last post-norm block's output is normalised: zero mean, unit variance per token
    # (LayerNorm's scale and bias start at 1 and 0)
    x = jnp.asarray(_tokens((2, 16), 7))
    _, state = post.apply({"params": post_params}, x, capture_intermediates=True, mutable=True)
    last = state["intermediates"]["decoder"][f"layer_{post.config.num_layers - 1}"]
    hidden = last["__call__"][0][0]  # [B, T, D]
    np.testing.assert_allclose(jnp.mean(hidden, -1), 0.0, atol=1e-5)
    np.testing.assert_allclose(jnp.std(hidden, -1), 1.0, atol=1e-3)


def test_sinusoidal_and_rope_models_run_past_max_len_but_learned_refuses():
    """Sinusoids are defined at every position (Vaswani §3.5's argument for them); a
    learned table has max_len rows."""
    long = _tokens((1, 200), 8)  # gpt-tiny's max_len is 128
    model, params = _model("gpt-tiny-post")  # sinusoidal positions
    logits = model.apply({"params": params}, long)[0]
    assert logits.shape == (1, 200, 256) and np.isfinite(logits).all()
    learned, learned_params = _model("gpt-tiny")
    with pytest.raises(ValueError, match="sequence length 200 exceeds max_len=128"):
        learned.apply({"params": learned_params}, long)


def test_sinusoidal_variant_gives_tokens_and_positions_the_same_scale():
    """Vaswani §3.4: with fixed sinusoids (entries of size ~1) the token table is scaled by
    sqrt(D) from std D^-1/2, so embedded tokens have unit variance, not GPT-2's 0.02."""
    model, params = _model("gpt-tiny-post")  # sinusoidal
    table = nn.unbox(params)["token_embedding"]["embedding"]
    d = model.config.d_model
    assert abs(float(jnp.std(table)) * np.sqrt(d) - 1.0) < 0.1
    _, learned_params = _model("gpt-tiny")
    assert abs(float(jnp.std(nn.unbox(learned_params)["token_embedding"]["embedding"])) - 0.02) < 0.003


def test_inputs_of_the_wrong_kind_are_named_in_one_line():
    """A 1-D or float token array was "not enough values to unpack" or JAX's "indices must
    have an integer type"; swapped lm_loss arguments a broadcasting error."""
    model, params = _model("gpt-tiny")
    tokens = _tokens((2, 8))
    for bad, got in ((tokens[0], r"int32 \(8,\)"), (tokens.astype(jnp.float32), r"float32 \(2, 8\)")):
        with pytest.raises(ValueError, match=rf"tokens must be an int array of shape \[B, T\]; "
                                             rf"got {got}"):
            model.apply({"params": params}, bad)
    with pytest.raises(ValueError, match=r"positions must be an int array of shape "
                                         r"\[B, T\]=\[2, 8\]; got int32 \(8,\)"):
        model.apply({"params": params}, tokens, positions=jnp.arange(8))
    logits, _ = model.apply({"params": params}, tokens)
    with pytest.raises(ValueError, match=r"tokens must be an int array of shape \[B, T\]; got "
                                         r"float32 \(2, 8, \d+\)"):
        gpt.lm_loss(tokens, logits)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\] over tokens' "
                                         r"\[B, T\]=\[2, 7\]; got \(2, 8, \d+\) \(the order is "
                                         r"lm_loss\(logits, tokens\)\)"):
        gpt.lm_loss(logits, tokens[:, :7])


def test_param_dtype_reaches_every_parameter():
    """The final norm was made without param_dtype: float32 among bfloat16 parameters."""
    import flax.linen as nn
    model = gpt.GPT(gpt.get_config("gpt-tiny", param_dtype="bfloat16"))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
    found = {"/".join(str(getattr(k, "key", k)) for k in path): leaf.dtype
             for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(params))}
    assert any("final_norm" in k for k in found)
    assert {str(d) for d in found.values()} == {"bfloat16"}, {
        k: d for k, d in found.items() if d != jnp.bfloat16}


def test_router_z_loss_weight_adds_its_multiple_of_the_z_loss_to_the_moe_loss():
    """The z-loss (ST-MoE) was computed and never trained on. moe_loss is now
    moe_loss_weight × Σ balance + router_z_loss_weight × Σ z over layers; the weight's
    default 0 leaves moe_loss the balance term alone, bit for bit."""
    tokens = _tokens((2, 16), 5)
    base = gpt.get_config("gpt-tiny-moe")
    params = gpt.GPT(base).init(jax.random.PRNGKey(0), tokens)
    _, aux0 = gpt.GPT(base).apply(params, tokens)
    assert base.router_z_loss_weight == 0.0
    assert float(aux0["moe_loss"]) == float(
        base.moe_loss_weight * jnp.sum(aux0["layers"]["moe"]["load_balance_loss"]))
    z = float(jnp.sum(aux0["layers"]["moe"]["router_z_loss"]))
    assert z > 0
    weighted = gpt.get_config("gpt-tiny-moe", router_z_loss_weight=1e-3)
    _, aux = gpt.GPT(weighted).apply(params, tokens)
    np.testing.assert_allclose(float(aux["moe_loss"]) - float(aux0["moe_loss"]), 1e-3 * z,
                               rtol=1e-5)
    for name in ("router_z_loss_weight", "moe_loss_weight"):
        for bad in (-1e-3, float("inf"), "1e-3"):
            with pytest.raises(ValueError, match=rf"^{name}={bad!r} is out of range; valid: "
                                                 rf"a finite {name} >= 0"):
                gpt.get_config("gpt-tiny-moe", **{name: bad})


def test_sample_logits_of_one_row_or_many_axes_and_lm_loss_weights_of_another_shape():
    """top_k/top_p indexed logits as [B, V]: one row [V] was an IndexError and [B, T, V]
    a broadcasting TypeError; an int for rng a TypeError from inside jax.random; lm_loss
    weights [B] an IndexError."""
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    key = jax.random.key(0)
    for kw in (dict(top_k=2), dict(top_p=0.7)):
        assert int(gpt.sample_logits(key, logits, **kw)) in (0, 1)
        drawn = gpt.sample_logits(key, jnp.broadcast_to(logits, (2, 3, 4)), **kw)
        assert drawn.shape == (2, 3) and set(np.asarray(drawn).ravel().tolist()) <= {0, 1}
    with pytest.raises(ValueError, match=r"^rng=0; valid: a JAX PRNG key"):
        gpt.sample_logits(0, logits[None])
    tokens = _tokens((2, 8))
    with pytest.raises(ValueError, match=r"^weights: shape \(2,\); valid: tokens' \[B, T\]="
                                         r"\[2, 8\]"):
        gpt.lm_loss(jnp.zeros((2, 8, 4)), tokens % 4, jnp.ones((2,)))
