"""The bare training step that `bench train` and `bench profile` time.

Both modes of the benchmark (train_speed.py, the CPU rows against `transformers` peers;
train_speed_gpu.py, the GPU rows and `bench profile`) build their model and its loss
and hand them to `make_train_step`: value_and_grad of the loss plus `optax.adamw`, on
the state (params, opt_state), under `jax.jit` with the state donated. Nothing of the
trainer's step is in it (gradient clipping, metrics, the non-finite guard, shardings):
the trainer's own step is timed beside it (trainer.py), and the gap between the two is
what the trainer adds. Its model FLOPs are counted by models/flops.py, as the trainer's.

JAX is imported inside the functions: the PyTorch peer's process (torch_gpt.py) reads
the hyperparameters here without starting JAX.
"""

from __future__ import annotations

# AdamW of every benchmarked step, ours and the PyTorch peers'.
LR, WEIGHT_DECAY, BETAS, EPS = 3e-4, 0.1, (0.9, 0.95), 1e-8


def adamw(decay_matrices_only: bool = False):
    """optax.adamw with the benchmark's hyperparameters; decay_matrices_only: weight decay
    on parameters of 2 or more dimensions only (nanoGPT's rule; the GPU rows, whose peer
    decays the same), else on all of them (`torch.optim.AdamW`'s default: the CPU rows)."""
    import jax
    import optax
    mask = (lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)) if decay_matrices_only else None
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                       mask=mask)


def make_train_step(loss_fn, tx):
    """train_step(state, *batch) -> (state, loss), jitted, state = (params, opt_state)
    donated (the new state reuses the old buffers). loss_fn(params, *batch) -> scalar."""
    import jax
    import optax

    def train_step(state, *batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(train_step, donate_argnums=0)
