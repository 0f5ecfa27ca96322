"""Where the arithmetic runs: the kernel backend of training, CPU thread budgets per rank, the
memory a node can still give, and the peak FLOP/s of MFU.

Ranks that share a node share its cores: ``configure_threads`` gives each rank
``cores it may use // ranks on those cores`` threads for BLAS, OpenMP and Numba (a rank bound to
its own cores keeps them all). It sets environment variables,
so it must run before NumPy or Numba are imported (``python -m mpipar.train`` does this); a
variable the user already set wins. They share its memory too: training compares the planner's
per-rank memory with ``available_memory_bytes() / ranks_on_this_node`` before it allocates.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mpipar.mpi_init import MPI  # MPI_Init under MPIPAR_INIT_TIMEOUT

from mpipar.config import Config, ConfigError, require, rules

HOST_BACKENDS = ("numba", "numpy")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
BLAS_SPIN = ("OPENBLAS_THREAD_TIMEOUT", "4")
"""How long an idle OpenBLAS worker spins for more work before it sleeps: 2^4 cycles, against
OpenBLAS's default of 2^28 (about 0.1 s). The Numba kernels (attention, the elementwise ops)
run their own threads between the GEMMs on the same cores. With 2 threads, causal attention at
seq 512 took twice as long right after a NumPy GEMM as alone (16.5-22 ms against 8-10 ms
forward), because the spinning workers held a core; with this setting it takes the same time
either way. Set like the thread counts, before NumPy loads; a value the user set stays."""


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
POOL_LIMIT = 32 << 20  # glibc's largest M_MMAP_THRESHOLD on 64-bit systems


def pool_freed_memory() -> bool:
    """Make the C allocator the step's buffer pool: arrays up to :data:`POOL_LIMIT` bytes come
    from a heap that keeps what is freed (no mmap per array, no trim), so the activations of one
    microbatch, freed after its backward, are the memory of the next, step after step: a step
    touches new pages only in its first microbatch of the first step, not on every allocation
    (measured: the page faults per step in docs/benchmarks.md). Process-wide and once per
    process; returns False where the C library has no ``mallopt`` (not glibc), changing
    nothing."""
    import ctypes
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, POOL_LIMIT) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def to_host(a):
    """A NumPy view (or, for a CuPy array, a host copy) of ``a``."""
    import numpy as np
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def cuda_unavailable() -> str | None:
    """None if CuPy imports and sees a CUDA device, else the reason it does not."""
    from mpipar.kernels import available_backends
    return available_backends()["cupy"]


def resolve_device(device: str) -> str:
    """``--device`` as a run uses it: ``auto`` is cuda when CuPy sees a device, else cpu."""
    if device == "auto":
        return "cuda" if cuda_unavailable() is None else "cpu"
    return device


@dataclass(frozen=True)
class Device:
    """Where one rank's arrays live: ``kind`` cpu or cuda, the CUDA device ``index`` (-1 on the
    CPU), and how many devices this process sees."""

    kind: str
    index: int = -1
    visible: int = 0

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


@rules("backend")
def check_config(cfg: Config, world: int) -> None:
    """The device, the kernels that run on it, the dtypes built, and how arrays reach MPI."""
    t = cfg.train
    require(t.dtype != "bfloat16",
            "train.dtype='bfloat16': mixed precision (bf16 compute with float32 master weights, "
            "optimizer state and gradient accumulation) is not built yet, on the CPU or on a "
            "CUDA device; use float32 or float64")
    if t.device == "cuda":
        reason = cuda_unavailable()
        require(reason is None, f"train.device='cuda': no CUDA device here: {reason}; use "
                                f"--device cpu (or auto)")
    device = resolve_device(t.device)
    require(device == "cuda" or t.backend != "cupy",
            f"train.backend='cupy' with train.device={t.device!r}: the CuPy kernels need "
            f"device arrays; use --device cuda (or auto on a machine with a CUDA device)")
    require(device == "cpu" or t.backend in ("auto", "cupy"),
            f"train.backend={t.backend!r} with train.device={t.device!r}: the CPU kernels "
            f"cannot run on a CUDA device; use --backend auto or cupy")
    if t.cuda_aware_mpi != "off":
        from mpipar.staging import cuda_aware_mpi
        try:
            aware, how = cuda_aware_mpi()
        except ValueError as exc:
            raise ConfigError(f"train.cuda_aware_mpi={t.cuda_aware_mpi!r}: {exc}") from None
        require(aware or t.cuda_aware_mpi != "on",
                f"train.cuda_aware_mpi='on': the MPI library does not take CUDA device buffers "
                f"({how}); use auto or off (staging through host buffers)")


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """This node's task count from SLURM's compact form, e.g. ``"4(x2),3"`` = 4, 4, 3."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        if not count.isdigit() or (repeat and not repeat.rstrip(")").isdigit()):
            return None
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[node_id] if 0 <= node_id < len(counts) else None


