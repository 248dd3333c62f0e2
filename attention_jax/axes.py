"""Logical axis names, defined once. Parameters and activations are annotated with these
(flax `nn.with_logical_partitioning` / `nn.with_logical_constraint`); a rules list in the
experiment config maps them onto mesh axes (`data`, `fsdp`, `sequence`, `tensor`), see sharding.py.
This module imports nothing so that every layer can use it.
"""

BATCH = "batch"  # B
LENGTH = "length"  # T or S (activations)
EMBED = "embed"  # D
HEADS = "heads"  # N
KV_HEADS = "kv_heads"  # K
HEAD_DIM = "head_dim"  # H
MLP = "mlp"  # F
VOCAB = "vocab"  # V
EXPERT = "expert"  # E
LAYERS = "layers"  # the stacked-layer axis of nn.scan
POSITION = "position"  # rows of a learned position table
NORM = "norm"  # scales and biases of norms (never sharded)
# Every logical name the models use: a mesh.rules entry naming another is a typo.
LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT, LAYERS,
                POSITION, NORM)

# Mesh axes (sharding.py maps the logical names above onto them; ring attention passes
# keys and values around SEQUENCE).
DATA = "data"  # batch split, parameters replicated
FSDP = "fsdp"  # batch and parameters split
SEQUENCE = "sequence"  # the length of activations split (ring attention)
TENSOR = "tensor"  # heads and MLP hidden units split
