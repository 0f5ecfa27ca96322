"""Every sequence-parallel mode, by the name ``--sp-mode`` gives: adding a mode is its module
and one line here."""
from __future__ import annotations

from typing import Any

from mpipar.parallel.sequence.halo import HALO
from mpipar.parallel.sequence.hybrid import HYBRID
from mpipar.parallel.sequence.mode import SequenceMode
from mpipar.parallel.sequence.ring import RING
from mpipar.parallel.sequence.ulysses import ULYSSES

SP_MODES: dict[str, SequenceMode] = {mode.name: mode for mode in (
    RING,
    ULYSSES,
    HYBRID,
    HALO,
)}


def sequence_mode(par: Any) -> SequenceMode:
    """The mode object of a parallel configuration's ``sp_mode``."""
    return SP_MODES[par.sp_mode]
