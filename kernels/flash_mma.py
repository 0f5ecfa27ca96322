"""mpipar's own FA2-style bf16 flash attention on tensor cores (a CuPy RawModule), forward and
backward, with `numpy_ref.attention_fwd` / `attention_bwd`'s contract in bf16.

Inputs q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` are C-contiguous ml_dtypes.bfloat16 CuPy arrays
(a non-contiguous view is refused, not silently copied); query head h reads kv head
h // (Hq // Hkv); query i sits at q_offset + i, key j at k_offset + j; `causal`: key j visible iff
k_offset + j <= q_offset + i, and with a sliding `window` W > 0 also q_offset + i - (k_offset + j)
< W. Forward: out bf16 `[B, Sq, Hq, D]`, lse float32 `[B, Hq, Sq]` (rows with no visible key:
out 0, lse -inf). Backward from a (possibly ring-merged) out and lse: dq `[B, Sq, Hq, D]`,
dk, dv `[B, Sk, Hkv, D]` in float32, dk and dv summed over the query heads of each kv group.

The kernels' CUDA source and how they work: `flash_mma_cuda`.

One module per head dim, compiled on first use (`cuda_sources()` lists them for the compile
gate). Tensor-core instructions need compute capability >= 8.0 (`supports`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator

import numpy as np

from . import numpy_ref as ref
from .cupy_arrays import device_views, host_array
from .flash_mma_cuda import SOURCE as _SOURCE
from .numpy_ref import Array, require

HEAD_DIMS = (32, 64, 96, 128)
"""Head dims the kernels are instantiated for (a multiple of 32 keeps every ldmatrix aligned)."""

# Tiles per head dim. fwd: (warps, m-tiles of 16 rows per warp, key tile, min blocks per SM,
# Q fragments kept in registers); dq: (warps, key tile, min blocks per SM, Q/dO in registers);
# dkdv: (warps, query tile, min blocks per SM, narrow k-steps in S^T/dP^T). Min blocks per SM
# caps the registers (__launch_bounds__); _smem_bytes gives the shared memory each takes. A
# packed-document kernel may have its own entry ("fwd_docs", "dq_docs", "dkdv_docs"; `_tiles`),
# else it runs its plain kernel's tiles. D=64's were timed on an H100 (bf16, 8 x 8192
# tokens, 32 heads, documents of median 200): fwd_docs (4,1,64,3,0) 1.239 ms against the plain
# tiles' 1.659 (six others 1.35-1.62); dkdv_docs (4,32,3,0) 3.86 ms backward against 4.07 (three
# others 4.24-4.56); for dq the plain tiles won (4.12 against 4.25, 4.48).
_TILES: dict[int, dict[str, tuple[int, ...]]] = {
    32: {"fwd": (4, 2, 64, 2, 0), "dq": (4, 32, 4, 1), "dkdv": (4, 64, 2, 0)},
    64: {"fwd": (4, 2, 64, 2, 0), "dq": (4, 32, 4, 1), "dkdv": (4, 64, 2, 0),
         "fwd_docs": (4, 1, 64, 3, 0), "dkdv_docs": (4, 32, 3, 0)},
    96: {"fwd": (4, 1, 64, 2, 1), "dq": (4, 32, 2, 1), "dkdv": (4, 32, 2, 0)},
    128: {"fwd": (4, 1, 64, 2, 1), "dq": (4, 32, 2, 1), "dkdv": (4, 32, 2, 1)},
}
"""Chosen by timing on an H100 (causal, B*S = 16k): D=128 fwd (4,1,64) 265-291 TFLOP/s beat
(4,1,32) at 3 blocks/SM and (4,2,32); D=64 fwd (4,2,64) 258-279 beat (4,1,128), (8,1,32). dk/dv: 64
keys per block; D=128 narrow 8.1 ms at S=16k beat (8,32,1) 8.4, (4,16,2) 11.1 (238 regs, sm_90;
wide k-steps with dP^T before dV, as first written: 255 and a spill under NVRTC 13.0.88)."""

_OPTIONS = ("--std=c++17",)
DOC_TILES_ALIGNED = False
"""Packed documents: whether a block's first key (dk/dv: query) tile starts at a multiple of the
tile (True) or at the first position its rows' documents hold (False, the default: fewer
entries, `score_entries`; the same loads and masks, `flash_mma_cuda`). The module compiles with
the value in force at the first launch (`_module` is keyed on it; the compile gate builds the
default, `cuda_sources`). Off by default: on an H200 the device tests pass and the
bench's bf16 batch (8 x 8192 tokens, 32 heads, documents of median 200) at 4.83-4.89 ms
document-masked against 4.94 aligned (two runs each; 1.227 -> 1.157 entries per pair)."""
_DELTA_WARPS = 8
LOG2E = 1.4426950408889634


def _names(head_dim: int) -> dict[str, str]:
    """The template instantiations launched for `head_dim`, by role; each attention kernel also
    as "ROLE_docs", its packed-document instantiation (the plain one carries none of that code,
    so full causal runs as it was timed before documents); the backward's two kernels each also
    as "ROLE_bf16" and "ROLE_docs_bf16", writing bf16 gradients (`attention_bwd`'s
    ``grad_dtype``)."""
    names = {}
    for docs in (False, True):
        for base, grads in (("fwd", (False,)), ("dq", (False, True)), ("dkdv", (False, True))):
            for bf16 in grads:
                role = _role(base, docs, bf16)
                names[role] = _instance(head_dim, base, _tiles(head_dim, role), docs, bf16)
    return {**names, "delta": f"attn_delta<{head_dim}>"}


def _instance(head_dim: int, base: str, tiles: tuple[int, ...], docs: bool, bf16: bool) -> str:
    """The template instantiation of kernel ``base`` with ``tiles`` (as in `_TILES`)."""
    flag = lambda x: str(bool(x)).lower()   # noqa: E731
    if base == "fwd":
        w, mt, bk, minb, qreg = tiles
        return f"flash_fwd<{head_dim}, {w}, {mt}, {bk}, {minb}, {flag(qreg)}, {flag(docs)}>"
    grad = "bf16_t" if bf16 else "float"
    w, b, minb, opt = tiles   # dq: key tile, Q/dO in registers; dkdv: query tile, narrow k-steps
    return (f"flash_bwd_{base}<{head_dim}, {w}, {b}, {minb}, {flag(opt)}, {flag(docs)}, "
            f"{grad}>")


def _tiles(head_dim: int, role: str) -> tuple[int, ...]:
    """The tiles of a role: its document kernel's own entry in `_TILES` ("fwd_docs", ...) where
    there is one, else its kernel's."""
    t = _TILES[head_dim]
    return t.get(role.removesuffix("_bf16"), t[_base(role)])


