"""``python -m mpipar.hf convert``: a Hugging Face checkpoint rewritten one tensor at a time.

The tensors are checked from the safetensors headers (:func:`~mpipar.checkpoint.huggingface.
check_tensors`), then streamed: each is read, cast and appended to the new ``model.safetensors``
before the next is read, so a conversion holds one tensor, never the model. Before anything is
read it is admitted: the largest tensor (as read and as written) must fit in the memory this node
has available, and the whole output in the space free where it goes; a header that declares
more than a file holds (a sparse or crafted file whose tensors were never written) is refused
with the rest by ``check_tensors``, since a file's tensors must lie inside it. The output
directory appears complete or not at all (:func:`mpipar.checkpoint.export_dir.publish`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.export_dir import publish
from mpipar.checkpoint.safetensors_format import header_bytes
from mpipar.checkpoint.huggingface import (_NUMPY_DTYPES, CONFIG_FILE,
                                           WEIGHTS_FILE, HFCheckpointError, _check_dtype,
                                           _read_file, check_export_target, check_tensors,
                                           hf_config, hf_name, model_config_from_hf, model_type,
                                           open_safetensors, passthrough_config,
                                           read_config_json, weight_files)
from mpipar.model.params import EMBED, param_specs

_READ_ITEMSIZE = {"F16": 2, "F32": 4, "F64": 8, "BF16": 10}
"""Bytes a stored value takes while it is read: bfloat16 is read as its 16 bits, widened to 32
and viewed as float32 (2 + 4 + 4)."""


@dataclass(frozen=True)
class Piece:
    """One tensor of the output: its name, where it is read, its shape and dtypes."""
    name: str          # in the output
    file: Path         # the safetensors file it is read from
    source: str        # its name there
    shape: tuple[int, ...]
    stored: str        # its safetensors dtype code there
    dtype: np.dtype    # as written

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def peak(self) -> int:
        """Bytes held at once while it is converted: as read, and as written."""
        return math.prod(self.shape) * _READ_ITEMSIZE[self.stored] + self.nbytes


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype=None,
            untie: bool = False) -> list[Piece]:
    """Write the checkpoint ``src`` as mpipar exports it (``config.json`` + one
    ``model.safetensors``) to ``dst``, one tensor at a time (module docstring): each in
    ``dtype`` (default: the file's; bfloat16 read as float32), a tied model tied unless
    ``untie``. Returns what was written. HFCheckpointError (a ConfigError) or ValueError,
    naming the file, tensor or amount, before anything is read or written."""
    dt, root = _check_dtype(dtype), Path(src)
    raw = read_config_json(root)
    cfg = model_config_from_hf(raw, str(root / CONFIG_FILE), untie)
    stored, kind = check_tensors(root, raw, cfg), raw.get("model_type", "llama")
    if kind == hf_deepseek.KIND:
        if raw.get("rope_interleave", True) is not True:
            raise HFCheckpointError(f"{root / CONFIG_FILE}: rope_interleave="
                                    f"{raw['rope_interleave']!r}: convert copies DeepSeek-V3's "
                                    f"tensors as stored, in the interleaved layout an export "
                                    f"declares (must be true)")
        files = weight_files(root)       # the routers' selection biases go along
        stored.update({n: files[n] for n in (hf_deepseek.SELECTION_BIAS.format(i=i)
                                             for i in range(cfg.layers)) if n in files})
    pieces = _pieces(cfg, stored, kind, dt)
    config = hf_config(cfg, pieces[0].dtype.name, passthrough_config(src))
    check_export_target(dst)
    admit(pieces, Path(dst))

    def write(tmp: Path) -> None:
        _write_streamed(pieces, tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    publish(Path(dst), write)
    return pieces


def _pieces(cfg, stored: dict[str, Path], kind: str, dt: np.dtype | None) -> list[Piece]:
    """The output's tensors in :func:`param_specs` order, read from ``stored`` (an untied head
    from the embedding); one dtype for all (ValueError naming them otherwise)."""
    pieces, written = [], model_type(cfg)
    extra = [(n, (cfg.moe_experts,)) for n in stored if n.endswith("e_score_correction_bias")]
    for spec_name, shape in [(s.name, s.shape) for s in param_specs(cfg)] + extra:
        name = spec_name if spec_name in stored else EMBED   # an untied head: a copy
        file, source = stored[name], hf_name(name, kind) if name not in dict(extra) else name
        with open_safetensors(file) as f:
            code = f.get_slice(source).get_dtype()
        read = np.dtype(np.float32 if code == "BF16" else _NUMPY_DTYPES[code])
        out = hf_name(spec_name, written) if spec_name not in dict(extra) else spec_name
        bias = spec_name in dict(extra)   # in the parameters' dtype (transformers widens it)
        pieces.append(Piece(out, file, source, tuple(shape), code,
                            dt or (pieces[0].dtype if bias else read)))
    kinds = sorted({p.dtype.name for p in pieces})
    if len(kinds) != 1:
        raise ValueError(f"the checkpoint's tensors have dtypes {kinds}; give --dtype to "
                         f"write one")
    return pieces


def admit(pieces: list[Piece], dst: Path) -> None:
    """Refuse (HFCheckpointError) a conversion whose largest tensor, as read and as written,
    needs more memory than this node has available, or whose output needs more space than
    the filesystem of ``dst`` has free."""
    from mpipar.runtime.host_memory import available_memory_bytes
    largest = max(pieces, key=lambda p: p.peak)
    available = available_memory_bytes()
    if available is not None and largest.peak > available:
        raise HFCheckpointError(
            f"{largest.file}: tensor {largest.source} {list(largest.shape)} needs "
            f"{largest.peak:,} bytes of memory to convert (read as {largest.stored}, written "
            f"as {largest.dtype.name}); this node has {available:,} bytes available: a tensor "
            f"must fit in memory")
    total = sum(p.nbytes for p in pieces)
    free = _free_bytes(dst.resolve().parent)
    if free is not None and total > free:
        raise HFCheckpointError(f"{dst}: the converted model takes {total:,} bytes, but its "
                                f"filesystem has {free:,} bytes free")


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _write_streamed(pieces: list[Piece], file: Path) -> None:
    """``model.safetensors`` of ``pieces``, each read and written before the next is read (the
    layout of :func:`mpipar.checkpoint.huggingface.write_safetensors`)."""
    text = header_bytes(((p.name, p.dtype, p.shape, p.nbytes) for p in pieces),
                        {"format": "pt"})
    with open(file, "wb") as fh:
        fh.write(text)
        for p in pieces:
            array = _read_file(p.file, [p.source])[p.source]
            out = np.ascontiguousarray(array.astype(p.dtype.newbyteorder("<"), copy=False))
            del array
            fh.write(memoryview(out.reshape(-1).view(np.uint8)))
