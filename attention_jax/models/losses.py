"""The losses every model family trains with, in float32 whatever the compute dtype.

    loss, metrics = cross_entropy(logits, targets, weights, label_smoothing=0.1)
    loss, metrics = chunked_head_cross_entropy(hidden, kernel, targets, weights,
                                               chunk_size=128)   # = cross_entropy(hidden @ kernel, ...)
    loss, metrics = head_cross_entropy(hidden, kernel, targets, weights,
                                       implementation="pallas")  # the same, the loss as a kernel
    tgt_in = shift_right(targets, bos_id)   # teacher forcing (data/objectives.py)

One cross-entropy for next-token, masked-LM, classification and translation targets:
weights mask padding or select the predicted positions. The chunked form fuses the LM
head into the loss so that the [B, T, V] logits never exist at once (see its docstring).
"""

from __future__ import annotations

import functools
import math
import numbers

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.sharding import PartitionSpec as P

from attention_jax import axes
from attention_jax.attention.call import compiling_for_gpu, target_backend
from attention_jax.data.objectives import shift_right
from attention_jax.errors import known_values
from attention_jax.layers.linear import matmul
from attention_jax.layers.logical import mesh_axes, row_mesh_axes, rows_logical
from attention_jax.models import loss_kernel

__all__ = ["cross_entropy", "token_cross_entropy", "chunked_head_cross_entropy",
           "head_cross_entropy", "choose_loss_kernel", "LOSS_KERNELS", "shift_right",
           "example_weighted", "WEIGHT"]

# The metric a loss adds when its batch carries per-example weights (an eval batch padded
# to the full batch size: data.loaders.EXAMPLE_WEIGHT): the total weight its means are
# over (examples, or weighted tokens). steps.evaluate sums mean × weight over batches and
# divides once by the summed weight, so a partial last batch counts for what it holds.
WEIGHT = "weight"


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}; valid: 0 <= label_smoothing < 1")


def token_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    """Cross-entropy at every position: logits [..., V], targets [...] ints -> [...].

    With label_smoothing ε the target is (1-ε)·onehot + ε/V (Szegedy et al. 2016;
    Vaswani et al. 2017 §5.4 use ε = 0.1)."""
    _check_label_smoothing(label_smoothing)
    _check_target_dtype(targets)
    return _cross_entropy_terms(float(label_smoothing), logits, targets.astype(jnp.int32))[0]


def _check_target_dtype(targets) -> None:
    """Class ids are ints (or bools, 0/1): float targets were cut to ints, unsaid (2.7
    read as class 2; soft labels of one axis as class 0), where the chunked loss refused
    them."""
    dtype = jnp.result_type(targets)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise ValueError(f"targets has dtype {dtype}; valid: an integer dtype (class ids: "
                         f"targets.astype(jnp.int32) if they are whole numbers)")


def cross_entropy(logits, targets, weights=None, label_smoothing: float = 0.0):
    """Mean cross-entropy over weighted positions, and accuracy.

    logits [..., V], targets [...] ints, weights [...] (0 for padding and positions that
    are not predicted; default all 1). Returns (loss, {"accuracy"}): a position counts
    as correct when its target is the argmax (the first index of the largest logit)."""
    _check_label_smoothing(label_smoothing)
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; valid: "
                         f"{tuple(logits.shape[:-1])} (logits' leading axes, logits "
                         f"{tuple(logits.shape)})")
    check_targets(targets, logits.shape[-1], weights)
    losses, correct = _cross_entropy_terms(float(label_smoothing), logits,
                                           targets.astype(jnp.int32))
    weights = jnp.ones_like(losses) if weights is None else weights.astype(jnp.float32)
    total = _weight_total(weights)
    return (losses * weights).sum() / total, {"accuracy": (correct * weights).sum() / total}


def _weight_total(weights):
    """Σw, the mean's divisor, or 1 where no position counts (a loss of 0, not NaN). Not
    max(Σw, 1): fractional weights summing below 1 gave a smaller loss than uniform ones."""
    total = weights.sum()
    return jnp.where(total > 0, total, 1.0)


