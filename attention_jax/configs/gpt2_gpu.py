r"""GPT-2 small (124M) on one GPU: the GPT-2 shape, bfloat16 compute, the byte-level
Python-stdlib corpus.

Command (one NVIDIA GPU; a step is 14 TFLOP, minutes on a laptop CPU):
  python -m attention_jax.main --config=gpt2_gpu --workdir=/tmp/gpt2_gpu
Its tokens/s and MFU side by side with the bare step and a PyTorch peer:
  python -m attention_jax.tools.bench train --device gpu --shapes gpt2-124m:16

The model is GPT-2 small exactly (12 layers, 12 heads, width 768, T = 1024, learned
positions, tied LM head) with GPT-2's padded vocabulary of 50304 rows, so the step has
GPT-2's FLOPs: 6·N + 12·L·T·D = 0.86 GFLOP per token. The tokens are bytes (the
corpus ships with Python, nothing is downloaded), so only 259 rows of the head are ever
targets. Float32 parameters and AdamW state; matmuls in bfloat16 with float32
accumulation (`train.compute_dtype`); LayerNorm statistics, softmax and the loss in
float32. Attention "auto": the Pallas kernels reading the q, k, v projection in place, for
documents packed into a row (segment ids go to the kernel, no dense mask) and, at this
head size and length, for plain causal rows too (faster than cuDNN's kernel with its
slicing counted; attention/pallas.py, packed_auto_reason).
`--config.data.packing=stream` trains as GPT-2 and nanoGPT do instead: a row is one
causal stream across documents, plain causal attention, the bare step's inputs.

Measured (H100 80GB HBM3, 2026-11-23): the bare step at this shape and batch 34.6 ms
(`bench train --device gpu --shapes gpt2-124m`), 473k tokens/s, MFU 40.9% of the 989
TFLOP/s peak, 1.04× the PyTorch peer (torch.compile, SDPA, fused AdamW: 35.9 ms); at
batch 32 67.3 ms, 42.1%, 1.01×. This config itself (the trainer's own logged tokens/s,
median of its windows after the first): 363k tokens/s at batch 16 (45.1 ms a step, 0.77
of the bare step), 402k at batch 32. The 5000-step run has not been made: a 120-step run
of this command (`--config.train.steps=120 --config.optim.warmup_steps=10`) logged a
mean training loss of 2.48 nats per byte over steps 101-120, 98 s for the whole command
(the corpus built, compiled, trained, checkpointed). On an H200 (2026-11-24,
`bench train --packing documents,stream`) the host cost nothing (main.py at 0.99-1.00 of
the trainer's own step) and the trainer step ran at 0.79 (documents) / 0.85 (stream) of
the bare step. On an H100 (2026-11-24, same command, after the loss got float32
parameters, one batch transfer a step and the Pallas kernels' packed-document ranges):
bare step 34.3 ms; the trainer's step 36.4 ms with packed documents (0.94 of bare),
34.9 ms with stream rows (0.98); main.py 36.5 / 35.5 ms (0.98-1.00 of its step). A
checkpoint save's first call held training 6-7 s there (where its device programs
compiled; they now compile ahead, `Checkpointer.prepare`, unmeasured on a GPU); later
ones 27-35 ms, their window still losing 0.4-0.5 s (docs/gpu_speed.md).
Config keys to try there:
`train.batch_size=32`, `train.loss_chunk_size`, `train.loss_kernel=xla` (auto takes the
Pallas loss kernels on a GPU since 2026-11-26, unmeasured there), `train.data_workers`,
`model.remat_policy`.
"""

import ml_collections

from attention_jax import config as config_lib


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    del arg
    c = config_lib.base_config()
    c.task = "gpt"  # next-token prediction on packed documents (tasks.lm_task).
    c.model.num_layers = 12  # GPT-2 small (models/gpt.py VARIANTS["gpt2"]).
    c.model.d_model = 768
    c.model.num_heads = 12
    c.model.vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT.
    c.model.max_len = 1024
    c.model.dropout_rate = 0.0  # a short run on a large corpus: no regularisation.
    c.model.implementation = "auto"  # the Pallas kernels here, or cuDNN (attention/__init__.py).
    c.model.ring_inner = "auto"  # mesh.sequence > 1: the chunk pairs' kernel (attention.RING_INNER).
    c.model.remat_policy = "none"  # 124M at batch 16 fits in 80 GB without recomputation.
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".

    c.data.name = "python_stdlib"  # the standard library's source, offline; "files": yours.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: the whole standard library (a small number for a smoke run).
    c.data.tokenizer = "byte"  # bytes: nothing to train; "bpe"; or a tokenizer.json path.
    c.data.seq_len = 1024  # tokens per packed row (GPT-2's context).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.
    # "documents": each packed document sees only itself (segment ids). "stream": one
    # causal stream across documents, as GPT-2 and nanoGPT train (the bare step's inputs).
    c.data.packing = "documents"

    c.optim.lr = 6e-4  # GPT-2 small's peak lr (GPT-3 paper, Table 2.1), cosine decay.
    c.optim.warmup_steps = 200
    c.optim.weight_decay = 0.1

    c.train.compute_dtype = "bfloat16"
    c.train.steps = 5000  # 82M tokens.
    c.train.batch_size = 16  # 16k tokens a step.
    c.train.log_every = 50  # the host waits for the GPU only at these steps (and checkpoints).
    c.train.checkpoint_every = 1000
    c.train.prefetch = 2  # batches sent to the GPU ahead of their step.

    c.mesh.data = -1

    c.eval.every = 1000
    c.eval.steps = 20
    c.eval.batch_size = 16
    c.eval.sample_prompts = config_lib.SHIPPED_PROMPTS["python_stdlib"]
    return c
