"""The model families, one module each: `from attention_jax.models import gpt`.

Each module has a frozen config dataclass with `from_variant(name, **overrides)`, a
VARIANTS table citing its paper, a linen model returning (output, aux), and its loss.
"""

from attention_jax.models import bert, encdec, gpt, rnn, vit

__all__ = ["bert", "encdec", "gpt", "rnn", "vit"]
