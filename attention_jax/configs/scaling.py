r"""Scaling laws (Kaplan et al. 2020): validation loss against model size N on one token budget,
and loss against training compute C for each size (the compute-efficient envelope).

One shape rule for every size: L layers of width D = 48·L, head dim 48 (L heads), MLP 4D,
no biases, so the non-embedding parameters are N = 12·L·D² (Kaplan's count; embeddings,
position table and norms left out): L = 1..12 gives 27.6k, 221k, 746k, 1.77M, 3.46M, 5.97M,
9.48M, 14.2M, ... 27.6M (L = 10) and 47.8M (L = 12). Argument `layers=L` picks the size. Every size trains on the same token
budget (`steps`, default 200, of batch 16 × 64 bytes of the stdlib corpus, under one epoch, so the
training loss is an unbiased estimate of the held-out loss) with Kaplan's size-dependent
peak learning rate lr(N) ≈ 0.003239 − 0.0001395·ln N (their eq. D.1), 10% warmup and a
cosine decay to 10%.

The compute axis is C ≈ 6·N·tokens (forward and backward of the non-embedding weights;
Kaplan §2.1), read from each run's logged training loss; the envelope is the lowest loss
any size reached at each C.

Command (the sweep, then the fit, table and plots):
  for l in 1 2 3 4 5 6 7 8 10 12; do
    python -m attention_jax.main --config=scaling:layers=$l,steps=2000 --workdir=/tmp/scaling/l$l
  done
  python -m attention_jax.tools.analysis scaling --out=docs/results/scaling /tmp/scaling/l*

Measured (one NVIDIA H200, 2026-11-24, three runs at a time on the GPU): 23-63 s a size,
4.5 minutes for all ten. Validation loss falls from 1.974 (L = 1) to 1.253
nats/byte (L = 7, 9.5M), then rises to 1.292 at 47.8M: on a fixed 2M tokens the larger
models are far from converged. Over L = 1..7, L = (N_c/N)^α_N with α_N = 0.079 ± 0.007
(Kaplan: 0.076). The table, both fits and the compute envelope: the README's Results
("Scaling laws"). An earlier CPU sweep (L = 1..4, 200 steps) is in docs/results/scaling_cpu.*.
"""

import math

import ml_collections

from attention_jax import config as config_lib

LAYERS = tuple(range(1, 13))
WIDTH_PER_LAYER = 48  # D = 48·L: the aspect ratio D/L = 48 at every size.
HEAD_DIM = 48


def non_embedding_params(layers: int) -> int:
    """Kaplan's N = 12·L·D² (attention 4D², MLP 8D² per layer; no biases, norms, embeddings)."""
    d = WIDTH_PER_LAYER * layers
    return 12 * layers * d * d


def kaplan_lr(n: int) -> float:
    """Kaplan et al. 2020, eq. D.1: the learning rate that worked across their sizes."""
    return 0.003239 - 0.0001395 * math.log(n)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, {"layers": LAYERS}, layers=2, steps=200)
    layers = args.layers
    c = config_lib.base_config()
    c.task = "gpt"
    c.model.implementation = "auto"
    c.model.ring_inner = "auto"  # mesh.sequence > 1: the chunk pairs' kernel (attention.RING_INNER).
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".
    c.model.num_layers = layers
    c.model.d_model = WIDTH_PER_LAYER * layers
    c.model.num_heads = layers  # head dim 48 at every size.
    c.model.mlp_dim = 4 * c.model.d_model
    c.model.dropout_rate = 0.0  # under one epoch: nothing to regularise.
    c.model.use_bias = False
    c.model.remat_policy = "none"
    c.model.max_len = 64

    c.data.name = "python_stdlib"  # the standard library's source, offline; "files": yours.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: all files; a small number for smoke runs.
    c.data.max_documents = 0  # the first N documents of a split only; 0: every one.
    c.data.tokenizer = "byte"  # bytes: nothing to train; "bpe"; or a tokenizer.json path.
    c.data.vocab_size = 1024  # unused by the byte tokenizer.
    c.data.seq_len = 64  # tokens per packed row.
    c.data.packing = "documents"  # each document attends to itself; "stream": across (GPT-2).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.

    steps = args.steps
    c.optim.lr = kaplan_lr(non_embedding_params(layers))
    c.optim.warmup_steps = max(1, steps // 10)
    c.optim.schedule = "cosine"
    c.optim.end_lr_ratio = 0.1
    c.optim.b2 = 0.95
    c.optim.weight_decay = 0.1

    c.train.steps = steps  # :steps=, the same for every size (200: 200 × 16 × 64 = 205k tokens).
    c.train.batch_size = 16
    c.train.log_every = 10  # the compute sweep's points.
    c.train.checkpoint_every = steps

    c.mesh.data = -1

    c.eval.every = 0  # once, at the end: L(N).
    c.eval.steps = 20  # 20 × 48 rows of 64 bytes = 61k validation tokens.
    c.eval.batch_size = 48
    return c
