"""``python -m mpipar.bench documents``: packed documents (``--document-masking``).

Work balance: samples packed from log-normal document lengths (median ``--median`` tokens,
``--sigma`` of the log), for each sequence length and sp, the max/mean attention work per sp
rank (causal pairs inside documents, :func:`mpipar.parallel.sequence_split.rank_work`) under the
contiguous, zigzag and balanced splits, the mean and the worst over ``--samples`` samples.

Speed: ``--rows`` packed rows (one by default) of such documents at ``--speed-seq`` tokens,
attention forward and backward on one process through the attention seam (``--backend``: the
run's kernels, cupy on a GPU, where the device is synchronised around each step), with document
masking against full causal attention (``--dtype``, float32 by default), the variants taking
turns for ``--repeats`` rounds (best of the rounds, and the median of each round's own ratio):
the time ratio against the work ratio (intra-document pairs / full causal pairs); the target
is a time ratio <= 1.2 x the work ratio. With kernels that take the document ids (Numba's; the GPU's
float and bf16 kernels; one call per block) also the seam's per-document calls (one kernel call
per document's block, as for numpy_ref), side by side.

The engine (``--engine RANKS``, off by default): ``mpirun -n RANKS python -m mpipar.train``
with ``--sp RANKS --document-masking`` on a token file of such documents (random bytes, EOS 255
ending each document), under the contiguous, zigzag and balanced splits in turns for
``--engine-rounds`` rounds: the median step time after each run's first step, its ratio to
contiguous's, and the attention imbalance the runs report (max/mean work over the sp ranks).
With ranks sharing cores, a rank's extra work delays the others less than on cores of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from mpipar.bench.harness import Section, ints, train_run


TILE_FLOORS = ((128, 128), (128, 64), (64, 64))
"""Tile shapes (query rows, keys) whose floor `entries` reports: cuDNN's and FlashAttention's
head-dim-64 forward tiles are of the first two; 64 rows is one Hopper warpgroup's MMA."""


def packed_documents(seq: int, median: float, sigma: float, rng) -> np.ndarray:
    """Document ids ``[1, seq]`` of one sample cut from documents of log-normal lengths."""
    lengths, total = [], 0
    while total < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(median), sigma))))
        total += lengths[-1]
    return np.repeat(np.arange(len(lengths)), lengths)[:seq][None]


