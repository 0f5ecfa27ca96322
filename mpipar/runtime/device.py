"""Where the arithmetic of training runs: the kernel backend, the device (rank -> GPU), the copy
of an array to the host, and the rules of --backend, --device, --dtype, --cpu-bf16-gemm and --cuda-aware-mpi."""
from __future__ import annotations

from dataclasses import dataclass

from mpipar.runtime.mpi_init import MPI  # MPI_Init under MPIPAR_INIT_TIMEOUT

from mpipar.config import ConfigError, require
from mpipar.layout import Layout
from mpipar.runtime.precision import Precision

HOST_BACKENDS = ("numba", "numpy")


def training_backend(name: str, device: str = "cpu"):
    """The kernels of training on ``device`` (resolved: cpu or cuda): on cuda the CuPy kernels;
    on the CPU ``auto`` is the fastest CPU backend available (Numba, else NumPy)."""
    from mpipar.kernels import available_backends, get_backend
    if device == "cuda":
        return get_backend("cupy")
    if name == "auto":
        free = available_backends()
        name = next(n for n in HOST_BACKENDS if free[n] is None)
    return get_backend(name)


def attention_kernels(kernels, requested: str, model) -> tuple:
    """``kernels`` with the bf16 attention of a CUDA device fixed to ``requested`` (auto, cudnn,
    mpipar) for ``model``'s head width and sliding windows, and the line that says which and
    why (the start-up line prints it). The choice is made for the widest window the model
    uses; under ``auto`` a call cuDNN refuses still runs mpipar's kernel."""
    from mpipar.kernels import with_attention
    return with_attention(kernels, requested, model.head_dim, max(model.windows()))


def check_attention(layout: Layout, device: str) -> None:
    """An explicit ``--attention-backend`` names the bf16 attention of a CUDA device, and that
    backend must take the model's attention (its head width, each of its windows)."""
    t, m = layout.train, layout.model
    if t.attention_backend == "auto":
        return
    require(device == "cuda" and Precision.named(t.dtype).mixed,
            f"train.attention_backend={t.attention_backend!r} chooses the bf16 attention of a "
            f"CUDA device; this run computes in {t.dtype} on {device}, where mpipar's exact "
            f"kernels run: leave it auto")
    require(not (t.attention_backend == "cudnn" and t.document_masking),
            "train.attention_backend='cudnn' with --document-masking: a one-token document is a "
            "block of one query and one key, which cuDNN's attention backward refuses; leave "
            "it auto (cuDNN for every block it takes, mpipar's kernel for the rest)")
    from mpipar.kernels.gpu_bf16 import attention_choice
    for window in sorted(set(m.windows())):
        try:
            attention_choice(t.attention_backend, m.head_dim, window)
        except ValueError as exc:
            raise ConfigError(f"train.attention_backend={t.attention_backend!r} for head_dim "
                              f"{m.head_dim}, window {window}: {exc}") from None


def cpu_gemm_kernels(kernels, train):
    """``kernels`` with a CPU run's bf16 GEMMs as ``train.cpu_bf16_gemm`` says (oneMKL's or the
    float32 BLAS, :func:`mpipar.kernels.with_cpu_bf16_gemm`), named in their description; a
    float32/float64 run and the GPU keep them as they are."""
    if not Precision.named(train.dtype).mixed:
        return kernels
    from mpipar.kernels import with_cpu_bf16_gemm
    return with_cpu_bf16_gemm(kernels, train.cpu_bf16_gemm)


