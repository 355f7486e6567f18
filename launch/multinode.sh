#!/usr/bin/env bash
# Multi-node training: one torchrun agent per node, all meeting at a rendezvous on the first node.
#
# Fixed membership, node ranks given (torchrun's static rendezvous: a c10d TCPStore on node 0):
#   node0$ bash launch/multinode.sh --nnodes 2 --node-rank 0 --master node0 -- --size small
#   node1$ bash launch/multinode.sh --nnodes 2 --node-rank 1 --master node0 -- --size small
# Elastic (torchrun's c10d rendezvous: nodes join in any order, failed workers are restarted and
# resume from the newest checkpoint; --nnodes 2:4 starts with 2 to 4 nodes; any node but --master
# may fail: the rendezvous store lives in the master node's agent, and without it the job ends on
# every node — launch them all again to resume):
#   every node$ bash launch/multinode.sh --nnodes 2 --rdzv-id job42 --master node0 -- --size small
#
# Options (environment variable in brackets):
#   --nnodes N|MIN:MAX    nodes in the job [NNODES] (default 1)
#   --node-rank R         this node's rank, fixed membership [NODE_RANK]
#   --rdzv-id ID          the job's name, elastic membership [RDZV_ID]
#   --master HOST[:PORT]  the first node as every node reaches it [MASTER_ADDR, MASTER_PORT]
#                         (port default 29500: the rendezvous store)
#   --nproc N             ranks on this node [NPROC] (default: one per GPU, else 2)
#   --iface NAME          network interface for gloo and NCCL [IFACE] (default: the one that
#                         reaches --master, found with `ip`); exported as GLOO_SOCKET_IFNAME and
#                         NCCL_SOCKET_IFNAME
#   --max-restarts K      worker restarts [MAX_RESTARTS] (default 0 fixed, 3 elastic)
#   -- ARGS               the rest goes to examples/train_gpt.py (default: a small GPT, 60 steps,
#                         checkpoints and metrics in runs/multinode, --resume auto)
# Backend: NCCL where this node has GPUs (one rank per GPU), gloo otherwise.
#
# Every node needs: this checkout at the same path and its Python environment (SKIP_SETUP=1 skips
# the install, for nodes without internet), TCP from every node to --master's port and between
# all nodes on any port (gloo/NCCL), iproute2's `ip` to find the interface (or --iface), and,
# for --ckpt-dir and --resume, a filesystem every node shares (rank 0 writes metrics and pictures).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-}
RDZV_ID=${RDZV_ID:-}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-29500}
IFACE=${IFACE:-}
IFACE_GIVEN=${IFACE:+1}
MAX_RESTARTS=${MAX_RESTARTS:-}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nnodes|--node-rank|--rdzv-id|--master|--nproc|--iface|--max-restarts)
            [[ $# -ge 2 ]] || { echo "multinode.sh: $1 expects a value" >&2; exit 2; } ;;&
        --nnodes) NNODES=$2; shift 2 ;;
        --node-rank) NODE_RANK=$2; shift 2 ;;
        --rdzv-id) RDZV_ID=$2; shift 2 ;;
        --master)
            MASTER_ADDR=${2%:*}
            [[ "$2" == *:* ]] && MASTER_PORT=${2##*:}
            shift 2 ;;
        --nproc) NPROC=$2; shift 2 ;;
        --iface) IFACE=$2; IFACE_GIVEN=1; shift 2 ;;
        --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        --) shift; break ;;
        *) echo "multinode.sh: unknown option '$1' (training arguments go after --)" >&2; usage 2 >&2 ;;
    esac
