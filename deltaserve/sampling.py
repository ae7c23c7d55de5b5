"""Sampling parameters, the per-request sampler (greedy / temperature / top-k / top-p, seeded), and stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int | None = 16           # None: up to the context length
    temperature: float = 1.0              # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0: no top-k cut
    seed: int | None = None               # reproducible sampling for this request, whatever else is batched
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "must be a positive integer"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be a non-negative integer (0 = off)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws one request's tokens; owns its random generator so batching never changes its samples."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 for this request's next position."""
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the mass before it already reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf"), device=logits.device))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopStrings:
    """Finds stop strings in streamed text and holds back any tail that may still grow into one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) - 1 for s in stops), default=0)

    def split(self, text: str, final: bool) -> tuple[str, bool]:
        """(the part of `text` that is safe to emit, whether a stop string was found). `text` is everything
        not yet emitted; the caller keeps the remainder."""
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        if final or not self.hold:
            return text, False
        safe = len(text)
        for k in range(min(self.hold, len(text)), 0, -1):     # longest tail that is a prefix of a stop string
            if any(s.startswith(text[-k:]) for s in self.stops):
                safe = len(text) - k
                break
        return text[:safe], False
