"""Reasoning routing: generated text split into `reasoning_content` and `content`, incrementally.

`kimi_k2`: `<think>...</think>`; reasoning also ends where a tool-call section begins (a model may call a tool
without closing its thinking), and the section goes on as content, for the tool parser. `kimi_k3`: XTML channels,
`<|open|>think<|sep|>...<|close|>think<|sep|>` then `<|open|>response<|sep|>...<|close|>response<|sep|>`, the
response's wrapper and the message's closing markers dropped. Whether the output starts inside reasoning is decided
from the rendered prompt, as the reference system does: a prompt that ends by opening the think block means the
first token is already reasoning. A marker is never released half-written; text that fits no channel is content,
never dropped.

Output is OpenAI delta dicts, `{"reasoning_content": text}` or `{"content": text}`.
"""
from __future__ import annotations

from typing import Any, Callable

from .markers import split_at_marker
from .tool_parser import SECTION_BEGIN

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
XTML_THINK_OPEN, XTML_THINK_CLOSE = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
XTML_RESPONSE_OPEN, XTML_RESPONSE_CLOSE = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
XTML_MESSAGE_END = ("<|close|>message<|sep|>", "<|end_of_msg|>")
REASONING, CONTENT = "reasoning_content", "content"        # the delta fields


class ReasoningParser:
    """A state machine over the generated text: each state names the markers it waits for and what its text is.
    Subclasses give `STATES`: state -> (channel of its text or None to drop whitespace, {marker: next state})."""

    STATES: dict[str, tuple[str | None, dict[str, str]]] = {"content": (CONTENT, {})}

    def __init__(self, state: str = "content"):
        self.state, self.buffer = state, ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._run(final=True)

    @property
    def in_reasoning(self) -> bool:
        return self.STATES[self.state][0] == REASONING

    @property
    def answer_marker(self) -> str | None:
        """The marker after which the answer starts, when the output starts inside reasoning (a structured-output
        grammar applies only after it, as vLLM's does); None when the output starts with the answer."""
        return None

    def _run(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            channel, moves = self.STATES[self.state]
            before, marker, self.buffer = split_at_marker(self.buffer, moves, final)
            if channel is None:          # between channels: layout whitespace is dropped, anything else is content
                channel = CONTENT if before.strip() else None
            if channel is not None and before:
                if out and channel in out[-1]:
                    out[-1][channel] += before
                else:
                    out.append({channel: before})
            if marker is None:
                return out
            self.state = moves[marker]
            if marker in SECTION_BEGIN:
                self.buffer = marker + self.buffer    # the tool-call region is content, for the tool parser


class NoReasoning(ReasoningParser):
    """Everything is content (no reasoning parser, or thinking switched off)."""


class KimiK2Reasoning(ReasoningParser):
    STATES = {
        "start": (CONTENT, {}),            # the first characters decide, in _run
        "reasoning": (REASONING, {THINK_CLOSE: "content", **{m: "content" for m in SECTION_BEGIN}}),
        "content": (CONTENT, {}),
    }

    def __init__(self, prompt: str):
        super().__init__("reasoning" if prompt.rstrip().endswith(THINK_OPEN) else "start")

    @property
    def answer_marker(self) -> str | None:
        return THINK_CLOSE if self.state == "reasoning" else None

    def _run(self, final: bool) -> list[dict[str, Any]]:
        if self.state == "start":
            head = self.buffer.lstrip()
            if not final and len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return []                # may still become <think>
            if head.startswith(THINK_OPEN):
                self.state, self.buffer = "reasoning", head[len(THINK_OPEN):]
            else:
                self.state = "content"
        return super()._run(final)


class KimiK3Reasoning(ReasoningParser):
    STATES = {
        "start": (None, {XTML_THINK_OPEN: "reasoning", XTML_RESPONSE_OPEN: "response"}),
        "reasoning": (REASONING, {XTML_THINK_CLOSE: "between"}),
        "between": (None, {XTML_RESPONSE_OPEN: "response"}),
        "response": (CONTENT, {XTML_RESPONSE_CLOSE: "after"}),
        "after": (None, {m: "after" for m in XTML_MESSAGE_END}),
    }

    def __init__(self, prompt: str):
        tail = prompt.rstrip()
        super().__init__("reasoning" if tail.endswith(XTML_THINK_OPEN) else
                         "response" if tail.endswith(XTML_RESPONSE_OPEN) else "start")

    @property
    def answer_marker(self) -> str | None:
        return XTML_RESPONSE_OPEN if self.state in ("start", "reasoning") else None


REASONING_PARSERS: dict[str, Callable[[str], ReasoningParser]] = {
    "kimi_k2": KimiK2Reasoning,
    "kimi_k3": KimiK3Reasoning,
    "none": lambda prompt: NoReasoning(),
}


def make_reasoning_parser(name: str, prompt: str, chat_template_kwargs: dict[str, Any] | None = None
                          ) -> ReasoningParser:
    """The parser `name` (a key of REASONING_PARSERS, or "auto": kimi_k3 when the prompt is XTML, else kimi_k2)
    for one request whose rendered prompt is `prompt`. With `{"thinking": false}` (or vLLM's `enable_thinking`)
    in the request's chat_template_kwargs, kimi_k2 routes nothing to reasoning, as in vLLM; kimi_k3 still unwraps
    the XTML response channel (its start state follows the prompt, which then does not open a think block)."""
    if name == "auto":
        name = "kimi_k3" if "<|open|>message" in prompt else "kimi_k2"
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(['auto', *REASONING_PARSERS])}")
    kwargs = chat_template_kwargs or {}
    if name == "kimi_k2" and not kwargs.get("thinking", kwargs.get("enable_thinking", True)):
        name = "none"
    return REASONING_PARSERS[name](prompt)
