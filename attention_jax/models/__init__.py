"""The model families, one module each: `from attention_jax.models import gpt`.

Each module has a frozen config dataclass with `from_variant(name, **overrides)`, a
VARIANTS table citing its paper and a linen model returning (output, aux); losses.py
holds the cross-entropy and shift_right they all train with.
"""

from attention_jax.models import bert, cnn, encdec, gpt, losses, rnn, vit

__all__ = ["bert", "cnn", "encdec", "gpt", "losses", "rnn", "vit"]
