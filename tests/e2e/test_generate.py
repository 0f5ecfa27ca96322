"""Generation from a launched run's TP=2 sharded checkpoint: ``python -m mpipar.generate`` under
mpirun with TP=2, and on one rank, gives transformers' greedy tokens (:mod:`generation`)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from mpi4py import MPI

from conftest import MPIRUN, needs_mpirun
from generation import (NEW, PROMPT, V, hf_dir, transformers_greedy,  # noqa: F401  (fixtures)
                        transformers_llama)
from mpipar import generate


@needs_mpirun
def test_greedy_from_a_tp2_sharded_checkpoint_equals_transformers(tmp_path, hf_dir,
                                                                 transformers_llama, capsys,
                                                                 monkeypatch):
    """Fine-tune the Hugging Face model 2 steps under TP=2 (a sharded checkpoint and an export);
    ``python -m mpipar.generate`` under mpirun with TP=2 reads the checkpoint's shards directly
    and gives transformers' greedy tokens on the export; so does one rank."""
    samples = tmp_path / "samples.npy"
    np.save(samples, np.random.default_rng(1).integers(0, V, size=(8, 17)))
    run, export = tmp_path / "run", tmp_path / "export"
    train = subprocess.run(
        [MPIRUN, "-n", "2", sys.executable, "-m", "mpipar.train", "--init-from-hf", str(hf_dir),
         "--tp", "2", "--steps", "2", "--dtype", "float64", "--backend", "numpy", "--data",
         str(samples), "--seq-len", "16", "--global-batch-size", "2", "--warmup-steps", "0",
         "--log-every", "0", "--tensorboard", "off", "--run-dir", str(run),
         "--export-hf", str(export)], capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    args = [str(run / "checkpoints"), "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", str(NEW), "--json", "--backend", "numpy"]
    two = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "mpipar.generate", *args,
                          "--tp", "2"], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    sharded = json.loads(two.stdout)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main installs its abort hook
    assert generate.main(args, MPI.COMM_SELF) == 0
    one = json.loads(capsys.readouterr().out)
    want, _ = transformers_greedy(transformers_llama, export, list(PROMPT.encode()), NEW)
    assert sharded["prompt_ids"] == list(PROMPT.encode()) and sharded["ids"] == want
    assert one["ids"] == want and one["stopped"] == "length"
    assert sharded["text"] == generate.byte_codec().decode(want)
