"""The planner against the engine on 8 ranks: exact state memory and message counts on each
layout."""
from __future__ import annotations

import pytest

from conftest import rank_failures
from layouts import small_config, token_source
from mpipar.plan.memory import predict_memory
from mpipar.plan.traffic import predict_step_bytes, predict_step_messages
from mpipar.rules import validate

CASES = [dict(tp=2, dp=4), dict(sp=4, dp=2), dict(sp=2, tp=2, pp=2), dict(sp=2, sp_mode="ulysses", dp=4),
         dict(sp=4, sp_overlap=True, tp=2), dict(pp=2, dp=2, sp=2, schedule="interleaved", virtual_stages=2),
         dict(dp=8, bucket_mb=0.001), dict(dp=4, tp=2, zero=1, bucket_mb=0.003),
         dict(pp=4, tp=2, schedule="zb-h1"), dict(dp=2, tp=2, pp=2, dtype="float32"),
         dict(tp=2, sp=2, dp=2, recompute="full"), dict(sp=2, sp_mode="ulysses", dp=2, pp=2,
                                                         recompute="full"),
         dict(tp=2, pp=2, dp=2, recompute="selective"),
         dict(model="tied", pp=2, tp=2, dp=2, zero=1, bucket_mb=0.003),
         dict(model="tied", dp=4, tp=2, schedule="interleaved", virtual_stages=2),
         dict(dp=8, zero=3), dict(dp=2, tp=2, pp=2, zero=2, schedule="zb-h1"),
         dict(model="tied", dp=2, sp=2, pp=2, zero=3, zero_prefetch=2, recompute="full"),
         dict(dp=2, tp=2, pp=2, zero=3, zero_shared="node", schedule="zb-h1"),
         dict(dp=4, pp=2, zero=3, zero_shared="node", ranks_per_node=2),
         dict(model="qwen3", tp=2, pp=2, dp=2, recompute="selective"),
         # latent attention: its down-projections' and latent norms' gradients summed over tp
         dict(model="latent", tp=2, pp=2, dp=2),
         # LoRA: the adapters alone reduced and updated, the frozen base sharded and gathered;
         # DPO: two rows a pair; Muon: one momentum per matrix, its exchanges over dp x sp and tp
         dict(dp=2, tp=2, pp=2, zero=3, train=dict(lora_rank=2, lora_alpha=4.0)),
         dict(sp=2, tp=2, pp=2, train=dict(objective="dpo")),
         dict(dp=4, tp=2, zero=1, bucket_mb=0.003, train=dict(optimizer="muon"))]


def _pairs_file(longest: int = 6) -> str:
    """Preference pairs of the test model's vocabulary for its 16-token rows, prompts and
    responses of 2..``longest`` tokens (this rank's copy: every rank writes the same)."""
    import json
    import tempfile
    from pathlib import Path

    import numpy as np
    from layouts import VOCAB
    from mpipar.data.preference import prepare_preference
    rng = np.random.default_rng(5)
    root = Path(tempfile.mkdtemp(prefix="mpipar-pairs-"))
    lines = [json.dumps({k: rng.integers(1, VOCAB, rng.integers(2, longest + 1)).tolist()
                         for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
             for _ in range(8)]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_preference(root / "pairs.jsonl", root / "pairs.h5", 16)
    return str(root / "pairs.h5")


def _moments(opt, zero: int) -> int:
    """Bytes of the optimizer's state: AdamW's moments, and under Muon its momentum buffers
    (ZeRO-1/2/3: held in AdamW's first moment)."""
    if hasattr(opt, "rest"):
        own = sum(q.buf.nbytes for q in opt.pieces.values()) if not zero else 0
        return own + _moments(opt.rest, zero)
    if zero:
        return sum(a.nbytes for a in opt.m) + sum(a.nbytes for a in opt.v)
    return sum(a.nbytes for a in opt.m.values()) + sum(a.nbytes for a in opt.v.values())


def _frozen_bytes(frozen) -> int:
    """Bytes of LoRA's frozen base on a rank: its tensors, or at ZeRO-3 its owned slices."""
    if frozen is None:
        return 0
    if hasattr(frozen, "units"):
        return sum(u.owned.nbytes for u in frozen.units.values())
    return sum(v.nbytes for v in frozen.params.values())


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", CASES, ids=["-".join(
    f"{k}{v}" if k != "train" else "-".join(f"{a}{b}" for a, b in v.items())
    for k, v in c.items())
    for c in CASES])
