#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): the launch defaults chosen on the
# H200 on 2026-11-27 (the attention's 64x64 forward and dQ tiles in 4 warps at T <= 1024,
# H <= 64; the norm kernels' one row in one warp) checked on the GPU first, then the
# bare step against the peer with a row of the old defaults beside. Then, on the
# still-warm machine, docs/gpu_second.sh.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 490
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
DEADLINE=${DEADLINE:-475}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The GPU tests of the kernels whose defaults changed: the attention's (the packed
# q, k, v the GPT layer hands them; separate q, k, v with no mask and with padding; rows
# of at most 1024, so the new tiles) and the norm's, Triton-compiled, against the
# float32/float64 references (about 20 s a case; 7 passed in 136 s on 2026-11-27 with the
# loss kernel's, left out now). A failure here makes every figure after it suspect.
run gpu_tests 150 env JAX_PLATFORMS=cuda $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/attention/test_pallas_packed.py \
  "tests/attention/test_pallas.py::test_pallas_on_gpu_equals_reference[full]" \
  "tests/attention/test_pallas.py::test_pallas_on_gpu_equals_reference[padding]" \
  tests/layers/test_norm_kernel.py
# 2. The bare step against the PyTorch peer at batch 16 and 32, and our step again with
# the defaults before 2026-11-27 (attention forward and dQ 128x64 in 8 warps; norms 8
# rows a step in 4 warps, 64 rows a backward program): each row its own process, about
# 35-45 s for ours, more for the peer's compile. On 2026-11-27 (the old defaults): ours
# 30.72 / 59.88 ms, the peer 33.14 / 64.80.
run peer 300 $PY -m attention_jax.tools.bench train --device gpu \
  --shapes gpt2-124m:16 gpt2-124m:32 --trainer-steps 0 --repeats 5 \
  --pallas-tiles fwd=128x64,warps=8 --norm-settings rows=8,program_rows=64,warps=4 \
  --out $OUT/peer.json
echo "== done at $((SECONDS - start)) s"
