"""Packed documents inside the blockwise CPU attention (kernels/attention_cpu.py, ``q_docs`` /
``k_docs``) against numpy_ref's document-masked attention, float64 <= 1e-12, forward and
backward: random layouts with documents of length 1, documents crossing tile boundaries
(tiles of 64 positions x 128 keys at head_dim 64), blocks that start mid-document (ring and
zigzag offsets), grouped-query heads and sliding windows; the tiles skipped (tile_work); and
the documents' bounds and blocks the kernels tile by (kernels/document_spans.py). No MPI.
"""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

ac = pytest.importorskip("mpipar.kernels.attention_cpu")
from mpipar.kernels import document_spans as dl  # noqa: E402  (after the importorskip: numba is there)

from tests.unit.test_attention_cpu import inputs, rel_err  # noqa: E402


def layout(rng, rows: int, S: int) -> np.ndarray:
    """Document ids ``[rows, S]`` (non-decreasing): lengths drawn from 1 (several in a row), a
    few tokens, and documents longer than a tile, in random order."""
    out = []
    for _ in range(rows):
        lengths = []
        while sum(lengths) < S:
            lengths.append(int(rng.choice([1, 1, 1, 2, 7, 40, 90, 150])))
        out.append(np.repeat(np.arange(len(lengths)), lengths)[:S] + int(rng.integers(0, 5)))
    return np.array(out)


def check(rng, q, k, v, qs, ks, window, qd, kd):
    """The Numba kernels with documents == numpy_ref's masked attention (float64, 1e-12)."""
    kw = dict(window=window, q_docs=qd, k_docs=kd)
    out, lse = ac.attention_fwd(q, k, v, qs, ks, True, **kw)
    r_out, r_lse = ref.attention_fwd(q, k, v, qs, ks, True, **kw)
    assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12
    dout = rng.standard_normal(q.shape)
    grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, qs, ks, True, **kw)
    for g, r in zip(grads, ref.attention_bwd(q, k, v, r_out, r_lse, dout, qs, ks, True, **kw)):
        assert np.abs(g - r).max() < 1e-12 * max(np.abs(r).max(), 1.0)
    return out, lse


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(11)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
@pytest.mark.parametrize("window", [0, 33])
@pytest.mark.parametrize("qs,qn,ks,kn", [
    (0, 300, 0, 300),      # a whole packed row (its own block)
    (150, 150, 0, 150),    # ring: keys wholly before the queries, documents across the cut
    (100, 150, 130, 170),  # keys start after the first queries (rows with no key)
    (70, 97, 70, 97),      # a block starting mid-document, off the tile grid
])
def test_documents_match_the_reference(rng, hq, hkv, window, qs, qn, ks, kn):
    docs = layout(rng, 2, 300)
    q, k, v = inputs(rng, 2, qn, kn, hq, hkv, 64, np.float64)
    check(rng, q, k, v, qs, ks, window, docs[:, qs:qs + qn], docs[:, ks:ks + kn])


def test_documents_without_causality_match_the_reference(rng):
    """Non-causal (numpy_ref's contract): the document's last key bounds every query."""
    docs = layout(rng, 2, 200)
    q, k, v = inputs(rng, 2, 200, 200, 4, 2, 64, np.float64)
    kw = dict(q_docs=docs, k_docs=docs)
    out, lse = ac.attention_fwd(q, k, v, 0, 0, False, **kw)
    r_out, r_lse = ref.attention_fwd(q, k, v, 0, 0, False, **kw)
    assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12
    dout = rng.standard_normal(q.shape)
    grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, 0, 0, False, **kw)
    for g, r in zip(grads, ref.attention_bwd(q, k, v, r_out, r_lse, dout, 0, 0, False, **kw)):
        assert rel_err(g, r) < 1e-12


