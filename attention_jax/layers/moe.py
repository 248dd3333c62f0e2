"""Mixture-of-Experts feed-forward layer: E expert MLPs, a learned top-A router, capacity.

Each token's router picks A of the E experts (GShard, Lepikhin et al. 2020; Switch,
Fedus et al. 2021 for A = 1). Experts process fixed-size buffers so shapes stay static:
each batch row (a "group") gives every expert room for

    C = ceil(capacity_factor · T · A / E)   tokens.

C depends on T, so a token can be dropped in a full forward pass but kept when decoded
alone (T = 1). Decoding with the KV cache (`no_drop`, which blocks pass when they
decode) drops nothing: the prompts' padded width would otherwise set C, and a prompt's
continuation depended on the other prompts batched with it. Its experts take their
tokens grouped (jax.lax.ragged_dot), not in slots. It matches the full pass exactly
where that drops nothing (capacity_factor >= E / A guarantees it).

Routing is written as dense one-hot tensors and einsums, never a Python loop over
experts, so the expert axis E of the weights and of the buffers can be sharded (the
EXPERT logical axis) and XLA turns the einsums into all-to-alls:
    dispatch [B, T, E, C]   1 where token t sits in slot c of expert e
    combine  [B, T, E, C]   dispatch × the token's gate weight for that expert
    expert_in  = einsum(dispatch, x)            [E, B, C, D]
    expert_out = MLP_e(expert_in)                [E, B, C, D]   weights [E, D, F], [E, F, D]
    y          = einsum(combine, expert_out)     [B, T, D]

Over capacity. Slots are given out in priority order, `priority`:
  "choice"  all tokens' first choices before any second choice, earlier tokens first
            within a choice (GShard §2.2): first choices are rarely dropped.
  "token"   earlier tokens first, a token's choices in rank order. Whether token t is
            dropped then depends only on tokens <= t, so a causal model stays causal
            ("choice" lets a later token's first choice evict an earlier second choice).
The tokens of a row share its slots: packed documents in a row compete for them (with
nothing dropped, capacity_factor >= E / A, they never meet). Padding does not: given
`token_mask` (True = a real token; a block passes its kv_mask, or else its segment ids
other than 0, a packed row's padding, and with them its own token_mask, where a GPT's
"stream" rows mark their padding), a padding token is
routed nowhere (y = 0), takes no slot and counts in no statistic below.
An assignment that
finds its expert full is DROPPED: it contributes nothing. A token all of whose
assignments are dropped gets y = 0, so in a residual block (x + MoE(x)) it passes
through unchanged; a token that keeps some assignments gets only those, with their
gate weights not renormalised. The fraction dropped is reported in aux.

Gates. With A > 1 the gate weights of a token's A choices are its router probabilities
renormalised to sum to 1 (GShard); with A = 1 the gate is the raw probability (Switch),
otherwise it would always be 1 and the router would get no gradient from the task loss.

Auxiliary outputs (aux dict), to add to the loss and to plot:
  load_balance_loss  E · Σ_e f_e · P_e  (Switch eq. 4), f_e the fraction of assignments
                     the router sends to e (before capacity), P_e the mean router
                     probability of e. Equals 1 for a uniform router, E when collapsed.
  router_z_loss      mean (logsumexp logits)², keeps router logits small (ST-MoE, Zoph 2022,
                     weight it 1e-3; a GPT's router_z_loss_weight, 0 by default).
  expert_load [E]    f_e: the router's load per expert (sums to 1).
  router_entropy     mean entropy of the router distribution (log E = uniform).
  dropped_fraction   fraction of assignments dropped for lack of capacity.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention_jax import axes
from attention_jax.errors import check_positive_ints, check_rates_and_epsilon
from attention_jax.layers.mlp import activation


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int,
                    capacity_factor: float) -> int:
    """C: slots per expert per group; at least 1. Exact arithmetic on the factor as
    written (its shortest decimal): in floats 1.1 · 100 / 2 is 55.00000000000001, and
    the ceiling gave a 56th slot where the formula says 55."""
    exact = Fraction(repr(float(capacity_factor))) * tokens_per_group * top_k / num_experts
    return max(1, math.ceil(exact))


PRIORITIES = ("choice", "token")
# The MoE's per-expert parameters (leading axis E, after a scanned stack's L): a token
# passes through top_k of each's E slices (models/flops.py counts only those).
EXPERT_PARAMS = ("wi", "wo", "wi_bias", "wo_bias")


def route(logits, top_k: int, capacity: int, normalize_gates: Optional[bool] = None,
          priority: str = "choice", token_mask=None):
    """Router logits [B, T, E] -> (dispatch [B, T, E, C] bool, combine [B, T, E, C], aux).
    token_mask [B, T] bool (True = a real token) or None: padding is routed nowhere and
    left out of the statistics.

    A pure function (no parameters) so the routing rules can be tested on chosen logits.
    """
    if priority not in PRIORITIES:
        raise ValueError(f"priority={priority!r} is unknown; valid: {PRIORITIES}")
    b, t, e = logits.shape
    logits, real, probs, gates, experts = _choose(logits, top_k, normalize_gates, token_mask)
    # [B, T, A, E]; a padding token chooses no expert, so it takes no slot
    choice = jax.nn.one_hot(experts, e, dtype=jnp.int32) * real[:, :, None, None].astype(jnp.int32)

    # Slot of each assignment in its expert's buffer: count earlier assignments to the same
    # expert in priority order (choice rank, then token position; or token, then rank).
    if priority == "choice":
        by_priority = jnp.swapaxes(choice, 1, 2).reshape(b, top_k * t, e)  # [B, A·T, E]
        slot = jnp.cumsum(by_priority, axis=1) - 1
        slot = jnp.swapaxes(slot.reshape(b, top_k, t, e), 1, 2)  # [B, T, A, E]
    else:
        slot = jnp.cumsum(choice.reshape(b, t * top_k, e), axis=1) - 1  # [B, T·A, E]
        slot = slot.reshape(b, t, top_k, e)
    slot = jnp.sum(slot * choice, axis=-1)  # [B, T, A]: slot in the chosen expert
    kept = (slot < capacity) & (real[:, :, None] > 0)  # [B, T, A]

    slot_onehot = jax.nn.one_hot(jnp.where(kept, slot, capacity), capacity)  # [B, T, A, C]; dropped -> 0
    dispatch_a = choice[..., None].astype(jnp.float32) * slot_onehot[:, :, :, None, :]  # [B, T, A, E, C]
    dispatch = jnp.sum(dispatch_a, axis=2)  # [B, T, E, C]
    combine = jnp.sum(dispatch_a * gates[..., None, None], axis=2)  # [B, T, E, C]
    return dispatch.astype(bool), combine, _statistics(logits, real, probs, choice, kept)


def route_all(logits, top_k: int, normalize_gates: Optional[bool] = None, token_mask=None):
    """Router logits [B, T, E] -> (experts [B, T, A] int32, gates [B, T, A], aux) with no
    capacity: every assignment kept, a padding token's gates 0. For `MoE(no_drop=True)`,
    whose experts then take their tokens grouped, not in slots."""
    b, t, e = logits.shape
    logits, real, probs, gates, experts = _choose(logits, top_k, normalize_gates, token_mask)
    choice = jax.nn.one_hot(experts, e, dtype=jnp.int32) * real[:, :, None, None].astype(jnp.int32)
    kept = jnp.broadcast_to(real[:, :, None] > 0, experts.shape)
    return experts, gates * real[:, :, None], _statistics(logits, real, probs, choice, kept)


def _choose(logits, top_k, normalize_gates, token_mask):
    """(logits in float32 at least, real [B, T] 1.0 where a token is, probs [B, T, E],
    gates and experts [B, T, A]): each token's top-A experts and their gate weights."""
    b, t, e = logits.shape
    if token_mask is not None and tuple(token_mask.shape) != (b, t):
        raise ValueError(f"token_mask: shape {tuple(token_mask.shape)}; valid: [B, T] = "
                         f"{(b, t)}, True for a real token")
    # (an int or float mask was used as a weight: segment ids 1, 2, 3 passed as the mask
    # scaled each token's expert output and its share of the router statistics by its id)
    if token_mask is not None and jnp.result_type(token_mask) != jnp.bool_:
        raise ValueError(f"token_mask: dtype {jnp.result_type(token_mask)}; valid: a bool "
                         f"array [B, T] = {(b, t)}, True for a real token (e.g. "
                         f"segment_ids != 0)")
    # Routing decisions in float32 at least (Switch §2.4); float64 logits stay float64, or
    # a float64 check of the layer met float32's rounding in its gates and aux losses.
    exact = jnp.promote_types(logits.dtype, jnp.float32)
    real = (jnp.ones((b, t), exact) if token_mask is None
            else token_mask.astype(exact))  # [B, T]
    logits = logits.astype(exact)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, T, E]
    gates, experts = jax.lax.top_k(probs, top_k)  # [B, T, A]
    if normalize_gates if normalize_gates is not None else top_k > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return logits, real, probs, gates, experts


