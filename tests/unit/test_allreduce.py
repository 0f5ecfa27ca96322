"""The all-reduce algorithm choice in process (:mod:`mpipar.runtime.allreduce`): the variables
each algorithm writes, the choice read before MPI from the command line or the TOML file, the
library check, and ``auto``'s nearest-size pick from a measured table."""
from __future__ import annotations

import pytest

from mpipar.config import ConfigError
from mpipar.runtime import allreduce as ar


def test_each_algorithm_writes_both_libraries_controls():
    env: dict[str, str] = {}
    ar.preset("rabenseifner", env)
    assert env == {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "reduce_scatter_allgather",
                   "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM": "sched_reduce_scatter_allgather",
                   "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                   "OMPI_MCA_coll_tuned_allreduce_algorithm": "6",
                   "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3"}
    for name in ("auto", "hierarchical"):
        env = {}
        ar.preset(name, env)
        assert env == {}
    for names in ar.MPICH_NAMES.values():          # every name is one MPICH lists
        for var, value in names.items():
            assert value in ar.MPICH_ENUM[var]


def test_the_choice_is_read_before_mpi(tmp_path):
    assert ar.early_choice([]) == "auto"
    assert ar.early_choice(["--steps", "3", "--allreduce-algorithm", "tree"]) == "tree"
    assert ar.early_choice(["--allreduce-algorithm=ring"]) == "ring"
    toml = tmp_path / "c.toml"
    toml.write_text('[parallel]\nallreduce_algorithm = "rabenseifner"\n')
    assert ar.early_choice(["--config", str(toml)]) == "rabenseifner"
    assert ar.early_choice(["--config", str(toml), "--allreduce-algorithm", "ring"]) == "ring"
    assert ar.early_choice(["--config", str(tmp_path / "missing.toml")]) == "auto"


def test_a_library_without_controls_refuses_an_explicit_algorithm():
    assert ar.check_library("ring", "MPICH Version: 4.2.0") == "mpich"
    assert ar.check_library("tree", "Open MPI v5.0.3, package: Open MPI") == "open mpi"
    for name in ("auto", "hierarchical"):
        assert ar.check_library(name, "SomeMPI 1.0") is None
    with pytest.raises(ConfigError, match="allreduce_algorithm='rabenseifner': this MPI library "
                                          "offers no control"):
        ar.check_library("rabenseifner", "SomeMPI 1.0")


def test_auto_picks_the_fastest_at_the_nearest_measured_size():
    table = {"ring": {2**16: 3.0, 2**20: 2.0, 2**24: 1.0},
             "tree": {2**16: 1.0, 2**20: 3.0, 2**24: 2.0},
             "rabenseifner": {2**16: 2.0, 2**20: 1.0, 2**24: 3.0}}
    choice = ar.SizeChoice(table, None)
    assert [choice.pick(n) for n in (1, 2**16, 2**17, 2**19, 2**20, 2**22 + 1, 2**30)] == \
        ["tree", "tree", "tree", "rabenseifner", "rabenseifner", "ring", "ring"]
    assert choice.describe() == "64 KiB tree, 1 MiB rabenseifner, 16 MiB ring"
    table["auto"] = {2**24: 0.5}                    # the library's own choice, when fastest
    assert ar.SizeChoice(table, None).pick(2**30) == "auto"


def test_hierarchical_is_mpipars_own_reduction():
    from mpipar.config import Config, ParallelConfig
    from mpipar.layout import resolve
    layout = resolve(Config(parallel=ParallelConfig(allreduce_algorithm="hierarchical")), 8)
    assert layout.config.parallel.dp_reduce == "hierarchical"
    assert resolve(Config(), 8).config.parallel.dp_reduce == "flat"


# --------------------------------------------------------------- wire bytes per algorithm
def test_wire_bytes_per_algorithm_are_each_schedules_sends():
    """Each rank's bytes under the textbook schedule (mpipar.runtime.ledger.allreduce_wire),
    against counts made by hand; over the group every algorithm sends 2 (n-1) payloads (the
    ring up to rounding), but not from the same ranks."""
    from mpipar.runtime.ledger import allreduce_wire, wire_bytes
    b = 4096
    # binomial tree of 8: rank 0 sends to 1, 2, 4; 4 to 5, 6; 2 to 3; 6 to 7; each to its parent
    assert [allreduce_wire(b, 8, r, "tree") // b for r in range(8)] == [3, 1, 2, 1, 3, 1, 2, 1]
    assert [allreduce_wire(b, 5, r, "tree") // b for r in range(5)] == [3, 1, 2, 1, 1]
    # Rabenseifner over 6: p = 4, ranks 0 and 2 fold into 1 and 3, which send the result back
    assert [allreduce_wire(b, 6, r, "rabenseifner") for r in range(6)] == \
        [b, b * 3 // 2 + b, b, b * 3 // 2 + b, b * 3 // 2, b * 3 // 2]
    for n in range(2, 17):
        for alg in ("tree", "rabenseifner"):
            assert sum(allreduce_wire(b, n, r, alg) for r in range(n)) == 2 * (n - 1) * b, (n, alg)
        assert allreduce_wire(b, n, 0, "tree") == (n - 1).bit_length() * b   # ceil(log2 n)
        ring = [allreduce_wire(b, n, r, "ring") for r in range(n)]
        assert ring == [wire_bytes("allreduce", b, n)] * n == [b * 2 * (n - 1) // n] * n
    assert allreduce_wire(b, 1, 0, "tree") == 0
    with pytest.raises(ValueError, match="no wire model"):
        allreduce_wire(b, 4, 0, "smp")


def test_the_algorithm_booked_is_the_one_in_effect_for_the_size():
    choice = ar.SizeChoice({"ring": {2**16: 3.0, 2**24: 1.0}, "tree": {2**16: 1.0, 2**24: 2.0},
                            "auto": {2**16: 5.0, 2**24: 0.5}}, None)
    assert ar.in_effect("tree", 2**30) == "tree"            # explicit: every size
    assert ar.in_effect("auto", 2**10, choice) == "tree"    # the table's pick
    assert ar.in_effect("auto", 2**30, choice) is None      # the library's own: booked as ring
    assert ar.in_effect("hierarchical", 2**10, choice) is None
    assert ar.in_effect("auto", 2**10) is None              # no table in this process


def test_the_planner_books_the_algorithm_auto_picks_from_the_hardware_file(tmp_path):
    import json
    from mpipar.config import Config, ParallelConfig
    from mpipar.layout import resolve
    from mpipar.parallel.calls import Call
    from mpipar.plan.traffic import call_algorithm
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"allreduce_seconds": {"ring": {"65536": 3.0, "16777216": 1.0},
                                                    "tree": {"65536": 1.0, "16777216": 2.0}}}))
    layout = resolve(Config(parallel=ParallelConfig(allreduce_hardware=str(hw))), 8)
    assert call_algorithm(layout, Call("dp_sp", "iallreduce", 2**10)) == "tree"
    assert call_algorithm(layout, Call("dp_sp", "iallreduce", 2**26)) == "ring"
    assert call_algorithm(layout, Call("dp_sp", "allgather", 2**10)) is None
