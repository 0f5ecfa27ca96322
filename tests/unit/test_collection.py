"""The multi-rank suite's collection rule (tests/conftest.py): under ``--only-mpi`` a test module
whose text does not name the ``mpi`` mark is not imported, so every module holding an mpi-marked
test must name it where the rule looks."""
from __future__ import annotations

from conftest import MPI_MARK, holds_mpi_tests


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
