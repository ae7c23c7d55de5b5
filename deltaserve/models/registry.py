"""The model families deltaserve serves, found by config.json's `architectures` (else its `model_type`).
A new family is one module declaring a ModelSpec, plus one line here."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ConfigError, read_config
from . import kimi_k3, kimi_linear
from .spec import ModelSpec

MODELS: tuple[ModelSpec, ...] = (
    kimi_linear.SPEC,
    kimi_k3.SPEC,
)


def spec_for(raw: dict[str, Any]) -> ModelSpec:
    """The family of a raw config.json."""
    archs = raw.get("architectures") or []
    for spec in MODELS:
        if any(a in spec.architectures for a in archs):
            return spec
    for spec in MODELS:
        if raw.get("model_type") == spec.model_type:
            return spec
    known = ", ".join(a for spec in MODELS for a in spec.architectures)
    raise ConfigError(f"model_type: {raw.get('model_type')!r} is not supported (architectures {archs}); "
                      f"deltaserve serves {known}")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> tuple[ModelSpec, Any]:
    """(family, typed config) of a checkpoint directory; hf_overrides merge into the (text) config."""
    raw = read_config(path)
    spec = spec_for(raw)
    return spec, spec.parse_config(raw, overrides)
