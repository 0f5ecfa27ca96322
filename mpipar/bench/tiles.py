"""`bench tiles`: flash_mma's tiles, compiled and timed on this device, role by role.

A role is one of flash_mma's kernels: fwd, dq, dkdv, or their packed-document instantiations
fwd_docs, dq_docs, dkdv_docs (`flash_mma._TILES`). Its candidates are its present tiles and
every tuple one value away on one axis (`flash_mma.tile_candidates`), plus any given with
`--tiles`. NVRTC compiles each for the device's architecture (the compile gate's report,
`kernels.cuda_gate`) and drops those that spill or ask for more shared memory than a block may
have; `--compile-only` stops there, and needs no device. The rest run on the role's batch (bf16,
rows x seq x heads x head dim: packed documents of the documents bench's log-normal lengths for
a "_docs" role, full causal otherwise), forward alone for fwd and the whole backward (delta, dq,
dk/dv, with the gradients in --grad-dtype) for dq and dkdv, in interleaved rounds; each
candidate's outputs are compared with the present tiles' (the largest difference relative to
the largest magnitude; float32 sums in another order, so not always bit-equal). A winner is
made a default by editing `_TILES` by hand, with the figures in its comment.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from mpipar.bench.harness import Section, time_call

ROLES = ("fwd", "dq", "dkdv", "fwd_docs", "dq_docs", "dkdv_docs")


def candidates(head_dim: int, role: str, extra: str = "") -> list[tuple[int, ...]]:
    """`flash_mma.tile_candidates` and the tuples of ``extra`` ("4,1,32,4,0 2,16,8,0": those
    with this role's arity; a refused one raises ValueError with flash_mma's reason)."""
    from mpipar.kernels import flash_mma

    found = flash_mma.tile_candidates(head_dim, role)
    for text in extra.split():
        cand = tuple(int(x) for x in text.split(","))
        if len(cand) != len(found[0]):
            continue
        why = flash_mma.tile_refusal(head_dim, role, cand)
        if why is not None:
            raise ValueError(f"--tiles {text} for {role}: {why}")
        if cand not in found:
            found.append(cand)
    return found


def compiled(head_dim: int, role: str, cands: list[tuple[int, ...]], arch: str,
             jobs: int) -> list[dict[str, Any]]:
    """One row per candidate: its tiles, NVRTC's registers and spills for ``arch``, shared
    memory, and "problems" (empty: it may run); every gradient type of the role compiled."""
    from mpipar.kernels import cuda_gate, flash_mma

    sources = []
    for cand in cands:
        with flash_mma.tiles_set(head_dim, role, cand):
            sources.append(flash_mma.role_source(head_dim, role))
    reports = cuda_gate.compile_all([arch], sources, jobs=jobs)
    rows = []
    for cand, src in zip(cands, sources):
        mine = [r for r in reports if r.name in src["names"]]
        rows.append({"role": role, "tiles": list(cand), "default": cand == cands[0],
                     "registers": max(r.registers for r in mine),
                     "spill_bytes": sum(max(r.spill_stores, 0) + max(r.spill_loads, 0)
                                        for r in mine),
                     "smem": max(r.dynamic_smem for r in mine),
                     "problems": sorted({p for r in mine for p in r.problems()})})
    return rows


def _batch(args: argparse.Namespace, docs: bool) -> dict[str, Any]:
    """The role's inputs on the device: q, k, v, dout bf16 and, with documents, their tables."""
    import cupy
    import ml_dtypes

    from mpipar.bench.documents import packed_documents
    from mpipar.kernels import flash_mma

    rng = np.random.default_rng(args.seed)
    shape = (args.rows, args.seq, args.heads, args.head_dim)
    q, k, v, dout = (cupy.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
                     for _ in range(4))
    ids = np.concatenate([packed_documents(args.seq, args.median, args.sigma, rng)
                          for _ in range(args.rows)])
    tables = flash_mma.document_tables(ids, ids) if docs else None
    return {"q": q, "k": k, "v": v, "dout": dout, "tables": tables}


def _call(role: str, batch: dict[str, Any], grad_dtype: Any) -> Any:
    """The call a role's time is: the forward for fwd, the whole backward for dq and dkdv."""
    from mpipar.kernels import flash_mma

    b = batch
    if role.startswith("fwd"):
        return lambda: flash_mma.attention_fwd(b["q"], b["k"], b["v"], tables=b["tables"])
    return lambda: flash_mma.attention_bwd(b["q"], b["k"], b["v"], b["out"], b["lse"], b["dout"],
                                           tables=b["tables"], grad_dtype=grad_dtype)


def _difference(got: Any, want: Any) -> float:
    """The largest difference over the outputs, relative to the largest magnitude of each."""
    import cupy

    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.astype(cupy.float32), w.astype(cupy.float32)
        finite = cupy.isfinite(w)
        scale = float(cupy.abs(cupy.where(finite, w, 0)).max()) or 1.0
        worst = max(worst, float(cupy.abs(cupy.where(finite, g - w, 0)).max()) / scale)
    return worst


