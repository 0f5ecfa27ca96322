"""DPO on dp x tp x pp layouts of 8 ranks (one with ZeRO-3, one with zigzag sp: a row's
log-probability summed over its sp ranks) equals transformers +
torch.optim.AdamW in float64 with DPO's loss written out (:mod:`dpo_reference`), and with LoRA
PyTorch + PEFT: losses, rewards, accuracy, gradient norms and trained weights (adapters) over
two steps to 1e-10 relative. Packed pairs (``--pack-pairs``) on dp x tp and on dp x sp x pp
equal the unpacked run on one process."""
from __future__ import annotations

import pytest

# First: importing dpo_reference skips this module where torch or transformers is missing.
from dpo_reference import (SHORT, dpo_differences, dpo_rank, packed_differences, torch_dpo,
                           write_pairs)
from transformers_reference import TOL, float64_transformers, make_checkpoint  # noqa: F401

from conftest import check_in_groups
from layouts import layout_name, layout_size
from mpipar.training import step as trainer

LAYOUTS = [dict(dp=2, tp=2, pp=2), dict(dp=2, pp=2, tp=2, zero=3),
           dict(sp=2, tp=2, pp=2, sp_split="zigzag")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return make_checkpoint("llama", root), write_pairs(root / "pairs.h5")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_dpo_layouts_train_like_torch(world, files, layout, float64_transformers):
    """Every rank builds the same checkpoint, pairs and reference (deterministic)."""
    def check(comm) -> list[str]:
        checkpoint, pairs = files
        rank = dpo_rank(checkpoint, pairs, comm, **layout)
        results = [trainer.train_step(rank, k) for k in range(2)]
        diffs = dpo_differences(results, trainer.gather_params(rank),
                                torch_dpo(checkpoint, pairs))
        if world.rank == 0:
            print(f"\nDPO {layout_name(layout)}: {diffs}")
        return [] if max(diffs.values()) <= TOL else [f"{diffs}"]

    check_in_groups(world, layout_size(layout), check)


@pytest.mark.mpi(min_size=8)
def test_dpo_with_lora_on_a_layout_trains_like_peft(world, files, float64_transformers,
                                                     tmp_path_factory):
    """DPO of LoRA adapters on dp x tp x pp equals PyTorch + PEFT: the reference is the base
    with the initial adapter, the adapters alone train."""
    from lora_reference import make_adapter
    from mpipar.model.lora import is_adapter
    layout = LAYOUTS[0]
    checkpoint, pairs = files
    adapter = make_adapter(checkpoint, tmp_path_factory.mktemp("adapter"))

    def check(comm) -> list[str]:
        rank = dpo_rank(checkpoint, pairs, comm, adapter=adapter, **layout)
        results = [trainer.train_step(rank, k) for k in range(2)]
        trained = {n: v for n, v in trainer.gather_params(rank).items() if is_adapter(n)}
        diffs = dpo_differences(results, trained, torch_dpo(checkpoint, pairs, adapter))
        if world.rank == 0:
            print(f"\nDPO with LoRA {layout_name(layout)}: {diffs}")
        return [] if max(diffs.values()) <= TOL else [f"{diffs}"]

    check_in_groups(world, layout_size(layout), check)


PACKED = [dict(dp=2, tp=2), dict(dp=2, sp=2, pp=2, sp_split="zigzag")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", PACKED, ids=[layout_name(v) for v in PACKED])
def test_packed_pairs_on_a_layout_train_like_unpacked(world, files, layout, tmp_path_factory):
    """--pack-pairs, four pairs a step, two a microbatch (a dp rank's two pairs packed into
    two rows, sharing one where they fit; with sp a sequence's log-probability summed over the
    sp ranks its positions fall to) equals the unpacked run of the same pairs on one process
    (its first rank runs it)."""
    checkpoint, _ = files
    pairs = write_pairs(tmp_path_factory.mktemp("short") / "short.h5", SHORT)

    def check(comm) -> list[str]:
        packed = dpo_rank(checkpoint, pairs, comm, pack_pairs=True, batch=4, micro=2, **layout)
        if comm.rank:
            for k in range(2):
                trainer.train_step(packed, k)
            trainer.gather_params(packed)
            return []
        diffs = packed_differences(packed, dpo_rank(checkpoint, pairs, batch=4))
        print(f"\nDPO packed {layout_name(layout)}: {diffs}")
        return [] if max(diffs.values()) <= TOL else [f"{diffs}"]

    check_in_groups(world, layout_size(layout), check)