TILE_AXES: dict[str, tuple[tuple[int, ...], ...]] = {
    "fwd": ((2, 4, 8), (1, 2), (32, 64, 128), (1, 2, 3, 4), (0, 1)),
    "dq": ((2, 4, 8), (16, 32, 64), (1, 2, 3, 4, 5), (0, 1)),
    "dkdv": ((2, 4, 8), (16, 32, 64), (1, 2, 3, 4, 6, 8), (0, 1)),
}
"""The values each axis of a kernel's tiles (`_TILES`' tuples) may take, for `tile_candidates`."""
SM_THREADS, SM_SMEM, BLOCK_SMEM_RESERVED = 2048, 233472, 1024
"""What one multiprocessor holds on sm_80/sm_90 (threads; shared memory bytes on sm_90, of which
the system reserves 1 KiB a block): the bound a tile's minimum blocks per SM must fit."""


def tile_candidates(head_dim: int, role: str) -> list[tuple[int, ...]]:
    """The tiles to time for ``role`` (fwd, dq, dkdv, or a "_docs" kernel): its present tiles
    first, then every tuple one value away on one axis (`TILE_AXES`) that the kernel's template
    takes and an SM can hold at its minimum blocks (`SM_THREADS`, `SM_SMEM`); whether it
    compiles without spills is NVRTC's to say (`bench tiles`)."""
    now = _tiles(head_dim, role)
    found = [now]
    for axis, values in enumerate(TILE_AXES[_base(role)]):
        for value in values:
            cand = now[:axis] + (value,) + now[axis + 1:]
            if cand not in found and tile_refusal(head_dim, role, cand) is None:
                found.append(cand)
    return found


