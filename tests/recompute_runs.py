"""Runs of the engine under each ``--recompute`` mode, shared by the one-process and multi-rank
recomputation tests: every mode must train bit-identically to ``none``."""
from __future__ import annotations

import numpy as np

from layouts import small_config, token_source
from mpipar.model.recompute import RECOMPUTE_MODES
from mpipar.rules import validate

MODES = [m for m in RECOMPUTE_MODES if m != "none"]
"""The modes that recompute or offload (each compared with ``none``)."""


def run_mode(layout: dict, mode: str, comm, run_dir: str, **train):
    """Two float64 steps of the test model under ``layout`` with ``--recompute mode`` on ``comm``
    (offload scratch in ``run_dir``; ``train``: other TrainConfig fields): (losses, gradient
    norms, gathered parameters)."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    cfg = small_config("float64", **layout)
    cfg.train.recompute, cfg.train.run_dir = mode, run_dir
    for key, value in train.items():
        setattr(cfg.train, key, value)
    rank = build_rank(validate(cfg, comm.Get_size()), comm, source=token_source(cfg.train.seq_len))
    out = [trainer.train_step(rank, k) for k in range(2)]
    params = trainer.gather_params(rank)
    trainer.close(rank)
    return [r.loss for r in out], [r.grad_norm for r in out], params


def identical(got, ref) -> list[str]:
    """What differs, bit for bit, between two runs' (losses, norms, params); [] if nothing."""
    fails = [f"{what} {a!r} != {b!r}" for what, a, b in
             (("losses", got[0], ref[0]), ("grad norms", got[1], ref[1])) if a != b]
    return fails + [f"{n} differs" for n in ref[2] if not np.array_equal(got[2][n], ref[2][n])]
