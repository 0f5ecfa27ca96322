# Shared pieces of the CI's Slurm stages, sourced by .ci/slurm.sh (one node, the host) and
# .ci/cluster.sh (namespaced nodes on a bridge): installing Debian's Slurm and munge, the munge
# daemon, the common part of slurm.conf, stopping daemons, submitting jobs and waiting for them,
# and the preemption round trip. The caller sets CI_NAME (its log prefix), START (=$SECONDS),
# REPO, WORK and, for the job helpers, TRAIN_ARGS (arguments every job's training gets).
# shellcheck shell=bash

say() { echo "$CI_NAME: [$((SECONDS - START))s] $*"; }
die() { echo "$CI_NAME: FAIL: $*" >&2; exit 1; }

install_slurm() {  # Debian's slurmctld, slurmd, client and munge, with no service started
    say "installing slurmctld slurmd slurm-client munge $*"
    export DEBIAN_FRONTEND=noninteractive
    local policy= status=0 log=/tmp/$CI_NAME-apt.log
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then  # keep apt from starting the distribution's services
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
    fi
    { apt-get update -q && apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge "$@"; } > "$log" 2>&1 || status=$?
    [[ -n $policy ]] && rm -f "$policy"
    if (( status )); then tail -20 "$log"; die "apt-get failed ($status)"; fi
    rm -f "$log"
}

start_munge() {  # a private munged: own key, socket, pid and log under $WORK
    chmod 755 "$WORK"  # munged wants the socket's directory searchable by everyone
    mungekey -c -k "$WORK/munge.key" -b 1024 >/dev/null
    munged --socket="$WORK/munge.sock" --key-file="$WORK/munge.key" \
        --log-file="$WORK/munged.log" --pid-file="$WORK/munged.pid" --seed-file="$WORK/munged.seed"
}

write_slurm_conf() {  # write_slurm_conf CLUSTER CTLD_HOST(ADDR) SLURMD_SUFFIX: the common options
    # SLURMD_SUFFIX names the per-node files: "" for one slurmd, ".%n" (the node name) for several.
    cat > "$SLURM_CONF" <<EOF
ClusterName=$1
SlurmctldHost=$2
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool$3
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd$3.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd$3.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
MinJobAge=3600
EOF
    mkdir -p "$WORK/state" "$WORK/jobs"
}

wait_nodes_idle() {  # wait_nodes_idle COUNT: until COUNT nodes are idle (60 s)
    local deadline=$((SECONDS + 60))
    while (( SECONDS < deadline )); do
        (( $(timeout 5 sinfo -h -N -t idle -o %N 2>/dev/null | wc -l) >= $1 )) && return 0
        sleep 0.5
    done
    die "fewer than $1 nodes came up: $(timeout 5 sinfo -N 2>&1)"
}

daemon_pid() { [[ -s $1 ]] && cat "$1"; }
stop_pid() {  # stop_pid PIDFILE NAME: TERM, wait up to 10 s, then KILL
    local pid
    pid=$(daemon_pid "$1") || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    say "$2 (pid $pid) ignored SIGTERM; killing it"
    kill -9 "$pid" 2>/dev/null || true
}
cancel_jobs() {  # our cluster's jobs: let them end before the slurmds stop
    [[ -s $WORK/slurmctld.pid ]] || return 0
    scancel --quiet --user=root 2>/dev/null
    for _ in $(seq 60); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.5; done
}
show_logs() {  # the tail of every job output and daemon log, after a failure
    local f
    for f in "$WORK"/jobs/*/*.out "$WORK"/slurmctld.log "$WORK"/slurmd*.log; do
        [[ -f $f ]] || continue
        echo "----- $f (last 40 lines)"; tail -40 "$f"
    done
}

# --- jobs ----------------------------------------------------------------------------------
job_state() { scontrol show job -o "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
job_field() { scontrol show job -o "$1" | grep -o " $2=[^ ]*" | cut -d= -f2; }
submit() {  # submit NAME SCRIPT [sbatch options...] -- [train args...]; prints the job id
    local name=$1 script=$2; shift 2
    local opts=()
    while [[ $1 != -- ]]; do opts+=("$1"); shift; done
    shift
    mkdir -p "$WORK/jobs/$name"
    (cd "$WORK/jobs/$name" && MPIPAR_RUN_DIR=$WORK/jobs/$name/run \
        sbatch --parsable --job-name="$name" --output="$WORK/jobs/$name/job.out" --time=8 \
        "${opts[@]}" "$REPO/$script" "${TRAIN_ARGS[@]}" "$@")
}
wait_done() {  # wait_done JOBID SECONDS: until the job leaves the queue for good
    local state
    for _ in $(seq $(($2 * 2))); do
        state=$(job_state "$1")
        case $state in
            PENDING|RUNNING|CONFIGURING|COMPLETING|REQUEUED|REQUEUE_HOLD|SUSPENDED) sleep 0.5 ;;
            *) echo "$state"; return 0 ;;
        esac
    done
    die "job $1 still $state after $2 s"
}
expect_completed() {  # expect_completed JOBID NAME
    local state code
    state=$(wait_done "$1" 420)
    code=$(job_field "$1" ExitCode)
    [[ $state == COMPLETED && $code == 0:0 ]] || die "job $2 ($1): $state, exit $code"
    say "job $2 ($1) COMPLETED in $(job_field "$1" RunTime) on $(job_field "$1" NodeList)"
}
steps_done() { local f=$WORK/jobs/$1/run/metrics.jsonl; if [[ -f $f ]]; then wc -l < "$f"; else echo 0; fi; }

preempt_requeue() {  # preempt_requeue NAME JOBID [scontrol update FIELD=VALUE...]
    # The signal that --signal=B:USR1@120 would send 2 minutes before the time limit is sent at
    # once, by hand, to the batch shell only (as Slurm does) after 5 steps; the script forwards
    # it, the ranks checkpoint and exit 0, the script requeues the job. The requeued job gets
    # the given fields (e.g. ExcNodeList=...: other nodes) and is released.
    local name=$1 jid=$2 state; shift 2
    for _ in $(seq 1200); do  # at most 240 s until it has trained 5 steps
        (( $(steps_done "$name") >= 5 )) && break
        state=$(job_state "$jid")
        [[ $state == RUNNING || $state == PENDING ]] || die "$name ended before it was signalled: $state"
        sleep 0.2
    done
    (( $(steps_done "$name") >= 5 )) || die "$name trained fewer than 5 steps in 240 s"
    scancel --batch --signal=USR1 "$jid"
    say "sent SIGUSR1 to the batch shell of $name (job $jid) after step $(steps_done "$name")"
    for _ in $(seq 240); do  # until Slurm has requeued it
        [[ $(job_field "$jid" Restarts) -ge 1 ]] && break
        state=$(job_state "$jid")
        if [[ $state != RUNNING && $state != COMPLETING ]]; then
            # Requeued between the two reads (then PENDING or REQUEUED), or really ended.
            [[ $(job_field "$jid" Restarts) -ge 1 ]] && break
            die "$name ended instead of requeueing: $state"
        fi
        sleep 0.5
    done
    [[ $(job_field "$jid" Restarts) -ge 1 ]] || die "$name was not requeued within 120 s"
    # Slurm holds a requeued job for a while (Reason=BeginTime); make it eligible sooner, but not
    # in the second of the requeue: slurmd refuses a credential issued then ("Job credential revoked").
    sleep 2
    scontrol update JobId="$jid" StartTime=now "$@"
    say "$name (job $jid) requeued; released it${*:+ with $*}"
}