def local_size_from_env() -> int | None:
    """Ranks on this node as the launcher says (MPICH/Hydra, Open MPI, MVAPICH, then srun), or
    None. MPI launchers come first: ranks that mpirun starts inside an allocation inherit the
    variables of its own one-task srun step, which would give the wrong count."""
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if "SLURM_PROCID" in os.environ and os.environ.get("SLURM_NODEID", "").isdigit():
        return slurm_tasks_on_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""),
                                   int(os.environ["SLURM_NODEID"]))
    return None


def ranks_on_node(names: list[str], rank: int) -> int:
    """How many ranks share this rank's node, from every rank's processor name (``names``, in
    rank order: the launcher did not say, so the caller gathered them)."""
    return names.count(names[rank])


def shared_memory_nodes(comm: MPI.Comm = MPI.COMM_WORLD) -> list[int]:
    """The node of every rank of ``comm``, by rank (small integers in order of first appearance),
    as MPI sees them: the ranks that can share memory (``Split_type(COMM_TYPE_SHARED)``, a
    collective). The one node detection of mpipar: the grid's node map and :func:`node_shape`
    both read it."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    first: dict[int, int] = {}
    return [first.setdefault(x, len(first)) for x in comm.allgather(leader)]


def node_shape(comm: MPI.Comm = MPI.COMM_WORLD) -> str:
    """The nodes of ``comm`` as MPI sees them (:func:`shared_memory_nodes`, a collective):
    ``"K node(s) x R rank(s) per node: host (ranks a-b), ..."`` (R like ``4/2`` when uneven)."""
    nodes = shared_memory_nodes(comm)
    hosts = comm.allgather(MPI.Get_processor_name())
    members: dict[int, list[int]] = {}
    for rank, n in enumerate(nodes):
        members.setdefault(n, []).append(rank)
    sizes = [len(m) for m in members.values()]
    per = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
    text = ", ".join(f"{hosts[m[0]]} (ranks {_ranges(m)})" for m in members.values())
    return f"{len(members)} node(s) x {per} rank(s) per node: {text}"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(out)


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask; all online cores where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_sharing_cores(ranks_on_node: int) -> int:
    """How many of this node's ``ranks_on_node`` ranks run on this rank's cores.

    A launcher that binds ranks (Open MPI without oversubscription, srun --cpu-bind) gives each
    a slice of the cores its own process may use; one that does not gives every rank all of
    them. The launcher's cores are this process's parent's affinity (its daemon: orted/prted,
    hydra_pmi_proxy, slurmstepd) joined with this process's; ranks spread evenly over them."""
    try:
        mine = os.sched_getaffinity(0)
        pool = mine | os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # not Linux, or the parent has gone
        return ranks_on_node
    return max(1, min(ranks_on_node, round(ranks_on_node * len(mine) / len(pool))))


