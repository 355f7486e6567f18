# Sourced by the launch/ scripts: install, then pick the ranks and threads per rank.
#   PY               the Python to run (PYTHON, default python3)
#   SKIP_SETUP=1     skip scripts/setup.sh (nodes without internet: install once, e.g. on the
#                    login node of a shared filesystem)
#   NPROC            ranks on this node (default: one per GPU, else 2)
#   OMP_NUM_THREADS  the cores split between the ranks (1 each when there are at least as many
#                    ranks as cores); a value set by the caller wins
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then
    bash scripts/setup.sh
fi
PY=${PYTHON:-python3}
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(( GPUS > 0 ? GPUS : 2 ))
elif [[ ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "--nproc / NPROC: expected a whole number of ranks >= 1, got '$NPROC'" >&2
    exit 2
fi
CORES=$(nproc)
if [[ -n "${OMP_NUM_THREADS:-}" && ! "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*$ ]]; then
    echo "OMP_NUM_THREADS: expected a whole number of threads per rank >= 1, got '$OMP_NUM_THREADS'" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES > NPROC ? CORES / NPROC : 1 ))}
