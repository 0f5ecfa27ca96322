"""flash_mma's bf16 tensor-core kernels (their CUDA source, `flash_mma_cuda.SOURCE`) run on the CPU
under HIP-CPU, against numpy_ref in float64 on the same bf16 inputs: a check of the kernels'
logic (blocks, tiles, masks, packed documents, the first document tile aligned or not) on a
machine with no GPU, beside tests/unit/test_flash_hip_cpu.py's for the float kernels, with the
same requirements (``MPIPAR_HIP_CPU``, g++, libtbb-dev; skipped without them, as in CI).

The source's PTX building blocks are swapped for C++ that does what each instruction does, for
one warp of 32 lanes: `ldmatrix` (x2, x4, .trans) and `mma.sync.m16n8k16` bf16 -> float32 hand
their fragments between the warp's lanes through a per-warp exchange with a barrier of the
warp's 32 threads (fragment layouts of the PTX ISA), `__shfl_xor_sync` the same way, `cp.async`
is a plain 16-byte copy (zero-filled when not valid), `cvt.rn.bf16x2.f32` rounds to nearest
even, `ex2.approx` is exp2. Everything else (the kernels, their tile loops, masks, document
bounds and skips) is the source as NVRTC compiles it. A final block barrier after each kernel
lets HIP-CPU's fibers end in one turn; the barriers' counters restart with each block (kernels
of other block sizes share an OS thread's fibers). What it cannot show is speed, or a race the fibers' order
hides; the device's tests/gpu/test_flash_mma.py run the same kernels through CuPy."""
from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

from mpipar.kernels import flash_mma, numpy_ref as ref
from mpipar.kernels.flash_mma_cuda import SOURCE
from tests.gpu.test_flash_mma import LSE_TOL, TOL, _rel   # the device test's bounds and measure
from tests.unit import test_flash_hip_cpu as hip_cpu

# g++ builds each kernel set in about a minute; on a loaded machine (CI's eight ranks beside it)
# well past the suite's 300 s per test
pytestmark = [hip_cpu.pytestmark, pytest.mark.timeout(1800)]


