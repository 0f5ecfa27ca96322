"""`python -m mpipar.bench gpu --static` in process: the compile gate's arguments and status."""

from __future__ import annotations

import pytest

from mpipar.bench.__main__ import main

pytest.importorskip("numba")


def test_gpu_static_returns_the_compile_gates_status(tmp_path, monkeypatch):
    """``gpu --static`` runs no benchmark: it hands --arch and --json to the compile gate and
    returns the gate's status."""
    from mpipar.kernels import cuda_gate

    calls = []
    monkeypatch.setattr(cuda_gate, "main", lambda argv: calls.append(argv) or 1)
    path = str(tmp_path / "gate.json")
    assert main(["gpu", "--static", "--arch", "sm_90", "--json", path]) == 1
    assert main(["gpu", "--static"]) == 1
    assert calls == [["--arch", "sm_90", "--json", path], []]
    assert not (tmp_path / "gate.json").exists()  # the gate writes its own report, not the bench
