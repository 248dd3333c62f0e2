"""The tiny LM of tiny.py as a `--config` file: the launch recipes' command line
(`python -m attention_jax.main --config=FILE ...`) trains it in test_multihost.py."""

import tiny  # registers the "tiny" task


def get_config(arg=None):
    del arg
    return tiny.tiny_config()
