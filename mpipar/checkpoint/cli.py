"""The command line of ``python -m mpipar.ckpt`` (:mod:`mpipar.ckpt` is its entry): look at,
check and convert mpipar checkpoints with :mod:`.tools` and :mod:`.reader`.

    python -m mpipar.ckpt inspect PATH [--json]      tensors, shapes, dtypes, metadata, shards
    python -m mpipar.ckpt verify PATH [PATH ...]     every shard present, every sha256 matches
    python -m mpipar.ckpt consolidate PATH OUT.h5 [--params-only]
    python -m mpipar.ckpt export-hf PATH OUT_DIR [--dtype float16|bfloat16|float32|float64]
    python -m mpipar.ckpt merge-adapter PATH --out OUT_DIR [--base HF_DIR] [--dtype ...]

PATH is a checkpoint directory (``step_NNNNNNNN``) or a save directory (its ``latest``).
Exit status: 0 success; 1 ``verify`` found damage (a missing, truncated or corrupted file; each
problem printed on its own line, naming the file); 2 the checkpoint cannot be used: malformed
metadata, a link or a path reaching outside its directory, a tensor the reading cannot find (the
message names the file and the field or dataset).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpipar.checkpoint import tools
from mpipar.checkpoint.directory import INDEX, STEP_DIR, CheckpointError, resolve_path
from mpipar.checkpoint.index import KINDS
from mpipar.checkpoint.reader import verify
from mpipar.config import ConfigError


def _inspect(path: str, as_json: bool) -> int:
    info = tools.inspect(path)
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    lay = info["layout"]
    print(f"{info['path']}: step {info['step']} (optimizer step {info['optimizer_step']}), "
          f"{info['dtype']}, saved {info['saved_at']} by {info['world_size']} rank(s)")
    print("layout: " + " ".join(f"{k}={v}" for k, v in lay.items()))
    print("model:  " + " ".join(f"{k}={v}" for k, v in info["model"].items()))
    sched = info["lr_schedule"]
    decay = (f", {sched['decay_shape']} decay from step {sched['decay_start'] + 1} "
             f"({sched['decay_fraction']:g} of the steps)" if sched["kind"] == "wsd" else "")
    print(f"lr:     {sched['kind']} peak {sched['lr']:g} min {sched['min_lr']:g} warm-up "
          f"{sched['warmup_steps']} of {sched['total_steps']}{decay}; next step "
          f"{sched['next_step']} lr {sched['next_lr']:.6g}")
    data = info["data"]
    print(f"data:   {data['path']} ({data['num_samples']} samples of {data['seq_len']}), seed "
          f"{data['seed']}, shuffle {data['shuffle']}, batch {data['global_batch_size']}; "
          f"next step {data['next_step']} ({data['samples_consumed']} samples consumed)")
    print(f"shards: {len(info['shards'])}")
    for s in info["shards"]:
        print(f"  {s['file']}  rank {s['rank']:>4}  dp {s['dp']} tp {s['tp']} pp {s['pp']} "
              f"sp {s['sp']}  {s['size']:>12,} bytes  {s['datasets']:>4} datasets  "
              f"sha256 {s['sha256'][:16]}...")
    total = 0
    print(f"tensors: {len(info['tensors'])}")
    for t in info["tensors"]:
        count = 1
        for n in t["shape"]:
            count *= n
        total += count
        print(f"  {t['name']:<56} {t['dtype']:<8} {str(t['shape']):<14} "
              f"{t['sources']} source rectangle(s)")
    print(f"  {total:,} values")
    return 0


def _checkpoint_of(spec: str):
    """The checkpoint ``spec`` names (:func:`resolve_path`; a run directory: its
    ``checkpoints/`` save directory's latest); CheckpointError for a path that does not exist or
    holds no checkpoint (bad input, not damage)."""
    p = Path(spec)
    if not p.exists():
        raise CheckpointError(f"{spec}: no such file or directory")
    if p.is_dir() and not (p / INDEX).exists() and (p / "checkpoints").is_dir():
        p = p / "checkpoints"                    # a run directory: its save directory
    path = resolve_path(p)
    if path.is_dir() and not (path / INDEX).exists() and not STEP_DIR.match(path.name):
        raise CheckpointError(f"{spec}: not a checkpoint (no {INDEX}), a save directory with "
                              f"a 'latest' or a run directory with checkpoints/")
    return path


def _verify(paths: list[str]) -> int:
    """Status 1 when a checkpoint is damaged, 2 when one cannot be used at all (a path that does
    not exist or is no checkpoint, a malformed index or shard, or one reaching outside its
    directory): the worst of ``paths``."""
    status = 0
    for spec in paths:
        try:
            path = _checkpoint_of(spec)
            problems = verify(path)
        except CheckpointError as exc:
            print(f"mpipar.ckpt: error: {exc}", file=sys.stderr)
            status = 2
            continue
        if problems:
            status = max(status, 1)
            print(f"FAILED {path}: {len(problems)} problem(s)")
            for p in problems:
                print(f"  {p}")
        else:
            shards = len(tools.inspect(path)["shards"])
            print(f"ok {path}: index and {shards} shard(s) present, sha256 checksums match")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpipar.ckpt",
                                     description="Inspect, verify and convert mpipar checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    ins = commands.add_parser("inspect", help="list tensors, shapes, dtypes and metadata")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="print everything as JSON")
    ver = commands.add_parser("verify", help="check every shard is present and its sha256 "
                                             "matches; exit 1 naming each problem")
    ver.add_argument("paths", nargs="+")
    con = commands.add_parser("consolidate", help="write one HDF5 file of plain global datasets")
    con.add_argument("path")
    con.add_argument("out")
    con.add_argument("--params-only", action="store_true", help="leave out the AdamW moments")
    exp = commands.add_parser("export-hf", help="write a Hugging Face directory (Llama; Qwen2 "
                                                "with attention biases)")
    exp.add_argument("path")
    exp.add_argument("out")
    exp.add_argument("--dtype", choices=("float16", "bfloat16", "float32", "float64"),
                     default=None,
                     help="dtype of the exported weights (default: the training dtype)")
    mer = commands.add_parser("merge-adapter", help="write a LoRA run's model, adapters merged "
                                                    "(PEFT's merge_and_unload()), as a Hugging "
                                                    "Face directory")
    mer.add_argument("path")
    mer.add_argument("--out", required=True, help="the Hugging Face directory to write")
    mer.add_argument("--base", default=None,
                     help="the frozen base's Hugging Face directory (default: the run's "
                          "--init-from-hf, else its seed's initialisation)")
    mer.add_argument("--dtype", choices=("float16", "bfloat16", "float32", "float64"),
                     default=None, help="dtype of the merged weights (default: the training dtype)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.path, args.json)
        if args.command == "verify":
            return _verify(args.paths)
        if args.command == "consolidate":
            kinds = ("param",) if args.params_only else KINDS
            out = tools.consolidate(args.path, args.out, kinds)
            print(f"wrote {out}: {', '.join(kinds)}")
            return 0
        if args.command == "merge-adapter":
            out = tools.merge_adapter(args.path, args.out, args.dtype, args.base)
        else:
            out = tools.export_hf(args.path, args.out, args.dtype)
        arch = json.loads((out / "config.json").read_text())["architectures"][0]
        print(f"wrote {out} (Hugging Face {arch})")
        return 0
    except (CheckpointError, ConfigError, OSError, ValueError) as exc:
        print(f"mpipar.ckpt: error: {exc}", file=sys.stderr)
        return 2
