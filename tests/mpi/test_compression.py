"""Gradient compression on 8 ranks: the compressed reductions of GradReducer against the same math
done on one rank from every rank's gradient, identical on every rank, and unbiased over steps
only with error feedback; the residuals in checkpoints, loaded slot by slot or summed."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_all_ranks, rank_failures, shared_tmpdir
from mpipar.parallel.compression import BLOCK, Int8Codec, TopKCodec
from mpipar.rules import validate


# -------------------------------------------------------------------------- 8 ranks, MPI
def _reducer(comm, codec: str, hierarchical: bool, sharded: bool, feedback: bool, n: int,
             ratio: float = 0.01):
    """A GradReducer of one bucket of ``n`` float64 elements over dp = 8 on nodes of 4."""
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.parallel.data_parallel.modes import COMPRESSIONS
    from mpipar.parallel.data_parallel.buckets import ReduceGroups
    from mpipar.parallel.data_parallel.reducer import GradReducer
    from mpipar.runtime.topology import ProcessGrid

    grid = ProcessGrid(comm, 8, 1, 1, 1, ranks_per_node=4)
    if hierarchical:
        grid.split_dp_sp_by_node()
    ledger = Ledger()
    g = {name: Group(c, name, ledger, grid.group_nodes(name)) for name, c in grid.comms.items()}
    groups = (ReduceGroups(g["dp_sp"], g["dp_sp_inter"], g["dp_sp_intra"]) if hierarchical
              else ReduceGroups(g["dp_sp"], g["dp_sp"]))
    return GradReducer({"w": np.zeros(n)}, ["w"], groups, bucket_mb=1e3, sharded=sharded, xp=np,
                       codec=COMPRESSIONS[codec].codec(ratio, np), feedback=feedback)


def _reduce(red, grad: np.ndarray) -> np.ndarray:
    red.start_step()
    red.grads["w"][...] = grad
    red.ready(["w"])
    red.finish()
    b = red.buckets[0]
    return (b.owned_grad if red.sharded else red.grads["w"]).copy()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec,sharded", [("int8", False), ("int8", True), ("topk", False),
                                           ("topk", True)])
def test_flat_compressed_reduction_is_the_codecs_math(world, codec, sharded):
    """Flat over dp = 8: every rank ends with the same sum (ZeRO-1: its owned slice of it), equal
    bit for bit to the codec's math applied on one rank to every rank's gradient: int8 encodes
    each rank's pieces, each owner sums its decoded pieces in rank order, re-encodes and every
    rank decodes; top-k adds every rank's k largest. Two steps, so the residuals take part."""
    n = 8 * 4 * BLOCK
    fails = []
    red = _reducer(world, codec, False, sharded, True, n)
    rng = np.random.default_rng(10 + world.rank)
    ref = Int8Codec(np) if codec == "int8" else TopKCodec(np, 0.01)
    residual = np.zeros(n)
    gathered_residual = np.zeros(n)          # the owners' second residuals, whole
    for _ in range(2):
        grad = rng.normal(size=n)
        got = _reduce(red, grad)
        grads = np.array(world.allgather(grad))
        residuals = np.array(world.allgather(residual))
        if codec == "int8":
            per = [np.empty((8, ref.packed_bytes(n // 8)), np.uint8) for _ in range(8)]
            new_res = []
            for r in range(8):
                x, e = grads[r].reshape(8, -1).copy(), residuals[r].copy()
                ref.encode_feedback(x, e, per[r])
                new_res.append(e)
            total = np.empty(n)
            for owner in range(8):
                pieces = np.stack([per[r][owner] for r in range(8)])
                s = ref.decode_sum(pieces, np.empty(n // 8))
                if sharded:
                    total[owner * n // 8:(owner + 1) * n // 8] = s
                    continue
                packed = np.empty((1, ref.packed_bytes(n // 8)), np.uint8)
                ref.encode_feedback(s.reshape(1, -1),
                                    gathered_residual[owner * n // 8:(owner + 1) * n // 8], packed)
                total[owner * n // 8:(owner + 1) * n // 8] = ref.decode(packed,
                                                                        np.empty((1, n // 8)))
        else:
            packed = np.empty((8, ref.packed_bytes(n, 8)), np.uint8)
            new_res = []
            for r in range(8):
                e = residuals[r].copy()
                ref.encode_feedback(grads[r].reshape(1, -1).copy(), e, packed[r:r + 1])
                new_res.append(e)
            total = ref.decode_sum(packed, np.empty(n))
        residual = new_res[world.rank]
        want = total[world.rank * n // 8:(world.rank + 1) * n // 8] if sharded else total
        if not np.array_equal(got, want):
            fails.append(f"differs from the codec's math by {np.abs(got - want).max():.3g}")
        if not sharded and not all(np.array_equal(got, x) for x in world.allgather(got)):
            fails.append("ranks hold different sums")
    assert_all_ranks(world, fails)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec,hierarchical", [("int8", True), ("topk", True),
                                                ("topk", False)])
def test_error_feedback_makes_the_compressed_sum_unbiased(world, codec, hierarchical):
    """The same gradients every step: with error feedback the mean of T = 40 compressed sums
    approaches the exact sum (what is not sent now is sent later); without it the error stays.
    Every rank holds the same sum (hierarchical: on 2 nodes of 4)."""
    n, steps = 8 * 2 * BLOCK, 40
    rng = np.random.default_rng(20 + world.rank)
    grad = rng.normal(size=n) * np.repeat(10.0 ** rng.uniform(-2, 0, n // BLOCK), BLOCK)
    exact = np.sum(world.allgather(grad), axis=0)
    errors, fails = {}, []
    for feedback in (True, False):
        red = _reducer(world, codec, hierarchical, False, feedback, n, ratio=0.1)
        mean = np.zeros(n)
        for _ in range(steps):
            got = _reduce(red, grad)
            mean += got / steps
        if not all(np.array_equal(got, x) for x in world.allgather(got)):
            fails.append(f"feedback={feedback}: ranks hold different sums")
        errors[feedback] = np.abs(mean - exact).max() / np.abs(exact).max()
    if not errors[True] < 0.2 * errors[False]:
        fails.append(f"error with feedback {errors[True]:.3g}, without {errors[False]:.3g}")
    assert_all_ranks(world, fails)


# ---------------------------------------------------------------------- residuals in checkpoints
@pytest.mark.mpi(min_size=8)
def test_residuals_load_slot_by_slot_or_summed(world):
    """One int8 step at dp=8 (8 slots, each rank's residual, plus the owners' second ones) is
    saved; loaded into the same layout the residuals are bit-identical; into dp=4 tp=2
    hierarchical on nodes of 4 (2 slots) their sum, the gradient still owed, lands whole in
    slot 0, per element."""
    from layouts import global_state, small_config, token_source
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-ef-") as root:
        a = build_rank(validate(small_config(dp=8, grad_compression="int8"), 8), world,
                   source=token_source())
        trainer.train_step(a, 0)
        path = writer.save(a.state, trainer.run_position(a, 1), root, Group(world, "world", Ledger()))
        saved = global_state(a, world)
        kinds = sorted({k for k, _ in saved if k.startswith("residual")})
        if set(kinds) != {f"residual_send.{s}" for s in range(8)} | {"residual_gather"}:
            fails.append(f"residual kinds {kinds}")
        same = build_rank(validate(small_config(dp=8, grad_compression="int8"), 8), world,
                      source=token_source())
        reader.load(same.state, path)
        again = global_state(same, world)
        fails += [f"{key} differs" for key in saved if not np.array_equal(saved[key], again[key])]
        other = build_rank(validate(small_config(dp=4, tp=2, ranks_per_node=4, dp_reduce="hierarchical",
                                    grad_compression="int8"), 8), world,
                       source=token_source())
        reader.load(other.state, path)
        moved = global_state(other, world)
        for name in a.state.shapes:
            owed = sum(saved[(k, name)] for k in kinds)
            if not np.allclose(moved[("residual_send.0", name)], owed, rtol=0, atol=1e-12):
                fails.append(f"{name}: slot 0 does not hold the sum")
            if np.any(moved[("residual_send.1", name)]):
                fails.append(f"{name}: slot 1 is not zero")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec,hierarchical", [("int8", False), ("int8", True),
                                                ("topk", False), ("topk", True)])
def test_error_feedback_owes_exactly_the_residuals(world, codec, hierarchical):
    """New gradients every step: after T = 6 steps the compressed sums add up to the exact sums
    less what the residuals still hold (every rank's sending residual at its node shard, the
    owners' second ones at their slices), to float64 rounding, on every rank — nothing is sent
    twice, scaled or lost, flat as hierarchical (2 nodes of 4)."""
    from mpipar.parallel.data_parallel.residuals import RESIDUAL_GATHER, RESIDUAL_SEND

    n, steps = 8 * 2 * BLOCK, 6
    rng = np.random.default_rng(30 + world.rank)
    red = _reducer(world, codec, hierarchical, False, True, n, ratio=0.05)
    b = red.buckets[0]
    sent, exact = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        grad = rng.normal(size=n) * np.repeat(10.0 ** rng.uniform(-2, 0, n // BLOCK), BLOCK)
        exact += np.sum(world.allgather(grad), axis=0)
        sent += _reduce(red, grad)
    owed = np.zeros(n)
    lo, hi = red.flat.node_range(b)
    owed[lo:hi] += b.residual[RESIDUAL_SEND]
    if RESIDUAL_GATHER in b.residual:
        lo, hi = red.owned_range(b)
        owed[lo:hi] += b.residual[RESIDUAL_GATHER]
    owed = np.sum(world.allgather(owed), axis=0)
    err = np.abs(sent + owed - exact).max() / np.abs(exact).max()
    assert_all_ranks(world, [] if err < 1e-12 else [f"sent + owed - exact: {err:.3g}"])
