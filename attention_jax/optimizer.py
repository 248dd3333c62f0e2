"""The optimizer: AdamW with decoupled weight decay on the matrices only, global-norm
clipping, and a warmup + decay learning-rate schedule (config.optim)."""

from __future__ import annotations

import jax
import optax

from attention_jax.checkpoint import key_name


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to optim.lr over optim.warmup_steps, then optim.schedule down to
    optim.lr * optim.end_lr_ratio at total_steps."""
    warmup = optax.linear_schedule(0.0, optim.lr, max(optim.warmup_steps, 1))
    decay_steps = max(total_steps - optim.warmup_steps, 1)
    end = optim.lr * optim.end_lr_ratio
    if optim.schedule == "cosine":
        decay = optax.cosine_decay_schedule(optim.lr, decay_steps, alpha=optim.end_lr_ratio)
    elif optim.schedule == "linear":
        decay = optax.linear_schedule(optim.lr, end, decay_steps)
    else:
        decay = optax.constant_schedule(optim.lr)
    return optax.join_schedules([warmup, decay], [optim.warmup_steps])


# Parameters that weight decay leaves alone, by the role their name gives them: lookup
# tables ("embedding": token, segment and learned position tables; ViT's
# "position_embeddings"; a table pulled toward zero only shrinks rare tokens), ViT's
# [CLS] token ("cls"), norm scales ("scale") and biases ("bias", "<matrix>_bias").
NO_DECAY = ("embedding", "position_embeddings", "cls", "scale", "bias")


def decay_mask(params):
    """True where weight decay applies: the matrices (projection kernels of any rank,
    ViT's patch-embedding convolution, MoE routers), by the role of the leaf's name."""
    def decays(path, x):
        name = key_name(path[-1]) if path else ""
        return x.ndim >= 2 and name not in NO_DECAY and not name.endswith("_bias")
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the optax transformation, its learning-rate schedule) of config.optim."""
    schedule = learning_rate_schedule(optim, total_steps)
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule
