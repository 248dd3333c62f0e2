"""Encoder-decoder Transformer: counts, masking, cached decoding, greedy and beam search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax.models import encdec as ed
from attention_jax.models.losses import cross_entropy, shift_right
from helpers import adam_losses, assert_beam_finds_the_best, assert_loss_goes_down


def _count(cfg):
    ones = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: ed.EncoderDecoder(cfg).init(jax.random.PRNGKey(0), ones, ones))
    return sum(x.size for x in jax.tree.leaves(shapes["params"]))


def test_parameter_counts_match_the_paper():
    base = _count(ed.get_config("transformer-base"))
    # Architecture arithmetic: shared 37000×512 embedding; encoder layer = 4 projections
    # (512² + 512 each), FFN 2·512·2048 + 2048 + 512, 2 LayerNorms; decoder layer adds
    # a second attention and a third LayerNorm.
    d, f, v = 512, 2048, 37000
    attn, ffn, ln = 4 * (d * d + d), 2 * d * f + f + d, 2 * d
    assert base == v * d + 6 * (attn + ffn + 2 * ln) + 6 * (2 * attn + ffn + 3 * ln)  # 63.08M
    # Table 3 rounds base to 65M: the same arithmetic gives 63.1M (3% below), while "big"
    # lands within 1% of its 213M, so the rounding is the paper's, not a missing part.
    assert abs(base - 65e6) / 65e6 < 0.03
    assert abs(_count(ed.get_config("transformer-big")) - 213e6) / 213e6 < 0.01


def test_bad_configs_raise_with_valid_choices():
    with pytest.raises(ValueError, match=r"unknown encoder-decoder variant.*'transformer-base'"):
        ed.get_config("transformer-huge")
    with pytest.raises(ValueError, match=r"num_heads=3 does not divide d_model=32.*\[1, 2, 4"):
        ed.get_config("transformer-tiny", num_heads=3)
    with pytest.raises(ValueError, match=r"valid: \('pre', 'post'\)"):
        ed.get_config("transformer-tiny", norm_position="sandwich")
    with pytest.raises(ValueError, match=r"sinusoidal positions are sin/cos pairs: d_model=63 "
                                         r"is odd; valid: an even d_model"):
        ed.get_config("transformer-tiny", d_model=63, num_heads=3)
    # A special id outside the vocabulary: greedy decoding all zeros, beam scores NaN.
    for name, value in (("bos_id", 50), ("pad_id", -1), ("eos_id", 8)):
        with pytest.raises(ValueError, match=rf"^{name}={value} is no token id of the "
                                             rf"vocabulary; valid: 0\.\.7$"):
            ed.get_config("transformer-tiny", vocab_size=8, **{name: value})


@pytest.mark.parametrize("field", ["d_model", "num_heads", "num_encoder_layers",
                                   "num_decoder_layers", "mlp_dim"])
@pytest.mark.parametrize("value", [0, -4])
def test_sizes_that_are_not_positive_name_the_field(field, value):
    """They divided by zero, failed in the stack's setup, or (mlp_dim=0) trained at 4D."""
    with pytest.raises(ValueError, match=rf"^{field} must be a positive integer; got {value} "
                                         rf"\(valid: an integer >= 1"):
        ed.get_config("transformer-tiny", **{field: value})


@functools.lru_cache(maxsize=None)
def _model(**overrides):
    model = ed.EncoderDecoder(ed.get_config("transformer-tiny", **overrides))
    ones = jnp.ones((1, 8), jnp.int32)
    return model, jax.jit(model.init)(jax.random.PRNGKey(0), ones, ones)["params"]


SRC = jnp.array([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0], [15, 16, 17, 18, 19, 0, 0]])


def _targets(shape, seed=0, vocab=64):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 3, vocab)


def test_decoder_is_causal_and_source_padding_is_invisible():
    model, params = _model()
    apply = jax.jit(lambda s, t, m: model.apply({"params": params}, s, t, m)[0])
    mask = SRC != 0
    tgt_in = shift_right(_targets((3, 8)))
    base = apply(SRC, tgt_in, mask)
    later = apply(SRC, tgt_in.at[:, 5:].set(_targets((3, 3), 1)), mask)
    np.testing.assert_allclose(base[:, :5], later[:, :5], atol=1e-5)
    assert not np.allclose(base[:, 5:], later[:, 5:], atol=1e-3)
    # the content of padded source slots does not matter once they are masked
    np.testing.assert_allclose(apply(jnp.where(mask, SRC, 33), tgt_in, mask), base, atol=1e-5)
    assert not np.allclose(apply(SRC, tgt_in, jnp.ones_like(mask)), base, atol=1e-3)