def tile_refusal(head_dim: int, role: str, tiles: tuple[int, ...]) -> str | None:
    """Why ``tiles`` cannot run ``role`` at ``head_dim``, or None: the template's rule (Q kept in
    registers for one m-tile only) and an SM's threads and shared memory at its min blocks."""
    base = _base(role)
    warps, minb = tiles[0], tiles[3 if base == "fwd" else 2]
    if base == "fwd" and tiles[4] and tiles[1] != 1:
        return f"{tiles}: Q fragments stay in registers for one m-tile per warp only"
    if 32 * warps * minb > SM_THREADS:
        return f"{tiles}: {warps} warps x {minb} blocks exceed an SM's {SM_THREADS} threads"
    smem = _smem_bytes(head_dim, role, tiles)
    if (smem + BLOCK_SMEM_RESERVED) * minb > SM_SMEM:
        return f"{tiles}: {minb} blocks x {smem} B exceed an SM's 228 KiB of shared memory"
    return None


@contextlib.contextmanager
def tiles_set(head_dim: int, role: str, tiles: tuple[int, ...]) -> Iterator[None]:
    """``role``'s kernels (both gradient types) run ``tiles`` inside the block, then what they
    ran before; the compiled modules are dropped on the way in and out (`bench tiles`)."""
    entry, table = role.removesuffix("_bf16"), _TILES[head_dim]
    before = table.get(entry)
    table[entry] = tuple(tiles)
    _module.cache_clear()
    _kernel.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del table[entry]
        else:
            table[entry] = before
        _module.cache_clear()
        _kernel.cache_clear()


def _role(base: str, docs: bool, bf16: bool) -> str:
    """The role name of kernel ``base`` (fwd, dq, dkdv) with documents and bf16 gradients."""
    return base + ("_docs" if docs else "") + ("_bf16" if bf16 else "")


def _base(role: str) -> str:
    """The kernel a role instantiates: fwd, dq, dkdv or delta."""
    return role.removesuffix("_bf16").removesuffix("_docs")


def _block_rows(head_dim: int, role: str, tiles: tuple[int, ...] | None = None) -> int:
    """Rows a block of a role owns (with its present tiles, or ``tiles``): query rows (fwd: 16
    per m-tile per warp; dq: 16 per warp), or key rows (dkdv: 16 per warp)."""
    t = _tiles(head_dim, role) if tiles is None else tiles
    return 16 * t[0] * (t[1] if _base(role) == "fwd" else 1)


def _smem_bytes(head_dim: int, role: str, tiles: tuple[int, ...] | None = None) -> int:
    """Dynamic shared memory of a kernel (with its present tiles, or ``tiles``): bf16 rows of
    head_dim + 8 (see the CUDA source)."""
    row, base = (head_dim + 8) * 2, _base(role)
    if base == "delta":
        return 0
    t = _tiles(head_dim, role) if tiles is None else tiles
    if base == "fwd":           # Q + 2 x (K, V) tiles
        return (_block_rows(head_dim, role, t) + 4 * t[2]) * row
    # dq: Q, dO + 2 x (K, V) tiles; dkdv: K, V + 2 x (Q, dO, lse, delta)
    rows, b = _block_rows(head_dim, role, t), t[1]
    return (2 * rows + 4 * b) * row + (4 * b * 4 if base == "dkdv" else 0)


def _threads(head_dim: int, role: str) -> int:
    return 32 * (_DELTA_WARPS if role == "delta" else
                 _tiles(head_dim, role)[0])


def cuda_sources() -> list[dict[str, Any]]:
    """The CUDA modules this file compiles, for the compile gate: one per head dim, each
    {"name", "code", "names" (every instantiation launched), "options" (NVRTC options beyond
    RawModule's own), "dynamic_smem" ({name expression: bytes})}."""
    sources = []
    for d in HEAD_DIMS:
        names = _names(d)
        sources.append({"name": f"flash_mma_d{d}", "code": _SOURCE,
                        "names": tuple(names.values()), "options": _options(DOC_TILES_ALIGNED),
                        "dynamic_smem": {names[r]: _smem_bytes(d, r) for r in names}})
    return sources


