"""The Python API: `LLM(path, ...)`, vLLM-style."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_into
from .config import ModelConfig
from .models.kimi_linear import KimiLinearForCausalLM
from .state import StatePool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu", chunk_size: int = 64,
               hf_overrides: dict[str, Any] | None = None, progress: bool | None = None) -> KimiLinearForCausalLM:
    cfg = ModelConfig.from_path(path, hf_overrides)
    with torch.device(device):
        model = KimiLinearForCausalLM(cfg, resolve_dtype(dtype, cfg), chunk_size)
    load_into(model.checkpoint_map(), path, progress)
    return model.eval()


class LLM:
    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 chunk_size: int = 64, hf_overrides: dict[str, Any] | None = None):
        if chunk_size < 1:
            raise ValueError(f"chunk_size: {chunk_size} must be positive")
        self.model = load_model(model, dtype, device, chunk_size, hf_overrides)
        self.cfg = self.model.cfg
        self.device = torch.device(device)
        self.max_model_len = min(max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position, [T, vocab] float32, from a fresh state."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.dim() != 1 or len(ids) == 0:
            raise ValueError("token_ids must be a non-empty list of ints")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len {self.max_model_len}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        pool = StatePool(self.cfg, 1, len(ids), self.model.dtype, self.device)
        step = self.model.chunk_size * max(1, 256 // self.model.chunk_size)   # whole delta-rule chunks per step
        out = [self.model(ids[None, s:s + step], pool.view([0], [s]))[0] for s in range(0, len(ids), step)]
        return torch.cat(out)
