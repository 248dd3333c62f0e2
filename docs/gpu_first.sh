#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): the kernels that auto takes on an
# NVIDIA GPU and that no GPU has run yet, checked and timed before anything else.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 580
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. Triton-compiled against XLA's ops and the float32 reference: the loss kernels
# (models/loss_kernel.py), the residual add + norm (layers/norm_kernel.py) and the
# attention kernels reading the packed q, k, v (attention/pallas.py). A failure here means
# auto must not take that kernel: its choose_* function answers xla until it is fixed.
# tests/conftest.py defaults JAX_PLATFORMS to cpu: without cuda here every GPU test skips.
run kernel_tests 240 env JAX_PLATFORMS=cuda $PY -m pytest -q -m gpu -p no:cacheprovider tests/models/test_loss_kernel.py \
  tests/layers/test_norm_kernel.py tests/attention/test_pallas_packed.py
# 2. The bare step with each of the two kernel families on or off (four rows, each its own
# process; attention auto: cuDNN for these plain causal rows). Row (xla, xla) is the step
# as last measured (1.02-1.04x the peer); a family whose pallas rows are slower than its
# xla rows goes back to xla in auto (losses.choose_loss_kernel, norms.choose_norm_kernel).
if [ "$SHAPE" = gpt2-124m ]; then SHAPES=gpt2-124m:16; else SHAPES=$SHAPE; fi
run step_kernels 300 $PY -m attention_jax.tools.bench train --device gpu --shapes $SHAPES \
  --no-torch --trainer-steps 0 --repeats 5 --loss-kernel xla,pallas --norm-kernel xla,pallas \
  --out $OUT/step_kernels.json
echo "== done at $((SECONDS - start)) s"
