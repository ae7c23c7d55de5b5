"""What a model family declares to the rest of deltaserve: how to read its config, which class computes it, how its
checkpoint is named and split across tensor-parallel ranks, and what `inspect`, `convert` and `make-tiny` need to know.
Commands read these declarations; none of them names a model or a tensor pattern itself."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..config import ConfigError


@dataclass(frozen=True)
class SplitPlan:
    """Tensor parallelism by checkpoint name: the first rule whose pattern is found in a name gives the dimension
    along which each rank holds 1/N of that tensor; names no rule matches are replicated."""
    rules: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple((re.compile(p), d) for p, d in self.rules))

    def dim(self, name: str) -> int | None:
        return next((d for pattern, d in self._compiled if pattern.search(name)), None)


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a layer's per-sequence state. per_token: `shape` is one position's, the pool holds a row per
    position of the context (a cache); otherwise `shape` is the whole state (a recurrence)."""
    shape: tuple[int, ...]
    dtype: Any
    per_token: bool = False


@dataclass(frozen=True)
class ModelSpec:
    model_type: str                                   # config.json's top-level model_type
    architectures: tuple[str, ...]                    # config.json's architectures served by this spec
    parse_config: Callable[[dict[str, Any], dict[str, Any] | None], Any]   # config.json + hf_overrides -> config
    model: Callable[..., nn.Module]                   # model(cfg, dtype, chunk_size, tp); see kimi_linear.py
    split_plan: Callable[[Any], SplitPlan]
    checkpoint_prefix: str = ""                       # the text model's tensors; others (vision) are never read
    fp32_tensors: tuple[str, ...] = ()                # name suffixes the official checkpoint stores in float32
    tensor_role: Callable[[str, Any], str] | None = None   # (name, config) -> role, for `inspect`'s bytes-by-role
    routed_experts: str | None = None                 # pattern of routed-expert weights, which `convert` quantizes
    mxfp4_ignore: tuple[str, ...] = ()                # compressed-tensors `ignore` list written by `convert`
    chat_template: str | None = None                  # used when the checkpoint ships none
    tiny_presets: dict[str, dict[str, Any]] = field(default_factory=dict)   # make-tiny's configs
    random_weight: Callable[..., Any] | None = None   # make-tiny: (name, shape, generator) -> float32 tensor

    def check_tp(self, cfg: Any, size: int) -> None:
        """Refuse, before loading anything, a configuration whose split dimensions do not divide by `size`."""
        if size < 1:
            raise ConfigError(f"tensor_parallel_size: {size} must be at least 1")
        for name, value in cfg.tp_dims().items():
            if value % size:
                raise ConfigError(f"{name} = {value} is not divisible by {size} (tensor_parallel_size)")