def role_source(head_dim: int, role: str) -> dict[str, Any]:
    """`cuda_sources`' entry for ``head_dim`` narrowed to ``role``'s instantiations (both
    gradient types), with the present tiles (`tiles_set` changes them): what `bench tiles`
    compiles per candidate."""
    (src,) = [s for s in cuda_sources() if s["name"] == f"flash_mma_d{head_dim}"]
    names = _names(head_dim)
    chosen = tuple(sorted({names[r] for r in names if r.removesuffix("_bf16") == role}))
    return {**src, "names": chosen, "dynamic_smem": {n: src["dynamic_smem"][n] for n in chosen}}


def supports(dtype: Any, head_dim: int, compute_capability: int | None = None) -> str | None:
    """None if these kernels handle `dtype` and `head_dim` (on a device of `compute_capability`,
    e.g. 90, when given), else the reason: the backend chooser's question."""
    try:
        import ml_dtypes
        import numpy as np

        bf16 = np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
    except (ImportError, TypeError):
        bf16 = False
    if not bf16:
        return f"flash_mma takes bfloat16 only, got {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"flash_mma: head_dim={head_dim} is not one of {HEAD_DIMS}"
    if compute_capability is not None and compute_capability < 80:
        return (f"flash_mma needs compute capability >= 8.0 (bf16 mma.sync, cp.async), "
                f"the device has {compute_capability / 10:.1f}")
    return None


def _options(aligned: bool = True) -> tuple[str, ...]:
    """NVRTC options beyond RawModule's own, with documents' first tiles ``aligned`` or not."""
    return _OPTIONS + (() if aligned else ("-DMPIPAR_DOC_TILES_ALIGNED=0",))


@functools.cache
def _module(head_dim: int, aligned: bool = True) -> Any:
    import cupy

    return cupy.RawModule(code=_SOURCE, options=_options(aligned),
                          name_expressions=tuple(_names(head_dim).values()))


@functools.cache
def _kernel(head_dim: int, role: str, aligned: bool = True) -> Any:
    """The compiled kernel for `role` (fwd, dq, dkdv, delta), its shared-memory limit raised."""
    fn = _module(head_dim, aligned).get_function(_names(head_dim)[role])
    smem = _smem_bytes(head_dim, role)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def _launch(head_dim: int, role: str, grid: tuple[int, ...], args: tuple) -> None:
    _kernel(head_dim, role, DOC_TILES_ALIGNED)(grid, (_threads(head_dim, role),), args,
                                               shared_mem=_smem_bytes(head_dim, role))


def _check(name: str, q: Array, k: Array, v: Array, causal: bool, window: int,
           scale: float | None, extra: tuple[Array, ...] = ()) -> float:
    """Validate the inputs (shapes as numpy_ref, bf16, C-contiguous CuPy arrays); the scale."""
    import cupy

    ref.check_attention_shapes(q, k, v, name)
    ref.check_window(window, causal, name)
    reason = supports(q.dtype, q.shape[3])
    require(reason is None, f"{name}: {reason}")
    for a in (q, k, v) + extra:
        require(isinstance(a, cupy.ndarray),
                f"{name}: expected CuPy arrays, got {type(a).__name__}")
        require(a.flags.c_contiguous, f"{name}: inputs must be C-contiguous (got strides "
                                      f"{a.strides} for shape {a.shape}); pass a copy")
    require(k.dtype == q.dtype and v.dtype == q.dtype, f"{name}: q, k, v must all be bfloat16")
    require(max(q.shape[1], k.shape[1]) * q.shape[0] * q.shape[2] < 2 ** 31,
            f"{name}: B * S * H must stay below 2^31 (one block per 16 rows), got {q.shape}")
    sc = ref.attention_scale(q.shape[3], scale)
    require(math.isfinite(sc) and sc > 0, f"{name}: scale={sc} must be finite and > 0")
    return sc


def _mask_args(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool,
               window: int) -> tuple:
    import cupy

    return (cupy.int32(q.shape[1]), cupy.int32(k.shape[1]), cupy.int32(q.shape[2]),
            cupy.int32(k.shape[2]), cupy.int64(q_offset), cupy.int64(k_offset),
            cupy.int32(bool(causal)), cupy.int64(window))


