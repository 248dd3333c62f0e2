#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): what the H100 runs of 2026-11-26
# left open, in the order it decides things.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 580
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
if [ "$SHAPE" = gpt2-124m ]; then BATCH=16; else BATCH=8; fi
PROFILE="$PY -m attention_jax.tools.bench profile --shape $SHAPE --batch $BATCH"
# 1. Where the bare step's 33.3 ms go now, with the loss and norm kernels (attention auto:
# cuDNN): device time per kind of kernel and the largest ops. The last such profile
# (34.7 ms, before the kernels) had 16.2 ms of matmuls, 4.7 of attention, 12.5 of
# reductions and elementwise kernels; what is left is the bare step's 1.2x target.
run profile_auto 130 $PROFILE --out /tmp/profile_auto
cp /tmp/profile_auto/summary.json $OUT/profile_auto.json 2>/dev/null
# 2. The same with the Pallas attention reading the packed q, k, v: 33.70 ms against
# cuDNN's 33.24 in the step, though 0.427 against 0.477 ms a layer alone (before the
# packed read). Which ops differ says where the step loses it.
run profile_pallas 130 $PROFILE --implementation pallas --out /tmp/profile_pallas
cp /tmp/profile_pallas/summary.json $OUT/profile_pallas.json 2>/dev/null
# 3. GPT-2 medium, auto (cuDNN) against Pallas: the row 2026-11-26's call ran out of time
# for (auto: 45.8-46.3 ms, 43.9% MFU; issue 35 asks 50%).
run medium 170 $PY -m attention_jax.tools.bench train --device gpu --shapes gpt2-medium:8 \
  --implementation auto,pallas --no-torch --trainer-steps 0 --repeats 5 --out $OUT/medium.json
# 4. main.py with saves (gpu_next.md §3): what each save holds and costs its window there.
run train_saves 150 $PY -m attention_jax.tools.bench train --device gpu --shapes $SHAPE:$BATCH \
  --packing stream --no-torch --repeats 3 --trainer-steps 300 \
  --trainer-args='--config.train.checkpoint_every=100' --out $OUT/train_saves.json
echo "== done at $((SECONDS - start)) s"