_EMULATION = r"""
#include <cstdint>
#include <cstring>
namespace mpipar_emu {
namespace {
typedef unsigned int u32;
inline float as_f(u32 x) { float f; std::memcpy(&f, &x, 4); return f; }
inline u32 as_u(float f) { u32 x; std::memcpy(&x, &f, 4); return x; }
// This block's dynamic shared memory: one OS thread runs a block's fibers at a time.
inline unsigned char* shared_base() {
    alignas(16) static thread_local unsigned char mem[233472];
    return mem;
}
inline unsigned char* at(u32 a) { return shared_base() + a; }
// What a warp's lanes hand each other: 8 words a lane, 32 lanes, 32 warps.
inline u32* slot(int lane) {
    static thread_local u32 s[32 * 32 * 8];
    return s + ((threadIdx.x >> 5) * 32 + lane) * 8;
}
// Barriers (as mpipar_hip::sync): a fiber waits, yielding, until the group's threads have all
// arrived; the group's first thread, which runs first in every turn, releases them, so all leave
// in one turn. Counters per block: group g's arrivals and releases, [0] the block, [1 + w] warp
// w; thread 0, which starts every block, zeroes them (kernels of other block sizes run on the
// same OS thread: counters left by one would release the next's barriers early).
inline unsigned long long* counters() {
    static thread_local unsigned long long c[2][33];
    return &c[0][0];
}
inline void block_begin() {
    if (threadIdx.x == 0) std::memset(counters(), 0, 2 * 33 * sizeof(unsigned long long));
}
inline void group_sync(int g, unsigned long long n, bool first) {
    unsigned long long* arrived = counters() + g;
    unsigned long long* released = counters() + 33 + g;
    const unsigned long long gen = *arrived / n + 1;
    ++*arrived;
    while (true) {
        if (first && *arrived >= gen * n) *released = gen;
        if (*released >= gen) return;
        hip::detail::Tile::this_tile().barrier();
    }
}
inline void block_sync() { group_sync(0, blockDim.x, threadIdx.x == 0); }
inline void warp_sync() { group_sync(1 + (threadIdx.x >> 5), 32, (threadIdx.x & 31) == 0); }
// ldmatrix .m8n8 x n: matrix i's rows at the addresses of lanes 8i .. 8i + 7; lane 4g + c gets
// row g, columns 2c, 2c + 1 (trans: rows 2c, 2c + 1 of column g).
inline void ldsm(u32* r, u32 addr, int n, bool trans) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    slot(lane)[0] = addr;
    warp_sync();
    for (int i = 0; i < n; ++i) {
        if (!trans) {
            std::memcpy(&r[i], at(slot(8 * i + g)[0]) + 4 * c, 4);
        } else {
            std::uint16_t lo, hi;
            std::memcpy(&lo, at(slot(8 * i + 2 * c)[0]) + 2 * g, 2);
            std::memcpy(&hi, at(slot(8 * i + 2 * c + 1)[0]) + 2 * g, 2);
            r[i] = lo | (u32)hi << 16;
        }
    }
    warp_sync();
}
inline float half_f(u32 word, int high) { return as_f(high ? word & 0xffff0000u : word << 16); }
// mma.sync.m16n8k16.row.col bf16 -> f32: lane 4g + c holds A {a0: row g, a1: row g + 8, a2, a3:
// the same rows 8 columns on} columns 2c, 2c + 1; B {b0, b1} rows 2c, 2c + 1 (+ 8) of column g;
// C rows g, g + 8, columns 2c, 2c + 1.
inline void mma(float* acc, const u32* a, u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    u32* mine = slot(lane);
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    warp_sync();
    float out[4];
    for (int rh = 0; rh < 2; ++rh)
        for (int e = 0; e < 2; ++e) {
            const int col = 2 * c + e;
            float s = acc[2 * rh + e];
            for (int k = 0; k < 16; ++k) {
                const float av = half_f(slot(4 * g + (k & 7) / 2)[rh + 2 * (k >> 3)], k & 1);
                const float bv = half_f(slot(4 * col + (k & 7) / 2)[4 + (k >> 3)], k & 1);
                s += av * bv;
            }
            out[2 * rh + e] = s;
        }
    warp_sync();
    for (int i = 0; i < 4; ++i) acc[i] = out[i];
}
inline float shfl_xor(float v, int off) {
    const int lane = threadIdx.x & 31;
    slot(lane)[0] = as_u(v);
    warp_sync();
    const float r = as_f(slot(lane ^ off)[0]);
    warp_sync();
    return r;
}
inline u32 bf16_rn(float f) {
    const u32 x = as_u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}
}
}
#undef __shfl_xor_sync
#undef __syncthreads
#undef __int_as_float
#define __shfl_xor_sync(mask, v, off) mpipar_emu::shfl_xor(v, off)
#define __syncthreads() mpipar_emu::block_sync()
#define __syncwarp() mpipar_emu::warp_sync()
#define __uint_as_float(x) mpipar_emu::as_f((unsigned int)(x))
#define __int_as_float(x) mpipar_emu::as_f((unsigned int)(x))
"""

# The source's PTX building blocks, as the C++ above.
_BLOCKS = r"""
__device__ __forceinline__ u32 sptr(const void* p) {
    return (u32)((const unsigned char*)p - mpipar_emu::shared_base());
}
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool valid) {
    if (valid) std::memcpy(mpipar_emu::at(dst), src, 16);
    else std::memset(mpipar_emu::at(dst), 0, 16);
}
__device__ __forceinline__ void cp_commit() {}
template <int N> __device__ __forceinline__ void cp_wait() {}
__device__ __forceinline__ void ldsm4(u32* r, u32 addr) { mpipar_emu::ldsm(r, addr, 4, false); }
__device__ __forceinline__ void ldsm2(u32* r, u32 addr) { mpipar_emu::ldsm(r, addr, 2, false); }
__device__ __forceinline__ void ldsm4t(u32* r, u32 addr) { mpipar_emu::ldsm(r, addr, 4, true); }
__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    mpipar_emu::mma(c, a, b0, b1);
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return mpipar_emu::bf16_rn(lo) | mpipar_emu::bf16_rn(hi) << 16;
}
"""

_KERNELS = ("flash_fwd", "attn_delta", "flash_bwd_dq", "flash_bwd_dkdv")


def _source() -> str:
    """SOURCE with the PTX blocks swapped, dynamic shared memory the block's buffer."""
    src = SOURCE
    a = src.index("__device__ __forceinline__ u32 sptr(")
    b = src.index("// Two adjacent gradient elements")
    src = src[:a] + _BLOCKS + src[b:]
    src = re.sub(r"(__device__ __forceinline__ float exp2a\(float x\) \{).*?\n\}",
                 r"\1 return std::exp2(x); }", src, count=1, flags=re.S)
    assert "asm" not in src
    return src.replace("extern __shared__ __align__(16) unsigned char smem[];",
                       "unsigned char* smem = mpipar_emu::shared_base();")


