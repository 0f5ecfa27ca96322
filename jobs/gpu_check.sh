#!/usr/bin/env bash
# The device check (see jobs/README.md): everything the GPU half owes, run on a fresh CUDA machine
# with no network, in stages that print as they go. Usage: jobs/gpu_check.sh OUT_DIR [STAGE...]
# Wheels for what the machine lacks (pytest-mpi, tomli-w, the mpich wheel for mpirun, the cuDNN
# frontend) are taken from ./.whl when present; nothing is downloaded.
set -uo pipefail
OUT=${1:?usage: jobs/gpu_check.sh OUT_DIR [STAGE...]}; shift
STAGES=${*:-"env setup compile kernels engine1 engine8 train"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
PY=${PYTHON:-python3}
t0=$SECONDS
stage() { echo "=== gpu_check: $1 ($((SECONDS - t0)) s)"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has env; then
  stage env
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  which $PY mpirun mpiexec nvcc 2>&1
  $PY - <<'PY'
import importlib
for m in ("numpy", "cupy", "ml_dtypes", "mpi4py", "h5py", "numba", "torch", "transformers", "cudnn"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", type(e).__name__, e)
try:
    import cupy
    print("cuda runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
    from cupy.cuda import nvrtc; print("nvrtc", nvrtc.getVersion())
except Exception as e:
    print("cupy probe failed", e)
PY
  $PY -m pip list 2>/dev/null | grep -i -E "nvidia|cudnn|mpi|pytest" 
fi

if has setup; then
  stage setup
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    if ! command -v mpiexec >/dev/null && [ -f .whl/mpich-*.whl ]; then
      rm -rf /tmp/mpich && mkdir -p /tmp/mpich && (cd /tmp/mpich && unzip -q "$OLDPWD"/.whl/mpich-*.whl)
      D=$(echo /tmp/mpich/mpich-*.data/data); chmod +x $D/bin/*
      export PATH=$D/bin:$PATH LD_LIBRARY_PATH=$D/lib:${LD_LIBRARY_PATH:-}
    fi
  fi
  [ -e mpipar/kernels ] || ln -s ../kernels mpipar/kernels
  export PYTHONPATH=$PWD:$PYTHONPATH
  $PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
  which mpiexec
fi

if has compile; then
  stage compile
  timeout 120 $PY - <<'PY' 2>&1 | tee "$OUT/compile.log"
from mpipar.kernels import cupy_gpu as g
import time
t = time.time(); m = g._flash_module(); 
for n in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv"):
    for dt in ("float32", "float64"):
        for d in g._HEAD_DIMS:
            try:
                g._flash(n, dt, d); 
            except Exception as e:
                print("LOAD FAIL", n, dt, d, e)
print("flash module loaded in", round(time.time() - t, 1), "s")
t = time.time(); g._rows_module(); print("rows module", round(time.time() - t, 1), "s")
PY
fi

if has kernels; then
  stage kernels
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py 2>&1 | tail -40 | tee "$OUT/kernels.log"
fi

if has engine1; then
  stage engine1
  timeout 300 $PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15 | tee "$OUT/engine1.log"
fi

if has engine8; then
  stage engine8
  timeout 240 mpiexec -n 8 $PY -m pytest -q -x -p no:cacheprovider --only-mpi tests/gpu 2>&1 | tail -60 | tee "$OUT/engine8.log"
fi

if has train; then
  stage train
  rm -rf /tmp/runs
  timeout 100 mpiexec -n 8 $PY -m mpipar.train --device cuda --steps 5 --run-dir /tmp/runs/gpu 2>&1 | tail -30 | tee "$OUT/train.log"
fi
stage done
