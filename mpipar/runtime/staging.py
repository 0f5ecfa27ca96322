"""How arrays reach MPI: handed over as they are, or staged through reusable host buffers.

Every buffer call of a :class:`mpipar.runtime.comm.Group` asks its path for the buffers MPI sees:

- :class:`DirectPath`: the arrays themselves. Host arrays always can; device (CuPy) arrays can
  when the MPI library is CUDA-aware (:func:`cuda_aware_mpi`), after the compute stream has been
  synchronized so that MPI reads finished values.
- :class:`StagedPath`: reusable host buffers (pinned on a device run) from a pool keyed by dtype
  and length, so that after the first step no buffer is allocated. An outgoing array is copied
  into its buffer before the call; an incoming one is copied back when the call (or the
  non-blocking request) completes, and the buffer returns to the pool. :meth:`StagedPath.ahead`
  starts the copy of an array that a coming call will send (the next gradient bucket) while the
  current call runs: on a device the copy runs on a stream of its own and overlaps the
  reduction; the call that sends it then only waits for it.

The path code is array-module generic: the copies are a :class:`HostCopies` (NumPy arrays,
plain memory; used on the CPU when ``--cuda-aware-mpi off`` forces staging, which is how the
host tests prove the staging path on every layout) or a :class:`DeviceCopies` (CuPy arrays,
pinned buffers, a copy stream and events); they copy every dtype a run holds, bfloat16
included (the group hands MPI its raw words after staging). The seconds and bytes of the
copies are booked in the group's ledger (``Ledger.staging``), apart from the MPI calls the
planner predicts.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections import defaultdict
from typing import Any, Protocol

import numpy as np

ENV_OVERRIDE = "MPIPAR_CUDA_AWARE_MPI"
"""Environment variable that overrides what the MPI library reports: 1/on/yes or 0/off/no
(for an MPI that is CUDA-aware without exporting a query, or one that lies)."""

_TRUE, _FALSE = ("1", "on", "yes", "true"), ("0", "off", "no", "false")


# ------------------------------------------------------------------ CUDA-aware MPI detection
def loaded_mpi_library() -> str | None:
    """The path of the MPI library mpi4py loaded into this process (``libmpi*.so*`` in
    /proc/self/maps), or None where it cannot be found (not Linux)."""
    import mpi4py.MPI  # noqa: F401  (loads the library)
    try:
        with open("/proc/self/maps") as fh:
            paths = [line.split()[-1] for line in fh if "/" in line]
    except OSError:
        return None
    return next((os.path.realpath(p) for p in paths
                 if os.path.basename(p).startswith("libmpi") and ".so" in p), None)


def query_cuda_support(library: str | None) -> tuple[bool, str]:
    """Ask ``library`` (a path; None: this process's global symbols) whether it handles CUDA
    device buffers: ``MPIX_Query_cuda_support()`` (Open MPI, MPICH >= 4.1), else MPICH's
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &ok)``. Returns (supported, how we know)."""
    handle = ctypes.CDLL(library) if library else ctypes.CDLL(None)
    name = library or "this process"
    query = getattr(handle, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype, query.argtypes = ctypes.c_int, []
        value = int(query())
        return bool(value), f"MPIX_Query_cuda_support() = {value} in {name}"
    gpu_query = getattr(handle, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        ok = ctypes.c_int(0)
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        gpu_query(0, ctypes.byref(ok))  # MPIX_GPU_SUPPORT_CUDA = 0
        return bool(ok.value), f"MPIX_GPU_query_support(CUDA) = {ok.value} in {name}"
    return False, f"{name} exports no CUDA support query (MPIX_Query_cuda_support)"


def cuda_aware_mpi() -> tuple[bool, str]:
    """Whether the loaded MPI library takes CUDA device buffers, and how we know: the
    environment override :data:`ENV_OVERRIDE` if set, else the library's own answer
    (:func:`query_cuda_support`). Raises ValueError for an override that is not a yes or no."""
    override = env_override()
    if override is not None:
        return override, f"{ENV_OVERRIDE}={os.environ[ENV_OVERRIDE].strip().lower()}"
    return query_cuda_support(loaded_mpi_library())


def env_override() -> bool | None:
    """What :data:`ENV_OVERRIDE` says (None: not set), read without loading MPI; ValueError for
    a value that is not a yes or no."""
    override = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if not override:
        return None
    if override not in _TRUE + _FALSE:
        raise ValueError(f"{ENV_OVERRIDE}={override!r}: must be one of "
                         f"{', '.join(_TRUE + _FALSE)}")
    return override in _TRUE


# ------------------------------------------------------------------------------- copies
class Copies(Protocol):
    """Host buffers and the copies between them and the arrays of one array module."""

    device: bool

    def empty(self, n: int, dtype: np.dtype) -> Any: ...
    def to_host(self, src: Any, dst: Any) -> Any: ...
    def to_array(self, src: Any, dst: Any) -> Any: ...
    def wait(self, event: Any) -> None: ...
    def sync(self) -> None: ...
    def staged(self, a: Any) -> bool: ...


class HostCopies:
    """NumPy arrays through plain host buffers: synchronous copies (events are None)."""

    device = False

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype)

    def to_host(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src.reshape(-1))

    def to_array(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst.reshape(-1), src)

    def wait(self, event: Any) -> None:
        return None

    def sync(self) -> None:
        return None

    def staged(self, a: Any) -> bool:
        return True


class DeviceCopies:
    """CuPy arrays through pinned host buffers: device-to-host copies on a copy stream of their
    own (ordered after the compute stream's work by an event), host-to-device copies on the
    compute stream; each returns the event that marks its end."""

    device = True

    def __init__(self) -> None:
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        import cupyx
        return cupyx.empty_pinned((n,), dtype)

    def to_host(self, src: Any, dst: np.ndarray) -> Any:
        self.stream.wait_event(self.cupy.cuda.get_current_stream().record())
        self.cupy.asnumpy(src.reshape(-1), stream=self.stream, out=dst, blocking=False)
        return self.stream.record()

    def to_array(self, src: np.ndarray, dst: Any) -> Any:
        stream = self.cupy.cuda.get_current_stream()
        dst.reshape(-1).set(src, stream=stream)
        return stream.record()

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def staged(self, a: Any) -> bool:
        return not isinstance(a, np.ndarray)  # host arrays (gathering for export) go straight


# -------------------------------------------------------------------------------- paths
class DirectPath:
    """MPI gets the arrays themselves (host arrays; device arrays with a CUDA-aware MPI, after
    the compute stream is synchronized)."""

    staging = False

    def __init__(self, copies: Copies, why: str) -> None:
        self.copies, self.why = copies, why

    def describe(self) -> str:
        return f"direct ({self.why})"

    def lease(self, a: Any, ledger: Any, load: bool) -> Any:
        if load:
            self.copies.sync()
        return a

    def release(self, a: Any, buf: Any, ledger: Any, store: bool) -> None:
        return None

    def ahead(self, a: Any, ledger: Any) -> None:
        return None


class StagedPath:
    """MPI gets reusable host buffers; see the module docstring."""

    staging = True

    def __init__(self, copies: Copies, why: str) -> None:
        self.copies, self.why = copies, why
        # by (dtype, length); the dtype itself, not its string: every bfloat16 and raw 2-byte
        # void dtype is "<V2"
        self.free: dict[tuple[np.dtype, int], list[tuple[Any, Any]]] = defaultdict(list)
        self.allocated = 0  # host buffers ever allocated (a bounded pool stops growing)
        self._ahead: dict[int, tuple[Any, Any, Any]] = {}  # id(a) -> (a, buffer, copy event)

    def describe(self) -> str:
        kind = "pinned host buffers" if self.copies.device else "host buffers"
        return f"staged through reusable {kind} ({self.why})"

    def _take(self, n: int, dtype: np.dtype) -> Any:
        free = self.free[(np.dtype(dtype), n)]
        if free:
            buf, event = free.pop()
            self.copies.wait(event)  # its last copy back must be over before it is refilled
            return buf
        self.allocated += 1
        return self.copies.empty(n, dtype)

    def ahead(self, a: Any, ledger: Any) -> None:
        """Start copying ``a`` (to be sent by a coming call) into a buffer now."""
        if not self.copies.staged(a) or id(a) in self._ahead:
            return
        t0 = time.perf_counter()
        buf = self._take(a.size, a.dtype)
        self._ahead[id(a)] = (a, buf, self.copies.to_host(a, buf))
        ledger.stage(a.nbytes, time.perf_counter() - t0)

    def lease(self, a: Any, ledger: Any, load: bool) -> Any:
        """The host buffer MPI uses for ``a`` (holding ``a``'s values when ``load``)."""
        if not self.copies.staged(a):
            return a
        t0 = time.perf_counter()
        early = self._ahead.pop(id(a), None)
        if early is not None and early[0] is a:
            _, buf, event = early
            self.copies.wait(event)
        else:
            buf = self._take(a.size, a.dtype)
            if load:
                self.copies.wait(self.copies.to_host(a, buf))
                ledger.stage(a.nbytes, 0.0)
        ledger.stage(0, time.perf_counter() - t0)
        return buf

    def release(self, a: Any, buf: Any, ledger: Any, store: bool) -> None:
        """The call on ``buf`` is over: copy it back into ``a`` when ``store``; pool it."""
        if buf is a:
            return
        t0 = time.perf_counter()
        event = self.copies.to_array(buf, a) if store else None
        self.free[(buf.dtype, buf.size)].append((buf, event))
        ledger.stage(a.nbytes if store else 0, time.perf_counter() - t0)


MpiPath = DirectPath | StagedPath


def copies_for(device: bool) -> Copies:
    """The copies of this run's array module: CuPy's on a device, NumPy's on the host."""
    return DeviceCopies() if device else HostCopies()


def choose_path(choice: str, device: bool) -> MpiPath:
    """The path of a run: ``choice`` is ``--cuda-aware-mpi`` (auto, on, off), ``device`` whether
    arrays live on a CUDA device. ``off`` stages (on the CPU too: the host tests force the
    staging path this way); ``on`` hands device arrays straight to MPI (the configuration
    rules have checked that the library takes them); ``auto`` does so when
    :func:`cuda_aware_mpi` says it can, and stages device arrays otherwise. Host arrays need no
    staging and go straight under ``auto`` and ``on``."""
    copies = copies_for(device)
    if choice == "off":
        return StagedPath(copies, "--cuda-aware-mpi off")
    if not device:
        return DirectPath(copies, "host arrays")
    aware, how = cuda_aware_mpi()
    if choice == "on" or aware:
        return DirectPath(copies, f"device buffers, CUDA-aware MPI: {how}")
    return StagedPath(copies, f"MPI is not CUDA-aware: {how}")
