"""The ``--sp-mode`` names, each with its line of the flag's help: what :mod:`mpipar.config`
offers as the field's choices, and the modes :data:`mpipar.parallel.sequence.registry.SP_MODES`
imports, in this order (mode ``NAME`` is the object ``NAME`` of ``parallel/sequence/NAME.py``).
It imports nothing, so the configuration (below ``parallel/``) can read it."""
from __future__ import annotations

SP_MODE_HELP: dict[str, str] = {
    "ring": "K/V passed around",
    "ulysses": "all-to-all to head groups",
    "hybrid": "Ulysses inside groups of --ulysses-size sp ranks, ring across them",
    "halo": "sliding window: only the W-1 positions before each rank's tokens come from the "
            "ranks holding them",
}


def sp_mode_help() -> str:
    """The help of ``--sp-mode``: every mode with its line."""
    modes = [f"{name} ({text})" for name, text in SP_MODE_HELP.items()]
    return "SP attention: " + ", ".join(modes[:-1]) + " or " + modes[-1]
