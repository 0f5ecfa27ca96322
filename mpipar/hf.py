"""``python -m mpipar.hf``: inspect and convert Hugging Face Llama, Qwen2 and Mistral checkpoints
(the formats and rules are :mod:`mpipar.checkpoint.huggingface`'s).

    python -m mpipar.hf inspect DIR      # what of the checkpoint mpipar supports, field by field
    python -m mpipar.hf convert SRC DST [--dtype float16|bfloat16|float32|float64]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.huggingface import (CONFIG_FILE, INDEX_FILE, SAVE_DTYPES,
                                           HFCheckpointError, Support, check_tensors,
                                           open_safetensors, read_config_json, support,
                                           weight_files)
from mpipar.config import ConfigError, ModelConfig
from mpipar.layout import resolve_model
def _describe_tensors(path: Path) -> list[str]:
    files = weight_files(path)
    rows, total = [], 0
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with open_safetensors(file) as f:
            held = set(f.keys())
            for name in sorted(names):
                if name not in held:
                    raise HFCheckpointError(f"{path / INDEX_FILE}: maps {name} to {file.name}, "
                                            f"which does not hold it")
                piece = f.get_slice(name)
                shape = piece.get_shape()
                total += math.prod(shape)
                rows.append(f"  {name:<52} {piece.get_dtype():<5} {shape}  [{file.name}]")
    return rows + [f"  {len(files)} tensors, {total:,} values"]


def _inspect(path: str) -> int:
    """Print config.json, the tensors, and what mpipar makes of each aspect; 1 if any is not
    supported."""
    root = Path(path)
    raw = read_config_json(root)
    print(f"{root / CONFIG_FILE}:")
    for key in sorted(raw):
        print(f"  {key}: {json.dumps(raw[key])}")
    print("tensors:")
    for row in _describe_tensors(root):
        print(row)
    found, fields = support(raw)
    if not any(a.problem for a in found):
        cfg = hf_deepseek.with_stored_mtp(resolve_model(ModelConfig(**fields)), raw,
                                          weight_files(root))
        declared = hf_deepseek.mtp_layers(raw) if raw.get("model_type") == hf_deepseek.KIND else 0
        if declared:
            found.append(Support("mtp", _mtp_reading(cfg, declared)))
        try:
            count = len(check_tensors(root, raw, cfg))  # what training checks before it reads
            found.append(Support("tensors", f"the {count} tensors the config implies, no other"))
        except HFCheckpointError as exc:
            found.append(Support("tensors", "", str(exc)))
    print("mpipar support:")
    for a in found:
        print(f"  {a.aspect:<12} " + (f"NOT SUPPORTED: {a.problem}" if a.problem else a.reading))
    problems = [a.aspect for a in found if a.problem]
    if problems:
        print(f"mpipar: not supported: {', '.join(problems)} (see above)")
        return 1
    print("mpipar model config:")
    for f in dataclasses.fields(cfg):
        print(f"  {f.name} = {getattr(cfg, f.name)!r}")
    return 0


def _mtp_reading(cfg: ModelConfig, declared: int) -> str:
    """What ``hf inspect`` says of a DeepSeek-V3's multi-token prediction modules."""
    L, d = cfg.layers, cfg.mtp_depth
    if not d:
        return (f"num_nextn_predict_layers={declared}: no module stored (model.layers.{L}.* "
                f"absent, as transformers saves it): model.mtp_depth=0")
    return (f"{d} of {declared} multi-token prediction module(s) stored as model.layers.{L}"
            f"{f'..{L + d - 1}' if d > 1 else ''} (enorm, hnorm, eh_proj, a decoder layer, "
            f"shared_head.norm; embed_tokens and shared_head.head are copies of the shared "
            f"embedding and head, not read): read as model.mtp_depth={d}")


def _convert(src: str, dst: str, dtype: str | None, untie: bool) -> int:
    from mpipar.checkpoint.hf_convert import convert
    pieces = convert(src, dst, dtype, untie)
    print(f"wrote {dst}: {len(pieces)} tensors, {pieces[0].dtype.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mpipar.hf {inspect,convert}``; exit status 2 on an unusable checkpoint."""
    parser = argparse.ArgumentParser(prog="python -m mpipar.hf",
                                     description="Inspect and convert Hugging Face Llama, "
                                                 "Qwen2 and Qwen3 checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    ins = commands.add_parser("inspect", help="print config.json, the tensors, and what of them "
                                              "mpipar supports (exit 1 if anything is not)")
    ins.add_argument("dir")
    conv = commands.add_parser("convert", help="read a checkpoint and write it as mpipar exports "
                                               "(config.json + one model.safetensors)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", choices=SAVE_DTYPES, default=None,
                      help="cast every tensor (default: keep the file's dtype; "
                           "bfloat16 -> float32)")
    conv.add_argument("--untie-embeddings", action="store_true",
                      help="untie a tied checkpoint: write lm_head as a copy of the embedding "
                           "(default: keep them tied, one tensor)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.dir)
        return _convert(args.src, args.dst, args.dtype, args.untie_embeddings)
    except (ConfigError, ValueError) as exc:
        print(f"mpipar.hf: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