@pytest.mark.parametrize("overrides", [{}, dict(scan_layers=True, norm_position="pre")])
def test_kv_cache_decoding_equals_teacher_forcing_for_unequal_prefixes(overrides):
    model, params = _model(**overrides)
    mask = SRC != 0
    b, total, lengths = 3, 8, np.array([1, 4, 2])
    tgt_in = shift_right(_targets((b, total), 2))
    full = jax.jit(lambda s, t: model.apply({"params": params}, s, t)[0])(SRC, tgt_in)
    encoded, _ = jax.jit(lambda s: model.apply({"params": params}, s, method=model.encode))(SRC)

    @jax.jit
    def step(cache, t, pos):
        (logits, _), state = model.apply(
            {"params": params, "cache": cache}, t, encoded, mask, positions=pos, decode=True,
            mutable=["cache"], method=model.decode)
        return logits, state["cache"]

    n = int(lengths.max())
    prefix = jnp.where(jnp.arange(n)[None] < lengths[:, None], tgt_in[:, :n], 0)
    cache = ed.init_cache(model, b, total, SRC.shape[1])
    logits, cache = step(cache, prefix, jnp.broadcast_to(jnp.arange(n), (b, n)))
    for row, m in enumerate(lengths):
        np.testing.assert_allclose(logits[row, :m], full[row, :m], atol=2e-4)
    rows = np.arange(b)
    for i in range(total - n):
        pos = lengths + i
        logits, cache = step(cache, tgt_in[rows, pos][:, None], jnp.asarray(pos)[:, None])
        np.testing.assert_allclose(logits[:, 0], full[rows, pos], atol=2e-4)


def test_greedy_decoding_matches_the_full_model_and_beam_of_one():
    model, params = _model()
    out = ed.greedy_decode(model, params, SRC, max_len=6)
    full = jax.jit(lambda s, t: model.apply({"params": params}, s, t)[0])(SRC, shift_right(out))
    best = np.asarray(jnp.argmax(full, -1))
    for row in range(3):
        seq = np.asarray(out[row])
        stop = int(np.argmax(seq == 2)) + 1 if 2 in seq else 6
        np.testing.assert_array_equal(seq[:stop], best[row, :stop])
        assert np.all(seq[stop:] == 0)
    beam, _ = ed.beam_search(model, params, SRC, beam_size=1, max_len=6, alpha=0.0)
    np.testing.assert_array_equal(beam[:, 0], out)
    # An id past the vocabulary embedded a NaN row under jit: all-pad tokens and NaN beam
    # scores, unsaid; max_len 0 an IndexError from the cache.
    bad = jnp.asarray(SRC).at[0, 1].set(model.config.vocab_size + 5)
    for decode in (lambda: ed.greedy_decode(model, params, bad, max_len=6),
                   lambda: ed.beam_search(model, params, bad, beam_size=2, max_len=4)):
        with pytest.raises(ValueError, match=rf"^src: {model.config.vocab_size + 5} is out of "
                                             rf"range; valid: 0\.\.{model.config.vocab_size - 1}"):
            decode()
    with pytest.raises(ValueError, match=r"^max_len=0; valid: an int >= 1"):
        ed.greedy_decode(model, params, SRC, max_len=0)


def test_wide_beam_search_finds_the_exact_best_sequence():
    """With W = V² beams on a 5-token vocabulary, beam search over 3 steps keeps every
    prefix, so it must return the most probable sequence found by enumeration."""
    v, steps = 5, 3
    model, params = _model(vocab_size=v)
    src = jnp.array([[3, 4, 1, 3, 0], [4, 4, 3, 0, 0]])
    tokens, scores = ed.beam_search(model, params, src, beam_size=v * v, max_len=steps, alpha=0.0)

    def teacher_forced(seqs):
        logits = jax.jit(lambda s, t: model.apply({"params": params}, s, t)[0])(
            jnp.repeat(src, len(seqs), 0), shift_right(jnp.tile(jnp.asarray(seqs), (2, 1))))
        return jax.nn.log_softmax(logits).reshape(2, len(seqs), steps, v)
    assert_beam_finds_the_best(tokens, scores, teacher_forced, v, steps)


