"""Hugging Face Llama checkpoints in and out: ``config.json`` + safetensors, with NumPy only.

A Hugging Face Llama directory holds ``config.json`` and the weights, either in one
``model.safetensors`` or in shards listed by ``model.safetensors.index.json``. Tensor names are
mpipar's parameter names with a ``model.`` prefix (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``), except the head,
``lm_head.weight``, which has none. Matrices are ``[out, in]`` in both. Both sides apply RoPE
in the rotate-half convention (pairs ``(i, i + head_dim/2)``), so q/k projections map without
any permutation; grouped-query heads are the ``kv_heads`` row blocks of k/v in both.

    python -m mpipar.hf inspect DIR
    python -m mpipar.hf convert SRC DST [--dtype float16|float32|float64]

What is refused, with the field named: another architecture or ``model_type``, RoPE scaling
types other than ``default`` (``rope_scaling`` in transformers 4.x, ``rope_parameters`` in 5.x),
``partial_rotary_factor`` below 1, ``attention_bias`` or ``mlp_bias`` true, a ``hidden_act``
other than SiLU, missing or unexpected tensors, shapes that disagree with the config, and tied
embeddings (``tie_word_embeddings: true``) unless the caller asks to untie them: mpipar trains an
untied LM head, so untying starts it as a copy of the embedding and the two then train apart.

bfloat16 tensors: NumPy has no bfloat16, so they are read from the file's raw bytes and widened
exactly to float32 (a bfloat16 is the upper 16 bits of a float32). Other tensors keep the
file's dtype unless a dtype is asked for.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from mpipar.config import ConfigError, ModelConfig, model_from_checkpoint
from mpipar.model.params import param_specs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEAD = "lm_head.weight"
EMBED = "embed_tokens.weight"

SAVE_DTYPES = ("float16", "float32", "float64")
"""dtypes :func:`save_hf` writes and :func:`load_hf` casts to."""

PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
"""config.json fields that do not change the computation but that an export should carry over."""

DEFAULT_MAX_POSITIONS = 4096
"""``max_position_embeddings`` written when the caller gives none (mpipar's RoPE has no limit)."""

# Non-persistent RoPE buffers that old transformers versions wrote into checkpoints.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"
_ACTIVATIONS = ("silu", "swish")  # transformers maps both names to SiLU
_HF_FIELD = {  # mpipar ModelConfig field -> config.json field
    "vocab_size": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range",
}
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


class HFCheckpointError(ConfigError):
    """A Hugging Face directory mpipar cannot use; the message names the file, field or tensor."""


# ----------------------------------------------------------------------------------- names
def hf_name(name: str) -> str:
    """Hugging Face tensor name of mpipar parameter ``name``."""
    return name if name == HEAD else "model." + name


def mpipar_name(name: str) -> str:
    """mpipar parameter name of Hugging Face tensor ``name`` (inverse of :func:`hf_name`)."""
    return name if name == HEAD else name.removeprefix("model.")


# ---------------------------------------------------------------------------------- config
def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of directory ``path``."""
    file = Path(path) / CONFIG_FILE
    if not Path(path).is_dir():
        raise HFCheckpointError(f"{path}: not a directory (a Hugging Face model directory holds "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise HFCheckpointError(f"{file}: file not found") from None
    except (OSError, ValueError) as exc:
        raise HFCheckpointError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file}: must hold a JSON object")
    return raw


def _rope(raw: Mapping[str, Any], where: str) -> float:
    """RoPE theta from either config style, refusing scaling types mpipar does not implement.

    transformers 4.x: ``rope_theta`` at top level, scaling in ``rope_scaling`` (None = plain RoPE).
    transformers 5.x: ``rope_parameters = {"rope_type": ..., "rope_theta": ...}``. As in
    transformers, a non-empty ``rope_scaling`` takes precedence over ``rope_parameters``.
    """
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(field) or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"{where}: {field}={params!r} must be an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise HFCheckpointError(f"{where}: {field}.rope_type={kind!r} is not supported; mpipar "
                                f"implements only plain RoPE (rope_type 'default' or no {field})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFCheckpointError(f"{where}: partial_rotary_factor={partial!r} is not supported; "
                                f"mpipar rotates the whole head (1.0)")
    top, inner = raw.get("rope_theta"), params.get("rope_theta")
    if top is not None and inner is not None and float(top) != float(inner):
        raise HFCheckpointError(f"{where}: rope_theta={top!r} contradicts "
                                f"{field}.rope_theta={inner!r}")
    theta = inner if inner is not None else top if top is not None else 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise HFCheckpointError(f"{where}: rope_theta={theta!r} must be a positive number")
    return float(theta)


def _int_field(raw: Mapping[str, Any], name: str, where: str, default: int | None = None) -> int:
    """``raw[name]`` as a positive int; absent or null takes ``default`` (None: required)."""
    value = raw.get(name)
    value = default if value is None else value
    if value is None:
        raise HFCheckpointError(f"{where}: field {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFCheckpointError(f"{where}: {name}={value!r} must be a positive integer")
    return value


def _float_field(raw: Mapping[str, Any], name: str, where: str, default: float) -> float:
    value = raw.get(name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HFCheckpointError(f"{where}: {name}={value!r} must be a positive number")
    return float(value)


def model_config_from_hf(raw: Mapping[str, Any], where: str = CONFIG_FILE) -> ModelConfig:
    """mpipar's (resolved) ModelConfig from a parsed Llama ``config.json``; refuse what mpipar
    cannot compute exactly. Tied embeddings are not judged here (see :func:`read_model_config`).
    Defaults for absent optional fields are transformers' LlamaConfig defaults."""
    archs = raw.get("architectures")
    if archs is not None and archs != ["LlamaForCausalLM"]:
        raise HFCheckpointError(f"{where}: architectures={archs!r} is not supported; mpipar "
                                f"reads and writes ['LlamaForCausalLM'] only")
    if raw.get("model_type", "llama") != "llama":
        raise HFCheckpointError(f"{where}: model_type={raw.get('model_type')!r} is not supported; "
                                f"mpipar needs 'llama'")
    for name in ("attention_bias", "mlp_bias"):
        if raw.get(name, False):
            raise HFCheckpointError(f"{where}: {name}={raw[name]!r} is not supported; mpipar's "
                                    f"linear layers have no bias")
    act = raw.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"{where}: hidden_act={act!r} is not supported; mpipar's MLP is "
                                f"SwiGLU with 'silu'")
    theta = _rope(raw, where)
    hidden = _int_field(raw, "hidden_size", where)
    heads = _int_field(raw, "num_attention_heads", where)
    kv_heads = _int_field(raw, "num_key_value_heads", where, heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise HFCheckpointError(f"{where}: hidden_size={hidden} is not divisible by "
                                f"num_attention_heads={heads} and head_dim is not given")
    head_dim = _int_field(raw, "head_dim", where, hidden // heads)
    if head_dim % 2:
        raise HFCheckpointError(f"{where}: head_dim={head_dim} must be even (RoPE rotates pairs)")
    if heads % kv_heads:
        raise HFCheckpointError(f"{where}: num_key_value_heads={kv_heads} must divide "
                                f"num_attention_heads={heads}")
    return ModelConfig(
        vocab_size=_int_field(raw, "vocab_size", where), hidden=hidden,
        layers=_int_field(raw, "num_hidden_layers", where), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden=_int_field(raw, "intermediate_size", where),
        rope_theta=theta, norm_eps=_float_field(raw, "rms_norm_eps", where, 1e-6),
        init_std=_float_field(raw, "initializer_range", where, 0.02))


def _tied(raw: Mapping[str, Any], where: str, untie_embeddings: bool) -> bool:
    tied = bool(raw.get("tie_word_embeddings", False))
    if tied and not untie_embeddings:
        raise HFCheckpointError(
            f"{where}: tie_word_embeddings=true is not supported as such: mpipar trains an untied "
            f"LM head. Ask to untie (untie_embeddings=True) to start lm_head as a copy of "
            f"embed_tokens; the two are then trained separately and exported untied")
    return tied


def read_model_config(path: str | os.PathLike, untie_embeddings: bool = False) -> ModelConfig:
    """The ModelConfig of the checkpoint in directory ``path``, from ``config.json`` alone (cheap:
    use it to validate a run before any weights are read). Raises HFCheckpointError."""
    raw = read_config_json(path)
    where = str(Path(path) / CONFIG_FILE)
    cfg = model_config_from_hf(raw, where)
    _tied(raw, where, untie_embeddings)
    return cfg


def passthrough_config(path: str | os.PathLike) -> dict[str, Any]:
    """The :data:`PASSTHROUGH_FIELDS` present in ``path``'s config.json (for a later export)."""
    raw = read_config_json(path)
    return {k: raw[k] for k in PASSTHROUGH_FIELDS if k in raw}


def hf_config(cfg: ModelConfig, dtype: str, extra: Mapping[str, Any] | None = None) -> dict:
    """The ``config.json`` of a LlamaForCausalLM with mpipar's model ``cfg`` and weights in
    ``dtype``. RoPE theta is written in both styles (top-level ``rope_theta`` for transformers
    4.x, ``rope_parameters`` for 5.x); ``extra`` may set the :data:`PASSTHROUGH_FIELDS`."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(PASSTHROUGH_FIELDS))
    if unknown:
        raise ValueError(f"extra config fields {unknown}: only {list(PASSTHROUGH_FIELDS)} may be "
                         f"given; the others follow from the model config")
    m = cfg.resolved()
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    out.update(extra)
    return out


def model_config_with_overrides(hf_cfg: ModelConfig, overrides: Mapping[str, Any],
                                source: str = "the Hugging Face checkpoint") -> ModelConfig:
    """The (resolved) model config of a run initialised from a checkpoint: see
    :func:`mpipar.config.model_from_checkpoint` (errors name the config.json field)."""
    return model_from_checkpoint(hf_cfg, overrides, source, _HF_FIELD)


# --------------------------------------------------------------------------------- tensors
def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """Where each tensor of directory ``path`` lives: ``{hf name: safetensors file}``."""
    root = Path(path)
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        with _safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFCheckpointError(f"{index}: needs a JSON object with a 'weight_map' "
                                    f"({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict):
            raise HFCheckpointError(f"{index}: 'weight_map' must map tensor names to files")
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise HFCheckpointError(f"{index}: shard file {shard.name} does not exist")
        return files
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pth"))
    hint = f" (found {others}: convert them to safetensors first)" if others else ""
    raise HFCheckpointError(f"{root}: no {WEIGHTS_FILE} and no {INDEX_FILE}{hint}")


@contextlib.contextmanager
def _safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)`` for NumPy; a file it cannot open (truncated, a damaged header) is an
    HFCheckpointError naming the file."""
    from safetensors import safe_open
    try:
        handle = safe_open(str(file), framework="np")
    except Exception as exc:  # safetensors raises its own error types
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    with handle as f:
        yield f


def check_tensors(path: str | os.PathLike, cfg: ModelConfig, tied: bool) -> dict[Path, list[str]]:
    """Check, from the safetensors headers alone, that directory ``path`` holds exactly the
    tensors of the model ``cfg`` (``lm_head.weight`` may be absent when ``tied``), each with its
    shape and a dtype mpipar reads. Returns the Hugging Face names to read from each file.
    Raises HFCheckpointError naming the file, the tensors or the shapes."""
    root = Path(path)
    files = {n: f for n, f in weight_files(root).items() if not n.endswith(_IGNORED_SUFFIX)}
    specs = {hf_name(s.name): s for s in param_specs(cfg)}
    optional = {HEAD} if tied else set()
    missing = sorted(set(specs) - optional - set(files))
    unexpected = sorted(set(files) - set(specs))
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise HFCheckpointError(f"{root}: {len(names)} {what} tensor(s) for a Llama with "
                                    f"{cfg.layers} layers: {shown}")
    wanted: dict[Path, list[str]] = {}
    for name in specs:
        if name in files:
            wanted.setdefault(files[name], []).append(name)
    for file, names in wanted.items():
        with _safetensors(file) as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    raise HFCheckpointError(f"{file}: tensor {name} is listed in {INDEX_FILE} "
                                            f"but not stored in this shard")
                piece = f.get_slice(name)
                kind, shape = piece.get_dtype(), list(piece.get_shape())
                if kind not in _NUMPY_DTYPES and kind != "BF16":
                    raise HFCheckpointError(f"{file}: tensor {name} has dtype {kind}; mpipar "
                                            f"reads floating-point F16, BF16, F32 and F64 tensors")
                if tuple(shape) != specs[name].shape:
                    raise HFCheckpointError(f"{root}: tensor {name} has shape {shape}, "
                                            f"{CONFIG_FILE} implies {list(specs[name].shape)}")
    return wanted


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of ``file`` and the byte offset where tensor data begins.

    Layout: 8 bytes little-endian header length N, N bytes of JSON, then the data; each entry's
    ``data_offsets`` are relative to the start of the data.
    """
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def _read_file(file: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Tensors ``names`` of safetensors ``file`` (checked by :func:`check_tensors`) as NumPy
    arrays (bfloat16 widened to float32)."""
    out, bf16 = {}, []
    with _safetensors(file) as f:
        for name in names:
            if f.get_slice(name).get_dtype() == "BF16":
                bf16.append(name)
            else:
                out[name] = f.get_tensor(name)
    if bf16:
        header, start = _header(file)
        for name in bf16:
            begin, end = header[name]["data_offsets"]
            bits = np.fromfile(file, dtype="<u2", count=(end - begin) // 2, offset=start + begin)
            # A bfloat16 is the upper half of the float32 of the same value: shift the bits up.
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(
                header[name]["shape"])
    return out


def _check_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(SAVE_DTYPES)}") from None
    if dt.name not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(SAVE_DTYPES)}")
    return dt


def load_hf(path: str | os.PathLike, dtype: Any = None,
            untie_embeddings: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read the Hugging Face Llama checkpoint in directory ``path``.

    Returns the resolved ModelConfig and every parameter as a global array under mpipar's name
    (shapes as in :func:`mpipar.model.params.param_specs`, e.g. ``layers.0.self_attn.k_proj.weight``
    ``[kv_heads * head_dim, hidden]``). ``dtype`` None keeps each tensor's file dtype (bfloat16
    becomes float32); else every tensor is cast to it (float16, float32 or float64).
    ``untie_embeddings`` accepts ``tie_word_embeddings: true`` by copying the embedding into
    ``lm_head.weight``. Raises HFCheckpointError (a ConfigError) naming the field or tensors.
    """
    dt = _check_dtype(dtype)
    root = Path(path)
    raw = read_config_json(root)
    where = str(root / CONFIG_FILE)
    cfg = model_config_from_hf(raw, where)
    tied = _tied(raw, where, untie_embeddings)
    arrays = {n: v for file, names in check_tensors(root, cfg, tied).items()
              for n, v in _read_file(file, names).items()}
    params = {s.name: arrays[hf_name(s.name)] if dt is None else arrays[hf_name(s.name)].astype(dt)
              for s in param_specs(cfg) if hf_name(s.name) in arrays}
    if tied:
        params[HEAD] = params[EMBED].copy()
    return cfg, params


# ---------------------------------------------------------------------------------- export
def _replaceable(path: Path) -> bool:
    """May an export replace ``path``? Only a previous export (or an empty directory) may go."""
    if not path.exists():
        return True
    return path.is_dir() and set(os.listdir(path)) <= {CONFIG_FILE, WEIGHTS_FILE}


def check_export_target(path: str | os.PathLike) -> None:
    """Raise ValueError unless :func:`save_hf` may write ``path`` (call it before training)."""
    p = Path(path)
    if not _replaceable(p):
        extra = sorted(set(os.listdir(p)) - {CONFIG_FILE, WEIGHTS_FILE}) if p.is_dir() else []
        raise ValueError(f"export directory {p}: exists and holds more than a previous export "
                         f"({extra[:5] or 'not a directory'}); choose a new or empty directory")
    parent = p.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"export directory {p}: parent {parent} is not a writable directory")


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray],
            dtype: Any = None, extra_config: Mapping[str, Any] | None = None) -> None:
    """Write ``params`` (mpipar names, global shapes) as a Hugging Face LlamaForCausalLM.

    Writes ``config.json`` and ``model.safetensors`` into a temporary directory beside ``path``
    and renames it into place, so ``path`` never holds a partial export. An existing ``path`` is
    replaced only if it is empty or a previous export (config.json and model.safetensors alone):
    it is renamed to ``.NAME.old-PID`` beside it, the new one renamed in, then the old removed
    (a crash between the two renames leaves the old export under that hidden name). ``dtype`` None keeps the parameters' dtype (they must share one);
    else float16, float32 or float64. ``extra_config`` sets :data:`PASSTHROUGH_FIELDS`.
    """
    from safetensors.numpy import save_file

    dt = _check_dtype(dtype)
    specs = {s.name: s for s in param_specs(cfg)}
    missing, unexpected = sorted(set(specs) - set(params)), sorted(set(params) - set(specs))
    if missing or unexpected:
        raise ValueError(f"save_hf: parameters do not match the model config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, spec in specs.items():
        if tuple(np.shape(params[name])) != spec.shape:
            raise ValueError(f"save_hf: {name} has shape {list(np.shape(params[name]))}, the "
                             f"model config needs {list(spec.shape)}")
    if dt is None:
        kinds = sorted({np.asarray(v).dtype.name for v in params.values()})
        if len(kinds) != 1:
            raise ValueError(f"save_hf: parameters have dtypes {kinds}; pass dtype to pick one")
        dt = _check_dtype(kinds[0])
    config = hf_config(cfg, dt.name, extra_config)
    tensors = {hf_name(n): np.ascontiguousarray(params[n], dtype=dt) for n in specs}

    dst = Path(path)
    check_export_target(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.resolve().parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        mask = _umask()  # mkdtemp makes 0700 and safetensors 0600: give what the umask allows
        os.chmod(tmp, 0o777 & ~mask)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.chmod(tmp / name, 0o666 & ~mask)
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
        os.rename(tmp, dst)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's file-mode creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------- CLI
def _describe_tensors(path: Path) -> list[str]:
    files = weight_files(path)
    rows, total = [], 0
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with _safetensors(file) as f:
            for name in sorted(names):
                piece = f.get_slice(name)
                shape = piece.get_shape()
                total += math.prod(shape)
                rows.append(f"  {name:<52} {piece.get_dtype():<5} {shape}  [{file.name}]")
    return rows + [f"  {len(files)} tensors, {total:,} values"]


def _inspect(path: str) -> int:
    root = Path(path)
    raw = read_config_json(root)
    print(f"{root / CONFIG_FILE}:")
    for key in sorted(raw):
        print(f"  {key}: {json.dumps(raw[key])}")
    print("tensors:")
    for row in _describe_tensors(root):
        print(row)
    try:
        cfg = read_model_config(root)
        check_tensors(root, cfg, tied=False)  # what training checks before it reads a weight
    except HFCheckpointError as exc:
        print(f"mpipar: not supported: {exc}")
        return 1
    print("mpipar model config:")
    for f in dataclasses.fields(cfg):
        print(f"  {f.name} = {getattr(cfg, f.name)!r}")
    return 0


def _convert(src: str, dst: str, dtype: str | None, untie: bool) -> int:
    cfg, params = load_hf(src, dtype, untie_embeddings=untie)
    save_hf(dst, cfg, params, extra_config=passthrough_config(src))
    kinds = sorted({v.dtype.name for v in params.values()})
    print(f"wrote {dst}: {len(params)} tensors, {'/'.join(kinds)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mpipar.hf {inspect,convert}``; exit status 2 on an unusable checkpoint."""
    parser = argparse.ArgumentParser(prog="python -m mpipar.hf",
                                     description="Inspect and convert Hugging Face Llama "
                                                 "checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    ins = commands.add_parser("inspect", help="print config.json, the tensors and mpipar's reading")
    ins.add_argument("dir")
    conv = commands.add_parser("convert", help="read a checkpoint and write it as mpipar exports "
                                               "(config.json + one model.safetensors)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--dtype", choices=SAVE_DTYPES, default=None,
                      help="cast every tensor (default: keep the file's dtype; "
                           "bfloat16 -> float32)")
    conv.add_argument("--untie-embeddings", action="store_true",
                      help="accept tie_word_embeddings: write lm_head as a copy of the embedding")
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
