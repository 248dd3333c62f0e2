#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): where the bare step's 30.3 ms go
# now (H200, 2026-11-28, with the launch defaults of 2026-11-27), GPT-2 medium with those
# defaults, cuDNN's GEMM fusions as an XLA flag, and the H = 128 forward's tiles. Then,
# on the still-warm machine, docs/gpu_second.sh.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 490
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it. The kernels did
# not change since their GPU tests passed on 2026-11-28; if they have, run those tests
# first (this script's step 1 of that day, in its git history).
DEADLINE=${DEADLINE:-475}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The bare step's profile, GPT-2 small at batch 16: the kernels by time, grouped
# (matmuls, attention, norms, GELU, loss, AdamW, casts), to say what is left between
# 30.3 ms and the 27.8 ms of 1.2x the peer (about 60 s).
run profile 110 $PY -m attention_jax.tools.bench profile --shape $SHAPE --batch 16 --top 40
# 2. GPT-2 medium with the new defaults (42.94 ms, 46.8% MFU on 2026-11-27 with the old
# ones), and GPT-2 small beside, ours only (about 45 s a row).
run steps 130 $PY -m attention_jax.tools.bench train --device gpu --no-torch \
  --shapes gpt2-124m:16 gpt2-medium:8 --trainer-steps 0 --repeats 5 --out $OUT/steps.json
# 3. cuDNN's GEMMs taking the bias adds and GELU into their epilogues: its own command,
# so a flag the GPU's XLA refuses loses only this row (the CPU host's XLA takes it).
run gemm_fusion 110 $PY -m attention_jax.tools.bench train --device gpu --no-torch \
  --shapes gpt2-124m:16 --trainer-steps 0 --repeats 5 \
  --xla-flags=--xla_gpu_cudnn_gemm_fusion_level=3 --out $OUT/gemm_fusion.json
# 4. The H = 128 forward at T = 4096 with 128 x 32 tiles (two programs an SM where the
# default 128 x 64 holds one; the standing plan's 450 TFLOP/s is not met).
run h128_tiles 100 $PY -m attention_jax.tools.bench attention --sizes 4096 --head-dims 128 \
  --masks causal --implementations pallas --no-torch \
  --pallas-tiles fwd=128x32 fwd=128x32,stages=4 --out $OUT/h128_tiles.json
echo "== done at $((SECONDS - start)) s"
