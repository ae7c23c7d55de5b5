"""The Python API: `LLM(path, ...)`, vLLM-style."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .chat import ChatTemplate
from .checkpoint import load_into
from .config import ModelConfig
from .engine import Engine, Request
from .models.kimi_linear import KimiLinearForCausalLM
from .sampling import SamplingParams
from .state import StatePool
from .tokenizer import Tokenizer, TokenizerError

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
    for module in model.modules():
        if hasattr(module, "finalize"):
            module.finalize()
    return model.eval()


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None

    @classmethod
    def of(cls, r: Request) -> "RequestOutput":
        return cls(r.prompt, list(r.output), r.text, r.num_cached_tokens, r.finish_reason)


class LLM:
    """Load a checkpoint and generate. Calls on one LLM share its prefix cache."""

    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 chunk_size: int = 64, hf_overrides: dict[str, Any] | None = None, max_num_seqs: int = 8,
                 prefill_tokens: int = 256, prefix_cache_bytes: int = 1 << 30, warmup: bool = False,
                 progress: bool | None = None):
        if chunk_size < 1:
            raise ValueError(f"chunk_size: {chunk_size} must be positive")
        self.model = load_model(model, dtype, device, chunk_size, hf_overrides, progress)
        self.cfg = self.model.cfg
        self.device = torch.device(device)
        self.max_model_len = min(max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model, self.cfg.eos_token_ids)
        except TokenizerError:
            self.tokenizer = None            # token-id prompts still work
        self.template = ChatTemplate(self.tokenizer.chat_template if self.tokenizer else None)
        self.engine = Engine(self.model, self.tokenizer, self.max_model_len, max_num_seqs, prefill_tokens,
                             prefix_cache_bytes)
        if warmup:
            self.engine.warmup()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError("this checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Each prompt is text (tokenized as is, no chat template) or a list of token ids; all run batched."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        ids = [self.encode(p) for p in prompts]
        requests = [self.engine.add_request(p, params) for p in ids]
        self.engine.run(requests)
        return [RequestOutput.of(r) for r in requests]

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        """One assistant turn for `messages`, rendered with the checkpoint's chat template."""
        return self.generate([self.encode(self.template.render(messages))], params)[0]

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
