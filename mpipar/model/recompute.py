"""The activation recompute modes (``--recompute``): what a decoder block keeps for backward.

A mode is a :class:`Recompute`; the model, the memory model, the step-time model and the traffic
predictions ask it their questions instead of comparing its name. The record it shapes is
:class:`mpipar.model.llama.BlockSaved` (one field per saved tensor); a mode names the fields it
keeps, and backward rebuilds the others with the same kernel calls on the same inputs, so every
mode gives bit-identical results:

- ``none``: every field.
- ``selective``: ``x``, ``x2``, the attention core's output and its saved context, ``g``, ``u``
  (and a sparse block's expert record and shared gate, and the sandwich norms' record); backward recomputes both RMSNorms, ``m``
  and q, k, v, none of it needing communication beyond what backward does anyway.
- ``full``: only the block input ``x``; backward re-runs the whole block forward first, which
  repeats its tensor-, sequence- and expert-parallel traffic.
- ``offload``: every field, written to a per-rank store block by block during forward and read
  back in backward (the LM head's record too); nothing stays in memory.

The configuration field keeps the names (:data:`RECOMPUTE_MODES`); the configuration resolves a
name to its mode once (:attr:`mpipar.config.TrainConfig.recompute_mode`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """One recompute mode. ``keeps``: the record fields it keeps (None: every field);
    ``reruns_block``: backward re-runs the block's forward from its input; ``offloads``: the
    records (the blocks' and the head's) live in a store, not in memory."""

    name: str
    keeps: frozenset[str] | None = None
    reruns_block: bool = False
    offloads: bool = False

    @staticmethod
    def named(name: str) -> Recompute:
        """The mode called ``name``; ValueError naming the value and the choices otherwise."""
        if name not in MODES:
            raise ValueError(f"recompute={name!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
        return MODES[name]

    def __str__(self) -> str:
        return self.name

    @property
    def keeps_everything(self) -> bool:
        """Backward finds every field of the record as forward filled it."""
        return self.keeps is None

    def keeps_field(self, name: str) -> bool:
        """Backward finds field ``name`` of a block's record without recomputing it."""
        return self.keeps is None or name in self.keeps

    def resident_bytes(self, sizes: Mapping[str, int]) -> int:
        """Bytes a record keeps in memory, given each field's bytes ``sizes`` (a field missing
        from ``sizes`` holds none); 0 when the record is offloaded."""
        if self.offloads:
            return 0
        return sum(b for name, b in sizes.items() if self.keeps_field(name))

    def forward_runs(self, backward: bool) -> int:
        """How often a block's forward (and its traffic) runs per microbatch: twice in a
        training step (``backward``) when backward re-runs it, else once."""
        return 2 if backward and self.reruns_block else 1

    def redo_seconds(self, block: float, qkv: float) -> float:
        """The forward work backward repeats, given the seconds of a block's forward ``block``
        and of its q/k/v projections ``qkv``: the whole block, the projections when q, k, v
        are dropped, else none."""
        if self.reruns_block:
            return block
        return 0.0 if self.keeps_field("q") else qkv


NONE = Recompute("none")
SELECTIVE = Recompute("selective", keeps=frozenset({
    "x", "x2", "attention_out", "attention_saved", "g", "u", "moe", "shared_gate",
    "post_norms"}))
FULL = Recompute("full", keeps=frozenset({"x"}), reruns_block=True)
OFFLOAD = Recompute("offload", offloads=True)

MODES: dict[str, Recompute] = {m.name: m for m in (NONE, SELECTIVE, FULL, OFFLOAD)}
RECOMPUTE_MODES = tuple(MODES)
"""The names ``--recompute`` accepts, in order of the memory they keep (offload last)."""
BY_MEMORY = (NONE, SELECTIVE, FULL)
"""The in-memory modes from the most memory kept to the least (the planner tries them in turn)."""
