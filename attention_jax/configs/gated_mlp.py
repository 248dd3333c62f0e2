r"""Gated MLPs (Shazeer 2020, "GLU Variants Improve Transformer"): ReLU, GELU, SwiGLU and
GeGLU feed-forward layers in the same small GPT, at equal parameters, same steps.

Argument `mlp=relu|gelu|swiglu|geglu` (it sets both model.mlp and model.activation, a gated
MLP's to its gate's; an override `--config.model.mlp=mlp` alone keeps that activation, silu
with the default swiglu; `--config.model.mlp=glu` gates with model.activation, e.g. relu:
ReGLU). A 2-layer GPT of width
D = 48 (2 heads of 24) on the byte-level stdlib corpus; the plain MLPs have hidden F = 4D = 192 (two matrices,
2·D·F = 18,432 weights a layer), the gated ones F = 8D/3 = 128 (three matrices, 3·D·F =
18,432): exactly the same parameter count, as in Shazeer's Table 1. (Small because the
2-core CPU was shared five ways when this ran: 12 runs had to fit in ~15 minutes.) No biases (Shazeer's
setting). 200 steps of batch 16 × 64 bytes, lr 2e-3, cosine; the seed
(`--config.train.seed`) sets the initialisation and the data order.

Arguments `layers`, `d_model` and `heads` set the size (defaults 2, 48, 2: the CPU run);
`d_model` must be a multiple of 3 so that 8D/3 is whole. `steps` and `eval_steps` set the
training and evaluation lengths.

One run: python -m attention_jax.main --config=gated_mlp:mlp=swiglu --workdir=/tmp/gated/swiglu
Command (2-core CPU; 4 variants × 3 seeds, then the table with the spread across seeds):
  python -m attention_jax.tools.sweep --config=gated_mlp \
      --workdir=/tmp/gated --grid=train.seed=0,1,2 --grid=mlp=relu,gelu,swiglu,geglu
  python -m attention_jax.tools.analysis seeds --out=docs/results/gated_mlp_cpu --by=mlp /tmp/gated/*
The GPU run (4 layers of width 384, 2000 steps; the README's Results):
  --config=gated_mlp:layers=4,d_model=384,heads=6,steps=2000,eval_steps=100

Measured (2-core CPU): shared five ways, 12 runs in 20 minutes wall, 64-430 s each (the
first run of each MLP compiles). Validation loss, mean ± std over 3 seeds: ReLU 2.6965 ±
0.0110, GELU 2.6934 ± 0.0153, SwiGLU 2.6907 ± 0.0350, GeGLU 2.6921 ± 0.0246: Shazeer's
order, but inside the seed spread. Measured (one NVIDIA H200, the GPU run): ReLU 1.727 ±
0.135, GELU 1.718 ± 0.092, SwiGLU 1.470 ± 0.071, GeGLU 1.515 ± 0.035; every gated run below
every plain one. Table and plot: the README's Results ("Gated MLPs").
"""

import ml_collections

from attention_jax import config as config_lib

VARIANTS = {  # mlp=... -> (config.model.mlp, config.model.activation)
    "relu": ("mlp", "relu"),
    "gelu": ("mlp", "gelu"),
    "swiglu": ("swiglu", "silu"),  # a gated MLP's activation is its gate's
    "geglu": ("geglu", "gelu"),
}
D_MODEL = 48


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, {"mlp": VARIANTS}, mlp="swiglu", steps=200, layers=2,
                                d_model=D_MODEL, heads=2, eval_steps=20)
    name, d = args.mlp, args.d_model
    if d % 3 or d % args.heads:
        raise config_lib.ConfigError(
            f":d_model={d} must be a multiple of 3 (8D/3 whole, for equal parameters) and of "
            f":heads={args.heads}; valid: e.g. 48, 96, 192, 384")
    c = config_lib.base_config()
    c.task = "gpt"
    c.model.implementation = "auto"
    c.model.ring_inner = "auto"  # mesh.sequence > 1: the chunk pairs' kernel (attention.RING_INNER).
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".
    c.model.num_layers = args.layers
    c.model.num_heads = args.heads
    c.model.d_model = d
    c.model.mlp, c.model.activation = VARIANTS[name]
    gated = c.model.mlp != "mlp"
    c.model.mlp_dim = 8 * d // 3 if gated else 4 * d  # equal params (D=48: 128 | 192).
    c.model.dropout_rate = 0.0
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

    c.optim.lr = 2e-3
    c.optim.warmup_steps = 20
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1

    c.train.steps = args.steps
    c.train.batch_size = 16
    c.train.log_every = 25
    c.train.checkpoint_every = c.train.steps

    c.mesh.data = -1

    c.eval.every = 0  # once, at the end.
    c.eval.steps = args.eval_steps  # × 48 rows of 64 bytes, the same rows for every run.
    c.eval.batch_size = 48
    return c
