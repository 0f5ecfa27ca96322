"""LoRA adapters as PEFT writes them: ``adapter_config.json`` + ``adapter_model.safetensors``.

A PEFT adapter of a Llama-family causal LM names a factor after the module path of its linear
under ``PeftModel``: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, which
is mpipar's name (:mod:`mpipar.model.lora`) behind :data:`PREFIX`. The config carries what the
tensors do not: ``r``, ``lora_alpha``, ``target_modules`` and ``use_rslora``. PEFT silently
defaults a missing ``lora_alpha`` (8) and ``target_modules`` (per model type), so
:func:`save_adapter` writes every field explicitly and :func:`read_adapter` requires them.

:func:`merge` folds adapters into their weights (``W + s B A``), as PEFT's
``merge_and_unload()`` does, for a Hugging Face export of the adapted model.

The routed experts' adapters (``experts.gate_up_proj``, ``experts.down_proj``:
:mod:`mpipar.model.lora`) are PEFT's ``target_parameters`` ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj`` on transformers' fused 3-D expert tensors. PEFT wraps the module
``layers.{i}.mlp.experts`` once per targeted parameter, so with both targeted gate_up_proj's
factors are the inner wrapper's, ``...mlp.experts.base_layer.lora_A.weight``, and down_proj's
the outer's, ``...mlp.experts.lora_A.weight`` (one target alone: the latter names). Each factor
holds every expert: ``lora_A`` ``[r*E, in]`` with expert ``e``'s ``A`` at rows
``[e*r, (e+1)*r)`` (``A.reshape(E, r, in)[e]``), ``lora_B`` ``[out, r*E]`` with expert ``e``'s
``B`` at columns ``e, E + e, 2E + e, ...`` (``B.reshape(out, r, E)[:, :, e]``);
:func:`to_peft` and :func:`from_peft` fuse and split them (:func:`peft_specs`: PEFT's names and
shapes).

Latent attention's adapters (DeepSeek-V3) are read and written with the rope rows of the
``lora_B`` of ``q_b_proj`` (``q_proj``) and ``kv_a_proj_with_mqa`` interleaved, as the base's
weights are on the hub (``rope_interleave``, transformers' default and what mpipar exports;
:func:`mpipar.checkpoint.hf_deepseek.adapters_from_hub`); in mpipar they are halves, as its
weights are, so :func:`merge` folds them in mpipar's layout.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.huggingface import HFCheckpointError, open_safetensors, write_safetensors
from mpipar.config import ModelConfig
from mpipar.model.lora import EXPERT_TARGETS, Lora, adapter_names
from mpipar.model.params import expert_names, param_specs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model."


class AdapterError(HFCheckpointError):
    """An adapter directory that does not fit the run (exit 2)."""


def adapter_specs(cfg: ModelConfig, lora: Lora) -> dict[str, tuple[int, ...]]:
    """Every adapter factor of model ``cfg`` under ``lora``: mpipar name -> global shape."""
    return {a.name: a.shape for spec in param_specs(cfg) for a in lora.specs(spec)}


def _expert_factor(name: str) -> tuple[int, str, str, int] | None:
    """(block, PEFT parameter ``gate_up_proj``/``down_proj``, factor, expert) of an expert's
    adapter factor ``layers.{i}.block_sparse_moe.experts.{e}.{param}.{factor}.weight``."""
    parts = name.split(".")
    if len(parts) != 8 or parts[3] != "experts":
        return None
    return int(parts[1]), parts[5], parts[6], int(parts[4])


def _peft_expert_name(lora: Lora, block: int, param: str, factor: str) -> str:
    """PEFT's name (less :data:`PREFIX`) of the fused ``factor`` of expert tensor ``param`` of
    block ``block`` (module docstring: the inner wrapper's is ``base_layer``'s)."""
    inner = param == "gate_up_proj" and "experts.down_proj" in lora.targets
    return f"layers.{block}.mlp.experts.{'base_layer.' if inner else ''}{factor}.weight"


def _expert_groups(cfg: ModelConfig, lora: Lora) -> dict[str, list[str]]:
    """PEFT's fused expert factor name -> the per-expert mpipar names it holds, by expert."""
    groups: dict[str, list[str]] = {}
    for name in adapter_specs(cfg, lora):
        key = _expert_factor(name)
        if key is not None:
            groups.setdefault(_peft_expert_name(lora, *key[:3]), []).append(name)
    return groups


def peft_specs(cfg: ModelConfig, lora: Lora) -> dict[str, tuple[int, ...]]:
    """Every tensor of PEFT's adapter of model ``cfg`` under ``lora``: name (less
    :data:`PREFIX`) -> shape (an expert tensor's factors fused: module docstring)."""
    specs = adapter_specs(cfg, lora)
    out = {n: s for n, s in specs.items() if _expert_factor(n) is None}
    for fused, names in _expert_groups(cfg, lora).items():
        a, b = specs[names[0]]
        out[fused] = (a * len(names), b) if fused.endswith("lora_A.weight") else (a, b * len(names))
    return out


