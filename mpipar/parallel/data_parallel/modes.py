"""The data-parallel reduction's modes: ``--dp-reduce``, ``--grad-compression``,
``--error-feedback`` and ``--topk-catch-up`` as objects.

The configuration keeps the names (its fields' choices); :func:`reduction_of` resolves a
parallel configuration to its :class:`Reduction` once, and the runtime, the rules and the
planner ask it and its :class:`Compression` their questions instead of comparing names.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpipar.parallel.compression import BLOCK, Codec, Int8Codec, TopKCodec


@dataclass(frozen=True)
class Compression:
    """One ``--grad-compression``. ``warmup_share``: the share of ``--steps`` it reduces
    uncompressed first under ``--compression-warmup -1``; ``block``: the elements a compressed
    piece is a multiple of; ``gathers_back``: the owners re-encode their sums and all-gather
    them (a second compressed direction, with a residual of its own); ``sparse``: it sends a
    selection of the elements (values and indices), every rank adding up every rank's."""

    name: str
    warmup_share: float = 0.0
    block: int = 1
    gathers_back: bool = False
    sparse: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def compresses(self) -> bool:
        """The reduction sends an encoding of the gradients, not the gradients."""
        return self is not NO_COMPRESSION

    def codec(self, topk_ratio: float, xp: ModuleType) -> Codec | None:
        """The codec over arrays of ``xp`` (None when nothing is compressed)."""
        if not self.compresses:
            return None
        return TopKCodec(xp, topk_ratio) if self.sparse else Int8Codec(xp, self.block)

    def label(self, topk_ratio: float) -> str:
        """A short name for a layout's line: ``int8``, ``top-0.01``."""
        return f"top-{topk_ratio:g}" if self.sparse else self.name

    def seconds_per_element(self, rates: Any) -> float:
        """A rank's encoding and decoding work per element compressed, of the planner's
        ``rates`` (:class:`mpipar.plan.step_time.Rates`)."""
        return rates.topk_seconds if self.sparse else rates.int8_seconds


NO_COMPRESSION = Compression("none")
INT8 = Compression("int8", warmup_share=0.1, block=BLOCK, gathers_back=True)
TOPK = Compression("topk", warmup_share=1 / 3, sparse=True)
# The warm-up shares are the smallest that kept the default 120-step run within 1 % (int8 with
# error feedback) and 5 % (top-k 1 %) of uncompressed over two seeds (docs/benchmarks.md).

COMPRESSIONS: dict[str, Compression] = {c.name: c for c in (NO_COMPRESSION, INT8, TOPK)}
"""Every ``--grad-compression``, by name."""

NODE_SPLITS: dict[str, bool] = {"flat": False, "hierarchical": True}
"""Every ``--dp-reduce``, by name: whether the reduction goes through the nodes (reduce-scatter
inside the node, the shard across nodes, all-gather inside the node)."""

SWITCHES: dict[str, bool] = {"on": True, "off": False}
"""``--error-feedback`` and ``--topk-catch-up``."""


def _named(table: dict[str, Any], field: str, name: str) -> Any:
    if name not in table:
        raise ValueError(f"{field}={name!r}: must be one of {', '.join(table)}")
    return table[name]


def hierarchical_named(name: str) -> bool:
    """Whether ``--dp-reduce name`` reduces through the nodes."""
    return _named(NODE_SPLITS, "dp_reduce", name)


@dataclass(frozen=True)
class Reduction:
    """The gradient reduction over dp x sp that a configuration asks for: ``hierarchical``
    (through the nodes) or flat, its ``compression``, whether a rank keeps what compression did
    not send (``feedback``) and whether the optimizer catches up coordinates that top-k held
    back (``catch_up``)."""

    hierarchical: bool
    compression: Compression
    feedback: bool
    catch_up: bool

    @property
    def compresses(self) -> bool:
        return self.compression.compresses

    @property
    def dense_and_flat(self) -> bool:
        """One dense reduction over the whole group (what ZeRO-2/3's reduce-scatter is)."""
        return not self.hierarchical and not self.compresses

    @property
    def keeps_residual(self) -> bool:
        """Compressed steps keep their error-feedback residuals."""
        return self.feedback and self.compresses

    @property
    def catches_up(self) -> bool:
        """Top-k sums with error feedback whose coordinates AdamW moves by the steps they
        waited (:func:`mpipar.training.optim.adamw_catch_up`)."""
        return self.catch_up and self.keeps_residual and self.compression.sparse

    @property
    def across(self) -> str:
        """The group the reduction crosses the nodes over (and compresses over): ``dp_sp_inter``
        when hierarchical, else the whole ``dp_sp``."""
        return "dp_sp_inter" if self.hierarchical else "dp_sp"

    def label(self, topk_ratio: float) -> str:
        """The reduction in a layout's line: `` hierarchical``, `` int8``, `` top-0.01 no-EF``
        (empty for a flat dense one)."""
        text = " hierarchical" if self.hierarchical else ""
        if self.compresses:
            text += " " + self.compression.label(topk_ratio) + ("" if self.feedback
                                                                else " no-EF")
        return text


def reduction_of(par: Any) -> Reduction:
    """The reduction of a parallel configuration (``dp_reduce``, ``grad_compression``,
    ``error_feedback``, ``topk_catch_up``); ValueError naming a value no mode has."""
    return Reduction(hierarchical_named(par.dp_reduce),
                     _named(COMPRESSIONS, "grad_compression", par.grad_compression),
                     _named(SWITCHES, "error_feedback", par.error_feedback),
                     _named(SWITCHES, "topk_catch_up", par.topk_catch_up))
