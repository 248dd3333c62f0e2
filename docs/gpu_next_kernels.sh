#!/usr/bin/env bash
# Issue 35, the kernels built without a GPU (docs/gpu_next.md §2), one device call after
# gpu_next.sh's: the Pallas attention reading the fused projection's [B, T, 3, N, H]
# output in place and summing its bias's gradient (attention/pallas.py,
# pallas_packed_attention), and the residual add + LayerNorm as one kernel each way
# (layers/norm_kernel.py). Both built 2026-11-26 on the CPU host, never run on a GPU.
#   mkdir -p .old && git archive aa279c6 attention_jax | tar -x -C .old   # q, k, v apart
#   device run: command "bash docs/gpu_next_kernels.sh", carry [".whl", ".old"], timeout_s 580
# Each measurement is its own process; every output lands in $OUT.
SHAPE=${SHAPE:-gpt2-124m}; PY=${PY:-python3}; DEADLINE=${DEADLINE:-550}
start=$SECONDS
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1
left() { local l=$((DEADLINE - (SECONDS - start))); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
run() {  # name, seconds at most, command...: its output in $OUT/name.txt with its exit status
  local name=$1 limit=$2; shift 2
  echo "== $name at $((SECONDS - start)) s"
  timeout "$(left "$limit")" "$@" > "$OUT/$name.txt" 2>&1; echo "rc $?" >> "$OUT/$name.txt"
}
if [ "$SHAPE" = gpt2-124m ]; then SHAPES=gpt2-124m:16; else SHAPES=$SHAPE; fi
STEP="-m attention_jax.tools.bench train --device gpu --shapes $SHAPES --no-torch --trainer-steps 0 --repeats 5"
# 1. The kernels Triton-compiled against XLA's ops and the float32 reference.
PYTHONPATH=$PWD:/tmp/site run kernel_tests 170 $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/layers/test_norm_kernel.py tests/attention/test_pallas_packed.py
# 2. The bare step, each row its own process: the norms as XLA's ops against the kernels,
# with cuDNN (auto's attention for plain causal rows; q, k, v projected apart) and with the
# Pallas kernels reading q, k, v packed. norm xla against norm pallas is what the norm
# kernels are worth (if slower: `auto` in norms.choose_norm_kernel should answer xla);
# auto against pallas whether auto should take the Pallas attention for causal rows too.
PYTHONPATH=$PWD:/tmp/site run step_kernels 300 $PY $STEP --implementation auto,pallas \
  --norm-kernel xla,pallas --out $OUT/step_kernels.json
# 3. The Pallas step from before the packed q, k, v (q, k, v projected apart, biased by
# XLA; norms as XLA's ops), run from inside .old so that its package is the one imported.
if [ -d .old/attention_jax ]; then
  (cd .old && PYTHONPATH=$PWD:/tmp/site run step_unpacked 80 $PY $STEP --implementation pallas \
    --out $OUT/step_unpacked.json)
fi
echo "== done at $((SECONDS - start)) s"
