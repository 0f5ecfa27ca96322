"""GPU kernels on CuPy arrays.

Most ops run the array-module-generic code of `numpy_ref` on CuPy arrays (the dispatcher falls
back to it); this module adds fused elementwise CUDA kernels for SwiGLU and builds the RoPE tables
on the device. Importing this module never imports CuPy: that happens on first use, so the
package imports cleanly on machines without CuPy or without a GPU (`unavailable_reason` says why).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from . import numpy_ref as ref
from .numpy_ref import Array, require

# Ops implemented in this module (the dispatcher uses numpy_ref's generic code for the others).
IMPLEMENTED: tuple[str, ...] = ("rope_cos_sin", "swiglu_fwd", "swiglu_bwd")

_SIGMOID = "T e = exp(-fabs(g)); T sig = g >= 0 ? 1 / (1 + e) : e / (1 + e);"


def unavailable_reason() -> str | None:
    """None if CuPy imports and sees at least one CUDA device, else a sentence saying why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy.cuda.runtime.CUDARuntimeError when no driver is present
        return f"cupy found no usable CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "cupy found no CUDA device"
    return None


def array_module() -> ModuleType:
    """The `cupy` module (imported on demand)."""
    import cupy

    return cupy


@functools.cache
def _elementwise_kernels() -> tuple[Any, Any]:
    """Compile (once) the SwiGLU forward and backward CUDA kernels."""
    cupy = array_module()
    fwd = cupy.ElementwiseKernel(
        "T g, T u", "T h",
        _SIGMOID + " h = g * sig * u;",
        "mpipar_swiglu_fwd",
    )
    bwd = cupy.ElementwiseKernel(
        "T dh, T g, T u", "T dg, T du",
        _SIGMOID + " dg = dh * u * sig * (1 + g * (1 - sig)); du = dh * (g * sig);",
        "mpipar_swiglu_bwd",
    )
    return fwd, bwd


def _device_float(a: Array, name: str) -> Array:
    cupy = array_module()
    require(isinstance(a, cupy.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize in (4, 8),
            f"{name}: expected a float32 or float64 cupy array, got {type(a).__name__} "
            f"of dtype {getattr(a, 'dtype', None)}")
    return a


def rope_cos_sin(positions: Array, head_dim: int, theta: float, dtype: Any,
                 **scaling: Any) -> tuple[Array, Array]:
    """cos, sin `[S, head_dim // 2]` on the device for global positions `[S]` (host or device
    array); ``scaling``: the RoPE scaling arguments of :func:`numpy_ref.rope_cos_sin`."""
    return ref.rope_cos_sin(array_module().asarray(positions), head_dim, theta, dtype, **scaling)


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up in one CUDA kernel; gate, up `[..., ffn]`."""
    _device_float(gate, "swiglu_fwd")
    require(gate.shape == up.shape, f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    fwd, _ = _elementwise_kernels()
    return fwd(gate, up.astype(gate.dtype, copy=False))


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `swiglu_fwd` in one CUDA kernel; all `[..., ffn]`."""
    _device_float(gate, "swiglu_bwd")
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    _, bwd = _elementwise_kernels()
    return bwd(dh.astype(gate.dtype, copy=False), gate, up.astype(gate.dtype, copy=False))
