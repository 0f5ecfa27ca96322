"""Fully sharded data parallelism: ZeRO-2 and ZeRO-3 over the dp x sp group.

The model names the *units* it reads parameters in (:class:`mpipar.model.llama.ParamScope`):
the embedding, each decoder block, the final norm with the LM head. Each unit is one flat buffer,
padded to a multiple of ``n`` (the dp x sp size); rank ``r`` of the group owns elements
``[r * N / n, (r + 1) * N / n)`` of it: its slice of the gradients and of the optimizer state
(:class:`mpipar.training.optim.ZeroAdamW`), and at ZeRO-3 of the parameters too.

- **ZeRO-2** (``gather=False``): every rank keeps the whole parameters of its stage; after the
  update the owned slices are all-gathered back (as ZeRO-1).
- **ZeRO-3** (``gather=True``): only the owned slice is persistent. When the model enters a unit
  (:meth:`ShardedParams.using`, around its forward and again around its backward) the unit is
  all-gathered into a buffer from a pool of reusable buffers, and the all-gathers of the next
  ``prefetch`` units of the chunk in the same direction are posted non-blocking, so they run
  while this one computes; when the model leaves the unit the buffer goes back to the pool
  (except, after the forward, the chunk's last ``1 + prefetch`` units: the backward enters
  them first, with nothing to hide their gathers behind).
  Between its operations the model calls :meth:`ShardedParams.progress`, which tests every
  gather and reduce-scatter in flight: an MPI without a progress thread (every CPU MPI by
  default) moves a non-blocking collective only while some call is inside MPI, so without it
  the prefetched transfer would happen in the wait. The reduce-scatters in flight are tested
  too: with MPICH, testing the gathers alone left them unfinished behind them (measured).
- **ZeRO-3 in node shared memory** (``node_groups``, :func:`node_shared`): each unit is one
  MPI-3 shared-memory window over the group's ranks on this node (``intra``;
  :meth:`mpipar.runtime.comm.Group.shared_array`), in which each allocates an equal part; every rank
  reads the whole unit in place, so the storage runs as ZeRO-2's (``gather`` false, the units
  bound) with nothing gathered per layer. A rank writes only its own slice (the update, a
  load); :meth:`gather_params` publishes the slices with one barrier over ``intra`` (and the
  first unit entered after a load). When the group spans nodes, each node holds a copy: before
  the barrier each rank all-gathers, over ``inter`` (the ranks in its place on every node),
  their updated slices into its node's copy, once a step (HSDP's memory: 1/``intra.size`` of
  the parameters a rank; its gradients and optimizer state stay 1/n).

Gradients, both stages: a unit's full-size gradient buffer exists only while its backward is in
flight. Once the unit's gradients of one microbatch are final (on leaving :meth:`using`, or
for zb-h1's deferred weight gradients at :meth:`weights_done`) the tp-partial ones are summed
over tp, a non-blocking reduce-scatter sends the buffer to the owners, and the received slice
is added to the owned gradient; at most ``MAX_IN_FLIGHT`` reduce-scatters are outstanding. Summed over the
step's microbatches this is the sum of the gradients over dp x sp, as the all-reduce of ZeRO-0.

Precision (:mod:`mpipar.runtime.precision`): ``owned`` is this rank's slice of the master
weights and ``owned_grad`` of the gradients, in the masters' dtype; with bf16 compute
(``compute_dtype``) the whole parameters the model reads (ZeRO-2's, the node's copy, ZeRO-3's
gathered buffers) are bf16 compute copies, and a ZeRO-3 unit keeps a bf16 copy of its owned
slice (``owned_compute``) to gather from, refreshed from the master after every update and load.
A unit's gradient buffer is in the masters' dtype; ``reduce_dtype`` (``--reduce-dtype``) is what
its reduce-scatter sends.

Experts sharded over ep (``--ep N``): a second :class:`ShardedParams` holds the rank's experts,
a unit per sparse block, over ``ep_dp`` instead of dp x sp, beside the dense units (sharing their
buffer pool: :class:`mpipar.parallel.experts.split.ExpertSplitUnits`).

Every rank of dp x sp holds the same pipeline and tp position and so runs the same op list: its
collectives start in the same order on every rank of the group. Buffers come from the kernel
backend's array module (``xp``).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any

from mpipar.parallel.fsdp.gather import Gathers, bind
from mpipar.parallel.fsdp.node_copy import NodeCopy
from mpipar.parallel.fsdp.scatter import GradScatter
from mpipar.parallel.fsdp.units import BufferPool, Unit, make_unit
from mpipar.runtime.comm import Group
from mpipar.parallel.fsdp.modes import in_node_memory

Units = list[list[tuple[str, list[str]]]]
"""Per model chunk, its units in forward order as ``(unit, parameter names)``."""

def kept_after_forward(chunks: list[list[str]], prefetch: int) -> set[str]:
    """ZeRO-3: the units whose gathered parameters stay from their forward to their backward:
    each chunk's last ``1 + prefetch`` units, which its backward enters first and would gather
    at once, with no compute before them to hide behind (FSDP's reshard-after-forward off for
    the last layer). A unit read by several chunks counts as the first chunk's. ``chunks``:
    each chunk's units in forward order."""
    order: dict[str, list[str]] = {}
    for names in chunks:
        for unit in names:
            order.setdefault(unit, names)
    return {unit for unit, names in order.items() if unit in names[-1 - prefetch:]}


