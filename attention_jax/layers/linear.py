"""Projections of activations [..., K] by weights [K..., O...] as one 2-D matmul.

    y = matmul(x, w)               # x [B, T, D], w [D, F]     -> [B, T, F]
    y = matmul(x, w, in_dims=2)    # x [B, T, N, H], w [N, H, D] -> [B, T, D]
    nn.Dense(F, dot_general=dot_general_2d)   # the same inside flax's Dense

Why a module for a reshape: the weight gradient of y = x·w contracts x and dy over every
leading axis (batch and length). Written with x as [B, T, D], XLA:CPU (jax 0.10) lowers
that gradient by first copying x and dy into transposed [D, B·T] buffers, and it copies
again where an activation's gradient is fused into the dot. Folding the leading axes
into one first (free: they are contiguous) turns every forward and backward dot into a
plain 2-D matmul; and q, k and v are three matmuls rather than one [D, 3, N, H] einsum
whose output is then sliced (slices copy). Both measured faster on the CPU (README, Measurements behind the code).
(Where the Pallas kernels run, the one product is not sliced: they read it in place,
layers/attention.py.)

Sharding: the folded axis is (batch, length, ...) with batch outermost, so a batch
sharded over the data axes stays sharded; folded weight axes keep their outermost
axis (heads, for [N, H, D]) likewise.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def matmul(x, w, in_dims: int = 1, precision=None, preferred_element_type=None):
    """x [..., *w.shape[:in_dims]] · w -> [..., *w.shape[in_dims:]], as [M, K] @ [K, O].

    preferred_element_type=jnp.float32 returns the float32 accumulator of bfloat16
    operands unrounded (the LM head's logits, models/losses.py)."""
    k_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    if x.shape[x.ndim - in_dims:] != k_shape:
        raise ValueError(f"matmul: x {x.shape} does not end in the weight's input axes "
                         f"{k_shape} (weight {w.shape}, in_dims={in_dims})")
    lead = x.shape[:x.ndim - in_dims]
    k = math.prod(k_shape)
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), precision=precision,
                   preferred_element_type=preferred_element_type)
    return y.reshape(*lead, *out_shape)


def dot_general_2d(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """A `lax.dot_general` for `nn.Dense(dot_general=...)`: Dense contracts the input's
    last axis with the kernel's first, which `matmul` computes with the leading axes
    folded. Other contractions go to lax.dot_general unchanged."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
            and not lhs_batch and not rhs_batch and rhs.ndim == 2 and lhs.ndim > 2):
        return matmul(lhs, rhs, precision=precision,
                      preferred_element_type=preferred_element_type)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
