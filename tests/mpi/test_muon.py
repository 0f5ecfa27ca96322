"""Muon (``--optimizer muon``) on every layout equals the one-process run in float64 (<= 1e-10:
losses, gradient norms and parameters after two steps), and each matrix is orthogonalised once
per step: by one rank of the ranks that hold pieces of it (tp shards, ZeRO-owned slices), by
every data-parallel replica at ZeRO-0 (each updates its own copy, as AdamW does). The
one-process run itself equals torch.optim.Muon + AdamW (unit/test_muon.py). A checkpoint
saved under one layout resumes under another equal to the uninterrupted run."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import check_in_groups
from layouts import (compare, global_state, layout_name, layout_size, run, small_config,
                     token_source)
from mpipar.rules import validate
from mpipar.training import muon
from mpipar.training import step as trainer
from mpipar.training.rank import build_rank

LAYOUTS = [
    dict(tp=2, pp=2),
    dict(dp=2, tp=2, zero=3),
    dict(sp=2, dp=2, zero=1),
    dict(sp=2, tp=2, zero=1),
    dict(dp=2, tp=2, zero=2),
    dict(dp=2, ep=2, zero=1, model="moe"),
    dict(dp=2, tp=2, ep=2, zero=3, model="moe_shared"),
    dict(dp=2, sp=2, zero=3, zero_shared="node"),
    dict(dp=4, zero=1, dp_reduce="hierarchical", ranks_per_node=2),
    dict(dp=2, tp=2, pp=2),
]
MATRICES = {"llama": (4 * 7, 0), "moe": (7 + 3 * 4, 3 * 4 * 3),
            "moe_shared": (7 + 3 * (4 + 3), 3 * 4 * 3)}
"""Muon's matrices of the test models, (those tp splits, those every tp rank holds whole): q,
k, v, o, gate, up, down per dense block; q, k, v, o, the shared expert's three (split) and each
of 4 experts' three (whole) per sparse block. A matrix held whole by every tp rank is
orthogonalised by each (as each applies AdamW to its own copy of a replicated weight)."""


def muon_config(model: str = "llama", **parallel):
    cfg = small_config("float64", model, **parallel)
    cfg.train.optimizer = "muon"
    return cfg


@functools.lru_cache(maxsize=None)
def muon_reference(model: str = "llama", steps: int = 2):
    from mpi4py import MPI
    losses, norms, params, rank = run(muon_config(model), MPI.COMM_SELF, steps)
    trainer.close(rank)
    return losses, norms, params


def _orthogonalisations(monkeypatch) -> list[int]:
    """Counts this rank's Newton-Schulz calls into the returned list's one element."""
    count = [0]
    real = muon.newton_schulz

    def counted(u, steps, *args):
        count[0] += 1
        return real(u, steps, *args)

    monkeypatch.setattr(muon, "newton_schulz", counted)
    return count


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_muon_layout_equals_single_process_float64(world, layout, monkeypatch):
    size = layout_size(layout)
    if world.size < size:
        pytest.skip(f"needs {size} ranks")
    layout = dict(layout)
    model = layout.pop("model", "llama")
    ref = muon_reference(model)
    count = _orthogonalisations(monkeypatch)

    def check(comm) -> list[str]:
        got = run(muon_config(model, **layout), comm)
        fails = compare(got[:3], ref, 1e-10)
        replicas = 1 if layout.get("zero") else layout.get("dp", 1) * layout.get("sp", 1)
        split, whole = MATRICES[model]
        tp = layout.get("tp", 1)
        per_step = (split + whole * tp if tp > 1 else split + whole) * replicas
        total = comm.allreduce(count[0])
        if total != 2 * per_step:
            fails.append(f"{total} orthogonalisations in 2 steps, not 2 x {per_step}")
        trainer.close(got[3])
        return fails

    check_in_groups(world, size, check)


RESUMES = [(dict(dp=2, tp=2, zero=3), dict(sp=2, tp=2, zero=1)),
           (dict(tp=2, pp=2), dict(dp=4, zero=2))]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("saved, resumed", RESUMES,
                         ids=[f"{layout_name(a)}-to-{layout_name(b)}" for a, b in RESUMES])
def test_muon_state_moves_between_layouts(world, saved, resumed):
    """Two steps under ``saved``; its state (parameters, momentum buffers, AdamW's moments) as
    global tensors, as checkpoints hold them, loaded under ``resumed``; two more steps: the
    losses and parameters of the uninterrupted four-step run."""
    ref = muon_reference(steps=4)

    def check(comm) -> list[str]:
        a = build_rank(validate(muon_config(**saved), 4), comm, source=token_source())
        losses = [trainer.train_step(a, k).loss for k in range(2)]
        state = global_state(a, comm)
        fails = [f"{key} not held by any rank" for key, v in state.items() if np.isnan(v).any()]
        b = build_rank(validate(muon_config(**resumed), 4), comm, source=token_source())
        b.state.load(lambda kind, name, region: state[(kind, name)][region], a.state.step)
        losses += [trainer.train_step(b, k).loss for k in range(2, 4)]
        q = "layers.1.self_attn.q_proj.weight"
        if not np.abs(state[("exp_avg", q)]).max() > 0:
            fails.append("the momentum buffer was not saved")
        fails += compare((losses, ref[1], trainer.gather_params(b)), ref, 1e-10)
        trainer.close(a)
        trainer.close(b)
        return fails

    check_in_groups(world, 4, check)
