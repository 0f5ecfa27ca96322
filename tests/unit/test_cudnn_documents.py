"""cuDNN's ragged (THD) attention for packed documents (`kernels.cudnn_documents`), the parts that
need no device: the sequences a block's document ids make, cuDNN's ragged offsets, the buckets
that keep the graphs few, and which calls it refuses. The
device half is `tests/gpu/test_documents_gpu.py` (against numpy_ref, with `ROUTED` on)."""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.kernels import cudnn_documents as cd


def test_buckets_are_powers_of_two_above_a_floor():
    assert [cd.bucket(n, 16) for n in (0, 1, 16, 17, 100, 1024, 1025)] == \
        [16, 16, 16, 32, 128, 1024, 2048]
    assert [cd.bucket(n, 64) for n in (1, 64, 65, 2015)] == [64, 64, 128, 2048]


def test_a_hand_counted_layout():
    """Two rows of 6 tokens: documents 2, 3, 1 | 4, 2 tokens (by hand)."""
    lay = cd.ragged_batch(np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 6, 6]]))
    assert lay.documents == 5 and lay.sequences == 16 and lay.longest == 64
    assert lay.lengths.tolist() == [2, 3, 1, 4, 2] + [0] * 11
    assert lay.starts.tolist() == [0, 2, 5, 6, 10] + [12] * 11
    off = lay.offsets(8).ravel().tolist()          # 8 elements a token (e.g. 2 heads x 4)
    assert off == [0, 16, 40, 48, 80] + [96] * 11 + [96] and lay.offsets(8).dtype == np.int32
    assert lay.offsets(8).shape == (17, 1, 1, 1)
    assert lay.offsets(3).ravel().tolist()[:6] == [0, 6, 15, 18, 30, 36]   # the statistics'


