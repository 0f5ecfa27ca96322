"""The experts sharded over ep: which ep positions hold them (:func:`expert_shards`), their units
(:func:`expert_units`), and the store that keeps them beside the dense one
(:class:`ExpertSplitReducer`; ZeRO-2/3: :class:`ExpertSplitUnits`)."""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from mpipar.layout import Layout
from mpipar.parallel.fsdp.sharded import Units
from mpipar.parallel.placement import PlacementTable, expert_of
from mpipar.runtime.comm import Group


def expert_shards(layout: Layout) -> int:
    """The ep positions the experts' weights, gradients and moments are sharded over: ``ep``,
    at every ZeRO stage and under gradient compression (the dense gradients compressed over
    dp x sp, the experts' reduced exactly over ``ep_dp``). The one home of this rule."""
    return layout.config.parallel.ep


def expert_units(chunks: Units, table: PlacementTable, ep_rank: int) -> tuple[Units, Units]:
    """ZeRO-2/3 with the experts sharded over ep (``table.ep`` > 1): ``chunks`` (a rank's
    units, :meth:`~mpipar.parallel.placement.PlacementTable.units`) split into the dense units
    (every unit without its experts: sharded over dp x sp) and the experts' units (of each
    sparse block, the experts of ep position ``ep_rank``, under the block's unit name: sharded
    over ``ep_dp``). Unsharded experts: (``chunks``, no expert units)."""
    if table.ep == 1:
        return chunks, [[] for _ in chunks]
    dense = [[(u, [n for n in names if expert_of(n) is None]) for u, names in units]
             for units in chunks]
    experts = [[(u, mine) for u, names in units
                if (mine := [n for n in names if expert_of(n) is not None
                             and table.holds(n, ep_rank)])]
               for units in chunks]
    return dense, experts


class ExpertSplitReducer:
    """The experts sharded over ep: the ``dense`` store over dp x sp (every dense weight, as
    without ep) beside the ``experts`` store over ``ep_dp`` (this rank's experts; ``ep``: the
    group the experts are split over), seen as one store (what the engine, the optimizer's
    publish and :class:`mpipar.training.state.TrainState` ask of a :class:`GradReducer`).
    ZeRO-0/1: two :class:`GradReducer` (under ``--grad-compression`` the dense one compresses,
    the experts' is exact); ZeRO-2/3: :class:`ExpertSplitUnits`. ``params`` and ``grads`` are
    live views of both (ZeRO-3 binds a unit's while it is entered). Residuals (compression)
    are the dense reducer's only."""

    def __init__(self, *, dense: Any, experts: Any, ep: Group) -> None:
        self.dense, self.experts, self.ep = dense, experts, ep
        self.xp, self.group = dense.xp, dense.group
        self.params = ChainMap(dense.params, experts.params)
        self.grads = ChainMap(dense.grads, experts.grads)
        self._of = {n: experts for n in experts.local_shapes()}

    @property
    def sends_sparse(self) -> bool:
        return self.dense.sends_sparse

    @property
    def sparse_sums(self) -> bool:
        return self.dense.sparse_sums

    def start_step(self, step: int = 0) -> None:
        self.dense.start_step(step)
        self.experts.start_step(step)

    def ready(self, names: list[str]) -> None:
        self.dense.ready([n for n in names if n not in self._of])
        self.experts.ready([n for n in names if n in self._of])

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def gather_params(self) -> None:
        self.dense.gather_params()
        self.experts.gather_params()

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.dense.local_shapes(), **self.experts.local_shapes()}

    def master_tensors(self) -> dict[str, Any]:
        return {**self.dense.master_tensors(), **self.experts.master_tensors()}

    def param_pieces(self):
        yield from self.dense.param_pieces()
        yield from self.experts.param_pieces()

    def load_local(self, name: str, value: Any) -> None:
        self._of.get(name, self.dense).load_local(name, value)

    def residual_pieces(self):
        """The dense reducer's residuals, and zeros for the experts (reduced exactly: nothing
        owed) in every residual kind, where the experts' parameters are reported, so that each
        kind tiles every parameter in a checkpoint."""
        yield from self.dense.residual_pieces()
        kinds = self.dense.residual_kinds()
        for name, lo, hi, values in (self.experts.param_pieces() if kinds else ()):
            zeros = self.xp.zeros(hi - lo, values.dtype)
            for kind in kinds:
                yield kind, name, lo, hi, zeros

    def load_residuals(self, local, kinds: set[str]) -> None:
        """The dense reducer's (a checkpoint's residuals of the experts, written by a run that
        compressed them, are not carried: these experts are reduced exactly)."""
        self.dense.load_residuals(local, kinds)

    def close(self) -> None:
        self.dense.close()
        self.experts.close()

    def describe(self) -> str:
        return (f"{self.dense.describe()}; experts sharded over ep, reduced over ep_dp "
                f"({self.experts.group.size} ranks)")


class ExpertSplitUnits(ExpertSplitReducer):
    """ZeRO-2/3 with the experts sharded over ep: the dense units over dp x sp and the
    experts' units over ``ep_dp`` (two :class:`mpipar.parallel.fsdp.sharded.ShardedParams` sharing one
    buffer pool), and the model's scope over both: entering a block's unit enters its dense
    unit, then its experts' (each store gathers and prefetches along its own units); leaving
    it leaves both in that order, so every rank of dp x sp posts the dense collectives, and
    every rank of ``ep_dp`` the experts', in one order. No residuals (no compression)."""

    @property
    def pool(self):
        return self.dense.pool

    @property
    def shared_bytes(self) -> int:
        return self.dense.shared_bytes

    def _experts_of(self, units: Sequence[str]) -> list[str]:
        return [u for u in units if u in self.experts.units]

    @contextmanager
    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> Iterator[None]:
        with self.dense.using(units, backward, grads_final), \
                self.experts.using(self._experts_of(units), backward, grads_final):
            yield

    def weights_done(self, units: list[str]) -> None:
        self.dense.weights_done(units)
        self.experts.weights_done(self._experts_of(units))

    def progress(self) -> None:
        self.dense.progress()
        self.experts.progress()

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self.dense.forward_only())
            stack.enter_context(self.experts.forward_only())
            yield

    def release(self) -> None:
        self.dense.release()
        self.experts.release()

    def residual_pieces(self):
        return ()

    def load_residuals(self, local, kinds: set[str]) -> None:
        return None

    def describe(self) -> str:
        return (f"{self.dense.describe()}; experts sharded over ep, {len(self.experts.units)} "
                f"units of them sharded over ep_dp ({self.experts.group.size} ranks)")