def test_state_memory_and_messages_equal_the_engine(world, case):
    """Weights, gradients and AdamW moments are the engine's buffers byte for byte; the MPI
    calls per group are the ledger's, and so are the bytes (recompute=full repeats forward
    traffic in backward)."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    case = dict(case)
    recompute = case.pop("recompute", "none")
    train = case.pop("train", {})
    cfg = small_config(case.pop("dtype", "float64"), **case)
    cfg.train.recompute = recompute
    for name, value in train.items():
        setattr(cfg.train, name, value)
    if cfg.train.objective == "dpo":
        cfg.train.data = _pairs_file(4 if cfg.train.pack_pairs else 6)
    cfg = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(cfg, world, source=None if cfg.train.data else token_source())
        if eng.data.preference is not None:    # the reference pass before step 0's
            eng.data.preference.reference = trainer.reference_logps(eng)
        mem = predict_memory(cfg, eng.coord)
        buckets = eng.weights.reducer.buckets
        moments = _moments(eng.weights.optimizer, cfg.parallel.zero)
        frozen = _frozen_bytes(eng.weights.frozen)
        if cfg.parallel.zero >= 2:   # units: this rank's slices (ZeRO-2: the whole parameters;
            # node shared: its part of the node's copy)
            store = eng.weights.reducer      # the trained units (under LoRA, the adapters')
            weights = (store.shared_bytes if store.shared else
                       sum((b.owned if cfg.parallel.zero == 3 else b.full).nbytes for b in buckets))
            got = (weights + frozen, sum(b.owned_grad.nbytes for b in buckets), moments)
        else:
            got = (sum(b.params.nbytes for b in buckets) + frozen,
                   sum(b.grads.nbytes for b in buckets), moments)
        if got != (mem.weights, mem.grads, mem.optimizer):
            fails.append(f"{eng.coord}: engine {got} != predicted "
                         f"{(mem.weights, mem.grads, mem.optimizer)}")
        eng.ledger.reset()
        trainer.train_step(eng, 0)
        messages: dict[str, int] = {}
        for (group, _), entry in eng.ledger.entries.items():
            messages[group] = messages.get(group, 0) + entry.messages
        if messages != predict_step_messages(cfg, eng.coord):
            fails.append(f"{eng.coord}: ledger messages {messages} != predicted "
                         f"{predict_step_messages(cfg, eng.coord)}")
        if eng.ledger.bytes_by_group() != predict_step_bytes(cfg, eng.coord):
            fails.append(f"{eng.coord}: ledger bytes {eng.ledger.bytes_by_group()} != "
                         f"predicted {predict_step_bytes(cfg, eng.coord)}")
        if cfg.parallel.zero >= 2:   # the buffers a step needed at once stay in the pool
            pooled = sum(b.nbytes for bufs in eng.weights.reducer.pool.free.values()
                         for b in bufs)
            if not 0 < pooled <= mem.buffers:
                fails.append(f"{eng.coord}: pool {pooled} B, bound {mem.buffers} B")
        trainer.close(eng)


# Latent attention on the ring: each block travels as its latent and RoPE key, and its
# gradient latent-sized (both relays of zigzag, overlapped).
LATENT_RING = [dict(model="latent", sp=4, tp=2, sp_split="zigzag", sp_overlap=True)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LATENT_RING, ids=["latent-sp4-tp2-zigzag-overlap"])
def test_latent_ring_messages_equal_the_engine(world, case):
    """The ring's latent messages: the ledger's bytes are the planner's."""
    test_state_memory_and_messages_equal_the_engine(world, case)