def check_targets(targets, classes: int, weights=None) -> None:
    """Targets outside 0..classes-1 at positions that count (weight not 0), where their
    values are known (errors.known_values): the loss would add their logsumexp to the
    mean with nothing said (PyTorch's ignore_index -100 among them). Weights of another
    shape than the targets' are refused: broadcast, they would count the mean's
    positions wrongly (a NumPy broadcast error otherwise); so are known negative or
    non-finite weights (the mean over Σw would go the wrong way, or be NaN)."""
    if weights is not None and tuple(np.shape(weights)) != tuple(targets.shape):
        raise ValueError(f"weights has shape {tuple(np.shape(weights))}; valid: "
                         f"{tuple(targets.shape)}, the targets' (one weight a target)")
    _check_target_dtype(targets)
    w = None if weights is None else known_values(weights)
    if w is not None and w.size and not (np.isfinite(w) & (w >= 0)).all():
        value = w[~(np.isfinite(w) & (w >= 0))].flat[0]
        raise ValueError(f"weights: {value} is a weight; valid: finite and >= 0 (0 leaves a "
                         f"position out; a negative weight pushes the mean's loss the "
                         f"wrong way)")
    known = known_values(targets)
    if known is None or not known.size or not np.issubdtype(known.dtype, np.integer):
        return
    bad = (known < 0) | (known >= classes)
    if weights is not None:
        if w is None:
            return
        bad &= np.broadcast_to(w, bad.shape) != 0
    if bad.any():
        value = int(known[bad].flat[0])
        raise ValueError(f"targets: {value} is not a class of the {classes} logits at a "
                         f"position that counts; valid: 0..{classes - 1} (to leave a "
                         f"position out, e.g. PyTorch's ignore_index -100, give it weight 0)")


def example_weighted(weights, example_weight):
    """Position weights [B, ...] (None: one per example) times a per-example weight [B]
    (None: unchanged), so that an eval batch's padding rows (example weight 0) count in
    neither the loss nor the accuracy."""
    if example_weight is None:
        return weights
    example_weight = jnp.asarray(example_weight, jnp.float32)
    if weights is None:
        return example_weight
    weights = jnp.asarray(weights).astype(jnp.float32)
    return weights * example_weight.reshape(example_weight.shape + (1,) * (weights.ndim - 1))


def classifier_cross_entropy(logits, labels, example_weight=None, label_smoothing: float = 0.0):
    """A classifier's loss over a batch of examples (logits [B, C], labels [B]): the mean
    cross-entropy and accuracy (`cross_entropy`), weighted per example where an eval batch
    gives weights (0 on the rows that pad its last batch), and then metrics[WEIGHT], the
    examples the means are over."""
    nll, metrics = cross_entropy(logits, labels, example_weight, label_smoothing)
    if example_weight is not None:
        metrics[WEIGHT] = jnp.sum(jnp.asarray(example_weight, jnp.float32))
    return nll, metrics


# Why a custom VJP for a textbook formula: the logits are the largest tensor of a
# language model's step ([B, T, V]: 1.6 GB in bfloat16 for GPT-2 small at 16 × 1024), and
# each pass over them is a pass through device memory. The forward reads them twice (the
# row max; then Σ exp and the target's logit, picked by comparing an iota with the
# target: no gather, so a vocabulary split over devices stays split); the backward reads
# them once and writes dlogits = (softmax - q)·g directly in the logits' dtype. Autodiff
# through optax's gather-based loss made five passes and a float32 dlogits. A one-pass
# forward (online softmax: one variadic reduction carrying the running max and the
# rescaled sum) is slower on a GPU: two exponentials per element make that pass
# compute-bound. Both measured with `bench profile` on an H100 (README, Measurements behind the code).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cross_entropy_terms(smoothing, logits, targets):
    """(loss, correct) per position, float32 [...]: loss = lse(z) - (1-ε)·z_y - ε·mean(z)."""
    return _cross_entropy_forward(smoothing, logits, targets)[0]


