#!/usr/bin/env bash
# Issue 35's second device call (docs/gpu_next.md §0), right after gpu_first.sh while the
# machine is warm (it goes back 30 s after a call): launch-setting sweeps of two kernels.
#   device run: command "bash docs/gpu_second.sh", carry [".whl"], timeout_s 270
# Each measurement is its own process; every output lands in $OUT.
DEADLINE=${DEADLINE:-255}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The packed attention kernels' tiles at GPT-2's shape (in the step, 2026-11-26: dK/dV
# 2.45 ms, dQ 2.00, forward 1.69 of the 6.15 of attention): defaults against four settings.
run tiles 95 $PY -m attention_jax.tools.bench attention --width 768 --sizes 1024 --head-dims 64 \
  --masks causal,docs --implementations pallas --qkv packed --no-torch --pallas-tiles \
  bwd=64x128,bwd_warps=8 bwd=128x64,bwd_warps=8 fwd=64x64,warps=4 fwd=128x128,warps=8 \
  --out $OUT/tiles.json
# 2. The loss kernel's launch settings (1.88 ms in the step, where a read and a write of
# the logits take 0.98 at the bandwidth: does its second read of a row miss the L2 cache
# because too many rows are in flight?). More warps a program, fewer rows in flight.
run loss 80 $PY -m attention_jax.tools.bench loss --loss-kernel pallas --repeats 3 \
  --pallas-settings warps=16 warps=32 warps=16,chunk=8192 warps=32,chunk=16384 \
  --out $OUT/loss.json
# 3. With what time is left: XLA letting cuDNN's GEMMs take elementwise producers and
# consumers (GELU, bias adds) among the autotuner's choices (the row runs with and
# without the flag); the compile on the CPU host cannot show it (no cuDNN there to fuse
# with: 443 kernels, 20.51 GB either way).
run cudnn_gemm_fusion 90 $PY -m attention_jax.tools.bench train --device gpu \
  --shapes $SHAPE:16 --no-torch --trainer-steps 0 --repeats 5 \
  --xla-flags=--xla_gpu_cudnn_gemm_fusion_level=3 --out $OUT/cudnn_gemm_fusion.json
echo "== done at $((SECONDS - start)) s"