@pytest.mark.mpi(min_size=8)
def test_packed_pairs_ring_bytes_are_the_planners_for_their_documents(world):
    """On the ring, packed pairs skip the hops no sequence crosses: given the step's packed
    rows' documents (each sequence one), the planner's bytes are the ledger's."""
    from mpipar.plan.traffic import predict_step_bytes
    from mpipar.training import step as trainer
    from mpipar.training.batches import prepare
    from mpipar.training.rank import build_rank

    cfg = small_config("float64", sp=2, tp=2, pp=2)
    cfg.train.objective, cfg.train.pack_pairs, cfg.train.data = "dpo", True, _pairs_file(4)
    layout = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(layout, world, source=None)
        eng.data.preference.reference = trainer.reference_logps(eng)
        full = predict_step_bytes(layout, eng.coord)
        eng.ledger.reset()
        docs = [mb.positions.docs for mb in prepare(eng, eng.data.sampler, 0).microbatches]
        trainer.train_step(eng, 0)
        got, want = eng.ledger.bytes_by_group(), predict_step_bytes(layout, eng.coord, docs)
        if got != want:
            fails.append(f"{eng.coord}: ledger {got} != predicted {want}")
        if not got.get("sp", 0) < full["sp"]:
            fails.append(f"sp bytes {got.get('sp')} not below the full ring's {full['sp']}")
        trainer.close(eng)


@pytest.mark.mpi(min_size=8)
def test_packed_pairs_equal_the_engine(world):
    """DPO with --pack-pairs: a microbatch of m pairs is m rows (the stream's and Ulysses'
    messages), its 2m sequences' log-probabilities still summed over sp. (Ulysses: no hops to
    skip; the ring's, given the packed documents, in the test above.)"""
    test_state_memory_and_messages_equal_the_engine(
        world, dict(sp=2, sp_mode="ulysses", dp=2, pp=2,
                    train=dict(objective="dpo", pack_pairs=True)))


MTP_CASES = [dict(model="mtp", dp=2, tp=2, pp=2, zero=1, bucket_mb=0.003)]
"""Multi-token prediction: the modules' state on the last stage and their calls."""


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", MTP_CASES, ids=["-".join(f"{k}{v}" for k, v in c.items())
                                                 for c in MTP_CASES])
def test_state_memory_and_messages_equal_the_engine_with_mtp(world, case):
    """As :func:`test_state_memory_and_messages_equal_the_engine`, with MTP modules."""
    test_state_memory_and_messages_equal_the_engine(world, case)


OPTIMIZER_CASES = [dict(dp=4, tp=2, zero=1, bucket_mb=0.003, train=dict(optimizer="muon")),
                   dict(dp=2, tp=2, pp=2, zero=2, train=dict(optimizer="muon"))]
"""What the optimizer step hands to MPI: Muon's exchanges and the updated parameters'
all-gathers (ZeRO-1's slices, ZeRO-2's units)."""


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=["-".join(
    f"{k}{v}" if k != "train" else "-".join(f"{a}{b}" for a, b in v.items())
    for k, v in c.items()) for c in OPTIMIZER_CASES])
def test_optimizer_bytes_equal_the_measured_cost(world, case):
    """The bytes the planner predicts for the optimizer step are those the step's
    OptimizerCost measures (the summary's optimizer line) on every rank."""
    from mpipar.plan.traffic import predict_optimizer_bytes
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    case = dict(case)
    train = case.pop("train", {})
    cfg = small_config("float64", **case)
    for name, value in train.items():
        setattr(cfg.train, name, value)
    cfg = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(cfg, world, source=token_source())
        got = trainer.train_step(eng, 0).optimizer.bytes
        want = predict_optimizer_bytes(cfg, eng.coord)
        if got != want or not want:
            fails.append(f"{eng.coord}: optimizer step {got} B, predicted {want} B")
        trainer.close(eng)
