r"""Character-level GPT at nanoGPT's CPU recipe, and its "baby GPT", on the offline corpus.

nanoGPT (Karpathy) trains a character-level model on a laptop CPU with
  --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
  --lr_decay_iters=2000 --dropout=0.0
and on a GPU the "baby GPT" of 6 layers, 6 heads, width 384 and context 256. Here both
shapes train on the Python standard library's source (the offline corpus) with a
byte-level tokenizer: the corpus is ASCII source code, so bytes are its characters.
Learning rate schedule as nanoGPT's shakespeare_char config: 1e-3 peak, 100 warmup
steps, cosine to 1e-4, AdamW betas (0.9, 0.99), weight decay 0.1, clip 1.0.

Command (2-core CPU):
  python -m attention_jax.main --config=char_gpt --workdir=/tmp/char_gpt
  python -m attention_jax.main --config=char_gpt:size=baby \
      --workdir=/tmp/baby_gpt      # 6x384, context 256, batch 16: sized for ~15 minutes
Samples from a checkpoint:
  python -m attention_jax.main --config=char_gpt --workdir=/tmp/char_gpt \
      --mode=sample

Measured (2-core CPU): other jobs sharing the cores, the CPU recipe (0.8M parameters)
trains 2000 steps in 182 s wall (~9k tokens/s), validation loss 1.59 nats/char
(perplexity 4.9, next-character accuracy 57%); samples are Python-shaped words and
indentation ("import the prort ____(string path, oviders, execept."). The baby GPT
(10.8M parameters) on the idle machine: 600 steps in 1065 s wall (17.7 min with
compilation, evaluations and samples; ~2.5k tokens/s), validation loss 1.538 nats/char
(perplexity 4.65, accuracy 58.7%), samples with Python's layout and invented words
("self.from = None"). docs/results.md ("Character-level GPT").
"""

import ml_collections

from attention_jax import config as config_lib

# size -> (layers, heads, width, context, batch, steps). The baby GPT's batch and steps
# are cut from nanoGPT's 64 x 5000 (a GPU budget) to what 2 CPU cores do in ~15 minutes.
SIZES = {
    "cpu": (4, 4, 128, 64, 12, 2000),
    "baby": (6, 6, 384, 256, 16, 600),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, {"size": SIZES}, size="cpu", steps=0)  # steps 0: the size's.
    layers, heads, width, context, batch, steps = SIZES[args.size]
    c = config_lib.base_config()
    c.task = "gpt"  # next-token prediction on packed documents (tasks.lm_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).
    c.model.ring_inner = "auto"  # mesh.sequence > 1: the chunk pairs' kernel (attention.RING_INNER).

    c.model.num_layers = layers  # n_layer.
    c.model.num_heads = heads  # n_head.
    c.model.d_model = width  # n_embd.
    c.model.max_len = context  # block_size: rows of the learned position table.
    c.model.dropout_rate = 0.0  # nanoGPT's CPU recipe's (its baby GPT's is 0.2).
    c.model.use_bias = False  # nanoGPT's shakespeare_char default (bias=False).
    c.model.remat_policy = "none"
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".

    c.data.name = "python_stdlib"  # offline corpus: the standard library's own source.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: all files.
    c.data.max_documents = 0  # the first N documents of a split only; 0: every one.
    c.data.tokenizer = "byte"  # characters of ASCII source (nanoGPT's char model has 65).
    c.data.vocab_size = 1024  # unused by the byte tokenizer.
    c.data.seq_len = context  # block_size.
    # Each document attends to itself (nanoGPT's char model reads one stream: "stream").
    c.data.packing = "documents"
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.

    c.optim.lr = 1e-3  # learning_rate.
    c.optim.warmup_steps = 100  # warmup_iters.
    c.optim.schedule = "cosine"  # decay_lr, lr_decay_iters = max_iters.
    c.optim.end_lr_ratio = 0.1  # min_lr = 1e-4.
    c.optim.b2 = 0.99  # beta2 (small batches of tokens).
    c.optim.weight_decay = 0.1
    c.optim.clip_norm = 1.0

    c.train.steps = args.steps or steps  # max_iters.
    c.train.batch_size = batch  # batch_size.
    c.train.log_every = 50
    c.train.checkpoint_every = 500

    c.mesh.data = -1

    c.eval.every = 500  # nanoGPT's eval_interval for the small configs is 250-500.
    c.eval.steps = 20  # eval_iters.
    c.eval.batch_size = 48  # 4x nanoGPT's 12 rows per eval batch: a steadier estimate.
    c.eval.sample_prompts = config_lib.SHIPPED_PROMPTS["python_stdlib"]
    c.eval.sample_tokens = 200 if context >= 256 else 60
    return c
