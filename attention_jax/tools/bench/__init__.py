"""Benchmarks. Speed and memory targets live here, never as timed tests.

    python -m attention_jax.tools.bench attention            # the full table (about 10 minutes)
    python -m attention_jax.tools.bench attention --quick    # small sizes (make bench-quick)
    python -m attention_jax.tools.bench train                # training steps/s vs PyTorch
    python -m attention_jax.tools.bench ring                 # ring attention vs sequence size
    python -m attention_jax.tools.bench checkpoint           # digest cost at save/restore
    python -m attention_jax.tools.bench profile              # where a GPT-2 step's time goes
    python -m attention_jax.tools.bench profile --save       # what a checkpoint save costs it
    python -m attention_jax.tools.bench gpu-hlo              # the step compiled for an H100, here
    python -m attention_jax.tools.bench loss                 # the LM head's loss, by loss kernel
    python -m attention_jax.tools.bench norm                 # a residual add and LayerNorm, by norm kernel

One module per command, named `<command>_speed.py` (or profile.py) so none shadows a
package module; `*_speed_gpu.py` are the GPU modes of `attention` and `train`, both
around shared parts: timing.py (what they measure with) and bare_step.py (the bare
training step both modes of `train` time).
"""