def _cross_entropy_forward(smoothing, logits, targets):
    z = logits.astype(jnp.float32)
    is_target = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
    z_max = jnp.max(z, axis=-1)
    target_z = jnp.sum(jnp.where(is_target, z, 0.0), axis=-1)
    lse = z_max + jnp.log(jnp.sum(jnp.exp(z - z_max[..., None]), axis=-1))
    loss = _smoothed_loss(smoothing, lse, target_z, lambda: jnp.mean(z, axis=-1))
    # argmax == target without a third pass: the target holds the max and no earlier
    # entry equals it (a sibling of the Σexp reduction over the same logits).
    iota = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    ties_before = jnp.sum(jnp.where((iota < targets[..., None]) & (z == z_max[..., None]),
                                    1.0, 0.0), axis=-1)
    correct = ((target_z >= z_max) & (ties_before == 0)).astype(jnp.float32)
    return (loss, correct), (logits, targets, lse)


def _smoothed_loss(smoothing, lse, target_z, mean_z):
    """-Σ q·log softmax(z) per position from its statistics: lse - z_y, and with label
    smoothing ε, (1-ε)·(lse - z_y) + ε·(lse - mean(z)). mean_z: a function giving mean(z),
    called only when ε > 0."""
    loss = lse - target_z
    if smoothing:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - mean_z())
    return loss


def _softmax_minus_target(smoothing, z, targets, lse):
    """d(loss)/dz per position: softmax(z) - q, float32 [..., V] (z float32, lse [...])."""
    is_target = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
    q = jnp.where(is_target, 1.0 - smoothing, 0.0) + smoothing / z.shape[-1]
    return jnp.exp(z - lse[..., None]) - q


def _cross_entropy_backward(smoothing, residuals, cotangents):
    logits, targets, lse = residuals
    g = cotangents[0]  # d/d(loss); `correct` has no gradient
    dz = _softmax_minus_target(smoothing, logits.astype(jnp.float32), targets, lse)
    return (dz * g[..., None]).astype(logits.dtype), None


_cross_entropy_terms.defvjp(_cross_entropy_forward, _cross_entropy_backward)


# ======================================================================== the chunked head
def chunked_head_cross_entropy(hidden, kernel, targets, weights=None, *, bias=None,
                               chunk_size: int, label_smoothing: float = 0.0):
    """`cross_entropy(hidden @ kernel + bias, targets, weights, label_smoothing)` computed
    `chunk_size` positions at a time, so that only one chunk's logits [B, c, V] exist.

    hidden [B, T, D] (the final hidden states), kernel [D, V], bias [V] or None, targets
    [B, T] ints, weights [B, T] (default all 1). Returns (loss, {"accuracy"}): the mean
    over weighted positions, and the weighted accuracy of the argmax, as cross_entropy.

    Precision: the head's matmul runs in the inputs' dtype (bfloat16 under mixed
    precision) with its float32 accumulator kept as the logits; softmax, log-sum-exp and
    loss in float32. Gradients flow to hidden, kernel and bias; weights are constants (no
    gradient; a loss weighted by a differentiable quantity must use cross_entropy), and
    targets are integers. Only reverse mode (grad, vjp): a custom VJP has no forward mode.

    How: a `lax.scan` over chunks of the length axis T (the batch axis stays whole, so its
    data/fsdp sharding is untouched). Chunk j holds positions j, j + n, j + 2n, ... (n
    chunks): a length sharded over the sequence axis then stays split the same way within
    each chunk (evenly when chunk_size is a multiple of that axis; else XLA pads the
    split). T not a multiple of chunk_size is padded with weight-0 positions, which add
    nothing.

    Under differentiation the forward computes the gradient too, chunk by chunk, as the
    fused linear cross-entropy of Liger-Kernel (Hsu et al. 2024): with
    dz = (softmax(z) - q)·w/Σw (q the target distribution after smoothing), it keeps
    dhidden = dz·kernelᵀ (hidden's dtype), and sums dkernel = hiddenᵀ·dz and dbias = Σ dz
    in float32; the backward pass only scales them by the loss's cotangent. That costs
    the same three matmuls as the whole-logits path (jax.checkpoint + scan would
    recompute the logits in the backward pass: a fourth), at the price of holding
    dkernel (D·V float32) from the forward pass to the end of the backward one. Without
    differentiation (evaluation) only the logits and the statistics are computed.

    On a mesh that splits the batch, each batch shard sums its own dkernel over the
    chunks and the shards' sums are reduced once at the end, as the whole-logits path
    reduces its one gradient (not once per chunk).
    """
    _check_chunked_args(hidden, kernel, targets, weights, bias, chunk_size, label_smoothing)
    check_targets(targets, kernel.shape[1], weights)  # dtype (bools: 0/1) and values
    b, t, d = hidden.shape
    weights = (jnp.ones((b, t), jnp.float32) if weights is None
               else jnp.asarray(weights).astype(jnp.float32))
    scale = lax.stop_gradient(weights / _weight_total(weights))  # w / Σw
    n, c = _chunk_layout(t, int(chunk_size))
    if n * c > t:  # padding positions carry weight 0
        pad = ((0, 0), (0, n * c - t))
        hidden = jnp.pad(hidden, pad + ((0, 0),))
        targets, scale = jnp.pad(targets, pad), jnp.pad(scale, pad)
    # Position i·n + j goes to chunk j: [B, n·c, ...] -> [B, c, n, ...] -> [n, B, c, ...].
    to_chunks = lambda x: jnp.moveaxis(x.reshape(b, c, n, *x.shape[2:]), 2, 0)
    loss, accuracy = _fused_head_loss(float(label_smoothing), to_chunks(hidden), kernel, bias,
                                      to_chunks(targets.astype(jnp.int32)), to_chunks(scale))
    return loss, {"accuracy": accuracy}


