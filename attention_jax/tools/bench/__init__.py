"""Benchmarks. Speed and memory targets live here, never as timed tests.

    python -m attention_jax.tools.bench attention            # the full table (about 10 minutes)
    python -m attention_jax.tools.bench attention --quick    # small sizes (make bench-quick)
    python -m attention_jax.tools.bench train                # training steps/s vs PyTorch
    python -m attention_jax.tools.bench ring                 # ring attention vs sequence size
    python -m attention_jax.tools.bench checkpoint           # digest cost at save/restore
    python -m attention_jax.tools.bench profile              # where a GPT-2 step's time goes

timing.py holds what they measure with; the others one benchmark each (train_speed.py
and train_speed_gpu.py the two modes of `train`, around bare_step.py's step).
"""