def test_one_document_is_plain_causal_and_single_tokens_see_themselves(rng):
    """One document: bit for bit the causal kernel; documents of one token: out = v."""
    q, k, v = inputs(rng, 1, 200, 200, 4, 2, 64, np.float64)
    one = np.zeros((1, 200), np.int64)
    got = check(rng, q, k, v, 0, 0, 0, one, one)
    plain = ac.attention_fwd(q, k, v)
    assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1])
    single = np.arange(200)[None]
    out, _ = check(rng, q, k, v, 0, 0, 0, single, single)
    assert rel_err(out, np.repeat(v, 2, axis=2)) < 1e-12


def test_zigzag_blocks_with_documents_merge_to_the_whole_row(rng):
    """A zigzag rank's two chunks against every chunk (documents across chunk ends), merged by
    log-sum-exp, equal numpy_ref's masked attention over the whole row; the blocks' backward
    with the merged out/lse sums to its gradients."""
    S, c = 320, 40
    docs = layout(rng, 1, S)
    q, k, v = inputs(rng, 1, S, S, 4, 2, 64, np.float64)
    dout = rng.standard_normal(q.shape)
    kw = dict(q_docs=docs, k_docs=docs)
    r_out, r_lse = ref.attention_fwd(q, k, v, **kw)
    r_dq, _, _ = ref.attention_bwd(q, k, v, r_out, r_lse, dout, **kw)
    for qi in (1, S // c - 2):  # rank 1 of sp = 4 holds chunks 1 and 6
        qc = slice(qi * c, (qi + 1) * c)
        out, lse = np.zeros_like(q[:, qc]), np.full((1, 4, c), -np.inf)
        dq = np.zeros_like(q[:, qc])
        for ki in range(S // c):
            kc = slice(ki * c, (ki + 1) * c)
            dk = dict(q_docs=docs[:, qc], k_docs=docs[:, kc])
            out, lse = ref.attention_merge(out, lse, *ac.attention_fwd(
                q[:, qc], k[:, kc], v[:, kc], qi * c, ki * c, **dk))
            dq += ac.attention_bwd(q[:, qc], k[:, kc], v[:, kc], r_out[:, qc], r_lse[:, :, qc],
                                   dout[:, qc], qi * c, ki * c, **dk)[0]
        assert rel_err(out, r_out[:, qc]) < 1e-12 and rel_err(lse, r_lse[:, :, qc]) < 1e-12
        assert rel_err(dq, r_dq[:, qc]) < 1e-12


def test_bf16_runs_the_float32_kernel_on_the_upcast_inputs(rng):
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    docs = layout(rng, 1, 150)
    q, k, v = (a.astype(bf16) for a in inputs(rng, 1, 150, 150, 4, 2, 64, np.float32))
    out, lse = ac.attention_fwd(q, k, v, q_docs=docs, k_docs=docs)
    up = (a.astype(np.float32) for a in (q, k, v))
    o32, l32 = ac.attention_fwd(*up, q_docs=docs, k_docs=docs)
    assert out.dtype == bf16 and np.array_equal(out, o32.astype(bf16)) and np.array_equal(lse, l32)


def test_tiles_with_no_same_document_pair_are_skipped():
    """tile_work with documents: single-token documents compute one score per query; documents
    of 200 tokens compute their causal squares and at most half a segment more a query (under
    1.2 x the pairs, against 10 x for the causal square); a key block of other documents
    computes nothing."""
    S = 2048
    assert ac.tile_work(S, S, 64, q_docs=np.arange(S)[None], k_docs=np.arange(S)[None])[1] == S
    docs = (np.arange(S) // 200)[None]
    pairs = sum(n * (n + 1) // 2 for n in np.bincount(docs[0]))
    _, entries = ac.tile_work(S, S, 64, q_docs=docs, k_docs=docs)
    full = ac.tile_work(S, S, 64)[1]
    assert pairs <= entries <= pairs + S * ac.SEGMENT // 2 and entries < 1.2 * pairs < 0.12 * full
    assert ac.tile_work(64, 64, 64, 200, 0, q_docs=docs[:, 1000:1064],
                        k_docs=docs[:, :64]) == (0, 0)


def test_keys_transposed_in_the_tasks_equal_one_transposition(rng):
    """The forward reads K^T two ways: each task transposes the key blocks it reads, or reads one
    K^T of the call (made for the keys those tasks read, `kt_keys`). Every task one way, every
    task the other, or alternate blocks each way: all give numpy_ref's attention (float64,
    1e-12).
    Without documents a call takes its tasks' own blocks only when they read each key at most 8
    times (not full causal)."""
    S, hq, hkv = 300, 4, 2
    docs = layout(rng, 2, S)
    q, k, v = inputs(rng, 2, S, S, hq, hkv, 64, np.float64)
    r_out, r_lse = ref.attention_fwd(q, k, v, q_docs=docs, k_docs=docs)
    klo, khi, qend = dl.document_bounds(docs, docs, 2, S, S)
    bq, bk = ac.tile_sizes(64)
    st = dl.document_blocks(qend, bq)[0]
    vis = dl.visible_keys(klo, khi, 0, 0, True, 0)
    # C-contiguous like the engine's plans: another array layout is another kernel signature
    # (a compile of its own)
    short = np.ascontiguousarray(np.broadcast_to(np.arange(st.shape[1] - 1) % 2 == 0,
                                                 (2, st.shape[1] - 1)))
    for owned in (np.ones_like(short), np.zeros_like(short), short, ~short):
        out, lse = np.empty(q.shape), np.empty((2, hq, S))
        kt = ac._heads_major(k, ac._row_stride(S, 8), ac.kt_keys(klo, khi, st, owned, S))
        ac._attention_fwd(q, kt, k, owned, v, 0, 0, True, 0, klo, khi, qend, 0.125, st,
                          ac.work_shares(vis, st, hkv, owned),
                          ac.work_shares(vis, st, hkv, ~owned, heads_outer=True), bk, out, lse)
        assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12
    assert ac._local_keys(klo, khi, bq)
    assert not ac._local_keys(*dl.document_bounds(None, None, 1, 4096, 4096)[:2], bq)
    assert not ac._local_keys(*dl.document_bounds(*[(np.arange(4096) // 2048)[None]] * 2, 1, 4096, 4096)[:2], bq)


def test_key_plan_transposes_one_kt_only_for_blocks_of_long_documents(rng):
    """With documents the forward's tasks transpose their own key blocks when their documents
    hold at most OWN_KEYS keys (with a window, within its reach), and one K^T of the call is made
    only when some block's hold more; without documents the call-level rule holds (full causal 4096: one
    K^T). A row mixing a long document with short ones (some tasks reading K^T,
    the others their own blocks) equals numpy_ref (float64, 1e-12)."""
    bq = ac.tile_sizes(64)[0]
    long_doc = ac.OWN_KEYS + 300

    def plan(docs, S, **kw):
        klo, khi, qend = dl.document_bounds(docs, docs, 1, S, S)
        st = dl.document_blocks(qend, bq)[0]
        owned = ac.key_plan(klo, khi, st, bq, docs is not None, kw.get("window", 0))
        assert owned.shape == (1, st.shape[1] - 1)
        return bool(owned.all()), bool(owned.any())

    assert plan((np.arange(4096) // ac.OWN_KEYS)[None], 4096) == (True, True)
    assert plan((np.arange(4096) // (ac.OWN_KEYS + 64))[None], 4096) == (False, True)  # 2112 + 1984
    assert plan(np.zeros((1, 4096), int), 4096) == (False, False)
    # a window of OWN_KEYS - 64 keys keeps every block of a long document within OWN_KEYS
    assert plan((np.arange(4096) // 4096)[None], 4096, window=ac.OWN_KEYS - 64) == (True, True)
    assert plan(None, 4096) == (False, False)
    assert plan(None, 512) == (True, True)

    lengths = [40, long_doc, 3, 200, 129]
    docs = np.repeat(np.arange(len(lengths)), lengths)[None]
    S = docs.shape[1]
    assert plan(docs, S) == (False, True)
    q, k, v = inputs(rng, 1, S, S, 2, 1, 64, np.float64)
    kw = dict(q_docs=docs, k_docs=docs)
    out, lse = ac.attention_fwd(q, k, v, **kw)
    r_out, r_lse = ref.attention_fwd(q, k, v, **kw)
    assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_key_blocks_transpose_exactly(rng, dtype):
    """`_key_block` (tiles transposed in vector registers, then the last keys and dims) copies
    K^T exactly: block lengths 1, 3, 4, 7, 8, 9, 64, 90 and 128 at any start, into a buffer wider
    than the block, for head dims 64, 12 (not a multiple of 8) and 3 (below a tile)."""
    for d in (64, 12, 3):
        x = rng.standard_normal((2, 300, 3, d)).astype(dtype)
        xt = np.full((d, 128), np.nan, dtype)
        for j0, nk in ((0, 1), (2, 3), (1, 4), (5, 7), (9, 8), (100, 9), (3, 64), (171, 90), (172, 128)):
            ac._key_block(x, 1, 2, j0, nk, xt)
            assert np.array_equal(xt[:, :nk], x[1, j0:j0 + nk, 2].T), (d, j0, nk)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_short_documents_on_the_tasks_own_key_blocks(rng, dtype):
    """Documents of 1, 5, 64 (a query block), 65, 128 (a key block) and 200 tokens: the call
    takes the short-documents path (each forward task transposes the key blocks it reads, the
    backward each span's K and V blocks, `_key_block`) and equals numpy_ref (float64 1e-12,
    float32 1e-5 relative)."""
    lengths = [1, 5, 64, 1, 1, 65, 128, 30, 200, 7]
    docs = np.repeat(np.arange(len(lengths)), lengths)[None]
    S = docs.shape[1]
    q, k, v = inputs(rng, 1, S, S, 4, 2, 64, dtype)
    klo, khi, qend = dl.document_bounds(docs, docs, 1, S, S)
    bq = ac.tile_sizes(64)[0]
    assert ac.key_plan(klo, khi, dl.document_blocks(qend, bq)[0], bq, True, 0).all()
    tol = 1e-12 if dtype == np.float64 else 1e-5
    kw = dict(q_docs=docs, k_docs=docs)
    out, lse = ac.attention_fwd(q, k, v, **kw)
    r_out, r_lse = ref.attention_fwd(q, k, v, **kw)
    assert rel_err(out, r_out) < tol and rel_err(lse, r_lse) < tol
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, **kw)
    for g, r in zip(grads, ref.attention_bwd(q, k, v, r_out, r_lse, dout, **kw)):
        assert g.dtype == dtype and rel_err(g, r) < tol


@pytest.mark.parametrize("qs,qn,ks,kn,docs,rows", [
    (150, 150, 0, 300, True, 2),   # ring: keys of documents before every query's (none sees them)
    (100, 150, 130, 170, True, 2),  # rows with no key; the last span owns the keys to Sk
    (0, 200, 0, 200, False, 2),    # no documents: one span owns every key
    (0, 200, 0, 200, False, 1),    # one span: two threads' runs start at its two kv heads
])
def test_backward_tasks_fill_every_row_of_their_outputs(rng, monkeypatch, qs, qn, ks, kn, docs, rows):
    """The backward's outputs start uninitialised and its tasks zero the rows they own
    (`_own_rows`: dq and delta of their queries, dk and dv of the keys from their first query's
    document to the next span's; the first task of a span in a thread's run does it for the
    span's kv heads in that run): with the buffers poisoned (NaN) every gradient still equals
    numpy_ref's (float64, 1e-12), keys that no query sees included (0), at every thread count
    (runs that start at a span's second kv head included)."""
    numba = pytest.importorskip("numba")
    made = ac._bwd_outputs
    monkeypatch.setattr(ac, "_bwd_outputs", lambda *a: tuple(x.fill(np.nan) or x for x in made(*a)))
    ids = layout(rng, rows, 300)
    q, k, v = inputs(rng, rows, qn, kn, 4, 2, 64, np.float64)
    kw = dict(q_docs=ids[:, qs:qs + qn], k_docs=ids[:, ks:ks + kn]) if docs else {}
    r_out, r_lse = ref.attention_fwd(q, k, v, qs, ks, True, **kw)
    dout = rng.standard_normal(q.shape)
    expect = ref.attention_bwd(q, k, v, r_out, r_lse, dout, qs, ks, True, **kw)
    for _ in _thread_counts(numba):
        grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, qs, ks, True, **kw)
        for g, r in zip(grads, expect):
            assert rel_err(g, r) < 1e-12


def test_document_bounds_equal_their_definition(rng):
    """`document_bounds` (one merge pass per row, `_bounds`) against its definition by binary
    search: klo / khi the first key whose id is >= / > the query's, qend the first query whose
    id is >; random rows of ids with gaps, empty documents on either side and unequal lengths."""
    for _ in range(200):
        b, sq, sk = (int(x) for x in rng.integers(1, 40, 3))
        qd = np.sort(rng.integers(0, 9, (b, sq)), axis=1)
        kd = np.sort(rng.integers(0, 9, (b, sk)), axis=1)
        klo, khi, qend = dl.document_bounds(qd, kd, b, sq, sk)
        for r in range(b):
            assert (klo[r] == np.searchsorted(kd[r], qd[r], "left")).all()
            assert (khi[r] == np.searchsorted(kd[r], qd[r], "right")).all()
            assert (qend[r] == np.searchsorted(qd[r], qd[r], "right")).all()


def test_bad_documents_raise(rng):
    q, k, v = inputs(rng, 1, 10, 10, 2, 2, 8, np.float64)
    up = np.arange(10)[None]
    for qd, kd in ((up, None), (up[:, ::-1], up), (up, up[:, :9])):
        with pytest.raises(ValueError, match="docs|document"):
            ac.attention_fwd(q, k, v, q_docs=qd, k_docs=kd)


EDGES = [200, 50, 10, 10] + [1] * 100 + [64, 65, 1, 128, 129, 2, 300, 7, 1, 1]  # see below


def test_blocks_start_at_documents_and_cut_long_ones_evenly():
    """document_blocks: blocks of at most `size` that cover the row in order, each inside one
    document or made of whole documents; a document longer than size in ceil(L / size) blocks
    of its own that differ by at most one position; with whole=True only whole documents (a
    long one alone). Also for a block that starts mid-document (ring hops)."""
    docs = np.repeat(np.arange(len(EDGES)), EDGES)[None]
    for row in (docs, docs[:, 130:]):
        ends = dl.document_bounds(row, row, 1, row.shape[1], row.shape[1])[2]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(row[0])) + 1])
        for size, whole in ((64, False), (128, False), (256, True)):
            cuts, nb = dl.document_blocks(ends, size, whole)
            cuts = cuts[0, :nb[0] + 1]
            assert cuts[0] == 0 and cuts[-1] == row.shape[1] and (np.diff(cuts) > 0).all()
            for i0, i1 in zip(cuts[:-1], cuts[1:]):
                one = row[0, i0] == row[0, i1 - 1]
                assert one or (ends[0, i1 - 1] == i1 and (i0 == 0 or row[0, i0 - 1] != row[0, i0]))
                length = ends[0, i0] - (starts[starts <= i0].max() if i0 else 0)
                if whole:
                    assert (i0 == 0 or row[0, i0 - 1] != row[0, i0]) and (i1 - i0 <= size or one)
                else:
                    assert i1 - i0 <= size
                    if one and length > size:       # a long document's blocks: nearly equal
                        inside = np.diff(cuts[(cuts >= ends[0, i0] - length) & (cuts <= ends[0, i0])])
                        assert len(inside) == -(-length // size) and np.ptp(inside) <= 1
    assert dl.document_blocks(np.full((1, 200), 200), 64)[0].tolist() == [[0, 50, 100, 150, 200]]


@pytest.mark.parametrize("own_keys", [ac.OWN_KEYS, 100, 0])
@pytest.mark.parametrize("window", [0, 70])
@pytest.mark.parametrize("qs,qn,ks,kn", [(0, 1068, 0, 1068), (130, 300, 0, 430), (200, 500, 150, 550)])
def test_tiles_at_document_edges_match_the_reference(rng, monkeypatch, own_keys, window, qs, qn, ks, kn):
    """Documents of 1 (a run of 100: several packed blocks), 64, 65, 128, 129 and 300 tokens
    (one tile, one more than a tile, longer than the backward's spans), 200 + 50 + 10 + 10 (a
    packed query block across the end of a backward span), whole rows and blocks that start
    mid-document (ring hops), with and without a window: numpy_ref's attention. With the
    forward's blocks transposing their own keys up to OWN_KEYS, 100 (a mix: the longer documents'
    blocks read a K^T made for their keys only, `kt_keys`) or 0 (every block reads it)."""
    monkeypatch.setattr(ac, "OWN_KEYS", own_keys)
    docs = np.repeat(np.arange(len(EDGES)), EDGES)[None]
    q, k, v = inputs(rng, 1, qn, kn, 4, 2, 64, np.float64)
    check(rng, q, k, v, qs, ks, window, docs[:, qs:qs + qn], docs[:, ks:ks + kn])


def _thread_counts(numba):
    """Each thread count from 1 to Numba's pool size, set in turn (`work_shares` cuts by
    `get_num_threads`); the caller's count restored after."""
    before = numba.get_num_threads()
    try:
        for threads in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(threads)
            yield threads
    finally:
        numba.set_num_threads(before)


def test_work_shares_split_tasks_by_work():
    """One run of consecutive tasks per thread, covering all, of nearly equal work: one long
    document among short ones splits between its heads instead of going to one thread."""
    numba = pytest.importorskip("numba")
    docs = np.repeat(np.arange(12), [50] * 5 + [2000] + [50] * 6)[None]
    S = docs.shape[1]
    klo, khi, qend = dl.document_bounds(docs, docs, 1, S, S)
    rows = dl.visible_keys(klo, khi, 0, 0, True, 0)
    spans, nspan = dl.document_blocks(qend, ac.SPAN, True)
    for threads in _thread_counts(numba):
        shares = ac.work_shares(rows, spans, 4)
        cost = np.repeat([(rows[0, a:b] + 16).sum() for a, b in zip(spans[0, :-1], spans[0, 1:])], 4)
        work = [cost[a:b].sum() for a, b in zip(shares[:-1], shares[1:])]
        assert shares[0] == 0 and shares[-1] == cost.size and len(work) == threads
        assert max(work) - min(work) <= cost.max()   # within half a task of the mean each


def test_forward_kt_tasks_split_by_work_in_head_order():
    """The forward's tasks that read K^T run apart from the others (`_attention_fwd`'s second
    phase), in the order (sequence, kv head, block), cut by `work_shares(..., heads_outer=True)`
    into runs of nearly equal work counting those tasks only: rows whose long documents differ
    (one long document, one mixed with short ones, one of short ones only) still give each
    thread its share, within one task."""
    numba = pytest.importorskip("numba")
    S, heads = 3200, 2
    docs = np.stack([np.zeros(S, np.int64), np.repeat(np.arange(13), [2600] + [50] * 12),
                     np.arange(S) // 50])
    klo, khi, qend = dl.document_bounds(docs, docs, 3, S, S)
    bq = ac.tile_sizes(64)[0]
    starts, nb = dl.document_blocks(qend, bq)
    owned = ac.key_plan(klo, khi, starts, bq, True, 0)
    kt = ~owned[:, :nb.max()] & (np.arange(nb.max()) < nb[:, None])   # blocks reading K^T
    assert kt[0, :nb[0]].all() and kt[1].any() and not kt[1].all() and not kt[2].any()
    rows = dl.visible_keys(klo, khi, 0, 0, True, 0)
    block = np.array([np.diff(np.concatenate([[0], np.cumsum(r + 16)])[s]) for r, s in zip(rows, starts)])
    cost = np.concatenate([np.tile(np.where(~owned[b], block[b], 0), heads) for b in range(3)])
    for threads in _thread_counts(numba):
        shares = ac.work_shares(rows, starts, heads, ~owned, heads_outer=True)
        work = [cost[a:b].sum() for a, b in zip(shares[:-1], shares[1:])]
        assert shares[0] == 0 and shares[-1] == cost.size and len(work) == threads
        assert max(work) - min(work) <= cost.max()
