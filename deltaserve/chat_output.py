"""A chat completion's generated text as OpenAI fields: reasoning routed first, then tool calls parsed out of the
content channel. One parser per request, fed the decoded text (special tokens as their text) as it arrives; the
same code gives the stream's deltas and, merged, the non-stream message."""
from __future__ import annotations

from typing import Any

from .reasoning import NoReasoning, ReasoningParser
from .tool_parser import ToolCallParser


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None):
        """`tools` is None when the request has no tools (or tool_choice "none"): content stays as generated."""
        self.reasoning = reasoning or NoReasoning()
        self.tools = tools
        self.tool_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """OpenAI deltas for this piece of text (possibly none, while a marker may be forming)."""
        return self._route(self.reasoning.feed(text), final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back, once generation has ended."""
        return self._route(self.reasoning.finish(), final=True)

    def _route(self, deltas: list[dict[str, Any]], final: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            return deltas
        out = []
        for delta in deltas:
            out += self.tools.feed(delta["content"]) if "content" in delta else [delta]
        if final:
            out += self.tools.finish()
        self.tool_calls += sum(1 for d in out for call in d.get("tool_calls", ()) if "id" in call)
        return out


def one_delta(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The deltas of one stream chunk as a single delta, since a chunk carries each choice once: text
    concatenated per field, a call's argument fragments joined to its entry."""
    out: dict[str, Any] = {}
    for d in deltas:
        for key, value in d.items():
            if key != "tool_calls":
                out[key] = out.get(key, "") + value
                continue
            calls = out.setdefault("tool_calls", [])
            for part in value:
                if calls and "id" not in part and calls[-1]["index"] == part["index"]:
                    calls[-1]["function"]["arguments"] += part["function"].get("arguments", "")
                else:
                    calls.append({**part, "function": dict(part["function"])})
    return out


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that a sequence of deltas spells: content (None when empty), reasoning_content and
    tool_calls (each only when present), as OpenAI's non-stream response has them."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for part in d.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                                    "function": {"name": None, "arguments": ""}})
            if "id" in part:
                call["id"], call["function"]["name"] = part["id"], part["function"]["name"]
            call["function"]["arguments"] += part["function"].get("arguments", "")
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def parse_chat_output(text: str, reasoning: ReasoningParser | None = None, tools: bool = True) -> dict[str, Any]:
    """The assistant message of a whole generated text (a non-stream response); calls whose arguments are not
    JSON are returned as content."""
    parser = ChatOutputParser(reasoning, ToolCallParser(validate_arguments=True) if tools else None)
    return merge_deltas(parser.feed(text) + parser.finish())
