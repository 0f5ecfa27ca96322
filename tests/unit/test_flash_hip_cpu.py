"""flash_exact's flash kernels (cupy_gpu's attention: their CUDA source, unchanged) run on the CPU under HIP-CPU, against
numpy_ref in float64: a check of the kernels' logic (block tables, packed-document bounds, ring
offsets, windows) on a machine with no GPU. It needs AMD's header-only HIP CPU runtime
(github.com/ROCm/HIP-CPU; set ``MPIPAR_HIP_CPU`` to its checkout), g++ and libtbb-dev; without
them it is skipped (CI has neither: the device's tests/gpu run the same kernels through CuPy).

HIP-CPU runs a block's threads as fibers with a 64-lane "warp" and maps ``__shfl_xor`` onto it;
the kernels' shuffles stay within the L lanes of one row, which run the same loops, so the sums
are the GPU's; ``__syncthreads`` is replaced by a true barrier (HIP-CPU's own is not one when
warps make different numbers of shuffles, as these kernels' warps do). What it cannot show is
speed, occupancy, or a race that the fibers' order hides: those are for the device tests."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mpipar.kernels import flash_exact, numpy_ref as ref

HIP = os.environ.get("MPIPAR_HIP_CPU", "")
pytestmark = pytest.mark.skipif(
    not (HIP and (Path(HIP) / "include/hip/hip_runtime.h").exists() and shutil.which("g++")
         and Path("/usr/include/tbb").exists()),
    reason="HIP-CPU not found (set MPIPAR_HIP_CPU to its checkout; needs g++ and libtbb-dev)")

_PROLOGUE = r"""
#include <hip/hip_runtime.h>
#include <algorithm>
#include <cmath>
#include <limits>
using std::exp; using std::isfinite; using std::log; using std::max; using std::min;
#define __shfl_xor_sync(mask, v, off) __shfl_xor(v, off)
#define __int_as_float(x) (std::numeric_limits<float>::infinity())
// HIP-CPU runs a block's threads as fibers in turn, and its __syncthreads is "every fiber on to
// its next barrier", shuffles included: the kernels' warps loop over different key ranges (so
// make different numbers of shuffles), so that is not a barrier between them. This one is: a
// fiber waits (yielding) until every thread of the block has arrived. Thread 0, which runs first
// in every turn, releases them, so that all leave in the same turn (HIP-CPU needs a block's
// fibers to finish in one turn, in order). Its counters have internal linkage: as an inline
// function's statics they would be one object across every library loaded (GNU unique symbols),
// and libraries with other block sizes would then share them.
namespace mpipar_hip {
namespace {
inline void sync() {
    static thread_local unsigned long long arrived = 0, released = 0;
    const unsigned long long n = blockDim.x * blockDim.y * blockDim.z;
    const unsigned long long gen = arrived / n + 1;
    const bool first = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
    ++arrived;
    while (true) {
        if (first && arrived >= gen * n) released = gen;
        if (released >= gen) return;
        hip::detail::Tile::this_tile().barrier();
    }
}
}
}
#define __syncthreads() mpipar_hip::sync()
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(ctype, head_dim, tile rows, threads per block) -> the flash kernels compiled for the CPU
    (a ctypes library)."""
    built = {}

    def get(ctype: str, d: int, tile: int, threads: int):
        if (ctype, d, tile, threads) not in built:
            lanes = flash_exact.flash_config(d, 8 if ctype == "double" else 4)[0]
            src = flash_exact._FLASH
            code = [_PROLOGUE, src, 'extern "C" {', f"typedef {ctype} T; typedef {ctype} A;"]
            for name in flash_exact._FLASH_KERNELS:
                params = re.search(r"__launch_bounds__\(NT, 1\) " + name + r"\((.*?)\)\s*\{",
                                   src, re.S).group(1)
                args = ", ".join(p.split()[-1].lstrip("*") for p in params.split(","))
                code.append(f"void launch_{name}(int gx, int gy, {params}) {{ hipLaunchKernelGGL("
                            f"({name}<{ctype}, {ctype}, {d}, {lanes}, {tile}, {threads}>), "
                            f"dim3(gx, gy), dim3({threads}), 0, 0, {args}); "
                            f"hipDeviceSynchronize(); }}")
            code.append("}")
            path = tmp_path_factory.mktemp("hip") / f"flash_{ctype}_{d}_{tile}_{threads}"
            path.with_suffix(".cpp").write_text("\n".join(code))
            subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", f"-I{HIP}/include",
                            str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so")),
                            "-ltbb", "-lpthread"], check=True)
            built[ctype, d, tile, threads] = ctypes.CDLL(str(path.with_suffix(".so")))
        return built[ctype, d, tile, threads]

    return get


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _run(build, ctype, dt, q, k, v, dout, q_offset, k_offset, causal, window, q_docs, k_docs,
         config=None):
    """out, lse, dq, dk, dv of the kernels, launched as flash_exact launches them (its
    `launch_config`, or ``config`` (tile, threads); the block tables of its `document_tables`,
    `_blocks`, here in host memory)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    lanes, tile, threads = flash_exact.launch_config(d, dt.itemsize, q_docs is not None)
    tile, threads = config or (tile, threads)
    lib, rows = build(ctype, d, tile, threads), threads // lanes
    keep = []

    def docs(mine, other, n, n_other):
        if mine is None:
            return (None, None, None, ctypes.c_int(0)), -(-n // rows)
        lo, hi, starts = flash_exact._blocks(mine, other, rows)
        keep.extend((lo, hi, starts))
        return (_ptr(lo), _ptr(hi), _ptr(starts), ctypes.c_int(starts.shape[1])), \
            max(1, starts.shape[1] - 1)

    acc = ctypes.c_double if dt == np.float64 else ctypes.c_float
    common = (ctypes.c_int(sq), ctypes.c_int(sk), ctypes.c_int(hq), ctypes.c_int(hkv),
              ctypes.c_longlong(q_offset), ctypes.c_longlong(k_offset), ctypes.c_int(causal),
              ctypes.c_longlong(window), acc(ref.attention_scale(d, None)))
    (qdocs, nq), (kdocs, nk) = docs(q_docs, k_docs, sq, sk), docs(k_docs, q_docs, sk, sq)
    out, lse = np.full_like(q, np.nan), np.full((b, hq, sq), np.nan, dt)
    grid = lambda n, h: (ctypes.c_int(n), ctypes.c_int(b * h))  # noqa: E731
    lib.launch_flash_fwd(*grid(nq, hq), *map(_ptr, (q, k, v, out, lse)), *common, *qdocs)
    delta = np.full((b, hq, sq), np.nan, dt)        # written by flash_bwd_dq, read by dk/dv
    dq, dk, dv = np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(v, np.nan)
    lib.launch_flash_bwd_dq(*grid(nq, hq), *map(_ptr, (q, k, v, dout, out, lse, delta, dq)),
                            *common, *qdocs)
    lib.launch_flash_bwd_dkdv(*grid(nk, hkv), *map(_ptr, (q, k, v, dout, lse, delta, dk, dv)),
                              *common, *kdocs)
    return out, lse, dq, dk, dv


def _docs(rng, rows: int, n: int, mean: float) -> np.ndarray:
    return np.cumsum(rng.random((rows, n)) < 1 / mean, axis=1).astype(np.int64)


def _cases():
    rng = np.random.default_rng(5)
    S = 300
    two = _docs(rng, 1, 2 * S, 90)
    one = np.zeros((1, S), np.int64)
    one[0, 200:] = 1
    # (name, B, Sq, Sk, Hq, Hkv, q_offset, k_offset, causal, window, q_docs, k_docs)
    return [
        ("causal", 2, 100, 100, 4, 2, 0, 0, 1, 0, None, None),
        ("ring hop", 1, 130, 70, 2, 1, 50, 0, 1, 0, None, None),
        ("documents ~40", 2, S, S, 4, 2, 0, 0, 1, 0, *[_docs(rng, 2, S, 40)] * 2),
        ("documents ~7", 2, S, S, 2, 1, 0, 0, 1, 0, *[_docs(rng, 2, S, 7)] * 2),
        ("documents ~150", 1, S, S, 2, 2, 0, 0, 1, 0, *[_docs(rng, 1, S, 150)] * 2),
        ("documents, window 37", 1, S, S, 2, 1, 0, 0, 1, 37, *[_docs(rng, 1, S, 60)] * 2),
        ("documents, ring hop", 1, S, S, 2, 1, S, 0, 1, 0, two[:, S:], two[:, :S]),
        ("documents, keys after", 1, S, S, 2, 1, 0, S, 1, 0, two[:, :S], two[:, S:]),
        ("documents, not causal", 1, S, S, 2, 2, 0, 0, 0, 0, two[:, :S], two[:, :S]),
        ("two documents", 1, S, S, 2, 1, 0, 0, 1, 0, one, one),
    ]


@pytest.mark.parametrize("ctype,d", [("double", 64), ("float", 64), ("double", 128),
                                     ("float", 80)])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_flash_kernels_on_the_cpu_match_numpy_ref(build, ctype, d, case):
    _check(build, ctype, d, case)


@pytest.mark.parametrize("config", [(64, 128), (32, 64), (16, 256)],
                         ids=lambda c: f"tile{c[0]}x{c[1]}")
@pytest.mark.parametrize("ctype", ["double", "float"])
@pytest.mark.parametrize("case", [c for c in _cases() if c[10] is not None], ids=lambda c: c[0])
def test_document_kernels_with_other_blocks_match_numpy_ref(build, ctype, case, config):
    """The launch configurations `_DOC_THREADS` / `_DOC_TILE` may take (fewer rows per block,
    shorter tiles) are the same kernels' other instantiations: each writes every element and
    matches numpy_ref, at D 64."""
    _check(build, ctype, 64, case, config)


def _check(build, ctype, d, case, config=None):
    _, b, sq, sk, hq, hkv, qo, ko, causal, window, q_docs, k_docs = case
    dt = np.dtype(np.float64 if ctype == "double" else np.float32)
    rng = np.random.default_rng(sq + hq + qo)
    q, dout = (rng.standard_normal((b, sq, hq, d)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(dt) for _ in range(2))
    got = _run(build, ctype, dt, q, k, v, dout, qo, ko, causal, window, q_docs, k_docs, config)
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    kw = {} if q_docs is None else {"q_docs": q_docs, "k_docs": k_docs}
    out, lse = ref.attention_fwd(*wide[:3], qo, ko, bool(causal), None, window, **kw)
    want = (out, lse, *ref.attention_bwd(*wide[:3], out, lse, wide[3], qo, ko, bool(causal), None,
                                         window, **kw))
    tol = 1e-12 if ctype == "double" else 2e-6
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert not np.isnan(g).any(), f"{name}: an element not written"
        assert np.array_equal(np.isinf(g), np.isinf(w)), name
        fin = np.isfinite(w)
        scale = np.linalg.norm(w[fin]) or 1.0
        assert np.linalg.norm(g[fin] - w[fin]) / scale <= tol, name
