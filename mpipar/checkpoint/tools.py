"""What ``python -m mpipar.ckpt`` does with a checkpoint: inspect it, consolidate it into one
HDF5 file, export its parameters as a Hugging Face directory. Every one goes through the checked
index (:func:`.index.read_index`); consolidate and export read tensors only once the checkpoint
verifies (:func:`.reader.require_sound`), and write nothing inside a checkpoint."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipar.checkpoint.directory import CheckpointError, fsync_file, require_outside, resolve_path
from mpipar.checkpoint.index import KINDS, read_index
from mpipar.config import Config
from mpipar.checkpoint.reader import (ShardFiles, read_config, read_moe_bias, read_tensors,
                                      require_config_shapes, require_memory, require_sound)


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds: metadata, layout, schedule and data positions, shards, tensors.

    Returns a JSON-ready dict: ``path, step, optimizer_step, dtype, world_size, saved_at,
    layout, lr_schedule, data, rng, model`` (dicts), ``shards`` (file, sha256, size, rank, dp,
    tp, pp, sp, datasets) and ``tensors`` (name ``kind/name``, shape, dtype, number of source
    rectangles). Reads the index only (checked against its schema); does not verify.
    """
    path = resolve_path(path)
    index = read_index(path)
    out: dict[str, Any] = {"path": str(path)}
    for key in ("step", "optimizer_step", "dtype", "world_size", "saved_at"):
        out[key] = index.attrs[key]
    out.update({group: dict(attrs) for group, attrs in index.groups.items()})
    if index.moe_bias:
        out["moe_bias"] = {f"layers.{i}": b.tolist() for i, b in index.moe_bias.items()}
    out["model"] = dataclasses.asdict(index.config.model)
    out["shards"] = [{"file": s.file, "sha256": s.sha256, "size": s.size, "rank": s.rank,
                      **dict(zip(("dp", "tp", "pp", "sp"), s.coord)), "datasets": s.datasets}
                     for s in index.shards.values()]
    out["tensors"] = [{"name": f"{kind}/{name}", "shape": list(t.shape),
                       "dtype": index.dtype.name, "sources": len(t.mappings)}
                      for kind, tensors in index.tensors.items() for name, t in tensors.items()]
    return out


def consolidate(path: str | os.PathLike, out: str | os.PathLike,
                kinds: tuple[str, ...] = KINDS) -> Path:
    """Write the checkpoint as one HDF5 file of plain datasets ``<kind>/<name>`` (global shapes,
    chunked with fletcher32) with the index's attributes; written beside ``out`` and renamed in.
    Verifies the checkpoint first, then that its tensors have the shapes its config implies and
    that the largest fits in memory (CheckpointError before anything is allocated)."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    path, out = resolve_path(path), Path(out)
    require_outside(out)
    index = require_sound(path)
    require_config_shapes(path, index)
    largest = max((math.prod(t.shape) for tensors in index.tensors.values()
                   for t in tensors.values()), default=0)
    require_memory(2 * largest * index.dtype.itemsize, f"consolidating {path} (its largest tensor)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with ShardFiles(path, index) as files, h5py.File(tmp, "w") as dst:
            for key, value in index.attrs.items():
                dst.attrs[key] = value
            for group, attrs in index.groups.items():
                g = dst.create_group(group)
                for key, value in attrs.items():
                    g.attrs[key] = value
            if index.moe_bias:
                g = dst.create_group("moe_bias")
                for i, value in index.moe_bias.items():
                    g.attrs[f"layers.{i}"] = value
            if index.dpo_reference is not None:
                dst.create_dataset("dpo_reference", data=index.dpo_reference)
            for kind in kinds:
                for name, tensor in index.tensors[kind].items():
                    value = files.read(kind, name, tuple(slice(0, n) for n in tensor.shape))
                    dst.create_dataset(f"{kind}/{name}", data=value, chunks=True, fletcher32=True)
        fsync_file(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def export_hf(path: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write the checkpoint's parameters as a Hugging Face directory (config.json +
    model.safetensors: :func:`mpipar.checkpoint.huggingface.save_hf`) in ``dtype`` (default:
    the training dtype). Verifies first, then the tensors' shapes against the config and the
    parameters' size against the memory available (CheckpointError before any is read)."""
    from mpipar.checkpoint import hf_moe
    from mpipar.checkpoint import huggingface as hf

    require_outside(Path(out))
    index = require_sound(resolve_path(path))
    require_config_shapes(resolve_path(path), index)
    params = sum(math.prod(t.shape) for t in index.tensors["param"].values())
    require_memory(2 * params * index.dtype.itemsize, f"exporting {path} (its parameters)")
    cfg = read_config(path)
    if cfg.train.lora_rank:
        raise CheckpointError(f"{path}: train.lora_rank={cfg.train.lora_rank}: a LoRA run's "
                              f"checkpoint holds its adapters, not a model; python -m "
                              f"mpipar.ckpt merge-adapter writes the merged model")
    params = read_tensors(path, "param")
    for note in hf_moe.export_notes(cfg.model, read_moe_bias(path)):
        print(f"mpipar: {note}", flush=True)
    hf.save_hf(out, cfg.model, params, dtype=dtype or cfg.train.dtype,
               extra_config={"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS,
                                                            cfg.train.seq_len)},
               biases=read_moe_bias(path))
    return Path(out)


