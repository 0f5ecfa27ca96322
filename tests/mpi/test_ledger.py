"""The ledger counts exactly what the layer shapes say one step sends (TP, SP, PP, DP), on 8 ranks;
a mismatch names the axis whose prediction (:mod:`mpipar.parallel.calls`) disagrees."""
from __future__ import annotations

import pytest

from conftest import assert_all_ranks, rank_failures
from layouts import small_config, token_source
from mpipar.rules import validate

PREDICTED_BY = {
    "tp": "mpipar.parallel.tensor.cost.tensor_calls",
    "sp": "mpipar.parallel.sequence (the mode's calls)",
    "sp_ulysses": "mpipar.parallel.sequence (the mode's calls)",
    "sp_ring": "mpipar.parallel.sequence (the mode's calls)",
    "pp": "mpipar.parallel.pipeline.cost.pipeline_calls",
    "tp_pp": "mpipar.plan.traffic._scalar_calls (the gradient norm)",
}
"""Which axis predicts each group's calls (:func:`mpipar.plan.traffic.step_calls`); the
reduction's groups are :func:`_reduction_owner`'s."""


def _reduction_owner(zero: int) -> str:
    return ("mpipar.parallel.fsdp.cost.sharded_calls" if zero >= 2 else
            "mpipar.parallel.data_parallel.cost.reduction_calls") + " (the loss: mpipar.plan.traffic)"


def _mismatches(got: dict, want: dict, zero: int) -> str:
    """Each group whose ledger count differs from the prediction, with the function that
    predicts it: the file to look at."""
    return "; ".join(f"{g}: ledger {got.get(g)} != predicted {want.get(g)} "
                     f"[{PREDICTED_BY.get(g) or _reduction_owner(zero)}]"
                     for g in sorted(set(got) | set(want)) if got.get(g) != want.get(g))


# The plain layouts' step bytes (tp, sp and its modes, pp schedules, dp buckets, ZeRO-1, float32)
# are checked beside the state memory in test_planner.py; these add validation and a second step.
CASES = [dict(tp=2, dp=4), dict(sp=4, sp_overlap=True, tp=2),
         dict(tp=2, dp=4, tp_sequence_parallel=True),
         dict(sp=2, tp=2, pp=2, tp_sequence_parallel=True),
         dict(pp=4, tp=2, schedule="zb-h1", tp_sequence_parallel=True),
         dict(pp=2, tp=2, dp=2, zero=1, bucket_mb=0.003, tp_sequence_parallel=True,
              recompute="full"),
         dict(pp=2, tp=2, sp=2, schedule="interleaved", virtual_stages=2,
              tp_sequence_parallel=True, recompute="selective"),
         # Qwen3's q/k norms: their gradients' all-reduce over tp, with and without tp sequence
         # parallelism, per block, per chunk (zb-h1) and per unit (ZeRO-3)
         dict(model="qwen3", tp=2, dp=4), dict(model="qwen3", pp=4, tp=2, schedule="zb-h1"),
         dict(model="qwen3", sp=2, tp=2, pp=2, tp_sequence_parallel=True),
         dict(model="qwen3", dp=4, tp=2, zero=3),
         # Gemma 3's four norms per block: their partial gradients' all-reduce over tp
         dict(model="gemma3", tp=2, dp=4, tp_sequence_parallel=True),
         # tied embeddings (their gradient sum over pp_ends), q/k/v biases, llama3 RoPE
         dict(model="tied", pp=2, tp=2, dp=2),
         dict(model="tied", pp=2, dp=2, sp=2, zero=1, bucket_mb=0.003),
         dict(model="tied", pp=4, tp=2, schedule="zb-h1", tp_sequence_parallel=True),
         dict(model="tied", pp=2, dp=2, tp=2, schedule="interleaved", virtual_stages=2, zero=1),
         # ZeRO-2/3: per-unit all-gathers and reduce-scatters (zb-h1 merges deferred ones)
         dict(dp=4, sp=2, zero=3, recompute="full"),
         dict(pp=2, tp=2, dp=2, zero=3, schedule="zb-h1", tp_sequence_parallel=True),
         dict(model="tied", pp=2, dp=2, sp=2, zero=2, schedule="interleaved", virtual_stages=2),
         dict(model="tied", dp=4, tp=2, zero=3, tp_sequence_parallel=True),
         # Sliding windows: ring hops and halo rows per layer (Gemma: local and global layers).
         dict(model="window", sp=4, dp=2), dict(model="window", sp=8, sp_split="zigzag"),
         dict(model="window", sp=8, sp_mode="halo", sp_split="zigzag"),
         dict(model="window", sp=4, tp=2, sp_mode="halo", recompute="full"),
         dict(model="gemma", sp=4, pp=2, sp_overlap=True, sp_split="zigzag"),
         dict(model="gemma", sp=4, dp=2, sp_mode="halo"),
         dict(model="window", sp=8, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag",
              sp_overlap=True),
         dict(model="window", sp=4, dp=2, zero=3, sp_mode="halo")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", CASES, ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in CASES])
def test_ledger_bytes_equal_planner_prediction(world, case):
    """A validation pass after each step books its own traffic in the engine's eval ledger, as
    predicted for it (forward only), and leaves the step's ledger as predicted for a step."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from mpipar.plan.traffic import predict_eval_bytes, predict_step_bytes

    case = dict(case)
    recompute = case.pop("recompute", "none")
    cfg = small_config(case.pop("dtype", "float64"), **case)
    cfg.train.recompute = recompute
    cfg.train.eval_fraction, cfg.train.eval_batches = 0.25, 2
    cfg = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(cfg, world, source=token_source())
        want = predict_step_bytes(cfg, eng.coord)
        want_eval = predict_eval_bytes(cfg, eng.coord)
        for step in range(2):  # the second step must count the same as the first
            eng.ledger.reset()
            trainer.train_step(eng, step)
            trainer.evaluate(eng)
            got, got_eval = eng.ledger.bytes_by_group(), eng.eval_ledger.bytes_by_group()
            if got != want:
                fails.append(f"step {step} {eng.coord}: "
                             + _mismatches(got, want, cfg.parallel.zero))
            if got_eval != want_eval:
                fails.append(f"validation after step {step} {eng.coord}: eval ledger "
                             + _mismatches(got_eval, want_eval, cfg.parallel.zero))
        trainer.close(eng)


MTP_CASES = [dict(model="mtp", tp=2, pp=2, dp=2, tp_sequence_parallel=True),
             dict(model="mtp", sp=2, dp=2, pp=2, zero=3, sp_split="zigzag")]
"""Multi-token prediction: the modules' blocks, the embedding's copy and the shared head on
the last stage (tensor, sequence, ZeRO-3 and the embedding's gradient over ``pp_ends``)."""


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", MTP_CASES,
                         ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in MTP_CASES])
