#!/usr/bin/env bash
# FSDP2 + distamp: install, then train the example GPT sharded with FSDP on one node.
#
#   bash launch/run_fsdp.sh                                   # 2 ranks, tiny model, 20 steps
#   NPROC=4 bash launch/run_fsdp.sh --size small --steps 50   # arguments go to train_gpt_fsdp.py
set -euo pipefail
source "$(dirname "$0")/common.sh"
set -- examples/train_gpt_fsdp.py --threads "$OMP_NUM_THREADS" "$@"
check_args "$@"
one_node_rdzv
exec "$PY" -m torch.distributed.run "${ONE_NODE_RDZV[@]}" --nproc_per_node="$NPROC" "$@"
