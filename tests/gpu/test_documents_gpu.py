"""Packed documents through the GPU kernels: the model's document-masked attention
(:func:`mpipar.model.attention.attend_fwd` / ``attend_bwd``) on the cupy backend, against
numpy_ref's document-masked attention on the host. float32/float64 go to cupy_gpu's flash
kernels, bf16 to mpipar's flash_mma (with ``cudnn_documents.ROUTED`` off, as where cuDNN's
frontend is missing; on, the default, ``auto`` sends the diagonal blocks to cuDNN's ragged
attention: `test_cudnn_ragged_documents`): both take the document ids, one launch forward and
one per gradient kernel backward, tiles with no same-document pair skipped.

float64 (cupy_gpu's exact kernels): <= 1e-12 relative, forward and backward. bf16 against
numpy_ref in float64 on the same bf16 inputs: the bf16 attention tolerances of
tests/gpu/test_cudnn_attention.py (out 4u, gradients 6u, u = 2**-9, relative over the tensor;
lse 1e-6). Rows with no visible key: out 0, lse -inf, in both. Layouts: documents of length 1,
documents longer than a tile, a query block starting mid-document (a ring hop), keys wholly
before the queries, grouped-query heads. The float kernels' document path was also checked on
the CPU under HIP-CPU (tests/unit/test_flash_hip_cpu.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

U = 2.0 ** -9


def _layout(rng, rows: int, S: int) -> np.ndarray:
    out = []
    for _ in range(rows):
        lengths = []
        while sum(lengths) < S:
            lengths.append(int(rng.choice([1, 1, 2, 7, 40, 90, 150])))
        out.append(np.repeat(np.arange(len(lengths)), lengths)[:S])
    return np.array(out)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and not np.isnan(got).any()
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    scale = np.linalg.norm(want[fin])
    return float(np.linalg.norm(got[fin] - want[fin]) / scale) if scale else 0.0


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("qs,qn,ks,kn", [(0, 300, 0, 300), (150, 150, 0, 150),
                                          (70, 97, 70, 97)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_document_masked_attention_on_the_device(monkeypatch, dtype, qs, qn, ks, kn, hq, hkv):
    from mpipar.kernels import cudnn_documents

    monkeypatch.setattr(cudnn_documents, "ROUTED", False)     # flash_mma takes every bf16 call
    _document_masked_attention(dtype, qs, qn, ks, kn, hq, hkv)


def _document_masked_attention(dtype, qs, qn, ks, kn, hq, hkv):
    """The model's document-masked attention through the cupy backend against numpy_ref, with
    the documents' calls counted (one each way, the ids in the kernel, the tables kept)."""
    import cupy
    import ml_dtypes

    from mpipar.kernels import get_backend
    from mpipar.model.attention import DocumentPositions, attend_bwd, attend_fwd
    rng = np.random.default_rng(qs + 3 * qn + 7 * ks + hq)
    S, B, D = 300, 2, 64
    docs = DocumentPositions.of(np.arange(S), _layout(rng, B, S))
    host_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float64
    q = rng.standard_normal((B, qn, hq, D)).astype(host_dtype)
    k = rng.standard_normal((B, kn, hkv, D)).astype(host_dtype)
    v = rng.standard_normal((B, kn, hkv, D)).astype(host_dtype)
    dout = rng.standard_normal((B, qn, hq, D)).astype(host_dtype)
    kb = get_backend("cupy")
    calls = []

    def counted(fn):
        def run(*a, **kw):
            calls.append("q_docs" in kw)
            return fn(*a, **kw)
        run.block_sparse_documents = getattr(fn, "block_sparse_documents", False)
        if hasattr(fn, "document_tables"):      # the seam's tables, kept per microbatch
            run.document_tables = fn.document_tables
        return run

    kb = dataclasses.replace(kb, attention_fwd=counted(kb.attention_fwd),
                             attention_bwd=counted(kb.attention_bwd))
    got = attend_fwd(kb, *(cupy.asarray(a) for a in (q, k, v)), qs, ks, 0, docs)
    marks = dict(q_docs=docs.docs[:, qs:qs + qn], k_docs=docs.docs[:, ks:ks + kn])
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    want_out, want_lse = ref.attention_fwd(*wide[:3], qs, ks, True, **marks)
    tol = {"out": 1e-12, "lse": 1e-12, "grad": 1e-12} if dtype == "float64" else \
        {"out": 4 * U, "lse": 1e-6, "grad": 6 * U}
    assert got is not None
    assert _rel(cupy.asnumpy(got[0]), want_out) <= tol["out"]
    assert _rel(cupy.asnumpy(got[1]), want_lse) <= tol["lse"]
    grads = attend_bwd(kb, *(cupy.asarray(a) for a in (q, k, v)), got[0], got[1],
                       cupy.asarray(dout), qs, ks, 0, docs)
    want = ref.attention_bwd(*wide[:3], want_out, want_lse, wide[3], qs, ks, True, **marks)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert _rel(cupy.asnumpy(g), w) <= tol["grad"], name
    # the ids in the kernel (float: cupy_gpu's; bf16: flash_mma's, as `auto` routes documented
    # calls): one call each way, the tables kept
    assert calls == [True, True]
    assert [key[0] for key in docs.memo].count("kernel_tables") == 1


