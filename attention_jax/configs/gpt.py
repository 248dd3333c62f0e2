r"""GPT on the offline Python-stdlib corpus (byte-level): next-token prediction.

Command (2-core CPU, default sizes):
  python -m attention_jax.main --config=gpt --workdir=/tmp/gpt
Variants: `--config=gpt:variant=gpt-tiny-rope` (any name of models/gpt.py's
VARIANTS, in its own shape: `:variant=gpt2` is GPT-2 small's 12 layers of width 768;
`gpt-tiny-moe` logs router load, entropy and dropped tokens). `--config.model.variant=X`
instead keeps the fields this config sets (2 layers, width 128, 4 heads). The
architecture's keys are the variant's unless given: `--config.model.position=rope
--config.model.norm=rmsnorm --config.model.mlp=swiglu --config.model.use_bias=False`.
Then: `--mode=sample` prints continuations of `eval.sample_prompts` from the checkpoint.

Measured (2-core CPU): 600 steps in 6.9 min wall (with other jobs sharing
the 2 cores; ~10k tokens/s), validation loss 1.81 nats/byte (perplexity 6.1), next-byte
accuracy 52%; samples are Python-looking words and indentation.
"""

import ml_collections

from attention_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, variant="gpt-tiny")
    c = config_lib.base_config()
    c.task = "gpt"  # next-token prediction on packed documents (tasks.lm_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).
    # With mesh.sequence > 1 (ring attention): the kernel on each chunk pair, "auto" or
    # one of attention.RING_INNER ("pallas", "splash", "blockwise").
    c.model.ring_inner = "auto"
    # A block's residual add and the norm after it: "auto" (one Pallas kernel each way on
    # NVIDIA GPUs, layers/norm_kernel.py), "xla" or "pallas" (layers/norms.py NORM_KERNELS).
    c.model.norm_kernel = "auto"

    c.model.variant = args.variant  # a row of models/gpt.py VARIANTS.
    # Explicit fields override a variant's: this config's own small model (0.4M
    # parameters, the figures above) only for the default; another variant keeps its
    # shape (None: the variant's value).
    own = args.variant == "gpt-tiny"
    c.model.num_layers = 2 if own else None
    c.model.d_model = 128 if own else None  # D.
    c.model.num_heads = 4 if own else None  # N (head dim 32).
    c.model.max_len = 128  # rows of the learned position table.
    c.model.mlp_dim = None  # F, the MLP's hidden width; None: the variant's, else 4D.
    # mlp="moe" (gpt-tiny-moe): experts, experts per token, capacity; None: the variant's.
    c.model.num_experts = None
    c.model.top_k = None
    c.model.capacity_factor = None
    c.model.dropout_rate = 0.0  # none: this config's own small model and short run need none.
    # The architecture, settable from the command line; None: the variant's (gpt-tiny's:
    # GPT-2's choices, models/gpt.py GPTConfig), e.g. --config.model.position=rope
    # --config.model.norm=rmsnorm --config.model.mlp=swiglu --config.model.use_bias=False.
    for field in config_lib.GPT_ARCHITECTURE_KEYS:
        c.model[field] = None
    c.model.remat_policy = "none"  # activation checkpointing per block (see layers/blocks.py).

    c.data.name = "python_stdlib"  # offline corpus: the standard library's own source.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: all files; a small number for smoke runs.
    c.data.max_documents = 0  # the first N documents of a split only; 0: every one.
    c.data.tokenizer = "byte"  # bytes: nothing to train; "bpe"; or a tokenizer.json path.
    c.data.vocab_size = 1024  # only for tokenizer="bpe" (trained on the train split).
    c.data.seq_len = 128  # tokens per packed row.
    # "documents": a packed document attends only to itself, positions restart;
    # "stream": one causal stream across documents, as GPT-2 and nanoGPT train.
    c.data.packing = "documents"
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.

    # Chosen for this config's own 0.4M-parameter model, which tolerates a large step (a
    # larger :variant= may want a smaller one).
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 50
    c.optim.weight_decay = 0.1  # GPT-2's and nanoGPT's value.

    c.train.steps = 600  # the own model's took 6.9 min on 2 shared CPU cores (docstring).
    c.train.batch_size = 32  # 4k tokens per step.
    c.train.log_every = 20
    c.train.checkpoint_every = 200

    c.mesh.data = -1  # all devices data-parallel by default.

    c.eval.every = 200  # validation loss / perplexity.
    c.eval.steps = 8
    c.eval.batch_size = 32
    c.eval.sample_prompts = config_lib.SHIPPED_PROMPTS["python_stdlib"]
    return c
