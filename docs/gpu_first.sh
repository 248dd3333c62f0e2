#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): the Pallas attention with the
# projection's bias folded into its algebra, in the step and alone.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 430
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
DEADLINE=${DEADLINE:-415}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. GPT-2 small's attention as its layer calls it (one [B, T, 3, N, H] projection output
# and its bias), Pallas against cuDNN (q, k, v sliced out and biased for it). The profile
# of 2026-11-26 had the Pallas kernels at 0.198 ms forward and 0.455 backward a layer in
# the step, against 0.118 and 0.309 alone on separate, unbiased q, k, v (2026-11-24).
run attention_packed 110 $PY -m attention_jax.tools.bench attention --width 768 --sizes 1024 \
  --head-dims 64 --masks causal,docs --implementations pallas,cudnn --qkv packed --no-torch \
  --out $OUT/attention_packed.json
# 2. The bare step, auto (cuDNN) against Pallas: 33.24 against 33.70 ms before.
run bare 150 $PY -m attention_jax.tools.bench train --device gpu --shapes $SHAPE:16 \
  --implementation auto,pallas --no-torch --trainer-steps 0 --repeats 5 --out $OUT/bare.json
# 3. The packed kernels, Triton-compiled, against the float32 reference.
run gpu_tests 90 env JAX_PLATFORMS=cuda $PY -m pytest -m gpu -q -p no:cacheprovider \
  tests/attention/test_pallas_packed.py
# 4. Where the Pallas step's time goes now, if time is left.
run profile_pallas 60 $PY -m attention_jax.tools.bench profile --shape $SHAPE --batch 16 \
  --implementation pallas --out /tmp/profile_pallas
cp /tmp/profile_pallas/summary.json $OUT/profile_pallas.json 2>/dev/null
echo "== done at $((SECONDS - start)) s"
