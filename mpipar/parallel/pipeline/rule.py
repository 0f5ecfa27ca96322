"""The pipeline axis's rule: layers over the virtual stages, and a schedule that can be built."""
from __future__ import annotations

from mpipar.config import ConfigError, require
from mpipar.layout import Layout
from mpipar.parallel.pipeline.schedule import build_schedule, schedule_of


def check_config(layout: Layout) -> None:
    """Layers must split evenly into the virtual stages, virtual stages need the interleaved
    schedule (and it them), and the schedule must be buildable for the step's microbatches."""
    m, p = layout.model, layout.parallel
    stages, interleaved = layout.stages, schedule_of(p).interleaved
    require(m.layers % stages == 0,
            f"parallel.pp*virtual_stages = {p.pp}*{p.virtual_stages} = {stages}: must divide "
            f"model.layers={m.layers}")
    require(p.virtual_stages == 1 or interleaved,
            f"parallel.virtual_stages={p.virtual_stages}: more than 1 needs "
            f"--schedule interleaved (got {p.schedule!r})")
    require(not interleaved or p.virtual_stages >= 2,
            f"parallel.schedule='interleaved': needs parallel.virtual_stages >= 2 "
            f"(got {p.virtual_stages})")
    try:
        build_schedule(p.schedule, p.pp, layout.microbatches, p.virtual_stages)
    except ValueError as exc:
        raise ConfigError(f"parallel.schedule={p.schedule!r}: {exc}") from None
