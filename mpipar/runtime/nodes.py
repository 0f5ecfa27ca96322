"""What shares a node: the ranks on it (from the launcher, the processor names, or MPI's
shared-memory split), and the CPU threads each rank gets.

Ranks that share a node share its cores: ``configure_threads`` gives each rank
``cores it may use // ranks on those cores`` threads for BLAS, OpenMP and Numba (a rank bound to
its own cores keeps them all); a variable the user already set wins. It sets the environment
variables, which libraries read when they load (the entry points call it before NumPy loads when
the launcher says how many ranks share the node), and sizes the pools of those already loaded
(threadpoolctl for BLAS and OpenMP, ``numba.set_num_threads``): ranks that learn their count from
MPI, after NumPy has loaded, would otherwise each run OpenBLAS with every core of the node.

``python -m mpipar.runtime.nodes`` under a launcher is the job scripts' start-up probe: rank 0
prints the nodes and ranks per node that MPI sees and the threads each rank gets.
"""
from __future__ import annotations

import os
import sys

from mpipar.runtime.mpi_init import MPI  # MPI_Init under MPIPAR_INIT_TIMEOUT


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


BLAS_SPIN = ("OPENBLAS_THREAD_TIMEOUT", "4")
"""How long an idle OpenBLAS worker spins for more work before it sleeps: 2^4 cycles, against
OpenBLAS's default of 2^28 (about 0.1 s). The Numba kernels (attention, the elementwise ops)
run their own threads between the GEMMs on the same cores. With 2 threads, causal attention at
seq 512 took twice as long right after a NumPy GEMM as alone (16.5-22 ms against 8-10 ms
forward), because the spinning workers held a core; with this setting it takes the same time
either way. Set like the thread counts, before NumPy loads; a value the user set stays."""


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def _count(var: str) -> int | None:
    """The positive integer environment variable ``var`` holds, or None."""
    value = os.environ.get(var, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


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
        if (count := _count(var)) is not None:
            return count
    if "SLURM_PROCID" in os.environ and os.environ.get("SLURM_NODEID", "").isdigit():
        return slurm_tasks_on_node(os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""),
                                   int(os.environ["SLURM_NODEID"]))
    return None


def ranks_on_node(names: list[str], rank: int) -> int:
    """How many ranks share this rank's node, from every rank's processor name (``names``, in
    rank order: the launcher did not say, so the caller gathered them)."""
    return names.count(names[rank])


def shared_memory_nodes(comm: MPI.Comm | None = None) -> list[int]:
    """The node of every rank of ``comm``, by rank (small integers in order of first appearance),
    as MPI sees them: the ranks that can share memory (``Split_type(COMM_TYPE_SHARED)``, a
    collective). The one node detection of mpipar: the grid's node map and :func:`node_shape`
    both read it."""
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    first: dict[int, int] = {}
    return [first.setdefault(x, len(first)) for x in comm.allgather(leader)]


def node_shape(comm: MPI.Comm | None = None) -> str:
    """The nodes of ``comm`` as MPI sees them (:func:`shared_memory_nodes`, a collective):
    ``"K node(s) x R rank(s) per node: host (ranks a-b), ..."`` (R like ``4/2`` when uneven)."""
    comm = MPI.COMM_WORLD if comm is None else comm
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


def configure_threads(ranks: int | None) -> None:
    """Split this node's cores among the ``ranks`` that share it (None: the count the launcher
    gives, else a lone process); :func:`threads_in_use` says what BLAS then runs."""
    if ranks is None:
        ranks = local_size_from_env() or 1
    threads = threads_per_rank(ranks)
    for var in THREAD_VARS:
        os.environ.setdefault(var, str(threads))
    os.environ.setdefault(*BLAS_SPIN)
    _size_loaded_pools()


def _size_loaded_pools() -> None:
    """The thread pools of libraries already loaded to the variables' counts (a library loaded
    later reads the variables itself). Under ``mpirun -n 2`` on two cores, two ranks whose
    OpenBLAS kept both cores ran a 512 x 512 GEMM at 18-21 GFLOP/s each against 80-150 with one
    thread each, and the default run's step took 5.5 s instead of 0.08-0.12."""
    if "numpy" in sys.modules:
        from threadpoolctl import threadpool_limits
        limits = {api: n for api, n in (("blas", _count("OPENBLAS_NUM_THREADS")),
                                        ("openmp", _count("OMP_NUM_THREADS"))) if n}
        if limits:
            threadpool_limits(limits=limits)
    numba = sys.modules.get("numba")
    wanted = _count("NUMBA_NUM_THREADS")
    if numba is not None and wanted:
        numba.set_num_threads(min(wanted, numba.config.NUMBA_NUM_THREADS))


def threads_in_use() -> int:
    """The threads this process's BLAS runs a product on now (the pool NumPy's products use;
    what the run's banner and peak report): the most over the BLAS libraries loaded."""
    __import__("numpy")  # loads the BLAS it reports
    from threadpoolctl import threadpool_info
    counts = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts, default=1)


def main() -> int:
    """``python -m mpipar.runtime.nodes`` under a launcher: rank 0 prints the nodes and ranks per node
    that MPI sees, and the threads and peak share each rank gets (a job's first line). All
    of it is start-up, so all of it runs under ``MPIPAR_INIT_TIMEOUT`` (:mod:`mpipar.runtime.mpi_init`):
    a launch whose ranks cannot reach each other fails instead of hanging."""
    from mpipar.runtime.mpi_init import deadline
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



def cpu_peak_share(threads: int, ranks_on_node: int) -> float:
    """The fraction of its threads' peak a rank gets when ``ranks_on_node`` ranks of
    ``threads`` threads each share this node: 1 unless more threads than cores run on the cores
    this rank may use (:func:`ranks_sharing_cores`: a rank bound to its own core gets all of it)."""
    if threads < 1 or ranks_on_node < 1:
        raise ValueError(f"cpu_peak_share: threads={threads} and ranks_on_node={ranks_on_node} "
                         f"must be >= 1")
    return min(1.0, cpu_count() / (threads * ranks_sharing_cores(ranks_on_node)))


def load_slowdown(threads: int, ranks_on_node: int, load: float | None = None) -> tuple[float, float]:
    """(the load average now, how many times longer a step of ``ranks_on_node`` ranks of
    ``threads`` threads takes while other processes keep that many threads runnable): the
    ranks' threads and the others' share the cores this rank may use. 1 on a quiet machine.
    ``load``: the 1-minute load average (None: this machine's now)."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available here
            return 0.0, 1.0
    ours = threads * ranks_sharing_cores(ranks_on_node)
    cores = cpu_count()
    return load, max(cores, ours + load) / max(cores, ours)


if __name__ == "__main__":
    raise SystemExit(main())
