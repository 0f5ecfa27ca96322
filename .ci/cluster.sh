#!/usr/bin/env bash
# CI stage: a Slurm cluster of namespaced nodes on this machine, and the multi-node jobs across it.
#
# Each node is a network + UTS + IPC + mount namespace: its own hostname (node1..node4), its own
# address on a bridge (one veth each), its own System V / POSIX IPC (so UCX does not take the
# other nodes for shared-memory peers: without it, UCX moves "inter-node" messages through
# shared memory and almost nothing crosses the bridge), its own /etc/hosts naming every node, and
# one slurmd with its own spool, pid and log files. slurmctld runs in a namespace of its own ("head"); munged is
# shared (one socket on the filesystem every node sees, as a cluster's shared filesystem). MPI
# traffic between nodes therefore crosses the bridge over TCP, and MPI's node detection
# (COMM_TYPE_SHARED, host names) sees separate nodes. Then, on a tiny float64 model:
#
#   reference    single_node.sbatch, 1 node x 8 ranks, dp2 tp2 pp2, STEPS steps
#   mpirun       multi_node_mpirun.sbatch, 2 nodes x 4 ranks, dp2 tp2 pp2, to step STEPS/2,
#                checkpoint on the shared filesystem
#   resume       multi_node_srun.sbatch, 4 nodes x 2 ranks, dp4 tp2: --resume auto from that
#                checkpoint (another node count and layout), to step STEPS
#   preemptible  preemptible.sbatch (srun), 2 nodes x 4 ranks, tp2 sp2 pp2, SIGUSR1 after 5
#                steps, requeued onto two other nodes, --resume auto, to step STEPS
#   launches     LAUNCHES srun launches of 2 nodes x 2 ranks, every one must start and finish
#   links        python -m mpipar.bench comm on 2 nodes x 2 ranks: the planner's hardware file
#
# and every loss equals the reference's at the same step (<= 1e-10 relative), every job prints
# the node shape MPI saw, and the bridge carried the traffic. Everything (daemons, namespaces,
# bridge, work directory) is removed on exit, also on failure or a signal.
#
#   .ci/cluster.sh          # as root, after .ci/run has created .venv (mpipar + the mpich wheel)
#
# Environment: MPIPAR_VENV (default .venv of this checkout), CLUSTER_LAUNCHES (default 100),
# CLUSTER_KEEP=1 keeps the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CI_NAME=cluster-ci
START=$SECONDS
# shellcheck source=.ci/slurm_lib.sh
source .ci/slurm_lib.sh
export MPIPAR_VENV=${MPIPAR_VENV:-$REPO/.venv}
# A rank stuck in MPI start-up prints its stack and exits after a minute (mpipar/mpi_init.py), and
# the job scripts launch a failed probe again: a start-up hang ends, with its stack, within the
# 420 s a job may take. sbatch passes the environment on to the jobs.
export MPIPAR_INIT_TIMEOUT=${MPIPAR_INIT_TIMEOUT:-60}
PY=$MPIPAR_VENV/bin/python
NODES=4
LAUNCHES=${CLUSTER_LAUNCHES:-100}

[[ $(id -u) == 0 ]] || die "run as root (installs packages, creates namespaces, runs slurmd)"
[[ -x $PY ]] || die "$PY missing: create the venv first (.ci/run does)"
install_slurm iproute2 util-linux

# --- network -------------------------------------------------------------------------------
# A tag and a /24 that no other run on this machine uses: interfaces and namespaces carry the
# tag, the subnet is 10.213.X.0/24 (.1 this host, .2 head, .11.. the nodes).
TAG=mpc$$
for x in $(shuf -i 1-250); do
    [[ -z $(ip -4 addr show to "10.213.$x.0/24") && -z $(ip -4 route show "10.213.$x.0/24") ]] && break
done
NET=10.213.$x
BRIDGE=${TAG}br
WORK=$(mktemp -d /tmp/mpipar-cluster.XXXXXX)
export SLURM_CONF=$WORK/slurm.conf
names=(head)
for i in $(seq "$NODES"); do names+=("node$i"); done
ok=0

