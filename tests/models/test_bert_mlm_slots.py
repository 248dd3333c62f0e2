"""The MLM task's predicted-position slots (tasks.text.mlm_slots): enough for every
prediction mlm_mask makes, and never more than the row holds."""

import numpy as np
import pytest

from attention_jax.data.objectives import mlm_mask
from attention_jax.tasks.text import mlm_slots


@pytest.mark.parametrize("rate", [0.05, 0.15, 0.3, 0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("seq_len", [1, 2, 3, 7, 10, 16, 33])
def test_slots_hold_every_prediction_and_fit_the_row(rate, seq_len):
    slots = mlm_slots(rate, seq_len)
    # lax.top_k(weights [B, T], slots) needs slots <= T: mask_rate=0.95, seq_len=10
    # asked for 11 of 10 and the first training step stopped.
    assert 1 <= slots <= seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 50, (64, seq_len))  # every token eligible: the most predicted
    out = mlm_mask(tokens, rng, mask_id=3, vocab_size=50, special_ids={0, 1, 2, 3},
                   mask_rate=rate)
    assert out["weights"].sum(-1).max() <= slots