def check_cpu_gemm(layout: Layout, device: str) -> None:
    """An explicit ``--cpu-bf16-gemm`` names the bf16 GEMM of a CPU run, and ``mkl`` needs a
    loadable oneMKL (``auto`` falls back quietly)."""
    t = layout.train
    if t.cpu_bf16_gemm == "auto":
        return
    require(device == "cpu" and Precision.named(t.dtype).mixed,
            f"train.cpu_bf16_gemm={t.cpu_bf16_gemm!r} chooses the bf16 GEMM of a CPU run; "
            f"this run computes in {t.dtype} on {device}: leave it auto")
    from mpipar.kernels.mkl_bf16 import gemm_choice
    try:
        gemm_choice(t.cpu_bf16_gemm)
    except ValueError as exc:
        raise ConfigError(f"train.cpu_bf16_gemm={t.cpu_bf16_gemm!r}: {exc}; or use auto or "
                          f"float32") from None


def to_host(a):
    """A NumPy view (or, for a CuPy array, a host copy) of ``a``."""
    import numpy as np
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def host_copy(a):
    """A host copy of ``a`` that later changes to ``a`` leave alone (what a background write
    reads): a plain copy of a NumPy array; a CuPy array lands in pinned host memory (the
    device-to-host copy at full bus speed; CuPy's pinned pool reuses the buffers)."""
    import numpy as np
    if isinstance(a, np.ndarray) or not hasattr(a, "get"):
        return np.array(a, copy=True)
    import cupy
    import cupyx
    out = cupyx.empty_pinned(a.shape, a.dtype)
    cupy.ascontiguousarray(a).get(out=out)
    return out


def cuda_unavailable() -> str | None:
    """None if CuPy imports and sees a CUDA device, else the reason it does not."""
    from mpipar.kernels import available_backends
    return available_backends()["cupy"]


@dataclass(frozen=True)
class DeviceChoice:
    """One ``--device``: where a run asks its arrays to live. ``gpu``: it names a CUDA device;
    ``probes``: it is decided on the machine that runs (``auto``: cuda when CuPy sees a
    device, else cpu). The rules, the planner and the rank ask it instead of comparing names."""

    name: str
    gpu: bool = False
    probes: bool = False

    def on_this_machine(self) -> DeviceChoice:
        """The device a run on this machine uses: cpu or cuda."""
        if self.probes:
            return CUDA if cuda_unavailable() is None else CPU
        return self

    def __str__(self) -> str:
        return self.name


CPU = DeviceChoice("cpu")
CUDA = DeviceChoice("cuda", gpu=True)
AUTO = DeviceChoice("auto", probes=True)
DEVICE_MODES: dict[str, DeviceChoice] = {d.name: d for d in (CPU, CUDA, AUTO)}
"""Every ``--device``, by name."""


def device_of(train) -> DeviceChoice:
    """The :class:`DeviceChoice` of a train section's ``device``."""
    return DEVICE_MODES[train.device]


def resolve_device(device: str) -> str:
    """``--device`` as a run uses it: ``auto`` is cuda when CuPy sees a device, else cpu."""
    return DEVICE_MODES[device].on_this_machine().name


@dataclass(frozen=True)
class Device:
    """Where one rank's arrays live: ``kind`` cpu or cuda, the CUDA device ``index`` (-1 on the
    CPU), and how many devices this process sees."""

    kind: str
    index: int = -1
    visible: int = 0

    @property
    def gpu(self) -> bool:
        """Whether this rank's arrays live on a CUDA device."""
        return self.kind == CUDA.name

    def describe(self) -> str:
        if self.kind == "cpu":
            return "cpu"
        return f"cuda:{self.index} of {self.visible} visible"


