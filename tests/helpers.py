"""Helpers the tests share: load a shipped experiment config, shrink its config to one tiny step.

Importable from every test directory (pytest puts tests/, where conftest.py lives, on
sys.path); the `data_dir` fixture is in conftest.py.
"""

import importlib
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    """The shipped config attention_jax/configs/<name>.py as a module."""
    return importlib.import_module(f"attention_jax.configs.{name}")


def shrink(c, data_dir):
    """One step at tiny size on small offline data (the 2k-pair translation set, six
    corpus files), so the test builds its datasets in seconds."""
    c.data.data_dir = data_dir
    if c.data.name == "number_translation":
        c.data.name = "number_translation/small"
    if "max_files" in c.data:
        c.data.max_files = 6
    if c.task == "gpt":
        c.data.seq_len = min(c.data.seq_len, 32)
        c.model.num_layers, c.model.d_model = 1, 4 * c.model.num_heads
    c.train.steps = 1
    c.train.batch_size = 8
    c.eval.batch_size = 8  # divides the 8 fake devices (a one-device eval batch may not).
    c.train.progress = False
    c.eval.every = -1
    return c


def adam_losses(loss_fn, params, steps: int, lr: float) -> list[float]:
    """The loss at each of `steps` jitted Adam steps on loss_fn(params, rng) -> scalar
    (rng: a fresh key per step, for dropout)."""
    import jax
    import optax
    tx = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    return losses


def assert_loss_goes_down(losses, by: float) -> None:
    """Every loss finite, and the last lower than the first by more than `by`."""
    import numpy as np
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - by, losses
