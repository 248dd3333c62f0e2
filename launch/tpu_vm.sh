#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM slice (e.g. v5e-64: 16 workers of 4 chips).
#
#   TPU=my-v5e-64 ZONE=us-west4-a WORKDIR=/mnt/runs/gpt2 CONFIG=gpt2_gpu \
#       launch/tpu_vm.sh [--config.group.key=value ...]
#
# Runs the same command on all workers at once (gcloud's --worker=all). JAX reads the
# slice's layout from the TPU VM metadata server (coordinator = worker 0, process ids),
# so the command names no address. WORKDIR must be one directory all workers share (a
# gs:// bucket, a bucket mounted with gcsfuse, NFS: README, "Workdirs in object storage").
# Multislice (several slices over the data-centre network): add
# --config.mesh.dcn_data=<number of slices>. Install first, once per slice:
#   gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
#       --command='pip install -U "jax[tpu]" && pip install -e ~/attention_jax'
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE to its zone}"
: "${WORKDIR:?set WORKDIR to a directory every worker shares}"
CONFIG=${CONFIG:-gpt2_gpu}
EXTRA=""
if [ $# -gt 0 ]; then printf -v EXTRA ' %q' "$@"; fi
# Quoted for the remote shell, as the extra overrides are (a path with a space stays one).
printf -v ARGS '%q ' "--config=$CONFIG" "--workdir=$WORKDIR"
COMMAND="python -m attention_jax.main ${ARGS}--config.mesh.distributed=True$EXTRA"
exec gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="$COMMAND"
