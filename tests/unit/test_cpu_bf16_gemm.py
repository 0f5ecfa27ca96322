"""bf16 GEMMs on the CPU through oneMKL (``kernels/mkl_bf16.py``, ``--cpu-bf16-gemm``).

Everywhere: the choice (CPU flags, the library's presence, what is asked for), its rule and the
backend's description. Where the mkl wheel loads (the ``[cpu-bf16]`` extra), MKL forced on
whatever the CPU is (it emulates bf16 where the CPU has no bf16 unit, with the same float32
accumulation): the GEMM against NumPy's float32 product of the bf16 operands within the bound
of two float32 sums of the same products (``mkl_bf16.gemm_bound``), the linear ops against
numpy_ref's bf16 recipe, and bf16 training steps through MKL against the float32 GEMMs within
the project's bf16 bound (1 % of a step's loss, ``tests/mpi/test_mixed_precision.py``). The
layouts through MKL are that file's.
"""
from __future__ import annotations

import numpy as np
import pytest

from layouts import run, small_config
from mpipar.config import Config, ConfigError
from mpipar.kernels import get_backend, mkl_bf16, numpy_ref as ref, with_cpu_bf16_gemm
from mpipar.rules import validate
from mpipar.training import step as trainer

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
_MISSING = mkl_bf16.unavailable_reason()
needs_mkl = pytest.mark.skipif(_MISSING is not None,
                               reason=f"{_MISSING}; {mkl_bf16.INSTALL}")
LOSS_TOLERANCE = 0.01
"""The project's bf16 bound on a step's loss (tests/mpi/test_mixed_precision.py's)."""


# ------------------------------------------------------------------------------ the choice
def test_the_choice_follows_the_cpu_flags_and_the_library(monkeypatch):
    choice = mkl_bf16.gemm_choice
    monkeypatch.setattr(mkl_bf16, "unavailable_reason", lambda: None)
    assert choice("auto", ()) == mkl_bf16.GemmChoice(
        "float32", "the CPU reports neither amx_bf16 nor avx512_bf16")
    assert choice("auto", ("amx_bf16", "avx512_bf16")) == mkl_bf16.GemmChoice(
        "mkl", "the CPU has amx_bf16 and avx512_bf16")
    assert choice("mkl", ()).reason == "asked for, on a CPU without a bf16 unit: MKL emulates it"
    assert choice("float32", ("amx_bf16",)) == mkl_bf16.GemmChoice("float32", "asked for")
    monkeypatch.setattr(mkl_bf16, "unavailable_reason", lambda: "oneMKL is not loadable (x)")
    assert choice("auto", ("avx512_bf16",)) == mkl_bf16.GemmChoice(
        "float32", "the CPU has avx512_bf16, but oneMKL is not loadable (x)")
    with pytest.raises(ValueError, match=r"not loadable \(x\); pip install 'mpipar\[cpu-bf16\]'"):
        choice("mkl", ("amx_bf16",))
    with pytest.raises(ValueError, match="bf16 GEMM 'amx': must be one of auto, mkl, float32"):
        choice("amx", ())


def test_the_cpu_flags_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert mkl_bf16.cpu_bf16_flags(str(info)) == ("amx_bf16", "avx512_bf16")
    info.write_text("flags\t\t: fpu avx2 fma\n")
    assert mkl_bf16.cpu_bf16_flags(str(info)) == ()
    assert mkl_bf16.cpu_bf16_flags(str(tmp_path / "none")) == ()


def test_the_backend_says_what_runs_its_bf16_gemms(monkeypatch):
    numpy = get_backend("numpy")
    kept = with_cpu_bf16_gemm(numpy, "float32")
    assert kept.describe() == "numpy (bf16 GEMMs: float32 BLAS on the upcast operands (asked for))"
    assert kept.linear_fwd is numpy.linear_fwd and kept.linear_bwd is numpy.linear_bwd
    monkeypatch.setattr(mkl_bf16, "cpu_bf16_flags", lambda: ())   # auto without a bf16 unit
    auto = with_cpu_bf16_gemm(numpy, "auto")
    assert auto.linear_fwd is numpy.linear_fwd
    assert auto.describe().endswith("(the CPU reports neither amx_bf16 nor avx512_bf16))")
    assert numpy.describe() == "numpy"


@pytest.mark.parametrize("changes,message", [
    (dict(cpu_bf16_gemm="mkl"), "train.cpu_bf16_gemm='mkl' chooses the bf16 GEMM of a CPU run; "
                                "this run computes in float32 on cpu: leave it auto"),
    (dict(cpu_bf16_gemm="float32", dtype="float64"), "train.cpu_bf16_gemm='float32' chooses")])
