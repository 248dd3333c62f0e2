#!/usr/bin/env bash
# Issue 35's second device call (docs/gpu_next.md §0), right after gpu_first.sh while the
# machine is warm (it goes back 30 s after a call): the trainer's rows with the new
# launch defaults, both packings (its jitted step alone on a real batch, then main.py's
# own logged tokens/s over 60 steps), beside the bare step of the same call.
#   device run: command "bash docs/gpu_second.sh", carry [".whl"], timeout_s 315
# On 2026-11-27 a 250 s call ran out during main.py's packed-documents row; stream rows:
# bare 30.94 ms, trainer step 31.17, main.py 31.63.
DEADLINE=${DEADLINE:-302}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
run trainer 300 $PY -m attention_jax.tools.bench train --device gpu --shapes gpt2-124m:16 \
  --no-torch --repeats 5 --packing stream,documents --trainer-steps 60 --out $OUT/trainer.json
echo "== done at $((SECONDS - start)) s"
