"""`python -m mpipar.data prepare` and a training run on its output, launched: the module entry
point, and a damaged chunk named by ``data info`` and by training (exit 2) when the source loads."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import launch_env
from hdf5_damage import invert_chunk_bytes
from mpipar.data.cli import main
from mpipar.data.prepare import prepare_tokens
from mpipar.data.sources import DataError, load_tokens
from text_files import write_texts


def test_prepare_module_entry_point(tmp_path):
    paths = write_texts(tmp_path, [b"0123456789" * 3])
    out = tmp_path / "m.h5"
    proc = subprocess.run([sys.executable, "-m", "mpipar.data", "prepare", *paths, "--out",
                           str(out)], capture_output=True, text=True, timeout=60, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    assert load_tokens(out, 256, 4).num_tokens == 30


def test_a_damaged_chunk_is_named_when_the_source_loads(tmp_path, capsys):
    """A corrupted chunk of a prepared uint8 file (whose ids need no range
    check) loaded silently and failed mid-training with a traceback; loading now reads every
    chunk once, and ``data info`` and training exit 2 naming the file and the token range."""
    paths = write_texts(tmp_path, [bytes(range(256)) * 1000])
    out = tmp_path / "tokens.h5"
    prepare_tokens(paths, out, chunk_tokens=1 << 14)
    invert_chunk_bytes(out, "tokens", 3, skip=100, count=1)
    message = f"{out}: cannot read tokens [0, 256000)"  # one check read covers the stream
    with pytest.raises(DataError, match="fletcher32|filter returned failure") as err:
        load_tokens(out, 256, 16)
    assert str(err.value).startswith(message) and "the file is damaged" in str(err.value)
    assert main(["info", str(out), "--seq-len", "16", "--vocab-size", "256"]) == 2
    assert message in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", "--data", str(out),
                           "--seq-len", "16", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                           "--layers", "2", "--global-batch-size", "4", "--steps", "1",
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