def test_ledger_bytes_equal_planner_prediction_with_mtp(world, case):
    """As :func:`test_ledger_bytes_equal_planner_prediction`, with MTP modules."""
    test_ledger_bytes_equal_planner_prediction(world, case)


# ------------------------------------------------------------------------ links across nodes
LINK_CASES = [
    dict(dp=8, ranks_per_node=4), dict(dp=8, ranks_per_node=4, dp_reduce="hierarchical"),
    dict(dp=8, ranks_per_node=2, dp_reduce="hierarchical", zero=1, bucket_mb=0.002),
    dict(dp=8, ranks_per_node=4, grad_compression="int8", bucket_mb=0.002),
    dict(dp=8, ranks_per_node=4, grad_compression="topk", zero=1),
    dict(dp=8, ranks_per_node=2, dp_reduce="hierarchical", grad_compression="int8"),
    dict(dp=4, tp=2, ranks_per_node=4, dp_reduce="hierarchical", grad_compression="int8",
         zero=1, bucket_mb=0.002),
    dict(dp=2, sp=2, tp=2, ranks_per_node=4, dp_reduce="hierarchical", grad_compression="topk",
         error_feedback="off"),
    dict(sp=8, ranks_per_node=4), dict(sp=8, sp_mode="hybrid", ulysses_size=2, ranks_per_node=2,
                                       sp_overlap=True, sp_split="zigzag"),
    dict(sp=4, dp=2, sp_mode="hybrid", ulysses_size=2, ranks_per_node=2,
         dp_reduce="hierarchical"),
    dict(pp=4, tp=2, ranks_per_node=2, schedule="zb-h1", tp_sequence_parallel=True),
    dict(pp=2, dp=2, sp=2, ranks_per_node=4, schedule="interleaved", virtual_stages=2),
    dict(model="tied", pp=2, dp=4, ranks_per_node=4, dp_reduce="hierarchical", zero=1),
    dict(model="tied", pp=2, dp=4, ranks_per_node=2, grad_compression="topk",
         error_feedback="off"),
    # an all-reduce under a named algorithm books that algorithm's sends for the rank's place
    dict(dp=8, ranks_per_node=4, allreduce_algorithm="tree", bucket_mb=0.002),
    dict(dp=4, tp=2, ranks_per_node=4, allreduce_algorithm="rabenseifner", zero=1),
    dict(dp=8, ranks_per_node=2, dp_reduce="hierarchical", allreduce_algorithm="tree")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LINK_CASES,
                         ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in LINK_CASES])
