"""The MPI library's all-reduce algorithm (``--allreduce-algorithm``), set through its own controls.

An MPI library picks an algorithm for each all-reduce by message size and group shape; it lets a
user force one with variables it reads in ``MPI_Init``. ``ring``, ``tree`` and ``rabenseifner``
(reduce-scatter then all-gather, halving and doubling) are set here, before ``MPI_Init``, for both
the blocking and the non-blocking all-reduce (the gradient buckets use ``Iallreduce``):

- MPICH (and its derivatives whose version string says MPICH): the control variables
  ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` (``ring``, ``tree``, ``reduce_scatter_allgather``)
  and ``MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM`` (``tsp_ring``, ``tsp_tree``,
  ``sched_reduce_scatter_allgather``); their values are read back through the MPI tool
  interface (``MPI_T_cvar_read``, :class:`MpiT`) and named in the start-up line.
- Open MPI: the tuned component's dynamic rules, ``OMPI_MCA_coll_tuned_use_dynamic_rules=1`` and
  ``OMPI_MCA_coll_tuned_allreduce_algorithm`` (4 ring, 2 reduce + broadcast over trees, 6
  Rabenseifner), and libnbc's ``OMPI_MCA_coll_libnbc_iallreduce_algorithm`` (1 ring, 2 binomial
  tree, 3 Rabenseifner); Open MPI exposes them as MPI_T control variables too, and they are
  read back the same way (:meth:`MpiT.open_mpi_algorithm`).

Both families are written (each library ignores the other's). After ``MPI_Init``
:func:`check_library` asks the library's version: one that is neither refuses an explicit
algorithm (ConfigError: exit 2) and keeps its own choice under ``auto``.

``hierarchical`` is not an MPI algorithm but mpipar's own reduction (``--dp-reduce
hierarchical``: reduce-scatter inside the node, all-reduce of the shard across nodes, all-gather
inside the node, :mod:`mpipar.parallel.data_parallel`); choosing it resolves ``dp_reduce`` to
hierarchical (:func:`mpipar.layout.resolve`) and leaves the library its own algorithm for each of
the three steps. MPICH's ``smp`` algorithm is the library's version of the same idea (reduce to
a node leader, all-reduce among leaders, broadcast), without the overlap with backward or the
compression across nodes that mpipar's reduction has.

``auto`` keeps the library's choice, unless ``--allreduce-hardware FILE`` names a hardware file
that ``python -m mpipar.bench comm --algorithms`` measured: then before each all-reduce the
algorithm measured fastest at the nearest measured size (the library's own choice among them)
is written into MPICH's control
variables through ``MPI_T_cvar_write`` (:class:`SizeChoice`; MPICH reads them at each call, and
the buckets of a reduction have the same size on every rank of its group, as the variables'
scope ``ALL_EQ`` asks). Open MPI reads its parameters when a communicator is made: there ``auto``
with a file keeps the library's choice.
"""
from __future__ import annotations

import bisect
import ctypes
import json
import math
import os
from collections.abc import Mapping, MutableMapping

from mpipar.runtime.allreduce_modes import ALGORITHMS, LIBRARY_ALGORITHMS  # noqa: F401

MPICH_BLOCKING = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"
MPICH_NONBLOCKING = "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM"
MPICH_NAMES = {
    "ring": {MPICH_BLOCKING: "ring", MPICH_NONBLOCKING: "tsp_ring"},
    "tree": {MPICH_BLOCKING: "tree", MPICH_NONBLOCKING: "tsp_tree"},
    "rabenseifner": {MPICH_BLOCKING: "reduce_scatter_allgather",
                     MPICH_NONBLOCKING: "sched_reduce_scatter_allgather"},
}
MPICH_ENUM = {
    MPICH_BLOCKING: ("auto", "nb", "smp", "recursive_doubling", "recursive_multiplying",
                     "reduce_scatter_allgather", "tree", "recexch", "ring",
                     "k_reduce_scatter_allgather", "ccl"),
    MPICH_NONBLOCKING: ("auto", "sched_auto", "sched_naive", "sched_smp",
                        "sched_recursive_doubling", "sched_reduce_scatter_allgather",
                        "tsp_recexch_single_buffer", "tsp_recexch_multiple_buffer", "tsp_tree",
                        "tsp_ring", "tsp_recexch_reduce_scatter_recexch_allgatherv"),
}
"""The integer value of each name, in the order MPICH 4-5 lists them (``mpivars``): what
``MPI_T_cvar_read`` returns and ``MPI_T_cvar_write`` takes (tests read them back)."""
OPEN_MPI_NAMES = {
    "ring": ("4", "1"), "tree": ("2", "2"), "rabenseifner": ("6", "3"),
}
"""algorithm -> (coll_tuned_allreduce_algorithm, coll_libnbc_iallreduce_algorithm)."""
OPEN_MPI_VARS = ("coll_tuned_use_dynamic_rules", "coll_tuned_allreduce_algorithm",
                 "coll_libnbc_iallreduce_algorithm")
