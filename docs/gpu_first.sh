#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): what the H100 run of 2026-11-26 left
# unmeasured, in the order it decides things.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 580
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
if [ "$SHAPE" = gpt2-124m ]; then SHAPES=gpt2-124m:16; else SHAPES=$SHAPE; fi
# 1. The trainer with the loss and norm kernels auto now takes (the bare step with them:
# 33.3 ms on the H100): its jitted step alone and main.py, `stream` rows and packed
# documents. Targets: the trainer step >= 0.95 of the bare step, main.py >= 0.95 of it,
# documents <= 5% over stream.
run trainer_rows 330 $PY -m attention_jax.tools.bench train --device gpu --shapes $SHAPES \
  --no-torch --repeats 5 --packing stream,documents --trainer-steps 60 --out $OUT/trainer_rows.json
# 2. The Pallas attention reading the packed q, k, v for plain causal rows, against auto's
# cuDNN, GPT-2 small and medium: if pallas is faster, auto should take it there
# (attention/__init__.py's dispatch). Medium's row is also the target of 50% MFU.
run bare_pallas 200 $PY -m attention_jax.tools.bench train --device gpu \
  --shapes $SHAPES gpt2-medium:8 --implementation auto,pallas --no-torch --trainer-steps 0 \
  --repeats 5 --out $OUT/bare_pallas.json
echo "== done at $((SECONDS - start)) s"