def _params(src: str, name: str) -> str:
    return re.search(r"[\n ]" + name + r"\((.*?)\)\s*\{", src, re.S).group(1)


def _launchers(src: str, d: int) -> list[str]:
    """For each role (not the bf16-gradient twins: the same loops) a kernel running its
    instantiation then a final block barrier, and ``launch_ROLE(grid, args...)``."""
    code = []
    for role, inst in flash_mma._names(d).items():
        if role.endswith("_bf16"):
            continue
        params = _params(src, inst.split("<")[0]).replace("GradT", "float")
        args = ", ".join(p.split()[-1].lstrip("*") for p in params.split(","))
        code.append(f"__global__ void emu_{role}({params}) {{ mpipar_emu::block_begin(); "
                    f"{inst}({args}); mpipar_emu::block_sync(); }}")
        code.append(f'extern "C" void launch_{role}(int grid, {params}) {{ '
                    f"hipLaunchKernelGGL(emu_{role}, dim3(grid), "
                    f"dim3({flash_mma._threads(d, role)}), 0, 0, {args}); "
                    f"hipDeviceSynchronize(); }}")
    return code


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(head dim, aligned) -> the kernels compiled for the CPU (a ctypes library); both builds
    of a head dim compile at once, on first use."""
    built = {}

    def get(d: int, aligned: bool):
        if (d, aligned) not in built:
            src = _source()
            cpp = tmp_path_factory.mktemp("hip_mma") / f"flash_mma_{d}.cpp"
            cpp.write_text("\n".join([hip_cpu._PROLOGUE, "#include <cmath>", _EMULATION, src,
                                      *_launchers(src, d)]))
            jobs = {a: subprocess.Popen(
                ["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w",
                 f"-DMPIPAR_DOC_TILES_ALIGNED={int(a)}", f"-I{hip_cpu.HIP}/include", str(cpp),
                 "-o", str(cpp.with_suffix(f".{int(a)}.so")), "-ltbb", "-lpthread"])
                for a in (True, False)}
            for a, job in jobs.items():
                assert job.wait() == 0, f"g++ failed on {cpp} (aligned={a})"
                built[d, a] = ctypes.CDLL(str(cpp.with_suffix(f".{int(a)}.so")))
        return built[d, aligned]

    return get


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _run(lib, d, q, k, v, dout, qo, ko, causal, window, q_docs, k_docs):
    """out, lse, dq, dk, dv as flash_mma launches them (grids, arguments, the document tables
    of `document_bounds`), in host memory; every output starts as NaN."""
    import ml_dtypes

    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    docs = q_docs is not None
    bits = [np.ascontiguousarray(a).view(np.uint16) for a in (q, k, v, dout)]
    tables = flash_mma.document_bounds(q_docs, k_docs) if docs else (None,) * 4
    scale = ref.attention_scale(d, None)
    tail = (ctypes.c_int(sq), ctypes.c_int(sk), ctypes.c_int(hq), ctypes.c_int(hkv),
            ctypes.c_longlong(qo), ctypes.c_longlong(ko), ctypes.c_int(int(causal)),
            ctypes.c_longlong(window), ctypes.c_float(scale * flash_mma.LOG2E))
    out = np.full(q.shape, 0xFFFF, np.uint16)
    lse = np.full((b, hq, sq), np.nan, np.float32)

    def launch(role, rows, *args):
        role += "_docs" if docs else ""
        grid = -(-rows // flash_mma._block_rows(d, role))
        getattr(lib, f"launch_{role}")(ctypes.c_int(grid * (hkv if "dkdv" in role else hq) * b),
                                       *args)

    launch("fwd", sq, *map(_ptr, (*bits[:3], out, lse)), *tail, *map(_ptr, tables[:2]))
    delta = np.full((b, hq, sq), np.nan, np.float32)
    rows = b * sq * hq
    lib.launch_delta(ctypes.c_int(-(-rows // 8)), _ptr(out), _ptr(bits[3]), _ptr(delta),
                     ctypes.c_int(sq), ctypes.c_int(hq), ctypes.c_longlong(rows))
    dq = np.full(q.shape, np.nan, np.float32)
    dk, dv = (np.full(k.shape, np.nan, np.float32) for _ in range(2))
    common = (*map(_ptr, (*bits[:3], bits[3], lse, delta)),)
    launch("dq", sq, *common, _ptr(dq), *tail, ctypes.c_float(scale), *map(_ptr, tables[:2]))
    launch("dkdv", sk, *common, _ptr(dk), _ptr(dv), *tail, ctypes.c_float(scale),
           *map(_ptr, tables[2:]))
    return out.view(ml_dtypes.bfloat16), lse, dq, dk, dv


def _check(build, d, aligned, case):
    import ml_dtypes

    name, b, sq, sk, hq, hkv, qo, ko, causal, window, q_docs, k_docs = case
    rng = np.random.default_rng(sq + hq + qo)
    q, dout = (rng.standard_normal((b, sq, hq, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    out, lse, dq, dk, dv = _run(build(d, aligned), d, q, k, v, dout, qo, ko, causal, window,
                                q_docs, k_docs)
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    kw = {} if q_docs is None else {"q_docs": q_docs, "k_docs": k_docs}
    want_out, want_lse = ref.attention_fwd(*wide[:3], qo, ko, bool(causal), None, window, **kw)
    dead = ~np.isfinite(want_lse)
    assert not np.isnan(lse).any() and np.array_equal(np.isneginf(lse), dead), name
    assert np.abs(lse[~dead] - want_lse[~dead]).max(initial=0.0) <= LSE_TOL, name
    out64 = out.astype(np.float64)
    assert (out64[dead.transpose(0, 2, 1)] == 0).all(), name
    assert _rel(out64, want_out) <= TOL, name
    # the backward from the kernel's own (bf16) out and lse, as tests/gpu/test_flash_mma.py
    want = ref.attention_bwd(*wide[:3], out64, lse.astype(np.float64), wide[3], qo, ko,
                             bool(causal), None, window, **kw)
    for label, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        e = _rel(g.astype(np.float64), w)
        assert e <= TOL, f"{name}: {label} relative error {e:.3e}"


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("case", hip_cpu._cases(), ids=lambda c: c[0])
def test_bf16_kernels_on_the_cpu_match_numpy_ref(build, aligned, case):
    """Every layout of the float kernels' HIP-CPU test (causal, a ring hop, documents of ~7 to
    ~150 tokens, a window, keys after every query, not causal, two documents), at D 64 with the
    document kernels' tiles: out, lse, dq, dk, dv within the device test's bounds, every element
    written (outputs start as NaN); the document kernels' first tiles aligned and not."""
    _check(build, 64, aligned, case)


