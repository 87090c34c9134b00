#!/bin/bash
# Rendered by `mhf-dist submit --hostfile` (profile a100-80g): 2 node(s) x 8 rank(s),
# started by DeepSpeed's launcher over ssh/pdsh. Re-run this script after a stop: it resumes.
set -uo pipefail
cd /shared/runs/demo

export NCCL_DEBUG=WARN
export OMP_NUM_THREADS=8
[ -x /opt/venv/bin/python ] || { echo "mhf-dist: "/opt/venv/bin/python" is not on $(hostname): install mhf-dist on storage every node sees, or set python/launcher in the cluster profile" >&2; exit 2; }
# DeepSpeed's launcher forwards only some variables to the other nodes; list the profile's in .deepspeed_env.
cat > .deepspeed_env <<'ENV'
NCCL_DEBUG=WARN
OMP_NUM_THREADS=8
ENV
/opt/venv/bin/python -m deepspeed.launcher.runner --hostfile /shared/hostfile --num_nodes 2 --num_gpus 8 \
  --master_port 29500 --no_local_rank --module mhf_dist train --run-dir /shared/runs/demo --preset 1b-h4b16k --set data.path=/shared/data