def local_rank(comm: MPI.Comm) -> int:
    """This rank's index among the ranks of its node (a ``COMM_TYPE_SHARED`` split of ``comm``,
    a collective: every rank of ``comm`` calls it)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def gpu_for(local: int, visible: int) -> int:
    """The CUDA device of the rank with node-local index ``local`` among ``visible`` devices
    (``CUDA_VISIBLE_DEVICES`` decides which and how many): ``local % visible``; several ranks
    share a device when there are more ranks than devices."""
    if visible < 1:
        raise ValueError(f"gpu_for: visible={visible}: no CUDA device to place rank {local} on")
    return local % visible


def ranks_sharing(index: int, visible: int, ranks_on_node: int) -> int:
    """How many of a node's ``ranks_on_node`` ranks :func:`gpu_for` places on CUDA device
    ``index`` of ``visible`` (at least 1: the asking rank is one of them)."""
    return max(1, len(range(index, ranks_on_node, visible)))


def device_memory() -> tuple[int, int]:
    """(free bytes of the current CUDA device, visible CUDA devices): what the device memory
    check divides among the ranks that share a GPU."""
    import cupy
    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free), cupy.cuda.runtime.getDeviceCount()


def select_device(device: str, comm: MPI.Comm) -> Device:
    """Make this rank's device current and say which it is (``device``: --device; on cuda a
    collective over ``comm`` finds the node-local rank). Call after the configuration rules."""
    if resolve_device(device) == "cpu":
        return Device("cpu")
    import cupy
    visible = cupy.cuda.runtime.getDeviceCount()
    index = gpu_for(local_rank(comm), visible)
    cupy.cuda.Device(index).use()
    return Device("cuda", index, visible)


def bf16_unavailable(device: str) -> str | None:
    """None if bfloat16 arrays can be computed with on ``device`` (cpu or cuda), else why not:
    every kernel backend runs bf16 (:mod:`mpipar.kernels`), given ml_dtypes' bfloat16 dtype, and
    on a CUDA device CuPy 14 or newer with NumPy 2.1.2 or newer (CuPy's bfloat16 arrays)."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError as exc:
        return (f"ml_dtypes (bfloat16 arrays) is not importable ({exc}); pip install "
                f"'ml-dtypes>=0.5'")
    if device != "cuda":
        return None
    import cupy
    import numpy as np

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())

    if version(cupy.__version__) < (14,) or version(np.__version__) < (2, 1, 2):
        return (f"CuPy {cupy.__version__} with NumPy {np.__version__}: CuPy's bfloat16 arrays "
                f"need CuPy >= 14 and NumPy >= 2.1.2")
    return None


def check_config(layout: Layout) -> None:
    """The device, the kernels that run on it, what bfloat16 needs there, and how arrays reach
    MPI."""
    t = layout.train
    if device_of(t).gpu:
        reason = cuda_unavailable()
        require(reason is None, f"train.device='cuda': no CUDA device here: {reason}; use "
                                f"--device cpu (or auto)")
    device = resolve_device(t.device)
    if Precision.named(t.dtype).mixed:
        reason = bf16_unavailable(device)
        require(reason is None, f"train.dtype='bfloat16' on {device}: {reason}; use float32 "
                                f"(or install what is missing)")
    check_attention(layout, device)
    check_cpu_gemm(layout, device)
    require(device == "cuda" or t.backend != "cupy",
            f"train.backend='cupy' with train.device={t.device!r}: the CuPy kernels need "
            f"device arrays; use --device cuda (or auto on a machine with a CUDA device)")
    require(device == "cpu" or t.backend in ("auto", "cupy"),
            f"train.backend={t.backend!r} with train.device={t.device!r}: the CPU kernels "
            f"cannot run on a CUDA device; use --backend auto or cupy")
    if t.cuda_aware_mpi != "off":
        from mpipar.runtime.staging import cuda_aware_mpi, env_override
        try:
            env_override()  # a value that is not a yes or no is refused on every device
            # Only a choice that can pass device buffers asks the MPI library (loading it).
            asks = t.cuda_aware_mpi == "on" or device == "cuda"
            aware, how = cuda_aware_mpi() if asks else (False, "not asked")
        except ValueError as exc:
            raise ConfigError(f"train.cuda_aware_mpi={t.cuda_aware_mpi!r}: {exc}") from None
        require(aware or t.cuda_aware_mpi != "on",
                f"train.cuda_aware_mpi='on': the MPI library does not take CUDA device buffers "
                f"({how}); use auto or off (staging through host buffers)")

