#!/usr/bin/env bash
# Run pytest node ids N times each, optionally beside CPU burners, and count the passes: the proof
# that a timing-, signal- or teardown-dependent test is deterministic.
#   .ci/repeat.sh N BURNERS NODEID [NODEID ...]
# Prints "NODEID: P/N passed (burners B)" per test; exits 1 if any run failed (its log is kept in
# $REPEAT_LOGS, default /tmp/mpipar-repeat).
set -u
n=$1 burners=$2
shift 2
logs=${REPEAT_LOGS:-/tmp/mpipar-repeat}
mkdir -p "$logs"
pids=()
for _ in $(seq 1 "$burners"); do
  ( while :; do :; done ) &
  pids+=($!)
done
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done' EXIT
status=0
for node in "$@"; do
  pass=0
  for i in $(seq 1 "$n"); do
    log="$logs/$(echo "$node" | tr -c 'A-Za-z0-9_.-' _)-b$burners-$i.log"
    if timeout 600 python -m pytest -q -p no:cacheprovider "$node" >"$log" 2>&1; then
      pass=$((pass + 1)); rm -f "$log"
    else
      status=1
    fi
  done
  echo "$node: $pass/$n passed (burners $burners)"
done
exit $status
