"""A text task reads a text at predict time as it read its texts in training: the same
special tokens around it, the same cut, for every tokenizer kind."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import config as config_lib
from attention_jax import tasks
from attention_jax.models import bert

DOCS = ["the cat sat on the mat", "a dog ran in the park", "stocks fell sharply today",
        "rain is expected later", "the band played a new song", "we read an old book"]


def _mlm_task(tmp_path, tokenizer, *overrides):
    for i, doc in enumerate(DOCS * 4):
        (tmp_path / f"d{i}.txt").write_text(doc)
    config = config_lib.load("bert_mlm", [
        "data.name=files", f"data.files={tmp_path}/*.txt", f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path}/cache", "data.vocab_size=300",
        "model.num_layers=1", "model.d_model=8", "model.num_heads=2", "model.mlp_dim=16",
        "train.progress=False", *overrides])
    task = tasks.TASKS["bert_mlm"](config, str(tmp_path / "run"))
    return config, task


def _training_framed(task, config):
    """The first packed training document as the loader hands it: its ids."""
    row = task.train_source[0]
    seg = np.asarray(row["segment_ids"])
    return np.asarray(row["tokens"])[seg == seg[0]].tolist()


@pytest.mark.parametrize("tokenizer", ["wordpiece", "bpe"])
def test_bert_mlm_embeds_a_text_framed_as_its_training_documents(tmp_path, tokenizer):
    """--mode=embed of a bert_mlm run: a text reads as its training documents read
    ([CLS] text [SEP] was embedded, where the run trained on documents with no [CLS],
    which the model never read as an input), cut at data.seq_len (the rows it trained
    on), not at the position table's end."""
    config, task = _mlm_task(tmp_path, tokenizer, "data.seq_len=16", "model.max_len=64")
    tok = tokenization_of(task, tmp_path)
    trained = _training_framed(task, config)
    text = tok.decode(trained)
    ids = tok.encode(text)
    eos = getattr(tok, "eos_id", None)
    assert trained == ids + ([eos] if eos is not None else [])  # how training framed it
    params = nn.meta.unbox(task.init(jax.random.PRNGKey(0)))
    model = bert.Bert(task.model.config, head="encoder")
    wanted = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]

    def reference(framed):
        hidden, _ = model.apply({"params": {k: params[k] for k in wanted}},
                                jnp.array([framed], jnp.int32))
        pooled = np.asarray(hidden[0]).mean(0)
        return pooled / np.linalg.norm(pooled)
    np.testing.assert_allclose(task.embed(params, [text])[0], reference(trained),
                               rtol=1e-4, atol=1e-5)
    long = " ".join(DOCS)  # more than 16 tokens: cut where the training rows end
    framed = tok.encode(long)[:16 - (eos is not None)] + ([eos] if eos is not None else [])
    np.testing.assert_allclose(task.embed(params, [long])[0], reference(framed),
                               rtol=1e-4, atol=1e-5)


def tokenization_of(task, tmp_path):
    from attention_jax.data import load_tokenizer
    task.save_assets(str(tmp_path / "saved"))
    return load_tokenizer(str(tmp_path / "saved" / "tokenizer"))


def test_a_target_s_eos_is_trained_on_where_the_pad_token_is_the_eos_token():
    """A tokenizer file whose pad token is its end-of-text token (save_pretrained after
    tokenizer.pad_token = tokenizer.eos_token, GPT-2's usual setting) weighed every
    target's EOS 0, as padding, by its id: the model never learnt to stop, unsaid."""
    from attention_jax import data
    ex = data.seq2seq_example([7, 8], [5, 6], source_len=4, target_len=5, bos_id=0,
                              eos_id=0, pad_id=0)
    np.testing.assert_array_equal(ex["targets"], [5, 6, 0, 0, 0])
    np.testing.assert_array_equal(ex["target_weights"], [1, 1, 1, 0, 0])
    ex = data.seq2seq_example([7], [5, 6], source_len=4, target_len=3, bos_id=1, eos_id=2,
                              pad_id=0)  # a target that fills its row: all weigh 1
    np.testing.assert_array_equal(ex["target_weights"], [1, 1, 1])


def test_an_empty_sample_prompt_starts_from_the_token_that_ends_each_training_document():
    """An empty prompt started from the begin token, which no GPT document here holds
    (they are text <eos>): samples continued a token the model never read."""
    from attention_jax.data import tokenization
    from attention_jax.tasks.text import empty_prompt
    tok = tokenization.ByteTokenizer()
    assert tok.bos_id != tok.eos_id and empty_prompt(tok) == [tok.eos_id]

    class NoEnd:  # a tokenizer.json with a begin token only
        bos_id = 5
    assert empty_prompt(NoEnd()) == [5]
