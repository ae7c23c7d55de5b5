"""Reading a checkpoint's `config.json`: the file itself, typed field access whose errors name the field, and the
one quantization format deltaserve understands. Each model family turns the raw dictionary into its own frozen
config (see models/); only what the math needs is kept, already resolved, and anything that cannot be computed
exactly is refused there, naming the field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that deltaserve cannot serve; the message names the field."""


def read_config(path: str | Path) -> dict[str, Any]:
    """The raw config.json of a checkpoint directory (or the file itself)."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: no config.json found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: must hold a JSON object")
    return raw


class Fields:
    """Typed reads of one config dictionary; `prefix` names where it sits (e.g. 'linear_attn_config.')."""

    def __init__(self, raw: dict[str, Any], prefix: str = ""):
        self.raw, self.prefix = raw, prefix

    def get(self, name: str, default: Any = ..., kind: type | tuple[type, ...] = int) -> Any:
        value = self.raw.get(name)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.prefix}{name}: missing from config.json")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{self.prefix}{name}: {value!r} is not a valid {names}")
        return value

    def positive(self, name: str, default: Any = ...) -> int:
        value = self.get(name, default)
        if value is not None and value <= 0:
            raise ConfigError(f"{self.prefix}{name}: {value!r} must be a positive integer")
        return value

    def number(self, name: str, default: Any = ...) -> float:
        return float(self.get(name, default, (int, float)))

    def flag(self, name: str, default: bool) -> bool:
        return self.get(name, default, bool)

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        value = self.get(name, default, str)
        if value not in options:
            raise ConfigError(f"{self.prefix}{name}: {value!r} is not supported (expected "
                              f"{' or '.join(repr(o) for o in options)})")
        return value


MXFP4_FORMAT = "mxfp4-pack-quantized"


def check_mxfp4(quant: Any, dims: dict[str, int]) -> None:
    """Only compressed-tensors MXFP4 weights (4-bit float in groups of 32, no activation quantization) are
    understood; `dims` are the quantized weights' input dimensions, which must hold whole groups."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors" \
            or quant.get("format") != MXFP4_FORMAT:
        fmt = quant.get("format") if isinstance(quant, dict) else quant
        raise ConfigError(f"quantization_config: {fmt!r} is not supported (deltaserve reads compressed-tensors "
                          f"'{MXFP4_FORMAT}' routed experts)")
    for name, group in (quant.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits", 4) != 4 or w.get("group_size", 32) != 32 or w.get("type", "float") != "float":
            raise ConfigError(f"quantization_config.config_groups.{name}.weights: only 4-bit float in groups of 32 "
                              "(MXFP4) is supported")
        if group.get("input_activations"):
            raise ConfigError(f"quantization_config.config_groups.{name}.input_activations: activation quantization "
                              "is not supported (weights-only MXFP4)")
    for name, size in dims.items():
        if size % 32:
            raise ConfigError(f"{name}: {size} must be a multiple of 32 for MXFP4 experts")
