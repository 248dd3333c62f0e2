r"""Language-model ablations the lectures argue, on the offline corpus (byte level).

Two studies on nanoGPT's CPU shape (4 layers, 4 heads, width 128), each a pair of runs
that differ in one field:

  study=position, variant=learned | rope
    Trained on rows of 64 tokens, evaluated on rows of 256: a learned position table has
    never trained rows 64-255 (they stay at their random initialisation), while RoPE
    (Su et al. 2021) encodes only relative offsets inside attention. The plot shows the
    validation loss at each position; the table the mean inside and beyond 64.
    (The GPT has no sinusoidal option; sinusoids live in models/encdec.py.)
  study=moe, variant=dense | moe
    Dense MLP of width 512 against a Switch-style mixture of 4 experts of width 512 with
    top-1 routing (Fedus et al. 2021): the same parameters active per token, 4x the MLP
    parameters in total. Same steps, batch and learning rate.

Command (2-core CPU):
  for v in learned rope; do
    python -m attention_jax.main --config=experiments/ablation_lm.py:study=position,variant=$v \
        --workdir=/tmp/abl/pos-$v; done
  python -m attention_jax.analysis positions --out=docs/results/positions --train_len=64 \
      --eval_len=256 learned=/tmp/abl/pos-learned rope=/tmp/abl/pos-rope
  for v in dense moe; do
    python -m attention_jax.main --config=experiments/ablation_lm.py:study=moe,variant=$v \
        --workdir=/tmp/abl/moe-$v; done
  python -m attention_jax.analysis runs --metric=loss --curves=loss \
      --out=docs/results/moe dense=/tmp/abl/moe-dense moe=/tmp/abl/moe-moe

Measured (2-core CPU): 1000 steps of batch 16 each, other jobs sharing the cores:
  position: learned 140 s, RoPE 179 s. Validation loss (trained on 64) at positions
    0-63 / 64-255 of 256-token rows: learned 1.94 / 3.50 (jumps at exactly 64), RoPE
    1.64 / 2.38 (flat to ~100, then rises gradually).
  moe: dense 164 s, validation loss 1.855; MoE (2.8x the parameters, same active ones)
    205 s, 1.871 including the 0.010 balance loss, 7.1% of tokens over capacity.
Plots and tables: docs/results.md ("Ablations").
"""

import ml_collections

from attention_jax import train

STUDIES = {"position": ("learned", "rope"), "moe": ("dense", "moe")}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = dict(kv.split("=", 1) for kv in arg.split(",")) if arg else {}
    study = args.get("study", "position")
    if study not in STUDIES:
        raise ValueError(f"experiments/ablation_lm.py: study={study!r} is unknown; "
                         f"valid: {sorted(STUDIES)}")
    variant = args.get("variant", STUDIES[study][0])
    if variant not in STUDIES[study]:
        raise ValueError(f"experiments/ablation_lm.py: variant={variant!r} is unknown for "
                         f"study={study}; valid: {STUDIES[study]}")
    c = train.base_config()
    c.task = "gpt"  # next-token prediction on packed documents (tasks.lm_task).

    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.embed_dim = 128  # D.
    c.model.mlp_dim = 512  # F = 4D, per expert in the MoE run.
    c.model.dropout_rate = 0.0
    c.model.use_bias = False
    c.model.remat_policy = "none"
    # A table 4x the training length: rows 64-255 exist (so the model can be evaluated
    # at 256) but are never trained. RoPE ignores max_len.
    c.model.max_len = 256
    c.model.position = variant if study == "position" else "learned"
    if study == "moe":
        c.model.mlp = "mlp" if variant == "dense" else "moe"
        c.model.num_experts = 4  # E.
        c.model.top_k = 1  # Switch routing: one expert's MLP per token = the dense MLP's cost.
        c.model.capacity_factor = 1.25  # Switch's default; overflow tokens skip the MLP.

    c.data.name = "python_stdlib"
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0
    c.data.max_documents = 0
    c.data.tokenizer = "byte"
    c.data.vocab_size = 1024  # unused by the byte tokenizer.
    c.data.seq_len = 64  # training length.
    c.data.train_split = "train"
    c.data.eval_split = "validation"

    c.optim.lr = 1e-3  # nanoGPT's shakespeare_char schedule (experiments/char_gpt.py).
    c.optim.warmup_steps = 100
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1

    c.train.steps = int(args.get("steps", 1000))
    c.train.batch_size = 16
    c.train.log_every = 50
    c.train.checkpoint_every = 500

    c.mesh.data = -1

    c.eval.every = 250
    c.eval.steps = 20
    c.eval.batch_size = 48
    return c