def merge_adapter(path: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                  base: str | None = None) -> Path:
    """Write the model of a LoRA run's checkpoint, adapters merged into their weights as PEFT's
    ``merge_and_unload()`` does (:func:`merged_model`), as a Hugging Face directory in ``dtype``
    (default: the training dtype). CheckpointError or ConfigError before anything is written
    when the checkpoint is not a LoRA run's or the base does not fit it."""
    from mpipar.checkpoint import huggingface as hf

    require_outside(Path(out))
    cfg, params, extra = merged_model(path, base)
    hf.save_hf(out, cfg.model, params, dtype=dtype or cfg.train.dtype, extra_config=extra)
    return Path(out)


def merged_model(path: str | os.PathLike, base: str | None = None
                 ) -> tuple[Config, dict[str, np.ndarray], dict[str, Any]]:
    """(the run's configuration, its model's float64 weights with the adapters merged, ``W +
    s B A``, and the Hugging Face config fields the base carries) of a LoRA run's checkpoint.
    The checkpoint holds the adapters alone; the frozen base is the run's: ``base`` (a Hugging
    Face directory), else the run's ``--init-from-hf``, else its seed's initialisation.
    CheckpointError when the checkpoint is not a LoRA run's or the base does not fit it."""
    from mpipar.checkpoint import huggingface as hf
    from mpipar.checkpoint import peft
    from mpipar.model.lora import Lora
    from mpipar.model.params import init_params, param_specs

    ckpt = resolve_path(path)
    require_sound(ckpt)
    require_config_shapes(ckpt, read_index(ckpt))
    cfg = read_config(ckpt)
    lora = Lora.of(cfg.train)
    if lora is None:
        raise CheckpointError(f"{ckpt}: train.lora_rank=0: not a LoRA run's checkpoint, it has "
                              f"no adapter to merge (python -m mpipar.ckpt export-hf writes it)")
    source = base or cfg.train.init_from_hf
    if source:
        weights = hf.load_hf(source, "float64", cfg.train.hf_untie_embeddings)[1]
        extra = hf.passthrough_config(source)
    else:
        weights = init_params(cfg.model, cfg.train.seed, "float64")
        extra = {"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS, cfg.train.seq_len)}
    for spec in param_specs(cfg.model):
        shape = tuple(weights[spec.name].shape) if spec.name in weights else None
        if shape != spec.shape:
            raise CheckpointError(f"base {source}: {spec.name} is "
                                  f"{'missing' if shape is None else list(shape)}, the model "
                                  f"{ckpt} was trained on needs {list(spec.shape)}")
    params = {**{s.name: weights[s.name] for s in param_specs(cfg.model)},
              **{n: v.astype("float64") for n, v in read_tensors(ckpt, "param").items()}}
    return cfg, peft.merge(cfg.model, lora, params), extra

