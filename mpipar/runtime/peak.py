"""Peak FLOP/s, the denominator of MFU: a GEMM probe on the CPU, the share of it a rank gets
when ranks share cores, and a CUDA device's rate: from its attributes (float32, float64 FMA
lanes) or, for bfloat16, its tensor cores' dense rate from the datasheet."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PeakProbe:
    """A GEMM probe's rates: the median of ``repeats`` windows (each window's fastest product)
    and the slowest and fastest window, with the ``threads`` it ran on."""

    flops: float
    low: float
    high: float
    repeats: int
    threads: int

    @property
    def spread(self) -> float:
        """(fastest - slowest window) / median: how much the machine disturbed the probe."""
        return (self.high - self.low) / self.flops

    def describe(self) -> str:
        return (f"median of {self.repeats} GEMM probes on {self.threads} thread(s), "
                f"{self.low / 1e9:,.1f}-{self.high / 1e9:,.1f} GFLOP/s, "
                f"spread {100 * self.spread:.0f}%")


def windowed_best(fn, repeats: int, seconds: float, clock=time.perf_counter) -> list[float]:
    """Seconds of ``fn()`` in each of ``repeats`` windows of about ``seconds / repeats`` each
    (after one warm-up call): the fastest call of each window (at least two calls a window), so
    that other processes taking the cores for a moment do not lengthen it. ``clock`` times the
    calls (``time.process_time``: the CPU this process spent, which other processes' load
    does not lengthen); the windows are wall time."""
    if not seconds > 0 or repeats < 1:
        raise ValueError(f"windowed_best: seconds={seconds!r} must be > 0 and repeats={repeats} "
                         f">= 1")
    fn()
    out = []
    for _ in range(repeats):
        best, reps, t_end = math.inf, 0, time.perf_counter() + seconds / repeats
        while reps < 2 or time.perf_counter() < t_end:
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
            reps += 1
        out.append(best)
    return out


def probe_peak(dtype: str = "float32", threads: int | None = None, repeats: int = 7,
               seconds: float = 0.25, n: int = 384,
               shape: tuple[int, int, int] | None = None) -> PeakProbe:
    """FLOP/s of a dense GEMM ``[n, n] @ [n, n]`` (``shape`` ``(m, k, p)``: ``[m, k] @ [k, p]``)
    of ``dtype`` on the CPU: ``repeats`` windows of about ``seconds / repeats`` each
    (:func:`windowed_best`), the fastest product of each window, and their median.
    ``threads``: the BLAS threads to probe with (None: this process's; the planner probes with a
    rank's share of the node's cores, as ``train`` runs). bfloat16 is measured as float32: the
    CPU kernels multiply bf16 operands in float32.

    Each window's fastest product, so that other processes taking the cores for a moment do not
    lower it; the median over windows, so that one lucky or disturbed window does not set it
    (:func:`mpipar.runtime.nodes.cpu_peak_share` accounts for the sharing that lasts)."""
    import numpy as np

    dtype = "float32" if dtype == "bfloat16" else dtype
    m, k, p = shape or (n, n, n)
    if not seconds > 0 or min(m, k, p) < 1 or repeats < 1:
        raise ValueError(f"probe_peak: seconds={seconds!r} must be > 0, n={n} (shape "
                         f"{(m, k, p)}) >= 1 and repeats={repeats} >= 1")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, p)).astype(dtype)
    out = np.empty((m, p), dtype)
    with blas_threads(threads):
        from mpipar.runtime.nodes import threads_in_use
        used = threads_in_use()
        rates = [2.0 * m * k * p / t
                 for t in windowed_best(lambda: np.matmul(a, b, out=out), repeats, seconds)]
    return PeakProbe(statistics.median(rates), min(rates), max(rates), repeats, used)


def blas_threads(threads: int | None):
    """A context in which BLAS runs ``threads`` threads (None: as it is)."""
    import contextlib
    if threads is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=threads, user_api="blas")


def measure_peak_flops(dtype: str = "float32", seconds: float = 0.25, n: int = 384) -> float:
    """The median rate of :func:`probe_peak` with this process's threads."""
    return probe_peak(dtype, seconds=seconds, n=n).flops


# Arithmetic lanes per streaming multiprocessor by compute capability: (float32, float64).
_SM_LANES = {(6, 0): (64, 32), (6, 1): (128, 4), (7, 0): (64, 32), (7, 5): (64, 2),
             (8, 0): (64, 32), (8, 6): (128, 2), (8, 7): (128, 2), (8, 9): (128, 2),
             (9, 0): (128, 64), (10, 0): (128, 64), (12, 0): (128, 2)}


# cudaDeviceAttr values (CUDA's driver_types.h): multiprocessors and the peak SM clock in kHz.
_ATTR_SM_COUNT, _ATTR_CLOCK_KHZ = 16, 13


BF16_DENSE_PEAK = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100 NVL", 835.5e12),
                   ("H100", 989.4e12), ("A100", 312e12))
"""bfloat16 tensor-core FLOP/s by device name (the first entry the name contains): the
datasheets' dense rates (without the 2:4 structured sparsity their headline figures double
by); H100 and H200 SXM 989.4 TFLOP/s, H100 PCIe 756.5, H100 NVL 835.5, A100 312."""

BF16_DENSE_PEAK_BY_CC = {(8, 0): 312e12, (9, 0): 989.4e12}
"""The same by compute capability, for a device whose name the table does not list."""


def bf16_dense_peak(name: str, cc: tuple[int, int]) -> float | None:
    """The datasheet's dense bfloat16 tensor-core FLOP/s of the device called ``name`` with
    compute capability ``cc`` (:data:`BF16_DENSE_PEAK`, then :data:`BF16_DENSE_PEAK_BY_CC`);
    None for a device neither lists."""
    for key, flops in BF16_DENSE_PEAK:
        if key in name:
            return flops
    return BF16_DENSE_PEAK_BY_CC.get(cc)


def gpu_peak_flops(dtype: str = "float32", device: int | None = None) -> float:
    """Peak FLOP/s of a CUDA device: for bfloat16 its tensor cores' dense rate
    (:func:`bf16_dense_peak`); otherwise (and for a bf16 device neither table lists, whose MFU
    is then against the float32 FMA rate) the FMA rate from its attributes:
    ``2 * SMs * lanes per SM * clock``, lanes by compute capability (:data:`_SM_LANES`)."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    cc_text = dev.compute_capability  # e.g. "90"
    cc = (int(cc_text[:-1]), int(cc_text[-1]))
    if dtype == "bfloat16":
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        tensor = bf16_dense_peak(name.decode() if isinstance(name, bytes) else str(name), cc)
        if tensor is not None:
            return tensor
    get = cupy.cuda.runtime.deviceGetAttribute
    sms, clock_khz = get(_ATTR_SM_COUNT, dev.id), get(_ATTR_CLOCK_KHZ, dev.id)
    lanes = _SM_LANES.get(cc) or _SM_LANES.get((cc[0], 0)) or (64, 2)
    per_sm = lanes[1] if dtype == "float64" else lanes[0]
    return 2.0 * sms * per_sm * clock_khz * 1e3