@pytest.mark.parametrize("qs,qn,ks,kn", [(0, 300, 0, 300), (150, 150, 0, 150),
                                          (70, 97, 70, 97)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
@pytest.mark.parametrize("grouped", [False, True])
def test_cudnn_ragged_documents(monkeypatch, poisoned_pool, qs, qn, ks, kn, hq, hkv, grouped):
    """The same bf16 cases with `cudnn_documents.ROUTED` on (the default): the diagonal blocks
    (queries and keys the same tokens) go to cuDNN's ragged attention, one call each way, the
    others to flash_mma; the same bounds against numpy_ref, every element written (a poisoned
    pool). With `GROUPED` each way runs one cuDNN graph per length class (documents of 1 to 150
    tokens: classes 64, 128, 256), which together must write every output element."""
    from mpipar.kernels import cudnn_attention, cudnn_documents as cd
    if cudnn_attention.frontend_unavailable():
        pytest.skip(cudnn_attention.frontend_unavailable())
    ragged, graphs = [], []
    for name in ("attention_fwd", "attention_bwd"):
        def counted(*a, _fn=getattr(cd, name), **kw):
            ragged.append(_fn.__name__)
            return _fn(*a, **kw)
        monkeypatch.setattr(cd, name, counted)

    def executed(kind, layout, *a, _fn=cd._execute):
        graphs.append((kind, layout.longest))
        return _fn(kind, layout, *a)
    monkeypatch.setattr(cd, "_execute", executed)
    monkeypatch.setattr(cd, "ROUTED", True)
    monkeypatch.setattr(cd, "GROUPED", grouped)
    _document_masked_attention("bfloat16", qs, qn, ks, kn, hq, hkv)
    diagonal = qs == ks and qn == kn
    assert ragged == (["attention_fwd", "attention_bwd"] if diagonal else [])
    fwd = [n for kind, n in graphs if kind == "fwd"]
    assert fwd == [n for kind, n in graphs if kind == "bwd"]
    assert len(fwd) == (0 if not diagonal else 1 if not grouped else len(set(fwd)))
    assert not grouped or not diagonal or len(fwd) >= 2


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", [64, 128])
def test_flash_kernels_take_document_ids(poisoned_pool, dtype, d):
    """cupy_gpu's flash kernels with document ids, against numpy_ref (float64 <= 1e-12, float32
    <= 2e-6 relative): the layouts tests/unit/test_flash_hip_cpu.py runs on the CPU (ring hops,
    a window, keys after every query, not causal, documents of ~7 to ~150 tokens), every output
    element written (the pool is poisoned with NaN)."""
    import cupy

    from mpipar.kernels import cupy_gpu
    from tests.unit.test_flash_hip_cpu import _cases

    dt = np.dtype(dtype)
    tol = 1e-12 if dtype == "float64" else 2e-6
    for name, b, sq, sk, hq, hkv, qo, ko, causal, window, q_docs, k_docs in _cases():
        rng = np.random.default_rng(sq + hq + qo)
        q, dout = (rng.standard_normal((b, sq, hq, d)).astype(dt) for _ in range(2))
        k, v = (rng.standard_normal((b, sk, hkv, d)).astype(dt) for _ in range(2))
        kw = {} if q_docs is None else {"q_docs": q_docs, "k_docs": k_docs}
        out, lse = cupy_gpu.attention_fwd(*(cupy.asarray(a) for a in (q, k, v)), qo, ko,
                                          bool(causal), None, window, **kw)
        grads = cupy_gpu.attention_bwd(*(cupy.asarray(a) for a in (q, k, v)), out, lse,
                                       cupy.asarray(dout), qo, ko, bool(causal), None, window, **kw)
        wide = [a.astype(np.float64) for a in (q, k, v, dout)]
        w_out, w_lse = ref.attention_fwd(*wide[:3], qo, ko, bool(causal), None, window, **kw)
        want = (w_out, w_lse, *ref.attention_bwd(*wide[:3], w_out, w_lse, wide[3], qo, ko,
                                                 bool(causal), None, window, **kw))
        for part, g, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
            assert _rel(cupy.asnumpy(g), w) <= tol, (name, part)