def test_unaligned_first_tiles_never_read_keys_before_the_document(build):
    """A document starting mid-tile (key 200 of 384; 128 queries at 256, all in it), the keys and
    values before it NaN: aligned, the forward's first tile starts at key 192 and reads eight of
    them (masked scores, but 0 x NaN in P V: the output is not finite); unaligned, it starts at
    200, and out, lse, dq, and dk, dv of the document's keys match numpy_ref on finite inputs.
    tests/gpu/test_flash_mma.py asserts the same on the device."""
    import ml_dtypes

    d, sq, sk, start = 64, 128, 384, 200
    rng = np.random.default_rng(7)
    q, dout = (rng.standard_normal((1, sq, 4, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, 2, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    q_docs = np.ones((1, sq), np.int64)
    k_docs = (np.arange(sk) >= start).astype(np.int64)[None]
    wide = [a.astype(np.float64) for a in (q, k, v, dout)]
    kw = {"q_docs": q_docs, "k_docs": k_docs}
    want_out, want_lse = ref.attention_fwd(*wide[:3], 256, 0, True, **kw)
    k[:, :start] = np.nan
    v[:, :start] = np.nan
    got = _run(build(d, True), d, q, k, v, dout, 256, 0, True, 0, q_docs, k_docs)
    assert not np.isfinite(got[0].astype(np.float64)).all()
    out, lse, dq, dk, dv = _run(build(d, False), d, q, k, v, dout, 256, 0, True, 0, q_docs, k_docs)
    out64 = out.astype(np.float64)
    assert _rel(out64, want_out) <= TOL and np.abs(lse - want_lse).max() <= LSE_TOL
    want = ref.attention_bwd(*wide[:3], out64, lse.astype(np.float64), wide[3], 256, 0, True,
                             **kw)
    assert _rel(dq.astype(np.float64), want[0]) <= TOL
    assert _rel(dk[:, start:].astype(np.float64), want[1][:, start:]) <= TOL
    assert _rel(dv[:, start:].astype(np.float64), want[2][:, start:]) <= TOL