address() { [[ $1 == head ]] && echo "$NET.2" || echo "$NET.$((10 + ${1#node}))"; }
netns() { echo "$TAG-$1"; }
veth() { [[ $1 == head ]] && echo "${TAG}h" || echo "${TAG}n${1#node}"; }
on_node() {  # on_node NAME COMMAND...: run COMMAND as a process of node NAME
    local node=$1; shift
    nsenter --net="/run/netns/$(netns "$node")" unshare --uts --ipc --mount sh -c \
        'hostname "$0"; mount --bind "$1" /etc/hosts; shift; exec "$@"' \
        "$node" "$WORK/hosts" "$@"
}
bridge_bytes() {  # bytes the bridge carried out of and into the nodes so far
    local n total=0
    for n in "${names[@]:1}"; do
        total=$((total + $(cat "/sys/class/net/$(veth "$n")/statistics/rx_bytes")))
    done
    echo "$total"
}

cleanup() {
    local status=$? n pid
    trap - EXIT INT TERM HUP
    set +e
    cancel_jobs
    for n in "${names[@]:1}"; do stop_pid "$WORK/slurmd.$n.pid" "slurmd on $n"; done
    stop_pid "$WORK/slurmctld.pid" slurmctld
    stop_pid "$WORK/munged.pid" munged
    for n in "${names[@]}"; do  # anything still running in a node (a stray rank) ends with it
        for pid in $(ip netns pids "$(netns "$n")" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
        ip netns del "$(netns "$n")" 2>/dev/null
    done
    ip link del "$BRIDGE" 2>/dev/null
    (( status != 0 || ok == 0 )) && show_logs
    if [[ ${CLUSTER_KEEP:-0} == 1 ]]; then say "kept $WORK"; else rm -rf "$WORK"; fi
    left=$(ip netns list | grep -c "^$TAG-")
    say "daemons stopped, $left namespaces and $(ip link show "$BRIDGE" 2>/dev/null | wc -l) bridge left; exit $status"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 143' INT TERM HUP

ip link add "$BRIDGE" type bridge
ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
{
    echo "127.0.0.1 localhost"
    for n in "${names[@]}"; do echo "$(address "$n") $n"; done
} > "$WORK/hosts"
for n in "${names[@]}"; do
    ip netns add "$(netns "$n")"
    ip link add "$(veth "$n")" type veth peer name eth0 netns "$(netns "$n")"
    ip link set "$(veth "$n")" master "$BRIDGE" up
    ip -n "$(netns "$n")" addr add "$(address "$n")/24" dev eth0
    ip -n "$(netns "$n")" link set eth0 up
    ip -n "$(netns "$n")" link set lo up
done
say "bridge $BRIDGE $NET.0/24: ${names[*]}"

# --- slurm ---------------------------------------------------------------------------------
start_munge
write_slurm_conf mpiparnet "head($(address head))" ".%n"
# 8 CPUs declared per node on a 2-core machine (config_overrides): ranks outnumber cores here.
for n in "${names[@]:1}"; do
    echo "NodeName=$n NodeAddr=$(address "$n") NodeHostname=$n CPUs=8 State=UNKNOWN" >> "$SLURM_CONF"
    mkdir -p "$WORK/spool.$n"
done
echo "PartitionName=ci Nodes=node[1-$NODES] Default=YES MaxTime=10 State=UP" >> "$SLURM_CONF"
on_node head slurmctld
for n in "${names[@]:1}"; do on_node "$n" slurmd; done
wait_nodes_idle "$NODES"
say "cluster up: $(sinfo -h -N -o '%N(%T,%c CPUs)' | tr '\n' ' ')"

# --- jobs ----------------------------------------------------------------------------------
STEPS=40
HALF=$((STEPS / 2))
TRAIN_ARGS=(--layers 2 --hidden 32 --heads 4 --kv-heads 2 --seq-len 32 --global-batch-size 8
            --dtype float64 --warmup-steps 2 --lr-schedule constant --backend numpy --log-every 10)
CKPT=$WORK/jobs/shared-checkpoints
last=node$NODES
before=$(bridge_bytes)
say "submitting reference (1 x 8 on $last), mpirun (2 x 4 on node[1-2]), preemptible (2 x 4 on node[1-2])"
ref=$(submit reference jobs/single_node.sbatch --nodes=1 --ntasks=8 -w "$last" \
    -- --dp 2 --tp 2 --pp 2 --steps "$STEPS")
mpirun_job=$(submit mpirun jobs/multi_node_mpirun.sbatch --nodes=2 --ntasks-per-node=4 -w node1,node2 \
    -- --dp 2 --tp 2 --pp 2 --steps "$HALF" --save-dir "$CKPT")
preempt=$(MPIPAR_LAUNCHER=srun submit preemptible jobs/preemptible.sbatch --nodes=2 \
    --ntasks-per-node=4 -w node1,node2 -- --tp 2 --sp 2 --pp 2 --steps "$STEPS" --log-every 1)
expect_completed "$mpirun_job" mpirun
say "submitting resume ($NODES x 2, srun) from $CKPT"
resume=$(submit resume jobs/multi_node_srun.sbatch --nodes=4 --ntasks-per-node=2 \
    -- --dp 4 --tp 2 --steps "$STEPS" --save-dir "$CKPT" --resume auto)
preempt_requeue preemptible "$preempt" NodeList=node3,node4
expect_completed "$ref" reference
expect_completed "$resume" resume
expect_completed "$preempt" preemptible
crossed=$(( $(bridge_bytes) - before ))
say "the bridge carried $((crossed / 1024)) KiB between the nodes during the jobs"
(( crossed > 4 * 1024 * 1024 )) || die "only $crossed bytes crossed the bridge: the ranks did not talk over it"

check() { "$PY" .ci/check_runs.py "$WORK/jobs" "$@"; }
check run reference --steps "$STEPS" --layout "world=8 dp=2 tp=2 pp=2 sp=1" --nodes 1 --per-node 8
check run mpirun --steps "$HALF" --layout "world=8 dp=2 tp=2 pp=2 sp=1" --nodes 2 --per-node 4 \
    --ref reference
check run resume --first $((HALF + 1)) --steps "$STEPS" --layout "world=8 dp=4 tp=2 pp=1 sp=1" \
    --nodes 4 --per-node 2 --ref reference
check preempted preemptible --steps "$STEPS" --ref reference --nodes 2 --per-node 4 --moved

# --- srun launches -------------------------------------------------------------------------
say "$LAUNCHES srun launches of 2 nodes x 2 ranks"
launch() {  # launch I: one srun of 2 nodes x 2 ranks as the sbatch scripts launch (OFI netmod)
    local out=$WORK/launches/$1.out
    MPIR_CVAR_CH4_NETMOD=ofi timeout 60 srun --nodes=2 --ntasks-per-node=2 --mpi=pmi2 --kill-on-bad-exit=1 \
        "$PY" -m mpipar.runtime.nodes > "$out" 2>&1 && grep -q "mpipar: 2 node(s) x 2 rank(s)" "$out" \
        && rm "$out"
}
mkdir -p "$WORK/launches"
for w in 0 1 2 3; do  # four at a time, as jobs start on a busy cluster
    (for i in $(seq $((w + 1)) 4 "$LAUNCHES"); do launch "$i" || true; done) &
done
wait
failed=$(find "$WORK/launches" -name '*.out' | wc -l)
for f in "$WORK"/launches/*.out; do [[ -f $f ]] && { say "launch $(basename "$f" .out) failed:"; tail -5 "$f"; }; done
say "srun launches: $((LAUNCHES - failed))/$LAUNCHES started and finished, $failed failed"
(( failed == 0 )) || die "$failed of $LAUNCHES srun launches failed"

# --- links ---------------------------------------------------------------------------------
say "python -m mpipar.bench comm on 2 nodes x 2 ranks (inside a node and across the bridge)"
MPIR_CVAR_CH4_NETMOD=ofi timeout 120 srun --nodes=2 --ntasks-per-node=2 --mpi=pmi2 \
    "$PY" -m mpipar.bench comm --quick --out "$WORK/hardware.json" | grep -v '^$'
"$PY" -c "import sys; from mpipar.plan.step_time import Hardware; hw = Hardware.load(sys.argv[1]); \
assert hw.ranks_per_node == 2 and hw.bandwidth > 0 and hw.intra_bandwidth > 0, hw" "$WORK/hardware.json"
ok=1
say "all cluster jobs passed"
