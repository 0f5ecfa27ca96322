"""CuPy on demand for the GPU kernels (`cupy_gpu`, `flash_exact`, `flash_mma`): whether it can
run here, the module itself (imported on first use, so the package imports cleanly without CuPy
or a GPU), the check of a kernel's float arrays and their C type names, and the host/device
moves of their small tables."""
from __future__ import annotations

from types import ModuleType
from typing import Any, Sequence

import numpy as np

from .numpy_ref import Array, require

CTYPES = {4: "float", 8: "double"}


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


def device_float(a: Array, name: str) -> Array:
    """``a`` if it is a float32 or float64 CuPy array, else ValueError naming ``name``."""
    cupy = array_module()
    require(isinstance(a, cupy.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize in (4, 8),
            f"{name}: expected a float32 or float64 cupy array, got {type(a).__name__} "
            f"of dtype {getattr(a, 'dtype', None)}")
    return a


def ctype(dtype: Any) -> str:
    """The C type ("float" or "double") of a float32 or float64 dtype."""
    return CTYPES[array_module().dtype(dtype).itemsize]


def host_array(a: Any) -> np.ndarray:
    """``a`` as a NumPy array (copied from the device if it is a CuPy array)."""
    cupy = array_module()
    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)


def device_views(parts: Sequence[np.ndarray]) -> list[Array]:
    """Host arrays of one dtype on the device in one copy: flat views, in order, of one array."""
    flat = array_module().asarray(np.concatenate([np.ravel(a) for a in parts]))
    views, at = [], 0
    for a in parts:
        views.append(flat[at:at + np.size(a)])
        at += np.size(a)
    return views
