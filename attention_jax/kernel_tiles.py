"""What the package's row-wise Pallas kernels for Triton share (models/loss_kernel.py,
layers/norm_kernel.py): where they run interpreted, their compiler parameters, and how a
row too long or too odd for one load is cut (Triton's loads have power-of-two sizes).
"""

from __future__ import annotations

from attention_jax.attention.call import target_backend


def interpret_off_gpu(interpret) -> bool:
    """`interpret` as given, or (None) True unless lowering for an NVIDIA GPU: Triton's
    kernels compile for those only, elsewhere they run in interpret mode (tests)."""
    return target_backend() != "gpu" if interpret is None else bool(interpret)


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Triton's compiler parameters for a pallas_call (None when interpreted)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # only meaningful when lowering to Triton
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def power_of_two_pieces(length: int, start: int = 0) -> list[tuple[int, int]]:
    """[(start, size)] covering [start, start + length) in descending powers of two (the
    set bits of length, largest first): 768 -> (0, 512), (512, 256)."""
    pieces, size = [], 1 << max(length.bit_length() - 1, 0)
    while length:
        if size <= length:
            pieces.append((start, size))
            start, length = start + size, length - size
        size //= 2
    return pieces