def timed(args: argparse.Namespace, role: str, rows: list[dict[str, Any]]) -> None:
    """Time the runnable rows of ``role`` in interleaved rounds (each round a best-of-batch
    median of `harness.time_call`); adds "ms" (the best round), "over_default" and
    "max_rel_difference" to each."""
    import cupy
    import ml_dtypes

    from mpipar.kernels import flash_mma

    batch = _batch(args, role.endswith("_docs"))
    batch["out"], batch["lse"] = flash_mma.attention_fwd(batch["q"], batch["k"], batch["v"],
                                                         tables=batch["tables"])
    grad = ml_dtypes.bfloat16 if args.grad_dtype == "bfloat16" else np.float32
    sync = cupy.cuda.get_current_stream().synchronize
    runnable = [r for r in rows if not r["problems"]]
    want = _call(role, batch, grad)()           # the present tiles' outputs
    times: dict[int, list[float]] = {id(r): [] for r in runnable}
    for _ in range(args.repeats):
        for r in runnable:
            with flash_mma.tiles_set(args.head_dim, role, tuple(r["tiles"])):
                fn = _call(role, batch, grad)
                times[id(r)].append(time_call(fn, sync, 1, args.min_seconds))
                if "max_rel_difference" not in r:
                    r["max_rel_difference"] = _difference(fn(), want)
    base = min(times[id(runnable[0])]) if runnable and runnable[0]["default"] else None
    for r in runnable:
        r["ms"] = min(times[id(r)]) * 1e3
        r["over_default"] = base and min(times[id(r)]) / base


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mpipar.kernels import flash_mma

    if args.quick:
        args.rows, args.heads, args.repeats = 2, 8, 2
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    for role in roles:
        if role not in ROLES:
            raise SystemExit(f"bench tiles: role {role!r} is not one of {', '.join(ROLES)}")
    if args.head_dim not in flash_mma.HEAD_DIMS:
        raise SystemExit(f"bench tiles: --head-dim {args.head_dim} is not one of "
                         f"{flash_mma.HEAD_DIMS}")
    if not args.arch:
        from mpipar.runtime.device import cuda_unavailable
        reason = cuda_unavailable()
        if reason is not None:
            print(f"tiles: skipped: {reason} (--compile-only --arch sm_90 needs no device)")
            return {"skipped": reason}
    arch = args.arch or _device_arch()
    print(f"tiles: flash_mma at head dim {args.head_dim}, {arch}; batch {args.rows} x {args.seq} "
          f"x {args.heads} heads (documents: median {args.median}, sigma {args.sigma}), "
          f"gradients {args.grad_dtype}")
    print(f"{'role':10} {'tiles':18} {'regs':>4} {'spill B':>7} {'smem B':>7} {'ms':>8} "
          f"{'/ now':>6} {'max diff':>9}  problems")
    results = []
    for role in roles:
        rows = compiled(args.head_dim, role, candidates(args.head_dim, role, args.tiles), arch,
                        args.jobs)
        if not args.compile_only:
            timed(args, role, rows)
        for r in rows:
            ms, ratio, diff = r.get("ms"), r.get("over_default"), r.get("max_rel_difference")
            print(f"{role:10} {','.join(map(str, r['tiles'])) + (' *' if r['default'] else ''):18} "
                  f"{r['registers']:>4} {r['spill_bytes']:>7} {r['smem']:>7} "
                  f"{'' if ms is None else f'{ms:.3f}':>8} "
                  f"{'' if ratio is None else f'{ratio:.3f}':>6} "
                  f"{'' if diff is None else f'{diff:.2e}':>9}  {'; '.join(r['problems'])}")
        results.extend(rows)
    print("(* the present tiles; / now: time over theirs, best of the rounds)")
    return {"head_dim": args.head_dim, "arch": arch, "rows": results}


def _device_arch() -> str:
    """sm_XX of the current CUDA device."""
    import cupy

    return f"sm_{cupy.cuda.Device().compute_capability}"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", default="fwd_docs,dq_docs,dkdv_docs",
                        help=f"comma list of {', '.join(ROLES)}")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tiles", default="", help="more candidates, space-separated tuples "
                        "(e.g. '4,1,32,4,0 2,16,8,0'; each goes to the roles of its arity)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--median", type=float, default=200.0, help="median document length")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of log(length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the backward's gradients (training writes bf16)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--min-seconds", type=float, default=0.05,
                        help="each round's batch of calls lasts at least this")
    parser.add_argument("--arch", default="", help="sm_XX to compile for (default: the device's)")
    parser.add_argument("--jobs", type=int, default=8, help="NVRTC compiles in parallel")
    parser.add_argument("--compile-only", action="store_true",
                        help="NVRTC's report only (no device needed with --arch)")


SECTION = Section("tiles", run, "flash_mma's tile candidates per kernel role: NVRTC's registers "
                  "and spills, then each timed on the device against the present tiles", configure)