def test_random_layouts_cover_every_token_once():
    """A row's first token starts a sequence even when the previous row ended in the same id;
    each sequence is one id in one row; lengths sum to the tokens; the buckets hold them."""
    rng = np.random.default_rng(7)
    for rows, seq in ((1, 1), (3, 50), (8, 300)):
        # ids non-decreasing over the rows laid end to end: a row's last document's id
        # continues into the next row
        docs = np.sort(rng.integers(0, max(2, rows * seq // 20), rows * seq)).reshape(rows, seq)
        lay = cd.ragged_batch(docs)
        assert lay.lengths.sum() == rows * seq and (lay.lengths[lay.documents:] == 0).all()
        real = lay.starts[:lay.documents]
        assert np.array_equal(real // seq, (real + lay.lengths[:lay.documents] - 1) // seq)
        ids = docs.ravel()
        for n in range(lay.documents):
            part = ids[real[n]:real[n] + lay.lengths[n]]
            assert (part == part[0]).all()
        assert lay.sequences >= lay.documents and lay.longest >= lay.lengths.max()
        assert (real % seq == 0).sum() == rows                 # every row starts one


def _refusal(docs_q, docs_k=None, q_off=0, k_off=0, causal=True, window=0, d=64, hq=4,
             hkv=2):
    b, s = docs_q.shape
    lay = cd.diagonal_batch(docs_q, docs_q if docs_k is None else docs_k)
    sk = s if docs_k is None else docs_k.shape[1]
    return cd.refusal(lay, (b, s, hq, d), (b, sk, hkv, d), q_off, k_off, causal, window)


def test_which_calls_go_to_cudnn():
    docs = np.repeat(np.arange(8), 32)[None].repeat(2, 0)
    assert _refusal(docs) is None and _refusal(docs, d=128) is None
    assert "differ" in _refusal(docs, docs[:, ::-1].copy())
    assert "differ" in _refusal(docs, docs[:, :128].copy())
    assert "own tokens" in _refusal(docs, q_off=256, k_off=0)
    assert "sliding window" in _refusal(docs, window=16)
    assert "causal" in _refusal(docs, causal=False)
    assert "head dim 72" not in str(_refusal(docs, d=72))
    assert "head dim 136" in _refusal(docs, d=136) and "head dim 60" in _refusal(docs, d=60)
    assert "int32" in _refusal(np.zeros((16, 65536), int), hq=32, d=64)
    # one long document among many one-token ones: buckets of 2048 sequences of up to 4096
    lop = np.concatenate([np.zeros(3000, int), np.arange(1, 1097)])[None]
    assert _refusal(lop) is None
    assert cd.ragged_batch(lop).sequences == 2048 and cd.ragged_batch(lop).longest == 4096


def test_layouts_need_a_two_dimensional_id_array():
    with pytest.raises(ValueError, match=r"must be \[B, S\]"):
        cd.ragged_batch(np.zeros(5, int))


def test_length_classes_by_hand():
    """One row of documents 70, 10, 200, 64, 65 tokens (starts 0, 70, 80, 280, 344): classes
    256 {200}, 128 {70, 65}, 64 {10, 64}, the longest first; a class's count bucketed from 1,
    padded with zero-length sequences at the block's end; 128-row grid tiles by hand."""
    docs = np.repeat(np.arange(5), [70, 10, 200, 64, 65])[None]
    lay = cd.ragged_batch(docs)
    got = [(g.longest, g.documents, g.sequences, g.lengths.tolist(), g.starts.tolist())
           for g in lay.groups()]
    assert got == [(256, 1, 1, [200], [80]), (128, 2, 2, [70, 65], [0, 344]),
                   (64, 2, 2, [10, 64], [70, 280])]
    assert all(g.lengths.dtype == np.int32 and g.starts.dtype == np.int64 for g in lay.groups())
    assert cd.grid_tiles((lay,)) == 16 * 2 and cd.grid_tiles(lay.groups()) == 2 + 2 + 2
    assert all(a is b for a, b in zip(lay.groups(), lay.groups()))     # made once


def test_calls_follow_grouped(monkeypatch):
    lay = cd.ragged_batch(np.repeat(np.arange(3), [5, 100, 300])[None])
    monkeypatch.setattr(cd, "GROUPED", False)
    assert cd.calls(lay) == (lay,)
    monkeypatch.setattr(cd, "GROUPED", True)
    assert cd.calls(lay) == lay.groups() and len(lay.groups()) == 3


def test_length_classes_cover_every_document_once():
    """Random packed rows: the classes' real sequences are the layout's, each exactly once; a
    class holds lengths in (longest / 2, longest] (64: 1 to 64); padding has length 0 and starts
    at the end; on a batch like the bench's (8 rows of 8192, median 200) the classes launch
    under a quarter of one call's grid."""
    from mpipar.bench.documents import packed_documents
    rng = np.random.default_rng(3)
    for rows, seq, median in ((1, 37, 5.0), (3, 700, 40.0), (8, 8192, 200.0)):
        docs = np.concatenate([packed_documents(seq, median, 1.0, rng) for _ in range(rows)])
        lay = cd.ragged_batch(docs)
        pairs = sorted((int(st), int(n)) for g in lay.groups()
                       for st, n in zip(g.starts[:g.documents], g.lengths[:g.documents]))
        assert pairs == sorted(zip(lay.starts[:lay.documents].tolist(),
                                   lay.lengths[:lay.documents].tolist()))
        for g in lay.groups():
            real = g.lengths[:g.documents]
            assert (real <= g.longest).all() and (real > (g.longest // 2 if g.longest > 64 else 0)).all()
            assert (g.lengths[g.documents:] == 0).all() and (g.starts[g.documents:] == rows * seq).all()
            assert g.sequences == cd.bucket(g.documents, 1)
        assert [g.longest for g in lay.groups()] == sorted({g.longest for g in lay.groups()},
                                                           reverse=True)
    assert cd.grid_tiles(lay.groups()) * 4 < cd.grid_tiles((lay,))


def test_tile_entries_count_the_tiles_with_a_causal_pair():
    """A tiled causal kernel's score entries on sequences each from its own tile 0: every tile
    holding at least one pair (key <= query, both inside the sequence) computed whole, against a
    brute-force walk of the tile grid; and by hand."""
    rng = np.random.default_rng(3)
    for rows, keys in ((128, 128), (128, 64), (64, 64), (16, 32), (3, 5)):
        lengths = rng.integers(1, 400, size=7)
        brute = 0
        for n in lengths:
            q, k = np.arange(n)[:, None], np.arange(n)[None, :]
            pair = k <= q
            for i in range(0, n, rows):
                for j in range(0, n, keys):
                    brute += rows * keys * bool(pair[i:i + rows, j:j + keys].any())
        assert cd.tile_entries(lengths, rows, keys) == brute
    # by hand: 200 tokens in 128 x 128 tiles: the first query tile one key tile, the second two
    assert cd.tile_entries([200], 128, 128) == 3 * 128 * 128
    assert cd.tile_entries([128, 1], 128, 64) == 2 * 128 * 64 + 128 * 64
