"""Compute kernels of mpipar and the dispatcher that picks an implementation per op.

    from mpipar.kernels import get_backend
    kb = get_backend("auto")          # cupy if usable, else numba, else numpy
    y = kb.linear_fwd(x, w)           # every op of OPS is an attribute
    print(kb.describe())              # e.g. "numba (linear_fwd, linear_bwd: numpy BLAS; ...)"

Backends: `numpy` (numpy_ref: the reference, array-module generic), `numba` (numba_cpu, with
numpy_ref for the ops it lacks or where NumPy is faster) and `cupy` (numpy_ref's generic code on
CuPy arrays plus the CUDA kernels of cupy_gpu for float32/float64, and for bf16 the tensor-core
ops of gpu_bf16: cuBLAS GEMMs, the fused kernels of cuda_fused, attention from cuDNN or
flash_mma, routed by the dtype of each call's first array; `with_attention` fixes the bf16
attention backend for a model and says why). Kernels are pure functions of arrays.

Beside the ops of :data:`OPS`, every backend carries the array-module generic code of
:data:`GENERIC_OPS` (numpy_ref's ``upcast`` and ``sigmoid``, and ``routing``: the expert
routing kernels of expert_routing), run on the backend's arrays, so the model reaches every
kernel through the backend it is given. The optimizer's device kernels (:func:`fused_adamw`,
:func:`device_sum_squares`) are reached through this module too.

Every op takes float32, float64 and bfloat16 (`ml_dtypes.bfloat16`) arrays. bf16 follows one
mixed-precision recipe, whose rounding points numpy_ref's module docstring tabulates: inputs
upcast to float32 once, float32 compute, only the activation outputs rounded to bf16, once;
statistics and gradients of parameters and of attention stay float32. The numba backend runs
its float32 kernels inside that recipe (upcast, kernel, round: 1.3-15x faster than numpy_ref on
bf16 at 4096 tokens x 1024), so no op falls back for bf16.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any, Callable, Mapping

import numpy as np

from . import expert_routing, numpy_ref

OPS: tuple[str, ...] = (
    "linear_fwd", "linear_bwd", "linear_bias_bwd", "embedding_fwd",
    "embedding_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd",
    "rope_cos_sin", "rope_fwd", "rope_bwd",
    "swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd",
    "attention_fwd", "attention_bwd", "attention_merge",
    "cross_entropy_stats", "cross_entropy_bwd",
)
MOVE_OPS: tuple[str, ...] = ("split_columns", "concat")
"""Moves without arithmetic (numpy_ref's, and for bf16 on the GPU the column-copy kernel of
cuda_moves): the same bits on every backend, so outside the op tables of :data:`OPS`."""
GENERIC_OPS: tuple[str, ...] = ("upcast", "sigmoid", "routing")
"""Array-module generic code, the same on every backend and run on its arrays: numpy_ref's
``upcast`` (bf16 -> float32) and ``sigmoid``, and ``routing``, the module of expert routing
kernels (expert_routing: the router's softmax and top-k, the permutation by expert, capacity)."""
BACKENDS: tuple[str, ...] = ("numpy", "numba", "cupy")
_CHOICES = ("auto",) + BACKENDS

Kernel = Callable[..., Any]


@dataclass(frozen=True, eq=False)
class Backend:
    """One set of kernels: `per_op[op]` names the implementation ("numpy", "numba" or "cupy") of each op.

    `fallback_reasons[op]` says why an op does not use the backend's own implementation. Backends are
    cached per name, so they compare and hash by identity.
    """

    name: str
    xp: ModuleType
    per_op: Mapping[str, str]
    linear_fwd: Kernel
    linear_bwd: Kernel
    linear_bias_bwd: Kernel
    embedding_fwd: Kernel
    embedding_bwd: Kernel
    rmsnorm_fwd: Kernel
    rmsnorm_bwd: Kernel
    add_rmsnorm_fwd: Kernel
    add_rmsnorm_bwd: Kernel
    rope_cos_sin: Kernel
    rope_fwd: Kernel
    rope_bwd: Kernel
    swiglu_fwd: Kernel
    swiglu_bwd: Kernel
    geglu_fwd: Kernel
    geglu_bwd: Kernel
    attention_fwd: Kernel
    attention_bwd: Kernel
    attention_merge: Kernel
    cross_entropy_stats: Kernel
    cross_entropy_bwd: Kernel
    split_columns: Kernel
    concat: Kernel
    upcast: Kernel
    sigmoid: Kernel
    routing: ModuleType
    fallback_reasons: Mapping[str, str] = field(default_factory=dict)
    bf16_gemm: str = ""
    """A CPU backend's bf16 GEMMs of the linear ops and why (:func:`with_cpu_bf16_gemm`); empty
    where no choice was made (a float32/float64 run, the GPU: cuBLAS)."""

    def describe(self) -> str:
        """One line: the backend name, which ops (of :data:`OPS` and :data:`GENERIC_OPS`) use
        another implementation, and why, and where set what runs the bf16 GEMMs."""
        groups: dict[str, list[str]] = {}
        for op in OPS + GENERIC_OPS:
            if self.per_op[op] != self.name:
                groups.setdefault(self.fallback_reasons.get(op, self.per_op[op]), []).append(op)
        parts = ["{}: {}".format(", ".join(ops), why) for why, ops in groups.items()]
        parts += [self.bf16_gemm] if self.bf16_gemm else []
        return f"{self.name} ({'; '.join(parts)})" if parts else self.name


def available_backends() -> dict[str, str | None]:
    """Backend name -> None if it can be used here, else the reason it cannot."""
    return {name: _unavailable_reason(name) for name in BACKENDS}


@functools.cache
def _unavailable_reason(name: str) -> str | None:
    """Probe one backend (imports numba or cupy) once per process."""
    if name == "numba":
        try:
            from . import numba_cpu  # noqa: F401  (imports numba)
        except ImportError as exc:
            return f"numba is not importable ({exc})"
    elif name == "cupy":
        from . import cupy_gpu

        return cupy_gpu.unavailable_reason()
    return None


@functools.cache
def _build(name: str) -> Backend:
    """The Backend for an available `name`, built once per process."""
    ops: dict[str, Any] = {op: getattr(numpy_ref, op) for op in OPS + MOVE_OPS}
    ops.update(upcast=numpy_ref.upcast, sigmoid=numpy_ref.sigmoid, routing=expert_routing)
    per_op = {op: "numpy" for op in OPS + GENERIC_OPS}
    reasons: dict[str, str] = {}
    xp: ModuleType = np
    if name == "numba":
        from . import numba_cpu

        for op in numba_cpu.IMPLEMENTED:
            if op in numba_cpu.SLOWER_THAN_NUMPY:
                reasons[op] = numba_cpu.SLOWER_THAN_NUMPY[op]
            else:
                ops[op], per_op[op] = getattr(numba_cpu, op), "numba"
        for op in OPS + GENERIC_OPS:
            if per_op[op] == "numpy" and op not in reasons:
                reasons[op] = "numpy"
    elif name == "cupy":
        from . import cupy_gpu, gpu_bf16

        xp = cupy_gpu.array_module()
        for op in cupy_gpu.IMPLEMENTED:
            ops[op], per_op[op] = getattr(cupy_gpu, op), "cupy"
        for op in OPS + GENERIC_OPS:
            if per_op[op] == "numpy":
                reasons[op] = "numpy_ref on cupy arrays"
        for op, bf16_op in gpu_bf16.bf16_ops(gpu_bf16.PER_CALL).items():
            ops[op] = gpu_bf16.by_dtype(ops[op], bf16_op, *gpu_bf16.ROUTED_BY.get(op, (0, None)))
            if op in reasons:
                reasons[op] += "; bf16: gpu_bf16's cuBLAS, fused and attention kernels"
    return Backend(name=name, xp=xp, per_op=MappingProxyType(per_op),
                   fallback_reasons=MappingProxyType(reasons), **ops)


def with_attention(backend: Backend, requested: str, head_dim: int, window: int = 0
                   ) -> tuple[Backend, str]:
    """``backend`` with its bf16 attention fixed to the ``requested`` backend (auto, cudnn,
    mpipar) for a model of ``head_dim`` (and sliding ``window``), and the line that says which
    and why; the CPU backends are returned as they are. ValueError names the reason an explicit
    choice cannot run."""
    if backend.name != "cupy":
        return backend, f"attention: {backend.per_op['attention_fwd']} kernels"
    from . import cupy_gpu, gpu_bf16

    choice = gpu_bf16.attention_choice(requested, head_dim, window)
    fwd, bwd = gpu_bf16.attention_ops(choice)
    new = dataclasses.replace(backend, attention_fwd=gpu_bf16.by_dtype(cupy_gpu.attention_fwd, fwd),
                              attention_bwd=gpu_bf16.by_dtype(cupy_gpu.attention_bwd, bwd))
    return new, (choice.describe() + f" for bf16 (packed documents: "
                 f"{gpu_bf16.documents_route(choice)}); float32/float64: mpipar's exact kernels")


def with_cpu_bf16_gemm(backend: Backend, requested: str) -> Backend:
    """A CPU ``backend`` whose linear ops run their bf16 GEMMs as ``requested`` (auto, mkl,
    float32: :func:`mkl_bf16.gemm_choice`), saying so in its description; float32 and float64
    calls keep the backend's own ops. The cupy backend is returned as it is (cuBLAS). ValueError
    names the reason an explicit ``mkl`` cannot run."""
    if backend.name == "cupy":
        return backend
    from . import gpu_bf16, mkl_bf16

    choice = mkl_bf16.gemm_choice(requested)
    if not choice.uses_mkl:
        return dataclasses.replace(backend, bf16_gemm=choice.describe())
    routed = {op: gpu_bf16.by_dtype(getattr(backend, op), getattr(mkl_bf16, op))
              for op in mkl_bf16.LINEAR_OPS}
    return dataclasses.replace(backend, bf16_gemm=choice.describe(), **routed)


def fused_adamw(p: Any, g: Any, m: Any, v: Any, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, scale: float) -> None:
    """One AdamW step in place on CuPy arrays of one dtype, fused into one pass (cuda_adamw)."""
    from . import cuda_adamw

    cuda_adamw.adamw(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, scale)


def device_sum_squares(arrays: list) -> float:
    """The sum over CuPy float32/float64 ``arrays`` of their squares, in float64 (cuda_moves)."""
    from . import cuda_moves

    return cuda_moves.sum_squares(arrays)


def get_backend(name: str = "auto") -> Backend:
    """The Backend called `name`: "auto", "numpy", "numba" or "cupy" (one cached object per name).

    "auto" is cupy when it is importable and sees a GPU, else numba when importable, else numpy.
    Raises ValueError for an unknown name and RuntimeError for a backend that cannot be used here.
    """
    if name not in _CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}: choose one of {', '.join(_CHOICES)}")
    if name == "auto":
        name = next(n for n in ("cupy", "numba", "numpy") if _unavailable_reason(n) is None)
    elif (reason := _unavailable_reason(name)) is not None:
        raise RuntimeError(f"kernel backend {name!r} is unavailable: {reason}")
    return _build(name)


__all__ = ["Backend", "BACKENDS", "GENERIC_OPS", "MOVE_OPS", "OPS", "available_backends",
           "device_sum_squares", "fused_adamw", "get_backend", "with_attention",
           "with_cpu_bf16_gemm"]
