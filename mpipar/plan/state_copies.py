"""What ``--state-copies 1`` costs a rank (:mod:`mpipar.training.state_copies`): the memory of
the copies it keeps and the bytes it sends its holder each step.

A rank's share is the unique state it reports to a checkpoint: of each trained parameter it
reports (every tp shard of a split tensor, tp rank 0's of a replicated one, the first pipeline
rank's of a tied one), the master weights and AdamW's two moments

- ZeRO-0: whole local shards, reported by rank 0 of the replica group (dp x sp, or ``ep_dp``
  for experts sharded over ep); the other replicas report nothing;
- ZeRO-1: the masters as ZeRO-0 (mixed precision: the owned slices), the moments' owned slices;
- ZeRO-2/3: the owned slices of the units, masters and moments alike;

in the masters' dtype, without the stores' padding. The rank sends its share once a step
(group ``copy``, one ``sendrecv`` to its holder) and keeps
:data:`mpipar.training.recovery.COPIES_KEPT` steps of its own share and of its partner's.
"""
from __future__ import annotations

from mpipar.layout import Layout
from mpipar.parallel.calls import Call
from mpipar.plan.optimizer import parts
from mpipar.plan.rank import grid_shape, group_members, nodes_of, placement_table
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord
from mpipar.training.recovery import COPIES_KEPT
from mpipar.training.state_copies import GROUP, holders


def share_elements(layout: Layout, coord: Coord) -> int:
    """Elements of the rank at ``coord``'s share (module docstring)."""
    par, table = layout.parallel, placement_table(layout)
    mixed = Precision.of(layout.train, par).mixed
    me = grid_shape(layout).rank_of(coord)
    total = 0
    for part in parts(layout, coord):
        mine = [n for n in part.elements if table[n].owned_by(coord.tp, coord.pp)]
        owned: dict[str, int] = {}
        for store in part.stores:
            for n, k in store.owned(part.slot).items():
                owned[n] = owned.get(n, 0) + k
        first = group_members(layout, part.group, me)[0] == me
        whole = sum(part.elements[n] for n in mine) if first else 0
        sliced = sum(owned.get(n, 0) for n in mine)
        params = sliced if par.zero >= 2 or (par.zero == 1 and mixed) else whole
        total += params + 2 * (sliced if par.zero else whole)
    return total


def share_bytes(layout: Layout, coord: Coord) -> int:
    """Bytes of the rank at ``coord``'s share (what it sends its holder each step)."""
    if not layout.train.state_copies:
        return 0
    return share_elements(layout, coord) * Precision.of(layout.train, layout.parallel).master_bytes


def _holders(layout: Layout) -> list[int]:
    return holders(list(nodes_of(layout).nodes))


def copy_calls(layout: Layout, coord: Coord) -> list[Call]:
    """The step's exchange of the rank at ``coord``: its share to its holder."""
    if not layout.train.state_copies or layout.world == 1:
        return []
    me = grid_shape(layout).rank_of(coord)
    peer = _holders(layout)[me]
    return [Call(GROUP, "sendrecv", share_bytes(layout, coord), 1, peer=peer)]


def copy_memory(layout: Layout, coord: Coord) -> int:
    """Bytes the rank at ``coord`` keeps: :data:`COPIES_KEPT` steps of its own share and of the
    share of the rank it holds for."""
    if not layout.train.state_copies:
        return 0
    shape = grid_shape(layout)
    partner = _holders(layout).index(shape.rank_of(coord))
    return COPIES_KEPT * (share_bytes(layout, coord)
                          + share_bytes(layout, shape.coord_of(partner)))
