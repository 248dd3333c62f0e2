r"""Language-model ablations the lectures argue, on the offline corpus (byte level).

Four studies, each a set of runs that differ in one field, on nanoGPT's CPU shape
(4 layers, 4 heads, width 128) unless said otherwise; 1000 steps of batch 16 on rows of
64 tokens, learning rate 1e-3, for all:

  study=position, variant=learned | rope | sinusoidal
    Trained on rows of 64 tokens, evaluated on rows of 256: a learned position table has
    never trained rows 64-255 (they stay at their random initialisation), while RoPE
    (Su et al. 2021) encodes only relative offsets inside attention, and the fixed
    sinusoids of Vaswani et al. (2017, §3.5) are defined at every position but were
    only seen at 0-63. The plot shows the validation loss at each position; the table
    the mean inside and beyond 64.
  study=moe, variant=dense | moe
    Dense MLP of width 512 against a Switch-style mixture of 4 experts of width 512 with
    top-1 routing (Fedus et al. 2021): the same parameters active per token, 4x the MLP
    parameters in total. Same steps, batch and learning rate.
  study=scale, variant=scaled-h32 | unscaled-h32 | scaled-h128 | unscaled-h128
    Attention logits q·k/sqrt(H) (Vaswani et al. 2017, §3.2.1) against q·k
    (attention_scale=1.0), at head dim H = 32 (4 heads) and H = 128 (1 head) of the
    same width: with unit-variance q and k the unscaled logits have std sqrt(H), which
    saturates the softmax (near one-hot rows, vanishing gradients), more so at larger H.
    `python -m attention_jax.tools.analysis attention` (below) measures the attention rows' entropy
    and largest weight at initialisation and after training.
  study=norm, variant=pre | post
    Pre-norm x + f(LN(x)) (GPT-2) against post-norm LN(x + f(x)) (GPT-1, Vaswani et
    al.) at depth: 24 layers of width 64 (4 heads, MLP 256), same learning rate. Two
    controls by override: the pair at lr 3e-4 (is it the learning rate?) and at 4
    layers (is it the depth?).

Command (2-core CPU):
  for v in learned rope sinusoidal; do
    python -m attention_jax.main --config=ablation_lm:study=position,variant=$v \
        --workdir=/tmp/abl/pos-$v; done
  python -m attention_jax.tools.analysis positions --out=docs/results/positions --train_len=64 \
      --eval_len=256 learned=/tmp/abl/pos-learned rope=/tmp/abl/pos-rope \
      sinusoidal=/tmp/abl/pos-sinusoidal
  for v in dense moe; do
    python -m attention_jax.main --config=ablation_lm:study=moe,variant=$v \
        --workdir=/tmp/abl/moe-$v; done
  python -m attention_jax.tools.analysis runs --metric=loss --curves=loss \
      --out=docs/results/moe dense=/tmp/abl/moe-dense moe=/tmp/abl/moe-moe
  for v in scaled-h32 unscaled-h32 scaled-h128 unscaled-h128; do
    python -m attention_jax.main --config=ablation_lm:study=scale,variant=$v \
        --workdir=/tmp/abl/scale-$v; done
  python -m attention_jax.tools.analysis runs --metric=loss --curves=loss --out=docs/results/scale \
      scaled-h32=/tmp/abl/scale-scaled-h32 unscaled-h32=/tmp/abl/scale-unscaled-h32 \
      scaled-h128=/tmp/abl/scale-scaled-h128 unscaled-h128=/tmp/abl/scale-unscaled-h128
  python -m attention_jax.tools.analysis attention --out=docs/results/scale_attention \
      scaled-h32=/tmp/abl/scale-scaled-h32 unscaled-h32=/tmp/abl/scale-unscaled-h32 \
      scaled-h128=/tmp/abl/scale-scaled-h128 unscaled-h128=/tmp/abl/scale-unscaled-h128
  for v in pre post; do
    python -m attention_jax.main --config=ablation_lm:study=norm,variant=$v \
        --workdir=/tmp/abl/norm-$v
    python -m attention_jax.main --config=ablation_lm:study=norm,variant=$v \
        --config.optim.lr=3e-4 --workdir=/tmp/abl/norm-$v-lr3e-4
    python -m attention_jax.main --config=ablation_lm:study=norm,variant=$v \
        --config.model.num_layers=4 --workdir=/tmp/abl/norm-$v-l4; done
  python -m attention_jax.tools.analysis runs --metric=loss --curves=loss --out=docs/results/norm \
      pre=/tmp/abl/norm-pre post=/tmp/abl/norm-post \
      pre-lr3e-4=/tmp/abl/norm-pre-lr3e-4 post-lr3e-4=/tmp/abl/norm-post-lr3e-4 \
      pre-4layers=/tmp/abl/norm-pre-l4 post-4layers=/tmp/abl/norm-post-l4

Measured (2-core CPU): 1000 steps of batch 16 each, other jobs sharing the cores (so
wall times vary by +-30% between otherwise equal runs):
  position: learned 140 s, RoPE 179 s, sinusoidal 97 s. Validation loss (trained on
    64) at positions 0-63 / 64-255 of 256-token rows: learned 1.94 / 3.50 (jumps at
    exactly 64), RoPE 1.64 / 2.38 (flat to ~100, then rises gradually), sinusoidal
    1.81 / 3.39 (between the two inside; climbs to ~3.4 by position 75).
  moe: dense 164 s, validation loss 1.855; MoE (2.8x the parameters, same active ones)
    205 s, 1.871 including the 0.010 balance loss, 7.1% of tokens over capacity.
  scale: 73-106 s each; validation loss scaled / unscaled: H=32 1.855 / 2.099, H=128
    1.896 / 2.330. Largest attention weight at init, scaled / unscaled: H=32 0.16 /
    0.70, H=128 0.16 / 0.76; after training unscaled H=128 is one-hot (0.97, entropy
    0.06 nats against 1.67 scaled). `python -m attention_jax.tools.analysis attention ...`: 42 s.
  norm, 24 layers: pre 224 s, 2.178; post 161 s, 3.114 (stalls at the unigram loss
    3.16 from step ~200 on; no NaN). lr 3e-4: pre 2.464, post 3.117 (246 s each). At
    4 layers post-norm trains, and better: pre 2.174, post 2.046 (about 60 s each).
Plots and tables: docs/results.md ("Ablations").
"""