def _check_chunked_args(hidden, kernel, targets, weights, bias, chunk_size, label_smoothing):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}; valid: an int >= 1 (positions per chunk)")
    _check_label_smoothing(label_smoothing)
    if hidden.ndim != 3:
        raise ValueError(f"hidden has shape {hidden.shape}; valid: [B, T, D] (3 axes)")
    b, t, d = hidden.shape
    if kernel.ndim != 2 or kernel.shape[0] != d:
        raise ValueError(f"kernel has shape {kernel.shape}; valid: [D, V] with D = {d} "
                         f"(hidden's last axis, hidden {hidden.shape})")
    if targets.shape != (b, t):
        raise ValueError(f"targets has shape {targets.shape}; valid: [B, T] = {(b, t)}")
    if weights is not None and jnp.shape(weights) != (b, t):
        raise ValueError(f"weights has shape {jnp.shape(weights)}; valid: [B, T] = {(b, t)}")
    if bias is not None and bias.shape != kernel.shape[1:]:
        raise ValueError(f"bias has shape {bias.shape}; valid: [V] = {kernel.shape[1:]} or None")


def _chunk_layout(t: int, chunk_size: int) -> tuple[int, int]:
    """(chunks n, positions per chunk c), n·c >= t: c = chunk_size, or t if that is less."""
    c = min(chunk_size, t)
    return math.ceil(t / c), c


