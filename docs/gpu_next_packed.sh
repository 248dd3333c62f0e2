#!/usr/bin/env bash
# Issue 35, the packed q, k, v (docs/gpu_next.md §2), one device call after gpu_next.sh's:
# the Pallas kernels reading the fused projection's [B, T, 3, N, H] output in place
# (attention/pallas.py, pallas_packed_attention; built 2026-11-26 on the CPU host, never
# run on a GPU) against the package of the commit before them, carried as .old:
#   mkdir -p .old && git archive aa279c6 attention_jax | tar -x -C .old
#   device run: command "bash docs/gpu_next_packed.sh", carry [".whl", ".old"], timeout_s 580
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
# 1. The packed kernels Triton-compiled against the float32 reference (bf16 and f32).
PYTHONPATH=$PWD:/tmp/site run packed_tests 150 $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/attention/test_pallas_packed.py
# 2. The bare step: cuDNN (auto's choice for plain causal rows; q, k, v projected apart)
# against the Pallas kernels reading q, k, v packed. If pallas is faster, auto should take
# the kernels for plain causal rows too (jax_nn.cudnn_auto_refusal or the table's order).
PYTHONPATH=$PWD:/tmp/site run step_packed 220 $PY $STEP --implementation auto,pallas \
  --out $OUT/step_packed.json
# 3. The same Pallas step from the commit before: q, k, v projected apart, biased by XLA.
# Run from inside .old, so that its package is the one imported (python -m puts the
# working directory first on the path).
if [ -d .old/attention_jax ]; then
  (cd .old && PYTHONPATH=$PWD:/tmp/site run step_unpacked 150 $PY $STEP --implementation pallas \
    --out $OUT/step_unpacked.json)
fi
echo "== done at $((SECONDS - start)) s"
