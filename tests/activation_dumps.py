"""Shared by the activation dump tests: a Rank that dumps activations, and the dumps of a
single-process run that every layout's dumps must reassemble to."""
from __future__ import annotations

import functools
import tempfile

import numpy as np

from layouts import small_config, token_source
from mpipar.checkpoint.activations import load_global
from mpipar.model.llama import ACTIVATION_NAMES
from mpipar.rules import validate
from mpipar.training import step as trainer


def dumping_rank(cfg, comm, run_dir: str, dump: str):
    """A Rank of ``cfg`` on ``comm`` writing its run to ``run_dir`` and dumping the
    activations of steps ``dump`` (``--dump-activations``, e.g. "1,2")."""
    from mpipar.training.rank import build_rank
    cfg.train.run_dir, cfg.train.dump_activations = run_dir, dump
    return build_rank(validate(cfg, comm.Get_size()), comm, source=token_source(cfg.train.seq_len))


@functools.lru_cache(maxsize=None)
def single_process_dump() -> str:
    """Run dir of a 2-step single-process run that dumped steps 1 and 2."""
    from mpi4py import MPI
    run_dir = tempfile.mkdtemp(prefix="mpipar-act-ref-")
    rank = dumping_rank(small_config("float64"), MPI.COMM_SELF, run_dir, "1,2")
    for k in range(2):
        trainer.train_step(rank, k)
    return run_dir


@functools.lru_cache(maxsize=None)
def reference_tensors(step: int) -> dict[tuple[int, str], np.ndarray]:
    """The single-process dump of ``step``: every layer's activations by (layer, name), each
    ``[B, S, width]`` (width: hidden, or heads * head_dim for ``attention``)."""
    run_dir = single_process_dump()
    layers = small_config().model.layers
    return {(i, n): load_global(run_dir, step, i, n) for i in range(layers)
            for n in ACTIVATION_NAMES}