def to_peft(cfg: ModelConfig, lora: Lora, params: Mapping[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
    """The adapter factors ``params`` (mpipar names) under PEFT's names and shapes (less
    :data:`PREFIX`): the experts' fused (module docstring)."""
    out = {n: params[n] for n in adapter_specs(cfg, lora) if _expert_factor(n) is None}
    for fused, names in _expert_groups(cfg, lora).items():
        if fused.endswith("lora_A.weight"):        # [E, r, in] -> [E*r, in]
            value = np.stack([params[n] for n in names])
            out[fused] = value.reshape(-1, value.shape[-1])
        else:                                       # [out, r, E] -> [out, r*E]
            value = np.stack([params[n] for n in names], axis=-1)
            out[fused] = value.reshape(value.shape[0], -1)
    return out


def from_peft(cfg: ModelConfig, lora: Lora, tensors: Mapping[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
    """:func:`to_peft` undone: PEFT's tensors (names less :data:`PREFIX`, shapes checked) as
    mpipar's adapter factors."""
    out = {n: tensors[n] for n in adapter_specs(cfg, lora) if _expert_factor(n) is None}
    for fused, names in _expert_groups(cfg, lora).items():
        value, count = tensors[fused], len(names)
        if fused.endswith("lora_A.weight"):
            split = value.reshape(count, -1, value.shape[-1])
            out.update({n: np.ascontiguousarray(split[e]) for e, n in enumerate(names)})
        else:
            split = value.reshape(value.shape[0], -1, count)
            out.update({n: np.ascontiguousarray(split[:, :, e]) for e, n in enumerate(names)})
    return out


def _read_config(root: Path) -> dict[str, Any]:
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{root}: no {CONFIG_FILE} (a PEFT adapter directory holds "
                           f"{CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{root / CONFIG_FILE}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{root / CONFIG_FILE}: must be a JSON object")
    return raw


def check_config(raw: Mapping[str, Any], lora: Lora, where: str) -> None:
    """Raise AdapterError unless the PEFT config ``raw`` is the adapters of ``lora``."""
    want = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha,
            "use_rslora": lora.rslora}
    for key, value in want.items():
        if key not in raw:
            raise AdapterError(f"{where}: {key} is missing (the run's is {value!r}; PEFT would "
                               f"default it silently)")
        if raw[key] != value:
            raise AdapterError(f"{where}: {key}={raw[key]!r}, the run's LoRA has {value!r} "
                               f"(--lora-rank, --lora-alpha, --lora-rslora)")
    targets = raw.get("target_modules")
    if not lora.module_targets and targets in (None, []):
        targets = []
    if isinstance(targets, str) or not isinstance(targets, list) or \
            sorted(targets) != sorted(lora.module_targets):
        raise AdapterError(f"{where}: target_modules={targets!r}, the run's --lora-targets are "
                           f"{list(lora.targets)}")
    parameters = raw.get("target_parameters") or []
    if not isinstance(parameters, list) or sorted(map(_expert_target, parameters)) != \
            sorted(lora.expert_targets):
        raise AdapterError(f"{where}: target_parameters={raw.get('target_parameters')!r}, the "
                           f"run's --lora-targets are {list(lora.targets)} (the routed experts: "
                           f"{', '.join('mlp.' + t for t in EXPERT_TARGETS)})")
    dropout = raw.get("lora_dropout") or 0.0     # a training setting: the run's applies
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise AdapterError(f"{where}: lora_dropout={dropout!r}: must be a number in [0, 1)")
    for key in ("layers_to_transform", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(f"{where}: {key}={raw[key]!r} is not supported (the same rank "
                               f"and alpha on every targeted linear of every layer)")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={raw['bias']!r}: only 'none' is supported")


def _expert_target(parameter: Any) -> str:
    """The expert target (:data:`mpipar.model.lora.EXPERT_TARGETS`) a ``target_parameters``
    entry names (``mlp.experts.gate_up_proj``, ``experts.gate_up_proj`` or ``gate_up_proj``),
    else the entry as text."""
    text = str(parameter)
    for target in EXPERT_TARGETS:
        if text in (target, "mlp." + target, target.split(".")[1]):
            return target
    return text


def read_adapter(path: str | os.PathLike, cfg: ModelConfig, lora: Lora
                 ) -> dict[str, np.ndarray]:
    """The adapter factors of PEFT directory ``path`` under mpipar's names, float64 global
    tensors, checked against the model ``cfg`` and the run's ``lora``: config, the exact set of
    tensor names and their shapes. AdapterError names the field or tensor."""
    root = Path(path)
    check_config(_read_config(root), lora, str(root / CONFIG_FILE))
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{root}: no {WEIGHTS_FILE}")
    specs = peft_specs(cfg, lora)
    with open_safetensors(file) as f:
        stored = {_mpipar_name(k): k for k in f.keys()}
        missing = sorted(set(specs) - set(stored))
        unexpected = sorted(stored[n] for n in set(stored) - set(specs))
        if missing or unexpected:
            raise AdapterError(f"{file}: tensors do not fit the model: missing "
                               f"{[PREFIX + n for n in missing[:4]]}, unexpected "
                               f"{unexpected[:4]}")
        out = {}
        for name, shape in specs.items():
            value = f.get_tensor(stored[name])
            if tuple(value.shape) != shape:
                raise AdapterError(f"{file}: {stored[name]} has shape {list(value.shape)}, the "
                                   f"model needs {list(shape)}")
            out[name] = value.astype(np.float64)
    out = from_peft(cfg, lora, out)
    return hf_deepseek.adapters_from_hub(cfg, out) if cfg.latent else out


def _mpipar_name(peft_name: str) -> str:
    """mpipar's name of a stored PEFT tensor (its adapter name, if kept, dropped)."""
    name = peft_name.removeprefix(PREFIX)
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def adapter_config(lora: Lora, base: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of ``lora`` on base model ``base``, every field that
    matters written out."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.alpha, "use_rslora": lora.rslora,
            "target_modules": list(lora.module_targets),
            "target_parameters": (["mlp." + t for t in lora.expert_targets]
                                  if lora.expert_targets else None),
            "lora_dropout": lora.dropout, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "layers_to_transform": None, "use_dora": False}


def check_export_target(path: str | os.PathLike) -> None:
    """Raise ValueError unless :func:`save_adapter` may write ``path``: new, or an empty or
    adapter directory (which it replaces)."""
    root = Path(path)
    if root.exists() and not (root.is_dir() and set(os.listdir(root)) <=
                              {CONFIG_FILE, WEIGHTS_FILE, "README.md"}):
        raise ValueError(f"{root} exists and is not an adapter directory; choose a new or "
                         f"empty directory")


def save_adapter(path: str | os.PathLike, cfg: ModelConfig, lora: Lora,
                 params: Mapping[str, np.ndarray], base: str = "") -> None:
    """Write the adapter factors in ``params`` (mpipar names, global shapes) as a PEFT adapter
    directory ``path`` (written beside it, then renamed into place; an existing adapter
    directory is replaced). ``base``: the base model's name or path, recorded for PEFT."""
    specs = adapter_specs(cfg, lora)
    for name, shape in specs.items():
        if tuple(np.shape(params[name])) != shape:
            raise ValueError(f"save_adapter: {name} has shape {list(np.shape(params[name]))}, "
                             f"the model needs {list(shape)}")
    root = Path(path)
    check_export_target(root)
    if cfg.latent:
        params = hf_deepseek.adapters_to_hub(cfg, {n: params[n] for n in specs})
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.resolve().parent))
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base), indent=2) + "\n")
    write_safetensors({PREFIX + n: np.ascontiguousarray(v)
                       for n, v in to_peft(cfg, lora, params).items()},
                      tmp / WEIGHTS_FILE, {"format": "pt"})
    if root.exists():
        for f in os.listdir(root):
            os.remove(root / f)
        root.rmdir()
    tmp.rename(root)