def node_shared(par: Any, device_buffers: bool) -> bool:
    """Whether ZeRO-3 may hold the parameters in node shared memory instead of gathering them:
    asked for (``zero_shared="node"``) with host buffers (CUDA memory is not an MPI shared
    window). It does where the dp x sp group is on one node, or spans nodes that each hold the
    same number (> 1) of its ranks (then each node holds a copy); elsewhere the units are
    gathered."""
    return par.zero == 3 and in_node_memory(par) and not device_buffers


def node_copy_layout(par: Any, device_buffers: bool, shape: Any, nodes: Any,
                     rank: int) -> tuple[int, int] | None:
    """Where :func:`node_shared` applies to grid rank ``rank`` (``shape``: the grid's
    :class:`mpipar.runtime.topology.GridShape`, ``nodes`` its node map): (ranks of its dp x sp group on
    its node, nodes the group spans), or None where the units are gathered (not asked for,
    CUDA, or a group across nodes that hold unequal numbers of its ranks, or one rank each).
    The engine and the planner both ask this."""
    if not node_shared(par, device_buffers):
        return None
    group = shape.members("dp_sp", rank, nodes)
    spans = len({nodes.nodes[r] for r in group})
    if spans > 1 and (shape.node_split_problem(nodes) is not None or len(group) == spans):
        return None
    return len(group) // spans, spans


