"""PyTorch's fused attention as a peer, in a process of its own:
`python -m attention_jax.tools.bench.torch_attention --rows '[[H, T, mask], ...]' --out F`.

SDPA with the FlashAttention-2 backend and with the cuDNN backend, bfloat16, the same
shapes and FLOP count as attention_speed_gpu.py (which starts this). Writes rows in its format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

WIDTH, TOKENS = 2048, 16384


def _time(torch, fn, repeats=7, min_seconds=0.05):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    inner = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", required=True, help="JSON list of [H, T, mask]")
    parser.add_argument("--out", required=True)
    parser.add_argument("--width", type=int, default=WIDTH, help="N·H")
    args = parser.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        raise SystemExit("torch has no CUDA device")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for h, t, mask in json.loads(args.rows):
        b, n = TOKENS // t, args.width // h
        q, k, v = (torch.randn(b, n, t, h, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        causal = mask != "full"
        for name, backend in (("torch_flash", SDPBackend.FLASH_ATTENTION),
                              ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
            row = {"impl": name, "H": h, "T": t, "mask": mask, "width": args.width}
            try:
                with sdpa_kernel(backend):
                    with torch.no_grad():
                        row["fwd_s"] = _time(torch, lambda: sdpa(q, k, v, is_causal=causal))

                    def fwd_bwd():
                        for x in (q, k, v):
                            x.grad = None
                        sdpa(q, k, v, is_causal=causal).float().sum().backward()

                    row["fwd_bwd_s"] = _time(torch, fwd_bwd)
            except Exception as e:  # a backend refusing a shape is a result
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
