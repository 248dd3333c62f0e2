#!/usr/bin/env bash
# Issue 35's next device call, as one command (docs/gpu_next.md §1): run it from the
# repository root with `.whl` carried (../shared/device/prepare_wheels.sh fills it):
#   device run: command "bash docs/gpu_next.sh", carry [".whl"], timeout_s 420
# Each setting of `bench profile --save` is its own process (one JAX each, ~60 s on an
# H200 for GPT-2 small); every output lands in $OUT. DEADLINE: seconds for all of it.
SHAPE=${SHAPE:-gpt2-124m}; PY=${PY:-python3}; DEADLINE=${DEADLINE:-400}
start=$SECONDS
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
left() { local l=$((DEADLINE - (SECONDS - start))); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
run() {  # name, seconds at most, command...: its output in $OUT/name.txt with its exit status
  local name=$1 limit=$2; shift 2
  echo "== $name at $((SECONDS - start)) s"
  timeout "$(left "$limit")" "$@" > "$OUT/$name.txt" 2>&1; echo "rc $?" >> "$OUT/$name.txt"
}
SAVE="$PY -m attention_jax.tools.bench profile --save --saves 4 --shape $SHAPE"
run save_packed 95 $SAVE --out /tmp/save_packed   # the default: 448 arrays written as 5
run save_per_array 95 $SAVE --packed off   # as on 2026-11-26, the save programs' objects frozen
run save_switch 95 $SAVE --packed off --switch-interval 0.0005   # the interpreter back 10x sooner
run save_packed_again 95 $SAVE
echo "== done at $((SECONDS - start)) s"
