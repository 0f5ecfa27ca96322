"""The configuration's building blocks: its error, how a field is declared (help, flag, choices
in the dataclass metadata), how TOML values are coerced to a field's type, and the generic rules
(representable numbers, positive sizes) every section's checks use."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field, the value and the rule."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (field, value and rule) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class LayerSet:
    """A set of blocks as a layer-set field writes it (``window_layers``, ``moe_layers``):
    ``all``, ``even`` (blocks 0, 2, ...), ``odd``, or a comma list of block indices (``listed``).
    :meth:`parse` is the one reader of that grammar; the model asks the set."""

    kind: str                                  # all, even, odd or list
    listed: frozenset[int] = frozenset()

    KEYWORDS = ("all", "even", "odd")

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(text: str, name: str, layers: int) -> LayerSet:
        """The set ``text`` names in a model of ``layers`` blocks; ConfigError names the field
        ``model.<name>``, the value and the rule."""
        spec = text.strip()
        if spec in LayerSet.KEYWORDS:
            return LayerSet(spec)
        items = [x.strip() for x in spec.split(",")]
        require(all(re.fullmatch(r"[0-9]+", x) and int(x) < layers for x in items),
                f"model.{name}={text!r}: must be all, even, odd or a comma list of layer "
                f"indices in [0, {layers})")
        return LayerSet("list", frozenset(int(x) for x in items))

    @property
    def every_layer(self) -> bool:
        """Whether the set is written ``all`` (every block, whatever the model's depth)."""
        return self.kind == "all"

    def contains(self, layer: int) -> bool:
        """Whether block ``layer`` is in the set."""
        if self.kind == "list":
            return layer in self.listed
        return self.kind == "all" or layer % 2 == (self.kind == "odd")

    def count(self, start: int, stop: int) -> int:
        """How many of the blocks ``[start, stop)`` are in the set, without a per-block walk."""
        if self.kind == "list":
            return sum(start <= i < stop for i in self.listed)
        odd = stop // 2 - start // 2
        return {"all": stop - start, "even": (stop - start) - odd, "odd": odd}[self.kind]

    def layers(self, n: int) -> list[int]:
        """The set's blocks of a model of ``n`` blocks, in order."""
        return [i for i in range(n) if self.contains(i)]


def described(default: Any, help: str, flag: str | None = None, choices: tuple | None = None,
       **kw: Any) -> Any:
    meta = {"help": help, "flag": flag, "choices": choices, **kw}
    return field(default=default, metadata=meta)


INT_LIMIT = 2**63
"""Integer fields must lie in (-2**63, 2**63): they are stored as 64-bit HDF5 attributes in
checkpoints and used as NumPy int64 values."""


def representable(obj: Any, section: str) -> None:
    """Every float field of ``obj`` is finite and every int field fits in 64 bits."""
    for f in fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)
        if kind == "float":
            require(math.isfinite(value), f"{section}.{f.name}={value}: must be a finite number")
        elif kind == "int":
            require(-INT_LIMIT < value < INT_LIMIT,
                    f"{section}.{f.name}={value}: must lie in (-2**63, 2**63)")


def positive(obj: Any, names: tuple[str, ...], section: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= 1, f"{section}.{name}={value}: must be a positive integer")


def set_fields(obj: Any, values: dict[str, Any], where: str) -> None:
    known = {f.name: f for f in fields(obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown field; known: {', '.join(known)}")
        setattr(obj, key, coerce(value, known[key], f"{where}.{key}"))


def coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str,
                                                     "bool": bool}[str(f.type)]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: must be true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: must be an integer")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: must be a number")
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}={value}: too large for a floating-point number") from None
    if not isinstance(value, str):
        raise ConfigError(f"{where}={value!r}: must be a string")
    if "\0" in value:  # TOML can spell one ("\u0000"); no path or name holds it
        raise ConfigError(f"{where}={value[:80]!r}: must not contain a NUL character")
    return value