def balance(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Max/mean attention work per sp rank for every (seq, sp, split)."""
    from mpipar.parallel.sequence_split import SeqLayout, balanced_layout, rank_work

    rows = []
    for seq in ints(args.seqs):
        for sp in ints(args.sps):
            rng = np.random.default_rng(args.seed)
            got: dict[str, list[float]] = {"contiguous": [], "zigzag": [], "balanced": []}
            for _ in range(args.samples):
                docs = packed_documents(seq, args.median, args.sigma, rng)
                for split, layout in (("contiguous", SeqLayout(seq, sp)),
                                      ("zigzag", SeqLayout(seq, sp, "zigzag")),
                                      ("balanced", balanced_layout(seq, sp, docs))):
                    work = rank_work(layout, docs)
                    got[split].append(float(work.max() / work.mean()))
            rows.append({"seq": seq, "sp": sp,
                         **{f"{s}_mean": float(np.mean(v)) for s, v in got.items()},
                         **{f"{s}_worst": float(np.max(v)) for s, v in got.items()}})
    return rows


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds of attention forward + backward with and without document masking, under the
    training engine's allocator policy (`pool_freed_memory`: freed arrays are the next call's
    memory, no fresh pages per call, as in a training step)."""
    from mpipar.kernels import get_backend, with_attention
    from mpipar.runtime.host_memory import pool_freed_memory
    from mpipar.runtime.precision import numpy_dtype
    from mpipar.runtime.staging import copies_for
    from mpipar.model.attention import DocumentPositions, LocalAttention, documents_in_kernel
    from mpipar.parallel.sequence_split import token_work

    pool_freed_memory()
    seq, rng = args.speed_seq, np.random.default_rng(args.seed)
    docs = np.concatenate([packed_documents(seq, args.median, args.sigma, rng)
                           for _ in range(args.rows)])
    kernels, chosen = with_attention(get_backend(args.backend), args.attention, args.head_dim)
    shape = (args.rows, seq, args.heads, args.head_dim)
    dtype = numpy_dtype(args.dtype)
    q, k, v, dout = (kernels.xp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    sync = copies_for(kernels.xp is not np).sync       # waits for the device's stream (host: no-op)

    def step(kb, positions) -> tuple[float, float, float]:
        """Wall and process CPU seconds (all threads) of one forward + backward (on a GPU, wall
        from the device idle to the device done), and the host's seconds to issue it (to the
        last launch's return, before the wait: on a GPU, a step whose issue time is near its
        wall time is bound by the host's dispatch, not by the kernels)."""
        core = LocalAttention(kb)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        out, saved = core.forward(q, k, v, positions)
        core.backward(dout, q, k, v, out, saved)
        issued = time.perf_counter() - t0
        sync()
        return time.perf_counter() - t0, time.process_time() - c0, issued

    docs_pos = DocumentPositions.of(np.arange(seq), docs)
    variants = {"full": (kernels, np.arange(seq)), "masked": (kernels, docs_pos)}
    if documents_in_kernel(kernels, q.dtype):   # the same kernels called once per document's block
        variants["per_doc"] = (dataclasses.replace(   # (partials: no document flag)
            kernels, attention_fwd=functools.partial(kernels.attention_fwd),
            attention_bwd=functools.partial(kernels.attention_bwd)), docs_pos)
    times = {name: [] for name in variants}
    for name, (kb, pos) in variants.items():     # the first calls compile
        step(kb, pos)
    for _ in range(args.repeats):                # interleaved: the variants take turns, round
        for name, (kb, pos) in variants.items():  # by round, under the same load
            times[name].append(step(kb, pos))
    best = {name: np.min(t, axis=0) for name, t in times.items()}   # best wall, CPU, issue
    full, full_cpu, full_issue = best["full"]
    masked, masked_cpu, masked_issue = best["masked"]
    per_doc, per_doc_cpu, _ = best.get("per_doc", (None, None, None))
    rounds = np.array(times["masked"]) / np.array(times["full"])    # each round's own ratio
    work = float(token_work(docs).sum() / (args.rows * seq * (seq + 1) / 2))
    return {**entries(docs, args.head_dim, dtype.itemsize), "dtype": args.dtype, "seq": seq,
            "rows": args.rows, "documents": int(sum(r.max() + 1 for r in docs)),
            "backend": kernels.name, "attention": chosen, "rounds": args.repeats,
            "round_time_over_work_median": float(np.median(rounds[:, 0]) / work),
            "round_cpu_over_work_median": float(np.median(rounds[:, 1]) / work),
            "full_s": full, "masked_s": masked, "time_ratio": masked / full,
            "work_ratio": work, "time_over_work": masked / full / work,
            "full_cpu_s": full_cpu, "masked_cpu_s": masked_cpu,
            "cpu_over_work": masked_cpu / full_cpu / work,
            "full_issue_s": full_issue, "masked_issue_s": masked_issue,
            "per_document_calls_s": per_doc, "per_document_cpu_s": per_doc_cpu,
            "per_document_time_over_work": per_doc and per_doc / full / work,
            "per_document_cpu_over_work": per_doc and per_doc_cpu / full_cpu / work}


SPLITS = ("contiguous", "zigzag", "balanced")
ENGINE_EOS = 255


def document_stream(tokens: int, median: float, sigma: float, rng) -> np.ndarray:
    """``tokens`` byte tokens ``[tokens]`` uint16 of packed documents of log-normal lengths:
    random ids below :data:`ENGINE_EOS`, each document (:func:`packed_documents`) ended by it."""
    ids = packed_documents(tokens, median, sigma, rng)[0]
    out = rng.integers(0, ENGINE_EOS, tokens).astype(np.uint16)
    out[np.flatnonzero(np.diff(ids))] = ENGINE_EOS
    return out


def engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Training steps under each split (``--engine RANKS`` sp ranks, the splits in turns)."""
    ranks, seq, rows = args.engine, args.engine_seq, args.engine_rows
    flags = ["--document-masking", "--eos-token-id", str(ENGINE_EOS), "--sp", str(ranks),
             "--seq-len", str(seq), "--global-batch-size", str(rows), "--micro-batch-size",
             str(rows), "--steps", str(args.engine_steps), "--log-every", "0", "--tensorboard",
             "off", "--seed", str(args.seed), *args.engine_flags.split()]
    steps: dict[str, list[float]] = {s: [] for s in SPLITS}
    imbalance: dict[str, list[float]] = {s: [] for s in SPLITS}
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-documents-") as tmp:
        data = os.path.join(tmp, "documents.npy")
        np.save(data, document_stream(64 * rows * (seq + 1) * args.engine_steps, args.median,
                                      args.sigma, np.random.default_rng(args.seed)))
        for rnd in range(args.engine_rounds):
            for split in SPLITS:
                records, _ = train_run("documents", ranks, [*flags, "--data", data, "--sp-split",
                                                            split],
                                       os.path.join(tmp, f"{split}-{rnd}"))
                steps[split] += [r["step_time_s"] for r in records[1:]]
                imbalance[split] += [r["attention_imbalance"] for r in records
                                     if r.get("attention_imbalance") is not None]
    base = statistics.median(steps["contiguous"])
    return [{"split": s, "ranks": ranks, "seq": seq, "rows": rows,
             "step_s": statistics.median(steps[s]),
             "vs_contiguous": statistics.median(steps[s]) / base,
             "imbalance_mean": float(np.mean(imbalance[s])),
             "imbalance_worst": float(np.max(imbalance[s]))} for s in SPLITS]


def entries(docs: np.ndarray, head_dim: int, itemsize: int = 4) -> dict[str, float]:
    """Score entries each kernel family computes for the packed row ``docs`` over its
    intra-document causal pairs, counted from the kernels' own loop bounds (no timing): the
    Numba kernels' tiles (`attention_cpu.tile_work`), the GPU's float flash kernels' warps
    (`flash_exact.score_entries`; float32 for a 2-byte dtype) and the GPU's bf16 kernel's 16-row
    slabs (`flash_mma.score_entries`, where it has the head dim); and the query tiles of
    `cudnn_documents.GRID_ROWS` rows a head that cuDNN's ragged calls launch (`grid_tiles`: one
    call, the length classes of `GROUPED`) against the documents' own; and for tiles of
    `TILE_FLOORS` shapes, each document its own sequence (`cudnn_documents.tile_entries`), the
    entries per pair over the full causal step's at the same tiles: the time / work a kernel of
    that tile shape reaches if it runs the documents at the full causal step's rate per entry."""
    from mpipar.kernels import cudnn_documents, flash_exact, flash_mma
    from mpipar.kernels.attention_cpu import tile_work
    from mpipar.parallel.sequence_split import token_work

    row = np.asarray(docs).reshape(-1, np.shape(docs)[-1])     # [rows, S]
    pairs, n = float(token_work(row).sum()), row.shape[1]
    ragged = cudnn_documents.ragged_batch(row)
    lengths = ragged.lengths[:ragged.documents]
    floors = {f"{r}x{k}": cudnn_documents.tile_entries(lengths, r, k) / pairs    # over a row's
              / (cudnn_documents.tile_entries([n], r, k) / (n * (n + 1) / 2))   # full causal
              for r, k in TILE_FLOORS}
    return {"tile_floors": floors,
            "cudnn_grid_tiles": cudnn_documents.grid_tiles((ragged,)),
            "cudnn_grouped_grid_tiles": cudnn_documents.grid_tiles(ragged.groups()),
            "cudnn_documents_tiles": cudnn_documents.document_tiles(ragged),
            "cudnn_classes": len(ragged.groups()),
            "cudnn_grouped": cudnn_documents.GROUPED, "cudnn_grid_rows": cudnn_documents.GRID_ROWS,
            "numba_entries_over_pairs": tile_work(n, n, head_dim, q_docs=row, k_docs=row)[1] / pairs,
            "gpu_entries_over_pairs": flash_exact.score_entries(n, n, head_dim, max(4, itemsize),
                                                                q_docs=row,
                                                                k_docs=row) / pairs,
            "bf16_entries_over_pairs": flash_mma.score_entries(n, n, head_dim, q_docs=row,
                                                               k_docs=row) / pairs
            if head_dim in flash_mma.HEAD_DIMS else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.seqs, args.samples, args.speed_seq, args.repeats = "8192", 5, 2048, 1
    rows = balance(args)
    print(f"documents: work balance, log-normal lengths (median {args.median}, sigma "
          f"{args.sigma}), {args.samples} samples; max/mean attention work per sp rank")
    print(f"{'seq':>6} {'sp':>3} " + " ".join(f"{s + ' mean/worst':>22}"
                                              for s in ("contiguous", "zigzag", "balanced")))
    for r in rows:
        print(f"{r['seq']:>6} {r['sp']:>3} " + " ".join(
            f"{r[s + '_mean']:>11.4f}/{r[s + '_worst']:<10.4f}"
            for s in ("contiguous", "zigzag", "balanced")))
    sp_ = speed(args)
    print(f"speed: {sp_['rows']} row(s) of {sp_['seq']} tokens, {sp_['documents']} documents, "
          f"{args.heads} heads x {args.head_dim}, {sp_['dtype']}, {sp_['backend']} kernels: "
          f"forward+backward full causal {sp_['full_s'] * 1e3:.1f} ms, document-masked "
          f"{sp_['masked_s'] * 1e3:.1f} ms; time ratio {sp_['time_ratio']:.4f}, work ratio "
          f"{sp_['work_ratio']:.4f}, time/work {sp_['time_over_work']:.2f} (target <= 1.2)")
    print(f"  {sp_['attention']}")
    print(f"  {sp_['rounds']} interleaved rounds, each round's masked / full causal over the work "
          f"ratio, median: wall {sp_['round_time_over_work_median']:.2f}, "
          f"CPU {sp_['round_cpu_over_work_median']:.2f}")
    print(f"  CPU time (all threads): full causal {sp_['full_cpu_s'] * 1e3:.1f} ms, "
          f"document-masked {sp_['masked_cpu_s'] * 1e3:.1f} ms, "
          f"cpu/work {sp_['cpu_over_work']:.2f}")
    if sp_["backend"] == "cupy":
        print(f"  host time to issue the step (before the wait for the device): full causal "
              f"{sp_['full_issue_s'] * 1e3:.2f} ms, document-masked "
              f"{sp_['masked_issue_s'] * 1e3:.2f} ms of its {sp_['masked_s'] * 1e3:.2f} ms")
    print(f"  score entries computed / intra-document pairs (the kernels' loop bounds): Numba "
          f"tiles {sp_['numba_entries_over_pairs']:.3f}, GPU flash warps "
          f"{sp_['gpu_entries_over_pairs']:.3f}, GPU bf16 slabs "
          f"{sp_['bf16_entries_over_pairs'] or float('nan'):.3f}")
    print(f"  cuDNN's ragged grid, query tiles of {sp_['cudnn_grid_rows']} a head: one call "
          f"{sp_['cudnn_grid_tiles']}, by length class {sp_['cudnn_grouped_grid_tiles']} "
          f"({sp_['cudnn_classes']} calls each way), the documents' own "
          f"{sp_['cudnn_documents_tiles']}; GROUPED {sp_['cudnn_grouped']}")
    print("  time / work at the full causal step's rate per entry, tiles rows x keys, each "
          "document its own sequence: " + ", ".join(f"{t} {f:.3f}"
                                                    for t, f in sp_["tile_floors"].items()))
    if sp_["per_document_calls_s"] is not None:
        print(f"  the same kernels called once per document's block: "
              f"{sp_['per_document_calls_s'] * 1e3:.1f} ms "
              f"(CPU {sp_['per_document_cpu_s'] * 1e3:.1f} ms), "
              f"time/work {sp_['per_document_time_over_work']:.2f}, "
              f"cpu/work {sp_['per_document_cpu_over_work']:.2f}")
    if not args.engine:
        return {"balance": rows, "speed": sp_}
    eng = engine(args)
    print(f"engine: mpirun -n {args.engine} python -m mpipar.train --sp {args.engine} "
          f"--document-masking, {args.engine_rows} row(s) of {args.engine_seq} tokens, "
          f"{args.engine_rounds} round(s) of {args.engine_steps} steps, the splits in turns")
    print(f"{'split':>11} {'step (median)':>14} {'/ contiguous':>13} {'imbalance mean/worst':>21}")
    for r in eng:
        print(f"{r['split']:>11} {r['step_s'] * 1e3:>11.1f} ms {r['vs_contiguous']:>13.3f} "
              f"{r['imbalance_mean']:>10.3f}/{r['imbalance_worst']:<10.3f}")
    return {"balance": rows, "speed": sp_, "engine": eng}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seqs", default="8192,32768", help="sequence lengths (comma list)")
    parser.add_argument("--sps", default="4,8", help="sp sizes (comma list)")
    parser.add_argument("--median", type=float, default=200.0, help="median document length")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of log(length)")
    parser.add_argument("--samples", type=int, default=50, help="samples per (seq, sp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed-seq", type=int, default=8192, help="speed check: tokens")
    parser.add_argument("--rows", type=int, default=1,
                        help="speed check: packed rows in the batch (each its own sample)")
    parser.add_argument("--heads", type=int, default=4, help="speed check: heads")
    parser.add_argument("--head-dim", type=int, default=64, help="speed check: head size")
    parser.add_argument("--repeats", type=int, default=3, help="speed check: timed rounds")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"),
                        help="speed check: the arrays' dtype (bfloat16 on a GPU: mpipar's "
                             "flash_mma, which takes the document ids)")
    parser.add_argument("--attention", default="auto", choices=("auto", "cudnn", "mpipar"),
                        help="speed check, bf16 on a GPU: the full causal step's attention "
                             "(auto: cuDNN where it takes the call, as in training; mpipar: "
                             "flash_mma for both, the kernel's own masking against itself)")
    parser.add_argument("--backend", default="auto", choices=("auto", "numba", "numpy", "cupy"),
                        help="speed check: kernels (auto: cupy with a GPU, else numba)")
    parser.add_argument("--engine", type=int, default=0, metavar="RANKS",
                        help="also train under mpirun -n RANKS (sp = RANKS) on packed documents "
                             "with each split, in turns (0: no)")
    parser.add_argument("--engine-seq", type=int, default=8192, help="engine: sequence length")
    parser.add_argument("--engine-rows", type=int, default=1, help="engine: rows in a step")
    parser.add_argument("--engine-steps", type=int, default=4, help="engine: steps a run")
    parser.add_argument("--engine-rounds", type=int, default=2, help="engine: runs per split")
    parser.add_argument("--engine-flags", default="",
                        help="engine: more python -m mpipar.train flags (e.g. the model's)")


SECTION = Section("documents", run, "packed documents: attention work per sp rank under the "
                  "contiguous, zigzag and balanced splits; document-masked attention time "
                  "against full causal", configure)
