"""A tiny language model and synthetic data for the training-system tests.

Small enough to compile in a second on CPU, but with every kind of parameter the
sharding rules care about: an embedding [vocab, embed], attention heads [embed, heads,
head_dim] (split over `tensor`), an MLP [embed, mlp], biases and a norm, and an
activation constraint on [batch, length, embed]. Registered as tasks.TASKS['tiny'].

Also runnable as a worker process: `python tests/system/tiny.py CONFIG_JSON WORKDIR
OUT_JSON` trains and writes the summary and a parameter checksum (subprocess tests).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from attention_jax import attention, train
from attention_jax.models import losses
from attention_jax import config as config_lib
from attention_jax import tasks

VOCAB, SEQ = 32, 16


class SyntheticSequences:
    """Random-access source: record i is an arithmetic sequence mod VOCAB with a start
    and stride drawn from a generator seeded by i (deterministic, learnable)."""

    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        rng = np.random.default_rng(self.offset + int(i))
        start, stride = rng.integers(VOCAB), rng.integers(1, 4)
        return {"tokens": ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class NextToken:
    def __call__(self, record, rng):
        del rng
        return {"inputs": record["tokens"][:-1], "targets": record["tokens"][1:]}


def _part(init, names):
    return nn.with_logical_partitioning(init, names)


class TinyLM(nn.Module):
    width: int = 16
    num_heads: int = 2  # spelled as the model configs spell it (config_lib.check_model_fits_mesh)
    hidden: int = 32
    dropout: float = 0.0
    dtype: str = "float32"  # the compute dtype: weights are cast where they are used

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        d, n = self.width, self.num_heads
        embed = self.param("embed", _part(nn.initializers.normal(0.5), ("vocab", "embed")),
                           (VOCAB, d))
        x = embed[tokens].astype(self.dtype)  # [B, T, D]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        qkv = self.param("qkv", _part(nn.initializers.lecun_normal(), ("embed", None, "heads", "head_dim")),
                         (d, 3, n, d // n))
        q, k, v = jnp.einsum("BTD,DCNH->CBTNH", x, qkv.astype(x.dtype))
        y = attention.dot_product_attention(q, k, v, causal=True, implementation="reference")
        out = self.param("out", _part(nn.initializers.lecun_normal(), ("heads", "head_dim", "embed")),
                         (n, d // n, d))
        x = x + jnp.einsum("BTNH,NHD->BTD", y, out.astype(x.dtype))
        h = nn.Dense(self.hidden, kernel_init=_part(nn.initializers.lecun_normal(), ("embed", "mlp")),
                     bias_init=_part(nn.initializers.zeros, ("mlp",)), dtype=x.dtype)(x)
        h = nn.Dropout(self.dropout, deterministic=not train)(nn.gelu(h))
        x = x + nn.Dense(d, kernel_init=_part(nn.initializers.lecun_normal(), ("mlp", "embed")),
                         bias_init=_part(nn.initializers.zeros, ("embed",)), dtype=x.dtype)(h)
        x = nn.LayerNorm(scale_init=_part(nn.initializers.ones, ("norm",)),
                         bias_init=_part(nn.initializers.zeros, ("norm",)), dtype=x.dtype)(x)
        return x @ embed.T.astype(x.dtype), {}


def make_tiny_task(config, workdir=None) -> tasks.Task:
    model = TinyLM(**config.model.to_dict(), dtype=config.train.compute_dtype)

    def loss(params, batch, rng, is_train):
        logits, aux = model.apply({"params": params}, batch["inputs"], train=is_train,
                                  rngs={"dropout": rng})
        return losses.cross_entropy(logits, batch["targets"],
                                   label_smoothing=config.optim.label_smoothing if is_train else 0.0)

    def init(rng):
        return model.init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"]

    return tasks.Task(model=model, init=init, loss=loss,
                      train_source=SyntheticSequences(4096), eval_source=SyntheticSequences(256, 10**6),
                      train_transform=NextToken(), eval_transform=NextToken(), unit="tokens",
                      count=lambda b: b["inputs"].size)


tasks.TASKS["tiny"] = make_tiny_task


def tiny_config(**overrides) -> ml_collections.ConfigDict:
    """10 steps of the tiny LM; overrides like {'mesh.data': 2, 'train.steps': 20}."""
    c = config_lib.base_config()
    c.task = "tiny"
    c.model = ml_collections.ConfigDict({"width": 16, "num_heads": 2, "hidden": 32, "dropout": 0.0})
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 2
    c.optim.decay_steps = 20  # the schedule of a 20-step run, so 10 + 10 steps resume it.
    c.train.steps = 10
    c.train.batch_size = 16
    c.train.log_every = 5
    c.train.progress = False
    c.train.checkpoint_every = 10
    c.eval.every = -1
    c.eval.steps = 2
    c.eval.batch_size = 16
    c.mesh.data = -1
    for key, value in overrides.items():
        group, name = key.split(".")
        c[group][name] = value
    return c


def flat_params(state) -> dict[str, np.ndarray]:
    """Host copies of the parameters, by path (single-process runs)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in flat}


def param_sums(state) -> list[float]:
    """Sum and sum of squares of each parameter: comparable across processes (computed
    under jit, so it works when no process holds a whole parameter)."""
    sums = jax.jit(lambda p: [(jnp.sum(x), jnp.sum(x * x)) for x in jax.tree.leaves(p)])
    return [float(v) for pair in sums(state["params"]) for v in pair]


if __name__ == "__main__":
    # Worker: OVERRIDES_JSON WORKDIR OUT_JSON. Trains the tiny LM, writes losses, the final
    # step, the stopping signal and parameter sums (and OUT_JSON.npz with the parameters
    # when it is the only process).
    cfg = tiny_config(**json.loads(sys.argv[1]))
    summary = train.train_and_evaluate(cfg, sys.argv[2])
    with open(sys.argv[3], "w") as f:
        json.dump({"losses": summary["losses"], "step": summary["step"],
                   "stopped_by": summary["stopped_by"],
                   "param_sums": param_sums(summary["state"])}, f)
    if jax.process_count() == 1:
        np.savez(sys.argv[3] + ".npz", **flat_params(summary["state"]))
