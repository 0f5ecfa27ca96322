"""Configuration: model, parallel layout and training, from TOML with CLI overrides.

Every field carries its documentation and its command-line flag in the dataclass metadata, so
``python -m mpipar.train --help``, the TOML file and docs/configuration.md all describe the same
thing.
A TOML config has up to three tables, ``[model]``, ``[parallel]`` and ``[train]``, whose keys are
the field names below. Command-line flags override the file; ``validate`` checks every rule
before any communication happens.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field, fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import tomli_w

from mpipar.config.schema import (ConfigError, LayerSet, positive, representable, require,
                                  set_fields)
from mpipar.config.model import (CHECKPOINT_OVERRIDABLE, ModelConfig, check_model)
from mpipar.config.parallel import ParallelConfig
from mpipar.config.train import (StepRanges, TrainConfig, check_train, held_out_from_checkpoint,
                                 trace_step_set)

__all__ = ["CHECKPOINT_OVERRIDABLE", "Config", "ConfigError", "LayerSet", "ModelConfig",
           "ParallelConfig", "StepRanges", "TrainConfig", "check_fields",
           "held_out_from_checkpoint", "require", "trace_step_set"]


@dataclass
class Config:
    """The whole resolved configuration of a run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    SECTIONS = ("model", "parallel", "train")

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "Config":
        cfg = cls()
        for section, values in data.items():
            if section not in cls.SECTIONS:
                raise ConfigError(f"{source}: unknown table [{section}]; known tables: "
                                  f"{', '.join(cls.SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{section}] must be a table")
            set_fields(getattr(cfg, section), values, f"{source}: {section}")
        return cfg

    @classmethod
    def from_toml(cls, path: str) -> "Config":
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: file not found") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
        except OSError as exc:
            raise ConfigError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
        return cls.from_dict(data, source=path)

    # ------------------------------------------------------------ validation
    @property
    def dump_steps(self) -> set[int]:
        """The steps listed in ``train.dump_activations``."""
        return {int(x) for x in self.train.dump_activations.split(",") if x.strip()}


def check_fields(cfg: Config, m: ModelConfig) -> None:
    """The fields' own rules (ranges, choices, what one field asks of another in its section);
    ``m`` is ``cfg.model`` with its derived defaults filled in (:func:`mpipar.layout.resolve_model`).
    The rules that involve what a component does with the values live with that component and
    are asked, in order, by :func:`mpipar.rules.validate`. Raises ConfigError naming the field,
    the value and the rule (the first violation)."""
    p, t = cfg.parallel, cfg.train
    for obj, section in ((cfg.model, "model"), (p, "parallel"), (t, "train")):
        representable(obj, section)
    # choices first: the rules below read modes (m.rope, ...) that resolve a field's name
    for obj, section in ((m, "model"), (p, "parallel"), (t, "train")):
        for f in fields(obj):
            choices = f.metadata.get("choices")
            value = getattr(obj, f.name)
            require(not choices or value in choices,
                    f"{section}.{f.name}={value!r}: must be one of "
                    f"{', '.join(map(str, choices or ()))}")
    check_model(m, head_dim_given=cfg.model.head_dim != 0)
    positive(p, ("tp", "pp", "sp", "virtual_stages"), "parallel")
    require(p.dp >= 0, f"parallel.dp={p.dp}: must be >= 0 (0 fills the world)")
    check_train(t)