def document_bounds(q_docs: Array, k_docs: Array) -> tuple[np.ndarray, ...]:
    """(klo, khi, qlo, qhi) int32 on the host for document ids ``q_docs`` `[B, Sq]`, ``k_docs``
    `[B, Sk]` (non-decreasing along each row): each query's document's keys [klo, khi) and each
    key's document's queries [qlo, qhi), block-local. Pure: no CuPy."""
    from .document_spans import document_bounds as bounds

    qd, kd = (np.asarray(a) for a in (q_docs, k_docs))
    require(qd.ndim == 2 and kd.ndim == 2 and qd.shape[0] == kd.shape[0],
            f"attention: q_docs {qd.shape} and k_docs {kd.shape} must be [B, Sq] and [B, Sk]")
    (b, sq), sk = qd.shape, kd.shape[1]
    klo, khi = bounds(qd, kd, b, sq, sk)[:2]
    qlo, qhi = bounds(kd, qd, b, sk, sq)[:2]
    return tuple(a.astype(np.int32) for a in (klo, khi, qlo, qhi))


def document_tables(q_docs: Array, k_docs: Array, head_dim: int = 0, dtype: Any = None) -> dict:
    """The kernels' packed-document arguments for ids ``q_docs`` `[B, Sq]`, ``k_docs`` `[B, Sk]`
    (host or device): {"q": (klo, khi) for the forward and dq, "k": (qlo, qhi) for dk/dv}, in
    device memory (one copy). The blocks stay the fixed grid; a block reads only the keys (dk/dv:
    queries) of its rows' documents, and each warp skips the tiles its rows' documents miss.
    The attention seam keeps them per microbatch (`mpipar.model.attention.kernel_documents`);
    ``head_dim`` and ``dtype`` are the seam's arguments, on which these tables do not depend."""
    views = device_views(document_bounds(host_array(q_docs), host_array(k_docs)))
    return {"q": tuple(views[:2]), "k": tuple(views[2:])}


def _documents(q_docs: Array | None, k_docs: Array | None, tables: dict | None,
               q: Array, k: Array) -> dict | None:
    """``tables`` as given, else found for the ids (None without documents); shapes checked."""
    if tables is None and q_docs is None and k_docs is None:
        return None
    if tables is None:
        require(q_docs is not None and k_docs is not None,
                "attention: q_docs and k_docs go together")
        tables = document_tables(q_docs, k_docs)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    require(tables["q"][0].size == b * sq and tables["k"][0].size == b * sk,
            f"attention: document tables for {tables['q'][0].size} queries and "
            f"{tables['k'][0].size} keys, the call has {b} x {sq} and {b} x {sk}")
    return tables


def _no_documents() -> tuple:
    import cupy

    return cupy.uint64(0), cupy.uint64(0)


