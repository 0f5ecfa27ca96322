#!/usr/bin/env bash
# The device check: everything the GPU half owes, on a fresh CUDA machine with no network, in
# stages that print as they go and leave their logs and a JSON of figures in OUT_DIR.
#
#   jobs/gpu_check.sh OUT_DIR [STAGE...]     (default: every stage, in this order)
#
# Stages: env setup gate kernels engine1 engine2 engine4 engine8 train bf16 moe bench documents ragged tiles profile micro
# (and `tests`, not run by default: kernels and engine1..8 side by side, when device time is short)
# (the results, logs and JSON, also land in OUT_DIR/all.tgz: one file to bring back)
# Wheels for what the machine lacks (pytest-mpi, tomli-w, the cuDNN frontend, an MPI with
# mpiexec if it has none) are taken from ./.whl when present; nothing is downloaded. Runs as
# root under Open MPI are permitted through OMPI_ALLOW_RUN_AS_ROOT (device machines often run as root).
# Each stage is bounded by a timeout; the whole default list runs past 25 minutes, so a short
# run names its stages (e.g. `env setup tests ragged`, 375 s on an H200, then `setup tiles`) and may set
# GPU_CHECK_DEADLINE (seconds): stages not begun by then are skipped, not cut off.
set -uo pipefail
OUT=${1:?usage: jobs/gpu_check.sh OUT_DIR [STAGE...]}; shift
STAGES=${*:-"env setup gate kernels engine1 engine2 engine4 engine8 train bf16 moe bench documents ragged tiles profile micro"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    OMPI_MCA_mpi_yield_when_idle=1
PY=${PYTHON:-python3}
t0=$SECONDS
stage() { echo "=== gpu_check: $1 ($((SECONDS - t0)) s)"; }
# A stage named but not yet begun when GPU_CHECK_DEADLINE seconds have passed is skipped (and
# recorded so): a time-bounded call ends with the summary and all.tgz instead of a stage cut off.
has() {
  [[ " $STAGES " == *" $1 "* ]] || return 1
  if [ -n "${GPU_CHECK_DEADLINE:-}" ] && (( SECONDS - t0 >= GPU_CHECK_DEADLINE )); then
    echo "=== gpu_check: $1 skipped, $((SECONDS - t0)) s >= GPU_CHECK_DEADLINE=$GPU_CHECK_DEADLINE"
    record "$1" skipped
    return 1
  fi
}
record() { echo "$1 $2" >> "$OUT/results.txt"; }   # "stage status" lines; summarised at the end

if has env; then
  stage env
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  $PY - <<'PY' 2>&1 | tee -a "$OUT/device.txt"
import importlib
for m in ("numpy", "cupy", "ml_dtypes", "mpi4py", "h5py", "numba", "threadpoolctl", "torch", "transformers", "cudnn"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__)
PY
fi

if has setup; then
  stage setup
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | grep -v "already exists" | tail -3
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    if ! command -v mpiexec >/dev/null && ls .whl/mpich-*.whl >/dev/null 2>&1; then
      rm -rf /tmp/mpich && mkdir -p /tmp/mpich && (cd /tmp/mpich && unzip -q "$OLDPWD"/.whl/mpich-*.whl)
      D=$(echo /tmp/mpich/mpich-*.data/data); chmod +x "$D"/bin/*
      export PATH=$D/bin:$PATH LD_LIBRARY_PATH=$D/lib:${LD_LIBRARY_PATH:-}
    fi
  fi
  [ -e mpipar/kernels ] || ln -s ../kernels mpipar/kernels
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  $PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
fi

if has gate; then
  stage "gate (NVRTC on the device, sm_80 and sm_90)"
  timeout 300 $PY -m mpipar.kernels.cuda_gate --arch sm_80,sm_90 --json "$OUT/gate.json" \
      > "$OUT/gate.log" 2>&1; rc=$?
  tail -5 "$OUT/gate.log"; record gate $rc
fi

kernels_stage() {   # tests/gpu on one rank (PYTEST_ADDOPTS may spread it over processes)
  timeout 600 $PY -m pytest -q -p no:cacheprovider --color=no tests/gpu > "$OUT/kernels.log" 2>&1
  local rc=$?; tail -15 "$OUT/kernels.log"; record kernels $rc
}
engine_stage() {    # tests/gpu --only-mpi on $1 ranks sharing the GPU
  local n=$1 launch=()
  [ "$n" = 1 ] || launch=(mpiexec -n "$n")
  timeout 900 "${launch[@]}" $PY -m pytest -q -p no:cacheprovider --color=no -p pytest_mpi \
      --only-mpi tests/gpu > "$OUT/engine$n.log" 2>&1
  local rc=$?; grep -a -E "passed|failed|error" "$OUT/engine$n.log" | tail -3; record "engine$n" $rc
}

if has kernels; then
  stage "kernels (tests/gpu, one rank)"
  kernels_stage
fi

for n in 1 2 4 8; do
  has "engine$n" || continue
  stage "engine on $n rank(s) sharing the GPU (tests/gpu --only-mpi)"
  engine_stage "$n"
done

if has tests; then   # kernels and engine1..8 side by side: about 4 minutes instead of 7-8
  stage "tests: tests/gpu on one rank (4 processes) beside --only-mpi on 8 and 4 ranks, then 2 and 1"
  xd=""; $PY -c "import xdist" 2>/dev/null && xd="-n 4"
  (PYTEST_ADDOPTS="$xd" kernels_stage > "$OUT/tests_kernels.out" 2>&1) &
  (engine_stage 8 > "$OUT/tests_engine8.out" 2>&1) &
  (engine_stage 4 > "$OUT/tests_engine4.out" 2>&1) &
  wait
  (engine_stage 2 > "$OUT/tests_engine2.out" 2>&1) &
  (engine_stage 1 > "$OUT/tests_engine1.out" 2>&1) &
  wait
  cat "$OUT"/tests_*.out
fi

if has train; then
  stage "train: --device cuda against the CPU, float32, 50 steps, 8 ranks"
  rm -rf /tmp/runs
  timeout 600 mpiexec -n 8 $PY -m mpipar.train --device cuda --steps 50 --log-every 10 \
      --run-dir /tmp/runs/cuda > "$OUT/train_cuda.log" 2>&1; rc1=$?
  timeout 600 mpiexec -n 8 $PY -m mpipar.train --device cpu --steps 50 --log-every 10 \
      --run-dir /tmp/runs/cpu > "$OUT/train_cpu.log" 2>&1; rc2=$?
  tail -4 "$OUT/train_cuda.log"
  cp /tmp/runs/cuda/metrics.jsonl "$OUT/metrics_cuda.jsonl" 2>/dev/null
  cp /tmp/runs/cpu/metrics.jsonl "$OUT/metrics_cpu.jsonl" 2>/dev/null
  $PY - "$OUT" <<'PY'; rc3=$?
import json, sys
out = sys.argv[1]
runs = {}
for kind in ("cuda", "cpu"):
    with open(f"{out}/metrics_{kind}.jsonl") as fh:
        runs[kind] = [json.loads(line)["loss"] for line in fh if '"loss"' in line]
a, b = runs["cuda"], runs["cpu"]
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"train: {len(a)} steps on cuda, {len(b)} on cpu; largest relative loss difference {worst:.3g}")
json.dump({"steps": [len(a), len(b)], "max_rel_loss_diff": worst}, open(f"{out}/train.json", "w"))
sys.exit(0 if len(a) == len(b) == 50 and worst <= 1e-4 else 1)
PY
  record train "$rc1$rc2$rc3"
fi

if has bf16; then
  stage "bf16: the default run on the GPU in bfloat16 against float32, 50 steps, 8 ranks"
  rm -rf /tmp/runs_bf16
  for dtype in float32 bfloat16; do
    timeout 600 mpiexec -n 8 $PY -m mpipar.train --device cuda --dtype $dtype --steps 50 \
        --log-every 10 --run-dir /tmp/runs_bf16/$dtype > "$OUT/train_$dtype.log" 2>&1
    echo "$dtype exit $?"; tail -3 "$OUT/train_$dtype.log"
    cp /tmp/runs_bf16/$dtype/metrics.jsonl "$OUT/metrics_$dtype.jsonl" 2>/dev/null
  done
  $PY - "$OUT" <<'PY'; rc=$?
import json, sys
out = sys.argv[1]
runs = {}
for dtype in ("float32", "bfloat16"):
    with open(f"{out}/metrics_{dtype}.jsonl") as fh:
        rows = [json.loads(line) for line in fh if '"loss"' in line]
    runs[dtype] = rows
a, b = ([r["loss"] for r in runs[d]] for d in ("float32", "bfloat16"))
tail = {d: sum(r["loss"] for r in runs[d][-10:]) / 10 for d in runs}
speed = {d: sorted(r["tokens_per_s"] for r in runs[d][1:])[len(runs[d][1:]) // 2] for d in runs}
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
rel = abs(tail["bfloat16"] - tail["float32"]) / tail["float32"]
print(f"bf16: {len(b)} steps; mean loss of the last 10: float32 {tail['float32']:.4f}, bfloat16 "
      f"{tail['bfloat16']:.4f} ({rel:.2%}); largest per-step difference {worst:.2%}; median "
      f"tokens/s float32 {speed['float32']:,.0f}, bfloat16 {speed['bfloat16']:,.0f}")
json.dump({"steps": len(b), "tail_rel": rel, "max_rel": worst, "tokens_per_s": speed},
          open(f"{out}/bf16.json", "w"))
sys.exit(0 if len(a) == len(b) == 50 and rel <= 0.03 else 1)
PY
  record bf16 $rc
fi

if has moe; then
  stage "moe: a bf16 mixture-of-experts run, --ep 4 on 8 ranks, GPU against CPU, 10 steps"
  for d in cuda cpu; do
    timeout 300 mpiexec -n 8 $PY -m mpipar.train --device $d --dtype bfloat16 --moe-experts 8 \
        --moe-top-k 2 --ep 4 --steps 10 --log-every 1 --run-dir /tmp/runs_moe/$d \
        > "$OUT/moe_$d.log" 2>&1
    echo "moe $d exit $?"
  done
  # bf16 on two devices: the issue's 1 % per step over 20 steps is the layouts' bound; here 3 %
  timeout 60 $PY -m mpipar.compare --rtol 0.03 --metric loss /tmp/runs_moe/cuda /tmp/runs_moe/cpu \
      > "$OUT/moe_compare.txt" 2>&1; rc=$?
  tail -3 "$OUT/moe_compare.txt"; record moe $rc
fi

if has bench; then
  stage "bench gpu (attention against the GEMM rate; training step against PyTorch eager)"
  timeout 900 $PY -m mpipar.bench gpu --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
  rc=$?; tail -30 "$OUT/bench_gpu.log"; record bench $rc
fi

if has documents; then
  stage "documents: document-masked attention against full causal on the GPU (time / work)"
  timeout 240 $PY -m mpipar.bench documents --seqs 8192 --sps 4 --samples 2 --repeats 5 \
      --backend cupy --json "$OUT/documents.json" > "$OUT/documents.log" 2>&1; rc=$?
  tail -7 "$OUT/documents.log"; record documents $rc
  # float32 on a batch of 8 rows x 32 heads (64 times the row's work for the same launches: what
  # the kernels cost where the host's dispatch does not dominate); bf16 (flash_mma with the
  # document ids) on the bench's row (4 heads), a model's heads (32) and a batch of 8 such rows,
  # against cuDNN's full causal step (auto, as in training) and, on the batch, against
  # flash_mma's own (mpipar: the kernel's masking alone)
  for shape in "float32 f32 8 32 auto" "bfloat16 bf16 1 4 auto" "bfloat16 bf16 1 32 auto" \
               "bfloat16 bf16 8 32 auto" "bfloat16 bf16 8 32 mpipar"; do
    read -r dtype short rows heads att <<< "$shape"; tag=documents_${short}_r${rows}_h$heads
    [ "$att" = auto ] || tag=${tag}_$att
    timeout 240 $PY -m mpipar.bench documents --seqs 8192 --sps 4 --samples 2 --repeats 5 \
        --backend cupy --dtype $dtype --rows $rows --heads $heads --attention $att \
        --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; rc=$?
    tail -8 "$OUT/$tag.log"; record $tag $rc
  done
fi

if has ragged; then
  stage "ragged: cuDNN's ragged attention for packed documents, by length class or in one call"
  # the device tests of cuDNN's ragged path (diagonal blocks through cuDNN against numpy_ref, in
  # one call and by length class: GROUPED) and of flash_mma's document kernels with
  # DOC_TILES_ALIGNED off; then the bench's bf16 batch and one row of 32 heads as the defaults
  # run them (ROUTED on: cuDNN's ragged attention for the diagonal blocks, in one call; unaligned
  # first tiles), with GROUPED on, and with ROUTED off (flash_mma's document kernels), against
  # cuDNN's full causal step (auto, as training runs it); each way twice, in turns
  timeout 300 $PY -m pytest -q -p no:cacheprovider --color=no tests/gpu/test_documents_gpu.py \
      tests/gpu/test_flash_mma.py -k "ragged or unaligned" > "$OUT/ragged_tests.log" 2>&1; rc=$?
  tail -5 "$OUT/ragged_tests.log"; record ragged_tests $rc
  for shape in "8 True False a" "8 True True a" "8 False False a" "8 True False b" \
               "8 True True b" "1 True False a" "1 True True a"; do
    read -r rows routed grouped turn <<< "$shape"; tag=ragged_r${rows}_h32_${routed}_${grouped}_$turn
    timeout 240 $PY -c 'import sys
from mpipar.kernels import cudnn_documents
cudnn_documents.ROUTED = sys.argv.pop(1) == "True"
cudnn_documents.GROUPED = sys.argv.pop(1) == "True"
from mpipar.bench.__main__ import main
sys.exit(main(sys.argv[1:]))' "$routed" "$grouped" documents --seqs 8192 --sps 4 --samples 2 \
        --repeats 5 --backend cupy --dtype bfloat16 --rows $rows --heads 32 \
        --attention auto --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1; rc=$?
    tail -8 "$OUT/$tag.log"; record $tag $rc
  done
fi

if has tiles; then
  stage "tiles: flash_mma's packed-document kernels' tile candidates, compiled and timed (D 64)"
  timeout 420 $PY -m mpipar.bench tiles --roles fwd_docs,dq_docs,dkdv_docs --repeats 3 \
      --tiles "4,1,32,4,0 4,16,3,0 2,16,8,0" --json "$OUT/tiles.json" > "$OUT/tiles.log" 2>&1
  rc=$?; tail -40 "$OUT/tiles.log"; record tiles $rc
fi

if has profile; then
  stage "profile: mpipar's 1.1B bf16 step at seq 2048, op by op"
  timeout 300 $PY -m mpipar.bench gpu --profile --models 1.1B --seqs 2048 \
      --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1; rc=$?
  head -30 "$OUT/profile.log"; record profile $rc
fi

if has micro; then
  stage "micro: the device's ceilings and the step's kernels one by one (1.1B shapes)"
  timeout 240 $PY -m mpipar.bench gpu --kernels --json "$OUT/micro.json" > "$OUT/micro.log" 2>&1
  rc=$?; tail -40 "$OUT/micro.log"; record micro $rc
fi

stage done
echo "--- summary (stage status; 0 = passed)"; cat "$OUT/results.txt" 2>/dev/null
tar czf /tmp/gpu_check_all.tgz -C "$OUT" . && mv /tmp/gpu_check_all.tgz "$OUT/all.tgz"
