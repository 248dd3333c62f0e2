"""Model FLOPs of a training step, the PaLM convention (Chowdhery et al. 2022, App. B).

Per token of a Transformer that reads T tokens per sequence:

    6·N + 12·L·T·D

N: the parameters that take part in a matmul per token (`matmul_params`): all but the
position (and BERT's token-type) tables; a tied embedding counts once, for the output
projection; of a mixture-of-experts layer's experts, the top_k a token is routed to
(the "active parameters" convention: Switch, Mixtral), its router in full. 6 = 2 (a
multiply-add) × 3 (the forward matmul and two backward ones, for the input's and the
weight's gradients). 12·L·T·D: the two attention matmuls QKᵀ and AV, 2·2·T·D
per token and layer forward, ×3 with the backward; counted in full for causal models too, as
PaLM does. "Model" FLOPs: what the model needs, not what the hardware did (activation
recomputation is not counted), so MFU = model FLOP/s ÷ peak compares implementations fairly.

One formula (`flops_per_token`) for every caller: the tasks (Task.flops_per_unit), the
scaling report (tools/fits.py) and the benchmarks (tools/bench).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import flax.linen as nn
import jax
import numpy as np

from attention_jax.errors import is_int
from attention_jax.layers.moe import EXPERT_PARAMS

__all__ = ["PER_PARAM", "matmul_params", "attention_flops_per_token", "flops_per_token",
           "conv_flops_per_example"]

PER_PARAM = 6  # FLOPs per parameter and token: 2 (multiply-add) × 3 (forward + 2 backward)
# Tables that are looked up, not multiplied: a position's row is added to the token's.
LOOKUP_TABLES = ("position", "token_type")


def _leaves(params):
    """(lower-case "a/b/c" path, shape) of every leaf of a params tree (arrays, shapes or
    flax's logical-axis boxes)."""
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(params))[0]
    for path, leaf in flat:
        yield "/".join(str(getattr(k, "key", k)) for k in path).lower(), tuple(np.shape(leaf))


def matmul_params(params, skip: Sequence[str] = LOOKUP_TABLES,
                  experts_per_token: Optional[tuple[int, int]] = None) -> int:
    """N of the formula: parameters of `params` (arrays or their shapes) whose path names
    none of `skip` (default: position and token-type tables). Pass "token_embedding" too
    for a GPT with an untied output head: its input table is then only looked up.

    experts_per_token: (top_k, num_experts) of the model's mixture-of-experts layers
    (layers/moe.py): each expert's weights and biases (EXPERT_PARAMS) count top_k /
    num_experts of their size, the experts a token is routed to (the active parameters;
    the router counts in full). A model FLOPs count: the capacity's empty slots and the
    dropped assignments change what the hardware does, not this. None: every parameter
    counts in full (a parameter count; for an MoE, every expert for every token)."""
    if experts_per_token is not None:
        top_k, num_experts = experts_per_token
        if not (is_int(top_k) and is_int(num_experts) and 1 <= top_k <= num_experts):
            raise ValueError(f"experts_per_token={experts_per_token!r}; valid: (top_k, "
                             f"num_experts) with 1 <= top_k <= num_experts")
    total = 0
    for name, shape in _leaves(params):
        if any(s in name for s in skip):
            continue
        size = int(np.prod(shape, dtype=np.int64))
        if experts_per_token is not None and name.rsplit("/", 1)[-1] in EXPERT_PARAMS:
            size = size * top_k // num_experts  # (exact: E divides an expert leaf's size)
        total += size
    return total


def attention_flops_per_token(num_layers: int, key_len: int, d_model: int) -> float:
    """12·L·S·D: QKᵀ and AV of one query token against S keys in each of L layers,
    forward and backward (D = heads × head dim)."""
    return 12.0 * num_layers * key_len * d_model


def flops_per_token(matmul_params: int, num_layers: int, seq_len: int, d_model: int) -> float:
    """Model FLOPs of a training step per token: 6·N + 12·L·T·D (PaLM, App. B).

    matmul_params: N (see `matmul_params`; e.g. GPT-2's V·D + L·(12·D² + 13·D) + 2·D;
    for a mixture of experts, the active parameters: top_k of the E experts per token);
    num_layers: L; seq_len: T, the tokens each attends over (a ViT image: patches, + 1
    with [CLS]); d_model: D. A step's FLOPs: this × tokens per step.
    """
    return PER_PARAM * float(matmul_params) + attention_flops_per_token(num_layers, seq_len,
                                                                         d_model)


def conv_flops_per_example(params, positions: int) -> float:
    """The same convention for a convolutional network with stride-1 'SAME' convolutions:
    6 × (each convolution kernel [kh, kw, C_in, C_out] × the `positions` (H·W) it is
    applied at + each other weight matrix once). Norm scales and biases are left out:
    they take part in no matmul, and at one per channel they are a vanishing share."""
    total = 0
    for name, shape in _leaves(params):
        if name.endswith("kernel"):
            total += int(np.prod(shape)) * (positions if len(shape) == 4 else 1)
    return PER_PARAM * float(total)
