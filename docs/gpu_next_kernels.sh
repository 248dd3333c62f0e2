#!/usr/bin/env bash
# Issue 35's third device call (docs/gpu_next.md §2), after gpu_first.sh's (the kernels'
# GPU tests and the loss and norm kernels on or off) and gpu_next.sh's (the save window):
# what the Pallas attention reading the fused projection's [B, T, 3, N, H] output in place
# and summing its bias's gradient (attention/pallas.py, pallas_packed_attention) is worth.
# Built 2026-11-26 on the CPU host, never run on a GPU.
#   mkdir -p .old && git archive aa279c6 attention_jax | tar -x -C .old   # q, k, v apart
#   device run: command "bash docs/gpu_next_kernels.sh", carry [".whl", ".old"], timeout_s 400
# Each measurement is its own process; every output lands in $OUT.
. docs/gpu_common.sh
if [ "$SHAPE" = gpt2-124m ]; then SHAPES=gpt2-124m:16; else SHAPES=$SHAPE; fi
STEP="-m attention_jax.tools.bench train --device gpu --shapes $SHAPES --no-torch --trainer-steps 0 --repeats 5"
# 1. The bare step with the Pallas attention reading q, k, v packed, each row its own
# process: with the norms as XLA's ops (against .old's row below: what the packed layout
# and the in-kernel bias gradient are worth) and with the norm kernels (against
# gpu_first.sh's row "loss pallas, norm pallas", which has cuDNN's attention: whether auto
# should take the Pallas attention for plain causal rows too).
PYTHONPATH=$PWD:/tmp/site run step_kernels 200 $PY $STEP --implementation pallas \
  --norm-kernel xla,pallas --out $OUT/step_kernels.json
# 2. The Pallas step from before the packed q, k, v (q, k, v projected apart, biased by
# XLA; norms as XLA's ops), run from inside .old so that its package is the one imported.
if [ -d .old/attention_jax ]; then
  (cd .old && PYTHONPATH=$PWD:/tmp/site run step_unpacked 80 $PY $STEP --implementation pallas \
    --out $OUT/step_unpacked.json)
fi
echo "== done at $((SECONDS - start)) s"