def test_decoding_within_a_tokenizer_s_vocabulary_never_emits_the_padding_ids():
    """vocab_size (a tokenizer's 5 ids in the model's 64): greedy decoding is the argmax
    over those ids under teacher forcing, and a beam search keeping every prefix finds
    the best sequence of the distribution over them. Unrestricted, the model emits ids
    past them (which a tokenizer decodes to nothing)."""
    model, params = _model()
    v, steps = 5, 3
    src = SRC[:2]
    assert int(ed.greedy_decode(model, params, src, max_len=6).max()) >= v  # (can tell)
    out = ed.greedy_decode(model, params, src, max_len=6, vocab_size=v)
    full = jax.jit(lambda s, t: model.apply({"params": params}, s, t)[0])(src, shift_right(out))
    best = np.asarray(jnp.argmax(full[..., :v], -1))
    for row in range(2):
        seq = np.asarray(out[row])
        stop = int(np.argmax(seq == 2)) + 1 if 2 in seq else 6
        np.testing.assert_array_equal(seq[:stop], best[row, :stop])
    tokens, scores = ed.beam_search(model, params, src, beam_size=v * v, max_len=steps,
                                    alpha=0.0, vocab_size=v)

    def teacher_forced(seqs):
        logits = jax.jit(lambda s, t: model.apply({"params": params}, s, t)[0])(
            jnp.repeat(src, len(seqs), 0), shift_right(jnp.tile(jnp.asarray(seqs), (2, 1))))
        return jax.nn.log_softmax(logits[..., :v]).reshape(2, len(seqs), steps, v)
    assert_beam_finds_the_best(tokens, scores, teacher_forced, v, steps)
    for bad in (0, 2, 65, 2.5):  # (2: eos could never end a sequence)
        with pytest.raises(ValueError, match=rf"^vocab_size={bad!r}; valid: None or 3\.\.64 "
                                             rf"\(the model's vocabulary, past its special "
                                             rf"ids \[0, 1, 2\]\)"):
            ed.greedy_decode(model, params, src, max_len=2, vocab_size=bad)
    # NumPy ints are ints; a NaN length penalty ranked every beam as NaN
    ed.beam_search(model, params, src, beam_size=np.int64(2), max_len=np.int64(2))
    with pytest.raises(ValueError, match=r"^alpha=nan; valid: a finite number"):
        ed.beam_search(model, params, src, beam_size=2, max_len=2, alpha=float("nan"))


def test_reference_and_blockwise_give_equal_outputs_and_gradients():
    model, params = _model()
    ref = ed.EncoderDecoder(ed.get_config("transformer-tiny", implementation="reference"))
    tgt = _targets((3, 8), 3)

    def value_and_grad(m):
        def loss(p):
            return cross_entropy(m.apply({"params": p}, SRC, shift_right(tgt))[0], tgt, tgt != 0)[0]
        return jax.jit(jax.value_and_grad(loss))(params)

    (l1, g1), (l2, g2) = value_and_grad(model), value_and_grad(ref)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_post_norm_transformer_trains_with_label_smoothing():
    model, params = _model(dropout_rate=0.1)
    tgt = _targets((3, 8), 4)

    def loss(p, rng):
        logits, _ = model.apply({"params": p}, SRC, shift_right(tgt), deterministic=False,
                                rngs={"dropout": rng})
        return cross_entropy(logits, tgt, tgt != 0, label_smoothing=0.1)[0]

    assert_loss_goes_down(adam_losses(loss, params, steps=6, lr=3e-3), by=0.1)


