"""Every sequence-parallel mode, by the name ``--sp-mode`` gives. Adding a mode is one file and
one line: its module ``parallel/sequence/NAME.py`` exporting the mode object ``NAME`` (upper
case), and its name with its help line in :data:`mpipar.parallel.sequence.names.SP_MODE_HELP`,
which the configuration offers as the field's choices and from which this registry imports
each mode's module."""
from __future__ import annotations

from importlib import import_module
from typing import Any

from mpipar.parallel.sequence.mode import SequenceMode
from mpipar.parallel.sequence.names import SP_MODE_HELP


def _mode(name: str) -> SequenceMode:
    """The object ``NAME`` of module ``parallel/sequence/NAME.py``."""
    mode = getattr(import_module(f"{__package__}.{name}"), name.upper())
    assert mode.name == name, f"parallel/sequence/{name}.py: its mode is named {mode.name!r}"
    return mode


SP_MODES: dict[str, SequenceMode] = {name: _mode(name) for name in SP_MODE_HELP}


def sequence_mode(par: Any) -> SequenceMode:
    """The mode object of a parallel configuration's ``sp_mode``."""
    return SP_MODES[par.sp_mode]
