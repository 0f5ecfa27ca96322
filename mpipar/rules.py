"""Every configuration rule of a run, in the order they are asked.

A rule lives with the component it governs (the tensor split with ``parallel/tensor/rule.py``, the
schedule with the pipeline, ...); this module only lists them: first every parallel axis's, in
:data:`mpipar.parallel.registry.AXES` order, then the other components'. :func:`validate` checks
the fields' own rules and the layout's (:func:`mpipar.layout.resolve`: the grid's sizes, the
batch split), then asks each component in :data:`RULES` order with the resolved :class:`Layout`, and
returns it. The first broken rule raises :class:`~mpipar.config.ConfigError` naming the field,
the value and the rule; the entry points print it once and every rank exits 2 before any
collective. Nothing registers itself on import: what is checked is what this list says.
"""
from __future__ import annotations

from collections.abc import Callable

from mpipar.config import Config
from mpipar.data import packing, sources
from mpipar.layout import Layout, resolve
from mpipar.model import lora, mtp
from mpipar.parallel.registry import AXES
from mpipar.runtime import device
from mpipar.training import objective, optim, optimizers, recovery

Rule = Callable[[Layout], None]

RULES: tuple[tuple[str, Rule], ...] = (
    *((axis.name, axis.check) for axis in AXES),   # the parallel axes (parallel/registry.py)
    ("eval", sources.check_config),         # the validation set
    ("documents", packing.check_config),    # EOS id, document masking, the EOS loss mask
    ("objective", objective.check_config),  # DPO: its beta, its pairs, what it excludes
    ("optimizer", optim.check_config),      # AdamW and the LR schedule
    ("muon", optimizers.check_config),      # Muon's momentum and Newton-Schulz steps
    ("lora", lora.check_config),            # adapters: targets, rank, what LoRA runs with
    ("mtp", mtp.check_config),              # multi-token prediction: what its modules take
    ("recovery", recovery.check_config),    # what --on-rank-failure shrink restores
    ("backend", device.check_config),       # kernels, device, dtype, CUDA-aware MPI
)
"""The components' rules, in the order :func:`validate` asks them."""


def validate(cfg: Config, world: int) -> Layout:
    """Every rule of ``cfg`` on ``world`` ranks, in order; the resolved Layout, or ConfigError."""
    layout = resolve(cfg, world)
    for _, check in RULES:
        check(layout)
    return layout