"""Open MPI's MCA parameters of the choice, which it also exposes as MPI_T control variables
(read back for the start-up line: integers, 0 = the library's own decision)."""


def library_controls(algorithm: str) -> dict[str, str]:
    """The environment variables forcing ``algorithm`` in MPICH and Open MPI (none for ``auto``
    and ``hierarchical``)."""
    if algorithm not in LIBRARY_ALGORITHMS:
        return {}
    tuned, nbc = OPEN_MPI_NAMES[algorithm]
    return {**MPICH_NAMES[algorithm], "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
            "OMPI_MCA_coll_tuned_allreduce_algorithm": tuned,
            "OMPI_MCA_coll_libnbc_iallreduce_algorithm": nbc}


def preset(algorithm: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Before ``MPI_Init``: write the library's controls for ``algorithm`` into ``environ``
    (an unknown name is left to the argument parser, which exits 2)."""
    environ.update(library_controls(algorithm))


def early_choice(argv: list[str]) -> str:
    """``--allreduce-algorithm`` of a command line (or ``[parallel] allreduce_algorithm`` of its
    ``--config`` TOML file), read before MPI starts; "auto" when neither says."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--allreduce-algorithm", default=None)
    parser.add_argument("--config", default=None)
    args, _ = parser.parse_known_args(argv)
    if args.allreduce_algorithm is not None:
        return args.allreduce_algorithm
    if args.config:
        try:
            import tomllib
            with open(args.config, "rb") as fh:
                return str(tomllib.load(fh).get("parallel", {}).get("allreduce_algorithm", "auto"))
        except (OSError, ValueError):
            return "auto"        # the full parser reports the file
    return "auto"


def library_family(version: str) -> str | None:
    """"mpich" or "open mpi" from ``MPI.Get_library_version()``, else None."""
    text = version.lower()
    if "open mpi" in text:
        return "open mpi"
    if "mpich" in text:
        return "mpich"
    return None


def check_library(algorithm: str, version: str) -> str | None:
    """After ``MPI_Init``: ConfigError when ``algorithm`` is one the library must run and the
    library (``version``) has no control for it; returns the library family."""
    from mpipar.config import require

    family = library_family(version)
    require(algorithm not in LIBRARY_ALGORITHMS or family is not None,
            f"parallel.allreduce_algorithm={algorithm!r}: this MPI library offers no control of "
            f"its all-reduce algorithm that mpipar knows (MPICH's MPIR_CVAR_*ALLREDUCE_INTRA_"
            f"ALGORITHM, Open MPI's coll_tuned/libnbc parameters); library: "
            f"{version.splitlines()[0] if version else 'unknown'}. Use --allreduce-algorithm auto")
    return family