def test_ledger_links_equal_planner_prediction(world, case):
    """With nodes of --ranks-per-node ranks, each group's wire bytes inside and across nodes,
    its payload bytes and its calls are the planner's, in every reduction, compression and SP
    mode."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from mpipar.plan.traffic import predict_link_bytes, predict_step_bytes, predict_step_messages

    cfg = validate(small_config("float32", **case), 8)
    with rank_failures(world) as fails:
        eng = build_rank(cfg, world, source=token_source())
        for step in range(2):
            eng.ledger.reset()
            trainer.train_step(eng, step)
            messages: dict[str, int] = {}
            for (group, _), entry in eng.ledger.entries.items():
                messages[group] = messages.get(group, 0) + entry.messages
            coord = eng.coord
            for what, got, want in (
                    ("links", eng.ledger.bytes_by_link(), predict_link_bytes(cfg, coord)),
                    ("bytes", eng.ledger.bytes_by_group(), predict_step_bytes(cfg, coord)),
                    ("messages", messages, predict_step_messages(cfg, coord))):
                if got != want:
                    fails.append(f"step {step} {coord} {what}: "
                                 + _mismatches(got, want, cfg.parallel.zero))
        trainer.close(eng)


MODES = {"flat": {}, "hierarchical": dict(dp_reduce="hierarchical"),
         "int8": dict(grad_compression="int8"), "topk": dict(grad_compression="topk"),
         "hierarchical+int8": dict(dp_reduce="hierarchical", grad_compression="int8"),
         "hierarchical+topk": dict(dp_reduce="hierarchical", grad_compression="topk")}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("k", [2, 4])
def test_inter_node_bytes_fall(world, k):
    """dp=8 on nodes of k ranks, float32: the most wire bytes any rank sends across nodes in a
    step (ledger) fall by at least k with hierarchical reduction, by >= 3.5x with int8 and by
    >= 10x with top-k 1% against flat; hierarchical and compressed multiply."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    inter = {}
    with rank_failures(world) as fails:
        for mode, extra in MODES.items():
            cfg = validate(small_config("float32", dp=8, ranks_per_node=k, **extra), 8)
            eng = build_rank(cfg, world, source=token_source())
            eng.ledger.reset()
            trainer.train_step(eng, 0)
            mine = sum(links["inter"] for links in eng.ledger.bytes_by_link().values())
            trainer.close(eng)
            inter[mode] = max(world.allgather(mine))
        ratio = {mode: inter["flat"] / inter[mode] for mode in MODES}
        for mode, least in (("hierarchical", k), ("int8", 3.5), ("topk", 10.0),
                            ("hierarchical+int8", 3.5 * k), ("hierarchical+topk", 10.0 * k)):
            if not ratio[mode] >= least:
                fails.append(f"{mode}: inter-node bytes {inter[mode]:,} vs flat "
                             f"{inter['flat']:,}: {ratio[mode]:.2f}x < {least}x")
        if world.rank == 0:
            print(f"nodes of {k}: inter-node bytes per rank per step " + ", ".join(
                f"{m} {inter[m]:,} ({ratio[m]:.2f}x)" for m in MODES))


@pytest.mark.mpi(min_size=2)
def test_request_books_its_test_seconds_apart(world):
    """A non-blocking all-gather completed by ``test`` calls books those seconds as ``tested``
    (part of ``seconds``); one completed by ``wait`` books none; bytes and data are exact."""
    import time

    import numpy as np

    from mpipar.runtime.comm import Group, Ledger

    group, failures = Group(world, "world", Ledger()), []
    n, size, rank = 1 << 16, group.size, group.rank
    send = np.arange(n, dtype=np.float64) + rank * n
    recv = np.empty(n * size)
    req, deadline = group.iallgather(send, recv), time.monotonic() + 60
    while not req.test():
        if time.monotonic() > deadline:
            raise AssertionError("the all-gather did not complete in 60 s")
    e = group.ledger.entries[("world", "iallgather")]
    first = (e.messages, e.bytes, e.tested, e.seconds, recv.copy())
    group.iallgather(send, recv).wait()
    whole = np.arange(n * size, dtype=np.float64)
    try:
        assert first[:2] == (1, send.nbytes), first[:2]
        assert 0 < first[2] == first[3], first[2:4]
        np.testing.assert_array_equal(first[4], whole)
        assert e.messages == 2 and e.tested == first[2] and e.seconds > first[2]
        np.testing.assert_array_equal(recv, whole)
    except AssertionError as error:
        failures.append(str(error))
    assert_all_ranks(world, failures)
