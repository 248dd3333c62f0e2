"""jax.nn.dot_product_attention behind this package's masks: the "xla" and "cudnn" backends.

jax.nn says causal, right padding (key_value_seq_lengths) and a causal left window in
its own arguments, which cuDNN's fused kernel turns into skipped tiles. Anything else
becomes one dense [B, N, T, S] mask, which is why "auto" sends cuDNN only what those
arguments express (`cudnn_auto_refusal`) and never picks "xla".
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attention_jax.attention.call import AttentionCall, Platform
from attention_jax.attention.masks import dense_mask


def xla(q, k, v, call: AttentionCall):
    """jax.nn's XLA path: q [B, T, N, H], k [B, S, K, H], v [B, S, K, H] -> [B, T, N, H]."""
    return _jax_nn(q, k, v, call, "xla")


def cudnn(q, k, v, call: AttentionCall):
    """jax.nn's fused cuDNN kernel (NVIDIA GPUs, float16/bfloat16), same shapes."""
    return _jax_nn(q, k, v, call, "cudnn")


def xla_refusal(call: AttentionCall, platform: Platform, name: str = "xla") -> Optional[str]:
    """jax.nn takes one head dim for q, k and v (it failed inside with "value shape
    should be ..."), and no float64: its softmax runs in float32 whatever the inputs, so
    float64 came back as float64 ~1e-7 from the float64 formula, not ~1e-15 - a silent
    loss of the precision asked for (jax 0.10 `_dot_product_attention_core`)."""
    if call.dtype == jnp.float64:
        # Pallas runs float64 only interpreted, on CPU (pallas.refusal).
        pallas = ", 'pallas'" if platform.backend == "cpu" else ""
        why = ("cuDNN's fused kernel runs float16/bfloat16 only" if name == "cudnn" else
               "jax.nn.dot_product_attention computes its softmax in float32 whatever the "
               "inputs' dtype")
        return (f"implementation={name!r} cannot compute float64: {why}. Valid for float64: "
                f"'auto', 'reference', 'blockwise'{pallas}")
    if call.value_dim == call.head_dim:
        return None
    return (f"implementation={name!r}: v's head dim Hv={call.value_dim} differs from q's "
            f"and k's H={call.head_dim}, which jax.nn.dot_product_attention cannot take. "
            f"Valid here: 'auto', 'reference', 'blockwise', 'pallas'")


def cudnn_refusal(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why cuDNN cannot run at all here: it needs an NVIDIA GPU, and jax.nn's one head dim."""
    if not platform.nvidia:
        return (f"implementation='cudnn' needs an NVIDIA GPU; this backend is "
                f"{platform.backend!r}. Valid here: 'auto', 'reference', 'blockwise', "
                f"'pallas', 'xla'")
    return xla_refusal(call, platform, "cudnn")


def cudnn_auto_reason(call: AttentionCall, platform: Platform) -> Optional[str]:
    """On NVIDIA GPUs "auto" looks at cuDNN first (after ring): its reason for taking it."""
    return "cuDNN expresses this mask through its own arguments" if platform.nvidia_gpu else None


def cudnn_auto_refusal(call: AttentionCall, platform: Platform) -> Optional[str]:
    """Why "auto" passes cuDNN over: what jax.nn's arguments cannot say would reach cuDNN
    as a dense mask (or not at all: jax.nn checks dtype and head dim)."""
    spec = call.spec
    if call.dtype not in (jnp.float16, jnp.bfloat16):
        return f"dtype {jnp.dtype(call.dtype).name}: cuDNN runs float16/bfloat16 only"
    if call.head_dim % 8 or call.head_dim > 128:
        return f"head dim {call.head_dim}: cuDNN needs a multiple of 8, at most 128"
    if spec.q_segment_ids is not None:
        return "segment ids (or kv_mask): cuDNN has no argument for them"
    if spec.mask is not None:
        return "a dense mask: cuDNN would take it as an N×N bias"
    if not call.offset_is_zero:
        return "a query offset: cuDNN's causal mask starts at query 0"
    if spec.window is not None and not spec.causal:
        return f"window {spec.window} without causal: cuDNN takes left windows with causal only"
    if spec.causal and call.q_len != call.kv_len:
        return (f"causal cross-attention (T={call.q_len}, S={call.kv_len}): left to the kernels "
                f"that define it")
    return None


def rows_with_keys(call: AttentionCall):
    """[B, T] bool: which queries see a key, for the masks jax.nn takes in its own
    arguments (causal from query 0, right padding, a causal left window), or None where
    every query does. Only padding hides every key from a row: all of them where a row has
    no real key, and with a left window L, query t's keys t - L..t where they start at
    or past the row's length (jax.nn's rows without a key come back as the mean of v)."""
    spec = call.spec
    if spec.kv_lengths is None:
        return None
    lengths = spec.kv_lengths[:, None]  # [B, 1]
    seen = jnp.broadcast_to(lengths > 0, (call.batch, call.q_len))
    if spec.window is not None and spec.causal:
        t = jnp.arange(call.q_len, dtype=jnp.int32)[None, :]
        seen = seen & (t - spec.window[0] < lengths)
    return seen


def _jax_nn(q, k, v, call: AttentionCall, implementation: str):
    """jax.nn.dot_product_attention, with the mask in its own arguments where they can say it."""
    spec = call.spec
    structural = (spec.q_segment_ids is None and spec.mask is None and call.offset_is_zero
                  and (spec.window is None or (spec.causal and implementation == "cudnn")))
    if structural:
        window = None if spec.window is None else (spec.window[0], 0)
        y = jax.nn.dot_product_attention(
            q, k, v, scale=call.scale, is_causal=spec.causal,
            key_value_seq_lengths=spec.kv_lengths, local_window_size=window,
            implementation=implementation)
        seen = rows_with_keys(call)
        if seen is not None:  # a row of no visible key is zero, as on every path
            y = jnp.where(seen[:, :, None, None], y, 0)
        return y
    full = dense_mask(spec, call.batch, call.heads, call.kv_heads, call.q_len, call.kv_len)
    y = jax.nn.dot_product_attention(q, k, v, scale=call.scale, mask=full,
                                     implementation=implementation)
    if full is not None:  # jax.nn gives rows with no visible key the mean of v
        any_visible = jnp.any(full, axis=-1)  # [B, N, T]
        y = jnp.where(jnp.transpose(any_visible, (0, 2, 1))[..., None], y, 0)
    return y
