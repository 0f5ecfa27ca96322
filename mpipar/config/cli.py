"""The configuration on a command line: one flag per field (its help from the field's doc, its
choices listed), a Config from ``--config`` and the flags given, the fields a user set, and the
field table of docs/configuration.md."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (defaults None, so only given flags override)."""
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [parallel], [train]")
    for section, cls in (("model", ModelConfig), ("parallel", ParallelConfig), ("train", TrainConfig)):
        group = parser.add_argument_group(section)
        for f in fields(cls):
            dest = f"{section}.{f.name}"
            if f.type in (bool, "bool"):
                # A boolean flag flips the default (--sp-overlap turns on, --no-shuffle turns off).
                group.add_argument(_flag(f), dest=dest, action="store_const", const=not f.default,
                                   default=None, help=f.metadata["help"])
                continue
            kind = {"int": int, "float": float, "str": str}[str(getattr(f.type, "__name__", f.type))]
            choices = f.metadata.get("choices")
            one_of = f"one of {', '.join(map(str, choices))}; " if choices else ""
            group.add_argument(_flag(f), dest=dest, type=kind, default=None, metavar=f.name.upper(),
                               choices=choices,
                               help=f"{f.metadata['help']} ({one_of}default: {f.default})")


def from_args(args: argparse.Namespace) -> Config:
    """Build a Config from ``--config`` (if any) and the flags that were given."""
    cfg = Config.from_toml(args.config) if getattr(args, "config", None) else Config()
    for key, value in vars(args).items():
        if "." not in key or value is None:
            continue
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    return cfg


def given_fields(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The fields of ``section`` the user set, in ``--config``'s table or as flags (flags win)."""
    given: dict[str, Any] = {}
    if getattr(args, "config", None):  # already validated by from_args
        with open(args.config, "rb") as fh:
            given.update(tomllib.load(fh).get(section, {}))
    given.update({k.split(".", 1)[1]: v for k, v in vars(args).items()
                  if k.startswith(section + ".") and v is not None})
    return given


def given_names(args: argparse.Namespace, *sections: str) -> set[str]:
    """Names of the fields of ``sections`` the user set (see :func:`given_fields`)."""
    return {name for section in sections for name in given_fields(args, section)}


def describe_fields() -> str:
    """Markdown table of every field (docs/configuration.md's table, held equal by a test)."""
    rows = ["| field | flag | default | meaning |", "|---|---|---|---|"]
    for section, cls in (("model", ModelConfig), ("parallel", ParallelConfig), ("train", TrainConfig)):
        for f in fields(cls):
            rows.append(f"| `{section}.{f.name}` | `{_flag(f)}` | `{f.default!r}` | "
                        f"{f.metadata['help']} |")
    return "\n".join(rows)
