"""One choice of a response, from the engine's updates to OpenAI's fields: a chat choice's text routed into
reasoning_content / content / tool_calls (chat_output.py), a completion choice's text with the echoed prompt, and
log-probabilities in OpenAI's two shapes (chat: `logprobs.content[]`; completions: the legacy `tokens` /
`token_logprobs` / `top_logprobs` / `text_offset` lists)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .chat_output import ChatOutputParser, one_delta, parse_chat_output
from .engine import Request
from .reasoning import ReasoningParser, make_reasoning_parser
from .sampling import TokenLogprob
from .tokenizer import Tokenizer
from .tool_parser import ToolCallParser

LOGPROB_FLOOR = -9999.0          # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass(frozen=True)
class ChatOutput:
    """How a chat request's output text is read: its reasoning parser and whether tool calls are parsed."""
    reasoning: str                        # a name of reasoning.REASONING_PARSERS, or "auto"
    prompt_tail: str                      # the end of the rendered prompt, which decides where the output starts
    template_kwargs: dict[str, Any]       # the request's chat_template_kwargs (thinking on or off)
    tools: bool                           # the request has tools and tool_choice is not "none"
    named_tool: bool = False              # tool_choice names the function to call

    def reasoning_parser(self) -> ReasoningParser:
        return make_reasoning_parser(self.reasoning, self.prompt_tail, self.template_kwargs)

    def parser(self) -> ChatOutputParser:
        """A parser for a stream: tool-call arguments are sent as they are generated."""
        return ChatOutputParser(self.reasoning_parser(), ToolCallParser() if self.tools else None)


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenText:
    """Each token's text (special tokens as their text) and bytes, for log-probabilities."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id) if self.tokenizer else b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace") if self.tokenizer else f"token_id:{token_id}"

    def chat(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """OpenAI's chat `logprobs.content` entries."""
        return [{**self._one(token, logprob), "top_logprobs": [self._one(t, lp) for t, lp in top]}
                for token, logprob, top in entries]

    def _one(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token), "logprob": clamp(logprob), "bytes": list(self.bytes(token))}

    def legacy(self, entries: list[tuple[TokenLogprob | None, int]], offset: int) -> tuple[dict[str, Any], int]:
        """The completions `logprobs` object of these (entry, token id) pairs, and the offset after them: each
        token's text_offset counts the characters of the token texts before it from `offset` (as vLLM counts); an
        entry None (the first prompt token, which has no context) gives nulls."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry, token in entries:
            text = self.text(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            _, logprob, top = entry
            alternatives = {self.text(t): clamp(lp) for t, lp in top}
            alternatives.setdefault(text, clamp(logprob))        # the sampled token is always listed, as in vLLM
            out["token_logprobs"].append(clamp(logprob))
            out["top_logprobs"].append(alternatives)
        return out, offset


class CompletionChoice:
    """A completions choice: its text (after the echoed prompt) and legacy log-probabilities."""

    def __init__(self, index: int, tokens: TokenText, echo: str | None, prompt: list[int], scorer: Request):
        """`scorer`: the request of this prompt's choices that scores the prompt (the first; the others start from
        its snapshot)."""
        self.index, self.tokens, self.echo, self.prompt, self.scorer = index, tokens, echo, prompt, scorer
        self.offset = 0                            # the next token's text_offset

    def start(self, r: Request) -> dict[str, Any] | None:
        """The stream's first chunk of this choice: the echoed prompt (None without echo)."""
        if self.echo is None:
            return None
        return {**self._part(self.echo, self._prompt_entries(r)), "finish_reason": None}

    def _prompt_entries(self, r: Request) -> list[tuple[TokenLogprob | None, int]] | None:
        if r.params.logprobs is None:
            return None
        scored = self.scorer.prompt_logprobs or [None] * len(self.prompt)
        return list(zip(scored, self.prompt))

    def update(self, text: str, logprobs: list[TokenLogprob], r: Request, finished: bool) -> list[dict[str, Any]]:
        """The stream chunk's choice for one engine update."""
        entries = [(e, e[0]) for e in logprobs] if r.params.logprobs is not None else None
        return [{**self._part(text, entries), "finish_reason": r.finish_reason if finished else None}]

    def _part(self, text: str, entries: list[tuple[TokenLogprob | None, int]] | None) -> dict[str, Any]:
        logprobs = None
        if entries is not None:
            logprobs, self.offset = self.tokens.legacy(entries, self.offset)
        return {"index": self.index, "text": text, "logprobs": logprobs}

    def whole(self, text: str, r: Request) -> dict[str, Any]:
        """The non-streamed choice."""
        start = self.start(r)
        [rest] = self.update(text, r.logprobs, r, finished=True)
        if start is None:
            return rest
        logprobs = None
        if rest["logprobs"] is not None:
            logprobs = {k: start["logprobs"][k] + rest["logprobs"][k] for k in rest["logprobs"]}
        return {"index": self.index, "text": start["text"] + text, "logprobs": logprobs,
                "finish_reason": r.finish_reason}


class ChatChoice:
    """A chat choice: deltas as the text arrives (stream), or the whole message."""

    def __init__(self, index: int, tokens: TokenText, output: ChatOutput):
        self.index, self.tokens, self.output = index, tokens, output
        self.parser = output.parser()

    def start(self, r: Request) -> dict[str, Any]:
        """The stream's first chunk of this choice: the assistant's role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def update(self, text: str, logprobs: list[TokenLogprob], r: Request, finished: bool) -> list[dict[str, Any]]:
        """The stream chunk's choice for one engine update: what the parser releases as one delta (possibly empty:
        each token shows progress), with its log-probabilities, and finish_reason when it ends."""
        delta = one_delta(self.parser.feed(text) + (self.parser.finish() if finished else [])) or {"content": ""}
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        if r.params.logprobs is not None:
            choice["logprobs"] = {"content": self.tokens.chat(logprobs)}
        if finished:
            choice["finish_reason"] = self.finish_reason(r.finish_reason, self.parser.tool_calls > 0)
        return [choice]

    def finish_reason(self, reason: str, called: bool) -> str:
        """OpenAI's: "tool_calls" when the model stopped by itself after calling tools, unless the call was forced
        by name (then "stop", as OpenAI answers)."""
        return "tool_calls" if reason == "stop" and called and not self.output.named_tool else reason

    def whole(self, text: str, r: Request) -> dict[str, Any]:
        """The non-streamed choice; a tool call whose arguments are not JSON is returned as content."""
        message = parse_chat_output(text, self.output.reasoning_parser(), self.output.tools)
        logprobs = {"content": self.tokens.chat(r.logprobs)} if r.params.logprobs is not None else None
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self.finish_reason(r.finish_reason, bool(message.get("tool_calls")))}