def _chunk_logits(h, kernel, bias):
    """h [B, c, D] -> float32 logits [B, c, V]: the matmul in h's dtype, its float32
    accumulator kept. The vocabulary may be split over the tensor axis."""
    z = matmul(h, kernel, preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return nn.with_logical_constraint(z, (axes.BATCH, axes.LENGTH, axes.VOCAB))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_head_loss(smoothing, h, kernel, bias, y, scale):
    """(Σ scale·loss, Σ scale·correct) over chunks h [n, B, c, D], y and scale [n, B, c]."""
    def body(carry, xs):
        h, y, scale = xs
        (loss, correct), _ = _cross_entropy_forward(smoothing, _chunk_logits(h, kernel, bias), y)
        return (carry[0] + jnp.sum(scale * loss), carry[1] + jnp.sum(scale * correct)), None

    zero = jnp.zeros((), jnp.float32)
    return lax.scan(body, (zero, zero), (h, y, scale))[0]


def _batch_shards(b: int) -> int:
    """Devices the batch axis is split over under the current mesh and logical rules (1
    without them, or when they do not divide b)."""
    mesh = jax.sharding.get_abstract_mesh()
    p = math.prod(mesh.shape[a] for a in mesh_axes(axes.BATCH))
    return p if b % p == 0 else 1


def _fused_head_loss_fwd(smoothing, h, kernel, bias, y, scale):
    v = kernel.shape[1]
    dtype = jnp.result_type(h.dtype, kernel.dtype)  # the matmuls' operand dtype
    # The weight gradient sums over the batch. Summed in one [D, V] accumulator, a batch
    # split over P devices is reduced across them at every chunk; so each batch shard
    # keeps its own partial sum ([P, D, V], split over P like the batch: per device the
    # size of one [D, V]) and the P partials are reduced once, after the last chunk.
    p = _batch_shards(h.shape[1])
    partial = (axes.BATCH, axes.EMBED, axes.VOCAB)

    def body(carry, xs):
        loss_sum, correct_sum, dkernel, dbias = carry
        hc, y, scale = xs
        b, c, d = hc.shape
        z = _chunk_logits(hc, kernel, bias)
        (loss, correct), (_, _, lse) = _cross_entropy_forward(smoothing, z, y)  # as the whole path
        dz = _softmax_minus_target(smoothing, z, y, lse) * scale[..., None]  # [B, c, V] float32
        dz = nn.with_logical_constraint(dz, (axes.BATCH, axes.LENGTH, axes.VOCAB))
        dz_in = dz.astype(dtype)
        dh = matmul(dz_in, kernel.T, preferred_element_type=jnp.float32).astype(h.dtype)
        dkernel = dkernel + lax.dot_general(  # hᵀ·dz per shard, over its folded [B/P·c] axis
            hc.reshape(p, b // p * c, d).astype(dtype), dz_in.reshape(p, b // p * c, v),
            (((1,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)  # [P, D, V]
        dkernel = nn.with_logical_constraint(dkernel, partial)
        if dbias is not None:
            dbias = dbias + jnp.sum(dz.reshape(p, -1, v), axis=1)  # [P, V]
        return (loss_sum + jnp.sum(scale * loss), correct_sum + jnp.sum(scale * correct),
                dkernel, dbias), dh

    zero = jnp.zeros((), jnp.float32)
    dkernel = nn.with_logical_constraint(jnp.zeros((p, *kernel.shape), jnp.float32), partial)
    dbias = None if bias is None else jnp.zeros((p, v), jnp.float32)
    (loss_sum, correct_sum, dkernel, dbias), dh = lax.scan(
        body, (zero, zero, dkernel, dbias), (h, y, scale))
    dkernel = nn.with_logical_constraint(dkernel.sum(0), (axes.EMBED, axes.VOCAB))
    dbias = None if dbias is None else dbias.sum(0)
    # kernel and bias ride along for their dtypes only (inputs: no copies).
    return (loss_sum, correct_sum), (dh, dkernel, dbias, kernel, bias)


def _fused_head_loss_bwd(smoothing, residuals, cotangents):
    dh, dkernel, dbias, kernel, bias = residuals
    g = cotangents[0]  # the accuracy is piecewise constant: its cotangent contributes 0
    dbias = None if bias is None else (g * dbias).astype(bias.dtype)
    return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dkernel).astype(kernel.dtype),
            dbias, None, None)


_fused_head_loss.defvjp(_fused_head_loss_fwd, _fused_head_loss_bwd)


# ======================================================================== the loss as a kernel
# How head_cross_entropy computes the loss: "xla" as cross_entropy does (XLA's fused
# reductions); "pallas" the kernels of loss_kernel.py (a row's statistics in one pass,
# its gradient written over the logits in the forward pass); "auto" pallas where they
# compile (NVIDIA GPUs) and pay (see choose_loss_kernel), xla elsewhere.
LOSS_KERNELS = ("auto", "xla", "pallas")


def choose_loss_kernel(implementation: str, dtype=jnp.bfloat16, vocab: int | None = None) -> str:
    """"xla" or "pallas" for `implementation` on this platform (see LOSS_KERNELS).

    auto takes pallas for logits other than float64 on NVIDIA GPUs (or compiling for
    them), where the kernels compile, unless:
      - the vocabulary is under loss_kernel.CHUNK (4096) wide: its logits cost little
        and a row is too short to fill a kernel's program;
      - the mesh splits the vocabulary (its logical axis onto a mesh axis of size > 1): a
        row's statistics would need every device's part of it;
      - several devices and no ambient mesh (`jax.set_mesh`) to split the rows over: the
        kernels are Pallas calls, which XLA's partitioner cannot split, and the trainer
        always sets one.
    Under a mesh the kernels run on each device's rows (shard_map over the batch and
    length axes' mesh axes)."""
    if implementation not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {implementation!r} is unknown; valid: {LOSS_KERNELS}")
    if implementation != "auto":
        return implementation
    if target_backend() != "gpu" or jnp.dtype(dtype) == jnp.float64:
        return "xla"
    if vocab is not None and vocab < loss_kernel.CHUNK:
        return "xla"
    mesh = jax.sharding.get_abstract_mesh()
    unsplittable = mesh.empty and not compiling_for_gpu() and jax.device_count() > 1
    return "xla" if unsplittable or mesh_axes(axes.VOCAB) else "pallas"


def head_cross_entropy(hidden, kernel, targets, weights=None, *, bias=None,
                       label_smoothing: float = 0.0, implementation: str = "auto"):
    """`cross_entropy(hidden @ kernel + bias, targets, weights, label_smoothing)` with the
    logits [..., V] in the matmul's dtype (bfloat16 under mixed precision, as a model's
    head computes them), and the loss by `implementation` (LOSS_KERNELS).

    hidden [..., D], kernel [D, V], bias [V] or None, targets [...] ints, weights [...]
    (default all 1). Returns (loss, {"accuracy"}) as cross_entropy.

    With "pallas", under differentiation the forward pass computes the gradient too, as
    chunked_head_cross_entropy does: the gradient kernel writes dz = (softmax - q)·w/Σw
    over the logits, then dhidden = dz·kernelᵀ and dkernel = hiddenᵀ·dz (and dbias =
    Σ dz) are computed at once, and the backward pass only scales them by the loss's
    cotangent. The logits are read twice and written once in all (XLA's loss reads them
    three times), dz written over their buffer. Weights are constants (no gradient), as
    for the chunked head. Under a mesh each device runs the kernels on its own rows
    (hidden [B, T, D]: B and T split as the logical rules split batch and length)."""
    _check_label_smoothing(label_smoothing)
    if kernel.ndim != 2 or kernel.shape[0] != hidden.shape[-1]:
        raise ValueError(f"kernel has shape {kernel.shape}; valid: [D, V] with D = "
                         f"{hidden.shape[-1]} (hidden's last axis, hidden {hidden.shape})")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets has shape {targets.shape}; valid: {hidden.shape[:-1]} "
                         f"(hidden's leading axes)")
    dtype = jnp.result_type(hidden.dtype, kernel.dtype)
    if choose_loss_kernel(implementation, dtype, kernel.shape[1]) == "xla":
        logits = matmul(hidden, kernel)
        if bias is not None:
            logits = logits + bias.astype(logits.dtype)
        return cross_entropy(logits, targets, weights, label_smoothing)  # checks the targets
    check_targets(targets, kernel.shape[1], weights)
    weights = (jnp.ones(targets.shape, jnp.float32) if weights is None
               else jnp.asarray(weights).astype(jnp.float32))
    scale = lax.stop_gradient(weights / _weight_total(weights))  # w / Σw
    loss, accuracy = _kernel_head_loss(float(label_smoothing), hidden, kernel, bias,
                                       targets.astype(jnp.int32), scale)
    return loss, {"accuracy": accuracy}


def _head_logits(h, kernel, bias):
    """h [..., D] · kernel [D, V] (+ bias) -> logits [..., V] in the matmul's dtype."""
    z = matmul(h, kernel)
    return z if bias is None else z + bias.astype(z.dtype)


def _on_rows(fn, logits, *rows):
    """fn(logits [M, V], *rows [M]) of loss_kernel.py on logits [..., V] and rows [...],
    its outputs shaped back to [...] (and [..., V]). Under a mesh of several devices each
    runs it on its own rows: a shard_map over the leading axes, split as the logical rules
    split batch (axis 0) and length (axis 1) where they divide, else whole."""
    lead = logits.shape[:-1]

    def local(z, *r):
        out = fn(z.reshape(-1, z.shape[-1]), *(x.reshape(-1) for x in r))
        return jax.tree.map(lambda a: a.reshape(z.shape[:-1] + a.shape[1:]), out)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return local(logits, *rows)
    split = []
    for size, logical, names in zip(lead, rows_logical(len(lead)), row_mesh_axes(len(lead))):
        divides = size % math.prod(mesh.shape[a] for a in names) == 0
        if names and not divides:  # correct, but every device computes those rows
            logging.warning("loss kernels: %s %d does not divide over mesh axes %s: each "
                            "device computes the loss of every row along it", logical, size,
                            names)
        split.append(names if names and divides else None)
    if mesh_axes(axes.VOCAB):  # loss_kernel='pallas' asked for where auto says xla
        logging.warning("loss kernels: the mesh splits the vocabulary over %s; each device "
                        "gathers its rows' logits whole (loss_kernel='xla' keeps them split)",
                        mesh_axes(axes.VOCAB))
    row_spec = P(*split)
    spec_of = lambda a: row_spec if a.ndim == len(lead) else P(*split, None)  # noqa: E731
    out = jax.eval_shape(local, logits, *rows)  # the outputs' structure
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_of(logits), *map(spec_of, rows)),
                         out_specs=jax.tree.map(spec_of, out), check_vma=False)(logits, *rows)


