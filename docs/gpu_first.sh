#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): the step with auto taking the
# Pallas attention (bias folded in) for GPT-2's plain causal rows, against the peer; the
# trainer's rows with it. Then, on the still-warm machine, docs/gpu_second.sh (sweeps).
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 490
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
DEADLINE=${DEADLINE:-475}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The bare step against the PyTorch peer at batch 16 and 32, one call (each row its
# own process, about 35-45 s for ours, more for the peer's compile): auto now takes the
# Pallas kernels here (32.5 ms against cuDNN's 32.9 at gpt2-124m:16 on 2026-11-26, the
# peer not run that day; 35.66 on an earlier day). Then GPT-2 medium, whose target is
# MFU alone (no peer: about 65 s a row).
run peer 230 $PY -m attention_jax.tools.bench train --device gpu \
  --shapes gpt2-124m:16 gpt2-124m:32 --trainer-steps 0 --repeats 5 --out $OUT/peer.json
run medium 85 $PY -m attention_jax.tools.bench train --device gpu --shapes gpt2-medium:8 \
  --no-torch --trainer-steps 0 --repeats 5 --out $OUT/medium.json
# 2. The trainer's rows with it (its step and main.py, stream rows and packed documents):
# issue 35's trainer targets were met with cuDNN for stream rows (0.99 and 0.98).
run trainer 150 $PY -m attention_jax.tools.bench train --device gpu --shapes $SHAPE:16 \
  --no-torch --repeats 5 --packing stream,documents --trainer-steps 60 --out $OUT/trainer.json
echo "== done at $((SECONDS - start)) s"
