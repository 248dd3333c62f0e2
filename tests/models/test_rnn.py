"""RNN seq2seq: Bahdanau attention vs the single-vector bottleneck, padding, decoding, training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models.losses import cross_entropy, shift_right
from attention_jax.models import rnn
from attention_jax.models.rnn import RNNConfig, RNNSeq2Seq, VARIANTS
from helpers import adam_losses, assert_beam_finds_the_best, assert_loss_goes_down

# Row 0 has 4 real source tokens and 2 pads; row 1 is full.
SRC = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], jnp.int32)
TGT = jnp.array([[4, 5, 2, 0], [6, 7, 8, 2]], jnp.int32)


@functools.lru_cache(maxsize=None)  # init compiles; share it between tests
def _init(variant, **overrides):
    model = RNNSeq2Seq(RNNConfig.from_variant(variant, **overrides))
    # (TGT's ids within a smaller target vocabulary: an id past it is refused)
    tgt_in = jnp.minimum(shift_right(TGT), model.config.target_vocab_size - 1)
    params = nn.unbox(model.init(jax.random.key(0), SRC, tgt_in)["params"])
    return model, params


@pytest.mark.parametrize("variant", ["tiny", "tiny-lstm"])
def test_attention_weights_sum_to_one_on_real_tokens_and_zero_on_padding(variant):
    model, params = _init(variant)
    logits, aux = model.apply({"params": params}, SRC, shift_right(TGT), return_weights=True)
    assert logits.shape == (2, 4, 32)
    alpha = np.asarray(aux["attention_weights"]["cross"])  # [L=1, B, N=1, T, S]
    assert alpha.shape == (1, 2, 1, 4, 6)
    alpha = alpha[0, :, 0]  # [B, T, S]
    np.testing.assert_allclose(alpha.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(alpha[0, :, 4:], 0.0)
    assert np.all(alpha[0, :, :4] > 0) and np.all(alpha[1] > 0)


def test_bottleneck_has_no_alignment_model_and_attention_does():
    attn_model, attn_params = _init("tiny")
    neck_model, neck_params = _init("tiny-bottleneck")
    for name in ("attn_keys",):
        assert name in attn_params and name not in neck_params
    for name in ("attn_query", "attn_v"):
        assert name in attn_params["decoder"] and name not in neck_params["decoder"]
    _, neck_aux = neck_model.apply({"params": neck_params}, SRC, shift_right(TGT),
                                   return_weights=True)
    assert "attention_weights" not in neck_aux and neck_aux["summary"].shape == (2, 64)
    # The bottleneck decoder reads the source only through the summary vector: swapping in
    # other annotations (same summary) leaves its logits unchanged; attention's do change.
    for model, params, should_change in ((neck_model, neck_params, False),
                                         (attn_model, attn_params, True)):
        memory, carry = model.apply({"params": params}, SRC, method=model.encode)
        noisy = dict(memory, annotations=memory["annotations"] + 1.0)
        if "keys" in memory:
            noisy["keys"] = memory["keys"] + 1.0

        def step(m, carry, mem):
            return m.decoder(carry, jnp.array([1, 1]), mem, True)[1]

        a = nn.apply(step, model)({"params": params}, carry, memory)
        b = nn.apply(step, model)({"params": params}, carry, noisy)
        assert bool(jnp.any(jnp.abs(a - b) > 1e-4)) == should_change


@pytest.mark.parametrize("variant", ["tiny", "tiny-bottleneck"])
def test_pad_token_ids_do_not_matter(variant):
    model, params = _init(variant)
    mask = SRC != 0
    other = jnp.where(mask, SRC, 17)  # same real tokens, different ids under the mask
    a, _ = model.apply({"params": params}, SRC, shift_right(TGT), src_mask=mask)
    b, _ = model.apply({"params": params}, other, shift_right(TGT), src_mask=mask)
    np.testing.assert_allclose(a, b, atol=1e-6)
    c, _ = model.apply({"params": params}, other, shift_right(TGT))  # 17s now count as real
    assert not np.allclose(a[0], c[0], atol=1e-4)


def test_greedy_decode_matches_teacher_forcing_on_its_own_output():
    model, params = _init("tiny")
    tokens, aux = model.apply({"params": params}, SRC, method=model.generate, max_len=7,
                              return_weights=True)
    alpha = aux["attention_weights"]["cross"][0, :, 0]  # [B, T, S]
    assert tokens.shape == (2, 7) and alpha.shape == (2, 7, 6)
    logits, tf_aux = model.apply({"params": params}, SRC, shift_right(tokens), return_weights=True)
    live = np.arange(7)[None, :] < np.asarray(aux["lengths"])[:, None]
    np.testing.assert_array_equal(np.where(live, jnp.argmax(logits, -1), 0), np.where(live, tokens, 0))
    np.testing.assert_allclose(
        np.where(live[..., None], tf_aux["attention_weights"]["cross"][0, :, 0], 0),
        np.where(live[..., None], alpha, 0), atol=1e-5)


@pytest.mark.parametrize("variant", ["tiny", "tiny-lstm", "tiny-bottleneck"])
def test_beam_of_one_is_greedy_and_a_wide_beam_finds_the_best_sequence(variant):
    """A beam of one decodes as `generate` does. With W = V² beams on a 5-token target
    vocabulary, beam search over 3 steps keeps every prefix, so it returns the most
    probable sequence (after eos only padding) found by enumerating all V³ under teacher
    forcing, with its log-probability as the score (alpha 0: no length penalty); the
    beams come best first. The LSTM carries (c, h), reordered with each beam."""
    model, params = _init(variant)
    greedy, _ = model.apply({"params": params}, SRC, method=model.generate, max_len=6)
    tokens, _ = rnn.beam_search(model, params, SRC, beam_size=1, max_len=6)
    np.testing.assert_array_equal(tokens[:, 0], greedy)
    v, steps = 5, 3
    model, params = _init(variant, tgt_vocab_size=v)
    tokens, scores = rnn.beam_search(model, params, SRC, beam_size=v * v, max_len=steps,
                                     alpha=0.0)

    def teacher_forced(seqs):
        logits, _ = jax.jit(lambda s, t: model.apply({"params": params}, s, t))(
            jnp.repeat(SRC, len(seqs), 0), shift_right(jnp.tile(jnp.asarray(seqs), (2, 1))))
        return jax.nn.log_softmax(logits).reshape(2, len(seqs), steps, v)
    assert_beam_finds_the_best(tokens, scores, teacher_forced, v, steps)
    with pytest.raises(ValueError, match=r"beam_size must be an int >= 1; got 0"):
        rnn.beam_search(model, params, SRC, beam_size=0, max_len=3)
    # A source id past the vocabulary: NaN scores under jit, unsaid.
    with pytest.raises(ValueError, match=rf"^src: {model.config.vocab_size} is out of range"):
        rnn.beam_search(model, params, jnp.asarray(SRC).at[0, 0].set(model.config.vocab_size),
                        beam_size=2, max_len=3)
    with pytest.raises(ValueError, match=r"beam_size=429496730 with a vocabulary of 5: "
                                         r"2147483650 candidates a step; valid: beam_size <= "
                                         r"429496729"):  # (top_k's int32 indices)
        rnn.beam_search(model, params, SRC, beam_size=2**31 // 5 + 1, max_len=3)


def test_decoding_within_a_tokenizer_s_vocabulary_never_emits_the_padding_ids():
    """vocab_size (a tokenizer's 5 ids in the model's 32): generate and a beam search
    keeping every prefix decode the distribution over those ids alone."""
    model, params = _init("tiny")
    v, steps = 5, 3
    out, _ = model.apply({"params": params}, SRC, method=model.generate, max_len=6)
    assert int(out.max()) >= v  # (unrestricted, the ids past them come out)
    out, _ = model.apply({"params": params}, SRC, method=model.generate, max_len=6,
                         vocab_size=v)
    logits, _ = model.apply({"params": params}, SRC, shift_right(out))
    best = np.asarray(jnp.argmax(logits[..., :v], -1))
    for row in range(2):
        seq = np.asarray(out[row])
        stop = int(np.argmax(seq == 2)) + 1 if 2 in seq else 6
        np.testing.assert_array_equal(seq[:stop], best[row, :stop])
    tokens, scores = rnn.beam_search(model, params, SRC, beam_size=v * v, max_len=steps,
                                     alpha=0.0, vocab_size=v)

    def teacher_forced(seqs):
        logits, _ = jax.jit(lambda s, t: model.apply({"params": params}, s, t))(
            jnp.repeat(SRC, len(seqs), 0), shift_right(jnp.tile(jnp.asarray(seqs), (2, 1))))
        return jax.nn.log_softmax(logits[..., :v]).reshape(2, len(seqs), steps, v)
    assert_beam_finds_the_best(tokens, scores, teacher_forced, v, steps)
    rnn.beam_search(model, params, SRC, beam_size=np.int64(2), max_len=np.int64(2))


def test_greedy_decode_stops_at_eos_and_pads_after():
    model, params = _init("tiny")

    def favour(token):  # an output layer that always predicts `token`
        kernel = jnp.zeros_like(params["decoder"]["logits"]["kernel"])
        logits = {"kernel": kernel, "bias": jnp.zeros(32).at[token].set(10.0)}
        return params | {"decoder": params["decoder"] | {"logits": logits}}

    tokens, aux = model.apply({"params": favour(2)}, SRC, method=model.generate, max_len=5)
    np.testing.assert_array_equal(tokens, [[2, 0, 0, 0, 0]] * 2)  # EOS, then padding
    np.testing.assert_array_equal(aux["lengths"], [1, 1])
    tokens, aux = model.apply({"params": favour(9)}, SRC, method=model.generate, max_len=5)
    np.testing.assert_array_equal(tokens, [[9] * 5] * 2)  # never stops: runs to max_len
    np.testing.assert_array_equal(aux["lengths"], [5, 5])


@pytest.mark.parametrize("variant,attention", [("tiny", True), ("tiny-lstm", False)])
def test_jitted_training_steps_decrease_the_loss(variant, attention):
    params = _init(variant, attention=attention)[1]  # dropout adds no parameters
    model = RNNSeq2Seq(RNNConfig.from_variant(variant, dropout_rate=0.1, attention=attention))

    def loss_fn(p, key):
        logits, _ = model.apply({"params": p}, SRC, shift_right(TGT), deterministic=False,
                                rngs={"dropout": key})
        return cross_entropy(logits, TGT, TGT != 0)[0]

    assert_loss_goes_down(adam_losses(loss_fn, params, steps=6, lr=1e-2), by=0.3)


def _gru_params(inp, n):  # flax GRUCell: 3 input kernels with biases, 3 recurrent, + b_hn
    return 3 * (inp * n + n) + 3 * n * n + n


def test_paper_size_rnnsearch_builds_without_memory_and_counts_match_equations():
    cfg = RNNConfig.from_variant("rnnsearch")
    model = RNNSeq2Seq(cfg)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 5), jnp.int32),
                            jnp.zeros((1, 4), jnp.int32))
    count = sum(x.size for x in jax.tree.leaves(nn.unbox(shapes["params"])))
    v, m, n, a, l = 30000, 620, 1000, 1000, 500
    expected = (v * m + 2 * _gru_params(m, n)  # source embedding, two encoder directions
                + 2 * n * n + n  # s_0 = tanh(W [→h; ←h])
                + 2 * n * a + a + n * a + a  # W_h (keys), W_s (query), v
                + v * m + _gru_params(m + 2 * n, n)  # target embedding, decoder GRU
                + (n + m + 2 * n) * 2 * l + 2 * l + l * v + v)  # maxout readout, output layer
    assert count == expected, (count, expected)


def test_bad_configuration_raises():
    with pytest.raises(ValueError, match="valid"):
        RNNConfig.from_variant("rnnsearch-xl")
    with pytest.raises(ValueError, match="cell"):
        RNNConfig.from_variant("tiny", cell="transformer")
    with pytest.raises(ValueError, match="eos_id"):
        RNNConfig.from_variant("tiny", eos_id=99)
    model, params = _init("tiny")
    with pytest.raises(ValueError, match="src_mask"):
        model.apply({"params": params}, SRC, shift_right(TGT), src_mask=jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match="max_len"):
        model.apply({"params": params}, SRC, method=model.generate, max_len=0)
    # Batches that differ were a concatenation's TypeError; float targets JAX's indexing.
    with pytest.raises(ValueError, match=r"src and tgt_in need the same batch B: src \(2, 6\), "
                                         r"tgt_in \(1, 4\)"):
        model.apply({"params": params}, SRC, shift_right(TGT)[:1])
    with pytest.raises(ValueError, match=r"tgt_in must be an int array of shape \[B, T\]; got "
                                         r"float32 \(2, 4\)"):
        model.apply({"params": params}, SRC, shift_right(TGT).astype(jnp.float32))
    assert set(VARIANTS) >= {"rnnsearch", "rnnencdec", "tiny", "tiny-bottleneck", "tiny-lstm"}


@pytest.mark.parametrize("variant", ["tiny", "tiny-lstm"])
def test_float64_runs_and_agrees_with_float32(variant, x64):
    """dtype float64 (the README's numerics checks) failed at init: flax starts a cell's
    carry in its param_dtype, float32, and the scan's carry came out float64."""
    model = RNNSeq2Seq(RNNConfig.from_variant(variant, dtype="float64"))
    params = nn.unbox(model.init(jax.random.key(0), SRC, shift_right(TGT))["params"])
    logits, _ = model.apply({"params": params}, SRC, shift_right(TGT))
    assert logits.dtype == jnp.float64
    f32 = RNNSeq2Seq(RNNConfig.from_variant(variant))
    low, _ = f32.apply({"params": jax.tree.map(lambda p: p.astype(jnp.float32), params)},
                       SRC, shift_right(TGT))
    np.testing.assert_allclose(np.asarray(low), np.asarray(logits), atol=1e-4)


@pytest.mark.parametrize("variant", ["tiny", "tiny-lstm"])
def test_float64_attention_weights_are_float64(variant, x64):
    """Under dtype float64 the additive attention's softmax ran in float32: its weights
    came back float32, summing to 1 only within ~1e-7, and the float64 model's logits
    carried that error."""
    model = RNNSeq2Seq(RNNConfig.from_variant(variant, dtype="float64"))
    params = nn.unbox(model.init(jax.random.key(0), SRC, shift_right(TGT))["params"])
    _, aux = model.apply({"params": params}, SRC, shift_right(TGT), return_weights=True)
    alpha = aux["attention_weights"]["cross"][0, :, 0]  # [B, T, S]
    assert alpha.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(alpha).sum(-1), 1.0, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.asarray(alpha)[0, :, 4:], 0.0)


def test_teacher_forcing_refuses_target_ids_past_the_vocabulary():
    """tgt_in is embedded inside the decoder's scan, where the lookup cannot check it:
    an id past the target vocabulary gave NaN logits, unsaid (src was checked)."""
    model, params = _init("tiny")
    v = model.config.target_vocab_size
    for bad in (v, -1):
        with pytest.raises(ValueError, match=rf"^tgt_in: {bad} is out of range; valid: "
                                             rf"0..{v - 1}"):
            model.apply({"params": params}, SRC, shift_right(TGT).at[1, 2].set(bad))
