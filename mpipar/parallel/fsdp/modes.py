"""``--zero-shared``, where ZeRO-3 keeps the parameters on the CPU: gathered per unit
(``off``) or in node shared memory (``node``). The configuration keeps the names; the runtime,
the rules and the planner ask :func:`in_node_memory`."""
from __future__ import annotations

from typing import Any

PLACES: dict[str, bool] = {"off": False, "node": True}
"""Every ``--zero-shared``, by name: whether it asks for node shared memory."""


def in_node_memory(par: Any) -> bool:
    """Whether a parallel configuration asks ZeRO-3 to hold the parameters in node shared
    memory; ValueError naming a value no choice has."""
    if par.zero_shared not in PLACES:
        raise ValueError(f"zero_shared={par.zero_shared!r}: must be one of {', '.join(PLACES)}")
    return PLACES[par.zero_shared]
