"""The experiment configs shipped with the package, one `get_config(arg)` per file.

Run one by name: `python -m attention_jax.main --config=NAME --workdir=DIR` (or a file
of your own: `--config=path/to/mine.py`, which may start from a shipped one:
`from attention_jax.configs import gpt; c = gpt.get_config(arg)`). Each file's docstring
gives its command, the machine it was measured on, the runtime and the metric reached;
`python -m attention_jax.main --help` lists them. Loading, `:ARG` parsing and overrides
are in attention_jax/config.py.
"""
