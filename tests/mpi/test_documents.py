"""Packed documents on 8 ranks: with --document-masking (and --eod-mask-loss) every sp mode
and split, tp (also with tp sequence parallelism), pp, dp and ZeRO-3 equal the one-process run
after two AdamW steps (<= 1e-10 relative in float64), which ``tests/unit/test_documents.py``
holds equal to each document run as its own sequence. The layouts' test data with EOS = 3
packs one to four documents a row, so ring blocks with no shared document occur and are
skipped."""
from __future__ import annotations

import functools

import pytest

from conftest import check_in_groups, rank_failures
from layouts import compare, layout_name, layout_size, run, small_config
from mpipar.training import step as trainer

EOS = 3
DOCS = dict(document_masking=True, eos_token_id=EOS)
EOD = dict(DOCS, eod_mask_loss=True)

LAYOUTS = [
    dict(sp=8), dict(sp=4, sp_split="zigzag", sp_overlap=True), dict(dp=2, sp=2, sp_mode="ulysses"),
    dict(sp=8, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag", sp_overlap=True),
    dict(tp=2, sp=2, tp_sequence_parallel=True), dict(pp=2, sp=2), dict(dp=2, sp=2, zero=3),
    dict(dp=2, tp=2, pp=2), dict(sp=4, model="window", sp_mode="halo"),
    dict(sp=8, sp_split="balanced", sp_overlap=True), dict(tp=2, sp=4, sp_split="balanced"),
    dict(dp=2, sp=2, sp_split="balanced", zero=3), dict(pp=2, sp=4, sp_split="balanced",
                                                        model="window"),
    # the default floor of 64 tokens a chunk: 4 tokens a rank stay one chunk, dealt whole
    dict(dp=2, sp=4, sp_split="balanced", sp_min_chunk=64),
]
EOD_LAYOUTS = [dict(sp=4, sp_split="zigzag"), dict(dp=2, pp=2, sp=2, sp_split="balanced")]
# The Numba kernels take the documents inside one call per block (ring and zigzag offsets,
# Ulysses' whole sequence); held to the one-process run with numpy_ref's per-document calls.
NUMBA_LAYOUTS = [dict(sp=4, sp_split="zigzag", sp_overlap=True), dict(sp=8, sp_split="balanced"),
                 dict(sp=8, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag")]
CASES = ([(layout, "docs") for layout in LAYOUTS]
         + [(layout, "eod") for layout in EOD_LAYOUTS] + [(dict(dp=2, sp=4), "eod-only")]
         + [(layout, "docs-numba") for layout in NUMBA_LAYOUTS])
TRAIN = {"docs": DOCS, "eod": EOD, "eod-only": dict(eod_mask_loss=True, eos_token_id=EOS),
         "docs-numba": dict(DOCS, backend="numba")}


def packed(model: str, case: str, **parallel):
    cfg = small_config("float64", model, **parallel)
    for name, value in TRAIN[case].items():
        setattr(cfg.train, name, value)
    return cfg


@functools.lru_cache(maxsize=None)
def reference(model: str, case: str):
    from mpi4py import MPI
    losses, norms, params, rank = run(packed(model, case), MPI.COMM_SELF)
    trainer.close(rank)
    return losses, norms, params


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout,case", CASES,
                         ids=[f"{case}-{layout_name(v)}" for v, case in CASES])
def test_packed_documents_equal_one_process(world, layout, case):
    layout = dict(layout)
    model = layout.pop("model", "llama")

    def check(comm) -> list[str]:
        got = run(packed(model, case, **layout), comm)
        try:
            return compare(got[:3], reference(model, case.removesuffix("-numba")), 1e-10)
        finally:
            trainer.close(got[3])

    check_in_groups(world, layout_size(layout), check)


LEDGER = [dict(sp=8), dict(sp=4, dp=2, sp_split="zigzag", sp_overlap=True),
          dict(sp=8, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag"),
          dict(sp=4, pp=2, recompute="full"), dict(sp=8, sp_split="balanced")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LEDGER, ids=[layout_name(c) for c in LEDGER])
def test_ring_hops_no_document_crosses_are_not_sent_and_the_planner_knows(world, case):
    """The ledger's bytes of each step equal the planner's prediction for that step's
    documents, and the sp ring moves fewer bytes than without documents (in some step)."""
    from mpipar.plan.traffic import predict_step_bytes
    from mpipar.rules import validate
    from mpipar.training.batches import prepare
    from mpipar.training.rank import build_rank
    from layouts import token_source

    case = dict(case)
    recompute = case.pop("recompute", "none")
    cfg = packed("llama", "docs", **case)
    cfg.train.recompute = recompute
    layout = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(layout, world, source=token_source())
        full, moved = predict_step_bytes(layout, eng.coord), []
        for step in range(2):
            eng.ledger.reset()
            docs = [mb.positions.docs for mb in prepare(eng, eng.data.sampler, step).microbatches]
            trainer.train_step(eng, step)
            got, want = eng.ledger.bytes_by_group(), predict_step_bytes(layout, eng.coord,
                                                                       docs)
            if got != want:
                fails.append(f"step {step} {eng.coord}: ledger {got} != predicted {want}")
            ring = "sp_ring" if "sp_ring" in full else "sp"
            moved.append(got.get(ring, 0))
        # a long document may need the whole ring; here zigzag's chunks of 2 tokens and
        # balanced's of 1 always do (contiguous's of 2 to 4 do not)
        if case.get("sp_split") is None and not min(moved) < full[ring]:
            fails.append(f"{ring} bytes {moved} never below {full[ring]}")
        trainer.close(eng)


def _eval_loss(world_size: int, comm=None, **parallel) -> float:
    from mpi4py import MPI
    from mpipar.rules import validate
    from mpipar.training.rank import build_rank
    from layouts import token_source
    cfg = packed("llama", "eod", **parallel)
    cfg.train.eval_fraction, cfg.train.eval_batches = 0.25, 2
    eng = build_rank(validate(cfg, world_size), comm or MPI.COMM_SELF, source=token_source())
    trainer.train_step(eng, 0)
    loss = trainer.evaluate(eng).loss
    trainer.close(eng)
    return loss


@pytest.mark.mpi(min_size=8)
def test_validation_loss_with_documents_and_eod_mask_equals_one_process(world):
    """The validation pass reads each microbatch's documents and counted targets too."""
    with rank_failures(world) as fails:
        got = _eval_loss(8, world, dp=2, pp=2, sp=2, sp_split="balanced")
        want = _eval_loss(1)
        if abs(got - want) > 1e-10 * abs(want):
            fails.append(f"validation loss {got!r} vs one process {want!r}")


IMBALANCE = [dict(dp=2, sp=4), dict(dp=2, sp=4, sp_split="zigzag"),
             dict(dp=2, sp=4, sp_split="balanced"), dict(dp=4, sp=2, sp_mode="ulysses"),
             dict(dp=2, sp=4, sp_mode="hybrid", ulysses_size=2),
             dict(dp=2, sp=4, sp_mode="halo", model="window"),
             dict(sp=8, sp_split="balanced", model="window")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", IMBALANCE, ids=[layout_name(c) for c in IMBALANCE])
def test_attention_imbalance_is_the_pairs_the_ranks_compute(world, case, monkeypatch):
    """A step's ``attention_imbalance`` equals the max/mean over each sp group (the worst
    group) of the intra-document pairs x query heads this rank's attention core hands the
    kernels in the step's forwards, counted here from each call's query and key runs: Ulysses
    shares a group's work, halo and windowed layers see at most W keys."""
    import numpy as np
    from mpipar.parallel.sequence import halo, ring, ulysses
    from mpipar.rules import validate
    from mpipar.training.rank import build_rank
    from layouts import token_source

    case = dict(case)
    cfg = packed(case.pop("model", "llama"), "docs", **case)
    pairs = [0]

    def counted(kernels, q, k, v, qs, ks, window, docs):
        d = docs.docs
        qp, kp = np.arange(qs, qs + q.shape[1]), np.arange(ks, ks + k.shape[1])
        seen = (kp[None, :] <= qp[:, None]) & ((window == 0) | (qp[:, None] - kp[None, :] < window))
        same = d[:, qp][:, :, None] == d[:, kp][:, None, :]
        pairs[0] += int((same & seen).sum()) * q.shape[2]
        return attend(kernels, q, k, v, qs, ks, window, docs)

    attend = ring.attend_fwd
    for module in (ring, halo, ulysses):        # every mode's core calls the kernels through it
        monkeypatch.setattr(module, "attend_fwd", counted)
    with rank_failures(world) as fails:
        eng = build_rank(validate(cfg, 8), world, source=token_source())
        for step in range(2):
            pairs[0] = 0
            got = trainer.train_step(eng, step).attention_imbalance
            c = eng.coord
            rows = world.allgather(((c.dp, c.tp, c.pp), pairs[0]))
            groups: dict = {}
            for key, n in rows:
                groups.setdefault(key, []).append(n)
            want = max(max(g) / np.mean(g) for g in groups.values())
            if got is None or abs(got - want) > 1e-12 * want:
                fails.append(f"step {step} {c}: attention_imbalance {got} != {want} counted "
                             f"({sorted(groups.items())})")
        trainer.close(eng)
