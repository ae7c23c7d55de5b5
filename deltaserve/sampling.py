"""Sampling parameters, the per-request sampler (greedy / temperature / top-k / top-p, seeded), and stop strings."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): the distribution is already one-hot to within
# float64 rounding, and dividing by a subnormal temperature would overflow the logits to inf.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)        # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    max_tokens: int | None = 16           # None: up to the context length
    temperature: float = 1.0              # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1: no top-k cut
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
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be finite and >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be an integer >= -1 (0 or -1 = off)"),
            (self.seed is None or isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
             f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


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
        """logits: [vocab] float32 for this request's next position. Sampling math runs in float64, so every
        accepted temperature and top_p (down to the smallest positive double) gives a valid distribution."""
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        logits = logits.double() / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token once the mass before it already reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.index_put((order[drop],), logits.new_tensor(float("-inf")))
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
