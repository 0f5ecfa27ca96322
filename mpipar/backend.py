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
from pathlib import Path

from mpi4py import MPI

from mpipar.config import Config, require, rules

HOST_BACKENDS = ("numba", "numpy")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def training_backend(name: str):
    """The kernels of training, which keeps every array in host memory: ``auto`` is the fastest
    CPU backend available (Numba, else NumPy)."""
    from mpipar.kernels import available_backends, get_backend
    if name == "auto":
        free = available_backends()
        name = next(n for n in HOST_BACKENDS if free[n] is None)
    return get_backend(name)


def to_host(a):
    """A NumPy view (or, for a CuPy array, a host copy) of ``a``."""
    import numpy as np
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@rules("backend")
def check_config(cfg: Config, world: int) -> None:
    """Training keeps its arrays in host memory: the CuPy backend is refused."""
    require(cfg.train.backend != "cupy",
            "train.backend='cupy': GPU training is not available yet: the engine keeps "
            "parameters, activations and MPI buffers in host memory (the CuPy kernels exist in "
            "mpipar.kernels but training does not use them); use auto, numba or numpy")


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


def gpu_peak_flops(dtype: str = "float32", device: int | None = None) -> float:
    """Peak FMA FLOP/s of a CUDA device (without tensor cores) from its attributes:
    ``2 * SMs * lanes per SM * clock``, lanes by compute capability (:data:`_SM_LANES`)."""
    import cupy

    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    attrs = dev.attributes
    cc = (attrs["ComputeCapabilityMajor"], attrs["ComputeCapabilityMinor"])
    lanes = _SM_LANES.get(cc) or _SM_LANES.get((cc[0], 0)) or (64, 2)
    per_sm = lanes[1] if dtype == "float64" else lanes[0]
    return 2.0 * attrs["MultiProcessorCount"] * per_sm * attrs["ClockRate"] * 1e3


def main() -> int:
    """``python -m mpipar.backend`` under a launcher: rank 0 prints the nodes and ranks per node
    that MPI sees, and the threads and peak share each rank gets (a job's first line)."""
    comm = MPI.COMM_WORLD
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