class MpiT:
    """MPICH's control variables through the MPI tool interface (``MPI_T_cvar_*``, by ctypes
    on the library mpi4py loaded; mpi4py has no binding). Integer variables only."""

    def __init__(self) -> None:
        from mpipar.runtime.mpi_init import MPI
        MPI.COMM_WORLD                          # MPI_Init first
        path = next((line.split()[-1] for line in open("/proc/self/maps")
                     if "/libmpi" in line and ".so" in line), None)
        if path is None:
            raise OSError("no libmpi mapped in this process")
        self.lib = ctypes.CDLL(path)
        provided = ctypes.c_int()
        self._call("MPI_T_init_thread", 0, ctypes.byref(provided))
        self._handles: dict[str, ctypes.c_void_p] = {}

    def _call(self, fn: str, *args) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            raise OSError(f"{fn}: MPI error {rc}")

    def _handle(self, name: str) -> ctypes.c_void_p:
        if name not in self._handles:
            index, count, handle = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
            self._call("MPI_T_cvar_get_index", name.encode(), ctypes.byref(index))
            self._call("MPI_T_cvar_handle_alloc", index, None, ctypes.byref(handle),
                       ctypes.byref(count))
            self._handles[name] = handle
        return self._handles[name]

    def read(self, name: str) -> int:
        value = ctypes.c_int()
        self._call("MPI_T_cvar_read", self._handle(name), ctypes.byref(value))
        return value.value

    def write(self, name: str, value: int) -> None:
        self._call("MPI_T_cvar_write", self._handle(name), ctypes.byref(ctypes.c_int(value)))

    def algorithm(self) -> dict[str, str]:
        """The names the two MPICH variables hold now."""
        return {name: MPICH_ENUM[name][self.read(name)] for name in MPICH_ENUM}

    def open_mpi_algorithm(self) -> dict[str, int]:
        """What Open MPI holds for :data:`OPEN_MPI_VARS` now."""
        return {name: self.read(name) for name in OPEN_MPI_VARS}

    def set_algorithm(self, algorithm: str) -> None:
        """Force ``algorithm`` ("auto": the library's choice) for the all-reduces that follow."""
        names = MPICH_NAMES.get(algorithm, {MPICH_BLOCKING: "auto", MPICH_NONBLOCKING: "auto"})
        for name, value in names.items():
            self.write(name, MPICH_ENUM[name].index(value))


HARDWARE_FILE_LIMIT = 1 << 24
"""Bytes a hardware file may hold (``bench comm`` writes a few KiB)."""


def read_hardware_file(path: str) -> dict:
    """The JSON object of hardware file ``path``; ValueError naming the file and the rule when
    it is larger than :data:`HARDWARE_FILE_LIMIT`, not UTF-8 JSON, nested too deeply, or not
    an object (OSError when it cannot be read)."""
    with open(path, "rb") as fh:
        raw = fh.read(HARDWARE_FILE_LIMIT + 1)
    if len(raw) > HARDWARE_FILE_LIMIT:
        raise ValueError(f"{path}: larger than {HARDWARE_FILE_LIMIT} bytes; a hardware file "
                         f"from python -m mpipar.bench comm holds a few KiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a JSON hardware file ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply for a hardware file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not an object of "
                         f"hardware fields")
    return data


def parse_table(table: object, where: str) -> dict[str, dict[int, float]]:
    """``allreduce_seconds`` (``where`` names it in messages): an object of algorithms (auto,
    ring, tree, rabenseifner) to objects of sizes (whole bytes >= 1, as strings) to seconds
    (finite, > 0). ValueError naming the entry and the rule."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be an object of algorithm -> {{bytes: seconds}}")
    known = ("auto", *LIBRARY_ALGORITHMS)
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown algorithms {unknown}; expected some of {list(known)}")
    out = {}
    for alg, sizes in table.items():
        if not isinstance(sizes, dict):
            raise ValueError(f"{where}.{alg}: must be an object of bytes -> seconds")
        out[alg] = {}
        for size, seconds in sizes.items():
            if not (isinstance(size, str) and size.isdigit() and len(size) <= 18
                    and int(size) >= 1):
                raise ValueError(f"{where}.{alg}: size {size[:40]!r} is not a whole number "
                                 f"of bytes >= 1")
            if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                    or not math.isfinite(seconds) or seconds <= 0):
                raise ValueError(f"{where}.{alg}.{size}: {str(seconds)[:40]!r} is not a time "
                                 f"in seconds (a finite number > 0)")
            out[alg][int(size)] = float(seconds)
    return out


def load_table(path: str) -> dict[str, dict[int, float]]:
    """``allreduce_seconds`` of a hardware file: algorithm -> {bytes: seconds}, checked
    (:func:`read_hardware_file`, :func:`parse_table`)."""
    table = parse_table(read_hardware_file(path).get("allreduce_seconds"),
                        f"{path}: allreduce_seconds")
    if not any(table.values()):
        raise ValueError(f"{path}: allreduce_seconds holds no all-reduce timings (python -m "
                         f"mpipar.bench comm --algorithms measures them)")
    return table


class SizeChoice:
    """``auto`` with a measured table: the fastest algorithm at the measured size nearest (in
    log scale) to each all-reduce's, written through :class:`MpiT` when it changes."""

    def __init__(self, table: Mapping[str, Mapping[int, float]], mpit: MpiT | None) -> None:
        sizes = sorted({s for per in table.values() for s in per})
        if not sizes:
            raise ValueError("no all-reduce timings (python -m mpipar.bench comm --algorithms)")
        self.sizes = sizes
        self.best = [min((per[s], alg) for alg, per in table.items() if s in per)[1]
                     for s in sizes]
        self.mpit, self.current = mpit, "auto"

    def pick(self, nbytes: int) -> str:
        """The algorithm for an all-reduce of ``nbytes``."""
        i = bisect.bisect_left(self.sizes, nbytes)
        if i == len(self.sizes) or (i > 0 and nbytes * nbytes < self.sizes[i - 1] * self.sizes[i]):
            i -= 1
        return self.best[i]

    def before(self, nbytes: int) -> None:
        algorithm = self.pick(nbytes)
        if algorithm != self.current and self.mpit is not None:
            self.mpit.set_algorithm(algorithm)
        self.current = algorithm

    def describe(self) -> str:
        return ", ".join(f"{_size(s)} {alg}" for s, alg in zip(self.sizes, self.best))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KiB"


