"""Hugging Face directories as files (no torch needed): damaged or inconsistent directories refused
with the file named, the same way by ``python -m mpipar.hf inspect`` and by a launched training
run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from hf_export import export_small_model
from mpipar.checkpoint.huggingface import CONFIG_FILE, INDEX_FILE, hf_name, load_hf
from mpipar.hf import main  # noqa: E402

TRAIN = ["--seq-len", "8", "--global-batch-size", "2", "--steps", "1", "--backend", "numpy",
         "--log-every", "0"]


@pytest.fixture
def exported(tmp_path):
    params = export_small_model(tmp_path / "hf")
    np.save(tmp_path / "data.npy", np.random.default_rng(0).integers(0, 61, size=(8, 9)))
    return tmp_path / "hf", params


def _sharded(src, dst):
    """``src``'s tensors split over two safetensors files with a weight map."""
    _, params = load_hf(src)
    names = [hf_name(n) for n in params]
    half = len(names) // 2
    dst.mkdir()
    (dst / CONFIG_FILE).write_text((src / CONFIG_FILE).read_text())
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        by_hf = {hf_name(n): v for n, v in params.items()}
        save_file({n: by_hf[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return dst


def _train(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "mpipar.train", *TRAIN, "--data",
                           str(tmp_path / "data.npy"), "--run-dir", str(tmp_path / "run"),
                           *flags], capture_output=True, text=True, timeout=120)


def test_a_truncated_shard_is_named_by_training_and_inspect(exported, tmp_path, capsys):
    """One truncated shard of a sharded checkpoint was a SafetensorError
    traceback; training exits 2 before any step and ``hf inspect`` exits 2, both naming it."""
    src, params = exported
    sharded = _sharded(src, tmp_path / "sharded")
    _, got = load_hf(sharded)  # intact: the same tensors
    assert all(np.array_equal(got[n], params[n]) for n in params)
    shard = sharded / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    message = f"{shard}: not a readable safetensors file"
    assert main(["inspect", str(sharded)]) == 2
    assert message in capsys.readouterr().err
    proc = _train(tmp_path, "--init-from-hf", str(sharded))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_inspect_refuses_what_training_refuses(exported, tmp_path, capsys):
    """``hf inspect`` returned 0 for a directory whose tensor shapes
    disagree with its config.json, which training refuses; both now give the same reason."""
    src, _ = exported
    raw = json.loads((src / CONFIG_FILE).read_text())
    (src / CONFIG_FILE).write_text(json.dumps(dict(raw, intermediate_size=96)))
    message = (f"{src}: tensor model.layers.0.mlp.gate_proj.weight has shape [64, 32], "
               f"config.json implies [96, 32]")
    assert main(["inspect", str(src)]) == 1
    out = capsys.readouterr().out
    assert f"tensors      NOT SUPPORTED: {message}" in out
    assert "mpipar: not supported: tensors (see above)" in out
    proc = _train(tmp_path, "--init-from-hf", str(src))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
