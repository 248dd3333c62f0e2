#!/usr/bin/env bash
# Issue 35's second device call, as one command (docs/gpu_next.md §1): run it from the
# repository root with `.whl` carried (../shared/device/prepare_wheels.sh fills it):
#   device run: command "bash docs/gpu_next.sh", carry [".whl"], timeout_s 580
# Each measurement is its own process (one JAX each); every output lands in $OUT.
# DEADLINE: seconds for all of it; the parts come in order of what they decide.
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The save window: the packed format (448 arrays written as 5) against one array per array.
SAVE="$PY -m attention_jax.tools.bench profile --save --saves 4 --shape $SHAPE"
run save_packed 95 $SAVE --out /tmp/save_packed
run save_per_array 95 $SAVE --packed off   # as on 2026-11-26, the save programs' objects frozen
# Python hands the interpreter to a thread that wants it every 5 ms: the launching thread,
# back from a step's dispatch, may wait that long behind a save's Python work each time.
# At 0.5 ms (on the CPU host, one array per array: 50.6 against 63.4 ms a later save).
run save_packed_switch 95 $SAVE --switch-interval 0.0005
# 2. The host's launch of a step without updating XLA's CUDA graphs (command_buffer::update
# held the launching thread 19.6 of each 34.8 ms on 2026-11-26): addresses kept by
# remapping (XLA's VMM allocator), so a save's pauses of the interpreter find more steps
# queued ahead of the device. The same save profile with it.
run save_never_update 95 env XLA_FLAGS=--xla_gpu_command_buffer_update_mode=NEVER_UPDATE $SAVE
# 3. The head's loss by itself, XLA's against the loss kernels (forward, forward + backward).
run loss_alone 60 $PY -m attention_jax.tools.bench loss --out $OUT/loss_alone.json
echo "== done at $((SECONDS - start)) s"