def score_entries(sq: int, sk: int, head_dim: int, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None, aligned: bool | None = None) -> int:
    """Query-key scores the forward kernel computes for one head of the rows of ``q_docs``
    `[B, Sq]` / ``k_docs`` `[B, Sk]` (one sequence without documents), summed: 16-row slabs
    times the key tiles each does not skip (`slab_span`) within its block's tiles; without
    documents every slab walks its block's tiles. Documents' first tiles ``aligned`` or not
    (default: `DOC_TILES_ALIGNED`). A host-side
    count of the kernel's own loops, as `flash_exact.score_entries`. Pure: no CuPy."""
    aligned = DOC_TILES_ALIGNED if aligned is None else aligned
    role = "fwd" if q_docs is None else "fwd_docs"
    bq, bk, shift = _block_rows(head_dim, role), _tiles(head_dim, role)[2], q_offset - k_offset
    if q_docs is None:
        klo, khi = np.zeros((1, sq), np.int64), np.full((1, sq), sk, np.int64)
    else:
        klo, khi = document_bounds(q_docs, k_docs)[:2]
    total = 0
    for b in range(klo.shape[0]):
        for q0 in range(0, sq, bq):
            last = min(sq, q0 + bq) - 1
            kend = min(sk, shift + last + 1) if causal else sk
            kbeg = max(0, shift + q0 - window + 1) if causal and window else 0
            kbeg, kend = max(kbeg - kbeg % bk, klo[b, q0]), min(kend, khi[b, last])
            kbeg -= kbeg % bk if aligned else 0
            tiles = len(range(kbeg, kend, bk))
            if q_docs is None:        # no documents: every slab of the block, every tile
                total += 16 * bk * tiles * bq // 16
                continue
            for r0 in range(q0, last + 1, 16):
                r1 = min(sq, r0 + 16) - 1
                beg, end = klo[b, r0], khi[b, r1]
                if causal:
                    end = min(end, shift + r1 + 1)
                    beg = max(beg, shift + r0 - window + 1) if window else beg
                for k0 in range(kbeg, kend, bk):
                    if end > max(beg, k0) and beg < k0 + bk:
                        total += 16 * bk
    return total


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None, window: int = 0,
                  q_docs: Array | None = None, k_docs: Array | None = None,
                  tables: dict | None = None) -> tuple[Array, Array]:
    """Flash attention forward in bf16 (`numpy_ref.attention_fwd`'s contract, packed documents
    included: ids ``q_docs`` `[B, Sq]`, ``k_docs`` `[B, Sk]`, or their `document_tables`): q
    `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` (bf16, C-contiguous) -> out bf16 `[B, Sq, Hq, D]`,
    lse float32 `[B, Hq, Sq]`; rows that see no key: out 0, lse -inf."""
    import cupy

    sc = _check("attention_fwd", q, k, v, causal, window, scale)
    docs = _documents(q_docs, k_docs, tables, q, k)
    b, sq, hq, d = q.shape
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((b, hq, sq), cupy.float32)
    if out.size == 0:
        lse.fill(-cupy.inf)
        return out, lse
    role = "fwd_docs" if docs else "fwd"
    _launch(d, role, (-(-sq // _block_rows(d, role)) * hq * b,),
            (q, k, v, out, lse, *_mask_args(q, k, q_offset, k_offset, causal, window),
             cupy.float32(sc * LOG2E), *(docs["q"] if docs else _no_documents())))
    return out, lse


def attention_delta(out: Array, dout: Array) -> Array:
    """D = rowsum(dout * out) in float32, `[B, Hq, Sq]` from bf16 `[B, Sq, Hq, D]` (FA2's
    backward preprocessing; out may be the ring-merged output)."""
    import cupy

    b, sq, hq, d = out.shape
    delta = cupy.empty((b, hq, sq), cupy.float32)
    rows = b * sq * hq
    if rows:
        _launch(d, "delta", (-(-rows // _DELTA_WARPS),),
                (out, dout, delta, cupy.int32(sq), cupy.int32(hq), cupy.int64(rows)))
    return delta


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None, tables: dict | None = None, grad_dtype: Any = None
                  ) -> tuple[Array, Array, Array]:
    """Flash attention backward in bf16 (`numpy_ref.attention_bwd`'s contract, packed documents
    as `attention_fwd`) for one key block, given the (possibly ring-merged) out bf16 and lse
    float32 `[B, Hq, Sq]`: dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]` in float32 (dk, dv
    summed over each kv group's query heads), or in bf16 when ``grad_dtype`` asks: the kernels
    then round them as they write them (the bits of the float32 result's cast, half the bytes)."""
    import cupy

    sc = _check("attention_bwd", q, k, v, causal, window, scale, (out, dout))
    grads = ref.grad_dtype_of(q.dtype, grad_dtype)
    bf16 = ref.is_bf16(grads)
    docs = _documents(q_docs, k_docs, tables, q, k)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse "
            f"{lse.shape} must be {(b, hq, sq)}")
    require(out.dtype == q.dtype and dout.dtype == q.dtype, "attention_bwd: out, dout must be bf16")
    lse = cupy.ascontiguousarray(lse, cupy.float32)
    dq, dk, dv = cupy.empty(q.shape, grads), cupy.empty(k.shape, grads), cupy.empty(k.shape, grads)
    args = (q, k, v, dout, lse, attention_delta(out, dout))
    tail = (*_mask_args(q, k, q_offset, k_offset, causal, window), cupy.float32(sc * LOG2E),
            cupy.float32(sc))
    if dq.size:
        role = _role("dq", bool(docs), bf16)
        _launch(d, role, (-(-sq // _block_rows(d, role)) * hq * b,),
                (*args, dq, *tail, *(docs["q"] if docs else _no_documents())))
    if dk.size:
        role = _role("dkdv", bool(docs), bf16)
        _launch(d, role, (-(-sk // _block_rows(d, role)) * hkv * b,),
                (*args, dk, dv, *tail, *(docs["k"] if docs else _no_documents())))
    return dq, dk, dv


attention_fwd.block_sparse_documents = attention_bwd.block_sparse_documents = True
attention_fwd.document_tables = attention_bwd.document_tables = document_tables
