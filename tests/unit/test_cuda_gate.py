"""The CUDA compile gate (mpipar.kernels.cuda_gate): the shipped sources pass it for sm_80 and
sm_90 with 0 spill bytes, and it fails, with the reason, on a syntax error, a spill, local
stack, static shared memory over 48 KiB and dynamic shared memory over the architecture's limit.
Compiling needs CuPy and NVRTC (the ``cuda-compile`` extra), no GPU; those tests are skipped
with the reason where they do not import."""
from __future__ import annotations

import json
import sys
import types

import pytest

from mpipar.kernels import cuda_gate


def _toolchain_reason() -> str | None:
    try:
        cuda_gate.toolchain()
    except cuda_gate.GateUnavailable as exc:
        return str(exc)
    return None


needs_nvrtc = pytest.mark.skipif(_toolchain_reason() is not None,
                                 reason=f"no NVRTC toolchain: {_toolchain_reason()}")

GOOD = r"""
template<typename T> __global__ void scale(T* y, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
"""
SYNTAX = 'extern "C" __global__ void broken(float* y) { y[0] = 1.0f }\n'
# 32 registers at most (1024 threads, 2 blocks an SM) for 48 live values squared: spills.
SPILL = r"""
extern "C" __global__ void __launch_bounds__(1024, 2) spill(const float* x, float* y) {
    float a[48];
#pragma unroll
    for (int i = 0; i < 48; ++i) a[i] = x[threadIdx.x + i * 1024];
    float s = 0;
#pragma unroll
    for (int i = 0; i < 48; ++i)
#pragma unroll
        for (int j = 0; j < 48; ++j) s += a[i] * a[(i * 7 + j) % 48];
#pragma unroll
    for (int i = 0; i < 48; ++i) y[threadIdx.x + i * 1024] = a[i] * s;
}
"""
# A local array indexed at run time lives in local memory (a stack frame), spilled or not.
STACK = r"""
extern "C" __global__ void stack(const float* x, const int* idx, float* y) {
    float a[64];
    for (int i = 0; i < 64; ++i) a[i] = x[threadIdx.x * 64 + i];
    for (int i = 0; i < 64; ++i) a[idx[i] & 63] += a[i];
    y[threadIdx.x] = a[idx[threadIdx.x] & 63];
}
"""
SHARED = r"""
template<int N> __global__ void tile(float* y) {
    __shared__ float t[N];
    t[threadIdx.x] = threadIdx.x;
    __syncthreads();
    y[threadIdx.x] = t[N - 1 - threadIdx.x];
}
"""


def _source(code: str, names: tuple[str, ...], dynamic: dict | None = None) -> dict:
    return {"name": "fake", "code": code, "names": names, "options": ("--std=c++17",),
            "dynamic_smem": dynamic or {}}


def _gate_on(monkeypatch, *sources: dict) -> None:
    """Make the gate see only a module whose cuda_sources() returns `sources`."""
    module = types.ModuleType("mpipar_gate_fake")
    module.cuda_sources = lambda: list(sources)
    monkeypatch.setitem(sys.modules, "mpipar_gate_fake", module)
    monkeypatch.setattr(cuda_gate, "MODULES", ("mpipar_gate_fake",))


@needs_nvrtc
def test_shipped_sources_pass(tmp_path, capsys):
    """Every shipped kernel compiles for sm_80 and sm_90 without spills; the float32/float64
    flash kernels for every head dim the product uses are among them."""
    from mpipar.kernels import cupy_gpu, flash_exact

    path = tmp_path / "gate.json"
    assert cuda_gate.main(["--arch", "sm_80,sm_90", "--json", str(path)]) == 0, \
        capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["ok"] and report["archs"] == ["sm_80", "sm_90"]
    kernels = report["kernels"]
    assert all(k["spill_stores"] == 0 == k["spill_loads"] and k["stack_bytes"] == 0
               and 0 < k["registers"] <= 255 and not k["problems"] for k in kernels)
    names = {(k["arch"], k["name"]) for k in kernels}
    for arch in ("sm_80", "sm_90"):
        for ctype in ("float", "double"):
            for d in flash_exact.HEAD_DIMS:
                for name in flash_exact._flash_names(ctype, d):
                    assert (arch, name) in names
        for name in cupy_gpu._rows_names():
            assert (arch, name) in names


@needs_nvrtc
@pytest.mark.parametrize("d", (64, 128))
def test_unaligned_document_tiles_compile_like_the_aligned(d):
    """flash_mma's document kernels with `DOC_TILES_ALIGNED` off (the module the runtime compiles
    then, `_options(False)`) pass the gate on sm_90 with the registers of the aligned build."""
    from mpipar.kernels import flash_mma

    assert "#ifndef MPIPAR_DOC_TILES_ALIGNED" in flash_mma._SOURCE
    assert flash_mma._options(False)[-1] == "-DMPIPAR_DOC_TILES_ALIGNED=0"
    for role in ("fwd_docs", "dq_docs", "dkdv_docs"):
        src = flash_mma.role_source(d, role)
        regs = {}
        for aligned in (True, False):
            reports = cuda_gate.compile_source({**src, "options": flash_mma._options(aligned)},
                                               "sm_90")
            assert len(reports) == len(src["names"])
            assert all(not r.problems() and r.spill_stores == 0 == r.stack_bytes for r in reports)
            regs[aligned] = sorted(r.registers for r in reports)
        assert regs[False] == regs[True], role


