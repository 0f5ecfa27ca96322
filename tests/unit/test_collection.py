"""The multi-rank suite's collection rule (tests/conftest.py): under ``--only-mpi`` a test module
whose text does not name the ``mpi`` mark is not imported, so every module holding an mpi-marked
test must name it where the rule looks."""
from __future__ import annotations

from conftest import MPI_MARK, holds_mpi_tests, sampled


def test_every_mpi_marked_test_lies_in_a_module_the_multi_rank_run_collects(request):
    items = request.session.items
    marked = {item.path for item in items if item.get_closest_marker("mpi") is not None}
    missed = sorted(str(path) for path in marked if not holds_mpi_tests(path))
    assert missed == [], (f"these modules mark tests mpi without the text {MPI_MARK!r}, so "
                          f"`mpirun -n 8 python -m pytest --only-mpi` never collects them")



def test_a_module_without_the_mark_is_recognised(tmp_path):
    plain, marked = tmp_path / "test_plain.py", tmp_path / "test_marked.py"
    plain.write_text("def test_a():\n    assert 1\n")
    marked.write_text("import pytest\n\n\n@pytest.mark.mpi(min_size=2)\ndef test_b():\n    pass\n")
    assert not holds_mpi_tests(plain) and holds_mpi_tests(marked)


def test_a_sample_keeps_every_nth_case_of_each_function_and_at_least_one():
    """`--mpi-sample N` (CI's Open MPI run): of a function's n cases, ceil(n / N) or floor(n / N)
    of them, at least one, at a stride of N; everything at N = 1; the same choice every time
    (each rank computes it alone); a function of few cases need not keep its first."""
    keys = [("m.py", "test_matrix")] * 269 + [("m.py", "test_one")] + \
        [("n.py", f"test_pair{i}") for i in range(40) for _ in range(2)]
    assert sampled(keys, 1) == [True] * len(keys)
    keep = sampled(keys, 4)
    assert keep == sampled(list(keys), 4)
    kept: dict = {key: [] for key in keys}
    for i, key in enumerate(keys):
        if keep[i]:
            kept[key].append(i)
    for key, chosen in kept.items():
        n = keys.count(key)
        assert chosen and len(chosen) in (n // 4, -(-n // 4)), (key, chosen)
        assert all(b - a == 4 for a, b in zip(chosen, chosen[1:])), (key, chosen)
    assert len(kept[("m.py", "test_matrix")]) in (67, 68)
    pairs = [key for key in kept if key[0] == "n.py"]
    firsts = sum(kept[key][0] == keys.index(key) for key in pairs)
    assert 0 < firsts < len(pairs), "every two-case function keeps the same case"


def test_a_covering_set_holds_every_axis_value_and_world_size():
    """The layout sweep runs each option on a covering set of the layouts that admit it: every
    value each axis takes among them, and every world size, in at least one chosen layout."""
    from conftest import covering, factorisations
    cases = [dict(dp=dp, tp=tp, pp=pp, sp=sp) for w in (2, 4, 8)
             for dp, tp, pp, sp in factorisations(w) if pp > 1]
    chosen = covering(cases)
    for key in ("dp", "tp", "pp", "sp"):
        assert {c[key] for c in chosen} == {c[key] for c in cases}, key
    assert ({c["dp"] * c["tp"] * c["pp"] * c["sp"] for c in chosen} == {2, 4, 8})
    assert len(chosen) < len(cases) and all(c in cases for c in chosen)
    assert covering([]) == []


def test_a_covering_set_holds_every_option_value_absent_included():
    """Options (the node size, the ZeRO stage) are covered beside the axes, and an option a case
    leaves out is a value of its own: a cover of hierarchical layouts keeps one without ZeRO-1
    and one with it, on nodes of 2 and of 4 ranks."""
    from conftest import covering
    cases = [dict(dp=dp, sp=8 // dp, ranks_per_node=k, **zero) for dp in (2, 4, 8)
             for k in (2, 4) for zero in ({}, {"zero": 1})]
    chosen = covering(cases, options=("ranks_per_node", "zero"))
    assert {c.get("zero") for c in chosen} == {None, 1}
    assert {c["ranks_per_node"] for c in chosen} == {2, 4}
    assert {c["dp"] for c in chosen} == {2, 4, 8}
    assert len(chosen) < len(cases)
