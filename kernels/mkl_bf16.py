"""bfloat16 GEMMs on the CPU through oneMKL: ``cblas_gemm_bf16bf16f32`` (the ``mkl`` wheel's
``libmkl_rt``, bound with ctypes), behind numpy_ref's linear signatures and its mixed-precision
recipe.

MKL multiplies the bf16 operands with float32 accumulation into a float32 result, which is where
numpy_ref's recipe rounds: ``linear_fwd``'s ``y = r(f(x) @ f(w).T + f(b))`` (the bias joins the
float32 sum, then one rounding), ``linear_bwd``'s ``dx = r(f(dy) @ f(w))`` and its float32
``dw = f(dy)^T f(x)``, accumulated straight into a given float32 ``dw`` (beta = 1), as the GPU's
cuBLAS path does. The products equal NumPy's float32 products of the upcast operands up to the
order of the float32 sums (:func:`gemm_bound`); the bf16 units (AMX, AVX512-BF16) also take
subnormal inputs (below 1.2e-38) as zero.

Where it runs fast: on CPUs with AMX-BF16 (``amx_bf16`` in /proc/cpuinfo: Sapphire Rapids and
later Xeons) or AVX512-BF16 (``avx512_bf16``) MKL dispatches to those units. Elsewhere MKL
emulates the bf16 product in float32, slower than NumPy's float32 BLAS, so :func:`gemm_choice`
takes it under ``auto`` only on such a CPU; ``mkl`` asks for it anywhere (the tests do).

Threads: MKL runs on the GNU OpenMP runtime (the one Numba's kernels use, so one pool and one
wait policy) when libgomp is found, else sequentially; ``MKL_THREADING_LAYER`` set by the user
wins. Loading it sets ``OMP_WAIT_POLICY=PASSIVE`` unless set, as numba_cpu does: with spinning
idle workers a 128 x 32 x 48 GEMM took 77 ms instead of 1.5 ms on a busy 2-core machine. Its thread count comes from ``MKL_NUM_THREADS`` (mpipar.runtime.nodes sets it per rank)
and threadpoolctl sizes it once loaded. Importing this module loads nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import numpy_ref as ref
from .numpy_ref import Array

CHOICES = ("auto", "mkl", "float32")
"""The bf16 GEMM of a CPU run: ``mkl`` (oneMKL's bf16 GEMM), ``float32`` (the operands upcast
and multiplied by NumPy's float32 BLAS), ``auto`` (mkl on a CPU with bf16 units, else float32)."""
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""The /proc/cpuinfo flags of the CPU units that multiply bf16 (either makes MKL's bf16 GEMM fast)."""
LINEAR_OPS = ("linear_fwd", "linear_bwd")
"""The ops whose bf16 calls run here (:func:`mpipar.kernels.with_cpu_bf16_gemm` routes them)."""
INSTALL = "pip install 'mpipar[cpu-bf16]' (the mkl wheel)"

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_LAYERS = {"GNU": 3, "SEQUENTIAL": 1}   # MKL_THREADING_GNU, MKL_THREADING_SEQUENTIAL


# ------------------------------------------------------------------------------ the library
def _candidates() -> list[str]:
    """Where libmkl_rt may lie: the files of the installed ``mkl`` distribution (the wheel puts
    them in the environment's lib/), then the loader's own search (a system or conda MKL)."""
    found: list[str] = []
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        try:
            dist = distribution("mkl")
            found += [str(dist.locate_file(f)) for f in dist.files or ()
                      if f.name.startswith("libmkl_rt.so")]
        except PackageNotFoundError:
            pass
    except ImportError:   # pragma: no cover  (importlib.metadata is in every supported Python)
        pass
    system = ctypes.util.find_library("mkl_rt")
    return sorted(found, key=len) + ([system] if system else [])


@functools.cache
def library() -> ctypes.CDLL:
    """libmkl_rt, loaded once, its threading layer set and its bf16 GEMM typed. OSError says why
    it cannot be (no mkl wheel, or a library without ``cblas_gemm_bf16bf16f32``)."""
    errors = []
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # read by libgomp when it first loads
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            gemm = lib.cblas_gemm_bf16bf16f32
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        gemm.restype = None
        gemm.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                               ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                               ctypes.c_void_p, ctypes.c_int])
        if "MKL_THREADING_LAYER" not in os.environ:
            layer = "GNU" if ctypes.util.find_library("gomp") else "SEQUENTIAL"
            lib.MKL_Set_Threading_Layer.restype = ctypes.c_int
            lib.MKL_Set_Threading_Layer(ctypes.c_int(_LAYERS[layer]))
        return lib
    raise OSError("; ".join(errors) or "libmkl_rt not found: no mkl wheel, no system MKL")