@needs_nvrtc
def test_good_kernel_passes(monkeypatch, capsys):
    """The control for the failures below: the same harness passes a sound kernel."""
    _gate_on(monkeypatch, _source(GOOD, ("scale<float>", "scale<double>")))
    assert cuda_gate.main(["--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "scale<double>" in out and "0 of 2 kernels fail" in out


@needs_nvrtc
@pytest.mark.parametrize("code,names,dynamic,why", [
    (SYNTAX, ("broken",), None, 'error: expected a ";"'),
    (SPILL, ("spill",), None, "spills"),
    (STACK, ("stack",), None, "local stack"),
    (SHARED, ("tile<12289>",), None, "uses too much shared data"),
    (SHARED, ("tile<1024>",), {"tile<1024>": 232448}, "shared memory 4096 + 232448 B > 232448"),
], ids=["syntax", "spill", "stack", "static-smem", "dynamic-smem"])
def test_gate_fails(monkeypatch, capsys, code, names, dynamic, why):
    """A broken kernel string makes the gate exit non-zero and say why."""
    _gate_on(monkeypatch, _source(code, names, dynamic))
    assert cuda_gate.main(["--arch", "sm_90"]) == 1
    out = capsys.readouterr().out
    assert why in out and "FAIL: 1 of 1 kernels fail" in out


@needs_nvrtc
def test_static_smem_at_the_limit_passes():
    """48 KiB of static shared memory is allowed; one float more is not (previous test)."""
    [report] = cuda_gate.compile_report("sm_80", [_source(SHARED, ("tile<12288>",))])
    assert report.static_smem == 48 * 1024 and report.problems() == []


@needs_nvrtc
def test_missing_module_is_a_note(monkeypatch, capsys):
    _gate_on(monkeypatch, _source(GOOD, ("scale<float>",)))
    monkeypatch.setattr(cuda_gate, "MODULES", ("mpipar_gate_fake", "mpipar.kernels.not_there"))
    assert cuda_gate.main(["--arch", "sm_80"]) == 0
    assert "note: mpipar.kernels.not_there: not present, skipped" in capsys.readouterr().out


def test_bad_protocol_is_refused():
    with pytest.raises(ValueError, match="'names' must be a tuple"):
        cuda_gate.check_source(dict(_source(GOOD, ()), names=["scale<float>"]))
    with pytest.raises(ValueError, match="names no kernel"):
        cuda_gate.check_source(_source(GOOD, ()))


def test_without_toolchain_exits_2(monkeypatch, capsys):
    def unavailable():
        raise cuda_gate.GateUnavailable("no NVRTC here")

    monkeypatch.setattr(cuda_gate, "toolchain", unavailable)
    assert cuda_gate.main(["--arch", "sm_90"]) == 2
    assert "no NVRTC here" in capsys.readouterr().err


def test_parse_ptxas():
    """ptxas -v lines -> numbers per entry; a non-inlined device function's frame is not the
    entry's."""
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperv
ptxas         .     64 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'
ptxas info    : Function properties for _Z1kPf
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 32768 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'plain' for 'sm_90'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]
"""
    assert cuda_gate.parse_ptxas(log) == {
        "_Z1kPf": {"registers": 80, "spill_stores": 4, "spill_loads": 12, "stack_bytes": 16,
                   "static_smem": 32768},
        "plain": {"registers": 12, "spill_stores": 0, "spill_loads": 0, "stack_bytes": 0,
                  "static_smem": 0}}


def test_smem_limits():
    assert cuda_gate.smem_limit("sm_80") == 166912
    assert cuda_gate.smem_limit("sm_90") == cuda_gate.smem_limit("sm_90a") == 232448
    assert cuda_gate.smem_limit("sm_89") == 101376


def test_flash_config():
    """The float32/float64 flash kernels' layout (pure): lanes per row a power of two <= 32
    dividing head_dim, at most 16 (float32) or 8 (float64) elements a lane, and the kernels'
    static tiles (two of [tile, head_dim], plus two [tile] statistics) within 48 KiB, and the
    document kernels' tiles no larger (a fixed 32 failed ptxas for float64 at D 96/128)."""
    from mpipar.kernels import flash_exact

    for itemsize, per_lane in ((4, 16), (8, 8)):
        for d in flash_exact.HEAD_DIMS:
            lanes, tile = flash_exact.flash_config(d, itemsize)
            assert lanes in (1, 2, 4, 8, 16, 32) and d % lanes == 0 and d // lanes <= per_lane
            assert 2 * tile * d * itemsize + 2 * tile * itemsize <= cuda_gate.STATIC_SMEM_LIMIT
            doc_lanes, doc_tile, _ = flash_exact.launch_config(d, itemsize, documents=True)
            assert doc_lanes == lanes and doc_tile <= tile
    with pytest.raises(ValueError, match="head_dim=24"):
        flash_exact.flash_config(24, 4)
