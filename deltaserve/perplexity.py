"""Perplexity and bits per character of a text through the engine's own prefill path (`LLM.logits`): the quality
yardstick for every fast path (dtype, MXFP4 experts, kernels), as llama.cpp gates its quantizations.

Windowing: the token sequence is cut into windows of at most `max_model_len` tokens that overlap by one token; each
window starts from a fresh state and predicts its tokens after the first, so every token but the text's first is
predicted exactly once, with the window's earlier tokens as context."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Perplexity:
    nats: float                # total negative log-likelihood of the predicted tokens
    tokens: int                # predicted tokens
    characters: int            # characters of the text
    window: int                # tokens per window

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats / self.tokens)

    @property
    def bits_per_character(self) -> float:
        """Comparable across tokenizers, unlike perplexity per token."""
        return self.nats / math.log(2) / self.characters

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity, "bits_per_character": self.bits_per_character}


def evaluate(llm: Any, text: str, decode: bool = False) -> Perplexity:
    """Score `text` with `llm` (a deltaserve.LLM) in windows of its max_model_len tokens. decode: feed the tokens
    one at a time through the decode path (its kernels and state updates) instead of the prefill path."""
    ids = llm.encode(text)
    if len(ids) < 2:
        raise ValueError(f"perplexity needs a text of at least 2 tokens, got {len(ids)}")
    window = llm.max_model_len
    nats = 0.0
    for start in range(0, len(ids) - 1, window - 1):
        chunk = ids[start:start + window]
        # decode: one token per forward in a private state (the runner's logits at step 1), as decoding runs
        logits = llm.runner.logits(chunk[:-1], 1) if decode else llm.logits(chunk)[:-1]
        nats += torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
    return Perplexity(nats, len(ids) - 1, len(text), window)


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the text to score ({e})") from None


def format_perplexity(p: Perplexity) -> str:
    return "\n".join([
        f"perplexity:          {p.perplexity:.3f} per token ({p.tokens} tokens predicted, windows of {p.window})",
        f"bits per character:  {p.bits_per_character:.4f} ({p.characters} characters)",
    ])
