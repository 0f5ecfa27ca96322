"""Muon's checkpoints through ``python -m mpipar.train``: a run resumed from a Muon checkpoint
under another layout continues as the uninterrupted run (1e-10 in float64: the momentum buffers
are in the checkpoint);
resuming under another optimizer is refused with exit 2 and the reason, unless
``--reset-optimizer``, which starts the optimizer state afresh."""
from __future__ import annotations

import numpy as np

from conftest import needs_mpirun
from tests.e2e.test_checkpoint import data, metrics, train  # noqa: F401  (data: a fixture)
from mpipar.checkpoint import reader
from mpipar.checkpoint.directory import resolve_path
from mpipar.checkpoint.index import read_index

MUON = ["--optimizer", "muon", "--muon-momentum", "0.9", "--dtype", "float64", "--steps", "4"]


@needs_mpirun
def test_muon_resumes_bit_exact_and_refuses_another_optimizer(tmp_path, data):  # noqa: F811
    train(2, tmp_path / "a", *MUON, "--tp", "2", "--save-dir", str(tmp_path / "a" / "ck"),
          "--save-every", "2", data=data)
    ckpt = tmp_path / "a" / "ck" / "step_00000002"
    buf = reader.read_tensors(ckpt, "exp_avg")["layers.0.self_attn.q_proj.weight"]
    assert np.abs(buf).max() > 0          # the momentum buffer is saved
    (tmp_path / "b").mkdir()
    with open(tmp_path / "a" / "metrics.jsonl") as fh:
        (tmp_path / "b" / "metrics.jsonl").write_text("".join(fh.readlines()[:2]))
    train(2, tmp_path / "b", *MUON, "--dp", "2", "--zero", "1", "--save-dir",
          str(tmp_path / "b" / "ck"), "--resume", str(ckpt), data=data)
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-10)

    refused = train(1, tmp_path / "c", "--dtype", "float64", "--steps", "4", "--resume",
                    str(ckpt), data=data, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (f"train.optimizer='adamw': the checkpoint {ckpt} was trained with 'muon'"
            in refused.stderr), refused.stderr
    assert "--reset-optimizer" in refused.stderr

    proc = train(1, tmp_path / "d", "--dtype", "float64", "--steps", "4", "--resume", str(ckpt),
                 "--reset-optimizer", "--save-dir", str(tmp_path / "d" / "ck"), data=data)
    assert "--reset-optimizer: the optimizer state starts afresh" in proc.stdout
    # A fresh optimizer: its update count restarts (AdamW's bias correction with it) and every
    # moment is AdamW's own.
    saved = read_index(resolve_path(tmp_path / "d" / "ck"))
    assert (saved.step, saved.optimizer_step) == (4, 2)
    after = reader.read_tensors(tmp_path / "d" / "ck", "exp_avg_sq")
    assert all(np.abs(v).max() > 0 for v in after.values())
