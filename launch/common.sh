# Sourced by the launch/ scripts: install, then pick the ranks and threads per rank.
#   PY               the Python to run (PYTHON, default python3)
#   SKIP_SETUP=1     skip scripts/setup.sh (nodes without internet: install once, e.g. on the
#                    login node of a shared filesystem)
#   NPROC            ranks on this node (default: one per GPU, else 2)
#   OMP_NUM_THREADS  the cores split between the ranks (1 each when there are at least as many
#                    ranks as cores); a value set by the caller wins
#   MASTER_PORT      run.sh, run_fsdp.sh, elastic.sh: the port of the rendezvous store on
#                    127.0.0.1 (a port from 1 to 65535, free); unset: torchrun --standalone picks
#                    a free one. multinode.sh: --master HOST:PORT (default 29500)
# -h/--help anywhere in the arguments: the example's help, without scripts/setup.sh first (an
# audit: `run.sh --help` ran a pip install before printing it); check_args answers it.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WANTS_HELP=0
for arg in "$@"; do  # sourced without arguments: the launch script's own
    if [[ "$arg" == -h || "$arg" == --help ]]; then
        WANTS_HELP=1
    fi
done
if [[ "${SKIP_SETUP:-0}" != 1 && "$WANTS_HELP" == 0 ]]; then
    bash scripts/setup.sh
fi
PY=${PYTHON:-python3}
# Before anything starts torch: libgomp printed its own complaint about OMP_NUM_THREADS=0 first.
if [[ -n "${OMP_NUM_THREADS:-}" && ! "$OMP_NUM_THREADS" =~ ^[1-9][0-9]*$ ]]; then
    echo "OMP_NUM_THREADS: expected a whole number of threads per rank >= 1, got '$OMP_NUM_THREADS'" >&2
    exit 2
fi
if [[ -n "${NPROC:-}" && ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "--nproc / NPROC: expected a whole number of ranks >= 1, got '$NPROC'" >&2
    exit 2
fi
if [[ -n "${MASTER_PORT:-}" ]] && { [[ ! "$MASTER_PORT" =~ ^[0-9]{1,5}$ ]] \
    || (( 10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535 )); }; then
    echo "MASTER_PORT: expected a port number from 1 to 65535, got '$MASTER_PORT'" >&2
    exit 2
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then  # a bare traceback said neither which Python nor why
    echo "launch: expected torch importable by $PY ($(command -v "$PY" || echo 'not found')), found none:" \
        "run scripts/setup.sh (unset SKIP_SETUP), or set PYTHON to the environment's Python" >&2
    exit 2
fi
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(( GPUS > 0 ? GPUS : 2 ))
fi
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES > NPROC ? CORES / NPROC : 1 ))}
# The ranks' way to tell that torchrun's agent is gone (examples/train_gpt.py,
# leave_with_the_launcher): every launch script execs torchrun, so this shell's pid is the
# agent's. A rank that asks its parent instead, after its imports, already found the init
# process there when the agent died early, and waited out the store's timeout (an audit).
export DISTAMP_LAUNCHER_PID=$$

# check_args SCRIPT ARGS...: validate the example's arguments once, before torchrun starts any
# rank. A bad value is one message and exit code 2 — not one per rank inside torchrun's
# traceback, nor restarted by --max-restarts as if it were a crash (an audit: elastic.sh printed
# a refusal six times over 33 s). --help is answered here.
check_args() {
    local arg
    for arg in "$@"; do
        if [[ "$arg" == -h || "$arg" == --help ]]; then
            exec "$PY" "$@"
        fi
    done
    # The run folders' locks too (a second run on them: exit 2 here, not torchrun's 1 after a
    # traceback, nor restarted by --max-restarts); multinode.sh sets CHECK_RUN_LOCKS=0: another
    # node's rank 0 of the same job may hold them already.
    LOCAL_WORLD_SIZE=$NPROC DISTAMP_CHECK_RUN_LOCKS=${CHECK_RUN_LOCKS:-1} \
        "$PY" "$@" --check-args || exit 2  # LOCAL_WORLD_SIZE: the ranks this node will run
}

# port_taken PORT: prints why PORT cannot be bound here and succeeds when it is taken. Bound as
# torchrun's rendezvous store binds it (SO_REUSEADDR): one in use failed ~13 s later in a torchrun
# traceback (EADDRINUSE; an audit).
port_taken() {
    ! "$PY" - "$1" <<'PYEOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError as e:
    print(e.strerror or e)
    sys.exit(1)
PYEOF
}

# one_node_rdzv: the one-node scripts' rendezvous, in ONE_NODE_RDZV: torchrun --standalone (a free
# port of its choosing), or, with MASTER_PORT, a c10d store this agent hosts on
# 127.0.0.1:MASTER_PORT, checked free first. is_host=1: when the port was taken, torch's own guess
# fell back to joining whatever store held it as a client (c10d_rendezvous_backend's
# _create_tcp_store).
one_node_rdzv() {
    ONE_NODE_RDZV=(--standalone)
    [[ -n "${MASTER_PORT:-}" ]] || return 0
    local port=$((10#$MASTER_PORT)) in_use
    if in_use=$(port_taken "$port"); then
        echo "MASTER_PORT: expected port $port free on 127.0.0.1 (the rendezvous store binds it)," \
            "found: $in_use — another job holds it; pick another port or unset MASTER_PORT" >&2
        exit 2
    fi
    ONE_NODE_RDZV=(--rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$port" --rdzv-conf=is_host=1)
}