def test_inputs_of_the_wrong_kind_are_named_in_one_line():
    """1-D or float src/tgt were JAX's indexing errors; batches that differ were named
    after attention's internal q and k."""
    model, params = _model()
    tgt = _targets((3, 5))
    with pytest.raises(ValueError, match=r"src must be an int array of shape \[B, T\]; got "
                                         r"int32 \(7,\)"):
        model.apply({"params": params}, SRC[0], tgt)
    with pytest.raises(ValueError, match=r"tgt_in must be an int array of shape \[B, T\]; got "
                                         r"float32 \(3, 5\)"):
        model.apply({"params": params}, SRC, tgt.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"src and tgt_in need the same batch B: src \(3, 7\), "
                                         r"tgt_in \(1, 5\)"):
        model.apply({"params": params}, SRC, tgt[:1])


def test_decoding_runs_with_float64_on():
    """With jax_enable_x64 (a notebook checking numerics) the cache write's indices and
    the beam's step counter widened to int64: greedy decoding and beam search raised."""
    model, params = _model()
    with jax.enable_x64(True):
        out = ed.greedy_decode(model, params, SRC, max_len=6)
        beam, _ = ed.beam_search(model, params, SRC, beam_size=1, max_len=6, alpha=0.0)
    np.testing.assert_array_equal(out, ed.greedy_decode(model, params, SRC, max_len=6))
    np.testing.assert_array_equal(beam[:, 0], out)


def test_param_dtype_reaches_every_parameter(x64):
    """The pre-norm stacks' final norms were made without param_dtype: float32 among the
    float64 parameters a check asked for."""
    import flax.linen as nn
    _, params = _model(norm_position="pre", param_dtype="float64", dtype="float64")
    found = {"/".join(str(getattr(k, "key", k)) for k in path): leaf.dtype
             for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(params))}
    assert "encoder_norm/scale" in found and "decoder_norm/scale" in found
    assert {str(d) for d in found.values()} == {"float64"}, {
        k: d for k, d in found.items() if d != jnp.float64}


def test_the_docstrings_loss_weights_are_the_tasks_target_weights():
    """The encoder-decoder's and the RNN's docstrings showed `tgt != pad_id` as the loss
    weights; the task weighs by position (data.seq2seq_example's target_weights), so where
    pad_id == eos_id each target's EOS still counts. Their expressions, evaluated on
    such a batch, give the task's weights; `!= pad_id` would not."""
    import re

    from attention_jax import data
    from attention_jax.models import rnn
    pairs = [([7, 8], [5, 6]), ([9], [4, 3, 5]), ([3], [6])]
    rows = [data.seq2seq_example(s, t, source_len=4, target_len=5, bos_id=1, eos_id=0,
                                 pad_id=0) for s, t in pairs]
    tgt = jnp.asarray(np.stack([r["targets"] for r in rows]))
    want = np.stack([r["target_weights"] for r in rows])
    lengths = jnp.asarray([len(t) for _, t in pairs])
    assert not np.array_equal(np.asarray(tgt != 0), want)  # the old docstrings' weights
    (line,) = re.findall(r"weights = (.*?)  #", ed.__doc__)
    got = eval(line, {"jnp": jnp, "tgt": tgt, "tgt_len": lengths})
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    (expr,) = re.findall(r"`(jnp\.arange\(T\) <= lengths\[:, None\])`", rnn.__doc__)
    got = eval(expr, {"jnp": jnp, "T": tgt.shape[1], "lengths": lengths})
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    for doc in (ed.__doc__, rnn.__doc__):  # `!= pad_id` named only as what not to do
        assert not re.search(r"cross_entropy\([^)]*!=", doc), doc


def test_a_src_mask_of_the_wrong_kind_is_named_src_mask():
    """An int src_mask (the 0/1 masks of other libraries) or one of another length was
    refused by attention as "kv_mask must be a bool array", an argument never passed."""
    model, params = _model()
    tgt = _targets((3, 5))
    for bad, got in ((jnp.ones(SRC.shape, jnp.int32), r"int32 \(3, 7\)"),
                     (jnp.ones((3, 6), bool), r"bool \(3, 6\)")):
        with pytest.raises(ValueError, match=rf"^src_mask must be a bool array of src's shape "
                                             rf"\[B, S\]=\[3, 7\] .*; got {got}"):
            model.apply({"params": params}, SRC, tgt, bad)
        with pytest.raises(ValueError, match=r"^src_mask must be a bool array"):
            ed.greedy_decode(model, params, SRC, max_len=3, src_mask=bad)
