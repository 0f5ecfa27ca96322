"""The ``--allreduce-algorithm`` choices as objects (:class:`Algorithm`). It imports nothing, so
the configuration (its field's choices) and the layout (``hierarchical`` resolves
``dp_reduce``) can read it; :mod:`mpipar.runtime.allreduce` sets them in the MPI library."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """One ``--allreduce-algorithm``. ``library``: an algorithm the MPI library runs when told
    to; ``own_reduction``: mpipar's hierarchical reduction (``--dp-reduce hierarchical``), the
    library keeping its own choice for each step; neither: ``auto``, the library's choice (or
    the fastest per size of ``--allreduce-hardware``)."""

    name: str
    library: bool = False
    own_reduction: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def chooses_per_size(self) -> bool:
        """The library (or a hardware file) picks the algorithm of each all-reduce."""
        return not self.library and not self.own_reduction


AUTO = Algorithm("auto")
MODES: dict[str, Algorithm] = {a.name: a for a in (
    AUTO, Algorithm("ring", library=True), Algorithm("tree", library=True),
    Algorithm("rabenseifner", library=True), Algorithm("hierarchical", own_reduction=True))}
ALGORITHMS = tuple(MODES)
"""The names ``--allreduce-algorithm`` accepts."""
LIBRARY_ALGORITHMS = tuple(name for name, a in MODES.items() if a.library)
"""The algorithms the MPI library runs (``auto`` and ``hierarchical`` leave it its own)."""


def algorithm_named(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the value and the choices otherwise."""
    if name not in MODES:
        raise ValueError(f"allreduce_algorithm={name!r}: must be one of {', '.join(ALGORITHMS)}")
    return MODES[name]