def merge(cfg: ModelConfig, lora: Lora, params: Mapping[str, np.ndarray]
          ) -> dict[str, np.ndarray]:
    """The base parameters of ``params`` with each adapter folded into its weight
    (``W + s B A``), adapters dropped: PEFT's ``merge_and_unload()``."""
    out = {}
    for spec in param_specs(cfg):
        value = params[spec.name]
        if lora.adapts(spec.name):
            a, b = adapter_names(spec.name)
            value = value + lora.scale * (params[b] @ params[a]).astype(value.dtype)
        out[spec.name] = value
    for spec in param_specs(cfg):      # an expert's gate_up_proj: B's gate rows, then up's
        names = lora.factor_names(spec.name) if lora.expert_target(spec.name) else ()
        if names:
            delta = lora.scale * (params[names[1]] @ params[names[0]])
            if lora.expert_target(spec.name) == "experts.gate_up_proj":
                w1, w3, _ = _expert_weights(spec.name)
                f = delta.shape[0] // 2
                out[w1] = out[w1] + delta[:f].astype(out[w1].dtype)
                out[w3] = out[w3] + delta[f:].astype(out[w3].dtype)
            else:
                out[spec.name] = out[spec.name] + delta.astype(out[spec.name].dtype)
    return out


def _expert_weights(name: str) -> tuple[str, str, str]:
    """(w1, w3, w2) of the expert whose weight is ``name``."""
    parts = name.split(".")
    return expert_names(int(parts[1]), int(parts[4]))