ACTIVE: SizeChoice | None = None
"""The process's per-size choice (``auto`` with a file), consulted by every all-reduce of
:class:`mpipar.runtime.comm.Group`; None: the algorithm is fixed for the run."""


def in_effect(configured: str, nbytes: int, choice: SizeChoice | None = None) -> str | None:
    """The all-reduce algorithm of a call of ``nbytes`` that the wire model books: the
    ``configured`` one when it is a library algorithm; under ``auto`` the one the per-size
    ``choice`` picks, if there is a choice and it names one; else None (the library's own
    choice: booked as the bandwidth-optimal ring). A Group passes the process's
    :data:`ACTIVE`, the planner the table of the layout's hardware file."""
    if configured in LIBRARY_ALGORITHMS:
        return configured
    if configured == "auto" and choice is not None:
        picked = choice.pick(nbytes)
        return picked if picked in LIBRARY_ALGORITHMS else None
    return None


def before_allreduce(nbytes: int) -> None:
    """Called by :class:`mpipar.runtime.comm.Group` before an all-reduce of ``nbytes``."""
    if ACTIVE is not None:
        ACTIVE.before(nbytes)


def configure(algorithm: str, hardware: str, version: str) -> str:
    """After ``MPI_Init`` on every rank: check the library (ConfigError for an explicit algorithm
    it cannot run, or a ``hardware`` file that is not one, under any library), arm the
    per-size choice of ``auto`` with a ``hardware`` file under MPICH,
    and return what the start-up line says."""
    global ACTIVE
    family = check_library(algorithm, version)
    if hardware:
        from mpipar.config import ConfigError
        try:
            table = load_table(hardware)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--allreduce-hardware {hardware}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    if algorithm == "hierarchical":
        return "allreduce hierarchical (mpipar's --dp-reduce hierarchical; library's own steps)"
    if algorithm == "auto":
        if hardware and family == "mpich":
            ACTIVE = SizeChoice(table, MpiT())
            return f"allreduce auto from {hardware} ({ACTIVE.describe()})"
        return "allreduce auto (the library's choice)"
    try:
        if family == "mpich":
            held = MpiT().algorithm()
            return (f"allreduce {algorithm} (MPICH {MPICH_BLOCKING}={held[MPICH_BLOCKING]}, "
                    f"{MPICH_NONBLOCKING}={held[MPICH_NONBLOCKING]})")
        if family == "open mpi":
            held = MpiT().open_mpi_algorithm()
            return f"allreduce {algorithm} (Open MPI " + ", ".join(
                f"{name}={value}" for name, value in held.items()) + ")"
    except OSError:   # no tool interface, or a variable it does not list: say what was set
        pass
    names = library_controls(algorithm)
    key = "OMPI_MCA_coll_tuned_allreduce_algorithm" if family == "open mpi" else MPICH_BLOCKING
    return f"allreduce {algorithm} ({family}: {key}={names[key]})"