def threads_per_rank(ranks_on_node: int) -> int:
    """Threads for a rank: the cores it may use split among the ranks that run on them."""
    return max(1, cpu_count() // ranks_sharing_cores(ranks_on_node))


def configure_threads(ranks: int | None) -> int:
    """Split this node's cores among the ``ranks`` that share it (None: the count the launcher
    gives, else a lone process); returns the threads per rank."""
    if ranks is None:
        ranks = local_size_from_env() or 1
    threads = threads_per_rank(ranks)
    for var in THREAD_VARS:
        os.environ.setdefault(var, str(threads))
    os.environ.setdefault(*BLAS_SPIN)
    return int(os.environ["NUMBA_NUM_THREADS"])



def available_memory_bytes() -> int | None:
    """Memory this node can still give, in bytes: ``MemAvailable`` of /proc/meminfo, lowered to
    what this process's memory cgroup still allows when it has a limit (a container or a batch
    job); None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            found += [int(line.split()[1]) * 1024 for line in fh
                      if line.startswith("MemAvailable:")]
    except OSError:
        pass
    headroom = _cgroup_headroom()
    if headroom is not None:
        found.append(headroom)
    return min(found) if found else None


SHARED_MEMORY_DIR = "/dev/shm"
"""Where MPICH and Open MPI put the files behind shared-memory windows on Linux."""


def shared_memory_bytes() -> int | None:
    """Bytes still free in :data:`SHARED_MEMORY_DIR` (a tmpfs: a container's is 64 MiB unless
    told otherwise), or None where there is none."""
    try:
        st = os.statvfs(SHARED_MEMORY_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, or v1), or None without one."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = f"/sys/fs/cgroup{path}", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = (f"/sys/fs/cgroup/memory{path}",
                           ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        else:
            continue
        try:
            limit, usage = (Path(base, f).read_text().strip() for f in files)
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 2**62:  # "max" or 2**63-ish: none
            return int(limit) - int(usage)
    return None


def measure_peak_flops(dtype: str = "float32", seconds: float = 0.25, n: int = 384) -> float:
    """FLOP/s of a dense GEMM ``[n, n] @ [n, n]`` of ``dtype`` on the CPU with this process's
    threads: the fastest of the products repeated for about ``seconds`` (after one warm-up).

    The fastest repetition, not the mean, so that other processes that share the cores for a
    moment do not lower the peak (:func:`cpu_peak_share` accounts for the sharing that lasts)."""
    import numpy as np

    if not seconds > 0 or n < 1:
        raise ValueError(f"measure_peak_flops: seconds={seconds!r} must be > 0 and n={n} >= 1")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    out = np.empty((n, n), dtype)
    np.matmul(a, b, out=out)
    best, reps, t_end = math.inf, 0, time.perf_counter() + seconds
    while reps < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2.0 * n ** 3 / best


def cpu_peak_share(threads: int, ranks_on_node: int) -> float:
    """The fraction of its threads' peak a rank gets when ``ranks_on_node`` ranks of
    ``threads`` threads each share this node: 1 unless more threads than cores run on the cores
    this rank may use (:func:`ranks_sharing_cores`: a rank bound to its own core gets all of it)."""
    if threads < 1 or ranks_on_node < 1:
        raise ValueError(f"cpu_peak_share: threads={threads} and ranks_on_node={ranks_on_node} "
                         f"must be >= 1")
    return min(1.0, cpu_count() / (threads * ranks_sharing_cores(ranks_on_node)))


# Arithmetic lanes per streaming multiprocessor by compute capability: (float32, float64).
_SM_LANES = {(6, 0): (64, 32), (6, 1): (128, 4), (7, 0): (64, 32), (7, 5): (64, 2),
             (8, 0): (64, 32), (8, 6): (128, 2), (8, 7): (128, 2), (8, 9): (128, 2),
             (9, 0): (128, 64), (10, 0): (128, 64), (12, 0): (128, 2)}


# cudaDeviceAttr values (CUDA's driver_types.h): multiprocessors and the peak SM clock in kHz.
_ATTR_SM_COUNT, _ATTR_CLOCK_KHZ = 16, 13


def gpu_peak_flops(dtype: str = "float32", device: int | None = None) -> float:
    """Peak FMA FLOP/s of a CUDA device (without tensor cores) from its attributes:
    ``2 * SMs * lanes per SM * clock``, lanes by compute capability (:data:`_SM_LANES`)."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    cc_text = dev.compute_capability  # e.g. "90"
    cc = (int(cc_text[:-1]), int(cc_text[-1]))
    get = cupy.cuda.runtime.deviceGetAttribute
    sms, clock_khz = get(_ATTR_SM_COUNT, dev.id), get(_ATTR_CLOCK_KHZ, dev.id)
    lanes = _SM_LANES.get(cc) or _SM_LANES.get((cc[0], 0)) or (64, 2)
    per_sm = lanes[1] if dtype == "float64" else lanes[0]
    return 2.0 * sms * per_sm * clock_khz * 1e3


def main() -> int:
    """``python -m mpipar.backend`` under a launcher: rank 0 prints the nodes and ranks per node
    that MPI sees, and the threads and peak share each rank gets (a job's first line). All
    of it is start-up, so all of it runs under ``MPIPAR_INIT_TIMEOUT`` (:mod:`mpipar.mpi_init`):
    a launch whose ranks cannot reach each other fails instead of hanging."""
    from mpipar.mpi_init import deadline
    with deadline():
        return _probe(MPI.COMM_WORLD)


def _probe(comm: MPI.Comm) -> int:
    shape = node_shape(comm)
    on_node = local_size_from_env() or ranks_on_node(comm.allgather(MPI.Get_processor_name()),
                                                     comm.Get_rank())
    threads = threads_per_rank(on_node)
    share = comm.gather(cpu_peak_share(threads, on_node))
    if comm.Get_rank() == 0:
        print(f"mpipar: {shape}; {threads} thread(s)/rank, CPU share per rank "
              f"{min(share):.2f}-{max(share):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
