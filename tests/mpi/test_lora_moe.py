"""LoRA on a mixture of experts' routed experts (:mod:`tests.lora_moe_reference`) on layouts of 4
ranks with ep (each ep rank holding its experts' adapters, reduced over its ep_dp group), tp (the
experts' adapters whole on every tp rank, as the experts) and pp under ZeRO-3 (the frozen base
and the adapters sharded) equals PyTorch + PEFT in float64: losses, gradient norms and the
trained adapters over two AdamW steps to 1e-10 relative, the frozen base unchanged."""
from __future__ import annotations

import pytest

from tests.lora_moe_reference import STEPS, float64_qwen3_moe, make_dirs, moe_rank, peft_training
from tests.lora_reference import differences_from_peft

from conftest import check_in_groups
from layouts import layout_name, layout_size
from mpipar.training import step as trainer

MOE_LAYOUTS = [dict(tp=2, dp=2, ep=2, zero=1),
               dict(pp=2, dp=2, ep=2, zero=3)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("lora-moe"))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=[layout_name(v) for v in MOE_LAYOUTS])
def test_expert_adapters_on_layouts_train_like_peft(world, dirs, layout, monkeypatch):
    float64_qwen3_moe(monkeypatch)
    base, adapter, rows = dirs

    def check(comm) -> list[str]:
        rank, params, _ = moe_rank(base, adapter, rows, comm, **layout)
        held = [n for n in rank.weights.reducer.master_tensors() if ".experts." in n]
        results = [trainer.train_step(rank, k) for k in range(STEPS)]
        trained = trainer.gather_params(rank)
        trainer.close(rank)
        losses, norms, want = peft_training(base, adapter, rows)
        problems = differences_from_peft(results, losses, norms, trained, want, params, trained)
        mine = {n.split(".")[4] for n in held}
        if layout.get("zero", 0) < 3 and len(mine) != 2:   # ep2: two of the four experts
            problems.append(f"expert adapters of experts {sorted(mine)} held")
        return problems

    check_in_groups(world, layout_size(layout), check)


@pytest.mark.mpi(min_size=4)
def test_expert_adapters_resume_on_another_layout(world, dirs, monkeypatch):
    """A checkpoint of step 1 on pp2 x dp2 x ep2 ZeRO-3 (the adapters and their moments, no
    frozen base) resumed on tp2 x dp2 x ep2 ZeRO-1 trains step 2 as PyTorch + PEFT does."""
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from conftest import shared_tmpdir
    float64_qwen3_moe(monkeypatch)
    base, adapter, rows = dirs

    def check(comm) -> list[str]:
        with shared_tmpdir(comm, "mpipar-lora-moe-") as root:
            first, params, _ = moe_rank(base, adapter, rows, comm, **MOE_LAYOUTS[1])
            trainer.train_step(first, 0)
            path = writer.save(first.state, trainer.run_position(first, 1), root,
                               Group(comm, "world", Ledger()))
            trainer.close(first)
            rank, _, _ = moe_rank(base, adapter, rows, comm, **MOE_LAYOUTS[0])
            step = reader.load(rank.state, path)
            result = trainer.train_step(rank, 1)
            trained = trainer.gather_params(rank)
            trainer.close(rank)
        losses, norms, want = peft_training(base, adapter, rows)
        problems = differences_from_peft([result], losses[1:], norms[1:], trained, want, params,
                                         trained)
        return problems + ([f"resumed at step {step}"] if step != 1 else [])

    check_in_groups(world, 4, check)


@pytest.mark.mpi(min_size=8)
def test_planner_counts_expert_adapters_as_the_engine_holds_them(world, monkeypatch):
    """The planner's state memory, messages and bytes of a LoRA run with the experts targeted
    equal the engine's: each ep rank's experts' adapters in buckets of their own reduced over
    ep_dp, whole on every tp rank with their gradients not summed over tp (routing forced
    uniform, the planner's count; the engine's two stores, dense and experts', read as one)."""
    from mpipar.kernels import expert_routing
    from mpipar.parallel.experts.split import ExpertSplitReducer
    from tests.mpi import test_planner
    from tests.mpi.test_moe import uniform_route
    monkeypatch.setattr(expert_routing, "route_topk", uniform_route)
    monkeypatch.setattr(ExpertSplitReducer, "buckets", property(
        lambda store: store.dense.buckets + store.experts.buckets), raising=False)
    moments = test_planner._moments
    monkeypatch.setattr(test_planner, "_moments", lambda opt, zero: (
        moments(opt.dense, zero) + moments(opt.experts, zero)))
    test_planner.test_state_memory_and_messages_equal_the_engine(world, dict(
        model="moe8", dp=4, tp=2, ep=2, zero=1, bucket_mb=0.003, train=dict(
            lora_rank=2, lora_alpha=4.0,
            lora_targets="q_proj,o_proj,experts.gate_up_proj,experts.down_proj")))
