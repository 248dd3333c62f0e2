#!/usr/bin/env bash
# Issue 35's first device call (docs/gpu_next.md §0): the kernels whose exponentials are
# now inline PTX (attention/ptx.py) checked on the GPU first, then the bare step against
# the peer, then the loss kernel alone (fewer instructions a logit: is it faster?). Then,
# on the still-warm machine, docs/gpu_second.sh.
#   device run: command "bash docs/gpu_first.sh", carry [".whl"], timeout_s 490
# (.whl: ../shared/device/prepare_wheels.sh fills it.) Each measurement is its own
# process; every output lands in $OUT. DEADLINE: seconds for all of it.
DEADLINE=${DEADLINE:-475}
. docs/gpu_common.sh
export PYTHONPATH=$PWD:/tmp/site
# 1. The GPU tests of the kernels changed on 2026-11-26 (session 21, no GPU then; their
# exponentials and multiply-adds now PTX, attention/ptx.py): the attention's (the packed
# q, k, v the GPT layer hands them; separate q, k, v with no mask and with padding), the
# loss's and the norm's, Triton-compiled, against the float32/float64 references (about
# 20 s a case). A failure here makes every figure after it suspect; rerunning with
# ATTENTION_JAX_INLINE_PTX=0 tells whether the PTX is why.
run gpu_tests 170 env JAX_PLATFORMS=cuda $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/attention/test_pallas_packed.py \
  "tests/attention/test_pallas.py::test_pallas_on_gpu_equals_reference[full]" \
  "tests/attention/test_pallas.py::test_pallas_on_gpu_equals_reference[padding]" \
  tests/models/test_loss_kernel.py tests/layers/test_norm_kernel.py
# 2. The bare step against the PyTorch peer at batch 16 and 32, one call (each row its
# own process, about 35-45 s for ours, more for the peer's compile): 32.5 ms at
# gpt2-124m:16 on 2026-11-26 before the inline exponentials and the leaner loss kernel
# (the peer not run that day; 35.66 on an earlier day).
run peer 220 $PY -m attention_jax.tools.bench train --device gpu \
  --shapes gpt2-124m:16 gpt2-124m:32 --trainer-steps 0 --repeats 5 --out $OUT/peer.json
# 3. The loss alone, XLA's against the kernels, and the kernels with more warps a program
# (fewer rows in flight: does the second read of a row then hit the L2 cache?). The
# kernels took 1.88 ms in the step on 2026-11-26, 44 SASS instructions a logit; now 16.
# Compiled for an H100 on the CPU host, the defaults (chunk 4096, 8 warps, 64 registers)
# hold 4 programs an SM: 528 rows of 100 KB in flight, 50.7 MiB, the whole L2 cache;
# warps=16 holds 3 an SM (38.0 MiB), warps=32 2 (25.3 MiB), warps=16,chunk=8192 2 (25.3
# MiB, the same 32 warps an SM and 16 logits a thread a chunk as the defaults). Since
# session 23 the gradient kernel tells the L2 which reads come again (the statistics'
# loads evict_last, the gradient's loads and stores evict_first; untimed): hints=0 is
# the kernels without those priorities, the A/B.
run loss 80 $PY -m attention_jax.tools.bench loss --loss-kernel xla,pallas --repeats 3 \
  --pallas-settings hints=0 warps=16 warps=32 warps=16,chunk=8192 --out $OUT/loss.json
echo "== done at $((SECONDS - start)) s"