import ml_collections

from attention_jax import config as config_lib

STUDIES = {
    "position": ("learned", "rope", "sinusoidal"),
    "moe": ("dense", "moe"),
    "scale": ("scaled-h32", "unscaled-h32", "scaled-h128", "unscaled-h128"),
    "norm": ("pre", "post"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # variant "": the study's first (its baseline).
    args = config_lib.parse_arg(arg, {"study": STUDIES}, study="position", variant="", steps=1000)
    study, variant = args.study, args.variant or STUDIES[args.study][0]
    config_lib.check_choice(f":variant (study={study})", variant, STUDIES[study])
    c = config_lib.base_config()
    c.task = "gpt"  # next-token prediction on packed documents (tasks.lm_task).
    c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).
    c.model.ring_inner = "auto"  # mesh.sequence > 1: the chunk pairs' kernel (attention.RING_INNER).
    c.model.norm_kernel = "auto"  # residual add + norm: one Pallas kernel each way on a GPU, or "xla".

    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.d_model = 128  # D.
    c.model.mlp_dim = 512  # F = 4D, per expert in the MoE run.
    c.model.dropout_rate = 0.0
    c.model.use_bias = False
    c.model.remat_policy = "none"
    # A table 4x the training length: rows 64-255 exist (so the model can be evaluated
    # at 256) but are never trained. RoPE and sinusoids ignore max_len.
    c.model.max_len = 256
    c.model.position = variant if study == "position" else "learned"
    c.model.norm_position = "pre"  # GPT-2; "post" (GPT-1, Vaswani et al.) in study=norm.
    c.model.attention_scale = None  # None: 1/sqrt(H); 1.0: unscaled logits (study=scale).
    if study == "moe":
        c.model.mlp = "mlp" if variant == "dense" else "moe"
        if variant != "dense":  # (a dense MLP has no experts: the keys would be a note)
            c.model.num_experts = 4  # E.
            c.model.top_k = 1  # Switch routing: one expert's MLP per token = the dense cost.
            c.model.capacity_factor = 1.25  # Switch's default; overflow tokens skip the MLP.
    if study == "scale":
        scaling, head_dim = variant.split("-h")
        c.model.num_heads = c.model.d_model // int(head_dim)  # H = 32: 4 heads; 128: 1.
        c.model.attention_scale = None if scaling == "scaled" else 1.0
    if study == "norm":
        # Deep and narrow: depth is what the two placements differ on (Xiong et al. 2020),
        # at about twice the 4x128 model's CPU time.
        c.model.num_layers = 24
        c.model.d_model = 64
        c.model.mlp_dim = 256
        c.model.norm_position = variant

    c.data.name = "python_stdlib"  # the standard library's source, offline; "files": yours.
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.max_files = 0  # 0: all files; a small number for smoke runs.
    c.data.max_documents = 0  # the first N documents of a split only; 0: every one.
    c.data.tokenizer = "byte"  # bytes: nothing to train; "bpe"; or a tokenizer.json path.
    c.data.vocab_size = 1024  # unused by the byte tokenizer.
    c.data.seq_len = 64  # training length.
    c.data.packing = "documents"  # each document attends to itself; "stream": across (GPT-2).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    config_lib.add_text_file_keys(c.data)  # data.name="files": your own text files.

    c.optim.lr = 1e-3  # nanoGPT's shakespeare_char schedule (configs/char_gpt.py).
    c.optim.warmup_steps = 100
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1

    c.train.steps = args.steps
    c.train.batch_size = 16
    c.train.log_every = 50
    c.train.checkpoint_every = 500

    c.mesh.data = -1

    c.eval.every = 250
    c.eval.steps = 20
    c.eval.batch_size = 48
    return c
