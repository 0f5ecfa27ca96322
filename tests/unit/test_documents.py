"""Packed documents on one process (--document-masking): document ids from EOS, the attention
seam against the masked reference kernel and against each document run alone, and the whole
model: a packed row's loss and gradients equal those of its documents run as their own
sequences (positions from 0), in float64."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from mpipar.kernels import get_backend
from mpipar.model.attention import LocalAttention, DocumentPositions, document_ids
from mpipar.model.params import init_params

from tests.unit.test_model import CFG, make_stage
from mpipar.training import step as trainer

EOS = 3


def test_document_ids_give_the_eos_to_the_document_it_ends():
    tokens = np.array([[5, 3, 7, 7, 3, 3, 1], [3, 1, 1, 1, 1, 1, 3]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    pos = DocumentPositions.of(np.arange(7), document_ids(tokens, EOS))
    assert pos.rope.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert pos.with_positions(np.array([2, 6])).rope.tolist() == [[0, 0], [1, 5]]


def _qkv(B=2, S=13, hq=4, hkv=2, D=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, S, hq, D)), rng.standard_normal((B, S, hkv, D)),
            rng.standard_normal((B, S, hkv, D)), rng.standard_normal((B, S, hq, D)))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("window", [0, 3])
def test_the_seam_equals_the_masked_kernel_and_each_document_alone(backend, window):
    q, k, v, dout = _qkv()
    tokens = np.array([[1, 1, 3, 1, 1, 1, 1, 1, 3, 3, 1, 1, 1],
                       [1] * 13])
    docs = document_ids(tokens, EOS)
    k_ = get_backend(backend)
    core = LocalAttention(k_)
    pos = DocumentPositions.of(np.arange(13), docs)
    out, saved = core.forward(q, k, v, pos, window)
    dq, dk, dv = core.backward(dout, q, k, v, out, saved, window)
    ref = get_backend("numpy")
    ro, rl = ref.attention_fwd(q, k, v, 0, 0, True, window=window, q_docs=docs, k_docs=docs)
    rg = ref.attention_bwd(q, k, v, ro, rl, dout, 0, 0, True, window=window, q_docs=docs,
                           k_docs=docs)
    np.testing.assert_allclose(out, ro, rtol=1e-12, atol=1e-13)
    for a, b in zip((dq, dk, dv), rg):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    # each document alone, at positions from 0: identical rows
    for b in range(2):
        for d in np.unique(docs[b]):
            at = np.flatnonzero(docs[b] == d)
            sl = (slice(b, b + 1), slice(at[0], at[-1] + 1))
            o, _ = ref.attention_fwd(q[sl], k[sl], v[sl], 0, 0, True, window=window)
            np.testing.assert_allclose(out[sl], o, rtol=1e-12, atol=1e-13)
    # the mask matters: without documents the first row differs
    full, _ = ref.attention_fwd(q, k, v, 0, 0, True, window=window)
    assert np.abs(full[0] - out[0]).max() > 1e-3


def test_the_gpu_seam_hands_documents_to_the_kernels_that_take_them(monkeypatch):
    """On a GPU one op routes float32/float64 to cupy_gpu's flash kernels and bf16 to mpipar's
    flash_mma (chosen, or by `auto`, which sends plain calls to cuDNN): all of them take the
    document ids (one launch per block). bf16 through cuDNN when it was asked for takes none (a
    call per document's block). The seam asks per dtype (`gpu_bf16.by_dtype`). Imports no
    CuPy."""
    import types

    import ml_dtypes

    from mpipar.kernels import cupy_gpu, flash_exact, flash_mma, gpu_bf16
    from mpipar.model.attention import documents_in_kernel

    auto = gpu_bf16.attention_ops(gpu_bf16.PER_CALL)
    mine = gpu_bf16.attention_ops(gpu_bf16.AttentionChoice("mpipar", "asked for"))
    cudnn = gpu_bf16.attention_ops(gpu_bf16.AttentionChoice("cudnn", "asked for"))
    assert mine == (flash_mma.attention_fwd, flash_mma.attention_bwd)
    for i, float_op in enumerate((cupy_gpu.attention_fwd, cupy_gpu.attention_bwd)):
        for ops, takes in ((auto, True), (mine, True), (cudnn, False)):
            op = gpu_bf16.by_dtype(float_op, ops[i])
            kb = types.SimpleNamespace(attention_fwd=op)
            assert documents_in_kernel(kb, np.float32) and documents_in_kernel(kb, np.float64)
            assert documents_in_kernel(kb, ml_dtypes.bfloat16) == takes
        assert auto[i].document_tables is auto[0].document_tables
        assert gpu_bf16.by_dtype(float_op, cudnn[i]).document_tables is flash_exact.document_tables
    # auto's tables: flash_mma's, and cuDNN's ragged layout only where it is routed and imports
    from mpipar.kernels import cudnn_attention, cudnn_documents
    monkeypatch.setattr(flash_mma, "document_tables", lambda q_docs, k_docs: {"q": q_docs.shape})
    ids, bf16 = np.array([[0, 0, 1, 1, 1]]), ml_dtypes.bfloat16
    assert auto[0].document_tables(ids, ids, 64, bf16) == {"q": (1, 5)}
    monkeypatch.setattr(cudnn_documents, "ROUTED", True)
    if cudnn_attention.frontend_unavailable():
        assert auto[0].document_tables(ids, ids, 64, bf16) == {"q": (1, 5)}
    monkeypatch.setattr(cudnn_attention, "frontend_unavailable", lambda: None)
    found = auto[0].document_tables(ids, ids, 64, bf16)
    assert found["ragged"].lengths[:2].tolist() == [2, 3]
    assert auto[0].document_tables(ids, ids[:, ::-1].copy(), 64, bf16)["ragged"] is None
    # and the run's attention line says where bf16 documents go
    routes = {c: gpu_bf16.documents_route(gpu_bf16.AttentionChoice(*c)) for c in
              (("mpipar", "asked for"), ("cudnn", "asked for"), ("auto", "per call"))}
    assert routes[("auto", "per call")].startswith("cuDNN's ragged attention for diagonal")
    assert routes[("cudnn", "asked for")] == "cuDNN, a call per document's block"
    assert routes[("mpipar", "asked for")] == "mpipar's kernel"
    monkeypatch.setattr(cudnn_documents, "ROUTED", False)
    assert gpu_bf16.documents_route(gpu_bf16.PER_CALL) == "mpipar's kernel"
    # one kernel for every dtype that takes no documents: the flag as it is
    plain = types.SimpleNamespace(attention_fwd=gpu_bf16.by_dtype(cudnn[0], cudnn[0]))
    assert not documents_in_kernel(plain, np.float32)


@pytest.mark.parametrize("d", [64, 128, 32])
def test_bf16_flash_kernels_walk_what_their_warps_see(d):
    """`flash_mma.score_entries` (the bf16 kernel's loops: fixed blocks, with documents each
    16-row slab over the key tiles it can see) against the visible pairs themselves (numpy_ref's
    masks, brute force): a slab's tiles are those that meet the span from its rows' first
    visible key to their last, on the tile grid (`aligned=True`; the unaligned walk, the default,
    is the next test's). Full causal (the plain kernel): every slab of block j walks its block's
    tiles 0 .. (BQ (j + 1) - 1) // BK."""
    from mpipar.bench.documents import packed_documents
    from mpipar.kernels import flash_mma
    from mpipar.kernels import numpy_ref as ref
    from mpipar.parallel.sequence_split import token_work

    w, mt, bk = flash_mma._TILES[d]["fwd"][:3]
    S, bq = 512, 16 * mt * w
    want = sum(bq * bk * ((bq * (j + 1) - 1) // bk + 1) for j in range(S // bq))
    assert flash_mma.score_entries(S, S, d) == want
    rng = np.random.default_rng(d)
    for docs, qo, ko, window in [(np.cumsum(rng.random((2, 300)) < 1 / 40, axis=1), 0, 0, 0),
                                 (np.cumsum(rng.random((1, 300)) < 1 / 9, axis=1), 0, 0, 0),
                                 (np.cumsum(rng.random((1, 300)) < 1 / 90, axis=1), 0, 0, 37),
                                 (np.cumsum(rng.random((1, 300)) < 1 / 60, axis=1), 200, 0, 0)]:
        vis = ref.visible_mask(np, 300, 300, qo, ko, window)[None] & \
            ref.document_mask(docs, docs)[:, 0, 0]
        want = 0
        for b in range(docs.shape[0]):
            for r0 in range(0, 300, 16):
                seen = np.flatnonzero(vis[b, r0:r0 + 16].any(axis=0))
                want += 16 * bk * (seen[-1] // bk - seen[0] // bk + 1) if seen.size else 0
        assert flash_mma.score_entries(300, 300, d, qo, ko, True, window, docs, docs,
                                       aligned=True) == want
    docs = np.asarray(packed_documents(8192, 200, 1.0, np.random.default_rng(0))).reshape(1, -1)
    ratio = flash_mma.score_entries(8192, 8192, d, q_docs=docs, k_docs=docs) \
        / token_work(docs).sum()
    assert 1.0 < ratio <= 3.0


@pytest.mark.parametrize("d", [64, 128])
def test_unaligned_document_tiles_walk_fewer_entries(d):
    """`flash_mma.score_entries(aligned=False)` (`DOC_TILES_ALIGNED` off: a block's first key tile
    starts at its first row's document start, the window's start rounded down as before) against
    the visible pairs themselves: each 16-row slab walks the tiles of its block's grid that meet
    its span. Never more entries than aligned tiles; on the bench's documents (median 200) fewer."""
    from mpipar.bench.documents import packed_documents
    from mpipar.kernels import flash_mma
    from mpipar.kernels import numpy_ref as ref
    from mpipar.parallel.sequence_split import token_work

    w, mt, bk = flash_mma._tiles(d, "fwd_docs")[:3]
    bq = 16 * w * mt
    rng = np.random.default_rng(d)
    for docs, qo, window in [(np.cumsum(rng.random((2, 300)) < 1 / 40, axis=1), 0, 0),
                             (np.cumsum(rng.random((1, 300)) < 1 / 9, axis=1), 0, 0),
                             (np.cumsum(rng.random((1, 300)) < 1 / 90, axis=1), 0, 37),
                             (np.cumsum(rng.random((1, 300)) < 1 / 60, axis=1), 200, 0)]:
        vis = ref.visible_mask(np, 300, 300, qo, 0, window)[None] & \
            ref.document_mask(docs, docs)[:, 0, 0]
        want = 0
        for b in range(docs.shape[0]):
            for q0 in range(0, 300, bq):
                start = int(np.argmax(docs[b] == docs[b, q0]))     # the row's document start
                ws = max(0, qo + q0 - window + 1) if window else 0
                kbeg = max(ws - ws % bk, start)
                for r0 in range(q0, min(300, q0 + bq), 16):
                    seen = np.flatnonzero(vis[b, r0:r0 + 16].any(axis=0))
                    if seen.size:
                        assert seen[0] >= kbeg
                        want += 16 * bk * ((seen[-1] - kbeg) // bk - (seen[0] - kbeg) // bk + 1)
        got = flash_mma.score_entries(300, 300, d, qo, 0, True, window, docs, docs, aligned=False)
        assert got == want
        assert got <= flash_mma.score_entries(300, 300, d, qo, 0, True, window, docs, docs,
                                              aligned=True)
    docs = np.asarray(packed_documents(8192, 200, 1.0, np.random.default_rng(0))).reshape(1, -1)
    pairs = token_work(docs).sum()
    unaligned, aligned = (flash_mma.score_entries(8192, 8192, d, q_docs=docs, k_docs=docs,
                                                  aligned=a) / pairs for a in (False, True))
    assert 1.0 < unaligned < aligned


def test_bf16_document_kernels_may_have_their_own_tiles(monkeypatch):
    """`flash_mma._tiles`: a packed-document kernel's own `_TILES` entry ("fwd_docs", "dq_docs")
    sets its instantiation, shared memory and threads (its bf16-gradient twin's too), and leaves
    the plain kernels as they are; without one, each takes its plain kernel's tiles. Every role
    of every head dim has a name, and the names are all different."""
    from mpipar.kernels import flash_mma

    plain = flash_mma._names(64)
    assert plain["fwd"] == "flash_fwd<64, 4, 2, 64, 2, false, false>"
    assert plain["fwd_docs"] == "flash_fwd<64, 4, 1, 64, 3, false, true>"
    assert plain["dkdv_docs"] == "flash_bwd_dkdv<64, 4, 32, 3, false, true, float>"
    assert plain["dkdv"] == "flash_bwd_dkdv<64, 4, 64, 2, false, false, float>"
    assert plain["dq_docs_bf16"] == "flash_bwd_dq<64, 4, 32, 4, true, true, bf16_t>"
    assert flash_mma._names(128)["fwd_docs"] == "flash_fwd<128, 4, 1, 64, 2, true, true>"
    monkeypatch.setitem(flash_mma._TILES[64], "fwd_docs", (4, 1, 64, 3, 1))
    monkeypatch.setitem(flash_mma._TILES[64], "dq_docs", (2, 32, 6, 1))
    got = flash_mma._names(64)
    assert got["fwd_docs"] == "flash_fwd<64, 4, 1, 64, 3, true, true>"
    assert got["dq_docs"] == "flash_bwd_dq<64, 2, 32, 6, true, true, float>"
    assert got["dq_docs_bf16"] == "flash_bwd_dq<64, 2, 32, 6, true, true, bf16_t>"
    assert {r: n for r, n in got.items() if "docs" not in r} == \
        {r: n for r, n in plain.items() if "docs" not in r}
    row = (64 + 8) * 2
    assert flash_mma._smem_bytes(64, "fwd_docs") == (16 * 4 + 4 * 64) * row
    assert flash_mma._smem_bytes(64, "fwd") == (16 * 2 * 4 + 4 * 64) * row
    assert flash_mma._smem_bytes(64, "dq_docs_bf16") == (2 * 16 * 2 + 4 * 32) * row
    assert flash_mma._threads(64, "dq_docs") == 64 and flash_mma._threads(64, "dq") == 128
    for d in flash_mma.HEAD_DIMS:
        names = flash_mma._names(d)
        assert len(names) == 11 and len(set(names.values())) == 11


def test_bf16_document_bounds_are_each_rows_document():
    """`flash_mma.document_bounds`: each query's keys [klo, khi) and each key's queries [qlo,
    qhi) are exactly its document's positions on the other side (brute force), int32."""
    from mpipar.kernels import flash_mma

    rng = np.random.default_rng(3)
    q_docs = np.cumsum(rng.random((2, 70)) < 0.1, axis=1) + 1
    k_docs = np.cumsum(rng.random((2, 50)) < 0.1, axis=1)
    klo, khi, qlo, qhi = flash_mma.document_bounds(q_docs, k_docs)
    assert all(a.dtype == np.int32 for a in (klo, khi, qlo, qhi))
    for mine, other, lo, hi in ((q_docs, k_docs, klo, khi), (k_docs, q_docs, qlo, qhi)):
        for b in range(2):
            for i in range(mine.shape[1]):
                same = np.flatnonzero(other[b] == mine[b, i])
                if same.size:
                    assert (lo[b, i], hi[b, i]) == (same[0], same[-1] + 1)
                else:
                    assert lo[b, i] == hi[b, i]


def test_the_seam_keeps_a_kernels_document_tables_per_microbatch():
    """A kernel that turns document ids into tables of its own (the GPU's `document_tables`)
    gets them from the seam, made once per microbatch and block for every layer and both
    directions, and the results are those of the kernel given the ids alone."""
    import dataclasses

    from mpipar.model.attention import attend_bwd, attend_fwd

    kb = get_backend("numba")
    made, seen = [], []

    def tables(q_docs, k_docs, head_dim, dtype):
        made.append((q_docs.shape, k_docs.shape, head_dim, np.dtype(dtype)))
        return object()

    def taking(fn):
        def run(*a, tables=None, **kw):
            seen.append(tables)
            return fn(*a, **kw)
        run.block_sparse_documents, run.document_tables = True, tables
        return run

    kt = dataclasses.replace(kb, attention_fwd=taking(kb.attention_fwd),
                             attention_bwd=taking(kb.attention_bwd))
    q, k, v, dout = _qkv(S=40)
    pos = DocumentPositions.of(np.arange(40), np.repeat(np.arange(8), 5)[None].repeat(2, 0))
    for _ in range(3):                                  # three layers of one microbatch
        got = attend_fwd(kt, q, k, v, 0, 0, 0, pos)
        grads = attend_bwd(kt, q, k, v, *got, dout, 0, 0, 0, pos)
    assert made == [((2, 40), (2, 40), q.shape[-1], q.dtype)]
    assert len(seen) == 6 and all(t is seen[0] for t in seen) and seen[0] is not None
    want = attend_fwd(kb, q, k, v, 0, 0, 0, pos)
    for a, b in zip((*got, *grads), (*want, *attend_bwd(kb, q, k, v, *want, dout, 0, 0, 0, pos))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("d,itemsize", [(64, 4), (64, 8), (128, 4), (8, 4)])
def test_gpu_flash_kernels_walk_what_their_warps_see(d, itemsize):
    """`flash_exact.score_entries` (the GPU flash kernels' loop bounds: blocks aligned to the
    documents, each warp over the keys its rows see) against the visible pairs themselves: each
    warp's walk is the span from its rows' first visible key to their last (from numpy_ref's
    masks, brute force), so nothing visible is skipped and the count is what the kernels loop
    over; full causal computes the pairs plus each warp's own triangle, and short documents stay
    within a few percent of their pairs (the bench's rows: 1.08x at D 64 float32)."""
    from mpipar.bench.documents import packed_documents
    from mpipar.kernels import flash_exact
    from mpipar.kernels import numpy_ref as ref
    from mpipar.parallel.sequence_split import token_work

    lanes, _, threads = flash_exact.launch_config(d, itemsize)
    rows, w = threads // lanes, 32 // lanes
    rng = np.random.default_rng(d + itemsize)
    # full causal: warp k of rows [kw, kw + w) walks keys [0, kw + w): w^2 (S/w)(S/w + 1) / 2
    S = 4 * rows
    assert flash_exact.score_entries(S, S, d, itemsize) == w * w * (S // w) * (S // w + 1) // 2
    rows = flash_exact.block_rows(d, itemsize, documents=True)  # the document kernels' blocks
    for docs, qo, ko, window in [(np.cumsum(rng.random((2, 300)) < 1 / 40, axis=1), 0, 0, 0),
                                 (np.cumsum(rng.random((1, 300)) < 1 / 9, axis=1), 0, 0, 0),
                                 (np.cumsum(rng.random((1, 300)) < 1 / 90, axis=1), 0, 0, 37)]:
        vis = ref.visible_mask(np, 300, 300, qo, ko, window)[None] & \
            ref.document_mask(docs, docs)[:, 0, 0]
        lo, hi, starts = flash_exact._blocks(docs, docs, rows)
        want = 0
        for b in range(docs.shape[0]):
            cut = np.unique(starts[b])
            for first, stop in zip(cut[:-1], cut[1:]):
                for w0 in range(first, stop, w):
                    seen = np.flatnonzero(vis[b, w0:min(stop, w0 + w)].any(axis=0))
                    want += w * (seen[-1] + 1 - seen[0]) if seen.size else 0
        assert flash_exact.score_entries(300, 300, d, itemsize, qo, ko, True, window,
                                         docs, docs) == want
    docs = np.asarray(packed_documents(8192, 200, 1.0, np.random.default_rng(0))).reshape(1, -1)
    ratio = flash_exact.score_entries(8192, 8192, d, itemsize, q_docs=docs, k_docs=docs) \
        / token_work(docs).sum()
    assert 1.0 < ratio <= 1.0 + 2.5 * w / 200


def test_gpu_flash_document_tables_must_match_the_kernels_blocks(monkeypatch):
    """The document kernels' launch (`flash_exact.launch_config`: `_DOC_THREADS` threads,
    `_DOC_TILE` tile rows, at most the plain kernel's: float64 at D 96/128 has no shared memory
    for 32) may differ from the plain kernels', and block tables cut for larger blocks than a
    kernel holds would leave rows unwritten: the launch refuses them by name."""
    from mpipar.kernels import flash_exact

    assert flash_exact.launch_config(64, 4) == (4, 64, 256)
    assert flash_exact.launch_config(64, 4, documents=True) == (4, 32, 128)
    assert flash_exact.launch_config(128, 8, documents=True) == (16, 16, 128)
    monkeypatch.setattr(flash_exact, "_DOC_THREADS", 256)
    monkeypatch.setattr(flash_exact, "_DOC_TILE", 0)
    assert flash_exact.launch_config(64, 4, documents=True) == (4, 64, 256)
    monkeypatch.setattr(flash_exact, "_DOC_THREADS", 128)
    monkeypatch.setattr(flash_exact, "_DOC_TILE", 32)
    assert flash_exact.launch_config(64, 4, documents=True) == (4, 32, 128)
    assert flash_exact.launch_config(64, 4) == (4, 64, 256)
    assert "flash_fwd<float,float,64,4,32,128>" in flash_exact._flash_names("float", 64)
    tables = {"q": ("q side", 3), "k": ("k side", 5), "rows": 32}
    assert flash_exact._documents(tables, "k", 100, 32) == ("k side", 5)
    with pytest.raises(ValueError, match="cut for 64-row blocks, the kernel's blocks hold 32"):
        flash_exact._documents({**tables, "rows": 64}, "q", 100, 32)


def test_the_numba_seam_makes_one_kernel_call_per_block():
    """The Numba attention takes the documents itself (one call forward, one backward, equal to
    numpy_ref's masked attention); numpy_ref is called per document's block."""
    import dataclasses

    from mpipar.model.attention import documents_in_kernel

    assert documents_in_kernel(get_backend("numba"), np.float64)
    assert not documents_in_kernel(get_backend("numpy"), np.float64)
    q, k, v, dout = _qkv(S=40)
    docs = np.repeat(np.arange(8), 5)[None].repeat(2, 0)
    pos = DocumentPositions.of(np.arange(40), docs)
    calls = []

    def counted(fn):
        def run(*a, **kw):
            calls.append(fn.__name__)
            return fn(*a, **kw)
        run.block_sparse_documents = getattr(fn, "block_sparse_documents", False)
        return run

    got = {}
    for name in ("numba", "numpy"):
        kb = get_backend(name)
        core = LocalAttention(dataclasses.replace(kb, attention_fwd=counted(kb.attention_fwd),
                                                  attention_bwd=counted(kb.attention_bwd)))
        calls.clear()
        out, saved = core.forward(q, k, v, pos)
        got[name] = (out, *core.backward(dout, q, k, v, out, saved))
        got[name + " calls"] = len(calls)
    assert got["numba calls"] == 2 and got["numpy calls"] == 2 * 2 * 8
    for a, b in zip(got["numba"], got["numpy"]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def packed_batch(seed: int = 0, B: int = 2, S: int = 12):
    """Token rows with EOS at random places (documents of mixed lengths), and their targets."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, (B, S + 1))
    toks[toks == EOS] = 4
    for b in range(B):
        toks[b, rng.choice(S, 3, replace=False)] = EOS
    return toks[:, :-1], toks[:, 1:]


def test_a_packed_row_equals_its_documents_run_alone():
    """Loss sum and every parameter gradient of the packed batch == the sums over its
    documents, each run as its own sequence from position 0 (float64)."""
    stage = make_stage("numpy")
    params = init_params(CFG, 1, np.float64)
    tokens, targets = packed_batch()
    pos = DocumentPositions.of(np.arange(tokens.shape[1]), document_ids(tokens, EOS))
    loss, cache = stage.forward(params, tokens, pos, targets)
    grads = {n: np.zeros_like(v) for n, v in params.items()}
    stage.backward(params, grads, np.ones(tokens.shape), cache)
    want_loss, want = 0.0, {n: np.zeros_like(v) for n, v in params.items()}
    for b in range(tokens.shape[0]):
        docs = document_ids(tokens[b:b + 1], EOS)[0]
        for d in np.unique(docs):
            at = np.flatnonzero(docs == d)
            t, y = tokens[b:b + 1, at], targets[b:b + 1, at]
            l, c = stage.forward(params, t, np.arange(len(at)), y)
            stage.backward(params, want, np.ones(t.shape), c)
            want_loss += float(l.sum())
    assert float(loss.sum()) == pytest.approx(want_loss, rel=1e-12)
    for n in params:
        np.testing.assert_allclose(grads[n], want[n], rtol=1e-10, atol=1e-13)
    plain, _ = stage.forward(params, tokens, np.arange(tokens.shape[1]), targets)
    assert abs(float(plain.sum()) - want_loss) > 1e-6      # documents change the loss


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_rope_inside_documents_uses_the_tables_of_each_document_alone(dtype):
    """RoPE of a packed row is, token for token and bit for bit, RoPE of each document run alone
    from position 0: the same tables (float32 for bf16 activations, as the plain path has them;
    bf16 tables, as the packed path once made, are not even accepted by the GPU's kernel)."""
    import ml_dtypes
    stage = make_stage("numpy")
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float64
    tokens, _ = packed_batch(seed=1)
    docs = document_ids(tokens, EOS)
    pos = DocumentPositions.of(np.arange(tokens.shape[1]), docs)
    x = np.random.default_rng(2).standard_normal(
        (tokens.shape[0], tokens.shape[1], CFG.heads, CFG.head_dim)).astype(dt)
    for backward in (False, True):
        (got,) = stage.block.rope.rotate([x], pos, backward)
        assert got.dtype == x.dtype
        for b in range(x.shape[0]):
            for d in np.unique(docs[b]):
                at = np.flatnonzero(docs[b] == d)
                (alone,) = stage.block.rope.rotate([x[b:b + 1, at]], np.arange(len(at)), backward)
                assert np.array_equal(got[b:b + 1, at].view(np.uint8), alone.view(np.uint8)), \
                    (dtype, backward, b, d)


# ------------------------------------------------------------------ the engine, two AdamW steps
def packed_config(**train):
    """The layouts' test model on its data with EOS = 3 (about one token in 13: rows of one to
    four documents)."""
    from layouts import small_config
    cfg = small_config("float64")
    cfg.train.document_masking, cfg.train.eos_token_id = True, EOS
    for name, value in train.items():
        setattr(cfg.train, name, value)
    return cfg


def documents_alone(rank):
    """Replace the engine's pipeline walk by one that runs every document of every row as its
    own sequence (positions from 0) through the single chunk, each target weighted as the step
    weights it; the rest of the step (reduction, clipping, AdamW) is the engine's."""
    chunk = rank.model.chunks[0]
    eos, masked = rank.data.eos, rank.cfg.train.eod_mask_loss

    def run(params, grads, micro, positions, act_shape, dtype, weight, on_ready=None,
            on_microbatch=None):
        total = 0.0
        for mb in micro:
            for b in range(mb.tokens.shape[0]):
                docs = document_ids(mb.tokens[b:b + 1], eos)[0]
                for d in np.unique(docs):
                    at = np.flatnonzero(docs == d)
                    t, y = mb.tokens[b:b + 1, at], mb.targets[b:b + 1, at]
                    keep = (t != eos) if masked else np.ones(t.shape, bool)
                    loss, cache = chunk.forward(params, t, np.arange(len(at)), y)
                    chunk.backward(params, grads, weight[0, 0] * keep, cache)
                    total += float(loss[keep].sum())
        if on_ready is not None:
            on_ready(chunk.param_names())
        return total

    rank.executor.run = run
    return rank


@pytest.mark.parametrize("train", [{}, {"eod_mask_loss": True}], ids=["docs", "docs-eod"])
def test_two_adamw_steps_equal_each_document_run_alone(train):
    """One process: the engine with --document-masking (and --eod-mask-loss) equals, after two
    AdamW steps (losses, gradient norms, parameters), the same steps whose gradients come from
    each document run as its own sequence, <= 1e-10 relative."""
    from mpi4py import MPI
    from layouts import compare, token_source
    from mpipar.rules import validate
    from mpipar.training.rank import build_rank

    def two_steps(alone: bool):
        layout = validate(packed_config(**train), 1)
        rank = build_rank(layout, MPI.COMM_SELF, source=token_source(16))
        if alone:
            documents_alone(rank)
        res = [trainer.train_step(rank, k) for k in range(2)]
        out = ([r.loss for r in res], [r.grad_norm for r in res], trainer.gather_params(rank))
        trainer.close(rank)
        return out

    packed, alone = two_steps(False), two_steps(True)
    assert compare(packed, alone, 1e-10) == []
    assert packed[0][0] != pytest.approx(two_steps_plain()[0], rel=1e-6)


@functools.lru_cache(maxsize=None)
def two_steps_plain():
    from mpi4py import MPI
    from layouts import run, small_config
    losses, _, _, rank = run(small_config("float64"), MPI.COMM_SELF)
    trainer.close(rank)
    return losses


# ------------------------------------------------------------------------ --sp-split balanced
@pytest.mark.parametrize("seq,sp,min_chunk", [(104, 8, 1), (96, 4, 1), (64, 2, 1), (4096, 8, 1),
                                              (3000, 6, 1), (4096, 8, 64), (3000, 6, 64)])
def test_the_balanced_split_holds_every_token_once_and_keeps_its_bound(seq, sp, min_chunk):
    """Each rank holds seq/sp tokens, every position once; max/mean rank work <= 1 + sp h / total
    + the slack, h the heaviest of the finest chunks' work (the finest deal's max - min <= h),
    for documents of every shape: one, many short, log-normal, a giant and dust."""
    from mpipar.parallel.sequence_split import (BALANCE_SLACK, balanced_chunks, balanced_layout,
                                                rank_work, token_work)
    rng = np.random.default_rng(seq + sp)
    cases = [np.zeros((1, seq), np.int64), np.repeat(np.arange(seq), 1)[None],
             np.sort(rng.integers(0, max(1, seq // 200), seq))[None],
             np.concatenate([np.zeros(seq - seq // 10, np.int64),
                             np.arange(1, seq // 10 + 1)])[None],
             np.sort(rng.integers(0, 5, (2, seq)), axis=1)]
    per = seq // sp
    c = balanced_chunks(per, min_chunk)
    assert per // c >= min(min_chunk, per)
    for docs in cases:
        layout = balanced_layout(seq, sp, docs, min_chunk)
        held = np.concatenate([layout.positions(r) for r in range(sp)])
        assert all(len(layout.positions(r)) == per for r in range(sp))
        assert np.array_equal(np.sort(held), np.arange(seq))
        work = rank_work(layout, docs)
        heaviest = token_work(docs).reshape(sp * c, per // c).sum(axis=1).max()
        total = token_work(docs).sum()
        assert work.max() / work.mean() <= 1 + sp * heaviest / total + BALANCE_SLACK + 1e-12
        assert work.sum() == total


def test_the_balanced_split_cuts_no_finer_than_its_balance_needs():
    """A rank's share is as few runs as keep the balance within the slack of the finest deal's
    (the ring makes a kernel call per pair of runs), in chunks of at least ``min_chunk`` tokens
    (64 by default): one run a rank where every token weighs the same; short documents at seq
    128 over sp 4 (one-token chunks at the finest, with ``min_chunk`` 1) in a few runs, not
    dozens, and in one run a rank by default (32 tokens a rank); log-normal documents in fewer
    runs than the finest deal's and within its balance + the slack."""
    from mpipar.bench.documents import packed_documents
    from mpipar.parallel import sequence_split as ss
    seq, sp = 4096, 8
    layout = ss.balanced_layout(seq, sp, np.arange(seq)[None], 1)  # every token its own document
    assert [len(r) for r in layout.runs] == [1] * sp
    rng = np.random.default_rng(1)

    def finest(seq, sp, docs, min_chunk):
        """The finest deal's chunk owners, its most runs a rank and its max/mean work."""
        owner = ss._deal(ss.token_work(docs), sp, ss.balanced_chunks(seq // sp, min_chunk))
        runs = max(len(np.flatnonzero(np.diff(np.flatnonzero(owner == r)) != 1)) + 1
                   for r in range(sp))
        return runs, ss._imbalance(ss.token_work(docs), owner, sp)

    lines = np.concatenate([packed_documents(128, 30.0, 0.6, rng) for _ in range(8)])
    fine_runs, _ = finest(128, 4, lines, 1)
    assert max(len(r) for r in ss.balanced_layout(128, 4, lines, 1).runs) <= fine_runs / 2
    assert [len(r) for r in ss.balanced_layout(128, 4, lines).runs] == [1] * 4
    for seq, sp in ((8192, 4), (8192, 8), (32768, 8)):
        docs = np.concatenate([packed_documents(seq, 200, 1.0, rng) for _ in range(2)])
        layout = ss.balanced_layout(seq, sp, docs)
        fine_runs, fine_imbalance = finest(seq, sp, docs, ss.MIN_CHUNK)
        assert max(len(r) for r in layout.runs) < fine_runs
        work = ss.rank_work(layout, docs)
        assert work.max() / work.mean() <= fine_imbalance + ss.BALANCE_SLACK + 1e-12


def test_the_balanced_split_is_within_5_percent_on_log_normal_documents():
    from mpipar.bench.documents import packed_documents
    from mpipar.parallel.sequence_split import SeqLayout, balanced_layout, rank_work
    rng = np.random.default_rng(0)
    for seq, sp in ((8192, 4), (8192, 8)):
        docs = packed_documents(seq, 200, 1.0, rng)
        w = rank_work(balanced_layout(seq, sp, docs), docs)
        assert w.max() / w.mean() <= 1.05
        w = rank_work(SeqLayout(seq, sp), docs)
        assert w.max() / w.mean() > 1.05      # contiguous is not balanced on these


def test_rank_work_by_hand_windows_and_ulysses_groups():
    """Documents of 3, 5 and 8 tokens: keys a query sees 1 2 3 | 1..5 | 1..8, at most W = 4
    with a window; over sp 4 contiguous (4 tokens a rank) and in Ulysses groups (hybrid's 2
    groups of 2 ranks; Ulysses' one of 4), whose members share their group's work."""
    from mpipar.parallel.sequence_split import SeqLayout, rank_work, token_work
    docs = np.repeat([0, 1, 2], [3, 5, 8])[None]
    assert token_work(docs).tolist() == [1, 2, 3, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7, 8]
    assert token_work(docs, 4).tolist() == [1, 2, 3, 1, 2, 3, 4, 4, 1, 2, 3, 4, 4, 4, 4, 4]
    lay = SeqLayout(16, 4)
    assert rank_work(lay, docs).tolist() == [7, 14, 10, 26]
    assert rank_work(lay, docs, 4).tolist() == [7, 13, 10, 16]
    assert rank_work(lay, docs, ulysses=2).tolist() == [10.5, 10.5, 18, 18]
    assert rank_work(lay, docs, 4, ulysses=4).tolist() == [11.5] * 4
    zig = SeqLayout(16, 2, "zigzag")     # groups hold chunks of 4: {0, 3} and {1, 2}
    assert rank_work(zig, docs).tolist() == [33, 24]


# --------------------------------------------------------------------------------------- rules
@pytest.mark.parametrize("train,parallel,model,needle", [
    ({}, {"sp": 2, "sp_split": "balanced"}, {}, "needs --document-masking and --sp-mode ring"),
    ({"document_masking": True, "eos_token_id": 3},
     {"sp": 2, "sp_split": "balanced", "sp_mode": "ulysses"}, {}, "--sp-mode ring"),
    ({"eos_token_id": 3}, {}, {}, "needs --document-masking or --eod-mask-loss"),
    ({"document_masking": True}, {}, {}, "records no EOS token; give --eos-token-id"),
    ({"eod_mask_loss": True, "eos_token_id": 13}, {}, {}, "must be < model.vocab_size=13"),
    ({"document_masking": True, "eos_token_id": 3}, {},
     {"rope_type": "dynamic", "rope_factor": 2.0, "rope_original_max_positions": 8},
     "dynamic NTK"),
])
def test_bad_document_options_name_the_rule(train, parallel, model, needle):
    from layouts import small_config
    from mpipar.config import ConfigError
    from mpipar.rules import validate
    cfg = small_config("float64", **parallel)
    for obj, values in ((cfg.train, train), (cfg.model, model)):
        for name, value in values.items():
            setattr(obj, name, value)
    with pytest.raises(ConfigError, match=None) as err:
        validate(cfg, parallel.get("sp", 1))
    assert needle in str(err.value)


# ------------------------------------------------------------------------------ SFT loss masks
from small_tokenizers import tokenizer_dir  # noqa: E402,F401  (the word-level fixture)

PAIRS = [("the cat", "sat on the mat"), ("the mat", "sat"), ("cat on the", "mat on")]


def test_sft_prepare_and_loss_mask_count_completion_tokens_only(tmp_path, tokenizer_dir):
    """Words are tokens: the pairs hold 2+5, 2+2, 3+3 tokens (completions with their EOS), 17
    a round and 10 of them completion; four rounds are 68 tokens. Eight samples of 8 inputs read
    positions 0..64, whose targets are positions 1..64: 40 completion tokens less the last
    example's 3 (positions 65..67) = 37 counted targets. The step's loss is the mean of the
    per-token losses over exactly those."""
    import json
    from mpi4py import MPI
    from layouts import small_config
    from mpipar.data.sft import prepare_sft
    from mpipar.rules import validate
    from mpipar.training.batches import prepare
    from mpipar.training.rank import build_rank

    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                             for _ in range(4) for p, c in PAIRS))
    out = tmp_path / "sft.h5"
    assert prepare_sft(jsonl, out, tokenizer_dir) == (68, 12, 40)
    cfg = small_config("float64")
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.data = 7, 8, str(out)
    cfg.train.loss_mask, cfg.train.micro_batch_size = True, 8
    rank = build_rank(validate(cfg, 1), MPI.COMM_SELF)
    assert prepare(rank, rank.data.sampler, 0).divisor == 37
    inputs, targets = rank.data.sampler.batch(0)
    losses, _ = rank.model.chunks[0].forward(rank.params, inputs, np.arange(8), targets)
    completion = set()                   # stream positions of completion tokens, by hand
    at = 0
    for _ in range(4):
        for p, c in PAIRS:
            at += len(p.split())
            completion |= set(range(at, at + len(c.split()) + 1))
            at += len(c.split()) + 1
    idx = rank.data.sampler.indices(0)
    counted = np.array([[8 * i + j + 1 in completion for j in range(8)] for i in idx])
    assert counted.sum() == 37
    result = trainer.train_step(rank, 0)
    assert result.loss == pytest.approx(float(losses[counted].sum()) / 37, rel=1e-12)
    assert result.loss != pytest.approx(float(losses.mean()), rel=1e-6)
    trainer.close(rank)


def test_sft_chat_messages_mask_the_reply_rendered_by_the_chat_template(tmp_path, tokenizer_dir):
    """Template "ROLE CONTENT " per message, "assistant " as the generation prompt: the prompt
    "user the cat assistant " is 4 word tokens (roles are [UNK]), the reply "sat on the mat " 4
    plus the EOS: 9 tokens, 5 of them completion."""
    import json
    import h5py
    from mpipar.data.sft import prepare_sft
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                               "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": "the cat"},
                                              {"role": "assistant",
                                               "content": "sat on the mat"}]}) + "\n")
    assert prepare_sft(jsonl, tmp_path / "chat.h5", tokenizer_dir) == (9, 1, 5)
    with h5py.File(tmp_path / "chat.h5") as f:
        assert f["loss_mask"][:].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
        assert f["tokens"][-1] == 0                    # the EOS "</s>"


def test_a_steps_mfu_counts_attention_inside_its_documents():
    """The step's FLOPs (MFU's numerator in metrics.jsonl) under --document-masking are the
    model's with each query's keys inside its document, from the whole global batch: below the
    full causal count, and the run's constant again without masking."""
    from mpi4py import MPI
    from layouts import token_source
    from mpipar.model.attention import document_ids
    from mpipar.model.flops import model_flops_per_step
    from mpipar.observe.metrics import step_record
    from mpipar.rules import validate
    from mpipar.runtime.comm import Ledger
    from mpipar.training.rank import build_rank
    layout = validate(packed_config(), 1)
    rank = build_rank(layout, MPI.COMM_SELF, source=token_source(16))
    result = trainer.train_step(rank, 0)
    docs = document_ids(rank.data.sampler.batch(0)[0], EOS)
    assert docs.max() > 0                                   # the batch has several documents
    assert result.flops == model_flops_per_step(layout, docs) < model_flops_per_step(layout)
    ranks = [dict.fromkeys(("memory", "inter_bytes"), 0)]
    record = step_record(result, [{**ranks[0], **{k: 0.0 for k in _time_keys()},
                                   **{f"bytes_{g}": 0 for g in _groups()}}], Ledger(),
                         123.0, 1.0, False, 0)
    assert record["flops"] == result.flops
    trainer.close(rank)
    plain = build_rank(validate(packed_config(document_masking=False, eos_token_id=-1), 1),
                   MPI.COMM_SELF, source=token_source(16))
    assert trainer.train_step(plain, 0).flops is None
    trainer.close(plain)


def _time_keys():
    from mpipar.observe.metrics import TIME_KEYS
    return TIME_KEYS


def _groups():
    from mpipar.observe.metrics import GROUPS
    return GROUPS
