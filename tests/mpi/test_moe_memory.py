"""The planner's activation memory of sparse blocks under ``mpirun -n 8``: with the router
forced uniform (each rank's experts receive exactly the dropless ``A = n K`` rows, the planner's
count), the record each sparse block of every rank keeps for backward (the routed experts'
rows received over ep, their g, u, m, the permutation and the ep regrouping, the router's
records, the shared expert split by tp and its gate) equals ``plan.memory._sparse_ffn_bytes``
plus the router's input ``h2`` it holds, to the byte, in ``none`` and ``selective``."""
from __future__ import annotations

import pytest

from conftest import rank_failures
from layouts import layout_name, small_config, token_source
from mpipar.rules import validate
from tests.mpi.test_moe import uniform_route

CASES = [dict(dp=2, sp=2, pp=2, ep=4, model="moe_qwen"),          # unnormalised, ep over sp
         dict(dp=2, tp=2, pp=2, ep=2, model="moe_gated", recompute="selective")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", CASES, ids=[layout_name(v) for v in CASES])
def test_sparse_records_equal_the_planner(world, case, monkeypatch):
    from mpipar.kernels import expert_routing
    from mpipar.model.llama import DecoderBlock
    from mpipar.plan.memory import _sparse_ffn_bytes
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from tests.unit.test_recompute import _kept_bytes
    monkeypatch.setattr(expert_routing, "route_topk", uniform_route)
    seen: list[int] = []
    keep = DecoderBlock.keep

    def recording(self, c):
        kept = keep(self, c)                     # what the recompute mode keeps of the record
        if c.moe is not None:
            seen.append(_kept_bytes([kept.moe, kept.g, kept.u, kept.m, kept.shared_gate]))
        return kept

    monkeypatch.setattr(DecoderBlock, "keep", recording)
    case = dict(case)
    recompute, model = case.pop("recompute", "none"), case.pop("model")
    cfg = small_config("float64", model, **case)
    cfg.train.recompute = recompute
    with rank_failures(world) as fails:
        layout = validate(cfg, 8)
        rank = build_rank(layout, world, source=token_source())
        trainer.train_step(rank, 0)
        trainer.close(rank)
        n = cfg.train.micro_batch_size * cfg.train.seq_len // layout.parallel.sp
        want = _sparse_ffn_bytes(layout, layout.train.recompute_mode) + n * cfg.model.hidden * 8
        if not seen or set(seen) != {want}:
            fails.append(f"sparse records {sorted(set(seen))} ({len(seen)}) vs {want}")
