"""What the pipeline axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): the
executors of its schedule's ops, training and forward-only."""
from __future__ import annotations

from typing import Any

from mpipar.layout import Layout
from mpipar.model.llama import RESIDENT
from mpipar.parallel.axis import Parts
from mpipar.parallel.pipeline.executor import PipelineExecutor
from mpipar.parallel.pipeline.schedule import build_schedule, forward_only


def pipeline_executors(layout: Layout, comms: Any, compute: Any, model: Any, weights: Any,
                       parts: Parts) -> Parts:
    """``executor``: this pipeline rank's ops of the training schedule over its chunks, each
    unit used inside the weights' scope; ``evaluator``: its forward-only ops."""
    par = layout.config.parallel
    ops = build_schedule(par.schedule, par.pp, layout.microbatches, par.virtual_stages)
    pp, chunks = comms.grid.coord.pp, list(model.chunks)
    executor = PipelineExecutor(ops=ops[pp], chunks=chunks, pp=comms.groups["pp"],
                                xp=compute.xp, scope=weights.sharded or RESIDENT)
    evaluator = PipelineExecutor(ops=forward_only(ops)[pp], chunks=chunks,
                                 pp=comms.groups["pp"], xp=compute.xp)
    return {"executor": executor, "evaluator": evaluator}