@functools.cache
def unavailable_reason() -> str | None:
    """None if oneMKL's bf16 GEMM can be called here, else why not."""
    try:
        library()
    except OSError as exc:
        return f"oneMKL is not loadable ({exc})"
    return None


def version() -> str:
    """MKL's version line (its library must load)."""
    buf = ctypes.create_string_buffer(256)
    library().mkl_get_version_string(buf, ctypes.c_int(len(buf)))
    return buf.value.decode(errors="replace").strip()


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The flags of :data:`BF16_FLAGS` the CPU reports (its first ``flags`` line); () where
    there is no such file."""
    try:
        with open(cpuinfo) as fh:
            line = next((ln for ln in fh if ln.startswith("flags")), "")
    except OSError:
        return ()
    have = set(line.partition(":")[2].split())
    return tuple(f for f in BF16_FLAGS if f in have)


# --------------------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class GemmChoice:
    """The bf16 GEMM a CPU run uses (``mkl`` or ``float32``) and why (the start-up line prints
    it, as part of the kernels' description)."""

    backend: str
    reason: str

    @property
    def uses_mkl(self) -> bool:
        return self.backend == "mkl"

    def describe(self) -> str:
        what = ("oneMKL cblas_gemm_bf16bf16f32" if self.uses_mkl
                else "float32 BLAS on the upcast operands")
        return f"bf16 GEMMs: {what} ({self.reason})"


def gemm_choice(requested: str, flags: tuple[str, ...] | None = None) -> GemmChoice:
    """The bf16 GEMM for ``requested`` (:data:`CHOICES`) on a CPU with bf16 ``flags`` (default:
    this CPU's). ``mkl`` without a loadable MKL raises ValueError with the reason; ``auto`` takes
    MKL where the CPU has a bf16 unit and MKL loads, else float32 with the reason."""
    if requested not in CHOICES:
        raise ValueError(f"bf16 GEMM {requested!r}: must be one of {', '.join(CHOICES)}")
    flags = cpu_bf16_flags() if flags is None else flags
    have = " and ".join(flags)
    if requested == "float32":
        return GemmChoice("float32", "asked for")
    missing = unavailable_reason()
    if requested == "mkl":
        if missing is not None:
            raise ValueError(f"{missing}; {INSTALL}")
        return GemmChoice("mkl", f"asked for, on a CPU with {have}" if flags else
                          "asked for, on a CPU without a bf16 unit: MKL emulates it")
    if not flags:
        return GemmChoice("float32", f"the CPU reports neither {' nor '.join(BF16_FLAGS)}")
    if missing is not None:
        return GemmChoice("float32", f"the CPU has {have}, but {missing}")
    return GemmChoice("mkl", f"the CPU has {have}")


# ---------------------------------------------------------------------------------- the GEMM
def _operand(a: np.ndarray) -> tuple[np.ndarray, int, int]:
    """``a`` (2-D bf16) as MKL reads it in row-major order: (array, transpose flag, leading
    dimension); a transposed view of a contiguous array is read as it lies, anything else is
    copied once."""
    rows, cols = a.shape
    s0, s1 = (s // a.itemsize for s in a.strides)
    if (s1 == 1 or cols == 1) and s0 >= max(1, cols) and a.strides[0] % a.itemsize == 0:
        return a, _NO_TRANS, max(1, s0, cols)
    if (s0 == 1 or rows == 1) and s1 >= max(1, rows) and a.strides[1] % a.itemsize == 0:
        return a, _TRANS, max(1, s1, rows)
    a = np.ascontiguousarray(a)
    return a, _NO_TRANS, max(1, cols)


def gemm(a: Array, b: Array, out: np.ndarray | None = None, beta: float = 0.0) -> np.ndarray:
    """``a [m, k] @ b [k, n]`` of bf16 matrices (any strides; transposed views are not copied) in
    float32: ``out = a @ b + beta * out`` (a new array when ``out`` is None, then beta is 0).
    ``out`` must be a C-contiguous float32 ``[m, n]`` array."""
    ref.require(a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0],
                f"gemm: shapes {a.shape} @ {b.shape} must be [m, k] @ [k, n]")
    ref.require(ref.is_bf16(a.dtype) and ref.is_bf16(b.dtype),
                f"gemm: operands must be bfloat16, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out, beta = np.empty((m, n), np.float32), 0.0
    ref.require(out.shape == (m, n) and out.dtype == np.float32 and out.flags.c_contiguous,
                f"gemm: out must be a C-contiguous float32 array of shape {(m, n)}, got "
                f"{out.dtype} {out.shape}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        out *= beta
        return out
    (a, ta, lda), (b, tb, ldb) = _operand(a), _operand(b)
    library().cblas_gemm_bf16bf16f32(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda,
                                     b.ctypes.data, ldb, beta, out.ctypes.data, max(1, n))
    return out


def gemm_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The elementwise bound on ``|gemm(a, b) - f(a) @ f(b)|`` (both float32 sums of the same
    exact products in different orders): ``2 gamma_k |f(a)| @ |f(b)|``, gamma_k = k u / (1 - k u),
    u = 2^-24, the classic bound on a float32 dot product of length k, once for each side."""
    k = a.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    return 2 * gamma * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


# ------------------------------------------------------------------------ the linear layers
def _rows(a: Array) -> Array:
    """``a`` as ``[tokens, features]`` (a view when it is contiguous)."""
    return a.reshape(-1, a.shape[-1])


def _both_bf16(*arrays: Any) -> bool:
    return all(isinstance(a, np.ndarray) and ref.is_bf16(a.dtype) for a in arrays)


def linear_fwd(x: Array, w: Array, b: Array | None = None) -> Array:
    """numpy_ref.linear_fwd: for bf16 ``x`` and ``w`` one MKL GEMM (``w = W.T`` of an input
    gradient read as it lies), the bias added to the float32 result, rounded to bf16 once; any
    other dtypes go to numpy_ref."""
    if not _both_bf16(x, w):
        return ref.linear_fwd(x, w, b)
    ref.require(w.ndim == 2 and x.shape[-1] == w.shape[1],
                f"linear_fwd: x {x.shape} and w {w.shape} must be [..., in] and [out, in]")
    ref.check_bias(b, w, "linear_fwd")
    y = gemm(_rows(x), w.T)
    if b is not None:
        y += ref.upcast(b)
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def linear_bwd(dy: Array, x: Array, w: Array | None, dw: Array | None = None
               ) -> tuple[Array | None, Array]:
    """numpy_ref.linear_bwd: for bf16 ``dy``, ``x`` (and ``w``) ``dx = r(dy @ w)`` and the float32
    ``dw = dy^T x``, accumulated by the GEMM into a given C-contiguous float32 ``dw`` (beta =
    1); any other dtypes go to numpy_ref."""
    if not (_both_bf16(dy, x) and (w is None or _both_bf16(w))):
        return ref.linear_bwd(dy, x, w, dw)
    wshape = ref.check_linear_bwd(dy, x, w, dw)
    dy2, x2 = _rows(dy), _rows(x)
    if dw is None:
        dw = gemm(dy2.T, x2)
    elif dw.dtype == np.float32 and dw.flags.c_contiguous:
        gemm(dy2.T, x2, out=dw, beta=1.0)
    else:
        dw += gemm(dy2.T, x2)
    dx = None if w is None else gemm(dy2, w).astype(dy.dtype).reshape(*dy.shape[:-1], wshape[1])
    return dx, dw
