"""``mpipar.compare`` in process, on metrics written by hand: two runs' losses and gradient norms
side by side; exit 0 within the tolerance (exactly equal by default), 1 beyond it naming the
first step, 2 on bad input. Real runs: e2e/test_compare.py."""
from __future__ import annotations

import json

from mpipar.compare import main


def _write(path, losses, norms=None):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as fh:
        for k, loss in enumerate(losses):
            fh.write(json.dumps({"step": k + 1, "loss": loss,
                                 "grad_norm": (norms or losses)[k]}) + "\n")
    return str(path)


def test_equal_runs_pass_and_a_difference_is_named(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0, 2.5, 2.25])
    b = _write(tmp_path / "b", [3.0, 2.5, 2.25])
    assert main([a, b]) == 0
    c = _write(tmp_path / "c", [3.0, 2.5, 2.25 * (1 + 1e-9)])
    assert main([c, b]) == 1
    err = capsys.readouterr().err
    assert "step 3: loss" in err and "relative 1e-09" in err
    assert main([c, b, "--rtol", "1e-8"]) == 0                  # within the tolerance
    assert main([c, b, "--steps", ":2"]) == 0                   # step 3 left out
    assert main([c, b, "--atol", "1e-8"]) == 0
    out = capsys.readouterr().out
    assert "largest relative" in out and "(step 3)" in out


def test_bad_input_exits_2_with_one_message(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0])
    assert main([a, str(tmp_path / "missing")]) == 2
    assert main([a, _write(tmp_path / "b", [1.0, 2.0]), "--steps", "2:"]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": "x", "grad_norm": 1}\n')
    assert main([a, str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("mpipar.compare: error:") for line in err)
