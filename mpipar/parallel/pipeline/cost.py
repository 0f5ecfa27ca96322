"""What the pipeline costs a rank: the pp group's calls in a step, and the pipeline's terms of
the memory and time models (what its schedule keeps in flight, what a message carries)."""
from __future__ import annotations

from collections.abc import Mapping

from mpipar.layout import Layout
from mpipar.parallel.calls import Call, element_bytes
from mpipar.parallel.pipeline.schedule import Op
from mpipar.runtime.topology import Coord, GridShape


def pipeline_calls(layout: Layout, coord: Coord, shape: GridShape, stages: list[int],
                   passes: int, backward: bool) -> list[Call]:
    """The pp group's calls of the rank at ``coord`` of the grid ``shape``, whose chunks are
    the global virtual ``stages``, in ``passes`` microbatches through each chunk: the
    activations ``[B, S/sp, H]`` (``[B*S/(sp*tp), H]`` under tensor sequence parallelism) to the
    next stage and, with ``backward`` (a training step), their gradients to the previous one,
    each with its receive on the other side; and the loss broadcast from the last stage."""
    m, par, tr = layout.model, layout.parallel, layout.train
    p, last = layout.pp, layout.stages - 1
    tokens = layout.micro_rows * (tr.seq_len // par.sp)
    act = tokens * m.hidden * element_bytes(tr.dtype) // (par.tp if par.tp_sequence_parallel
                                                          else 1)
    outgoing = sum(s < last for s in stages) * passes       # activations to the next stage
    incoming = sum(s > 0 for s in stages) * passes          # activations from the previous
    nxt = shape.rank_of(coord._replace(pp=(coord.pp + 1) % p))
    loss = Call("pp", "bcast", 8 if coord.pp == p - 1 else 0)
    if not backward:
        return [Call("pp", "send", act, outgoing, nxt), Call("pp", "recv", 0, incoming), loss]
    prv = shape.rank_of(coord._replace(pp=(coord.pp - 1) % p))
    return [Call("pp", "send", act, outgoing, nxt), Call("pp", "send", act, incoming, prv),
            Call("pp", "recv", 0, outgoing + incoming), loss]


def saved_peak(ops: list[Op], saved: Mapping[int, int]) -> int:
    """The most bytes a rank whose schedule is ``ops`` keeps between forwards and their
    backwards at once, each forward of chunk ``c`` keeping ``saved[c]`` until its backward."""
    live, peak = 0, 0
    for op in ops:
        if op.kind == "fwd":
            live += saved[op.chunk]
            peak = max(peak, live)
        elif op.kind in ("bwd", "bwd_weight"):
            live -= saved[op.chunk]
    return peak


def message_bytes(layout: Layout) -> int:
    """Bytes of the activations one microbatch sends between stages, as the time model books a
    pipeline hop: ``[B, S/sp, H]`` in the activations' dtype."""
    m, par, tr = layout.model, layout.parallel, layout.train
    n = layout.micro_rows * (tr.seq_len // par.sp)
    return n * m.hidden * element_bytes(tr.dtype)
