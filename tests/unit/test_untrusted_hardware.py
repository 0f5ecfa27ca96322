"""Hardware files from elsewhere (``--allreduce-hardware`` of train, ``--hardware`` of plan):
every malformed one is refused before training starts with exit 2 and one line naming the file
and the rule, no traceback; a table of NaN times or negative sizes is not taken for a
measurement."""
from __future__ import annotations

import json
import os

import pytest

from mpipar.plan import cli as plan_cli
from untrusted import TINY, run_train

GOOD = {"ring": {"1024": 1e-5, "1048576": 1e-3}, "tree": {"1024": 2e-5, "1048576": 2e-3}}


def _deep(n: int) -> str:
    return "[" * n + "]" * n


CASES = [
    ("empty", "", "not a JSON hardware file"),
    ("not json", "bandwidth: fast", "not a JSON hardware file"),
    ("not utf-8", b"\xff\xfe{}", "not a JSON hardware file"),
    ("a list", "[1, 2]", "holds a JSON list, not an object of hardware fields"),
    ("null", "null", "holds a JSON NoneType, not an object"),
    ("deep", _deep(100000), "nested too deeply"),
    ("table a list", json.dumps({"allreduce_seconds": [1]}),
     "allreduce_seconds: must be an object of algorithm"),
    ("sizes a list", json.dumps({"allreduce_seconds": {"ring": [1, 2]}}),
     "allreduce_seconds.ring: must be an object of bytes -> seconds"),
    ("string size", json.dumps({"allreduce_seconds": {"ring": {"big": 1e-3}}}),
     "allreduce_seconds.ring: size 'big' is not a whole number of bytes >= 1"),
    ("negative size", json.dumps({"allreduce_seconds": {"ring": {"-1024": 1e-3}}}),
     "size '-1024' is not a whole number of bytes >= 1"),
    ("string time", json.dumps({"allreduce_seconds": {"ring": {"1024": "fast"}}}),
     "allreduce_seconds.ring.1024: 'fast' is not a time in seconds"),
    ("nan time", '{"allreduce_seconds": {"ring": {"1024": NaN}}}',
     "allreduce_seconds.ring.1024: 'nan' is not a time in seconds"),
    ("negative time", json.dumps({"allreduce_seconds": {"ring": {"1024": -1.0}}}),
     "'-1.0' is not a time in seconds (a finite number > 0)"),
    ("only unknown", json.dumps({"allreduce_seconds": {"bruck": {"1024": 1e-3}}}),
     "allreduce_seconds: unknown algorithms ['bruck']"),
    ("no timings", json.dumps({"allreduce_seconds": {}}),
     "allreduce_seconds holds no all-reduce timings"),
]


def _write(tmp_path, text) -> str:
    path = tmp_path / "hw.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name,text,message", CASES, ids=[c[0] for c in CASES])
def test_train_refuses_a_malformed_allreduce_hardware_file(tmp_path, name, text, message):
    path = _write(tmp_path, text)
    code, err = run_train([*TINY, "--allreduce-hardware", path, "--run-dir",
                           str(tmp_path / "run")])
    assert code == 2, err
    assert err.count("mpipar: error:") == 1 and "Traceback" not in err, err
    assert f"--allreduce-hardware {path}: " in err and message in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_link_to_a_file_that_is_no_hardware_file_is_refused(tmp_path):
    os.symlink("/etc/passwd", tmp_path / "hw.json")
    code, err = run_train([*TINY, "--allreduce-hardware", str(tmp_path / "hw.json"),
                           "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "not a JSON hardware file" in err and "Traceback" not in err, err


def test_a_good_allreduce_hardware_file_is_taken(tmp_path):
    path = _write(tmp_path, json.dumps({"allreduce_seconds": GOOD}))
    code, err = run_train([*TINY, "--steps", "1", "--allreduce-hardware", path, "--run-dir",
                           str(tmp_path / "run")])
    assert code == 0, err


PLAN_CASES = [c for c in CASES if c[0] != "no timings"] + [
    ("string field", json.dumps({"bandwidth": "fast"}), "bandwidth='fast' is not a number >= 0"),
    ("nan field", '{"latency": NaN}', "latency='nan' is not a number >= 0"),
    ("negative field", json.dumps({"bandwidth": -1}), "bandwidth='-1' is not a number >= 0"),
    ("fractional ranks", json.dumps({"ranks_per_node": 2.5}),
     "ranks_per_node='2.5' is not a whole number >= 0"),
]


@pytest.mark.parametrize("name,text,message", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_refuses_a_malformed_hardware_file(tmp_path, capsys, name, text, message):
    path = _write(tmp_path, text)
    assert plan_cli.main(["--world", "2", "--hardware", path]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"--hardware {path}: " in err, err
    assert message in err and "Traceback" not in err, err
