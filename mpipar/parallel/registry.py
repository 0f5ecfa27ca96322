"""Every parallel axis, in the order their rules are asked: adding an axis is its module (or
package) and one line here. :mod:`mpipar.rules` asks each axis's rule;
:func:`mpipar.plan.traffic.step_calls` concatenates their calls; :mod:`mpipar.plan.memory` and
:mod:`mpipar.plan.step_time` sum their terms; :func:`mpipar.training.rank.build_rank` calls their
build hooks, phase by phase. The sequence axis's modes are
:data:`mpipar.parallel.sequence.registry.SP_MODES`."""
from __future__ import annotations

from mpipar.parallel.axis import Axis
from mpipar.parallel.data_parallel.axis import DATA
from mpipar.parallel.experts.axis import EXPERTS
from mpipar.parallel.fsdp.axis import FSDP
from mpipar.parallel.pipeline.axis import PIPELINE
from mpipar.parallel.sequence.axis import SEQUENCE
from mpipar.parallel.tensor.axis import TENSOR

AXES: tuple[Axis, ...] = (
    TENSOR,      # heads, FFN, tokens for tp sequence parallelism
    PIPELINE,    # layers per stage, virtual stages, the schedule
    SEQUENCE,    # sequence split, the SP mode (Ulysses heads, hybrid groups, ...)
    DATA,        # buckets, hierarchical nodes, compression
    FSDP,        # ZeRO-2/3 groups, prefetch, node shared memory
    EXPERTS,     # mixture of experts: ep, what it composes with
)
