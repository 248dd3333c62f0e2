"""experiments/bert_mlm.py: the default trains BERT's WordPiece vocabulary; a variant
argument gives that variant's shape (explicit model fields would override it)."""

import importlib.util
import os

from attention_jax import tasks, train
from attention_jax.models import bert

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    path = os.path.join(REPO, "experiments", "bert_mlm.py")
    spec = importlib.util.spec_from_file_location("bert_mlm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_uses_wordpiece_and_its_own_shape():
    c = load().get_config()
    train.validate_config(c)
    assert c.data.tokenizer == "wordpiece"
    assert c.model.max_positions >= c.data.seq_len
    cfg = tasks.model_config(bert.BertConfig, c, vocab_size=30528)
    assert (cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.mlp_dim) == (
        c.model.num_layers, c.model.num_heads, c.model.d_model, 4 * c.model.d_model)


def test_variant_argument_takes_the_variant_shape():
    c = load().get_config("variant=bert-mini")
    train.validate_config(c)
    cfg = tasks.model_config(bert.BertConfig, c, vocab_size=30528)
    mini = bert.VARIANTS["bert-mini"]
    assert (cfg.num_layers, cfg.num_heads, cfg.d_model, cfg.mlp_dim) == (
        mini["num_layers"], mini["num_heads"], mini["d_model"], mini["mlp_dim"])
    assert cfg.max_positions >= c.data.seq_len
