#!/usr/bin/env bash
# The main job: install, then train the example GPT with torchrun on one node.
#
#   bash launch/run.sh                                  # 2 ranks, small model, 60 steps, O2 (or O0, see below)
#   NPROC=4 bash launch/run.sh --size tiny --steps 20   # arguments go to examples/train_gpt.py
#
# Installs first (scripts/setup.sh: only what is missing; SKIP_SETUP=1 skips it).
# CPU: gloo, one rank per NPROC (default 2). GPUs: NCCL, one rank per GPU unless NPROC says
# otherwise. The script picks the backend itself (NCCL when CUDA is available, else gloo).
# Rank 0 shows a progress bar (plain lines when stdout is not a terminal) and leaves
# runs/main/metrics.jsonl and runs/main/metrics.png, the loss and loss scale over the steps
# (python -m distamp.plot runs/main redraws it). Several machines: launch/multinode.sh, Slurm:
# launch/slurm.sbatch.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ $# -eq 0 ]]; then
    # O2 (O0 on a CPU without bf16 units); a sharded checkpoint every 20 steps under runs/main
    # (see launch/elastic.sh for resuming from them), with the metrics and their picture.
    set -- --size small --steps 60 --log-every 10 --ckpt-dir runs/main --save-every 20 \
        --resume none --run-dir runs/main
fi
set -- examples/train_gpt.py --threads "$OMP_NUM_THREADS" "$@"
check_args "$@"
one_node_rdzv
exec "$PY" -m torch.distributed.run "${ONE_NODE_RDZV[@]}" --nproc_per_node="$NPROC" "$@"
