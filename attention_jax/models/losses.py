"""The losses every model family trains with, in float32 whatever the compute dtype.

    loss, metrics = cross_entropy(logits, targets, weights, label_smoothing=0.1)
    tgt_in = shift_right(targets, bos_id)   # teacher forcing (data/objectives.py)

One cross-entropy for next-token, masked-LM, classification and translation targets:
weights mask padding or select the predicted positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from attention_jax.data.objectives import shift_right

__all__ = ["cross_entropy", "token_cross_entropy", "shift_right"]


def token_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    """Cross-entropy at every position: logits [..., V], targets [...] ints -> [...].

    With label_smoothing ε the target is (1-ε)·onehot + ε/V (Szegedy et al. 2016;
    Vaswani et al. 2017 §5.4 use ε = 0.1)."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}; valid: 0 <= label_smoothing < 1")
    logits = logits.astype(jnp.float32)
    if label_smoothing:
        soft = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), label_smoothing)
        return optax.softmax_cross_entropy(logits, soft)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.astype(jnp.int32))


def cross_entropy(logits, targets, weights=None, label_smoothing: float = 0.0):
    """Mean cross-entropy over weighted positions, and accuracy.

    logits [..., V], targets [...] ints, weights [...] (0 for padding and positions that
    are not predicted; default all 1). Returns (loss, {"accuracy"})."""
    losses = token_cross_entropy(logits, targets, label_smoothing)
    weights = jnp.ones_like(losses) if weights is None else weights.astype(jnp.float32)
    total = jnp.maximum(weights.sum(), 1.0)
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return (losses * weights).sum() / total, {"accuracy": (correct * weights).sum() / total}