done
# Checked here, not by torchrun's traceback or a rendezvous that waits for a node that cannot
# come (an audit: --node-rank 3 of 1 node hung silently); first, so that --nnodes 0 is named as
# the mistake rather than a missing --node-rank.
if [[ ! "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] \
    || { [[ "$NNODES" == *:* ]] && (( ${NNODES%:*} > ${NNODES#*:} )); }; then
    echo "multinode.sh: --nnodes expects N or MIN:MAX (whole numbers >= 1, MIN <= MAX), got '$NNODES'" >&2
    exit 2
fi
if [[ -n "$NODE_RANK" && -n "$RDZV_ID" ]]; then
    echo "multinode.sh: give --node-rank (fixed membership) or --rdzv-id (elastic), not both" >&2
    exit 2
fi
# A range is elastic membership: torchrun's static rendezvous waited, silently, for MAX nodes
# (an audit: --nnodes 1:2 --node-rank 0 on one node hung).
if [[ -n "$NODE_RANK" && "$NNODES" == *:* ]]; then
    echo "multinode.sh: --nnodes $NNODES is a range (elastic membership): expected --rdzv-id ID with it, got --node-rank $NODE_RANK (fixed membership wants --nnodes N)" >&2
    exit 2
fi
if [[ -z "$NODE_RANK" && -z "$RDZV_ID" ]]; then
    NODE_RANK=0
    if [[ "$NNODES" != 1 ]]; then
        echo "multinode.sh: with --nnodes $NNODES give --node-rank R or --rdzv-id ID" >&2
        exit 2
    fi
fi
if [[ -z "$MASTER_ADDR" ]]; then
    [[ "$NNODES" == 1 ]] || { echo "multinode.sh: --master HOST is needed with --nnodes $NNODES" >&2; exit 2; }
    MASTER_ADDR=127.0.0.1
fi
if [[ -n "$NODE_RANK" ]]; then
    if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || { [[ "$NNODES" =~ ^[0-9]+$ ]] && (( NODE_RANK >= NNODES )); }; then
        echo "multinode.sh: --node-rank expects a whole number from 0 to $NNODES - 1 (--nnodes $NNODES), got '$NODE_RANK'" >&2
        exit 2
    fi
fi
if [[ ! "$MASTER_PORT" =~ ^[0-9]+$ ]] || (( 10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535 )); then
    echo "multinode.sh: --master HOST:PORT expects a port number from 1 to 65535, got '$MASTER_PORT'" >&2
    exit 2
fi

if [[ -n "$MAX_RESTARTS" && ! "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
    echo "multinode.sh: --max-restarts expects a whole number >= 0, got '$MAX_RESTARTS'" >&2
    exit 2
fi

source "$(dirname "$0")/common.sh"

# The interface that reaches the master: the master's own when it is this node's address, else
# the route's. Left to gloo, the interface is the one the hostname resolves to, which another node
# may not reach (a second NIC, a container's address).
MASTER_IP=$MASTER_ADDR
if [[ ! "$MASTER_ADDR" =~ ^[0-9.]+$ ]]; then
    MASTER_IP=$(getent ahostsv4 "$MASTER_ADDR" | awk '{print $1; exit}' || true)
    [[ -n "$MASTER_IP" ]] || { echo "multinode.sh: cannot resolve --master $MASTER_ADDR" >&2; exit 2; }
fi
IS_MASTER=0
LOCAL_ADDR=
if command -v ip >/dev/null; then
    if [[ -n "$(ip -o -4 addr show to "$MASTER_IP/32" 2>/dev/null)" ]]; then
        IS_MASTER=1
    fi
    if [[ -z "$IFACE" ]]; then
        IFACE=$(ip -o -4 addr show to "$MASTER_IP/32" | awk '{print $2; exit}')
        [[ -n "$IFACE" ]] || IFACE=$(ip -o route get "$MASTER_IP" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' || true)
    fi
    if [[ -n "$IFACE" ]] && ! ip link show dev "$IFACE" >/dev/null 2>&1; then
        echo "multinode.sh: --iface $IFACE: no such interface here ('ip -o link' lists them)" >&2
        exit 2
    fi
    LOCAL_ADDR=$(ip -o -4 addr show dev "$IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}' || true)
elif [[ -z "$IFACE" ]]; then
    echo "multinode.sh: no 'ip' command (iproute2) to find the interface: pass --iface" >&2
fi
# --iface (or IFACE) sets both; the interface found above only fills what the caller left unset
# (an audit: a cluster's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=^docker,lo were overwritten).
if [[ -n "$IFACE" && -n "$IFACE_GIVEN" ]]; then
    export GLOO_SOCKET_IFNAME=$IFACE NCCL_SOCKET_IFNAME=$IFACE
elif [[ -n "$IFACE" ]]; then
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$IFACE} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$IFACE}
fi
SOCKET_NOTE=  # the caller's own choice, when it is not the interface above
if [[ -n "${GLOO_SOCKET_IFNAME:-}" && "${GLOO_SOCKET_IFNAME:-}" != "$IFACE" ]]; then
    SOCKET_NOTE="(GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME) "
fi
BACKEND=gloo
if (( GPUS > 0 )); then
    BACKEND=nccl
fi

RDZV=()
if [[ -n "$RDZV_ID" ]]; then
    # c10d: the agent on the master's node hosts the store; say which one that is instead of
    # letting torch guess from the hostname (it misses a master address on a second NIC). Ranks
    # go by the nodes' addresses (--local-addr). A loopback master (several "nodes" on one
    # machine, to try the job out) is left to torch: an explicit is_host=1 on every agent there
    # made all but the first fail to bind and the first wait out the rendezvous timeout (an
    # audit); torch's own guess lets the later ones join as clients.
    HOST_CONF=is_host=$IS_MASTER
    [[ "$MASTER_IP" == 127.* ]] && HOST_CONF=
    CONF=$HOST_CONF${RDZV_CONF:+${HOST_CONF:+,}$RDZV_CONF}
    RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_IP:$MASTER_PORT" --rdzv-id="$RDZV_ID"
          ${CONF:+--rdzv-conf="$CONF"} --max-restarts="${MAX_RESTARTS:-3}")
    # After a restart the workers of every node must meet in a store with no keys of the dead
    # attempt. The agents' shared store keeps them, and the attempt number that could tell them
    # apart differs between nodes (the node that failed counts a restart, the others restart
    # for the membership change and do not: pytorch/pytorch#135712), so the workers hung in
    # init_process_group. Unshared, rank 0 hosts a fresh store for every attempt.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
else
    RDZV=(--node-rank="$NODE_RANK" --master-addr="$MASTER_IP" --master-port="$MASTER_PORT"
          --max-restarts="${MAX_RESTARTS:-0}")
    # Node rank 0 hosts the store on --master's port (port_taken: launch/common.sh).
    if (( 10#$NODE_RANK == 0 )) && in_use=$(port_taken "$MASTER_PORT"); then
        echo "multinode.sh: --master $MASTER_ADDR:$MASTER_PORT: expected the port free on node rank 0" \
            "(it hosts the rendezvous store there), found: $in_use — another job holds it; pick another port" >&2
        exit 2
    fi
fi
if [[ -n "$LOCAL_ADDR" ]]; then
    RDZV+=(--local-addr="$LOCAL_ADDR")
fi
if [[ $# -eq 0 ]]; then
    set -- --size small --steps 60 --log-every 10 --ckpt-dir runs/multinode --save-every 20 \
        --run-dir runs/multinode --resume auto
fi
echo "multinode.sh: $(hostname) | ${RDZV_ID:+elastic rendezvous $RDZV_ID, }nodes $NNODES${NODE_RANK:+, node rank $NODE_RANK}" \
    "| master $MASTER_IP:$MASTER_PORT$( ((IS_MASTER)) && echo ' (this node)') | interface ${IFACE:-?}" \
    "(${LOCAL_ADDR:-?}) ${SOCKET_NOTE}| backend $BACKEND | $NPROC ranks x $OMP_NUM_THREADS threads" >&2
set -- examples/train_gpt.py --backend "$BACKEND" --threads "$OMP_NUM_THREADS" "$@"
CHECK_RUN_LOCKS=0 check_args "$@"  # (the ranks' own lock still refuses a second job)
exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" "${RDZV[@]}" "$@"