def _kernel_terms(smoothing, stats, y, v):
    """(loss, correct) per row, float32 [...], from the kernels' row statistics."""
    lse, target_z, sum_z, first_max = stats
    return (_smoothed_loss(smoothing, lse, target_z, lambda: sum_z / v),
            (first_max == y).astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_head_loss(smoothing, h, kernel, bias, y, scale):
    """(Σ scale·loss, Σ scale·correct) over rows h [..., D], y and scale [...]."""
    statistics = functools.partial(loss_kernel.row_statistics, sums=smoothing != 0)
    stats = _on_rows(statistics, _head_logits(h, kernel, bias), y)
    loss, correct = _kernel_terms(smoothing, stats, y, kernel.shape[1])
    return jnp.sum(scale * loss), jnp.sum(scale * correct)


def _kernel_head_loss_fwd(smoothing, h, kernel, bias, y, scale):
    d, v = kernel.shape
    dtype = jnp.result_type(h.dtype, kernel.dtype)
    gradient = functools.partial(loss_kernel.row_statistics_and_gradient, smoothing=smoothing)
    stats, dz = _on_rows(gradient, _head_logits(h, kernel, bias), y, scale)
    loss, correct = _kernel_terms(smoothing, stats, y, v)
    # Both matmuls accumulate in float32 and round once to the operands' dtype, the
    # dtype autodiff gives them; held to the end of the backward pass, dkernel [D, V]
    # is then half the bytes of a float32 one.
    dh = matmul(dz, kernel.T).astype(h.dtype)
    dkernel = lax.dot_general(h.reshape(-1, d).astype(dtype), dz.reshape(-1, v),
                              (((0,), (0,)), ((), ())))  # [D, V]
    dbias = None if bias is None else jnp.sum(dz.reshape(-1, v).astype(jnp.float32), axis=0)
    # The backward pass is the chunked head's: scale what the forward computed.
    return (jnp.sum(scale * loss), jnp.sum(scale * correct)), (dh, dkernel, dbias, kernel, bias)


_kernel_head_loss.defvjp(_kernel_head_loss_fwd, _fused_head_loss_bwd)
