#!/usr/bin/env bash
# Issue 35's second device call (docs/gpu_next.md §0), right after gpu_first.sh while the
# machine is warm (it goes back 30 s after a call): the trainer's rows with packed
# documents (its jitted step alone on a real batch, then main.py's own logged tokens/s
# over 60 steps), beside the bare step of the same call. Twice (2026-11-27 and -28) a call
# with the `stream` rows first ran out of time during main.py's documents row, so this
# call runs the documents rows alone (stream, 2026-11-28: bare 30.40 ms, trainer step
# 30.80, main.py 31.64).
#   device run: command "bash docs/gpu_second.sh", carry [".whl"], timeout_s 315
DEADLINE=${DEADLINE:-302}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
run trainer 300 $PY -m attention_jax.tools.bench train --device gpu --shapes gpt2-124m:16 \
  --no-torch --repeats 5 --packing documents --trainer-steps 60 --out $OUT/trainer.json
echo "== done at $((SECONDS - start)) s"
