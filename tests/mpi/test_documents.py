"""Packed documents on 8 ranks: with --document-masking (and --eod-mask-loss) every sp mode
and split, tp (also with tp sequence parallelism), pp, dp and ZeRO-3 equal the one-process run
after two AdamW steps (<= 1e-10 relative in float64), which ``tests/unit/test_documents.py``
holds equal to each document run as its own sequence. The layouts' test data with EOS = 3
packs one to four documents a row, so ring blocks with no shared document occur and are
skipped."""
from __future__ import annotations

import functools

import pytest

from conftest import assert_all_ranks
from layouts import compare, layout_name, layout_size, run, small_config

EOS = 3
DOCS = dict(document_masking=True, eos_token_id=EOS)
EOD = dict(DOCS, eod_mask_loss=True)

LAYOUTS = [
    dict(sp=8), dict(sp=4, sp_split="zigzag", sp_overlap=True), dict(dp=2, sp=2, sp_mode="ulysses"),
    dict(sp=8, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag", sp_overlap=True),
    dict(tp=2, sp=2, tp_sequence_parallel=True), dict(pp=2, sp=2), dict(dp=2, sp=2, zero=3),
    dict(dp=2, tp=2, pp=2), dict(sp=4, model="window", sp_mode="halo"),
]
EOD_LAYOUTS = [dict(sp=4, sp_split="zigzag"), dict(dp=2, pp=2, sp=2)]
CASES = ([(layout, "docs") for layout in LAYOUTS]
         + [(layout, "eod") for layout in EOD_LAYOUTS] + [(dict(dp=2, sp=4), "eod-only")])
TRAIN = {"docs": DOCS, "eod": EOD, "eod-only": dict(eod_mask_loss=True, eos_token_id=EOS)}


def packed(model: str, case: str, **parallel):
    cfg = small_config("float64", model, **parallel)
    for name, value in TRAIN[case].items():
        setattr(cfg.train, name, value)
    return cfg


@functools.lru_cache(maxsize=None)
def reference(model: str, case: str):
    from mpi4py import MPI
    losses, norms, params, engine = run(packed(model, case), MPI.COMM_SELF)
    engine.close()
    return losses, norms, params


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout,case", CASES,
                         ids=[f"{case}-{layout_name(v)}" for v, case in CASES])
def test_packed_documents_equal_one_process(world, layout, case):
    layout = dict(layout)
    model = layout.pop("model", "llama")
    comm = world.Split(world.rank // layout_size(layout), world.rank)
    fails: list[str] = []
    try:
        got = run(packed(model, case, **layout), comm)
        try:
            fails = compare(got[:3], reference(model, case), 1e-10)
        finally:
            got[3].close()
    except Exception as exc:  # a rank's error must reach every rank, never hang them
        fails = [f"{type(exc).__name__}: {exc}"]
    finally:
        comm.Free()
    assert_all_ranks(world, fails)
