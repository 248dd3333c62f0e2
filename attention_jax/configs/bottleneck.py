r"""The bottleneck and attention (Bahdanau et al. 2015): translation quality by input length.

The lectures' first argument: an RNN encoder-decoder that squeezes the source into one
vector (Cho et al. 2014) loses long inputs; letting the decoder attend over all encoder
states (Bahdanau et al.) does not, and neither does the Transformer (Vaswani et al.
2017), which is attention only. Three models on the same data (English -> French number
words, 20k training pairs, sources of 1-30 BPE tokens), same steps and batch:

  model=rnn-bottleneck   bidirectional GRU encoder, decoder sees one summary vector
  model=rnn-attention    the same GRUs with Bahdanau (additive) attention
  model=transformer      encoder-decoder Transformer, 2 + 2 layers, width 64

Command (2-core CPU; one line per model, then the bucketed evaluation on the test split):
  for m in rnn-bottleneck rnn-attention transformer; do
    python -m attention_jax.main --config=bottleneck:model=$m \
        --workdir=/tmp/bottleneck/$m; done
  python -m attention_jax.tools.analysis translation --out=docs/results/bottleneck \
      rnn-bottleneck=/tmp/bottleneck/rnn-bottleneck \
      rnn-attention=/tmp/bottleneck/rnn-attention transformer=/tmp/bottleneck/transformer

Measured (2-core CPU): other jobs sharing the cores, 1500 steps each in 140 s
(rnn-bottleneck), 192 s (rnn-attention), 144 s (transformer); the evaluation 11 s.
Exact match on the 1000 test pairs by source length (BPE tokens 1-8 / 9-16 / 17-24 /
25-32): rnn-bottleneck 100 / 99.1 / 95.0 / 83.4% (BLEU 100 / 99.5 / 98.3 / 95.9),
rnn-attention 100% in every bucket, transformer 96.9 / 99.7 / 99.5 / 99.5% (BLEU
98.8-99.9): only the single-vector model degrades with length. Table and plot:
docs/results.md ("The bottleneck and attention").
"""

import ml_collections

from attention_jax import config as config_lib

MODELS = ("rnn-bottleneck", "rnn-attention", "transformer")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = config_lib.parse_arg(arg, {"model": MODELS}, model="rnn-attention", steps=1500)
    model = args.model
    c = config_lib.base_config()

    if model.startswith("rnn"):
        c.task = "rnn_seq2seq"  # teacher-forced translation (tasks.translation_task).
        # models/rnn.py VARIANTS: 'tiny' has attention, 'tiny-bottleneck' does not.
        c.model.variant = {"rnn-attention": "tiny", "rnn-bottleneck": "tiny-bottleneck"}[model]
        c.model.embed_dim = 64  # m.
        c.model.hidden_dim = 128  # n, per encoder direction (the bottleneck is 2n = 256 wide).
        c.model.attention_dim = 64  # n', alignment MLP.
        c.model.readout_dim = 64  # l, maxout readout.
        c.model.cell = "gru"
        c.optim.lr = 3e-3  # measured stable for both RNNs (configs/rnn_seq2seq.py).
        c.optim.b2 = 0.999
        c.optim.weight_decay = 0.0  # none for the RNNs (as Bahdanau et al.).
    else:
        c.task = "encdec"
        c.model.implementation = "auto"  # attention backend (attention_jax.attention.IMPLEMENTATIONS).
        c.model.variant = "transformer-tiny"  # models/encdec.py VARIANTS.
        c.model.d_model = 64
        c.model.num_heads = 4
        c.model.mlp_dim = 256  # d_ff = 4 d_model.
        c.model.num_encoder_layers = 2
        c.model.num_decoder_layers = 2
        c.model.dropout_rate = 0.0  # like the RNNs: no regularisation, one pass of settings.
        c.model.norm_position = "post"  # the paper's Add & Norm.
        c.optim.lr = 2e-3  # measured (configs/encdec.py).
        c.optim.b2 = 0.98  # Vaswani §5.3.
        c.optim.eps = 1e-9
        c.optim.weight_decay = 0.0
    c.optim.warmup_steps = 100

    c.data.name = "number_translation"  # 20k/1k/1k pairs, integers below 10^12 (long inputs).
    c.data.data_dir = ""  # tfds data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    c.data.source = "en"  # the source language: the key of a record holding it.
    c.data.target = "fr"  # fr | de (German reorders: 'einundzwanzig').
    c.data.tokenizer = "bpe"  # one byte-level BPE vocabulary for both languages.
    c.data.vocab_size = 512  # size of the BPE vocabulary trained on the train split.
    c.data.source_len = 40  # the longest English source is 30 BPE tokens: nothing is cut.
    c.data.target_len = 40  # the longest French target, 35 tokens + EOS (measured).
    c.data.train_split = "train"  # the split trained on.
    c.data.eval_split = "validation"  # the split evaluated (files: the held-out records).
    c.data.cache_dir = ""  # the records cache (data/records_cache.py); "" = DATA_DIR/token_cache.

    c.train.steps = args.steps  # :steps= (1500: ~2.4 epochs of 20k pairs at batch 32).
    c.train.batch_size = 32
    c.train.log_every = 50
    c.train.checkpoint_every = 500

    c.mesh.data = -1

    c.eval.every = 500  # teacher-forced token accuracy; the bucketed greedy eval is analysis.py.
    c.eval.steps = 0  # the whole validation split (1k pairs).
    c.eval.batch_size = 40
    # Source sentences --mode=sample translates (greedy), and the run at its end.
    c.eval.sample_prompts = config_lib.SHIPPED_PROMPTS["number_translation"]
    return c
