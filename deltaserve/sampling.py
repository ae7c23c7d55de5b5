"""Sampling parameters, the per-request sampler (logit bias, repetition / frequency / presence penalties, then
greedy or temperature / min-p / top-k / top-p, seeded), log-probabilities, stop strings, and the checkpoint's
generation_config.json defaults."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .ops.cpu_kernels import kernels

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
    min_p: float = 0.0                    # drop tokens less likely than min_p times the likeliest one
    presence_penalty: float = 0.0         # subtracted from a token's logit once it appears in the output
    frequency_penalty: float = 0.0        # subtracted once per appearance in the output
    repetition_penalty: float = 1.0       # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None           # per output token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None    # the same for every prompt token after the first
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True      # False: special tokens come out as their text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        counts = (self.logprobs, self.prompt_logprobs)
        checks = [
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "must be a positive integer"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be finite and >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be an integer >= -1 (0 or -1 = off)"),
            (self.seed is None or isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
             f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (math.isfinite(self.presence_penalty), "presence_penalty", "must be finite"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty", "must be finite"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "must be finite and > 0"),
            (all(math.isfinite(b) for b in self.logit_bias.values()), "logit_bias", "values must be finite"),
            (all(n is None or isinstance(n, int) and n >= 0 for n in counts), "logprobs", "must be integers >= 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Sampler:
    """Draws one request's tokens; owns its random generator so batching never changes its samples, and the
    history its penalties need (the prompt, and every token it has drawn)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", prompt: Sequence[int] = ()):
        self.params = params
        self.prompt = prompt
        self.counts: torch.Tensor | None = None      # [vocab] float64 occurrences of each token in the output
        self.seen: torch.Tensor | None = None        # [vocab] bool: in the prompt or the output
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 for this request's next position (a grammar's mask already applied). Sampling
        math runs in float64, so every accepted temperature and top_p (down to the smallest positive double) gives
        a valid distribution."""
        token = self._draw(self.process(logits))
        if self.params.penalized:
            self.counts[token] += 1
            self.seen[token] = True
        return token

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after logit_bias and the penalties (vLLM's order: bias, repetition, then frequency and
        presence), as float64; the input itself when there is nothing to apply. Never modifies `logits`."""
        p = self.params
        if not p.logit_bias and not p.penalized:
            return logits
        x = logits.to(torch.float64, copy=True)                  # the caller's logits stay as they are
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=x.device)
            x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device))
        if p.penalized:
            if self.counts is None:
                self.counts = torch.zeros_like(x)
                self.seen = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
                self.seen[torch.tensor(list(self.prompt), dtype=torch.long, device=x.device)] = True
            if p.repetition_penalty != 1:
                penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                x = torch.where(self.seen, penalized, x)
            x = x - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        return x.clamp_(max=torch.finfo(x.dtype).max)     # a tiny repetition_penalty divides logits into inf

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return argmax(logits)
        logits = logits.double()
        logits = (logits - logits.max()) / p.temperature       # <= 0 before dividing: no temperature overflows it
        if p.min_p > 0:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True, stable=True)   # ties: the lowest id first, as argmax
            probs = sorted_logits.softmax(-1)
            # drop a token once the mass before it already reaches top_p (the first token always stays)
            drop = probs.cumsum(-1) - probs >= p.top_p
            logits = logits.index_put((order[drop],), logits.new_tensor(float("-inf")))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def argmax(logits: torch.Tensor) -> int:
    """torch.argmax of one row, through the CPU kernel where there is one (torch's takes ~1 ns an element)."""
    k = kernels() if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) else None
    return int(k.argmax(logits) if k is not None else logits.argmax())


TokenLogprob = tuple[int, float, list[tuple[int, float]]]     # token, its log-probability, the top (token, lp)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """For each row of `logits` [N, vocab] and its token: the token's log-probability and the `top` likeliest
    tokens with theirs, likeliest first, under softmax computed in float64. These are the model's own (vLLM's
    default "raw" log-probabilities): before logit_bias, penalties, a grammar's mask and temperature."""
    logp = torch.log_softmax(logits.double(), -1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return [(t, lp, list(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


class StopStrings:
    """Finds stop strings in streamed text and holds back any tail that may still grow into one."""

    def __init__(self, stops: list[str], include: bool = False):
        """`include`: the stop string found is part of the emitted text (vLLM's include_stop_str_in_output)."""
        self.stops, self.include = stops, include
        self.hold = max((len(s) - 1 for s in stops), default=0)

    def split(self, text: str, final: bool) -> tuple[str, bool]:
        """(the part of `text` that is safe to emit, whether a stop string was found). `text` is everything
        not yet emitted; the caller keeps the remainder."""
        found = [(i, -len(s)) for s in self.stops for i in [text.find(s)] if i >= 0]
        if found:
            cut, minus_length = min(found)                          # the first stop string; the longest at a tie
            return text[:cut - minus_length if self.include else cut], True
        if final or not self.hold:
            return text, False
        safe = len(text)
        for k in range(min(self.hold, len(text)), 0, -1):     # longest tail that is a prefix of a stop string
            if any(s.startswith(text[-k:]) for s in self.stops):
                safe = len(text) - k
                break
        return text[:safe], False


# The generation_config.json fields that set request defaults (vLLM's --generation-config auto), and their names here.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint declares in its generation_config.json ({} when it has none), under
    SamplingParams' names; a request's own values win."""
    file = Path(folder) / "generation_config.json"
    if not file.exists():
        return {}
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if config.get(theirs) is not None}
    SamplingParams(**defaults)           # refuse a value no request could use, naming it
    return defaults
