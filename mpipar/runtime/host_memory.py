"""Memory a node can still give a run (``MemAvailable``, a cgroup's limit, /dev/shm), and the C
allocator as the step's buffer pool. Training compares the planner's per-rank memory with
``available_memory_bytes() / ranks on this node`` before it allocates."""
from __future__ import annotations

import os
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def pool_freed_memory() -> bool:
    """Make the C allocator the step's buffer pool: every array comes from a heap that keeps
    what is freed (no mmap for any size, no trim), so the activations of one microbatch, freed
    after its backward, are the memory of the next, step after step: a step touches new pages
    only in its first microbatch of the first step, not on every allocation (measured: the page
    faults per step in docs/benchmarks.md). No mmap at all rather than a higher mmap threshold:
    glibc caps the threshold at 32 MiB, and arrays over it (64 MiB attention outputs of an
    8-row batch) would otherwise be fresh pages, zeroed by the kernel, on every call. The cost:
    a process keeps the memory of its peak (a large temporary, freed, is not given back to the
    system but serves the next allocations), as a GPU caching allocator does. Process-wide and
    once per process; returns False where the C library has no ``mallopt`` (not glibc),
    changing nothing."""
    import ctypes
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


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

