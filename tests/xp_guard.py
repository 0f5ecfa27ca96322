"""The array seam's guard, shared by the one-process and multi-rank seam tests: a step run with
the kernel backend's ``xp`` swapped for a recording wrapper of NumPy, while ``np`` in every
hot-path module is swapped for a guard that fails on any NumPy function (types, dtypes and
constants pass)."""
from __future__ import annotations

import dataclasses
import importlib
import types

import numpy as np

from layouts import token_source
from mpipar.rules import validate

HOT_PATH = ("mpipar.training.step", "mpipar.training.batches", "mpipar.runtime.comm",
            "mpipar.model.llama", "mpipar.model.attention",
            "mpipar.parallel.tensor.ops", "mpipar.parallel.sequence.common",
            "mpipar.parallel.sequence.ring", "mpipar.parallel.sequence.halo",
            "mpipar.parallel.sequence.ulysses", "mpipar.parallel.sequence.hybrid",
            "mpipar.parallel.data_parallel.reducer",
            "mpipar.parallel.compression", "mpipar.parallel.pipeline.executor")
ALLOWED = {"dtype", "inf", "nan", "ndarray", "generic", "integer", "floating", "bool_"}


class RecordingXP(types.ModuleType):
    """NumPy, counting each function called through it."""

    def __init__(self) -> None:
        super().__init__("recording_xp")
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        value = getattr(np, name)
        if callable(value) and not isinstance(value, type):
            def counted(*args, **kwargs):
                self.calls[name] = self.calls.get(name, 0) + 1
                return value(*args, **kwargs)
            return counted
        return value


class NumpyGuard(types.ModuleType):
    """Stands in for ``np`` in a hot-path module: types, dtypes and constants only."""

    def __init__(self, module: str) -> None:
        super().__init__("numpy_guard")
        self.module = module

    def __getattr__(self, name: str):
        value = getattr(np, name)
        if isinstance(value, (type, float, np.dtype)) or name in ALLOWED:
            return value
        raise AssertionError(f"np.{name} called in {self.module} during a training step: "
                             f"allocate from the backend's xp")


def guarded_step(monkeypatch, cfg, comm) -> tuple[list, RecordingXP]:
    """Two steps and a validation pass (on a separate file: the training data stays the
    reference's) with the seam swapped in; returns (losses, norms, params) and the recorder. The
    validation loss must equal an unguarded pass's."""
    from mpipar.training import rank as rank_mod
    from mpipar.training import step as trainer
    from mpipar.runtime.device import training_backend

    recording = RecordingXP()
    backend = dataclasses.replace(training_backend("numpy"), xp=recording)
    monkeypatch.setattr(rank_mod, "training_backend", lambda name, device="cpu": backend)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=2,
                                                             eval_data=token_source().path))
    eng = rank_mod.build_rank(validate(cfg, comm.Get_size()), comm, source=token_source())
    for name in HOT_PATH:
        module = importlib.import_module(name)
        if hasattr(module, "np"):
            monkeypatch.setattr(module, "np", NumpyGuard(name))
    results = [trainer.train_step(eng, k) for k in range(2)]
    guarded = trainer.evaluate(eng).loss
    monkeypatch.undo()
    assert guarded == trainer.evaluate(eng).loss
    return ([r.loss for r in results], [r.grad_norm for r in results],
            trainer.gather_params(eng)), \
        recording
