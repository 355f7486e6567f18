#!/usr/bin/env bash
# System packages the launch tests use, installed only when missing:
#   ip            (iproute2)                  tests/test_multinode.py: two hosts as network namespaces
#   slurmctld, slurmd, sbatch, munged (slurmctld slurmd slurm-client munge)
#                                             tests/test_slurm.py: a local Slurm cluster
#
#   bash scripts/system-deps.sh            # all of them
#   bash scripts/system-deps.sh iproute2   # only these packages
#
# Quiet, idempotent, and never fatal: where nothing is missing it does nothing; without root or
# apt-get it says what is missing and exits 0, and the tests that need it skip, naming it.
set -uo pipefail
declare -A COMMAND=([iproute2]=ip [slurmctld]=slurmctld [slurmd]=slurmd [slurm-client]=sbatch
                    [munge]=munged)
WANT=("$@")
if [[ ${#WANT[@]} -eq 0 ]]; then
    WANT=(iproute2 slurmctld slurmd slurm-client munge)
fi
MISSING=()
for pkg in "${WANT[@]}"; do
    cmd=${COMMAND[$pkg]:-$pkg}
    if ! command -v "$cmd" >/dev/null && [[ ! -x /usr/sbin/$cmd && ! -x /sbin/$cmd ]]; then
        MISSING+=("$pkg")
    fi
done
[[ ${#MISSING[@]} -eq 0 ]] && exit 0
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "system-deps: missing ${MISSING[*]}; not installed (needs root and apt-get): the tests that use them skip" >&2
    exit 0
fi
LOG=$(mktemp "${TMPDIR:-/tmp}/distamp-system-deps.XXXXXX.log")
# One apt at a time: two pytest workers may ask together.
(
    flock -w 900 9 || exit 1
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq &&
    timeout 900 apt-get install -y -qq --no-install-recommends "${MISSING[@]}"
) 9>"${TMPDIR:-/tmp}/distamp-system-deps.lock" </dev/null >"$LOG" 2>&1
status=$?
if [[ $status -ne 0 ]]; then
    echo "system-deps: apt-get install ${MISSING[*]} failed (exit $status); the tests that use them skip. Its last lines:" >&2
    tail -n 5 "$LOG" >&2
fi
rm -f "$LOG"
exit 0