class ShardedParams:
    """ZeRO-2/3 storage and communication of one rank: the parameters as units sharded over
    ``group`` (dp x sp), the ``params``/``grads`` dicts the model reads and writes, and the
    scope the model announces its units through.

    ``initial(name)``: this rank's (tp-local) initial tensor of a parameter, asked for one unit
    at a time (so initialisation never holds more than one whole unit); ``chunks``: per model
    chunk, its units in forward order as ``(unit name, parameter names)``;
    ``before_reduce(names)``: called with a unit's parameter names before its gradients leave
    (sums the tp-partial ones over tp);
    ``tied``: names (the embedding tied across the pipeline, a unit of its own on both ends)
    whose owned gradients are then summed over ``tied_group``. ``initial`` gives master
    values; ``compute_dtype`` and ``reduce_dtype`` (default: theirs) as in the module
    docstring; ``pool``: the buffer pool to take whole units from (default: one of its own;
    the experts' units sharded over ``ep_dp`` share the dense units' pool:
    :class:`mpipar.parallel.experts.split.ExpertSplitUnits`). ``frozen``: parameters that do not
    train (LoRA's base, :class:`FrozenBaseScope`): gathered as the others, with no gradient
    buffer and no reduction."""

    def __init__(self, initial: Callable[[str], Any], chunks: list[list[tuple[str, list[str]]]],
                 group: Group, *, gather: bool, prefetch: int, xp: ModuleType,
                 before_reduce: Callable[[list[str]], None], tied: Collection[str] = (),
                 tied_group: Group | None = None,
                 node_groups: tuple[Group, Group | None] | None = None,
                 compute_dtype: Any = None, reduce_dtype: Any = None,
                 pool: BufferPool | None = None, frozen: bool = False) -> None:
        self.compute_dtype, self.frozen, self.mixed = compute_dtype, frozen, False
        # ZeRO-3 in node shared memory: the whole units stay bound, as at ZeRO-2, but each is
        # one array the node's ranks of the group map together, each allocating a part.
        shared = node_groups is not None and gather
        self.group, self.gather, self.xp = group, gather and not shared, xp
        self.node = NodeCopy(group.rank, group.size, *node_groups) if shared else None
        self.units: dict[str, Unit] = {}
        order: dict[str, list[str]] = {}     # unit -> its chunk's units in forward order
        for units in chunks:
            names = [u for u, _ in units]
            for unit, pnames in units:   # a unit two chunks read (a tied embedding) is one
                if unit not in self.units:
                    self.units[unit] = self._make_unit(unit, pnames, initial)
                    order[unit] = names
        self.pool = BufferPool(xp) if pool is None else pool
        self.shapes = {n: s for u in self.units.values() for n, s in u.shapes.items()}
        self.params: dict[str, Any] = {}
        master = next((u.owned.dtype for u in self.units.values()), None)
        self.scatter = GradScatter(
            group, self.pool, master if reduce_dtype is None else reduce_dtype, before_reduce,
            [] if frozen else [u for u in self.units.values() if set(u.names) <= set(tied)],
            tied_group)
        self.gathers = Gathers(
            self.units, order, group, self.pool, self.compute_dtype, self.params,
            prefetch=prefetch,
            kept=kept_after_forward([[u for u, _ in units] for units in chunks], prefetch)
        ) if self.gather else None
        if not self.gather:          # ZeRO-2, or node shared: the whole parameters stay bound
            for u in self.units.values():
                bind(self.params, u, u.full)
        if self.node is not None:
            self.node.publish(self.units.values())

    def _make_unit(self, unit: str, names: list[str], initial: Callable[[str], Any]) -> Unit:
        """The unit of parameters ``names`` (:func:`~mpipar.parallel.fsdp.units.make_unit`);
        the compute dtype defaults to the masters'."""
        values = {n: initial(n) for n in names}
        dtype = values[names[0]].dtype
        self.compute_dtype = dtype if self.compute_dtype is None else self.compute_dtype
        self.mixed = self.compute_dtype != dtype
        return make_unit(unit, names, values, self.group, self.xp, node=self.node,
                         compute_dtype=self.compute_dtype, gather=self.gather, frozen=self.frozen)

    @property
    def shared(self) -> bool:
        """ZeRO-3 in node shared memory."""
        return self.node is not None

    @property
    def grads(self) -> dict[str, Any]:
        """name -> the gradient the model writes, while its unit's backward runs."""
        return self.scatter.grads

    # ------------------------------------------------------------ the model's scope
    @contextmanager
    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> Iterator[None]:
        """The model runs ``units`` (forward, or ``backward``) inside this context
        (:class:`mpipar.model.llama.ParamScope`): entering one gathers it (ZeRO-3:
        :class:`~mpipar.parallel.fsdp.gather.Gathers`) and binds its gradients (backward);
        leaving it after backward with ``grads_final`` reduce-scatters them (else at
        :meth:`weights_done`). An exception inside leaves them as they are; a unit with
        nothing trained (LoRA's frozen embedding and head) is not here."""
        units = [u for u in units if u in self.units]
        for unit in units:
            if self.node is not None and self.node.stale:
                self.node.publish(self.units.values())
            if self.gathers is not None:
                self.gathers.enter(unit, backward)
            if backward and not self.frozen:
                self.scatter.bind(self.units[unit])
        yield
        for unit in units:
            if self.gathers is not None:
                self.gathers.leave(unit, backward)
            if backward and grads_final and not self.frozen:
                self.scatter.done(self.units[unit])

    def weights_done(self, units: list[str]) -> None:
        """The deferred weight gradients of ``units`` (one backward pass each) are in."""
        for unit in [u for u in units if u in self.units and not self.frozen]:
            self.scatter.done(self.units[unit])

    def progress(self) -> None:
        """Advance the all-gathers and reduce-scatters in flight (``test`` runs MPI's progress
        engine): on an MPI without a progress thread they move only while some call is in MPI."""
        if self.gathers is not None:
            self.gathers.progress()
        self.scatter.progress()

    # ------------------------------------------------------------ per step
    def start_step(self, step: int = 0) -> None:
        """Before optimizer step ``step``: the owned gradients start from zero."""
        for u in self.units.values() if not self.frozen else ():
            u.owned_grad.fill(0)

    def finish(self) -> None:
        """Complete every outstanding reduce-scatter: the owned gradients are the step's sums
        (the tied ones summed over the pipeline's ends too). A gather prefetched but not
        entered, or kept from the forward, is completed and dropped: the update is about to
        change the shards."""
        self.release()
        self.scatter.finish()

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        """Passes with no backward (evaluation): every unit goes back to the pool as it is left,
        and the units kept before are released first."""
        self.release()
        with self.gathers.forward_only() if self.gathers is not None else nullcontext():
            yield

    def release(self) -> None:
        """Give back every gathered buffer no scope is reading (prefetched, or kept from the
        forward), its gather completed first (after an evaluation, before an update)."""
        if self.gathers is not None:
            self.gathers.release()

    def gather_params(self) -> None:
        """After the update: the compute copies of the owned slices refreshed from the masters
        (mixed precision); ZeRO-2 all-gathers them back into the whole parameters; ZeRO-3
        keeps only its slices (in node shared memory: publishes them, the one barrier of its
        step; no rank reads a slice while its owner updates it, as the update waits for every
        reduce-scatter, which each rank posts after its last read)."""
        for u in self.units.values() if self.mixed else ():
            u.refresh(self.gather)
        if self.node is not None:
            self.node.publish(self.units.values())
        elif not self.gather:
            for u in self.units.values():
                lo, hi = self.owned_range(u)
                self.group.allgather(u.full[lo:hi].copy(), u.full)

    def describe(self) -> str:
        """The sharding in words, for the startup line."""
        stage = (f"ZeRO-3 (parameters gathered per unit, {self.gathers.prefetch} prefetched)"
                 if self.gathers is not None else
                 self.node.describe() if self.node is not None else "ZeRO-2")
        return (f"dp x sp {stage}: {len(self.units)} units sharded over {self.group.size} ranks, "
                f"reduce-scattered per unit")

    @property
    def shared_bytes(self) -> int:
        """Bytes of node shared memory this rank allocated (its part of the node's copy; not
        NumPy's, so tracemalloc does not see them)."""
        return self.node.shared_bytes if self.node is not None else 0

    def close(self) -> None:
        """Free the node shared memory (a collective; no parameter view may be used after);
        the units use the dp x sp group itself (the engine frees it)."""
        if self.node is not None and self.node.windows:
            self.params.clear()
            for u in self.units.values():
                u.full = u.owned = None
            self.node.free()

    # ------------------------------------------------------------ the optimizer's view
    @staticmethod
    def owned_range(u: Unit) -> tuple[int, int]:
        return u.lo, u.hi

    def owned_pieces(self) -> Iterator[tuple[Unit, str, int, int]]:
        """(unit, name, lo, hi) of every parameter range inside this rank's owned slices, with
        ``lo, hi`` relative to the owned slice."""
        for u in self.units.values():
            for name, lo, hi in u.owned_names():
                yield u, name, lo, hi

    @property
    def buckets(self) -> list[Unit]:
        """The units, under the name the sharded optimizer iterates (a unit is its bucket)."""
        return list(self.units.values())

    # ------------------------------------------------------------ whole local tensors
    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.shapes

    def master_tensors(self) -> dict[str, Any]:
        """Every tp-local master tensor of this rank, whole (collective over the group where
        the masters are sharded: ZeRO-3, and every stage under mixed precision)."""
        if self.node is not None and self.node.stale:
            self.node.publish(self.units.values())
        out: dict[str, Any] = {}
        for u in self.units.values():
            full = u.full
            if self.gather or self.mixed:
                full = self.xp.empty(u.size, u.owned.dtype)
                self.group.allgather(u.owned, full)
            bind(out, u, full)
        return out

    def param_pieces(self) -> Iterator[tuple[str, int, int, Any]]:
        """``(name, lo, hi, values)``: ranges of the flattened tp-local tensors that this rank
        reports as parameters (its owned slices: each element once over the group)."""
        for u, name, lo, hi in self.owned_pieces():
            a0, _ = self.owned_range(u)
            start = a0 + lo - u.offsets[name][0]
            yield name, start, start + hi - lo, u.owned[lo:hi]

    def load_local(self, name: str, value: Any) -> None:
        """Set parameter ``name`` from its whole tp-local tensor ``value`` (master dtype): its
        master slice and compute copies (collective-free; a gathered copy no scope is reading
        is dropped, as it would be stale)."""
        self.release()
        flat = self.xp.asarray(value).reshape(-1)
        for u in self.units.values():
            if name not in u.offsets:
                continue
            u.load(name, flat, self.mixed, self.gather)
            if self.node is not None:      # the other slices are their owners' to write
                self.node.stale = True
            elif not self.gather:
                s, e = u.offsets[name]
                u.full[s:e] = flat


class FrozenBaseScope:
    """ZeRO-3 under LoRA: the model's scope over the frozen base's units (``frozen``, a
    :class:`ShardedParams` of ``frozen=True``: gathered around each unit, never reduced) and the
    adapters' (``trained``): entering a unit enters the base's, then the adapters'; leaving
    leaves both in that order, so every rank of dp x sp posts the collectives in one order.
    The update and the checkpoints see ``trained`` alone."""

    def __init__(self, trained: ShardedParams, frozen: ShardedParams) -> None:
        self.trained, self.frozen = trained, frozen

    @contextmanager
    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> Iterator[None]:
        with self.frozen.using(units, backward, grads_final), \
                self.trained.using(units, backward, grads_final):
            yield

    def weights_done(self, units: list[str]) -> None:
        self.trained.weights_done(units)

    def progress(self) -> None:
        self.frozen.progress()
        self.trained.progress()

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        with self.frozen.forward_only(), self.trained.forward_only():
            yield

    def release(self) -> None:
        self.frozen.release()
        self.trained.release()