def test_an_explicit_choice_outside_a_cpu_bf16_run_is_refused(changes, message):
    cfg = Config()
    for key, value in changes.items():
        setattr(cfg.train, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


def test_mkl_without_the_library_is_refused_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(mkl_bf16, "unavailable_reason", lambda: "oneMKL is not loadable (gone)")
    cfg = Config()
    cfg.train.dtype, cfg.train.cpu_bf16_gemm = "bfloat16", "mkl"
    with pytest.raises(ConfigError, match=r"train.cpu_bf16_gemm='mkl': oneMKL is not loadable "
                                          r"\(gone\); pip install 'mpipar\[cpu-bf16\]'"):
        validate(cfg, 1)
    cfg.train.cpu_bf16_gemm = "auto"
    validate(cfg, 1)


# --------------------------------------------------------------------------------- the GEMM
def _bf16(rng, *shape):
    return rng.standard_normal(shape).astype(BF16)


@needs_mkl
def test_the_gemm_is_the_float32_product_within_the_sum_order_bound():
    rng = np.random.default_rng(5)
    for m, k, n in [(7, 13, 5), (64, 96, 48), (1, 5, 3), (5, 1, 4), (33, 200, 1)]:
        a, b = _bf16(rng, m, k), _bf16(rng, k, n)
        for x, y in [(a, b), (np.ascontiguousarray(a.T).T, b),       # transposed views
                     (a, np.ascontiguousarray(b.T).T), (a[:, ::-1], b[::-1]),   # copied
                     (np.pad(a, ((0, 0), (0, 3)))[:, :k], b)]:        # a leading dimension > k
            got = mkl_bf16.gemm(x, y)
            want = x.astype(np.float32) @ y.astype(np.float32)
            assert got.dtype == np.float32
            assert (np.abs(got - want) <= mkl_bf16.gemm_bound(x, y)).all(), (m, k, n)
        acc = np.ones((m, n), np.float32)
        mkl_bf16.gemm(a, b, out=acc, beta=1.0)
        want = a.astype(np.float32) @ b.astype(np.float32) + 1
        assert np.allclose(acc, want, rtol=0, atol=float(mkl_bf16.gemm_bound(a, b).max()) + 1e-6)
    assert mkl_bf16.gemm(_bf16(rng, 3, 0), _bf16(rng, 0, 2)).tolist() == [[0.0] * 2] * 3


def _neighbours(a, b):
    """Each element of the bf16 arrays ``a`` and ``b`` is the same value or its neighbour (the
    float32 sums of the same products, in another order, rounded once)."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    return (np.abs(a - b) <= 2.0 ** -7 * np.maximum(np.abs(a), np.abs(b))).all()


@needs_mkl
def test_the_linear_ops_follow_the_bf16_recipe():
    kb = with_cpu_bf16_gemm(get_backend("numpy"), "mkl")
    rng = np.random.default_rng(6)
    x, w, bias, dy = _bf16(rng, 2, 9, 24), _bf16(rng, 16, 24), _bf16(rng, 16), _bf16(rng, 2, 9, 16)
    y = kb.linear_fwd(x, w, bias)
    assert y.dtype == BF16 and _neighbours(y, ref.linear_fwd(x, w, bias))
    dx_t = kb.linear_fwd(dy, w.T)                       # an input gradient, w read as it lies
    assert dx_t.dtype == BF16 and _neighbours(dx_t, ref.linear_fwd(dy, w.T))
    bound = mkl_bf16.gemm_bound(dy.reshape(-1, 16).T, x.reshape(-1, 24))
    dw = np.full((16, 24), 0.5, np.float32)
    dx, same = kb.linear_bwd(dy, x, w, dw=dw)
    want_dx, want_dw = ref.linear_bwd(dy, x, w, dw=np.full((16, 24), 0.5, np.float32))
    assert same is dw and _neighbours(dx, want_dx)
    assert (np.abs(dw - want_dw) <= bound + 2.0 ** -24).all()
    none, fresh = kb.linear_bwd(dy, x, None, dw=np.zeros((16, 24), np.float32))
    assert none is None and (np.abs(fresh - (want_dw - 0.5)) <= bound).all()
    f32 = [a.astype(np.float32) for a in (x, w, bias)]   # float32 calls are the backend's own
    assert np.array_equal(kb.linear_fwd(*f32), ref.linear_fwd(*f32))


@needs_mkl
@pytest.mark.parametrize("model", ["llama", "moe"])
def test_bf16_training_through_mkl_tracks_the_float32_gemms(model):
    """Two bf16 steps of the test model, dense and with experts (its linears' and experts'
    GEMMs, input and weight gradients through MKL) against the same steps through the float32
    GEMMs: losses and gradient norms within the project's bf16 bound."""
    from mpi4py import MPI
    got = {}
    for gemm in ("mkl", "float32"):
        cfg = small_config("bfloat16", model)
        cfg.train.cpu_bf16_gemm = gemm
        losses, norms, _, rank = run(cfg, MPI.COMM_SELF, 2)
        got[gemm] = (losses, norms, rank.compute.kernels.describe())
        trainer.close(rank)
    assert "oneMKL cblas_gemm_bf16bf16f32 (asked for" in got["mkl"][2]
    assert "float32 BLAS" in got["float32"][2]
    for a, b in zip(got["mkl"][0] + got["mkl"][1], got["float32"][0] + got["float32"][1]):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(b), (got["mkl"][:2], got["float32"][:2])
