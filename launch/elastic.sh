#!/usr/bin/env bash
# Elastic restart: torchrun restarts the job after a rank dies; the training script resumes from
# the newest complete checkpoint (distamp.latest_checkpoint), at any world size.
#
#   bash launch/elastic.sh                       # demo: rank 1 is SIGKILLed at step 25 of 40,
#                                                # torchrun restarts, training resumes at step 21
#   CKPT=/data/run1 FAIL_AT=0 bash launch/elastic.sh --size small --steps 500 --save-every 50
#   NPROC=4 bash launch/elastic.sh --size tiny --steps 60   # go on past the demo's 40 steps
#                                                # on 4 ranks from its 2-rank checkpoint: no conversion
#
# Environment: NPROC (ranks, default 2), CKPT (checkpoint folder, default runs/elastic),
# MAX_RESTARTS (default 2), FAIL_AT (step of the injected failure on the first attempt, default
# 25; 0 turns it off). Further arguments go to examples/train_gpt.py.
set -euo pipefail
source "$(dirname "$0")/common.sh"
CKPT=${CKPT:-runs/elastic}

if [[ $# -eq 0 ]]; then
    set -- --size tiny --steps 40 --log-every 5
fi
set -- examples/train_gpt.py --threads "$OMP_NUM_THREADS" --ckpt-dir "$CKPT" --run-dir "$CKPT" \
    --save-every 10 --resume auto --fail-at-step "${FAIL_AT:-25}" "$@"
check_args "$@"
one_node_rdzv
exec "$PY" -m torch.distributed.run "${ONE_NODE_RDZV[@]}" --nproc_per_node="$NPROC" \
    --max-restarts="${MAX_RESTARTS:-2}" "$@"
