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


def test_steps_only_one_run_logged_fail_the_comparison(tmp_path, capsys):
    """A 6-step run against a 2-step run is not 'equal over 2 steps': exit 1 naming the steps
    only one side logged; ``--steps`` restricting both to the shared ones passes."""
    six = _write(tmp_path / "six", [3.0, 2.5, 2.25, 2.0, 1.9, 1.8])
    two = _write(tmp_path / "two", [3.0, 2.5])
    assert main([six, two]) == 1
    err = capsys.readouterr().err
    assert ("run A logged 4 step(s) the other did not (3, 4, 5, 6): the runs differ in the "
            "steps they logged") in err and "Traceback" not in err
    assert main([two, six]) == 1 and "run B logged 4 step(s)" in capsys.readouterr().err
    assert main([six, two, "--steps", "1:2"]) == 0


def test_a_step_logged_twice_is_refused(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0, 2.5])
    with open(tmp_path / "a" / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 2, "loss": 9.0, "grad_norm": 9.0}) + "\n")
    b = _write(tmp_path / "b", [3.0, 2.5])
    assert main([a, b]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl: step 2 is logged twice (record 3)" in err


def test_a_metric_named_twice_counts_once(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0, 2.5])
    assert main([a, a, "--metric", "loss", "--metric", "loss"]) == 0
    assert "over 2 steps" in capsys.readouterr().out


def test_deep_json_and_an_unwritable_png_exit_2(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0, 2.5])
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "metrics.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n"
                                                     + json.dumps({"step": 1}) + "\n")
    assert main([a, str(tmp_path / "deep")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1 is JSON nested too deeply" in err
    assert main([a, a, "--png", str(tmp_path / "no" / "such" / "dir" / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--png" in err and "cannot be written" in err


def test_configurations_that_differ_are_listed(tmp_path, capsys):
    a = _write(tmp_path / "a", [3.0, 2.5])
    b = _write(tmp_path / "b", [3.0, 2.5])
    (tmp_path / "a" / "config.toml").write_text("[train]\nlr = 0.001\nseed = 1\n")
    (tmp_path / "b" / "config.toml").write_text("[train]\nlr = 0.002\nseed = 1\n")
    assert main([a, b]) == 0
    assert "the runs' configurations differ: train.lr: 0.001 vs 0.002" in capsys.readouterr().out
