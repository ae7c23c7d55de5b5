"""The Python API: `LLM(path, ...)`, vLLM-style."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torch import nn

from .chat import ChatTemplate
from .checkpoint import load_into
from .distributed import TP
from .compiled import enforce_eager_default
from .engine import Engine, Request
from .layers.linear import quantize_module_weights
from .models.registry import load_config
from .ops.cpu_kernels import kernels
from .parallel import TPRunner, Workers, join_group
from .runner import ModelRunner
from .sampling import SamplingParams
from .tokenizer import Tokenizer, TokenizerError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, cfg: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}" if dtype != "auto" else
                         f"dtype auto: the checkpoint's config.json gives {name!r}, not one of {', '.join(DTYPES)}; "
                         f"pass --dtype")
    return DTYPES[name]


QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class LoadConfig:
    """What a process needs to build its (slice of the) model: the same on every tensor-parallel rank."""
    path: str
    dtype: str = "auto"
    device: str = "cpu"
    chunk_size: int = 64                          # delta-rule chunk: part of the numerics
    hf_overrides: dict[str, Any] | None = None
    quantization: str | None = None               # "int8": weight-only int8 projections (Q8_0 layout)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size: {self.chunk_size} must be positive")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization: {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available to this torch build ({torch.__version__})")


def load_model(load: LoadConfig, progress: bool | None = None, tp: TP = TP()) -> nn.Module:
    """Build the model (this rank's slice of it under tensor parallelism) and fill it from the checkpoint."""
    spec, cfg = load_config(load.path, load.hf_overrides)
    spec.check_tp(cfg, tp.size)
    with torch.device(load.device):
        model = spec.model(cfg, resolve_dtype(load.dtype, cfg), load.chunk_size, tp)
    if torch.device(load.device).type == "cpu":
        kernels()                 # build / load the CPU decode kernels now, not during a request
    prefix = spec.checkpoint_prefix
    targets = {prefix + name: t for name, t in model.checkpoint_map().items()}
    load_into(targets, load.path, progress, tp, spec.split_plan(cfg), prefix)
    for module in model.modules():
        if hasattr(module, "finalize"):
            module.finalize()
    if load.quantization == "int8":
        quantize_module_weights(model)
    return model.eval()


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    finish_reason: str | None
    error: str | None = None          # why, when finish_reason is "error"

    @classmethod
    def of(cls, r: Request) -> "RequestOutput":
        return cls(r.prompt, list(r.output), r.text, r.num_cached_tokens, r.finish_reason, r.error)


DEFAULT_MAX_MODEL_LEN = 32768


def context_length(cfg: Any, max_model_len: int | None) -> int:
    """The context served: as asked (up to the model's limit), else the model's limit capped at 32,768, since each
    state slot preallocates its MLA latent cache for the whole context."""
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len: {max_model_len} must be at least 2")
    return min(max_model_len or DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings)


def make_runner(load: LoadConfig, num_slots: int, max_len: int, init_method: str | None, tp: TP) -> ModelRunner:
    """A worker rank's runner: join the group, load this rank's slices (picklable, for spawned processes)."""
    join_group(tp, init_method, load.device)
    return ModelRunner(load_model(load, progress=False, tp=tp), num_slots, max_len)


class LLM:
    """Load a checkpoint and generate. Calls on one LLM share its prefix cache.

    `enforce_eager` (vLLM's name): never compile the decode step (compiled.py). Unset, it is on when the
    DELTASERVE_ENFORCE_EAGER environment variable is 1. `warmup` also compiles every graph now, rather than at each
    one's first use."""

    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "cpu", max_model_len: int | None = None,
                 chunk_size: int = 64, hf_overrides: dict[str, Any] | None = None, max_num_seqs: int = 8,
                 prefill_tokens: int = 512, prefix_cache_bytes: int = 1 << 30, warmup: bool = False,
                 progress: bool | None = None, tensor_parallel_size: int = 1, quantization: str | None = None,
                 batch_invariant: bool = False, enforce_eager: bool | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: {max_num_seqs} must be at least 1")
        load = LoadConfig(str(model), dtype, device, chunk_size, hf_overrides, quantization)
        spec, cfg = load_config(model, hf_overrides)
        spec.check_tp(cfg, tensor_parallel_size)                 # refuse before any process or weight
        self.spec, self.cfg = spec, cfg
        self.device = torch.device(device)
        self.max_model_len = context_length(cfg, max_model_len)
        if tensor_parallel_size == 1:
            self.model = load_model(load, progress)
            eager = enforce_eager_default() if enforce_eager is None else enforce_eager
            self.runner: ModelRunner = ModelRunner(self.model, max_num_seqs, self.max_model_len, not eager)
        else:
            size = tensor_parallel_size
            if device == "cpu":
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            workers = Workers(size, functools.partial(make_runner, load, max_num_seqs, self.max_model_len))
            try:
                workers.join(device)
                self.model = load_model(load, progress, TP(0, size))
                workers.check()
            except BaseException:      # e.g. a bad checkpoint: leave no rank and no group behind
                workers.stop(wait=0)
                raise
            self.runner = TPRunner(self.model, max_num_seqs, self.max_model_len, workers)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model, self.cfg.eos_token_ids)
        except TokenizerError:
            self.tokenizer = None            # token-id prompts still work
        self.template = ChatTemplate((self.tokenizer.chat_template if self.tokenizer else None) or spec.chat_template)
        self.engine = Engine(self.runner, self.tokenizer, self.max_model_len, max_num_seqs, prefill_tokens,
                             prefix_cache_bytes, batch_invariant)
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
        """One assistant turn for `messages`, rendered with the checkpoint's chat template; special-token text in
        the messages is plain text."""
        return self.generate([self.template.render_ids(self.tokenizer, messages)], params)[0]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position, [T, vocab] float32, from a fresh state."""
        if not token_ids or not all(isinstance(t, int) for t in token_ids):
            raise ValueError("token_ids must be a non-empty list of ints")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        if min(token_ids) < 0 or max(token_ids) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        step = self.runner.chunk_size * max(1, 256 // self.runner.chunk_size)   # whole delta-rule chunks per step
        return self.runner.logits(list(token_ids), step)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any."""
        if isinstance(self.runner, TPRunner):
            self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
