#!/usr/bin/env bash
# The wheels jobs/gpu_check.sh's `setup` stage installs on a device machine that cannot download
# (see its header): fetched here, on a machine that can, into DIR (default ./.whl), for the
# device image's Python (3.12, x86_64 Linux; PYVER changes it). Only wheels: nothing to build there.
#
#   jobs/gpu_wheels.sh [DIR]
#
# pytest-mpi, pytest-timeout and pytest-xdist (+ execnet) for the tests, tomli-w (mpipar's config
# writer), safetensors, tqdm and threadpoolctl (mpipar's own requirements, in case the image
# lacks them),
# cuDNN's frontend (the image has cuDNN, not its Python frontend) and the mpich wheel (an
# mpiexec, for images without one).
set -euo pipefail
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
mkdir -p "$DIR"
python3 -m pip download -q --only-binary=:all: --no-deps --dest "$DIR" \
    --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    pytest-mpi pytest-timeout pytest-xdist execnet tomli-w safetensors tqdm threadpoolctl \
    "nvidia-cudnn-frontend>=1.14,<1.24" mpich
ls "$DIR"
