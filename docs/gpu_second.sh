#!/usr/bin/env bash
# Issue 35's second device call (docs/gpu_next.md §0), right after gpu_first.sh while the
# machine is warm (it goes back 30 s after a call): the attention kernels' tiles, the norm
# kernels' launch settings and GPT-2 medium's MFU (the trainer's rows: a later call, §0).
#   device run: command "bash docs/gpu_second.sh", carry [".whl"], timeout_s 285
# Each measurement is its own process; every output lands in $OUT.
DEADLINE=${DEADLINE:-272}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The packed attention kernels' tiles at GPT-2's shape (in the step on 2026-11-26:
# dK/dV 2.45 ms, dQ 2.00, forward 1.69 of the 6.15 of attention; alone 172 TFLOP/s
# forward and forward + backward): defaults against four settings. Since then each
# score costs a third fewer SASS instructions (`bench gpu-hlo --kernel-code`: the
# forward's loop 450 -> 326 a tile, dQ's 401 -> 273, dK/dV's 506 -> 394). Compiled for
# an H100 on the CPU host (registers -> programs an SM; README, "What an SM holds"): the
# defaults hold 2 programs an SM in each kernel (dK/dV 210 registers, 4 warps: 8 warps an
# SM); bwd=32x64 holds 3 (149 registers); fwd=64x64,warps=4 holds 4 forward and 3 dQ
# programs; bwd=64x128,bwd_warps=8 and fwd=128x128 hold 1 (fewer loads of Q and dO, or
# of K and V, a score); bwd=128x64,bwd_warps=8 (244 registers, 1 an SM) is left out.
run tiles 95 $PY -m attention_jax.tools.bench attention --width 768 --sizes 1024 --head-dims 64 \
  --masks causal,docs --implementations pallas --qkv packed --no-torch --pallas-tiles \
  bwd=32x64 bwd=64x128,bwd_warps=8 fwd=64x64,warps=4 fwd=128x128,warps=8 \
  --out $OUT/tiles.json
# 2. The residual add and LayerNorm alone (`bench norm`, GPT-2 small's [16384, 768]):
# the kernels' defaults (8 rows a step, 4 warps: about 100 barriers a step of the
# backward, 255 registers, compiled for an H100 on a CPU host) against one row a step in
# one warp (no barrier, 206 registers), one row in four warps (56 registers: 9 programs,
# 36 warps, an SM where the defaults' backward has 8 warps; 14 barriers a row), two rows
# in two warps and four in four (168 and 196 registers, fewer barriers; none of these
# spills; two rows in one warp would). One row in one warp with 32 rows a program is
# left out: its 512 backward programs fill 0.48 of the SMs' places (8 warps each).
# The norm kernels took 2.35 ms of the step on 2026-11-26, where their bytes take 1.48
# at the bandwidth. Each row's value and gradients' Σ g² say whether it computes the
# same (the GPU tests check the defaults only).
run norm 60 $PY -m attention_jax.tools.bench norm --repeats 3 --pallas-settings \
  rows=1,program_rows=16,warps=1 rows=1,program_rows=16,warps=4 \
  rows=2,program_rows=16,warps=2 rows=4,program_rows=64,warps=4 --out $OUT/norm.json
# 2b. The same at GPT-2 medium's batch 8 ([8192, 1024]): the defaults, whose backward now
# walks 32 rows a program there (256 programs; session 23, untimed), against the 64 it
# walked before (128 programs, one an SM of the two that fit), given as a setting.
run norm_medium 22 $PY -m attention_jax.tools.bench norm --rows 8192 --width 1024 \
  --norm-kernel pallas --repeats 3 --pallas-settings program_rows=64 --out $OUT/norm_medium.json
# 3. GPT-2 medium, whose target is 50% MFU (no peer: about 65 s a row; 45.5 ms, 44.1%,
# with cuDNN before the fold). Since session 23 the norm backward's grid at this batch
# fills the SMs (256 programs of 32 rows; it was 128 of 64, half an H100's places).
run medium 85 $PY -m attention_jax.tools.bench train --device gpu --shapes gpt2-medium:8 \
  --no-torch --trainer-steps 0 --repeats 5 --out $OUT/medium.json
echo "== done at $((SECONDS - start)) s"