def _statistics(logits, real, probs, choice, kept):
    """The router's aux (module doc) from its choices [B, T, A, E] and which of the
    assignments were kept [B, T, A]."""
    e, top_k = logits.shape[-1], choice.shape[2]
    # Means over the real tokens (every token without a mask).
    count = jnp.maximum(jnp.sum(real), 1.0)
    mean = lambda per_token: jnp.sum(per_token * real) / count  # noqa: E731  [B, T] -> ()
    load = jnp.sum(jnp.sum(choice, axis=2), axis=(0, 1)) / (count * top_k)  # [E] f_e, sums to 1
    mean_prob = jnp.sum(probs * real[..., None], axis=(0, 1)) / count  # [E] P_e
    return {
        "load_balance_loss": e * jnp.sum(load * mean_prob),
        "router_z_loss": mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "expert_load": load,
        "router_entropy": mean(-jnp.sum(probs * jnp.log(probs + 1e-9), axis=-1)),
        "dropped_fraction": 1.0 - mean(jnp.mean(kept.astype(jnp.float32), axis=-1)),
    }


class MoE(nn.Module):
    """Mixture-of-Experts MLP [B, T, D] -> ([B, T, D], aux); see the module doc.

    Attributes:
      num_experts: E.  top_k: A experts per token.  capacity_factor: slack in C.
      hidden: F of each expert (default 4D).  activation: as in layers/mlp.py.
      normalize_gates: renormalise the A gates to sum to 1 (default: when A > 1).
      priority: "choice" | "token", who gets a slot first (module doc); decoders use "token".
    """

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    hidden: Optional[int] = None
    activation: str = "gelu"
    use_bias: bool = True
    normalize_gates: Optional[bool] = None
    priority: str = "choice"
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True, token_mask=None,
                 no_drop: bool = False):
        """x [B, T, D]; token_mask [B, T] bool or None: True for a real token (padding
        is routed nowhere: y = 0 there, and it takes no expert's slot). no_drop: every
        assignment computed, whatever capacity_factor says (the module doc; `_grouped`)."""
        if x.ndim != 3:  # (not enough values to unpack)
            raise ValueError(f"x: shape {x.shape}; valid: [B, T, D] (one sequence: x[None])")
        check_rates_and_epsilon(self)  # dropout_rate=10 (a percentage) zeroed every output
        check_positive_ints(self, ["hidden"], {"hidden": "4 times the input's width"})
        b, t, d = x.shape
        e, f = self.num_experts, self.hidden or 4 * x.shape[-1]
        if e < 1 or not 1 <= self.top_k <= e:
            raise ValueError(f"MoE needs num_experts >= 1 and 1 <= top_k <= num_experts; got "
                             f"num_experts={e}, top_k={self.top_k} (valid top_k: 1..{max(e, 1)})")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0; got {self.capacity_factor}")
        act = activation(self.activation)
        fan_in = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                  in_axis=-2, out_axis=-1, batch_axis=0)

        def param(name, init, shape, names):
            return self.param(name, nn.with_logical_partitioning(init, names), shape,
                              self.param_dtype)

        w_router = param("router", nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                         (d, e), (axes.EMBED, None))
        exact = jnp.promote_types(self.dtype, jnp.float32)  # the router's, at least float32
        logits = jnp.einsum("BTD,DE->BTE", x.astype(exact), w_router.astype(exact))
        wi = param("wi", fan_in, (e, d, f), (axes.EXPERT, axes.EMBED, axes.MLP))
        wo = param("wo", fan_in, (e, f, d), (axes.EXPERT, axes.MLP, axes.EMBED))
        wi_bias = wo_bias = None
        if self.use_bias:
            wi_bias = param("wi_bias", nn.initializers.zeros, (e, f), (axes.EXPERT, axes.MLP))
            wo_bias = param("wo_bias", nn.initializers.zeros, (e, d), (axes.EXPERT, axes.EMBED))
        x = x.astype(self.dtype)
        dropout = nn.Dropout(self.dropout_rate)
        if no_drop:
            return self._grouped(x, logits, token_mask, wi, wo, wi_bias, wo_bias, act, dropout,
                                 deterministic)
        capacity = expert_capacity(t, e, self.top_k, self.capacity_factor)
        dispatch, combine, aux = route(logits, self.top_k, capacity, self.normalize_gates,
                                       self.priority, token_mask)
        expert_in = jnp.einsum("BTEC,BTD->EBCD", dispatch.astype(self.dtype), x)  # [E, B, C, D]
        expert_in = nn.with_logical_constraint(expert_in, (axes.EXPERT, axes.BATCH, None, axes.EMBED))
        hdn = jnp.einsum("EBCD,EDF->EBCF", expert_in, wi.astype(self.dtype))  # [E, B, C, F]
        if wi_bias is not None:
            hdn = hdn + wi_bias[:, None, None, :].astype(self.dtype)
        hdn = dropout(act(hdn), deterministic=deterministic)
        out = jnp.einsum("EBCF,EFD->EBCD", hdn, wo.astype(self.dtype))  # [E, B, C, D]
        if wo_bias is not None:
            out = out + wo_bias[:, None, None, :].astype(self.dtype)
        y = jnp.einsum("BTEC,EBCD->BTD", combine.astype(self.dtype), out)  # [B, T, D]
        return nn.with_logical_constraint(y, (axes.BATCH, axes.LENGTH, axes.EMBED)), aux

    def _grouped(self, x, logits, token_mask, wi, wo, wi_bias, wo_bias, act, dropout,
                 deterministic):
        """Every assignment computed (no capacity, nothing dropped): the B·T·A assignments
        sorted by expert, each expert's rows one group of jax.lax.ragged_dot. Memory and
        FLOPs linear in T, where slots enough for every token ([B, T, E, C = T]) grew as
        T²: 4 GiB a row at E = 64, T = 4096."""
        b, t, d = x.shape
        experts, gates, aux = route_all(logits, self.top_k, self.normalize_gates, token_mask)
        flat = experts.reshape(-1)  # [M = B·T·A]
        order = jnp.argsort(flat, stable=True)
        token = (jnp.arange(b * t * self.top_k) // self.top_k)[order]  # each row's token
        chosen = flat[order]
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)  # [E]
        rows = x.reshape(b * t, d)[token]  # [M, D]
        hdn = jax.lax.ragged_dot(rows, wi.astype(self.dtype), sizes)  # [M, F]
        if wi_bias is not None:
            hdn = hdn + wi_bias[chosen].astype(self.dtype)
        hdn = dropout(act(hdn), deterministic=deterministic)
        out = jax.lax.ragged_dot(hdn, wo.astype(self.dtype), sizes)  # [M, D]
        if wo_bias is not None:
            out = out + wo_bias[chosen].astype(self.dtype)
        weighted = out * gates.reshape(-1)[order][:, None].astype(out.dtype)
        y = jnp.zeros((b * t, d), out.dtype).at[token].add(weighted).reshape(b, t, d)
        return nn.with_logical_constraint(y, (axes.BATCH, axes.LENGTH, axes.EMBED)), aux
