#!/usr/bin/env bash
# CI stage: the jobs/ sbatch scripts on a real one-node Slurm cluster on this machine.
#
# Installs Debian's slurmctld, slurmd and munge (apt-get; root), writes a private configuration
# under a temporary directory (own munge socket and key, own ports, nothing under /etc touched),
# starts munged, slurmctld and slurmd, submits every script in jobs/ with sbatch on a tiny model,
# waits with bounded timeouts and asserts on their output, metrics and checkpoints; the daemons
# are stopped and the directory removed whatever happens.
#
#   .ci/slurm.sh            # after .ci/run has created .venv (mpipar editable + the mpich wheel)
#
# Environment: MPIPAR_VENV (default .venv of this checkout), SLURM_CI_KEEP=1 keeps the work
# directory (configuration, daemon logs, job outputs) for inspection.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export MPIPAR_VENV=${MPIPAR_VENV:-$REPO/.venv}
PY=$MPIPAR_VENV/bin/python
CI_NAME=slurm-ci
START=$SECONDS
# shellcheck source=.ci/slurm_lib.sh
source .ci/slurm_lib.sh

[[ $(id -u) == 0 ]] || die "run as root (installs packages, runs slurmd)"
[[ -x $PY ]] || die "$PY missing: create the venv first (.ci/run does)"
install_slurm

# --- cluster -------------------------------------------------------------------------------
WORK=$(mktemp -d /tmp/mpipar-slurm.XXXXXX)
export SLURM_CONF=$WORK/slurm.conf
NODE=$(uname -n | cut -d. -f1)  # slurmd finds its NodeName by the short host name
ok=0

cleanup() {
    local status=$?
    trap - EXIT INT TERM HUP
    set +e
    cancel_jobs
    stop_pid "$WORK/slurmd.pid" slurmd
    stop_pid "$WORK/slurmctld.pid" slurmctld
    stop_pid "$WORK/munged.pid" munged
    (( status != 0 || ok == 0 )) && show_logs
    if [[ ${SLURM_CI_KEEP:-0} == 1 ]]; then say "kept $WORK"; else rm -rf "$WORK"; fi
    say "daemons stopped; exit $status"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 143' INT TERM HUP

start_munge
SLURMCTLD_PORT=16817 SLURMD_PORT=16818 write_slurm_conf mpiparci "$NODE(127.0.0.1)" ""
mkdir -p "$WORK/spool"
# 8 CPUs declared on a smaller machine (config_overrides): 4-rank jobs run two at a time, as
# ranks that outnumber cores do on this 2-core CI machine anyway.
cat >> "$SLURM_CONF" <<EOF
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=10 State=UP
EOF
slurmctld -c
slurmd
wait_nodes_idle 1
say "cluster up: $(sinfo -h -o '%P %D %T %c CPUs %N')"

# --- jobs ----------------------------------------------------------------------------------
# A tiny float64 model: every layout computes the same losses (README: <= 1e-10 relative), so
# the launchers on their layouts and the preempted-and-resumed run must all agree.
STEPS=60
TRAIN_ARGS=(--layers 2 --hidden 32 --heads 4 --kv-heads 2 --seq-len 32 --global-batch-size 8
            --dtype float64 --warmup-steps 2 --steps "$STEPS" --log-every 20)
say "submitting single_node (mpirun, tp 2), multi_node_mpirun (mpirun, sp 2 x tp 2)," \
    "4 ranks each on 1 node"
single=$(submit single_node jobs/single_node.sbatch --ntasks=4 -- --tp 2)
mmpirun=$(submit multi_node_mpirun jobs/multi_node_mpirun.sbatch --nodes=1 --ntasks-per-node=4 \
    -- --sp 2 --tp 2)
expect_completed "$single" single_node
expect_completed "$mmpirun" multi_node_mpirun
check() { "$PY" .ci/check_runs.py "$WORK/jobs" "$@"; }
check run single_node --steps "$STEPS" --layout "world=4 dp=2 tp=2 pp=1 sp=1" --nodes 1 --per-node 4
check run multi_node_mpirun --steps "$STEPS" --layout "world=4 dp=1 tp=2 pp=1 sp=2" --nodes 1 \
    --per-node 4 --ref single_node

# --- preemption ----------------------------------------------------------------------------
say "submitting preemptible (mpirun, tp 2, 4 ranks)"
preempt=$(MPIPAR_LAUNCHER=mpirun submit preemptible jobs/preemptible.sbatch \
    --nodes=1 --ntasks-per-node=4 -- --tp 2 --log-every 1)
preempt_requeue preemptible "$preempt"
expect_completed "$preempt" preemptible
check preempted preemptible --steps "$STEPS" --ref single_node --nodes 1 --per-node 4
ok=1
say "all slurm jobs passed"
